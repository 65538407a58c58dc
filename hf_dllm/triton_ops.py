"""Fused Triton kernels for the elementwise parts of a LLaDA (or Dream) block: RMSNorm (with the residual add fused
in), RoPE (in float32 as LLaDA's, or rounded in the activation dtype as Dream's) and the SiLU gate; and the greedy
proposal over the vocabulary (argmax and its softmax probability in one pass, split among programs for few rows).

Why: a denoising step at batch 1 feeds 32 tokens through 32 layers; in plain PyTorch each layer launches ~30 tiny
elementwise kernels (casts, pow, mean, rsqrt, cat, ...) that cost more than the matrix products around them even
inside a CUDA graph. Each kernel here replaces one such chain with one launch and keeps the same rounding points
as the PyTorch code in `modeling_llada.py` (float32 math, casts to the activation dtype where PyTorch casts).

`kernels.py` decides when these run (CUDA tensors and Triton available, unless overridden); the PyTorch code stays
the reference and the CPU path. This file is exported as Hub remote code: Triton is imported inside `try:`.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

# The one place Triton is imported: the other kernel files (`triton_attention.py`, `triton_moe.py`,
# `fp8_triton.py`) take `triton`, `tl` and `TRITON_AVAILABLE` from here.
try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # CPU-only installs: the PyTorch path is used
    triton = None
    tl = None
    TRITON_AVAILABLE = False

# Programmatic dependent launch (CUDA's PDL, Hopper and later; Triton >= 3.5 names it): a kernel launched with it
# may start while the kernel before it on the stream still runs, so a step's ~200 launches stop paying each one's
# launch latency and ramp in the gap between kernels (0.5-0.8 us a kernel in captured chains on an H200). Every kernel
# of hf_dllm starts with `wait_for_previous_kernel()` and every launch passes `**dependent_launch()`.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.language.target_info import constexpr_function, cuda_capability_geq

    DEPENDENT_LAUNCH_AVAILABLE = TRITON_AVAILABLE
except ImportError:  # older Triton: kernels launch after the previous one ends
    DEPENDENT_LAUNCH_AVAILABLE = False

# Whether launches ask for programmatic dependent launch where the GPU has it (off: plain launches, same bits).
DEPENDENT_LAUNCH = True


@functools.cache
def _capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device (the current one for a bare "cuda"), looked up once per device."""
    index = torch.device(device).index
    return _capability(torch.cuda.current_device() if index is None else index)


def dependent_launch() -> dict:
    """The launch options of a kernel that starts with `wait_for_previous_kernel()`, on the current CUDA device
    (the tensors' one: `on_tensor_device`): `launch_pdl` on Hopper and later GPUs (`DEPENDENT_LAUNCH`), none in
    Triton's interpreter or before. Looked up once per device: it runs at every launch."""
    if not (DEPENDENT_LAUNCH and DEPENDENT_LAUNCH_AVAILABLE) or not torch.cuda.is_initialized():
        return {}
    return _dependent_launch_options(torch.cuda.current_device())


@functools.cache
def _dependent_launch_options(device: int) -> dict:
    if os.environ.get("TRITON_INTERPRET") == "1" or capability(device) < (9, 0):
        return {}
    return {"launch_pdl": True}


if DEPENDENT_LAUNCH_AVAILABLE:
    # Triton's interpreter has no `griddepcontrol`; like `triton.jit` itself, decided when the module is imported.
    _INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

    @constexpr_function
    def _grid_dependency_control():
        # At compile time: whether the target runs `griddepcontrol` (sm_90 and later).
        return cuda_capability_geq(9, 0)

    @triton.jit
    def wait_for_previous_kernel():
        # A kernel's first statement. Lets the next kernel on the stream launch as soon as every program of this one
        # has started (its programs then wait here in turn), then waits until the previous kernel has finished and
        # its writes are visible: nothing of this kernel reads or writes memory before that, so the stream's order
        # holds as without PDL, transitively (every program waits, none returns before this). A no-op when the
        # launch had no `launch_pdl`.
        if not _INTERPRETED:
            if _grid_dependency_control():
                gdc_launch_dependents()
                gdc_wait()

elif TRITON_AVAILABLE:

    @triton.jit
    def wait_for_previous_kernel():
        pass


def on_tensor_device(launcher):
    """Run a kernel launcher with its first argument's CUDA device as the current device: Triton launches on the
    current device, which is not the tensors' for a model on cuda:1 or split over GPUs (`device_map`)."""

    @functools.wraps(launcher)
    def wrapper(tensor: torch.Tensor, *args, **kwargs):
        context = torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
        with context:
            return launcher(tensor, *args, **kwargs)

    return wrapper


def launch(kernel, grid, interpreter_config: dict, *args, config: triton.Config | None = None, **kwargs) -> dict:
    """Launch an autotuned kernel (`fp8_triton.py`, `grouped_gemm.py`) on `grid(meta)`: with `config` (tests and sweeps)
    that config, else the autotuner's choice. Triton's interpreter (TRITON_INTERPRET=1, CPU tests) cannot time the
    autotuner's configs: it runs `interpreter_config`. Returns the parameters of the config that ran."""
    if config is not None:
        meta = dict(kwargs, **config.kwargs)
        kernel.fn[grid(meta)](
            *args, **meta, num_warps=config.num_warps, num_stages=config.num_stages, **dependent_launch()
        )
        return config.kwargs
    if os.environ.get("TRITON_INTERPRET") == "1":
        meta = dict(kwargs, **interpreter_config)
        kernel.fn[grid(meta)](*args, **meta)
        return interpreter_config
    kernel[grid](*args, **kwargs, **dependent_launch())
    return kernel.best_config.kwargs


