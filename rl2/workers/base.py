"""The FSDP2 model base of the policy, the critic and the reward model: packed micro-batches,
batched inference and globally normalised gradient accumulation."""

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from rl2.config import ConfigError, ModelConfig
from rl2.distributed.fsdp import DTYPES, gathered_while_accumulating, load_fsdp_model, move_optimizer
from rl2.distributed.packing import pack_micro_batch, plan_grouped_micro_batches, unpack_row
from rl2.distributed.process_group import all_reduce_sum, build_fsdp_mesh, build_sp_group, device, rank, world_size
from rl2.distributed.ring_attention import (
    ring_attention_implementation,
    ring_kernel,
    zigzag_cu_seqlens,
    zigzag_gather,
    zigzag_position_ids,
    zigzag_split,
)
from rl2.lora import base_model
from rl2.vision.detect import is_vision_config
from rl2.vision.forward import packed_vision_inputs, vision_attention_implementation
from rl2.vision.placeholder import with_placeholder_image
from rl2.vision.positions import IMAGE_KEYS, VISION_POSITIONS, pack_vision_samples, rope_index_of
from rl2.vision.sequence_parallel import split_text_model_inputs
from rl2.vision.tower import freeze_vision_tower
from rl2.vision.value_model import vision_head_class
from rl2.workers.optim import build_optimizer

logger = logging.getLogger(__name__)

