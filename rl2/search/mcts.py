"""Monte Carlo tree search over solution steps (rStar-Math).

Each rollout selects from the root by UCT (or PUCT) down to a step not yet expanded, then keeps
expanding: `width` candidate next steps are sampled, the best one by the selection rule is taken
(an unvisited one first, or by its PPM score), until a final answer or the depth limit. The
terminal's value (+1 correct / -1 wrong from the env, or the PPM's score) is back-propagated along
the path: every node on it gains a visit and the value. A rollout that reaches a finished solution
again back-propagates its value once more; one whose candidates were all invalid back-propagates -1.
"""

from rl2.search.agent import SearchAgent
from rl2.search.tree import Node, backpropagate, select_child

DEAD_END = -1.0  # the value of a step whose candidate next steps were all invalid


class MCTS(SearchAgent):
    def __init__(self, root: Node, rollouts: int, width: int, c: float, rule: str = "uct"):
        super().__init__(root)
        self.rollouts, self.width, self.c, self.rule = rollouts, width, c, rule
        self.rollouts_done = 0
        self.current: Node | None = None  # the step the running rollout expands next

    def requests(self) -> list[tuple[Node, int]]:
        while not self.done and self.current is None:
            node = self.root
            while node.expanded and not node.terminal:
                child = select_child(node, self.c, self.rule)
                if child is None:
                    break
                node = child
            if node.terminal:
                self._end_rollout(node, node.reward)
            elif node.expanded:
                self._end_rollout(node, DEAD_END)
            else:
                self.current = node
        return [] if self.done else [(self.current, self.width)]

    def expanded(self, results: list[tuple[Node, list[Node]]]) -> None:
        ((node, _),) = results
        self.current = None
        child = select_child(node, self.c, self.rule)
        if child is None:
            self._end_rollout(node, DEAD_END)
        elif child.terminal:
            self._end_rollout(child, child.reward)
        else:
            self.current = child

    def _end_rollout(self, node: Node, value: float) -> None:
        backpropagate(node, value)
        self.rollouts_done += 1
        self.done = self.rollouts_done >= self.rollouts
