"""Stand-in for sglang.srt.utils.patch_torch (SGLang patches CUDA tensor pickling for IPC)."""


def monkey_patch_torch_reductions() -> None:
    """Nothing to patch for CPU tensors."""
