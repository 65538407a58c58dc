"""Fused Triton kernels for the LLaDA2.x MoE layer and its attention glue: fewer, larger launches per layer.

A LLaDA2.0-mini block step at batch 1 sends 32 tokens through 20 layers; in PyTorch each MoE layer launched ~100
kernels (router: casts, sigmoid, grouped top-k, scatter, masked fill, top-k, gather, normalisation; routing: sort
by expert, gather, counts, cumsum, index copy, weighting, sum, casts; shared expert: four more), each costing more
launch time than work. The kernels here replace those chains (the same routing as DeepSeek-V3's group-limited
gate, arXiv:2412.19437, Sec. 2.1.2, which LLaDA2 / Ling 2.0 use):

- `route`: scores (sigmoid or softmax), expert bias, group-limited top-k and the normalised weights times
  `routed_scaling_factor`, one program per token, from the router's float32 logits (the logits product stays a
  cuBLAS float32 GEMM, as in the reference: a Triton float32 product without TF32 measured 3.6x slower at batch 32
  on an H100, `benchmarks/results/h100_bench_llada2_kernels_batch32.log`);
- `router_partials`: the router's logits product for few tokens (a batch-1 block step of LLaDA-MoE), the experts
  and the hidden size split across programs, float32 partial products that `route` adds up and rounds to the
  activations' dtype as it loads them (no cast or reduction kernel);
- `align_by_expert`: the (token, choice) pairs in stable expert order (what `argsort(stable=True)` gives), the
  groups' end offsets for `torch._grouped_mm`, and each pair's row in that order, no host synchronisation
  (CUDA-graph capturable, static shapes): one program per expert for few pairs, a chunked counting sort (three
  kernels) for many;
- `combine`: each token's routed rows weighted and summed in float32, rounded, plus the shared expert's row and
  the residual, with PyTorch's rounding points;
- `combine_and_norm`: `combine` plus the next layer's RMS norm of its output, one program per token (LLaDA-MoE);
- `qk_norm_rope_to_cache`: per-head RMS norm of q and k, partial RoPE with the tables in the activation dtype, q
  written `(B, Hq, L, D)` and k, v written into the K/V cache, one launch instead of ~20.

The experts' grouped products are `grouped_gemm.py`'s (bf16 or FP8 weights). The
PyTorch code in `modeling_llada2_moe.py` stays the reference and the CPU path. Exported as Hub remote code: Triton
is imported inside `try:`.
"""

from __future__ import annotations

import torch

from .kernels import plain_half_linear
from .triton_attention import num_sms
from .triton_ops import TRITON_AVAILABLE, dependent_launch, on_tensor_device, tl, triton  # None: CPU-only

if TRITON_AVAILABLE:
    from .triton_ops import _rms_normed, wait_for_previous_kernel

