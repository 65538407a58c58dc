"""Which implementation runs the models' elementwise ops (RMSNorm, RoPE, SiLU gate): chosen once, logged once; the
concatenated projections the fused path multiplies with (`ConcatenatedProjections`: LLaDA's, Dream's,
DiffusionGemma's); and `linear(layer, x)`, which runs FP8-quantized layers (transformers' `FineGrainedFP8Config`)
through `fp8.py`.

- `auto` (default): the fused Triton kernels of `triton_ops.py` for CUDA tensors when Triton is installed,
  PyTorch otherwise (CPU, no Triton, or when autograd needs the graph: the kernels have no backward).
- `torch`: always PyTorch. `triton`: always Triton (on CPU this needs `TRITON_INTERPRET=1`; used by tests).

Override with the environment variable `HF_DLLM_KERNELS` or `set_kernel_mode()`. The same choice holds with and
without CUDA graphs, so graph capture never changes outputs.

This file is exported as Hub remote code.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn.modules import module as _global_module_hooks
from transformers.utils import logging

from . import triton_linear
from .fp8 import QuantizedRows, fp8_block_size, fp8_linear, fp8_scales, is_fp8_linear, quantized_input_group
from .tensor_parallel import is_sharded, local_head_linear, local_shape, local_tensor, row_parallel_linear
from .triton_linear import few_rows_applies, few_rows_linear
from .triton_ops import TRITON_AVAILABLE

logger = logging.get_logger(__name__)

KERNEL_MODES = ("auto", "torch", "triton")
_mode = os.environ.get("HF_DLLM_KERNELS", "auto")
_logged: set[str] = set()


def set_kernel_mode(mode: str) -> None:
    """Select `auto`, `torch` or `triton` kernels for the elementwise ops (see module docstring)."""
    global _mode
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode must be one of {KERNEL_MODES}, got {mode!r}.")
    if mode == "triton" and not TRITON_AVAILABLE:
        raise ValueError("kernel mode 'triton' needs the `triton` package (pip install hf-dllm[triton]).")
    _mode = mode
    _logged.clear()


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (host) on `device`, without making the host wait for the GPU. CUDA copies from pageable host memory
    first wait for the work already queued on the stream, so a plain `.to("cuda")` between two blocks drains the
    GPU and it then idles until the host queues the next step (on an H100, LLaDA2.0-mini at batch 1: three such
    uploads per block). Here the data goes through pinned memory and is copied asynchronously; the caching host
    allocator keeps the pinned buffer until the copy has run. Elsewhere (CPU, same device) a plain `.to(device)`."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def kernel_mode() -> str:
    if _mode not in KERNEL_MODES:
        raise ValueError(f"HF_DLLM_KERNELS must be one of {KERNEL_MODES}, got {_mode!r}.")
    return _mode


def use_fused_kernels(tensor: torch.Tensor | QuantizedRows) -> bool:
    """Whether the fused Triton kernels handle this activation tensor. `QuantizedRows` exist only where they run
    (a fused kernel wrote them for the FP8 product that takes them)."""
    if isinstance(tensor, QuantizedRows):
        return True
    mode = kernel_mode()
    if mode == "torch" or not TRITON_AVAILABLE:
        chosen = False
    elif torch.is_grad_enabled() and tensor.requires_grad:
        chosen = False
    else:
        chosen = mode == "triton" or tensor.is_cuda
    key = f"{tensor.device.type}:{chosen}"
    if key not in _logged:
        _logged.add(key)
        logger.info(
            f"hf_dllm: {'Triton' if chosen else 'PyTorch'} kernels for RMSNorm/RoPE/SiLU on {tensor.device.type}"
        )
    return chosen


def returns_its_forward(module: nn.Module, allow_pre_hooks: bool = True) -> bool:
    """Whether calling `module` returns what its class's `forward` computes on whole weights: no forward hook (on it,
    on a submodule, or on every module: one may replace an output; pre-hooks, which see only the inputs, may be set
    unless `allow_pre_hooks` is False, its own and every module's: a caller that runs the module on another stream
    runs them there too, and `linear` then calls the module rather than multiply itself), no
    accelerate `_hf_hook` wrapper, no `forward` replaced on it or a submodule (tensor and expert parallelism wrap it
    to all-reduce the output), no sharded parameter. Only then may a caller take the output in another form, or
    compute it on another stream."""
    if _global_module_hooks._global_forward_hooks:
        return False
    if not allow_pre_hooks and _global_module_hooks._global_forward_pre_hooks:
        return False
    for part in module.modules():
        if part._forward_hooks or "_hf_hook" in part.__dict__ or "forward" in vars(part):
            return False
        if not allow_pre_hooks and part._forward_pre_hooks:
            return False
    return not any(is_sharded(parameter) for parameter in module.parameters())


def plain_half_linear(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer(x)` is a plain product a kernel may compute from `layer.weight` instead (a router's through
    `triton_moe.router_partials`): an `nn.Linear` (not quantized) without bias, returning its own forward
    (`returns_its_forward`, pre-hooks excluded too: not offloaded, hooked or sharded), its weight in x's
    half-precision dtype on x's device."""
    return (
        type(layer) is nn.Linear
        and layer.bias is None
        and x.dtype in (torch.bfloat16, torch.float16)
        and layer.weight.dtype == x.dtype
        and layer.weight.device == x.device
        and returns_its_forward(layer, allow_pre_hooks=False)
    )


