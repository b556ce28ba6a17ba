"""The SGLang engine adapter, on CPU: conversions of SGLang's outputs and arguments, the process
state around engine start-up, the error without SGLang, and the adapter's calls in order against
the stand-in package in tests/sglang_stand_in (SGLang's API, run by the embedded engine)."""

import importlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from unittest.mock import patch

from conftest import REPO, run_python, run_torchrun
from rl2.config import ConfigError, load_config
from rl2.config_checks import check_rl_config
from rl2.engines import HFEngine, SamplingParams, build_engine_from_config
from rl2.engines.base import Generation
from rl2.engines.sglang import (
    SGLANG_REQUIREMENT,
    SGLangEngine,
    check_result,
    cut_at_stop_string,
    OWN_SERVER_ARGS,
    engine_args,
    load_sglang,
    sampling_params_dict,
    sglang_process_state,
    single_token_stops,
    to_generation,
)
from rl2.engines.tp_group import plan_tp_group
from rl2.metrics import read_metrics
from rl2.rollout.multi_turn import rollout

pytestmark = pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins

STAND_IN = os.path.join(REPO, "tests", "sglang_stand_in")
SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None and STAND_IN not in sys.path


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def stand_in():
    """The stand-in `sglang` importable for one test; the real one (if any) is put back after."""
    saved = {name: module for name, module in sys.modules.items() if name == "sglang" or name.startswith("sglang.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, STAND_IN)
    try:
        yield load_sglang()
    finally:
        sys.path.remove(STAND_IN)
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        sys.modules.update(saved)


# ---- conversions ----------------------------------------------------------------------------


def test_outputs_become_generations():
    """Recorded SGLang output shapes: stop (eos kept), length, abort with its message, and
    output_ids without the stop token (trimmed) next to log-probs that keep it."""
    stop = {
        "output_ids": [5, 6, 2],
        "meta_info": {"output_token_logprobs": [(-0.5, 5, None), (-1.0, 6, None), (-0.1, 2, None)],
                      "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": 3},
    }
    assert to_generation(stop) == Generation([5, 6, 2], [-0.5, -1.0, -0.1], "stop")
    trimmed = {**stop, "output_ids": [5, 6]}
    assert to_generation(trimmed).token_ids == [5, 6, 2]
    length = {"output_ids": [7], "meta_info": {"output_token_logprobs": [(-2.0, 7, "x")],
                                               "finish_reason": {"type": "length", "length": 1}}}
    assert to_generation(length) == Generation([7], [-2.0], "length")
    abort = {"output_ids": [], "meta_info": {"output_token_logprobs": [],
                                             "finish_reason": {"type": "abort", "message": "input is too long"}}}
    generation = to_generation(abort)
    assert generation.finish_reason == "abort" and generation.token_ids == []
    assert "input is too long" in generation.error
    assert to_generation({"meta_info": {"output_token_logprobs": [(-1.0, 3, None)], "finish_reason": "stop"}}).token_ids == [3]


@pytest.mark.parametrize(
    "output,message",
    [
        ({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}}, "return_logprob=True"),
        ({"output_ids": [9], "meta_info": {"output_token_logprobs": [(-1.0, 1, None)], "finish_reason": {"type": "stop"}}},
         "disagree"),
        ({"output_ids": [1], "meta_info": {"output_token_logprobs": [(-1.0, 1, None)], "finish_reason": {"type": "eos"}}},
         "unknown finish_reason"),
    ],
    ids=["no-logprobs", "ids-disagree", "unknown-reason"],
)
def test_malformed_outputs_are_errors(output, message):
    with pytest.raises(ValueError, match=message):
        to_generation(output)


def test_stop_strings(tokenizer):
    """A multi-token stop string cuts the returned tokens after the token that completes it; a
    one-token stop string becomes a stop token id for the engine."""
    tokens = tokenizer("the answer is 42</search> and more text", add_special_tokens=False)["input_ids"]
    generation = Generation(tokens, [-float(i) for i in range(len(tokens))], "length")
    cut = cut_at_stop_string(generation, ["</search>"], tokenizer)
    text = tokenizer.decode(cut.token_ids)
    assert text.endswith("</search>") and "</search>" not in tokenizer.decode(cut.token_ids[:-1])
    assert cut.finish_reason == "stop" and cut.logprobs == generation.logprobs[: len(cut.token_ids)]
    assert cut_at_stop_string(generation, ["never there"], tokenizer) is generation
    assert cut_at_stop_string(generation, [], tokenizer) is generation
    one_token = tokenizer.convert_ids_to_tokens(tokens[0])
    stop = tokenizer.decode([tokens[0]])
    assert single_token_stops([stop, "</search>"], tokenizer) == [tokens[0]], one_token
    assert len(tokenizer("</search>", add_special_tokens=False)["input_ids"]) > 1


def test_sampling_params_and_engine_args():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33, stop=["x"], stop_token_ids=[4])
    assert sampling_params_dict(params, [9, 4]) == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 33, "stop_token_ids": [4, 9],
        "ignore_eos": False, "skip_special_tokens": False, "no_stop_trim": True,
    }
    layout = plan_tp_group(rank=6, world_size=8, local_rank=6, local_world_size=8, tp_size=2)
    args = engine_args("/models/qwen", layout, "bfloat16", 0.6, 7, nccl_port=12345)
    assert args["tp_size"] == 2 and args["base_gpu_id"] == 6 and args["gpu_id_step"] == 1
    assert args["skip_tokenizer_init"] is True and args["enable_memory_saver"] is True
    assert args["mem_fraction_static"] == 0.6 and args["random_seed"] == 7 and args["nccl_port"] == 12345
    other = engine_args("/models/qwen", plan_tp_group(2, 8, 2, 8, 2), "bfloat16", 0.6, 7, nccl_port=1)
    assert other["port"] != args["port"]  # engines on one node need their own ports


