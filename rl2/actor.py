"""The FSDP2 policy model: log-probs on packed micro-batches and globally normalised updates."""

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rl2.config import ModelConfig
from rl2.distributed import all_reduce_sum, build_fsdp_mesh, device, rank, world_size
from rl2.fsdp import load_fsdp_model, move_optimizer
from rl2.optim import build_optimizer
from rl2.packing import pack_micro_batch, plan_micro_batches, unpack_row

logger = logging.getLogger(__name__)

# loss_fn(logps, micro_batch) -> (sum of per-token losses over the micro-batch, metrics summed likewise)
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens before t in its sequence), aligned with `input_ids`; 0 at sequence starts."""
    logps = -F.cross_entropy(
        logits[0, :-1].float(), input_ids[0, 1:], reduction="none"
    )
    logps = F.pad(logps, (1, 0)).unsqueeze(0)
    # A sequence's first token is "predicted" by the previous packed sequence: meaningless.
    return logps.masked_fill(position_ids == 0, 0.0)


class Actor:
    """A causal LM sharded with FSDP2 over all ranks, with its AdamW optimizer and schedule.

    Every rank sees the whole list of sequences of a step (or its lengths); `plan_micro_batches`
    gives each rank a balanced share in packed micro-batches of at most `max_length_per_device`
    tokens, the same number on every rank.
    """

    def __init__(self, config: ModelConfig, total_steps: int, model_cls: type = AutoModelForCausalLM):
        self.config = config
        self.device = device()
        self.dp_rank, self.dp_size = rank(), world_size()
        if config.sp_size != 1:
            raise ValueError(f"sp_size={config.sp_size}: sequence parallelism is not available yet; use sp_size=1")
        self.mesh = build_fsdp_mesh(config.fsdp_size)
        self.model = load_fsdp_model(
            config.model_name,
            self.mesh,
            self.device,
            dtype=config.dtype,
            gradient_checkpointing=config.gradient_checkpointing,
            model_cls=model_cls,
        )
        self.optimizer, self.scheduler = build_optimizer(
            self.model, config.lr, config.weight_decay, total_steps, config.warmup_ratio
        )
        if self.device.type != "cuda" and (config.offload_model or config.offload_optimizer):
            logger.info("offload_model / offload_optimizer have no effect on CPU: the model already lives there")

    # ---- packing -------------------------------------------------------------------------

    def pack(
        self, sequences: list[dict[str, torch.Tensor]], max_tokens: int
    ) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
        """This rank's share of `sequences` (dicts of 1-D tensors): its index lists and packed rows.

        A micro-batch with no sequence (fewer sequences than ranks) becomes a one-token row with
        an all-zero loss mask, so the rank still joins FSDP's collectives.
        """
        lengths = [len(seq["input_ids"]) for seq in sequences]
        plan = plan_micro_batches(lengths, self.dp_size, max_tokens)[self.dp_rank]
        rows = [
            pack_micro_batch([sequences[i] for i in indices] or [_placeholder_like(sequences[0])])
            for indices in plan
        ]
        return plan, [{k: v.to(self.device) for k, v in row.items()} for row in rows]

    # ---- forward / backward ----------------------------------------------------------------

    def forward_logps(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token log-probs [1, T] of a packed row."""
        logits = self.model(
            input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"], use_cache=False
        ).logits
        return token_logps(logits, micro_batch["input_ids"], micro_batch["position_ids"])

    @torch.no_grad()
    def compute_logps(self, sequences: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Log-probs of every sequence as 1-D tensors: each rank computes its share, all ranks get all."""
        self.model.eval()
        lengths = [len(seq["input_ids"]) for seq in sequences]
        result = [torch.zeros(n) for n in lengths]
        plan, rows = self.pack(sequences, self._inference_max_tokens())
        for indices, row in zip(plan, rows):
            per_sequence = unpack_row(self.forward_logps(row).cpu(), row["cu_seqlens"].cpu())
            for i, logps in zip(indices, per_sequence):
                result[i] = logps
        # Each sequence was computed on exactly one rank, zeros elsewhere: a sum gathers them all.
        return list(all_reduce_sum(torch.cat(result)).split(lengths))

    @torch.no_grad()
    def evaluate(self, sequences: list[dict[str, torch.Tensor]], loss_fn: LossFn) -> dict[str, float]:
        """`loss_fn`'s loss and metrics over `sequences`, per loss token, without updating."""
        self.model.eval()
        _, rows = self.pack(sequences, self._inference_max_tokens())
        return self._per_token(rows, loss_fn, backward=False)

    def train_step(self, sequences: list[dict[str, torch.Tensor]], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over all `sequences` (see `accumulate_gradients`)."""
        metrics = self.accumulate_gradients(sequences, loss_fn)
        metrics["grad_norm"] = self.optimizer_step()
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def accumulate_gradients(self, sequences: list[dict[str, torch.Tensor]], loss_fn: LossFn) -> dict[str, float]:
        """Backward over this rank's micro-batches of `sequences`.

        The loss is the sum of per-token losses divided by the number of loss tokens in the whole
        global batch, so gradients do not depend on the world size, the packing or the number of
        micro-batches.
        """
        self.model.train()
        _, rows = self.pack(sequences, self.config.max_length_per_device)
        return self._per_token(rows, loss_fn, backward=True)

    def _per_token(self, rows: list[dict], loss_fn: LossFn, backward: bool) -> dict[str, float]:
        totals: dict[str, float] = {}
        global_tokens = max(all_reduce_sum(float(sum(row["loss_mask"].sum().item() for row in rows))), 1.0)
        for row in rows:
            loss_sum, metric_sums = loss_fn(self.forward_logps(row), row)
            if backward:
                # FSDP averages gradients over the data-parallel ranks; undo that: we want the sum.
                (loss_sum * self.dp_size / global_tokens).backward()
            for name, value in {"loss": loss_sum, **metric_sums}.items():
                totals[name] = totals.get(name, 0.0) + float(value.detach())
        metrics = {name: all_reduce_sum(value) / global_tokens for name, value in totals.items()}
        metrics["loss_tokens"] = global_tokens
        return metrics

    def _inference_max_tokens(self) -> int:
        return self.config.max_inference_length_per_device or self.config.max_length_per_device

    def optimizer_step(self) -> float:
        """Clip, step and schedule; a non-finite gradient norm skips the update (logged).

        With `offload_optimizer` on GPU the optimizer state lives on CPU between steps.
        """
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        offload_optimizer = self.config.offload_optimizer and self.device.type == "cuda"
        if torch.isfinite(grad_norm):
            if offload_optimizer:
                move_optimizer(self.optimizer, self.device)
            self.optimizer.step()
            if offload_optimizer:
                move_optimizer(self.optimizer, "cpu")
        else:
            logger.warning(f"non-finite gradient norm {grad_norm.item()}: update skipped")
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm.item()


def _placeholder_like(sequence: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A one-token sequence with the same keys and dtypes and nothing in the loss."""
    return {key: torch.zeros(1, dtype=value.dtype) for key, value in sequence.items()}


def sft_loss(logps: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Negative log-likelihood summed over the loss-masked tokens."""
    return -(logps * micro_batch["loss_mask"]).sum(), {}
