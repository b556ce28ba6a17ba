"""`trainer.eval_only`: the test set's avg@k / pass@k of `actor.model_name` under the run's engine and env file
(`python -m rl2.trainer.ppo trainer.eval_only=true ...`), written to `<save_dir>/eval.json` and printed."""

import json
import logging
import os

from rl2.config import Config
from rl2.config_checks import check_config
from rl2.data.conversations import RLDataset
from rl2.data.rows import Columns, write_json
from rl2.distributed.process_group import is_rank0
from rl2.rollout.service import RolloutService
from rl2.trainer.base import Trainer

logger = logging.getLogger("rl2.trainer.ppo")


def trajectory_dump_dir(config: Config) -> str | None:
    """Where a run dumps its trajectories: `<actor.save_dir>/trajectories` with `trainer.dump_trajectories`."""
    return os.path.join(config.actor.save_dir, "trajectories") if config.trainer.dump_trajectories else None


def rollout_service(config: Config, tokenizer) -> RolloutService:
    """A run's `RolloutService` (a training run's, with its partial rollout, unless `trainer.eval_only`), given
    the sections and values of `config` it reads."""
    return RolloutService(config.rollout, config.data, config.actor, tokenizer, seed=config.trainer.seed,
                          step_discount=config.adv.gamma, engine_dtype=config.engine_dtype,
                          prompts_per_step=config.prompts_per_step, responses_per_prompt=config.generated_per_prompt,
                          dump_dir=trajectory_dump_dir(config), training=not config.trainer.eval_only)


class PPOEvaluator(Trainer):
    """Evaluates `actor.model_name` on `data.test_path` with `rollout.test_responses_per_prompt` responses a
    prompt: the engine alone serves the model (nothing trains, no checkpoint)."""

    name = "PPO"

    def __init__(self, config: Config):
        check_config(config, "ppo")
        super().__init__(config)
        self.rollout = rollout_service(config, self.tokenizer)
        self.test_data = RLDataset(config.data.test_path, self.tokenizer, self.rollout.max_length,
                                   columns=Columns.for_run(config, "rl"), tools=self.rollout.tools)
        logger.info(
            f"evaluating {config.actor.model_name} on {len(self.test_data)} prompts of {config.data.test_path}, "
            f"{config.rollout.test_responses_per_prompt} responses each, env={config.rollout.env_path}"
        )

    def evaluate(self) -> dict[str, float]:
        """The rollout's `test/` metrics of the model (an evaluation in which no test reward could be computed
        is an error); on rank 0 also `<save_dir>/eval.json` and the report printed as one JSON line."""
        config = self.config
        prompts = [self.test_data[i] for i in range(len(self.test_data))]
        results = self.rollout.evaluate(prompts, config.trainer.seed - 1, "eval", require_rewards=True)
        if is_rank0():
            report = {"model": config.actor.model_name, "test_path": config.data.test_path,
                      "prompts": len(self.test_data), "k": config.rollout.test_responses_per_prompt, **results}
            write_json(os.path.join(config.actor.save_dir, "eval.json"), report)
            logger.info("evaluation: " + ", ".join(f"{key} {value:.4f}" for key, value in results.items()))
            print(json.dumps(report), flush=True)
        return results

    def train(self) -> None:
        """The whole evaluation-only run (`python -m rl2.trainer.ppo trainer.eval_only=true`): `evaluate()`, then
        the engine and the env's worker processes stopped (also on an error, which is raised)."""
        try:
            self.evaluate()
        except BaseException:
            self.close_after_error()
            raise
        self.close()

    def release(self) -> None:
        """The engine and the env's worker processes stopped."""
        self.rollout.close()
