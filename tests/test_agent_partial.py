"""Partial rollout with agent files (`rl2.rollout.agent_partial`): the agents still at work when a step has its
groups go on in the next step on the same server; a generation the pause cut keeps its tokens and goes on
from the same random stream, each token with the version that drew it; requests made between steps wait
and are answered under the new weights; groups train whole; a checkpoint restarts the groups in flight."""

import concurrent.futures
import json
import textwrap
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from conftest import counting_prompts as prompts
from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import HFEngine, SamplingParams
from rl2.rollout.agent_partial import AgentPartialRollout
from rl2.rollout.agent_rollout import AgentFile, agent_rollout
from rl2.serve.openai_server import OpenAIServer

pytest.importorskip("openai")
CPU = torch.device("cpu")
GROUP = 2

AGENT = """
import asyncio

async def run(row, client):
    messages = list(row["messages"])
    for request in range(REQUESTS):
        if request:
            messages.append({"role": "user", "content": "Go on."})
        short = {"max_tokens": SHORT} if SHORT and row["answer"] == "0" else {}
        reply = await client.chat.completions.create(model="rl2", messages=messages, **short)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        await asyncio.sleep(0)
    return float(len(messages[-1]["content"]) % 2)
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def server(tokenizer):
    """A server of each test's own: closing it ends the agents its partial rollouts left in flight, on its loop
    (a server shared with the next test kept them, and their clients, once dropped, closed their sockets
    from the collecting thread, under the loop's feet: a later request on a reused fd was never read)."""
    server = OpenAIServer(tokenizer)
    yield server
    server.close()


def agent(tmp_path, requests: int, short_first: int = 0) -> AgentFile:
    """The agent of `requests` requests; with `short_first`, the first row's answers are that many tokens."""
    path = tmp_path / f"agent_{requests}_{short_first}.py"
    path.write_text(textwrap.dedent(AGENT).replace("REQUESTS", str(requests)).replace("SHORT", str(short_first)))
    return AgentFile(str(path))


class HoldsAfterShortAnswers(HFEngine):
    """Once `hold_after` answers of at most `short` tokens are done (the first group's), decoding stops until the
    rollout aborts it: the other answers, all longer, are then surely cut by the pause, however slowly the
    server's loop runs on a loaded machine (without this, every answer could end before the pause landed).
    Decoding also starts only once every agent has made its request: on a loaded machine the first group's
    answers could otherwise end before the other agents' requests arrived, and a request the pause finds not
    yet begun is drawn in the next call, from that call's random stream."""

    hold_after = 0
    short = 0

    def generate_turns(self, turns, params, on_generation, max_turns):
        if self.hold_after:
            requests = [turn for turn in turns if isinstance(turn, concurrent.futures.Future)]
            _, late = concurrent.futures.wait(requests, timeout=60)
            assert not late, f"{len(late)} agents never made their request"
        done_short = 0

        def held(index, generation):
            nonlocal done_short
            upcoming = on_generation(index, generation)
            if generation.finish_reason != "abort" and len(generation.token_ids) <= self.short:
                done_short += 1
                if done_short == self.hold_after:
                    assert self.aborting.wait(60), "the rollout never paused"
            return upcoming

        super().generate_turns(turns, params, held, max_turns)


def service(server, engine, tokenizer, agent_file, max_length: int, max_turns: int):
    """What AgentPartialRollout uses of a RolloutService."""
    rollout = SimpleNamespace(agent_timeout=60.0, max_turns=max_turns, tool_parser="hermes", agent_sequences="merge")
    return SimpleNamespace(engine=engine, env=None, tokenizer=tokenizer, server=server, agent=agent_file,
                           max_length=max_length, rollout_config=rollout)


def test_paused_agents_continue_token_for_token(tiny_model_dir, tokenizer, server, tmp_path):
    """One request per agent, weights unchanged between steps: every trajectory of step 1's prompts has the
    tokens and log-probs of the same rollout without pauses; those drawn after the pause carry version 1;
    step 1 stops once one group is done (target 1 of 6: the first, whose answers are short), and the rest train
    in step 2 (max_age 1)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    engine = HoldsAfterShortAnswers(tiny_model_dir, tokenizer, CPU, seed=5, max_batch_size=12)
    batch = prompts(tokenizer, 6)
    max_length = max(len(p["prompt_ids"]) for p in batch) + 12  # answers of 12 to ~45 tokens
    one_request = agent(tmp_path, 1, short_first=3)
    engine.reseed(11 * 1_000_003)
    whole = agent_rollout(server, engine, one_request, tokenizer, get_tool_parser("hermes"), batch, GROUP, params, 1,
                          max_length)

    assert all(sum(t.action_mask) > 3 for t in whole[GROUP:])  # only the first group's answers are short
    engine.hold_after, engine.short = GROUP, 3
    partial = AgentPartialRollout(service(server, engine, tokenizer, one_request, max_length, 1), target=1, extra=5,
                                  max_age=1, responses_per_prompt=GROUP)
    assert partial.prompts_wanted() == 6
    first = partial.generate(batch, params, seed=11, version=0)
    assert len(first) == GROUP and len(partial.carried) == 5
    assert partial.prompts_wanted() == 1
    second = partial.generate(prompts(tokenizer, 1, start=100), params, seed=12, version=1)
    started_in_step_1 = [t for t in first + second if t.started == 0]
    assert len(started_in_step_1) == 6 * GROUP
    reference = {(t.group, i % GROUP): t for i, t in enumerate(whole)}
    resumed = 0
    for i, t in enumerate(sorted(started_in_step_1, key=lambda t: t.group)):
        expected = reference[(t.group, i % GROUP)]
        assert t.token_ids == expected.token_ids and t.messages == expected.messages
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(expected.logprobs), rtol=0, atol=1e-4)
        generated = [v for v, m in zip(t.versions, t.action_mask) if m]
        assert generated == sorted(generated) and set(generated) <= {0, 1}
        resumed += 1 in generated and 0 in generated
        assert t.reward is not None and not t.errors
    assert resumed == (6 - 1) * GROUP  # every answer but the first group's was cut (the engine held for the pause)
    metrics = partial.metrics(second, version=1)
    assert metrics["partial/resumed_ratio"] > 0 and metrics["partial/age_max"] == 1.0


def test_requests_made_between_steps_wait_for_the_new_weights(tiny_model_dir, tokenizer, server, tmp_path):
    """Agents of three requests: those still at work when step 1 has its group go on, their next requests
    answered in step 2 under version 1; every trajectory stays one exact sequence (the later requests
    continue the sampled ids) whose tokens' versions never go back; every group trains whole, by step 3."""
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    engine = HFEngine(tiny_model_dir, tokenizer, CPU, seed=7, max_batch_size=4)
    batch = prompts(tokenizer, 4)
    partial = AgentPartialRollout(service(server, engine, tokenizer, agent(tmp_path, 3), 4096, 3), target=1,
                                  extra=3, max_age=2, responses_per_prompt=GROUP)
    trained = []
    for version in range(3):
        wanted = partial.prompts_wanted()
        trained += partial.generate(prompts(tokenizer, wanted, start=10 * version) if version else batch[:wanted],
                                    params, seed=version, version=version)
    from_step_1 = [t for t in trained if t.started == 0]
    assert len(from_step_1) == 4 * GROUP  # max_age 2: every group of step 1 trained by step 3
    assert {t.group for t in from_step_1} == {0, 1, 2, 3}
    spans = 0
    for t in from_step_1:
        assert t.turns == 3 and t.turn_starts is None and not t.errors and t.reward is not None
        assert t.agent_stats["reused_tokens"] > 0 and t.agent_stats["drift_requests"] == 0
        generated = [v for v, m in zip(t.versions, t.action_mask) if m]
        assert generated == sorted(generated)
        spans += len(set(generated)) > 1
    assert spans > 0, "no agent went on across a step"
    assert all(len([t for t in trained if t.group == g]) == GROUP for g in {t.group for t in trained})


def test_a_resumed_run_replays_its_agents_and_goes_on_exactly(tiny_model_dir, tokenizer, server, tmp_path):
    """From one checkpoint after step 1 (answers cut by the pause): the run that went on, and a fresh server and
    engine that load the checkpoint, whose agents start again and are answered from their slots' logs, train
    the same step 2: the same tokens, log-probs and versions (the cut answers finished from their streams)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    batch = prompts(tokenizer, 6)
    max_length = max(len(p["prompt_ids"]) for p in batch) + 12
    one_request = agent(tmp_path, 1, short_first=3)

    def run(on_server):
        engine = HoldsAfterShortAnswers(tiny_model_dir, tokenizer, CPU, seed=5, max_batch_size=12)
        engine.hold_after, engine.short = GROUP, 3
        return AgentPartialRollout(service(on_server, engine, tokenizer, one_request, max_length, 1), target=1,
                                   extra=5, max_age=1, responses_per_prompt=GROUP)

    went_on = run(server)
    went_on.generate(batch, params, seed=11, version=0)
    state = json.loads(json.dumps(went_on.state_dict()))  # as the checkpoint's trainer_state.json keeps it
    saved = [slot for group in state["groups_by_rank"][0] for slot in group["slots"]]
    assert len(state["groups_by_rank"][0]) == 5 and sum(slot["cut"] is not None for slot in saved) == 10
    expected = went_on.generate([], params, seed=12, version=1)

    other_server = OpenAIServer(tokenizer)
    try:
        resumed = run(other_server)
        resumed.load_state_dict(state)
        assert resumed.prompts_wanted() == 1  # 5 in flight of 6 (the dataset gives none here, as at its end)
        trained = resumed.generate([], params, seed=12, version=1)
        assert resumed.metrics(trained, 1)["partial/replay_mismatches"] == 0
    finally:
        other_server.close()
    assert len(trained) == len(expected) == 5 * GROUP
    for got, want in zip(sorted(trained, key=lambda t: t.group), sorted(expected, key=lambda t: t.group)):
        assert (got.group, got.started, got.token_ids, got.versions) == (want.group, want.started, want.token_ids,
                                                                         want.versions)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
        assert 0 in got.versions and 1 in got.versions


def test_a_checkpoint_of_another_world_size_restarts_the_groups_in_flight(tiny_model_dir, tokenizer, server,
                                                                          tmp_path):
    """Groups in flight on ranks this run does not have: their agents start again from their prompts, and the
    run takes that many fewer new prompts."""
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    engine = HFEngine(tiny_model_dir, tokenizer, CPU, seed=3, max_batch_size=4)
    make = lambda: AgentPartialRollout(service(server, engine, tokenizer, agent(tmp_path, 2), 4096, 2), target=1,
                                       extra=3, max_age=2, responses_per_prompt=GROUP)
    partial = make()
    partial.prompts_wanted()
    partial.generate(prompts(tokenizer, 4), params, seed=0, version=0)
    state = partial.state_dict()
    assert len(state["groups_by_rank"][0]) == len(partial.carried) == 3 and state["next_group"] == 4
    carried_questions = [g.prompt["messages"][0]["content"] for g in partial.carried]
    state["groups_by_rank"] = [state["groups_by_rank"][0][:2], state["groups_by_rank"][0][2:]]  # as 2 ranks had

    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.prompts_wanted() == 1
    trained = resumed.generate(prompts(tokenizer, 1, start=50), params, seed=1, version=1)
    in_flight = [g.prompt["messages"][0]["content"] for g in resumed.carried]
    questions = {t.messages[0]["content"] for t in trained} | set(in_flight)
    assert set(carried_questions) <= questions and len(questions) == 4
    assert all(t.started == 1 and 0 not in t.versions for t in trained)
