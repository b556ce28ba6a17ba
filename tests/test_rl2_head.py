"""RL2 HEAD's env files run unchanged (files of our own, written to RL2 HEAD's interface as read in its
`RL2/datasets/rl.py`, `RL2/workers/rollout.py` and `envs/`): an `env_step` file through `base_generate`, a
gem-style file with its own `generate` and a stateful environment pool, and a deep_research-style file that
asks the router for its workers, the model's length, a function-call parse and a chat completion. The
episodes become the sequences RL2 trains, token for token."""

import json
import textwrap

import pytest

from conftest import run_python
from rl2.data.chat_template import render_chat
from rl2.engines import SamplingParams
from rl2.metrics import read_metrics
from rl2.rollout.env_file import EnvError
from rl2.rollout.rl2_head import RL2HeadFile, rl2_head_rollout, rl2_rollout_config
from rl2.serve.openai_server import OpenAIServer
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine

COUNTDOWN = '''
import re
from functools import partial
from RL2.datasets import Sample, base_generate


async def env_step(sample: Sample):
    response = {"next_state": None, "done": True, "reward": 0.0}
    match = re.search(r"<answer>(.*?)</answer>", sample.action_text)
    if match is None:
        return response
    response["reward"] = 0.1
    try:
        numbers = sorted(int(n) for n in re.findall(r"\\d+", match.group(1)))
        value = eval(match.group(1), {"__builtins__": None}, {})
        if numbers == sorted(sample.sample["numbers"]) and value == sample.sample["target"]:
            response["reward"] = 1.0
    except Exception:
        pass
    return response

generate = partial(base_generate, env_step_fn=env_step)
'''

# Two turns: the second state extends the first (one sequence), unless the row asks for a fresh prompt
# (RL2 then starts a second sequence).
TWO_TURNS = '''
from functools import partial
from RL2.datasets import Sample, base_generate


async def env_step(sample: Sample):
    if sample.turn == 1:
        if sample.sample["fresh"]:
            state = "<|im_start|>user\\nNow the blue one.<|im_end|>\\n<|im_start|>assistant\\n"
        else:
            state = sample.state_text + sample.action_text + "\\n<|im_start|>user\\nAnd blue?<|im_end|>\\n<|im_start|>assistant\\n"
        return {"next_state": state, "done": False, "reward": 0.25}
    return {"next_state": None, "done": True, "reward": 0.5}

generate = partial(base_generate, env_step_fn=env_step)
'''

# gem.py's shape: its own generate, a pool of stateful environments taken and given back, RL2's helpers.
GEM_STYLE = '''
import asyncio
from collections import deque
from omegaconf import OmegaConf
from RL2.datasets import Sample, initialize_state_dict, add_llm_response, add_env_response
from RL2.utils.communication import async_request


class LetterCounting:
    """A stand-in of a gem environment: how many times a letter is in a word, two words an episode."""

    def __init__(self, seed):
        self.words = ["banana", "letter"][seed % 2:] + ["banana", "letter"][:seed % 2]

    def reset(self):
        self.index = 0
        return f"How many a's in {self.words[0]}?", {}

    def step(self, action):
        right = str(self.words[self.index].count("a")) in action
        self.index += 1
        if self.index == len(self.words):
            return "", float(right), True, False, {}
        return f"How many a's in {self.words[self.index]}?", float(right), False, False, {}


POOL = [LetterCounting(seed) for seed in range(4)]
AVAILABLE = deque(range(4))
SEMAPHORE = asyncio.Semaphore(4)


async def env_step(tokenizer, sample):
    prompt, reward, terminated, truncated, _ = POOL[sample.sample["env_idx"]].step(sample.action_text)
    next_state = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    if terminated or truncated:
        AVAILABLE.append(sample.sample["env_idx"])
        SEMAPHORE.release()
    return {"next_state": next_state, "done": terminated or truncated, "reward": reward}


async def generate(config, tokenizer, router_url, sample):
    sampling_params = OmegaConf.to_container(OmegaConf.create(dict(config.sampling_params)))
    if sample.status == Sample.Status.RUNNING:
        await SEMAPHORE.acquire()
        env_idx = AVAILABLE.popleft()
        prompt, _ = POOL[env_idx].reset()
        sample.state_text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                          add_generation_prompt=True, tokenize=False)
        sample.sample["env_idx"] = env_idx
        sample.state_dict = initialize_state_dict(tokenizer, sample.state_text)
    while True:
        response = await async_request(router_url, "generate", json={
            "input_ids": sample.state_dict["states"],
            "sampling_params": {**sampling_params, "no_stop_trim": True},
            "return_logprob": True})
        add_llm_response(sample, response)
        if sample.status == Sample.Status.ABORTED:
            return
        add_env_response(tokenizer, sample, await env_step(tokenizer, sample))
        if sample.status == Sample.Status.DONE:
            return
'''

