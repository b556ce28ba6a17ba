"""Stand-in for `sglang.Engine`: the calls rl2 makes, with SGLang's outputs and failure modes.

Generation runs rl2's embedded engine on CPU in this process. Every call is appended to
`calls` and, when STAND_IN_SGLANG_LOG names a file, to that file as a JSON line.
"""

import asyncio
import json
import logging
import multiprocessing
import os
import signal
import threading
from types import SimpleNamespace

import torch
from transformers.core_model_loading import revert_weight_conversion

from rl2.engines.routed_experts import RouteLayout
from sglang.srt.utils import producer_and_payload
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

logger = logging.getLogger("sglang.stand_in")

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")
# The architectures whose SGLang model implements get_weights_by_name in 0.5.20/0.5.21; for the others
# (Qwen2 among them) the weight exporter catches the AttributeError and returns None.
READBACK_ARCHITECTURES = {"LlamaForCausalLM", "GraniteForCausalLM", "OPTForCausalLM", "Exaone4ForCausalLM"}
REQUIRED_ARGS = ("model_path", "tp_size", "mem_fraction_static", "base_gpu_id", "random_seed")
# SGLang 0.5.21 (which has begin/end_weight_update, as this stand-in does) refuses a load outside a session:
# managers/scheduler_components/weight_updater.py, update_weights_from_tensor / _from_distributed.
SESSION_NEEDED = "{call} must run between begin_weight_update() and end_weight_update()"


