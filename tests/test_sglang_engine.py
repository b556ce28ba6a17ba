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
from collections.abc import Callable
from dataclasses import replace
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from unittest.mock import patch

from conftest import REPO, counting_prompts, run_python, run_torchrun, tokenize_prompt
from rl2.config import ConfigError, load_config
from rl2.config_checks import check_rl_config
from rl2.engines import HFEngine, SamplingParams, build_engine_from_config
from rl2.engines.base import Generation, Turn
from rl2.engines.sglang import (
    SGLANG_REQUIREMENT,
    SGLangEngine,
    _free_port,
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
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import Pause, continue_rollout, new_trajectories, rollout

pytestmark = pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins

STAND_IN = os.path.join(REPO, "tests", "sglang_stand_in")
SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None and STAND_IN not in sys.path


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@contextmanager
def _stand_in_modules():
    """The stand-in `sglang` importable (its API loaded) while it lasts; the real one (if any) is put back after."""
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


@pytest.fixture
def stand_in():
    """The stand-in `sglang` importable for one test."""
    with _stand_in_modules() as loaded:
        yield loaded


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


def test_r3_asks_sglang_for_the_routed_experts_and_hands_back_the_moe_layers(stand_in, tmp_path):
    """actor.router_replay=r3 with rollout.engine=sglang on a MoE model: the engine starts with
    enable_return_routed_experts, each request asks for them, and each generation's routes (SGLang's over every
    decoder layer, the MoE layers kept) are those a plain forward over the sample routes, cut with a stop string's
    cut; without r3 nothing is asked for."""
    from rl2.models.routing_replay import RoutingReplay
    from rl2.testing.tiny_moe import save_tiny_moe

    moe = save_tiny_moe(str(tmp_path / "moe"), "qwen3_moe")
    tokenizer = AutoTokenizer.from_pretrained(moe)
    plain = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)

    def plain_routes(tokens):
        with RoutingReplay(plain) as replay, torch.no_grad():
            replay.record()
            plain(input_ids=torch.tensor([tokens]), use_cache=False)
            return replay.routes().transpose(0, 1)[:-1]

    def engine_for(*overrides):
        config = load_config(["rollout.engine=sglang", f"actor.model_name={moe}", "actor.dtype=float32", *overrides])
        with patch("rl2.engines.sglang.load_sglang", return_value=stand_in):
            return build_engine_from_config(config.rollout, config.actor, tokenizer, seed=1)

    engine = engine_for("actor.router_replay=r3")
    assert engine.engine.args["enable_return_routed_experts"] is True
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 9)]
    generations = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10))
    for prompt, generation in zip(prompts, generations):
        assert generation.routes.dtype == torch.int8
        assert torch.equal(generation.routes, plain_routes(prompt + generation.token_ids))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    whole = engine.generate(prompts[1:2], greedy)[0]
    cut = engine.generate(prompts[1:2], replace(greedy, stop=[tokenizer.decode(whole.token_ids[2:4])]))[0]
    assert len(cut.token_ids) < len(whole.token_ids) and len(cut.routes) == len(prompts[1]) + len(cut.token_ids) - 1
    assert torch.equal(cut.routes, plain_routes(prompts[1] + cut.token_ids))
    engine.shutdown()
    off = engine_for()
    assert "enable_return_routed_experts" not in off.engine.args
    assert off.generate(prompts[:1], greedy)[0].routes is None
    off.shutdown()


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
def test_missing_sglang_fails_at_start(tiny_model_dir, tmp_path, monkeypatch):
    # not the stand-in either (the module's stand-in api may be importable on this worker while this runs)
    monkeypatch.setattr(sys, "path", [path for path in sys.path if path != STAND_IN])
    for name in [name for name in sys.modules if name == "sglang" or name.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
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


# ---- against the stand-in and the real SGLang ---------------------------------------------------
# The same test bodies run against the stand-in (SGLang's API run by the embedded engine: its calls are recorded and
# their order checked) and, where SGLang is installed (make test-sglang: its CPU engine), against SGLang itself: one
# engine per module and api (module-scoped), its tests on one xdist worker; a test that needs its own checkpoint
# starts its own engine.

REAL_ONLY = "SGLang is not installed here (make test-sglang runs these against it)"
API_PARAMS = [
    pytest.param("stand-in", marks=pytest.mark.xdist_group("sglang_stand_in")),
    pytest.param("sglang", marks=[pytest.mark.xdist_group("sglang_real"), pytest.mark.skipif(not SGLANG_INSTALLED,
                                                                                         reason=REAL_ONLY)]),
]


@pytest.fixture(scope="module", params=API_PARAMS)
def api(request):
    """SGLang's API: the stand-in's (its modules importable while the fixture lasts) or the real one."""
    if request.param == "sglang":
        yield load_sglang()
    else:
        with _stand_in_modules() as loaded:
            yield loaded


@pytest.fixture(scope="module")
def engine(api, tiny_model_dir, tokenizer):
    """One engine on the tiny model for the module (per api): every test pushes the weights it checks against."""
    engine = SGLangEngine(tiny_model_dir, tokenizer, dtype="float32", api=api)
    yield engine
    engine.shutdown()


def _recorded(engine: SGLangEngine) -> list[tuple[str, dict]] | None:
    """The stand-in's record of the adapter's calls (None on the real SGLang, which keeps none)."""
    return getattr(engine.engine, "calls", None)


def _calls(engine: SGLangEngine, start: int = 0) -> list[str]:
    return [name for name, _ in engine.engine.calls[start:]]


def _perturbed(model_dir: str, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return model


def _actor_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(token) of `tokens` after `prompt` under the HF model (fp32): what rl2's actor computes (T = 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _assert_generates_as(engine: SGLangEngine, model: torch.nn.Module, tokenizer, folder: str, prompts,
                         max_new_tokens: int = 8) -> list[Generation]:
    """Greedy tokens and log-probs of `engine` equal a fresh embedded engine's on `model` (saved to `folder`), and
    the log-probs the HF forward of `model` gives the tokens (the actor's)."""
    model.save_pretrained(folder)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    want = HFEngine(folder, tokenizer, "cpu").generate(prompts, params)
    got = engine.generate(prompts, params)
    for prompt, g, expected in zip(prompts, got, want):
        assert g.token_ids == expected.token_ids and g.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
        assert g.logprobs == pytest.approx(_actor_logprobs(model, prompt, g.token_ids), abs=1e-5)
    return got


def _ids(tokenizer, *texts: str) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


# First in the module: these start engines of their own, before the module's engine. SGLang's Engine.shutdown kills
# every child process of the caller (kill_process_tree(os.getpid(), include_parent=False)), the module engine's too.
@pytest.mark.parametrize("checkpoint", ["tied-with-a-head-kept", "untied"])
def test_the_head_follows_the_push(api, tiny_model_dir, tokenizer, tmp_path, checkpoint):
    """SGLang's head for a tied config is the embedding module, also where the checkpoint keeps an lm_head.weight
    beside it (as rl2's do; vLLM then unties): the push's lm_head.weight (the embeddings again) is not sent, and the
    embeddings move the head. An untied head is its own parameter: it is sent. (An engine of its own checkpoint.)"""
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
    engine = SGLangEngine(folder, tokenizer, dtype="float32", api=api)
    try:
        prompts = _ids(tokenizer, "hello world")
        _assert_generates_as(engine, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tokenizer,
                             str(tmp_path / "loaded"), prompts)  # the checkpoint's head, as loaded
        changed = _perturbed(folder)
        assert changed.config.tie_word_embeddings == (checkpoint != "untied")
        if checkpoint == "untied":
            with torch.no_grad():  # only the head moves: a head left stale would not follow
                for name, parameter in changed.named_parameters():
                    if name != "lm_head.weight":
                        parameter.copy_(model.state_dict()[name])
        engine.update_weights(changed.state_dict().items())  # tied: the embeddings twice, the second name not sent
        if _recorded(engine) is not None:
            names = [name for call, details in engine.engine.calls if call == "update_weights_from_tensor"
                     for name in details["names"]]
            assert ("lm_head.weight" in names) == (checkpoint == "untied") and engine.engine.unknown_names == []
        _assert_generates_as(engine, changed, tokenizer, str(tmp_path / "changed"), prompts)
    finally:
        engine.shutdown()


def test_generation_matches_the_embedded_engine(engine, tiny_model_dir, tokenizer, tmp_path):
    """Greedy tokens and log-probs through the adapter equal the embedded engine's and the HF forward's (fp32); eos
    ends a generation with the eos token kept; a multi-token stop string is cut on our side."""
    model = _perturbed(tiny_model_dir, seed=10)
    engine.update_weights(model.state_dict().items())
    prompts = _ids(tokenizer, "hello world", "a b c d", "x")
    want = _assert_generates_as(engine, model, tokenizer, str(tmp_path / "model"), prompts, max_new_tokens=12)
    stop_text = tokenizer.decode(want[0].token_ids[2:4])  # two generated tokens: a stop string the model says
    stopped = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=12, stop=[stop_text]))[0]
    assert stopped.finish_reason == "stop" and stop_text in tokenizer.decode(stopped.token_ids)
    assert len(stopped.token_ids) <= 4 and stopped.token_ids == want[0].token_ids[: len(stopped.token_ids)]
    stop_id = want[0].token_ids[1]
    eos = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_id]))[0]
    assert eos.finish_reason == "stop" and eos.token_ids == want[0].token_ids[: want[0].token_ids.index(stop_id) + 1]
    assert engine.generate([], SamplingParams(temperature=0.0, max_new_tokens=12)) == []


