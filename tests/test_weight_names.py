"""Names and buckets of the weights sent to an inference engine (rl2.rollout.weight_sync)."""

import os
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rl2.engines.weight_names import bucketed, engine_named_tensors, engine_param_name

pytestmark = pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins

CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig}
MODEL_CASES = [(arch, tied) for arch in CONFIGS for tied in (True, False)]


def tiny_model(arch: str, tied: bool):
    config = CONFIGS[arch](
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module", params=MODEL_CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in MODEL_CASES])
def case(request, tmp_path_factory):
    """(model, tied, checkpoint keys, checkpoint path) for one tiny model."""
    arch, tied = request.param
    model = tiny_model(arch, tied)
    folder = tmp_path_factory.mktemp(f"{arch}_{tied}")
    model.save_pretrained(str(folder))
    path = os.path.join(str(folder), "model.safetensors")
    with safe_open(path, "pt") as f:
        keys = list(f.keys())
    return model, tied, keys, path


def mapped(names, tied):
    return [out for out in (engine_param_name(name, tied) for name in names) if out is not None]


def expected_order(state_dict_names, tied):
    """The state-dict names in their order, without the tied head."""
    return [name for name in state_dict_names if not (tied and name == "lm_head.weight")]


# --- plain models against their checkpoints -------------------------------------------------------


def test_checkpoint_has_head_only_when_untied(case):
    model, tied, keys, _ = case
    assert ("lm_head.weight" in keys) is (not tied)
    assert "lm_head.weight" in model.state_dict()  # the state dict lists the head either way


def test_state_dict_names_map_to_checkpoint_names(case):
    model, tied, keys, _ = case
    names = list(model.state_dict())
    out = mapped(names, tied)
    assert set(out) == set(keys)
    assert len(out) == len(keys)  # no duplicates
    assert out == expected_order(names, tied)  # order kept
    assert len(out) == len(names) - (1 if tied else 0)
    assert engine_param_name("lm_head.weight", tied) == (None if tied else "lm_head.weight")
    assert engine_param_name("model.embed_tokens.weight", tied) == "model.embed_tokens.weight"


def test_engine_named_tensors_keeps_tensors_and_values(case):
    model, tied, keys, path = case
    state = model.state_dict()
    out = list(engine_named_tensors(state.items(), tied))
    assert [name for name, _ in out] == expected_order(list(state), tied)
    for name, tensor in out:
        assert tensor is state[name]  # the same tensor objects, not copies
    with safe_open(path, "pt") as f:
        for name, tensor in out:
            assert torch.equal(tensor, f.get_tensor(name)), name


def test_engine_named_tensors_is_lazy():
    def source():
        yield "module.lm_head.weight", torch.zeros(1)
        raise RuntimeError("consumed too far")

    stream = engine_named_tensors(source(), tied_embeddings=False)
    name, _ = next(stream)
    assert name == "lm_head.weight"
    with pytest.raises(RuntimeError, match="consumed too far"):
        next(stream)


# --- wrapper prefixes -----------------------------------------------------------------------------

LAYER = re.compile(r"(layers\.\d+\.)")


def fsdp1(name: str) -> str:
    """FSDP1 with the root and every decoder layer wrapped."""
    return "_fsdp_wrapped_module." + LAYER.sub(r"\1_fsdp_wrapped_module.", name)


def checkpointed(name: str) -> str:
    return LAYER.sub(r"\1_checkpoint_wrapped_module.", name)


def fsdp1_checkpointed(name: str) -> str:
    return "_fsdp_wrapped_module." + LAYER.sub(r"\1_fsdp_wrapped_module._checkpoint_wrapped_module.", name)


def ddp(name: str) -> str:
    return "module." + name


PEFT_TARGETS = re.compile(r"\.(q_proj|v_proj|k_proj|o_proj)\.(weight|bias)$")


def peft(name: str) -> str:
    """PEFT LoRA on the attention projections (the targets gain `.base_layer`)."""
    return "base_model.model." + PEFT_TARGETS.sub(r".\1.base_layer.\2", name)


REWRITES = {
    "fsdp1": fsdp1,
    "checkpoint": checkpointed,
    "fsdp1+checkpoint": fsdp1_checkpointed,
    "ddp": ddp,
    "peft": peft,
    "ddp+peft": lambda n: ddp(peft(n)),
    "compile+fsdp1": lambda n: "_orig_mod." + fsdp1(n),
    "compile+peft": lambda n: "_orig_mod." + peft(n),
}


def test_rewrites_look_like_the_real_wrappers():
    name = "model.layers.0.self_attn.q_proj.weight"
    assert fsdp1(name) == "_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight"
    assert checkpointed(name) == "model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.weight"
    assert peft(name) == "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert peft("model.layers.1.mlp.up_proj.weight") == "base_model.model.model.layers.1.mlp.up_proj.weight"
    assert ddp(name) == "module." + name


def test_torch_compile_state_dict_maps_to_checkpoint_names(case):
    model, tied, keys, _ = case
    compiled = torch.compile(model)  # never called: only its state-dict names are used
    names = list(compiled.state_dict())
    assert names and all(name.startswith("_orig_mod.") for name in names)
    out = mapped(names, tied)
    assert set(out) == set(keys) and len(out) == len(keys)
    assert out == expected_order(list(model.state_dict()), tied)


@pytest.mark.parametrize("wrapper", list(REWRITES))
def test_wrapped_names_map_to_checkpoint_names(case, wrapper):
    model, tied, keys, _ = case
    plain = list(model.state_dict())
    names = [REWRITES[wrapper](name) for name in plain]
    assert names != plain  # the rewrite changed something
    out = mapped(names, tied)
    assert set(out) == set(keys) and len(out) == len(keys)
    assert out == expected_order(plain, tied)


@pytest.mark.parametrize(
    "name, tied, expected",
    [
        ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight", False,
         "model.layers.0.self_attn.q_proj.weight"),
        ("model.layers.1._checkpoint_wrapped_module.mlp.down_proj.weight", True, "model.layers.1.mlp.down_proj.weight"),
        ("module.model.norm.weight", True, "model.norm.weight"),
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", False,
         "model.layers.0.self_attn.q_proj.weight"),
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias", False,
         "model.layers.0.self_attn.q_proj.bias"),
        ("_orig_mod.model.embed_tokens.weight", True, "model.embed_tokens.weight"),
        ("_orig_mod.lm_head.weight", False, "lm_head.weight"),
        ("_orig_mod.lm_head.weight", True, None),
        ("_fsdp_wrapped_module.lm_head.weight", True, None),
        ("module.lm_head.weight", True, None),
        ("base_model.model.lm_head.weight", True, None),
        ("base_model.model.lm_head.weight", False, "lm_head.weight"),
    ],
)
def test_single_names(name, tied, expected):
    assert engine_param_name(name, tied) == expected


