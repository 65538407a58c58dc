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
block-scaled product at a refresh forward's and a batch-32 step's rows on an H100 (RESULTS.md, FP8, session 28). At a
block step's few rows they take the few-rows kernel's row-scaled variant instead (`few_rows_w8a8_applies`: the
MMA accumulates in place over k tiles of up to 256 columns, the scales applied once; faster than cuBLASLt there on
every LLaDA-8B shape, RESULTS.md, FP8, session 37).

Which runs follows `kernels.use_fused_kernels` (Triton on CUDA; on the CPU with `TRITON_INTERPRET=1` in tests), and
`weight_only_applies` splits few from many rows (measured: benchmarks/bench_fp8_gemm.py, benchmarks/RESULTS.md).
Every path is free of host syncs and keeps static shapes, so block steps stay CUDA-graph capturable.

This file is exported as Hub remote code: Triton is imported inside `try:`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from . import triton_ops
from .graphs import tensor_version
from .triton_ops import (  # None without Triton (CPU-only installs)
    TRITON_AVAILABLE,
    launch,
    on_tensor_device,
    tl,
    triton,
)

if TRITON_AVAILABLE:
    from .triton_ops import fp8_row_groups

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# Rows up to which the weight-only kernel may run (a product this small is bound by reading the weight); the w8a8
# path above it: on an H100 cuBLASLt's block-scaled FP8 was faster than the weight-only kernel from 128 rows on
# (benchmarks/bench_fp8_gemm.py, benchmarks/RESULTS.md).
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
# quantized beforehand (`python benchmarks/bench_fp8_gemm.py --rows 32,64 --weight-copies 4`; RESULTS.md, FP8,
# session 25): LLaDA-8B's down (4096 x 12288) 26.4 / 30.0 us against the weight-only kernel's 28.7 / 31.8, gate/up
# (24576 x 4096) 41.3 / 42.7 against cuBLASLt's 43.5 / 44.0; fused q/k/v (3x) stays with cuBLASLt (24.2 against
# 25.8 at 32 rows), the square output projection with the weight-only kernel (13.2 against 14.3 with its
# activations' quantization, which no kernel before it writes fused). An FP8 head (31x; transformers' default keeps
# it bf16) takes it too: 191 us against cuBLASLt's 202 and the weight-only kernel's 199 at 32 rows (session 30).
FEW_ROWS_W8A8_MAX_ROWS = WEIGHT_ONLY_MAX_ROWS
FEW_ROWS_W8A8_MIN_WIDTH_RATIO = 6
# Row-scaled weights (`fp8-tensor`) up to `FEW_ROWS_W8A8_MAX_ROWS` rows: the few-rows kernel's row-scaled variant
# (`few_rows_w8a8_applies`) instead of cuBLASLt's `torch._scaled_mm`. On an H100 at 32 rows, each product reading
# its weight from memory, the activations quantized beforehand (`python benchmarks/bench_fp8_gemm.py --rows 32
# --weight-copies 4 --kernels rowwise_gemm_only,few_rows_rowwise_gemm_only`; RESULTS.md, FP8, session 37): LLaDA-8B's
# output projection 10.4 us against 13.7, fused q/k/v 21.6 against 23.7, gate/up 38.2 against 42.5, down 23.0
# against 32.5, an FP8 head 178.4 against 200.3; at 64 rows 11.3 / 21.4 / 41.0 / 25.0 against 13.3 / 23.7 / 42.3 /
# 31.8. A batch-1 `fp8-tensor+head` call: 4.80 -> 4.17 ms per forward.
FEW_ROWS_ROWWISE = True


# `FineGrainedFP8Config(modules_to_not_convert=...)` per model type, where transformers' defaults do not fit:
# transformers replaces every module named `*.experts` with its fused `FP8Experts` (one 3D tensor per projection),
# which LLaDA2's `experts` list of per-expert `{e}.{gate,up,down}_proj` layers (the Hub's names) is not: the list
# itself is skipped, the layers in it are quantized one by one (as the Hub's pre-quantized MoE checkpoints store
# them) and run stacked by `grouped_gemm.py`. Naming any module drops transformers' default skips, hence the output
# head named again.
FP8_MODULES_TO_NOT_CONVERT = {"llada2_moe": ["lm_head", r".*\.experts$"]}


