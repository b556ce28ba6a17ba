"""Mixture-of-experts models in packed rows, and routing record and replay (`rl2.models.routing_replay`), on tiny
Qwen3-MoE, OLMoE, gpt-oss and Qwen3-Next models built offline (`rl2.testing.tiny_moe`), in fp32 on CPU."""

import pytest
import torch

import packed_rows
from packed_rows import packed_inputs, varlen  # noqa: F401  (varlen: the fixture)
from rl2.models.linear_attention import PerSequenceLinearAttention
from rl2.models.routing_replay import (
    UNRECORDED,
    RoutingReplay,
    packed_routes,
    route_dtype,
    routers,
    routing_mismatch,
    sequence_routes,
)
from rl2.testing.tiny_moe import build_tiny_hybrid, build_tiny_moe

LENGTHS = (5, 9, 9, 16, 3)


def sequences(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    return packed_rows.sequences(lengths, seed)


def model_of(family: str, varlen: str) -> torch.nn.Module:
    """A tiny model of `family` in rl2's packed-row attention (gpt-oss's sinks and window:
    tests/test_gpt_oss_packing.py)."""
    if family == "qwen3_next":
        return build_tiny_hybrid(family, attn_implementation=varlen)
    return build_tiny_moe(family, attn_implementation=varlen)


def forward(model: torch.nn.Module, family: str, inputs: dict) -> torch.Tensor:
    if family == "qwen3_next":
        with PerSequenceLinearAttention(model):
            return model(**inputs).logits
    return model(**inputs).logits


def perturb_routers(model: torch.nn.Module, scale: float = 0.1, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * scale)


class ExpertsSeen:
    """The expert ids each MoE layer's experts module was called with, per forward: [layers, tokens, k]."""

    def __init__(self, model: torch.nn.Module):
        experts = [module for module in model.modules() if type(module).__name__.endswith("Experts")]
        self.seen: list[torch.Tensor | None] = [None] * len(experts)
        self.handles = [module.register_forward_pre_hook(self._hook(layer)) for layer, module in enumerate(experts)]

    def _hook(self, layer: int):
        def hook(module, args):
            self.seen[layer] = args[1].detach().clone()
        return hook

    def routes(self) -> torch.Tensor:
        return torch.stack(self.seen)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# ---- packing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_a_packed_moe_row_gives_each_sequence_its_logits_and_gradients_alone(family, varlen):
    model = build_tiny_moe(family, attn_implementation=varlen)
    seqs = sequences()
    weights = [torch.randn(len(s), 1024, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]

    packed = model(**packed_inputs(seqs)).logits[0]
    (packed * torch.cat(weights)).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone = []
    for s, w in zip(seqs, weights):
        logits = model(input_ids=s[None], position_ids=torch.arange(len(s))[None], use_cache=False).logits[0]
        (logits * w).sum().backward()
        alone.append(logits.detach())

    torch.testing.assert_close(packed.detach(), torch.cat(alone), rtol=0, atol=1e-5)
    assert packed_grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item()  # fp32 sums over tokens in another order: 1e-6 of the largest
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=0, atol=1e-5 * scale, msg=name)
    assert any("gate" in name and grad.abs().sum() > 0 for name, grad in packed_grads.items())


# ---- routing replay --------------------------------------------------------------------------------------------


FAMILIES = ["qwen3_moe", "olmoe", "gpt_oss", "qwen3_next"]


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_with_unchanged_weights_gives_the_recorded_forward_exactly(family, varlen):
    model = model_of(family, varlen)
    inputs = packed_inputs(sequences())
    with RoutingReplay(model) as replay:
        replay.record()
        with torch.no_grad():
            recorded = forward(model, family, inputs)
        routes = replay.routes()
        replay.replay(routes)
        replayed = forward(model, family, inputs)
        assert replay.mismatch() == 0.0
    tokens = inputs["input_ids"].shape[1]
    assert routes.shape == (2, tokens, 2) and routes.dtype == torch.int8
    assert (replayed.detach() - recorded).abs().max().item() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_after_the_routers_change_the_replayed_forward_uses_the_recorded_experts(family, varlen):
    model = model_of(family, varlen)
    inputs = packed_inputs(sequences())
    with RoutingReplay(model) as replay:
        replay.record()
        with torch.no_grad():
            forward(model, family, inputs)
        recorded = replay.routes()
        perturb_routers(model)
        seen = ExpertsSeen(model)
        replay.replay(recorded)
        replayed = forward(model, family, inputs)
        replayed.square().mean().backward()
        live = replay.routes()
        seen.close()
        replay.off()
        with torch.no_grad():
            free = forward(model, family, inputs)
    assert routing_mismatch(live, recorded) > 0  # the live routers would route some tokens elsewhere ...
    assert torch.equal(seen.routes(), recorded.long())  # ... and the experts got the recorded ones
    assert (replayed.detach() - free).abs().max() > 1e-3
    for router in routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_the_experts_check_catches_a_replay_that_recomputes_routes(varlen):
    class RecomputingReplay(RoutingReplay):  # the mutant: in replay mode the routers route as they like
        def _hook(self, layer, router, args, output):
            super()._hook(layer, router, args, output)
            return None

    model = model_of("qwen3_moe", varlen)
    inputs = packed_inputs(sequences())
    with RecomputingReplay(model) as replay:
        replay.record()
        with torch.no_grad():
            forward(model, "qwen3_moe", inputs)
        recorded = replay.routes()
        perturb_routers(model)
        seen = ExpertsSeen(model)
        replay.replay(recorded)
        with torch.no_grad():
            forward(model, "qwen3_moe", inputs)
        seen.close()
    assert not torch.equal(seen.routes(), recorded.long())


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_mismatch_is_zero_with_unchanged_weights_and_positive_after_the_routers_change(family, varlen):
    model = model_of(family, varlen)
    inputs = packed_inputs(sequences())
    with RoutingReplay(model) as replay, torch.no_grad():
        replay.record()
        forward(model, family, inputs)
        recorded = replay.routes()
        replay.replay(recorded)
        forward(model, family, inputs)
        assert replay.mismatch() == 0.0 and routing_mismatch(replay.routes(), recorded) == 0.0
        perturb_routers(model)
        replay.replay(recorded)
        forward(model, family, inputs)
        mismatch, live = replay.mismatch(), replay.routes()
    assert 0 < mismatch < 1
    assert mismatch == pytest.approx(routing_mismatch(live, recorded))
    # The live routers' choices under replay: the first layer's are a free forward's (the same input); later
    # layers' inputs come from replayed layers, so they are the decisions of the training forward being run.
    with RoutingReplay(model) as free, torch.no_grad():
        free.record()
        forward(model, family, inputs)
        assert torch.equal(free.routes()[0], live[0]) and not torch.equal(free.routes()[0], recorded[0])


def test_unrecorded_tokens_go_where_the_live_router_sends_them(varlen):
    model = model_of("olmoe", varlen)
    seqs = sequences()
    inputs = packed_inputs(seqs)
    last = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0) - 1  # each sequence's last token
    with RoutingReplay(model) as replay:
        replay.record()
        with torch.no_grad():
            forward(model, "olmoe", inputs)
        recorded = replay.routes().clone()
        recorded[:, last] = UNRECORDED
        perturb_routers(model)
        seen = ExpertsSeen(model)
        replay.replay(recorded)
        with torch.no_grad():
            forward(model, "olmoe", inputs)
        seen.close()
        live, mismatch = replay.routes(), replay.mismatch()
    recorded_tokens = torch.ones(recorded.shape[1], dtype=torch.bool).index_fill(0, last, False)
    assert torch.equal(seen.routes()[:, recorded_tokens], recorded[:, recorded_tokens].long())
    assert torch.equal(seen.routes()[:, last], live[:, last].long())
    assert mismatch == pytest.approx(routing_mismatch(live, recorded)) and mismatch > 0
    kept = (recorded[:, recorded_tokens].long().unsqueeze(-1) == live[:, recorded_tokens].long().unsqueeze(-2)).any(-1)
    assert mismatch == pytest.approx(1 - kept.float().mean().item())