@pytest.mark.parametrize(
    "name",
    [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight",
        "module.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
    ],
)
@pytest.mark.parametrize("tied", [True, False])
def test_unmerged_lora_weights_raise(name, tied):
    with pytest.raises(ValueError, match="merge") as error:
        engine_param_name(name, tied)
    assert "lora_" in str(error.value)
    with pytest.raises(ValueError, match="merge"):
        list(engine_named_tensors([("model.norm.weight", torch.zeros(1)), (name, torch.zeros(1))], tied))


@pytest.mark.parametrize(
    "name",
    ["base_model.model.lm_head.modules_to_save.default.weight", "base_model.model.lm_head.original_module.weight"],
)
def test_peft_modules_to_save_raise(name):
    with pytest.raises(ValueError, match="modules_to_save copy; merge"):
        engine_param_name(name, tied_embeddings=False)


# --- buckets --------------------------------------------------------------------------------------


def names_of(buckets):
    return [[name for name, _ in bucket] for bucket in buckets]


def test_bucketed_exact_small_case():
    f32, bf16 = torch.float32, torch.bfloat16
    tensors = [
        ("a", torch.zeros(4, dtype=f32)),  # 16 B
        ("b", torch.zeros(2, 2, dtype=f32)),  # 16 B: fills the bucket to exactly the limit
        ("c", torch.zeros(2, dtype=f32)),  # 8 B: would pass it, new bucket
        ("d", torch.zeros(8, dtype=bf16)),  # 16 B: dtype change
        ("e", torch.zeros(4, dtype=bf16)),  # 8 B
        ("f", torch.zeros(20, dtype=f32)),  # 80 B: dtype change and over the limit, alone
        ("g", torch.zeros(1, dtype=f32)),  # 4 B
    ]
    buckets = list(bucketed(tensors, bucket_bytes=32))
    assert names_of(buckets) == [["a", "b"], ["c"], ["d", "e"], ["f"], ["g"]]
    flat = [pair for bucket in buckets for pair in bucket]
    assert [name for name, _ in flat] == [name for name, _ in tensors]
    assert all(got is want for (_, got), (_, want) in zip(flat, tensors))


