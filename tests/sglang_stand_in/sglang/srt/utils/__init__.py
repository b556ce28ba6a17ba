"""Stand-in for sglang.srt.utils: the serializer for weight payloads."""

import base64
import os
import pickle


class MultiprocessingSerializer:
    """Pickles a payload with the rank of the process that made it, so the stand-in engine can
    check that payload i came from TP rank i (SGLang's carries CUDA IPC handles of that GPU)."""

    @staticmethod
    def serialize(obj, output_str: bool = False):
        data = pickle.dumps({"rank": int(os.environ.get("RANK", 0)), "obj": obj})
        return base64.b64encode(data).decode() if output_str else data

    @staticmethod
    def deserialize(data):
        return producer_and_payload(data)[1]


def producer_and_payload(data) -> tuple[int, object]:
    if isinstance(data, str):
        data = base64.b64decode(data)
    unpacked = pickle.loads(data)
    return unpacked["rank"], unpacked["obj"]


def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                              group_name=None, pg_options=None):
    """A process group outside the default one, met at `init_method` (SGLang's builds it with torch's
    internals; here a gloo group over the same rendezvous: the tests run on CPU)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import PrefixStore

    if store is None:
        store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size))
    timeout = timeout or datetime.timedelta(minutes=5)
    return dist.ProcessGroupGloo(PrefixStore(group_name or "", store), rank, world_size, timeout)
