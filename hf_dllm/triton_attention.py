"""Triton attention for the cached block step: a few queries (the block) against the whole cached sequence.

A dual-cache step (Fast-dLLM arXiv:2505.22618, Sec. 3.2) asks for attention of `L` (e.g. 32) query positions per
head against `T` (prompt + generated, e.g. 768) cached keys, bidirectional, with a key padding mask for left-padded
rows. With one program per (row, head), a batch-1 step keeps only `heads` programs busy on a 132-SM GPU, each
streaming the whole K/V of its head. This kernel splits the keys into chunks (flash-decoding): each program
computes a partial softmax over one chunk for all queries of a key/value head (grouped-query heads share the
K/V load), and the chunks are merged with their log-sum-exp. With enough programs, one split is used and the kernel
writes the output directly.

The merge runs in the attention kernel itself (split-K's "last program merges", as stream-K GEMMs fix up their
tiles, Osama et al. arXiv:2301.03598): each split program writes its partial output and log-sum-exp, then counts
itself in an int32 counter per (row, key/value head, row tile) with an acquire-release atomic; the program that
counts last reads every split's partials and writes the output, and sets the counter back to zero, so the next
launch (and every replay of a CUDA graph) finds it at zero. The counters are one zeroed buffer per device, allocated
once and kept (`merge_counters`): no launch per call (a first call inside a CUDA graph capture, before any outside
it, merges in a second kernel: a buffer zeroed inside a capture is zero only once the graph replays). Launches on one
device share it, which is safe because a stream runs its kernels in order; they must not run on two streams at once.
`AttentionTiles.fold_merge=False` merges in a second kernel always, with the same operations (the outputs are equal
bit for bit).

Shapes: q `(B, Hq, Lq, D)`, k/v `(B, Hkv, T, D)`, key padding `(B, T)` bool (True = attend), output
`(B, Lq, Hq, D)`. Scores, softmax statistics and accumulation in float32; the probabilities are cast to the value
dtype for the second product, as FlashAttention does.

This file is exported as Hub remote code: Triton is imported inside `try:`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .triton_ops import TRITON_AVAILABLE, dependent_launch, on_tensor_device, tl, triton  # None: CPU-only

if TRITON_AVAILABLE:
    from .triton_ops import wait_for_previous_kernel

    @triton.jit
    def _attend_tile(
        q, k_base, v_base, k_scale_ptr, v_scale_ptr, scale_base, mask_ptr, cols, col_valid, q_pos, row_valid, b,
        stride_kn, stride_vn, stride_mb, stride_mq, dims, score_scale, m_i, l_i, acc,
        HAS_MASK: tl.constexpr, HAS_KV_SCALE: tl.constexpr, MASK_PER_QUERY: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # One key tile of the online softmax (FlashAttention's loop body): the running max `m_i`, sum `l_i` and
        # float32 accumulator `acc` of a row tile, updated.
        k = tl.load(k_base + cols[:, None] * stride_kn + dims[None, :], mask=col_valid[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :], mask=col_valid[:, None], other=0.0)
        if HAS_KV_SCALE:
            # An FP8 cache: float8 K/V (exact in fp16 and float32) with a float32 scale per key, applied to the
            # scores' columns and to the probabilities, not to the tiles.
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            k_scale = tl.load(k_scale_ptr + scale_base + cols, mask=col_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_base + cols, mask=col_valid, other=0.0)
        attend = col_valid[None, :]
        if HAS_MASK:
            if MASK_PER_QUERY:
                # A mask with a query dimension (block-causal): one row per query position.
                attend = attend & (
                    tl.load(
                        mask_ptr + b * stride_mb + q_pos[:, None] * stride_mq + cols[None, :],
                        mask=row_valid[:, None] & col_valid[None, :],
                        other=0,
                    )
                    != 0
                )
            else:
                attend = attend & (tl.load(mask_ptr + b * stride_mb + cols, mask=col_valid, other=0) != 0)[None, :]
        # float32 inputs are multiplied in full float32 (tl.dot would use TF32 tensor cores: ~1e-3 relative error,
        # enough to flip near-tied tokens against an fp32 reference); bf16/fp16 use the tensor cores as usual.
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * score_scale
        else:
            scores = tl.dot(q, tl.trans(k)) * score_scale
        if HAS_KV_SCALE:
            scores = scores * k_scale[None, :]
        scores = tl.where(attend, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A chunk whose keys are all padding keeps m at -inf: shift by 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if HAS_KV_SCALE:
            # Each key's value scale relative to the tile's largest, so the weights stay in [0, 1] (fp16-safe,
            # as FlashAttention's probabilities); the largest multiplies the tile's product.
            v_max = tl.max(v_scale, axis=0)
            v_max = tl.where(v_max > 0, v_max, 1.0)
            weights = (p * (v_scale / v_max)[None, :]).to(v.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + v_max * tl.dot(weights, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + v_max * tl.dot(weights, v)
        elif IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _split_weight(weights, splits, s):
        # Column `s` of `weights` (R, BLOCK_S), exactly: every other term of the sum is zero.
        return tl.sum(tl.where(splits[None, :] == s, weights, 0.0), axis=1)

    @triton.jit
    def _merge_splits(
        part_ptr, lse_ptr, rows, row_valid, n_splits, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        # The output of rows `rows` (R,) (`(b * Hq + head) * Lq + q_pos`) from their `n_splits` partial outputs and
        # log-sum-exps: softmax weights of the log-sum-exps, then the weighted sum of the partials. Both sums run
        # split by split in order (unrolled): an order that does not depend on the tile's layout or the launch's
        # warps (`tl.sum`'s does), so the merge in the attention kernel and in `_combine_splits_kernel` give the
        # same bits. The loads go to L2 (".cg"): partials another multiprocessor wrote in this launch are never
        # read from a stale L1 line.
        splits = tl.arange(0, BLOCK_S)
        split_valid = splits < n_splits
        lse = tl.load(
            lse_ptr + rows[:, None] * n_splits + splits[None, :],
            mask=row_valid[:, None] & split_valid[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )
        lse = tl.where(row_valid[:, None], lse, 0.0)  # a tile's rows past the last: finite, never stored
        lse_max = tl.max(lse, axis=1)
        weights = tl.where(split_valid[None, :], tl.exp(lse - lse_max[:, None]), 0.0)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        for s in tl.static_range(BLOCK_S):
            total += _split_weight(weights, splits, s)
        weights = weights / total[:, None]
        dims = tl.arange(0, HEAD_DIM)
        out = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
        for s in tl.static_range(BLOCK_S):
            part = tl.load(
                part_ptr + (rows[:, None] * n_splits + s) * HEAD_DIM + dims[None, :],
                mask=row_valid[:, None] & (tl.full([1, 1], s, tl.int32) < n_splits),  # (a tensor: the interpreter)
                other=0.0,
                cache_modifier=".cg",
            )
            out += part * _split_weight(weights, splits, s)[:, None]
        return out

    @triton.jit
    def _merge_row_tile(
        part_ptr, lse_ptr, out_ptr, b, kv_head, m_tile, n_kv_heads, n_rep, q_len, n_splits, stride_ob, stride_om,
        stride_oh, BLOCK_M: tl.constexpr, MERGE_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        # The output of an attention program's row tile from its splits' partials, MERGE_ROWS rows at a time (the
        # merge's registers bounded: the tile's loop keeps its own).
        dims = tl.arange(0, HEAD_DIM)
        for chunk in range(BLOCK_M // MERGE_ROWS):
            rows = m_tile * BLOCK_M + chunk * MERGE_ROWS + tl.arange(0, MERGE_ROWS)
            row_valid = rows < n_rep * q_len
            head = kv_head * n_rep + rows // q_len
            q_pos = rows % q_len
            row_index = (b * (n_kv_heads * n_rep) + head) * q_len + q_pos
            out = _merge_splits(part_ptr, lse_ptr, row_index, row_valid, n_splits, MERGE_ROWS, BLOCK_S, HEAD_DIM)
            out_ptrs = out_ptr + b * stride_ob + q_pos[:, None] * stride_om + head[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])

    @triton.jit
    def _block_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        mask_ptr,
        out_ptr,
        part_ptr,
        lse_ptr,
        counter_ptr,
        kv_end_ptr,
        gap_ptr,
        k_scale_ptr,
        v_scale_ptr,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_sb,
        stride_sh,
        stride_mb,
        stride_mq,
        stride_ob,
        stride_om,
        stride_oh,
        n_kv_heads,
        n_rep,
        q_len,
        kv_len,
        n_splits,
        scale,
        TILES_PER_SPLIT: tl.constexpr,
        HAS_MASK: tl.constexpr,
        HAS_KV_END: tl.constexpr,
        HAS_GAP: tl.constexpr,
        HAS_KV_SCALE: tl.constexpr,
        MASK_PER_QUERY: tl.constexpr,
        SKIP_MASKED: tl.constexpr,
        SINGLE_SPLIT: tl.constexpr,
        FOLD_MERGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_S: tl.constexpr,
        MERGE_ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        wait_for_previous_kernel()
        split = tl.program_id(0)
        batch_head = tl.program_id(1)
        m_tile = tl.program_id(2)
        b = (batch_head // n_kv_heads).to(tl.int64)
        kv_head = (batch_head % n_kv_heads).to(tl.int64)

        # Rows of this tile: the (query head in the group, query position) pairs of one key/value head.
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < n_rep * q_len
        head = kv_head * n_rep + rows // q_len
        q_pos = rows % q_len
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + b * stride_qb + head[:, None] * stride_qh + q_pos[:, None] * stride_qm + dims[None, :],
            mask=row_valid[:, None],
            other=0.0,
        )

        # A chunk is TILES_PER_SPLIT key tiles (a power of two, so few variants get compiled). Keys from the row's
        # `kv_end` on are masked for every query (a block-causal step's later blocks): their tiles are never read.
        start = split * (TILES_PER_SPLIT * BLOCK_N)
        n_tiles = TILES_PER_SPLIT
        if HAS_KV_END:
            n_tiles = tl.minimum(n_tiles, tl.maximum(tl.cdiv(tl.load(kv_end_ptr + b) - start, BLOCK_N), 0))
        # A gap (a static cache's unwritten slots [gap_start, gap_end), masked for every query): the chunks split the
        # keys outside it, evenly in whole tiles, read through the index k -> k + gap length from gap_start on.
        gap_start = 0
        gap_length = 0
        kv_keys = kv_len
        if HAS_GAP:
            gap_start = tl.load(gap_ptr + 2 * b)
            gap_length = tl.load(gap_ptr + 2 * b + 1) - gap_start
            kv_keys = kv_len - gap_length
            key_tiles = tl.cdiv(kv_keys, BLOCK_N)
            per_split = tl.cdiv(key_tiles, n_splits)
            start = split * per_split * BLOCK_N
            n_tiles = tl.minimum(tl.maximum(key_tiles - split * per_split, 0), per_split)
        # An FP8 cache with half-precision queries: the products run in fp16, to which float8 converts in one
        # instruction per two values (to bf16 it takes several: at batch 32 the conversions cost more than the
        # bytes saved). The queries are scaled by a power of two into fp16's range (1 unless |q| > 32768) and
        # the scores scaled back; fp16 holds bf16's 8 significant bits.
        score_scale = scale
        if HAS_KV_SCALE and not IEEE:
            q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
            q_shift = tl.where(q_max > 32768.0, tl.exp2(tl.ceil(tl.log2(q_max / 32768.0))), 1.0)
            q = (q.to(tl.float32) / q_shift).to(tl.float16)
            score_scale = scale * q_shift
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        k_base = k_ptr + b * stride_kb + kv_head * stride_kh
        v_base = v_ptr + b * stride_vb + kv_head * stride_vh
        scale_base = b * stride_sb + kv_head * stride_sh
        for tile in range(n_tiles):
            cols = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
            col_valid = cols < kv_keys
            if HAS_GAP:
                cols = tl.where(cols >= gap_start, cols + gap_length, cols)
            if SKIP_MASKED:
                # A key padding mask: a tile whose keys are all masked (a ring cache's empty slots, left padding)
                # adds nothing (p = 0, m unchanged), so its K/V are not read at all.
                key_ok = tl.load(mask_ptr + b * stride_mb + cols, mask=col_valid, other=0) != 0
                if tl.max(key_ok.to(tl.int32), axis=0) > 0:
                    m_i, l_i, acc = _attend_tile(
                        q, k_base, v_base, k_scale_ptr, v_scale_ptr, scale_base, mask_ptr, cols, col_valid & key_ok,
                        q_pos, row_valid, b, stride_kn, stride_vn, stride_mb, stride_mq, dims, score_scale, m_i, l_i,
                        acc, False, HAS_KV_SCALE, False, IEEE,
                    )  # fmt: skip
            else:
                m_i, l_i, acc = _attend_tile(
                    q, k_base, v_base, k_scale_ptr, v_scale_ptr, scale_base, mask_ptr, cols, col_valid, q_pos,
                    row_valid, b, stride_kn, stride_vn, stride_mb, stride_mq, dims, score_scale, m_i, l_i, acc,
                    HAS_MASK, HAS_KV_SCALE, MASK_PER_QUERY, IEEE,
                )  # fmt: skip

        if SINGLE_SPLIT:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_ptrs = out_ptr + b * stride_ob + q_pos[:, None] * stride_om + head[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        else:
            # Partial results, layout (B, Hq, Lq, n_splits, D) and (B, Hq, Lq, n_splits), contiguous.
            row_index = (b * (n_kv_heads * n_rep) + head) * q_len + q_pos
            lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            part = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(lse_ptr + row_index * n_splits + split, lse, mask=row_valid)
            part_ptrs = part_ptr + (row_index[:, None] * n_splits + split) * HEAD_DIM + dims[None, :]
            tl.store(part_ptrs, part, mask=row_valid[:, None])
            if FOLD_MERGE:
                # Every thread's stores issued before one thread counts (the barrier orders them before its
                # release); the last of the tile's splits to count acquires them all and merges.
                tl.debug_barrier()
                counter = counter_ptr + batch_head * tl.num_programs(2) + m_tile
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
                    _merge_row_tile(
                        part_ptr, lse_ptr, out_ptr, b, kv_head, m_tile, n_kv_heads, n_rep, q_len, n_splits,
                        stride_ob, stride_om, stride_oh, BLOCK_M, MERGE_ROWS, BLOCK_S, HEAD_DIM,
                    )  # fmt: skip
                    tl.store(counter, 0)  # every split has counted: nothing else touches it in this launch

    @triton.jit
    def _combine_splits_kernel(
        part_ptr,
        lse_ptr,
        out_ptr,
        n_heads,
        q_len,
        n_splits,
        stride_ob,
        stride_om,
        stride_oh,
        BLOCK_S: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        # The merge as a second launch (`AttentionTiles.fold_merge=False`), one program per row.
        wait_for_previous_kernel()
        rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # (b * n_heads + head) * q_len + q_pos
        q_pos = rows % q_len
        head = (rows // q_len) % n_heads
        b = rows // (q_len * n_heads)
        out = _merge_splits(part_ptr, lse_ptr, rows, rows >= 0, n_splits, 1, BLOCK_S, HEAD_DIM)
        dims = tl.arange(0, HEAD_DIM)
        out_ptrs = out_ptr + (b * stride_ob + q_pos * stride_om + head * stride_oh)[:, None] + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class AttentionTiles:
    """Tile shape of `_block_attention_kernel`: `block_m` query rows (grouped heads x positions) by `block_n` keys
    per step, the launch's warps and pipeline stages, and `one_split_from`: from this many (row, key/value head, row
    tile) programs per multiprocessor on, the keys are not split (None: always as `plan_splits` plans). `splits`:
    key chunks to ask for (None: `plan_splits`'s, from the multiprocessor count). `skip_masked`: with a key padding
    mask `(B, T)`, test each key tile's mask first and skip the tiles it masks whole (a ring cache's empty slots),
    at the price of a branch in the loop (its K/V loads are not pipelined across it). `even_splits`: the key chunks
    as even as whole tiles allow (`key_chunks`), each length compiled apart, rather than a power of two of tiles
    each (few variants compiled, but 1,279 keys asked in 4 chunks of 64-key tiles run as 3 chunks of 8 tiles).
    `fold_merge`: with several splits, the last split program of each row tile merges them (one launch); False: a
    second kernel does (two launches, the same output bits; more than `MAX_FOLDED_SPLITS` splits always do)."""

    block_m: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    one_split_from: float | None = None
    splits: int | None = None
    skip_masked: bool = False
    even_splits: bool = False
    fold_merge: bool = True


# Grouped-query blocks (more than 32 query rows per key/value head: LLaDA2.0-mini's 4 heads x 32 positions).
# Measured on an H100 at its block step (`benchmarks/bench_llada2_kernels.py --attention-sweep`; 768 cached keys,
# 544 visible, `kv_end` given): 8.6 / 17.8 / 19.0 / 24.7 us per layer at batch 1 / 8 / 16 / 32, against 10.8 /
# 19.5 / 37.9 / 71.7 with the tiles of smaller groups and sdpa's 31.6 / 35.0 / 41.2 / 57.0. Splitting the keys
# stops paying once the programs fill half the GPU (batch 16: 19.0 us with one split against 27.3 with three).
GROUPED_QUERY_TILES = AttentionTiles(block_m=64, block_n=32, num_warps=4, num_stages=3, one_split_from=0.5)


def default_tiles(rows: int) -> AttentionTiles:
    """The tile shape for `rows` query rows per key/value head: up to 32 (LLaDA's block of 32, one head per group)
    the smallest row tile that holds them, beyond `GROUPED_QUERY_TILES`."""
    if rows <= 32:
        return AttentionTiles(block_m=16 if rows <= 16 else 32)
    return GROUPED_QUERY_TILES


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Multiprocessors of `device` (asked once: the attention dispatch reads it every layer of every forward)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def plan_splits(
    batch: int,
    n_kv_heads: int,
    m_tiles: int,
    kv_len: int,
    block_n: int,
    n_sms: int,
    one_split_from: float | None = None,
) -> int:
    """Number of key chunks: enough programs for ~2 waves of the GPU, each chunk at least two key tiles; one chunk
    from `one_split_from` programs per multiprocessor on (`AttentionTiles`)."""
    programs = batch * n_kv_heads * m_tiles
    if one_split_from is not None and programs >= one_split_from * n_sms:
        return 1
    max_splits = max(1, kv_len // (2 * block_n))
    return max(1, min(max_splits, math.ceil(2 * n_sms / programs)))


def key_chunks(kv_len: int, n_splits: int, block_n: int, even: bool = False) -> tuple[int, int]:
    """(key tiles per chunk, chunks) for `kv_len` keys asked in `n_splits` chunks of `block_n`-key tiles: the tiles
    per chunk rounded up to a power of two (few kernel variants; fewer chunks may follow), or with `even` the least
    whole number of tiles that `n_splits` chunks cover the keys with."""
    per_chunk = -(-kv_len // n_splits)  # ceil(kv_len / n_splits) keys
    tiles = -(-per_chunk // block_n)
    if not even:
        tiles = 1 << (tiles - 1).bit_length()
    return tiles, -(-kv_len // (tiles * block_n))


# The most key splits the attention kernel merges itself (`AttentionTiles.fold_merge`); more (a batch of few
# key/value heads over thousands of keys) merge in a second kernel. The merge is unrolled over the splits: at 64,
# its loads spill registers (ptxas, sm_90, Triton 3.6: ~1 KB a thread at LLaDA-MoE's and LLaDA2.0-mini's tiles).
MAX_FOLDED_SPLITS = 32

# Counters of the kernels whose last program merges (the folded merge, `triton_linear`'s split-K sums), per device
# and owner: zeroed once, kept at zero by the kernels. A buffer outgrown by a larger grid stays referenced, since a
# captured CUDA graph may still replay on it.
_MERGE_COUNTERS: dict[tuple[torch.device, int | None], list[torch.Tensor]] = {}


def merge_counters(device: torch.device, size: int, owner: int | None = None) -> torch.Tensor | None:
    """At least `size` int32 counters on `device`, all zero between launches (`_block_attention_kernel` and
    `triton_linear._dense_rows_kernel` reset each counter they use): allocated once (4096, or the next power of two
    above `size`), not cleared per call. `owner` (e.g. a weight's address) gives a caller counters of its own: kernels
    that may run at once on two streams must not share them. None where they would have to be allocated inside a
    CUDA graph capture: the zeroing would be captured, not run, and the buffer would hold garbage until the graph's
    first replay (the caller then runs its other path)."""
    buffers = _MERGE_COUNTERS.setdefault((device, owner), [])
    if not buffers or buffers[-1].numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffers.append(torch.zeros(max(4096, triton.next_power_of_2(size)), dtype=torch.int32, device=device))
    return buffers[-1]


@on_tensor_device
def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    n_splits: int | None = None,
    kv_end: torch.Tensor | None = None,
    tiles: AttentionTiles | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key_gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional attention of `q` `(B, Hq, Lq, D)` over `k`, `v` `(B, Hkv, T, D)`.

    `key_padding_mask` `(B, T)` (True/1 = real key) masks padded keys; a `(B, Lq, T)` mask gives each query
    position its own keys (LLaDA2's block-causal mask; every query must see at least one key). `kv_end` `(B,)`
    int32, optional: every key from `kv_end[b]` on is masked for every query of row `b` (the mask must say so too);
    those key tiles are skipped. `key_gap` `(B, 2)` int32, optional: keys `key_gap[b, 0]` to `key_gap[b, 1] - 1` are
    masked for every query of row `b` (the mask must say so too: a static cache's unwritten slots); the chunks split
    the other keys (evenly, in whole tiles) and never read those. `tiles`: the tile shape (default `default_tiles`;
    its `splits` where `n_splits` is None, `skip_masked` with a `(B, T)` mask). Returns `(B, Lq, Hq, D)` in q's
    dtype.

    An FP8 cache (`cache.FP8DiffusionKVCache`): k/v float8 e4m3 and `k_scale`/`v_scale` `(B, Hkv, T)` float32 with
    equal strides, the last dim contiguous: key `j` is `k[..., j, :] * k_scale[..., j]`, and likewise the values,
    read in place (half the bytes of bfloat16 K/V).
    """
    batch, n_heads, q_len, dim = q.shape
    if kv_end is not None and (kv_end.dtype != torch.int32 or kv_end.shape != (batch,)):
        raise ValueError(
            f"`kv_end` must be an int32 tensor of shape ({batch},), got {kv_end.dtype} {tuple(kv_end.shape)}."
        )
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    if key_gap is not None:
        if key_gap.dtype != torch.int32 or key_gap.shape != (batch, 2) or key_gap.device != q.device:
            raise ValueError(
                f"`key_gap` must be an int32 tensor of shape ({batch}, 2) on {q.device}, got {key_gap.dtype} "
                f"{tuple(key_gap.shape)} on {key_gap.device}."
            )
        if kv_end is not None:
            raise ValueError("Pass `key_gap` or `kv_end`, not both.")
        key_gap = key_gap.contiguous()
    scaled = k_scale is not None
    if scaled and (
        v_scale is None
        or k.dtype != torch.float8_e4m3fn
        or v.dtype != torch.float8_e4m3fn
        or k_scale.shape != (batch, n_kv_heads, kv_len)
        or k_scale.stride() != v_scale.stride()
        or k_scale.stride(-1) != 1
    ):
        raise ValueError(
            "FP8 K/V need float8_e4m3fn k and v with k_scale/v_scale of shape (B, Hkv, T), equal strides and the "
            f"last dim contiguous; got k {k.dtype}, v {v.dtype}, k_scale "
            f"{None if k_scale is None else tuple(k_scale.shape)}, v_scale {None if v_scale is None else 'given'}."
        )
    if not scaled and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise ValueError(f"k and v must have q's dtype {q.dtype} (or be FP8 with scales), got {k.dtype}, {v.dtype}.")
    n_rep = n_heads // n_kv_heads
    scale = dim**-0.5 if scale is None else scale
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    rows = n_rep * q_len
    if tiles is None:
        tiles = default_tiles(rows)
    block_m, block_n = tiles.block_m, tiles.block_n
    m_tiles = triton.cdiv(rows, block_m)
    if n_splits is None:
        n_splits = tiles.splits
    if n_splits is not None and n_splits < 1:
        raise ValueError(f"`n_splits` (or `tiles.splits`) must be a positive int or None, got {n_splits}.")
    if n_splits is None:
        n_splits = plan_splits(batch, n_kv_heads, m_tiles, kv_len, block_n, num_sms(q.device), tiles.one_split_from)
    tiles_per_split, n_splits = key_chunks(kv_len, n_splits, block_n, tiles.even_splits)

    out = torch.empty(batch, q_len, n_heads, dim, dtype=q.dtype, device=q.device)
    per_query = key_padding_mask is not None and key_padding_mask.dim() == 3
    if key_padding_mask is not None:
        # A boolean mask is read as bytes in place (no cast kernel); other dtypes are converted.
        if key_padding_mask.dtype == torch.bool:
            mask = key_padding_mask.view(torch.int8)
        else:
            mask = key_padding_mask.to(torch.int8)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    else:
        mask = out  # never read
    single = n_splits == 1
    counters = None
    if tiles.fold_merge and 1 < n_splits <= MAX_FOLDED_SPLITS:
        counters = merge_counters(q.device, batch * n_kv_heads * m_tiles)
    fold = counters is not None
    if single:
        part = lse = out  # never written
    else:
        part = torch.empty(batch, n_heads, q_len, n_splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, n_heads, q_len, n_splits, dtype=torch.float32, device=q.device)
    block_s = max(2, triton.next_power_of_2(n_splits))
    # The folded merge's rows at a time: 32 float32 values of the output tile per thread.
    merge_rows = min(block_m, max(1, 32 * 32 * tiles.num_warps // dim))
    _block_attention_kernel[(n_splits, batch * n_kv_heads, m_tiles)](
        q,
        k,
        v,
        mask,
        out,
        part,
        lse,
        counters if fold else out,  # never touched unfolded
        out if kv_end is None else kv_end,
        out if key_gap is None else key_gap,
        k_scale if scaled else out,  # never read without HAS_KV_SCALE
        v_scale if scaled else out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        k_scale.stride(0) if scaled else 0,
        k_scale.stride(1) if scaled else 0,
        mask.stride(0) if key_padding_mask is not None else 0,
        mask.stride(1) if per_query else 0,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        n_kv_heads,
        n_rep,
        q_len,
        kv_len,
        n_splits,
        scale,
        TILES_PER_SPLIT=tiles_per_split,
        HAS_MASK=key_padding_mask is not None,
        HAS_KV_END=kv_end is not None,
        HAS_GAP=key_gap is not None,
        HAS_KV_SCALE=scaled,
        MASK_PER_QUERY=per_query,
        SKIP_MASKED=tiles.skip_masked and key_padding_mask is not None and not per_query,
        SINGLE_SPLIT=single,
        FOLD_MERGE=fold,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_S=block_s if fold else 2,  # (unfolded: one compiled kernel whatever the splits)
        MERGE_ROWS=merge_rows,
        HEAD_DIM=dim,
        IEEE=q.dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **dependent_launch(),
    )
    if not single and not fold:
        _combine_splits_kernel[(batch * n_heads * q_len,)](
            part,
            lse,
            out,
            n_heads,
            q_len,
            n_splits,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            BLOCK_S=block_s,
            HEAD_DIM=dim,
            num_warps=1 if dim <= 64 else 2,
            **dependent_launch(),
        )
    return out
