"""MoE and hybrid models under rl2's workers: packed rows through `Policy` (FSDP2, gloo) against plain
transformers forwards of each sequence alone, on tiny models built offline, in fp32 on CPU."""

import pytest

from conftest import run_python, run_torchrun
from rl2.testing.tiny_moe import save_tiny_moe

HYBRID_POLICY = """
import sys, torch
from transformers import AutoModelForCausalLM
from rl2.workers.policy import Policy, token_logps
from rl2.config import ModelConfig
from rl2.distributed.process_group import init_distributed, rank
init_distributed()
folder = sys.argv[1]
config = ModelConfig(model_name=folder, dtype="float32", max_length_per_device=256, lr=1e-3, gradient_checkpointing=False)
actor = Policy(config, total_steps=1)
generator = torch.Generator().manual_seed(2)
lengths = (5, 70, 17, 17, 30)
sequences = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator), "loss_mask": torch.ones(n),
              "loss_weight": torch.full((n,), 1.0 / sum(lengths))} for n in lengths]
ours = actor.compute(sequences)
plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
expected, loss = [], 0.0
for seq in sequences:
    ids = seq["input_ids"].unsqueeze(0)
    logps = token_logps(plain(input_ids=ids, use_cache=False).logits, ids, torch.arange(ids.shape[1]).unsqueeze(0))[0]
    expected.append(logps.detach())
    loss = loss - (logps * seq["loss_weight"]).sum()
loss.backward()
worst = max((got - want).abs().max().item() for got, want in zip(ours, expected))

def loss_fn(outputs, row):
    return -(outputs["logps"] * row["loss_weight"]).sum(), {}

actor.accumulate_gradients(sequences, loss_fn)
plain_grads = dict(plain.named_parameters())
grad_worst = 0.0
for name, parameter in actor.model.named_parameters():
    grad = parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad
    grad_worst = max(grad_worst, (grad - plain_grads[name].grad).abs().max().item())
if rank() == 0:
    print("logps_difference", worst, "grad_difference", grad_worst)
"""


@pytest.fixture(scope="module")
def tiny_hybrid_dir(tmp_path_factory):
    return save_tiny_moe(str(tmp_path_factory.mktemp("tiny_qwen3_5")), "qwen3_5")


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_hybrid_policy_on_packed_rows_gives_each_sequences_logps_and_gradients_alone(tiny_hybrid_dir, nproc):
    """Qwen3.5 (gated delta-nets beside full attention) under `Policy`: its packed rows' log-probs and the
    gradients of a loss over them equal plain transformers forwards of each sequence alone."""
    args = ["-c", HYBRID_POLICY, tiny_hybrid_dir]
    result = run_python(args) if nproc == 1 else run_torchrun(args, nproc=nproc)
    logps, grads = result.stdout.split("logps_difference")[-1].split()[0::2]
    assert float(logps) < 1e-5 and float(grads) < 1e-5, result.stdout


