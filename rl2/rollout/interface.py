"""What a PPO trainer asks of its rollout, whichever it is: `RolloutService` (every rank generates: colocated,
with partial rollout or agents) or `RemoteRollout` (split placement: the rollout ranks generate). The trainer
never asks which.

A step: `next_batch` (the step's scored trajectories), `check_rewards` (a rollout without any reward is
counted, and past `rollout.max_unscored_steps` an error), `roc_penalties` (GRPO-RoC), then after the update
`sync_weights`. Around the steps: `evaluate`, `dump`, `state_dict` / `load_state_dict` with the checkpoints,
`close` at the end.
"""

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import nn

from rl2.engines import SamplingParams
from rl2.metrics import PhaseTimer
from rl2.rollout.trajectory import Trajectory

Draw = Callable[[int], list[dict]]  # the next n training prompts, in step order


@runtime_checkable
class Rollout(Protocol):
    train_params: SamplingParams
    test_params: SamplingParams
    max_length: int

    @property
    def tools(self) -> dict:
        """The env file's tools (name -> schema), rendered into prompts."""

    def next_batch(self, step: int, draw: Draw, responses_per_prompt: int,
                   timer: PhaseTimer) -> tuple[list[Trajectory], dict]:
        """Step `step`'s trajectories, scored, on every rank, `responses_per_prompt` per prompt (the prompts drawn with
        `draw`), and the rollout's own metrics for it."""

    def check_rewards(self, trajectories: list[Trajectory]) -> None: ...

    def roc_penalties(self, trajectories: list[Trajectory]) -> list[float]: ...

    def fault_metrics(self) -> dict[str, float]: ...

    def dump(self, trajectories: list[Trajectory], name: str) -> None: ...

    def sync_weights(self, model: nn.Module, version: int = 0) -> None: ...

    def evaluate(self, prompts: list[dict], seed: int, name: str, require_rewards: bool = False) -> dict[str, float]: ...

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollout (groups or batches in flight), under keys of its own."""

    def load_state_dict(self, state: dict) -> None:
        """Take back `state_dict()`'s keys from a checkpoint's state (absent keys: nothing to restore)."""

    def close(self) -> None: ...
