"""RL2 HEAD's env files run unchanged (files of our own, written to RL2 HEAD's interface as read in its
`RL2/datasets/rl.py`, `RL2/workers/rollout.py` and `envs/`): an `env_step` file through `base_generate`; the
patterns of RL2's envs/orz.py (math-verify in env_step: it needs a main thread), envs/gem.py (a module-level
environment pool behind an asyncio Semaphore and Lock, its own generate, an OmegaConf config) and
envs/deep_research.py (the router URL in a global, list_workers, v1/models, parse_function_call, a judge of its
own) in `tests/envs/rl2_*_style.py`, run in env worker processes as RL2 runs them on its main thread; the turn
limit; workers that hang or crash. The episodes become the sequences RL2 trains, token for token."""

import json
import os
import re
import textwrap

import pytest
from omegaconf import OmegaConf

from conftest import REPO, run_python
from rl2.chat.template import render_chat
from rl2.config import Config, DataConfig, RolloutConfig
from rl2.engines import SamplingParams
from rl2.metrics import read_metrics
from rl2.rollout.env_file import EnvError
from rl2.rollout import rl2_head_workers
from rl2.rollout.rl2_head_rollout import RL2HeadFile, rl2_head_rollout, rl2_rollout_config
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


# An episode that never ends by itself: each env_step answers with another user turn (reward -0.5), extending
# the sequence, or, for rows asking for it, as a fresh prompt (a sequence of its own).
ENDLESS = """
from functools import partial
from RL2.datasets import Sample, base_generate


async def env_step(sample: Sample):
    if sample.sample["fresh"]:
        state = "<|im_start|>user\\nTry again.<|im_end|>\\n<|im_start|>assistant\\n"
    else:
        state = sample.state_text + sample.action_text + "\\n<|im_start|>user\\nTry again.<|im_end|>\\n<|im_start|>assistant\\n"
    return {"next_state": state, "done": False, "reward": -0.5}

generate = partial(base_generate, env_step_fn=env_step)
"""

# A file whose episodes misbehave as their row says: block the worker's event loop, kill the worker, or sleep
# past the timeout.
MISBEHAVING = """
import asyncio
import os
import time
from functools import partial
from RL2.datasets import Sample, base_generate


async def env_step(sample: Sample):
    kind = sample.sample["kind"]
    if kind == "block":
        time.sleep(60)
    elif kind == "crash":
        os._exit(3)
    elif kind == "slow":
        await asyncio.sleep(60)
    return {"next_state": None, "done": True, "reward": 1.0}

generate = partial(base_generate, env_step_fn=env_step)
"""

ENVS = os.path.join(REPO, "tests", "envs")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(template="qwen2.5")


@pytest.fixture(scope="module")
def server(tokenizer):
    server = OpenAIServer(tokenizer)
    yield server
    server.close()


@pytest.fixture
def load(tokenizer):
    """`load(path, workers=..., **env_args)`: an RL2HeadFile, its workers stopped after the test."""
    files = []

    def load(path, workers: int = 0, **args) -> RL2HeadFile:
        files.append(RL2HeadFile(str(path), args, tokenizer, workers))
        return files[-1]

    yield load
    for file in files:
        file.close()