# The FP8 values of `--quantization` (cli/loading.py), each a `FineGrainedFP8Config` setting: "fp8" transformers'
# default, one scale per 128 x 128 block (the Hub's layout); "fp8-tensor" one scale per matrix, run as row-scaled
# products (faster at many rows; RESULTS.md, FP8, session 28).
FP8_SCHEMES = {"fp8": {}, "fp8-tensor": {"weight_block_size": None}}

# A scheme's name with this suffix quantizes the output head too (`fp8_quantization_config(quantize_head=True)`).
HEAD_SUFFIX = "+head"
FP8_QUANTIZATIONS = (*FP8_SCHEMES, *(scheme + HEAD_SUFFIX for scheme in FP8_SCHEMES))


def split_head_suffix(name: str) -> tuple[str, bool]:
    """An `FP8_QUANTIZATIONS` name -> (its `FP8_SCHEMES` name, whether the output head is quantized too):
    `"fp8-tensor+head"` -> `("fp8-tensor", True)`."""
    if name not in FP8_QUANTIZATIONS:
        raise ValueError(f"an FP8 quantization must be one of {', '.join(FP8_QUANTIZATIONS)}, got {name!r}.")
    scheme = name.removesuffix(HEAD_SUFFIX)
    return scheme, scheme != name


