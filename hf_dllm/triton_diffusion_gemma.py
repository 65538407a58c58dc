"""DiffusionGemma's sampler as two Triton kernels over the vocabulary, in chunks: the fast path of
`EntropyBoundSampler.denoise` on CUDA (`decoding_diffusion_gemma.py` keeps the PyTorch code, the CPU path and the
reference).

Per position (a row of the LM head's raw output `x` `(rows, vocab)`, in the model's dtype): z = cap * tanh(x / cap) /
T (the soft cap, arXiv:2408.00118, then the step's temperature); from z the entropy of softmax(z), its argmax, a
sample of softmax(z) by inversion of its cumulative distribution (one uniform u per row: the first word of Philox4x32
at (seed, row), Salmon et al. 2011, 31 bits; one `(1,)` int64 seed per step read from the device, so a CUDA-graph
replay draws anew), and softmax(z) in the model's dtype where the next step's self-conditioning needs it
(`softmax(z).to(dtype) @ E`, the rounding point of the PyTorch path). Nothing of shape `(rows, vocab)` in float32 is
written (the PyTorch path writes several float32 passes over rows x 262,144 values: ~270 MB each for a batch-1
canvas of 256 positions).

- `_partials_kernel`, grid (rows, splits): each program reduces a chunk of a row (running max m, a scalar updated
  per block of `BLOCK_V` columns, the sums rescaled only when a block raises it; sum S of e^(z - m); sum of e^(z - m)
  (z - m), for the entropy without cancellation; the first argmax). No random numbers.
- `_finish_kernel`, grid (rows, splits): each program combines its row's partials (entropy H = log S - B / S,
  argmax with the lowest index on ties, the log-sum-exp and the row's max z; the first chunk's program stores
  them) and writes its chunk of softmax(z) = e^(z - lse) (unless the row's batch row is frozen: its
  self-conditioning stays). The draw: chunk k holds the mass M_k = e^(m_k - max z) S_k of e^(z - max z); with t = u
  sum M, the chunk k with M_0 + ... + M_(k-1) <= t < M_0 + ... + M_k claims it (every program of the row computes
  these sums from the same loads in float64, so exactly one claims; rows whose t is no number: the last chunk with
  mass), and only its program scans: the first column where the chunk's running sum of e^(z - max z) (float32
  within a block of `BLOCK_V` columns, float64 across blocks) exceeds t less the mass before the chunk is the
  sample, written by that program. Where rounding leaves the chunk's recomputed sum below that, the chunk's last
  column of nonzero mass is taken: never a column of probability 0 (e^(z - max z) below 2^-126) nor one past the
  vocabulary. The scan stops at the sample. Per column nothing is random: the Gumbel-max draw this replaces ran a
  Philox and two logarithms for every column (67M a batch-1 step of 256 x 262,144), which bounded the kernel on
  flat rows.

Both vocabulary passes run single-warp programs over blocks of `BLOCK_V` columns (8 per lane: a block's max is a
warp reduction, no barrier), the next block's load issued before a block's arithmetic.

The draw is not `torch.multinomial`'s (it samples softmax(z) up to float32 rounding, from other uniforms): seeded
parity with transformers is the CPU path's. Exported as Hub remote code: Triton is imported inside `try:`
(`triton_ops.py`).
"""

from __future__ import annotations

import torch

from .triton_ops import TRITON_AVAILABLE, dependent_launch, on_tensor_device, tl, triton  # None: CPU-only

if TRITON_AVAILABLE:
    from .triton_moe import weighted_rows_sum
    from .triton_ops import wait_for_previous_kernel

# Columns a program reads per iteration (one warp's: 8 per lane; a block's max is then a warp reduction, no
# barrier), programs aimed for (single-warp programs: at most 32 resident per multiprocessor) and chunks per row at
# most.
BLOCK_V = 256
TARGET_PROGRAMS = 8192
MAX_SPLITS = 64
# Triton's interpreter (CPU tensors: the tests) runs programs one by one and pays per operation, not per column:
# there one chunk per row, in blocks of this many columns.
INTERPRETER_BLOCK_V = 1024

