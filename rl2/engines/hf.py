"""A rollout engine on plain transformers and torch: continuous batching over a slot KV cache,
shared prefixes, CUDA-graph decode, exact log-probs.

Every sequence lives in a slot of a preallocated KV cache (`kv_slots`). Requests enter free slots
as others finish; their prompts are prefilled together in one packed row, and a prompt that
shares a prefix with a slot's contents (the other responses of the same prompt, or the earlier
turns of the same conversation, kept after they finished) copies that prefix's keys and values
instead of recomputing them. In multi-turn rollouts (`generate_turns`) a conversation's next turn
joins as soon as its tool answers, while the others go on decoding. Decode runs over the first R
slots at once, from a captured CUDA graph on CUDA (`decode_step`); an eager step (CPU), once most of
those slots have finished, runs over the running ones alone. Stop conditions (eos, stop ids, length)
are checked on the device; the host looks every `sync_interval` tokens, and stop strings are found
then and cut exactly. It needs nothing beyond transformers, runs on CPU, and its log-probs follow the
trainer's convention exactly.

With `record_routes` (R3 routing replay, a mixture-of-experts model) every token a forward computes has its
top-k experts per MoE layer written beside its keys in the slot cache (`KVSlots.keep_routes`), so a shared
or kept prefix carries its routes; a generation hands back those of its prompt and of every token it fed back
(`Generation.routes`).
"""

import concurrent.futures
import contextlib
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from rl2.distributed.fsdp import DTYPES
from rl2.engines.base import Engine, FirstTurn, Generation, OnGeneration, SamplingParams, Turn
from rl2.engines.decode_step import DecodeStep
from rl2.engines.kv_slots import KVSlots, PrefillPlan, no_masks, prefill_attention, register_slot_attention
from rl2.engines.linear_attention_slots import LinearAttentionSlots
from rl2.engines.sampling import request_uniforms, sample
from rl2.engines.slot_table import BLOCK, SlotTable, block_hashes
from rl2.engines.vision_prompt import VisionPrompt, mrope_positions
from rl2.engines.weight_names import engine_named_tensors
from rl2.models.routing_replay import RoutingReplay, routers
from rl2.vision.detect import is_vision_config
from rl2.vision.image_inputs import ImageInputs
from rl2.vision.positions import rope_index_of

logger = logging.getLogger(__name__)


class _Refusal(ValueError):
    """A turn the engine cannot generate (`Generation.refused`): the message says why."""


@dataclass
class _Request:
    index: int  # in the `generate` call
    turn: int  # how many generations of this request came before
    prompt: list[int]
    max_new: int  # tokens this turn may add
    call_key: int  # with sample_key: the random stream its tokens are drawn from (`request_uniforms`)
    sample_key: int
    offset: int = 0  # tokens of this generation drawn before (a resumed partial rollout): its first position
    slot: int = -1
    fed_bound: int = 0  # at least the positions its slot holds: for sizing the decode's kv_length
    checked: int = 0  # generated tokens already checked for stop strings
    vision: VisionPrompt | None = None  # a vision-language model's prompt: its images and where they lie
    key: list[int] | None = None  # the prompt as its slot is indexed (`VisionPrompt.keys`); None: the prompt

    @property
    def indexed(self) -> list[int]:
        """The prompt as the slot table indexes it."""
        return self.key if self.key is not None else self.prompt


