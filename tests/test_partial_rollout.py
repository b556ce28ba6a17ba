"""Partial rollout (`rl2.rollout.partial`): trajectories paused when a step has its groups continue where they
stood, token for token, with the behaviour log-probs and policy version of every token; groups train whole;
none waits more than `rollout.partial_max_age` steps; the carried-over groups survive a checkpoint."""

import json
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from conftest import counting_prompts as prompts
from rl2.engines import Engine, Generation, HFEngine, SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import _turn, rollout
from rl2.rollout.partial import PartialRollout

CPU = torch.device("cpu")
GROUP = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def service(engine, env, tokenizer, max_turns: int = 1, max_length: int = 4096):
    """What PartialRollout uses of a RolloutService."""
    return SimpleNamespace(engine=engine, env=env, tokenizer=tokenizer, max_length=max_length, tool_calling=None,
                           rollout_config=SimpleNamespace(max_turns=max_turns, trajectory_format="whole"),
                           data_config=SimpleNamespace(apply_chat_template=True))


@pytest.fixture
def reward_env(tmp_path):
    path = tmp_path / "env.py"
    path.write_text("def reward_fn(messages, answer):\n    return float(len(messages[-1]['content']) % 2)\n")
    with Env(str(path), workers=0) as env:
        yield env


def test_paused_trajectories_continue_token_for_token(tiny_model_dir, tokenizer, reward_env):
    """With the weights unchanged between steps, every trajectory that started in step 1 (paused or not) has
    the tokens and behaviour log-probs the same rollout without pauses gives; the tokens drawn in step 1 carry
    version 0, those drawn after the pause version 1; a paused one trains in step 2 (max_age 1). Step 1 stops
    as soon as one group is done (target 1 of 6 in flight)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    engine = HFEngine(tiny_model_dir, tokenizer, CPU, seed=5, max_batch_size=8)
    batch = prompts(tokenizer, 6)
    max_length = max(len(p["prompt_ids"]) for p in batch) + 12  # answers of 12 to ~45 tokens
    engine.reseed(11 * 1_000_003)
    whole = rollout(engine, reward_env, tokenizer, batch, GROUP, params, max_length=max_length)  # never paused

    partial = PartialRollout(service(engine, reward_env, tokenizer, max_length=max_length), target=1, extra=5,
                             max_age=1, responses_per_prompt=GROUP)
    assert partial.prompts_wanted() == 6
    first = partial.generate(batch, params, seed=11, version=0)
    assert len(first) == GROUP and len(partial.carried) == 5
    paused = [t for group in partial.carried for t in group if not t.done]
    drawn_before = {id(t): (list(t.token_ids), list(t.logprobs)) for t in paused}
    assert paused, ("nothing was paused: the test would not test resuming", [(t.group, t.done, len(t.token_ids)) for g in partial.carried for t in g], [len(t.token_ids) for t in first])
    second = partial.generate(prompts(tokenizer, partial.prompts_wanted(), start=100), params, seed=12, version=1)
    started_in_step_1 = [t for t in first + second if t.started == 0]
    assert len(started_in_step_1) == 6 * GROUP  # every group of step 1 trained by step 2 (max_age 1)
    reference = {(t.messages[0]["content"], i % GROUP): t for i, t in enumerate(whole)}
    seen = {}
    for t in started_in_step_1:
        key = t.messages[0]["content"]
        seen[key] = seen.get(key, -1) + 1
        expected = reference[(key, seen[key])]
        assert t.token_ids == expected.token_ids and t.messages == expected.messages
        drawn_first = sum(v == 0 for v in t.versions)
        if id(t) in drawn_before:  # resumed: what it drew before the pause is kept as it was sampled
            tokens, logprobs = drawn_before[id(t)]
            assert t.token_ids[:len(tokens)] == tokens and t.logprobs[:len(logprobs)] == logprobs
            assert t.versions[len(tokens):] == [1] * (len(t.token_ids) - len(tokens))
        # another batch composition (prefill packing) rounds log-probs differently: float32, ~1e-7
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(expected.logprobs), rtol=0, atol=1e-4)
        generated = [v for v, m in zip(t.versions, t.action_mask) if m]
        assert generated == sorted(generated) and set(generated) <= {0, 1} and drawn_first > 0
        assert t.reward is not None
    assert any(1 in t.versions for t in started_in_step_1)  # some were resumed under version 1
    metrics = partial.metrics(second, version=1)
    assert metrics["partial/resumed_ratio"] > 0 and metrics["partial/age_max"] == 1.0


SLOW_TOOL_ENV = """
import os, time, zlib