class Engine:
    def __init__(self, **kwargs):
        from rl2.engines.hf import HFEngine

        missing = [key for key in REQUIRED_ARGS if key not in kwargs]
        if missing:
            raise TypeError(f"stand-in sglang.Engine: missing {missing}")
        if "TORCHELASTIC_USE_AGENT_STORE" in os.environ:
            raise RuntimeError("TORCHELASTIC_USE_AGENT_STORE is set: SGLang hangs at start-up under torchrun")
        self.args = kwargs
        self.tp_size = kwargs["tp_size"]
        self.skip_tokenizer_init = kwargs.get("skip_tokenizer_init", False)
        self.rank = int(os.environ.get("RANK", 0))
        self.calls: list[tuple] = []
        self.released: set[str] = set()
        self.in_update = False
        self.unknown_names: list[str] = []
        self.weight_groups: dict = {}  # init_weights_update_group's groups, by name
        # SGLang's start-up changes the calling process (server_args / _set_envs_and_config).
        os.environ.update({"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "8",
                           "CUDA_MODULE_LOADING": "AUTO", "SGLANG_RUN_ID": "stand-in"})
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        multiprocessing.set_start_method("spawn", force=True)
        no_tokenizer = SimpleNamespace(eos_token_id=None, pad_token_id=None)  # eos from the model's config
        dtype = kwargs.get("dtype", "float32")
        # SGLang's --enable-return-routed-experts: the embedded engine records them (a MoE model's)
        self.return_routes = kwargs.get("enable_return_routed_experts", False)
        self.hf = HFEngine(kwargs["model_path"], no_tokenizer, "cpu", dtype=dtype if dtype != "auto" else "float32",
                           seed=kwargs["random_seed"], record_routes=self.return_routes)
        self.route_layout = RouteLayout.of(kwargs["model_path"]) if self.return_routes else None
        self.context_length = getattr(self.hf.model.config, "max_position_embeddings", 1 << 30)
        self.tokenizer_manager = SimpleNamespace(abort_request=self._abort_request)
        # SGLang's Engine drives its tokenizer manager (and its ZMQ sockets) from this loop, in the thread
        # that calls generate: run_until_complete.
        self.loop = asyncio.new_event_loop()
        self._record("start", tp_size=self.tp_size, base_gpu_id=kwargs["base_gpu_id"])

    def _record(self, name: str, **details) -> None:
        self.calls.append((name, details))
        path = os.environ.get("STAND_IN_SGLANG_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"rank": self.rank, "call": name, **details}, default=str) + "\n")

    # ---- generation ------------------------------------------------------------------------

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, image_data=None,
                 return_routed_experts=False, **kwargs):
        from rl2.engines.base import SamplingParams

        if return_routed_experts and not self.return_routes:
            raise ValueError("return_routed_experts needs the engine started with enable_return_routed_experts")
        if self.released:
            raise RuntimeError(f"generate with released memory {sorted(self.released)}: SGLang would crash here")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        prompts = [input_ids] if single else list(input_ids)
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(prompts)
        images = self._images(prompts, [image_data] if single and image_data is not None else image_data)
        self._record("generate", prompts=len(prompts),
                     max_new_tokens=sorted({p.get("max_new_tokens") for p in params_list}),
                     images=[0 if i is None else i.count for i in images], image_data=image_data is not None)
        outputs = [None] * len(prompts)
        by_params: dict[str, list[int]] = {}
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            if params.get("stop") and self.skip_tokenizer_init:
                raise ValueError("stop strings need the tokenizer: SGLang rejects them with skip_tokenizer_init")
            if len(prompt) >= self.context_length:
                outputs[i] = _output([], [], {"type": "abort", "message": f"input of {len(prompt)} tokens is longer "
                                              f"than the model's context length {self.context_length}"}, return_logprob)
                continue
            by_params.setdefault(json.dumps(params, sort_keys=True), []).append(i)
        for key, indices in by_params.items():
            params = json.loads(key)
            ours = SamplingParams(
                temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0), top_k=params.get("top_k", -1),
                max_new_tokens=params.get("max_new_tokens", 128), stop_token_ids=params.get("stop_token_ids") or [],
                ignore_eos=params.get("ignore_eos", False),
            )
            batch = [prompts[i] for i in indices], ours, [images[i] for i in indices]
            generated = self.loop.run_until_complete(self.loop.run_in_executor(
                None, lambda: self.hf.generate(batch[0], batch[1], images=batch[2])))
            for i, generation in zip(indices, generated):
                if generation.finish_reason == "stop":
                    reason = {"type": "stop", "matched": generation.token_ids[-1]}
                elif generation.finish_reason == "length":
                    reason = {"type": "length", "length": len(generation.token_ids)}
                else:
                    reason = {"type": "abort", "message": "Abort in waiting queue"}
                outputs[i] = _output(generation.token_ids, generation.logprobs, reason, return_logprob)
                if return_routed_experts and generation.routes is not None:  # int32 [prompt + output - 1, decoder layers, k], base64 (SGLang's)
                    outputs[i]["meta_info"]["routed_experts"] = self.route_layout.encode(generation.routes)
        return outputs[0] if single else outputs

    def _images(self, prompts, image_data) -> list:
        """Each request's images from `image_data` (one entry per request: None, or a list of `processor_output`
        dicts with `pixel_values` and `image_grid_thw`, as SGLang's offline API takes a processor's output beside
        pre-expanded `input_ids`). Strict where SGLang would fail: a length that is not the batch's, an item of
        another format, image-pad tokens that do not match the grids (SGLang's "image features and image tokens do
        not match"), images for a model without a vision tower."""
        from rl2.vision.image_inputs import ImageInputs

        if image_data is None:
            return [None] * len(prompts)
        if len(image_data) != len(prompts):
            raise ValueError(f"image_data has {len(image_data)} entries for {len(prompts)} requests")
        config = self.hf.model.config
        if not getattr(self.hf, "vision", False):
            raise ValueError("image_data for a model that is not multimodal")
        images = []
        for prompt, items in zip(prompts, image_data):
            if items is None:
                images.append(None)
                continue
            parts = []
            for item in items:
                if not isinstance(item, dict) or item.get("format") != "processor_output":
                    raise ValueError(f"stand-in: image_data items must be processor_output dicts, got {item!r:.80}")
                if not isinstance(item.get("pixel_values"), torch.Tensor) or not isinstance(
                        item.get("image_grid_thw"), torch.Tensor):
                    raise ValueError("a processor_output item needs pixel_values and image_grid_thw tensors")
                parts.append(ImageInputs(item["pixel_values"], item["image_grid_thw"]))
            request_images = ImageInputs.concat(parts)
            pads = sum(1 for token in prompt if token == config.image_token_id)
            merge = config.vision_config.spatial_merge_size
            expected = int((request_images.image_grid_thw.prod(-1) // merge**2).sum()) if request_images else 0
            if pads != expected:
                raise ValueError(f"image features and image tokens do not match: tokens {pads}, features {expected}")
            images.append(request_images)
        return images

    def _abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not self.loop.is_running() or asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("abort_request outside the engine's event loop: SGLang's ZMQ sockets are not "
                               "thread-safe (schedule it with engine.loop.call_soon_threadsafe)")
        self._record("abort", abort_all=abort_all)
        if abort_all:
            self.hf.abort()

    # ---- memory ----------------------------------------------------------------------------

    def release_memory_occupation(self, tags=None):
        tags = list(tags or ALL_TAGS)
        self._record("release", tags=sorted(tags))
        if "weights" in tags:  # no CPU backup: the weights are gone until pushed again
            with torch.no_grad():
                for parameter in self.hf.model.parameters():
                    parameter.zero_()
        if "weights" in tags or "kv_cache" in tags:
            self.hf.flush_cache()
        self.released |= set(tags)

    def resume_memory_occupation(self, tags=None):
        tags = list(tags or ALL_TAGS)
        self._record("resume", tags=sorted(tags))
        if not set(tags) <= self.released:  # torch_memory_saver refuses to resume a region that is not paused
            raise RuntimeError(f"resume_memory_occupation({sorted(tags)}) with only {sorted(self.released)} released")
        self.released -= set(tags)

    def flush_cache(self):
        self._record("flush_cache")
        if "kv_cache" in self.released:
            raise RuntimeError("flush_cache with the KV cache released")
        self.hf.flush_cache()

    # ---- weights ---------------------------------------------------------------------------

    def begin_weight_update(self):
        assert not self.in_update, "begin_weight_update called while a weight-update session is already open"
        self.in_update = True
        self._record("begin_weight_update")
        return True, "Success"

    def end_weight_update(self):
        assert self.in_update, "end_weight_update without begin_weight_update"
        self.in_update = False
        self._record("end_weight_update")
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if load_format != "flattened_bucket":
            return False, f"stand-in supports load_format='flattened_bucket' only, got {load_format!r}"
        if "weights" in self.released:
            return False, "weights are released: resume_memory_occupation(['weights']) first"
        if not self.in_update:
            return False, SESSION_NEEDED.format(call="update_weights_from_tensor")
        if len(named_tensors) != self.tp_size:
            return False, f"{len(named_tensors)} payloads for {self.tp_size} TP ranks"
        buckets = []
        for tp_rank, payload in enumerate(named_tensors):
            producer, flattened = producer_and_payload(payload)
            if producer != self.rank + tp_rank:
                return False, f"payload {tp_rank} was made by rank {producer}, not by TP rank {tp_rank}'s rank"
            buckets.append(FlattenedTensorBucket(flattened_tensor=flattened["flattened_tensor"],
                                                 metadata=flattened["metadata"]).reconstruct_tensors())
        names = [name for name, _ in buckets[0]]
        self._record("update_weights_from_tensor", names=names, dtypes=sorted({str(t.dtype) for _, t in buckets[0]}),
                     in_session=self.in_update, flush_cache=flush_cache)
        for other in buckets[1:]:
            if [n for n, _ in other] != names or any(not torch.equal(a, b) for (_, a), (_, b) in zip(buckets[0], other)):
                return False, "TP ranks sent different weights"
        self._load(buckets[0], flush_cache)
        return True, "Succeeded to update parameter online."

    def _load(self, named_tensors, flush_cache: bool) -> None:
        """Copy pushed weights into the model, as SGLang's loader does: each tensor on its own (SGLang writes
        a q/k/v or gate/up shard into its slice of the fused parameter alone), the tied head skipped (the
        head is the embeddings), unknown names logged and ignored. Without `flush_cache` the prefix cache
        (the embedded engine's kept slots) stays, computed by the old weights, as SGLang's radix cache does.
        Names are the checkpoint's, as SGLang's `load_weights` takes them (a Qwen2.5-VL's `visual.*`, not the
        transformers model's `model.visual.*`)."""
        state = stored_state_dict(self.hf.model)
        tied = getattr(self.hf.model.config, "tie_word_embeddings", False)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if tied and name == "lm_head.weight":
                    continue  # SGLang skips it and ties the head to embed_tokens
                if name not in state:
                    logger.warning(f"unknown parameter {name} (ignored, as SGLang does)")
                    self.unknown_names.append(name)
                    continue
                state[name].copy_(tensor)
        if flush_cache:
            self.hf.flush_cache()

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        """The TP workers join the trainer's group (here the one process stands for the engine's only worker:
        the tests run TP 1 engines this way)."""
        from sglang.srt.utils import init_custom_process_group

        if self.tp_size != 1:
            return False, "stand-in: the weight group needs tp_size=1 (one process stands for the engine's workers)"
        self._record("init_weights_update_group", rank_offset=rank_offset, world_size=world_size, backend=backend)
        self.weight_groups[group_name] = init_custom_process_group(
            backend="gloo", init_method=f"tcp://{master_address}:{master_port}", world_size=world_size,
            rank=rank_offset, group_name=group_name)
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache=True, **kwargs):
        import torch.distributed as dist

        group = self.weight_groups.get(group_name)
        if group is None:
            return False, f"no weight update group {group_name!r}: init_weights_update_group first"
        if "weights" in self.released:
            return False, "weights are released: resume_memory_occupation(['weights']) first"
        if not self.in_update:
            return False, SESSION_NEEDED.format(call="update_weights_from_distributed")
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype))
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([tensor], options).wait()
            received.append((name, tensor))
        self._record("update_weights_from_distributed", names=len(names), dtypes=sorted(set(map(str, dtypes))),
                     flush_cache=flush_cache)
        self._load(received, flush_cache)
        return True, "Succeeded to update parameter online from distributed."

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        parameter = self.hf.model.state_dict().get(name)
        architecture = type(self.hf.model).__name__
        self._record("get_weights_by_name", parameter=name, architecture=architecture,
                     shape=None if parameter is None else list(parameter.shape))
        if architecture not in READBACK_ARCHITECTURES or parameter is None:
            return None
        return parameter.tolist()[:truncate_size]  # as SGLang's Llama: the whole tensor to a list, then cut

    def shutdown(self):
        self._record("shutdown")


def _output(token_ids, logprobs, finish_reason, return_logprob) -> dict:
    meta = {"finish_reason": finish_reason, "prompt_tokens": 0, "completion_tokens": len(token_ids)}
    if return_logprob:
        meta["output_token_logprobs"] = [(logprob, token, None) for logprob, token in zip(logprobs, token_ids)]
    return {"output_ids": list(token_ids), "meta_info": meta}


def stored_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict under its checkpoint's names (what `save_pretrained` writes, as it loaded them)."""
    state = {}
    for name, tensor in model.state_dict().items():
        stored = list(revert_weight_conversion(model, {name: tensor}))
        state[stored[0] if len(stored) == 1 else name] = tensor
    return state
