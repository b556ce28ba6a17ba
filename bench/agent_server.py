"""What the OpenAI-compatible server (`rl2/serve`) costs a multi-turn rollout: the same 2-turn conversations
generated directly (`rl2.rollout.multi_turn.rollout` with an env file) and through the server by an agent
file (`rl2.rollout.agent_rollout`: the `openai` package's AsyncOpenAI over HTTP, one API key a trajectory).

The task is the function-calling demo's (`recipes/ppo_tiny.sh` with TASK=tools): a tiny random model with
the `chatml-tools` template (hidden size 128, 2 layers), questions "What is the code of the <colour>
<thing> box?" with the `lookup` tool's schema, and
- direct: the demo's env file (`envs/demo_tools.py`: a stateful `Boxes` per trajectory whose `lookup()`
  reads the box), the call parsed by the hermes parser and answered as a tool message, then a second turn;
- server: an agent file that does the same conversation with `client.chat.completions.create(tools=...)`,
  appends the reply and one tool message per call, and asks again.
Both paths add a user message instead where a turn made no call, so both always generate 2 turns. Eos is
ignored (`--new-tokens` per turn) and the first turn's last tokens are replaced by the demo's call
(`<tool_call>{"name": "lookup", "arguments": {}}</tool_call>`, finish "stop"), as in
bench/function_calling.py: by default the turn ends there, as a `stop=["</tool_call>"]` turn does (the
template's end-of-turn comes in the bridge); `--call-end eos` ends it with the end-of-turn token instead,
which with eos ignored the server does not take for a stop token (see the mismatch it prints). Special and
tool-call tokens the random model draws elsewhere are replaced by a plain one, so that no stray call makes
the paths differ. Both paths therefore generate the same tokens:
the totals are checked and printed.

At each concurrency (trajectories in one rollout, prompts x responses per prompt) it reports the wall
seconds of a rollout (median of `--repeats`, after one warm-up; the paths alternate), the requests/s the
server answered, the added latency per request, (server - direct) / requests, and server / direct, the
issue's target being <= 1.10 at the demo's rollout (16 prompts x 8 responses = 128); and the agent
sessions' statistics (`Trajectory.agent_stats`, summed): `drift_requests` 0 says that no sampled token was
re-encoded.

    python bench/agent_server.py [--concurrency 1 16 128 --new-tokens 48 --repeats 3 --threads 1]
                                 [--hidden-size 128 --layers 2]   (a larger model: generation costs more)
"""

import argparse
import os
import statistics
import tempfile
import textwrap
import time
from collections import Counter
from concurrent.futures import Future

import torch
from transformers import AutoTokenizer

from rl2.chat.template import render_chat
from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import Engine, Generation, HFEngine, SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import ToolCalling, rollout
from rl2.rollout.rollout_metrics import agent_metrics
from rl2.rollout.agent_rollout import AgentFile, agent_rollout
from rl2.serve.openai_server import OpenAIServer
from rl2.testing.tiny import save_tiny

ENVS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envs")
AGAIN = "Please go on."  # what a turn without a call gets, in both paths
CALL = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'
COLOURS = "red blue green black white gold pink grey brown orange purple silver".split()
THINGS = "cat dog fox owl bee ant cow pig hen elk yak ram bat eel emu ape".split()

ENV_FILE = textwrap.dedent(f'''
    """The function-calling demo's env file, and a user message for a turn that made no call."""
    import sys

    sys.path.insert(0, {ENVS!r})
    from demo_tools import ENVIRONMENT, reward_fn  # noqa: F401


    def interact(messages):
        return [{{"role": "user", "content": {AGAIN!r}}}]
''')

AGENT_FILE = textwrap.dedent(f'''
    """The same conversation through the OpenAI API: the first reply's calls answered as tool messages (as
    envs/demo_tools.py answers them), or a user message where it made none; then a second request."""
    import sys

    sys.path.insert(0, {ENVS!r})
    from demo_lookup import QUESTION, secret_code, tool_reply


    async def run(row, client):
        messages = list(row["messages"])
        colour, thing = QUESTION.search(messages[-1]["content"]).groups()
        reply = await client.chat.completions.create(model="rl2-policy", messages=messages, tools=row["tools"])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            content = (tool_reply(secret_code(colour, thing)) if call.function.name == "lookup"
                       else f"Error: unknown tool {{call.function.name}}")
            messages.append({{"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": content}})
        if not message.tool_calls:
            messages.append({{"role": "user", "content": {AGAIN!r}}})
        await client.chat.completions.create(model="rl2-policy", messages=messages, tools=row["tools"])
        return 0.0
''')


