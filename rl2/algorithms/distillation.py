"""On-policy distillation on plain tensors: a frozen teacher scores the tokens the student sampled.

The signal is the per-token reverse KL of the student from the teacher on the student's own samples,
estimated on each sampled token y_t by log p_student(y_t) - log p_teacher(y_t) (the k1 estimate, as in
Thinking Machines' "On-Policy Distillation" (2025), verl and slime). It trains either as a dense
per-token reward, -coef x that estimate (`distill_rewards`), or as a per-token loss beside the policy
loss (`distill_loss`). A per-sequence tensor is 1-D and aligned with the sequence's token ids.
"""

from torch import Tensor

from rl2.algorithms.losses import kl_penalty


def reverse_kl(student_logps: Tensor, teacher_logps: Tensor) -> Tensor:
    """Per-token k1 estimate of KL(student || teacher) on tokens the student sampled:
    log p_student(y_t) - log p_teacher(y_t)."""
    return student_logps - teacher_logps


def distill_rewards(student_logps: Tensor, teacher_logps: Tensor, mask: Tensor, coef: float) -> Tensor:
    """The dense per-token reward -coef x (log p_student - log p_teacher) on the `mask`ed (generated)
    tokens, 0 elsewhere."""
    return -coef * reverse_kl(student_logps, teacher_logps) * mask


def distill_loss(logps: Tensor, teacher_logps: Tensor, estimator: str) -> Tensor:
    """Per-token loss toward the teacher, differentiable w.r.t. the student's `logps`: Schulman's
    `estimator` of KL(student || teacher) (`rl2.algorithms.losses.kl_penalty`). k2's gradient,
    (log p_s - log p_t) grad log p_s, is the reverse KL's on the student's own samples."""
    return kl_penalty(logps, teacher_logps.detach(), estimator)
