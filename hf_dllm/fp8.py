"""Matrix products with FP8 weights: the layers transformers' `FineGrainedFP8Config` makes (`FP8Linear`: weights in
`float8_e4m3fn`, one float32 `weight_scale_inv` per `block_size` = (128, 128) block, the Hub's layout as in
DeepSeek-V3, arXiv:2412.19437 section 3.3), run by hf_dllm's own kernels.

Why not `FP8Linear.forward`: in transformers 5.x it fetches its Triton kernel from the Hub
(`kernels-community/finegrained-fp8`) at the first call, which needs the `kernels` package and a network, and it
launches per layer, where the fused q/k/v and gate/up products of `kernels.ConcatenatedProjections` multiply one
matrix. Here, with shapes `x (..., K)`, `weight (N, K)`, `weight_scale_inv (ceil(N / bn), ceil(K / bk))`:

- few rows (a block step: 32 x batch rows): `weight_only`, a Triton kernel that reads the FP8 weight tile, scales
  it in registers (float32, rounded once to the activations' dtype, where the `torch` path rounds its dequantized
  weight too) and multiplies in bfloat16. Half the bytes of bfloat16 is the gain, and the activations stay
  unquantized (no extra error).
  Wide weights (fused q/k/v, the head) take the w8a8 path even there, where cuBLASLt streams them faster; deep
  ones (down) and the widest (gate/up) a Triton w8a8 kernel made for these few rows (`few_rows_w8a8`: FP8 tensor
  cores, split-K), faster there than either.
- many rows (the full-sequence forwards): `w8a8`, activations quantized per token and 128 columns
  (`quantize_rows`), then FP8 tensor cores through cuBLASLt's block-scaled `torch._scaled_mm` where this torch and
  GPU have it, else a Triton block-scaled FP8 kernel (the scheme of DeepSeek-V3's inference code). Where the
  kernel producing the activations is hf_dllm's RMSNorm or SiLU gate, it writes them already quantized
  (`QuantizedRows`, `quantized_input_group`): the same bits, one pass over the activations fewer.
- `torch` (CPU, autograd, `HF_DLLM_KERNELS=torch`): the weight dequantized to the activation dtype, then `F.linear`.

Per-tensor FP8 layers (`FineGrainedFP8Config(weight_block_size=None)`: one `weight_scale_inv` per matrix,
activations quantized per token) count as rows scaled one by one, block size `(1, K)` (`fp8_block_size`), their scale
repeated over the rows (`fp8_scales`), so fused q/k/v and gate/up layers concatenate into one row-scaled matrix. On
GPUs with FP8 tensor cores they multiply through `torch._scaled_mm` with one scale per activation row and per weight
row and fast accumulation (`rowwise`): no per-128-column rescaling inside the product, ~15-20 % faster than the
block-scaled product at a refresh forward's and a batch-32 step's rows on an H100 (`benchmarks/bench_fp8_gemm.py`). At a
block step's few rows they take the few-rows kernel's row-scaled variant instead (`few_rows_w8a8_applies`: the
MMA accumulates in place over k tiles of up to 256 columns, the scales applied once; faster than cuBLASLt there on
every LLaDA-8B shape, `benchmarks/bench_fp8_gemm.py`).

Which runs follows `kernels.use_fused_kernels` (Triton on CUDA; on the CPU with `TRITON_INTERPRET=1` in tests), and
`weight_only_applies` splits few from many rows (measured: benchmarks/bench_fp8_gemm.py).
Every path is free of host syncs and keeps static shapes, so block steps stay CUDA-graph capturable. This file holds
the rules, the layers' scales and the cuBLASLt products; hf_dllm's Triton kernels and their launchers are in
`fp8_triton.py`.

This file is exported as Hub remote code: Triton is imported inside `try:`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from . import triton_ops
from .fp8_schemes import FP8_QUANTIZATIONS, FP8_SCHEMES, HEAD_SUFFIX
from .fp8_triton import (
    FP8_DTYPE,
    activation_buffers,
    few_rows_product,
    quantize_rows,
    triton_w8a8_matmul,
    weight_only_matmul,
)
from .graphs import tensor_version
from .triton_ops import TRITON_AVAILABLE, on_tensor_device

FP8_MAX = torch.finfo(FP8_DTYPE).max
# Rows up to which the weight-only kernel may run (a product this small is bound by reading the weight); the w8a8
# path above it: on an H100 cuBLASLt's block-scaled FP8 was faster than the weight-only kernel from 128 rows on
# (benchmarks/bench_fp8_gemm.py).
WEIGHT_ONLY_MAX_ROWS = 64
# Up to `WEIGHT_ONLY_MAX_ROWS` rows, a weight at least this many times wider (N) than deep (K) still goes to
# cuBLASLt's block-scaled FP8 where it is available: it streams such weights faster than the weight-only kernel, the
# activations' quantization included. On an H100 at 32 / 64 rows, each product reading its weight from memory
# (`python benchmarks/bench_fp8_gemm.py --rows 32,64 --weight-copies 4`): LLaDA-8B's fused q/k/v (12288 x 4096)
# 24.3 / 24.7 us against 27.7 / 40.9, gate/up (24576 x 4096) 45.0 / 45.5 against 48.8 / 66.9, the head (126464 x
# 4096) 201 / 210 against 208 / 275; square and deep weights stay weight-only (the 4096 x 4096 output projection 13.6
# / 15.7 against 16.5 / 19.4, down 4096 x 12288 31.5 / 37.2 against 37.1 / 37.2).
W8A8_MIN_WIDTH_RATIO = 3
# Up to this many rows, a weight of 128 x 128 blocks deeper (K) than wide (N), or at least
# `FEW_ROWS_W8A8_MIN_WIDTH_RATIO` times wider than deep, runs hf_dllm's few-rows w8a8 kernel (`few_rows_w8a8_applies`):
# FP8 tensor cores, split-K, the activations quantized by the kernel that produces them where that is LLaDA's
# RMSNorm or SiLU gate. On an H100 at 32 / 64 rows, each product reading its weight from memory, the activations
# quantized beforehand (`python benchmarks/bench_fp8_gemm.py --rows 32,64 --weight-copies 4`):
# LLaDA-8B's down (4096 x 12288) 26.4 / 30.0 us against the weight-only kernel's 28.7 / 31.8, gate/up
# (24576 x 4096) 41.3 / 42.7 against cuBLASLt's 43.5 / 44.0; fused q/k/v (3x) stays with cuBLASLt (24.2 against
# 25.8 at 32 rows), the square output projection with the weight-only kernel (13.2 against 14.3 with its
# activations' quantization, which no kernel before it writes fused). An FP8 head (31x; transformers' default keeps
# it bf16) takes it too: 191 us against cuBLASLt's 202 and the weight-only kernel's 199 at 32 rows.
FEW_ROWS_W8A8_MAX_ROWS = WEIGHT_ONLY_MAX_ROWS
FEW_ROWS_W8A8_MIN_WIDTH_RATIO = 6
# Row-scaled weights (`fp8-tensor`) up to `FEW_ROWS_W8A8_MAX_ROWS` rows: the few-rows kernel's row-scaled variant
# (`few_rows_w8a8_applies`) instead of cuBLASLt's `torch._scaled_mm`. On an H100 at 32 rows, each product reading
# its weight from memory, the activations quantized beforehand (`python benchmarks/bench_fp8_gemm.py --rows 32
# --weight-copies 4 --kernels rowwise_gemm_only,few_rows_rowwise_gemm_only`): LLaDA-8B's
# output projection 10.4 us against 13.7, fused q/k/v 21.6 against 23.7, gate/up 38.2 against 42.5, down 23.0
# against 32.5, an FP8 head 178.4 against 200.3; at 64 rows 11.3 / 21.4 / 41.0 / 25.0 against 13.3 / 23.7 / 42.3 /
# 31.8. A batch-1 `fp8-tensor+head` call: 4.80 -> 4.17 ms per forward.
FEW_ROWS_ROWWISE = True


def split_head_suffix(name: str) -> tuple[str, bool]:
    """An `FP8_QUANTIZATIONS` name -> (its `FP8_SCHEMES` name, whether the output head is quantized too):
    `"fp8-tensor+head"` -> `("fp8-tensor", True)`."""
    if name not in FP8_QUANTIZATIONS:
        raise ValueError(f"an FP8 quantization must be one of {', '.join(FP8_QUANTIZATIONS)}, got {name!r}.")
    scheme = name.removesuffix(HEAD_SUFFIX)
    return scheme, scheme != name


def fp8_quantization_config(family=None, scheme: str = "fp8", quantize_head: bool = False):
    """transformers' `FineGrainedFP8Config` for a model family (a `family.DiffusionFamily` or its registered name;
    None: transformers' defaults) and an `FP8_SCHEMES` name, keeping the family's `fp8_modules_to_not_convert`
    unquantized: what `--quantization` loads with and `hf-dllm export` writes. `quantize_head=True` quantizes the output head too (`modules_to_not_convert` without it; transformers
    keeps it in the model's dtype by default): the largest single weight a block step reads (LLaDA-8B: 1.04 GB in
    bf16)."""
    from transformers import FineGrainedFP8Config

    if scheme not in FP8_SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(FP8_SCHEMES)}, got {scheme!r}.")
    if not isinstance(quantize_head, bool):
        raise TypeError(f"quantize_head must be True or False, got {quantize_head!r}.")
    from .family import registered_family

    if isinstance(family, str):
        family = registered_family(family)
    skipped = (
        None if family is None or family.fp8_modules_to_not_convert is None else list(family.fp8_modules_to_not_convert)
    )
    if quantize_head:  # naming any module (even none) drops transformers' default skip of the output head
        skipped = [name for name in skipped or () if name != "lm_head"]
    return FineGrainedFP8Config(modules_to_not_convert=skipped, **FP8_SCHEMES[scheme])


def fp8_config_for(model_config, quantization: str):
    """`fp8_quantization_config` for an `FP8_QUANTIZATIONS` name and a model's config (a `PretrainedConfig` or its
    `config.json` dict): what `--quantization` loads with and `hf-dllm export` writes. ValueError for a `+head`
    name where the output head is the input embedding (`tie_word_embeddings`, LLaDA's `weight_tying`): quantizing
    the head would quantize the embedding the model reads its inputs from."""
    scheme, head = split_head_suffix(quantization)
    field = (
        model_config.get
        if isinstance(model_config, dict)
        else lambda name, default: getattr(model_config, name, default)
    )
    if head and (field("tie_word_embeddings", False) or field("weight_tying", False)):
        raise ValueError(
            f"--quantization {quantization} quantizes the output head, but this model ties it to its input embedding "
            f"(tie_word_embeddings); use --quantization {scheme}."
        )
    from .family import family_for_config

    return fp8_quantization_config(family_for_config(model_config), scheme, quantize_head=head)


def _casts_before_quantizing() -> bool:
    # transformers before 5.23 (at least 5.10 to 5.22) casts each checkpoint tensor to its model parameter's dtype
    # before the quantizer's load-time op runs, and `FP8Linear`'s placeholder weight is float8_e4m3fn: a weight
    # quantized on the fly was first rounded to FP8 unscaled (3 mantissa bits; magnitudes up to 2^-10 flushed to
    # zero), then quantized in blocks from that. 5.23 skips the cast for parameters quantized on load.
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return (major, minor) < (5, 23)


def fp8_placeholders_in_load_dtype(model: nn.Module, quantizer, dtype: torch.dtype | None) -> list[str]:
    """Before a checkpoint's weights load into `model` (on the meta device) with transformers' FP8 quantizer
    quantizing them on the fly (`quantization_config=fp8_quantization_config(...)`, `--quantization fp8`): the FP8
    placeholders of the parameters it quantizes on load take the load `dtype`, so transformers casts the checkpoint
    tensor to that (not to FP8) before quantizing it in blocks, as transformers >= 5.23 does by itself. Nothing for
    another quantizer or a pre-quantized checkpoint (`quantizer.pre_quantized`: its FP8 tensors load as stored).
    Returns the names of the parameters changed."""
    if quantizer is None or quantizer.pre_quantized or quantizer.quantization_config.quant_method != "fp8":
        return []
    dtype = dtype or torch.get_default_dtype()
    names = [
        name
        for name, parameter in model.named_parameters()
        if parameter.dtype == FP8_DTYPE and quantizer.param_needs_quantization(model, name)
    ]
    for name in names:
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        placeholder = getattr(module, attribute)
        setattr(module, attribute, nn.Parameter(torch.empty_like(placeholder, dtype=dtype), requires_grad=False))
    return names


class QuantizesFromLoadDtype:
    """First base of hf_dllm's `PreTrainedModel`s: under transformers < 5.23 a load quantized on the fly to FP8
    quantizes the checkpoint's weights in the load dtype (`fp8_placeholders_in_load_dtype`), not after a first
    unscaled rounding to FP8 (`_casts_before_quantizing`), so it holds what `hf-dllm export --quantization fp8`
    writes and what later transformers load."""

    @classmethod
    def _load_pretrained_model(cls, model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        if _casts_before_quantizing():
            fp8_placeholders_in_load_dtype(model, load_config.hf_quantizer, load_config.dtype)
        return super()._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs)


def is_fp8_linear(layer: nn.Module) -> bool:
    """Whether `layer` holds FP8 weights with block scales, or one scale for the whole matrix (transformers'
    `FP8Linear` after loading, `block_size` None)."""
    weight = getattr(layer, "weight", None)
    scale = getattr(layer, "weight_scale_inv", None)
    if weight is None or weight.dtype != FP8_DTYPE or scale is None:
        return False
    return getattr(layer, "block_size", None) is not None or scale.numel() == 1


def fp8_block_size(layer: nn.Module) -> tuple[int, int]:
    """The `(rows, columns)` an FP8 layer's scales cover: its `block_size`, or `(1, K)` for a per-tensor layer,
    whose scale `fp8_scales` repeats over the rows (rows scaled one by one: what a row-scaled product takes, and
    what concatenated per-tensor layers are)."""
    if layer.block_size is not None:
        return tuple(layer.block_size)
    return (1, layer.weight.shape[-1])


def fp8_scales(layer: nn.Module) -> torch.Tensor:
    """An FP8 layer's scales laid out for `fp8_block_size`: its `weight_scale_inv`, or for a per-tensor layer that
    one scale repeated per row, float32 `(N, 1)`, cached on the layer until the scale is replaced or changed in
    place."""
    scale = layer.weight_scale_inv
    if layer.block_size is not None:
        return scale
    rows = layer.weight.shape[0]
    # An inference tensor has no version (None): it cannot be changed outside inference mode, and a scale is not
    # changed inside it.
    stamp = (scale.data_ptr(), tensor_version(scale), rows)
    cached = layer.__dict__.get("_hf_dllm_row_scales")
    if cached is not None and cached[0] is scale and cached[1] == stamp:
        return cached[2]
    with torch.inference_mode(False):  # usable outside inference mode too (as the concatenated weights)
        expanded = scale.detach().float().reshape(1, 1).expand(rows, 1).contiguous()
    layer.__dict__["_hf_dllm_row_scales"] = (scale, stamp, expanded)
    return expanded


def is_row_scaled(block_size, cols: int) -> bool:
    """Whether scales of `block_size` over a weight of `cols` columns are one per row (per-tensor layers,
    `fp8_block_size`): the row-scaled product (`rowwise_matmul`) multiplies them."""
    return block_size[0] == 1 and block_size[1] >= cols


def dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size, dtype: torch.dtype) -> torch.Tensor:
    """`weight (..., N, K)` FP8 times its per-block scales `(..., ceil(N / bn), ceil(K / bk))` -> `(..., N, K)` in
    `dtype` (computed in float32, rounded once); leading dims: e.g. stacked experts."""
    block_n, block_k = block_size
    rows, cols = weight.shape[-2:]
    scale = weight_scale_inv.float().repeat_interleave(block_n, -2)[..., :rows, :]
    scale = scale.repeat_interleave(block_k, -1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def quantize_blocks(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight (..., N, K)` -> FP8 `(..., N, K)` and `weight_scale_inv (..., ceil(N / bn), ceil(K / bk))` float32
    (leading dims: e.g. stacked experts, each quantized alone), with the arithmetic of transformers' `Fp8Quantize`
    (the op that quantizes at load time): per block, scale = FP8 max / max-abs in float32 (1 for an all-zero
    block), the weight multiplied by it, its inverse stored. A partial last block is scaled by its own values
    (transformers leaves such weights unquantized). Used by `hf-dllm export --quantization fp8` (`hub/quantize.py`),
    tests and benchmarks; models are quantized by transformers."""
    block_n, block_k = block_size
    rows, cols = weight.shape[-2:]
    pad_rows, pad_cols = -rows % block_n, -cols % block_k
    padded = nn.functional.pad(weight.to(torch.float32), (0, pad_cols, 0, pad_rows))
    blocks = padded.unflatten(-2, (-1, block_n)).unflatten(-1, (-1, block_k))  # (..., Nb, bn, Kb, bk)
    max_abs = blocks.abs().amax(dim=(-3, -1))  # (..., Nb, Kb)
    scale = torch.where(max_abs > 0, FP8_MAX / max_abs, torch.ones_like(max_abs))
    quantized = torch.clamp(blocks * scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.flatten(-2).flatten(-3, -2)[..., :rows, :cols].contiguous(), 1.0 / scale


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size,
    bias: torch.Tensor | None = None,
    use_triton: bool = True,
) -> torch.Tensor:
    """`x (..., K) @ dequantize(weight).T + bias` -> `(..., N)` in `x.dtype` (see the module docstring for the
    kernels). `use_triton=False` forces the PyTorch path. `x` may be `QuantizedRows` (written by their producer,
    where `quantized_input_group` said this product runs w8a8)."""
    if isinstance(x, QuantizedRows):
        return w8a8_rows_matmul(x, weight, weight_scale_inv, block_size, bias)
    n_out, cols = weight.shape
    kernel = "torch"
    # Row scales go to `torch._scaled_mm` (the rule says where it runs), block scales to hf_dllm's kernels; both
    # read the weight's rows contiguous.
    if use_triton and TRITON_AVAILABLE and weight.stride(-1) == 1:
        if is_row_scaled(block_size, cols) or fp8_kernel_supports(weight, block_size):
            kernel = fp8_product_kernel(x, n_out, cols, block_size)
    if kernel == "torch":
        return nn.functional.linear(x, dequantize(weight, weight_scale_inv, block_size, x.dtype), bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if kernel == "rowwise":
        values, scales = quantize_rows(x2, cols, row_multiple=SCALED_MM_ROW_MULTIPLE)
        rows = QuantizedRows(values, scales, x2.shape, x2.dtype)
        out = rowwise_matmul(rows, weight, weight_scale_inv, bias)
    elif kernel == "few_rows":
        values, scales = quantize_rows(x2, block_size[1])
        rows = QuantizedRows(values, scales, x2.shape, x2.dtype)
        out = few_rows_w8a8_matmul(rows, weight, weight_scale_inv, block_size, bias)
    elif kernel == "weight_only":
        out = weight_only_matmul(x2, weight, weight_scale_inv, block_size, bias)
    else:  # `scaled_mm` or `triton`, the backend `auto` would pick, decided once
        out = w8a8_matmul(x2, weight, weight_scale_inv, block_size, bias, kernel)
    return out.view(*shape[:-1], n_out)


def fp8_product_kernel(x: torch.Tensor, n_out: int, cols: int, block_size) -> str:
    """Which of hf_dllm's kernels `fp8_linear` multiplies `x (..., cols)` by an `(n_out, cols)` FP8 weight with where
    the fused kernels run: `few_rows` (`few_rows_w8a8_applies`, block or row scales), `rowwise` (row-scaled weights
    above its rows, `rowwise_matmul`), `weight_only` (`weight_only_applies`), or the w8a8 product through cuBLASLt
    (`scaled_mm`, `cublaslt_takes`) or Triton (`triton`); `torch` for row scales where `torch._scaled_mm` cannot take
    them. The one rule that `fp8_linear` runs and `quantized_input_group` reads."""
    rows = x.numel() // x.shape[-1]
    if few_rows_w8a8_applies(rows, n_out, cols, block_size, x.device):
        return "few_rows"
    if is_row_scaled(block_size, cols):
        return "rowwise" if _rowwise_runs(x.device, n_out, cols) else "torch"
    cublaslt = cublaslt_takes(x, n_out, cols, block_size)
    if weight_only_applies(rows, n_out, cols, cublaslt):
        return "weight_only"
    return "scaled_mm" if cublaslt else "triton"


def weight_only_applies(rows: int, n_out: int, cols: int, cublaslt: bool) -> bool:
    """Whether `fp8_linear` multiplies `rows` rows by an `(n_out, cols)` FP8 weight with the weight-only kernel (else
    w8a8): few rows, unless the weight is wide and cuBLASLt's block-scaled product (`cublaslt`) can take it
    (`WEIGHT_ONLY_MAX_ROWS`, `W8A8_MIN_WIDTH_RATIO`)."""
    return rows <= WEIGHT_ONLY_MAX_ROWS and not (cublaslt and n_out >= W8A8_MIN_WIDTH_RATIO * cols)


def few_rows_w8a8_applies(rows: int, n_out: int, cols: int, block_size, device: torch.device) -> bool:
    """Whether `fp8_linear` multiplies `rows` rows by an `(n_out, cols)` FP8 weight on `device` with the few-rows
    w8a8 kernel (`few_rows_w8a8_matmul`): up to `FEW_ROWS_W8A8_MAX_ROWS` rows on a GPU with FP8 tensor cores (compute
    capability 8.9 or more), for 128 x 128 weight blocks a weight deeper than wide or at least
    `FEW_ROWS_W8A8_MIN_WIDTH_RATIO` times wider than deep, for row scales (`is_row_scaled`) every weight where
    `FEW_ROWS_ROWWISE` is on (else cuBLASLt's row-scaled product, `rowwise_matmul`)."""
    if not (TRITON_AVAILABLE and device.type == "cuda" and rows <= FEW_ROWS_W8A8_MAX_ROWS):
        return False
    if is_row_scaled(block_size, cols):
        shape_fits = FEW_ROWS_ROWWISE
    else:
        shape_fits = tuple(block_size) == (128, 128) and (cols > n_out or n_out >= FEW_ROWS_W8A8_MIN_WIDTH_RATIO * cols)
    return shape_fits and _fp8_tensor_cores(device.index or 0)


@functools.cache
def _fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def fp8_kernel_supports(weight: torch.Tensor, block_size) -> bool:
    """Whether hf_dllm's block-scaled FP8 kernels take this weight: power-of-two blocks of at least 16, last dim
    contiguous (row scales, `is_row_scaled`, run `torch._scaled_mm` instead: `fp8_product_kernel`)."""
    if block_size is None:
        return False
    block_n, block_k = block_size
    power_of_two = all(b >= 16 and b & (b - 1) == 0 for b in (block_n, block_k))
    return power_of_two and weight.stride(-1) == 1


def few_rows_w8a8_matmul(x: QuantizedRows, weight, weight_scale_inv, block_size, bias=None, config=None):
    """`x`'s real rows times the FP8 weight on FP8 tensor cores with hf_dllm's few-rows kernel -> `(..., N)` in
    `x.dtype`: the product of `scaled_mm_rows` (the same block-scaled arithmetic up to the order of float32 sums),
    made for a block step's rows, where cuBLASLt streams the weight slower (`few_rows_w8a8_applies`). `x`'s group and
    the weight's block of columns must both be 128 (`block_size` (128, 128)); or, for a row-scaled weight
    (`is_row_scaled`), one scale per row of each: `rowwise_matmul`'s product. `config`:
    one of `fp8_triton.few_rows_w8a8_configs()` (`few_rows_rowwise_configs()`) instead of the autotuner's choice
    (tests)."""
    cols = x.shape[-1]
    row_scaled = is_row_scaled(block_size, cols)
    if row_scaled:
        _check_row_scales(x, weight, weight_scale_inv, "few_rows_w8a8_matmul")
    elif tuple(block_size) != (128, 128) or x.scales.shape[1] != -(-cols // 128):
        raise ValueError(f"few_rows_w8a8_matmul needs 128 x 128 weight blocks and 128-column groups, got {block_size}.")
    rows = x.shape[:-1].numel()
    out = few_rows_product(x.values, x.scales, rows, x.dtype, weight, weight_scale_inv, bias, config, row_scaled)
    return out.view(*x.shape[:-1], weight.shape[0])


# Rows of a product through cuBLASLt are padded to a multiple of this (zero rows): a one-row product disagreed with
# the reference in a GPU test; the benchmarked shapes (multiples of 16) run unpadded.
SCALED_MM_ROW_MULTIPLE = 16


class QuantizedRows(NamedTuple):
    """Activations quantized for a w8a8 product (`w8a8_rows_matmul`: cuBLASLt or the few-rows kernel): by
    `quantize_rows`, or written so by the kernel that produces them (`rms_norm_to_fp8`, `silu_mul_to_fp8`: the same
    bits, without the pass over the activations that quantizing takes). `values` FP8 `(padded rows, K)` and `scales`
    float32 `(padded rows, K / group)` laid out for cuBLASLt (the few-rows kernel reads any strides); `shape` the activations' `(..., K)` (its rows are the real ones) and `dtype`
    theirs, the product's output dtype."""

    values: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


def w8a8_rows_matmul(x: QuantizedRows, weight, weight_scale_inv, block_size, bias=None) -> torch.Tensor:
    """`x`'s real rows times the FP8 weight -> `(..., N)` in `x.dtype`: the few-rows kernel where it applies
    (`few_rows_w8a8_applies`, block or row scales), else cuBLASLt: row-scaled (`rowwise_matmul`) or block-scaled
    (`scaled_mm_rows`)."""
    if few_rows_w8a8_applies(x.shape[:-1].numel(), *weight.shape, block_size, x.values.device):
        return few_rows_w8a8_matmul(x, weight, weight_scale_inv, block_size, bias)
    if is_row_scaled(block_size, weight.shape[1]):
        return rowwise_matmul(x, weight, weight_scale_inv, bias)
    return scaled_mm_rows(x, weight, weight_scale_inv, bias)


def scaled_mm_rows(x: QuantizedRows, weight, weight_scale_inv, bias=None) -> torch.Tensor:
    """`x`'s real rows times the FP8 weight through cuBLASLt's block-scaled product -> `(..., N)` in `x.dtype`."""
    out = _scaled_mm_blockwise(x.values, x.scales, weight, weight_scale_inv, bias, x.dtype)
    return out[: x.shape[:-1].numel()].view(*x.shape[:-1], weight.shape[0])


# Whether the kernels producing a cuBLASLt product's activations (RMSNorm, SiLU-mul) write them quantized
# (`quantized_input_group`). The same bits either way; tests compare the two.
FUSE_ACTIVATION_QUANTIZATION = True


def quantized_input_group(x: torch.Tensor, n_out: int, cols: int, block_size) -> int | None:
    """The column group in which `fp8_linear` would quantize `x (..., cols)` to multiply it by an `(n_out, cols)`
    FP8 weight (the w8a8 paths: cuBLASLt, or the few-rows kernel), so that the kernel producing `x` can write it as
    `QuantizedRows`; None where another kernel would run (or `FUSE_ACTIVATION_QUANTIZATION` is off)."""
    if not FUSE_ACTIVATION_QUANTIZATION or not TRITON_AVAILABLE or not x.is_cuda:
        return None
    kernel = fp8_product_kernel(x, n_out, cols, block_size)
    if kernel == "rowwise":
        return cols  # one scale per row
    return block_size[1] if kernel in ("few_rows", "scaled_mm") else None


def _scaled_mm_buffers(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Empty `(values, scales, group)` for `x (..., K)` quantized for cuBLASLt (`QuantizedRows`' layout)."""
    rows = x.numel() // x.shape[-1]
    values, scales = activation_buffers(rows, x.shape[-1], group, x.device, True, SCALED_MM_ROW_MULTIPLE)
    return values, scales, group


def rms_norm_to_fp8(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, group: int, residual: torch.Tensor | None = None
) -> tuple[QuantizedRows, torch.Tensor]:
    """`triton_ops.rms_norm` with the normed rows written only quantized: `(QuantizedRows, x + residual)`; the
    values `quantize_rows(rms_norm(...))` gives, in one pass (`group`: from `quantized_input_group`)."""
    buffers = _scaled_mm_buffers(x, group)
    _, total = triton_ops.rms_norm(x, weight, eps, residual=residual, fp8_out=buffers)
    return QuantizedRows(buffers[0], buffers[1], x.shape, x.dtype), total


def silu_mul_to_fp8(gate: torch.Tensor, up: torch.Tensor, group: int) -> QuantizedRows:
    """`triton_ops.silu_mul(gate, up)` written only quantized, the values `quantize_rows` would give it."""
    buffers = _scaled_mm_buffers(gate, group)
    triton_ops.silu_mul_fp8(gate, up, buffers)
    return QuantizedRows(buffers[0], buffers[1], gate.shape, gate.dtype)


@functools.cache
def _scaled_mm_block_scaling(device_index: int) -> bool:
    """Whether this torch and GPU run `torch._scaled_mm` with 1x128 x 128x128 block scales (cuBLASLt on SM90)."""
    try:
        if torch.cuda.get_device_capability(device_index) != (9, 0):
            return False
        device = torch.device("cuda", device_index)
        a = torch.zeros(128, 512, device=device).to(FP8_DTYPE)
        w = torch.zeros(128, 512, device=device).to(FP8_DTYPE)
        a_scale = torch.ones(4, 128, device=device).t()
        w_scale = torch.ones(1, 4, device=device)
        _scaled_mm_blockwise(a, a_scale, w, w_scale, None, torch.bfloat16)
        return True
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


def scaled_mm_fits(n_out: int, cols: int, block_size) -> bool:
    """Whether cuBLASLt's block-scaled FP8 GEMM takes this weight: 128x128 blocks, and the scales' leading
    dimension (K / 128 for the weight's, passed transposed) a multiple of 4 (16 bytes, cuBLASLt's alignment)."""
    return tuple(block_size) == (128, 128) and cols % 512 == 0 and n_out % 128 == 0


def cublaslt_takes(x: torch.Tensor, n_out: int, cols: int, block_size) -> bool:
    """Whether cuBLASLt's block-scaled FP8 product can multiply `x` by an `(n_out, cols)` weight: `x` on a GPU
    where this torch runs it (`_scaled_mm_block_scaling`) and a weight it takes (`scaled_mm_fits`)."""
    return x.is_cuda and scaled_mm_fits(n_out, cols, block_size) and _scaled_mm_block_scaling(x.device.index or 0)


# Row-scaled products accumulate in the FP8 tensor cores' own precision, as torchao's and vLLM's FP8 inference do:
# with one scale per row there is nothing to rescale inside the product, and this is where its speed comes from (on an
# H100 at 24,576 rows 15-17 % faster than without; the error against float32 the same, 3.75e-2, in every shape of
# `benchmarks/bench_fp8_gemm.py`).
ROWWISE_FAST_ACCUMULATION = True


def rowwise_matmul(x: QuantizedRows, weight, row_scales, bias=None) -> torch.Tensor:
    """`x`'s real rows (quantized one scale per row: `quantize_rows(x, K)`) times an FP8 weight with one scale per
    row, `row_scales` float32 `(N, 1)` (`fp8_scales`), through `torch._scaled_mm` -> `(..., N)` in `x.dtype`."""
    _check_row_scales(x, weight, row_scales, "rowwise_matmul")
    out = torch._scaled_mm(
        x.values,
        weight.t(),
        scale_a=x.scales,
        scale_b=row_scales.view(1, -1),
        out_dtype=x.dtype,
        use_fast_accum=ROWWISE_FAST_ACCUMULATION,
    )
    out = out[: x.shape[:-1].numel()].view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _check_row_scales(x: QuantizedRows, weight, row_scales, name: str) -> None:
    if x.scales.shape[1] != 1 or row_scales.shape != (weight.shape[0], 1):
        raise ValueError(
            f"{name} needs one activation scale per row and row_scales of shape {(weight.shape[0], 1)}, got "
            f"{tuple(x.scales.shape)} and {tuple(row_scales.shape)}."
        )


@functools.cache
def _scaled_mm_row_scaling(device_index: int) -> bool:
    """Whether this torch and GPU run `torch._scaled_mm` with one scale per row of each operand (FP8 tensor cores:
    compute capability 8.9 or more)."""
    try:
        if torch.cuda.get_device_capability(device_index) < (8, 9):
            return False
        device = torch.device("cuda", device_index)
        a = torch.zeros(16, 32, device=device).to(FP8_DTYPE)
        w = torch.zeros(16, 32, device=device).to(FP8_DTYPE)
        ones = torch.ones(16, 1, device=device)
        rowwise_matmul(QuantizedRows(a, ones, a.shape, torch.bfloat16), w, ones)
        return True
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


def _rowwise_runs(device: torch.device, n_out: int, cols: int) -> bool:
    """Whether `rowwise_matmul` can multiply an `(n_out, cols)` row-scaled FP8 weight on `device`: a GPU where
    `torch._scaled_mm` runs row scales, both dims multiples of 16 (its alignment)."""
    return device.type == "cuda" and n_out % 16 == 0 and cols % 16 == 0 and _scaled_mm_row_scaling(device.index or 0)


def _scaled_mm_blockwise(a, a_scale, weight, weight_scale_inv, bias, out_dtype):
    # cuBLASLt's block-scaled FP8 GEMM: a (M, K) with (M, K/128) scales laid out column-major, the weight
    # (N, K) with (N/128, K/128) scales, passed transposed as the (K, N) operand.
    out = torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=weight_scale_inv.t(), out_dtype=out_dtype)
    return out if bias is None else out + bias


@on_tensor_device
def w8a8_matmul(x: torch.Tensor, weight, weight_scale_inv, block_size, bias=None, backend: str = "auto"):
    """`x (M, K)` quantized per row and `block_k` columns, times the FP8 weight on FP8 tensor cores -> `(M, N)` in
    `x.dtype`. `backend`: `auto` (cuBLASLt where available, see the module docstring), `scaled_mm` or `triton`."""
    rows, cols = x.shape
    n_out = weight.shape[0]
    block_n, block_k = block_size
    if backend not in ("auto", "scaled_mm", "triton"):
        raise ValueError(f"backend must be 'auto', 'scaled_mm' or 'triton', got {backend!r}.")
    if backend == "scaled_mm" or (backend == "auto" and cublaslt_takes(x, n_out, cols, block_size)):
        a, a_scale = quantize_rows(x, block_k, scales_column_major=True, row_multiple=SCALED_MM_ROW_MULTIPLE)
        return scaled_mm_rows(QuantizedRows(a, a_scale, x.shape, x.dtype), weight, weight_scale_inv, bias)
    return triton_w8a8_matmul(x, weight, weight_scale_inv, block_size, bias)