def test_sampled_logprobs_are_the_actors(engine, tiny_model_dir, tokenizer):
    """Sampled at temperature 1 (the tokens the engine draws), each token's log-prob is the actor's."""
    model = _perturbed(tiny_model_dir, seed=11)
    engine.update_weights(model.state_dict().items())
    prompts = _ids(tokenizer, "hello world", "the answer is")
    for prompt, generation in zip(prompts, engine.generate(
            prompts, SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True))):
        assert len(generation.token_ids) == 16 and generation.finish_reason == "length"
        assert generation.logprobs == pytest.approx(_actor_logprobs(model, prompt, generation.token_ids), abs=1e-5)


def test_release_push_resume_order(engine, tiny_model_dir, tokenizer, tmp_path, monkeypatch):
    """sleep releases everything; update_weights resumes the weights, pushes in a session and the pushed weights are
    the ones generating; wake resumes the KV cache. Out of order is an error."""
    freed = []
    monkeypatch.setattr(engine, "free_memory", lambda: freed.append(len(_recorded(engine) or [])))
    recorded = _recorded(engine)
    start = len(recorded) if recorded is not None else 0
    prompt = _ids(tokenizer, "hello world")
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine.generate(prompt, params)  # cached before the sleep
    engine.sleep()
    with pytest.raises(RuntimeError, match="call wake"):
        engine.generate(prompt, params)
    with pytest.raises(RuntimeError, match="update_weights comes before wake"):
        engine.wake()
    changed = _perturbed(tiny_model_dir, seed=12)
    engine.update_weights(changed.state_dict().items())
    engine.wake()
    _assert_generates_as(engine, changed, tokenizer, str(tmp_path / "changed"), prompt)
    if recorded is None:
        return
    calls = _calls(engine, start)
    calls = calls[calls.index("release"):]
    assert calls[: calls.index("generate")] == [
        "release", "resume", "begin_weight_update", "update_weights_from_tensor", "end_weight_update",
        *(["get_weights_by_name"] if "get_weights_by_name" in calls else []), "resume", "flush_cache",
    ]
    resumes = [start + i for i, (name, _) in enumerate(recorded[start:]) if name == "resume"]
    assert len(resumes) == 2 and set(resumes) <= set(freed)  # the allocator is emptied before every resume
    tags = [details["tags"] for name, details in recorded[start:] if name in ("release", "resume")]
    assert tags == [["cuda_graph", "kv_cache", "weights"], ["weights"], ["cuda_graph", "kv_cache"]]
    pushed = [details for name, details in recorded[start:] if name == "update_weights_from_tensor"][0]
    assert "lm_head.weight" not in pushed["names"] and pushed["in_session"]  # tied to embed_tokens
    assert engine.engine.unknown_names == []


