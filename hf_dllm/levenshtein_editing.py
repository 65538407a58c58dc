"""LLaDA2.2's Levenshtein editing: mask-to-token and token-to-token decoding plus DELETE / SPLIT edit tokens.

LLaDA2.2 keeps LLaDA2.1's token editing (`decoding.TokenEditing`) and adds two control tokens, `delete_token_id` and
`split_token_id` of the checkpoint's `config.json`. Writing DELETE at a block position removes it (the rest of the
block's generated part shifts left and MASK is padded at the end); writing SPLIT inserts a fresh MASK before the
token that was there (the block's last token falls off). The block keeps its length; a finished block never holds
MASK, DELETE or SPLIT.

The rule is SGLang's `JointThresholdInDel` (`python/sglang/srt/dllm/algorithm/joint_threshold_indel.py`, commit
`0fbe7e46`), step for step (tests/fixtures/llada22-tiny-ref/README section "llada22-tiny-ref"): original-mask flags
that travel with their token, a cumulative post-edit budget, a final cleanup step that scrubs MASK / DELETE /
SPLIT, and a deterministic anti-loop (a block content seen before re-samples its least confident changing position
without any token already written there). SGLang's extra "persist" forward after a block's last change (so that
its KV cache holds the final tokens) is not made: `ExactBlockCache`'s first forward of the next block recomputes
the finished block's K/V from its final tokens, and without a cache every forward recomputes everything.

The per-block state (flags, counters, the set of past block contents, the tokens ever written per index) lives in
fixed-shape device tensors updated in place without host synchronisation, so the step stays CUDA-graph
capturable; where the run has a graph runner, the buffers are the runner's (`StepGraphs.constant`), so graphs that
outlive one `generate()` call keep reading live memory. Where the fused kernels run (`kernels.use_fused_kernels`:
CUDA and Triton), a step is three launches: `triton_ops.edit_candidates`' two over the logits, and
`triton_levenshtein.levenshtein_step` for everything after them, bit-identical to the PyTorch step here (the
reference, and the path elsewhere), which launches ~160 small kernels.

Which models use it is their family's decision (`family_llada2.LLaDA22Family`: a config with both edit tokens);
`check_settings` is what the rule refuses.

This file is exported as Hub remote code (relative imports only).
"""

from __future__ import annotations

import contextlib

import torch

from .decoding import UnmaskingPolicy, rank_by_confidence
from .kernels import use_fused_kernels
from .triton_levenshtein import levenshtein_step
from .triton_ops import edit_candidates

NEG_INF = float("-inf")