def fp8_quantization_config(model_type: str, scheme: str = "fp8", quantize_head: bool = False):
    """transformers' `FineGrainedFP8Config` for a model of `model_type` and an `FP8_SCHEMES` name (its defaults,
    with the modules of `FP8_MODULES_TO_NOT_CONVERT` kept): what `--quantization` loads with and `hf-dllm export`
    writes. `quantize_head=True` quantizes the output head too (`modules_to_not_convert` without it; transformers
    keeps it in the model's dtype by default): the largest single weight a block step reads (LLaDA-8B: 1.04 GB in
    bf16)."""
    from transformers import FineGrainedFP8Config

    if scheme not in FP8_SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(FP8_SCHEMES)}, got {scheme!r}.")
    if not isinstance(quantize_head, bool):
        raise TypeError(f"quantize_head must be True or False, got {quantize_head!r}.")
    skipped = FP8_MODULES_TO_NOT_CONVERT.get(model_type)
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
    return fp8_quantization_config(field("model_type", ""), scheme, quantize_head=head)


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
    them. The one rule that
    `fp8_linear` runs and `quantized_input_group` reads."""
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


def weight_only_configs() -> list:
    # SPLIT_K > 1 splits K over programs (partial sums reduced by a second kernel): at a block step's 32 rows an
    # N of 4096 gives too few (row, column) tiles to keep every SM streaming weights. SWAP multiplies the weight
    # tile by the transposed activations (the weight's rows as the MMA's M). With the weight scaled before the
    # MMA, the fastest at 32 rows were (H100, benchmarks/RESULTS.md, FP8, session 22): BLOCK_N 128 split 4 with
    # SWAP (LLaDA-8B's o, LLaDA2.0-mini's q/k/v), BLOCK_N 64 split 1-2 without (wide weights), split 4-8 for deep
    # ones (down); 3 or 4 stages.
    return [
        triton.Config(
            {"BLOCK_N": block_n, "BLOCK_M": block_m, "SPLIT_K": split, "SWAP": swap},
            num_warps=warps,
            num_stages=stages,
        )
        for block_m in (16, 32, 64, 128)
        for block_n, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 4, 4), (256, 8, 3))
        for split in ((1, 2, 4, 8) if block_m <= 64 else (1,))
        for swap in ((False, True) if block_m <= 64 and block_n <= 128 else (False,))
    ]


def _row_tile(rows: int, largest: int) -> int:
    """The smallest power-of-two row tile (BLOCK_M) holding `rows`, from 16 to `largest`."""
    return min(largest, max(16, triton.next_power_of_2(rows)))


def _prune_weight_only(configs, named_args, **kwargs):
    # BLOCK_M: the smallest tile >= the rows (min 16), or the two largest at many rows: a larger one only wastes work.
    rows = named_args["M"]
    wanted = _row_tile(rows, 128)
    allowed = {wanted, wanted // 2} if rows > 64 else {wanted}
    kept = [c for c in configs if c.kwargs["BLOCK_M"] in allowed and (rows <= 64 or c.kwargs["SPLIT_K"] == 1)]
    if named_args["x_ptr"].dtype == torch.float32:
        # float32 runs for exactness, not speed (`tile_product` multiplies it in full float32, on the CUDA cores):
        # one config, unsplit and the narrowest, instead of compiling and timing every one for each new row key.
        return [min(kept, key=lambda c: (c.kwargs["SPLIT_K"], c.kwargs["BLOCK_N"], c.num_stages))]
    return kept


def _add_up_timed_splits(nargs: dict, exception=None) -> None:
    """The split-K product kernels' autotuners' `post_hook`: Triton runs it inside each timed call of a config, so a
    config that splits K is timed with the kernel that adds up its partial sums (`_add_up_splits`), as
    `_split_k_product` runs it after the chosen config. Timed without it, splitting looked free and won
    by margins within the timing noise over configs whose output needs no second kernel (H100, LLaDA-8B's q/k/v
    at 32 rows: split 2 in one process, 1 in another; RESULTS.md, FP8, session 38)."""
    if exception is None and nargs["SPLIT_K"] > 1:
        bias = nargs["bias_ptr"] if nargs["HAS_BIAS"] else None
        _add_up_splits(nargs["partial_ptr"], bias, nargs["out_ptr"], nargs["SPLIT_K"])


def _split_k_autotune(configs: list, prune):
    """Triton's autotuner for a split-K product kernel (launched by `_split_k_product`): keyed by the product's
    shape, `prune` keeping the configs for its rows, each split config timed with its sum (`_add_up_timed_splits`)."""
    return triton.autotune(
        configs=configs,
        key=["M", "N", "K"],
        prune_configs_by={"early_config_prune": prune},
        post_hook=_add_up_timed_splits,
    )


def _largest_split(*kernels) -> int:
    """The largest SPLIT_K the autotuners `kernels` may choose: room for its partial sums is allocated where splits
    may run."""
    return max(config.kwargs["SPLIT_K"] for kernel in kernels for config in kernel.configs)


def few_rows_w8a8_configs() -> list:
    # The weight tile is always the MMA's M (64 or 128 weight rows), the few activation rows its N. SPLIT_K as in
    # `weight_only_configs`: at 32 rows an N of 4096 gives too few tiles to keep every SM streaming weights.
    return [
        triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split}, num_warps=4, num_stages=stages)
        for block_m in (16, 32, 64)
        for block_n in (64, 128)
        for split in (1, 2, 4, 8)
        for stages in (3, 4, 5)
    ]


def _prune_few_rows(configs, named_args, **kwargs):
    # BLOCK_M: the smallest tile >= the rows (min 16), at most 64 (more rows take several row tiles).
    return [c for c in configs if c.kwargs["BLOCK_M"] == _row_tile(named_args["M"], 64)]


def few_rows_rowwise_configs() -> list:
    # As `few_rows_w8a8_configs`, and BLOCK_K free of the scales: with one scale per row nothing is rescaled inside
    # the product, so a k tile may span 256 columns (longer contiguous loads, half the loop's iterations). Deeper
    # pipelines of 64 x 256 tiles (5-6 stages, unsplit or split in 2) won a 288-config sweep on LLaDA-8B's output
    # projection and down by 1.3-1.6 us, timed with their split sums (RESULTS.md, FP8, sessions 37-38).
    return [
        triton.Config(
            {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split},
            num_warps=4,
            num_stages=stages,
        )
        for block_m in (16, 32, 64)
        for block_n, block_k in ((64, 256), (128, 128), (128, 256))
        for split in (1, 2, 4, 8)
        for stages in ((3, 4, 5, 6) if (block_n, block_k) == (64, 256) and split <= 2 else (3, 4))
    ]


if TRITON_AVAILABLE:

    @triton.jit
    def tile_product(x, w, scale_ptrs, in_n, acc, HAS_SCALE: tl.constexpr, SWAP: tl.constexpr):
        # acc += x (BLOCK_M, BLOCK_K) @ w (BLOCK_N, BLOCK_K)^T, each weight row times its scale (read at
        # `scale_ptrs`) if HAS_SCALE: a k tile lies inside one scale block. The tile is scaled in float32 and rounded
        # once to x's dtype before the product, so the MMA accumulates in place. (Scaling each tile's partial product
        # instead, as the FP8 kernels did until session 22, made every k tile wait for its MMA's result: at 32 rows
        # the products were bound by that wait, not by the weight's bytes, their best configs 5-9 % slower on
        # LLaDA-8B's and LLaDA2.0-mini's shapes; RESULTS.md, FP8, session 22.) SWAP: acc is (BLOCK_N, BLOCK_M), the
        # same sums transposed. Used by `_weight_only_kernel` and `grouped_gemm`'s experts.
        if HAS_SCALE:
            scale = tl.load(scale_ptrs, mask=in_n, other=0.0)
            w = (w.to(tl.float32) * scale[:, None]).to(x.dtype)
        else:
            w = w.to(x.dtype)
        if SWAP:
            lhs, rhs = w, tl.trans(x)
        else:
            lhs, rhs = x, tl.trans(w)
        # One return after the branches: Triton's compiler also builds the statements after a constexpr branch
        # that returns. float32 operands are multiplied in full float32: tl.dot would round them to TF32 (~1e-3
        # relative error), enough to flip near-tied tokens against a float32 reference.
        if x.dtype == tl.float32:
            acc = tl.dot(lhs, rhs, acc, input_precision="ieee")
        else:
            acc = tl.dot(lhs, rhs, acc)
        return acc

    @triton.jit
    def _split_k_program(
        M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr
    ):
        # Program (n, m, s) of a split-K product of an (M, K) by a (N, K) matrix: its output rows and columns with
        # their in-bounds masks, its split s, and the k tiles [k_first, k_last) it sums (the last splits may get
        # fewer, or none).
        pid_k = tl.program_id(2)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        k_first = pid_k * per_split
        k_last = tl.minimum(k_first + per_split, tl.cdiv(K, BLOCK_K))
        return offs_m, offs_n, offs_m < M, offs_n < N, pid_k, k_first, k_last

    @triton.jit
    def _k_tile_ptrs(ptr, offs, stride, k_first, BLOCK_K: tl.constexpr):
        # Pointers to the (len(offs), BLOCK_K) tile of rows `offs` of a row-major matrix at k tile `k_first`.
        return ptr + offs[:, None].to(tl.int64) * stride + tl.arange(0, BLOCK_K)[None, :] + k_first * BLOCK_K

    @triton.jit
    def _store_split_product(
        result,
        offs_m,
        offs_n,
        M,
        N,
        pid_k,
        bias_ptr,
        out_ptr,
        partial_ptr,
        HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        # A (BLOCK_M, BLOCK_N) float32 product tile of out `(M, N)` (contiguous): with SPLIT_K 1 (+ bias) rounded
        # into out; else split pid_k's float32 partial sums `(SPLIT_K, M, N)`, which `_sum_splits_kernel` adds up in
        # a fixed order (deterministic, unlike atomics).
        in_n = offs_n < N
        mask = (offs_m < M)[:, None] & in_n[None, :]
        offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                result += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(partial_ptr + pid_k * M * N + offsets, result, mask=mask)

    @_split_k_autotune(weight_only_configs(), _prune_weight_only)
    @triton.jit
    def _weight_only_kernel(
        x_ptr,
        w_ptr,
        scale_ptr,
        bias_ptr,
        out_ptr,
        partial_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_sn,
        SCALE_N: tl.constexpr,
        SCALE_K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_K: tl.constexpr,
        SWAP: tl.constexpr,
    ):
        # out[m, n] = sum over k tiles of x[m, k] @ (w[n, k] * scale[n // SCALE_N, k // SCALE_K])^T (`tile_product`:
        # BLOCK_K <= SCALE_K, so a k tile lies inside one scale block). Program (n, m, s) sums the s-th of SPLIT_K
        # ranges of k tiles (`_split_k_program`, `_store_split_product`).
        offs_m, offs_n, in_m, in_n, pid_k, k_first, k_last = _split_k_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = _k_tile_ptrs(x_ptr, offs_m, stride_xm, k_first, BLOCK_K)
        w_ptrs = _k_tile_ptrs(w_ptr, offs_n, stride_wn, k_first, BLOCK_K)
        scale_ptrs = scale_ptr + (offs_n // SCALE_N) * stride_sn
        # SWAP: the same sums as (BLOCK_N, BLOCK_M) tiles, `w @ x^T`, transposed once at the end.
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_first, k_last):
            in_k = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_n[:, None] & in_k[None, :], other=0.0)
            acc = tile_product(x, w, scale_ptrs + (k * BLOCK_K) // SCALE_K, in_n, acc, True, SWAP)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWAP:
            result = tl.trans(acc)
        else:
            result = acc
        _store_split_product(result, offs_m, offs_n, M, N, pid_k, bias_ptr, out_ptr, partial_ptr, HAS_BIAS, SPLIT_K)

    _MAX_SPLIT_K = _largest_split(_weight_only_kernel)

    @triton.jit
    def _sum_splits_kernel(partial_ptr, bias_ptr, out_ptr, M, N, SPLITS, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # out (M, N) contiguous = sum of the SPLITS float32 slices (M, N) (+ bias), rounded once.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < M * N
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in range(0, SPLITS):
            total += tl.load(partial_ptr + split * M * N + offs, mask=inside, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs % N, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        M,
        M_PADDED,
        K,
        stride_xm,
        stride_qm,
        stride_sm,
        stride_sk,
        ROWS: tl.constexpr,
        GROUP: tl.constexpr,
    ):
        # One program per (ROWS rows, group of GROUP columns), quantized by `fp8_row_groups` (per row: scale =
        # amax / FP8 max, q = x / scale), the helper the fused producers (`rms_norm_to_fp8`, `silu_mul_to_fp8`) call.
        # Rows from M to M_PADDED are written as zero rows, the padding cuBLASLt's product wants.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)
        in_cols = (cols < K)[None, :]
        written = rows < M_PADDED
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None] & in_cols, other=0.0)
        q, scale = fp8_row_groups(x.to(tl.float32))
        q_at = q_ptr + rows64[:, None] * stride_qm + cols[None, :]
        tl.store(q_at, q.to(q_ptr.dtype.element_ty), mask=written[:, None] & in_cols)
        tl.store(scale_ptr + rows64 * stride_sm + group * stride_sk, scale, mask=written)

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=3),
        ],
        key=["M", "N", "K"],
    )
    @triton.jit
    def _w8a8_kernel(
        a_ptr,
        a_scale_ptr,
        w_ptr,
        w_scale_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_am,
        stride_asm,
        stride_ask,
        stride_wn,
        stride_wsn,
        stride_om,
        SCALE_N: tl.constexpr,
        SCALE_K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # Block-scaled FP8 GEMM: per k tile, the FP8 tensor-core product times a's row scales and w's column scales.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        # Grouped ordering: GROUP_M row tiles share each weight tile while it is in L2.
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m = offs_m < M
        in_n = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        a_scale_ptrs = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
        w_scale_ptrs = w_scale_ptr + (offs_n // SCALE_N) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            in_k = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_n[:, None] & in_k[None, :], other=0.0)
            a_scale = tl.load(a_scale_ptrs + ((k * BLOCK_K) // SCALE_K) * stride_ask, mask=in_m, other=0.0)
            w_scale = tl.load(w_scale_ptrs + (k * BLOCK_K) // SCALE_K, mask=in_n, other=0.0)
            acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])

    @triton.jit
    def _few_rows_kernel(
        a_ptr,
        a_scale_ptr,
        w_ptr,
        w_scale_ptr,
        bias_ptr,
        out_ptr,
        partial_ptr,
        M,
        N,
        K,
        stride_am,
        stride_asm,
        stride_ask,
        stride_wn,
        stride_wsn,
        SCALE_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_K: tl.constexpr,
        ROW_SCALED: tl.constexpr,
    ):
        # FP8 operands on FP8 tensor cores, the weight tile as the MMA's M. Program (n, m, s) sums the s-th of
        # SPLIT_K ranges of k tiles, as in `_weight_only_kernel`.
        # Block scales: out[m, n] = sum over k tiles of (w[n, tile] @ a[m, tile]^T)^T * a_scale[m, k] *
        # w_scale[n // SCALE_N, k]. A k tile is one scale block of both (BLOCK_K = the weight's and the activations'
        # block of columns), and BLOCK_N divides SCALE_N, so one weight scale per program and k tile; each tile's
        # product is scaled before it is added, so every k tile waits for its MMA.
        # ROW_SCALED (one scale per row of each operand, `rowwise_matmul`'s arithmetic): out[m, n] = (sum over k of
        # w[n, k] a[m, k]) * a_scale[m] * w_scale[n]. The MMA accumulates in place across k tiles (of any width), in
        # the FP8 tensor cores' own precision as `rowwise_matmul`'s fast accumulation does; the scales apply once, to
        # each program's (partial) sums, which `_sum_splits_kernel` adds up.
        offs_m, offs_n, in_m, in_n, pid_k, k_first, k_last = _split_k_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = _k_tile_ptrs(a_ptr, offs_m, stride_am, k_first, BLOCK_K)
        w_ptrs = _k_tile_ptrs(w_ptr, offs_n, stride_wn, k_first, BLOCK_K)
        a_scale_ptrs = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
        w_scale_row = w_scale_ptr + ((tl.program_id(0) * BLOCK_N) // SCALE_N) * stride_wsn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_first, k_last):
            in_k = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_n[:, None] & in_k[None, :], other=0.0)
            if ROW_SCALED:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                a_scale = tl.load(a_scale_ptrs + k * stride_ask, mask=in_m, other=0.0)
                acc += tl.dot(w, tl.trans(a)) * (a_scale[None, :] * tl.load(w_scale_row + k))
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if ROW_SCALED:
            a_scale = tl.load(a_scale_ptrs, mask=in_m, other=0.0)
            w_scale = tl.load(w_scale_ptr + offs_n.to(tl.int64) * stride_wsn, mask=in_n, other=0.0)
            acc = acc * w_scale[:, None] * a_scale[None, :]
        _store_split_product(
            tl.trans(acc), offs_m, offs_n, M, N, pid_k, bias_ptr, out_ptr, partial_ptr, HAS_BIAS, SPLIT_K
        )

    # One kernel, two autotuners (each keeps its own choices): block scales fix the k tile at 128 columns, row scales
    # leave it to the configs.
    _few_rows_w8a8_kernel = _split_k_autotune(few_rows_w8a8_configs(), _prune_few_rows)(_few_rows_kernel)
    _few_rows_rowwise_kernel = _split_k_autotune(few_rows_rowwise_configs(), _prune_few_rows)(_few_rows_kernel)
    _MAX_FEW_ROWS_SPLIT_K = _largest_split(_few_rows_w8a8_kernel, _few_rows_rowwise_kernel)

# The config each kernel runs in Triton's interpreter (CPU tests; they set others to cover every formulation).
INTERPRETER_CONFIGS = {
    "weight_only": {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2, "SWAP": False},
    "few_rows_w8a8": {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2},
    "few_rows_rowwise": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2},
    "w8a8": {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2},
}


@on_tensor_device
def weight_only_matmul(x: torch.Tensor, weight, weight_scale_inv, block_size, bias=None, config=None) -> torch.Tensor:
    """`x (M, K)` (last dim contiguous) @ dequantized `weight (N, K)`.T (+ bias) -> `(M, N)` in `x.dtype`, the
    weight read in FP8 and scaled in registers. `config`: one of `weight_only_configs()` to run instead of the
    autotuner's choice (tests)."""
    rows, cols = x.shape
    block_n, block_k = block_size
    few = rows <= 64  # splits run at few rows only (`_prune_weight_only`)
    return _split_k_product(
        _weight_only_kernel,
        dict(INTERPRETER_CONFIGS["weight_only"], **({} if few else {"SPLIT_K": 1})),
        (x, weight, weight_scale_inv),
        (x.stride(0), weight.stride(0), weight_scale_inv.stride(0)),
        rows,
        weight.shape[0],
        cols,
        x.dtype,
        bias,
        _MAX_SPLIT_K if few else 1,
        config,
        SCALE_N=block_n,
        SCALE_K=block_k,
        BLOCK_K=min(block_k, 128),
    )


