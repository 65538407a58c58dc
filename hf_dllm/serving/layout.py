"""One layout of a continuous batch: the running rows of one settings group, laid out anew before each block and
decoded by the one block loop (`LayoutRun`, a `BlockDiffusionRun`). The scheduler that forms layouts is
`engine.ContinuousBatcher`.

Between two blocks nothing ties a row to its place in the batch (a bidirectional model's caches recompute every
position at a block's first step; a block-causal model's earlier blocks hold committed tokens only), so:

- Each row is a request's prompt as `generate()` would decode it alone (its own `BlockPlan`, columns counted
  from its first prompt token). Before a block, every row is shifted right so that its *current* block starts at
  one shared column `C` (rows of different requests are at different blocks of their own plans); columns before
  a row's prompt and after its canvas are padding, masked as keys, and each row's RoPE positions are its own. The
  block is then decoded by the one loop (`BlockDiffusionRun.denoise_block`: the same steps, policies, caches and
  CUDA graphs as `generate()`), and each row's block is copied back into its own canvas. In float32 a row's
  tokens and forwards are those of `generate()` alone: padding is masked, nothing else is shared.
- A block's forwards over whole canvases (the prefix/dual cache's refresh at the block's first step, the dual
  cache of Fast-dLLM, arXiv:2505.22618; every step without a cache) are most of the work, and the aligned layout
  would compute every row at the widest row's columns. Where the model takes packed rows (LLaDA, Dream, LLaDA2:
  `packed.PackedRows`) they run on the rows' canvases laid end to end instead, each row attending to itself: no
  padding is computed, and the keys/values go straight to each row's aligned columns of the cache.
- Block-causal models (LLaDA2.x) are shifted by whole blocks (their blocks stay aligned to positions). A committed
  block's K/V never change, so, as `generate()` does (`ExactBlockCache`), each is computed once: every running row
  owns a slot of a K/V store (`row_cache.RowKVStore`, its exact K/V at its own columns) that is copied into the
  layout's cache at the row's shifted columns before the block, and the block's first step (`StoredBlockCache`)
  recomputes only the previous block (committed now; its K/V go back to the store) and the block. Rows at their
  first block (joining) are prefilled in a forward of their own, each at its own columns (prompt and first block,
  `generate()`'s first step), packed end to end, so continuing rows never pay for a joining row's prompt, nor a
  short prompt for a long one. A row takes part in one of
  the two forwards: its forwards (NFE) are still `generate()`'s; the engine makes one forward more.
- One K/V cache serves every layout (`max_batch_size x max_batch_width` positions, or the engine's budget of
  positions): a layout sees its rows of its width laid end to end from the buffers' start
  (`DiffusionKVCache.set_length`), so captured CUDA graphs keep their addresses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..block_loop import BlockDiffusionRun
from ..cache import StoredBlockCache
from ..generation_config import DiffusionGenerationConfig
from ..graphs import StepGraphs
from ..packed import PackedRows
from .row_cache import RowKVStore
from .rows import BlockUpdate, EngineRequest

# Captured step shapes the engine keeps: its layouts vary in rows and width (`ContinuousBatcher.width_granularity`),
# far more than one `generate()` call's shapes, and a shape dropped from the cache is captured again at its next use.
# Measured on an H100 (LLaDA-8B shape, K/V budget, `benchmarks/bench_load.py`; RESULTS.md, continuous batching,
# session 33): a server met ~300 shapes; keeping 128, it captured 152 steps at 2.35 requests/s where 41 shapes were
# new (the rest evicted ones again), and keeping 512, 40 for 39; p50 latency 5.5 / 2.7 s against 8.2 / 4.7 at
# 2.45 / 2.35 requests/s in the same lease, the same peak GPU memory.
ENGINE_MAX_GRAPHS = 512


def kv_positions(rows: int, width: int, config: DiffusionGenerationConfig) -> int:
    """K/V positions a layout of `rows` rows of `width` columns takes in the model's batch: twice the rows with
    classifier-free guidance (each row's unconditional copy, as the block loop's `rows_per_forward`)."""
    return rows * (2 if config.cfg_scale > 0 else 1) * width


class LayoutRun(BlockDiffusionRun):
    """The decoding state of one settings group: `BlockDiffusionRun`'s rules, policies, cache and CUDA graphs,
    with rows laid out anew before each block (`decode_block`) instead of one canvas for the whole call."""

    def __init__(
        self,
        model,
        config: DiffusionGenerationConfig,
        max_rows: int,
        max_width: int,
        device,
        shared_cache,
        store: RowKVStore | None = None,
        row_bucket: Callable[[int, int], int] | None = None,
        max_positions: int | None = None,
    ):
        """`shared_cache()` gives the engine's K/V cache (one for every settings group: layouts are decoded one
        after the other and no K/V survives in it between blocks); `store` keeps block-causal rows' exact K/V
        between blocks (used when the config caches); `row_bucket(k, limit)` (None: no padding rows), the rows a
        forward of `k` rows runs with when at most `limit` fit, `k <= row_bucket(k, limit) <= limit`
        (`_with_padding_rows`); `max_positions` (None: no budget), the K/V positions (rows x columns) the shared
        cache holds, which caps a layout's padding rows at its width."""
        self.store = store if model.diffusion_family.committed_kv_exact and config.use_cache else None
        cache_policy = StoredBlockCache() if self.store is not None else None
        self._setup_decoding(model, config, device, None, cache_policy)
        self.first_step_positions = 0  # positions (rows x columns) fed to the model by blocks' first steps
        self.streamer = None
        self.stopping_criteria = []
        self.max_width = max_width
        self.max_rows = max_rows
        self.row_bucket = row_bucket
        self.max_positions = max_positions
        self._shared_cache = shared_cache
        self._setup_cache(max_rows, ENGINE_MAX_GRAPHS)
        self._setup_rules()

    def _new_cache(self):
        return self._shared_cache(self.rows_per_forward) if self.cache_policy.uses_cache else None

    def _graph_shape(self) -> tuple:
        # Layouts of every row count and width share the runner (rows and width are in each step's key); its cache
        # holds `max_positions` (another engine's runner, of another budget, is not taken over).
        return ("continuous", self.rows_per_forward, self.max_width, self.max_positions)

    def release(self) -> None:
        if self.graphs is not None:
            StepGraphs.release_to(self.model)
            self.graphs = None

    def decode_block(self, rows: list[EngineRequest], width: int) -> list[BlockUpdate]:
        """Decode the current block of every row in `rows` (one cohort: equal block length and steps) on a canvas
        of `width` columns (`layout_width`); returns each row's update (in the order of `rows`) and advances the
        rows.

        Forwards that start at a row's first column (the block's first step with a prefix/dual cache: the refresh;
        every step without a cache; a block-causal row's prefill) run on the rows packed end to end
        (`_packed_forward`), so no row pays for the others' lengths or misalignment in the block's most expensive
        forward. Block-causal rows keep their K/V in the store (`_first_step_from_store`): only the rows at their
        first block are prefilled (packed), the others recompute their previous block in the aligned layout.

        With `row_bucket` the layout gets padding rows (`_with_padding_rows`) so that every step it runs through
        the model has a bucketed number of rows (few CUDA-graph shapes)."""
        order = list(range(len(rows)))
        if self.store is not None:  # the rows that continue first, then those at their first block (joining)
            order.sort(key=lambda i: rows[i].block == 0)
            rows = [rows[i] for i in order]
        joining = sum(row.block == 0 for row in rows) if self.store is not None else 0  # rows at their first block
        layout = self._with_padding_rows(rows, joining, width)
        where = [i for i, row in enumerate(layout) if row is not None]  # each of `rows`' place in the layout
        device, n = self.device, len(layout)
        first_real = rows[0]
        length = first_real.plan.blocks[first_real.block][1] - first_real.plan.blocks[first_real.block][0]
        block_start = max(row.plan.blocks[row.block][0] for row in rows)
        block_end = block_start + length
        # A padding row is all prompt (no mask, nothing generated: it commits nothing, never ends, never adds a
        # step) at unshifted columns, seeing the columns up to the block's end (finite attention).
        starts = torch.tensor([block_start if row is None else row.plan.blocks[row.block][0] for row in layout])
        shifts = block_start - starts
        prompt_lengths = torch.tensor([width if row is None else int(row.plan.prompt_end[0]) for row in layout])
        self.x = torch.full((n, width), self.config.prompt_pad_token_id, dtype=torch.long, device=device)
        self.key_mask = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, row in enumerate(layout):
            if row is None:
                self.key_mask[i, :block_end] = 1
                continue
            shift, own = int(shifts[i]), min(row.tokens.shape[0], width - int(shifts[i]))
            self.x[i, shift : shift + own] = row.tokens[:own]
            self.key_mask[i, shift : shift + own] = 1
        columns = torch.arange(width, device=device)
        self.position_ids = (columns - shifts.to(device).unsqueeze(-1)).clamp(min=0)
        self.host_prompt_end = shifts + prompt_lengths
        self.prompt_end = self.host_prompt_end.to(device)
        self.seq_len = width
        self.rows, self.host_rows = torch.arange(n, device=device), torch.arange(n)
        self.stopped = torch.zeros(n, dtype=torch.bool, device=device)
        self.nfe_per_row = torch.zeros(n, dtype=torch.long, device=device)
        self.attention_masks = {}
        if self.cache is not None:  # every policy here recomputes all of it at the block's first step
            self.cache.set_length(width)
        self.packed = None
        if self.store is not None:
            self.joining, self.continuing = joining, len(rows) - joining
            # Layout rows of the continuing rows' first-step forward (theirs and their padding), then the joining
            # rows'. A padding row loads the first row's slot (any finite K/V do) and saves nothing.
            self.first_step_rows = where[self.continuing] if joining else n
            self.slots = torch.tensor([(first_real if row is None else row).slot for row in layout])
            self.shifts, self.starts = shifts, starts
            if joining:  # their prefill: prompt and first block, each at its own columns
                joining_rows = slice(self.first_step_rows, self.first_step_rows + joining)
                self.packed = self._packed_layout(layout, shifts, length, block_end, joining_rows)
        elif self.model.diffusion_packed_rows and not self.cfg:
            first, end = self.cache_policy.query_range(block_start, block_end, width, first_step=True)
            if first == 0:  # the whole canvas (bidirectional), or up to the block (block-causal, no cache)
                self.packed = self._packed_layout(layout, shifts, length, end, slice(0, len(rows)))
        steps = first_real.plan.block_steps[0, first_real.block]  # one cohort: every row's steps are equal
        self.denoise_block(steps.expand(n).clone(), block_start, block_end)

        last = torch.tensor([row is not None and row.block == int(row.plan.last_block[0]) for row in layout])
        ended = (
            self.finished_rows(last, block_end).cpu()
            if self._rows_can_finish(last)
            else torch.zeros(n, dtype=torch.bool)
        )
        if bool(ended.any()):  # as generate() shows ended rows: EOS after the block (and after a block-causal EOS)
            rows_ended = ended.to(device)
            self.x[rows_ended] = self.filled(self.x[rows_ended], self._generated_part(block_end)[rows_ended], block_end)
        block = self.x[:, block_start:block_end].cpu()  # the one copy to the host of this block
        nfe = self.nfe_per_row.tolist()
        updates = [None] * len(rows)
        for k, (i, row) in enumerate(zip(where, rows, strict=True)):
            start, shift, prompt = int(starts[i]), int(shifts[i]), int(prompt_lengths[i])
            if bool(ended[i]):  # as `filled` shows it: the fill token after the layout's columns too
                own = min(row.tokens.shape[0], width - shift)
                row.tokens = torch.full_like(row.tokens, self.fill_id)
                row.tokens[:own] = self.x[i, shift : shift + own]
            else:
                row.tokens[start : start + length] = self.x[i, block_start:block_end]
            previous = row.committed
            row.committed = max(0, min(start + length - prompt, row.config.max_new_tokens))
            row.nfe += nfe[i]
            row.block += 1
            new = block[i, previous + prompt - start : row.committed + prompt - start].tolist()
            updates[order[k]] = BlockUpdate(new, bool(ended[i]), row.nfe)
        return updates

    def _with_padding_rows(self, rows: list[EngineRequest], joining: int, width: int) -> list[EngineRequest | None]:
        """The layout's rows, None for a padding row: `rows` as they are without `row_bucket`; with it, padding
        rows after the rows of each forward that steps them, so that each has `row_bucket(k, limit)` rows, `limit`
        the rows that fit: `max_rows`, and with `max_positions` the rows of `width` columns within it. Block-causal
        rows with a store run two such forwards: the first step of the `len(rows) - joining` continuing rows (the
        layout's first rows) and the later steps of all rows; the last `joining` rows' prefill is packed (no
        padding)."""
        if self.row_bucket is None:
            return list(rows)
        limit = self.max_rows
        if self.max_positions is not None:  # the engine admitted `rows` within the budget: limit >= len(rows)
            limit = min(limit, self.max_positions // kv_positions(1, width, self.config))
        continuing = len(rows) - joining
        first = self.row_bucket(continuing, limit) if continuing and joining else continuing
        if first + joining > limit:  # no room to pad both forwards: pad the later steps only
            first = continuing
        total = self.row_bucket(first + joining, limit)
        return [
            *rows[:continuing],
            *[None] * (first - continuing),
            *rows[continuing:],
            *[None] * (total - first - joining),
        ]

    def _packed_layout(self, layout, shifts: torch.Tensor, length: int, end: int, packed_rows: slice) -> dict:
        """The layout rows `layout[packed_rows]` (no padding row among them) for a forward over their columns before
        `end` (an aligned column), packed end to end, made once per block: their `packing` (`packed.PackedRows`: no
        padding, and where their K/V go),
        `(T,)` device tensors `rows` and `columns` (each packed position's row and column in `self.x`),
        `positions` (its column in its row's own canvas, also its RoPE position), `cache_position` (`[0, T)`), and
        `logits_index`
        `(rows * length,)` (the packed positions whose logits the block's step reads)."""
        lengths, row_index, columns, logits_index, offset = [], [], [], [], 0
        block_columns = torch.arange(length)
        for i in range(packed_rows.start, packed_rows.stop):
            shift, row = int(shifts[i]), layout[i]
            own = min(row.tokens.shape[0], end - shift)
            lengths.append(own)
            row_index.append(torch.full((own,), i))
            columns.append(torch.arange(shift, shift + own))
            logits_index.append(offset + row.plan.blocks[row.block][0] - self.shift + block_columns)
            offset += own
        device = self.device
        columns = torch.cat(columns).to(device)
        row_index = torch.cat(row_index).to(device)
        positions = columns - shifts.to(device)[row_index]
        # K/V go to a bidirectional row's aligned columns (the block's later steps read them there), a block-causal
        # joining row's own columns of the cache's first rows (`_first_step_from_store` saves them to its slot).
        cache_columns = positions if self.store is not None else columns
        return dict(
            packing=PackedRows(
                lengths, self.cache, cache_columns if self.cache is not None else None, kept_per_row=length
            ),
            layout_rows=packed_rows,
            rows=row_index,
            columns=columns,
            positions=positions,
            cache_position=torch.arange(columns.shape[0], device=device),
            logits_index=torch.cat(logits_index).to(device),
        )

    def _packed_forward(self, block_start, block_end, step, active, generated):
        """Step `step` of the packed rows (`self.packed`), on their canvases packed end to end, so no padding
        column is computed (their K/V go where `_packed_layout` says). Returns every layout row's block `(rows, L)`
        (the packed rows' new one, the others' as it is) and whether each edited a committed token `(rows,)`."""
        packed, length = self.packed, block_end - block_start
        packing, rows = packed["packing"], packed["layout_rows"]
        tokens = self.x[packed["rows"], packed["columns"]].unsqueeze(0)
        if step == 0:
            self.first_step_positions += tokens.shape[1]
        logits = self.model._diffusion_forward(
            tokens,
            packing,
            packed["positions"].unsqueeze(0),
            packing,
            packed["cache_position"],
            packed["logits_index"],
            **self.forward_kwargs,
        ).to(self.device)
        scheduled = self.unmasking.scheduled_counts(step, self.x.shape[0], self.device)[rows]
        new_block = self.x[:, block_start:block_end].clone()
        edited = torch.zeros(self.x.shape[0], dtype=torch.bool, device=self.device)
        new_block[rows], _, edited[rows] = self.decide(
            self.x[rows, block_start:block_end],
            logits.view(len(packing.lengths), length, -1),
            scheduled,
            None if generated is None else generated[rows],
            None if active is None else active[rows],
        )
        self.nfe += 1
        return new_block, edited

    def run_step(self, block_start, block_end, step, active=None, generated=None):
        """`BlockDiffusionRun.run_step`; with a store, the first step is `_first_step_from_store`. A step over whole
        canvases runs packed (`_packed_forward`) where the model takes packed rows: the block's first step, and
        without a cache every step where no CUDA graphs run it (on a GPU the captured aligned step is kept: it was
        measured, the packed eager one is not)."""
        if step == 0 and self.store is not None:
            return self._first_step_from_store(block_start, block_end, active, generated)
        if self.packed is not None and (step == 0 or (self.cache is None and self.graphs is None)):
            new_block, edited = self._packed_forward(block_start, block_end, step, active, generated)
            self.x[:, block_start:block_end] = new_block
            return new_block, edited
        return super().run_step(block_start, block_end, step, active, generated)

    def _step_inputs(self, block_start, block_end, step, active, generated, rows=None):
        """`BlockDiffusionRun._step_inputs`, counting the positions of blocks' first steps (`first_step_positions`)."""
        inputs, key = super()._step_inputs(block_start, block_end, step, active, generated, rows)
        if step == 0:
            self.first_step_positions += inputs["tokens"].numel()
        return inputs, key

    def _first_step_from_store(self, block_start, block_end, active, generated):
        """The block's first step with the rows' K/V kept in the store (block-causal models; layout rows as in
        `decode_block`: the `continuing` rows that decoded a block before and their padding rows, the first
        `first_step_rows`, then the `joining` rows at their first block (the packed rows), then padding rows).

        1. The joining rows' prefill: prompt and block at their own columns (`generate()`'s first step), packed
           (`_packed_forward`), written to the cache's first rows; their prompt's K/V (exact: columns before the
           block) go to their slots.
        2. Every row's slot is copied into the aligned layout at the row's columns.
        3. The continuing rows' forward (`StoredBlockCache`: previous block and block, on the cache's first rows);
           the previous block's K/V (exact now) go to their slots.
        Returns the new block `(rows, L)` and the rows that edited a committed token, as `run_step`."""
        continuing, length = self.continuing, block_end - block_start
        if self.joining:
            rows = self.packed["layout_rows"]
            new_block, edited = self._packed_forward(block_start, block_end, 0, active, generated)
            prefix = torch.arange(int(self.starts[rows].max())).expand(self.joining, -1)
            self.store.save(self.cache, self.slots[rows], prefix, prefix)
        else:
            new_block = self.x[:, block_start:block_end].clone()
            edited = torch.zeros(self.x.shape[0], dtype=torch.bool, device=self.device)
        self.store.load(self.cache, self.slots, self.shifts, block_start)
        if continuing:
            # `StoredBlockCache`: the previous block and the block, at the aligned columns, of the continuing rows.
            first = self.first_step_rows
            inputs, key = self._step_inputs(block_start, block_end, 0, active, generated, first)
            new_block[:first], _, edited[:first] = self._step_of(inputs, key)
            self.nfe += 1
            previous = torch.arange(block_start - length, block_start).expand(continuing, -1)
            self.store.save(self.cache, self.slots[:continuing], previous, previous - self.shifts[:continuing, None])
        self.x[:, block_start:block_end] = new_block
        return new_block, edited