class LevenshteinEditing(UnmaskingPolicy):
    """LLaDA2.2's rule (SGLang's `JointThresholdInDel`) as an `UnmaskingPolicy`.

    Args:
        threshold: M2T: masked positions with probability strictly above it are committed when they are at least
            `1 + introduced masks`; else that many most confident ones. None = 1.0 (the floor alone).
        editing_threshold: T2T: a generated, non-mask position whose greedy token differs with probability strictly
            above it is rewritten (0 = wherever the prediction differs, SGLang's default).
        max_post_steps: SGLang's `max_post_edit_steps`: steps a block may make with no original mask left before
            the final cleanup (0: the step that fills the last original mask is the cleanup).
        mask_token_id, delete_token_id, split_token_id: the special ids.
    """

    reads_logits = True  # its confidences come from the whole vocabulary's logits

    edits = True
    capturable = True

    def __init__(
        self,
        threshold: float | None,
        editing_threshold: float,
        max_post_steps: int,
        mask_token_id: int,
        delete_token_id: int,
        split_token_id: int,
    ) -> None:
        if isinstance(max_post_steps, bool) or not isinstance(max_post_steps, int) or max_post_steps < 0:
            raise ValueError(f"max_post_steps must be a non-negative integer, got {max_post_steps!r}.")
        for name, value in (("delete_token_id", delete_token_id), ("split_token_id", split_token_id)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"LevenshteinEditing needs an integer {name}, got {value!r}.")
        if len({mask_token_id, delete_token_id, split_token_id}) != 3:
            raise ValueError(
                f"mask_token_id ({mask_token_id}), delete_token_id ({delete_token_id}) and split_token_id "
                f"({split_token_id}) must be distinct."
            )
        self.threshold = 1.0 if threshold is None else float(threshold)
        self.editing_threshold = float(editing_threshold)
        self.max_post_steps = int(max_post_steps)
        self.mask_token_id = int(mask_token_id)
        self.delete_token_id = int(delete_token_id)
        self.split_token_id = int(split_token_id)
        self._graphs = None
        self._state: dict[str, torch.Tensor] | None = None
        self._totals: torch.Tensor | None = None

    def step_constants(self) -> tuple:
        return (
            self.threshold,
            self.editing_threshold,
            self.max_post_steps,
            self.mask_token_id,
            self.delete_token_id,
            self.split_token_id,
        )

    def max_regular_updates(self, block_length: int) -> int:
        """SGLang's `max_regular_update_steps`: the step after this many is the final cleanup at the latest."""
        return block_length + self.max_post_steps

    def max_updates(self, block_length: int) -> int:
        """SGLang's `max_steps`: regular updates, the final cleanup and its persist forward (which this loop does
        not make); the depth of the state's history."""
        return block_length + self.max_post_steps + 2

    # ----- state (host side, outside any captured step) -----

    def keep_state_in(self, graphs) -> None:
        """Keep the state buffers in the run's CUDA-graph runner (`StepGraphs.constant`): its graphs read them by
        address, in this call and in later calls that replay them."""
        self._graphs = graphs

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = f"levenshtein.{name}.{'x'.join(map(str, shape))}.{dtype}"
        made = self.__dict__.setdefault("_buffers", {})
        buffer = made.get((key, device))
        if buffer is None:
            buffer = torch.zeros(shape, dtype=dtype, device=device)
            if self._graphs is not None:
                buffer = self._graphs.constant(key, buffer)
            made[(key, device)] = buffer
        return buffer

    def prepare_block(self, rows: int, device: torch.device) -> None:
        """Reset the block state for `rows` rows on `device` (called by the loop after `start_block`)."""
        length = self.block_length
        depth = self.max_updates(length)
        state = {
            "orig": self._buffer("orig", (rows, length), torch.bool, device),
            "started": self._buffer("started", (rows,), torch.bool, device),
            "updates": self._buffer("updates", (rows,), torch.long, device),
            "post": self._buffer("post", (rows,), torch.long, device),
            "finished": self._buffer("finished", (rows,), torch.bool, device),
            "seen": self._buffer("seen", (rows, depth, length), torch.long, device),
            "seen_count": self._buffer("seen_count", (rows,), torch.long, device),
            "hist": self._buffer("hist", (rows, length, depth), torch.long, device),
        }
        for name, buffer in state.items():
            buffer.fill_(-1 if name == "hist" else 0)
        if self._totals is None:
            # DELETE and SPLIT written and anti-loop re-samples over the call (all rows): what the fixtures count.
            self._totals = self._buffer("totals", (3,), torch.long, device)
            self._totals.zero_()
        self._state = state

    @contextlib.contextmanager
    def rows_only(self, rows: slice | None):
        """Steps inside decide `rows` of the block's rows only: their state is copied into the buffers a block of
        that many rows uses, and back afterwards; the other rows' state is left as it is. The buffers a step reads
        thus depend on its row count alone, as the key of its CUDA graph does (a graph captured here and one captured
        for a whole block of as many rows are one graph, reading the same memory)."""
        full = self._state
        if full is None or rows is None or (rows.start or 0, rows.stop) == (0, full["finished"].shape[0]):
            yield
            return
        part = {}
        for name, buffer in full.items():
            count = len(range(*rows.indices(buffer.shape[0])))
            part[name] = self._buffer(name, (count, *buffer.shape[1:]), buffer.dtype, buffer.device)
            part[name].copy_(buffer[rows])
        self._state = part
        try:
            yield
        finally:
            for name, buffer in full.items():
                buffer[rows].copy_(part[name])
            self._state = full

    def totals(self) -> dict[str, int]:
        """DELETE and SPLIT tokens consumed and anti-loop re-samples over the call so far, summed over rows (host
        synchronisation: for tests and diagnostics)."""
        if self._totals is None:
            return {"deletes": 0, "splits": 0, "anti_loop": 0}
        deletes, splits, anti_loop = self._totals.tolist()
        return {"deletes": deletes, "splits": splits, "anti_loop": anti_loop}

    def init_state(self, block: torch.Tensor, generated: torch.Tensor) -> dict[str, torch.Tensor]:
        """The block's state before its first step, as SGLang's `init_step_state` (for driving `step` by hand):
        every generated MASK position is an original mask. Resets the buffers (`start_block` must have run)."""
        rows, length = block.shape
        if getattr(self, "block_length", None) != length:
            self.start_block(length, 1)
        self.prepare_block(rows, block.device)
        self._state["orig"].copy_(generated & (block == self.mask_token_id))
        self._state["started"].fill_(True)
        return self._state

    def start_block(self, block_length: int, num_steps) -> None:
        super().start_block(block_length, num_steps)
        self._state = None

    def steps_for_block(self) -> None:
        return None

    def steps_per_row(self) -> None:
        return None

    def still_active(self, active, masked_before, masked_after, edited, step):
        return active & ~self._state["finished"]

    # ----- the step (device side, graph-capturable) -----

    def commit(self, proposal, scheduled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if proposal.logits is None:
            raise ValueError("LevenshteinEditing needs the logits of every block position.")
        if self._state is None:
            rows, length = proposal.block.shape
            self.prepare_block(rows, proposal.block.device)
        new_block, _, edited = self.step(proposal.block, proposal.logits, proposal.generated, self._state)
        return new_block, edited

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy tokens `(R, B, 3)` of the logits `(R, B, V)`: the argmax over every token, over every token but
        MASK, and over every token but MASK, DELETE and SPLIT; and their probabilities under the full float32
        softmax `(R, B, 3)`. One read of the logits where the fused kernels run (`triton_ops.edit_candidates`: the
        same tokens, the probabilities up to the softmax's summation order), else PyTorch's passes."""
        if use_fused_kernels(logits):
            return edit_candidates(logits, self.mask_token_id, self.delete_token_id, self.split_token_id)
        logits = logits.float()
        probabilities = logits.softmax(-1)
        excluded = logits.clone()
        excluded[..., self.mask_token_id] = NEG_INF
        no_mask = excluded.argmax(-1)
        excluded[..., self.delete_token_id] = NEG_INF
        excluded[..., self.split_token_id] = NEG_INF
        tokens = torch.stack([logits.argmax(-1), no_mask, excluded.argmax(-1)], dim=-1)
        return tokens, probabilities.gather(-1, tokens)

    def step(
        self,
        block: torch.Tensor,
        logits: torch.Tensor,
        generated: torch.Tensor,
        state: dict[str, torch.Tensor],
        candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of SGLang's rule on `block` `(R, B)` with its logits `(R, B, V)`; `generated` `(R, B)` bool marks
        the non-prompt positions. Updates `state` in place; returns the new block, its original-mask flags and
        `(R,)` bool whether the block changed. `candidates`: `self.candidates(logits)` when already computed (tests
        drive both paths from the same ones).

        Where the fused kernels run, everything after the candidates is one Triton launch
        (`triton_levenshtein.levenshtein_step`, bit-identical to the PyTorch code below, which is the reference)."""
        tokens, probabilities = self.candidates(logits) if candidates is None else candidates
        if use_fused_kernels(logits):
            return levenshtein_step(
                block,
                generated,
                tokens,
                probabilities,
                logits,
                state,
                self._totals,
                *self.step_constants(),
            )
        mask_id, delete_id, split_id = self.mask_token_id, self.delete_token_id, self.split_token_id
        rows, length = block.shape
        device = block.device
        depth = state["hist"].shape[-1]
        post_limit = self.max_post_steps
        positions = torch.arange(length, device=device)

        live = ~state["finished"]
        # Original masks: the block's generated MASK positions before its first step (SGLang's `init_step_state`).
        orig = torch.where(state["started"].unsqueeze(-1), state["orig"], generated & (block == mask_id))

        # 1. Greedy token and its probability (and the greedy tokens without MASK, without MASK / DELETE / SPLIT).
        x, p = tokens[..., 0], probabilities[..., 0]

        # 2-4. Masks, original masks, counters, whether this is the final cleanup.
        masked = generated & (block == mask_id)
        original = orig & masked
        original_count = original.sum(-1)
        masked_count = masked.sum(-1)
        introduced = masked_count - original_count
        updates = state["updates"] + live.long()
        post = state["post"] + (live & (original_count == 0)).long()
        if post_limit > 0:
            final = post >= post_limit
        else:
            final = original_count == 0
        final = final | (updates > length + post_limit)

        # 5. At original masks, MASK predictions take the best other token (not at the final cleanup).
        fallback = original & (x == mask_id) & ~final.unsqueeze(-1)
        x = torch.where(fallback, tokens[..., 1], x)
        p = torch.where(fallback, probabilities[..., 1], p)

        # 6. M2T selection.
        confidence = torch.where(masked, p, NEG_INF)
        _, ranks = rank_by_confidence(confidence)
        need = 1 + introduced
        above = (confidence > self.threshold) & masked
        most_confident = masked & (ranks < torch.minimum(need, masked_count).unsqueeze(-1))
        partial = torch.where((above.sum(-1) >= need).unsqueeze(-1), above, most_confident)
        select = torch.where((final | (original_count == 0)).unsqueeze(-1), masked, partial)

        # 7. Without post-edit rounds, the step that fills the last original mask is the final cleanup.
        if post_limit == 0:
            fills = (original_count > 0) & ~(original & ~select).any(-1)
            final = final | fills
            select = torch.where(fills.unsqueeze(-1), masked, select)

        # 8. T2T selection.
        edit = generated & ~masked & (x != block) & (p > self.editing_threshold)

        # 9. Nothing to write: the block is done.
        write = select | edit
        writes = write.any(-1) & live

        # 10. The final cleanup writes no MASK, DELETE or SPLIT.
        forbidden = (x == mask_id) | (x == delete_id) | (x == split_id)
        x = torch.where(final.unsqueeze(-1) & write & forbidden, tokens[..., 2], x)

        # 11. Anti-loop: a block content seen before re-samples its least confident changing position without the
        # tokens ever written at that index (and without MASK at an original mask).
        seen, seen_count = state["seen"], state["seen_count"]
        slots = torch.arange(depth, device=device)
        was_seen = ((seen == block.unsqueeze(1)).all(-1) & (slots < seen_count.unsqueeze(-1))).any(-1)
        changing = write & (x != block)
        loop = writes & was_seen & ~final & changing.any(-1)
        chosen = torch.where(changing, p, float("inf")).argmin(-1)
        history = state["hist"].gather(1, chosen.view(rows, 1, 1).expand(rows, 1, depth)).squeeze(1)
        vocab = logits.shape[-1]
        excluded = torch.zeros(rows, vocab, device=device).scatter_add_(1, history.clamp(min=0), (history >= 0).float())
        chosen_logits = logits.gather(1, chosen.view(rows, 1, 1).expand(rows, 1, vocab)).squeeze(1).float()
        chosen_logits = chosen_logits.masked_fill(excluded > 0, NEG_INF)
        chosen_original = original.gather(1, chosen.unsqueeze(-1)).squeeze(-1)
        chosen_logits[:, mask_id] = torch.where(chosen_original, NEG_INF, chosen_logits[:, mask_id])
        resampled = chosen_logits.argmax(-1)
        at_chosen = loop.unsqueeze(-1) & (positions == chosen.unsqueeze(-1))
        x = torch.where(at_chosen, resampled.unsqueeze(-1), x)

        # ... and the current content joins `seen` (every step that writes).
        slot = seen_count.clamp(max=depth - 1).view(rows, 1, 1).expand(rows, 1, length)
        seen_entry = torch.where(writes.view(rows, 1, 1), block.unsqueeze(1), seen.gather(1, slot))
        new_seen = seen.scatter(1, slot, seen_entry)
        new_seen_count = seen_count + writes.long()

        # 12. Written tokens join the history of their index.
        step_slot = (updates - 1).clamp(0, depth - 1).view(rows, 1, 1).expand(rows, length, 1)
        hist = state["hist"]
        hist_entry = torch.where(
            (write & writes.unsqueeze(-1)).unsqueeze(-1), x.unsqueeze(-1), hist.gather(2, step_slot)
        )
        new_hist = hist.scatter(2, step_slot, hist_entry)
        new = torch.where(write, x, block)

        # 13. DELETE / SPLIT rebuild the block: each generated position emits nothing (DELETE), MASK then its old
        # token (SPLIT) or its new token; the result is cut to B or padded with MASK (flags false).
        deleted = write & (x == delete_id)
        split = write & (x == split_id)
        new, new_orig = apply_edit_operations(new, block, orig, generated, mask_id, delete_id, split_id)

        # 14. The final cleanup, or a step with nothing to write, finishes the block (no persist forward: the
        # cache writes a finished block's K/V from its final tokens).
        new = torch.where(writes.unsqueeze(-1), new, block)
        finished = state["finished"] | (live & (final | ~write.any(-1)))

        live_rows = live.unsqueeze(-1)
        state["orig"].copy_(torch.where(live_rows, new_orig, state["orig"]))
        state["started"].fill_(True)
        state["updates"].copy_(updates)
        state["post"].copy_(post)
        state["finished"].copy_(finished)
        state["seen"].copy_(new_seen)
        state["seen_count"].copy_(new_seen_count)
        state["hist"].copy_(new_hist)
        if self._totals is not None:
            counted = writes & ~final
            self._totals.add_(
                torch.stack(
                    [
                        (deleted & counted.unsqueeze(-1)).sum(),
                        (split & counted.unsqueeze(-1)).sum(),
                        loop.sum(),
                    ]
                )
            )
        return new, new_orig, (new != block).any(-1)


def apply_edit_operations(
    new: torch.Tensor,
    old: torch.Tensor,
    orig: torch.Tensor,
    generated: torch.Tensor,
    mask_token_id: int,
    delete_token_id: int,
    split_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DELETE / SPLIT on a block (SGLang's `_apply_edit_operations`, for every row at once): `new` `(R, B)` holds
    the step's written tokens, `old` the block before it, `orig` its original-mask flags, `generated` its
    non-prompt positions. Prompt positions keep their old token and flag; in the generated part DELETE emits
    nothing, SPLIT emits MASK (flag false) then the old token (its flag), anything else the new token (its flag).
    The result is cut to B or padded with MASK (flag false). Rows without DELETE or SPLIT come back unchanged."""
    rows, length = new.shape
    deleted = generated & (new == delete_token_id)
    split = generated & (new == split_token_id)
    emitted = torch.where(deleted, 0, torch.where(split, 2, 1))
    start = emitted.cumsum(-1) - emitted
    dump = 2 * length  # a slot past the kept ones, for what emits nothing
    first_slot = torch.where(emitted > 0, start, dump)
    second_slot = torch.where(split, start + 1, dump)
    tokens = torch.full((rows, dump + 1), mask_token_id, dtype=new.dtype, device=new.device)
    flags = torch.zeros((rows, dump + 1), dtype=torch.bool, device=new.device)
    tokens.scatter_(1, first_slot, torch.where(split, mask_token_id, torch.where(generated, new, old)))
    flags.scatter_(1, first_slot, orig & ~split)
    tokens.scatter_(1, second_slot, old)
    flags.scatter_(1, second_slot, orig)
    indel = (deleted | split).any(-1, keepdim=True)
    return torch.where(indel, tokens[:, :length], new), torch.where(indel, flags[:, :length], orig)


def check_settings(config) -> None:
    """`ValueError` naming the setting for generation settings this rule cannot honour: it is greedy, with a
    confidence threshold (`threshold`), `editing_threshold` and `max_post_steps` only (no `steps` schedule, no
    `factor`, one masked position at least per step)."""
    refused = {
        "steps": config.steps is not None,
        "factor": config.factor is not None,
        "num_to_transfer": config.num_to_transfer != 1,
        "temperature": config.temperature != 0,
        "remasking": config.remasking != "low_confidence",
        "logits_eos_inf": bool(config.logits_eos_inf),
        "confidence_eos_eot_inf": bool(config.confidence_eos_eot_inf),
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(
                f"`{name}={getattr(config, name)!r}` is not supported by LLaDA2.2's Levenshtein editing: it is "
                "greedy, with a confidence threshold (`threshold`), `editing_threshold` and `max_post_steps` only."
            )
