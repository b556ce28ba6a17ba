"""`killed_mid_shard.py STEP_DIR RANK MODULE ARGS...`: run `python -m MODULE ARGS...`, on a rank that, if it is
RANK (torchrun's), SIGKILLs itself once it has written the first item of its checkpoint shard in STEP_DIR/dcp:
a rank killed while it writes its part of a save (the shard left partial, as a crash leaves it)."""

import os
import runpy
import signal
import sys

import torch.distributed.checkpoint.filesystem as filesystem

step_dir, killed_rank, module, *args = sys.argv[1:]
write_item = filesystem._write_item  # dcp writes each item of a shard file with it, in that file's order


def write_then_die(transforms, stream, *rest, **kwargs):
    result = write_item(transforms, stream, *rest, **kwargs)
    in_step = os.path.dirname(os.path.abspath(stream.name)) == os.path.join(os.path.abspath(step_dir), "dcp")
    if in_step and os.environ["RANK"] == killed_rank:
        stream.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return result


filesystem._write_item = write_then_die
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
