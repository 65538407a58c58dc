"""Dense products of few rows, `x @ weight.T (+ bias)`, in one Triton launch split over the reduction (split-K).

Why: a block step at batch 1 multiplies 32 rows by each layer's matrices, so every product is a read of its weight
and nothing else. cuBLAS tiles such a product over its output columns only: LLaDA-MoE's o-projection (2048 x 2048)
becomes 32 programs on an H200's 132 multiprocessors and reads its 8 MB at 1.4 TB/s (6.1 us). Here the reduction
is split too, so enough programs stream the weight at once (4.4 us), and the kernel is launched like hf_dllm's
other kernels (programmatic dependent launch, `triton_ops.dependent_launch`), which cuBLAS's are not.

Each of the SPLIT_K programs of a column tile writes its float32 partial product; the last of them to count itself
in the tile's counter (acquire-release) adds the partials in split order and writes the output, rounded once, with
the bias added in float32 first. The order of the sums does not depend on which program finishes last, so a row's
result is the same in every launch and in every batch of up to `FEW_ROWS` rows (the tile's other rows never enter
it). The counters are the weight's own (`triton_attention.merge_counters`): two products on two streams never share
one.

`kernels.py` decides where it runs (`few_rows_applies`); `nn.functional.linear` stays the reference. Exported as Hub
remote code: Triton is imported inside `try:` (`triton_ops`).
"""

from __future__ import annotations

import torch

from .triton_attention import merge_counters
from .triton_ops import (  # None without Triton (CPU-only installs)
    TRITON_AVAILABLE,
    capability,
    dependent_launch,
    on_tensor_device,
    tl,
    triton,
)

if TRITON_AVAILABLE:
    from .triton_ops import wait_for_previous_kernel

    @triton.jit
    def _dense_rows_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K, stride_xm, stride_wn, stride_om, chunk,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        # Program (n, s): output columns [n * BLOCK_N, +BLOCK_N) of all M (<= BLOCK_M) rows, summed over the s-th
        # chunk of `chunk` reduction columns. The weight tile is the MMA's M side (BLOCK_N >= 16 rows of it), the few
        # rows its N side: the product is computed transposed, (BLOCK_N, BLOCK_M). EVEN_K (K and `chunk` whole
        # BLOCK_K steps): no reduction mask, whose per-column bound would keep the weight's loads from vectorizing.
        wait_for_previous_kernel()
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        in_n = offs_n < N
        in_m = offs_m < M
        k_first = split * chunk
        k_end = tl.minimum(k_first + chunk, K)
        offs_k = k_first + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_first, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=in_n[:, None], other=0.0)
                x = tl.load(x_ptrs, mask=in_m[None, :], other=0.0)
            else:
                in_k = offs_k < k_end - (k - k_first)
                w = tl.load(w_ptrs, mask=in_n[:, None] & in_k[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=in_m[None, :] & in_k[:, None], other=0.0)
            acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_n[:, None] & in_m[None, :])
        else:
            # Partials (SPLIT_K, BLOCK_M, N), contiguous.
            tile = offs_m[None, :] * N + offs_n[:, None]
            tl.store(partial_ptr + split * BLOCK_M * N + tile, acc, mask=in_n[:, None] & in_m[None, :])
            # Every thread's stores issued before one thread counts (the barrier orders them before its release);
            # the last of the tile's splits to count acquires them all and sums them.
            tl.debug_barrier()
            counter = counter_ptr + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # split order, whichever program came last
                    total += tl.load(
                        partial_ptr + s * BLOCK_M * N + tile,
                        mask=in_n[:, None] & in_m[None, :],
                        other=0.0,
                        cache_modifier=".cg",  # written by other multiprocessors in this launch: not from L1
                    )
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[:, None]
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=in_n[:, None] & in_m[None, :])
                tl.store(counter, 0)  # every split has counted: nothing else touches it in this launch


