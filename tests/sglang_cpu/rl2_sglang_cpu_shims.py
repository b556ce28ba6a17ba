"""Shims that let the real SGLang run on a CPU machine without CUDA, in `make test-sglang`'s virtual environments
(and vLLM's Qwen-VL models, for the torchvision part, in `make test-vllm`'s): their .pth file imports this module at
start-up and calls `install()`; nothing of rl2's imports it.

- `sgl_kernel`: SGLang's kernel package is built for CUDA alone (its wheels fail to import without libcuda.so.1).
  On a CPU without AMX SGLang takes its pure-torch paths and only *imports* kernel names at module load. This is
  an import-only stand-in: every `sgl_kernel.*` module imports, every name in it is a function that raises
  `KernelCalled` if it is ever called, so a path that would need a real kernel fails loudly, naming it.
- `torchvision`: the registry's build is CUDA's, whose operators do not load beside torch+cpu; its meta
  registrations then fail on import (`operator torchvision::nms does not exist`), and SGLang and transformers'
  image processors import it. Before torchvision loads, its operators' schemas are defined here (none is run:
  a text model's engine never calls them).
- `torch.ops.sgl_kernel`: a few SGLang model modules look a CPU kernel up in torch's operator registry at import
  (`qwen3_5.py`: `torch.ops.sgl_kernel.fused_sigmoid_mul_cpu`), and the Qwen-VL image processor module imports
  one of them; without the operator, SGLang skips that processor and refuses every Qwen-VL model ("No processor
  registered"). Before SGLang loads, those operators are defined here, with no kernel: a call fails loudly in
  torch's dispatcher.
"""

import importlib.abc
import importlib.machinery
import sys
import types

KERNEL_PACKAGE = "sgl_kernel"

# torchvision's operators (torchvision/csrc/ops/*.cpp), as its meta registrations look them up.
TORCHVISION_SCHEMAS = [
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) "
    "-> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
]


# The sgl_kernel CPU operators SGLang's modules look up at import time without AMX (qwen3_5.py, gdn_backend.py,
# gdn_triton.py). Their arguments here are a placeholder: none has a kernel, so any call fails.
SGL_KERNEL_IMPORT_TIME_OPERATORS = [
    "fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu", "fused_gdn_gating_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
]


class KernelCalled(RuntimeError):
    """A function of the import-only `sgl_kernel` stand-in was called: this SGLang path needs the real kernels."""


class _Kernel:
    """A name of the stand-in: calling it raises `KernelCalled`; its attributes are names too
    (`scalar_types.uint4b8` at SGLang's module level)."""

    def __init__(self, qualified_name: str):
        self._qualified_name = qualified_name

    def __call__(self, *args, **kwargs):
        raise KernelCalled(f"{self._qualified_name} was called, but sgl_kernel here is rl2's import-only stand-in "
                           "(tests/sglang_cpu): this SGLang path needs CUDA kernels")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Kernel(f"{self._qualified_name}.{name}")

    def __repr__(self) -> str:
        return f"<import-only stand-in {self._qualified_name}>"


class _KernelModule(types.ModuleType):
    """A stand-in `sgl_kernel` module: any attribute is a `_Kernel`."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Kernel(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates the `sgl_kernel` stand-in's modules, and defines torchvision's schemas before it loads."""

    def __init__(self):
        self.torchvision_library = None
        self.kernel_library = None

    def find_spec(self, name, path=None, target=None):
        if name == KERNEL_PACKAGE or name.startswith(KERNEL_PACKAGE + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name == "torchvision" and self.torchvision_library is None:
            self.torchvision_library = define_schemas("torchvision", TORCHVISION_SCHEMAS)  # kept: they live as long
        if name == "sglang" and self.kernel_library is None:
            self.kernel_library = define_schemas(
                KERNEL_PACKAGE, [f"{name}(Tensor[] placeholder) -> ()" for name in SGL_KERNEL_IMPORT_TIME_OPERATORS])
        return None  # torchvision and sglang themselves: the normal finders

    def create_module(self, spec):
        module = _KernelModule(spec.name)
        module.__path__ = []  # a package: its submodules import too
        module.__version__ = "0.0.0+rl2-import-only-stand-in"
        return module

    def exec_module(self, module):
        pass


def define_schemas(namespace: str, schemas: list[str]):
    """Operator schemas in a torch library fragment of `namespace` (returned: they last as long as it does)."""
    import torch

    library = torch.library.Library(namespace, "FRAGMENT")
    for schema in schemas:
        if not hasattr(getattr(torch.ops, namespace), schema.split("(", 1)[0]):
            library.define(schema)
    return library


def install() -> None:
    """Put the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, _ShimFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ShimFinder())
