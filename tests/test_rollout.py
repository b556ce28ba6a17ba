"""Trajectory assembly: masks, token-exact multi-turn rendering, turn and length limits, env errors."""

import textwrap

import pytest
from transformers import AutoTokenizer

from conftest import tokenize_prompt
from rl2.chat.template import render_chat
from rl2.engines import Generation, SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import assign_rewards, observation_tokens, rollout
from rl2.rollout.rollout_metrics import rollout_metrics, unscored_report
from scripted_engine import ScriptedEngine


ENV = textwrap.dedent(
    """
    import time

    def interact(messages):
        content = messages[-1]["content"]
        if "<tool_call>fail</tool_call>" in content:
            raise RuntimeError("tool crashed")
        if "<tool_call>hang</tool_call>" in content:
            time.sleep(5)
        if "<tool_call>" in content:
            return [{"role": "tool", "content": "result: 42"}]
        return []

    def reward_fn(messages, answer):
        if "bad" in messages[-1]["content"]:
            return "not a number"
        return float(messages[-1]["content"].endswith(str(answer)))
    """
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def env(tmp_path):
    path = tmp_path / "env.py"
    path.write_text(ENV)
    with Env(str(path), timeout=0.5, need_interact=True) as env:
        yield env


def prompt(tokenizer, question="What is 6 x 7?", answer="42"):
    messages = [{"role": "user", "content": question}]
    return {"prompt_ids": tokenize_prompt(messages, tokenizer), "messages": messages, "answer": answer}


def tool_then_answer(text):
    return "The answer is 42" if "result: 42" in text else "Let me compute. <tool_call>calc</tool_call>"


def test_single_turn_masks_and_groups(tokenizer, env):
    engine = ScriptedEngine(tokenizer, lambda text: "The answer is 42")
    prompts = [prompt(tokenizer), prompt(tokenizer, "What is 1 + 2?", "3")]
    trajectories = rollout(engine, env, tokenizer, prompts, 3, SamplingParams(), max_turns=1)
    assert [t.group for t in trajectories] == [0, 0, 0, 1, 1, 1]
    first = trajectories[0]
    n_prompt = len(prompts[0]["prompt_ids"])
    response = tokenizer("The answer is 42", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert first.token_ids == prompts[0]["prompt_ids"] + response
    assert first.action_mask == [0] * n_prompt + [1] * len(response)
    assert first.logprobs == [0.0] * n_prompt + [-0.5] * len(response)
    assert first.messages[-1] == {"role": "assistant", "content": "The answer is 42"}
    assert first.turns == 1 and first.done and not first.truncated
    assign_rewards(env, trajectories)
    assert [t.reward for t in trajectories] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("end", ["eos", "stop"])
def test_multi_turn_is_token_exact(tokenizer, env, end):
    """The trajectory equals a fresh tokenisation of the final conversation, whether a turn ends
    with <|im_end|> (generated) or on a stop string (the template closes the turn)."""
    engine = ScriptedEngine(tokenizer, tool_then_answer, end=end)
    (trajectory,) = rollout(engine, env, tokenizer, [prompt(tokenizer)], 1, SamplingParams(), max_turns=3)
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.turns == 2 and not trajectory.truncated
    full_text = render_chat(trajectory.messages, tokenizer, add_generation_prompt=False)
    full_ids = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    n = len(trajectory.token_ids)
    assert full_ids[:n] == trajectory.token_ids
    # What the template adds after the last generated token: the final newline (and <|im_end|>
    # when the last turn ended on a stop string rather than the end-of-turn token).
    rest = tokenizer.decode(full_ids[n:], skip_special_tokens=False)
    assert rest == ("\n" if end == "eos" else "<|im_end|>\n")

    # Tool tokens (and the template's glue) are never actions; generated tokens are.
    tool_ids = tokenizer("result: 42", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(n) if trajectory.token_ids[i : i + len(tool_ids)] == tool_ids)
    assert trajectory.action_mask[start : start + len(tool_ids)] == [0] * len(tool_ids)
    second_turn_prompt = engine.calls[1][0]
    assert trajectory.token_ids[: len(second_turn_prompt)] == second_turn_prompt
    generated = [tok for tok, mask in zip(trajectory.token_ids, trajectory.action_mask) if mask]
    answers = tokenizer(["Let me compute. <tool_call>calc</tool_call>", "The answer is 42"], add_special_tokens=False)
    eos = [tokenizer.eos_token_id] if end == "eos" else []
    assert generated == answers["input_ids"][0] + eos + answers["input_ids"][1] + eos


def test_observation_tokens_fallback_when_text_differs(tokenizer):
    """A trajectory whose decoded text differs from the template's rendering (here: the message
    content was rewritten) still gets the template's glue and tool message."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Calling."}]
    so_far = tokenize_prompt(messages[:1], tokenizer) + tokenizer("Calling!", add_special_tokens=False)["input_ids"]
    so_far.append(tokenizer.eos_token_id)
    tokens = observation_tokens(tokenizer, so_far, messages, [{"role": "tool", "content": "ok"}])
    assert tokenizer.decode(tokens, skip_special_tokens=False) == "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"


def test_max_turns_stops_a_tool_loop(tokenizer, env):
    engine = ScriptedEngine(tokenizer, lambda text: "<tool_call>again</tool_call>")
    (trajectory,) = rollout(engine, env, tokenizer, [prompt(tokenizer)], 1, SamplingParams(), max_turns=3)
    assert trajectory.turns == 3 and len(engine.calls) == 3
    assert [m["role"] for m in trajectory.messages] == ["user"] + ["assistant", "tool"] * 2 + ["assistant"]


def test_no_tool_call_ends_the_episode(tokenizer, env):
    engine = ScriptedEngine(tokenizer, lambda text: "The answer is 42")
    (trajectory,) = rollout(engine, env, tokenizer, [prompt(tokenizer)], 1, SamplingParams(), max_turns=5)
    assert trajectory.turns == 1 and len(engine.calls) == 1


def test_length_limit_truncates_and_flags(tokenizer, env):
    engine = ScriptedEngine(tokenizer, tool_then_answer)
    p = prompt(tokenizer)
    limit = len(p["prompt_ids"]) + 5
    (trajectory,) = rollout(engine, env, tokenizer, [p], 1, SamplingParams(), max_turns=3, max_length=limit)
    assert trajectory.truncated and trajectory.done
    assert len(trajectory.token_ids) == limit == len(trajectory.action_mask) == len(trajectory.logprobs)
    assert engine.calls and trajectory.turns == 1

    # A tool answer that leaves no room to reply also ends the episode at the limit.
    first_turn = len(p["prompt_ids"]) + len(tokenizer("Let me compute. <tool_call>calc</tool_call>")["input_ids"]) + 1
    (trajectory,) = rollout(
        ScriptedEngine(tokenizer, tool_then_answer), env, tokenizer, [p], 1, SamplingParams(), 3, first_turn + 3
    )
    assert trajectory.truncated and trajectory.turns == 1 and len(trajectory.token_ids) == first_turn + 3
    assert trajectory.action_mask[first_turn:] == [0, 0, 0]


def test_max_new_tokens_is_flagged(tokenizer, env):
    engine = ScriptedEngine(tokenizer, lambda text: "The answer is 42 and more words follow")
    (trajectory,) = rollout(engine, env, tokenizer, [prompt(tokenizer)], 1, SamplingParams(max_new_tokens=4))
    assert trajectory.truncated and trajectory.response_length == 4


@pytest.mark.parametrize("call", ["fail", "hang"])
def test_env_errors_end_the_trajectory_and_are_kept(tokenizer, env, call):
    engine = ScriptedEngine(tokenizer, lambda text: f"<tool_call>{call}</tool_call>")
    good = ScriptedEngine(tokenizer, tool_then_answer)
    (broken,) = rollout(engine, env, tokenizer, [prompt(tokenizer)], 1, SamplingParams(), max_turns=3)
    assert broken.done and broken.turns == 1 and len(broken.errors) == 1
    assert ("raised RuntimeError" if call == "fail" else "timed out") in broken.errors[0]
    (fine,) = rollout(good, env, tokenizer, [prompt(tokenizer)], 1, SamplingParams(), max_turns=3)
    assert fine.errors == [] and fine.turns == 2


def test_reward_errors_leave_the_trajectory_unscored_and_excluded(tokenizer, env):
    """A failed reward_fn is "could not score", not a reward of 0: no reward, and out of training."""
    engine = ScriptedEngine(tokenizer, lambda text: "bad answer 42")
    trajectories = rollout(engine, env, tokenizer, [prompt(tokenizer)], 2, SamplingParams())
    assign_rewards(env, trajectories)
    assert [t.reward for t in trajectories] == [None, None]
    assert all(t.excluded and "expected a number" in t.errors[0] for t in trajectories)
    assert all(t.to_json()["reward"] is None for t in trajectories)


def test_a_trajectory_whose_interact_failed_is_not_scored(tokenizer, env):
    """An episode cut short by a failed tool is no outcome of the policy's: reward_fn is not called for
    it, its reward stays null, and a rollout of nothing else has no reward statistics (not the reward
    its cut conversation would have had: this one ends with "42", which reward_fn scores 1.0)."""
    engine = ScriptedEngine(tokenizer, lambda text: "42 <tool_call>fail</tool_call>")
    trajectories = rollout(engine, env, tokenizer, [prompt(tokenizer, answer="</tool_call>")], 2, SamplingParams(),
                           max_turns=3)
    assign_rewards(env, trajectories)
    assert [t.reward for t in trajectories] == [None, None] and all(t.excluded for t in trajectories)
    assert all(len(t.errors) == 1 and "raised RuntimeError" in t.errors[0] for t in trajectories)  # no reward error
    metrics = rollout_metrics(trajectories)
    assert "reward/mean" not in metrics and metrics["excluded"] == 2 == metrics["env_errors"]
    assert "no trajectory could be scored" in unscored_report(trajectories, "env.py")
    assert "tool crashed" in unscored_report(trajectories, "env.py")


def test_lockstep_engine_is_called_every_turn(tokenizer, env):
    """An engine shared by a group of ranks gets a call every turn, empty once this rank's
    trajectories are done (the others may still be taking turns); a plain engine does not."""
    for lockstep, expected in [(True, [2, 0, 0]), (False, [2])]:
        engine = ScriptedEngine(tokenizer, lambda text: "The answer is 42")
        engine.lockstep = lockstep
        rollout(engine, env, tokenizer, [prompt(tokenizer)], 2, SamplingParams(), max_turns=3)
        assert [len(call) for call in engine.calls] == expected
        engine.calls.clear()
        rollout(engine, env, tokenizer, [], 2, SamplingParams(), max_turns=3)  # no prompts on this rank
        assert [len(call) for call in engine.calls] == ([0, 0, 0] if lockstep else [])


def test_aborted_generation_ends_the_trajectory_with_its_reason(tokenizer, env):
    class Aborting(ScriptedEngine):
        def generate(self, prompts, params):
            return [Generation([5, 6], [-1.0, -1.0], "abort", "SGLang aborted the request: too long") for _ in prompts]

    trajectory = rollout(Aborting(tokenizer, None), env, tokenizer, [prompt(tokenizer)], 1, SamplingParams(), max_turns=3)[0]
    assert trajectory.done and trajectory.turns == 1 and trajectory.response_length == 2
    assert trajectory.errors == ["SGLang aborted the request: too long"]


TOOL_ENV = textwrap.dedent(
    """
    import time, zlib

    def interact(messages):
        # Tools that take different times: the trajectories' turns interleave in the engine.
        time.sleep(0.002 * (zlib.crc32(messages[-1]["content"].encode()) % 20))
        return [{"role": "tool", "content": f"call {len(messages)}"}]

    def reward_fn(messages, answer):
        return 0.0
    """
)


def test_interleaved_turns_equal_turn_by_turn_rollouts(tokenizer, peaked_model_dir, tmp_path):
    """With the hf engine the next turn of a trajectory starts as soon as its tool answers; greedy,
    the trajectories (tokens, masks, log-probs, messages, truncation) equal the turn-by-turn ones."""
    from rl2.engines import Engine, HFEngine

    class TurnByTurn(HFEngine):
        def generate_turns(self, *args):
            return Engine.generate_turns(self, *args)

    path = tmp_path / "tools.py"
    path.write_text(TOOL_ENV)
    # Greedy, the peaked model stops on these ids after a few tokens or runs to max_new_tokens.
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=[135, 189, 194, 874])
    prompts = [prompt(tokenizer, f"question {i}" + " more" * (3 * i)) for i in range(5)]
    runs, engines = [], []
    with Env(str(path), need_interact=True) as env:
        for engine_class in (HFEngine, TurnByTurn):
            engines.append(engine_class(peaked_model_dir, tokenizer, "cpu", max_batch_size=4))
            runs.append(rollout(engines[-1], env, tokenizer, prompts, 2, params, max_turns=3, max_length=120))
    interleaved, turn_by_turn = runs
    assert engines[0].stats["next_turns"] > 0 and engines[1].stats["next_turns"] == 0
    assert {t.truncated for t in interleaved} == {True, False} and {t.turns for t in interleaved} == {2, 3}
    for got, want in zip(interleaved, turn_by_turn):
        assert got.token_ids == want.token_ids and got.action_mask == want.action_mask
        assert got.messages == want.messages and got.turns == want.turns and got.truncated == want.truncated
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5
        assert len(got.token_ids) <= 120