MOE_REPLAY = """
import sys, torch
from transformers import AutoModelForCausalLM
from rl2.workers.policy import Policy, token_logps
from rl2.config import ActorConfig
from rl2.distributed.process_group import init_distributed, rank
from rl2.models.routing_replay import RoutingReplay
init_distributed()
folder, coef = sys.argv[1], float(sys.argv[2])
config = ActorConfig(model_name=folder, dtype="float32", max_length_per_device=96, lr=3e-2, warmup_ratio=0.0,
                     gradient_checkpointing=False, router_replay="r2", moe_aux_loss_coef=coef)
actor = Policy(config, total_steps=4)
generator = torch.Generator().manual_seed(3)
lengths = (9, 40, 17, 17, 30, 6)
sequences = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator), "loss_mask": torch.ones(n),
              "loss_weight": torch.full((n,), 1.0 / sum(lengths)), "metric_weight": torch.full((n,), 1.0 / sum(lengths))}
             for n in lengths]
logps, routes = actor.compute_with_routes(sequences)
plain_logps = actor.compute(sequences)
replayed = [{**seq, "routes": r} for seq, r in zip(sequences, routes)]

def loss_fn(outputs, row):
    loss = -(outputs["logps"] * row["loss_weight"]).sum()
    metrics = {}
    if "moe_aux_loss" in outputs:
        aux = outputs["moe_aux_loss"] * row["metric_weight"].sum()
        loss, metrics = loss + outputs["moe_aux_loss_coef"] * aux, {"moe_aux_loss": aux.detach()}
    return loss, metrics

before_off = actor.evaluate(sequences, loss_fn)["loss"]
before_replay = actor.evaluate(replayed, loss_fn)["loss"]
unchanged = actor.router_mismatch()
for _ in range(3):
    stepped = actor.train_step(replayed, loss_fn)
trained_mismatch = actor.router_mismatch()
recorded = torch.cat(routes).long()  # [tokens, layers, k]
expected_counts = torch.stack([torch.bincount(recorded[:, layer].flatten(), minlength=8) for layer in range(recorded.shape[1])])
counts_replayed = torch.equal(actor.expert_counts(), 3 * expected_counts)
after = actor.compute(replayed)
after_live = actor.compute(sequences)
changed = actor.router_mismatch()
# the same weights in plain transformers, each sequence alone, its routers replaying the recorded experts
plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
state = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for name, p in actor.model.named_parameters()}
plain.load_state_dict(state, strict=False)
worst_replay, worst_live = 0.0, 0.0
with RoutingReplay(plain) as replay, torch.no_grad():
    for seq, r, got, live in zip(sequences, routes, after, after_live):
        ids = seq["input_ids"].unsqueeze(0)
        replay.replay(r.transpose(0, 1))
        expected = token_logps(plain(input_ids=ids, use_cache=False).logits, ids, torch.arange(ids.shape[1]).unsqueeze(0))[0]
        worst_replay = max(worst_replay, (got - expected).abs().max().item())
        worst_live = max(worst_live, (live - expected).abs().max().item())
if rank() == 0:
    print("RESULT", abs(before_off - before_replay), unchanged, changed, worst_replay, worst_live,
          (torch.cat(logps) - torch.cat(plain_logps)).abs().max().item(), stepped.get("moe_aux_loss", -1.0),
          routes[0].dtype, tuple(routes[1].shape), counts_replayed)
"""


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    return save_tiny_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), "qwen3_moe")


@pytest.mark.parametrize("nproc", [1, 2])
def test_r2_replays_the_old_logprob_forwards_experts_in_the_update(tiny_moe_dir, nproc):
    """`actor.router_replay=r2` on a tiny Qwen3-MoE policy: the recording forward's log-probs are `compute`'s; with
    unchanged weights the replayed loss equals the unreplayed one and no decision changes; after updates the
    replayed forward equals plain transformers replaying the recorded experts (and differs from routing live),
    and `router_mismatch` counts the decisions the trained routers would change."""
    args = ["-c", MOE_REPLAY, tiny_moe_dir, "0.01"]
    result = run_python(args) if nproc == 1 else run_torchrun(args, nproc=nproc)
    fields = result.stdout.split("RESULT")[-1].split()
    same_loss, unchanged, changed, replay_diff, live_diff, record_diff, aux = map(float, fields[:7])
    assert same_loss < 1e-6 and unchanged == 0.0 and record_diff < 1e-6, result.stdout
    assert changed > 0.0, result.stdout  # the updates moved the routers off the recorded experts
    assert replay_diff < 1e-5, result.stdout  # the replayed forward used the recorded experts
    assert live_diff > 1e-3, result.stdout  # routing live would have given other log-probs (a mutant that recomputes fails)
    assert aux > 0.0, result.stdout  # the load-balancing loss is in the trained loss
    assert fields[7] == "torch.int8" and fields[8:11] == ["(40,", "2,", "2)"], fields
    assert fields[11] == "True", fields  # the updates' expert counts are the replayed routes' (3 updates)


EXPERT_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
from rl2.workers.policy import Policy
from rl2.config import ActorConfig
from rl2.distributed.process_group import init_distributed, rank
from rl2.models.expert_load import load_max
from rl2.models.routing_replay import RoutingReplay
init_distributed()
folder = sys.argv[1]
config = ActorConfig(model_name=folder, dtype="float32", max_length_per_device=96, lr=1e-3, warmup_ratio=0.0,
                     gradient_checkpointing=True, router_replay="off")
actor = Policy(config, total_steps=2)
generator = torch.Generator().manual_seed(4)
lengths = (9, 40, 17, 23, 30, 6)
sequences = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator), "loss_mask": torch.ones(n),
              "loss_weight": torch.full((n,), 1.0 / sum(lengths))} for n in lengths]