def interact(messages):
    # a tool whose latency depends on the call: some answer at once, some only once the test releases
    # them (env_args' file exists; 30 s at most)
    if zlib.crc32(messages[-1]["content"].encode()) % 3 == 0:
        start = time.monotonic()
        while not os.path.exists(env_args["release"]) and time.monotonic() - start < 30:
            time.sleep(0.01)
    return [{"role": "tool", "content": "tool says " + str(len(messages))}]

def reward_fn(messages, answer):
    return 1.0
"""


def test_a_trajectory_paused_at_its_tool_calls_it_again_and_goes_on(tiny_model_dir, tokenizer, tmp_path):
    """Multi-turn: a step that has its groups does not wait for a slow tool; the trajectories waiting for it
    call it again in the next step and take their next turn; each conversation has its tool message once."""
    path = tmp_path / "tool_env.py"
    path.write_text(SLOW_TOOL_ENV)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, stop=["e"])  # short turns that end, not cut
    engine = HFEngine(tiny_model_dir, tokenizer, CPU, seed=2, max_batch_size=16)
    release = tmp_path / "release"
    with Env(str(path), workers=0, need_interact=True, timeout=60, args={"release": str(release)}) as env:
        partial = PartialRollout(service(engine, env, tokenizer, max_turns=2), target=2, extra=6, max_age=2,
                                 responses_per_prompt=GROUP)
        start = time.perf_counter()
        first = partial.generate(prompts(tokenizer, 8), params, seed=1, version=0)
        took = time.perf_counter() - start
        release.touch()  # the slow calls answer from now on
        waiting = [t for group in partial.carried for t in group if t.running.stage == "interact" and not t.done]
        assert len(first) >= 2 * GROUP and waiting, "no trajectory was left waiting for its tool"
        assert took < 25, took  # the slow calls (held for 30 s) were not waited for
        trained = first
        for step in range(1, 4):
            trained += partial.generate(prompts(tokenizer, partial.prompts_wanted(), start=100 * step), params,
                                        seed=1 + step, version=step)
    for t in trained:
        assert t.done and t.turns <= 2
        tools = [m for m in t.messages if m["role"] == "tool"]
        assert len(tools) == (1 if t.turns == 2 else 0) or t.truncated
        assert len(t.versions) == len(t.token_ids)


class TickEngine(Engine):
    """A fake engine for the schedule: request i's turn is `length(prompt)` tokens long and takes that
    many ticks of 1 ms; abort() returns the tokens drawn so far."""

    def __init__(self, length):
        self.length, self.aborting = length, threading.Event()

    def generate(self, prompts, params):
        raise NotImplementedError

    def generate_turns(self, turns, params, on_generation, max_turns):
        self.aborting.clear()
        pending = {}
        for index, turn in enumerate(turns):
            turn = turn.result() if hasattr(turn, "result") else turn
            if turn is not None:
                pending[index] = [turn, 0]
        while pending and not self.aborting.is_set():
            time.sleep(0.001)
            for index in list(pending):
                turn, drawn = pending[index]
                pending[index][1] = drawn = drawn + 1
                if turn.offset + drawn >= min(self.length(turn.prompt), turn.offset + turn.max_new_tokens):
                    del pending[index]
                    on_generation(index, Generation([7] * drawn, [-0.1] * drawn, "stop", None, (0, index)))
        for index, (turn, drawn) in pending.items():
            on_generation(index, Generation([7] * drawn, [-0.1] * drawn, "abort", "aborted", (0, index)))

    def abort(self):
        self.aborting.set()

    def reseed(self, seed):
        pass

    def update_weights(self, named_tensors, partial=False):
        pass


@pytest.mark.parametrize("seed", range(5))
def test_schedule_properties_with_random_lengths(tokenizer, reward_env, seed):
    """Random answer lengths (a long tail): every step trains at least its target of groups, each group whole
    and done; no group trains more than max_age steps after it began; no trajectory is lost or trained twice."""
    rng = random.Random(seed)
    lengths = {}

    def length(prompt):
        key = tuple(prompt[:len(prompt) - sum(1 for token in reversed(prompt) if token == 7)])
        if key not in lengths:
            lengths[key] = rng.choice([2, 3, 4, 5, 60, 200])
        return lengths[key]

    target, extra, max_age = 3, 3, 2
    partial = PartialRollout(service(TickEngine(length), reward_env, tokenizer), target, extra, max_age, GROUP)
    trained_ids = []
    for step in range(8):
        batch = prompts(tokenizer, partial.prompts_wanted(), start=1000 * step)
        trained = partial.generate(batch, SamplingParams(max_new_tokens=400), seed=step, version=step)
        groups = [trained[i:i + GROUP] for i in range(0, len(trained), GROUP)]
        assert len(groups) >= target
        for group in groups:
            assert all(t.done for t in group) and len({t.group for t in group}) == 1
            assert step - group[0].started <= max_age
        trained_ids += [t.group for t in trained[::GROUP]]
        in_flight = len(partial.carried) + len(groups)
        assert in_flight == target + extra  # nothing lost
    assert len(trained_ids) == len(set(trained_ids))  # nothing trained twice


def test_the_carried_groups_survive_a_checkpoint(tokenizer, reward_env):
    partial = PartialRollout(service(TickEngine(lambda prompt: 50 if len(prompt) % 2 else 3), reward_env, tokenizer),
                             2, 4, 3, GROUP)
    partial.generate(prompts(tokenizer, 6), SamplingParams(max_new_tokens=100), seed=0, version=0)
    assert partial.carried
    state = json.loads(json.dumps(partial.state_dict()))  # as trainer_state.json holds it
    restored = PartialRollout(partial.service, 2, 4, 3, GROUP)
    restored.load_state_dict(state)
    assert restored.next_group == partial.next_group and restored.carried == partial.carried


def test_a_checkpoint_from_before_the_running_state_loads(tokenizer, reward_env):
    """Checkpoints written before `Trajectory.running` hold its fields in the trajectory's own (`turn_start` for
    `generating_from`): their carried groups load as they stood, and a trajectory paused inside its turn goes on
    from the same token, random stream and room."""
    batch = prompts(tokenizer, 6)
    short = sorted(len(p["prompt_ids"]) for p in batch)[1]  # the two shortest prompts answer at once
    partial = PartialRollout(service(TickEngine(lambda prompt: 3 if len(prompt) <= short else 2000), reward_env,
                                     tokenizer), 2, 4, 3, GROUP)
    params = SamplingParams(max_new_tokens=3000)
    partial.generate(batch, params, seed=0, version=0)
    state = json.loads(json.dumps(partial.state_dict()))
    old = {"next_group": state["next_group"], "carried": [[flat(t) for t in group] for group in state["carried"]]}
    assert any(t["turn_start"] >= 0 and t["stream"] is not None for group in old["carried"] for t in group)
    restored = PartialRollout(partial.service, 2, 4, 3, GROUP)
    restored.load_state_dict(old)
    assert restored.next_group == partial.next_group and restored.carried == partial.carried
    for before, after in zip([t for g in partial.carried for t in g], [t for g in restored.carried for t in g]):
        if not before.done:
            assert _turn(after, params, 4096) == _turn(before, params, 4096)


def flat(fields: dict) -> dict:
    """A trajectory's checkpoint fields as they were before `running`: its fields among the trajectory's."""
    fields = dict(fields)
    running = fields.pop("running")
    return {**fields, **{("turn_start" if name == "generating_from" else name): value for name, value in running.items()}}
