"""The contract between a search agent (one problem's search) and the solver that batches them."""

from rl2.search.tree import Node


class SearchAgent:
    """Searches the tree of one problem. Each round the solver asks every agent which nodes it wants
    expanded (`requests`), generates, runs and scores the candidate steps of all of them at once,
    and hands each agent its results (`expanded`); an agent is `done` when its budget is spent."""

    def __init__(self, root: Node):
        self.root = root
        self.done = False
        self.tokens = 0  # tokens generated for this problem

    def requests(self) -> list[tuple[Node, int]]:
        """The nodes to expand this round, each with how many candidate next steps to sample."""
        raise NotImplementedError

    def expanded(self, results: list[tuple[Node, list[Node]]]) -> None:
        """The requested nodes with their new children (executed and scored; invalid ones included)."""
        raise NotImplementedError

    def answer(self) -> Node | None:
        """The solution the search settles on: the valid finished one with the highest value (its
        terminal reward; ties go to the higher Q, then the one found first); None if none finished."""
        best = None
        for node in self.root.walk():
            if node.terminal and node.valid and node.reward is not None:
                if best is None or (node.reward, node.q) > (best.reward, best.q):
                    best = node
        return best