def test_small_buckets_and_failed_pushes(engine, tiny_model_dir, tokenizer, tmp_path, monkeypatch):
    """Many small buckets (every tensor alone) load the same weights; a push the engine refuses fails the sync with
    the reason instead of leaving stale weights behind, and closes SGLang's weight-update session: the next push
    loads (SGLang refuses a second begin_weight_update while one is open)."""
    monkeypatch.setattr(engine, "bucket_bytes", 0)
    recorded = _recorded(engine)
    start = len(recorded) if recorded is not None else 0
    changed = _perturbed(tiny_model_dir, seed=13)
    state = changed.state_dict()
    engine.update_weights(state.items())
    if recorded is not None:
        pushes = [d for name, d in recorded[start:] if name == "update_weights_from_tensor"]
        assert len(pushes) == len(state) - 1  # every tensor alone (bucket size 0), the tied head left out
    _assert_generates_as(engine, changed, tokenizer, str(tmp_path / "changed"), _ids(tokenizer, "a b c d"))
    with monkeypatch.context() as patched:
        patched.setattr(engine.engine, "update_weights_from_tensor",
                        lambda **kwargs: (False, "shape mismatch in layer 0"), raising=False)
        with pytest.raises(RuntimeError, match="update_weights_from_tensor failed: shape mismatch in layer 0"):
            engine.update_weights(_perturbed(tiny_model_dir, seed=14).state_dict().items())
    again = _perturbed(tiny_model_dir, seed=15)
    engine.update_weights(again.state_dict().items())
    _assert_generates_as(engine, again, tokenizer, str(tmp_path / "again"), _ids(tokenizer, "a b c d"))


