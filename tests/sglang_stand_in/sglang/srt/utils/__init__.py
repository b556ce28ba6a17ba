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
