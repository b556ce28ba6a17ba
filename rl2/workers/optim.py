"""AdamW with linear warm-up and cosine decay."""

import torch
from torch import nn
from transformers import get_cosine_schedule_with_warmup


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float, total_steps: int, warmup_ratio: float
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters and its per-step learning-rate schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=int(warmup_ratio * total_steps), num_training_steps=max(total_steps, 1)
    )
    return optimizer, scheduler
