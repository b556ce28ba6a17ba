"""The rollout side of an RL run: the inference engine and the env file, and what is done with them.

Training (`rl2.trainer.ppo`), evaluation-only runs (`trainer.eval_only`) and the difficulty filter
(`rl2.trainer.difficulty_filter`) each hold one `RolloutService` (`rl2.rollout.interface.Rollout`).
"""

import json
import logging
import os

from torch import nn

from rl2.config import ActorConfig, ConfigError, DataConfig, RolloutConfig
from rl2.config.env_interface import rl2_sample_interface
from rl2.distributed.process_group import all_gather_objects, broadcast_from_rank0, is_rank0, rank, rank_slice
from rl2.engines import SamplingParams, build_engine_from_config, check_sglang
from rl2.metrics import PhaseTimer
from rl2.rollout.env import Env, EnvError
from rl2.rollout.images import RolloutImages
from rl2.rollout.interface import Draw
from rl2.rollout.multi_turn import ToolCalling, assign_rewards, rollout
from rl2.rollout.partial import partial_rollout
from rl2.rollout.rollout_metrics import eval_metrics, unscored_report
from rl2.rollout.trajectory import Trajectory
from rl2.lora import is_lora
from rl2.rollout.weight_sync import iter_full_weights
from rl2.tools.roc_penalty import roc_penalty

logger = logging.getLogger(__name__)


def trajectory_max_length(data: DataConfig, actor: ActorConfig) -> int:
    """The longest trajectory (prompt and every turn): `data.max_length`, else what one training
    micro-batch holds (`actor.max_length_per_device` x `actor.sp_size`)."""
    return data.max_length or actor.max_length_per_device * actor.sp_size


class RolloutRecords:
    """What the trainers keep of a run's rollouts, wherever they were generated: each step's trajectory
    dump (into `dump_dir`; None: no dumps) and the count of rollouts in a row in which no `reward_fn`
    call succeeded; the `rollout` section's sampling params, and `max_length`."""

    def __init__(self, rollout: RolloutConfig, max_length: int, dump_dir: str | None):
        self.rollout_config = rollout
        self.dump_dir = dump_dir
        self.unscored_in_a_row = 0  # rollouts in a row in which no reward_fn call succeeded
        self.train_params = SamplingParams.from_dict(rollout.train_sampling_params)
        self.test_params = SamplingParams.from_dict(rollout.test_sampling_params)
        self.max_length = max_length

    def check_rewards(self, trajectories: list[Trajectory]) -> None:
        """Check that the rollout's rewards could be computed: a rollout in which no `reward_fn` call
        succeeded is an error, not a step with reward 0. After `rollout.max_unscored_steps` such rollouts
        in a row, raise `EnvError` naming the env file, the error and a sample (every rank holds the same
        trajectories, so every rank raises); before that, log it."""
        report = unscored_report(trajectories, self.rollout_config.agent_path or self.rollout_config.env_path)
        if report is None:
            self.unscored_in_a_row = 0
            return
        self.unscored_in_a_row += 1
        limit = self.rollout_config.max_unscored_steps
        if self.unscored_in_a_row >= limit:
            raise EnvError(f"no reward could be computed in {self.unscored_in_a_row} rollout(s) in a row "
                           f"(rollout.max_unscored_steps={limit}): {report}")
        logger.error(f"no reward could be computed in this rollout ({self.unscored_in_a_row} in a row; the run "
                     f"stops at rollout.max_unscored_steps={limit}): {report}")

    def dump(self, trajectories: list[Trajectory], name: str) -> None:
        """`<dump_dir>/<name>.jsonl` on rank 0, when there is a `dump_dir` (`trainer.dump_trajectories`)."""
        if self.dump_dir is None or not is_rank0():
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        with open(os.path.join(self.dump_dir, f"{name}.jsonl"), "w") as f:
            for trajectory in trajectories:
                f.write(json.dumps(trajectory.to_json(), default=str) + "\n")