def test_bucketed_limit_just_below_a_pair():
    tensors = [(str(i), torch.zeros(4, dtype=torch.float32)) for i in range(5)]  # 16 B each
    assert names_of(bucketed(tensors, 31)) == [["0"], ["1"], ["2"], ["3"], ["4"]]
    assert names_of(bucketed(tensors, 32)) == [["0", "1"], ["2", "3"], ["4"]]
    assert names_of(bucketed(tensors, 48)) == [["0", "1", "2"], ["3", "4"]]
    assert names_of(bucketed(tensors, 10**9)) == [["0", "1", "2", "3", "4"]]


def test_bucketed_splits_on_every_dtype_change():
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float16]
    tensors = [(f"t{i}", torch.zeros(1, dtype=dtype)) for i, dtype in enumerate(dtypes)]
    buckets = list(bucketed(tensors, bucket_bytes=1 << 20))
    assert names_of(buckets) == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    for bucket in buckets:
        assert len({tensor.dtype for _, tensor in bucket}) == 1


def test_bucketed_empty_input():
    assert list(bucketed([], 1024)) == []
    assert list(bucketed(iter(()), 1024)) == []


def test_bucketed_large_meta_tensors():
    mib = 2**20
    bf16, f32 = torch.bfloat16, torch.float32
    big = torch.empty(300 * mib, dtype=bf16, device="meta")  # 600 MiB
    assert big.numel() * big.element_size() == 600 * mib
    tensors = [
        ("w0", torch.empty(100 * mib, dtype=bf16, device="meta")),  # 200 MiB
        ("w1", torch.empty(128 * mib, dtype=bf16, device="meta")),  # 256 MiB: 456
        ("w2", torch.empty(28 * mib, dtype=bf16, device="meta")),  # 56 MiB: 512, exactly the limit
        ("w3", torch.empty(1, dtype=bf16, device="meta")),  # 2 B: over, new bucket
        ("big", big),  # 600 MiB: over the limit, alone
        ("w5", torch.empty(64 * mib, dtype=bf16, device="meta")),  # 128 MiB
        ("w6", torch.empty(96 * mib, dtype=f32, device="meta")),  # 384 MiB, fp32: new bucket
        ("w7", torch.empty(32 * mib, dtype=f32, device="meta")),  # 128 MiB: 512
        ("w8", torch.empty(256 * mib, dtype=f32, device="meta")),  # 1 GiB: alone
        ("w9", torch.empty(2, 3, dtype=f32, device="meta")),  # 24 B
    ]
    limit = 512 * mib
    buckets = list(bucketed(tensors, limit))
    assert names_of(buckets) == [["w0", "w1", "w2"], ["w3"], ["big"], ["w5"], ["w6", "w7"], ["w8"], ["w9"]]
    sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets]
    assert sizes == [512 * mib, 2, 600 * mib, 128 * mib, 512 * mib, 1024 * mib, 24]
    for bucket, size in zip(buckets, sizes):
        if len(bucket) > 1:
            assert size <= limit
        else:
            (_, tensor), = bucket
            assert tensor.device.type == "meta"