others = [{**seq, "input_ids": torch.randint(0, 1000, (len(seq["input_ids"]),), generator=generator)} for seq in sequences]
none_yet = actor.expert_counts()
actor.compute(others)  # an inference forward: not counted
actor.train_step(sequences, lambda outputs, row: (-(outputs["logps"] * row["loss_weight"]).sum(), {}))
counts = actor.expert_counts()
after = actor.expert_counts()  # taken: none since
# the hand count: a plain transformers forward of each sequence alone, its routes recorded
plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
with RoutingReplay(plain) as replay, torch.no_grad():
    routes = []
    for seq in sequences:
        replay.record()
        plain(input_ids=seq["input_ids"].unsqueeze(0), use_cache=False)
        routes.append(replay.routes().long())
routes = torch.cat(routes, dim=1)  # [layers, tokens, k]
expected = torch.stack([torch.bincount(layer.flatten(), minlength=8) for layer in routes])
if rank() == 0:
    print("RESULT", none_yet is None, after is None, torch.equal(counts, expected), int(counts.sum()),
          " ".join(f"{x:.6f}" for x in load_max(counts)), " ".join(f"{x:.6f}" for x in load_max(expected)))
"""


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_expert_counts_of_training_forwards_equal_a_hand_count_of_plain_routes(tiny_moe_dir, nproc):
    """A tiny Qwen3-MoE policy without routing replay (gradient checkpointing on): `expert_counts` after an update
    is each layer's count per expert of the routes plain transformers gives each sequence alone, over all ranks;
    inference forwards and the checkpointed layers' recomputation in backward are not counted, and a call takes
    the counts; `load_max` is the busiest expert's count over the uniform share."""
    args = ["-c", EXPERT_LOAD, tiny_moe_dir]
    result = run_python(args) if nproc == 1 else run_torchrun(args, nproc=nproc)
    fields = result.stdout.split("RESULT")[-1].split()
    assert fields[:3] == ["True", "True", "True"], result.stdout
    assert int(fields[3]) == 2 * 2 * (9 + 40 + 17 + 23 + 30 + 6), fields  # layers x k x tokens
    loads = list(map(float, fields[4:6]))
    assert loads == list(map(float, fields[6:8])) and all(1.0 < load <= 8.0 for load in loads), fields


def test_load_max_is_the_busiest_experts_share_over_the_uniform_one():
    import torch

    from rl2.models.expert_load import load_max

    counts = torch.tensor([[5, 5, 5, 5], [20, 0, 0, 0], [10, 6, 4, 0], [0, 0, 0, 0]])
    assert load_max(counts) == [1.0, 4.0, 2.0, 0.0]


def test_trajectory_routes_survive_a_checkpoint_and_reach_the_sequences_under_r3():
    """`Trajectory.routes` round-trip through `state()` (JSON) exactly, are absent from the state of a trajectory
    without them, and become the sequence's `routes` under r3 only, UNRECORDED after the recorded tokens."""
    import json
    from types import SimpleNamespace

    import torch

    from rl2.models.routing_replay import UNRECORDED
    from rl2.rollout.trajectory import Trajectory
    from rl2.trainer.ppo_stages import route_fields

    routes = torch.randint(-1, 8, (4, 3, 2), dtype=torch.int8)
    trajectory = Trajectory(messages=[], answer=None, group=0, token_ids=[1, 2, 3, 4, 5], action_mask=[0, 0, 1, 1, 1],
                            logprobs=[0.0] * 5, routes=routes)
    restored = Trajectory.from_dict(json.loads(json.dumps(trajectory.state())))
    assert restored.routes.dtype == torch.int8 and torch.equal(restored.routes, routes)
    plain = Trajectory(messages=[], answer=None, group=0, token_ids=[1], action_mask=[0], logprobs=[0.0])
    assert "routes" not in plain.state() and Trajectory.from_dict(plain.state()).routes is None
    plan = lambda mode: SimpleNamespace(actor=SimpleNamespace(router_replay=mode))  # noqa: E731
    assert route_fields(trajectory, plan("off")) == {} and route_fields(trajectory, plan("r2")) == {}
    carried = route_fields(trajectory, plan("r3"))["routes"]
    assert carried.shape == (5, 3, 2) and torch.equal(carried[:4], routes) and (carried[4] == UNRECORDED).all()


