"""The SGLang rollout engine: one tensor-parallel SGLang engine per group of `rollout.tp_size` ranks.

Every rank is one trainer process. The ranks of a group (see `tp_group`) share one in-process
`sglang.Engine` owned by the group's first rank, the leader; SGLang runs its TP ranks as
scheduler processes on the group's GPUs. Each call is collective over the group:

- `generate`: the group's prompts are gathered on the leader, generated in one batch, and the
  outputs broadcast back; each rank keeps its own.
- `update_weights`: every rank flattens each bucket of its full weights (on its own GPU) and
  serialises it as CUDA IPC handles; the leader gathers one payload per TP rank, in TP-rank
  order, and posts them with `update_weights_from_tensor(load_format="flattened_bucket")`, so
  each SGLang TP rank reads the copy on its own GPU. SGLang 0.5.21 loads only inside a
  `begin_weight_update` / `end_weight_update` session (0.5.20 has none); the prefix (radix) cache is
  flushed once at the end. The first sync is checked by reading one
  1-D parameter back (SGLang only logs names it does not know); SGLang 0.5.20/0.5.21 read back
  for Llama-family models only and return None for the others (Qwen2 included): the check is
  then skipped with a warning.
- `sleep` / `wake`: `release_memory_occupation` / `resume_memory_occupation` (SGLang's memory
  saver). Released weights are not backed up: after `sleep`, `update_weights` brings them
  back (it resumes the weights' memory first), then `wake` resumes the KV cache. Before either
  resume every rank of the group empties its caching allocator (SGLang's processes cannot use
  what the trainer's allocator keeps reserved), and after a sync frees the CUDA IPC handles.

Stop strings: started with `skip_tokenizer_init`, SGLang rejects them. A stop string that is a
single token becomes a stop token id, so the engine stops on it; every stop string is also
looked for in the returned tokens, which are cut after the token that completes it, as the
embedded engine does (the engine may have generated past a multi-token stop string: that
costs time, not correctness).

Idle and refusals: SGLang flushes its prefix cache, and releases memory, only while its scheduler is idle, which it
may not be yet right after the last output came back (its loop clears the last batch an iteration later); a release
then fails an assertion in the scheduler, which ends the engine and this process. Each flush and release waits for
idle (`_flush_when_idle`). SGLang refuses a whole `generate` call when one prompt does not fit the context, or its
prompt plus max_new_tokens does not: such a prompt is refused alone and the others' max_new_tokens cut to their room.

Images (a vision-language model): a prompt's images go as SGLang's `image_data`, one `processor_output` item
per request (`image_data`) beside its `input_ids`, whose image-pad tokens rl2 has expanded itself (one per merged
patch). SGLang's multimodal path decodes the ids and tokenizes the text again with its processor's tokenizer,
splitting it at each `<|vision_start|><|image_pad|>+<|vision_end|>`; the pixels are rl2's, so the grids match the
pads. Checked against the stand-in only (which checks the items and the pad counts); not yet on the real engine.

Routes (R3, `record_routes`, a mixture-of-experts model): the engine starts with `enable_return_routed_experts`,
each request asks for `return_routed_experts`, and SGLang's experts of every token it fed through the model (all
decoder layers) become the generation's routes, the MoE layers' (`rl2.engines.routed_experts`). Checked against
the stand-in only.

`sglang` is imported only when this engine is built (`pip install -e ".[gpu]"`). Tests run the adapter against a
stand-in package that follows SGLang's API (its calls recorded) and, in `make test-sglang`'s venv, against SGLang's
own CPU engine (`CPU_SERVER_ARGS`).
"""

import gc
import json
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig

from rl2.distributed.process_group import world_size
from rl2.engines.base import Engine, Generation, SamplingParams
from rl2.engines.routed_experts import RouteLayout
from rl2.engines.tp_group import TPGroupLayout, new_tp_group, plan_this_rank
from rl2.engines.weight_names import bucketed, checkpoint_names, engine_named_tensors
from rl2.vision.detect import is_vision_config
from rl2.vision.image_inputs import ImageInputs

logger = logging.getLogger(__name__)