# loss_fn(outputs, micro_batch) -> (loss, metrics): the one normalisation rule of every loss. Each is a sum
# over the micro-batch of per-token (or per-pair) terms times the sequences' "loss_weight", which the
# trainer sets to sum to 1 over the whole batch (`rl2.algorithms.losses.with_loss_weights`,
# `rl2.algorithms.preference.with_pair_weights`); summed over micro-batches and ranks, they are the
# batch's weighted means. `outputs` holds the model's per-token tensors [1, T]: "logps" (and
# "entropy"), "values" or "scores".
LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def align_to_tokens(next_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Values computed at each position about the next token [1, T] → aligned with the token
    they are about: value[t] comes from position t − 1, and is 0 at sequence starts (where the
    "previous position" belongs to the previous packed sequence)."""
    return F.pad(next_values[:, :-1], (1, 0)).masked_fill(position_ids == 0, 0.0)


class ModelWorker:
    """A transformers model sharded with FSDP2 over all ranks, with its AdamW optimizer and
    schedule, run on packed micro-batches; subclasses say what `forward` returns per token.

    Every rank sees the whole list of sequences of a step (or its lengths); `pack` gives each
    data-parallel group a balanced share in packed micro-batches, the same number on every rank.
    With `sp_size > 1` the ranks of a group split each row with ZigZag ring attention
    (`rl2.distributed.ring_attention`); a row then holds up to `sp_size × max_length_per_device`
    tokens. With `trainable=False` (a reference model) no optimizer is built, and `offload_model`
    keeps the shards in CPU memory except while `compute` runs (on GPU). `model_cls` and
    `config_overrides` (set on the model's config) choose the head; `prepare` may then change the
    model before it is sharded. With `config.lora.rank` > 0 only LoRA adapters (and
    `lora_modules_to_save`, a head) train (`rl2.lora`). A vision-language model (`vlm_config`, its
    config; None for a text model) loads as an image-text-to-text model (with a head other than a causal
    LM's: its backbone with that head, `rl2.vision.value_model`) and packs its samples with their
    images and mRoPE positions (`rl2.vision`); trained, its vision tower is frozen unless `freeze_vision`
    is false. With `sp_size > 1` every rank of a group runs its vision tower over the whole row, and its
    text model runs on the rank's share (`rl2.vision.sequence_parallel`).
    """

    def __init__(
        self,
        config: ModelConfig,
        total_steps: int,
        trainable: bool = True,
        model_cls: type = AutoModelForCausalLM,
        config_overrides: dict | None = None,
        logps_chunk_size: int = 0,
        prepare: Callable[[torch.nn.Module], None] | None = None,
        lora_modules_to_save: list[str] | None = None,
    ):
        self.config = config
        self.device = device()
        self.world_size = world_size()
        self.sp_size = config.sp_size
        if self.sp_size < 1 or self.world_size % self.sp_size != 0:
            raise ValueError(f"sp_size={self.sp_size} must divide the world size {self.world_size}")
        # Ranks r·sp .. r·sp + sp − 1 share each packed row (sequence parallelism); data
        # parallelism runs over the dp = world / sp groups. FSDP shards over all ranks.
        self.dp_size = self.world_size // self.sp_size
        self.dp_rank, self.sp_rank = divmod(rank(), self.sp_size)
        self.sp_group = build_sp_group(self.sp_size) if self.sp_size > 1 else None
        if self.sp_group is not None:
            compute = torch.empty(0, 1, device=self.device, dtype=DTYPES[config.dtype])
            logger.info(f"sequence parallelism over {self.sp_size} ranks: ring attention with {ring_kernel(compute)} pieces")
        self.mesh = build_fsdp_mesh(config.fsdp_size)
        # A vision-language model (Qwen2.5-VL, Qwen3-VL): rows carry images and 3 more position rows (mRoPE).
        self.vlm_config = AutoConfig.from_pretrained(config.model_name)
        if not is_vision_config(self.vlm_config):
            self.vlm_config = None
        attn_implementation = ring_attention_implementation(self.sp_group) if self.sp_group else None
        if self.vlm_config is not None:
            model_cls, attn_implementation = self._vision_model(model_cls, attn_implementation)
        self.model = load_fsdp_model(
            config.model_name,
            self.mesh,
            self.device,
            dtype=config.dtype,
            gradient_checkpointing=config.gradient_checkpointing and trainable,
            model_cls=model_cls,
            attn_implementation=attn_implementation,
            attention=config.attn_implementation,
            compile_layers=config.compile,
            logps_chunk_size=logps_chunk_size,
            prepare=prepare,
            lora=config.lora if trainable else None,
            lora_modules_to_save=lora_modules_to_save,
            **(config_overrides or {}),
        )
        if self.vlm_config is not None and self.sp_group is not None:  # the whole row's embeddings, then the ring
            split_text_model_inputs(self.model, self.sp_rank, self.sp_size)
        if self.vlm_config is not None and trainable and getattr(config, "freeze_vision", True):
            frozen = freeze_vision_tower(self.model)  # before the optimizer is built and FSDP's lazy init
            logger.info(f"vision tower frozen: {len(frozen)} parameter tensors (freeze_vision)")
        self.optimizer = self.scheduler = None
        if trainable:
            self.optimizer, self.scheduler = build_optimizer(
                self.model, config.lr, config.weight_decay, total_steps, config.warmup_ratio
            )
        else:
            self.model.requires_grad_(False)
        self.offload_model = config.offload_model and not trainable and self.device.type == "cuda"
        if self.offload_model:
            self.model.to("cpu")  # FSDP2 moves the shards and re-registers them (FSDPModule._apply)
        if self.device.type != "cuda" and (config.offload_model or config.offload_optimizer):
            logger.info("offload_model / offload_optimizer have no effect on CPU: the model already lives there")
        elif config.offload_model and trainable:
            logger.warning("offload_model is implemented for frozen models (ref_actor.offload_model) only: "
                           "this trained model stays on the device")

    def _vision_model(self, model_cls: type, ring: str | None) -> tuple[type, dict[str, str]]:
        """The model class and attention of a vision-language model: the image-text-to-text class (for a
        policy) or its backbone with `model_cls`'s head (a critic, a reward model: `rl2.vision.value_model`),
        rl2's packed-row attention (`ring`, the registered ring attention, with sequence parallelism) for its
        text model and bidirectional sdpa for its vision tower."""
        if model_cls is AutoModelForCausalLM:
            model_cls = AutoModelForImageTextToText
        else:
            if ring is not None:
                raise ConfigError(f"{self.config.model_name} is a vision-language model: as a critic or reward "
                                  f"model it trains with sp_size=1 only (ring attention is tested for its "
                                  f"policy); set sp_size=1")
            try:
                model_cls = vision_head_class(self.vlm_config, model_cls)
            except ValueError as error:
                raise ConfigError(f"{self.config.model_name} is a vision-language model: {error}") from None
        if ring is not None:
            return model_cls, {"text_config": ring, "vision_config": "sdpa"}
        dtype = DTYPES[self.config.dtype]
        try:
            return model_cls, vision_attention_implementation(self.device, self.config.attn_implementation, dtype)
        except ValueError as error:
            raise ConfigError(f"{self.config.model_name}: {error}") from None

    @contextlib.contextmanager
    def on_device(self):
        """The model's shards on the compute device for the duration (a no-op unless offloaded)."""
        if not self.offload_model:
            yield
            return
        self.model.to(self.device)
        try:
            yield
        finally:
            self.model.to("cpu")
            torch.cuda.empty_cache()

    # ---- packing -------------------------------------------------------------------------

    def pack(
        self, sequences: list[dict[str, torch.Tensor]], max_tokens: int, group_size: int = 1
    ) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
        """This rank's share of `sequences` (dicts of 1-D tensors): its index lists and packed rows
        of at most `max_tokens` tokens per device (`sp_size` times that per row, which the ranks of
        a sequence-parallel group split between them).

        With `group_size` > 1, each run of that many consecutive sequences (a preference pair:
        chosen, rejected) is planned as one unit, so it lands whole and in order in one row.
        A micro-batch with no sequence (fewer units than ranks) becomes a row of `group_size`
        one-token sequences with an all-zero loss mask, so the rank still joins FSDP's collectives.
        """
        if sequences and "routes" in sequences[0]:  # MoE routes: a policy's (`Policy.pack`), no other model's
            sequences = [{k: v for k, v in seq.items() if k != "routes"} for seq in sequences]
        lengths = [len(seq["input_ids"]) for seq in sequences]
        plan = plan_grouped_micro_batches(lengths, group_size, self.dp_size, max_tokens * self.sp_size)[self.dp_rank]
        if group_size == 1:  # a row's sequences by length: CPU attention batches each length as one slice of the row
            plan = [sorted(indices, key=lambda i: lengths[i]) for indices in plan]
        if self.vlm_config is not None:
            rows = [self._pack_vision([sequences[i] for i in indices], sequences[0], group_size) for indices in plan]
        elif any("pixel_values" in seq for seq in sequences):
            raise ValueError(f"{self.config.model_name} is a text-only model: it cannot read sequences with images")
        else:
            placeholder = [_placeholder_like(sequences[0])] * group_size
            rows = [pack_micro_batch([sequences[i] for i in indices] or placeholder) for indices in plan]
        return plan, [{k: v.to(self.device) for k, v in row.items()} for row in rows]

    def _pack_vision(self, samples: list[dict[str, torch.Tensor]], first: dict[str, torch.Tensor],
                     group_size: int) -> dict[str, torch.Tensor]:
        """A vision-language row: per-sample mRoPE positions and the samples' images; a row without an
        image gets a placeholder image as its next sequence (`rl2.vision.placeholder`: every rank runs the
        vision tower, FSDP's collectives line up), then `group_size` − 1 one-token sequences so the row still
        holds whole groups (a preference pair: chosen, rejected); nothing reads their outputs (`unpack_row`
        by the plan). Sequences without `mm_token_type_ids` (an RL trajectory's) get it from their image-pad
        tokens."""
        if not samples:
            per_token = {k: v for k, v in first.items() if k not in IMAGE_KEYS and k != VISION_POSITIONS}
            samples = [_placeholder_like(per_token)] * group_size
        samples = [self._with_token_types(sample) for sample in samples]
        with_image = with_placeholder_image(samples, self.vlm_config)
        if len(with_image) > len(samples) and group_size > 1:
            per_token = {k: v for k, v in samples[0].items() if k not in IMAGE_KEYS and k != VISION_POSITIONS}
            with_image += [_placeholder_like(per_token)] * (group_size - 1)
        rope_index = rope_index_of(base_model(self.model))
        return pack_vision_samples(with_image, rope_index)

    def _with_token_types(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`sample` with `mm_token_type_ids` (1 on image-pad tokens), which mRoPE positions are computed from."""
        if "mm_token_type_ids" in sample:
            return sample
        return {**sample, "mm_token_type_ids": (sample["input_ids"] == self.vlm_config.image_token_id).long()}

    def forward(self, micro_batch: dict[str, torch.Tensor], with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """The model's per-token outputs [1, T] for a packed row, by name (e.g. "logps", "values")."""
        raise NotImplementedError

    def _model_inputs(self, micro_batch: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
        """The model's inputs for this rank's tokens of a packed row, and the id of the token that
        follows each of them [1, T] (the row's next token; meaningless at a sequence's last token)."""
        input_ids, cu_seqlens = micro_batch["input_ids"], micro_batch["cu_seqlens"]
        next_ids = F.pad(input_ids[:, 1:], (0, 1))
        if self.vlm_config is not None:  # 4-row positions (text, then mRoPE's), the row's images
            # The whole row, also with sequence parallelism: the text model takes this rank's share itself.
            inputs = packed_vision_inputs(micro_batch)
            if self.sp_group is None:
                return inputs, next_ids
            return inputs, zigzag_split(next_ids, cu_seqlens, self.sp_rank, self.sp_size)
        if self.sp_group is None:
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # one host sync here, not one per layer
            inputs = {
                "input_ids": input_ids,
                "position_ids": micro_batch["position_ids"],
                "cu_seq_lens_q": cu_seqlens,
                "cu_seq_lens_k": cu_seqlens,
                "max_length_q": longest,
                "max_length_k": longest,
                "use_cache": False,
            }
            return inputs, next_ids
        local_cu = zigzag_cu_seqlens(cu_seqlens, self.sp_size)
        longest = int((local_cu[1:] - local_cu[:-1]).max())
        inputs = {
            "input_ids": zigzag_split(input_ids, cu_seqlens, self.sp_rank, self.sp_size),
            "position_ids": zigzag_position_ids(cu_seqlens, self.sp_rank, self.sp_size).to(self.device),
            "cu_seq_lens_q": local_cu,
            "cu_seq_lens_k": local_cu,
            "max_length_q": longest,
            "max_length_k": longest,
            "use_cache": False,
        }
        return inputs, zigzag_split(next_ids, cu_seqlens, self.sp_rank, self.sp_size)

    def _per_token_outputs(self, **inputs) -> torch.Tensor:
        """The model's head output at every input token, [1, T, ...]."""
        return self.model(**inputs).logits

    def _gather(self, values: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's per-token values → the whole row's (a no-op without sequence parallelism);
        gradients flow back to the rank that computed each token."""
        if self.sp_group is None:
            return values
        return zigzag_gather(values, micro_batch["cu_seqlens"], self.sp_group)

    def _align(self, next_values: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token values computed at each token for the next one ([1, T], or this rank's zigzag
        part) → aligned with the tokens they are about: value[t] comes from position t − 1, and
        is 0 at sequence starts. With sequence parallelism the whole row is gathered on every
        rank of the group; gradients flow back to the rank that computed each token."""
        return align_to_tokens(self._gather(next_values, micro_batch), micro_batch["position_ids"])

    @torch.no_grad()
    def compute(self, sequences: list[dict[str, torch.Tensor]], output: str = "logps") -> list[torch.Tensor]:
        """One per-token output of every sequence as 1-D tensors: each rank computes its share,
        all ranks get all."""
        self.model.eval()
        plan, rows = self.pack(sequences, self._inference_max_tokens())
        with self.on_device():
            values = [self.forward(row)[output] for row in rows]
        return self._per_sequence(sequences, plan, rows, values)

    def _per_sequence(self, sequences: list[dict[str, torch.Tensor]], plan: list[list[int]], rows: list[dict],
                      values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-token `values` of this rank's packed `rows` (planned as `plan`) → every sequence's, on all ranks."""
        lengths = [len(seq["input_ids"]) for seq in sequences]
        result = [torch.zeros(n) for n in lengths]
        for indices, row, row_values in zip(plan, rows, values):
            for i, sequence_values in zip(indices, unpack_row(row_values.detach().float().cpu(), row["cu_seqlens"].cpu())):
                result[i] = sequence_values
        # Each sequence was computed by exactly one data-parallel group (whose SP ranks all hold it;
        # the first one reports it), zeros elsewhere: a sum gathers them all.
        local = torch.cat(result) if self.sp_rank == 0 else torch.zeros(sum(lengths))
        return list(all_reduce_sum(local).split(lengths))

    @torch.no_grad()
    def evaluate(
        self, sequences: list[dict[str, torch.Tensor]], loss_fn: LossFn, group_size: int = 1
    ) -> dict[str, float]:
        """`loss_fn`'s loss and metrics over `sequences`, without updating; `group_size` as in `pack`."""
        self.model.eval()
        _, rows = self.pack(sequences, self._inference_max_tokens(), group_size)
        with self.on_device():
            return self._accumulate(rows, loss_fn, backward=False)

    def train_step(
        self, sequences: list[dict[str, torch.Tensor]], loss_fn: LossFn, group_size: int = 1
    ) -> dict[str, float]:
        """One optimizer step over all `sequences` (see `accumulate_gradients`)."""
        metrics = self.accumulate_gradients(sequences, loss_fn, group_size)
        return self._step(metrics)

    def train_step_keeping(
        self, sequences: list[dict[str, torch.Tensor]], loss_fn: LossFn, output: str
    ) -> tuple[dict[str, float], list[torch.Tensor]]:
        """`train_step`, also returning every sequence's `output` from the step's own forward pass (the
        model before the update; detached, as `compute` gives it), on all ranks."""
        self.model.train()
        plan, rows = self.pack(sequences, self.config.max_length_per_device)
        kept: list[torch.Tensor] = []
        metrics = self._accumulate(rows, loss_fn, backward=True, kept=(output, kept))
        return self._step(metrics), self._per_sequence(sequences, plan, rows, kept)

    def _step(self, metrics: dict[str, float]) -> dict[str, float]:
        metrics["lr"] = self.scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler moves on after it)
        metrics["grad_norm"] = self.optimizer_step()
        return metrics

    def accumulate_gradients(
        self, sequences: list[dict[str, torch.Tensor]], loss_fn: LossFn, group_size: int = 1
    ) -> dict[str, float]:
        """Backward over this rank's micro-batches of `sequences`.

        The loss is the sum of `loss_fn`'s results over every micro-batch of every rank: with the
        sequences' `loss_weight` summing to 1 over the batch, the batch's weighted mean. Gradients
        therefore do not depend on the world size, the packing or the number of micro-batches.
        `group_size` keeps groups of sequences together (see `pack`).
        """
        self.model.train()
        _, rows = self.pack(sequences, self.config.max_length_per_device, group_size)
        return self._accumulate(rows, loss_fn, backward=True)

    def _accumulate(self, rows: list[dict], loss_fn: LossFn, backward: bool,
                    kept: tuple[str, list[torch.Tensor]] | None = None) -> dict[str, float]:
        # The ranks of a sequence-parallel group hold the same rows: only the first one reports.
        reporting = 1.0 if self.sp_rank == 0 else 0.0
        tokens = all_reduce_sum(reporting * float(sum(row["loss_mask"].sum().item() for row in rows)))
        totals: dict[str, float] = {}
        with gathered_while_accumulating(self.model, backward and self.world_size == 1) as before_micro_batch:
            for index, row in enumerate(rows):
                before_micro_batch(index == len(rows) - 1)
                outputs = self.forward(row, with_entropy=backward)
                if kept is not None:
                    kept[1].append(outputs[kept[0]].detach())
                loss, metrics = loss_fn(outputs, row)
                if backward:
                    # FSDP averages gradients over all ranks; undo that: we want the sum over the
                    # data-parallel groups (each SP rank's backward reaches only its own tokens).
                    (loss * self.world_size).backward()
                for name, value in {"loss": loss, **metrics}.items():
                    totals[name] = totals.get(name, 0.0) + float(value.detach())
        metrics = {name: all_reduce_sum(reporting * value) for name, value in sorted(totals.items())}
        metrics["loss_tokens"] = tokens
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