def test_server_args_pass_through_except_the_ones_rl2_sets():
    """rollout.server_args reach sglang.Engine as given (log_level too); an argument rl2 sets itself
    is refused with the rl2 key to use, or as rl2's own; every argument rl2 sets is in that list."""
    layout = plan_tp_group(rank=0, world_size=1, local_rank=0, local_world_size=1, tp_size=1)
    args = engine_args("/m", layout, "bfloat16", 0.6, 7, nccl_port=1,
                       server_args={"attention_backend": "fa3", "log_level": "info", "chunked_prefill_size": 4096})
    assert args["attention_backend"] == "fa3" and args["log_level"] == "info" and args["chunked_prefill_size"] == 4096
    assert set(engine_args("/m", layout, "bfloat16", 0.6, 7, nccl_port=1)) == set(OWN_SERVER_ARGS) | {"log_level"}
    with pytest.raises(ValueError, match="rollout.server_args.tp_size: set rollout.tp_size instead"):
        engine_args("/m", layout, "bfloat16", 0.6, 7, nccl_port=1, server_args={"tp_size": 4})
    with pytest.raises(ValueError, match="rollout.server_args.port: rl2 sets this SGLang argument itself"):
        engine_args("/m", layout, "bfloat16", 0.6, 7, nccl_port=1, server_args={"port": 1})
    # SGLang ties the head by its config with this override applied; the actor's pushes follow the checkpoint's
    with pytest.raises(ValueError, match="tie_word_embeddings must stay the checkpoint's"):
        engine_args("/m", layout, "bfloat16", 0.6, 7, nccl_port=1,
                    server_args={"json_model_override_args": '{"tie_word_embeddings": false}'})
    assert engine_args("/m", layout, "bfloat16", 0.6, 7, nccl_port=1,
                       server_args={"json_model_override_args": '{"rope_theta": 1e6}'})["json_model_override_args"]


