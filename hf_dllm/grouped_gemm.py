"""Grouped GEMMs over expert-sorted rows, with the experts' weights in FP8 (block scales, read in place and scaled
in registers) or in the activations' dtype: the routed experts of LLaDA2.x's MoE layer where `torch._grouped_mm`
cannot run them (FP8 weights, issue #13: transformers' `FineGrainedFP8Config` quantizes each expert's Hub-named
`gate_proj` / `up_proj` / `down_proj` with `weight_scale_inv` per 128 x 128 block, as DeepSeek-V3 ships its
experts, arXiv:2412.19437 section 3.3).

Shapes: `x (tokens, K)`; the rows `(pairs,)` in expert order, as `triton_moe.align_by_expert` gives them
(`rows_of`: each row's token, so the gather of the activations is fused into the product's loads), and the groups'
end rows `offsets (groups,)`; weights stacked `(groups, N, K)`, FP8 block scales `(groups, ceil(N / bn),
ceil(K / bk))`.

- `grouped_matmul(..., gated=True)`: the stacked gate/up weight `(groups, 2 * I, K)` (each expert's gate rows, then
  its up rows) -> `act(x @ gate.T) * (x @ up.T)` `(pairs, I)`, both products in one program and the gate's
  activation in its epilogue (the rounding points of the unfused path: each product and the activation rounded to
  the output dtype): `activation` "silu" (LLaDA2.x, LLaDA-MoE) or "gelu_tanh" (GELU's tanh approximation,
  DiffusionGemma's `gelu_pytorch_tanh`).
- `grouped_matmul(...)`: `(pairs, K) @ down.T` -> `(pairs, N)`.

Each program multiplies `BLOCK_M` rows of one group by `BLOCK_N` of its weight's rows. The grid is static (the
most tiles any routing can make: `ceil(pairs / BLOCK_M) + groups`); a program finds its group and first row from
the offsets alone (tiles per group, their prefix sum) and programs past the last tile return at once, so the
products have no host synchronisation and are CUDA-graph capturable (vLLM's `fused_moe` pads every group to
`BLOCK_M` rows in an alignment kernel instead). A weight read once per row tile: at a block step's few rows per
expert the product is bound by reading the selected experts' weights, which FP8 halves.

Exported as Hub remote code (LLaDA2.x): Triton is imported inside `try:` (`triton_ops.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .fp8 import fp8_block_size, is_fp8_linear
from .tensor_parallel import EP_IMPLEMENTATIONS, is_sharded, local_tensor
from .triton_ops import (
    GATE_ACTIVATIONS,
    TRITON_AVAILABLE,
    launch,
    on_tensor_device,
    tl,
    triton,
)  # None without Triton (CPU-only installs)

if TRITON_AVAILABLE:
    from .triton_ops import gate_activation, wait_for_previous_kernel


def grouped_configs() -> list:
    """The configs the autotuner times (`benchmarks/bench_llada2_moe_gemm.py --sweep` times each)."""
    # SWAP multiplies the weight tile by the transposed rows (the weight's rows as the MMA's M dimension), which
    # streamed FP8 weights faster at few rows in the dense weight-only kernel (`fp8_triton.weight_only_configs`).
    # BLOCK_N 32: more programs where few experts hold rows (a batch-1 block step of LLaDA2.0-mini selects ~28 of
    # 256 per layer: ~28 row tiles, 16 column tiles each of gate/up's 512 outputs at BLOCK_N 32).
    # Every config fits an H100's shared memory for FP8 gate/up (each stage holds a row tile in bf16 and two weight
    # tiles in FP8: 4 stages of 128 x 128 tiles would not); with bf16 weights the autotuner skips those that do not.
    # N_FASTEST (the grid's order): a row tile's n blocks side by side, the empty tiles last. At a batch-32 step
    # (1,024 tokens, tiles of 32 or 64 rows) it streamed both products 3-8 % faster (`bench_llada2_moe_gemm.py
    # --sweep`); 16-row tiles (few rows) keep the tiles side by side.
    return [
        triton.Config(
            {"BLOCK_M": block_m, "BLOCK_N": block_n, "SWAP": swap, "N_FASTEST": n_fastest},
            num_warps=warps,
            num_stages=stages,
        )
        for block_m in (16, 32, 64, 128)
        for block_n, warps, stages in ((32, 4, 4), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 4))
        if block_m * block_n * stages < 128 * 128 * 4
        for swap in ((False, True) if block_m <= 32 else (False,))
        for n_fastest in ((False, True) if block_m >= 32 else (False,))
    ]


def footprint_bytes(config, x_bytes: int, w_bytes: int, block_k: int, gated: bool) -> int:
    """Shared memory `config` needs at most: every pipeline stage's row tile of x and one (gated: two) weight tiles
    of `block_k` columns buffered (an upper bound of what Triton allocates)."""
    step = block_k // config.kwargs.get("K_DIVISOR", 1)
    stage = step * (config.kwargs["BLOCK_M"] * x_bytes + (2 if gated else 1) * config.kwargs["BLOCK_N"] * w_bytes)
    return config.num_stages * stage


def fits_shared_memory(config, x_bytes: int, w_bytes: int, block_k: int, gated: bool, device: torch.device) -> bool:
    """Whether `config` surely launches on `device` (`footprint_bytes` within its shared memory)."""
    return footprint_bytes(config, x_bytes, w_bytes, block_k, gated) <= _shared_memory_bytes(device)


# Configs pinned for a product, keyed `(gated, N, K, groups, rows bucket, weight dtype)` (N: the output columns, the
# gated product's `I`; the rows bucket: `rows_bucket(pairs)`), where a sweep of every config timed as the block step
# runs them (replayed from a CUDA graph, back to back, the experts' weights read from HBM: `bench_llada2_moe_gemm.py
# --sweep`) ranked a config above the autotuner's pick. The autotuner times each config launched alone from the
# host (`triton.testing.do_bench`: per-call events, the L2 cleared before each call); at these 10-30 us products its
# ranking lands a few microseconds off the graph's (and in a captured step the kernels run between others).
# A pin may be outside `grouped_configs()`, like `STEP_64` below: such configs are given to the autotuner
# (`autotuned_configs`) only to be taken where pinned.
# 32-row tiles of 64 columns whose loop steps 64 of K, not the launch's 128 (`K_DIVISOR` 2): the best of each swept
# product below, twice the loop's iterations over the same bytes (DiffusionGemma's down product: 11 whole steps over
# its 704 columns, not 5 and a half-masked one).
STEP_64 = dict(BLOCK_M=32, BLOCK_N=64, SWAP=True, N_FASTEST=True, K_DIVISOR=2)
PINNED_CONFIGS = {
    # LLaDA-MoE-7B-A1B's batch-1 block step (32 tokens x top-8: 256 pairs over 64 experts of width 1024, hidden
    # 2048), bf16 weights, H200 (`benchmarks/results/h200_bench_llada2_moe_gemm_llada_moe.log`): gate/up 25.6 us
    # and down 11.5 us, against 26.6 and 12.4 for the former pins (steps of 128 columns).
    (True, 1024, 2048, 64, 256, torch.bfloat16): (STEP_64, 4, 4),
    (False, 2048, 1024, 64, 256, torch.bfloat16): (STEP_64, 4, 4),
    # DiffusionGemma-26B-A4B's batch-1 canvas (256 tokens x top-8: 2,048 pairs over 128 experts of width 704,
    # hidden 2816), bf16, H200 (`benchmarks/results/h200_bench_llada2_moe_gemm_diffusion_gemma.log`): down 130.2 us
    # against the autotuner's pick's 133.9; the captured batch-1 step 16.13 against 16.22 ms with that pick (medians
    # of 4 alternated recaptures, one process). Gate/up keeps the autotuner's pick, the sweep's best.
    (False, 2816, 704, 128, 2048, torch.bfloat16): (STEP_64, 4, 4),
}


def _pin_key(kwargs: dict, warps: int, stages: int) -> tuple:
    return (tuple(sorted(kwargs.items())), warps, stages)


def _config_key(config) -> tuple:
    return _pin_key(config.kwargs, config.num_warps, config.num_stages)


def autotuned_configs() -> list:
    """The autotuner's configs: `grouped_configs()` and the pins outside it (`PINNED_CONFIGS`), which
    `_prune_grouped` keeps only where pinned."""
    configs = grouped_configs()
    known = {_config_key(config) for config in configs}
    extra = {_pin_key(*pin): pin for pin in PINNED_CONFIGS.values() if _pin_key(*pin) not in known}
    return configs + [triton.Config(dict(kwargs), num_warps=w, num_stages=st) for kwargs, w, st in extra.values()]


def pinned_config(gated: bool, n: int, k: int, groups: int, bucket: int, weight_dtype: torch.dtype, configs=None):
    """The config of `configs` (default `autotuned_configs()`) pinned for a product of `groups` groups with `n`
    output columns over `k`, rows bucket `bucket` (`rows_bucket(pairs)`), weights in `weight_dtype`
    (`PINNED_CONFIGS`), or None (the autotuner chooses)."""
    pin = PINNED_CONFIGS.get((gated, n, k, groups, bucket, weight_dtype))
    if pin is None:
        return None
    wanted = _pin_key(*pin)
    for config in autotuned_configs() if configs is None else configs:
        if _config_key(config) == wanted:
            return config
    return None


def _prune_grouped(configs, named_args, **kwargs):
    sizes = (named_args["x_ptr"].element_size(), named_args["w_ptr"].element_size(), kwargs["BLOCK_K"], kwargs["GATED"])
    smallest = min(configs, key=lambda c: footprint_bytes(c, *sizes))  # surely fits the shared memory
    if named_args["x_ptr"].dtype == torch.float32:
        # float32 runs for exactness, not speed (`tile_product` multiplies it in full float32, on the CUDA cores):
        # that one config, instead of compiling and timing every one of them for each new row key (minutes).
        return [smallest]
    if not kwargs["HAS_SCALE"]:
        pinned = pinned_config(
            kwargs["GATED"], named_args["N"], named_args["K"], named_args["n_groups"], named_args["ROWS_BUCKET"],
            named_args["w_ptr"].dtype, configs,
        )  # fmt: skip
        if pinned is not None and fits_shared_memory(pinned, *sizes, named_args["x_ptr"].device):
            return [pinned]  # one config: nothing to choose between
    # BLOCK_M near the rows a used group holds (tiles are per group: a larger tile mostly multiplies padding); the
    # configs that are there only as pins are left out.
    per_group = named_args["ROWS_BUCKET"] // max(1, named_args["n_groups"])
    allowed = {16, 32} if per_group <= 32 else {32, 64} if per_group <= 128 else {64, 128}
    listed = {_config_key(config) for config in grouped_configs()}
    kept = [c for c in configs if c.kwargs["BLOCK_M"] in allowed and _config_key(c) in listed]
    # N_FASTEST puts the row tiles on the grid's second axis: not where there may be more than it takes.
    kept = [
        c
        for c in kept
        if not c.kwargs["N_FASTEST"]
        or named_args["ROWS_BUCKET"] // c.kwargs["BLOCK_M"] + named_args["n_groups"] <= MAX_GRID_Y
    ]
    # The smallest config is kept too where none of those fits the shared memory: the autotuner skips configs that
    # fail to launch, but were all to fail it would launch one of them anyway.
    if not any(fits_shared_memory(c, *sizes, named_args["x_ptr"].device) for c in kept):
        kept.append(smallest)
    return kept


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis

# Rows (pairs) up to which every power of two is an autotuning key of its own (`rows_bucket`).
FINE_ROWS_BUCKETS = 1 << 16


def rows_bucket(pairs: int) -> int:
    """The autotuner's row key for `pairs` rows: the next power of two up to `FINE_ROWS_BUCKETS`, above it the next
    power of 16. Each new key makes the autotuner time every config (~0.1 s each: ~2-4 s per product), and a
    serving engine's packed prefills have any number of rows: with a key per power of two a server met new keys
    long after its warm-up, one stalled boundary each (4-6 s on an H100, LLaDA2.0-mini shape at max batch 128;
    `benchmarks/bench_load.py`). Above 2**16 rows the pruned configs no longer change with the
    key (tiles of 64 or 128 rows for any expert count up to 256), so few keys are enough. The next power of 16
    still bounds the row tiles for `_prune_grouped`'s grid check."""
    exponent = max(0, pairs - 1).bit_length()
    if 1 << exponent <= FINE_ROWS_BUCKETS:
        return 1 << exponent
    return 1 << -(-exponent // 4) * 4


def _shared_memory_bytes(device: torch.device) -> int:
    """Shared memory a program may use on `device` (opt-in maximum; 99 KiB where it cannot be asked)."""
    properties = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return getattr(properties, "shared_memory_per_block_optin", 99 * 1024)


if TRITON_AVAILABLE:
    from .fp8_triton import tile_product

    @triton.jit
    def _tile_of_program(offsets_ptr, n_groups, tile, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
        # Group `group` owns ceil(rows / BLOCK_M) consecutive tiles; `tile`'s group is the number of groups whose
        # tiles all end at or before it (group >= n_groups: past the last tile). Returns the group, the tile's
        # first row and the group's end row.
        g = tl.arange(0, BLOCK_G)
        ends = tl.load(offsets_ptr + g, mask=g < n_groups, other=0)
        starts = tl.load(offsets_ptr + g - 1, mask=(g >= 1) & (g < n_groups), other=0)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        tile_ends = tl.cumsum(tiles, 0)
        group = tl.sum((tile_ends <= tile).to(tl.int32), 0)
        mine = g == group
        first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), 0)
        first_row = tl.sum(tl.where(mine, starts, 0), 0) + (tile - first_tile) * BLOCK_M
        end_row = tl.sum(tl.where(mine, ends, 0), 0)
        return group, first_row, end_row

    @triton.autotune(
        configs=autotuned_configs(),
        # n_groups too: the pruning depends on it (tiles near the rows per group, `PINNED_CONFIGS`).
        key=["ROWS_BUCKET", "N", "K", "n_groups", "GATED", "HAS_SCALE"],
        prune_configs_by={"early_config_prune": _prune_grouped},
    )
    @triton.jit
    def _grouped_kernel(
        x_ptr,
        token_ptr,
        offsets_ptr,
        w_ptr,
        scale_ptr,
        out_ptr,
        n_groups,
        N,
        K,
        stride_xm,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_om,
        up_rows,
        up_scale_rows,
        ROWS_BUCKET,
        GATHER: tl.constexpr,
        GATED: tl.constexpr,
        GELU: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        SCALE_N: tl.constexpr,
        SCALE_K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SWAP: tl.constexpr,
        N_FASTEST: tl.constexpr,
        K_DIVISOR: tl.constexpr = 1,
    ):
        # Program (tile, n): out[rows, n block] for the tile's rows of one group, the tile on the grid's first axis
        # (or, N_FASTEST, its second). GATED: the up product uses the weight's rows `up_rows` further on (and scale
        # rows `up_scale_rows` further on). Each step of the loop over K takes BLOCK_K // K_DIVISOR columns (BLOCK_K:
        # the launch's widest step, an FP8 scale block at most).
        wait_for_previous_kernel()
        tile, pid_n = (tl.program_id(1), tl.program_id(0)) if N_FASTEST else (tl.program_id(0), tl.program_id(1))
        group, first_row, end_row = _tile_of_program(offsets_ptr, n_groups, tile, BLOCK_M, BLOCK_G)
        if group >= n_groups:
            return
        rows = first_row + tl.arange(0, BLOCK_M)
        in_m = rows < end_row
        if GATHER:
            source = tl.load(token_ptr + rows, mask=in_m, other=0)
        else:
            source = rows
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K // K_DIVISOR)
        in_n = offs_n < N
        x_ptrs = x_ptr + source[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + group.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        scale_ptrs = scale_ptr + group.to(tl.int64) * stride_se + (offs_n // SCALE_N) * stride_sn
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros_like(acc)
        for k in range(0, tl.cdiv(K, BLOCK_K // K_DIVISOR)):
            in_k = offs_k < K - k * (BLOCK_K // K_DIVISOR)
            x = tl.load(x_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_n[:, None] & in_k[None, :], other=0.0)
            scale_k = (k * (BLOCK_K // K_DIVISOR)) // SCALE_K
            acc = tile_product(x, w, scale_ptrs + scale_k, in_n, acc, HAS_SCALE, SWAP)
            if GATED:
                w_up = tl.load(w_ptrs + up_rows * stride_wn, mask=in_n[:, None] & in_k[None, :], other=0.0)
                acc_up = tile_product(
                    x, w_up, scale_ptrs + up_scale_rows * stride_sn + scale_k, in_n, acc_up, HAS_SCALE, SWAP
                )
            x_ptrs += BLOCK_K // K_DIVISOR
            w_ptrs += BLOCK_K // K_DIVISOR
        if GATED:
            # The unfused path's rounding: both products and the activation's output rounded to the output dtype.
            out_dtype = out_ptr.dtype.element_ty
            gate = acc.to(out_dtype).to(tl.float32)
            activated = gate_activation(gate, GELU)
            acc = activated.to(out_dtype).to(tl.float32) * acc_up.to(out_dtype).to(tl.float32)
        if SWAP:
            acc = tl.trans(acc)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


# The config the kernel runs in Triton's interpreter (CPU tests set others to cover both formulations).
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "SWAP": False, "N_FASTEST": False}


@on_tensor_device
def grouped_matmul(
    x: torch.Tensor,
    offsets: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    rows_of: torch.Tensor | None = None,
    gated: bool = False,
    config=None,
    activation: str = "silu",
) -> torch.Tensor:
    """Each group's rows times its weight (see the module docstring).

    x `(tokens, K)` with `rows_of` `(pairs,)` int64 (row r is `x[rows_of[r]]`), or `(pairs, K)` already in group
    order; offsets `(groups,)` int32, each group's end row; weight `(groups, N, K)` (last dim contiguous), FP8 with
    `weight_scale_inv` `(groups, ceil(N / bn), ceil(K / bk))` float32 and `block_size` `(bn, bk)`, or in x's dtype
    with neither. Returns `(pairs, N)` in x's dtype, or with `gated` `(pairs, N // 2)`: `silu(gate) * up` of the
    weight's two halves, `act` the `activation` ("silu" or "gelu_tanh"). `config`: one of `grouped_configs()` instead
    of the autotuner's (tests, sweeps)."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {GATE_ACTIVATIONS}, got {activation!r}.")
    groups, n_weight, k_in = weight.shape
    pairs = rows_of.shape[0] if rows_of is not None else x.shape[0]
    if offsets.shape != (groups,):
        raise ValueError(f"offsets must have shape ({groups},) (one end row per group), got {tuple(offsets.shape)}.")
    if x.shape[-1] != k_in:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {k_in}.")
    has_scale = weight_scale_inv is not None
    if has_scale != (block_size is not None):
        raise ValueError("weight_scale_inv and block_size are given together (FP8 weights) or not at all.")
    if not has_scale and weight.dtype != x.dtype:
        raise ValueError(f"a {weight.dtype} weight without block scales must have x's dtype ({x.dtype}).")
    if has_scale:
        scale_rows = (2 if gated else 1) * -(-(n_weight // (2 if gated else 1)) // block_size[0])
        if weight_scale_inv.shape != (groups, scale_rows, -(-k_in // block_size[1])):
            raise ValueError(
                f"weight_scale_inv has shape {tuple(weight_scale_inv.shape)}, expected "
                f"{(groups, scale_rows, -(-k_in // block_size[1]))} (per group, {'the gate then the up scales' if gated else 'one per block'})."
            )
    if weight.stride(-1) != 1:
        raise ValueError("the weight's last dim must be contiguous.")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_out = n_weight // 2 if gated else n_weight
    out = torch.empty(pairs, n_out, device=x.device, dtype=x.dtype)
    if pairs == 0:
        return out
    block_n, block_k = block_size if has_scale else (n_weight, 128)
    scale = weight_scale_inv if has_scale else out  # an unused pointer without scales
    up_scale_rows = -(-n_out // block_n) if has_scale else 0

    def grid(meta):
        # Tiles on the first axis (no 65,535 limit; a group's row tiles side by side share its weight tiles in L2),
        # or on the second with N_FASTEST.
        tiles, n_blocks = triton.cdiv(pairs, meta["BLOCK_M"]) + min(groups, pairs), triton.cdiv(n_out, meta["BLOCK_N"])
        if not meta["N_FASTEST"]:
            return (tiles, n_blocks)
        if tiles > MAX_GRID_Y:
            raise ValueError(f"N_FASTEST puts the {tiles} row tiles on the grid's second axis (at most {MAX_GRID_Y}).")
        return (n_blocks, tiles)

    launch(
        _grouped_kernel,
        grid,
        INTERPRETER_CONFIG,
        x,
        rows_of if rows_of is not None else offsets,
        offsets,
        weight,
        scale,
        out,
        groups,
        n_out,
        k_in,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        scale.stride(0) if has_scale else 0,
        scale.stride(1) if has_scale else 0,
        out.stride(0),
        n_out,
        up_scale_rows,
        rows_bucket(pairs),
        GATHER=rows_of is not None,
        GATED=gated,
        GELU=activation == "gelu_tanh",
        HAS_SCALE=has_scale,
        SCALE_N=block_n if has_scale else 1,
        SCALE_K=block_k,
        BLOCK_K=min(block_k, 128),
        BLOCK_G=max(16, triton.next_power_of_2(groups)),
        config=config,
    )
    return out


# The experts' weights stacked for `grouped_matmul` (LLaDA2.x's and LLaDA-MoE's MoE blocks).
class ExpertStacks(NamedTuple):
    """The experts' weights stacked for the grouped products (LLaDA2's and LLaDA-MoE's MoE blocks):
    gate_up `(E', 2 * I, H)` (each expert's gate rows, then its up rows) and down `(E', H, I)` in the experts'
    dtype; for FP8 experts (transformers' `FineGrainedFP8Config`) also their block scales, gate_up_scale
    `(E', 2 * ceil(I / bn), ceil(H / bk))` (the gate's scale rows, then the up's) and down_scale
    `(E', ceil(H / bn), ceil(I / bk))`, and block_size `(bn, bk)`."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    block_size: tuple[int, int] | None = None


def expert_fp8_block_size(layer: nn.Linear) -> tuple[int, int] | None:
    """An FP8 layer's block size (transformers' `FP8Linear`; `(1, K)` per tensor), None for a layer in a floating
    dtype."""
    return fp8_block_size(layer) if is_fp8_linear(layer) else None


def stack_expert_parameters(experts: list[nn.Module], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' (SwiGLU MLPs with `gate_proj`, `up_proj`, `down_proj`) `name` parameters (`weight`, or FP8
    layers' `weight_scale_inv`) stacked: `(E', gate rows + up rows, ...)` and `(E', down rows, ...)`; each expert's
    parameters re-pointed to views of the stacks (no second copy; under tensor parallelism, this rank's slices)."""

    def local(linear: nn.Linear) -> torch.Tensor:
        return local_tensor(getattr(linear, name)).detach()

    gate_up = torch.stack([torch.cat([local(expert.gate_proj), local(expert.up_proj)]) for expert in experts])
    down = torch.stack([local(expert.down_proj) for expert in experts])
    gate_rows = local(experts[0].gate_proj).shape[0]
    for e, expert in enumerate(experts):
        local_tensor(getattr(expert.gate_proj, name)).data = gate_up[e, :gate_rows]
        local_tensor(getattr(expert.up_proj, name)).data = gate_up[e, gate_rows:]
        local_tensor(getattr(expert.down_proj, name)).data = down[e]
    return gate_up, down


def stack_experts(experts: list[nn.Module]) -> ExpertStacks:
    """`ExpertStacks` of the experts' weights, with their block scales where the experts are FP8 (the parameters
    re-pointed to views of the stacks: `stack_expert_parameters`)."""
    gate_up, down = stack_expert_parameters(experts, "weight")
    block_size = expert_fp8_block_size(experts[0].gate_proj)
    if block_size is None:
        return ExpertStacks(gate_up, down)
    return ExpertStacks(gate_up, down, *stack_expert_parameters(experts, "weight_scale_inv"), block_size)


# -- the routed experts as one module, for transformers' expert parallelism -------------------------------------------
def _torch_grouped_mm():
    """torch's grouped GEMM (`nn.functional.grouped_mm`, `torch._grouped_mm` before), or None."""
    return getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class ExpertList(nn.ModuleList):
    """A MoE layer's routed experts, one module per expert under the Hub's names (`experts.{e}.gate_proj.weight`, ...:
    SwiGLU MLPs with `gate_proj`, `up_proj`, `down_proj` and `act_fn`), callable as transformers' experts modules are,
    so that transformers' expert parallelism partitions them whole (`tensor_parallel.EXPERTS_STYLE`, Switch
    Transformer's / GShard's expert parallelism, arXiv:2101.03961, arXiv:2006.16668):

    - `keep_local_experts(rank, ranks)`: keep experts `[first, first + num_experts)`, replace the others by empty
      modules (their checkpoint tensors are then neither read nor initialised);
    - `forward(hidden_states, top_k_index, top_k_weights)`: hidden_states `(tokens, hidden)`, each token's chosen
      experts `(tokens, k)` as indices into this list's kept experts (an index outside `[0, num_experts)`: another
      rank's expert, skipped) and their weights `(tokens, k)` -> `(tokens, hidden)` in the weights' dtype, the
      weighted sum of the chosen experts' outputs. Two grouped GEMMs over the kept experts' stacked weights (no host
      synchronisation) where torch's grouped GEMM runs for the device and dtype (`runs_grouped`), else a loop over
      the experts that got tokens.
    """

    def __init__(self, experts, config):
        super().__init__(experts)
        self.config = config  # its `_experts_implementation` ("eager": the loop)
        self.first = 0
        self.num_experts = len(self)
        self._stacks: tuple | None = None  # (ExpertStacks, the weights and pointers they were made from)

    @property
    def partitioned(self) -> bool:
        """Whether this rank holds only some of the experts (expert parallelism)."""
        return self.num_experts < len(self)

    def keep_local_experts(self, rank: int, ranks: int) -> None:
        """Rank `rank` of `ranks` keeps experts `[rank * E / ranks, (rank + 1) * E / ranks)`; the others become empty
        modules. Called by `tensor_parallel.LocalExperts` before the weights load."""
        implementation = getattr(getattr(self.config, "distributed_config", None), "ep_implementation", "auto")
        if implementation not in EP_IMPLEMENTATIONS:
            # The experts run on the batch every rank holds (`ExpertDispatch` joins a shared expert's partial sums).
            raise ValueError(
                f"expert parallelism of hf_dllm's MoE models takes ep_implementation in {EP_IMPLEMENTATIONS}, got "
                f"{implementation!r}."
            )
        if len(self) % ranks:
            raise ValueError(
                f"expert parallelism splits the {len(self)} experts of a layer evenly over its ranks: ep_size must "
                f"divide {len(self)}, got {ranks}."
            )
        self.num_experts = len(self) // ranks
        self.first = rank * self.num_experts
        for e in range(len(self)):
            if not self.first <= e < self.first + self.num_experts:
                self[e] = nn.Module()
        self._stacks = None

    def local_experts(self) -> list[nn.Module]:
        return list(self)[self.first : self.first + self.num_experts]

    def _apply(self, fn, *args, **kwargs):
        self._stacks = None  # new storage after `.to()` and friends
        return super()._apply(fn, *args, **kwargs)

    def runs_grouped(self, x: torch.Tensor) -> bool:
        """Whether `forward` runs as torch's grouped GEMMs for activations `x`: not asked for the loop
        (`experts_implementation="eager"`), no autograd graph to record, plain weights in x's dtype with 16-byte
        row strides, and torch's grouped GEMM for the device (CUDA: Hopper or newer, bfloat16; the CPU's)."""
        from transformers.utils.import_utils import is_torch_greater_or_equal

        if getattr(self.config, "_experts_implementation", None) == "eager" or _torch_grouped_mm() is None:
            return False
        weight = self.local_experts()[0].gate_proj.weight
        if is_fp8_linear(self.local_experts()[0].gate_proj) or weight.dtype != x.dtype:
            return False
        if torch.is_grad_enabled() and weight.requires_grad:
            return False
        size = weight.element_size()
        if (weight.shape[0] * size) % 16 or (weight.shape[1] * size) % 16:
            return False
        if x.device.type == "cuda":
            return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
        return x.device.type == "cpu" and is_torch_greater_or_equal("2.9", accept_dev=True)

    def stacks(self) -> ExpertStacks:
        """The kept experts' weights stacked (`ExpertStacks`: gate_up `(E_local, 2I, H)`, down `(E_local, H, I)`, and
        FP8 experts' block scales; `stack_expert_parameters` re-points the parameters to views of them, so no copy is
        kept and in-place updates such as `load_state_dict` reach the stacks), made again after `.to()` or when the
        first or last kept expert's weights were replaced."""
        experts = self.local_experts()
        current = (experts[0].gate_proj.weight, experts[-1].down_proj.weight)
        if self._stacks is not None:
            stacks, made_from = self._stacks
            if all(a is b and a.data_ptr() == pointer for a, (b, pointer) in zip(current, made_from, strict=True)):
                return stacks
        with torch.no_grad():
            stacks = stack_experts(experts)
        self._stacks = (stacks, tuple((weight, weight.data_ptr()) for weight in current))
        return stacks

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, hidden = hidden_states.shape
        top_k = top_k_index.shape[1]
        count = self.num_experts
        # The (token, choice) pairs sorted by expert, other ranks' experts (index `count`) last.
        chosen = torch.where((top_k_index >= 0) & (top_k_index < count), top_k_index, count).reshape(-1)
        order = chosen.argsort(stable=True)
        if self.runs_grouped(hidden_states):
            sorted_out = self._grouped(hidden_states[order // top_k], chosen)
        else:
            sorted_out = self._loop(hidden_states[order // top_k], chosen)
        pairs = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out).view(tokens, top_k, hidden)
        return (pairs.to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)).sum(dim=1)

    def _grouped(self, sorted_x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each kept expert on its rows of `sorted_x` `(pairs, hidden)` (sorted by `chosen`): two grouped GEMMs; the
        rows of other ranks' experts (after the last group) come out as zeros."""
        grouped_mm = _torch_grouped_mm()
        stacks = self.stacks()
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int32, device=chosen.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.int32))
        offsets = counts[:-1].cumsum(0, dtype=torch.int32)
        gate, up = grouped_mm(sorted_x, stacks.gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        activated = (self.local_experts()[0].act_fn(gate) * up).contiguous()
        out = grouped_mm(activated, stacks.down.transpose(1, 2), offs=offsets)
        return zero_rows_past(out, offsets[-1])

    def _loop(self, sorted_x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """As `_grouped`, one kept expert at a time (the counts read on the host)."""
        out = torch.zeros_like(sorted_x)
        start = 0
        counts = torch.bincount(chosen, minlength=self.num_experts + 1)[: self.num_experts].tolist()
        for expert, count in zip(self.local_experts(), counts, strict=True):
            if count:
                out[start : start + count] = expert(sorted_x[start : start + count])
                start += count
        return out


def zero_rows_past(out: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """out `(rows, n)` with its rows from `end` on zeroed (`end` a 0-d device tensor, the last group's end row; no
    host synchronisation). Grouped products leave the rows past their last group unwritten: under expert
    parallelism, the pairs routed to other ranks' experts, whose weight 0 times an unwritten NaN would be NaN."""
    kept = torch.arange(out.shape[0], device=out.device) < end
    return torch.where(kept[:, None], out, 0)


class ExpertDispatch(nn.Module):
    """Where transformers' expert parallelism reaches an `ExpertList` (the module named `"ep_dispatch_experts"` in
    the expert-parallel plan; registered after the list, so that it sees the list's kept experts): `forward` is the
    list's, `num_experts` its kept experts. Without expert parallelism it is the list itself (global indices). Holds
    the list by reference (no second copy of its parameters in the module tree).

    `shared`: a shared expert (with `partial_forward`) that tensor parallelism splits over the same ranks: its partial
    output joins the routed experts' (`joins_shared`), so that transformers' one all-reduce of the layer sums both
    (`AllReduceEP`, which every rank of the group runs on the same batch)."""

    def __init__(self, experts: ExpertList, shared: nn.Module | None = None):
        super().__init__()
        self._experts = (experts,)
        self._shared = (shared,)

    @property
    def num_experts(self) -> int:
        return self._experts[0].num_experts

    @property
    def joins_shared(self) -> bool:
        shared = self._shared[0]
        return shared is not None and self._experts[0].partitioned and is_sharded(shared.down_proj.weight)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = self._experts[0](hidden_states, top_k_index, top_k_weights)
        if self.joins_shared:
            out = out + self._shared[0].partial_forward(hidden_states).to(out.dtype)
        return out


def other_ranks_expert_keys(model: nn.Module, keys) -> set[str]:
    """The checkpoint keys among `keys` that name experts this rank dropped under expert parallelism
    (`ExpertList.keep_local_experts`): loading skips them by design, so they are not reported as unexpected."""
    import re

    kept = {
        name: (experts.first, experts.first + experts.num_experts)
        for name, experts in model.named_modules()
        if isinstance(experts, ExpertList) and experts.partitioned
    }
    if not kept:
        return set()
    expert_key = re.compile(r"(.*\.experts)\.(\d+)\.")
    others = set()
    for key in keys:
        match = expert_key.match(key)
        span = match and kept.get(match.group(1))
        if span and not span[0] <= int(match.group(2)) < span[1]:
            others.add(key)
    return others
