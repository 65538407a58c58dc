"""One layout of a continuous batch: the running rows of one settings group, laid out anew before each block and
decoded by the steps of `generate()` (`LayoutRun`, which holds a `step_machine.StepMachine` as `generate()`'s
`BlockDiffusionRun` does). The scheduler that forms layouts is `engine.ContinuousBatcher`.

Between two blocks nothing ties a row to its place in the batch (a bidirectional model's caches recompute every
position at a block's first step; a block-causal model's earlier blocks hold committed tokens only), so:

- Each row is a request's prompt as `generate()` would decode it alone (its own `BlockPlan`, columns counted
  from its first prompt token). Before a block, every row is shifted right so that its *current* block starts at
  one shared column `C` (rows of different requests are at different blocks of their own plans); columns before
  a row's prompt and after its canvas are padding, masked as keys, and each row's RoPE positions are its own. The
  block is then decoded by the one loop (`step_machine.Canvas.denoise_block`: the same steps, policies, caches and
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

from ..cache import StoredBlockCache
from ..generation_config import DiffusionGenerationConfig
from ..packed import PackedRows
from ..step_machine import Canvas, StepMachine, decoding_policies
from .row_cache import RowKVStore
from .rows import BlockUpdate, EngineRequest

# Captured step shapes the engine keeps: its layouts vary in rows and width (`ContinuousBatcher.width_granularity`),
# far more than one `generate()` call's shapes, and a shape dropped from the cache is captured again at its next use.
# Measured on an H100 (LLaDA-8B shape, K/V budget, `benchmarks/bench_load.py`): a
# server met ~300 shapes; keeping 128, it captured 152 steps at 2.35 requests/s where 41 shapes were
# new (the rest evicted ones again), and keeping 512, 40 for 39; p50 latency 5.5 / 2.7 s against 8.2 / 4.7 at
# 2.45 / 2.35 requests/s in the same lease, the same peak GPU memory.
ENGINE_MAX_GRAPHS = 512


def kv_positions(rows: int, width: int, config: DiffusionGenerationConfig) -> int:
    """K/V positions a layout of `rows` rows of `width` columns takes in the model's batch: twice the rows with
    classifier-free guidance (each row's unconditional copy, as the block loop's `rows_per_forward`)."""
    return rows * (2 if config.cfg_scale > 0 else 1) * width


class PackedLayout:
    """Layout rows `layout[layout_rows]` (no padding row among them) for a forward over their columns before `end`
    (an aligned column), packed end to end, made once per block so that no padding column is computed.

    Attributes:
        packing (`packed.PackedRows`): the rows' lengths, and where their K/V go in the cache.
        layout_rows (`slice`): the packed rows among the layout's.
        rows, columns (`torch.LongTensor` `(T,)`, device): each packed position's row and column in the canvas.
        positions (`torch.LongTensor` `(T,)`): its column in its row's own canvas, also its RoPE position.
        cache_position (`torch.LongTensor` `(T,)`): `[0, T)`.
        logits_index (`torch.LongTensor` `(rows * length,)`): the packed positions whose logits the block's step
            reads.
    """

    def __init__(
        self, machine: StepMachine, layout, shifts: torch.Tensor, length: int, end: int, layout_rows: slice, own: bool
    ):
        """`shifts` `(n,)`: each layout row's shift; `own`: K/V go to each row's own columns of the cache's first
        rows (a block-causal joining row: `LayoutRun._first_step_from_store` saves them to its slot), else to its
        aligned columns (a bidirectional row: the block's later steps read them there)."""
        lengths, row_index, columns, logits_index, offset = [], [], [], [], 0
        block_columns = torch.arange(length)
        for i in range(layout_rows.start, layout_rows.stop):
            shift, row = int(shifts[i]), layout[i]
            own_columns = min(row.tokens.shape[0], end - shift)
            lengths.append(own_columns)
            row_index.append(torch.full((own_columns,), i))
            columns.append(torch.arange(shift, shift + own_columns))
            logits_index.append(offset + row.plan.blocks[row.block][0] - machine.shift + block_columns)
            offset += own_columns
        device = machine.device
        self.columns = torch.cat(columns).to(device)
        self.rows = torch.cat(row_index).to(device)
        self.positions = self.columns - shifts.to(device)[self.rows]
        cache_columns = self.positions if own else self.columns
        cache = machine.cache
        self.packing = PackedRows(lengths, cache, cache_columns if cache is not None else None, kept_per_row=length)
        self.layout_rows = layout_rows
        self.cache_position = torch.arange(self.columns.shape[0], device=device)
        self.logits_index = torch.cat(logits_index).to(device)

    def step(self, machine: StepMachine, canvas: Canvas, block_start, block_end, step, active, generated):
        """Step `step` of the packed rows, on their canvases packed end to end (their K/V go where `packing`
        says); counts the forward. Returns every layout row's block `(rows, L)` (the packed rows' new one, the
        others' as it is) and whether each edited a committed token `(rows,)`."""
        x, device, rows, packing = canvas.x, machine.device, self.layout_rows, self.packing
        tokens = x[self.rows, self.columns].unsqueeze(0)
        if step == 0:
            machine.first_step_positions += tokens.shape[1]
        logits = machine.forward_logits(
            tokens, packing, self.positions.unsqueeze(0), packing, self.cache_position, self.logits_index
        ).to(device)
        scheduled = machine.unmasking.scheduled_counts(step, x.shape[0], device)[rows]
        new_block = x[:, block_start:block_end].clone()
        edited = torch.zeros(x.shape[0], dtype=torch.bool, device=device)
        new_block[rows], _, edited[rows] = machine.decide(
            x[rows, block_start:block_end],
            logits.view(len(packing.lengths), block_end - block_start, -1),
            scheduled,
            None if generated is None else generated[rows],
            None if active is None else active[rows],
            rows=rows,
        )
        machine.nfe += 1
        return new_block, edited


class LayoutRun:
    """The decoding state of one settings group: a `StepMachine` (the rules, policies, cache and CUDA graphs of
    `generate()`'s run), with rows laid out anew on a `Canvas` before each block (`decode_block`) instead of one
    canvas for the whole call."""

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
        """`shared_cache(rows)` gives the engine's K/V cache (one for every settings group: layouts are decoded one
        after the other and no K/V survives in it between blocks); `store` keeps block-causal rows' exact K/V
        between blocks (used when the config caches); `row_bucket(k, limit)` (None: no padding rows), the rows a
        forward of `k` rows runs with when at most `limit` fit, `k <= row_bucket(k, limit) <= limit`
        (`_with_padding_rows`); `max_positions` (None: no budget), the K/V positions (rows x columns) the shared
        cache holds, which caps a layout's padding rows at its width."""
        self.store = store if model.diffusion_family.committed_kv_exact and config.use_cache else None
        policies = decoding_policies(model, config, None, StoredBlockCache() if self.store is not None else None)
        self.model, self.config, self.device = model, config, device
        self.max_width = max_width
        self.max_rows = max_rows
        self.row_bucket = row_bucket
        self.max_positions = max_positions
        self.canvas: Canvas | None = None  # the layout of the block under way (`decode_block`)
        self.packed: PackedLayout | None = None
        self.machine = StepMachine(
            model, config, device, policies, max_rows, shared_cache, self._graph_shape, ENGINE_MAX_GRAPHS
        )

    def _graph_shape(self, rows: int) -> tuple:
        # Layouts of every row count and width share the runner (rows and width are in each step's key); its cache
        # holds `max_positions` (another engine's runner, of another budget, is not taken over).
        return ("continuous", rows, self.max_width, self.max_positions)

    def release(self) -> None:
        """Give the model's CUDA-graph runner back (`StepMachine.release`): the settings group left."""
        self.machine.release()

    def decode_block(self, rows: list[EngineRequest], width: int) -> list[BlockUpdate]:
        """Decode the current block of every row in `rows` (one cohort: equal block length and steps) on a canvas
        of `width` columns (`layout_width`); returns each row's update (in the order of `rows`) and advances the
        rows.

        Forwards that start at a row's first column (the block's first step with a prefix/dual cache: the refresh;
        every step without a cache; a block-causal row's prefill) run on the rows packed end to end
        (`PackedLayout`), so no row pays for the others' lengths or misalignment in the block's most expensive
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
        first_real = rows[0]
        length = first_real.plan.blocks[first_real.block][1] - first_real.plan.blocks[first_real.block][0]
        block_start = max(row.plan.blocks[row.block][0] for row in rows)
        block_end = block_start + length
        canvas = self._lay_out(layout, width, block_start, block_end)
        self._plan_first_step(layout, where, len(rows), joining, block_start, block_end)
        steps = first_real.plan.block_steps[0, first_real.block]  # one cohort: every row's steps are equal
        canvas.denoise_block(self.machine, steps.expand(len(layout)).clone(), block_start, block_end, self.run_step)

        last = torch.tensor([row is not None and row.block == int(row.plan.last_block[0]) for row in layout])
        ended = canvas.finished_rows(self.machine, last, block_end)
        ended = torch.zeros(len(layout), dtype=torch.bool) if ended is None else ended.cpu()
        if bool(ended.any()):  # as generate() shows ended rows: EOS after the block (and after a block-causal EOS)
            canvas.fill_ended(self.machine, ended.to(self.device), block_end)
        updates = [None] * len(rows)
        for k, update in enumerate(self._advance(rows, where, ended, block_start, block_end)):
            updates[order[k]] = update
        return updates

    def _lay_out(self, layout: list[EngineRequest | None], width: int, block_start: int, block_end: int) -> Canvas:
        """The canvas of `layout` (`canvas`, also returned): every row shifted right so that its current block
        starts at `block_start`, its own RoPE positions, padding masked as keys. A padding row (None) is all prompt
        (no mask, nothing generated: it commits nothing, never ends, never adds a step) at unshifted columns, seeing
        the columns up to the block's end (finite attention). Sets each layout row's `starts` (its block's start in
        its own canvas), `shifts` and `prompt_lengths` (`(n,)` long, host)."""
        device, n = self.device, len(layout)
        starts = torch.tensor([block_start if row is None else row.plan.blocks[row.block][0] for row in layout])
        shifts = block_start - starts
        prompt_lengths = torch.tensor([width if row is None else int(row.plan.prompt_end[0]) for row in layout])
        x = torch.full((n, width), self.config.prompt_pad_token_id, dtype=torch.long, device=device)
        key_mask = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, row in enumerate(layout):
            if row is None:
                key_mask[i, :block_end] = 1
                continue
            shift, own = int(shifts[i]), min(row.tokens.shape[0], width - int(shifts[i]))
            x[i, shift : shift + own] = row.tokens[:own]
            key_mask[i, shift : shift + own] = 1
        columns = torch.arange(width, device=device)
        position_ids = (columns - shifts.to(device).unsqueeze(-1)).clamp(min=0)
        host_prompt_end = shifts + prompt_lengths
        self.canvas = Canvas(x, position_ids, key_mask, host_prompt_end.to(device), host_prompt_end)
        self.starts, self.shifts, self.prompt_lengths = starts, shifts, prompt_lengths
        if self.machine.cache is not None:  # every policy here recomputes all of it at the block's first step
            self.machine.cache.set_length(width)
        return self.canvas

    def _plan_first_step(self, layout, where: list[int], real: int, joining: int, block_start: int, block_end: int):
        """How the block's first step runs (`run_step`): packed rows (`packed`), and with a store the continuing and
        joining rows (`_first_step_from_store`). `where`: the layout row of each of the `real` rows (the others
        are padding), the last `joining` of them at their first block."""
        self.packed = None
        length = block_end - block_start
        if self.store is not None:
            self.joining, self.continuing = joining, real - joining
            # Layout rows of the continuing rows' first-step forward (theirs and their padding), then the joining
            # rows'. A padding row loads the first row's slot (any finite K/V do) and saves nothing.
            self.first_step_rows = where[self.continuing] if joining else len(layout)
            first_real = layout[where[0]]
            self.slots = torch.tensor([(first_real if row is None else row).slot for row in layout])
            if joining:  # their prefill: prompt and first block, each at its own columns
                joining_rows = slice(self.first_step_rows, self.first_step_rows + joining)
                self.packed = PackedLayout(self.machine, layout, self.shifts, length, block_end, joining_rows, True)
        elif self.model.diffusion_packed_rows and not self.machine.cfg:
            width = self.canvas.width
            first, end = self.machine.cache_policy.query_range(block_start, block_end, width, first_step=True)
            if first == 0:  # the whole canvas (bidirectional), or up to the block (block-causal, no cache)
                self.packed = PackedLayout(self.machine, layout, self.shifts, length, end, slice(0, real), False)

    def _advance(self, rows, where: list[int], ended: torch.Tensor, block_start: int, block_end: int):
        """Copy each row's decoded block (an ended row: its whole canvas, as `fill_ended` shows it) back into its
        own canvas and advance it; returns each row's `BlockUpdate`, in the order of `rows` (`where`: each one's
        layout row; `ended` `(n,)` bool, host)."""
        x, width, length = self.canvas.x, self.canvas.width, block_end - block_start
        block = x[:, block_start:block_end].cpu()  # the one copy to the host of this block
        nfe = self.canvas.nfe_per_row.tolist()
        updates = []
        for i, row in zip(where, rows, strict=True):
            start, shift, prompt = int(self.starts[i]), int(self.shifts[i]), int(self.prompt_lengths[i])
            if bool(ended[i]):  # as `fill_ended` shows it: the fill token after the layout's columns too
                own = min(row.tokens.shape[0], width - shift)
                row.tokens = torch.full_like(row.tokens, self.machine.fill_id)
                row.tokens[:own] = x[i, shift : shift + own]
            else:
                row.tokens[start : start + length] = x[i, block_start:block_end]
            previous = row.committed
            row.committed = max(0, min(start + length - prompt, row.config.max_new_tokens))
            row.nfe += nfe[i]
            row.block += 1
            new = block[i, previous + prompt - start : row.committed + prompt - start].tolist()
            updates.append(BlockUpdate(new, bool(ended[i]), row.nfe))
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

    def run_step(self, block_start, block_end, step, active=None, generated=None):
        """The layout's step `step` of the block (`Canvas.denoise_block`'s `run_step`), written into the canvas:
        `StepMachine.step_rows`, but with a store the first step is `_first_step_from_store`, and a step over whole
        canvases runs packed (`PackedLayout`) where the model takes packed rows: the block's first step, and without
        a cache every step where no CUDA graphs run it (on a GPU the captured aligned step is kept: it was measured,
        the packed eager one is not). Returns the new block `(rows, L)` and whether each row edited a committed
        token `(rows,)`."""
        machine, canvas = self.machine, self.canvas
        if step == 0 and self.store is not None:
            return self._first_step_from_store(block_start, block_end, active, generated)
        if self.packed is not None and (step == 0 or (machine.cache is None and machine.graphs is None)):
            new_block, edited = self.packed.step(machine, canvas, block_start, block_end, step, active, generated)
        else:
            new_block, _, edited = machine.step_rows(canvas, block_start, block_end, step, active, generated)
        canvas.x[:, block_start:block_end] = new_block
        return new_block, edited

    def _first_step_from_store(self, block_start, block_end, active, generated):
        """The block's first step with the rows' K/V kept in the store (block-causal models; layout rows as in
        `decode_block`: the `continuing` rows that decoded a block before and their padding rows, the first
        `first_step_rows`, then the `joining` rows at their first block (the packed rows), then padding rows).

        1. The joining rows' prefill: prompt and block at their own columns (`generate()`'s first step), packed
           (`PackedLayout`), written to the cache's first rows; their prompt's K/V (exact: columns before the
           block) go to their slots.
        2. Every row's slot is copied into the aligned layout at the row's columns.
        3. The continuing rows' forward (`StoredBlockCache`: previous block and block, on the cache's first rows);
           the previous block's K/V (exact now) go to their slots.
        Returns the new block `(rows, L)` and the rows that edited a committed token, as `run_step`."""
        continuing, length = self.continuing, block_end - block_start
        machine, canvas = self.machine, self.canvas
        if self.joining:
            rows = self.packed.layout_rows
            new_block, edited = self.packed.step(machine, canvas, block_start, block_end, 0, active, generated)
            prefix = torch.arange(int(self.starts[rows].max())).expand(self.joining, -1)
            self.store.save(machine.cache, self.slots[rows], prefix, prefix)
        else:
            new_block = canvas.x[:, block_start:block_end].clone()
            edited = torch.zeros(canvas.x.shape[0], dtype=torch.bool, device=self.device)
        self.store.load(machine.cache, self.slots, self.shifts, block_start)
        if continuing:
            # `StoredBlockCache`: the previous block and the block, at the aligned columns, of the continuing rows.
            first = self.first_step_rows
            step = machine.step_rows(canvas, block_start, block_end, 0, active, generated, first)
            new_block[:first], _, edited[:first] = step
            previous = torch.arange(block_start - length, block_start).expand(continuing, -1)
            self.store.save(machine.cache, self.slots[:continuing], previous, previous - self.shifts[:continuing, None])
        canvas.x[:, block_start:block_end] = new_block
        return new_block, edited