def test_server_args_from_the_config_reach_the_engine(stand_in, tiny_model_dir, tokenizer):
    config = load_config(["rollout.engine=sglang", f"actor.model_name={tiny_model_dir}", "actor.dtype=float32",
                          "rollout.server_args.attention_backend=torch_native", "rollout.server_args.mem_fraction_static=0.3"])
    assert config.rollout.gpu_memory_utilization == 0.3  # RL2's name for it, mapped
    with patch("rl2.engines.sglang.load_sglang", return_value=stand_in):
        engine = build_engine_from_config(config.rollout, config.actor, tokenizer, seed=1)
    assert engine.engine.args["attention_backend"] == "torch_native"
    assert engine.engine.args["mem_fraction_static"] == 0.3
    engine.shutdown()


def test_server_args_are_checked_with_the_config(tiny_model_dir):
    with pytest.raises(ConfigError, match="are SGLang's arguments: set rollout.engine=sglang"):
        check_rl_config(load_config(["rollout.server_args.attention_backend=fa3"]))
    with pytest.raises(ConfigError, match="rollout.server_args.random_seed: set trainer.seed instead"):
        check_rl_config(load_config(["rollout.engine=sglang", "rollout.server_args.random_seed=3"]))


@pytest.mark.parametrize(
    "result,ok",
    [(None, True), ((True, "Success"), True), ([True, "ok", 3], True), ({"success": True}, True),
     ((False, "bad name"), False), ({"success": False, "message": "bad name"}, False)],
)
def test_check_result(result, ok):
    if ok:
        check_result(result, "update_weights_from_tensor")
    else:
        with pytest.raises(RuntimeError, match="update_weights_from_tensor failed: bad name"):
            check_result(result, "update_weights_from_tensor")