def linear(layer: nn.Module, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """`layer(x)` for an `nn.Linear`; for transformers' `FP8Linear` (FP8 weights with block or per-tensor scales) the
    product runs through `fp8.fp8_linear`: hf_dllm's kernels where the fused kernels run, the dequantized weight
    otherwise. `x` may be `QuantizedRows` where `linear_input_group` gave a group."""
    if is_fp8_linear(layer):
        fused = use_fused_kernels(x)
        return fp8_linear(x, layer.weight, fp8_scales(layer), fp8_block_size(layer), layer.bias, fused)
    # Row-wise sharded (tensor parallelism): the all-reduce of `tensor_parallel.all_reduce` (symmetric-memory
    # kernels where they pay) rather than the plan hook's NCCL call.
    out = row_parallel_linear(layer, x)
    if out is None:  # a step's head kept as this rank's vocabulary slice (`tensor_parallel.local_head_logits`)
        out = local_head_linear(layer, x)
    if out is None and x.is_cuda and type(layer) is nn.Linear and returns_its_forward(layer, allow_pre_hooks=False):
        return dense_linear(x, layer.weight, layer.bias)  # the module's forward, its product maybe hf_dllm's
    return layer(x) if out is None else out


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)`; for few rows of a CUDA tensor where the fused kernels run, through
    `triton_linear.few_rows_linear` (split over the reduction: a block step's products read their weights faster
    than cuBLAS's tiling of 32 rows, and launch like the other kernels)."""
    if x.is_cuda and triton_linear.FEW_ROWS_PRODUCTS and use_fused_kernels(x) and few_rows_applies(x, weight, bias):
        return few_rows_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def linear_input_group(layer: nn.Module, x: torch.Tensor) -> int | None:
    """The column group in which the kernel producing `x` may write it quantized (`fp8.QuantizedRows`) for
    `linear(layer, x)`: an unsharded FP8 layer whose product runs w8a8 (`fp8.quantized_input_group`);
    else None."""
    if not is_fp8_linear(layer) or is_sharded(layer.weight):
        return None
    return quantized_input_group(x, *layer.weight.shape, fp8_block_size(layer))


class ConcatenatedProjections(nn.Module):
    """Base of the modules whose linear layers feeding the same input can run as one matrix product (q/k/v with
    their biases, gate/up): a product of 32 rows reads one 4608- or 37888-row matrix faster than several smaller
    ones (k and v are 512 rows each in Dream 7B), and it is one launch instead of several.

    `concatenated(names)` concatenates the layers' weights (and biases) along the output dim and re-points the
    parameters to views of the concatenation, so it costs no memory, stays in sync with in-place weight updates,
    and `state_dict` / `save_pretrained` keep the Hub's separate names and tensors. It is rebuilt if the parameters
    were replaced or moved (e.g. by `.to()`). Used where the fused kernels run (`use_fused_kernels`): LLaDA's
    blocks, Dream's and DiffusionGemma's attention and MLP.

    `project(x, names)` is that product. FP8 layers (transformers' `FineGrainedFP8Config`) are concatenated the same
    way, their FP8 weights and their block scales `weight_scale_inv` both along the output dim, which is exact when
    every layer's output size is a multiple of the scale block (128 for the Hub's checkpoints); otherwise each layer
    runs its own product. Per-tensor FP8 layers concatenate into one matrix with a scale per row (`fp8.fp8_scales`)."""

    def __init__(self):
        super().__init__()
        self._concatenated: dict[tuple, torch.Tensor | tuple | None] = {}

    def _apply(self, fn, *args, **kwargs):
        # `.to()`, `.cuda()`, `.half()` give the parameters new storage: drop the old concatenations with them.
        self._concatenated.clear()
        return super()._apply(fn, *args, **kwargs)

    @staticmethod
    def _are_views_of(tensors: list[torch.Tensor], fused: torch.Tensor) -> bool:
        if fused.device != tensors[0].device or fused.dtype != tensors[0].dtype:
            return False
        offset = fused.data_ptr()
        for tensor in tensors:
            if tensor.data_ptr() != offset:
                return False
            offset += tensor.numel() * tensor.element_size()
        return True

    @staticmethod
    def _concatenate(tensors: list[torch.Tensor]) -> torch.Tensor:
        # Never an inference tensor (the first call may run under `torch.inference_mode()`): the parameters become
        # views of it and must stay trainable.
        with torch.inference_mode(False):
            fused = torch.cat([tensor.detach() for tensor in tensors], dim=0)
        row = 0
        for tensor in tensors:
            tensor.data = fused[row : row + tensor.shape[0]]
            row += tensor.shape[0]
        return fused

    def _concatenated_parameter(self, names: tuple[str, ...], attribute: str) -> torch.Tensor | None:
        """The layers' `attribute` (`weight`, `bias`, `weight_scale_inv`) concatenated along dim 0, or None when
        none of them has it."""
        # Under tensor parallelism (column-wise q/k/v, gate/up) each rank concatenates its own slices: the product
        # gives this rank's heads / intermediate columns, exactly what the separate sharded layers would.
        modules = self._modules  # not getattr: nn.Module.__getattr__ is slow, and this runs in every forward
        tensors = [modules[name]._parameters.get(attribute) for name in names]
        tensors = [None if tensor is None else local_tensor(tensor) for tensor in tensors]
        if all(tensor is None for tensor in tensors):
            return None
        if any(tensor is None for tensor in tensors):
            raise ValueError(f"{names}: all or none of the layers must have a {attribute} to be concatenated.")
        key = (names, attribute)
        cached = self._concatenated.get(key)
        if cached is not None and self._are_views_of(tensors, cached):
            return cached
        fused = self._concatenate(tensors)
        self._concatenated[key] = fused
        return fused

    def concatenated(self, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(weight, bias)` of the linear layers `names` as one layer (bias None when none of them has one)."""
        modules = self._modules  # not getattr: nn.Module.__getattr__ is slow, and this runs in every forward
        biases = [modules[name]._parameters.get("bias") for name in names]
        if any((bias is not None) != (biases[0] is not None) for bias in biases):
            raise ValueError(f"{names}: all or none of the layers must have a bias to be concatenated.")
        return self._concatenated_parameter(names, "weight"), self._concatenated_parameter(names, "bias")

    @staticmethod
    def _fp8_block(layers: list[nn.Module]) -> tuple[int, int] | None:
        """The block size of FP8 layers that multiply as one concatenated FP8 matrix (the same blocks, every output
        size a multiple of the block's rows), else None."""
        if not is_fp8_linear(layers[0]):
            return None
        block = fp8_block_size(layers[0])
        if all(
            is_fp8_linear(layer) and fp8_block_size(layer) == block and layer.weight.shape[0] % block[0] == 0
            for layer in layers
        ):
            return block
        return None

    def _concatenated_scales(self, names: tuple[str, ...], layers: list[nn.Module]) -> torch.Tensor:
        """The FP8 layers' scales concatenated along the output dim: their block scales (views, as the weights), or
        for per-tensor layers their per-row scales (`fp8.fp8_scales`), cached until one of those is rebuilt."""
        if layers[0].block_size is not None:
            return self._concatenated_parameter(names, "weight_scale_inv")
        parts = [fp8_scales(layer) for layer in layers]
        key = (names, "row_scales")
        cached = self._concatenated.get(key)
        if cached is not None and all(a is b for a, b in zip(cached[0], parts, strict=True)):
            return cached[1]
        with torch.inference_mode(False):
            fused = torch.cat(parts)
        self._concatenated[key] = (parts, fused)
        return fused

    def multiplies_as_one(self, names: tuple[str, ...]) -> bool:
        """Whether `project(x, names)` is one matrix product: not for FP8 layers whose output sizes are not whole
        scale blocks (each runs its own product, then a concatenation: a caller may rather keep them apart)."""
        layers = [self._modules[name] for name in names]
        return not any(is_fp8_linear(layer) for layer in layers) or self._fp8_block(layers) is not None

    def project(self, x: torch.Tensor | QuantizedRows, names: tuple[str, ...]) -> torch.Tensor:
        """`x (..., in)` times the layers `names` as one layer -> `(..., sum of their out sizes)`. `x` may be
        `QuantizedRows` where `quantized_input_group` gave a group."""
        layers = [self._modules[name] for name in names]  # not getattr (slow), as in `concatenated`
        if not any(is_fp8_linear(layer) for layer in layers):
            weight, bias = self.concatenated(names)
            return dense_linear(x, weight, bias)
        block = self._fp8_block(layers)
        if block is not None:
            weight, bias = self.concatenated(names)
            return fp8_linear(x, weight, self._concatenated_scales(names, layers), block, bias, use_fused_kernels(x))
        return torch.cat([linear(layer, x) for layer in layers], dim=-1)

    def quantized_input_group(self, x: torch.Tensor, names: tuple[str, ...]) -> int | None:
        """The column group in which the kernel producing `x` may write it quantized (`fp8.QuantizedRows`) for
        `project(x, names)`: FP8 layers multiplied as one w8a8 matrix product (`fp8.quantized_input_group`, on
        this rank's slices under tensor parallelism); else None."""
        layers = [self._modules[name] for name in names]
        block = self._fp8_block(layers)
        if block is None:
            return None
        shapes = [local_shape(layer.weight) for layer in layers]
        return quantized_input_group(x, sum(shape[0] for shape in shapes), shapes[0][1], block)
