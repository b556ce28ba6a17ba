"""The rollout engine interface: sampling parameters, generations, and the `Engine` contract."""

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, fields
from typing import Union

import torch

from rl2.vision.image_inputs import ImageInputs


@dataclass
class SamplingParams:
    """How to sample a completion; names and conventions follow SGLang (`top_k=-1` is off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    stop: list[str] = field(default_factory=list)  # stop strings; a single str is wrapped in a list
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer's eos
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = [int(token) for token in self.stop_token_ids]
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @classmethod
    def from_dict(cls, params: dict) -> "SamplingParams":
        """Sampling parameters from a dict (e.g. a config section); unknown keys are an error."""
        valid = [f.name for f in fields(cls)]
        for key, value in params.items():
            if key not in valid:
                raise ValueError(f"unknown sampling parameter {key!r}; valid ones: {', '.join(valid)}")
            expected = _SAMPLING_TYPES.get(key)
            if expected is not None and (isinstance(value, bool) or not isinstance(value, expected)):
                raise ValueError(f"sampling parameter {key}={value!r}: expected a number")
        return cls(**params)


_SAMPLING_TYPES = {"temperature": (int, float), "top_p": (int, float), "top_k": int, "max_new_tokens": int}


@dataclass
class Generation:
    """One completion.

    `token_ids` include the token that stopped it (eos, a stop token id, or the token that
    completed a stop string). `logprobs[i]` is log p(token_ids[i]) under softmax(logits / T),
    T the temperature (T = 1 when greedy); top_p / top_k filtering does not change them.
    `finish_reason` is "stop", "length" or "abort" (cut short by `Engine.abort` or refused by
    the engine; `error` then says why). `routes`, where the engine records them (R3 routing replay, a
    mixture-of-experts model): the experts each token of the prompt and each generated token but the last (the
    one no forward fed back) was routed to, [len(prompt) + len(token_ids) - 1, moe layers, k] int8/int16
    (`rl2.models.routing_replay`).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    error: str | None = None
    stream: tuple[int, int] | None = None  # the random stream it drew from, where the engine has one (`Turn.stream`)
    routes: torch.Tensor | None = None

    @staticmethod
    def refused(why: str) -> "Generation":
        """What an engine answers for one request it cannot generate (an empty prompt, an id outside the
        vocabulary), while the others of its call go on: no tokens, "abort", and why."""
        return Generation([], [], "abort", REFUSED + why)

    @property
    def was_refused(self) -> bool:
        return self.finish_reason == "abort" and not self.token_ids and (self.error or "").startswith(REFUSED)


REFUSED = "refused by the engine: "


@dataclass
class Turn:
    """One generation of a multi-turn request: the whole conversation so far as token ids, and
    how many tokens this turn may add (at most the sampling parameters' `max_new_tokens`).

    A turn that continues an interrupted generation (a partial rollout) passes that generation's
    `stream` and how many tokens it already drew (`offset`): an engine with per-request random
    streams (the `hf` engine) then draws the rest exactly as the uninterrupted generation would have."""

    prompt: list[int]
    max_new_tokens: int
    stream: tuple[int, int] | None = None
    offset: int = 0
    # A vision-language model's prompt: the images its image-pad tokens stand for, in order; None: none.
    images: ImageInputs | None = None


# Called with (request index, finished generation): None when the request is done, else a future
# of its next `Turn` (None once the tool decides the episode is over).
OnGeneration = Callable[[int, Generation], "Future[Turn | None] | None"]
# A request's first turn, or a future of it (a request resumed while its tool still runs).
FirstTurn = Union[Turn, "Future[Turn | None]"]