if TRITON_AVAILABLE:

    @triton.jit
    def fp8_row_groups(x):
        # Rows of a float32 tile `x (R, G)` as w8a8 activations (`fp8_triton.quantize_rows`, the products' activation
        # side): per row the scale max|x| / 448 (at least 1e-12 / 448, so a zero row stays finite) and x / scale clamped
        # to +-448, in float32 for the caller's cast to float8 e4m3. Every kernel that quantizes activations for the
        # products calls this, so a fused producer writes the bits `quantize_rows` would.
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        return tl.clamp(x / scale[:, None], -448.0, 448.0), scale

    @triton.jit
    def _rms_norm_input(x_ptrs, residual_ptrs, mask, dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        # The norm's input: x, or x + residual as PyTorch adds two activations (in float32, the sum rounded to the
        # activation dtype). Masked-out elements are 0 (a zero row for rows past the tensor's).
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptrs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        return x

    @triton.jit
    def _rms_normed(x, rstd, weight_ptrs, mask, dtype: tl.constexpr, HAS_WEIGHT: tl.constexpr):
        # LLaDA's norm of x (float32) given its row's 1 / rms: rounded to `dtype`, then times the weight in float32,
        # rounded again. A masked-out weight is 0, so a zero row stays +0.
        normed = (x.to(tl.float32) * rstd).to(dtype)
        if HAS_WEIGHT:
            w = tl.load(weight_ptrs, mask=mask, other=0.0)
            normed = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
        return normed

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        out_ptr,
        sum_ptr,
        wide_ptr,
        q_ptr,
        scale_ptr,
        n_rows,
        n_cols,
        eps,
        stride_scale_row,
        stride_scale_group,
        HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        WIDE: tl.constexpr,
        FP8_GROUP: tl.constexpr,
        TILE_GROUPS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per row of a contiguous (rows, n_cols) tensor. With FP8_GROUP > 0 the normed rows are
        # written only quantized, as `fp8_triton.quantize_rows` would quantize them (groups of FP8_GROUP columns), and
        # the grid may hold rows past n_rows: zero rows, the padding cuBLASLt's product wants.
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        row_cols = tl.where(row < n_rows, n_cols, 0)  # a row past n_rows loads and stores nothing
        in_row = cols < row_cols
        offsets = row * n_cols + cols
        x = _rms_norm_input(x_ptr + offsets, residual_ptr + offsets, in_row, sum_ptr.dtype.element_ty, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(sum_ptr + offsets, x, mask=in_row)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        if FP8_GROUP > 0:
            # A second pass over the row, by tiles of (TILE_GROUPS, FP8_GROUP) read again (from cache) and normed
            # by the same helpers, so the same bits; a tile's rows are the quantization groups. (Reshaping the row
            # held in registers into groups instead made the kernel ~10x slower on an H100.)
            groups = tl.arange(0, TILE_GROUPS)
            for start in range(0, BLOCK, TILE_GROUPS * FP8_GROUP):
                tile_cols = start + groups[:, None] * FP8_GROUP + tl.arange(0, FP8_GROUP)[None, :]
                tile_in = tile_cols < row_cols
                tile_at = row * n_cols + tile_cols
                xt = _rms_norm_input(
                    x_ptr + tile_at, residual_ptr + tile_at, tile_in, sum_ptr.dtype.element_ty, HAS_RESIDUAL
                )
                yt = _rms_normed(xt, rstd, weight_ptr + tile_cols, tile_in, out_ptr.dtype.element_ty, HAS_WEIGHT)
                q, scale = fp8_row_groups(yt.to(tl.float32))
                tl.store(q_ptr + tile_at, q.to(q_ptr.dtype.element_ty), mask=tile_cols < n_cols)
                group_index = start // FP8_GROUP + groups
                scale_at = scale_ptr + row * stride_scale_row + group_index * stride_scale_group
                tl.store(scale_at, scale, mask=group_index * FP8_GROUP < n_cols)
        else:
            normed = _rms_normed(x, rstd, weight_ptr + cols, in_row, out_ptr.dtype.element_ty, HAS_WEIGHT)
            tl.store(out_ptr + offsets, normed, mask=in_row)
        if WIDE:
            # The output widened to float32 (exact), for a float32 consumer (LLaDA2's router): no cast kernel.
            tl.store(wide_ptr + offsets, normed.to(tl.float32), mask=in_row)

    @triton.jit
    def _rope_halves(x1, x2, cos1, cos2, sin1, sin2):
        # The two halves of x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), in float32, as
        # modeling_llada.apply_rotary_pos_emb (the float32 RoPE kernels below; Dream's rounds each product).
        return x1 * cos1 + (-x2) * sin1, x2 * cos2 + x1 * sin2

    @triton.jit
    def _e4m3_grid(v):
        # float32 v (|v| <= 448) rounded to the nearest float8 e4m3 value, ties to even, so that the cast to float8
        # that follows is exact: the same bits as PyTorch's cast on every backend (Triton's interpreter rounds a
        # value just below a power of two, e.g. 125.8, down to the power below: 64). Normal range: the float32
        # mantissa rounded to 3 bits in the integer domain (a carry moves into the exponent); below 2**-6, multiples
        # of 2**-9 (float32 addition at 2**14 rounds there), the sign kept for -0.
        bits = v.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        small = ((v + 24576.0) - 24576.0).to(tl.uint32, bitcast=True) | (bits & 0x80000000)
        return tl.where(tl.abs(v) < 0.015625, small.to(tl.float32, bitcast=True), normal)

    @triton.jit
    def _store_fp8_heads(dst_ptr, scale_ptr, x1, x2, head_valid, HALF: tl.constexpr):
        # Rows of x1/x2 (the two halves of a head's vector, float32) as `cache.quantize_kv` stores them: one scale
        # per row, max|x| * float32(1 / 448) (1 for a zero row), and x / scale rounded to e4m3.
        amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
        scale = amax * (1.0 / 448.0)  # as `quantize_kv`: times the float32 reciprocal
        scale = tl.where(scale > 0, scale, 1.0)
        offs = tl.arange(0, HALF)[None, :]
        # IEEE division, as PyTorch's tensor division: a product here would be fused with `_e4m3_grid`'s addition
        # into one FMA on the GPU (Triton contracts by default), changing the bits of values below 2**-6.
        y1 = _e4m3_grid(tl.math.div_rn(x1, scale[:, None]))
        y2 = _e4m3_grid(tl.math.div_rn(x2, scale[:, None]))
        tl.store(dst_ptr + offs, y1.to(dst_ptr.dtype.element_ty), mask=head_valid[:, None])
        tl.store(dst_ptr + HALF + offs, y2.to(dst_ptr.dtype.element_ty), mask=head_valid[:, None])
        tl.store(scale_ptr, scale, mask=head_valid)

    @triton.jit
    def _rotary_kernel(
        q_ptr,
        k_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        k_out_ptr,
        seq_len,
        n_q_heads,
        n_k_heads,
        stride_qb,
        stride_ql,
        stride_qh,
        stride_kb,
        stride_kl,
        stride_kh,
        stride_tb,
        stride_tl,
        HALF: tl.constexpr,
    ):
        # One program per (batch, position, head) over the q heads followed by the k heads. Inputs are (B, L, H, D)
        # with any strides (views of the projections); outputs are contiguous (B, L, H, D).
        wait_for_previous_kernel()
        pid = tl.program_id(0).to(tl.int64)
        n_heads = n_q_heads + n_k_heads
        head = pid % n_heads
        token = pid // n_heads  # b * seq_len + l
        b = token // seq_len
        pos = token % seq_len
        offs = tl.arange(0, HALF)
        table = b * stride_tb + pos * stride_tl
        cos1 = tl.load(cos_ptr + table + offs)
        cos2 = tl.load(cos_ptr + table + HALF + offs)
        sin1 = tl.load(sin_ptr + table + offs)
        sin2 = tl.load(sin_ptr + table + HALF + offs)
        if head < n_q_heads:
            src = q_ptr + b * stride_qb + pos * stride_ql + head * stride_qh
            dst = q_out_ptr + (token * n_q_heads + head) * (2 * HALF)
        else:
            kh = head - n_q_heads
            src = k_ptr + b * stride_kb + pos * stride_kl + kh * stride_kh
            dst = k_out_ptr + (token * n_k_heads + kh) * (2 * HALF)
        x1 = tl.load(src + offs).to(tl.float32)
        x2 = tl.load(src + HALF + offs).to(tl.float32)
        y1, y2 = _rope_halves(x1, x2, cos1, cos2, sin1, sin2)
        tl.store(dst + offs, y1.to(q_out_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, y2.to(q_out_ptr.dtype.element_ty))

    @triton.jit
    def _rotary_to_cache_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        cache_k_ptr,
        cache_v_ptr,
        k_scale_ptr,
        v_scale_ptr,
        k_out_ptr,
        position_ptr,
        seq_len,
        n_q_heads,
        n_k_heads,
        stride_qb,
        stride_ql,
        stride_qh,
        stride_kb,
        stride_kl,
        stride_kh,
        stride_vb,
        stride_vl,
        stride_vh,
        stride_cb,
        stride_ch,
        stride_cn,
        stride_sb,
        stride_sh,
        stride_tb,
        stride_tl,
        HALF: tl.constexpr,
        HEADS: tl.constexpr,
        GROUPS: tl.constexpr,
        QUANTIZE: tl.constexpr,
        KEYS_OUT: tl.constexpr,
    ):
        # As _rotary_kernel, but rotated keys and the values go straight into the K/V cache `(B, Hk, T, D)` at
        # column `position[l]`: one launch instead of RoPE plus two index copies. Program (token, g) rotates the
        # g-th of the token's chunks of HEADS query heads (and of key/value heads), every GROUPS-th chunk, so a
        # token's cos/sin row (float32, read in place: the table may broadcast over the batch) is loaded once per
        # program, not per head: few chunks per token when there are many tokens, more when there are few.
        wait_for_previous_kernel()
        token = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        b = token // seq_len
        pos = token % seq_len
        offs = tl.arange(0, HALF)
        heads = tl.arange(0, HEADS)
        table = b * stride_tb + pos * stride_tl
        cos1 = tl.load(cos_ptr + table + offs)[None, :]
        cos2 = tl.load(cos_ptr + table + HALF + offs)[None, :]
        sin1 = tl.load(sin_ptr + table + offs)[None, :]
        sin2 = tl.load(sin_ptr + table + HALF + offs)[None, :]
        for first in range(group * HEADS, n_q_heads, GROUPS * HEADS):
            head = first + heads
            inside = (head < n_q_heads)[:, None]
            src = q_ptr + b * stride_qb + pos * stride_ql + head[:, None] * stride_qh + offs[None, :]
            dst = q_out_ptr + (token * n_q_heads + head[:, None]) * (2 * HALF) + offs[None, :]
            x1 = tl.load(src, mask=inside).to(tl.float32)
            x2 = tl.load(src + HALF, mask=inside).to(tl.float32)
            y1, y2 = _rope_halves(x1, x2, cos1, cos2, sin1, sin2)
            tl.store(dst, y1.to(q_out_ptr.dtype.element_ty), mask=inside)
            tl.store(dst + HALF, y2.to(q_out_ptr.dtype.element_ty), mask=inside)
        column = tl.load(position_ptr + pos).to(tl.int64)
        for first in range(group * HEADS, n_k_heads, GROUPS * HEADS):
            head = first + heads
            inside = (head < n_k_heads)[:, None]
            vectors = b * stride_cb + head[:, None] * stride_ch + column * stride_cn
            cache = vectors + offs[None, :]
            v_src = v_ptr + b * stride_vb + pos * stride_vl + head[:, None] * stride_vh + offs[None, :]
            src = k_ptr + b * stride_kb + pos * stride_kl + head[:, None] * stride_kh + offs[None, :]
            x1 = tl.load(src, mask=inside).to(tl.float32)
            x2 = tl.load(src + HALF, mask=inside).to(tl.float32)
            y1, y2 = _rope_halves(x1, x2, cos1, cos2, sin1, sin2)
            if QUANTIZE:
                # An FP8 cache (`cache.FP8DiffusionKVCache`): the rotated keys rounded to the activations' dtype
                # first, as the module path hands them to `quantize_kv`.
                scales = b * stride_sb + head * stride_sh + column
                act = k_ptr.dtype.element_ty
                y1, y2 = y1.to(act).to(tl.float32), y2.to(act).to(tl.float32)
                if KEYS_OUT:  # the rotated keys too, contiguous (B, L, Hk, D): a refresh attends to them as computed
                    k_dst = k_out_ptr + (token * n_k_heads + head[:, None]) * (2 * HALF) + offs[None, :]
                    tl.store(k_dst, y1.to(act), mask=inside)
                    tl.store(k_dst + HALF, y2.to(act), mask=inside)
                _store_fp8_heads(cache_k_ptr + vectors, k_scale_ptr + scales, y1, y2, head < n_k_heads, HALF)
                v1 = tl.load(v_src, mask=inside).to(tl.float32)
                v2 = tl.load(v_src + HALF, mask=inside).to(tl.float32)
                _store_fp8_heads(cache_v_ptr + vectors, v_scale_ptr + scales, v1, v2, head < n_k_heads, HALF)
            else:
                tl.store(cache_v_ptr + cache, tl.load(v_src, mask=inside), mask=inside)
                tl.store(cache_v_ptr + cache + HALF, tl.load(v_src + HALF, mask=inside), mask=inside)
                tl.store(cache_k_ptr + cache, y1.to(cache_k_ptr.dtype.element_ty), mask=inside)
                tl.store(cache_k_ptr + cache + HALF, y2.to(cache_k_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rounded_rotary_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        k_dst_ptr,
        v_dst_ptr,
        position_ptr,
        seq_len,
        n_q_heads,
        n_k_heads,
        skip,
        stride_qb,
        stride_ql,
        stride_qh,
        stride_kb,
        stride_kl,
        stride_kh,
        stride_vb,
        stride_vl,
        stride_vh,
        stride_db,
        stride_dh,
        stride_dn,
        HALF: tl.constexpr,
        TO_CACHE: tl.constexpr,
    ):
        # RoPE with Dream's (Qwen2's) rounding points: the tables are in the activation dtype and PyTorch rounds
        # `x * cos`, `rotate_half(x) * sin` and their sum to it (products of two bf16 values are exact in float32,
        # so rounding each float32 product reproduces PyTorch's bf16 ops bit for bit). One program per (batch,
        # position, head) over the q heads followed by the k heads; q/k/v `(B, L, H, D)` with any strides.
        # Rotated keys go to `k_dst` `(B, Hk, T, D)` (strides `stride_d*`) at column `pos` or, with TO_CACHE, at
        # `position[pos]`, with the values beside them in `v_dst`; TO_CACHE skips the first `skip` positions'
        # keys/values (read-only queries whose cache entries stay). Rotated q is contiguous `(B, L, Hq, D)`.
        wait_for_previous_kernel()
        pid = tl.program_id(0).to(tl.int64)
        n_heads = n_q_heads + n_k_heads
        head = pid % n_heads
        token = pid // n_heads  # b * seq_len + l
        b = token // seq_len
        pos = token % seq_len
        offs = tl.arange(0, HALF)
        table = token * (2 * HALF)
        cos1 = tl.load(cos_ptr + table + offs).to(tl.float32)
        cos2 = tl.load(cos_ptr + table + HALF + offs).to(tl.float32)
        sin1 = tl.load(sin_ptr + table + offs).to(tl.float32)
        sin2 = tl.load(sin_ptr + table + HALF + offs).to(tl.float32)
        write = offs < HALF
        if head < n_q_heads:
            src = q_ptr + b * stride_qb + pos * stride_ql + head * stride_qh
            dst = q_out_ptr + (token * n_q_heads + head) * (2 * HALF)
        else:
            kh = head - n_q_heads
            src = k_ptr + b * stride_kb + pos * stride_kl + kh * stride_kh
            if TO_CACHE:
                column = tl.load(position_ptr + pos).to(tl.int64)
                write = (offs * 0 + pos) >= skip
                v_src = v_ptr + b * stride_vb + pos * stride_vl + kh * stride_vh
                v_dst = v_dst_ptr + b * stride_db + kh * stride_dh + column * stride_dn
                tl.store(v_dst + offs, tl.load(v_src + offs), mask=write)
                tl.store(v_dst + HALF + offs, tl.load(v_src + HALF + offs), mask=write)
            else:
                column = pos
            dst = k_dst_ptr + b * stride_db + kh * stride_dh + column * stride_dn
        dtype = q_out_ptr.dtype.element_ty
        x1 = tl.load(src + offs).to(tl.float32)
        x2 = tl.load(src + HALF + offs).to(tl.float32)
        # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), each product and the sum rounded.
        a1 = (x1 * cos1).to(dtype).to(tl.float32)
        b1 = ((-x2) * sin1).to(dtype).to(tl.float32)
        a2 = (x2 * cos2).to(dtype).to(tl.float32)
        b2 = (x1 * sin2).to(dtype).to(tl.float32)
        tl.store(dst + offs, (a1 + b1).to(dtype), mask=write)
        tl.store(dst + HALF + offs, (a2 + b2).to(dtype), mask=write)

    @triton.jit
    def gate_activation(gate, GELU: tl.constexpr):
        # A float32 gate's activation: PyTorch's gelu(approximate="tanh") (GELU) = 0.5 x (1 + tanh(sqrt(2 / pi) (x +
        # 0.044715 x^3))), the tanh as 1 - 2 / (exp(2 y) + 1) (exact at both tails in float32; no libdevice in the
        # interpreter); else silu(x) = x / (1 + exp(-x)).
        if GELU:
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
        else:
            return gate / (1.0 + tl.exp(-gate))

    @triton.jit
    def _gated_values(g, u, dtype: tl.constexpr, GELU: tl.constexpr = False):
        # act(g) * u as PyTorch computes it in `dtype`: float32 math, the activation's output rounded to `dtype`
        # before the product, the product rounded again.
        s = gate_activation(g.to(tl.float32), GELU).to(dtype).to(tl.float32)
        return (s * u.to(tl.float32)).to(dtype)

    @triton.jit
    def _gated_mul_kernel(gate_ptr, up_ptr, out_ptr, width, stride_row, GELU: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, BLOCK columns): gate/up are (rows, width) with a row stride (views of one fused projection);
        # out is contiguous. (A 2-D grid: no division of a flat index by the width per element.)
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        g = tl.load(gate_ptr + row * stride_row + cols, mask=inside, other=0.0)
        u = tl.load(up_ptr + row * stride_row + cols, mask=inside, other=0.0)
        tl.store(out_ptr + row * width + cols, _gated_values(g, u, out_ptr.dtype.element_ty, GELU), mask=inside)

    @triton.jit
    def _silu_mul_fp8_kernel(
        gate_ptr,
        up_ptr,
        q_ptr,
        scale_ptr,
        n_rows,
        n_padded,
        width,
        stride_row,
        stride_scale_row,
        stride_scale_group,
        ROWS: tl.constexpr,
        GROUP: tl.constexpr,
    ):
        # One program per (ROWS rows, GROUP columns): silu(gate) * up in the activations' dtype, then written only
        # quantized (`fp8_row_groups`); rows from n_rows to n_padded are zero rows (cuBLASLt's padding).
        wait_for_previous_kernel()
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
        in_cols = cols < width
        rows64 = rows.to(tl.int64)
        src = rows64[:, None] * stride_row + cols[None, :]
        loaded = (rows < n_rows)[:, None] & in_cols[None, :]
        g = tl.load(gate_ptr + src, mask=loaded, other=0.0)
        u = tl.load(up_ptr + src, mask=loaded, other=0.0)
        q, scale = fp8_row_groups(_gated_values(g, u, gate_ptr.dtype.element_ty).to(tl.float32))
        written = rows < n_padded
        dst = q_ptr + rows64[:, None] * width + cols[None, :]
        tl.store(dst, q.to(q_ptr.dtype.element_ty), mask=written[:, None] & in_cols[None, :])
        tl.store(scale_ptr + rows64 * stride_scale_row + tl.program_id(1) * stride_scale_group, scale, mask=written)

    @triton.jit
    def _running_best(candidate, best, best_index, start):
        # The running best (first index on ties, as torch.argmax) over the chunks so far, with the chunk
        # `candidate` (its first column `start`) added.
        chunk_best, chunk_index = tl.max(candidate, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = chunk_best > best
        return tl.where(better, chunk_best, best), tl.where(better, start + chunk_index.to(tl.int64), best_index)

    @triton.jit
    def _best_of(x, index, excluded, best, best_index, start):
        # `_running_best` of a chunk's logits with `excluded` (a boolean tile) taken out.
        return _running_best(tl.where(excluded, float("-inf"), x), best, best_index, start)

    @triton.jit
    def _online_logsumexp(x, running_max, running_sum):
        # (max, sum of exp(x - max)) over the chunks so far, with the chunk `x` added. While every logit so far is
        # -inf, shift by 0 (-inf - -inf would be nan); the same values otherwise.
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        return new_max, running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)

    @triton.jit
    def _merged_logsumexp(split_max, split_sum):
        # (max, sum of exp(x - max)) of a row from its splits' (max, sum) pairs.
        row_max = tl.max(split_max, axis=0)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        return row_max, tl.sum(split_sum * tl.exp(split_max - shift), axis=0)

    @triton.jit
    def _greedy_propose_kernel(
        logits_ptr,
        token_ptr,
        prob_ptr,
        best_ptr,
        index_ptr,
        max_ptr,
        sum_ptr,
        vocab,
        stride_row,
        excluded,
        split_width,
        BLOCK: tl.constexpr,
        EXCLUDE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        # Program (row, split): the split's `split_width` columns of one row in chunks of BLOCK: the best candidate
        # (first index on ties, as torch.argmax; `excluded` is never a candidate) and an online logsumexp over every
        # token (the candidate's probability is under the full softmax, as in the PyTorch path). One split: the
        # token and its probability; several (SPLIT): the split's best logit, its index, max and sum of exp(x - max)
        # for `_greedy_merge_kernel`.
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        base = logits_ptr + row * stride_row
        first = split * split_width
        end = tl.minimum(first + split_width, vocab)
        best = tl.full([1], float("-inf"), tl.float32)
        best_index = tl.zeros([1], tl.int64)
        running_max = tl.full([1], float("-inf"), tl.float32)
        running_sum = tl.zeros([1], tl.float32)
        for start in range(first, end, BLOCK):
            index = start + tl.arange(0, BLOCK)
            x = tl.load(base + index, mask=index < end, other=float("-inf")).to(tl.float32)
            candidate = tl.where(index == excluded, float("-inf"), x) if EXCLUDE else x
            best, best_index = _running_best(candidate, best, best_index, start)
            running_max, running_sum = _online_logsumexp(x, running_max, running_sum)
        if SPLIT:
            part = row * tl.num_programs(1) + split + tl.arange(0, 1)
            tl.store(best_ptr + part, best)
            tl.store(index_ptr + part, best_index)
            tl.store(max_ptr + part, running_max)
            tl.store(sum_ptr + part, running_sum)
        else:
            tl.store(token_ptr + row + tl.arange(0, 1), best_index)
            tl.store(prob_ptr + row + tl.arange(0, 1), tl.exp(best - running_max) / running_sum)

    @triton.jit
    def _greedy_merge_kernel(
        best_ptr,
        index_ptr,
        max_ptr,
        sum_ptr,
        token_ptr,
        prob_ptr,
        n_splits,
        BLOCK_S: tl.constexpr,
    ):
        # One program per row: the best of its splits' candidates (the first split on ties: its columns come first)
        # and the probability under the logsumexp merged from the splits' (max, sum).
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        splits = tl.arange(0, BLOCK_S)
        valid = splits < n_splits
        part = row * n_splits + splits
        best = tl.load(best_ptr + part, mask=valid, other=float("-inf"))
        split_max = tl.load(max_ptr + part, mask=valid, other=float("-inf"))
        split_sum = tl.load(sum_ptr + part, mask=valid, other=0.0)
        top, which = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
        index = tl.load(index_ptr + row * n_splits + which)
        row_max, total = _merged_logsumexp(split_max, split_sum)
        tl.store(token_ptr + row, index)
        tl.store(prob_ptr + row, tl.exp(top - row_max) / total)

    @triton.jit
    def _edit_candidates_kernel(
        logits_ptr,
        best_ptr,
        index_ptr,
        max_ptr,
        sum_ptr,
        vocab,
        stride_row,
        mask_id,
        delete_id,
        split_id,
        split_width,
        BLOCK: tl.constexpr,
    ):
        # Program (row, split): over the split's columns, the best logit and its index of three nested candidate
        # sets (every token; every token but MASK; every token but MASK, DELETE and SPLIT) and the split's max and
        # sum of exp(x - max) over every token, for `_edit_candidates_merge_kernel`.
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        base = logits_ptr + row * stride_row
        first = split * split_width
        end = tl.minimum(first + split_width, vocab)
        best0 = tl.full([1], float("-inf"), tl.float32)
        best1 = tl.full([1], float("-inf"), tl.float32)
        best2 = tl.full([1], float("-inf"), tl.float32)
        index0 = tl.zeros([1], tl.int64)
        index1 = tl.zeros([1], tl.int64)
        index2 = tl.zeros([1], tl.int64)
        running_max = tl.full([1], float("-inf"), tl.float32)
        running_sum = tl.zeros([1], tl.float32)
        for start in range(first, end, BLOCK):
            index = start + tl.arange(0, BLOCK)
            x = tl.load(base + index, mask=index < end, other=float("-inf")).to(tl.float32)
            is_mask = index == mask_id
            best0, index0 = _best_of(x, index, index < 0, best0, index0, start)
            best1, index1 = _best_of(x, index, is_mask, best1, index1, start)
            edit_token = is_mask | (index == delete_id) | (index == split_id)
            best2, index2 = _best_of(x, index, edit_token, best2, index2, start)
            running_max, running_sum = _online_logsumexp(x, running_max, running_sum)
        part = (row * tl.num_programs(1) + split) * 3 + tl.arange(0, 1)
        tl.store(best_ptr + part, best0)
        tl.store(best_ptr + part + 1, best1)
        tl.store(best_ptr + part + 2, best2)
        tl.store(index_ptr + part, index0)
        tl.store(index_ptr + part + 1, index1)
        tl.store(index_ptr + part + 2, index2)
        single = row * tl.num_programs(1) + split + tl.arange(0, 1)
        tl.store(max_ptr + single, running_max)
        tl.store(sum_ptr + single, running_sum)

    @triton.jit
    def _edit_candidates_merge_kernel(
        best_ptr, index_ptr, max_ptr, sum_ptr, token_ptr, prob_ptr, n_splits, BLOCK_S: tl.constexpr
    ):
        # One program per row: each candidate set's best over the splits (the first split on ties: its columns come
        # first) and its probability under the softmax merged from the splits' (max, sum).
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        splits = tl.arange(0, BLOCK_S)
        valid = splits < n_splits
        split_max = tl.load(max_ptr + row * n_splits + splits, mask=valid, other=float("-inf"))
        split_sum = tl.load(sum_ptr + row * n_splits + splits, mask=valid, other=0.0)
        row_max, total = _merged_logsumexp(split_max, split_sum)
        for k in tl.static_range(3):
            part = (row * n_splits + splits) * 3 + k
            best = tl.load(best_ptr + part, mask=valid, other=float("-inf"))
            top, which = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(token_ptr + row * 3 + k, tl.load(index_ptr + (row * n_splits + which) * 3 + k))
            tl.store(prob_ptr + row * 3 + k, tl.exp(top - row_max) / total)


# The greedy proposal's chunk of the vocabulary (columns a program reads at once), and the programs it aims for:
# with fewer rows than that the vocabulary is split among programs of a row, whose results a second kernel merges
# (a batch-1 block step's 32 rows with one program each left most multiprocessors idle: on an H100 it was 0.2-0.3
# ms slower than PyTorch's five passes at LLaDA-8B's 126k vocabulary).
GREEDY_PROPOSE_BLOCK = 4096
GREEDY_PROPOSE_PROGRAMS = 1024


def fp8_group_tiling(group: int, cols: int) -> tuple[int, int, int]:
    """How the kernels that quantize activations (`fp8_triton.quantize_rows`, `silu_mul_fp8`) tile groups of `group` of
    `cols` columns: `(columns a program loads per row, rows per program, warps)`. A group of at least `cols` columns
    is the whole row (one scale per row, for row-scaled products): its columns padded to a power of two, masked
    (zeros leave the row's max unchanged), one row per program past 1,024 columns so that the tile stays small."""
    loaded = group if group < cols else triton.next_power_of_2(cols)
    rows = 16 if loaded <= 1024 else 1
    return loaded, rows, 8 if loaded >= 8192 else 4


def greedy_propose_splits(rows: int, vocab: int) -> int:
    """Programs per row (`greedy_propose`): enough for `GREEDY_PROPOSE_PROGRAMS` in all, at most one per chunk of
    `GREEDY_PROPOSE_BLOCK` columns."""
    return max(1, min(triton.cdiv(vocab, GREEDY_PROPOSE_BLOCK), triton.cdiv(GREEDY_PROPOSE_PROGRAMS, max(rows, 1))))


@on_tensor_device
def greedy_propose(
    logits: torch.Tensor, excluded_token_id: int | None, n_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy candidates and their softmax probabilities: logits `(..., vocab)` (any float dtype, read once) ->
    token `(...)` long (argmax, never `excluded_token_id`) and probability `(...)` float32. Replaces PyTorch's
    clone + argmax + gather + logsumexp + exp, each a pass over `rows x vocab` floats (at batch 32 and a 157k
    vocabulary, 644 MB per pass). `n_splits`: programs per row, each over its share of the vocabulary (default
    `greedy_propose_splits`; the share is rounded up to whole chunks, so fewer may run)."""
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_rows = rows.shape[0]
    tokens = torch.empty(n_rows, dtype=torch.long, device=logits.device)
    probability = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return tokens.view(logits.shape[:-1]), probability.view(logits.shape[:-1])
    chunks = triton.cdiv(vocab, GREEDY_PROPOSE_BLOCK)
    wanted = greedy_propose_splits(n_rows, vocab) if n_splits is None else n_splits
    split_width = triton.cdiv(chunks, max(1, min(wanted, chunks))) * GREEDY_PROPOSE_BLOCK
    splits = triton.cdiv(vocab, split_width)
    if splits > 1:
        best, split_max, split_sum = torch.empty(3, n_rows, splits, dtype=torch.float32, device=logits.device)
        index = torch.empty(n_rows, splits, dtype=torch.long, device=logits.device)
    else:
        best = index = split_max = split_sum = probability  # never written
    _greedy_propose_kernel[(n_rows, splits)](
        rows,
        tokens,
        probability,
        best,
        index,
        split_max,
        split_sum,
        vocab,
        rows.stride(0),
        -1 if excluded_token_id is None else excluded_token_id,
        split_width,
        BLOCK=GREEDY_PROPOSE_BLOCK,
        EXCLUDE=excluded_token_id is not None,
        SPLIT=splits > 1,
        num_warps=8,
        **dependent_launch(),
    )
    if splits > 1:
        _greedy_merge_kernel[(n_rows,)](
            best,
            index,
            split_max,
            split_sum,
            tokens,
            probability,
            splits,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=1,
            **dependent_launch(),
        )
    return tokens.view(logits.shape[:-1]), probability.view(logits.shape[:-1])


@on_tensor_device
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    float_copy: bool = False,
    fp8_out: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """`norm(x + residual)` over the last dim. x, residual `(..., d)`; weight `(d,)` or None.

    Returns `(normed, x + residual)` (the sum is `x` itself when `residual` is None), and with `float_copy` a third
    tensor, `normed.float()` written by the same kernel. With `fp8_out = (values, scales, group)` (the buffers of
    `fp8_triton.activation_buffers`: float8 `(padded rows, d)`, float32 `(padded rows, d / group)`) the normed rows are
    written there only, quantized as `fp8_triton.quantize_rows` quantizes them, and `normed` is None."""
    d = x.shape[-1]
    x2 = x.contiguous().view(-1, d)
    rows = x2.shape[0]
    total = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.contiguous().view(-1, d) if residual is not None else x2
    if fp8_out is not None:
        values, scales, group = fp8_out
        out, grid_rows = None, values.shape[0]
    else:
        values, scales, group = x2, x2, 0
        out, grid_rows = torch.empty_like(x2), rows
    wide = torch.empty(x2.shape, dtype=torch.float32, device=x2.device) if float_copy else x2
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(grid_rows,)](
        x2,
        r2,
        weight if weight is not None else x2,
        out if out is not None else x2,
        total,
        wide,
        values,
        scales,
        rows,
        d,
        eps,
        scales.stride(0),
        scales.stride(1),
        HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None,
        WIDE=float_copy,
        FP8_GROUP=fp8_group_tiling(group, d)[0] if group else 0,  # a whole-row group: the row's block, masked
        TILE_GROUPS=max(1, min(8, block // group)) if group else 1,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
        **dependent_launch(),
    )
    normed = out.view(x.shape) if out is not None else None
    if float_copy:
        return normed, total.view(x.shape), wide.view(x.shape)
    return normed, total.view(x.shape)


@on_tensor_device
def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in float32. q `(B, L, Hq, D)`, k `(B, L, Hk, D)` (any strides, last dim contiguous), cos/sin
    `(B, L, D)` float32. Returns contiguous `(B, L, Hq, D)` and `(B, L, Hk, D)` in the input dtype."""
    batch, seq_len, n_q, dim = q.shape
    n_k = k.shape[2]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    cos, sin = _rope_table(cos, sin, batch, seq_len, dim)
    q_out = torch.empty(batch, seq_len, n_q, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(batch, seq_len, n_k, dim, dtype=k.dtype, device=k.device)
    grid = (batch * seq_len * (n_q + n_k),)
    _rotary_kernel[grid](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        seq_len,
        n_q,
        n_k,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        cos.stride(0),
        cos.stride(1),
        HALF=dim // 2,
        num_warps=1 if dim <= 128 else 2,
        **dependent_launch(),
    )
    return q_out, k_out


def _rope_table(cos: torch.Tensor, sin: torch.Tensor, batch: int, seq_len: int, dim: int):
    """cos/sin as float32 `(batch, seq_len, dim)` views the RoPE kernels read in place by their batch and position
    strides (a table shared by the batch has batch stride 0): copied only where the two differ in layout or the
    last dim is strided."""
    cos = cos.to(torch.float32).expand(batch, seq_len, dim)
    sin = sin.to(torch.float32).expand(batch, seq_len, dim)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


@on_tensor_device
def rotary_to_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_keys: torch.Tensor,
    cache_values: torch.Tensor,
    cache_position: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    keys_out: bool = False,
):
    """RoPE on q and k, with k (rotated) and v written into the cache. q `(B, L, Hq, D)`, k/v `(B, L, Hk, D)` (any
    strides, last dim contiguous), cache_keys/values `(B, Hk, T, D)` contiguous in the last dim with equal strides,
    cache_position `(L,)` the columns to write. Returns the rotated q, contiguous `(B, L, Hq, D)`.

    An FP8 cache (`cache.FP8DiffusionKVCache`): float8 e4m3 cache_keys/values and `key_scales`/`value_scales`
    `(B, Hk, T)` float32 with equal strides, last dim contiguous; each written vector is stored as
    `cache.quantize_kv` stores it (the rotated key rounded to k's dtype first), the same bits. With `keys_out`
    (FP8 cache only) also returns the rotated keys, contiguous `(B, L, Hk, D)`: `(q, keys)`."""
    batch, seq_len, n_q, dim = q.shape
    n_k = k.shape[2]
    quantize = key_scales is not None
    if quantize and (
        value_scales is None
        or cache_keys.dtype != torch.float8_e4m3fn
        or key_scales.stride() != value_scales.stride()
        or key_scales.stride(-1) != 1
    ):
        raise ValueError(
            "rotary_to_cache into an FP8 cache needs float8_e4m3fn cache_keys/values and key_scales/value_scales "
            "with equal strides (last dim contiguous)."
        )
    if keys_out and not quantize:
        raise ValueError("rotary_to_cache: `keys_out` is for an FP8 cache (key_scales/value_scales given).")
    k_out = torch.empty(batch, seq_len, n_k, dim, dtype=k.dtype, device=k.device) if keys_out else None
    cos, sin = _rope_table(cos, sin, batch, seq_len, dim)
    q_out = torch.empty(batch, seq_len, n_q, dim, dtype=q.dtype, device=q.device)
    # Chunks of 16 heads for a block-start forward's hundreds of tokens (H100, LLaDA-8B, 768 positions: 0.38 ms per
    # forward against 1.00 ms with a program per head); a program per head for a block step's 32 x batch (chunks of
    # 4 heads, or all heads, took 0.128 ms per step against 0.088 ms).
    heads = min(triton.next_power_of_2(max(n_q, n_k)), 16) if batch * seq_len >= 512 else 1
    groups = triton.cdiv(max(n_q, n_k), heads)
    _rotary_to_cache_kernel[(batch * seq_len, groups)](
        q,
        k,
        v,
        cos,
        sin,
        q_out,
        cache_keys,
        cache_values,
        key_scales if quantize else q_out,  # never read without QUANTIZE
        value_scales if quantize else q_out,
        k_out if keys_out else q_out,  # never written without KEYS_OUT
        cache_position,
        seq_len,
        n_q,
        n_k,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        cache_keys.stride(0),
        cache_keys.stride(1),
        cache_keys.stride(2),
        key_scales.stride(0) if quantize else 0,
        key_scales.stride(1) if quantize else 0,
        cos.stride(0),
        cos.stride(1),
        HALF=dim // 2,
        HEADS=heads,
        GROUPS=groups,
        QUANTIZE=quantize,
        KEYS_OUT=keys_out,
        num_warps=4 if heads > 1 else 1,
        **dependent_launch(),
    )
    return (q_out, k_out) if keys_out else q_out


@on_tensor_device
def rounded_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_keys: torch.Tensor | None = None,
    cache_values: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    skip: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE rounded as PyTorch rounds it in the activation dtype (Dream / Qwen2: `q * cos + rotate_half(q) * sin`
    with tables in the activation dtype, each product and the sum rounded), equal to that PyTorch code bit for bit.

    q `(B, L, Hq, D)`, k/v `(B, L, Hk, D)` (any strides, last dim contiguous), cos/sin `(B or 1, L, D)`. Without a
    cache returns the rotated q, contiguous `(B, L, Hq, D)`, and the rotated k, contiguous `(B, Hk, L, D)` (v is
    not read). With `cache_keys`/`cache_values` `(B, Hk, T, D)` (last dim contiguous, equal strides) and
    `cache_position` `(L,)`, the rotated k and v of positions `skip..L-1` are written into the cache at those
    columns (one launch instead of RoPE plus two index copies); returns the rotated q and None."""
    batch, seq_len, n_q, dim = q.shape
    n_k = k.shape[2]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cos = cos.to(q.dtype).expand(batch, seq_len, dim).contiguous()
    sin = sin.to(q.dtype).expand(batch, seq_len, dim).contiguous()
    q_out = torch.empty(batch, seq_len, n_q, dim, dtype=q.dtype, device=q.device)
    to_cache = cache_keys is not None
    if to_cache:
        k_out, k_dst, v_dst, position = None, cache_keys, cache_values, cache_position
    else:
        k_out = torch.empty(batch, n_k, seq_len, dim, dtype=k.dtype, device=k.device)
        k_dst, v_dst, position = k_out, k_out, q_out
    _rounded_rotary_kernel[(batch * seq_len * (n_q + n_k),)](
        q,
        k,
        v,
        cos,
        sin,
        q_out,
        k_dst,
        v_dst,
        position,
        seq_len,
        n_q,
        n_k,
        skip,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        k_dst.stride(0),
        k_dst.stride(1),
        k_dst.stride(2),
        HALF=dim // 2,
        TO_CACHE=to_cache,
        num_warps=1 if dim <= 128 else 2,
        # No fused multiply-add: PyTorch rounds each product (this matters for float32 activations).
        enable_fp_fusion=False,
        **dependent_launch(),
    )
    return q_out, k_out


# The gate activations the gated kernels compute (`gated_mul`, `grouped_gemm.grouped_matmul(activation=...)`):
# SiLU and GELU's tanh approximation (transformers' `gelu_pytorch_tanh`).
GATE_ACTIVATIONS = ("silu", "gelu_tanh")


@on_tensor_device
def gated_mul(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """`act(gate) * up`, elementwise, in one launch (PyTorch's two ops' rounding: the activation's output rounded to
    gate's dtype, then the product), `activation` one of `GATE_ACTIVATIONS`. gate/up `(..., I)` of equal strides
    whose rows may be strided (e.g. the two halves of one fused gate/up projection); returns a contiguous `(..., I)`
    tensor."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {GATE_ACTIVATIONS}, got {activation!r}.")
    width = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, width), up.reshape(-1, width)
    if gate2.stride(-1) != 1 or up2.stride(-1) != 1 or gate2.stride(0) != up2.stride(0):
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))  # 8 columns per lane (16 bytes in half precision)
    _gated_mul_kernel[(gate2.shape[0], triton.cdiv(width, block))](
        gate2, up2, out, width, gate2.stride(0), GELU=activation == "gelu_tanh", BLOCK=block,
        num_warps=max(1, block // 256),
        **dependent_launch(),
    )  # fmt: skip
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`: `gated_mul(gate, up, "silu")`."""
    return gated_mul(gate, up, "silu")


@on_tensor_device
def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor, fp8_out: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    """`silu(gate) * up` (as `silu_mul` computes it), written only quantized into `fp8_out = (values, scales,
    group)` (`fp8_triton.activation_buffers`: float8 `(padded rows, I)`, float32 `(padded rows, I / group)`), as
    `fp8_triton.quantize_rows` would quantize `silu_mul`'s output. gate/up `(..., I)` as for `silu_mul`."""
    width = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, width), up.reshape(-1, width)
    if gate2.stride(-1) != 1 or up2.stride(-1) != 1 or gate2.stride(0) != up2.stride(0):
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    values, scales, group = fp8_out
    loaded, tile_rows, warps = fp8_group_tiling(group, width)
    _silu_mul_fp8_kernel[(triton.cdiv(values.shape[0], tile_rows), triton.cdiv(width, group))](
        gate2,
        up2,
        values,
        scales,
        gate2.shape[0],
        values.shape[0],
        width,
        gate2.stride(0),
        scales.stride(0),
        scales.stride(1),
        ROWS=tile_rows,
        GROUP=loaded,
        num_warps=warps,
        **dependent_launch(),
    )


@on_tensor_device
def edit_candidates(
    logits: torch.Tensor, mask_token_id: int, delete_token_id: int, split_token_id: int, n_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy tokens of LLaDA2.2's Levenshtein editing in one read of the logits `(..., vocab)` (any float
    dtype): tokens `(..., 3)` long and their probabilities under the full softmax `(..., 3)` float32, for the
    argmax over every token, over every token but MASK, and over every token but MASK, DELETE and SPLIT (first
    index on ties, as torch.argmax). Replaces the float32 copy, softmax, clone and three argmax passes over the
    block's `rows x vocab` logits. `n_splits` as in `greedy_propose`."""
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_rows = rows.shape[0]
    tokens = torch.empty(n_rows, 3, dtype=torch.long, device=logits.device)
    probability = torch.empty(n_rows, 3, dtype=torch.float32, device=logits.device)
    shape = (*logits.shape[:-1], 3)
    if n_rows == 0:
        return tokens.view(shape), probability.view(shape)
    chunks = triton.cdiv(vocab, GREEDY_PROPOSE_BLOCK)
    wanted = greedy_propose_splits(n_rows, vocab) if n_splits is None else n_splits
    split_width = triton.cdiv(chunks, max(1, min(wanted, chunks))) * GREEDY_PROPOSE_BLOCK
    splits = triton.cdiv(vocab, split_width)
    best = torch.empty(n_rows, splits, 3, dtype=torch.float32, device=logits.device)
    index = torch.empty(n_rows, splits, 3, dtype=torch.long, device=logits.device)
    split_max, split_sum = torch.empty(2, n_rows, splits, dtype=torch.float32, device=logits.device)
    _edit_candidates_kernel[(n_rows, splits)](
        rows,
        best,
        index,
        split_max,
        split_sum,
        vocab,
        rows.stride(0),
        mask_token_id,
        delete_token_id,
        split_token_id,
        split_width,
        BLOCK=GREEDY_PROPOSE_BLOCK,
        num_warps=8,
        **dependent_launch(),
    )
    _edit_candidates_merge_kernel[(n_rows,)](
        best,
        index,
        split_max,
        split_sum,
        tokens,
        probability,
        splits,
        BLOCK_S=triton.next_power_of_2(splits),
        num_warps=1,
        **dependent_launch(),
    )
    return tokens.view(shape), probability.view(shape)


# How a step counts the positions it commits (`commit_most_confident`'s `rule`; an unmasking policy's
# `fused_count`): the schedule's count; every masked position with confidence >= threshold, at least one
# (Fast-dLLM's threshold); the positions with confidence > threshold where they are at least the schedule's count,
# else the count (LLaDA2.0's).
COMMIT_SCHEDULED, COMMIT_AT_LEAST_THRESHOLD, COMMIT_ABOVE_THRESHOLD_OR_SCHEDULED = 0, 1, 2
# Block positions up to which `commit_most_confident` decides a step: it compares every pair of a row's positions in
# registers (compiled for sm_90: 32 positions on one warp 96 registers a thread, 64 on eight warps 126, no spills;
# 128 spilled even on sixteen warps); longer blocks keep PyTorch's sort.
COMMIT_MAX_POSITIONS = 64


def commit_applies(block_length: int) -> bool:
    """Whether `commit_most_confident` takes blocks of `block_length` positions."""
    return 0 < block_length <= COMMIT_MAX_POSITIONS


if TRITON_AVAILABLE:

    @triton.jit
    def _commit_most_confident_kernel(
        block_ptr,
        x0_ptr,
        probability_ptr,
        candidates_ptr,
        scheduled_ptr,
        active_ptr,
        new_ptr,
        draft_ptr,
        edited_ptr,
        length,
        n_candidates,
        mask_id,
        threshold,
        RULE: tl.constexpr,
        HAS_CANDIDATES: tl.constexpr,
        HAS_ACTIVE: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_U: tl.constexpr,
    ):
        # One program per row: the proposal scattered to the block's positions (from the candidate positions, or
        # at every position), each masked position's rank among the row's confidences (descending; ties to the
        # lower position; NaN first, as a stable descending sort), the count by RULE, the commit of the best
        # ranked, the row frozen unless active, the draft; edited is all False (no committed token changes).
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_L)
        in_row = i < length
        block = tl.load(block_ptr + row * length + i, mask=in_row, other=0)
        if HAS_CANDIDATES:
            u = tl.arange(0, BLOCK_U)
            in_u = u < n_candidates
            where_u = tl.load(candidates_ptr + row * n_candidates + u, mask=in_u, other=-1)
            x0_u = tl.load(x0_ptr + row * n_candidates + u, mask=in_u, other=0)
            p_u = tl.load(probability_ptr + row * n_candidates + u, mask=in_u, other=0.0)
            match = where_u[None, :] == i[:, None]  # (L, U): distinct candidate positions, at most one per row
            found = tl.max(match.to(tl.int32), axis=1) > 0
            x0 = tl.where(found, tl.sum(tl.where(match, x0_u[None, :], 0), axis=1), block)
            probability = tl.sum(tl.where(match, p_u[None, :], 0.0), axis=1)  # 0 at positions not proposed
        else:
            x0 = tl.load(x0_ptr + row * length + i, mask=in_row, other=0)
            probability = tl.load(probability_ptr + row * length + i, mask=in_row, other=0.0)
        masked = (block == mask_id) & in_row
        confidence = tl.where(masked, probability, float("-inf"))
        mine = confidence[:, None]
        other = confidence[None, :]
        nan_mine = mine != mine
        nan_other = other != other
        ahead = (other > mine) | (nan_other & ~nan_mine)
        tied = (other == mine) | (nan_other & nan_mine)
        before = (ahead | (tied & (i[None, :] < i[:, None]))) & in_row[None, :]
        rank = tl.sum(before.to(tl.int32), axis=1)
        scheduled = tl.load(scheduled_ptr + row)
        if RULE == 0:
            count = scheduled
        elif RULE == 1:
            count = tl.maximum(tl.sum(((confidence >= threshold) & in_row).to(tl.int64), axis=0), 1)
        else:
            above = tl.sum(((confidence > threshold) & in_row).to(tl.int64), axis=0)
            count = tl.where(above >= scheduled, above, scheduled)
        new = tl.where(masked & (rank < count), x0, block)
        if HAS_ACTIVE:
            new = tl.where(tl.load(active_ptr + row) != 0, new, block)
        tl.store(new_ptr + row * length + i, new, mask=in_row)
        tl.store(draft_ptr + row * length + i, tl.where(new == mask_id, x0, new), mask=in_row)
        tl.store(edited_ptr + row + tl.arange(0, 1), tl.zeros([1], dtype=tl.int1))


@on_tensor_device
def commit_most_confident(
    block: torch.Tensor,
    x0: torch.Tensor,
    probability: torch.Tensor,
    candidates: torch.Tensor | None,
    scheduled: torch.Tensor,
    active: torch.Tensor | None,
    mask_token_id: int,
    rule: int,
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mask-based denoising step's decision from its proposal in one launch (`decoding.denoise_step` with the
    base `UnmaskingPolicy.commit`: PyTorch's scatter of the proposal, stable sort, rank scatter, count, commit,
    freeze and draft took ~15 small kernels). block `(rows, L)` long; x0 `(rows, U)` long and probability `(rows, U)`
    float32 at the positions `candidates` `(rows, U)` long (distinct), or `(rows, L)` with candidates None;
    scheduled `(rows,)` long; active `(rows,)` bool or None. `rule` one of `COMMIT_SCHEDULED`,
    `COMMIT_AT_LEAST_THRESHOLD`, `COMMIT_ABOVE_THRESHOLD_OR_SCHEDULED` with `threshold`. Returns the new block
    `(rows, L)`, the draft `(rows, L)` (still-masked positions show their candidate) and edited `(rows,)` bool
    (all False): the same as the PyTorch path, position for position."""
    if rule not in (COMMIT_SCHEDULED, COMMIT_AT_LEAST_THRESHOLD, COMMIT_ABOVE_THRESHOLD_OR_SCHEDULED):
        raise ValueError(f"commit_most_confident: rule must be 0, 1 or 2 (the COMMIT_* constants), got {rule!r}.")
    rows, length = block.shape
    if not commit_applies(length):
        raise ValueError(
            f"commit_most_confident takes blocks of 1 to {COMMIT_MAX_POSITIONS} positions, got {length} "
            f"(`commit_applies` tells which)."
        )
    proposed = length if candidates is None else candidates.shape[1]
    if x0.shape != (rows, proposed) or probability.shape != (rows, proposed) or scheduled.shape != (rows,):
        raise ValueError(
            f"commit_most_confident: x0 and probability must be ({rows}, {proposed}) and scheduled ({rows},), got "
            f"{tuple(x0.shape)}, {tuple(probability.shape)} and {tuple(scheduled.shape)}."
        )
    block, x0, probability = block.contiguous(), x0.contiguous(), probability.contiguous()
    new, draft = torch.empty_like(block), torch.empty_like(block)
    edited = torch.empty(rows, dtype=torch.bool, device=block.device)
    if rows == 0:
        return new, draft, edited
    block_l = triton.next_power_of_2(length)
    _commit_most_confident_kernel[(rows,)](
        block,
        x0,
        probability,
        candidates.contiguous() if candidates is not None else block,
        scheduled.contiguous(),
        active.contiguous() if active is not None else block,
        new,
        draft,
        edited,
        length,
        proposed,
        mask_token_id,
        float(threshold),
        RULE=rule,
        HAS_CANDIDATES=candidates is not None,
        HAS_ACTIVE=active is not None,
        BLOCK_L=block_l,
        BLOCK_U=triton.next_power_of_2(proposed),
        num_warps=1 if block_l <= 32 else 8,  # (`COMMIT_MAX_POSITIONS`)
        **dependent_launch(),
    )
    return new, draft, edited