if TRITON_AVAILABLE:

    @triton.jit
    def store_top_k(choice, scores, lanes, index_ptr, weight_ptr, token, scale, expert_scale_ptr, TOP_K: tl.constexpr,
                    NORMALIZE: tl.constexpr, BLOCK_K: tl.constexpr, HAS_EXPERT_SCALE: tl.constexpr):  # fmt: skip
        # One token's TOP_K experts by descending `choice` (ties: the lowest index) and their `scores` as weights
        # (normalised with NORMALIZE, times `scale`, times the chosen experts' scales with HAS_EXPERT_SCALE: any float
        # dtype, widened as PyTorch's promotion does), stored at its row of index_ptr / weight_ptr, the weights
        # rounded to weight_ptr's dtype (round to nearest even, as PyTorch's casts). choice, scores, lanes: 1D over
        # the experts, `lanes` each lane's expert (2**31 - 1 for lanes past the experts). Shared by `route` and
        # LLaDA2.2's block router (`llada2_moe_layer.fused_block_route`).
        ks = tl.arange(0, BLOCK_K)
        chosen = tl.zeros([BLOCK_K], dtype=tl.int64)
        weights = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            top_score = tl.max(choice, axis=0)
            top = tl.min(tl.where(choice == top_score, lanes, 2147483647), axis=0)
            picked = lanes == top
            chosen = tl.where(ks == k, top.to(tl.int64), chosen)
            weights = tl.where(ks == k, tl.sum(tl.where(picked, scores, 0.0), axis=0), weights)
            choice = tl.where(picked, float("-inf"), choice)
        if NORMALIZE:
            total = tl.sum(tl.where(ks < TOP_K, weights, 0.0), axis=0) + 1e-20
            weights = tl.math.div_rn(weights, tl.full(weights.shape, 1.0, tl.float32) * total)
        weights = weights * scale
        if HAS_EXPERT_SCALE:
            weights = weights * tl.load(expert_scale_ptr + chosen, mask=ks < TOP_K, other=0.0).to(tl.float32)
        tl.store(index_ptr + token * TOP_K + ks, chosen, mask=ks < TOP_K)
        tl.store(weight_ptr + token * TOP_K + ks, weights.to(weight_ptr.dtype.element_ty), mask=ks < TOP_K)

    @triton.jit
    def _route_kernel(
        logits_ptr,
        bias_ptr,
        expert_scale_ptr,
        index_ptr,
        weight_ptr,
        summed_ptr,
        n_tokens,
        n_experts,
        group_size,
        scale,
        SPLITS: tl.constexpr,
        SIGMOID: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_EXPERT_SCALE: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        NORMALIZE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_K: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        # One program per token. Experts laid out (group, index in group): expert = g * group_size + s.
        wait_for_previous_kernel()
        token = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, BLOCK_G)[:, None]
        s = tl.arange(0, BLOCK_S)[None, :]
        expert = g * group_size + s
        valid = (g < N_GROUP) & (s < group_size)
        if SPLITS == 0:
            # Half-precision logits widened here, as `.float()` would (exact): no cast kernel before the launch.
            x = tl.load(logits_ptr + token * n_experts + expert, mask=valid, other=float("-inf")).to(tl.float32)
        else:
            # The float32 partial products over SPLITS chunks of the hidden size (`router_partials`), added in chunk
            # order as they are loaded (unrolled: all loads in flight), rounded to summed_ptr's dtype as a product
            # in that dtype rounds its float32 sum, stored there (the router logits) and routed from.
            x = tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.float32)
            for split in tl.static_range(SPLITS):
                x += tl.load(logits_ptr + (split * n_tokens + token) * n_experts + expert, mask=valid, other=0.0)
            x = x.to(summed_ptr.dtype.element_ty)
            tl.store(summed_ptr + token * n_experts + expert, x, mask=valid)
            x = tl.where(valid, x.to(tl.float32), float("-inf"))
        if SIGMOID:
            # CUDA's expf and IEEE division, as PyTorch's sigmoid (`1 / (1 + exp(-x))`), so the choice is the same
            # (Triton's own exp is an approximation in float32).
            if LIBDEVICE:
                e = tl.extra.libdevice.exp(-x)
            else:
                e = tl.exp(-x)
            scores = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + e)
        else:
            shifted = x - tl.max(tl.max(x, axis=1), axis=0)
            if LIBDEVICE:
                shifted = tl.extra.libdevice.exp(shifted)
            else:
                shifted = tl.exp(shifted)
            scores = shifted / tl.sum(tl.sum(shifted, axis=1), axis=0)
        scores = tl.where(valid, scores, float("-inf"))
        choice = scores
        if HAS_BIAS:
            # The bias in its own dtype (bfloat16 in a bfloat16 model), widened as PyTorch's type promotion does.
            choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
        if TOPK_GROUP < N_GROUP:
            # A group's score: the sum of its two best experts' choice scores (one when groups hold one expert).
            best = tl.max(choice, axis=1)
            first = tl.argmax(choice, axis=1, tie_break_left=True)
            group_score = best
            if BLOCK_S > 1:
                second = tl.max(tl.where(s == first[:, None], float("-inf"), choice), axis=1)
                group_score = best + second
            groups = tl.arange(0, BLOCK_G)
            group_score = tl.where(groups < N_GROUP, group_score, float("-inf"))
            selected = groups < 0
            for _ in tl.static_range(TOPK_GROUP):
                # The best remaining group; on ties the lowest index.
                top = tl.argmax(group_score, axis=0, tie_break_left=True)
                selected = selected | (groups == top)
                group_score = tl.where(groups == top, float("-inf"), group_score)
            choice = tl.where(selected[:, None], choice, float("-inf"))
        flat_choice = tl.reshape(choice, [BLOCK_G * BLOCK_S])
        flat_scores = tl.reshape(scores, [BLOCK_G * BLOCK_S])
        flat_expert = tl.reshape(tl.where(valid, expert, 2147483647), [BLOCK_G * BLOCK_S])
        store_top_k(
            flat_choice, flat_scores, flat_expert, index_ptr, weight_ptr, token, scale, expert_scale_ptr, TOP_K,
            NORMALIZE, BLOCK_K, HAS_EXPERT_SCALE,
        )  # fmt: skip

    @triton.jit
    def _align_kernel(
        expert_ptr,
        sorted_token_ptr,
        row_ptr,
        offsets_ptr,
        n_pairs,
        per_token,
        shared_expert,
        HAS_SHARED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per expert e (the shared expert, if any, is the last): its pairs' rows are
        # [start, start + count) with start = pairs of lower experts, in pair order (stable). Pair p belongs to
        # token p // per_token; choice per_token - 1 of each token is the shared expert when shared_expert >= 0.
        wait_for_previous_kernel()
        e = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        start = tl.zeros([1], dtype=tl.int32)
        count = tl.zeros([1], dtype=tl.int32)
        for base in range(0, n_pairs, BLOCK):
            pair = base + offs
            ids = _pair_expert(expert_ptr, pair, n_pairs, per_token, shared_expert, HAS_SHARED)
            start += tl.sum((ids < e).to(tl.int32), axis=0)
            count += tl.sum((ids == e).to(tl.int32), axis=0)
        tl.store(offsets_ptr + e + tl.arange(0, 1), start + count)
        seen = start
        for base in range(0, n_pairs, BLOCK):
            pair = base + offs
            ids = _pair_expert(expert_ptr, pair, n_pairs, per_token, shared_expert, HAS_SHARED)
            mine = (ids == e).to(tl.int32)
            row = seen + tl.cumsum(mine, axis=0) - 1
            tl.store(sorted_token_ptr + row, pair // per_token, mask=mine > 0)
            tl.store(row_ptr + pair, row, mask=mine > 0)
            seen += tl.sum(mine, axis=0)

    @triton.jit
    def _router_product_kernel(
        x_ptr,
        gate_ptr,
        out_ptr,
        tokens,
        n_experts,
        hidden,
        chunk,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per (tile of BLOCK_E experts, tile of BLOCK_T tokens, chunk of `chunk` hidden columns): that
        # chunk's part of x @ gate.T with float32 accumulation, stored at `out[chunk index]` `(tokens, n_experts)`.
        # Splitting the experts and the hidden size across programs divides the router weight each program streams
        # (one program for all 64 experts of LLaDA-MoE read 256 KB alone; eight, one per 16 x 16 tile, 64 KB each).
        wait_for_previous_kernel()
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)[None, :]
        split = tl.program_id(2)
        real_t = t < tokens
        real_e = e < n_experts
        h = tl.arange(0, BLOCK_H)
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        first = split * chunk
        for start in range(first, first + chunk, BLOCK_H):
            cols = start + h
            xs = tl.load(x_ptr + t * hidden + cols[None, :], mask=real_t & (cols[None, :] < hidden), other=0.0)
            ws = tl.load(gate_ptr + e * hidden + cols[:, None], mask=real_e & (cols[:, None] < hidden), other=0.0)
            acc = tl.dot(xs, ws, acc)
        out = out_ptr + split.to(tl.int64) * tokens * n_experts + t * n_experts + e
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=real_t & real_e)

    @triton.jit
    def _chunk_histogram_kernel(
        expert_ptr,
        counts_ptr,
        n_pairs,
        per_token,
        shared_expert,
        HAS_SHARED: tl.constexpr,
        CHUNK: tl.constexpr,
        BINS: tl.constexpr,
    ):
        # One program per chunk of CHUNK pairs: how many of its pairs each expert has, `counts[chunk, expert]`.
        # Pairs past the end count in the last bin, which is no expert (BINS > experts).
        wait_for_previous_kernel()
        chunk = tl.program_id(0)
        pair = chunk * CHUNK + tl.arange(0, CHUNK)
        ids = _pair_expert(expert_ptr, pair, n_pairs, per_token, shared_expert, HAS_SHARED)
        ids = tl.where(pair < n_pairs, ids, BINS - 1)
        tl.store(counts_ptr + chunk * BINS + tl.arange(0, BINS), tl.histogram(ids, BINS))

    @triton.jit
    def _chunk_scan_kernel(counts_ptr, base_ptr, offsets_ptr, n_chunks, groups, BINS: tl.constexpr, ROWS: tl.constexpr):
        # One program: `base[chunk, e]` = pairs of expert e in earlier chunks; row `n_chunks` of `base` = each
        # expert's first row (pairs of lower experts); `offsets[e]` = its end row.
        wait_for_previous_kernel()
        bins = tl.arange(0, BINS)
        total = tl.zeros([BINS], dtype=tl.int32)
        for first in range(0, n_chunks, ROWS):
            chunks = first + tl.arange(0, ROWS)
            inside = (chunks < n_chunks)[:, None]
            counts = tl.load(counts_ptr + chunks[:, None] * BINS + bins[None, :], mask=inside, other=0)
            before = total[None, :] + tl.cumsum(counts, axis=0) - counts
            tl.store(base_ptr + chunks[:, None] * BINS + bins[None, :], before, mask=inside)
            total += tl.sum(counts, axis=0)
        start = tl.cumsum(total, axis=0) - total
        tl.store(base_ptr + n_chunks * BINS + bins, start)
        tl.store(offsets_ptr + bins, start + total, mask=bins < groups)

    @triton.jit
    def _chunk_scatter_kernel(
        expert_ptr,
        base_ptr,
        sorted_token_ptr,
        row_ptr,
        n_pairs,
        n_chunks,
        per_token,
        shared_expert,
        HAS_SHARED: tl.constexpr,
        CHUNK: tl.constexpr,
        BINS: tl.constexpr,
    ):
        # One program per chunk: a pair's row = its expert's first row + that expert's pairs in earlier chunks +
        # those earlier in this chunk (stable order).
        wait_for_previous_kernel()
        chunk = tl.program_id(0)
        offs = tl.arange(0, CHUNK)
        pair = chunk * CHUNK + offs
        valid = pair < n_pairs
        ids = _pair_expert(expert_ptr, pair, n_pairs, per_token, shared_expert, HAS_SHARED)
        earlier = (ids[None, :] == ids[:, None]) & (offs[None, :] < offs[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        ids = tl.where(valid, ids, 0)
        start = tl.load(base_ptr + n_chunks * BINS + ids, mask=valid, other=0)
        before = tl.load(base_ptr + chunk * BINS + ids, mask=valid, other=0)
        row = start + before + rank
        tl.store(sorted_token_ptr + row, pair // per_token, mask=valid)
        tl.store(row_ptr + pair, row, mask=valid)

    @triton.jit
    def _pair_expert(expert_ptr, pair, n_pairs, per_token, shared_expert, HAS_SHARED: tl.constexpr):
        # The expert of each pair: the router's choice, or the shared expert for the last choice of each token.
        in_range = pair < n_pairs
        if HAS_SHARED:
            token, choice = pair // per_token, pair % per_token
            routed = choice < per_token - 1
            ids = tl.load(expert_ptr + token * (per_token - 1) + choice, mask=in_range & routed, other=-1)
            ids = tl.where(routed, ids.to(tl.int32), shared_expert)
        else:
            ids = tl.load(expert_ptr + pair, mask=in_range, other=-1).to(tl.int32)
        return tl.where(in_range, ids, 2147483647)

    @triton.jit
    def _combine_kernel(
        rows_ptr,
        row_index_ptr,
        weight_ptr,
        residual_ptr,
        out_ptr,
        hidden,
        TOP_K: tl.constexpr,
        HAS_SHARED: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per (token, chunk of hidden). Pair rows of token t: row_index[t * per_token + k].
        wait_for_previous_kernel()
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_row = cols < hidden
        per_token = TOP_K + 1 if HAS_SHARED else TOP_K
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        # Unrolled, so the top-k rows' loads (each behind a load of its row index) are in flight together; the sum
        # keeps PyTorch's order (k = 0, 1, ...).
        for k in tl.static_range(TOP_K):
            row = tl.load(row_index_ptr + token * per_token + k).to(tl.int64)
            w = tl.load(weight_ptr + token * TOP_K + k)
            y = tl.load(rows_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
            acc += y * w
        # PyTorch: the float32 weighted sum rounded to the activation dtype, plus the shared expert (rounded), plus
        # the residual (rounded).
        out = acc.to(out_ptr.dtype.element_ty)
        if HAS_SHARED:
            row = tl.load(row_index_ptr + token * per_token + TOP_K).to(tl.int64)
            shared = tl.load(rows_ptr + row * hidden + cols, mask=in_row, other=0.0)
            out = (out.to(tl.float32) + shared.to(tl.float32)).to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + token * hidden + cols, mask=in_row, other=0.0)
            out = (residual.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + token * hidden + cols, out, mask=in_row)

    @triton.jit
    def weighted_rows_sum(rows_ptr, row_index_ptr, weight_ptr, token, cols, in_row, hidden, TOP_K: tl.constexpr,
                          ON_GPU: tl.constexpr):  # fmt: skip
        # Token `token`'s experts' weighted sum over columns `cols` in float32: sum over k of
        # rows[row_index[token * TOP_K + k]] * weight[token * TOP_K + k], in k order, each product rounded as
        # `_combine_kernel` (compiled without fusion) rounds it, also in kernels compiled with fused multiply-adds.
        acc = tl.zeros(cols.shape, dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            row = tl.load(row_index_ptr + token * TOP_K + k).to(tl.int64)
            w = tl.load(weight_ptr + token * TOP_K + k).to(tl.float32)
            y = tl.load(rows_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
            if ON_GPU:
                # An explicit round-to-nearest multiplication: never contracted into a fused multiply-add, and
                # without libdevice's flush of subnormals.
                w = tl.full(y.shape, 0.0, tl.float32) + w
                acc += tl.inline_asm_elementwise(
                    "mul.rn.f32 $0, $1, $2;", "=r,r,r", [y, w], dtype=tl.float32, is_pure=True, pack=1
                )
            else:
                acc += y * w
        return acc

    @triton.jit
    def _combine_norm_kernel(
        rows_ptr,
        row_index_ptr,
        weight_ptr,
        residual_ptr,
        norm_weight_ptr,
        out_ptr,
        normed_ptr,
        hidden,
        eps,
        TOP_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        # One program per token, its whole row: `_combine_kernel`'s residual + weighted sum (the same rounding
        # points), then `triton_ops.rms_norm` of that sum (the same reduction over a row of BLOCK_H, the same
        # rounding points), so the next layer's input norm needs no kernel of its own. Compiled with fused
        # multiply-adds as `rms_norm` is (its sum of squares may use them); the combine's products are explicit
        # rounded multiplications (never fused), as `_combine_kernel`, compiled without fusion, computes them.
        wait_for_previous_kernel()
        token = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        in_row = cols < hidden
        acc = weighted_rows_sum(rows_ptr, row_index_ptr, weight_ptr, token, cols, in_row, hidden, TOP_K, ON_GPU)
        dtype = out_ptr.dtype.element_ty
        residual = tl.load(residual_ptr + token * hidden + cols, mask=in_row, other=0.0)
        out = (residual.to(tl.float32) + acc.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + token * hidden + cols, out, mask=in_row)
        x = out.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
        normed = _rms_normed(x, rstd, norm_weight_ptr + cols, in_row, dtype, True)
        tl.store(normed_ptr + token * hidden + cols, normed, mask=in_row)

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr,
        q_weight_ptr,
        k_weight_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        cache_k_ptr,
        cache_v_ptr,
        position_ptr,
        seq_len,
        n_q_heads,
        n_k_heads,
        row_heads,
        q_first,
        k_first,
        v_shift,
        rotary_dim,
        eps,
        stride_cb,
        stride_ch,
        stride_cn,
        HEAD_DIM: tl.constexpr,
        HAS_NORM: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per (token, BLOCK_H heads) over the n_q_heads q heads then the n_k_heads k heads taken from the
        # fused projection `(B, L, row_heads, D)` (contiguous): q head h is projection head `q_first + h`, k head j
        # is `k_first + j` and its v head `v_shift` further (all heads: 0, Hq and Hk; under tensor parallelism this
        # rank's heads of the gathered projection). A (BLOCK_H, D) tile, so a token's RoPE table is read once for
        # several heads and a batch-32 step launches 4x fewer programs than with one head each. Per-head RMS norm
        # (float32, rounded, times the weight, rounded), then RoPE on the first `rotary_dim` dims with tables in the
        # activation dtype, each product and the sum rounded (PyTorch's rounding points). q goes to
        # `(B, n_q_heads, L, D)`; k (rotated) and v to the cache `(B, n_k_heads, T, D)` at column `position[l]`.
        wait_for_previous_kernel()
        token = tl.program_id(0).to(tl.int64)  # b * seq_len + l
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        is_q = heads < n_q_heads
        is_k = (heads >= n_q_heads) & (heads < n_q_heads + n_k_heads)
        rows = (is_q | is_k)[:, None]
        b = token // seq_len
        pos = token % seq_len
        dtype = q_out_ptr.dtype.element_ty
        d = tl.arange(0, HEAD_DIM)
        half = rotary_dim // 2
        partner = tl.where(d < half, d + half, tl.where(d < rotary_dim, d - half, d))
        source_head = tl.where(is_q, q_first + heads, k_first + heads - n_q_heads)
        src = qkv_ptr + (token * row_heads + source_head[:, None]) * HEAD_DIM
        x = tl.load(src + d[None, :], mask=rows, other=0.0).to(tl.float32)
        xp = tl.load(src + partner[None, :], mask=rows, other=0.0).to(tl.float32)
        if HAS_NORM:
            inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
            w = tl.where(is_q[:, None], tl.load(q_weight_ptr + d)[None, :], tl.load(k_weight_ptr + d)[None, :])
            wp = tl.where(
                is_q[:, None], tl.load(q_weight_ptr + partner)[None, :], tl.load(k_weight_ptr + partner)[None, :]
            )
            x = (w.to(tl.float32) * (x * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            xp = (wp.to(tl.float32) * (xp * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        rotating = d < rotary_dim
        table = token * rotary_dim + d
        cos = tl.load(cos_ptr + table, mask=rotating, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + table, mask=rotating, other=0.0).to(tl.float32)[None, :]
        rotated_half = tl.where((d < half)[None, :], -xp, xp)
        y = ((x * cos).to(dtype).to(tl.float32) + (rotated_half * sin).to(dtype).to(tl.float32)).to(dtype)
        y = tl.where(rotating[None, :], y, x.to(dtype))
        q_dst = q_out_ptr + ((b * n_q_heads + heads[:, None]) * seq_len + pos) * HEAD_DIM + d[None, :]
        tl.store(q_dst, y, mask=is_q[:, None])
        kh = tl.where(is_k, heads - n_q_heads, 0)[:, None]
        column = tl.load(position_ptr + pos).to(tl.int64)
        dst = b * stride_cb + kh * stride_ch + column * stride_cn + d[None, :]
        tl.store(cache_k_ptr + dst, y, mask=is_k[:, None])
        v = tl.load(src + v_shift * HEAD_DIM + d[None, :], mask=is_k[:, None], other=0.0)
        tl.store(cache_v_ptr + dst, v, mask=is_k[:, None])

else:
    store_top_k = None  # (imported by `llada2_moe_layer.py`'s block router)


# The floating dtypes the routing kernels read logits in and store weights in (float32 arithmetic either way).
ROUTE_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@on_tensor_device
def route(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    top_k: int,
    score_function: str,
    normalize: bool,
    routed_scaling_factor: float,
    weight_dtype: torch.dtype = torch.float32,
    expert_scale: torch.Tensor | None = None,
    summed_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k routing (`LLaDA2MoeGate` after its logits product). logits `(tokens, E)` float32 or half
    precision (widened to float32 in the kernel, as `.float()` would), expert_bias `(E,)` (any float dtype, widened
    to float32 as PyTorch's promotion does) or None -> expert indices `(tokens, top_k)` int64 in descending choice
    score (ties: lowest index first) and weights `(tokens, top_k)` computed in float32 (normalised if `normalize` and
    top_k > 1, times `routed_scaling_factor`, times the chosen experts' `expert_scale` `(E,)` if given, widened to
    float32: DiffusionGemma's `per_expert_scale`) and stored in `weight_dtype` (rounded as `.to(weight_dtype)`
    rounds: LLaDA-MoE's weights in the activations' dtype, without a cast kernel).

    With `summed_logits` `(tokens, E)` (float32 or half precision), logits are `router_partials`' float32 partial
    products `(splits, tokens, E)`: the kernel adds them up (in split order), rounds the sums to summed_logits'
    dtype, stores them there (the router logits) and routes from those rounded logits."""
    if score_function not in ("sigmoid", "softmax"):
        raise ValueError(f"score_function must be 'sigmoid' or 'softmax', got {score_function!r}.")
    if weight_dtype not in ROUTE_WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {ROUTE_WEIGHT_DTYPES}, got {weight_dtype}.")
    splits = 0  # the kernel's SPLITS: 0 reads logits as they are
    if summed_logits is not None:
        if logits.dim() != 3 or logits.dtype != torch.float32:
            raise ValueError(
                f"route: with summed_logits, logits must be float32 partial products (splits, tokens, experts), got "
                f"{logits.dtype} {tuple(logits.shape)}."
            )
        splits = logits.shape[0]
        if summed_logits.shape != logits.shape[1:] or summed_logits.dtype not in ROUTE_WEIGHT_DTYPES:
            raise ValueError(
                f"route: summed_logits must be a {tuple(logits.shape[1:])} tensor of one of {ROUTE_WEIGHT_DTYPES}, "
                f"got {summed_logits.dtype} {tuple(summed_logits.shape)}."
            )
        if not summed_logits.is_contiguous():
            raise ValueError("route: summed_logits must be contiguous (the kernel stores the logits into it).")
    elif logits.dim() != 2:
        raise ValueError(
            f"route: logits must be (tokens, experts), or partial products (splits, tokens, experts) with "
            f"summed_logits, got {tuple(logits.shape)}."
        )
    tokens, n_experts = logits.shape[-2:]
    if n_experts % n_group:
        raise ValueError(f"num_experts ({n_experts}) must be divisible by n_group ({n_group}).")
    if expert_scale is not None and (expert_scale.shape != (n_experts,) or not expert_scale.is_floating_point()):
        raise ValueError(
            f"expert_scale must be a ({n_experts},) floating-point tensor, got {expert_scale.dtype} "
            f"{tuple(expert_scale.shape)}."
        )
    logits = logits.contiguous() if logits.dtype in ROUTE_WEIGHT_DTYPES else logits.contiguous().float()
    index = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    weight = torch.empty(tokens, top_k, dtype=weight_dtype, device=logits.device)
    if tokens == 0:
        return index, weight
    group_size = n_experts // n_group
    bias = expert_bias.contiguous() if expert_bias is not None else logits  # read in its dtype: no cast kernel
    _route_kernel[(tokens,)](
        logits,
        bias,
        expert_scale.contiguous() if expert_scale is not None else logits,
        index,
        weight,
        summed_logits if summed_logits is not None else logits,
        tokens,
        n_experts,
        group_size,
        float(routed_scaling_factor),
        SPLITS=splits,
        SIGMOID=score_function == "sigmoid",
        HAS_BIAS=expert_bias is not None,
        HAS_EXPERT_SCALE=expert_scale is not None,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        NORMALIZE=normalize and top_k > 1,
        BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_S=triton.next_power_of_2(group_size),
        BLOCK_K=triton.next_power_of_2(top_k),
        LIBDEVICE=logits.is_cuda,  # the interpreter (CPU tensors) has no libdevice
        # One warp: its reductions (about thirty per token) are shuffles without a barrier. On an H100, 32 / 1,024
        # tokens: 3.8 / 4.6 us against 5.3 / 8.4 with four warps, the same experts and weights.
        num_warps=1,
        **dependent_launch(),
    )
    return index, weight


# Up to this many (token, choice) pairs the alignment is one kernel with a program per expert, each reading every
# pair twice (a batch-1 block step: 288 pairs, 3.1 us on an H100); beyond, three kernels over chunks of the pairs,
# whose time grows with the pairs and not with the experts times the pairs (a batch-32 step, 9,216 pairs: 23.8 us ->
# 15.0 us; the crossover lies between 2,304 and 4,608 pairs: `benchmarks/bench_llada2_kernels.py`).
SINGLE_PASS_ALIGN_PAIRS = 3072
ALIGN_CHUNK = 128


@on_tensor_device
def align_by_expert(
    topk_index: torch.Tensor, n_experts: int, shared_expert: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs grouped by expert for grouped GEMMs. topk_index `(tokens, top_k)` -> with
    `per_token = top_k + shared_expert` (the shared expert, numbered `n_experts`, as each token's last choice):

    - sorted_token `(tokens * per_token,)` int64: the token of each row, rows in stable expert order (the order
      `argsort(stable=True)` of the pairs' experts gives);
    - offsets `(n_experts + shared_expert,)` int32: each expert's end row (`torch._grouped_mm`'s `offs`);
    - row `(tokens, per_token)` int64: the row of each pair.

    No host synchronisation (CUDA-graph capturable). Two implementations give the same result; the number of pairs
    picks one (`SINGLE_PASS_ALIGN_PAIRS`)."""
    tokens, top_k = topk_index.shape
    per_token = top_k + int(shared_expert)
    if tokens * per_token <= SINGLE_PASS_ALIGN_PAIRS:
        return _align_per_expert(topk_index, n_experts, shared_expert)
    return _align_by_chunks(topk_index, n_experts, shared_expert)


# Up to this many tokens the router's product is `router_partials` (a batch-1 or batch-2 block step of LLaDA-MoE:
# measured on an H200 at 32 tokens only); beyond, cuBLAS's product, which reads the weight once for all tokens.
ROUTER_PRODUCT_MAX_TOKENS = 64
# Tokens and experts per program: tl.dot's least width, so that the most programs share the weight's reading.
ROUTER_PRODUCT_TILE = 16
# Hidden columns per program at least (`router_splits`): a chunk stays one 128-column step of one program.
ROUTER_PRODUCT_MIN_CHUNK = 128


def router_product_applies(tokens: int, max_tokens: int = ROUTER_PRODUCT_MAX_TOKENS) -> bool:
    """Whether `router_partials` takes `tokens` tokens (a model whose router was measured at more passes its own
    `max_tokens`)."""
    return 0 < tokens <= max_tokens


def router_splits(tokens: int, n_experts: int, hidden: int, device: torch.device) -> int:
    """The chunks of the hidden size `router_partials` splits the product into by default: the largest power of two
    that keeps the programs (16 x 16 tiles of experts x tokens, times the chunks) within the multiprocessors and each
    chunk at least `ROUTER_PRODUCT_MIN_CHUNK` columns. LLaDA-MoE-7B's batch-1 block step (32 tokens, 64 experts,
    hidden 2048) on an H200 (132 multiprocessors): 16 chunks of 128 columns, 128 programs (8 without the split,
    5.5 us, each streaming a quarter of the weight, 64 KB, in 8 steps)."""
    tiles = triton.cdiv(n_experts, ROUTER_PRODUCT_TILE) * triton.cdiv(tokens, ROUTER_PRODUCT_TILE)
    splits = 1
    while 2 * splits * tiles <= num_sms(device) and 2 * splits * ROUTER_PRODUCT_MIN_CHUNK <= hidden:
        splits *= 2
    return splits


@on_tensor_device
def router_partials(
    x: torch.Tensor, gate_weight: torch.Tensor, splits: int | None = None, max_tokens: int = ROUTER_PRODUCT_MAX_TOKENS
) -> torch.Tensor:
    """The router logits `x @ gate_weight.T` for few tokens (`router_product_applies`) as float32 partial products
    over `splits` chunks of the hidden size `(splits, tokens, E)` (default `router_splits`), which `route` adds up
    (in chunk order) and rounds as it loads them (its `summed_logits`): the product split over the most programs
    without a second launch, atomics or a zeroed buffer. x `(tokens, H)` and gate_weight `(E, H)` in one
    half-precision dtype; each chunk's product accumulated in float32 (the order of the sums is the kernel's: the
    logits are within float32 rounding of the exact product before their rounding to x's dtype)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or gate_weight.dtype != x.dtype:
        raise ValueError(
            f"router_partials: x and gate_weight must share a half-precision dtype (bfloat16 or float16), got "
            f"{x.dtype} and {gate_weight.dtype}."
        )
    if gate_weight.dim() != 2 or x.dim() != 2 or gate_weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"router_partials: x must be (tokens, hidden) and gate_weight (experts, hidden), got {tuple(x.shape)} and "
            f"{tuple(gate_weight.shape)}."
        )
    (tokens, hidden), n_experts = x.shape, gate_weight.shape[0]
    if not router_product_applies(tokens, max_tokens):
        raise ValueError(
            f"router_partials takes 1 to {max_tokens} tokens, got {tokens}: use the router's own "
            f"product (`router_product_applies` tells which)."
        )
    if splits is None:
        splits = router_splits(tokens, n_experts, hidden, x.device)
    if not isinstance(splits, int) or isinstance(splits, bool) or not 1 <= splits <= hidden:
        raise ValueError(f"router_partials: splits must be an int from 1 to the hidden size {hidden}, got {splits!r}.")
    x, gate_weight = x.contiguous(), gate_weight.contiguous()
    partials = torch.empty(splits, tokens, n_experts, dtype=torch.float32, device=x.device)
    block_t = block_e = ROUTER_PRODUCT_TILE
    block_h, stages = _router_product_tiles(block_t + block_e, x.element_size(), x.device)
    # A chunk in whole steps of at most block_h columns (at least 16: tl.dot's least width).
    block_h = min(block_h, max(16, triton.next_power_of_2(triton.cdiv(hidden, splits))))
    chunk = block_h * triton.cdiv(triton.cdiv(hidden, splits), block_h)
    _router_product_kernel[(triton.cdiv(n_experts, block_e), triton.cdiv(tokens, block_t), splits)](
        x,
        gate_weight,
        partials,
        tokens,
        n_experts,
        hidden,
        chunk,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_H=block_h,
        num_warps=4,
        num_stages=stages,
        **dependent_launch(),
    )
    return partials


def route_by(
    router: torch.nn.Module,
    x: torch.Tensor,
    *routing,
    product_in_kernel: bool = True,
    max_tokens: int = ROUTER_PRODUCT_MAX_TOKENS,
    **route_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route(router(x), *routing, **route_kwargs)` for x `(tokens, hidden)` -> the router logits `(tokens, E)`,
    then `route`'s indices and weights. For few tokens (`router_product_applies` with `max_tokens`) where the router
    is a plain half-precision linear layer (`kernels.plain_half_linear`) and `product_in_kernel`, its product is
    `router_partials`, added up and rounded to x's dtype in `route`'s kernel (which stores the logits): one launch
    fewer than cuBLAS's split-K product and its reduction."""
    tokens = x.shape[0]
    if product_in_kernel and router_product_applies(tokens, max_tokens) and plain_half_linear(router, x):
        logits = x.new_empty(tokens, router.out_features)
        partials = router_partials(x, router.weight, max_tokens=max_tokens)
        return (logits, *route(partials, *routing, summed_logits=logits, **route_kwargs))
    logits = router(x)
    return (logits, *route(logits, *routing, **route_kwargs))


def _router_product_tiles(rows: int, element_size: int, device: torch.device) -> tuple[int, int]:
    """(hidden columns per step, steps in flight) of `router_partials`: the widest tiles and most stages whose
    tiles of `rows` rows (tokens + experts) fit the device's shared memory (16 KB kept for the rest)."""
    if device.type != "cuda":
        return 256, 3
    budget = torch.cuda.get_device_properties(device).shared_memory_per_block_optin - 16 * 1024
    for block_h, stages in ((256, 4), (256, 3), (128, 3), (128, 2), (64, 2)):
        if stages * block_h * rows * element_size <= budget:
            return block_h, stages
    return 32, 1


def _align_outputs(topk_index: torch.Tensor, n_experts: int, shared_expert: bool):
    tokens, top_k = topk_index.shape
    per_token = top_k + int(shared_expert)
    device = topk_index.device
    sorted_token = torch.empty(tokens * per_token, dtype=torch.long, device=device)
    row = torch.empty(tokens, per_token, dtype=torch.long, device=device)
    offsets = torch.empty(n_experts + int(shared_expert), dtype=torch.int32, device=device)
    return sorted_token, offsets, row, per_token


def _align_per_expert(
    topk_index: torch.Tensor, n_experts: int, shared_expert: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_by_expert` as one kernel, one program per expert (each reads all pairs twice)."""
    sorted_token, offsets, row, per_token = _align_outputs(topk_index, n_experts, shared_expert)
    n_pairs = sorted_token.shape[0]
    block = min(1024, max(16, triton.next_power_of_2(n_pairs)))
    _align_kernel[(offsets.shape[0],)](
        topk_index.contiguous(),
        sorted_token,
        row,
        offsets,
        n_pairs,
        per_token,
        n_experts,
        HAS_SHARED=shared_expert,
        BLOCK=block,
        num_warps=4,
        **dependent_launch(),
    )
    return sorted_token, offsets, row


def _align_by_chunks(
    topk_index: torch.Tensor, n_experts: int, shared_expert: bool, scan_rows: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_by_expert` as a counting sort over chunks of `ALIGN_CHUNK` pairs: each chunk's count per expert
    (one program per chunk), their prefix sums over chunks and experts (one program), then each pair's row = its
    expert's first row + that expert's pairs in earlier chunks + those earlier in its chunk (one program per
    chunk). `scan_rows`: chunks per step of the prefix-sum program."""
    sorted_token, offsets, row, per_token = _align_outputs(topk_index, n_experts, shared_expert)
    n_pairs = sorted_token.shape[0]
    bins = triton.next_power_of_2(offsets.shape[0] + 1)  # one bin more than experts, for the pairs past the end
    n_chunks = triton.cdiv(n_pairs, ALIGN_CHUNK)
    topk_index = topk_index.contiguous()
    counts = torch.empty(n_chunks, bins, dtype=torch.int32, device=topk_index.device)
    base = torch.empty(n_chunks + 1, bins, dtype=torch.int32, device=topk_index.device)
    args = (n_pairs, per_token, n_experts)
    _chunk_histogram_kernel[(n_chunks,)](
        topk_index,
        counts,
        *args,
        HAS_SHARED=shared_expert,
        CHUNK=ALIGN_CHUNK,
        BINS=bins,
        num_warps=4,
        **dependent_launch(),
    )
    _chunk_scan_kernel[(1,)](
        counts, base, offsets, n_chunks, offsets.shape[0], BINS=bins, ROWS=scan_rows, num_warps=8, **dependent_launch()
    )
    _chunk_scatter_kernel[(n_chunks,)](
        topk_index,
        base,
        sorted_token,
        row,
        n_pairs,
        n_chunks,
        per_token,
        n_experts,
        HAS_SHARED=shared_expert,
        CHUNK=ALIGN_CHUNK,
        BINS=bins,
        num_warps=4,
        **dependent_launch(),
    )
    return sorted_token, offsets, row


@on_tensor_device
def combine(
    expert_rows: torch.Tensor,
    row: torch.Tensor,
    weight: torch.Tensor,
    shared_expert: bool,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`residual + (sum_k weight[t, k] * expert_rows[row[t, k]] + shared)` with PyTorch's rounding points (the sum in
    `weight`'s dtype, rounded to the rows' dtype; the shared expert's row `row[t, top_k]` added and rounded; the
    residual added and rounded). expert_rows `(pairs, H)`, row `(tokens, per_token)`, weight `(tokens, top_k)`,
    residual `(tokens, H)` or None -> `(tokens, H)` in the rows' dtype."""
    tokens, top_k = weight.shape
    hidden = expert_rows.shape[1]
    out = torch.empty(tokens, hidden, dtype=expert_rows.dtype, device=expert_rows.device)
    if tokens == 0:
        return out
    block = min(2048, triton.next_power_of_2(hidden))
    # Chunks of the hidden size small enough to give every multiprocessor two programs (a batch-1 block step has
    # 32 tokens; on an H100 one program per token was a 6 us kernel), at least 256 columns each.
    while block > 256 and tokens * triton.cdiv(hidden, block) < 2 * num_sms(expert_rows.device):
        block //= 2
    residual = residual.contiguous() if residual is not None else out
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        expert_rows.contiguous(),
        row.contiguous(),
        weight.contiguous(),
        residual,
        out,
        hidden,
        TOP_K=top_k,
        HAS_SHARED=shared_expert,
        HAS_RESIDUAL=residual is not out,
        BLOCK_H=block,
        num_warps=4 if block >= 1024 else 2,
        # No fused multiply-add: PyTorch rounds each product before the sum.
        enable_fp_fusion=False,
        **dependent_launch(),
    )
    return out


@on_tensor_device
def combine_and_norm(
    expert_rows: torch.Tensor,
    row: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`total = combine(expert_rows, row, weight, False, residual)` and `triton_ops.rms_norm(total, norm_weight,
    eps)[0]` in one launch (one program per token; the same values): the MoE layer's output and the next layer's
    normed input. expert_rows `(pairs, H)`, row `(tokens, top_k)`, weight `(tokens, top_k)`, residual `(tokens, H)`,
    norm_weight `(H,)` -> total, normed `(tokens, H)` in the rows' dtype."""
    tokens, top_k = weight.shape
    hidden = expert_rows.shape[1]
    if residual.shape != (tokens, hidden) or norm_weight.shape != (hidden,):
        raise ValueError(
            f"combine_and_norm: residual must be ({tokens}, {hidden}) and norm_weight ({hidden},), got "
            f"{tuple(residual.shape)} and {tuple(norm_weight.shape)}."
        )
    out = torch.empty(tokens, hidden, dtype=expert_rows.dtype, device=expert_rows.device)
    normed = torch.empty_like(out)
    if tokens == 0:
        return out, normed
    block = triton.next_power_of_2(hidden)
    _combine_norm_kernel[(tokens,)](
        expert_rows.contiguous(),
        row.contiguous(),
        weight.contiguous(),
        residual.contiguous(),
        norm_weight.contiguous(),
        out,
        normed,
        hidden,
        float(eps),
        TOP_K=top_k,
        BLOCK_H=block,
        ON_GPU=expert_rows.is_cuda,  # the interpreter (CPU tensors) has no inline assembly (nor fused multiply-adds)
        num_warps=8 if block >= 2048 else 4,  # as `triton_ops.rms_norm`: the same reduction
        **dependent_launch(),
    )
    return out, normed


@on_tensor_device
def qk_norm_rope_to_cache(
    qkv: torch.Tensor,
    n_q_heads: int,
    n_k_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_keys: torch.Tensor,
    cache_values: torch.Tensor,
    cache_position: torch.Tensor,
    projection_heads: tuple[int, int] | None = None,
    first_heads: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """LLaDA2's attention inputs in one launch. qkv `(B, L, (Pq + 2 Pk) * D)` (the fused projection: its Pq query
    heads, Pk key heads, Pk value heads; `projection_heads` = (Pq, Pk), by default (n_q_heads, n_k_heads)), of which
    the query heads `[q0, q0 + n_q_heads)` and the key/value heads `[k0, k0 + n_k_heads)` are used (`first_heads` =
    (q0, k0): under tensor parallelism the projection is gathered whole and each rank takes its own heads, without a
    copy). The per-head RMS norm weights `(D,)` (None: no q/k norm), cos/sin `(B, L, R)` in the activation dtype (R
    the rotary dims), cache_keys/values `(B, n_k_heads, T, D)` (last dim contiguous, equal strides), cache_position
    `(L,)`. Writes the normed, rotated keys and the values into the cache at those columns and returns the normed,
    rotated queries `(B, n_q_heads, L, D)` contiguous."""
    batch, seq_len, width = qkv.shape
    all_q, all_k = (n_q_heads, n_k_heads) if projection_heads is None else projection_heads
    q_first, k_first = first_heads
    if not (0 <= q_first and q_first + n_q_heads <= all_q and 0 <= k_first and k_first + n_k_heads <= all_k):
        raise ValueError(
            f"qk_norm_rope_to_cache: first_heads {tuple(first_heads)} with n_q_heads {n_q_heads} and n_k_heads "
            f"{n_k_heads} select query heads [{q_first}, {q_first + n_q_heads}) and key/value heads "
            f"[{k_first}, {k_first + n_k_heads}), which must lie within projection_heads ({all_q}, {all_k})."
        )
    if width % (all_q + 2 * all_k):
        raise ValueError(
            f"qk_norm_rope_to_cache: qkv's last dim {width} is not a multiple of its {all_q + 2 * all_k} heads "
            f"(projection_heads ({all_q}, {all_k}))."
        )
    head_dim = width // (all_q + 2 * all_k)
    rotary_dim = cos.shape[-1]
    if head_dim & (head_dim - 1) or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"qk_norm_rope_to_cache: head_dim {head_dim} must be a power of 2 >= rotary_dim {rotary_dim}.")
    qkv = qkv.contiguous()
    cos = cos.to(qkv.dtype).expand(batch, seq_len, rotary_dim).contiguous()
    sin = sin.to(qkv.dtype).expand(batch, seq_len, rotary_dim).contiguous()
    q_out = torch.empty(batch, n_q_heads, seq_len, head_dim, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm_weight is not None
    block_h = 4
    _qk_norm_rope_kernel[(batch * seq_len, triton.cdiv(n_q_heads + n_k_heads, block_h))](
        qkv,
        q_norm_weight if has_norm else qkv,
        k_norm_weight if has_norm else qkv,
        cos,
        sin,
        q_out,
        cache_keys,
        cache_values,
        cache_position,
        seq_len,
        n_q_heads,
        n_k_heads,
        all_q + 2 * all_k,
        q_first,
        all_q + k_first,
        all_k,
        rotary_dim,
        float(eps),
        cache_keys.stride(0),
        cache_keys.stride(1),
        cache_keys.stride(2),
        HEAD_DIM=head_dim,
        HAS_NORM=has_norm,
        BLOCK_H=block_h,
        num_warps=4 if head_dim <= 128 else 8,
        # No fused multiply-add: PyTorch rounds each product.
        enable_fp_fusion=False,
        **dependent_launch(),
    )
    return q_out