def write(tmp_path, name: str, source: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def prompt(tokenizer, question: str, **columns) -> dict:
    messages = [{"role": "user", "content": question}]
    ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    return {"prompt_ids": ids, "messages": messages, "answer": None, "row": {"messages": messages, **columns}}


def roll(server, engine, tokenizer, file, prompts, max_requests=4, responses_per_prompt=1, timeout=600.0):
    params = SamplingParams(max_new_tokens=64)
    config = rl2_rollout_config(DataConfig(), RolloutConfig(), None, params, responses_per_prompt)
    return rl2_head_rollout(server, engine, file, tokenizer, prompts, responses_per_prompt, params, config,
                            max_requests, 2048, timeout=timeout)


def tokens(tokenizer, text: str) -> list[int]:
    """A reply's sampled ids: its text's, then the end of turn."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_an_env_step_file_scores_through_base_generate(server, tokenizer, tmp_path, load):
    """RL2's Countdown shape: the row's own columns (`numbers`, `target`) reach env_step; one sequence, the
    prompt's tokens then exactly the sampled ones; the reward is env_step's."""
    replies = {"3 5 8": "<answer>3 + 5</answer>", "2 2 5": "<answer>2 + 2</answer>", "1 1 9": "no idea"}
    engine = ScriptedEngine(tokenizer, lambda text: next(r for q, r in replies.items() if q in text))
    prompts = [prompt(tokenizer, f"Use {q}", numbers=[int(n) for n in q.split()[:2]], target=int(q.split()[2]))
               for q in replies]
    right, wrong, none = roll(server, engine, tokenizer, load(write(tmp_path, "countdown", COUNTDOWN)), prompts)
    assert (right.reward, wrong.reward, none.reward) == (1.0, 0.1, 0.0)
    assert not right.errors and right.turns == 1 and right.turn_starts is None
    sampled = tokens(tokenizer, "<answer>3 + 5</answer>")
    assert right.token_ids == prompts[0]["prompt_ids"] + sampled
    assert right.action_mask == [0] * len(prompts[0]["prompt_ids"]) + [1] * len(sampled)


@pytest.mark.parametrize("fresh", [False, True], ids=["extends", "new-sequence"])
def test_a_next_state_that_does_not_extend_starts_a_sequence(server, tokenizer, tmp_path, load, fresh):
    """As RL2's add_env_response: a next state that extends state + action appends its new text's tokens
    (one sequence); one that does not starts a second sequence, trained on its own; the episode's reward is
    the sum of each sequence's last reward."""
    engine = ScriptedEngine(tokenizer, lambda text: "red is 3" if "blue" not in text.lower() else "blue is 4")
    (trajectory,) = roll(server, engine, tokenizer, load(write(tmp_path, "two_turns", TWO_TURNS)),
                         [prompt(tokenizer, "The red one?", fresh=fresh)])
    assert trajectory.turns == 2 and not trajectory.errors
    first_prompt, second_prompt = engine.calls[0][0], engine.calls[1][0]
    if fresh:
        assert trajectory.turn_starts == [0, len(first_prompt) + len(tokens(tokenizer, "red is 3"))]
        assert trajectory.token_ids == first_prompt + tokens(tokenizer, "red is 3") + second_prompt + tokens(tokenizer, "blue is 4")
        assert trajectory.reward == 0.25 + 0.5
    else:
        assert trajectory.turn_starts is None
        red = first_prompt + tokens(tokenizer, "red is 3")
        assert second_prompt[:len(red)] == red
        assert trajectory.token_ids == second_prompt + tokens(tokenizer, "blue is 4")
        assert trajectory.reward == 0.5
    assert sum(trajectory.action_mask) == len(tokens(tokenizer, "red is 3")) + len(tokens(tokenizer, "blue is 4"))


def orz_reply(text: str) -> str:
    question = text.split("<|im_start|>user\n")[-1]
    return {"2+2": "So it is \\boxed{4}.", "3*3": "The answer is $9$", "1+6": "Surely \\boxed{8}"}[question[:3]]


def test_an_orz_style_file_scores_with_math_verify_in_its_workers(server, tokenizer, load):
    """envs/orz.py's shape: math-verify's parse / verify in env_step. In the env workers (the file's generate
    on each one's main-thread loop, as RL2 runs it) right answers score 1, wrong ones 0, none is an error; on
    the server's thread (rollout.env_workers=0) math-verify refuses, as it did before the workers."""
    engine = ScriptedEngine(tokenizer, orz_reply)
    prompts = [prompt(tokenizer, "2+2?", answer="4"), prompt(tokenizer, "3*3?", answer="$9$"),
               prompt(tokenizer, "1+6?", answer="7")]
    path = os.path.join(ENVS, "rl2_orz_style.py")
    trajectories = roll(server, engine, tokenizer, load(path, workers=2), prompts, responses_per_prompt=2)
    assert [t.errors for t in trajectories] == [[]] * 6
    assert [t.reward for t in trajectories] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    in_process = roll(server, engine, tokenizer, load(path), prompts[:1])
    assert in_process[0].reward is None and "threaded environment" in in_process[0].errors[0]


def count_a(text: str) -> str:
    word = re.findall(r"How many a's in (\w+)\?", text)[-1]
    return str(word.count("a"))


def test_a_gem_style_file_keeps_its_pool_semaphore_and_lock_across_steps(server, tokenizer, load):
    """envs/gem.py's shape: its own generate takes a game from a module-level pool behind an asyncio
    Semaphore and Lock (more trajectories than games: the rest wait, which binds them to the loop), every
    turn a fresh prompt (a new sequence), rewards summed; `config` is an OmegaConf section
    (`OmegaConf.to_container(config.sampling_params)`). A second step runs on the same loop in the same
    worker: the module's Semaphore and Lock still work."""
    engine = ScriptedEngine(tokenizer, count_a)
    gem = load(os.path.join(ENVS, "rl2_gem_style.py"), workers=1)
    for step in range(2):
        trajectories = roll(server, engine, tokenizer, gem, [prompt(tokenizer, "go")] * 3, responses_per_prompt=2)
        assert [t.errors for t in trajectories] == [[]] * 6, step
        for trajectory in trajectories:  # each sequence its last reward: two right answers
            assert trajectory.reward == 2.0 and trajectory.turns == 2 and len(trajectory.turn_starts) == 2


def researcher(text: str) -> str:
    """The model of the research tests: a judge, a summariser, and a policy that searches, visits, then
    answers (or, for a question about 'loops', visits again and again)."""
    if text.count("Judge the response.") and "[correct_answer]" in text:
        correct = re.search(r"\[correct_answer\]: (\S+)", text).group(1)
        response = re.search(r"\[response\]: (.*?)\n\[correct_answer\]", text, re.S).group(1)
        return f"correct: {'yes' if correct in response else 'no'}"
    if "Summarise this page for the goal." in text.split("<|im_start|>user")[-1]:
        return "<think>hm</think>The box holds the code 42."
    turns = text.count("<|im_start|>assistant") - 1  # turns so far
    if turns == 0 and "loops" not in text:
        return '<tool_call>\n{"name": "search", "arguments": {"query": ["box code"]}}\n</tool_call>'
    if turns == 1 or "loops" in text:
        return '<tool_call>\n{"name": "visit", "arguments": {"url": ["box.example"], "goal": "the code"}}\n</tool_call>'
    return "<answer>42</answer>"


def count_calls(engine, marker: str) -> int:
    return sum(marker in engine.tokenizer.decode(p).split("<|im_start|>user")[-1] for call in engine.calls for p in call)


def test_a_research_style_file_routes_each_trajectory_to_its_own_session(server, tokenizer, load, tmp_path):
    """envs/deep_research.py's shape, 16 trajectories in 2 workers: the router URL in a global (the last
    trajectory's), the server URL from list_workers and the model length from v1/models kept from the first
    (and from the step before), yet each trajectory's requests reach its own session; its summariser's and
    judge's chat completions are served but are no turns (3 /generate turns fit rollout.max_turns=3 beside
    them); the rows have no messages (prompt and answer, as deep_research's)."""
    log = tmp_path / "seen.jsonl"
    research = load(os.path.join(ENVS, "rl2_research_style.py"), workers=2, log=str(log))
    prompts = [{"row": {"prompt": f"What code is in box {n}?", "answer": answer}, "answer": answer}
               for n, answer in enumerate(["42", "42", "7", "42"])]
    for step in range(2):
        engine = ScriptedEngine(tokenizer, researcher)
        trajectories = roll(server, engine, tokenizer, research, prompts, max_requests=3, responses_per_prompt=4)
        assert [t.errors for t in trajectories] == [[]] * 16, step
        assert [t.reward for t in trajectories] == [1.0] * 8 + [0.0] * 4 + [1.0] * 4
        assert all(t.turns == 3 and t.turn_starts is None for t in trajectories)
        assert count_calls(engine, "Judge the response.") == 16 and count_calls(engine, "Summarise this page") == 16
        assert sum(len(call) for call in engine.calls) == 16 * 5
        answer = tokens(tokenizer, "<answer>42</answer>")
        assert trajectories[0].token_ids[-len(answer):] == answer
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 32 and {entry["max_tokens"] for entry in seen} == {2048}
    assert len({entry["server_url"] for entry in seen}) == 2  # one per worker, kept from its first episode


def test_the_turn_limit_ends_a_research_episode_scored(server, tokenizer, load):
    """A policy that never answers: at rollout.max_turns its next /generate is answered as an aborted one, the
    file returns, and the episode ends scored (the env's reward for that state: 0), its last observation
    trimmed; the summariser's completions did not count as turns."""
    engine = ScriptedEngine(tokenizer, researcher)
    research = load(os.path.join(ENVS, "rl2_research_style.py"), workers=1)
    prompts = [{"row": {"prompt": "Where do the loops end?", "answer": "42"}}]
    trajectories = roll(server, engine, tokenizer, research, prompts, max_requests=2, responses_per_prompt=3)
    visit = tokens(tokenizer, '<tool_call>\n{"name": "visit", "arguments": {"url": ["box.example"], '
                              '"goal": "the code"}}\n</tool_call>')
    for trajectory in trajectories:
        assert not trajectory.errors and trajectory.reward == 0.0 and trajectory.turns == 2
        assert trajectory.token_ids[-len(visit):] == visit and sum(trajectory.action_mask) == 2 * len(visit)
    assert count_calls(engine, "Summarise this page") == 6 and count_calls(engine, "Judge the response.") == 0


@pytest.mark.parametrize("fresh", [False, True], ids=["extends", "new-sequence"])
def test_the_turn_limit_keeps_the_last_env_step_reward(server, tokenizer, tmp_path, load, fresh):
    """An episode cut at rollout.max_turns=2 is done and scored as the env left it: the sequence up to the last
    action (the observation after it trimmed), its reward the last env_step's; with fresh prompts each
    sequence keeps its own and the new one, with no action yet, is dropped."""
    engine = ScriptedEngine(tokenizer, lambda text: "maybe")
    (trajectory,) = roll(server, engine, tokenizer, load(write(tmp_path, "endless", ENDLESS)),
                         [prompt(tokenizer, "Guess.", fresh=fresh)], max_requests=2)
    maybe = tokens(tokenizer, "maybe")
    assert not trajectory.errors and trajectory.turns == 2 and trajectory.token_ids[-len(maybe):] == maybe
    assert trajectory.reward == (-1.0 if fresh else -0.5)
    assert (trajectory.turn_starts is not None) == fresh and sum(trajectory.action_mask) == 2 * len(maybe)


def test_a_worker_that_hangs_or_crashes_costs_its_share(server, tokenizer, tmp_path, load, monkeypatch):
    """A worker whose loop a sync call blocks is killed past the timeout, one that dies is noticed: their
    trajectories get errors naming the file and what happened, the other worker's are scored, and the pool's
    fresh workers serve the next rollout. An async episode past the timeout costs itself alone."""
    # The grace is the margin between the episodes' own deadline (the slow episode's, answered by its worker)
    # and the pool's kill. It must hold while the crashed worker's replacement imports the env file beside the
    # slow episode's worker: at 1 s, a loaded 2-core CI machine once starved that worker past it (its loop
    # judged blocked, its answer lost).
    monkeypatch.setattr(rl2_head_workers, "GRACE", 5.0)
    engine = ScriptedEngine(tokenizer, lambda text: "done")
    path = write(tmp_path, "misbehaving", MISBEHAVING)
    file = load(path, workers=2)

    def rollout(*kinds):
        return roll(server, engine, tokenizer, file, [prompt(tokenizer, kind, kind=kind) for kind in kinds], timeout=2)

    ok, blocked = rollout("ok", "block")
    assert ok.reward == 1.0 and not ok.errors
    assert blocked.reward is None and path in blocked.errors[0] and "did not answer within 2 s" in blocked.errors[0]
    slow, crashed = rollout("slow", "crash")
    assert slow.reward is None and "generate did not finish within 2 s" in slow.errors[0]
    assert crashed.reward is None and path in crashed.errors[0] and "exited with code 3" in crashed.errors[0]
    assert [t.reward for t in rollout("ok", "ok")] == [1.0, 1.0]


def test_statuses_and_broken_files(server, tokenizer, tmp_path, load):
    """A generate that raises, or returns before the sample is done, leaves no reward and says so; a file
    with env_step but no generate is refused at start-up naming what RL2 expects, in this process and in the
    workers alike."""
    engine = ScriptedEngine(tokenizer, lambda text: "x")
    broken = load(write(tmp_path, "broken", """
        from RL2.datasets import Sample

        async def generate(config, tokenizer, router_url, sample):
            if sample.sample["kind"] == "raise":
                raise ValueError("no luck")
    """), workers=1)
    raised, early = roll(server, engine, tokenizer, broken, [prompt(tokenizer, "a", kind="raise"),
                                                              prompt(tokenizer, "b", kind="early")])
    assert raised.reward is None and "generate raised" in raised.errors[0] and "ValueError: no luck" in raised.errors[0]
    assert early.reward is None and "returned with the sample running" in early.errors[0]
    path = write(tmp_path, "no_generate", "from RL2.datasets import Sample\n\nasync def env_step(sample):\n    return {}\n")
    for workers in (0, 1):
        with pytest.raises(EnvError, match="defines no generate"):
            load(path, workers=workers)


def test_the_config_is_rl2s_rollout_section():
    """`config` is an OmegaConf DictConfig with the keys of RL2's rollout.train (ppo.yaml at HEAD), from rl2's
    config: OmegaConf.to_container, .get and attribute access work on it as in RL2's files."""
    config = Config()
    config.data.path, config.actor.save_dir, config.data.prompts_per_rollout = "train.jsonl", "/tmp/run", 8
    section = rl2_rollout_config(config.data, config.rollout, config.actor.save_dir,
                                 SamplingParams(temperature=0.7, max_new_tokens=32, stop=["</answer>"]), 4)
    assert OmegaConf.is_config(section) and set(section) == {
        "path", "prompt_key", "messages_key", "apply_chat_template", "prompts_per_rollout", "responses_per_prompt",
        "sampling_params", "dynamic_filtering", "partial_rollout", "save_dir"}
    assert OmegaConf.to_container(section.sampling_params) == {"temperature": 0.7, "max_new_tokens": 32,
                                                               "stop": ["</answer>"]}
    assert (section.path, section.get("responses_per_prompt"), section.save_dir) == ("train.jsonl", 4, "/tmp/run/train")
    test = rl2_rollout_config(config.data, config.rollout, config.actor.save_dir, SamplingParams(), 1, train=False)
    assert test.save_dir == "/tmp/run/test" and not test.dynamic_filtering


def orz_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": str(a + b)}
            for a in range(1, 5) for b in range(1, 5)]