def test_a_rows_routes_are_its_sequences_routes_alone_and_split_and_pack_as_its_tokens(varlen):
    model = model_of("qwen3_moe", varlen)
    seqs = sequences()
    inputs = packed_inputs(seqs)
    with RoutingReplay(model) as replay, torch.no_grad():
        replay.record()
        forward(model, "qwen3_moe", inputs)
        row = replay.routes()
        replay.record()
        for s in seqs:
            forward(model, "qwen3_moe", packed_inputs([s]))
        one_by_one = replay.routes()
    per_sequence = sequence_routes(row, inputs["cu_seq_lens_q"])
    assert [r.shape[1] for r in per_sequence] == [len(s) for s in seqs]
    assert torch.equal(row, one_by_one)  # a sequence's routes do not depend on its row
    assert torch.equal(packed_routes(per_sequence), row)


def test_replay_under_gradient_checkpointing_gives_the_gradients_without_it(varlen):
    model = model_of("qwen3_moe", varlen)
    inputs = packed_inputs(sequences())
    with RoutingReplay(model) as replay:
        replay.record()
        with torch.no_grad():
            forward(model, "qwen3_moe", inputs)
        recorded = replay.routes()
        perturb_routers(model)
        grads = []
        for checkpointing in (False, True):
            model.train()
            if checkpointing:
                model.activation_checkpointing_enable()
            model.zero_grad()
            replay.replay(recorded)
            model(**inputs).logits.square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(plain, checkpointed, rtol=1e-6, atol=1e-7)