class CallingEngine(Engine):
    """The hf engine, each slot's first turn ending in the demo's call (`call_ids`: its last tokens replaced,
    finish "stop"); in every turn the special and tool-call tokens drawn elsewhere are replaced by `filler`."""

    def __init__(self, engine: HFEngine, call_ids: list[int], banned: set[int], filler: int):
        self.engine, self.call_ids, self.banned, self.filler = engine, call_ids, banned, filler

    def generate_turns(self, first, params, on_generation, max_turns):
        turns = Counter()

        def replaced(index: int, generation: Generation) -> Future | None:
            turns[index] += 1
            ids = [self.filler if t in self.banned else t for t in generation.token_ids]
            finish = generation.finish_reason
            if turns[index] == 1 and finish != "abort":
                ids, finish = ids[: -len(self.call_ids)] + self.call_ids, "stop"
            return on_generation(index, Generation(ids, generation.logprobs[: len(ids)], finish))

        return self.engine.generate_turns(first, params, replaced, max_turns)

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def update_weights(self, named_tensors, partial=False):
        raise NotImplementedError


def make_prompts(count: int, tokenizer, tools: list[dict]) -> list[dict]:
    """`count` demo questions (distinct boxes), rendered with the tool's schema."""
    rows = []
    for i in range(count):
        colour, thing = COLOURS[i % len(COLOURS)], THINGS[(i // len(COLOURS)) % len(THINGS)]
        messages = [{"role": "user", "content": f"What is the code of the {colour} {thing} box?"}]
        ids = tokenizer(render_chat(messages, tokenizer, True, tools), add_special_tokens=False)["input_ids"]
        rows.append({"prompt_ids": list(ids), "messages": messages, "answer": "0", "tools": tools})
    return rows


def summary(trajectories) -> dict:
    """What both paths must agree on, and what went wrong."""
    return {
        "trajectories": len(trajectories),
        "response_tokens": sum(t.response_length for t in trajectories),
        "tokens": sum(len(t.token_ids) for t in trajectories),
        "turns": sum(t.turns for t in trajectories),
        "tool_messages": sum(m["role"] == "tool" for t in trajectories for m in t.messages),
        "user_fallbacks": sum(m["role"] == "user" and m["content"] == AGAIN for t in trajectories for m in t.messages),
        "errors": sum(bool(t.errors) for t in trajectories),
    }


def agent_totals(trajectories) -> dict:
    """`Trajectory.agent_stats` summed (numbers only; `ignored_fields` counted by field)."""
    totals: Counter = Counter()
    for trajectory in trajectories:
        for key, value in trajectory.agent_stats.items():
            if isinstance(value, dict):
                for name, count in value.items():
                    totals[f"ignored_fields.{name}"] += count
            else:
                totals[key] += value
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 128],
                        help="trajectories per rollout (prompts x responses per prompt)")
    parser.add_argument("--responses-per-prompt", type=int, default=8, help="the demo's; fewer where it does not divide")
    parser.add_argument("--new-tokens", type=int, default=48, help="per turn (the demo's TASK=tools)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the server has a thread of its own)")
    parser.add_argument("--call-end", choices=["stop-string", "eos"], default="stop-string",
                        help="how the first turn's call ends: at </tool_call> (a stop string's turn) or with eos")
    parser.add_argument("--hidden-size", type=int, default=128, help="the tiny model's (the demo's: 128)")
    parser.add_argument("--layers", type=int, default=2, help="the tiny model's (the demo's: 2)")
    parser.add_argument("--target", type=float, default=1.10, help="server / direct wall time the server must stay under")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    folder = tempfile.mkdtemp(prefix="rl2-agent-server-")
    save_tiny(folder, template="chatml-tools", hidden_size=args.hidden_size, num_layers=args.layers)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    call_ids = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    if args.call_end == "eos":
        call_ids.append(tokenizer.eos_token_id)
    if args.new_tokens <= len(call_ids):
        raise SystemExit(f"--new-tokens must exceed the call's {len(call_ids)} tokens")
    banned = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]))
    filler = tokenizer(" box", add_special_tokens=False)["input_ids"][0]
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    engine = CallingEngine(HFEngine(folder, tokenizer, device, dtype=dtype, max_batch_size=max(args.concurrency)),
                           call_ids, banned, filler)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    with open(f"{folder}/env.py", "w") as f:
        f.write(ENV_FILE)
    with open(f"{folder}/agent.py", "w") as f:
        f.write(AGENT_FILE)
    agent = AgentFile(f"{folder}/agent.py")
    hermes = get_tool_parser("hermes")
    server = OpenAIServer(tokenizer)
    paths = ["direct", "server"]
    results = []
    try:
        with Env(f"{folder}/env.py", timeout=30, workers=0) as env:
            tools = [tool.schema for tool in env.tools.values()]
            calling = ToolCalling(get_tool_parser("hermes"))
            for concurrency in args.concurrency:
                per_prompt = max(r for r in range(1, min(args.responses_per_prompt, concurrency) + 1)
                                 if concurrency % r == 0)
                prompts = make_prompts(concurrency // per_prompt, tokenizer, tools)

                def direct():
                    return rollout(engine, env, tokenizer, prompts, per_prompt, params, max_turns=2, tool_calling=calling)

                def served():
                    return agent_rollout(server, engine, agent, tokenizer, hermes, prompts, per_prompt, params,
                                         max_requests=2, max_length=None)

                runs = {"direct": direct, "server": served}
                walls = {name: [] for name in paths}
                seen = {name: [] for name in paths}
                for repeat in range(args.repeats + 1):  # the first warms up; the paths alternate
                    for name in paths:
                        start = time.perf_counter()
                        trajectories = runs[name]()
                        wall = time.perf_counter() - start
                        if repeat:
                            walls[name].append(wall)
                        seen[name].append(trajectories)
                results.append((concurrency, len(prompts), per_prompt, walls, seen))
    finally:
        server.close()

    print(f"device {device} ({args.threads} torch threads); tiny chatml-tools model (hidden {args.hidden_size}, "
          f"{args.layers} layers); "
          f"2 turns of {args.new_tokens} tokens a trajectory (eos ignored), the demo's lookup call in the first "
          f"(ending: {args.call_end}); medians of {args.repeats} rollouts after a warm-up")
    print(f"{'traj':>5} {'prompts x n':>11} {'direct s':>9} {'server s':>9} {'requests':>9} {'req/s':>8} "
          f"{'added ms/req':>13} {'server/direct':>14}")
    ratios = {}
    for concurrency, n_prompts, per_prompt, walls, seen in results:
        direct_s, server_s = statistics.median(walls["direct"]), statistics.median(walls["server"])
        requests = agent_totals(seen["server"][-1]).get("requests", 0)
        ratios[concurrency] = server_s / direct_s
        line = (f"{concurrency:>5} {f'{n_prompts} x {per_prompt}':>11} {direct_s:>9.3f} {server_s:>9.3f} {requests:>9} "
                f"{requests / server_s:>8.1f} {(server_s - direct_s) / requests * 1e3:>13.2f} {server_s / direct_s:>14.3f}")
        print(line)
    print("added ms/req: (server wall - direct wall) / requests, over the whole rollout (requests run concurrently)")

    print("\nwhat the paths generated (every run; direct and server must agree on tokens and turns):")
    mismatch = False
    for concurrency, _, _, _, seen in results:
        for name in paths:
            runs = [summary(t) for t in seen[name]]
            same = all(run == runs[0] for run in runs)
            print(f"{concurrency:>5} {name:<7} {runs[0]}{'' if same else '  (differs between runs: ' + str(runs) + ')'}")
        keys = ("response_tokens", "tokens", "turns")
        for name in paths[1:]:
            one, other = summary(seen["direct"][-1]), summary(seen[name][-1])
            if any(one[k] != other[k] for k in keys):
                mismatch = True
                print(f"      MISMATCH: {name} did not generate the same tokens as direct at {concurrency} trajectories")

    print("\nagent/* statistics of the server path's last run (Trajectory.agent_stats summed; rl2's agent/* metrics):")
    for concurrency, _, _, _, seen in results:
        metrics = {key.removeprefix("agent/"): round(value, 2) for key, value in agent_metrics(seen["server"][-1]).items()}
        print(f"{concurrency:>5} summed {agent_totals(seen['server'][-1])}\n      agent/* {metrics}")
    drift = sum(agent_totals(t).get("drift_requests", 0) for *_, seen in results for name in paths[1:] for t in seen[name])
    print(f"drift_requests over all server runs: {drift} ({'no sampled token re-encoded' if drift == 0 else 'RE-ENCODED'})")

    biggest = max(ratios)
    verdict = "met" if ratios[biggest] <= args.target else "NOT met"
    print(f"\ntarget: the server adds <= {args.target - 1:.0%} to a multi-turn rollout's wall time on the demo "
          f"({biggest} trajectories): server/direct = {ratios[biggest]:.3f} -> {verdict}")
    for concurrency, ratio in sorted(ratios.items()):
        print(f"  {concurrency:>5} trajectories: {ratio - 1:+.1%}")
    if mismatch:
        raise SystemExit("the paths generated different token counts: the comparison is not like for like")


if __name__ == "__main__":
    main()