class Engine(ABC):
    """Generates completions of tokenized prompts and takes weight updates from the trainer.

    The trainer drives every engine in the same order each step: `generate` (rollout) → `sleep`
    (free accelerator memory for training) → `update_weights` (the new policy) → `wake` →
    `generate` … An engine may drop its weights in `sleep`; `update_weights` brings them back.
    """

    # True when the ranks of a group share one engine: every rank must then call `generate` (and
    # the other methods) the same number of times, with an empty prompt list if it has none.
    lockstep: bool = False

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One generation per prompt, in the order of `prompts`. An engine that serves vision-language models
        also takes `images=[ImageInputs | None per prompt]` (passed only when some prompt has images)."""

    def generate_turns(
        self, turns: list[FirstTurn], params: SamplingParams, on_generation: OnGeneration, max_turns: int
    ) -> None:
        """Multi-turn generation: each finished generation goes to `on_generation`, which may
        return a future of the request's next turn (e.g. the conversation with a tool's output
        appended), generated once the future resolves; `max_turns` generations per request at most.
        A first turn may itself be such a future (a request that waits for its tool).

        This default generates in waves: each wave is one `generate` call over the requests whose turn is
        ready, waiting only until at least one is (a request whose future waits on another's progress, as
        an agent waiting for a pooled environment, never blocks the wave). A lockstep engine keeps
        `max_turns` waves, every request's turn awaited before each: its ranks must make the same calls.
        An engine with its own scheduler overrides it to let a request's next turn start while others
        still generate.
        """
        if self.lockstep:
            self._generate_turns_lockstep(turns, params, on_generation, max_turns)
            return
        waiting: dict[int, FirstTurn] = dict(enumerate(turns))
        generated = dict.fromkeys(waiting, 0)
        while waiting:
            ready = {index: turn for index, turn in waiting.items() if not isinstance(turn, Future) or turn.done()}
            if not ready:
                wait([turn for turn in waiting.values() if isinstance(turn, Future)], return_when=FIRST_COMPLETED)
                continue
            batch = {}
            for index, turn in ready.items():
                del waiting[index]
                turn = turn.result() if isinstance(turn, Future) else turn
                if turn is not None:
                    batch[index] = turn
            if not batch:
                continue
            room = max(turn.max_new_tokens for turn in batch.values())
            call_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
            generations = self.generate([turn.prompt for turn in batch.values()], call_params,
                                        **_images_of(batch.values()))
            for (index, turn), generation in zip(batch.items(), generations):
                generated[index] += 1
                future = on_generation(index, _within(generation, turn.max_new_tokens))
                if future is not None and generated[index] < max_turns:
                    waiting[index] = future

    def _generate_turns_lockstep(
        self, turns: list[FirstTurn], params: SamplingParams, on_generation: OnGeneration, max_turns: int
    ) -> None:
        pending = {index: turn.result() if isinstance(turn, Future) else turn for index, turn in enumerate(turns)}
        pending = {index: turn for index, turn in pending.items() if turn is not None}
        for _ in range(max_turns):
            room = max((turn.max_new_tokens for turn in pending.values()), default=1)
            call_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
            generations = self.generate([turn.prompt for turn in pending.values()], call_params,
                                        **_images_of(pending.values()))
            futures = [
                (index, on_generation(index, _within(generation, turn.max_new_tokens)))
                for (index, turn), generation in zip(pending.items(), generations)
            ]
            pending = {}
            for index, future in futures:
                turn = future.result() if future is not None else None
                if turn is not None:
                    pending[index] = turn

    # Whether the weights outlive `sleep`: then a LoRA sync sends only the weights its adapters changed.
    keeps_weights_asleep = True

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Load full (unsharded) tensors by state-dict name, consuming the stream one item at a time;
        `partial`: only some of the model's tensors come (the others keep their values)."""

    def reseed(self, seed: int) -> None:
        """Restart the engine's sampling random stream from `seed`."""
        raise NotImplementedError(f"{type(self).__name__} cannot be reseeded")

    def sleep(self) -> None:
        """Release accelerator memory until `wake` (no-op by default)."""

    def wake(self) -> None:
        """Undo `sleep` (no-op by default)."""

    def abort(self) -> None:
        """Stop the generations in flight (callable from another thread): they return what they
        have so far with finish_reason "abort" (no-op by default)."""

    def shutdown(self) -> None:
        """Free the engine's memory and processes; it cannot be used afterwards (no-op by default)."""


def _images_of(turns: Iterable[Turn]) -> dict:
    """`generate`'s `images` argument for `turns`, where any turn has images (an engine without images in
    its signature is never passed one for text-only turns)."""
    images = [turn.images for turn in turns]
    return {"images": images} if any(image is not None for image in images) else {}


def _within(generation: Generation, max_new_tokens: int) -> Generation:
    """`generation` cut to `max_new_tokens` tokens (finish reason "length" if that cut it, unless aborted)."""
    if len(generation.token_ids) <= max_new_tokens:
        return generation
    reason = "abort" if generation.finish_reason == "abort" else "length"
    routes = generation.routes
    if routes is not None:  # the tokens cut off were not fed back either
        routes = routes[: len(routes) - (len(generation.token_ids) - max_new_tokens)]
    return dataclasses.replace(generation, token_ids=generation.token_ids[:max_new_tokens],
                               logprobs=generation.logprobs[:max_new_tokens], finish_reason=reason, routes=routes)
