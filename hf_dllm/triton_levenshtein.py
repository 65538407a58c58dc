"""LLaDA2.2's Levenshtein editing step (`levenshtein_editing.LevenshteinEditing.step`) after its greedy candidates,
as one Triton kernel: one program per row.

Why: the step's bookkeeping (M2T / T2T selection, the anti-loop's past contents and per-index history, DELETE /
SPLIT's shifts, the counters) is ~160 tiny PyTorch kernels per step on a block of 32; inside a CUDA graph each
costs its run time plus a launch gap, ~0.4 ms per step on an H200 at the LLaDA2.0-mini shape, more than the whole
difference to LLaDA2.1's token editing. Here it is one launch after `triton_ops.edit_candidates`' two.

The kernel is integer and boolean logic on the same candidate tokens and probabilities as the PyTorch step, so
its results are bit-identical to it (tokens, flags, every state buffer, the totals): the ranks of
`decoding.rank_by_confidence` (stable descending sort: NaN first, ties to the lower position) by a B x B
comparison, `torch.argmin`'s choice (the first NaN, else the first minimum), the anti-loop's argmax over the
vocabulary (first index on ties, index 0 when everything is excluded) read only in a row where the anti-loop fires
(NaN logits there are the one input where the two may differ: torch.argmax picks a NaN, Triton's max need not).
The PyTorch step stays the reference and the path off CUDA (`kernels.use_fused_kernels`).

This file is exported as Hub remote code (relative imports only; Triton comes from `triton_ops.py`'s `try:`).
"""

from __future__ import annotations

import torch

from .triton_ops import TRITON_AVAILABLE, dependent_launch, on_tensor_device, tl, triton

# Columns of the chosen position's logits the anti-loop's argmax reads at once (fewer for a smaller vocabulary).
LEVENSHTEIN_VOCAB_BLOCK = 4096

