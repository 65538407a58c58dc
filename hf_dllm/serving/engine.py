"""Continuous batching for block diffusion: requests join a running batch at block boundaries and leave at EOS.

Diffusion decoding has a natural admission point: every block boundary. A bidirectional model's caches (prefix,
dual, none) recompute every position at a block's first step anyway, and a block-causal model's blocks before the
current one hold committed tokens only. So between two blocks nothing ties a row to its place in the batch, and
the engine lays the running rows out anew before every block:

- Each row is a request's prompt as `generate()` would decode it alone (its own `BlockPlan`, columns counted
  from its first prompt token). Before a block, every row is shifted right so that its *current* block starts at
  one shared column `C` (rows of different requests are at different blocks of their own plans); columns before
  a row's prompt and after its canvas are padding, masked as keys, and each row's RoPE positions are its own. The
  block is then decoded by the one loop (`BlockDiffusionRun.denoise_block`: the same steps, policies, caches and
  CUDA graphs as `generate()`), and each row's block is copied back into its own canvas. In float32 a row's
  tokens and forwards are those of `generate()` alone: padding is masked, nothing else is shared.
- A block's forwards over whole canvases (the prefix/dual cache's refresh at the block's first step, the dual
  cache of Fast-dLLM, arXiv:2505.22618; every step without a cache) are most of the work, and the aligned layout
  would compute every row at the widest row's columns. Where the model takes packed rows (LLaDA, Dream:
  `packed.PackedRows`) they run on the rows' canvases laid end to end instead, each row attending to itself: no
  padding is computed, and the keys/values go straight to each row's aligned columns of the cache.
- Rows step together within a block, so the rows of one layout must agree on the block's length, its number of
  steps and every setting except `max_new_tokens` and `steps` (which only shape a row's own plan): a `cohort`.
  Rows that differ are decoded in separate layouts at the same boundary, one after the other.
- Block-causal models (LLaDA2.x) are shifted by whole blocks (their blocks stay aligned to positions). A committed
  block's K/V never change, so, as `generate()` does (`ExactBlockCache`), each is computed once: every running row
  owns a slot of a K/V store (`row_cache.RowKVStore`, its exact K/V at its own columns) that is copied into the
  layout's cache at the row's shifted columns before the block, and the block's first step (`StoredBlockCache`)
  recomputes only the previous block (committed now; its K/V go back to the store) and the block. Rows at their
  first block (joining) are prefilled in a forward of their own, each at its own columns (prompt and first block,
  `generate()`'s first step), so continuing rows never pay for a joining row's prompt. A row takes part in one of
  the two forwards: its forwards (NFE) are still `generate()`'s; the engine makes one forward more.
- One K/V cache of `max_batch_size x max_batch_width` columns serves every layout (a view of its first columns,
  `DiffusionKVCache.set_length`), so captured CUDA graphs keep their addresses; a layout's width is rounded up to
  `width_granularity` columns, so few shapes (graphs) are needed.

`ContinuousBatcher` owns the running rows: `submit()` queues requests (any thread), `decode_boundary()` admits
waiting requests that fit, decodes one block of every running row and reports each row's new tokens to its
`on_block` callback, which may end the row (a stop string, a disconnected client); rows that ended leave and
their places are taken at the next boundary. `serving.batching` runs it in a thread for `hf-dllm serve`.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache import StoredBlockCache
from ..generation_config import DiffusionGenerationConfig
from ..generation_utils import (
    BlockDiffusionRun,
    BlockPlan,
    decoding_policies,
    plan_bidirectional,
    plan_block_causal,
)
from ..graphs import StepGraphs
from ..packed import PackedRows
from .row_cache import RowKVStore


def settings_key(config: DiffusionGenerationConfig, without: tuple[str, ...] = ()) -> str:
    """Resolved settings as a key: rows may share a layout only when every setting (but `without`) is equal."""
    return json.dumps(
        {name: getattr(config, name) for name in config.field_names() if name not in without}, sort_keys=True
    )


@dataclass(eq=False)
class BlockUpdate:
    """What one committed block gave a row: its new generated tokens, whether the row ended by the run's own rules
    (EOS with `eos_early_stop`, in-block EOS stop, last block) and its forwards so far."""

    new_tokens: list[int]
    ended: bool
    nfe: int


@dataclass(eq=False)
class EngineRequest:
    """One prompt to decode with `config` (resolved settings, as for `generate()`). `on_block(update)` is called
    (from the engine's thread) after every block the row decoded; returning True ends the row there (it takes
    part in no more forwards). `cancelled` ends it at the next boundary without another call."""

    prompt_ids: list[int]
    config: DiffusionGenerationConfig
    on_block: Callable[[BlockUpdate], bool | None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Called with the row's forwards when the engine drops it because `cancelled` was set (no `on_block` call).
    on_cancel: Callable[[int], None] | None = None
    # Set by the engine.
    settings: str = ""  # `settings_key` of `config` without `max_new_tokens` and `steps`
    error: BaseException | None = None  # why the row ended without finishing, if a layout failed
    plan: BlockPlan | None = None
    tokens: torch.Tensor | None = None  # `(canvas_width,)` the row's own canvas: prompt, then generated positions
    block: int = 0  # the next block of `plan.blocks` to decode
    slot: int = -1  # the row's place while it runs (its `RowKVStore` slot for block-causal models)
    nfe: int = 0
    committed: int = 0  # generated positions final so far
    ended: bool = False

    @property
    def generated(self) -> torch.Tensor:
        """`(max_new_tokens,)` the row's generated positions (masks where not decoded; EOS after its end)."""
        start = int(self.plan.prompt_end[0])
        return self.tokens[start : start + self.config.max_new_tokens]


