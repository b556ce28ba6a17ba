"""RL2's config keys, in its current layout and its 2025 ones, and the rl2 keys they mean.

RL2 renamed its keys several times: `data.train_data_path` (summer 2025), `train_data.path` with
`rollout.train_sampling_params` (mid 2025), `train_data.*` holding the sampling params, turns and columns
too (Nov-Dec 2025: `train_data.sampling_params.max_new_tokens`, `train_data.apply_chat_template`), now
`rollout.train.path`; a command line or YAML file written for any of these versions parses here.
Each RL2 key in `RL2_KEYS` is one of:
- another name for rl2 keys: its value lands there (`rollout.train.path` -> `data.path`);
- a key whose value changes no result in rl2: accepted, and the log says so;
- a key with no rl2 meaning: accepted at the values that are rl2's behaviour anyway, any other
  value is an error that says what rl2 does instead.
Every RL2 key met is reported in one line, so a run's log shows where each of its arguments went.
"""

from dataclasses import dataclass
from typing import Any

from rl2.config.commands import Command
from rl2.errors import ConfigError


@dataclass(frozen=True)
class RL2Key:
    """One of RL2's keys (`prefix.*`: every key under `prefix`) and what it is in rl2."""

    name: str
    rl2_keys: tuple[str, ...] = ()  # where its value goes; `prefix.*` keeps the part under RL2's prefix
    invert: bool = False  # a bool meaning the opposite of its rl2 key (use_wandb / disable_wandb)
    neutral: tuple = ()  # without rl2_keys: the values that are rl2's behaviour (accepted)
    any_value: bool = False  # without rl2_keys: every value accepted (it changes no result in rl2)
    note: str = ""  # without rl2_keys: what rl2 does instead, and what to use


def _model_keys(model: str) -> list[RL2Key]:
    """The keys RL2's actor and critic sections share."""
    schedule = f"rl2's schedule is a linear warm-up ({model}.warmup_ratio) then cosine decay to 0"
    return [
        RL2Key(f"{model}.cp_size", (f"{model}.sp_size",)),
        RL2Key(f"{model}.enable_gradient_checkpointing", (f"{model}.gradient_checkpointing",)),
        RL2Key(f"{model}.optimizer.lr", (f"{model}.lr",)),
        RL2Key(f"{model}.optimizer.weight_decay", (f"{model}.weight_decay",)),
        RL2Key(f"{model}.scheduler.warmup_ratio", (f"{model}.warmup_ratio",)),
        RL2Key(f"{model}.scheduler.name", note=schedule),
        RL2Key(f"{model}.scheduler.min_lr", note=schedule),
        RL2Key(f"{model}.scheduler", note=schedule),  # 2025: a name, e.g. constant
        RL2Key(f"{model}.avg_level", (f"{model}.loss_level",)),
        RL2Key(f"{model}.use_liger_kernel", any_value=True,
               note=f"log-probs come from the LM head in chunks, never as full logits ({model}.logps_chunk_size)"),
        RL2Key(f"{model}.ddp_size", neutral=(1,),
               note=f"rl2 shards parameters over {model}.fsdp_size ranks (0 = all; smaller = replicated groups of that many)"),
        RL2Key(f"{model}.tp_size", neutral=(1,),
               note=f"rl2 trains with FSDP2 and sequence parallelism ({model}.sp_size), not tensor parallelism"),
    ]


_TRAJECTORIES = "rl2 writes each step's trajectories to <actor.save_dir>/trajectories/ (trainer.dump_trajectories)"
_ALL_TEST_PROMPTS = "rl2 evaluates every test prompt in one rollout, rollout.max_batch_size sequences at a time"
_STOP_KEPT = "rl2 keeps the stop string in the response (RL2's no_stop_trim=true): its tokens are trained as sampled"
_OFF_POLICY = ("without rollout.partial_rollout no token is off-policy; with it, rl2 keeps the tokens carried over "
               "from an earlier step and weighs them by actor.rollout_correction (tis by default), never masks them")
_SFT_ROWS = ("rl2's SFT rows are conversations (data.messages_key): a prompt/response row is "
             "[{role: user, content: prompt}, {role: assistant, content: response}]")

