"""Every check of a parsed config, by command, in one place: each entry point calls `check_config`
before anything starts (no process group, no model), so a bad value fails at once with a message
that names the key. Types, unknown keys and choices are checked while parsing (`rl2.config`)."""

import dataclasses
import os

from rl2.config import SEARCH_MODES, Config, ConfigError
from rl2.config.suggest import did_you_mean

COMMANDS = ("ppo", "sft", "rm", "dpo", "filter", "search")


def check_config(config: Config, command: str) -> None:
    """Raise ConfigError for the first value `command` cannot run with: a required key unset, a value
    out of range, settings that contradict each other, a model folder that does not exist."""
    if command == "ppo":
        distilling = config.distill.coef > 0 and not config.trainer.eval_only
        require(config, "data.test_path" if config.trainer.eval_only else "data.path", "actor.model_name",
                *([] if config.rollout.agent_path or distilling else ["rollout.env_path"]))
        check_rl_config(config)
        check_distill_config(config)
    elif command == "sft":
        require(config, "data.path", "actor.model_name")
    elif command == "rm":
        check_rm_config(config)
        require(config, "data.path", "critic.model_name")
    elif command == "dpo":
        check_dpo_config(config)
        require(config, "data.path", "actor.model_name")
    elif command == "filter":
        require(config, "data.path", "filter.output", "actor.model_name", "rollout.env_path")
        check_filter_config(config)
        check_rl_config(config)
    elif command == "search":
        require(config, "data.path", "actor.model_name", "rollout.env_path")
        check_search_config(config)
    else:
        raise ValueError(f"unknown command {command!r}; expected one of {COMMANDS}")
    if command in ("sft", "rm", "dpo", "search"):
        check_chat_template(config, command)
    if command in ("ppo", "sft", "rm", "dpo") and config.trainer.overwrite and config.trainer.load_ckpt_from is not None:
        raise ConfigError(
            f"trainer.overwrite=true starts afresh, trainer.load_ckpt_from={config.trainer.load_ckpt_from} resumes: "
            "pass one of them (trainer.load_ckpt_from=null to start over)"
        )
    for section in ("actor", "critic", "teacher"):
        check_local_model_path(getattr(config, section).model_name, f"{section}.model_name")


def require(config: Config, *keys: str) -> None:
    """Fail before anything starts when a key the trainer cannot run without is unset."""
    for key in keys:
        section, name = key.split(".")
        if getattr(getattr(config, section), name) is None:
            raise ConfigError(f"{key} is required (pass {key}=...)")


def check_local_model_path(name: str | None, key: str) -> None:
    """A model name that is clearly a path (absolute, ./ or ../, or more than one `/`, which no Hub
    id has) must be an existing folder: otherwise transformers reports it as a malformed repo id."""
    if name is None:
        return
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(f"{key}={name}: no such model folder")


def require_pair_budget(config: Config, section: str) -> None:
    """Pair trainers: a pair (chosen and rejected, up to `data.max_length` tokens each) must fit in
    one micro-batch, since both are packed side by side."""
    model = getattr(config, section)
    budget = model.max_length_per_device * model.sp_size
    if config.data.max_length is not None and 2 * config.data.max_length > budget:
        raise ConfigError(
            f"data.max_length={config.data.max_length} allows pairs of {2 * config.data.max_length} tokens (chosen and "
            f"rejected share a micro-batch), more than {section}.max_length_per_device x {section}.sp_size = {budget}; "
            f"raise {section}.max_length_per_device or lower data.max_length"
        )


def check_chat_template(config: Config, command: str) -> None:
    """Raw prompts (`data.apply_chat_template=false`) are for RL (ppo, filter) only."""
    if config.data.apply_chat_template:
        return
    if command == "search":
        raise ConfigError(
            "data.apply_chat_template=false is not supported by rl2.search: it renders each problem's "
            f"data.messages_key={config.data.messages_key!r} column with the chat template and writes SFT / "
            "preference rows of messages; use rows of messages"
        )
    if command == "sft":
        raw_columns = "prompt / response"
        example = '{"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": RESPONSE}]}'
    else:
        raw_columns = "prompt / chosen / rejected"
        example = '{"messages": [{"role": "user", "content": PROMPT}], "chosen": RESPONSE, "rejected": RESPONSE}'
    raise ConfigError(
        f"data.apply_chat_template=false is not supported for {command.upper()}: rl2 reads the conversation from "
        f"the data.messages_key={config.data.messages_key!r} column and renders it with the chat template (RL2's "
        f"raw mode reads {raw_columns} columns; rl2 does not). Put each row's text in messages, e.g. {example}, "
        "and drop data.apply_chat_template=false (it is for RL prompts: rl2.trainer.ppo)"
    )