def test_a_push_to_an_awake_engine_flushes_the_prefix_cache(engine, tiny_model_dir, tokenizer, tmp_path,
                                                             monkeypatch):
    """Pushed to an engine that kept its KV cache (no sleep), bucket by bucket without flushing (SGLang's
    `flush_cache=False`), with every tensor alone so q, k and v (and gate and up) arrive in separate buckets: the
    prompts generated before are not served from the prefix cache the old weights computed; one flush at the end."""
    monkeypatch.setattr(engine, "bucket_bytes", 0)
    prompts = _ids(tokenizer, "hello world", "a b c d")
    before = _perturbed(tiny_model_dir, seed=16)
    engine.update_weights(before.state_dict().items())
    old = _assert_generates_as(engine, before, tokenizer, str(tmp_path / "before"), prompts)  # their caches kept
    recorded = _recorded(engine)
    start = len(recorded) if recorded is not None else 0
    changed = _perturbed(tiny_model_dir, seed=17)
    engine.update_weights(changed.state_dict().items())
    new = _assert_generates_as(engine, changed, tokenizer, str(tmp_path / "changed"), prompts)
    assert all(a.logprobs != b.logprobs for a, b in zip(old, new))  # the push changed what the engine computes
    if recorded is None:
        return
    pushes = [details for name, details in recorded[start:] if name == "update_weights_from_tensor"]
    assert not any(push["flush_cache"] for push in pushes) and _calls(engine, start).count("flush_cache") == 1
    for part in ("q", "k", "v", "gate", "up"):
        assert any(push["names"] == [f"model.layers.0.{'mlp' if part in ('gate', 'up') else 'self_attn'}.{part}_proj"
                                     ".weight"] for push in pushes)