def countdown_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Use {a} {b} to make {a + b}"}], "numbers": [a, b],
             "target": a + b} for a in range(1, 5) for b in range(1, 5)]


TRAINED = {  # file, its rows, the run's extra keys: none of RL2's example scripts gives a turn limit
    "countdown": (None, countdown_rows, []),
    "orz": ("rl2_orz_style.py", orz_rows, []),
    "gem": ("rl2_gem_style.py", lambda: [{"prompt": "play"}] * 8, []),
    "research": ("rl2_research_style.py",
                 lambda: [{"prompt": f"What code is in box {n}?", "answer": "42"} for n in range(8)], []),
    # RL2's searchr1 scripts until Dec 2025 give rollout.train.max_turns=2: a policy that never answers is scored there
    "searchr1": ("rl2_searchr1_style.py",
                 lambda: [{"messages": [{"role": "user", "content": f"Who wrote book {n}?"}], "answer": ["Ann"]}
                          for n in range(8)], ["rollout.train.max_turns=2"]),
}


def test_rl2_head_files_get_rl2s_unbounded_turns_unless_a_limit_is_given(tmp_path):
    """RL2 HEAD's files loop until env_step says done (RL2 has no turn limit; gem.py's pool gets a game back
    only then): without rollout.max_turns such a file gets RL2_HEAD_MAX_TURNS, a bound against a file that never
    ends; a limit given (rl2's key or RL2's rollout.train.max_turns) holds; rl2's own env files keep one turn."""
    from rl2.config import RL2_HEAD_MAX_TURNS, load_config

    gem = os.path.join(ENVS, "rl2_gem_style.py")
    assert load_config([f"rollout.env_path={gem}"]).rollout.max_turns == RL2_HEAD_MAX_TURNS > 8
    assert load_config([f"rollout.env_path={gem}", "rollout.max_turns=3"]).rollout.max_turns == 3
    assert load_config([f"rollout.env_path={gem}", "rollout.train.max_turns=2"]).rollout.max_turns == 2
    assert load_config([f"rollout.env_path={os.path.join(ENVS, 'good_sync.py')}"]).rollout.max_turns == 1