# deep_research.py's shape: the router's workers, the model's length, SGLang's function-call parser, a chat
# completion of its own (a judge), all at the URLs RL2 gives.
RESEARCH_STYLE = '''
import json
from RL2.datasets import Sample, initialize_state_dict, add_llm_response, add_env_response
from RL2.utils.communication import async_request

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
SEEN = {}


async def generate(config, tokenizer, router_url, sample):
    server_url = (await async_request(router_url, "list_workers", "GET"))["urls"][0]
    SEEN["max_model_len"] = (await async_request(server_url, "v1/models", "GET"))["data"][0]["max_model_len"]
    sample.state_text = tokenizer.apply_chat_template(sample.sample["messages"], add_generation_prompt=True, tokenize=False)
    sample.state_dict = initialize_state_dict(tokenizer, sample.state_text)
    response = await async_request(router_url, "generate", json={
        "input_ids": sample.state_dict["states"], "sampling_params": dict(config.sampling_params),
        "return_logprob": True})
    add_llm_response(sample, response)
    parsed = await async_request(server_url, "parse_function_call", json={
        "text": sample.action_text, "tools": TOOLS, "tool_call_parser": "qwen25"})
    SEEN["calls"] = [(call["name"], json.loads(call["parameters"])) for call in parsed["calls"]]
    judge = await async_request(router_url, "v1/chat/completions", json={
        "model": "", "messages": [{"role": "user", "content": "Is it right?"}], "temperature": 0.7})
    verdict = judge["choices"][0]["message"]["content"]
    add_env_response(tokenizer, sample, {"next_state": None, "done": True, "reward": float(verdict == "yes")})
    sample.sample["seen"] = dict(SEEN)
'''


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(template="qwen2.5")


@pytest.fixture(scope="module")
def server(tokenizer):
    server = OpenAIServer(tokenizer)
    yield server
    server.close()


def env_file(tmp_path, name: str, source: str) -> RL2HeadFile:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return RL2HeadFile(str(path))


def prompt(tokenizer, question: str, **columns) -> dict:
    messages = [{"role": "user", "content": question}]
    ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    return {"prompt_ids": ids, "messages": messages, "answer": None, "row": {"messages": messages, **columns}}


def roll(server, engine, tokenizer, file, prompts, max_requests=4, responses_per_prompt=1):
    params = SamplingParams(max_new_tokens=64)
    config = rl2_rollout_config(params, True, "messages", "prompt", responses_per_prompt)
    return rl2_head_rollout(server, engine, file, tokenizer, prompts, responses_per_prompt, params, config,
                            max_requests, 2048)