if TRITON_AVAILABLE:
    from .triton_ops import wait_for_previous_kernel

    @triton.jit
    def _count(flags):
        # Number of true entries of a boolean vector.
        return tl.sum(flags.to(tl.int32), axis=0)

    @triton.jit
    def _count_rows(flags):
        # Number of true entries in each row of a boolean tile.
        return tl.sum(flags.to(tl.int32), axis=1)

    @triton.jit
    def _edit_operations(new, old, orig, generated, valid, cols, mask_id, delete_id, split_id, BLOCK_B: tl.constexpr):
        # `levenshtein_editing.apply_edit_operations` on one row: the emitted tokens' slots by an exclusive cumsum,
        # each output position j takes the token and flag of the (at most one) emission landing on it, MASK and
        # false where none does (the padding of a row that lost tokens).
        deleted = generated & (new == delete_id)
        split = generated & (new == split_id)
        emitted = tl.where(valid, tl.where(deleted, 0, tl.where(split, 2, 1)), 0)
        start = tl.cumsum(emitted, axis=0) - emitted
        dump = 2 * BLOCK_B  # past every output position: what emits nothing
        first_slot = tl.where(emitted > 0, start, dump)
        second_slot = tl.where(split, start + 1, dump)
        first_token = tl.where(split, mask_id, tl.where(generated, new, old))
        first_flag = orig & ~split
        first = first_slot[None, :] == cols[:, None]  # [output j, source i]
        second = second_slot[None, :] == cols[:, None]
        tokens = tl.sum(tl.where(first, first_token[None, :], 0) + tl.where(second, old[None, :], 0), axis=1)
        landed = tl.sum((first | second).to(tl.int32), axis=1) > 0
        tokens = tl.where(landed, tokens, mask_id)
        flags = tl.sum(((first & first_flag[None, :]) | (second & orig[None, :])).to(tl.int32), axis=1) > 0
        indel = _count(deleted | split) > 0
        return tl.where(indel, tokens, new), tl.where(indel, flags, orig)

    @triton.jit
    def _resample(logits_row, stride_vocab, vocab, history, history_valid, no_mask, mask_id, BLOCK_V: tl.constexpr):
        # The anti-loop's token: argmax over the vocabulary (first index on ties) of the chosen position's logits
        # without the tokens of its history (and without MASK where `no_mask`); 0 when all of them are -inf (as
        # torch.argmax). Only a chunk whose best beats the running best is checked against the history: its winner,
        # while excluded, is taken out and the chunk's argmax taken again (a handful of reductions at most, instead
        # of comparing every column with the whole history).
        best = tl.full([], float("-inf"), tl.float32)
        best_index = tl.full([], 0, tl.int64)
        for start in range(0, vocab, BLOCK_V):
            index = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_row + index.to(tl.int64) * stride_vocab, mask=index < vocab, other=float("-inf"))
            x = tl.where(no_mask & (index == mask_id), float("-inf"), x.to(tl.float32))
            top, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            if top > best:
                excluded = _count(history_valid & (history == start + at)) > 0
                while excluded & (top > best):
                    x = tl.where(index == start + at, float("-inf"), x)
                    top, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
                    excluded = _count(history_valid & (history == start + at)) > 0
                better = top > best  # then the winner is not excluded
                best = tl.where(better, top, best)
                best_index = tl.where(better, start + at.to(tl.int64), best_index)
        return best_index

    @triton.jit
    def _levenshtein_step_kernel(
        block_ptr,
        generated_ptr,
        tokens_ptr,
        probs_ptr,
        logits_ptr,
        orig_ptr,
        started_ptr,
        updates_ptr,
        post_ptr,
        finished_ptr,
        seen_ptr,
        seen_count_ptr,
        hist_ptr,
        totals_ptr,
        new_ptr,
        new_orig_ptr,
        edited_ptr,
        length,
        depth,
        vocab,
        stride_block,
        stride_generated,
        stride_logits_row,
        stride_logits_position,
        stride_logits_vocab,
        threshold,
        editing_threshold,
        post_limit,
        mask_id,
        delete_id,
        split_id,
        HAS_TOTALS: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # One program per row; the numbered steps are `LevenshteinEditing.step`'s.
        wait_for_previous_kernel()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_B)
        valid = cols < length
        block = tl.load(block_ptr + row * stride_block + cols, mask=valid, other=0)
        generated = tl.load(generated_ptr + row * stride_generated + cols, mask=valid, other=0) != 0
        live = tl.load(finished_ptr + row) == 0
        started = tl.load(started_ptr + row) != 0
        state_orig = tl.load(orig_ptr + row * length + cols, mask=valid, other=0) != 0
        masked = generated & (block == mask_id)
        orig = tl.where(started, state_orig, masked)

        # 1. The candidates (`triton_ops.edit_candidates`' or PyTorch's): (R, B, 3) each.
        candidate = (row * length + cols) * 3
        x = tl.load(tokens_ptr + candidate, mask=valid, other=0)
        second_token = tl.load(tokens_ptr + candidate + 1, mask=valid, other=0)
        third_token = tl.load(tokens_ptr + candidate + 2, mask=valid, other=0)
        p = tl.load(probs_ptr + candidate, mask=valid, other=0.0)
        second_p = tl.load(probs_ptr + candidate + 1, mask=valid, other=0.0)

        # 2-4. Counters and the final cleanup.
        original = orig & masked
        original_count = _count(original)
        masked_count = _count(masked)
        updates = tl.load(updates_ptr + row) + live.to(tl.int64)
        post = tl.load(post_ptr + row) + (live & (original_count == 0)).to(tl.int64)
        final = tl.where(post_limit > 0, post >= post_limit, original_count == 0)
        final = final | (updates > length + post_limit)

        # 5. MASK at an original mask takes the best other token (not at the final cleanup).
        fallback = original & (x == mask_id) & ~final
        x = tl.where(fallback, second_token, x)
        p = tl.where(fallback, second_p, p)

        # 6. M2T: ranks of a stable descending sort (NaN first, ties to the lower position).
        confidence = tl.where(masked, p, float("-inf"))
        mine = confidence[:, None]
        other = confidence[None, :]
        ahead = (other > mine) | ((other != other) & (mine == mine))
        tied = (other == mine) | ((other != other) & (mine != mine))
        ranks = tl.sum((ahead | (tied & (cols[None, :] < cols[:, None]))).to(tl.int32), axis=1)
        need = 1 + masked_count - original_count
        above = (confidence > threshold) & masked
        most_confident = masked & (ranks < tl.minimum(need, masked_count))
        partial = tl.where(_count(above) >= need, above, most_confident)
        select = tl.where(final | (original_count == 0), masked, partial)

        # 7. Without post-edit rounds, the step that fills the last original mask is the final cleanup.
        fills = (post_limit == 0) & (original_count > 0) & (_count(original & ~select) == 0)
        final = final | fills
        select = tl.where(fills, masked, select)

        # 8-10. T2T; what is written; no MASK / DELETE / SPLIT at the final cleanup.
        edit = generated & ~masked & (x != block) & (p > editing_threshold)
        write = select | edit
        any_write = _count(write) > 0
        writes = any_write & live
        forbidden = (x == mask_id) | (x == delete_id) | (x == split_id)
        x = tl.where(final & write & forbidden, third_token, x)

        # 11. Anti-loop: a content seen before re-samples its least confident changing position.
        slots = tl.arange(0, BLOCK_D)
        seen_count = tl.load(seen_count_ptr + row)
        seen_rows = seen_ptr + row * depth * length + slots[:, None] * length + cols[None, :]
        # (only the slots in use are read: a block's early steps read little of the (D, B) history)
        seen = tl.load(seen_rows, mask=(slots[:, None] < tl.minimum(seen_count, depth)) & valid[None, :], other=0)
        differs = _count_rows((seen != block[None, :]) & valid[None, :])
        was_seen = _count((differs == 0) & (slots < seen_count) & (slots < depth)) > 0
        changing = write & (x != block)
        loop = writes & was_seen & ~final & (_count(changing) > 0)
        least = tl.where(changing, p, float("inf"))
        first_nan = tl.min(tl.where(least != least, cols, BLOCK_B), axis=0)
        _, lowest = tl.min(
            tl.where(least != least, float("inf"), least),
            axis=0,
            return_indices=True,
            return_indices_tie_break_left=True,
        )
        chosen = tl.where(first_nan < BLOCK_B, first_nan, lowest).to(tl.int64)
        resampled = tl.full([], 0, tl.int64)
        if loop:
            history = tl.load(hist_ptr + (row * length + chosen) * depth + slots, mask=slots < depth, other=-1)
            chosen_original = _count(original & (cols == chosen)) > 0
            logits_row = logits_ptr + row * stride_logits_row + chosen * stride_logits_position
            resampled = _resample(
                logits_row, stride_logits_vocab, vocab, history, history >= 0, chosen_original, mask_id, BLOCK_V
            )
        x = tl.where(loop & (cols == chosen), resampled, x)

        # 12-13. The new content, DELETE / SPLIT applied.
        new = tl.where(write, x, block)
        deleted = write & (x == delete_id)
        split = write & (x == split_id)
        new, new_orig = _edit_operations(
            new, block, orig, generated, valid, cols, mask_id, delete_id, split_id, BLOCK_B
        )

        # 14. A row with nothing to write, or at its final cleanup, is finished.
        new = tl.where(writes, new, block)
        finished = ~live | (final | ~any_write)

        # Every read of the state above happened before any write below (the warps of a program share it). The
        # store masks that depend on `writes` are `tl.where`s: Triton's interpreter (CPU tests) widens a scalar
        # `&` a vector to int32, which it refuses as a store mask.
        tl.debug_barrier()
        slot = tl.minimum(seen_count, depth - 1)
        tl.store(seen_ptr + (row * depth + slot) * length + cols, block, mask=tl.where(writes, valid, False))
        tl.store(seen_count_ptr + row, seen_count + writes.to(tl.int64))
        step_slot = tl.minimum(tl.maximum(updates - 1, 0), depth - 1)
        tl.store(hist_ptr + (row * length + cols) * depth + step_slot, x, mask=tl.where(writes, valid & write, False))
        tl.store(orig_ptr + row * length + cols, tl.where(live, new_orig, state_orig), mask=valid)
        tl.store(started_ptr + row, tl.full([], 1, tl.int1))
        tl.store(updates_ptr + row, updates)
        tl.store(post_ptr + row, post)
        tl.store(finished_ptr + row, finished)
        if HAS_TOTALS:
            counted = writes & ~final
            tl.atomic_add(totals_ptr, tl.where(counted, _count(deleted), 0).to(tl.int64))
            tl.atomic_add(totals_ptr + 1, tl.where(counted, _count(split), 0).to(tl.int64))
            tl.atomic_add(totals_ptr + 2, loop.to(tl.int64))
        tl.store(new_ptr + row * length + cols, new, mask=valid)
        tl.store(new_orig_ptr + row * length + cols, new_orig, mask=valid)
        tl.store(edited_ptr + row, _count((new != block) & valid) > 0)


