"""What native function calling costs per turn: parsing the calls, checking their arguments against the
schema and bridging the tool messages (`rl2.chat`), against the same tool through `interact(messages)`
(RL2's text protocol, the env parsing the text itself), and against the turn's generation time.

A tiny model with Qwen2.5's chat template (the tools in the system turn) generates each turn with the hf
engine (eos ignored: `--new-tokens` per turn); the first turn's last tokens are replaced by a call of the
`add(a, b)` tool as Qwen writes it, so that both protocols parse, run and answer one call a trajectory.
Times: the rl2 functions a turn goes through, summed over the trajectories, over the rollout's wall time.

    python bench/function_calling.py [--trajectories 64 --new-tokens 64 --repeats 3]
"""

import argparse
import tempfile
import textwrap
import time
from collections import defaultdict
from concurrent.futures import Future

from transformers import AutoTokenizer

from rl2.chat import tool_parsers
from rl2.engines import Engine, Generation, HFEngine, SamplingParams
from rl2.rollout import env as env_module
from rl2.rollout import multi_turn
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import ToolCalling, rollout
from rl2.testing.tiny import save_tiny

NATIVE = textwrap.dedent('''
    def add(a: int, b: int) -> int:
        """Add two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    TOOLS = [add]

    def reward_fn(messages, answer):
        return 0.0
''')
TEXT = textwrap.dedent('''
    import json, re

    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def interact(messages):
        replies = []
        for body in CALL.findall(messages[-1]["content"]):
            call = json.loads(body)
            replies.append({"role": "tool", "content": str(call["arguments"]["a"] + call["arguments"]["b"])})
        return replies

    def reward_fn(messages, answer):
        return 0.0
''')
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class CallingEngine(Engine):
    """The hf engine, with the first turn of every trajectory ending in a call and the end-of-turn token
    (its last tokens replaced)."""

    def __init__(self, engine: HFEngine, call_ids: list[int], eos_id: int):
        self.engine, self.call_ids = engine, call_ids + [eos_id]

    def generate_turns(self, first, params, on_generation, max_turns):
        turns = defaultdict(int)

        def replaced(index: int, generation: Generation) -> Future | None:
            turns[index] += 1
            if turns[index] == 1:
                ids = generation.token_ids[: -len(self.call_ids)] + self.call_ids
                generation = Generation(ids, generation.logprobs[: len(ids)], "stop")
            return on_generation(index, generation)

        return self.engine.generate_turns(first, params, replaced, max_turns)

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def update_weights(self, named_tensors, partial=False):
        raise NotImplementedError


def timed(functions: dict[str, tuple[object, str]], seconds: dict[str, float]) -> list:
    """Wrap each (module, name) so that its calls add their time to seconds[key]; returns the originals."""
    originals = []
    for key, (module, name) in functions.items():
        original = getattr(module, name)

        def wrapper(*args, _original=original, _key=key, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_key] += time.perf_counter() - start

        originals.append((module, name, original))
        setattr(module, name, wrapper)
    return originals


def one_rollout(engine, env, tokenizer, prompts, params, calling) -> tuple[float, dict[str, float]]:
    seconds: dict[str, float] = defaultdict(float)
    functions = {"bridge": (multi_turn, "observation_tokens")}
    if calling is not None:
        functions.update({"parse": (multi_turn, "_parse_calls"), "validate": (env_module, "argument_problem")})
    originals = timed(functions, seconds)
    try:
        start = time.perf_counter()
        trajectories = rollout(engine, env, tokenizer, prompts, 1, params, max_turns=2, tool_calling=calling)
        wall = time.perf_counter() - start
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
    # The random text before the call may hold a stray <tool_call> of its own (another, malformed call).
    answered = sum(any(m["role"] == "tool" and m["content"] == "5" for m in t.messages) for t in trajectories)
    assert answered >= 0.9 * len(prompts), f"only {answered} of {len(prompts)} trajectories got the tool's answer"
    return wall, dict(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    save_tiny(folder, template="qwen2.5", hidden_size=128)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = CallingEngine(HFEngine(folder, tokenizer, "cpu", max_batch_size=args.trajectories),
                           tokenizer(CALL, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = {}
    native_tools: list[dict] = []
    for name, source, calling in (("native", NATIVE, ToolCalling(tool_parsers.get_tool_parser("hermes"))),
                                  ("interact", TEXT, None)):
        path = f"{folder}/{name}_env.py"
        with open(path, "w") as f:
            f.write(source)
        with Env(path, timeout=30, workers=0, need_interact=calling is None) as env:
            # The same prompt for both: the interact env's rows carry the tool's schema.
            tools = [tool.schema for tool in env.tools.values()] or native_tools
            messages = [{"role": "user", "content": "What is 2 + 3?"}]
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            prompt = {"prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"], "messages": messages,
                      "answer": "5", "tools": tools}
            runs = [one_rollout(engine, env, tokenizer, [prompt] * args.trajectories, params, calling)
                    for _ in range(args.repeats + 1)][1:]  # the first warms up
            native_tools = tools
        rows[name] = runs
    print(f"{args.trajectories} trajectories x 2 turns of {args.new_tokens} tokens, hf engine on CPU, tiny "
          f"Qwen2.5-template model; medians of {args.repeats} rollouts")
    print(f"{'protocol':<10}{'rollout s':>10}{'parse ms':>10}{'validate ms':>12}{'bridge ms':>10}"
          f"{'per turn ms':>12}{'share':>8}")
    for name, runs in rows.items():
        wall = sorted(w for w, _ in runs)[len(runs) // 2]
        parts = {key: sorted(s.get(key, 0.0) for _, s in runs)[len(runs) // 2] for key in ("parse", "validate", "bridge")}
        overhead = sum(parts.values())
        print(f"{name:<10}{wall:>10.2f}{parts['parse'] * 1e3:>10.1f}{parts['validate'] * 1e3:>12.1f}"
              f"{parts['bridge'] * 1e3:>10.1f}{overhead / args.trajectories * 1e3:>12.2f}{overhead / wall:>8.1%}")
    print("share: the functions' time over the rollout's (they run in the tool threads, beside generation)")


if __name__ == "__main__":
    main()
