"""The process preference model served to the search: a reward model (trained by `rl2.trainer.rm`
on step-level pairs) whose score of a partial solution, squashed by tanh into [-1, 1] as in
rStar-Math, is the value of its last step. A round's new steps are scored in length-sorted batches."""

import math

from rl2.rollout.reward_scorer import RewardScorer


class ProcessPreferenceModel:
    """Values of partial solutions from a reward model folder; see `RewardScorer` for the scoring."""

    def __init__(self, path: str, device: str | None = None, max_length: int | None = None):
        self.scorer = RewardScorer(path, device=device, max_length=max_length)

    def values(self, conversations: list[list[dict]]) -> list[float]:
        """tanh of the reward model's score of each conversation (the problem, then the partial
        solution as the assistant's message)."""
        return [math.tanh(score) for score in self.scorer.score_many(conversations)]
