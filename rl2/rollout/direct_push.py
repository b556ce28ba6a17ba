"""The first trainer's weight group with SGLang's engines (split placement, `rollout.engine=sglang`): the
weights go from the trainer straight to the engines' TP workers, NCCL on GPUs, as SGLang's
`init_weights_update_group` / `update_weights_from_distributed` expect (verl and OpenRLHF push the same way).

The trainer is rank 0 of the group; the workers of engine e are ranks 1 + e x tp_size + tp_rank (one node:
the rendezvous is on this machine). The group is made with SGLang's own `init_custom_process_group`, so both
sides meet the same store; the trainer's sender thread joins it, then broadcasts each staged weight in the
order of the request that the engines' leaders pass to `update_weights_from_distributed`.
"""

import socket

import torch


GROUP_NAME = "rl2_weights"


class DirectPush:
    """The trainer's side of the weight group."""

    def __init__(self):
        self.name = GROUP_NAME
        self.group = None
        self.requested = False

    def group_request(self, rollout_ranks: int) -> dict:
        """The request that makes the rollout ranks' engines join (sent once, before the first push)."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.requested = True
        return {"kind": "weight_group", "address": "127.0.0.1", "port": port, "world": 1 + rollout_ranks,
                "group": self.name}

    def join(self, request: dict) -> None:
        """Join as rank 0 (in the sender thread, right after the request went out: both sides block until all joined)."""
        from rl2.engines.sglang import load_sglang

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.group = load_sglang().init_custom_process_group(
            backend=backend, init_method=f"tcp://{request['address']}:{request['port']}", world_size=request["world"],
            rank=0, group_name=request["group"])
