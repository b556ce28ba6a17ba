"""One actor step on one rank over many micro-batches, with the layers kept gathered while gradients accumulate
(`gathered_while_accumulating`, what a one-rank mesh gets) and without; saves both steps' gradients, parameters
after the step, metrics and collective counts.

Usage: one_rank_accumulation.py MODEL_DIR OUT_FILE DTYPE
"""

import sys
from unittest import mock

import torch
import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group

import rl2.workers.base as worker_base
from rl2.algorithms.losses import sft_loss, with_loss_weights
from rl2.config import ModelConfig
from rl2.distributed.fsdp import gather_full_state_dict, gathered_while_accumulating
from rl2.distributed.process_group import exit_process, init_distributed
from rl2.workers.policy import Policy
from fsdp_step import random_batch


def one_step(model_dir: str, dtype: str, keep_gathered: bool) -> dict:
    config = ModelConfig(model_name=model_dir, dtype=dtype, gradient_checkpointing=False, max_length_per_device=64,
                         lr=1e-3, max_grad_norm=1e9)
    actor = Policy(config, total_steps=10)
    batch = with_loss_weights(random_batch(actor.model.config.vocab_size, 13))
    # FSDP2 on one rank skips the collectives themselves; what is counted is what it still does for each:
    # a group's parameters made unsharded (the cast to the compute dtype), its gradients reduced into the shards.
    counts = {"all_gather": 0, "reduce_scatter": 0}
    unshard = fsdp_param_group.FSDPParamGroup.unshard

    def counted_unshard(group, *args, **kwargs):
        counts["all_gather"] += not group.is_unsharded and group._all_gather_result is None
        return unshard(group, *args, **kwargs)

    def counted(name, collective):
        def call(*args, **kwargs):
            counts[name] += 1
            return collective(*args, **kwargs)
        return call

    switch = (lambda model, enabled: gathered_while_accumulating(model, enabled and keep_gathered))
    with mock.patch.object(worker_base, "gathered_while_accumulating", switch), \
            mock.patch.object(fsdp_param_group.FSDPParamGroup, "unshard", counted_unshard), \
            mock.patch.object(fsdp_param_group, "foreach_reduce", counted("reduce_scatter", fsdp_param_group.foreach_reduce)):
        metrics = actor.accumulate_gradients(batch, sft_loss)
    packed = actor.pack(batch, config.max_length_per_device)[1]
    rows = len(packed)
    row_lengths = [(row["cu_seqlens"][1:] - row["cu_seqlens"][:-1]).tolist() for row in packed]
    grads = {name: p.grad.full_tensor().clone() for name, p in actor.model.named_parameters()}
    metrics["grad_norm"] = actor.optimizer_step()
    params = {name: t.clone() for name, t in gather_full_state_dict(actor.model).items()}
    logps = actor.compute(batch)  # after the step: the engine-facing forward sees the updated weights
    return {"grads": grads, "params": params, "metrics": metrics, "counts": counts, "rows": rows, "logps": logps,
            "row_lengths": row_lengths}


def main() -> None:
    model_dir, out_file, dtype = sys.argv[1:4]
    init_distributed()
    torch.save({keep: one_step(model_dir, dtype, keep) for keep in (True, False)}, out_file)


if __name__ == "__main__":
    main()
    exit_process(0)