class _WeightGroup:
    """The stand-in's weight group: the trainer's side, in this process (each broadcast gives the next tensor)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = iter(tensors)

    def broadcast(self, tensors, options):
        tensors[0].copy_(next(self.tensors))
        return type("Work", (), {"wait": lambda self: None})()


def _in_thread(action: Callable[[], Any]) -> Callable[[], Any]:
    """Run `action` in a thread now; the returned function waits for it and gives its result (or raises)."""
    box = {}

    def run():
        try:
            box["result"] = action()
        except BaseException as error:  # raised in the waiting thread
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait():
        thread.join(timeout=120)
        assert not thread.is_alive(), "the trainer's side of the weight group hangs"
        if "error" in box:
            raise box["error"]
        return box.get("result")

    return wait


def test_received_weights_load_in_a_session_and_flush_the_cache(api, engine, tiny_model_dir, tokenizer, tmp_path):
    """Split placement: the engine joins the trainer's weight group (gloo; the trainer is this process, rank 0);
    `update_weights_from_distributed` runs between begin/end_weight_update (SGLang 0.5.21 refuses it outside a session)
    and flushes the prefix cache, awake; asleep, the weights are resumed for it and the flush waits for the KV cache
    (wake). The engine then generates as the broadcast weights do."""
    real = _recorded(engine) is None
    group_name = f"weights_{os.getpid()}"
    if real:
        port = _free_port()
        joined = _in_thread(lambda: api.init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=group_name))
        engine.join_weight_group("127.0.0.1", port, 2, group_name)
        trainer_group = joined()
    prompts = _ids(tokenizer, "hello world")
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))  # cached
    for asleep in (False, True):
        changed = _perturbed(tiny_model_dir, seed=20 + int(asleep))
        state = [(name, tensor) for name, tensor in changed.state_dict().items() if name != "lm_head.weight"]
        if real:
            def send(tensors=[tensor for _, tensor in state]):
                for tensor in tensors:
                    dist.broadcast(tensor, src=0, group=trainer_group)
        else:
            engine.engine.weight_groups[group_name] = _WeightGroup([tensor for _, tensor in state])
        if asleep:
            engine.sleep()
        start = 0 if real else len(engine.engine.calls)
        sent = _in_thread(send) if real else (lambda: None)
        engine.receive_weights([name for name, _ in state], [str(t.dtype).removeprefix("torch.") for _, t in state],
                               [list(t.shape) for _, t in state], group_name)
        sent()
        engine.wake()
        if not real:
            calls = [(name, details) for name, details in engine.engine.calls[start:] if name != "resume"]
            assert [name for name, _ in calls] == ["begin_weight_update", "update_weights_from_distributed",
                                                   "end_weight_update"] + (["flush_cache"] if asleep else [])
            assert calls[1][1]["flush_cache"] is not asleep
        _assert_generates_as(engine, changed, tokenizer, str(tmp_path / f"changed{int(asleep)}"), prompts)


def test_abort_keeps_the_tokens_and_refused_prompts(engine, tiny_model_dir, tokenizer, tmp_path):
    """abort() from another thread ends generations in flight with "abort", the tokens drawn kept with the actor's
    log-probs; a push right after it loads (nothing left running blocks its cache flush). A prompt the engine
    refuses (too long for the model) ends its trajectory with the engine's reason, not the run; one with less room
    than max_new_tokens generates what fits."""
    model = _perturbed(tiny_model_dir, seed=30)
    engine.update_weights(model.state_dict().items())
    timer = threading.Timer(1.0, engine.abort)
    timer.start()
    start = time.time()
    aborted = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=100_000, ignore_eos=True))[0]
    assert aborted.finish_reason == "abort" and "bort" in aborted.error and time.time() - start < 60
    assert 0 < len(aborted.token_ids) == len(aborted.logprobs)
    assert aborted.logprobs == pytest.approx(_actor_logprobs(model, [1, 2, 3], aborted.token_ids), abs=1e-5)
    if _recorded(engine) is not None:
        assert ("abort", {"abort_all": True}) in engine.engine.calls  # sent from the engine's loop (else an error)
    changed = _perturbed(tiny_model_dir, seed=31)
    engine.update_weights(changed.state_dict().items())  # at once: the aborted request is gone from the scheduler
    _assert_generates_as(engine, changed, tokenizer, str(tmp_path / "changed"), _ids(tokenizer, "a b c d"))
    aborts = _calls(engine).count("abort") if _recorded(engine) is not None else None
    engine.abort()  # nothing in flight: nothing is sent, and the next generation is not cut short
    kept = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert kept.finish_reason == "length" and len(kept.token_ids) == 5
    if aborts is not None:
        assert _calls(engine).count("abort") == aborts
    context = AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings
    prompts = [
        {"prompt_ids": [1] * (context + 5), "messages": [{"role": "user", "content": "long"}], "answer": None},
        {"prompt_ids": [1, 2, 3], "messages": [{"role": "user", "content": "short"}], "answer": None},
        {"prompt_ids": [1] * (context - 12), "messages": [{"role": "user", "content": "almost"}], "answer": None},
    ]
    long, short, almost = rollout(engine, None, tokenizer, prompts, 1,
                                  SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    assert long.done and long.response_length == 0 and "context length" in long.errors[0]
    assert short.response_length == 16 and not short.errors
    assert 0 < almost.response_length <= 16 and not almost.errors  # SGLang: the 12 tokens of room it has


MULTI_TURN_ENV = """
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)