def _split_k_product(
    kernel,
    interpreter_config,
    operands,
    operand_strides,
    rows,
    n_out,
    cols,
    dtype,
    bias,
    max_split,
    config,
    **constexprs,
) -> torch.Tensor:
    """Launch a split-K product kernel (`_weight_only_kernel`, `_few_rows_w8a8_kernel`, whose arguments are
    `operands`, bias, out, partials, M, N, K, `operand_strides`, then `constexprs`) over (column tiles, row tiles,
    splits) -> `(rows, n_out)` in `dtype`; where the kernel split K, `_sum_splits_kernel` adds the partial sums up
    (+ bias). `max_split`: the largest split the autotuner may choose (room for its
    partial sums); `config`: the config to run instead (tests)."""
    device = operands[0].device
    out = torch.empty(rows, n_out, device=device, dtype=dtype)
    splits = config.kwargs["SPLIT_K"] if config is not None else max_split
    partials = torch.empty(splits if splits > 1 else 0, rows, n_out, device=device, dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(n_out, meta["BLOCK_N"]), triton.cdiv(rows, meta["BLOCK_M"]), meta["SPLIT_K"])

    ran = launch(
        kernel,
        grid,
        interpreter_config,
        *operands,
        bias if bias is not None else out,
        out,
        partials,
        rows,
        n_out,
        cols,
        *operand_strides,
        HAS_BIAS=bias is not None,
        config=config,
        **constexprs,
    )
    _add_up_splits(partials, bias, out, ran["SPLIT_K"])
    return out