PARITY_ENV = """def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)
"""


def tiny_ppo_steps(model_dir: str, tmp_path, *overrides: str) -> list[dict]:
    """`rl2.trainer.ppo` for 2 steps on one rank with the hf engine (fp32, 4 prompts x 4 responses of the successor
    task, a parity reward); each step's metrics."""
    import json

    data = str(tmp_path / "data")
    run_python(["recipes/make_demo_data.py", "--task", "successor", "--out", data, "--rows", "16", "--test-rows", "4"])
    env = tmp_path / "parity.py"
    env.write_text(PARITY_ENV)
    run_torchrun([
        "-m", "rl2.trainer.ppo", f"data.path={data}/train.jsonl", f"data.test_path={data}/test.jsonl",
        "data.prompts_per_rollout=4", "data.responses_per_prompt=4", f"actor.model_name={model_dir}",
        "actor.dtype=float32", "actor.lr=1e-3", "actor.gradient_checkpointing=false", f"actor.save_dir={tmp_path / 'run'}",
        f"rollout.env_path={env}", "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 6}",
        "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: 6}", "trainer.total_steps=2",
        "trainer.test_freq=2", "trainer.disable_wandb=true", *overrides,
    ], nproc=1)
    return [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][1:]


def test_ppo_with_r2_trains_a_tiny_moe_and_reports_the_router_metrics(tiny_moe_dir, tmp_path):
    """`rl2.trainer.ppo` on a tiny Qwen3-MoE with the hf engine, actor.router_replay=r2 and two updates per
    rollout: it runs, and reports actor/moe_aux_loss and router/mismatch (positive: the second minibatch's
    routers moved after the first update)."""
    steps = tiny_ppo_steps(tiny_moe_dir, tmp_path, "actor.router_replay=r2", "actor.update_per_rollout=2")
    assert all("router/mismatch" in s and s["actor/moe_aux_loss"] > 0 for s in steps), steps
    assert all(1.0 <= s["router/load_max/layer0"] <= 8.0 and 1.0 <= s["router/load_max/layer1"] <= 8.0
               and s["router/load_max"] == (s["router/load_max/layer0"] + s["router/load_max/layer1"]) / 2
               and "router/load_max/layer2" not in s for s in steps), steps
    assert any(s["router/mismatch"] > 0 for s in steps), steps


def test_ppo_with_a_hybrid_actor_on_the_hf_engine(tiny_hybrid_dir, tmp_path):
    """`rl2.trainer.ppo` on a tiny Qwen3.5 (gated delta-nets) with the hf engine: the engine's log-probs of its
    samples equal the trainer's (fp32), before and after a weight push."""
    steps = tiny_ppo_steps(tiny_hybrid_dir, tmp_path)
    assert len(steps) == 2 and all(s["logp_mismatch/max"] < 1e-4 for s in steps), steps


def test_the_moe_demo_recipe_runs_without_routing_replay_and_logs_the_expert_load(tmp_path):
    """`make demo-moe`'s recipe, shortened (10 warm-up and 3 GRPO steps, 1 rank), with ROUTER_REPLAY=off (a word YAML
    reads as false): it runs and logs router/load_max per layer and no router/mismatch; another ROUTER_REPLAY is
    refused."""
    import json
    import os
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OUT": str(tmp_path), "NPROC": "1", "SFT_STEPS": "10", "PPO_STEPS": "3", "ROUTER_REPLAY": "off",
           "PYTHONPATH": repo}
    done = subprocess.run(["bash", "recipes/ppo_moe_tiny.sh", "trainer.test_freq=null", "trainer.dump_trajectories=false"],
                          cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-5000:]
    steps = [json.loads(line) for line in open(tmp_path / "ppo" / "metrics.jsonl")]
    updated = [s for s in steps if "actor/loss" in s]
    assert updated and all("router/load_max/layer1" in s and "router/mismatch" not in s for s in updated), steps
    refused = subprocess.run(["bash", "recipes/ppo_moe_tiny.sh"], cwd=repo, env={**env, "ROUTER_REPLAY": "r4"},
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "ROUTER_REPLAY must be off, r2 or r3" in refused.stderr