# Captured step shapes the engine keeps: its layouts vary in rows and width (`ContinuousBatcher.width_granularity`),
# far more than one `generate()` call's shapes, and a shape dropped from the cache is run eagerly and captured again.
ENGINE_MAX_GRAPHS = 128


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
    ):
        """`shared_cache()` gives the engine's K/V cache (one for every settings group: layouts are decoded one
        after the other and no K/V survives in it between blocks); `store` keeps block-causal rows' exact K/V
        between blocks (used when the config caches)."""
        block_causal = bool(getattr(model, "diffusion_block_causal", False))
        self.store = store if block_causal and config.use_cache else None
        cache_policy = StoredBlockCache() if self.store is not None else None
        self._setup_decoding(model, config, device, None, cache_policy)
        self.first_step_positions = 0  # positions (rows x columns) fed to the model by blocks' first steps
        self.streamer = None
        self.stopping_criteria = []
        self.max_rows, self.max_width = max_rows, max_width
        self._shared_cache = shared_cache
        self.rows_per_forward = max_rows * (2 if self.cfg else 1)
        self.graphs = None
        if self._graphs_allowed():
            signature = ("continuous", self.rows_per_forward, max_width, *self._graph_signature())
            self.graphs = StepGraphs.acquire(model, signature, self._new_cache, ENGINE_MAX_GRAPHS)
        self.cache = self.graphs.cache if self.graphs is not None else self._new_cache()
        self._setup_rules()

    def _new_cache(self):
        return self._shared_cache(self.rows_per_forward) if self.cache_policy.uses_cache else None

    def release(self) -> None:
        if self.graphs is not None:
            StepGraphs.release_to(self.model)
            self.graphs = None

    def decode_block(self, rows: list[EngineRequest], width: int, compact_width: int) -> list[BlockUpdate]:
        """Decode the current block of every row in `rows` (one cohort: equal block length and steps) on a canvas
        of `width` columns (`layout_width`); returns each row's update (in the order of `rows`) and advances the
        rows.

        Forwards over every row's whole canvas (the block's first step with a cache: the prefix/dual cache refresh;
        every step without one) run on the rows packed end to end where the model takes packed rows
        (`_packed_step`), so no row pays for the others' lengths or misalignment in the block's most expensive
        forward. Block-causal rows keep their K/V in the store instead (`_first_step_from_store`): only the rows at
        their first block run on the compact layout (their prefill, `compact_width` wide), the others recompute
        their previous block in the aligned one."""
        order = list(range(len(rows)))
        if self.store is not None:  # the rows that continue first, then those at their first block (joining)
            order.sort(key=lambda i: rows[i].block == 0)
            rows = [rows[i] for i in order]
        device, n = self.device, len(rows)
        starts = torch.tensor([row.plan.blocks[row.block][0] for row in rows])
        length = rows[0].plan.blocks[rows[0].block][1] - int(starts[0])
        block_start = int(starts.max())
        shifts = block_start - starts
        self.x = torch.full((n, width), self.config.prompt_pad_token_id, dtype=torch.long, device=device)
        self.key_mask = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, row in enumerate(rows):
            shift, own = int(shifts[i]), min(row.tokens.shape[0], width - int(shifts[i]))
            self.x[i, shift : shift + own] = row.tokens[:own]
            self.key_mask[i, shift : shift + own] = 1
        device_shifts = shifts.to(device)
        columns = torch.arange(width, device=device)
        self.position_ids = (columns - device_shifts.unsqueeze(-1)).clamp(min=0)
        prompt_lengths = torch.tensor([int(row.plan.prompt_end[0]) for row in rows])
        self.host_prompt_end = shifts + prompt_lengths
        self.prompt_end = self.host_prompt_end.to(device)
        self.seq_len = width
        self.rows, self.host_rows = torch.arange(n, device=device), torch.arange(n)
        self.stopped = torch.zeros(n, dtype=torch.bool, device=device)
        self.nfe_per_row = torch.zeros(n, dtype=torch.long, device=device)
        self.attention_masks = {}
        if self.cache is not None:  # every policy here recomputes all of it at the block's first step
            self.cache.set_length(width)
        self.refresh = self.packed = None
        if self.store is not None:
            self.joining = sum(row.block == 0 for row in rows)
            self.slots, self.shifts, self.starts = torch.tensor([row.slot for row in rows]), shifts, starts
            if self.joining:
                joining = slice(n - self.joining, n)
                self.refresh = self._compact_refresh(
                    rows[joining], starts[joining], length, compact_width, device_shifts[joining]
                )
        elif self.model.diffusion_packed_rows and not self.cfg:
            self.packed = self._packed_layout(rows, shifts, length)
        steps = torch.stack([row.plan.block_steps[0, row.block] for row in rows])
        block_end = block_start + length
        self.denoise_block(steps, block_start, block_end)

        last = torch.tensor([row.block == int(row.plan.last_block[0]) for row in rows])
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
        updates = [None] * n
        for i, row in enumerate(rows):
            start, shift, prompt = int(starts[i]), int(shifts[i]), int(prompt_lengths[i])
            if bool(ended[i]):
                row.tokens = self.x[i, shift : shift + row.tokens.shape[0]].clone()
            else:
                row.tokens[start : start + length] = self.x[i, block_start:block_end]
            previous = row.committed
            row.committed = max(0, min(start + length - prompt, row.config.max_new_tokens))
            row.nfe += nfe[i]
            row.block += 1
            new = block[i, previous + prompt - start : row.committed + prompt - start].tolist()
            updates[order[i]] = BlockUpdate(new, bool(ended[i]), row.nfe)
        return updates

    def _compact_refresh(self, rows, starts, length: int, width: int, shifts: torch.Tensor) -> dict:
        """Inputs of the block's full forward with every row of `rows` at its own columns `[0, canvas)`
        (`(len(rows), width)`)."""
        device, n = self.device, len(rows)
        tokens = torch.full((n, width), self.config.prompt_pad_token_id, dtype=torch.long, device=device)
        key_mask = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, row in enumerate(rows):
            own = min(row.tokens.shape[0], width)
            tokens[i, :own] = row.tokens[:own]
            key_mask[i, :own] = 1
        block_index = starts.to(device).unsqueeze(-1) + torch.arange(length, device=device)
        return dict(tokens=tokens, key_mask=key_mask, block_index=block_index, width=width, shifts=shifts)

    def _packed_layout(self, rows, shifts: torch.Tensor, length: int) -> dict:
        """Where the rows' canvases lie in the aligned layout, for forwards of every row's whole canvas packed end
        to end (`packed.PackedRows`: no padding): `lengths` (host), and `(T,)` device tensors `rows` and `columns`
        (each packed position's place in `self.x` and in the cache), `positions` (its RoPE position, the row's own
        column) and `logits_index` `(rows * length,)` (the packed positions whose logits the block's step reads)."""
        lengths, row_index, columns, logits_index, offset = [], [], [], [], 0
        block_columns = torch.arange(length)
        for i, row in enumerate(rows):
            shift = int(shifts[i])
            own = min(row.tokens.shape[0], self.seq_len - shift)
            lengths.append(own)
            row_index.append(torch.full((own,), i))
            columns.append(torch.arange(shift, shift + own))
            logits_index.append(offset + row.plan.blocks[row.block][0] - self.shift + block_columns)
            offset += own
        device = self.device
        columns = torch.cat(columns).to(device)
        return dict(
            lengths=lengths,
            rows=torch.cat(row_index).to(device),
            columns=columns,
            positions=columns - shifts.to(device).repeat_interleave(torch.tensor(lengths).to(device)),
            logits_index=torch.cat(logits_index).to(device),
        )

    def _packed_step(self, block_start, block_end, step, active, generated):
        """A step whose forward covers every row's whole canvas (the block's full forward, which refreshes the
        prefix/dual cache; every step without a cache), computed on the rows packed end to end (`_packed_layout`),
        so no padding column is computed; with a cache, each row's keys/values are written at its aligned columns,
        where the block's later steps read them. Returns what `run_step` returns."""
        packed, n, length = self.packed, self.x.shape[0], block_end - block_start
        packing = PackedRows(
            packed["lengths"],
            self.cache,
            packed["columns"] if self.cache is not None else None,
            kept_per_row=length,
        )
        tokens = self.x[packed["rows"], packed["columns"]].unsqueeze(0)
        if step == 0:
            self.first_step_positions += tokens.shape[1]
        logits = self.model._diffusion_forward(
            tokens,
            packing,
            packed["positions"].unsqueeze(0),
            packing,
            torch.arange(tokens.shape[1], device=self.device),
            packed["logits_index"],
            **self.forward_kwargs,
        ).to(self.device)
        scheduled = self.unmasking.scheduled_counts(step, n, self.device)
        block = self.x[:, block_start:block_end]
        new_block, _, edited = self.decide(block, logits.view(n, length, -1), scheduled, generated, active)
        self.nfe += 1
        self.x[:, block_start:block_end] = new_block
        return new_block, edited

    def _compact_inputs(self, block_start, block_end, active, generated, rows: slice):
        """The first step's inputs on the compact layout (`self.refresh`) of the layout's rows `rows` (`active`
        and `generated` are the layout's), and the key of its CUDA graph."""
        refresh, device = self.refresh, self.device
        n, width = refresh["tokens"].shape
        columns = torch.arange(width, device=device)
        self.cache.set_length(width)
        attention_mask = self.model._diffusion_attention_mask(refresh["key_mask"], width)
        inputs = dict(
            tokens=refresh["tokens"],
            position_ids=columns.expand(n, -1),
            cache_position=columns,
            logits_index=refresh["block_index"] - self.shift,
            block_index=refresh["block_index"],
            scheduled=self.unmasking.scheduled_counts(0, self.x.shape[0], device)[rows],
            active=None if active is None else active[rows],
            generated=None if generated is None else generated[rows],
            attention_mask=attention_mask,
        )
        return inputs, ("compact", n, width, block_end - block_start, attention_mask is not None)

    def _forward(self, inputs: dict, key: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`step(**inputs)`, through the CUDA graph of `key` when the run has graphs."""
        self.first_step_positions += inputs["tokens"].numel()
        if self.graphs is None:
            return self.step(**inputs)
        return self.graphs.run(key, self.step, inputs)

    def run_step(self, block_start, block_end, step, active=None, generated=None):
        """`BlockDiffusionRun.run_step`; a step over whole canvases runs packed (`_packed_step`) where the model
        takes packed rows; with a store, the first step is `_first_step_from_store`."""
        if step == 0 and self.store is not None:
            return self._first_step_from_store(block_start, block_end, active, generated)
        if self.packed is not None and (step == 0 or self.cache is None):
            return self._packed_step(block_start, block_end, step, active, generated)
        if step == 0:
            q_start, q_end = self.cache_policy.query_range(block_start, block_end, self.seq_len, first_step=True)
            self.first_step_positions += self.x.shape[0] * (q_end - q_start)
        return super().run_step(block_start, block_end, step, active, generated)

    def _first_step_from_store(self, block_start, block_end, active, generated):
        """The block's first step with the rows' K/V kept in the store (block-causal models; rows ordered as in
        `decode_block`: `continuing` rows that decoded a block before, then `joining` rows at their first block).

        1. The joining rows' prefill: prompt and block at their own columns (`generate()`'s first step), on the
           cache's first rows; their prompt's K/V (exact: columns before the block) go to their slots.
        2. Every row's slot is copied into the aligned layout at the row's columns.
        3. The continuing rows' forward (`StoredBlockCache`: previous block and block, on the cache's first rows);
           the previous block's K/V (exact now) go to their slots.
        Returns the new block `(rows, L)` and the rows that edited a committed token, as `run_step`."""
        n, joining = self.x.shape[0], self.joining
        continuing, length = n - joining, block_end - block_start
        new_block = self.x[:, block_start:block_end].clone()
        edited = torch.zeros(n, dtype=torch.bool, device=self.device)
        if joining:
            rows = slice(continuing, n)
            inputs, key = self._compact_inputs(block_start, block_end, active, generated, rows)
            new_block[rows], _, edited[rows] = self._forward(inputs, key)
            self.nfe += 1
            prefix = torch.arange(int(self.starts[rows].max())).expand(joining, -1)
            self.store.save(self.cache, self.slots[rows], prefix, prefix)
        self.cache.set_length(self.seq_len)
        self.store.load(self.cache, self.slots, self.shifts, block_start)
        if continuing:
            # `StoredBlockCache`: the previous block and the block, at the aligned columns, of the continuing rows.
            inputs, key = BlockDiffusionRun._step_inputs(self, block_start, block_end, 0, active, generated, continuing)
            new_block[:continuing], _, edited[:continuing] = self._forward(inputs, key)
            self.nfe += 1
            previous = torch.arange(block_start - length, block_start).expand(continuing, -1)
            self.store.save(self.cache, self.slots[:continuing], previous, previous - self.shifts[:continuing, None])
        self.x[:, block_start:block_end] = new_block
        return new_block, edited


def cohort_key(row: EngineRequest) -> tuple:
    """Rows of equal keys share a layout: the same settings (but `max_new_tokens` and `steps`), and current blocks
    of the same length and number of steps."""
    start, end = row.plan.blocks[row.block]
    return (row.settings, end - start, int(row.plan.block_steps[0, row.block]))


class ContinuousBatcher:
    """The running rows of one model and the requests waiting to join them (see the module doc).

    Args:
        model: a `DiffusionGenerationMixin` model.
        max_batch_size: rows decoded at once (at most; rows of different settings groups count together).
        max_batch_width: the widest layout (columns); the K/V cache holds `max_batch_size x max_batch_width`
            positions (block-causal models: as many again in the rows' K/V store, `row_cache.RowKVStore`).
            Default: the model's context (`max_sequence_length` / `max_position_embeddings`), so any request that
            fits the context can run, alone if need be.
        width_granularity: layouts are rounded up to a multiple of this many columns, so that few CUDA-graph
            shapes are captured. Default: 64 on CUDA, 1 elsewhere (no graphs; and a row decoding alone then has no
            padding, so its float32 arithmetic is exactly `generate()`'s: masked padding columns change the order
            of attention's sums, which can flip a near-tie between two tokens).
    """

    def __init__(
        self,
        model,
        *,
        max_batch_size: int = 16,
        max_batch_width: int | None = None,
        width_granularity: int | None = None,
    ):
        self.device = model.get_input_embeddings().weight.device
        if width_granularity is None:
            width_granularity = 64 if self.device.type == "cuda" else 1
        for name, value in (("max_batch_size", max_batch_size), ("width_granularity", width_granularity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
        if max_batch_width is None:
            max_batch_width = getattr(model.config, "max_sequence_length", None) or getattr(
                model.config, "max_position_embeddings", None
            )
        if not isinstance(max_batch_width, int) or isinstance(max_batch_width, bool) or max_batch_width < 1:
            raise ValueError(f"`max_batch_width` must be an integer >= 1, got {max_batch_width!r}.")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_batch_width = max_batch_width
        self.width_granularity = width_granularity
        self.block_causal = bool(getattr(model, "diffusion_block_causal", False))
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.runs: dict[str, LayoutRun] = {}
        self.cache = None
        # Block-causal rows' exact K/V between blocks, a slot per running row (buffers allocated at first use).
        self.store = RowKVStore(max_batch_size, max_batch_width) if self.block_causal else None
        self.lock = threading.Lock()
        self.forwards = 0  # model forwards made (one batched forward counts once)
        # Positions (rows x columns, padding included) fed to the model by blocks' first steps: what rows recompute
        # of their prefix (and joining rows' prefill).
        self.first_step_positions = 0
        self.layouts = 0  # layouts decoded (one per cohort per boundary)
        self.last_layout_sizes: list[int] = []  # rows of each layout of the last boundary

    # -- requests ---------------------------------------------------------------------------------------------
    def prepare(self, request: EngineRequest) -> EngineRequest:
        """Plan `request` as `generate()` plans a lone prompt; raises ValueError for what generate() refuses."""
        config, prompt = request.config, list(request.prompt_ids)
        if not prompt:
            raise ValueError("`prompt_ids` is empty: a row needs at least one prompt token.")
        if self.block_causal:
            plan = plan_block_causal([len(prompt)], len(prompt), config, torch.device("cpu"))
        else:
            plan = plan_bidirectional(len(prompt), 1, config, torch.device("cpu"))
        if plan.canvas_width > self.max_batch_width:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens decoding {config.max_new_tokens} needs {plan.canvas_width} "
                f"columns, more than max_batch_width ({self.max_batch_width})."
            )
        # What the run's rules refuse (e.g. a setting the model family does not take) fails this request now,
        # not the layout it would join.
        decoding_policies(self.model, config)
        tokens = torch.full((plan.canvas_width,), config.mask_token_id, dtype=torch.long)
        tokens[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        request.plan, request.tokens = plan, tokens.to(self.device)
        # A row's length and its total of steps only shape its own plan (`BlockPlan`): rows that differ only there
        # share a layout whenever their current blocks have the same length and steps (`cohort_key`).
        request.settings = settings_key(config, without=("max_new_tokens", "steps"))
        return request

    def submit(self, request: EngineRequest) -> None:
        """Queue a request (any thread); it joins the batch at the next boundary where it fits."""
        if request.plan is None:
            self.prepare(request)
        with self.lock:
            self.waiting.append(request)

    def pending(self) -> int:
        with self.lock:
            return len(self.waiting)

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.running or self.waiting)

    # -- layouts ----------------------------------------------------------------------------------------------
    def layout_width(self, rows: list[EngineRequest]) -> int:
        """Columns of the layout of `rows`: their current blocks aligned at the latest block start, plus the
        longest rest of a canvas after it, rounded up to `width_granularity` (at most `max_batch_width`)."""
        starts = [row.plan.blocks[row.block][0] for row in rows]
        width = max(starts) + max(row.plan.canvas_width - start for row, start in zip(rows, starts, strict=True))
        rounded = -(-width // self.width_granularity) * self.width_granularity
        return max(width, min(rounded, self.max_batch_width))

    def compact_width(self, rows: list[EngineRequest]) -> int:
        """Columns of the prefill of block-causal rows at their first block (joining; the others' prefix is in
        the store), each at its own columns up to the end of that block (later blocks are never attended); 0 when
        no row joins, and for bidirectional models (their full forwards run packed or on the aligned layout)."""
        joining = [row.plan.blocks[row.block][1] for row in rows if row.block == 0]
        if not self.block_causal or not joining:
            return 0
        width = max(joining)
        rounded = -(-width // self.width_granularity) * self.width_granularity
        return max(width, min(rounded, self.layout_width(rows)))

    def _admit(self) -> None:
        """Waiting requests join, oldest first, while there is a free row and their layout fits the cache; the
        oldest waits for room rather than be passed (no starvation)."""
        with self.lock:
            if any(row.cancelled.is_set() for row in self.waiting):
                self.waiting = deque(row for row in self.waiting if not self._drop_cancelled(row))
            free = sorted(set(range(self.max_batch_size)) - {row.slot for row in self.running})
            while self.waiting and len(self.running) < self.max_batch_size:
                head = self.waiting[0]
                partners = [row for row in self.running if cohort_key(row) == cohort_key(head)]
                if partners and self.layout_width([*partners, head]) > self.max_batch_width:
                    break
                head.slot = free.pop(0)
                self.running.append(self.waiting.popleft())

    def _cohorts(self) -> list[list[EngineRequest]]:
        """The running rows grouped into layouts (cohorts), each split further where it would exceed the cache's
        width; in order of their oldest row."""
        groups: dict[tuple, list[EngineRequest]] = {}
        for row in self.running:
            groups.setdefault(cohort_key(row), []).append(row)
        layouts = []
        for rows in groups.values():
            current: list[EngineRequest] = []
            for row in rows:
                if current and self.layout_width([*current, row]) > self.max_batch_width:
                    layouts.append(current)
                    current = []
                current.append(row)
            layouts.append(current)
        return layouts

    def _run_for(self, row: EngineRequest) -> LayoutRun:
        """The decoding state of the row's settings group (made when the group appears; the first group holds the
        model's CUDA-graph runner, the others run eagerly until it leaves)."""
        run = self.runs.get(row.settings)
        if run is None:
            run = LayoutRun(
                self.model,
                row.config,
                self.max_batch_size,
                self.max_batch_width,
                self.device,
                self._shared_cache,
                self.store,
            )
            self.runs[row.settings] = run
        return run

    def _shared_cache(self, rows: int):
        if self.cache is None or self.cache.max_batch_size < rows:
            self.cache = self.model._diffusion_new_cache(rows, self.max_batch_width)
        return self.cache

    def decode_boundary(self) -> int:
        """One block boundary: admit waiting requests, decode one block of every running row, report each row's
        update to its `on_block` and drop the rows that ended. Returns the number of rows decoded. A layout that
        fails (an exception in the model) ends its rows with the exception re-raised after the others ran."""
        self.running = [row for row in self.running if not self._drop_cancelled(row)]
        self._admit()
        decoded, failure = 0, None
        self.last_layout_sizes = []
        for rows in self._cohorts():
            try:
                run = self._run_for(rows[0])
                before, positions = run.nfe, run.first_step_positions
                with torch.no_grad():
                    updates = run.decode_block(rows, self.layout_width(rows), self.compact_width(rows))
            except Exception as error:  # the other layouts still decode; these rows end with the error
                for row in rows:
                    row.ended = True
                    row.error = error
                failure = failure or error
                continue
            self.forwards += run.nfe - before
            self.first_step_positions += run.first_step_positions - positions
            self.layouts += 1
            self.last_layout_sizes.append(len(rows))
            decoded += len(rows)
            for row, update in zip(rows, updates, strict=True):
                stop = row.on_block(update)
                row.ended = update.ended or bool(stop) or row.cancelled.is_set()
        self.running = [row for row in self.running if not row.ended]
        groups = {row.settings for row in self.running}
        for settings in [settings for settings in self.runs if settings not in groups]:
            self.runs.pop(settings).release()
        if failure is not None:
            raise failure
        return decoded

    @staticmethod
    def _drop_cancelled(row: EngineRequest) -> bool:
        """Whether `row` leaves before decoding (cancelled, or ended); a cancelled row's `on_cancel` is told."""
        if row.cancelled.is_set() and not row.ended:
            row.ended = True
            if row.on_cancel is not None:
                row.on_cancel(row.nfe)
        return row.ended

    def graph_counts(self) -> dict[str, int]:
        """Steps the model's CUDA-graph runner ran eagerly, captured and replayed (zeros without graphs): how
        often the engine's layouts hit a captured shape."""
        runner = getattr(self.model, "_hf_dllm_step_graphs", None)
        return dict(runner.counts) if runner is not None else {"eager": 0, "captured": 0, "replayed": 0}

    def abandon(self) -> None:
        """Forget every waiting and running row (the server is shutting down: their owners are told) and give the
        model's CUDA-graph runner back."""
        with self.lock:
            self.waiting.clear()
        self.running = []
        self.release()

    def release(self) -> None:
        """Give the model's CUDA-graph runner back (the captured graphs stay with the model for the next run of
        the same signature)."""
        for run in self.runs.values():
            run.release()
        self.runs = {}

    def run_until_done(self) -> None:
        """Decode boundaries until no row runs or waits (tests, offline use)."""
        while self.has_work():
            self.decode_boundary()
