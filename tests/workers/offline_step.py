"""An offline trainer (sft, rm, dpo) run as from the command line; rank 0 saves what its optimizer stepped with.

Usage: offline_step.py TRAINER OUT_FILE [--sgd] key=value ...

The trainer trains, logs and saves as `python -m rl2.trainer.TRAINER key=value ...` would; with
`--sgd` its model steps with plain SGD at the configured lr instead of AdamW (step_capture.py says
why). Saved: the trained model's parameters before training and after it, the full gradients and lr
of every optimizer step, and (AdamW) "replayed": the parameters AdamW gives from the same start and
those gradients in one process.
"""

import sys

import torch

from rl2 import DPOTrainer, RMTrainer, SFTTrainer
from rl2.config import load_config
from rl2.distributed.process_group import exit_process, is_rank0
from rl2.distributed.fsdp import gather_full_state_dict
from step_capture import capture_steps, replay_adamw, use_sgd

TRAINERS = {"sft": SFTTrainer, "rm": RMTrainer, "dpo": DPOTrainer}


def main() -> None:
    trainer_name, out_file, *overrides = sys.argv[1:]
    sgd = "--sgd" in overrides
    trainer = TRAINERS[trainer_name](load_config([o for o in overrides if o != "--sgd"]))
    if sgd:
        use_sgd(trainer.trained)
    model, optimizer = trainer.trained.model, trainer.trained.optimizer
    # cloned: on one CPU rank the full state dict shares memory with the parameters
    before = {name: tensor.clone() for name, tensor in gather_full_state_dict(model).items()}
    steps = capture_steps(model, optimizer)
    trainer.train()
    after = gather_full_state_dict(model)
    if is_rank0():
        replayed = {} if sgd else replay_adamw(before, steps, optimizer)
        torch.save({"before": before, "after": after, "steps": steps, "replayed": replayed}, out_file)


if __name__ == "__main__":
    main()
    exit_process(0)  # see its docstring: gloo can abort a finished rank during interpreter teardown