def test_process_state_is_restored(monkeypatch):
    """SGLang's start-up sets NCCL / CUDA variables, signal handlers and the start method in the
    caller; the trainer's are put back, and torchrun's agent-store variable is hidden meanwhile."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    handler = signal.getsignal(signal.SIGCHLD)
    method = multiprocessing.get_start_method(allow_none=True)
    with sglang_process_state():
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
        os.environ.update({"CUDA_DEVICE_MAX_CONNECTIONS": "8", "NCCL_CUMEM_ENABLE": "0", "NCCL_DEBUG": "INFO",
                           "SGLANG_RUN_ID": "x"})
        signal.signal(signal.SIGCHLD, lambda *args: None)
        multiprocessing.set_start_method("spawn" if method != "spawn" else "fork", force=True)
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True" and os.environ["NCCL_DEBUG"] == "WARN"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and "NCCL_CUMEM_ENABLE" not in os.environ
    assert os.environ.pop("SGLANG_RUN_ID") == "x"  # SGLang's own variables stay
    assert signal.getsignal(signal.SIGCHLD) is handler
    assert multiprocessing.get_start_method(allow_none=True) == method


# ---- without SGLang -------------------------------------------------------------------------


@pytest.mark.skipif(SGLANG_INSTALLED, reason="SGLang is installed here")
def test_missing_sglang_fails_at_start(tiny_model_dir, tmp_path):
    with pytest.raises(ImportError) as error:
        load_sglang()
    assert 'pip install -e ".[gpu]"' in str(error.value) and SGLANG_REQUIREMENT in str(error.value)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": "1"}) + "\n")
    args = ["-m", "rl2.trainer.ppo", f"data.path={data}", f"actor.model_name={tiny_model_dir}",
            "data.responses_per_prompt=2", "rollout.env_path=envs/demo_successor.py", "rollout.engine=sglang",
            "trainer.disable_wandb=true"]
    with pytest.raises(AssertionError) as failed:
        run_python(args, timeout=120)
    assert "(2)" in str(failed.value) and "rl2: error:" in str(failed.value)
    assert 'pip install -e ".[gpu]"' in str(failed.value) and "Traceback" not in str(failed.value)


# ---- against the stand-in -------------------------------------------------------------------


def _calls(engine: SGLangEngine) -> list[str]:
    return [name for name, _ in engine.engine.calls]


def test_generation_matches_the_embedded_engine(stand_in, tiny_model_dir, tokenizer):
    """Greedy tokens and log-probs through the adapter equal the embedded engine's; eos ends a
    generation with the eos token kept; a multi-token stop string is cut on our side."""
    engine = SGLangEngine(tiny_model_dir, tokenizer, dtype="float32", api=stand_in)
    reference = HFEngine(tiny_model_dir, tokenizer, "cpu")
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("hello world", "a b c d", "x")]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    got, want = engine.generate(prompts, params), reference.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    stop_text = tokenizer.decode(want[0].token_ids[2:4])  # two generated tokens: a stop string the model says
    stopped = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=12, stop=[stop_text]))[0]
    assert stopped.finish_reason == "stop" and stop_text in tokenizer.decode(stopped.token_ids)
    assert len(stopped.token_ids) <= 4 and stopped.token_ids == want[0].token_ids[: len(stopped.token_ids)]
    assert engine.generate([], params) == []


def test_release_push_resume_order(stand_in, tiny_model_dir, tokenizer):
    """sleep releases everything; update_weights resumes the weights, pushes in a session and
    the pushed weights are the ones generating; wake resumes the KV cache. Out of order is an error."""
    engine = SGLangEngine(tiny_model_dir, tokenizer, dtype="float32", api=stand_in,
                          free_memory=lambda: engine.engine.calls.append(("free_memory", {})))
    prompt = [tokenizer("hello world", add_special_tokens=False)["input_ids"]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine.sleep()
    with pytest.raises(RuntimeError, match="call wake"):
        engine.generate(prompt, params)
    with pytest.raises(RuntimeError, match="update_weights comes before wake"):
        engine.wake()
    changed = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for parameter in changed.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    engine.update_weights(changed.state_dict().items())
    engine.wake()
    calls = _calls(engine)
    assert [call for call in calls[calls.index("release"):] if call != "free_memory"] == [
        "release", "resume", "begin_weight_update", "update_weights_from_tensor", "end_weight_update",
        "get_weights_by_name", "resume", "flush_cache",
    ]
    # The allocator is emptied before every resume (the trainer's cached blocks go back to the driver first).
    assert all(calls[i - 1] == "free_memory" for i, call in enumerate(calls) if call == "resume")
    tags = [details["tags"] for name, details in engine.engine.calls if name in ("release", "resume")]
    assert tags == [["cuda_graph", "kv_cache", "weights"], ["weights"], ["cuda_graph", "kv_cache"]]
    pushed = [details for name, details in engine.engine.calls if name == "update_weights_from_tensor"][0]
    assert "lm_head.weight" not in pushed["names"] and pushed["in_session"]  # tied to embed_tokens
    changed_dir = str(tokenizer.name_or_path) + "_changed"
    changed.save_pretrained(changed_dir)
    want = HFEngine(changed_dir, tokenizer, "cpu").generate(prompt, params)[0]
    got = engine.generate(prompt, params)[0]
    assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert engine.engine.unknown_names == []


def test_small_buckets_and_failed_pushes(stand_in, tiny_model_dir, tokenizer):
    """Many small buckets load the same weights; a push the engine refuses, and names it does not
    know, fail the sync with the reason instead of leaving stale weights behind."""
    engine = SGLangEngine(tiny_model_dir, tokenizer, dtype="float32", bucket_mb=0, api=stand_in)
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    engine.update_weights(state.items())
    pushes = [d for name, d in engine.engine.calls if name == "update_weights_from_tensor"]
    assert len(pushes) == len(state) - 1  # every tensor alone (bucket size 0), the tied head left out
    engine.engine.update_weights_from_tensor = lambda **kwargs: (False, "shape mismatch in layer 0")
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed: shape mismatch in layer 0"):
        engine.update_weights(state.items())


def _perturbed(model_dir: str, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return model


def _assert_generates_as(engine: SGLangEngine, model: torch.nn.Module, tokenizer, folder: str, prompts) -> None:
    """Greedy tokens and log-probs of `engine` equal a fresh embedded engine's on `model` (saved to `folder`)."""
    model.save_pretrained(folder)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    want = HFEngine(folder, tokenizer, "cpu").generate(prompts, params)
    for got, expected in zip(engine.generate(prompts, params), want):
        assert got.token_ids == expected.token_ids and got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def test_a_push_to_an_awake_engine_flushes_the_prefix_cache(stand_in, tiny_model_dir, tokenizer, tmp_path):
    """Pushed to an engine that kept its KV cache (no sleep), bucket by bucket without flushing (SGLang's
    `flush_cache=False`), with every tensor alone so q, k and v (and gate and up) arrive in separate buckets: the
    prompts generated before are not served from the prefix cache the old weights computed; one flush at the end."""
    engine = SGLangEngine(tiny_model_dir, tokenizer, dtype="float32", bucket_mb=0, api=stand_in)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("hello world", "a b c d")]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))  # their caches are kept
    changed = _perturbed(tiny_model_dir)
    engine.update_weights(changed.state_dict().items())
    _assert_generates_as(engine, changed, tokenizer, str(tmp_path / "changed"), prompts)
    pushes = [details for name, details in engine.engine.calls if name == "update_weights_from_tensor"]
    assert not any(push["flush_cache"] for push in pushes) and _calls(engine).count("flush_cache") == 1
    for part in ("q", "k", "v", "gate", "up"):
        assert any(push["names"] == [f"model.layers.0.{'mlp' if part in ('gate', 'up') else 'self_attn'}.{part}_proj"
                                     ".weight"] for push in pushes)