def interact(messages):
    # Conversations that ask for it go on for another turn (with the tool's answer); the others end.
    return [{"role": "tool", "content": "more " + str(len(messages))}] if "continue" in messages[0]["content"] else []
"""


def test_multi_turn_rollout_equals_the_embedded_engines(engine, tiny_model_dir, tokenizer, tmp_path):
    """`rl2.rollout.multi_turn.rollout` with a tool (some conversations take three turns, some one), greedy: the
    trajectories' tokens, masks and behaviour log-probs equal those of the embedded engine on the same weights."""
    model = _perturbed(tiny_model_dir, seed=40)
    engine.update_weights(model.state_dict().items())
    model.save_pretrained(str(tmp_path / "model"))
    (tmp_path / "env.py").write_text(MULTI_TURN_ENV)
    rows = [{"messages": [{"role": "user", "content": f"{word} {i}"}], "answer": ""}
            for i, word in enumerate(["continue", "stop", "continue please"])]
    for row in rows:
        row["prompt_ids"] = tokenize_prompt(row["messages"], tokenizer)
    # A turn that ends at its length limit ends the episode: here every token stops a turn (one token each).
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=list(range(len(tokenizer))))
    with Env(str(tmp_path / "env.py"), workers=0) as env:
        got = rollout(engine, env, tokenizer, rows, 2, params, max_turns=3, max_length=200)
        want = rollout(HFEngine(str(tmp_path / "model"), tokenizer, "cpu"), env, tokenizer, rows, 2, params,
                       max_turns=3, max_length=200)
    assert [t.turns for t in got] == [t.turns for t in want] and max(t.turns for t in got) == 3
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.action_mask == w.action_mask and g.messages == w.messages
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5) and g.reward == w.reward


def test_a_cut_generation_goes_on_from_its_tokens(engine, tiny_model_dir, tokenizer):
    """A turn cut by a pause (partial rollout) goes on from the tokens it drew, prefilled again: greedy, the rest
    equals the uncut generation's rest; sampled, the tokens are the drawn ones and their log-probs the actor's
    (SGLang has no per-request random stream to resume: what is drawn after the cut is a new draw)."""
    model = _perturbed(tiny_model_dir, seed=50)
    engine.update_weights(model.state_dict().items())
    prompt = [11, 12, 13, 14]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=16, ignore_eos=True)
        whole = engine.generate([prompt], params)[0]
        drawn = whole.token_ids[:6]  # as if the pause had come after 6 tokens
        results = []
        engine.generate_turns([Turn(prompt + drawn, 10, whole.stream, len(drawn))], params,
                              lambda index, generation: results.append(generation), max_turns=1)
        rest = results[0]
        assert len(rest.token_ids) == 10 and rest.finish_reason == "length"
        if temperature == 0.0:
            assert drawn + rest.token_ids == whole.token_ids
            assert rest.logprobs == pytest.approx(whole.logprobs[6:], abs=1e-5)
        expected = _actor_logprobs(model, prompt, drawn + rest.token_ids)[len(drawn):]
        assert rest.logprobs == pytest.approx(expected, abs=1e-5)