def check_sampling_params(config: Config) -> None:
    """Both sampling sections hold only sampling parameters, each with a value the engines take."""
    from rl2.engines.base import SamplingParams

    valid = [field.name for field in dataclasses.fields(SamplingParams)]
    for key in ("train_sampling_params", "test_sampling_params"):
        params = getattr(config.rollout, key)
        unknown = next((name for name in params if name not in valid), None)
        if unknown is not None:
            raise ConfigError(f"rollout.{key}: unknown sampling parameter {unknown!r}{did_you_mean(unknown, valid)}; "
                              f"valid ones: {', '.join(valid)}")
        try:
            SamplingParams.from_dict(params)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"rollout.{key}: {error}") from None


def check_rl_config(config: Config) -> None:
    """Values an RL run (training, evaluation or the difficulty filter) cannot run with."""
    check_sampling_params(config)
    if config.rollout.max_turns < 1:
        raise ConfigError(f"rollout.max_turns must be >= 1, got {config.rollout.max_turns}")
    if config.rollout.env_workers is not None and config.rollout.env_workers < 0:
        raise ConfigError(f"rollout.env_workers must be >= 0 (0 = threads), got {config.rollout.env_workers}")
    if config.rollout.env_worker_memory_mb < 0:
        raise ConfigError(f"rollout.env_worker_memory_mb must be >= 0 (0 = no limit), got {config.rollout.env_worker_memory_mb}")
    if config.rollout.max_unscored_steps < 1:
        raise ConfigError(f"rollout.max_unscored_steps must be >= 1, got {config.rollout.max_unscored_steps}")
    if config.data.responses_per_prompt < 1:
        raise ConfigError(f"data.responses_per_prompt must be >= 1, got {config.data.responses_per_prompt}")
    if config.rollout.agent_path and not config.data.apply_chat_template:
        raise ConfigError("rollout.agent_path serves chat completions through the chat template: it needs "
                          "data.apply_chat_template=true")
    if config.rollout.trajectory_format == "per_turn" and not config.data.apply_chat_template:
        raise ConfigError("rollout.trajectory_format=per_turn renders each turn's prompt with the chat template: "
                          "it needs data.apply_chat_template=true")
    if config.adv.estimator == "rloo" and config.data.responses_per_prompt < 2 and not config.adv.global_norm:
        raise ConfigError("adv.estimator=rloo leaves each response out of its group's baseline: it needs "
                          "data.responses_per_prompt >= 2 (or adv.global_norm=true for the batch)")
    if not 0 < config.adv.turn_discount <= 1:
        raise ConfigError(f"adv.turn_discount must be in (0, 1], got {config.adv.turn_discount}")
    if config.adv.turn_discount != 1.0 and config.adv.estimator == "gae":
        raise ConfigError("adv.turn_discount scales each sequence's advantage by its place in the trajectory; "
                          "adv.estimator=gae discounts per token with adv.gamma instead: give one of them")
    if not config.adv.std_eps >= 0:
        raise ConfigError(f"adv.std_eps must be >= 0, got {config.adv.std_eps}")
    if config.actor.update_per_rollout < 1 or config.critic.update_per_rollout < 1:
        raise ConfigError("actor.update_per_rollout and critic.update_per_rollout must be >= 1")
    longest = config.actor.max_length_per_device * config.actor.sp_size
    if config.data.max_length is not None and config.data.max_length > longest:
        raise ConfigError(
            f"data.max_length={config.data.max_length} (the longest trajectory) exceeds what one micro-batch holds, "
            f"actor.max_length_per_device x actor.sp_size = {longest}; raise actor.max_length_per_device"
        )
    if config.adv.resample_on_correct:
        if config.rollout.oversample is None or config.rollout.oversample <= config.data.responses_per_prompt:
            raise ConfigError(
                f"adv.resample_on_correct=true needs rollout.oversample > data.responses_per_prompt "
                f"({config.data.responses_per_prompt}), e.g. 32 generated and 16 kept; got {config.rollout.oversample}"
            )
        if not 0 <= 2 * config.adv.roc_min_each <= config.data.responses_per_prompt:
            raise ConfigError(
                f"adv.roc_min_each={config.adv.roc_min_each} must be between 0 and data.responses_per_prompt / 2"
            )
    elif config.rollout.oversample is not None:
        raise ConfigError("rollout.oversample is GRPO-RoC's: set adv.resample_on_correct=true, or leave it unset")
    if config.trainer.eval_only and config.trainer.load_ckpt_from is not None:
        raise ConfigError(
            "trainer.eval_only evaluates actor.model_name: pass actor.model_name=<checkpoint folder> "
            "(e.g. ckpts/step100), not trainer.load_ckpt_from"
        )
    if config.rollout.server_args:
        if config.rollout.engine != "sglang":
            raise ConfigError(
                f"rollout.server_args ({', '.join(config.rollout.server_args)}) are SGLang's arguments: "
                "set rollout.engine=sglang, or leave them out for the embedded engine"
            )
        from rl2.engines.sglang import check_server_args

        try:
            check_server_args(config.rollout.server_args)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if config.rollout.test_responses_per_prompt < 1:
        raise ConfigError(f"rollout.test_responses_per_prompt must be >= 1, got {config.rollout.test_responses_per_prompt}")
    check_off_policy_config(config)