def _add_up_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, splits: int) -> None:
    """Where a split-K product ran with `splits` > 1: `out (M, N)` = the sum of its float32 partial sums
    `partials[:splits]` (+ bias), in a fixed order (`_sum_splits_kernel`)."""
    if splits == 1:
        return
    rows, n_out = out.shape
    block = 1024
    _sum_splits_kernel[(triton.cdiv(rows * n_out, block),)](
        partials,
        bias if bias is not None else out,
        out,
        rows,
        n_out,
        splits,
        HAS_BIAS=bias is not None,
        BLOCK=block,
    )


def few_rows_w8a8_matmul(x: QuantizedRows, weight, weight_scale_inv, block_size, bias=None, config=None):
    """`x`'s real rows times the FP8 weight on FP8 tensor cores with hf_dllm's few-rows kernel -> `(..., N)` in
    `x.dtype`: the product of `scaled_mm_rows` (the same block-scaled arithmetic up to the order of float32 sums),
    made for a block step's rows, where cuBLASLt streams the weight slower (`few_rows_w8a8_applies`). `x`'s group and
    the weight's block of columns must both be 128 (`block_size` (128, 128)); or, for a row-scaled weight
    (`is_row_scaled`), one scale per row of each: `rowwise_matmul`'s product. `config`:
    one of `few_rows_w8a8_configs()` (`few_rows_rowwise_configs()`) instead of the autotuner's choice (tests)."""
    cols = x.shape[-1]
    row_scaled = is_row_scaled(block_size, cols)
    if row_scaled:
        _check_row_scales(x, weight, weight_scale_inv, "few_rows_w8a8_matmul")
    elif tuple(block_size) != (128, 128) or x.scales.shape[1] != -(-cols // 128):
        raise ValueError(f"few_rows_w8a8_matmul needs 128 x 128 weight blocks and 128-column groups, got {block_size}.")
    rows = x.shape[:-1].numel()
    out = _few_rows_w8a8(x.values, x.scales, rows, x.dtype, weight, weight_scale_inv, bias, config, row_scaled)
    return out.view(*x.shape[:-1], weight.shape[0])


@on_tensor_device
def _few_rows_w8a8(values, scales, rows: int, dtype, weight, weight_scales, bias, config, row_scaled: bool):
    # `few_rows_w8a8_matmul`'s launch on the first `rows` rows of `values` (on their device) -> `(rows, N)`. Block
    # scales fix the k tile at their 128 columns; with row scales it is the config's.
    if row_scaled:
        kernel, name, constexprs = _few_rows_rowwise_kernel, "few_rows_rowwise", dict(SCALE_N=1)
    else:
        kernel, name, constexprs = _few_rows_w8a8_kernel, "few_rows_w8a8", dict(SCALE_N=128, BLOCK_K=128)
    return _split_k_product(
        kernel,
        INTERPRETER_CONFIGS[name],
        (values, scales, weight, weight_scales),
        (values.stride(0), scales.stride(0), scales.stride(1), weight.stride(0), weight_scales.stride(0)),
        rows,
        weight.shape[0],
        weight.shape[1],
        dtype,
        bias,
        _MAX_FEW_ROWS_SPLIT_K,
        config,
        ROW_SCALED=row_scaled,
        **constexprs,
    )


def activation_buffers(
    rows: int, cols: int, group: int, device: torch.device, scales_column_major: bool = False, row_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty FP8 activations `(padded, cols)` and float32 scales `(padded, ceil(cols / group))` for `rows` rows
    padded to a multiple of `row_multiple`. `scales_column_major`: the scales' memory is `(groups, padded)`, its
    leading dimension a multiple of 4 (16 bytes), as cuBLASLt's block-scaled `_scaled_mm` wants it."""
    padded = -(-rows // row_multiple) * row_multiple
    groups = -(-cols // group)
    values = torch.empty(padded, cols, device=device, dtype=FP8_DTYPE)
    if scales_column_major:
        lead = -(-padded // 4) * 4
        return values, torch.empty(groups, lead, device=device, dtype=torch.float32)[:, :padded].t()
    return values, torch.empty(padded, groups, device=device, dtype=torch.float32)


@on_tensor_device
def quantize_rows(x: torch.Tensor, group: int = 128, scales_column_major: bool = False, row_multiple: int = 1):
    """`x (M, K)` -> FP8 `(M, K)` and float32 scales `(M, ceil(K / group))` (one per row and `group` columns, the
    activation side of block-scaled FP8). `scales_column_major`: laid out for cuBLASLt (`activation_buffers`).
    `row_multiple`: both padded with zero rows (x padded with zeros, quantized) to a multiple of it."""
    rows, cols = x.shape
    q, scales = activation_buffers(rows, cols, group, x.device, scales_column_major, row_multiple)
    loaded, tile_rows, warps = triton_ops.fp8_group_tiling(group, cols)
    _quantize_rows_kernel[(triton.cdiv(q.shape[0], tile_rows), scales.shape[1])](
        x,
        q,
        scales,
        rows,
        q.shape[0],
        cols,
        x.stride(0),
        q.stride(0),
        scales.stride(0),
        scales.stride(1),
        ROWS=tile_rows,
        GROUP=loaded,
        num_warps=warps,
    )
    return q, scales


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
# RESULTS.md, FP8, session 28).
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
    a, a_scale = quantize_rows(x, block_k)
    out = torch.empty(rows, n_out, device=x.device, dtype=x.dtype)

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(n_out, meta["BLOCK_N"]),)

    launch(
        _w8a8_kernel,
        grid,
        INTERPRETER_CONFIGS["w8a8"],
        a,
        a_scale,
        weight,
        weight_scale_inv,
        bias if bias is not None else out,
        out,
        rows,
        n_out,
        cols,
        a.stride(0),
        a_scale.stride(0),
        a_scale.stride(1),
        weight.stride(0),
        weight_scale_inv.stride(0),
        out.stride(0),
        SCALE_N=block_n,
        SCALE_K=block_k,
        BLOCK_K=min(block_k, 128),
        HAS_BIAS=bias is not None,
    )
    return out
