"""Best-of-N: N solutions sampled step by step independently (greedy decoding is N = 1 at
temperature 0); the answer is the finished one with the highest value (the PPM's score as an
outcome reward, or the env's)."""

from rl2.search.agent import SearchAgent
from rl2.search.tree import Node, backpropagate


class BestOfN(SearchAgent):
    def __init__(self, root: Node, n: int):
        super().__init__(root)
        self.n = n
        self.ends: list[Node] | None = None  # the last step of each unfinished sample

    def requests(self) -> list[tuple[Node, int]]:
        if self.done:
            return []
        if self.ends is None:
            return [(self.root, self.n)]
        return [(end, 1) for end in self.ends]

    def expanded(self, results: list[tuple[Node, list[Node]]]) -> None:
        self.ends = []
        for _, children in results:
            for child in children:
                if child.valid and child.terminal:
                    backpropagate(child, child.reward)
                elif child.valid:
                    self.ends.append(child)
        self.done = not self.ends