def check_distill_config(config: Config) -> None:
    """On-policy distillation: a teacher exactly when distill.coef > 0, and a run it can score."""
    distill, teacher, rollout = config.distill, config.teacher, config.rollout
    if not distill.coef >= 0:
        raise ConfigError(f"distill.coef must be >= 0 (0 = no distillation), got {distill.coef}")
    if distill.coef == 0:
        if teacher.model_name is not None:
            raise ConfigError(f"teacher.model_name={teacher.model_name} is set but distill.coef=0: the teacher would "
                              "not be used; set distill.coef > 0 (e.g. 1.0) or leave teacher.model_name unset")
        return
    if config.trainer.eval_only:
        raise ConfigError("trainer.eval_only evaluates actor.model_name: no teacher scores it; leave distill.coef=0")
    if teacher.model_name is None:
        raise ConfigError(f"distill.coef={distill.coef} distils from a teacher: pass teacher.model_name=...")
    if rollout.env_path is None and rollout.agent_path is None:
        if rollout.max_turns > 1:
            raise ConfigError("rollout.max_turns > 1 needs an env file (rollout.env_path) to answer the turns")
        if config.trainer.test_freq is not None:
            raise ConfigError("trainer.test_freq evaluates the env file's reward: set rollout.env_path, or "
                              "trainer.test_freq=null to distil without one")


def check_off_policy_config(config: Config) -> None:
    """The policy loss, the rollout correction, the entropy bonus and overlong shaping."""
    from rl2.algorithms.off_policy import rollout_correction

    actor, rollout = config.actor, config.rollout
    correcting = rollout_correction(config.actor, config.rollout).mode != "none"
    loss_names = {"token": "token_mean", "sequence": "seq_mean_token_mean"}
    for name in ("actor", "critic"):
        section = getattr(config, name)
        if section.loss_agg and section.loss_level != "token" and loss_names[section.loss_level] != section.loss_agg:
            raise ConfigError(f"{name}.loss_level={section.loss_level} is {name}.loss_agg="
                              f"{loss_names[section.loss_level]}, but {name}.loss_agg={section.loss_agg}: give one of them")
        if section.loss_agg_norm is not None and not section.loss_agg_norm > 0:
            raise ConfigError(f"{name}.loss_agg_norm must be > 0, got {section.loss_agg_norm}")
    if actor.clip_c is not None and not actor.clip_c > 1:
        raise ConfigError(f"actor.clip_c (dual-clip PPO) must be > 1, got {actor.clip_c}")
    if actor.tis_coef < 0:
        raise ConfigError(f"actor.tis_coef must be >= 0 (0 = off), got {actor.tis_coef}")
    if actor.tis_coef > 0 and actor.rollout_correction not in ("auto", "none", "tis"):
        raise ConfigError(f"actor.tis_coef={actor.tis_coef} is token-level TIS (RL2's key), "
                          f"actor.rollout_correction={actor.rollout_correction} another correction: give one of them")
    if correcting and not actor.recompute_logprobs:
        raise ConfigError("a rollout correction weighs each token by proximal / behaviour log-probs: it needs the "
                          "actor's own (proximal) log-probs, actor.recompute_logprobs=true")
    if not actor.correction_threshold > 0:
        raise ConfigError(f"actor.correction_threshold must be > 0, got {actor.correction_threshold}")
    if not 0 < actor.icepop_low <= 1 <= actor.icepop_high:
        raise ConfigError(f"need 0 < actor.icepop_low <= 1 <= actor.icepop_high, got {actor.icepop_low} and "
                          f"{actor.icepop_high}")
    if not (0 < actor.gspo_clip < 1 and actor.gspo_clip_high > 0):
        raise ConfigError(f"need 0 < actor.gspo_clip < 1 and actor.gspo_clip_high > 0, got {actor.gspo_clip} and "
                          f"{actor.gspo_clip_high}")
    if rollout.overlong_buffer < 0 or rollout.overlong_penalty < 0:
        raise ConfigError(f"rollout.overlong_buffer and rollout.overlong_penalty must be >= 0, got "
                          f"{rollout.overlong_buffer} and {rollout.overlong_penalty}")
    if rollout.partial_rollout:
        if rollout.tp_size > 1:
            raise ConfigError("rollout.partial_rollout needs rollout.tp_size=1: ranks that share one engine would "
                              "have to pause together")
        if rollout.partial_max_age < 1 or (rollout.partial_extra_prompts is not None and rollout.partial_extra_prompts < 1):
            raise ConfigError(f"rollout.partial_max_age and rollout.partial_extra_prompts must be >= 1, got "
                              f"{rollout.partial_max_age} and {rollout.partial_extra_prompts}")
    if rollout.max_staleness < 0:
        raise ConfigError(f"rollout.max_staleness must be >= 0, got {rollout.max_staleness}")
    if rollout.placement == "split":
        if config.trainer.eval_only:
            raise ConfigError("trainer.eval_only evaluates on every rank: leave rollout.placement=colocated")
        if rollout.ranks < 1:
            raise ConfigError(f"rollout.ranks must be >= 1, got {rollout.ranks}")
    elif rollout.max_staleness > 0:
        raise ConfigError("rollout.max_staleness > 0 needs rollout.placement=split: colocated engines wait for "
                          "the trainer that shares their device")
    max_new_tokens = rollout.train_sampling_params.get("max_new_tokens", 512)
    if rollout.overlong_buffer >= max_new_tokens:
        raise ConfigError(f"rollout.overlong_buffer={rollout.overlong_buffer} must be below the training "
                          f"max_new_tokens ({max_new_tokens}): the punishment starts that many tokens before it")