@on_tensor_device
def levenshtein_step(
    block: torch.Tensor,
    generated: torch.Tensor,
    tokens: torch.Tensor,
    probabilities: torch.Tensor,
    logits: torch.Tensor,
    state: dict[str, torch.Tensor],
    totals: torch.Tensor | None,
    threshold: float,
    editing_threshold: float,
    max_post_steps: int,
    mask_token_id: int,
    delete_token_id: int,
    split_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`LevenshteinEditing.step` after its candidates, in one launch: `block` `(R, B)` long, `generated` `(R, B)`
    bool, the candidates `tokens` `(R, B, 3)` long and `probabilities` `(R, B, 3)` float32, `logits` `(R, B, V)`
    (read at one position of a row only where its anti-loop fires), `state` the policy's buffers (updated in
    place: `orig` `(R, B)`, `started` / `updates` / `post` / `finished` / `seen_count` `(R,)`, `seen` `(R, D, B)`,
    `hist` `(R, B, D)`), `totals` `(3,)` long (added to) or None. Returns the new block `(R, B)`, its original-mask
    flags `(R, B)` and `(R,)` whether the block changed. No host synchronisation (CUDA-graph capturable)."""
    rows, length = block.shape
    depth = state["hist"].shape[-1]
    tokens, probabilities = tokens.contiguous(), probabilities.contiguous()
    if block.stride(-1) != 1:
        block = block.contiguous()
    if generated.stride(-1) != 1:
        generated = generated.contiguous()
    for name, buffer in state.items():
        if not buffer.is_contiguous():
            raise ValueError(f"levenshtein_step needs contiguous state buffers; `{name}` is not.")
    new = torch.empty_like(block, memory_format=torch.contiguous_format)
    new_orig = torch.empty(rows, length, dtype=torch.bool, device=block.device)
    edited = torch.empty(rows, dtype=torch.bool, device=block.device)
    if rows == 0:
        return new, new_orig, edited
    block_b, block_d = triton.next_power_of_2(length), triton.next_power_of_2(depth)
    _levenshtein_step_kernel[(rows,)](
        block,
        generated,
        tokens,
        probabilities,
        logits,
        state["orig"],
        state["started"],
        state["updates"],
        state["post"],
        state["finished"],
        state["seen"],
        state["seen_count"],
        state["hist"],
        totals if totals is not None else state["updates"],  # never written without HAS_TOTALS
        new,
        new_orig,
        edited,
        length,
        depth,
        logits.shape[-1],
        block.stride(0),
        generated.stride(0),
        logits.stride(0),
        logits.stride(1),
        logits.stride(2),
        float(threshold),
        float(editing_threshold),
        int(max_post_steps),
        int(mask_token_id),
        int(delete_token_id),
        int(split_token_id),
        HAS_TOTALS=totals is not None,
        BLOCK_B=block_b,
        BLOCK_D=block_d,
        BLOCK_V=min(LEVENSHTEIN_VOCAB_BLOCK, triton.next_power_of_2(logits.shape[-1])),
        num_warps=4 if block_b * block_d <= 2048 else 8,  # blocks past 32: the (D, B) history tile in more registers
        **dependent_launch(),
    )
    return new, new_orig, edited