class RolloutService(RolloutRecords):
    """The env file (loaded first: a broken one fails before any model loads) and the engine of a
    run, which serves `actor.model_name` until weights are synced into it.

    Every rank holds one; `generate` rolls out each rank's share of the prompts and gives every rank
    all the scored trajectories, in prompt order. Build it before the policy's optimizer: a GPU
    engine sizes its KV cache from the memory still free.
    """

    def __init__(self, rollout: RolloutConfig, data: DataConfig, actor: ActorConfig, tokenizer, *, seed: int,
                 step_discount: float, engine_dtype: str, prompts_per_step: int, responses_per_prompt: int,
                 dump_dir: str | None = None, training: bool = True):
        """The `rollout`, `data` and `actor` sections and what a run derives from several (`Config`'s
        `engine_dtype`, `prompts_per_step` and `generated_per_prompt` as `responses_per_prompt`; `adv.gamma` as
        `step_discount`, `trainer.seed`); `training`: a training run (its partial rollout), not an evaluation."""
        if rollout.engine == "sglang":
            check_sglang(rollout.tp_size)  # before any model is loaded
        super().__init__(rollout, trajectory_max_length(data, actor), dump_dir)
        self.data_config = data
        self.tokenizer = tokenizer
        self.seed, self.engine_dtype, self.prompts_per_step = seed, engine_dtype, prompts_per_step
        self.save_dir = actor.save_dir
        # An agent file (rollout.agent_path) may come without an env file: its run() gives the rewards. An env
        # file written to RL2 HEAD's interface (env_step / generate) runs through its adapter.
        agent, env_path = rollout.agent_path, rollout.env_path
        self.agent = self.rl2_head = self.server = self.env = None
        if agent:  # aiohttp and openai: the agents extra, imported only for agent runs
            from rl2.rollout.agent_rollout import AgentFile

            self.agent = AgentFile(agent, rollout.env_args)
        if env_path and rl2_sample_interface(env_path):
            from rl2.rollout.env import default_env_workers
            from rl2.rollout.rl2_head_rollout import RL2HeadFile

            workers = default_env_workers() if rollout.env_workers is None else rollout.env_workers
            self.rl2_head = RL2HeadFile(env_path, rollout.env_args, tokenizer, workers, rollout.env_worker_memory_mb)
        elif env_path:
            self.env = Env.from_config(rollout, need_interact=rollout.max_turns > 1 and not agent,
                                       step_discount=step_discount)
        self.tool_calling = ToolCalling.for_env(self.env, rollout)
        # A vision-language policy: its prompts' images and its tools' (None for a text-only model).
        self.images = RolloutImages.for_model(actor.model_name, data, tokenizer)
        if self.images is not None and self.rl2_head:
            raise ConfigError("a vision-language policy rolls out through an env file (rollout.env_path) or an agent "
                              "file (rollout.agent_path), not an RL2 HEAD env file (env_step / generate): its "
                              "trajectories' images do not reach training")
        self.engine = build_engine_from_config(rollout, actor, tokenizer, seed)
        if agent or self.rl2_head:
            from rl2.serve.openai_server import OpenAIServer

            from rl2.vision.detect import is_vision_model
            from rl2.vision.processing import ImageProcessing

            images = (ImageProcessing.from_pretrained(actor.model_name, data.min_pixels, data.max_pixels)
                      if is_vision_model(actor.model_name) else None)  # chat requests may then hold images
            self.server = OpenAIServer(tokenizer, actor.model_name, rollout.agent_max_request_mb, images)
        self.faults_logged: dict[str, int] = {}  # the env's fault totals already in the metrics
        # With partial rollout (a training run): the unfinished groups this rank carries from step to step.
        self.partial = partial_rollout(self, rollout, prompts_per_step, responses_per_prompt) if training else None

    def next_batch(self, step: int, draw: Draw, responses_per_prompt: int,
                   timer: PhaseTimer) -> tuple[list[Trajectory], dict]:
        """Step `step`'s trajectories, scored, on every rank: its prompts' (`draw`n, a step's worth); with partial
        rollout the groups that finished first among those carried over and new prompts."""
        seed, sleep = self.seed + step, self.rollout_config.sleep
        if self.partial is None:
            prompts = draw(self.prompts_per_step)
            return self.generate(prompts, self.train_params, responses_per_prompt, seed, timer, sleep_after=sleep), {}
        version = step - 1  # the updates the policy has had
        trajectories = self.partial.generate(draw(self.partial.prompts_wanted()), self.train_params, seed, version,
                                             timer, sleep_after=sleep)
        return trajectories, self.partial.metrics(trajectories, version)

    def state_dict(self) -> dict:
        """The carried-over groups of partial rollout (resumed exactly); nothing otherwise."""
        return {"partial_rollout": self.partial.state_dict()} if self.partial is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.partial is not None and "partial_rollout" in state:
            self.partial.load_state_dict(state["partial_rollout"])

    def generate(
        self,
        prompts: list[dict],
        params: SamplingParams,
        responses_per_prompt: int,
        seed: int,
        timer: PhaseTimer | None = None,
        sleep_after: bool = False,
        version: int = 0,
    ) -> list[Trajectory]:
        """Roll out this rank's share of `prompts` (whole groups), score it, and gather every
        rank's trajectories on every rank, in prompt order. `sleep_after` puts the engine to
        sleep once generation is done (training follows; the next `sync_weights` wakes it); `version`
        is the policy version the engine holds (recorded per token)."""
        timer = timer or PhaseTimer()
        start, end = rank_slice(len(prompts))
        self.engine.wake()
        self.engine.reseed(seed * 1_000_003 + rank())
        if self.rl2_head is not None:
            return self._generate_with_rl2_head(prompts[start:end], params, responses_per_prompt, start, timer,
                                                sleep_after, version)
        if self.agent is not None:
            return self._generate_with_agent(prompts[start:end], params, responses_per_prompt, start, timer,
                                             sleep_after, version)
        with timer("rollout"):
            mine = self.images.prepare(prompts[start:end]) if self.images is not None else prompts[start:end]
            trajectories = rollout(
                self.engine,
                self.env,
                self.tokenizer,
                mine,
                responses_per_prompt,
                params,
                self.rollout_config.max_turns,
                self.max_length,
                first_group=start,
                apply_chat_template=self.data_config.apply_chat_template,
                version=version,
                tool_calling=self.tool_calling,
                per_turn=self.rollout_config.trajectory_format == "per_turn",
                images=self.images,
            )
        if sleep_after:
            with timer("sync"):  # the engine hands its memory back: part of the sync (a release on SGLang)
                self.engine.sleep()
        with timer("reward"):
            assign_rewards(self.env, trajectories)
        return all_gather_objects(trajectories)

    def _generate_with_agent(self, prompts: list[dict], params: SamplingParams, responses_per_prompt: int,
                             first_group: int, timer: PhaseTimer, sleep_after: bool, version: int) -> list[Trajectory]:
        """`generate` with the agent file: its runs give the trajectories and their rewards; with an env file
        too, its `reward_fn` scores the ones whose run gave none."""
        from rl2.chat.tool_parsers import get_tool_parser
        from rl2.rollout.agent_rollout import agent_rollout, score_unscored

        rollout_config = self.rollout_config
        with timer("rollout"):
            trajectories = agent_rollout(
                self.server, self.engine, self.agent, self.tokenizer, get_tool_parser(rollout_config.tool_parser),
                prompts, responses_per_prompt, params, rollout_config.max_turns, self.max_length, first_group,
                version, merge=rollout_config.agent_sequences == "merge", timeout=rollout_config.agent_timeout,
            )
        if sleep_after:
            with timer("sync"):  # the engine hands its memory back: part of the sync (a release on SGLang)
                self.engine.sleep()
        with timer("reward"):  # with an env file too, its reward_fn scores the ones whose run gave no reward
            score_unscored(self.env, trajectories)
        return all_gather_objects(trajectories)

    def _generate_with_rl2_head(self, prompts: list[dict], params: SamplingParams, responses_per_prompt: int,
                                first_group: int, timer: PhaseTimer, sleep_after: bool,
                                version: int) -> list[Trajectory]:
        """`generate` with an RL2 HEAD env file: its `generate` gives the trajectories and their rewards."""
        from rl2.rollout.rl2_head_rollout import rl2_head_rollout, rl2_rollout_config

        rollout_config = self.rollout_config
        config = rl2_rollout_config(self.data_config, rollout_config, self.save_dir, params, responses_per_prompt,
                                    train=params is not self.test_params)
        with timer("rollout"):
            trajectories = rl2_head_rollout(
                self.server, self.engine, self.rl2_head, self.tokenizer, prompts, responses_per_prompt, params, config,
                rollout_config.max_turns, self.max_length, first_group, version, timeout=rollout_config.agent_timeout,
            )
        if sleep_after:
            with timer("sync"):  # the engine hands its memory back: part of the sync (a release on SGLang)
                self.engine.sleep()
        return all_gather_objects(trajectories)

    def evaluate(self, prompts: list[dict], seed: int, name: str, require_rewards: bool = False) -> dict[str, float]:
        """`test/` metrics (mean reward, avg@k, pass@k with k = rollout.test_responses_per_prompt, the
        failed rewards) of the engine's model on `prompts`; the trajectories are dumped as `name`.
        When no test reward could be computed: `EnvError` with `require_rewards`, else a logged error."""
        k = self.rollout_config.test_responses_per_prompt
        trajectories = self.generate(prompts, self.test_params, k, seed)
        self.dump(trajectories, name)
        report = unscored_report(trajectories, self.rollout_config.agent_path or self.rollout_config.env_path)
        if report is not None and require_rewards:
            raise EnvError(f"evaluation: no test reward could be computed: {report}")
        if report is not None:
            logger.error(f"evaluation {name}: no test reward could be computed: {report}")
        return eval_metrics(trajectories, k)

    def sync_weights(self, model: nn.Module, version: int = 0) -> None:
        """Push `model`'s weights into the engine, bucket by bucket, then wake it: with SGLang,
        weight memory is resumed, the weights pushed, and only then the KV cache resumed."""
        adapted_only = is_lora(model) and self.engine.keeps_weights_asleep  # LoRA: only what its adapters change
        self.engine.update_weights(
            iter_full_weights(model, self.engine_dtype, self.rollout_config.sync_bucket_mb, adapted_only),
            partial=adapted_only,
        )
        self.engine.wake()

    @property
    def tools(self) -> dict:
        """The env file's tools by name (`rl2.chat.tools.Tool`), for the prompts' chat template."""
        return self.env.tools if self.env is not None else {}

    def roc_penalties(self, trajectories: list[Trajectory]) -> list[float]:
        """GRPO-RoC's penalty of each trajectory: the env file's `roc_penalty(messages)` where it
        defines one (the default penalty where a call fails), else `rl2.tools.roc_penalty`; rank 0's
        on every rank, so all ranks keep the same trajectories."""
        conversations = [t.messages for t in trajectories]
        penalties = [roc_penalty(messages) for messages in conversations]
        if self.env is not None and self.env.has_roc_penalty:
            for i, result in enumerate(self.env.roc_penalties(conversations)):
                if result.error is None:
                    penalties[i] = result.value
        return broadcast_from_rank0(penalties)

    def fault_metrics(self) -> dict[str, float]:
        """`faults/<name>`: the faults the env's pools and clients recovered from since the last
        call (workers replaced, calls retried), summed over ranks; every name seen so far is logged,
        0 when nothing happened."""
        totals = self.env.fault_counts() if self.env is not None else {}
        new = {name: max(total - self.faults_logged.get(name, 0), 0) for name, total in totals.items()}
        self.faults_logged = totals
        summed: dict[str, float] = {}
        for rank_counts in all_gather_objects([new]):
            for name, count in rank_counts.items():
                summed[f"faults/{name}"] = summed.get(f"faults/{name}", 0.0) + count
        return summed

    def close(self) -> None:
        """End the env file's worker pools and the engine (SGLang: its scheduler processes)."""
        if self.env is not None:
            self.env.close()
        if self.rl2_head is not None:
            self.rl2_head.close()
        if self.server is not None:
            self.server.close()
        self.engine.shutdown()
        if self.images is not None:
            self.images.close()