def check_rm_config(config: Config) -> None:
    """Reward modelling trains in the critic section."""
    if config.critic.model_name is None:
        hint = (
            f"; actor.model_name={config.actor.model_name} is not used here: did you mean critic.model_name?"
            if config.actor.model_name is not None
            else ""
        )
        raise ConfigError(
            "critic.model_name is required: rl2.trainer.rm trains the reward model in the critic section "
            f"(critic.model_name, critic.lr, critic.save_dir, ...), as RL2 does{hint}"
        )
    require_pair_budget(config, "critic")


def check_dpo_config(config: Config) -> None:
    if not config.actor.beta > 0:
        raise ConfigError(f"actor.beta must be > 0, got {config.actor.beta}")
    if not 0 <= config.actor.label_smoothing < 0.5:
        raise ConfigError(
            f"actor.label_smoothing must be in [0, 0.5), got {config.actor.label_smoothing} "
            "(at 0.5 the loss no longer prefers either response)"
        )
    require_pair_budget(config, "actor")


def check_filter_config(config: Config) -> None:
    settings = config.filter
    if settings.responses_per_prompt < 1:
        raise ConfigError(f"filter.responses_per_prompt must be >= 1, got {settings.responses_per_prompt}")
    if not 0.0 <= settings.pass_rate_min < settings.pass_rate_below <= 1.0:
        raise ConfigError(
            f"need 0 <= filter.pass_rate_min < filter.pass_rate_below <= 1 (rows kept: min <= pass rate < below), "
            f"got {settings.pass_rate_min} and {settings.pass_rate_below}"
        )


def check_search_config(config: Config) -> None:
    check_sampling_params(config)
    search = config.search
    unknown = [mode for mode in search.modes if mode not in SEARCH_MODES]
    if unknown or not search.modes:
        raise ConfigError(f"search.modes={search.modes}: choose from {', '.join(SEARCH_MODES)}")
    for key in ("rollouts", "width", "max_depth", "beam_size", "n", "max_step_tokens", "sandbox_workers",
                "sft_per_problem", "pairs_per_side"):
        if getattr(search, key) < 1:
            raise ConfigError(f"search.{key} must be >= 1, got {getattr(search, key)}")
    if search.c < 0:
        raise ConfigError(f"search.c must be >= 0, got {search.c}")
    if search.terminal_value == "ppm" and search.ppm_path is None:
        raise ConfigError("search.terminal_value=ppm needs search.ppm_path")
    if not search.step_end or not search.answer_end or search.step_end == search.answer_end:
        raise ConfigError("search.step_end and search.answer_end must be two different non-empty texts")
    check_local_model_path(search.ppm_path, "search.ppm_path")
