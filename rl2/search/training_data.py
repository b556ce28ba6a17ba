"""Self-evolution data from search trees (rStar-Math): SFT rows of the best correct solutions and
step-level preference pairs for the process preference model, as rl2 data rows.

- SFT: per problem, up to `per_problem` correct solutions with the highest mean Q over their
  steps, as `{"messages": prompt + [assistant solution]}`.
- PPM pairs: at every expanded step with both kinds of children, the (up to) `per_side` children
  with the highest Q among those that lead to a correct answer are chosen, the `per_side` with the
  lowest Q among those that do not (wrong answers, failed code, dead ends) rejected, every chosen
  paired with every rejected, as `{"messages": prompt, "chosen": prefix + step, "rejected":
  prefix + step}`: the whole partial solution is the assistant's reply, as the search scores it.
"""

from rl2.search.tree import Node


def mean_q(node: Node) -> float:
    path = node.path()
    return sum(step.q for step in path) / max(len(path), 1)


def sft_rows(root: Node, messages: list[dict], per_problem: int = 2) -> list[dict]:
    """The best correct solutions of one problem's tree as SFT rows, best first."""
    correct = [node for node in root.walk() if node.terminal and node.valid and node.correct]
    correct.sort(key=mean_q, reverse=True)  # stable: ties keep the order the search found them
    unique, seen = [], set()
    for node in correct:
        text = node.solution()
        if text not in seen:
            seen.add(text)
            unique.append(text)
    return [{"messages": [*messages, {"role": "assistant", "content": text}]} for text in unique[:per_problem]]


def ppm_pairs(root: Node, messages: list[dict], per_side: int = 2) -> list[dict]:
    """Step-level preference pairs from one problem's tree."""
    rows = []
    for node in root.walk():
        if len(node.children) < 2:
            continue
        good = [child for child in node.children if child.valid and child.leads_to_correct() and child.q > 0]
        bad = [child for child in node.children if not child.leads_to_correct() and child.q < 0]
        if not good or not bad:
            continue
        chosen = sorted(good, key=lambda child: child.q, reverse=True)[:per_side]
        rejected = sorted(bad, key=lambda child: child.q)[:per_side]
        prefix = node.solution()
        for good_step in chosen:
            for bad_step in rejected:
                if good_step.text != bad_step.text:
                    rows.append({"messages": messages, "chosen": prefix + good_step.text, "rejected": prefix + bad_step.text})
    return rows
