"""A tiny search task where the policy must explore: reach a target sum in a fixed number of steps.

A problem reads "Reach T in D steps."; a step is "add k<end_of_step>" with k drawn from
`STEP_PROBS` (greedy always adds 1), and after D steps the final step boxes the sum. Greedy
decoding reaches D, so it solves no target above D; sampling reaches a target with a probability
the tests compute. `WalkEngine` is this policy behind the `Engine` interface; `TabularPPM` is a
process preference model fitted (Bradley-Terry) on step-level pairs, over the features of a
partial solution that decide whether the target is still reachable.
"""

import math
import random
import re

import torch

from rl2.engines import Engine, Generation, SamplingParams
from rl2.search.run import no_programs
from rl2.search.solver import Problem, Solver

STEP_PROBS = {1: 0.5, 2: 0.3, 3: 0.2}
PROBLEM = re.compile(r"Reach (\d+) in (\d+) steps\.")


def problem_messages(target: int, steps: int) -> list[dict]:
    return [{"role": "user", "content": f"Reach {target} in {steps} steps."}]


def walk_state(text: str) -> tuple[int, int, int]:
    """(steps allowed, steps taken so far, their sum) from a prompt + partial solution."""
    steps = int(PROBLEM.search(text).group(2))
    solution = text.split("<|im_start|>assistant\n", 1)[-1]
    adds = [int(k) for k in re.findall(r"add (\d+)", solution)]
    return steps, len(adds), sum(adds)


class WalkEngine(Engine):
    """The walk policy: samples a step from `STEP_PROBS` (temperature 0: the most likely one)."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer, self.rng, self.calls = tokenizer, random.Random(seed), 0

    def reseed(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def generate(self, prompts, params):
        self.calls += 1
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            steps, taken, total = walk_state(text)
            if taken >= steps:
                reply, logprob = f"The sum is \\boxed{{{total}}}.<end_of_answer>", 0.0
            else:
                if params.temperature == 0:
                    k = max(STEP_PROBS, key=STEP_PROBS.get)
                else:
                    k = self.rng.choices(list(STEP_PROBS), weights=list(STEP_PROBS.values()))[0]
                reply, logprob = f"add {k}<end_of_step>", math.log(STEP_PROBS[k])
            tokens = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            out.append(Generation(tokens, [logprob] * len(tokens), "stop"))
        return out

    def update_weights(self, named_tensors, partial=False):
        raise NotImplementedError


def walk_features(messages: list[dict], solution: str) -> tuple:
    """What decides a partial solution's value: how far the target is and how many steps are left."""
    target, steps = map(int, PROBLEM.search(messages[-1]["content"]).groups())
    adds = [int(k) for k in re.findall(r"add (\d+)", solution)]
    boxed = re.findall(r"\\boxed\{(\d+)\}", solution)
    if boxed:
        return ("final", target - int(boxed[-1]))
    return ("open", target - sum(adds), steps - len(adds))


class TabularPPM:
    """A PPM with one parameter per feature value, trained with the reward model's Bradley-Terry
    loss -log sigma(r_chosen - r_rejected) on pair rows; values are tanh of the parameter."""

    def __init__(self, pairs: list[dict], steps: int = 300, lr: float = 0.5):
        features = [(walk_features(p["messages"], p["chosen"]), walk_features(p["messages"], p["rejected"])) for p in pairs]
        self.index = {f: i for i, f in enumerate(sorted({f for pair in features for f in pair}, key=str))}
        theta = torch.zeros(len(self.index), requires_grad=True)
        chosen = torch.tensor([self.index[c] for c, _ in features])
        rejected = torch.tensor([self.index[r] for _, r in features])
        optimizer = torch.optim.SGD([theta], lr=lr)
        for _ in range(steps):
            optimizer.zero_grad()
            loss = -torch.nn.functional.logsigmoid(theta[chosen] - theta[rejected]).mean()
            loss.backward()
            optimizer.step()
        self.theta = theta.detach()

    def values(self, conversations: list[list[dict]]) -> list[float]:
        out = []
        for messages in conversations:
            feature = walk_features(messages[:-1], messages[-1]["content"])
            i = self.index.get(feature)
            out.append(math.tanh(float(self.theta[i])) if i is not None else 0.0)
        return out


def run_walk(tokenizer, env, make_agent, targets: list[int], seed: int, greedy: bool = False, ppm=None,
             terminal_value: str = "env") -> tuple[float, float, list, list]:
    """Search reach-`target`-in-3-steps problems with one agent each: (accuracy of the chosen answers,
    generated tokens per problem, the agents, the problems)."""
    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_new_tokens=32)
    solver = Solver(WalkEngine(tokenizer, seed=seed), tokenizer, params, env, no_programs, ppm=ppm,
                    terminal_value=terminal_value, max_depth=4)
    problems = [Problem(problem_messages(t, 3), str(t)) for t in targets]
    agents = [make_agent() for _ in problems]
    solver.solve(problems, agents)
    accuracy = sum(bool(a.answer() and a.answer().correct) for a in agents) / len(agents)
    tokens = sum(a.tokens for a in agents) / len(agents)
    return accuracy, tokens, agents, problems