def test_an_env_step_file_scores_through_base_generate(server, tokenizer, tmp_path):
    """RL2's Countdown shape: the row's own columns (`numbers`, `target`) reach env_step; one sequence, the
    prompt's tokens then exactly the sampled ones; the reward is env_step's."""
    replies = {"3 5 8": "<answer>3 + 5</answer>", "2 2 5": "<answer>2 + 2</answer>", "1 1 9": "no idea"}
    engine = ScriptedEngine(tokenizer, lambda text: next(r for q, r in replies.items() if q in text))
    prompts = [prompt(tokenizer, f"Use {q}", numbers=[int(n) for n in q.split()[:2]], target=int(q.split()[2]))
               for q in replies]
    right, wrong, none = roll(server, engine, tokenizer, env_file(tmp_path, "countdown", COUNTDOWN), prompts)
    assert (right.reward, wrong.reward, none.reward) == (1.0, 0.1, 0.0)
    assert not right.errors and right.turns == 1 and right.turn_starts is None
    sampled = tokenizer("<answer>3 + 5</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert right.token_ids == prompts[0]["prompt_ids"] + sampled
    assert right.action_mask == [0] * len(prompts[0]["prompt_ids"]) + [1] * len(sampled)


@pytest.mark.parametrize("fresh", [False, True], ids=["extends", "new-sequence"])
def test_a_next_state_that_does_not_extend_starts_a_sequence(server, tokenizer, tmp_path, fresh):
    """As RL2's add_env_response: a next state that extends state + action appends its new text's tokens
    (one sequence); one that does not starts a second sequence, trained on its own; the episode's reward is
    the sum of each sequence's last reward."""
    engine = ScriptedEngine(tokenizer, lambda text: "red is 3" if "blue" not in text.lower() else "blue is 4")
    (trajectory,) = roll(server, engine, tokenizer, env_file(tmp_path, "two_turns", TWO_TURNS),
                         [prompt(tokenizer, "The red one?", fresh=fresh)])
    assert trajectory.turns == 2 and not trajectory.errors
    first_prompt, second_prompt = engine.calls[0][0], engine.calls[1][0]
    turn = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # noqa: E731
    if fresh:
        assert trajectory.turn_starts == [0, len(first_prompt) + len(turn("red is 3"))]
        assert trajectory.token_ids == first_prompt + turn("red is 3") + second_prompt + turn("blue is 4")
        assert trajectory.reward == 0.25 + 0.5
    else:
        assert trajectory.turn_starts is None
        assert second_prompt[:len(first_prompt) + len(turn("red is 3"))] == first_prompt + turn("red is 3")
        assert trajectory.token_ids == second_prompt + turn("blue is 4")
        assert trajectory.reward == 0.5
    assert sum(trajectory.action_mask) == len(turn("red is 3")) + len(turn("blue is 4"))


def test_a_gem_style_file_with_its_own_generate_and_environment_pool(server, tokenizer, tmp_path):
    """gem.py's shape: its own generate takes an environment from a pool (more trajectories than
    environments: the rest wait), every turn a fresh prompt (a new sequence), rewards summed."""
    engine = ScriptedEngine(tokenizer, lambda text: "3" if "banana" in text.split("<|im_start|>user")[-1] else "0")
    trajectories = roll(server, engine, tokenizer, env_file(tmp_path, "gem_style", GEM_STYLE),
                        [prompt(tokenizer, "go")] * 3, responses_per_prompt=2)
    assert len(trajectories) == 6
    for trajectory in trajectories:
        assert not trajectory.errors and trajectory.turns == 2 and len(trajectory.turn_starts) == 2
        assert trajectory.reward == 2.0  # each sequence its last reward: banana, 3 a's, right; letter, "0", right


def test_a_research_style_file_reaches_the_router_endpoints_it_uses(server, tokenizer, tmp_path):
    """list_workers, v1/models (max_model_len), parse_function_call with SGLang's parser name, and a chat
    completion of the file's own (its judge): served; only /generate's tokens are the trajectory's."""
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "red box"}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, lambda text: "yes" if "Is it right?" in text else call)
    research = env_file(tmp_path, "research_style", RESEARCH_STYLE)
    (trajectory,) = roll(server, engine, tokenizer, research, [prompt(tokenizer, "Find the code")])
    assert not trajectory.errors and trajectory.reward == 1.0 and trajectory.turns == 1
    assert research.module.SEEN == {"max_model_len": 2048, "calls": [("search", {"query": "red box"})]}
    assert call in trajectory.messages[1]["content"]
    sampled = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sum(trajectory.action_mask) == len(sampled)


def test_statuses_and_broken_files(server, tokenizer, tmp_path):
    """A generate that raises, or returns before the sample is done, leaves no reward and says so; a file
    with env_step but no generate is refused at start-up naming what RL2 expects."""
    engine = ScriptedEngine(tokenizer, lambda text: "x")
    broken = env_file(tmp_path, "broken", '''
        from RL2.datasets import Sample

        async def generate(config, tokenizer, router_url, sample):
            if sample.sample["kind"] == "raise":
                raise ValueError("no luck")
    ''')
    raised, early = roll(server, engine, tokenizer, broken, [prompt(tokenizer, "a", kind="raise"),
                                                              prompt(tokenizer, "b", kind="early")])
    assert raised.reward is None and "generate raised" in raised.errors[0] and "ValueError: no luck" in raised.errors[0]
    assert early.reward is None and "returned with the sample running" in early.errors[0]
    path = tmp_path / "no_generate.py"
    path.write_text("from RL2.datasets import Sample\n\nasync def env_step(sample):\n    return {}\n")
    with pytest.raises(EnvError, match="defines no generate"):
        RL2HeadFile(str(path))


def test_ppo_trains_on_an_rl2_head_env_file(tiny_model_dir, tmp_path):
    """`rollout.env_path` = an RL2 HEAD file: the PPO trainer runs it unchanged (its rows' own columns read
    by env_step) and trains."""
    rows = [{"messages": [{"role": "user", "content": f"Use {a} {b} to make {a + b}"}], "numbers": [a, b],
             "target": a + b} for a in range(1, 5) for b in range(1, 5)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = tmp_path / "countdown.py"
    env.write_text(textwrap.dedent(COUNTDOWN))
    run_python(["-m", "rl2.trainer.ppo", f"data.path={data}", "data.prompts_per_rollout=4",
                "data.responses_per_prompt=2", f"actor.model_name={tiny_model_dir}", "actor.dtype=float32",
                "actor.gradient_checkpointing=false", f"actor.save_dir={tmp_path / 'run'}", f"rollout.env_path={env}",
                "rollout.dynamic_filtering=false", "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 8}",
                "trainer.total_steps=2", "trainer.disable_wandb=true"])
    metrics = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [row["step"] for row in metrics] == [1, 2]
    assert all(row["env_errors"] == 0 and row["reward_errors"] == 0 and "actor/loss" in row for row in metrics)