@pytest.mark.parametrize("name", list(TRAINED))
def test_grpo_trains_on_an_rl2_head_env_file(tiny_model_dir, tmp_path, name):
    """`rollout.env_path` = an RL2 HEAD file: the PPO trainer runs it unchanged in its env workers, GRPO
    (reinforce, std-normalised) trains two steps, and every trajectory is scored (no env errors)."""
    file, rows, extra = TRAINED[name]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    env = os.path.join(ENVS, file) if file else write(tmp_path, "countdown", COUNTDOWN)
    run_python(["-m", "rl2.trainer.ppo", f"data.path={data}", "data.prompts_per_rollout=4",
                "data.responses_per_prompt=2", f"actor.model_name={tiny_model_dir}", "actor.dtype=float32",
                "actor.gradient_checkpointing=false", f"actor.save_dir={tmp_path / 'run'}", f"rollout.env_path={env}",
                "rollout.dynamic_filtering=false", "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 8}",
                "rollout.env_workers=2", "adv.norm_var=true", "trainer.total_steps=2", "trainer.disable_wandb=true",
                *extra])
    metrics = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [row["step"] for row in metrics] == [1, 2]
    assert all(row["env_errors"] == 0 and row["reward_errors"] == 0 and "actor/loss" in row for row in metrics)
    for step in (1, 2):
        dumped = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / f"step_{step}.jsonl").open()]
        assert len(dumped) == 8 and all(t["reward"] is not None and not t["errors"] for t in dumped)
        if name == "searchr1":  # the tiny policy never writes a tag: every episode is cut at the limit, scored 0
            assert all(t["turns"] == 2 and t["reward"] == 0.0 for t in dumped), [(t["turns"], t["reward"]) for t in dumped]