RL2_KEYS: list[RL2Key] = [
    # RL2 since Oct 2025: the data of a rollout under rollout.train / rollout.test; SGLang's own arguments.
    RL2Key("rollout.train.path", ("data.path",)),
    RL2Key("rollout.train.prompt_key", ("data.prompt_key",)),
    RL2Key("rollout.train.messages_key", ("data.messages_key",)),
    RL2Key("rollout.train.apply_chat_template", ("data.apply_chat_template",)),
    RL2Key("rollout.train.prompts_per_rollout", ("data.prompts_per_rollout",)),
    RL2Key("rollout.train.responses_per_prompt", ("data.responses_per_prompt",)),
    RL2Key("rollout.train.sampling_params.*", ("rollout.train_sampling_params.*",)),
    RL2Key("rollout.train.max_turns", ("rollout.max_turns",)),
    RL2Key("rollout.train.dynamic_filtering", ("rollout.dynamic_filtering",)),
    RL2Key("rollout.train.partial_rollout", ("rollout.partial_rollout",)),
    RL2Key("rollout.train.save_dir", note=_TRAJECTORIES),
    RL2Key("rollout.test.path", ("data.test_path",)),
    RL2Key("rollout.test.responses_per_prompt", ("rollout.test_responses_per_prompt",)),
    RL2Key("rollout.test.sampling_params.*", ("rollout.test_sampling_params.*",)),
    RL2Key("rollout.test.prompts_per_rollout", any_value=True, note=_ALL_TEST_PROMPTS),
    RL2Key("rollout.test.save_dir", note=_TRAJECTORIES),
    RL2Key("rollout.test_ratio", ("data.test_ratio",)),
    RL2Key("rollout.bucket_size", ("rollout.sync_bucket_mb",)),
    RL2Key("rollout.server_args.model_path", ("actor.model_name",)),
    RL2Key("rollout.server_args.tp_size", ("rollout.tp_size",)),
    RL2Key("rollout.server_args.mem_fraction_static", ("rollout.gpu_memory_utilization",)),
    RL2Key("rollout.server_args.dtype", ("rollout.dtype",)),
    RL2Key("data.train.path", ("data.path",)),
    RL2Key("data.train.max_length", ("data.max_length",)),
    RL2Key("data.train.batch_size", ("data.batch_size",)),
    RL2Key("data.train.messages_key", ("data.messages_key",)),
    RL2Key("data.train.prompt_key", ("data.prompt_key",)),
    RL2Key("data.train.apply_chat_template", ("data.apply_chat_template",)),
    RL2Key("data.train.response_key", neutral=("response",), note=_SFT_ROWS),
    RL2Key("data.train.chosen_key", neutral=("chosen",), note="rl2 reads the chosen reply from the column 'chosen'"),
    RL2Key("data.train.rejected_key", neutral=("rejected",), note="rl2 reads the rejected reply from the column 'rejected'"),
    RL2Key("data.test.path", ("data.test_path",)),
    *_model_keys("actor"),
    *_model_keys("critic"),
    RL2Key("actor.kl.*", ("kl.*",)),
    RL2Key("actor.entropy.coef", ("actor.entropy_coef",)),
    RL2Key("adv.responses_per_prompt", ("data.responses_per_prompt",)),
    RL2Key("trainer.save_dir", ("actor.save_dir", "critic.save_dir")),
    RL2Key("trainer.save_freq", ("actor.save_freq", "critic.save_freq")),
    RL2Key("trainer.use_wandb", ("trainer.disable_wandb",), invert=True),
    # RL2, mid 2025 (27b288e) and Oct-Dec 2025 (8e7305f to 209d390, 1fce214): train_data / test_data sections.
    RL2Key("train_data.path", ("data.path",)),
    RL2Key("train_data.prompts_per_rollout", ("data.prompts_per_rollout",)),
    RL2Key("train_data.responses_per_prompt", ("data.responses_per_prompt",)),
    RL2Key("train_data.max_turns", ("rollout.max_turns",)),
    RL2Key("train_data.sampling_params.no_stop_trim", neutral=(True,), note=_STOP_KEPT),
    RL2Key("train_data.sampling_params.*", ("rollout.train_sampling_params.*",)),
    RL2Key("train_data.max_new_tokens", ("rollout.train_sampling_params.max_new_tokens",)),
    RL2Key("train_data.mask_offpolicy_data", any_value=True, note=_OFF_POLICY),
    RL2Key("train_data.prompt_key", ("data.prompt_key",)),
    RL2Key("train_data.messages_key", ("data.messages_key",)),
    RL2Key("train_data.apply_chat_template", ("data.apply_chat_template",)),
    RL2Key("train_data.experience.max_turns", ("rollout.max_turns",)),
    RL2Key("train_data.experience.max_new_tokens", ("rollout.train_sampling_params.max_new_tokens",)),
    RL2Key("train_data.experience.responses_per_prompt", ("data.responses_per_prompt",)),
    RL2Key("train_data.experience.mask_offpolicy_data", any_value=True, note=_OFF_POLICY),
    RL2Key("test_data.path", ("data.test_path",)),
    RL2Key("test_data.responses_per_prompt", ("rollout.test_responses_per_prompt",)),
    RL2Key("test_data.response_per_prompt", ("rollout.test_responses_per_prompt",)),  # RL2's own spelling
    RL2Key("test_data.prompts_per_rollout", any_value=True, note=_ALL_TEST_PROMPTS),
    RL2Key("test_data.max_turns", ("rollout.max_turns",)),  # one for both sets: a different value is an error
    RL2Key("test_data.sampling_params.no_stop_trim", neutral=(True,), note=_STOP_KEPT),
    RL2Key("test_data.sampling_params.*", ("rollout.test_sampling_params.*",)),
    RL2Key("test_data.max_new_tokens", ("rollout.test_sampling_params.max_new_tokens",)),
    RL2Key("test_data.prompt_key", ("data.prompt_key",)),  # rl2 reads train and test rows alike
    RL2Key("test_data.messages_key", ("data.messages_key",)),
    RL2Key("test_data.apply_chat_template", ("data.apply_chat_template",)),
    RL2Key("test_data.experience.max_turns", ("rollout.max_turns",)),
    RL2Key("test_data.experience.max_new_tokens", ("rollout.test_sampling_params.max_new_tokens",)),
    RL2Key("test_data.experience.responses_per_prompt", ("rollout.test_responses_per_prompt",)),
    RL2Key("rollout.train_prompts_per_rollout", ("data.prompts_per_rollout",)),
    RL2Key("rollout.test_prompts_per_rollout", any_value=True, note=_ALL_TEST_PROMPTS),
    RL2Key("rollout.train_sampling_params.no_stop_trim", neutral=(True,), note=_STOP_KEPT),
    RL2Key("rollout.test_sampling_params.no_stop_trim", neutral=(True,), note=_STOP_KEPT),
    # RL2's SFT / RM / DPO data sections of Nov-Dec 2025 (8ceccf4): the columns of rows that are not messages.
    RL2Key("data.response_key", neutral=("response",), note=_SFT_ROWS),
    RL2Key("data.chosen_key", neutral=("chosen",), note="rl2 reads the chosen reply from the column 'chosen'"),
    RL2Key("data.rejected_key", neutral=("rejected",), note="rl2 reads the rejected reply from the column 'rejected'"),
    # RL2, mid 2025 (27b288e): rollout.model_name.
    RL2Key("rollout.model_name", ("actor.model_name",)),
    RL2Key("rollout.responses_per_prompt", ("data.responses_per_prompt",)),
    # RL2, summer 2025 (8166bc9): data.train_data_path / data.test_data_path; group filtering by mean reward.
    RL2Key("data.train_data_path", ("data.path",)),
    RL2Key("data.test_data_path", ("data.test_path",)),
    RL2Key("rollout.group_filtering.lower", neutral=(0.0,),
           note="rl2's rollout.dynamic_filtering drops the groups whose rewards are all equal (for 0/1 rewards, "
                "the groups group_filtering 0..1 drops); there is no other band"),
    RL2Key("rollout.group_filtering.upper", neutral=(1.0,),
           note="rl2's rollout.dynamic_filtering drops the groups whose rewards are all equal (for 0/1 rewards, "
                "the groups group_filtering 0..1 drops); there is no other band"),
]