@pytest.mark.parametrize("checkpoint", ["tied-with-a-head-kept", "untied"])
def test_the_head_follows_the_push(stand_in, tiny_model_dir, tokenizer, tmp_path, checkpoint):
    """SGLang's head for a tied config is the embedding module, also where the checkpoint keeps an lm_head.weight
    beside it (as rl2's do; vLLM then unties): the push's lm_head.weight (the embeddings again) is not sent, and the
    embeddings move the head. An untied head is its own parameter: it is sent."""
    folder = str(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if checkpoint == "untied":
        model.config.tie_word_embeddings = False
        untied = type(model)(model.config)
        untied.load_state_dict({**model.state_dict(), "lm_head.weight": model.lm_head.weight.detach().clone() * 2})
        untied.save_pretrained(folder)
    else:
        from safetensors.torch import save_file

        model.save_pretrained(folder)
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        state["lm_head.weight"] = state["lm_head.weight"].clone()  # kept beside the embeddings, as rl2's are
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    engine = SGLangEngine(folder, tokenizer, dtype="float32", api=stand_in)
    changed = _perturbed(folder)
    assert changed.config.tie_word_embeddings == (checkpoint != "untied")
    engine.update_weights(changed.state_dict().items())  # tied: the embeddings twice, the second name not sent
    names = [name for call, details in engine.engine.calls if call == "update_weights_from_tensor"
             for name in details["names"]]
    assert ("lm_head.weight" in names) == (checkpoint == "untied") and engine.engine.unknown_names == []
    _assert_generates_as(engine, changed, tokenizer, str(tmp_path / "changed"),
                         [tokenizer("hello world", add_special_tokens=False)["input_ids"]])


class _WeightGroup:
    """The trainer's side of the weight group, in this process: each broadcast gives the next tensor."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = iter(tensors)

    def broadcast(self, tensors, options):
        tensors[0].copy_(next(self.tensors))
        return type("Work", (), {"wait": lambda self: None})()


def test_received_weights_load_in_a_session_and_flush_the_cache(stand_in, tiny_model_dir, tokenizer, tmp_path):
    """Split placement: `update_weights_from_distributed` runs between begin/end_weight_update (SGLang 0.5.21
    refuses it outside a session) and flushes the prefix cache, awake; asleep, the weights are resumed for it and
    the flush waits for the KV cache (wake)."""
    engine = SGLangEngine(tiny_model_dir, tokenizer, dtype="float32", api=stand_in)
    prompts = [tokenizer("hello world", add_special_tokens=False)["input_ids"]]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))  # cached
    for asleep in (False, True):
        changed = _perturbed(tiny_model_dir, seed=int(asleep))
        state = [(name, tensor) for name, tensor in changed.state_dict().items() if name != "lm_head.weight"]
        engine.engine.weight_groups["weights"] = _WeightGroup([tensor for _, tensor in state])
        if asleep:
            engine.sleep()
        start = len(engine.engine.calls)
        engine.receive_weights([name for name, _ in state], [str(t.dtype).removeprefix("torch.") for _, t in state],
                               [list(t.shape) for _, t in state], "weights")
        engine.wake()
        calls = [(name, details) for name, details in engine.engine.calls[start:] if name != "resume"]
        assert [name for name, _ in calls] == ["begin_weight_update", "update_weights_from_distributed",
                                               "end_weight_update"] + (["flush_cache"] if asleep else [])
        assert calls[1][1]["flush_cache"] is not asleep
        _assert_generates_as(engine, changed, tokenizer, str(tmp_path / f"changed{int(asleep)}"), prompts)


def test_first_sync_reads_back_one_vector_and_where_sglang_cannot_it_warns(stand_in, tiny_model_dir, tokenizer,
                                                                          caplog, monkeypatch):
    """SGLang 0.5.20/0.5.21 read parameters back for Llama-family models only (None for Qwen2): the first sync
    then warns instead of failing. Where it can, a push the engine did not load fails the sync; only a 1-D
    parameter is read (SGLang's read-back lists the whole tensor)."""
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    engine = SGLangEngine(tiny_model_dir, tokenizer, dtype="float32", api=stand_in)
    with caplog.at_level("WARNING", logger="rl2.engines.sglang"):
        engine.update_weights(state.items())  # Qwen2: nothing read back, a warning
    assert "weight sync not verified" in caplog.text and "Llama-family" in caplog.text
    reads = [details for name, details in engine.engine.calls if name == "get_weights_by_name"]
    assert [(r["parameter"], r["architecture"]) for r in reads] == [("model.norm.weight", "Qwen2ForCausalLM")]

    engine_module = sys.modules["sglang.engine"]
    monkeypatch.setattr(engine_module, "READBACK_ARCHITECTURES", {"Qwen2ForCausalLM"})  # as Llama's
    engine.verified = False
    changed = {name: tensor + 0.5 for name, tensor in state.items()}
    engine.engine.update_weights_from_tensor = lambda **kwargs: (True, "Success")  # accepted, not loaded
    with pytest.raises(RuntimeError, match="'model.norm.weight' differs from the actor's"):
        engine.update_weights(changed.items())
    del engine.engine.update_weights_from_tensor
    engine.update_weights(changed.items())  # loaded: verified
    reads = [details for name, details in engine.engine.calls if name == "get_weights_by_name"]
    assert all(len(r["shape"]) == 1 for r in reads)


def test_abort_and_refused_prompts(stand_in, tiny_model_dir, tokenizer):
    """abort() from another thread ends generations in flight with "abort"; a prompt the engine
    refuses (too long for the model) ends its trajectory with the engine's reason, not the run."""
    engine = SGLangEngine(tiny_model_dir, tokenizer, dtype="float32", api=stand_in)
    timer = threading.Timer(0.3, engine.abort)
    timer.start()
    start = time.time()
    aborted = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=100_000, ignore_eos=True))[0]
    assert aborted.finish_reason == "abort" and "aborted" in aborted.error and time.time() - start < 30
    assert ("abort", {"abort_all": True}) in engine.engine.calls  # sent from the engine's loop (else an error)
    engine.abort()  # nothing in flight: nothing is sent, and the next generation is not cut short
    kept = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert kept.finish_reason == "length" and _calls(engine).count("abort") == 1
    context = engine.engine.context_length
    prompts = [
        {"prompt_ids": [1] * (context + 5), "messages": [{"role": "user", "content": "long"}], "answer": None},
        {"prompt_ids": [1, 2, 3], "messages": [{"role": "user", "content": "short"}], "answer": None},
    ]
    long, short = rollout(engine, None, tokenizer, prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert long.done and long.response_length == 0 and "context length" in long.errors[0]
    assert short.response_length > 0 and not short.errors


def test_tp_size_that_does_not_fit(stand_in, tiny_model_dir, tokenizer):
    with pytest.raises(ValueError, match=r"rollout.tp_size=2 must divide the number of ranks \(world size 1\)"):
        SGLangEngine(tiny_model_dir, tokenizer, tp_size=2, api=stand_in)


TOOL_ENV = """
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)


def interact(messages):
    # Only conversations that ask for it go on: the ranks then need different numbers of turns.
    return [{"role": "tool", "content": "more"}] if "continue" in messages[0]["content"] else []
"""


def _ppo_args(model_dir: str, data: str, env: str, save_dir: str, *extra: str) -> list[str]:
    return [
        "-m", "rl2.trainer.ppo", f"data.path={data}", "data.shuffle=false", "data.prompts_per_rollout=4",
        "data.responses_per_prompt=2", f"actor.model_name={model_dir}", "actor.dtype=float32", "actor.lr=1e-3",
        "actor.gradient_checkpointing=false", f"actor.save_dir={save_dir}", f"rollout.env_path={env}",
        # Every token is a stop token: each turn is one token and ends with "stop", not at the length limit.
        "rollout.max_turns=3", f"rollout.train_sampling_params={{max_new_tokens: 6, stop_token_ids: {list(range(1024))}}}",
        "rollout.engine=sglang", "rollout.tp_size=2", "trainer.total_steps=2", "trainer.test_freq=null",
        "trainer.disable_wandb=true",
        # Rewards here are arbitrary; a group whose two rewards agree must still train.
        "rollout.dynamic_filtering=false", *extra,
    ]


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "engine-logprobs"])
def test_ppo_on_a_two_rank_engine_group(tiny_model_dir, tmp_path, recompute):
    """PPO on 2 ranks sharing one TP-2 engine: only rank 0 starts an engine; both ranks' prompts
    reach it, also when only rank 1 still has turns to take (rank 0 joins with no prompts); the
    weight payloads arrive in TP-rank order (checked by the stand-in); each step releases,
    resumes the weights, pushes, resumes the KV cache; and the engine's log-probs match the
    actor's after the push, so the pushed weights are the actor's."""
    data, env = tmp_path / "train.jsonl", tmp_path / "env.py"
    env.write_text(TOOL_ENV)
    # Rows 0-1 go to rank 0 and end after one turn; rows 2-3 go to rank 1 and take three.
    rows = ["stop", "stop", "continue", "continue"] * 2
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{word} {i}"}], "answer": ""}) + "\n"
                            for i, word in enumerate(rows)))
    log = tmp_path / "sglang_calls.jsonl"
    save_dir = tmp_path / "run"
    run_torchrun(
        _ppo_args(tiny_model_dir, str(data), str(env), str(save_dir), f"actor.recompute_logprobs={str(recompute).lower()}"),
        env={"PYTHONPATH": f"{STAND_IN}{os.pathsep}{REPO}", "STAND_IN_SGLANG_LOG": str(log)},
    )
    calls = [json.loads(line) for line in open(log)]
    assert {call["rank"] for call in calls} == {0}
    names = [call["call"] for call in calls]
    assert names.count("start") == 1
    step_end = names.index("release")
    # Turn 1: 2 ranks x 2 prompts x 2 responses; turns 2 and 3: rank 1's 4 trajectories only.
    assert [call.get("prompts") for call in calls[1:step_end]] == [8, 4, 4]
    assert names[step_end : step_end + 3] == ["release", "resume", "begin_weight_update"]
    after_push = names.index("end_weight_update")
    assert set(names[step_end + 3 : after_push]) == {"update_weights_from_tensor"}
    # the first sync is read back (Qwen2: SGLang cannot, a warning), then the KV cache resumes
    assert names[after_push + 1 : after_push + 5] == ["get_weights_by_name", "resume", "flush_cache", "generate"]
    assert calls[after_push + 2]["tags"] == ["cuda_graph", "kv_cache"]
    assert names.count("update_weights_from_tensor") == 2 * names[:after_push].count("update_weights_from_tensor")
    metrics = read_metrics(str(save_dir / "metrics.jsonl"))
    assert [row["step"] for row in metrics] == [1, 2]
    for row in metrics:
        assert row["logp_mismatch/mean"] < 1e-4, row
        assert ("logp_mismatch/max" in row) == recompute
        assert row["turns/mean"] == 2.0  # half the trajectories took 1 turn, half 3