def test_recording_appends_forwards_along_the_tokens(varlen):
    model = model_of("olmoe", varlen)
    first, second = sequences((6,)), sequences((4, 3), seed=1)
    with RoutingReplay(model) as replay, torch.no_grad():
        replay.record()
        forward(model, "olmoe", packed_inputs(first))
        alone = replay.routes()
        forward(model, "olmoe", packed_inputs(second))
        both = replay.routes()
    assert both.shape == (2, 13, 2) and torch.equal(both[:, :6], alone)


def test_closing_leaves_the_routers_as_they_were(varlen):
    model = model_of("qwen3_moe", varlen)
    inputs = packed_inputs(sequences())
    with torch.no_grad():
        before = model(**inputs).logits
    with RoutingReplay(model) as replay:
        replay.replay(torch.zeros(2, inputs["input_ids"].shape[1], 2, dtype=torch.int8))  # every token to expert 0
        with torch.no_grad():
            assert not torch.equal(model(**inputs).logits, before)
    assert all(not router._forward_hooks for router in routers(model))
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)


def test_replay_refuses_routes_of_another_shape(varlen):
    model = model_of("qwen3_moe", varlen)
    inputs = packed_inputs(sequences())
    with RoutingReplay(model) as replay:
        with pytest.raises(ValueError, match="layers"):
            replay.replay(torch.zeros(3, 7, 2, dtype=torch.int8))
        replay.replay(torch.zeros(2, 7, 2, dtype=torch.int8))
        with pytest.raises(ValueError, match="cover 7 tokens"), torch.no_grad():
            model(**inputs)


def test_routes_are_the_smallest_integers_that_hold_the_expert_ids():
    assert route_dtype(8) == torch.int8 and route_dtype(128) == torch.int8
    assert route_dtype(129) == torch.int16 and route_dtype(512) == torch.int16
    with pytest.raises(ValueError):
        route_dtype(2**16)


def test_a_dense_model_is_refused():
    from rl2.testing.tiny import build_tiny_model, build_tiny_tokenizer

    with pytest.raises(ValueError, match="no MoE router"):
        RoutingReplay(build_tiny_model(build_tiny_tokenizer(vocab_size=300)))


@pytest.mark.parametrize("family", FAMILIES)
def test_routes_recorded_while_generating_are_a_forwards_routes_on_the_sample(family, varlen):
    """What the `hf` engine's recording will rest on: generation's forwards (prefill, then one token per step
    with a cache) route each token as one forward over the whole sample does. The last sampled token goes
    through no generation forward: it is UNRECORDED, and replaying the rest gives the sample's forward."""
    model = build_tiny_hybrid(family) if family == "qwen3_next" else build_tiny_moe(family)
    prompt = sequences((6,))[0][None]
    with RoutingReplay(model) as replay, torch.no_grad():
        replay.record()
        torch.manual_seed(0)
        sample = model.generate(prompt, max_new_tokens=10, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None)
        generated = replay.routes()
        replay.record()
        free = model(input_ids=sample).logits
        assert torch.equal(generated, replay.routes()[:, :-1])
        replay.replay(torch.cat([generated, torch.full_like(generated[:, :1], UNRECORDED)], dim=1))
        assert torch.equal(model(input_ids=sample).logits, free)
