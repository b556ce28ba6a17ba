"""A rollout engine on plain transformers: a batched KV-cache sampling loop with exact log-probs.

Slower than a serving engine, but it needs nothing beyond transformers, runs on CPU, and its
log-probs follow the trainer's convention exactly. Prompts are sorted by length and run in
chunks of at most `max_batch_size`, left-padded; finished rows leave the batch (and its KV
cache) as soon as they finish.
"""

import logging
import threading
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

from rl2.engines.base import Engine, Generation, SamplingParams
from rl2.fsdp import DTYPES

logger = logging.getLogger(__name__)


class HFEngine(Engine):
    """An unsharded copy of the policy in `dtype` on `device`, sampling with its own seeded generator."""

    def __init__(
        self,
        model_path: str,
        tokenizer,
        device: torch.device,
        dtype: str = "float32",
        seed: int = 0,
        max_batch_size: int = 64,
    ):
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], attn_implementation="sdpa"
        ).to(self.device)
        self.model.eval()
        self.eos_ids = _eos_ids(tokenizer, self.model)
        # Padding is masked out, so any valid id will do.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.asleep = False
        self.aborting = threading.Event()

    # ---- generation ------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One generation per prompt, in the order of `prompts`."""
        if self.asleep:
            raise RuntimeError("HFEngine.generate called while asleep: call wake() first")
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        self.aborting.clear()
        # Longest first: similar lengths share a chunk (less padding), and memory peaks early.
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            for i, generation in zip(chunk, self._generate_chunk([prompts[i] for i in chunk], params)):
                results[i] = generation
        return results

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        batch, width = len(prompts), max(len(prompt) for prompt in prompts)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        # Positions count real tokens only, so a left-padded row sees the positions it would alone.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        next_positions = attention_mask.sum(-1, keepdim=True)

        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]

        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish: list[str | None] = [None] * batch
        active = list(range(batch))  # chunk rows still generating, in cache order
        while True:
            if self.aborting.is_set():
                for row in active:
                    finish[row] = "abort"
                break
            next_tokens, next_logprobs = sample(logits, params, self.generator)
            for row, token, logprob in zip(active, next_tokens.tolist(), next_logprobs.tolist()):
                tokens[row].append(token)
                logprobs[row].append(logprob)
                finish[row] = self._finish_reason(tokens[row], stop_ids, params)
            keep = [j for j, row in enumerate(active) if finish[row] is None]
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                attention_mask, next_positions, next_tokens = (
                    attention_mask[index], next_positions[index], next_tokens[index]
                )
                active = [active[j] for j in keep]
            attention_mask = F.pad(attention_mask, (0, 1), value=1)
            logits = self.model(
                input_ids=next_tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_positions,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            next_positions = next_positions + 1
        return [
            Generation(tokens[row], logprobs[row], finish[row], "aborted" if finish[row] == "abort" else None)
            for row in range(batch)
        ]

    def _finish_reason(self, tokens: list[int], stop_ids: set[int], params: SamplingParams) -> str | None:
        """"stop" / "length" if the row is done after its last token, else None."""
        if tokens[-1] in stop_ids or (params.stop and self._completes_stop_string(tokens, params.stop)):
            return "stop"
        if len(tokens) >= params.max_new_tokens:
            return "length"
        return None

    def _completes_stop_string(self, tokens: list[int], stops: list[str]) -> bool:
        """Whether the last token completes one of `stops` (checked after every token, so only the tail)."""
        # A character is at most 4 bytes and a byte-level token holds at least 1 byte, so the
        # tokens that make up a stop string are among the last 4 per character (+1 to spare).
        window = 4 * max(len(stop) for stop in stops) + 1
        text = self.tokenizer.decode(
            tokens[-window:], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return any(stop in text for stop in stops)

    # ---- weights and memory ----------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (state-dict name, full tensor) into the model, casting dtype and device.

        Tied weights (e.g. `lm_head.weight` and `model.embed_tokens.weight`) are one tensor:
        either name updates it. Every tensor of the state dict must arrive at least once.
        """
        targets = self.model.state_dict(keep_vars=True)
        pending = {}  # id(tensor) -> a name of it, for tensors not updated yet
        for name, target in targets.items():
            pending.setdefault(id(target), name)
        for name, tensor in named_tensors:
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
        if pending:
            names = list(pending.values())
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            raise ValueError(
                f"update_weights: {len(names)} parameters were not updated (the engine now mixes old and new "
                f"weights): {', '.join(names[:5])}{more}"
            )

    def abort(self) -> None:
        """Make the running `generate` return at its next token, the unfinished rows with "abort"."""
        self.aborting.set()

    def shutdown(self) -> None:
        """Drop the model."""
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reseed(self, seed: int) -> None:
        """Restart sampling from `seed`: the same prompts and parameters then give the same samples."""
        self.generator.manual_seed(seed)

    def sleep(self) -> None:
        """On CUDA, move the model to CPU and free the cached accelerator memory."""
        if self.device.type == "cuda" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.asleep = True

    def wake(self) -> None:
        """Move the model back to its device after `sleep`."""
        if self.asleep:
            self.model.to(self.device)
            self.asleep = False


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] from last-position logits [B, V], and their log-probs under softmax(logits / T).

    Temperature 0 is greedy (log-probs at T = 1). top_k then top_p restrict what is sampled, not
    the reported log-probs.
    """
    logits = logits.float()
    if params.temperature == 0:
        next_tokens = logits.argmax(-1)
        logps = torch.log_softmax(logits, -1)
    else:
        logits = logits / params.temperature
        logps = torch.log_softmax(logits, -1)
        filtered = filter_top_k_top_p(logits, params.top_k, params.top_p)
        next_tokens = torch.multinomial(filtered.softmax(-1), 1, generator=generator).squeeze(-1)
    return next_tokens, logps.gather(-1, next_tokens[:, None]).squeeze(-1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` with -inf outside the top_k tokens, then outside the nucleus of mass top_p.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p; it
    always holds the most likely token.
    """
    if top_k != -1 and top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = logits.sort(-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        outside_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before it already reaches top_p
        outside = outside_sorted.scatter(-1, sorted_index, outside_sorted)
        logits = logits.masked_fill(outside, float("-inf"))
    return logits


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
