"""hf_dllm's Triton FP8 products and their launchers: the kernels `fp8.py`'s rules choose (its docstring says which
runs where, and why).

- `weight_only_matmul`: FP8 weight tiles scaled in registers and multiplied in the activations' dtype, split-K at
  few rows (`_weight_only_kernel`).
- `few_rows_product`: a block step's few rows on FP8 tensor cores, the weight tile as the MMA's M, split-K, block or
  row scales (`_few_rows_kernel`, one autotuner per scaling).
- `triton_w8a8_matmul`: activations quantized per row and 128 columns, block-scaled FP8 tensor-core product
  (`_w8a8_kernel`), where cuBLASLt's is not available.
- `quantize_rows`: activations to FP8 with one scale per row and column group.

Split-K products add their float32 partial sums in a second kernel (`_sum_splits_kernel`), in a fixed order, and
every config is timed with it (`_add_up_timed_splits`). Each launcher runs one fixed config in Triton's interpreter
(`INTERPRETER_CONFIGS`: the CPU tests) and takes a `config` to run instead of the autotuner's choice (tests).
Static shapes, no host syncs: block steps stay CUDA-graph capturable.

This file is exported as Hub remote code: Triton is imported inside `try:` (`triton_ops`).
"""

from __future__ import annotations

import torch

from .triton_ops import (  # None without Triton (CPU-only installs)
    TRITON_AVAILABLE,
    dependent_launch,
    fp8_group_tiling,
    launch,
    on_tensor_device,
    tl,
    triton,
)

if TRITON_AVAILABLE:
    from .triton_ops import fp8_row_groups, wait_for_previous_kernel

FP8_DTYPE = torch.float8_e4m3fn


def weight_only_configs() -> list:
    # SPLIT_K > 1 splits K over programs (partial sums reduced by a second kernel): at a block step's 32 rows an
    # N of 4096 gives too few (row, column) tiles to keep every SM streaming weights. SWAP multiplies the weight
    # tile by the transposed activations (the weight's rows as the MMA's M). With the weight scaled before the
    # MMA, the fastest at 32 rows were (H100, `benchmarks/sweep_fp8_weight_only.py`): BLOCK_N 128 split 4 with
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
    at 32 rows: split 2 in one process, 1 in another)."""
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
    # projection and down by 1.3-1.6 us, timed with their split sums (`benchmarks/bench_fp8_gemm.py`).
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
        # instead, as the FP8 kernels once did, made every k tile wait for its MMA's result: at 32 rows
        # the products were bound by that wait, not by the weight's bytes, their best configs 5-9 % slower on
        # LLaDA-8B's and LLaDA2.0-mini's shapes.) SWAP: acc is (BLOCK_N, BLOCK_M), the
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
        wait_for_previous_kernel()
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
        wait_for_previous_kernel()
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
        wait_for_previous_kernel()
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
        wait_for_previous_kernel()
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
        wait_for_previous_kernel()
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
        **dependent_launch(),
    )


@on_tensor_device
def few_rows_product(values, scales, rows: int, dtype, weight, weight_scales, bias, config, row_scaled: bool):
    """`fp8.few_rows_w8a8_matmul`'s launch on the first `rows` rows of FP8 `values` with their `scales` (on their
    device) -> `(rows, N)` in `dtype`. Block scales fix the k tile at their 128 columns; with row scales
    (`row_scaled`) it is the config's."""
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
    loaded, tile_rows, warps = fp8_group_tiling(group, cols)
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
        **dependent_launch(),
    )
    return q, scales


@on_tensor_device
def triton_w8a8_matmul(x: torch.Tensor, weight, weight_scale_inv, block_size, bias=None) -> torch.Tensor:
    """`x (M, K)` quantized per row and `block_k` columns (`quantize_rows`), times the FP8 weight `(N, K)` with its
    `(ceil(N / bn), ceil(K / bk))` scales by the Triton block-scaled kernel (`_w8a8_kernel`, FP8 tensor cores) ->
    `(M, N)` in `x.dtype`: `fp8.w8a8_matmul`'s product where cuBLASLt's does not run."""
    rows, cols = x.shape
    n_out = weight.shape[0]
    block_n, block_k = block_size
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