if TRITON_AVAILABLE:

    @triton.jit
    def _processed(x, cap, inverse_cap, temperature, HAS_CAP: tl.constexpr):
        # z from raw values x: the soft cap in float32 (tanh as 1 - 2 / (e^(2y) + 1): exact at both tails, and the
        # interpreter has no libdevice), then the temperature's quotient.
        x = x.to(tl.float32)
        if HAS_CAP:
            y = x * inverse_cap
            x = cap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        return x / temperature

    @triton.jit
    def _uniform(seed, offset):
        # A uniform in [0, 1) in float64 from the first word of Philox4x32-10 at (seed, offset) (`tl.randint`):
        # its 31 bits of magnitude (a negative word w as ~w, as `tl.rand` maps it) times 2^-31, exactly (tl.rand's
        # float32 product rounds to 24 bits and can round up to 1).
        word = tl.randint(seed, offset).to(tl.int32, bitcast=True)
        return tl.where(word < 0, ~word, word).to(tl.float64) * 4.656612873077393e-10

    @triton.jit
    def _partials_kernel(
        x_ptr, temperature_ptr, partial_ptr, index_ptr, vocab, chunk, splits, cap, inverse_cap,
        HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # partial[row, split, :] = (m, S, B, argmax value); index[row, split] = argmax.
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        temperature = tl.load(temperature_ptr)
        offs = tl.arange(0, BLOCK)
        start = split * chunk
        end = tl.minimum(start + chunk, vocab)
        # The chunk's running max m (a scalar: a block's max is a warp reduction) and per lane sums relative to it,
        # rescaled only when a block raises m.
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        b = tl.zeros([BLOCK], dtype=tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_at = tl.zeros([BLOCK], dtype=tl.int32)
        # The next block's load is issued before this block's arithmetic: two loads in flight per warp. (Loads
        # written out rather than in a helper: each helper call costs the interpreter's tests a builtin patch.)
        x_row = x_ptr + row * vocab
        following = tl.load(x_row + start + offs, mask=start + offs < end, other=0.0)
        for first in range(start, end, BLOCK):
            cols = first + offs
            in_row = cols < end
            raw = following
            following = tl.load(x_row + BLOCK + cols, mask=BLOCK + cols < end, other=0.0)
            z = tl.where(in_row, _processed(raw, cap, inverse_cap, temperature, HAS_CAP), float("-inf"))
            block_m = tl.max(z, axis=0)
            if block_m > m:
                shift = tl.where(m == float("-inf"), 0.0, m - block_m)  # m = -inf: s = b = 0, no NaN
                rescale = tl.exp(shift)
                b = rescale * (b + shift * s)
                s = rescale * s
                m = block_m
            d = z - m
            # e^d as 2^(d log2 e) flushing results below 2^-126 to 0 (one instruction on the GPU where tl.exp's
            # denormal handling takes four): such terms are below the sums' rounding (the max's term is 1).
            e = tl.exp2(d * 1.4426950408889634)
            b += e * tl.where(in_row, d, 0.0)
            s += e
            better = z > best  # strictly: the first column of a lane's maximum stays
            best_at = tl.where(better, cols, best_at)
            best = tl.where(better, z, best)
        top = tl.max(best, axis=0)
        top_at = tl.min(tl.where(best == top, best_at, 2147483647), axis=0)
        slot = (row * splits + split) * 4
        tl.store(partial_ptr + slot + 0, m)
        tl.store(partial_ptr + slot + 1, tl.sum(s, axis=0))
        tl.store(partial_ptr + slot + 2, tl.sum(b, axis=0))
        tl.store(partial_ptr + slot + 3, top)
        tl.store(index_ptr + row * splits + split, top_at)

    @triton.jit
    def _finish_kernel(
        x_ptr, temperature_ptr, seed_ptr, partial_ptr, index_ptr, sample_ptr, entropy_ptr, argmax_ptr, frozen_ptr,
        probabilities_ptr, vocab, chunk, splits, positions, cap, inverse_cap,
        HAS_CAP: tl.constexpr, HAS_FROZEN: tl.constexpr, WRITE_PROBABILITIES: tl.constexpr, BLOCK: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        # Program (row, split): the row's statistics from the partials, then its chunk's probabilities and, if the
        # chunk claims the row's draw, sample[row].
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        parts = tl.arange(0, BLOCK_S)
        used = parts < splits
        slot = (row * splits + parts) * 4
        m = tl.load(partial_ptr + slot + 0, mask=used, other=float("-inf"))
        s = tl.load(partial_ptr + slot + 1, mask=used, other=0.0)
        b = tl.load(partial_ptr + slot + 2, mask=used, other=0.0)
        row_m = tl.max(m, axis=0)
        weight = tl.exp(m - row_m)
        weight = tl.where(m == float("-inf"), 0.0, weight)
        total_s = tl.sum(weight * s, axis=0)
        total_b = tl.sum(weight * (b + tl.where(m == float("-inf"), 0.0, m - row_m) * s), axis=0)
        log_s = tl.log(total_s)
        lse = row_m + log_s
        if split == 0:
            tl.store(entropy_ptr + row, log_s - total_b / total_s)
            top = tl.load(partial_ptr + slot + 3, mask=used, other=float("-inf"))
            top_at = tl.load(index_ptr + row * splits + parts, mask=used, other=2147483647)
            best = tl.max(top, axis=0)
            tl.store(argmax_ptr + row, tl.min(tl.where(top == best, top_at, 2147483647), axis=0).to(tl.int64))
        # The draw's chunk: the masses of e^(z - row_m) before and through this chunk, as masked sums of one vector
        # (every program of the row reduces the same values in the same tree: this program's `through` is the next
        # one's `before` bit for bit, so exactly one program claims a t below the total). Float64: t resolves a
        # column's share of a sum of 262,144 terms (float32 would quantize it to 1/32 of a flat row's column).
        mass = tl.where(weight > 0, weight * s, 0.0).to(tl.float64)
        before = tl.sum(tl.where(parts < split, mass, 0.0), axis=0)
        through = tl.sum(tl.where(parts <= split, mass, 0.0), axis=0)
        total = tl.sum(mass, axis=0)
        last = tl.max(tl.where(mass > 0, parts, 0), axis=0)
        t = _uniform(tl.load(seed_ptr), row) * total
        claimed = ((before <= t) & (t < through)) | ((split == last) & ~(t < total))  # t NaN: the last chunk
        write = split >= 0
        if HAS_FROZEN:
            write = tl.load(frozen_ptr + row // positions) == 0
        busy = claimed
        if WRITE_PROBABILITIES:
            busy = busy | write
        temperature = tl.load(temperature_ptr)
        offs = tl.arange(0, BLOCK)
        start = split * chunk
        end = tl.minimum(start + chunk, vocab)
        stop = tl.where(busy, end, start)  # nothing to write and no draw: no pass over the chunk
        out_dtype = probabilities_ptr.dtype.element_ty
        # The scan: the mass left before the sample (t less the chunk's, less the blocks' scanned), the sample's
        # column once found (-1 before), and per lane the last column of nonzero mass (the fallback).
        left = t - before
        picked = tl.full([], -1, tl.int32)
        nonzero_at = tl.full([BLOCK], -1, tl.int32)
        x_row = x_ptr + row * vocab  # the next block loaded early, as in the partials kernel
        following = tl.load(x_row + start + offs, mask=start + offs < stop, other=0.0)
        for first in range(start, stop, BLOCK):
            cols = first + offs
            in_row = cols < end
            raw = following
            following = tl.load(x_row + BLOCK + cols, mask=BLOCK + cols < stop, other=0.0)
            z = _processed(raw, cap, inverse_cap, temperature, HAS_CAP)
            if WRITE_PROBABILITIES:
                if write:
                    tl.store(probabilities_ptr + row * vocab + cols, tl.exp(z - lse).to(out_dtype), mask=in_row)
            if claimed & (picked < 0):
                # e^(z - row_m) as the partials' terms (exp2, results below 2^-126 flushed to 0), summed within the
                # block in float32; in the block whose sum exceeds what is left (the running sums only there), the
                # first column whose running sum does, of nonzero mass. (Rounding may leave none there: what is
                # left turns negative and the next column of nonzero mass is taken.)
                e = tl.where(in_row, tl.exp2((z - row_m) * 1.4426950408889634), 0.0)
                nonzero = e > 0
                nonzero_at = tl.where(nonzero, cols, nonzero_at)
                block_mass = tl.sum(e, axis=0)
                if block_mass.to(tl.float64) > left:
                    running = tl.cumsum(e, axis=0)
                    hit = tl.min(tl.where((running > left.to(tl.float32)) & nonzero, cols, 2147483647), axis=0)
                    picked = tl.where(hit < 2147483647, hit, picked)
                left -= block_mass.to(tl.float64)
        if claimed:
            fallback = tl.max(nonzero_at, axis=0)
            picked = tl.where(picked >= 0, picked, tl.where(fallback >= 0, fallback, start))
            tl.store(sample_ptr + row, picked.to(tl.int64))

    @triton.jit
    def _weighted_norm(x, weight_ptr, cols, in_row, n_cols, eps, dtype: tl.constexpr, HAS_WEIGHT: tl.constexpr):
        # DiffusionGemma's norm of a float32 row (masked lanes 0): x * (mean(x^2) + eps)^-0.5, times the weight in
        # float32 (HAS_WEIGHT), rounded once to `dtype`; returned as float32. Every norm kernel here computes it.
        inverse = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / n_cols + eps)
        y = x * inverse
        if HAS_WEIGHT:
            y = y * tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        return y.to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, weight_ptr, residual_ptr, scale_ptr, out_ptr, n_cols, eps,
        HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One program per row: `_weighted_norm`; with a residual, residual + that (the sum in float32, rounded); with
        # a scale, that times the scale (the product in float32, rounded: PyTorch's `x * layer_scalar`).
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < n_cols
        out_dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * n_cols + cols, mask=in_row, other=0.0).to(tl.float32)
        y = _weighted_norm(x, weight_ptr, cols, in_row, n_cols, eps, out_dtype, HAS_WEIGHT)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * n_cols + cols, mask=in_row, other=0.0)
            y = (residual.to(tl.float32) + y).to(out_dtype).to(tl.float32)
        if HAS_SCALE:
            y = y * tl.load(scale_ptr).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_dtype), mask=in_row)

    @triton.jit
    def _post_attention_kernel(
        x_ptr, residual_ptr, weight_ptr, sum_ptr, weight1_ptr, out1_ptr, weight2_ptr, out2_ptr, weight3_ptr, out3_ptr,
        n_cols, eps, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One program per row: h = residual + norm(x) * w (`_rms_norm_kernel` with a residual), then three norms of
        # h with their own weights, each rounded to the output dtype (four `_rms_norm_kernel` launches' results).
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < n_cols
        at = row * n_cols + cols
        dtype = sum_ptr.dtype.element_ty
        x = tl.load(x_ptr + at, mask=in_row, other=0.0).to(tl.float32)
        residual = tl.load(residual_ptr + at, mask=in_row, other=0.0).to(tl.float32)
        h = (residual + _weighted_norm(x, weight_ptr, cols, in_row, n_cols, eps, dtype, True)).to(dtype)
        tl.store(sum_ptr + at, h, mask=in_row)
        h = h.to(tl.float32)
        tl.store(
            out1_ptr + at, _weighted_norm(h, weight1_ptr, cols, in_row, n_cols, eps, dtype, True).to(dtype), mask=in_row
        )
        tl.store(
            out2_ptr + at, _weighted_norm(h, weight2_ptr, cols, in_row, n_cols, eps, dtype, True).to(dtype), mask=in_row
        )
        tl.store(
            out3_ptr + at, _weighted_norm(h, weight3_ptr, cols, in_row, n_cols, eps, dtype, True).to(dtype), mask=in_row
        )

    @triton.jit
    def _post_feedforward_kernel(
        dense_ptr, moe_ptr, residual_ptr, dense_weight_ptr, moe_weight_ptr, weight_ptr, scale_ptr, out_ptr, n_cols, eps,
        row_index_ptr, expert_weight_ptr, next_weight_ptr, normed_ptr,
        BLOCK: tl.constexpr, TOP_K: tl.constexpr, ON_GPU: tl.constexpr, NEXT_NORM: tl.constexpr,
    ):  # fmt: skip
        # One program per row: s = norm(dense) * w1 + norm(moe) * w2 (each rounded, the sum rounded), then
        # (residual + norm(s) * w) * scale, rounded after each op (three `_rms_norm_kernel` launches' result).
        # TOP_K > 0: moe is the row's experts' weighted sum, computed here from the experts' output rows (moe_ptr:
        # `(pairs, n_cols)`, the row's k-th at row_index[row * TOP_K + k], weighted by the float32
        # expert_weight[row * TOP_K + k]) as `triton_moe.combine` computes it: each product rounded (never fused
        # into an add), summed in k order in float32, the sum rounded to the activations' dtype.
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < n_cols
        at = row * n_cols + cols
        dtype = out_ptr.dtype.element_ty
        dense = tl.load(dense_ptr + at, mask=in_row, other=0.0).to(tl.float32)
        if TOP_K > 0:
            moe = weighted_rows_sum(moe_ptr, row_index_ptr, expert_weight_ptr, row, cols, in_row, n_cols, TOP_K, ON_GPU)
            moe = moe.to(dtype).to(tl.float32)
        else:
            moe = tl.load(moe_ptr + at, mask=in_row, other=0.0).to(tl.float32)
        dense = _weighted_norm(dense, dense_weight_ptr, cols, in_row, n_cols, eps, dtype, True)
        summed = (dense + _weighted_norm(moe, moe_weight_ptr, cols, in_row, n_cols, eps, dtype, True)).to(dtype)
        residual = tl.load(residual_ptr + at, mask=in_row, other=0.0).to(tl.float32)
        y = (residual + _weighted_norm(summed.to(tl.float32), weight_ptr, cols, in_row, n_cols, eps, dtype, True)).to(
            dtype
        )
        y = (y.to(tl.float32) * tl.load(scale_ptr).to(tl.float32)).to(dtype)
        tl.store(out_ptr + at, y, mask=in_row)
        if NEXT_NORM:  # the next layer's input norm of y, as `_rms_norm_kernel` computes it (same reduction)
            normed = _weighted_norm(y.to(tl.float32), next_weight_ptr, cols, in_row, n_cols, eps, dtype, True)
            tl.store(normed_ptr + at, normed.to(dtype), mask=in_row)

    @triton.jit
    def _norm_rope_heads(
        x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, token, head_block, seq_len, n_heads, eps, stride_xt, stride_xh,
        stride_cb, stride_ob, stride_oh, stride_ot,
        HAS_WEIGHT: tl.constexpr, HAS_ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # Token `token` (b * seq_len + t), heads `head_block` * BLOCK_H on: each head's RMS norm (float32, rounded
        # once, `DiffusionGemmaRMSNorm`), then RoPE with tables in the activation dtype, each product and the sum
        # rounded (`x * cos + rotate_half(x) * sin`, PyTorch's rounding points), written to (B, heads, T, D) at the
        # output's strides (maybe a cache's slots). x rows: token t at t * stride_xt, head h at + h * stride_xh (a
        # projection's output viewed (B, T, H, D), maybe a slice of a wider one).
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        in_heads = (heads < n_heads)[:, None]
        d = tl.arange(0, HEAD_DIM)
        dtype = out_ptr.dtype.element_ty
        src = x_ptr + token * stride_xt + heads[:, None].to(tl.int64) * stride_xh
        x = tl.load(src + d[None, :], mask=in_heads, other=0.0).to(tl.float32)
        inverse = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        y = x * inverse[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(weight_ptr + d).to(tl.float32)[None, :]
        y = y.to(dtype)
        b = token // seq_len
        t = token % seq_len
        if HAS_ROPE:
            half = HEAD_DIM // 2
            partner = tl.where(d < half, d + half, d - half)
            xp = tl.load(src + partner[None, :], mask=in_heads, other=0.0).to(tl.float32)
            yp = xp * inverse[:, None]
            if HAS_WEIGHT:
                yp = yp * tl.load(weight_ptr + partner).to(tl.float32)[None, :]
            yp = yp.to(dtype).to(tl.float32)
            rotated = tl.where((d < half)[None, :], -yp, yp)
            table = b * stride_cb + t * HEAD_DIM + d
            cos = tl.load(cos_ptr + table).to(tl.float32)[None, :]
            sin = tl.load(sin_ptr + table).to(tl.float32)[None, :]
            y = ((y.to(tl.float32) * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)
        dst = out_ptr + b * stride_ob + heads[:, None].to(tl.int64) * stride_oh + t * stride_ot + d[None, :]
        tl.store(dst, y, mask=in_heads)

    @triton.jit
    def _qkv_norm_rope_kernel(
        q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr, seq_len,
        n_q, n_kv, q_eps, k_eps, v_eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb,
        stride_qob, stride_qoh, stride_qot, stride_kob, stride_koh, stride_kot, stride_vob, stride_voh, stride_vot,
        HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # An attention's three `_norm_rope_heads` in one launch: program (token, head block), the blocks of the
        # queries (weighted norm, RoPE), then the keys' (the same), then the values' (norm without scale, no RoPE).
        wait_for_previous_kernel()
        token = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        q_blocks = tl.cdiv(n_q, BLOCK_H)
        kv_blocks = tl.cdiv(n_kv, BLOCK_H)
        if block < q_blocks:
            _norm_rope_heads(
                q_ptr, q_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, token, block, seq_len, n_q, q_eps, stride_qt,
                stride_qh, stride_cb, stride_qob, stride_qoh, stride_qot, True, True, HEAD_DIM, BLOCK_H,
            )  # fmt: skip
        elif block < q_blocks + kv_blocks:
            _norm_rope_heads(
                k_ptr, k_weight_ptr, cos_ptr, sin_ptr, k_out_ptr, token, block - q_blocks, seq_len, n_kv, k_eps,
                stride_kt, stride_kh, stride_cb, stride_kob, stride_koh, stride_kot, True, True, HEAD_DIM, BLOCK_H,
            )  # fmt: skip
        else:
            _norm_rope_heads(
                v_ptr, v_ptr, cos_ptr, sin_ptr, v_out_ptr, token, block - q_blocks - kv_blocks, seq_len, n_kv, v_eps,
                stride_vt, stride_vh, stride_cb, stride_vob, stride_voh, stride_vot, False, False, HEAD_DIM, BLOCK_H,
            )  # fmt: skip


if TRITON_AVAILABLE:

    @triton.jit
    def _masked_softmax_kernel(
        scores_ptr, mask_ptr, out_ptr, keys, queries, rows_per_batch, mask_rows,
        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One program per score row (batch b, K/V head, query head in group, query t): softmax over the row's keys
        # with the masked ones at -inf, in float32, stored in the output's dtype.
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < keys
        x = tl.load(scores_ptr + row * keys + cols, mask=inside, other=float("-inf"))
        if HAS_MASK:
            batch = row // rows_per_batch
            query = (row % queries) * (mask_rows > 1)
            visible = tl.load(mask_ptr + (batch * mask_rows + query) * keys + cols, mask=inside, other=0)
            x = tl.where(visible != 0, x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(out_ptr + row * keys + cols, (e / tl.sum(e, axis=0)).to(out_ptr.dtype.element_ty), mask=inside)


@on_tensor_device
def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, queries: int, dtype: torch.dtype) -> torch.Tensor:
    """softmax over the last dim of `scores` `(B, ..., T, S)` float32 (contiguous) with `mask` `(B, 1, T or 1, S)`
    bool (None: every key) hiding keys, in `dtype`: one launch where torch takes four (masked_fill, softmax, cast
    and a mask broadcast). `queries`: T (a score row's query is its row index mod T)."""
    keys = scores.shape[-1]
    rows = scores.numel() // keys
    out = torch.empty(scores.shape, dtype=dtype, device=scores.device)
    if rows == 0:
        return out
    batch = scores.shape[0]
    flat_mask = scores if mask is None else mask.expand(batch, 1, mask.shape[-2], keys).contiguous()
    _masked_softmax_kernel[(rows,)](
        scores,
        flat_mask,
        out,
        keys,
        queries,
        rows // batch,
        1 if mask is None else mask.shape[-2],
        HAS_MASK=mask is not None,
        BLOCK=triton.next_power_of_2(keys),
        num_warps=4 if keys <= 2048 else 8,
        **dependent_launch(),
    )
    return out


def _norm_rope_operands(x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x `(B, T, H, D)` in the layout `_norm_rope_heads` reads, the output `(B, H, T, D)`: `out` checked, or a new
    contiguous one)."""
    batch, seq_len, heads, head_dim = x.shape
    if x.stride(-1) != 1 or x.stride(-2) != head_dim or x.stride(0) != seq_len * x.stride(1):
        x = x.contiguous()
    if head_dim & (head_dim - 1):
        raise ValueError(f"qkv_norm_rope: head_dim {head_dim} must be a power of 2.")
    if out is None:
        out = torch.empty(batch, heads, seq_len, head_dim, dtype=x.dtype, device=x.device)
    elif out.shape != (batch, heads, seq_len, head_dim) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"qkv_norm_rope: an `out` must be ({batch}, {heads}, {seq_len}, {head_dim}) {x.dtype} with its last dim "
            f"contiguous, got {tuple(out.shape)} {out.dtype} strides {out.stride()}."
        )
    return x, out


def _rope_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cos, sin `(B or 1, T, D)` in x's dtype, contiguous, and their batch stride (0: shared by the rows)."""
    batch, seq_len, _, head_dim = x.shape
    cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    if cos.shape[1:] != (seq_len, head_dim) or cos.shape[0] not in (1, batch) or sin.shape != cos.shape:
        raise ValueError(
            f"qkv_norm_rope: cos/sin must be (1 or {batch}, {seq_len}, {head_dim}), got {tuple(cos.shape)}."
        )
    return cos, sin, cos.stride(0) if cos.shape[0] > 1 else 0


@on_tensor_device
def qkv_norm_rope(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    eps: tuple[float, float, float],
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_out: torch.Tensor | None = None,
    value_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DiffusionGemma's per-head norms then RoPE of an attention in one launch (`_norm_rope_heads`: what
    `rope(norm(x)).transpose(1, 2)` gives, its rounding points): query `(B, T, Hq, D)` with `weights[0]` and RoPE,
    key `(B, T, Hkv, D)` with `weights[1]` and RoPE, value `(B, T, Hkv, D)` normed without scale (the key tensor
    itself in full layers), each with its `eps`; inputs with their last two dims dense (views of a projection),
    cos/sin `(B or 1, T, D)`. Returns `(B, Hq, T, D)`, `(B, Hkv, T, D)` x2; `key_out` / `value_out`: where to write
    the keys and values, `(B, Hkv, T, D)` in their dtype with the last dim contiguous, any other strides (a static
    cache's canvas slots, so that no copy follows)."""
    query, query_out = _norm_rope_operands(query, None)
    key, key_out = _norm_rope_operands(key, key_out)
    value, value_out = _norm_rope_operands(value, value_out)
    batch, seq_len, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    if key.shape != (batch, seq_len, kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"qkv_norm_rope: key and value must be ({batch}, {seq_len}, kv_heads, {head_dim}) alike, got "
            f"{tuple(key.shape)} and {tuple(value.shape)}."
        )
    if query.numel() == 0:
        return query_out, key_out, value_out
    cos, sin, stride_cb = _rope_tables(query, cos, sin)
    block_h = 4 if head_dim <= 256 else 2
    blocks = triton.cdiv(heads, block_h) + 2 * triton.cdiv(kv_heads, block_h)
    _qkv_norm_rope_kernel[(batch * seq_len, blocks)](
        query, key, value, weights[0], weights[1], cos, sin, query_out, key_out, value_out, seq_len, heads, kv_heads,
        float(eps[0]), float(eps[1]), float(eps[2]), query.stride(1), query.stride(2), key.stride(1), key.stride(2),
        value.stride(1), value.stride(2), stride_cb, query_out.stride(0), query_out.stride(1), query_out.stride(2),
        key_out.stride(0), key_out.stride(1), key_out.stride(2), value_out.stride(0), value_out.stride(1),
        value_out.stride(2), HEAD_DIM=head_dim, BLOCK_H=block_h, num_warps=4,
        enable_fp_fusion=False,  # PyTorch rounds each product before the sum
        **dependent_launch(),
    )  # fmt: skip
    return query_out, key_out, value_out


@on_tensor_device
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """DiffusionGemma's RMS norm over the last dim in one launch (`DiffusionGemmaRMSNorm`'s rounding: float32,
    one rounding to x's dtype), plus `residual` (x's shape) if given, times `scale` `(1,)` (x's dtype) if given.
    x `(..., d)`, weight `(d,)` (any float dtype, read as float32) or None."""
    if scale is not None and (scale.numel() != 1 or scale.dtype != x.dtype):
        raise ValueError(f"rms_norm: scale must be a (1,) tensor of x's dtype {x.dtype}, got {scale.dtype} "
                         f"{tuple(scale.shape)}.")  # fmt: skip
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    res = residual.reshape(-1, d).contiguous() if residual is not None else rows
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight if weight is not None else rows, res, scale if scale is not None else rows, out, d, float(eps),
        HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None, HAS_SCALE=scale is not None,
        **_norm_launch(rows)[2],
        **dependent_launch(),
    )  # fmt: skip
    return out.view(x.shape)


def _norm_launch(x: torch.Tensor) -> tuple[int, int, dict]:
    """(rows, columns, launch options) of a row-wise norm kernel over x `(..., d)`: one program per row."""
    d = x.shape[-1]
    block = triton.next_power_of_2(d)
    return x.numel() // d, d, dict(BLOCK=block, num_warps=8 if block >= 2048 else 4 if block >= 512 else 2)


@on_tensor_device
def post_attention_norms(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weights: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """A DiffusionGemma layer after its attention, in one launch: h = `rms_norm(x, weight, eps, residual)`, then
    `rms_norm(h, w, eps)` for each of the three `weights` (the MLP's, the experts' and the router's input norms).
    x, residual `(..., d)` of one dtype, weights `(d,)` (any float dtype) -> (h, *norms), each x's shape and
    dtype."""
    if len(weights) != 3:
        raise ValueError(f"post_attention_norms: three weights (the three norms of h), got {len(weights)}.")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"post_attention_norms: residual must be x's shape and dtype {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}.")  # fmt: skip
    x, residual = x.contiguous(), residual.contiguous()
    outputs = [torch.empty_like(x) for _ in range(4)]
    rows, d, options = _norm_launch(x)
    if rows:
        _post_attention_kernel[(rows,)](
            x, residual, weight, outputs[0], weights[0], outputs[1], weights[1], outputs[2], weights[2], outputs[3],
            d, float(eps), **options,
            **dependent_launch(),
        )  # fmt: skip
    return tuple(outputs)


@on_tensor_device
def post_feedforward_norms(
    dense: torch.Tensor,
    moe: torch.Tensor,
    residual: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    eps: float,
    scale: torch.Tensor,
    experts: tuple[torch.Tensor, torch.Tensor] | None = None,
    next_norm_weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A DiffusionGemma layer's end in one launch: `rms_norm(rms_norm(moe, w2, eps, rms_norm(dense, w1, eps)), w,
    eps, residual, scale)` for `weights` (w1, w2, w). dense, residual `(..., d)` of one shape and dtype; scale `(1,)`
    in it (the layer scalar) -> dense's shape and dtype. moe: dense's shape and dtype, or with `experts` (row
    `(tokens, top_k)` integer, weight `(tokens, top_k)` float32) the experts' output rows `(pairs, d)` in dense's
    dtype, combined in the kernel as `triton_moe.combine(moe, row, weight, False)` combines them (same bits: no
    launch and no `(tokens, d)` round trip for the experts' sum). With `next_norm_weight` `(d,)`: (out, the norm of
    out with that weight and `eps`), that norm as `rms_norm` computes it (the next layer's input norm: no launch)."""
    shapes = residual.shape == dense.shape and (experts is not None or moe.shape == dense.shape)
    if not shapes or residual.dtype != dense.dtype or moe.dtype != dense.dtype:
        raise ValueError("post_feedforward_norms: dense, moe and residual must be of one shape and dtype.")
    d = dense.shape[-1]
    if experts is None:
        row, expert_weight, top_k = dense, dense, 0  # (row and weight never read)
    else:
        row, expert_weight = experts
        top_k = row.shape[-1]
        if (
            moe.dim() != 2
            or moe.shape[1] != d
            or row.shape != expert_weight.shape
            or row.shape[0] != dense.numel() // d
        ):
            raise ValueError(
                f"post_feedforward_norms: with `experts`, moe must be the experts' rows (pairs, {d}) and row and "
                f"weight (tokens, top_k) for dense's {dense.numel() // d} tokens, got {tuple(moe.shape)}, "
                f"{tuple(row.shape)} and {tuple(expert_weight.shape)}."
            )
        if expert_weight.dtype != torch.float32 or row.dtype.is_floating_point:
            raise ValueError(
                f"post_feedforward_norms: `experts` takes integer rows and float32 weights, got {row.dtype} and "
                f"{expert_weight.dtype}."
            )
        row, expert_weight = row.contiguous(), expert_weight.contiguous()
    dense, moe, residual = dense.contiguous(), moe.contiguous(), residual.contiguous()
    if scale.numel() != 1 or scale.dtype != dense.dtype:
        raise ValueError(f"post_feedforward_norms: scale must be a (1,) {dense.dtype} tensor, got {scale.dtype} "
                         f"{tuple(scale.shape)}.")  # fmt: skip
    if next_norm_weight is not None and next_norm_weight.shape != (d,):
        raise ValueError(
            f"post_feedforward_norms: next_norm_weight must be ({d},), got {tuple(next_norm_weight.shape)}."
        )
    out = torch.empty_like(dense)
    normed = torch.empty_like(dense) if next_norm_weight is not None else out
    rows, _, options = _norm_launch(dense)
    if rows:
        _post_feedforward_kernel[(rows,)](
            dense, moe, residual, *weights, scale, out, d, float(eps), row, expert_weight,
            out if next_norm_weight is None else next_norm_weight, normed, TOP_K=top_k, ON_GPU=dense.is_cuda,
            NEXT_NORM=next_norm_weight is not None, **options,
            **dependent_launch(),
        )  # fmt: skip
    return out if next_norm_weight is None else (out, normed)


def vocabulary_splits(rows: int, vocab: int, block: int = BLOCK_V) -> int:
    """Chunks per row: enough programs (`TARGET_PROGRAMS`) for a few positions, one chunk per row for many; at
    most `MAX_SPLITS` and no more than the row has blocks of `block` columns."""
    wanted = max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(rows, 1))))
    return max(1, min(wanted, -(-vocab // block)))


@on_tensor_device
def fused_sample(
    raw_logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    softcap: float | None,
    probabilities: torch.Tensor | None = None,
    frozen: torch.Tensor | None = None,
    splits: int | None = None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the LM head's raw output `raw_logits` `(B, C, vocab)` (any float dtype; rows contiguous), with z =
    softcap(x) / temperature (`softcap` None: no cap; `temperature` a `(1,)` float32 device tensor): a sample of
    softmax(z) (inverse CDF from one Philox uniform per position, from the `(1,)` int64 device tensor `seed`: one
    seed, one sample), argmax(z) (first on ties) and the entropy of softmax(z) (float32), each `(B, C)`. With
    `probabilities` `(B, C, vocab)`: softmax(z) in its dtype written there for the rows of batch rows not `frozen`
    `(B,)` bool (None: all). `splits`, `block`: the chunking and the columns a program reads per iteration (tests;
    default `vocabulary_splits` and `BLOCK_V` on CUDA, one chunk per row and `INTERPRETER_BLOCK_V` in Triton's
    interpreter)."""
    batch, positions, vocab = raw_logits.shape
    rows = batch * positions
    x = raw_logits.reshape(rows, vocab)
    if x.stride(-1) != 1 or x.stride(0) != vocab:
        x = x.contiguous()
    if temperature.dtype != torch.float32 or temperature.numel() != 1:
        raise ValueError(
            f"temperature must be a (1,) float32 tensor, got {temperature.dtype} {tuple(temperature.shape)}."
        )
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"seed must be a (1,) int64 tensor, got {seed.dtype} {tuple(seed.shape)}.")
    if probabilities is not None and (probabilities.shape != raw_logits.shape or not probabilities.is_contiguous()):
        raise ValueError(
            f"probabilities must be a contiguous tensor of the logits' shape {tuple(raw_logits.shape)}, got "
            f"{tuple(probabilities.shape)}."
        )
    if frozen is not None and frozen.shape != (batch,):
        raise ValueError(f"frozen must have shape ({batch},), got {tuple(frozen.shape)}.")
    device = raw_logits.device
    block = block or (BLOCK_V if x.is_cuda else INTERPRETER_BLOCK_V)
    splits = splits or (vocabulary_splits(rows, vocab, block) if x.is_cuda else 1)
    per_split = -(-vocab // splits)
    chunk = -(-per_split // block) * block  # whole blocks per chunk
    splits = -(-vocab // chunk)
    partial = torch.empty(rows, splits, 4, dtype=torch.float32, device=device)
    index = torch.empty(rows, splits, dtype=torch.int32, device=device)
    entropy = torch.empty(rows, dtype=torch.float32, device=device)
    argmax = torch.empty(rows, dtype=torch.long, device=device)
    sample = torch.empty(rows, dtype=torch.long, device=device)  # every row's claiming program writes it
    cap = float(softcap) if softcap else 1.0
    warps = max(1, block // 256)  # 8 columns per lane
    _partials_kernel[(rows, splits)](
        x, temperature, partial, index, vocab, chunk, splits, cap, 1.0 / cap,
        HAS_CAP=bool(softcap), BLOCK=block, num_warps=warps,
        **dependent_launch(),
    )  # fmt: skip
    _finish_kernel[(rows, splits)](
        x, temperature, seed, partial, index, sample, entropy, argmax,
        frozen.contiguous() if frozen is not None else entropy,  # bool, read as int1
        probabilities if probabilities is not None else entropy,
        vocab, chunk, splits, positions, cap, 1.0 / cap,
        HAS_CAP=bool(softcap), HAS_FROZEN=frozen is not None, WRITE_PROBABILITIES=probabilities is not None,
        BLOCK=block, BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=warps,
        **dependent_launch(),
    )  # fmt: skip
    shape = (batch, positions)
    return sample.view(shape), argmax.view(shape), entropy.view(shape)


__all__ = [
    "BLOCK_V",
    "fused_sample",
    "post_attention_norms",
    "post_feedforward_norms",
    "qkv_norm_rope",
    "rms_norm",
    "vocabulary_splits",
]