def test_a_paused_rollout_resumes_token_for_token(engine, tiny_model_dir, tokenizer):
    """Partial rollout's pause and resume on the engine, greedy: a pause in flight (`Pause.now()` from another thread)
    aborts the generations, which keep the tokens drawn; continued from those (under policy version 1), every
    trajectory has the tokens and log-probs of a rollout never paused."""
    model = _perturbed(tiny_model_dir, seed=60)
    engine.update_weights(model.state_dict().items())
    params = SamplingParams(temperature=0.0, max_new_tokens=600, ignore_eos=True)
    batch = counting_prompts(tokenizer, 2)
    start = time.monotonic()
    whole = rollout(engine, None, tokenizer, batch, 1, params)
    trajectories = new_trajectories(batch, 1)
    pause = Pause(engine)
    timer = threading.Timer((time.monotonic() - start) / 3, pause.now)  # a third of the way, on any machine
    timer.start()
    continue_rollout(engine, None, tokenizer, trajectories, params, pause=pause)
    timer.join()
    drawn = [t.response_length for t in trajectories]
    assert all(not t.done for t in trajectories) and all(0 < n < 600 for n in drawn), drawn  # paused in flight
    continue_rollout(engine, None, tokenizer, trajectories, params, version=1)
    for t, expected, n in zip(trajectories, whole, drawn):
        assert t.done and t.token_ids == expected.token_ids and t.response_length == 600
        assert t.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
        generated = [v for v, m in zip(t.versions, t.action_mask) if m]
        assert generated == [0] * n + [1] * (600 - n)


TP_GROUP_SCRIPT = """
import json, multiprocessing, os, sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl2.engines import SamplingParams
from rl2.engines.sglang import SGLangEngine

if __name__ == "__main__":  # SGLang spawns its processes
    model_dir, changed_dir, out, tp_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Each rank's own authkey, as under the real torchrun (ranks forked by the tests' launcher share the parent's):
    # SGLang's second TP rank fetches rank 1's pushed buckets from rank 1's process.
    multiprocessing.current_process().authkey = os.urandom(32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = SGLangEngine(model_dir, tokenizer, dtype="float32", tp_size=tp_size, bucket_mb=0)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"]
               for text in (["hello world", "a b c d"] if rank == 0 else ["x", "the answer is"])]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(prompts, params)
    changed = AutoModelForCausalLM.from_pretrained(changed_dir, dtype=torch.float32).state_dict()
    engine.sleep()
    engine.update_weights(changed.items())  # every tensor a bucket: q/k/v and gate/up split between them
    engine.wake()
    after = engine.generate(prompts if rank == 0 else [], params)  # rank 1 joins with none
    awake = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    engine.update_weights(awake.items())  # back to the first weights, awake: the prefix cache flushed
    again = engine.generate(prompts, params)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"prompts": prompts, **{name: [[g.token_ids, g.logprobs] for g in generations]
                                          for name, generations in (("before", before), ("after", after),
                                                                    ("again", again))}}, f)
    engine.shutdown()
    dist.destroy_process_group()
"""


@pytest.mark.skipif(not SGLANG_INSTALLED, reason=REAL_ONLY)
@pytest.mark.xdist_group("sglang_real_tp")
@pytest.mark.parametrize("tp_size", [2, 1], ids=["one TP-2 engine", "an engine per rank"])
def test_two_ranks_share_one_tp2_engine(tiny_model_dir, tokenizer, tmp_path, tp_size):
    """2 ranks (torchrun, gloo) share ONE SGLang engine of TP 2 (rank 0's; its 2 CPU ranks), or hold one engine each
    (TP 1; SGLang picks a CPU rank's cores by its gpu id: the second engine of the node needs a second share): each
    rank's prompts come back to it, generated greedily as the model (TP 1 and the HF forward) does; a push from both
    ranks (after a sleep, and awake) loads the new weights into every TP rank's shard (each rank with its own
    multiprocessing authkey, as under torchrun); a rank may join a call with no prompts."""
    changed = _perturbed(tiny_model_dir, seed=70)
    changed.save_pretrained(str(tmp_path / "changed"))
    (tmp_path / "tp.py").write_text(TP_GROUP_SCRIPT)
    run_torchrun([str(tmp_path / "tp.py"), tiny_model_dir, str(tmp_path / "changed"), str(tmp_path / "out"),
                  str(tp_size)], timeout=400, env={"PYTHONPATH": REPO, "SGLANG_CPU_OMP_THREADS_BIND": None})
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for rank in (0, 1):
        result = json.load(open(tmp_path / f"out.{rank}.json"))
        prompts = result["prompts"]
        expected = {"before": (original, tiny_model_dir), "after": (changed, str(tmp_path / "changed")),
                    "again": (original, tiny_model_dir)}
        for name, (model, folder) in expected.items():
            got = result[name]
            if name == "after" and rank == 1:
                assert got == []
                continue
            want = HFEngine(folder, tokenizer, "cpu").generate(prompts, params)
            assert len(got) == len(prompts)
            for prompt, (tokens, logprobs), w in zip(prompts, got, want):
                assert tokens == w.token_ids, (rank, name)
                assert logprobs == pytest.approx(_actor_logprobs(model, prompt, tokens), abs=1e-5), (rank, name)
        assert result["before"] != result["after"] or rank == 1


