"""Step-level beam search: every partial solution in the beam is expanded into `width` candidate
next steps, and the `beam_size` best unfinished candidates (by PPM score; by the policy's mean
token log-probability without a PPM) form the next beam. Finished candidates are set aside; the
search ends when `beam_size` have finished or no candidate is left."""

from rl2.search.agent import SearchAgent
from rl2.search.tree import Node, backpropagate


def beam_rank(node: Node) -> float:
    return node.score if node.score is not None else node.logprob


class BeamSearch(SearchAgent):
    def __init__(self, root: Node, beam_size: int, width: int):
        super().__init__(root)
        self.beam_size, self.width = beam_size, width
        self.beam = [root]
        self.finished: list[Node] = []

    def requests(self) -> list[tuple[Node, int]]:
        return [] if self.done else [(node, self.width) for node in self.beam]

    def expanded(self, results: list[tuple[Node, list[Node]]]) -> None:
        candidates = [child for _, children in results for child in children if child.valid]
        for child in candidates:
            if child.terminal:
                self.finished.append(child)
                backpropagate(child, child.reward)
        unfinished = [child for child in candidates if not child.terminal]
        self.beam = sorted(unfinished, key=beam_rank, reverse=True)[: self.beam_size]  # stable: ties keep order
        self.done = not self.beam or len(self.finished) >= self.beam_size