_BY_NAME = {tuple(key.name.removesuffix(".*").split(".")): key for key in RL2_KEYS}


def _flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    """Leaf path (a tuple of keys) -> value; an empty mapping is a leaf."""
    leaves = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and value:
            leaves.update(_flatten(value, path))
        else:
            leaves[path] = value
    return leaves


def _unflatten(leaves: dict[tuple, Any]) -> dict:
    tree: dict = {}
    for path, value in leaves.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _match(path: tuple) -> tuple[RL2Key | None, tuple]:
    """The RL2 key `path` is (exactly, or under an RL2 `prefix.*`), and the part of `path` under it."""
    if path in _BY_NAME and not _BY_NAME[path].name.endswith(".*"):
        return _BY_NAME[path], ()
    for end in range(len(path), 0, -1):
        key = _BY_NAME.get(path[:end])
        if key is not None and key.name.endswith(".*"):
            return key, path[end:]
    return None, ()


def _dotted(path: tuple) -> str:
    return ".".join(path)


def translate_rl2_keys(raw: dict) -> tuple[dict, list[str], dict[str, list[str]]]:
    """`raw` (nested, as parsed from a YAML file or key=value arguments) with RL2's keys replaced by
    the rl2 keys they mean, one line for each RL2 key met saying what became of it, and each given
    key (dotted) with the rl2 keys it set (none for an RL2 key that changes nothing in rl2).

    A ConfigError for an RL2 key without rl2 meaning set to a value that matters, and for two
    keys that set one rl2 key to different values."""
    out: dict[tuple, Any] = {}
    set_by: dict[tuple, str] = {}
    notes = []
    sets: dict[str, list[str]] = {}

    def put(path: tuple, value: Any, given_as: str) -> None:
        if path in out and out[path] != value:
            raise ConfigError(
                f"{set_by[path]}={out[path]!r} and {given_as}={value!r} both set {_dotted(path)}; give one of them"
            )
        out[path], set_by[path] = value, given_as

    for path, value in _flatten(raw).items():
        key, rest = _match(path)
        given = _dotted(path)
        sets[given] = []
        if key is None:
            put(path, value, given)
            sets[given].append(given)
        elif key.rl2_keys:
            if key.invert:
                if not isinstance(value, bool):
                    raise ConfigError(f"invalid value for RL2's '{given}': expected bool (true/false), got {value!r}")
                value = not value
            targets = [tuple(t.removesuffix(".*").split(".")) + rest for t in key.rl2_keys]
            for target in targets:
                put(target, value, given)
                sets[given].append(_dotted(target))
            meaning = " and ".join(_dotted(t) for t in targets)
            notes.append(f"RL2's {given} is rl2's {meaning}" + (f" (={value!r}, inverted)" if key.invert else ""))
        elif key.any_value or value in key.neutral:
            notes.append(f"RL2's {given}={value!r} changes nothing in rl2: {key.note}")
        else:
            accepted = f" (accepted: {', '.join(repr(v) for v in key.neutral)})" if key.neutral else ""
            raise ConfigError(f"RL2's {given}={value!r} has no equivalent in rl2{accepted}: {key.note}")
    return _unflatten(out), notes, sets


def rl2_keys_help(reader: Command | None = None) -> list[str]:
    """The help lines listing every RL2 key accepted and what it is in rl2; with a command, only the
    keys whose rl2 keys it reads, and those without an rl2 key in the sections it reads."""
    lines = ["", "RL2's key names (its current and 2025 layouts), accepted with a log line:"]
    for key in RL2_KEYS:
        if reader is not None:
            if key.rl2_keys:
                shown = any(reader.reads_key(target.removesuffix(".*")) for target in key.rl2_keys)
            else:
                shown = reader.reads_section(key.name.split(".")[0])
            if not shown:
                continue
        if key.rl2_keys:
            meaning = " and ".join(key.rl2_keys) + (" (inverted)" if key.invert else "")
        elif key.any_value:
            meaning = f"any value, no effect: {key.note}"
        else:
            accepted = ", ".join(repr(v) for v in key.neutral) or "no value"
            meaning = f"accepted: {accepted}; {key.note}"
        lines.append(f"  {key.name} -> {meaning}")
    return lines