# ---- against the stand-in only --------------------------------------------------------------


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


# Whole runs against the stand-in, in `make test`; where SGLang is installed (make test-sglang: its time goes to the
# real engine's tests, test_two_ranks_share_one_tp2_engine for the TP group) they are left to that run.
STAND_IN_RUN = pytest.mark.skipif(SGLANG_INSTALLED, reason="a stand-in run of several processes: make test runs it "
                                                           "(here the real TP-2 engine's test covers the group)")


@STAND_IN_RUN
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
    assert [call.get("prompts") for call in calls[1:step_end - 1]] == [8, 4, 4]
    assert names[step_end - 1] == "flush_cache"  # the release waits for an idle engine (a flush that succeeds)
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


@STAND_IN_RUN
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


@STAND_IN_RUN
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


def test_cpu_threads_binding_gives_every_sglang_rank_of_the_node_a_share():
    """SGLang gives its CPU rank of gpu id g the g-th share: one per rank of the node, contiguous where there are
    enough cores, a core each (taken in turn) where there are fewer."""
    from rl2.engines.sglang import cpu_threads_binding

    assert cpu_threads_binding(2, [0, 1]) == "0|1"
    assert cpu_threads_binding(2, list(range(8))) == "0-3|4-7"
    assert cpu_threads_binding(1, [0, 1]) == "0-1"
    assert cpu_threads_binding(2, [0, 2, 4, 6]) == "0,2|4,6"
    assert cpu_threads_binding(3, [0, 1]) == "0|1|0"


# ---- vision-language models on the real SGLang (issue 68) -----------------------------------------------------------
# One family per tested release (an engine start each): Qwen2.5-VL, whose checkpoint stores other names than its
# transformers model holds, on 0.5.21; Qwen3-VL (DeepStack) on 0.5.23.
VLM_FAMILY_OF_RELEASE = {"0.5.21": "qwen2_5_vl", "0.5.23": "qwen3_vl"}


@pytest.mark.xdist_group("sglang_vlm")
@pytest.mark.skipif(not SGLANG_INSTALLED, reason=REAL_ONLY)
def test_the_real_sglang_generates_with_images_as_the_embedded_engine_and_loads_pushed_towers(tmp_path):
    """Images reach SGLang's own vision tower as rl2's processor output: greedy tokens equal the embedded engine's,
    log-probs within 1e-5 (fp32). A push of every weight, the vision tower's included, then generates as a fresh
    engine on those weights: the pushed names are the checkpoint's (SGLang's Qwen2.5-VL skips others silently, or
    fails on the tower's MLP), and with `image_embedding_cache=False` SGLang does not serve the images it has seen
    with the old tower's embeddings."""
    from test_vision_engine import generates_as_the_hf_engine_before_and_after_a_push, save_vlm

    api = load_sglang()
    family = VLM_FAMILY_OF_RELEASE.get(api.version, "qwen3_vl")
    vlm_dir = save_vlm(str(tmp_path / family), family, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    engine = SGLangEngine(vlm_dir, tokenizer, dtype="float32", api=api, image_embedding_cache=False)
    generates_as_the_hf_engine_before_and_after_a_push(engine, vlm_dir, tokenizer, str(tmp_path / "pushed"), 1e-5)