def test_bucketed_real_model_respects_limit_and_order():
    model = tiny_model("qwen2", tied=False)
    named = list(engine_named_tensors(model.state_dict().items(), tied_embeddings=False))
    # mix dtypes: every parameter of layer 1 in bfloat16
    named = [(n, t.to(torch.bfloat16) if ".layers.1." in n else t) for n, t in named]
    limit = 16 * 1024
    buckets = list(bucketed(named, limit))
    assert [n for bucket in buckets for n, _ in bucket] == [n for n, _ in named]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert len({t.dtype for _, t in bucket}) == 1
        if len(bucket) > 1:
            assert size <= limit
    # consecutive buckets of one dtype could not have been merged
    for first, second in zip(buckets, buckets[1:]):
        if first[0][1].dtype == second[0][1].dtype:
            size = sum(t.numel() * t.element_size() for _, t in first)
            assert size + second[0][1].numel() * second[0][1].element_size() > limit
    # exact: embed (128*32*4 = 16 KiB) fills one bucket alone; the head too
    assert names_of(buckets)[0] == ["model.embed_tokens.weight"]
    assert names_of(buckets)[-1] == ["lm_head.weight"]


GATHER_CHECK = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from rl2.rollout.weight_sync import iter_full_weights

dist.init_process_group("gloo")
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
expected = {name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()}
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
gathered = []
all_gather = dist.all_gather_into_tensor
dist.all_gather_into_tensor = lambda out, local, **kwargs: gathered.append(local.dtype) or all_gather(out, local, **kwargs)
bucket_mb = float(sys.argv[2])
sent = dict(iter_full_weights(model, "bfloat16", bucket_mb=bucket_mb))
assert "lm_head.weight" not in sent and len(sent) == len(expected) - 1, len(sent)
assert all(torch.equal(sent[name], expected[name]) for name in sent)
if dist.get_world_size() > 1:  # cast, then gathered: one collective per bucket
    buckets = 1 if bucket_mb > 1 else len(sent)
    assert gathered == [torch.bfloat16] * buckets, gathered
    # rows that do not split evenly (5 = 3 + 2; 1 = 1 + none), in one gather with an even one
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from rl2.rollout.weight_sync import _full_row_sharded
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = [torch.arange(n * 3, dtype=torch.float32).view(n, 3) for n in (5, 1, 4)]
    shards = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]
    assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(_full_row_sharded(shards, torch.bfloat16), full))
else:
    assert gathered == []  # one rank holds it all
print("ok")
"""


@pytest.mark.parametrize("ranks,bucket_mb", [(1, 0), (2, 0), (2, 64)], ids=["one-rank", "tensor-buckets", "one-bucket"])
def test_full_weights_are_cast_before_the_gather_and_tied_ones_sent_once(tiny_model_dir, ranks, bucket_mb):
    """The sync gathers bf16 shards, not fp32 masters to cast afterwards, a bucket's shards (uneven: the
    tiny model's rows do not all split evenly over 2 ranks) in one all-gather, and sends the tied head once."""
    from conftest import run_torchrun

    assert "ok" in run_torchrun(["-c", GATHER_CHECK, tiny_model_dir, str(bucket_mb)], nproc=ranks).stdout


def test_checkpoint_names_are_the_names_a_vision_language_checkpoint_stores(vlm_dir):
    """Qwen2.5-VL's transformers model holds `model.visual.*` / `model.language_model.*`; its checkpoint (what
    SGLang's loader takes) stores `visual.*` / `model.*`: every pushed name maps to a stored one."""
    from transformers import AutoModelForImageTextToText

    from rl2.engines.weight_names import checkpoint_names

    stored_names = checkpoint_names(vlm_dir)
    assert stored_names["model.visual.blocks.0.mlp.gate_proj.weight"] == "visual.blocks.0.mlp.gate_proj.weight"
    assert stored_names["model.language_model.layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"
    live = AutoModelForImageTextToText.from_pretrained(vlm_dir).state_dict()
    tied = live["lm_head.weight"].data_ptr() == live["model.language_model.embed_tokens.weight"].data_ptr()
    pushed = dict(engine_named_tensors(live.items(), tied_embeddings=tied, stored_names=stored_names))
    with safe_open(f"{vlm_dir}/model.safetensors", "pt") as checkpoint:
        assert set(pushed) == set(checkpoint.keys())
