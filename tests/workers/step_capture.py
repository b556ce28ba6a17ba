"""What an optimizer steps with (the full gradients and the lr of every step), its replay, and SGD.

Imported by the workers next to it (a script's own folder is first on sys.path).

Why: Adam's first steps are ~lr * sign(g), so an element whose gradient is near zero turns
reduction-order rounding (which differs between 1 and 2 ranks, and between processors) into a step
of up to lr either way. Comparing parameters after an AdamW step across world sizes therefore
depends on the machine, and so does everything computed after it (the next step's gradients, a loss
curve). What does not: the gradients before the step (equal up to float32 rounding of sums); the
step replayed from those same gradients (elementwise arithmetic, nothing to amplify); and steps of
plain SGD, which moves a parameter by lr times its gradient, so rounding stays rounding.
"""

import torch


def capture_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """A list that gets, at every `optimizer.step()` (after clipping, before the update), the full
    (unsharded) gradients by parameter name (those that have one) and the lr. Every rank must step:
    gathering a sharded gradient is a collective. Steps at lr 0 change nothing and are left out: saving
    a checkpoint takes one to initialise an optimizer that keeps no state yet (SGD)."""
    steps: list[dict] = []

    def capture(*_) -> None:
        if optimizer.param_groups[0]["lr"] == 0:
            return
        grads = {}
        for name, param in model.named_parameters():
            if param.grad is None:
                continue  # not trained by this step (the optimizer skips it too)
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            grads[name] = grad.detach().cpu().clone()
        steps.append({"grads": grads, "lr": optimizer.param_groups[0]["lr"]})

    optimizer.register_step_pre_hook(capture)
    return steps


def replay_adamw(
    before: dict[str, torch.Tensor], steps: list[dict], optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """The parameters that `optimizer`'s hyper-parameters (AdamW: betas, eps, weight decay) give
    from `before` and the captured steps, computed here in one process on plain tensors."""
    group = optimizer.param_groups[0]
    params = {name: before[name].clone().requires_grad_() for name in steps[0]["grads"]}
    adamw = torch.optim.AdamW(
        params.values(), lr=steps[0]["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"]
    )
    for step in steps:
        adamw.param_groups[0]["lr"] = step["lr"]
        for name, param in params.items():
            param.grad = step["grads"][name].clone()
        adamw.step()
    return {name: param.detach() for name, param in params.items()}


def use_sgd(model) -> None:
    """Step `model` (an rl2 Policy or one of its subclasses) with plain SGD at its configured lr, kept
    constant, instead of its AdamW and schedule."""
    model.optimizer = torch.optim.SGD([p for p in model.model.parameters() if p.requires_grad], lr=model.config.lr)
    model.scheduler = torch.optim.lr_scheduler.LambdaLR(model.optimizer, lambda _: 1.0)