# sglang 0.5.20 / 0.5.21 are built against torch 2.13.0, the torch rl2 is tested with; 0.5.22+ pin torch 2.14.1.
# Tested on the real engine (CPU, make test-sglang): 0.5.21 and 0.5.23.
SGLANG_REQUIREMENT = "sglang>=0.5.20,<0.5.24"
SGLANG_TESTED = ("0.5.21", "0.5.23")
SGLANG_INSTALL = 'pip install -e ".[gpu]"'
# The parameter read back from the engine after the first weight sync, when the model has it (else the
# first 1-D parameter sent). Never a matrix: SGLang's Llama read-back turns the whole tensor into a Python
# list before truncating it (an embedding matrix would be gigabytes of Python objects).
VERIFIED_PARAMETER = "model.norm.weight"
_SAMPLE_SIZE = 64
# How long a flush of the prefix cache waits for SGLang's scheduler to be idle (`_flush_when_idle`).
IDLE_TIMEOUT_S = 60.0
# Environment variables SGLang sets in the calling process that the trainer's own NCCL and CUDA
# use; restored after the engine starts (its processes keep SGLang's values).
_TRAINER_ENV_PREFIXES = ("NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "TORCHELASTIC_USE_AGENT_STORE")
_RESTORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGCHLD")


@dataclass
class SGLangAPI:
    """The parts of SGLang the adapter uses."""

    Engine: Callable[..., Any]
    FlattenedTensorBucket: Callable[..., Any]
    MultiprocessingSerializer: Any
    monkey_patch_torch_reductions: Callable[[], None]
    version: str
    init_custom_process_group: Callable[..., Any] | None = None  # the weight group (split placement)


def load_sglang() -> SGLangAPI:
    """Import SGLang; without it, an error that says how to install the supported version. Without CUDA,
    SGLang's CPU engine is chosen first (`SGLANG_USE_CPU_ENGINE=1`: SGLang reads it at import)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        import sglang
        from sglang.srt.utils import MultiprocessingSerializer, init_custom_process_group
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as error:
        raise ImportError(
            f"rollout.engine=sglang needs SGLang ({SGLANG_REQUIREMENT}; 0.5.20/0.5.21 are built for torch 2.13.0) "
            f"on a CUDA machine: {SGLANG_INSTALL}, or use rollout.engine=hf (import failed: {error})"
        ) from error
    version = getattr(sglang, "__version__", "unknown")
    if not version.startswith(("0.5.20", *SGLANG_TESTED)):
        logger.warning(f"SGLang {version} is installed; rl2 is tested with SGLang {' and '.join(SGLANG_TESTED)} "
                       f"({SGLANG_REQUIREMENT})")
    return SGLangAPI(
        sglang.Engine, FlattenedTensorBucket, MultiprocessingSerializer, monkey_patch_torch_reductions, version,
        init_custom_process_group,
    )


# ---- pure conversions (tested on CPU) ---------------------------------------------------------


# The SGLang arguments rl2 sets itself, and the rl2 key that decides each (None: rl2 needs its value).
OWN_SERVER_ARGS = {
    "model_path": "actor.model_name", "tp_size": "rollout.tp_size", "dtype": "actor.dtype",
    "mem_fraction_static": "rollout.gpu_memory_utilization", "random_seed": "trainer.seed",
    "enable_memory_saver": None, "base_gpu_id": None, "gpu_id_step": None, "port": None, "nccl_port": None,
    "skip_tokenizer_init": None, "nnodes": None, "node_rank": None,
}


def check_server_args(server_args: dict) -> None:
    """ValueError naming the rl2 key to use for a `rollout.server_args` entry that rl2 sets itself, and for
    a model override of `tie_word_embeddings`."""
    for name in server_args:
        if name in OWN_SERVER_ARGS:
            instead = OWN_SERVER_ARGS[name]
            raise ValueError(
                f"rollout.server_args.{name}: " + (f"set {instead} instead" if instead else
                                                   "rl2 sets this SGLang argument itself (placement, ports, weight sync)")
            )
    # SGLang ties the head to the embeddings by its config (with this override applied: configs/model_config.py,
    # get_config(model_override_args)); rl2's pushes follow the checkpoint's config, and would leave a head the
    # override unties stale.
    overrides = server_args.get("json_model_override_args") or {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError:
            overrides = {}  # SGLang reports it
    if isinstance(overrides, dict) and "tie_word_embeddings" in overrides:
        raise ValueError("rollout.server_args.json_model_override_args: tie_word_embeddings must stay the checkpoint's "
                         "(the actor's weights are pushed as its config ties them)")


# SGLang's CPU engine (the pure-torch paths, on a CPU without AMX): what it needs that its defaults are not,
# as defaults under the user's `rollout.server_args`. Its KV cache is sized in tokens (the GPU's
# `mem_fraction_static` would take a fraction of the machine's memory).
# `sleep_on_idle`: an idle scheduler otherwise polls its sockets in a busy loop, a whole core (the trainer's, on CPU).
CPU_SERVER_ARGS = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
                   "max_total_tokens": 32768, "sleep_on_idle": True}


def engine_args(
    model_path: str, layout: TPGroupLayout, dtype: str, memory_fraction: float, seed: int, nccl_port: int,
    server_args: dict | None = None, device: str = "cuda", return_routes: bool = False,
) -> dict:
    """`sglang.Engine` keyword arguments for the engine of `layout`'s group on `device` ("cuda" or "cpu");
    `server_args` are the user's further SGLang arguments (`rollout.server_args`), none of them one that
    rl2 sets; `return_routes`: the engine captures each token's experts (R3)."""
    check_server_args(server_args or {})
    return {
        **({"enable_return_routed_experts": True} if return_routes else {}),
        "log_level": "error",
        **(CPU_SERVER_ARGS if device == "cpu" else {}),
        **(server_args or {}),
        "model_path": model_path,
        "tp_size": layout.tp_size,
        "dtype": dtype,
        "mem_fraction_static": memory_fraction,
        "enable_memory_saver": device != "cpu",  # torch_memory_saver needs libcuda
        "base_gpu_id": layout.base_gpu_id,
        "gpu_id_step": 1,
        # Engines on one node need their own ports; their base GPUs differ.
        "port": 30000 + 100 * layout.base_gpu_id,
        "nccl_port": nccl_port,
        "skip_tokenizer_init": True,
        "random_seed": seed,
        "nnodes": 1,
        "node_rank": 0,
    }


def cpu_threads_binding(ranks: int, cpus: list[int] | None = None) -> str:
    """`SGLANG_CPU_OMP_THREADS_BIND` for `ranks` SGLang CPU ranks on this node: this process's cores in `ranks`
    contiguous shares ("0|1", "0-3|4-7"; with fewer cores than ranks, one core each, taken in turn). SGLang gives
    its CPU rank of gpu id g the g-th share (its own default, one rank per NUMA node, has too few entries for a
    second engine on the node, or a second TP rank, on a one-node machine)."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < ranks:
        return "|".join(str(cpus[rank % len(cpus)]) for rank in range(ranks))
    share, shares = len(cpus) // ranks, []
    for rank in range(ranks):
        own = cpus[rank * share: (rank + 1) * share]
        contiguous = own[-1] - own[0] == len(own) - 1
        shares.append(str(own[0]) if len(own) == 1 else f"{own[0]}-{own[-1]}" if contiguous else ",".join(map(str, own)))
    return "|".join(shares)


def sampling_params_dict(params: SamplingParams, stop_token_ids: Iterable[int]) -> dict:
    """SGLang's sampling parameters for `params`; stop strings are given as `stop_token_ids`."""
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": sorted(set(params.stop_token_ids) | set(stop_token_ids)),
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


def single_token_stops(stops: list[str], tokenizer) -> list[int]:
    """Token ids of the stop strings that are one token of the vocabulary."""
    ids = []
    for stop in stops:
        tokens = tokenizer(stop, add_special_tokens=False)["input_ids"]
        if len(tokens) == 1:
            ids.append(tokens[0])
    return ids


def to_generation(output: dict, routes: RouteLayout | None = None) -> Generation:
    """Our `Generation` from one SGLang `generate` output (`return_logprob=True`).

    Tokens and log-probs come from `meta_info.output_token_logprobs` ([(logprob, token_id, text)]),
    which keeps the token that stopped generation; `output_ids`, when given, must agree with them. With a
    `routes` layout (`return_routed_experts=True`), `meta_info.routed_experts` (every token SGLang fed through the
    model: the prompt's and the generated ones but the last) become the generation's routes.
    """
    meta = output.get("meta_info") or {}
    if "output_token_logprobs" not in meta:
        raise ValueError("SGLang output has no meta_info.output_token_logprobs: generate needs return_logprob=True")
    entries = meta["output_token_logprobs"] or []
    token_ids = [int(entry[1]) for entry in entries]
    logprobs = [float(entry[0]) if entry[0] is not None else 0.0 for entry in entries]
    output_ids = output.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids[: len(output_ids)]:
        raise ValueError(
            f"SGLang output_ids {list(output_ids)[:8]}... disagree with the token ids of its log-probs {token_ids[:8]}..."
        )
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    routed = None
    if routes is not None and meta.get("routed_experts") is not None:
        routed = routes.decode(meta["routed_experts"], meta.get("routed_experts_dtype") or "int32")
    if kind in ("stop", "length"):
        return Generation(token_ids, logprobs, kind, routes=routed)
    if kind == "abort":
        message = reason.get("message") if isinstance(reason, dict) else None
        return Generation(token_ids, logprobs, "abort", f"SGLang aborted the request: {message or 'no reason given'}",
                          routes=routed)
    raise ValueError(f"SGLang output has an unknown finish_reason {reason!r}")


def cut_at_stop_string(generation: Generation, stops: list[str], tokenizer) -> Generation:
    """`generation` cut after the first token that completes one of `stops` (finish "stop")."""
    if not stops or not generation.token_ids:
        return generation

    def contains_stop(length: int) -> bool:
        text = tokenizer.decode(
            generation.token_ids[:length], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return any(stop in text for stop in stops)

    if not contains_stop(len(generation.token_ids)):
        return generation
    low, high = 1, len(generation.token_ids)  # the shortest prefix containing a stop lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        if contains_stop(middle):
            high = middle
        else:
            low = middle + 1
    routes = generation.routes
    if routes is not None:  # the tokens cut off were fed back: their routes go too
        routes = routes[: len(routes) - (len(generation.token_ids) - high)]
    return Generation(generation.token_ids[:high], generation.logprobs[:high], "stop", routes=routes)


def image_data(images: ImageInputs | None) -> list[dict] | None:
    """One request's `image_data` for `sglang.Engine.generate`: its images as one `processor_output` item
    (the image processor's `pixel_values` and `image_grid_thw`, as SGLang's offline API takes a Hugging
    Face processor's output beside pre-expanded `input_ids`), so SGLang runs rl2's own preprocessing and the
    prompt's image-pad tokens (rl2 expanded them, one per merged patch) match its grids; None without images."""
    if images is None:
        return None
    return [{"format": "processor_output", "pixel_values": images.pixel_values,
             "image_grid_thw": images.image_grid_thw}]


# SGLang's cache of image embeddings (mem_cache/multimodal_cache.py, MultiModalStaticCache; 100 MB by default):
# with 0 it keeps none.
IMAGE_CACHE_MB = "SGLANG_VLM_CACHE_SIZE_MB"


def check_result(result: Any, what: str) -> None:
    """Raise if an SGLang control call reports failure ((success, message), a dict or an object)."""
    if result is None:
        return
    if isinstance(result, (tuple, list)):
        success, message = bool(result[0]), result[1] if len(result) > 1 else ""
    elif isinstance(result, dict):
        success, message = bool(result.get("success", True)), result.get("message", "")
    else:
        success, message = bool(getattr(result, "success", True)), getattr(result, "message", "")
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


@contextmanager
def sglang_process_state(settings: dict[str, str] | None = None) -> Iterator[None]:
    """Around `sglang.Engine(...)`: drop TORCHELASTIC_USE_AGENT_STORE (SGLang hangs with it under
    torchrun) and set `settings` (SGLang's environment variables, read by the processes it starts), then
    put back those, the NCCL / CUDA variables, signal handlers and multiprocessing start method that SGLang
    changes in the calling process and the trainer relies on."""
    settings = settings or {}
    saved = {key: value for key, value in os.environ.items() if key.startswith(_TRAINER_ENV_PREFIXES)}
    saved_settings = {name: os.environ.get(name) for name in settings}
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in _RESTORED_SIGNALS}
    start_method = multiprocessing.get_start_method(allow_none=True)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved_settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for key in [key for key in os.environ if key.startswith(_TRAINER_ENV_PREFIXES)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)
        if main_thread:
            for name, handler in handlers.items():
                if handler is not None:
                    signal.signal(getattr(signal, name), handler)
        if multiprocessing.get_start_method(allow_none=True) != start_method:
            multiprocessing.set_start_method(start_method, force=True)


def free_device_memory() -> None:
    """Give the trainer's cached GPU blocks back to the driver, so SGLang's processes can resume into them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_ipc_handles() -> None:
    """Release the CUDA IPC handles of buckets the engine has read."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


# ---- the engine -----------------------------------------------------------------------------


class SGLangEngine(Engine):
    """This rank's handle on its group's SGLang engine (the engine itself lives on the leader)."""

    lockstep = True
    keeps_weights_asleep = False  # released without a backup: every sync sends every weight

    def __init__(
        self,
        model_path: str,
        tokenizer,
        dtype: str = "bfloat16",
        seed: int = 0,
        tp_size: int = 1,
        memory_fraction: float = 0.5,
        bucket_mb: int = 512,
        server_args: dict | None = None,
        record_routes: bool = False,
        api: SGLangAPI | None = None,
        free_memory: Callable[[], None] = free_device_memory,
        image_embedding_cache: bool = True,
    ):
        """`image_embedding_cache=False` (a vision tower that trains): SGLang keeps no image embeddings between
        requests. Its cache is keyed by the image alone and outlives weight pushes: after the tower changed, an
        image seen before would get the old tower's embeddings."""
        self.api = api or load_sglang()
        self.free_memory = free_memory
        self.tokenizer = tokenizer
        self.bucket_bytes = bucket_mb * 2**20
        self.layout = plan_this_rank(tp_size)
        self.group = new_tp_group(self.layout, world_size()) if tp_size > 1 else None
        # SGLang's Qwen2 / Llama make a tied head the embedding module itself (models/qwen2.py and llama.py,
        # `self.lm_head = self.model.embed_tokens`) and never load an lm_head.weight into it (Qwen2 logs it
        # as not found, Llama skips it): pushing the embeddings updates the head. An untied head is its own
        # parameter and is pushed.
        config = AutoConfig.from_pretrained(model_path)
        self.tied_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.stored_names = checkpoint_names(model_path) if is_vision_config(config) else {}
        self.released: set[str] = set()
        self.verified = False
        self.update_open = False  # leader: SGLang's weight-update session is open (begin_weight_update)
        self.engine = None
        # R3 (`record_routes`, a mixture-of-experts model): SGLang returns each request's routed experts
        self.routes = RouteLayout.of(model_path) if record_routes else None

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu" and self.group is not None:
            # A CPU tensor pushed by rank r is a file-descriptor share that SGLang's TP rank r (a child of the
            # leader) fetches from rank r's process, which accepts only its own multiprocessing authkey: the
            # group's processes take the leader's (before the engine's processes start).
            key = [bytes(multiprocessing.current_process().authkey)]  # an AuthenticationString refuses pickling
            dist.broadcast_object_list(key, src=self.layout.leader, group=self.group)
            multiprocessing.current_process().authkey = key[0]

        def start() -> None:
            if self.device == "cpu":  # a core share per SGLang rank of the node, indexed by its gpu id
                engines = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), self.layout.base_gpu_id + tp_size)
                os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_binding(engines))
            with sglang_process_state({} if image_embedding_cache else {IMAGE_CACHE_MB: "0"}):
                self.engine = self.api.Engine(**engine_args(model_path, self.layout, dtype, memory_fraction, seed,
                                                            _free_port(), server_args, self.device,
                                                            return_routes=self.routes is not None))
            where = (f"GPUs {self.layout.base_gpu_id}..{self.layout.base_gpu_id + tp_size - 1}" if self.device == "cuda"
                     else "the CPU (SGLang's CPU engine)")
            logger.info(f"SGLang {self.api.version} engine {self.layout.group_index}: TP {tp_size} on {where}, "
                        f"ranks {list(self.layout.ranks)}")

        self._on_leader(start, "engine start")

    # ---- group plumbing --------------------------------------------------------------------

    def _broadcast(self, value: Any) -> Any:
        """The leader's `value`, on every rank of the group."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.layout.leader, group=self.group)
        return box[0]

    def _on_leader(self, action: Callable[[], Any], what: str) -> Any:
        """Run `action` on the leader; its result on every rank, and its failure raised on every rank."""
        result, error = None, None
        if self.layout.is_leader:
            try:
                result = action()
            except Exception as exc:  # re-raised below, on every rank of the group
                error = f"{what} on the SGLang engine of ranks {list(self.layout.ranks)} failed: {exc}"
                logger.error(error)
        result, error = self._broadcast((result, error))
        if error is not None:
            raise RuntimeError(error)
        return result

    # ---- generation ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[ImageInputs | None] | None = None) -> list[Generation]:
        """One generation per prompt; collective over the group (an empty list takes part too). `images[i]`:
        prompt i's images (a vision-language model; its image-pad tokens already expanded, as rl2 builds them)."""
        prompts = [list(map(int, prompt)) for prompt in prompts]
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts")
        parts = [(prompts, params, images)]
        if self.group is not None:  # ranks may differ in prompts and in room left (max_new_tokens)
            parts = [None] * self.layout.tp_size
            dist.all_gather_object(parts, (prompts, params, images), group=self.group)

        def run() -> list[list[Generation]]:
            # One SGLang parameter dict per rank (its stop strings tokenised once), shared by its prompts.
            requests = []
            for part_prompts, part_params, part_images in parts:
                sglang_params = self._sampling_params(part_params)
                requests += [(prompt, part_params, sglang_params, image)
                             for prompt, image in zip(part_prompts, part_images)]
            generations = self._generate_batch(requests) if requests else []
            split, start = [], 0
            for part_prompts, _, _ in parts:
                split.append(generations[start : start + len(part_prompts)])
                start += len(part_prompts)
            return split

        return self._on_leader(run, "generate")[self.layout.tp_rank]

    def _generate_batch(self, requests: list[tuple[list[int], SamplingParams, dict, ImageInputs | None]]
                        ) -> list[Generation]:
        if self.released:
            raise RuntimeError(f"generate while SGLang's {sorted(self.released)} memory is released: call wake() first")
        # SGLang refuses the whole batch (ValueError) when one prompt does not fit the model's context, or its
        # prompt plus max_new_tokens does not (tokenizer_manager.py, _validate_one_request): a prompt that does
        # not fit is refused alone, and the others' max_new_tokens are cut to the room they have (finish "length").
        # The scheduler's own bound on a prompt is a few tokens below the context (tp_worker.py, max_req_input_len).
        manager = getattr(self.engine, "tokenizer_manager", None)
        context = getattr(manager, "context_len", None)
        longest = getattr(manager, "max_req_input_len", None) or context
        generations: list[Generation | None] = [None] * len(requests)
        sent = []
        for index, (prompt, _, sglang_params, images) in enumerate(requests):
            if longest is not None and len(prompt) >= longest:
                generations[index] = Generation.refused(
                    f"a prompt of {len(prompt)} tokens does not fit the model's context length ({context} tokens; "
                    f"SGLang takes prompts of fewer than {longest})")
                continue
            if context is not None and len(prompt) + sglang_params["max_new_tokens"] > context:
                sglang_params = {**sglang_params, "max_new_tokens": context - len(prompt)}
            sent.append((index, prompt, sglang_params, images))
        multimodal = {}
        if any(images is not None for *_, images in sent):
            multimodal["image_data"] = [image_data(images) for *_, images in sent]
        outputs = self.engine.generate(
            input_ids=[prompt for _, prompt, _, _ in sent],
            sampling_params=[sglang_params for _, _, sglang_params, _ in sent],
            return_logprob=True,
            **({"return_routed_experts": True} if self.routes is not None else {}),
            **multimodal,
        ) if sent else []
        if len(outputs) != len(sent):
            raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(sent)} prompts")
        for output, (index, *_) in zip(outputs, sent):
            generation = to_generation(output, self.routes)
            generations[index] = cut_at_stop_string(generation, requests[index][1].stop, self.tokenizer)
        return generations

    def _sampling_params(self, params: SamplingParams) -> dict:
        stop_ids = single_token_stops(params.stop, self.tokenizer)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.append(self.tokenizer.eos_token_id)
        return sampling_params_dict(params, stop_ids)

    def abort(self) -> None:
        """Abort every request in flight (leader; callable from another thread). The abort is sent from
        the engine's event loop, whose thread owns SGLang's ZMQ sockets (they are not thread-safe); with
        the loop idle no `generate` is running, so there is nothing to abort."""
        engine = self.engine
        if self.layout.is_leader and engine is not None and engine.loop.is_running():
            engine.loop.call_soon_threadsafe(lambda: engine.tokenizer_manager.abort_request(abort_all=True))

    def reseed(self, seed: int) -> None:
        """No-op: SGLang seeds its sampler once, from `random_seed` at start (rollouts on SGLang are
        not bit-reproducible across runs)."""

    # ---- memory ----------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release the engine's weights, KV cache and CUDA graphs on every GPU of the group."""

        def release() -> None:
            if not self.released:
                # SGLang asserts in its scheduler that it is idle (and the failed assertion ends the engine and, by
                # SIGQUIT, this process); right after the last output came back it may not be yet.
                self._flush_when_idle()
                check_result(self.engine.release_memory_occupation(), "release_memory_occupation")
                self.released = {"weights", "kv_cache", "cuda_graph"}

        self._on_leader(release, "release memory")

    def _flush_when_idle(self) -> None:
        """Leader: flush SGLang's prefix cache, once its scheduler is idle. It flushes only when idle and else answers
        success=False (Scheduler.flush_cache, is_fully_idle), also for an iteration or two of its loop after the
        last output came back (its last batch not yet cleared) or after an abort: tried again until
        `IDLE_TIMEOUT_S`, then an error."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            try:
                check_result(self.engine.flush_cache(), "flush_cache")
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def _before_resume(self) -> None:
        """Every rank of the group empties its allocator before the leader resumes SGLang's memory."""
        self.free_memory()
        if self.group is not None:
            dist.barrier(group=self.group)

    def wake(self) -> None:
        """Resume the KV cache and CUDA graphs; the weights must have been pushed since `sleep`."""
        self._before_resume()

        def resume() -> None:
            if "weights" in self.released:
                raise RuntimeError("its weights were released and not pushed since: update_weights comes before wake")
            tags = sorted(self.released)
            if tags:
                check_result(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
                self.released.clear()
                # Releasing the KV cache flushed it (release_memory_occupation), and pushes since did not.
                self._flush_when_idle()

        self._on_leader(resume, "resume memory")

    # ---- weights ---------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Push full weights bucket by bucket (collective over the group; every rank streams the
        same tensors, in the same order). Resumes released weight memory first."""
        if "weights" in self._broadcast(set(self.released) if self.layout.is_leader else None):
            self._before_resume()

        self._on_leader(self._begin_update, "weight update")
        if self.device == "cuda":  # CUDA IPC handles that name the GPU by UUID; it fails on CPU tensors
            self.api.monkey_patch_torch_reductions()
        samples: dict[str, torch.Tensor] = {}  # what was sent of the 1-D parameters, for the read-back
        # A fused group (q/k/v, gate/up) may be split between buckets: SGLang loads each bucket on its own
        # (model_runner_components/weight_updater.py, _update_weights_from_flattened_bucket -> model.load_weights)
        # and writes each shard into its slice of the fused parameter alone (layers/linear.py,
        # QKVParallelLinear.weight_loader / MergedColumnParallelLinear.weight_loader: narrow, then copy_).
        for bucket in bucketed(engine_named_tensors(named_tensors, self.tied_embeddings, self.stored_names), self.bucket_bytes):
            # The flattened copy is shared with the engine through CUDA IPC: it stays referenced here
            # until the post below has returned, i.e. until the engine has read it.
            flattened, payload = self._serialize(bucket)
            payloads = [payload]
            if self.group is not None:
                payloads = [None] * self.layout.tp_size if self.layout.is_leader else None
                dist.gather_object(payload, payloads, dst=self.layout.leader, group=self.group)
            if self.layout.is_leader and not self.verified:
                for name, tensor in bucket:
                    if tensor.dim() == 1 and (name == VERIFIED_PARAMETER or not samples):
                        samples[name] = tensor.detach()[:_SAMPLE_SIZE].float().cpu()

            def post() -> None:
                # flush_cache=False: SGLang then leaves the radix cache as it is (scheduler_components/
                # weight_updater.py, flush_cache_after_weight_update); `end` flushes once.
                try:
                    result = self.engine.update_weights_from_tensor(
                        named_tensors=payloads, load_format="flattened_bucket", flush_cache=False
                    )
                    check_result(result, "update_weights_from_tensor")
                except Exception:
                    self._abandon_update()
                    raise

            self._on_leader(post, "weight update")  # collective: every rank's bucket is read when it returns
            del flattened  # read by the engine: the next bucket's copy may take its memory

        def end() -> None:
            self._end_update()
            if "kv_cache" not in self.released:
                self._flush_when_idle()
            if not self.verified:
                name = VERIFIED_PARAMETER if VERIFIED_PARAMETER in samples else next(iter(samples), None)
                self._verify(name, samples.get(name))

        self._on_leader(end, "weight update")
        free_ipc_handles()
        self.verified = True

    def join_weight_group(self, address: str, port: int, world_size: int, group_name: str) -> None:
        """Split placement: this engine's TP workers join the first trainer's weight group
        (`rl2.rollout.direct_push`) as ranks 1 + group_index x tp_size + tp_rank."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"

        def join() -> None:
            check_result(self.engine.init_weights_update_group(
                master_address=address, master_port=port, rank_offset=1 + self.layout.group_index * self.layout.tp_size,
                world_size=world_size, group_name=group_name, backend=backend), "init_weights_update_group")

        self._on_leader(join, "weight group")

    def receive_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str) -> None:
        """Split placement: load the weights the first trainer broadcasts over the weight group, in this order
        (in a weight-update session, as for `update_weights`), then flush the prefix cache."""

        def receive() -> None:
            self._begin_update()
            try:
                check_result(self.engine.update_weights_from_distributed(
                    names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                    flush_cache="kv_cache" not in self.released), "update_weights_from_distributed")
            except Exception:
                self._abandon_update()
                raise
            self._end_update()

        self._on_leader(receive, "weight update")

    def _begin_update(self) -> None:
        """Leader: resume released weight memory, and open SGLang's weight-update session where it has one
        (0.5.21 refuses `update_weights_from_tensor` / `_from_distributed` outside it:
        managers/scheduler_components/weight_updater.py)."""
        if "weights" in self.released:
            check_result(self.engine.resume_memory_occupation(tags=["weights"]), "resume_memory_occupation")
            self.released.discard("weights")
        if self.update_open:  # a failed update left its session open: SGLang refuses to open a second one
            self._end_update()
        if hasattr(self.engine, "begin_weight_update"):  # SGLang >= 0.5.21
            check_result(self.engine.begin_weight_update(), "begin_weight_update")
            self.update_open = True

    def _end_update(self) -> None:
        if self.update_open:
            self.update_open = False
            check_result(self.engine.end_weight_update(), "end_weight_update")

    def _abandon_update(self) -> None:
        """Leader, after a failed load: close the session (the next sync opens its own and sends every weight)."""
        try:
            self._end_update()
        except Exception as error:  # the load's failure is the one reported
            logger.warning(f"closing SGLang's weight-update session after a failed load: {error}")

    def _serialize(self, bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, Any]:
        """The bucket flattened into one tensor, and that tensor serialised as CUDA IPC handles."""
        flat = self.api.FlattenedTensorBucket(named_tensors=bucket)
        flattened = flat.get_flattened_tensor()
        payload = self.api.MultiprocessingSerializer.serialize(
            {"flattened_tensor": flattened, "metadata": flat.get_metadata()}, output_str=True
        )
        return flattened, payload

    def _verify(self, name: str | None, sent: torch.Tensor | None) -> None:
        """Read the 1-D parameter `name` back: SGLang only logs a name it does not know, and the
        parameter keeps its old value. Skipped, with a warning, where SGLang cannot read back."""
        if name is None:
            logger.warning("weight sync not verified: no 1-D parameter was pushed")
            return
        got = self.engine.get_weights_by_name(name, truncate_size=_SAMPLE_SIZE)
        if got is None:
            logger.warning(
                f"weight sync not verified: SGLang {self.api.version} reads no parameter back from this model "
                f"(it does for Llama-family models only; {name!r} gave None). If the engine did not load the "
                f"pushes, logp_mismatch/mean grows as the actor trains"
            )
            return
        got = torch.as_tensor(got, dtype=torch.float32).flatten()
        n = min(len(got), len(sent))
        if n == 0 or not torch.allclose(got[:n], sent[:n], rtol=1e-2, atol=1e-3):
            raise RuntimeError(
                f"after the weight sync SGLang's {name!r} differs from the actor's (engine {got[:4].tolist()}, "
                f"actor {sent[:4].tolist()}): the engine did not load the pushed weights"
            )
        logger.info(f"weight sync verified on {name}")

    def shutdown(self) -> None:
        """Stop the engine and its processes."""
        if self.layout.is_leader and self.engine is not None:
            self.engine.shutdown()
        self.engine = None