@dataclass
class _DeviceState:
    """One `generate` call's per-slot decode state, on the device so stop checks need no host sync."""

    next_input: torch.Tensor  # [S] the token to feed next
    length: torch.Tensor  # [S] positions in the slot's cache (= the next input's position)
    count: torch.Tensor  # [S] tokens generated
    live: torch.Tensor  # [S] still generating
    limit: torch.Tensor  # [S] tokens the slot's request may generate
    call_key: torch.Tensor  # [S] the slot's request's random stream (`request_uniforms`)
    sample_key: torch.Tensor  # [S]
    offset: torch.Tensor  # [S] the stream position of the slot's first new token
    tokens: torch.Tensor  # [S, max_new + 1] generated tokens (the last column is scratch)
    logprobs: torch.Tensor  # [S, max_new + 1]
    stop_ids: torch.Tensor  # [k]
    max_new: int

    @classmethod
    def create(cls, slots: int, max_new: int, stop_ids: set[int], device) -> "_DeviceState":
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(zeros(slots), zeros(slots), zeros(slots), zeros(slots, dtype=torch.bool), zeros(slots),
                   zeros(slots), zeros(slots), zeros(slots), zeros(slots, max_new + 1),
                   zeros(slots, max_new + 1, dtype=torch.float32),
                   torch.tensor(sorted(stop_ids), dtype=torch.long, device=device), max_new)

    def uniforms(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """One uniform number per row for the token each row draws next, from its request's stream."""
        return request_uniforms(self.call_key[rows], self.sample_key[rows], self.offset[rows] + self.count[rows])

    def record(self, rows: torch.Tensor, running: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append `tokens` to the running ones of `rows`; a row stops on a stop id or at its limit."""
        column = torch.where(running, self.count[rows], self.max_new)
        self.tokens[rows, column] = tokens
        self.logprobs[rows, column] = logprobs
        self.count[rows] += running
        self.next_input[rows] = torch.where(running, tokens, self.next_input[rows])
        stopped = torch.isin(tokens, self.stop_ids) | (self.count[rows] >= self.limit[rows])
        self.live[rows] = running & ~stopped


class HFEngine(Engine):
    """An unsharded copy of the policy in `dtype` on `device`, sampling with its own seeded generator.

    `max_batch_size` sequences run at once (the KV slots); `sync_interval` decode steps run
    between host checks (default 8 on CUDA, 1 on CPU); on CUDA, `cuda_graphs` replays decode steps
    from captured graphs; `max_prefill_tokens` bounds one prefill forward, whose attention
    `attn_implementation` picks (`kv_slots.prefill_attention`: auto = a variable-length kernel on
    CUDA, one sdpa call per sequence on CPU).

    A vision-language model (a config with a `vision_config`: Qwen2.5-VL, Qwen3-VL) loads as
    `AutoModelForImageTextToText` with the slot attention for its text model and sdpa for its vision tower.
    A turn's `images` prefill through the model's own forward (merged embeddings, mRoPE positions); each
    slot keeps its rope delta so decode positions continue the prompt's; a cached prefix is shared only
    up to where the images differ (`VisionPrompt.keys`).

    A hybrid model (Qwen3.5, Qwen3-Next: gated delta-nets beside full attention) keeps each slot's
    linear-attention states beside its keys and values (`linear_attention_slots`); as a state cannot be cut
    back, a cached prefix is reused only when it is a kept slot's whole contents (a conversation's next turn),
    and copies of a prompt share its prefill only when they enter in the same round.

    `record_routes`: each generation carries its routes (`Generation.routes`), where the model has MoE routers
    that `rl2.models.routing_replay` knows (a dense model records none).
    """

    def __init__(
        self,
        model_path: str,
        tokenizer,
        device: torch.device,
        dtype: str = "float32",
        seed: int = 0,
        max_batch_size: int = 64,
        sync_interval: int | None = None,
        cuda_graphs: bool = True,
        max_prefill_tokens: int = 16384,
        attn_implementation: str = "auto",
        record_routes: bool = False,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        cuda = self.device.type == "cuda"
        self.sync_interval = sync_interval or (8 if cuda else 1)
        self.max_prefill_tokens = max_prefill_tokens
        config = AutoConfig.from_pretrained(model_path)
        self.prefill_attention = prefill_attention(self.device, attn_implementation, dtype=DTYPES[dtype],
                                                   model_type=config.model_type)
        logger.info(f"hf engine prefill attention on {self.device.type}: {self.prefill_attention}"
                    + (" (auto)" if attn_implementation == "auto" else ""))
        self.vision = is_vision_config(config)
        model_cls, attention = AutoModelForCausalLM, register_slot_attention()
        if self.vision:  # the vision tower's attention stays bidirectional (the slot attention is causal)
            model_cls, attention = AutoModelForImageTextToText, {"text_config": attention, "vision_config": "sdpa"}
        self.model = model_cls.from_pretrained(model_path, dtype=DTYPES[dtype], attn_implementation=attention)
        self.model.to(self.device)
        self.model.eval()
        if self.vision:
            self.image_pad_id = config.image_token_id
            self.merge_size = config.vision_config.spatial_merge_size
            self.rope_index = rope_index_of(self.model)
        self.kv = KVSlots.for_model(self.model, max_batch_size)
        self.linear = LinearAttentionSlots.for_model(self.model, max_batch_size)  # a hybrid model's recurrent states
        self.slots = SlotTable(max_batch_size)
        self.routing = None
        if record_routes and routers(self.model):  # before the cache and any decode graph exist
            self.routing = RoutingReplay(self.model)
            self.kv.keep_routes(self.routing.num_layers, self.routing.top_k, self.routing.dtype)
            self.routing.record(sink=self.kv.write_routes)
        self.decode = DecodeStep(self.model, self.kv, use_graphs=cuda and cuda_graphs, mrope=self.vision)
        if not self.vision and not _takes_mask_dict(self.model):  # e.g. Qwen3-MoE, OLMoE: a placeholder it passes on
            self.decode.no_masks = no_masks(True, self.device)
        self.eos_ids = _eos_ids(tokenizer, self.model)
        self.generator = torch.Generator().manual_seed(seed)  # draws one key per `generate` call
        self.asleep = False
        self.aborting = threading.Event()
        # prefill_tokens (computed), reused_tokens (copied or kept from a slot), decode_steps (compact_decode_steps:
        # those over the running slots alone), host_syncs
        self.stats: Counter = Counter()

    # ---- generation ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[ImageInputs | None] | None = None) -> list[Generation]:
        """One generation per prompt, in the order of `prompts`; `images[i]`: prompt i's images (a
        vision-language model)."""
        results: list[Generation | None] = [None] * len(prompts)

        def keep(index: int, generation: Generation) -> None:
            results[index] = generation

        images = images or [None] * len(prompts)
        turns = [Turn(list(p), params.max_new_tokens, images=i) for p, i in zip(prompts, images, strict=True)]
        self._schedule(turns, params, keep, max_turns=1)
        return results

    def generate_turns(
        self, turns: list[FirstTurn], params: SamplingParams, on_generation: OnGeneration, max_turns: int
    ) -> None:
        """Multi-turn generation in one schedule: a request's next turn enters a free slot as soon
        as its future resolves (its tool answered), while the others go on decoding, and reuses the
        cache its earlier turns left in their slot. The futures are looked at every host sync.

        Turn t of request i draws from random stream (call key, t·len(turns) + i), so the samples do
        not depend on how fast the tools answer; a turn that names its `stream` draws from that one,
        from position `offset`. After `abort`, the requests still waiting for a tool are dropped: the
        call returns without waiting for them.
        """
        self._schedule(turns, params, on_generation, max_turns)

    @torch.inference_mode()
    def _schedule(self, turns: list[Turn], params: SamplingParams, on_generation: OnGeneration, max_turns: int) -> None:
        if self.asleep:
            raise RuntimeError("HFEngine.generate called while asleep: call wake() first")
        self.aborting.clear()
        if not turns:
            return
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        call_key = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        state = _DeviceState.create(self.max_batch_size, params.max_new_tokens, stop_ids, self.device)
        waiting: deque[_Request] = deque()
        running: list[_Request] = []
        tools: list[tuple[_Request, concurrent.futures.Future]] = []  # requests waiting for their next turn

        def finished(request: _Request, generation: Generation) -> None:
            future = on_generation(request.index, generation)
            if future is not None:
                tools.append((request, future))

        for i, turn in enumerate(turns):
            if isinstance(turn, concurrent.futures.Future):  # its first turn comes when its tool answers
                tools.append((_Request(i, -1, [], 0, call_key, 0), turn))
            else:
                self._enqueue(waiting, i, 0, turn, params, len(turns), call_key, finished)
        self._reserve(max((len(r.prompt) for r in waiting), default=1) + min(params.max_new_tokens, 256))
        try:
            while waiting or running or tools:
                if self.aborting.is_set():
                    self._finish(running, state, params, stop_ids, finished, abort=True)
                    running = []
                    while waiting:
                        request = waiting.popleft()
                        finished(request, Generation([], [], "abort", "aborted", (request.call_key, request.sample_key)))
                    tools.clear()  # not waited for: their tools may never answer
                    continue
                self._collect_turns(tools, waiting, params, len(turns), max_turns, call_key, finished,
                                    block=not (waiting or running))
                while waiting and self.slots.free_slots():
                    running += self._admit(waiting, state, params)
                for _ in range(self.sync_interval):
                    self._decode_step(running, state, params)
                self._finish(running, state, params, stop_ids, finished)
                running = [r for r in running if r.slot >= 0]
        finally:
            self.slots.drop_active()  # after an error: their caches are incomplete

    def _request(self, index: int, turn_number: int, turn: Turn, params: SamplingParams, requests: int,
                 call_key: int) -> _Request:
        if len(turn.prompt) == 0:
            raise _Refusal(f"request {index}: every prompt needs at least one token")
        if turn.max_new_tokens < 1:
            raise _Refusal(f"request {index}: a turn needs max_new_tokens >= 1, got {turn.max_new_tokens}")
        embedded = self.model.get_input_embeddings().num_embeddings
        if min(turn.prompt) < 0 or max(turn.prompt) >= embedded:  # a lookup would raise in the middle of the batch
            outside = next(t for t in turn.prompt if not 0 <= t < embedded)
            raise _Refusal(f"request {index}: token id {outside} is outside the vocabulary (0 to {embedded - 1})")
        vision = None
        if self.vision:
            try:
                vision = VisionPrompt.of(turn.prompt, turn.images, self.image_pad_id, self.merge_size)
            except ValueError as why:
                raise _Refusal(f"request {index}: {why}") from None
        elif turn.images is not None:
            raise _Refusal(f"request {index}: has images but the model is not a vision-language model")
        max_new = min(turn.max_new_tokens, params.max_new_tokens)
        if turn.stream is not None:
            call_key, sample_key = turn.stream
        else:
            sample_key = turn_number * requests + index
        request = _Request(index, turn_number, list(turn.prompt), max_new, call_key, sample_key, turn.offset)
        if vision is not None:
            request.vision, request.key = vision, vision.keys(request.prompt)
        return request

    def _collect_turns(self, tools: list, waiting: deque, params: SamplingParams, requests: int, max_turns: int,
                       call_key: int, finished: Callable[[_Request, Generation], None], block: bool) -> None:
        """Move the requests whose next turn is ready from `tools` to `waiting` (in the order they
        were handed out); with `block`, wait until at least one future is done (or `abort`). A future
        that fails raises here; a turn past `max_turns` is dropped."""
        futures = [future for _, future in tools]
        while block and futures and not self.aborting.is_set():  # abort() wakes the wait within 50 ms
            done, _ = concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
            if done:
                break
        still = []
        for request, future in tools:
            if not future.done():
                still.append((request, future))
                continue
            turn = future.result()
            if turn is not None and request.turn + 1 < max_turns:
                self._enqueue(waiting, request.index, request.turn + 1, turn, params, requests, call_key, finished)
                self.stats["next_turns"] += 1
        tools[:] = still

    def _enqueue(self, waiting: deque, index: int, turn_number: int, turn: Turn, params: SamplingParams, requests: int,
                 call_key: int, finished: Callable[[_Request, Generation], None]) -> None:
        """Queue a turn, or answer it at once with `Generation.refused` (the call's other requests go on)."""
        try:
            waiting.append(self._request(index, turn_number, turn, params, requests, call_key))
        except _Refusal as why:
            self.stats["refused"] += 1
            finished(_Request(index, turn_number, [], 0, call_key, 0), Generation.refused(str(why)))

    def _admit(self, waiting: deque, state: _DeviceState, params: SamplingParams) -> list[_Request]:
        """Prefill as many waiting requests as there are free slots (and prefill budget) in one
        packed forward; their first tokens are sampled. A request that shares a longer prefix
        with another one of this round than with any slot waits for the next round, to copy it.
        A hybrid model's slot state cannot be cut back (`_shareable`): there a prompt equal to one of
        this round (the n responses of one prompt) copies its slot, state and first logits after the prefill."""
        admitted, round_blocks, tokens = [], {}, 0
        deferred = []
        twins: list[tuple[_Request, _Request]] = []  # a hybrid model's (request, the admitted one of its prompt)
        firsts: dict[tuple[int, ...], _Request] = {}
        while waiting and self.slots.free_slots():
            request = waiting.popleft()
            if self.linear is not None and request.vision is None and tuple(request.prompt) in firsts:
                request.slot = self.slots.claim()
                twins.append((request, firsts[tuple(request.prompt)]))
                continue
            # At least the last prompt token is computed: its logits give the first new token.
            reusable = request.indexed[: len(request.prompt) - 1]
            hashes = block_hashes(reusable)
            source, shared = self.slots.longest_prefix(reusable, hashes)
            if request.vision is not None:
                shared = request.vision.shareable(shared)
            if self.linear is not None:
                source, shared = self._shareable(source, shared)
            elif any(h in round_blocks for h in hashes[shared // BLOCK :]):
                deferred.append(request)
                continue
            if admitted and tokens + len(request.prompt) - shared > self.max_prefill_tokens:
                waiting.appendleft(request)
                break
            request.slot = self.slots.claim(source if source >= 0 and not self.slots.active[source] else -1)
            if source >= 0 and source != request.slot:
                self.kv.copy_prefix(source, request.slot, shared)
                if self.linear is not None:
                    self.linear.copy(source, request.slot)
            admitted.append((request, shared))
            if self.linear is not None:
                firsts.setdefault(tuple(request.prompt), request)
            tokens += len(request.prompt) - shared
            round_blocks.update(dict.fromkeys(hashes))
        waiting.extendleft(reversed(deferred))
        if not admitted:
            return []
        self._reserve(max(len(request.prompt) for request, _ in admitted) + 1)
        self.stats["prefill_tokens"] += tokens
        self.stats["reused_tokens"] += sum(shared for _, shared in admitted)
        ids, segments, last = [], [], []
        for request, shared in admitted:
            start = len(ids)
            ids += request.prompt[shared:]
            segments.append((request.slot, shared, start, len(ids)))
            last.append(len(ids) - 1)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        plan = PrefillPlan.build(segments, self.device, self.prefill_attention)
        inputs = {"position_ids": plan.positions[None]}
        rows = as_tensor([request.slot for request, _ in admitted])
        if self.vision:
            inputs = self._vision_inputs(admitted, plan, rows)
        with self.kv.routing_to(plan.slots, plan.positions) if self.routing else contextlib.nullcontext():
            logits = self.model(
                input_ids=as_tensor(ids)[None],
                attention_mask=self.decode.no_masks,
                kv_slots=self.kv,
                kv_plan=plan,
                use_cache=False,
                logits_to_keep=as_tensor(last),
                **inputs,
            ).logits[0]
        if twins:
            logits, rows = self._copy_twins(twins, admitted, logits, rows)
        state.call_key[rows] = as_tensor([request.call_key for request, _ in admitted])
        state.sample_key[rows] = as_tensor([request.sample_key for request, _ in admitted])
        state.offset[rows] = as_tensor([request.offset for request, _ in admitted])
        state.count[rows] = 0
        next_tokens, logprobs = sample(logits, params, state.uniforms(rows))  # each one's first token
        state.length[rows] = as_tensor([len(request.prompt) for request, _ in admitted])
        state.limit[rows] = as_tensor([request.max_new for request, _ in admitted])
        state.record(rows, torch.ones_like(rows, dtype=torch.bool), next_tokens, logprobs)
        for request, _ in admitted:
            self.slots.start(request.slot, request.indexed)
            request.fed_bound = len(request.prompt)
        return [request for request, _ in admitted]

    def _copy_twins(self, twins: list[tuple[_Request, _Request]], admitted: list[tuple[_Request, int]],
                    logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each twin's slot made a copy of its prompt's prefilled slot (keys, values and linear-attention states)
        and added to `admitted` (its whole prompt shared); returns the logits and slots of all admitted."""
        position = {id(request): i for i, (request, _) in enumerate(admitted)}
        for twin, original in twins:
            self.kv.copy_prefix(original.slot, twin.slot, len(twin.prompt))
            self.linear.copy(original.slot, twin.slot)
            admitted.append((twin, len(twin.prompt)))
        self.stats["reused_tokens"] += sum(len(twin.prompt) for twin, _ in twins)
        picked = torch.tensor([position[id(original)] for _, original in twins], device=logits.device)
        slots = torch.tensor([twin.slot for twin, _ in twins], dtype=torch.long, device=rows.device)
        return torch.cat([logits, logits[picked]]), torch.cat([rows, slots])

    def _shareable(self, source: int, shared: int) -> tuple[int, int]:
        """A hybrid model's (slot, length) to reuse: a linear-attention state holds only the end of its slot's
        contents and cannot be cut back, so a prefix is reused only from a kept slot, and only whole (a
        conversation's next turn); else (-1, 0), the prompt computed from the start."""
        if source >= 0 and not self.slots.active[source] and shared == len(self.slots.contents[source]):
            return source, shared
        return -1, 0

    def _vision_inputs(self, admitted: list[tuple[_Request, int]], plan: PrefillPlan, rows: torch.Tensor) -> dict:
        """A vision-language model's prefill inputs: 4-row positions (the cache positions, then each
        prompt's mRoPE rows from its first computed token) and the images of the computed tokens; each
        slot's rope delta is set for its decode."""
        mrope, deltas, images = [], [], []
        for request, shared in admitted:
            positions, delta = mrope_positions(self.rope_index, request.prompt, request.vision, self.image_pad_id,
                                               self.device)
            mrope.append(positions[:, shared:])
            deltas.append(delta)
            images.append(request.vision.images_from(shared))
        self.decode.rope_deltas[rows] = torch.tensor(deltas, dtype=torch.long, device=self.device)
        inputs = {"position_ids": torch.cat([plan.positions[None], torch.cat(mrope, dim=1)])[:, None]}
        images = ImageInputs.concat(images)
        if images is not None:
            inputs["pixel_values"] = images.pixel_values.to(self.device, self.model.dtype)
            inputs["image_grid_thw"] = images.image_grid_thw.to(self.device)
        return inputs

    def _reserve(self, positions: int) -> None:
        """Room for `positions` per slot; the cache at least doubles when it grows."""
        if positions > self.kv.capacity:
            if self.kv.reserve(_round_up(max(positions, 2 * self.kv.capacity), 64)):
                self.decode.reset()
        if self.linear is not None and self.linear.allocate():
            self.decode.reset()

    def _decode_step(self, running: list[_Request], state: _DeviceState, params: SamplingParams) -> None:
        if not running:
            return
        self.stats["decode_steps"] += 1
        longest = max(r.fed_bound for r in running) + 1
        self._reserve(longest)
        rows, kv_length = self.decode.sizes(self.slots.highest_active() + 1, longest)
        slots = None  # the first `rows` slots, read as views
        if not self.decode.use_graphs and 2 * len(running) <= rows:
            # Most slots below the highest running one have finished (e.g. one long answer left in a high
            # slot): an eager step computes the running slots alone, their caches gathered.
            slots = torch.tensor(sorted(r.slot for r in running), device=self.device)
            self.stats["compact_decode_steps"] += 1
        index = slice(0, rows) if slots is None else slots
        live = state.live[index]
        write_positions = torch.where(live, state.length[index], self.kv.capacity)
        logits = self.decode(state.next_input[index], write_positions, kv_length, slots)
        next_tokens, logprobs = sample(logits, params, state.uniforms(index))
        state.length[index] += live
        state.record(torch.arange(rows, device=self.device) if slots is None else slots, live, next_tokens, logprobs)
        for request in running:
            request.fed_bound = min(request.fed_bound + 1, len(request.prompt) + request.max_new - 1)

    def _finish(self, running: list[_Request], state: _DeviceState, params: SamplingParams, stop_ids: set[int],
                finished: Callable[[_Request, Generation], None], abort: bool = False) -> None:
        """Look at the device state (the host's sync): hand the requests that finished to
        `finished` and keep their caches. Stop strings are searched in the new tokens and cut exactly."""
        if not running:
            return
        self.stats["host_syncs"] += 1
        slots = torch.tensor([r.slot for r in running], device=self.device)
        live, count = state.live[slots].tolist(), state.count[slots].tolist()
        done = [i for i, r in enumerate(running) if abort or not live[i] or params.stop]
        if not done:
            return
        picked = slots[done]
        tokens, logprobs = state.tokens[picked].tolist(), state.logprobs[picked].tolist()
        stopped_rows = []
        for i, row_tokens, row_logprobs in zip(done, tokens, logprobs):
            request, n = running[i], count[i]
            row_tokens, row_logprobs = row_tokens[:n], row_logprobs[:n]
            fed = row_tokens[:-1]  # every generated token but the last was fed back
            if abort:
                reason, error = "abort", "aborted"
            elif params.stop and (cut := self._stop_string_end(row_tokens, request, params.stop)) is not None:
                row_tokens, row_logprobs, reason, error = row_tokens[:cut], row_logprobs[:cut], "stop", None
                if live[i]:
                    stopped_rows.append(request.slot)
            elif not live[i]:
                length_reached = n >= request.max_new and row_tokens[-1] not in stop_ids
                reason, error = ("length" if length_reached else "stop"), None
            else:
                continue  # only searched for stop strings, none yet
            # The cache holds the prompt and every generated token but the last (never fed back). A hybrid
            # model's linear-attention state covers all of them, past a stop string's cut too, and cannot be cut.
            routes = (self.kv.routes_of(request.slot, len(request.prompt) + max(len(row_tokens) - 1, 0))
                      if self.routing else None)
            self.slots.keep(request.slot, request.indexed + (fed if self.linear is not None else row_tokens[:-1]))
            request.slot = -1
            finished(request, Generation(row_tokens, row_logprobs, reason, error, (request.call_key, request.sample_key),
                                         routes))
        if stopped_rows:
            state.live[torch.tensor(stopped_rows, device=self.device)] = False

    def _stop_string_end(self, tokens: list[int], request: _Request, stops: list[str]) -> int | None:
        """The length of `tokens` up to the token that completes a stop string, if one does;
        tokens before `request.checked` were searched already."""
        for end in range(request.checked + 1, len(tokens) + 1):
            if _completes_stop_string(self.tokenizer, tokens[:end], stops):
                return end
        request.checked = len(tokens)
        return None

    # ---- weights and memory ----------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Copy each (state-dict name, full tensor) into the model, casting dtype and device.

        Tied weights (e.g. `lm_head.weight` and `model.embed_tokens.weight`) are one tensor:
        either name updates it. Every tensor of the state dict must arrive at least once, unless
        `partial` (LoRA: only the adapted weights changed).
        """
        targets = self.model.state_dict(keep_vars=True)
        pending = {}  # id(tensor) -> a name of it, for tensors not updated yet
        for name, target in targets.items():
            pending.setdefault(id(target), name)
        for name, tensor in engine_named_tensors(named_tensors, tied_embeddings=False):  # wrapper / peft names off
            target = targets.get(name)
            if target is None:
                raise ValueError(
                    f"update_weights: unknown parameter {name!r} (not in the engine model's state dict)"
                )
            if target.shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the engine model's is {tuple(target.shape)}"
                )
            target.copy_(tensor)
            pending.pop(id(target), None)
        self.flush_cache()  # kept caches were computed by the old weights
        if pending and not partial:
            names = list(pending.values())
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            raise ValueError(
                f"update_weights: {len(names)} parameters were not updated (the engine now mixes old and new "
                f"weights): {', '.join(names[:5])}{more}"
            )

    def flush_cache(self) -> None:
        """Forget the kept caches (call after changing the model's weights other than by
        `update_weights`)."""
        self.slots.clear()

    def abort(self) -> None:
        """Make the running `generate` return at its next token, the unfinished rows with "abort"."""
        self.aborting.set()

    def shutdown(self) -> None:
        """Drop the model, the KV cache and the captured graphs (the decode step holds the model, the
        cache, its static inputs and the graphs' memory pool), and return the cached memory."""
        self.slots.clear()
        self.kv.release()
        if self.linear is not None:
            self.linear.release()
        self.decode.reset()
        if self.routing is not None:
            self.routing.close()
        self.model = self.kv = self.decode = self.linear = self.routing = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reseed(self, seed: int) -> None:
        """Restart sampling from `seed`: the same prompts and parameters then give the same samples."""
        self.generator.manual_seed(seed)

    def sleep(self) -> None:
        """Free the KV cache and the captured graphs; on CUDA, also move the model to CPU and
        return the cached accelerator memory."""
        self.slots.clear()
        self.kv.release()
        if self.linear is not None:
            self.linear.release()
        self.decode.reset()
        if self.device.type == "cuda" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.asleep = True

    def wake(self) -> None:
        """Move the model back to its device after `sleep`."""
        if self.asleep:
            self.model.to(self.device)
            self.asleep = False


def _completes_stop_string(tokenizer, tokens: list[int], stops: list[str]) -> bool:
    """Whether the last token of `tokens` completes one of `stops` (checked token by token, so only the tail)."""
    # A character is at most 4 bytes and a byte-level token holds at least 1 byte, so the
    # tokens that make up a stop string are among the last 4 per character (+1 to spare).
    window = 4 * max(len(stop) for stop in stops) + 1
    text = tokenizer.decode(tokens[-window:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return any(stop in text for stop in stops)


def _takes_mask_dict(model: torch.nn.Module) -> bool:
    """Whether the model's decoder takes a dict of masks per layer type as its `attention_mask` (transformers'
    newer models); the others (Qwen3-MoE, OLMoE in transformers 5.x) build theirs from it and need a tensor."""
    import inspect

    decoder = getattr(model, "model", model)
    source = inspect.getsource(type(decoder).forward)
    return "isinstance(causal_mask_mapping := attention_mask, dict)" in source or "isinstance(attention_mask, dict)" in source


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _eos_ids(tokenizer, model) -> set[int]:
    """The tokenizer's eos plus the model's generation-config eos (an int or a list)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    return ids
