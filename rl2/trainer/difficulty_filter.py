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

from tqdm import tqdm

from rl2.config import Config
from rl2.config_checks import check_config
from rl2.data.conversations import RLDataset
from rl2.data.rows import Columns, write_jsonl
from rl2.distributed.process_group import is_rank0
from rl2.rollout.rollout_metrics import correct_by_prompt
from rl2.trainer.base import run_main, start_run
from rl2.trainer.ppo_eval import rollout_service

logger = logging.getLogger("rl2.trainer.difficulty_filter")


class DifficultyFilter:
    """A `RolloutService` serving `actor.model_name` over the problems of `data.path`."""

    def __init__(self, config: Config):
        # Sampling only, as an evaluation does: no checkpoint to resume, no trajectory dumps.
        config = dataclasses.replace(
            config,
            trainer=dataclasses.replace(config.trainer, eval_only=True, load_ckpt_from=None, dump_trajectories=False),
        )
        check_config(config, "filter")
        self.config = config
        tokenizer = start_run(config)
        self.rollout = rollout_service(config, tokenizer)
        self.dataset = RLDataset(config.data.path, tokenizer, self.rollout.max_length,
                                 columns=Columns.from_config(config.data, images=self.rollout.images is not None),
                                 tools=self.rollout.tools)

    def run(self) -> dict[str, float]:
        """Sample, score and write the kept rows; returns counts and the mean pass rate."""
        config, dataset, n = self.config, self.dataset, self.config.filter.responses_per_prompt
        chunk = config.prompts_per_step
        pass_rates: list[float] = []  # NaN: none of the problem's answers could be scored
        progress = tqdm(total=len(dataset), desc="difficulty filter", disable=not is_rank0())
        for start in range(0, len(dataset), chunk):
            prompts = [dataset[i] for i in range(start, min(start + chunk, len(dataset)))]
            trajectories = self.rollout.generate(prompts, self.rollout.train_params, n, config.trainer.seed + start)
            self.rollout.check_rewards(trajectories)
            pass_rates += correct_by_prompt(trajectories, n).nanmean(dim=1).tolist()
            progress.update(len(prompts))
        progress.close()
        self.rollout.close()
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
        output, dataset = self.config.filter.output, self.dataset
        kept_set = set(kept)
        write_jsonl(output, [dataset.rows[dataset.indices[i]] for i in kept])
        write_jsonl(output + ".pass_rates.jsonl", [
            {"row": dataset.indices[i] + 1, "pass_rate": None if math.isnan(rate) else rate, "kept": i in kept_set}
            for i, rate in enumerate(pass_rates)
        ])


def main() -> None:
    run_main(lambda config: DifficultyFilter(config).run(), "filter")


if __name__ == "__main__":
    main()