def test_gpu_smoke_script_runs_against_the_stand_in(tmp_path):
    """bench/gpu_sglang_smoke.py (written for GPUs with SGLang) runs end to end on the stand-in:
    the script's own order of calls and its agreement checks work."""
    result = run_torchrun(
        ["bench/gpu_sglang_smoke.py", "--tp-size", "2", "--prompts", "4", "--max-new-tokens", "12",
         "--dtype", "float32", "--lr", "1e-3"],
        env={"PYTHONPATH": f"{STAND_IN}{os.pathsep}{REPO}", "TMPDIR": str(tmp_path)},
    )
    summary = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["ok"] and summary["mismatch_after_mean"] < 1e-5 and summary["step_moved_logps_mean"] > 1e-3


def test_search_on_a_two_rank_engine_group(tiny_model_dir, tmp_path):
    """`python -m rl2.search` on 2 ranks sharing one TP-2 engine: rank 0's problems end in the first
    round (no room for a step), rank 1's go on for three (a step ends at a '>', frequent in the random model's text); rank 0 keeps joining the engine's calls with
    no prompts until rank 1 is done, and the results of both come back in row order."""
    data, env = tmp_path / "problems.jsonl", tmp_path / "env.py"
    env.write_text("def reward_fn(messages, answer):\n    return 0.0\n")
    prompts = ["long " * 42, "long " * 42, "short", "short"]  # rows 1-2 on rank 0 (56 tokens), 3-4 on rank 1
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}], "answer": "1"}) + "\n"
                            for p in prompts))
    log = tmp_path / "sglang_calls.jsonl"
    run_torchrun(
        ["-m", "rl2.search", f"data.path={data}", f"actor.model_name={tiny_model_dir}", "actor.dtype=float32",
         f"rollout.env_path={env}", "rollout.engine=sglang", "rollout.tp_size=2", "data.max_length=60",
         "search.modes=[mcts]", "search.rollouts=1", "search.width=1", "search.max_depth=3",
         "search.max_step_tokens=8", "search.step_end='>'", "search.execute_code=false",
         f"search.output_dir={tmp_path / 'out'}"],
        env={"PYTHONPATH": f"{STAND_IN}{os.pathsep}{REPO}", "STAND_IN_SGLANG_LOG": str(log)},
    )
    calls = [json.loads(line) for line in open(log)]
    assert {call["rank"] for call in calls} == {0}
    generated = [call["prompts"] for call in calls if call["call"] == "generate"]
    solutions = [json.loads(line) for line in open(tmp_path / "out" / "mcts" / "solutions.jsonl")]
    trees = [json.loads(line)["tree"] for line in open(tmp_path / "out" / "mcts" / "trees.jsonl")]
    assert [s["row"] for s in solutions] == [1, 2, 3, 4]
    assert [s["tokens"] for s in solutions[:2]] == [0, 0] and all(s["tokens"] > 0 for s in solutions[2:])
    assert generated == [2, 2, 2]  # rank 1's two problems in each of three rounds, rank 0 joining with none
    assert all(not tree["children"] for tree in trees[:2])