# Whether `kernels.dense_linear` multiplies few rows here (off: always `nn.functional.linear`; A/B measurements).
FEW_ROWS_PRODUCTS = True
# Rows up to which `kernels.py` multiplies with this kernel (a batch-1 block step's 32), one tile of them.
FEW_ROWS = 32
# Weights up to this many elements: the output heads (over 300 M) stay cuBLAS's, which reads them at the copy rate.
FEW_ROWS_MAX_WEIGHT = 1 << 27
BLOCK_N = 64
BLOCK_K = 128


def few_rows_config(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """The split of the reduction and the pipeline depth for an `(n, k)` weight: the most splits (a power of two,
    at most 8, chunks of at least 4 `BLOCK_K` steps) with at most 128 programs where k <= 2048, 256 above. An
    H200's sweep of 32-row products (8 shapes of LLaDA-MoE-7B, LLaDA2.0-mini, LLaDA-8B) picked those splits: e.g.
    1 for LLaDA-MoE's q/k/v (96 column tiles; 8.5 us against cuBLAS's 9.6), 4 for its o-projection (32 tiles;
    4.4 against 6.1), 4 for LLaDA-8B's down projection (64 tiles, k 12288; 27.3 against 30.2). Six stages where
    the multiprocessor has Hopper's shared memory, three before."""
    tiles = triton.cdiv(n, BLOCK_N)
    budget = 128 if k <= 2048 else 256
    split = 1
    while split < 8 and tiles * split * 2 <= budget and k >= split * 2 * 4 * BLOCK_K:
        split *= 2
    stages = 6 if device.type == "cuda" and capability(device) >= (9, 0) else 3
    return split, stages


def few_rows_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `few_rows_linear(x, weight, bias)` computes this product (the caller has checked that the fused kernels
    run, `kernels.use_fused_kernels`): at most `FEW_ROWS` rows, x, weight (and bias) in one half-precision dtype on
    one device, plain tensors, the weight `(N, K)` row-major and at most `FEW_ROWS_MAX_WEIGHT` elements."""
    return (
        TRITON_AVAILABLE
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.device == x.device
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.stride(-1) == 1
        and weight.numel() <= FEW_ROWS_MAX_WEIGHT
        and 0 < x.numel() // max(x.shape[-1], 1) <= FEW_ROWS
        and x.shape[-1] == weight.shape[1]
        and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],)))
    )


@on_tensor_device
def few_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: tuple[int, int] | None = None
) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)` for x `(..., K)` of at most `FEW_ROWS` rows (`few_rows_applies`),
    weight `(N, K)`, bias `(N,)` -> `(..., N)` in x's dtype, summed in float32 (the order of the sums is the
    kernel's). `config`: `(split_k, num_stages)` instead of `few_rows_config`'s (tests, sweeps)."""
    if not few_rows_applies(x, weight, bias):
        raise ValueError(
            f"few_rows_linear takes 1 to {FEW_ROWS} rows of x in weight's half-precision dtype with a row-major "
            f"weight of at most {FEW_ROWS_MAX_WEIGHT} elements: got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}."
        )
    n, k = weight.shape
    split, stages = config or few_rows_config(n, k, x.device)
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    tiles = triton.cdiv(n, BLOCK_N)
    # The weight's own counters (two streams never share one); one split counts nothing: any pointer. None inside a
    # CUDA graph capture before the weight's first product: cuBLAS's product then.
    counters = merge_counters(x.device, tiles, owner=weight.data_ptr()) if split > 1 else rows
    if counters is None:
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty(rows.shape[0], n, device=x.device, dtype=x.dtype)
    partials = torch.empty(split, FEW_ROWS, n, device=x.device, dtype=torch.float32) if split > 1 else out
    chunk = BLOCK_K * triton.cdiv(triton.cdiv(k, split), BLOCK_K)
    _dense_rows_kernel[(tiles, split)](
        rows, weight, bias if bias is not None else weight, out, partials, counters, rows.shape[0], n, k,
        rows.stride(0), weight.stride(0), out.stride(0), chunk, HAS_BIAS=bias is not None, BLOCK_M=FEW_ROWS,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=split, EVEN_K=k % BLOCK_K == 0, num_warps=4, num_stages=stages,
        **dependent_launch(),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
