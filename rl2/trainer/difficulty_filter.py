"""Difficulty filter between RL stages (rStar2-Agent): sample answers from a checkpoint, keep the
problems it does not already solve every time.

    torchrun --nproc_per_node=N -m rl2.trainer.difficulty_filter config=recipe.yaml \\
        actor.model_name=ckpts/step400 data.path=train.jsonl \\
        filter.responses_per_prompt=8 filter.pass_rate_below=1.0 filter.output=train_hard.jsonl

Every problem of `data.path` gets `filter.responses_per_prompt` answers (sampled with
`rollout.train_sampling_params`, through the env file, tools included); its pass rate is the share
of its scored answers that scored above 0 (answers that could not be scored, env errors, count
neither way; a problem with none scored has no pass rate and is not kept). Rows with
`pass_rate_min <= pass rate < pass_rate_below` are written to `filter.output` with all their
columns, and every row's pass rate (null when unknown) to `<output>.pass_rates.jsonl`.
"""

import dataclasses
import json
import logging
import math
import sys

from tqdm import tqdm

from rl2.config import Config, ConfigError, load_config
from rl2.data.rows import write_jsonl
from rl2.distributed.process_group import exit_process, is_rank0
from rl2.trainer.base import require, user_errors_reported
from rl2.trainer.ppo import PPOTrainer, correct_by_prompt

logger = logging.getLogger("rl2.trainer.difficulty_filter")


class DifficultyFilter(PPOTrainer):
    """The PPO trainer's engine and env, without an actor, over `data.path`."""

    def __init__(self, config: Config):
        require(config, "data.path", "filter.output")
        check_filter_config(config)
        super().__init__(
            dataclasses.replace(
                config,
                data=dataclasses.replace(config.data, test_path=config.data.path),
                trainer=dataclasses.replace(
                    config.trainer, eval_only=True, load_ckpt_from=None, dump_trajectories=False
                ),
            )
        )

    def run(self) -> dict[str, float]:
        """Sample, score and write the kept rows; returns counts and the mean pass rate."""
        config, dataset, n = self.config, self.test_data, self.config.filter.responses_per_prompt
        chunk = config.data.prompts_per_rollout or config.data.batch_size
        pass_rates: list[float] = []  # NaN: none of the problem's answers could be scored
        progress = tqdm(total=len(dataset), desc="difficulty filter", disable=not is_rank0())
        for start in range(0, len(dataset), chunk):
            prompts = [dataset[i] for i in range(start, min(start + chunk, len(dataset)))]
            trajectories = self.generate(prompts, self.train_params, n, seed=config.trainer.seed + start)
            pass_rates += correct_by_prompt(trajectories, n).nanmean(dim=1).tolist()
            progress.update(len(prompts))
        progress.close()
        self.close()
        low, high = config.filter.pass_rate_min, config.filter.pass_rate_below
        kept = [i for i, rate in enumerate(pass_rates) if low <= rate < high]  # NaN compares False
        known = [rate for rate in pass_rates if not math.isnan(rate)]
        summary = {
            "problems": float(len(dataset)),
            "kept": float(len(kept)),
            "always_solved": float(sum(rate == 1.0 for rate in known)),
            "never_solved": float(sum(rate == 0.0 for rate in known)),
            "unscored": float(len(pass_rates) - len(known)),
            "pass_rate_mean": sum(known) / max(len(known), 1),
        }
        if is_rank0():
            self.write(kept, pass_rates)
            logger.info(
                f"kept {len(kept)} of {len(dataset)} problems with pass rate in [{low}, {high}) "
                f"({int(summary['always_solved'])} always solved, {int(summary['never_solved'])} never) "
                f"-> {config.filter.output}"
            )
            print(json.dumps(summary), flush=True)
        return summary

    def write(self, kept: list[int], pass_rates: list[float]) -> None:
        """The kept rows (as read, every column) and every row's pass rate, each written whole
        under a temporary name first, so an interrupted run leaves no partial file."""
        output, dataset = self.config.filter.output, self.test_data
        kept_set = set(kept)
        write_jsonl(output, [dataset.rows[dataset.indices[i]] for i in kept])
        write_jsonl(output + ".pass_rates.jsonl", [
            {"row": dataset.indices[i] + 1, "pass_rate": None if math.isnan(rate) else rate, "kept": i in kept_set}
            for i, rate in enumerate(pass_rates)
        ])


def check_filter_config(config: Config) -> None:
    settings = config.filter
    if settings.responses_per_prompt < 1:
        raise ConfigError(f"filter.responses_per_prompt must be >= 1, got {settings.responses_per_prompt}")
    if not 0.0 <= settings.pass_rate_min < settings.pass_rate_below <= 1.0:
        raise ConfigError(
            f"need 0 <= filter.pass_rate_min < filter.pass_rate_below <= 1 (rows kept: min <= pass rate < below), "
            f"got {settings.pass_rate_min} and {settings.pass_rate_below}"
        )


def main() -> None:
    with user_errors_reported():
        DifficultyFilter(load_config(sys.argv[1:])).run()
    exit_process(0)


if __name__ == "__main__":
    main()
