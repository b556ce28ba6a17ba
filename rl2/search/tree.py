"""A search tree of solution steps: nodes, their statistics, UCT / PUCT selection and back-propagation.

A node is one step of a solution (its text as the model sees it, code output included); the path
from the root to a node is a partial solution. Every node keeps what MCTS needs (visits N, value
sum W, so Q = W / N), what a process preference model said about it (`score`), and what the step
cost and produced.
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    """One step of a solution. The root is the problem itself (empty text, depth 0)."""

    text: str = ""  # the step as the model sees it: generated text, then its code's output block
    parent: "Node | None" = None
    children: list["Node"] = field(default_factory=list)
    depth: int = 0
    code: str | None = None  # the step's program, None when it has none
    visits: int = 0
    value_sum: float = 0.0
    score: float | None = None  # the process preference model's value of the path to here, in [-1, 1]
    prior: float = 1.0  # the policy's probability of this step among its siblings (PUCT)
    logprob: float = 0.0  # mean log-probability of the step's tokens under the policy
    tokens: int = 0  # tokens generated for the step
    valid: bool = True  # False: its code failed, it was cut at the token limit, or it could not be scored
    error: str | None = None  # why it is invalid
    terminal: bool = False  # a final answer, or a step at the depth limit
    reward: float | None = None  # a terminal's value for the search: +1 / -1 from the env, or the PPM's
    correct: bool | None = None  # a terminal's answer checked against the dataset's (None: not checked)
    expanded: bool = False  # its candidate next steps were generated (the children, valid or not)

    def add_child(self, child: "Node") -> "Node":
        child.parent, child.depth = self, self.depth + 1
        self.children.append(child)
        return child

    @property
    def q(self) -> float:
        """Q = W / N once visited; before that a finished solution's reward, else the PPM's score if
        it has one, else 0. An invalid step is -1."""
        if not self.valid:
            return -1.0
        if self.visits > 0:
            return self.value_sum / self.visits
        if self.terminal and self.reward is not None:
            return self.reward
        return self.score if self.score is not None else 0.0

    def path(self) -> list["Node"]:
        """The nodes from the root's first step down to this one (the root itself left out)."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def solution(self) -> str:
        """The partial solution this node ends: the text of every step from the root."""
        return "".join(step.text for step in self.path())

    def program_history(self) -> list[str]:
        """The programs of the steps before this one, in order (they run again before its own)."""
        return [step.code for step in self.path()[:-1] if step.code is not None]

    def walk(self) -> Iterator["Node"]:
        """This node and every node below it, depth first, children in order."""
        yield self
        for child in self.children:
            yield from child.walk()

    def leads_to_correct(self) -> bool:
        """Some terminal at or below this node has a correct answer."""
        return any(node.terminal and node.correct for node in self.walk())


def uct(node: Node, c: float) -> float:
    """Q + c·sqrt(ln N(parent) / N): an unvisited step without a PPM score is tried first (+inf);
    one with a score counts as visited once."""
    if node.visits == 0 and node.score is None:
        return math.inf
    parent_visits = max(node.parent.visits if node.parent else 1, 1)
    return node.q + c * math.sqrt(math.log(parent_visits) / max(node.visits, 1))


def puct(node: Node, c: float) -> float:
    """AlphaZero's Q + c·P·sqrt(N(parent)) / (1 + N), P the policy's share of the step among its siblings."""
    parent_visits = node.parent.visits if node.parent else 0
    return node.q + c * node.prior * math.sqrt(parent_visits) / (1 + node.visits)


SELECTION_RULES = {"uct": uct, "puct": puct}


def select_child(node: Node, c: float, rule: str = "uct") -> Node | None:
    """The valid child with the highest UCT (or PUCT) value, the first on ties; None if it has none."""
    score = SELECTION_RULES[rule]
    best, best_value = None, -math.inf
    for child in node.children:
        if not child.valid:
            continue
        value = score(child, c)
        if best is None or value > best_value:
            best, best_value = child, value
    return best


def backpropagate(node: Node, value: float) -> None:
    """Add one visit and `value` to the node and every ancestor up to the root."""
    while node is not None:
        node.visits += 1
        node.value_sum += value
        node = node.parent


def set_priors(children: list[Node]) -> None:
    """PUCT priors: the softmax over siblings of each step's mean token log-probability (so a long
    step is not penalised for its length)."""
    if not children:
        return
    top = max(child.logprob for child in children)
    weights = [math.exp(child.logprob - top) for child in children]
    total = sum(weights)
    for child, weight in zip(children, weights):
        child.prior = weight / total


def tree_to_json(node: Node) -> dict:
    """The tree below `node` as plain JSON (for dumping and inspection)."""
    return {
        "text": node.text,
        "depth": node.depth,
        "visits": node.visits,
        "q": node.q,
        "score": node.score,
        "valid": node.valid,
        "error": node.error,
        "terminal": node.terminal,
        "reward": node.reward,
        "correct": node.correct,
        "tokens": node.tokens,
        "children": [tree_to_json(child) for child in node.children],
    }
