"""Continuous batching for block diffusion: requests join a running batch at block boundaries and leave at EOS.

Diffusion decoding has a natural admission point: every block boundary. A bidirectional model's caches (prefix,
dual, none) recompute every position at a block's first step anyway, and a block-causal model's blocks before the
current one hold committed tokens only. So between two blocks nothing ties a row to its place in the batch: the
engine lays the running rows out anew before every block, each at its own block of its own plan (`layout.py`
says how a layout is decoded, by the one block loop, with each row's tokens and forwards those of `generate()`
alone).

- Rows step together within a block, so the rows of one layout must agree on the block's length, its number of
  steps and every setting except `max_new_tokens` and `steps` (which only shape a row's own plan): a `cohort`.
  Rows that differ are decoded in separate layouts at the same boundary, one after the other.
- Optionally (`max_refresh_positions`, off by default), a bidirectional model's layout whose canvases hold more
  positions is cut into slices (`Slice`), and requests that arrive during the boundary join the slices still to
  decode.
- One K/V cache serves every layout: `max_batch_size x max_batch_width` positions, or a budget of
  `max_batch_positions` (rows x columns: many narrow rows or few wide ones, the default for bidirectional models on
  CUDA); a layout's width is rounded up to `width_granularity` columns (block-causal rows: only their visible
  columns, in power-of-two widths) and, on CUDA, its rows to a bucket (`bucketed_rows`: padding rows that commit
  nothing), so few shapes (CUDA graphs) are needed.

`ContinuousBatcher` owns the running rows: `submit()` queues requests (any thread) in its `admission.Admission`,
`decode_boundary()` admits waiting requests that fit, groups the running rows into layouts
(`scheduler.LayoutScheduler`), decodes one block of every running row (`runner.LayoutRunner`) and reports each
row's new tokens to its `on_block` callback, which may end the row (a stop string, a disconnected client); rows
that ended leave and their places are taken at the next boundary. `serving.batching` runs it in a thread for `hf-dllm serve`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..generation_config import DiffusionGenerationConfig, is_int
from ..step_machine import decoding_policies
from .admission import Admission, drop_cancelled
from .layout import LayoutRun, kv_positions  # noqa: F401 (tests patch engine.LayoutRun)
from .options import AUTO_BATCH_MEMORY_SHARE, DEFAULT_MAX_BATCH_SIZE, JOIN_LAYOUT_MIN_ROWS, MAX_AUTO_BATCH_SIZE
from .row_cache import RowKVStore
from .rows import EngineRequest
from .runner import LayoutRunner
from .scheduler import LayoutScheduler, Slice

# sdpa backends for the engine's changing shapes: all but cuDNN, which builds an execution plan per new shape.
_PLANLESS_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Bucketed row counts (CUDA graphs) step by this many rows from 8 to 32 rows (`bucketed_rows`): few captured shapes
# without padding many rows.
ROW_BUCKET_STEP = 4


def bucketed_rows(rows: int, max_rows: int) -> int:
    """The rows a forward of `rows` layout rows runs with when rows are bucketed (`ContinuousBatcher.bucket_rows`):
    the next of 1, 2, 4, 8, then multiples of `ROW_BUCKET_STEP` (12, 16, ..., 32), then of an eighth of the power
    of two above `rows` (40, 48, 56, 64, 80, 96, ...), at most `max_rows`; 0 for 0."""
    if rows <= 8:
        bucket = 1 << (rows - 1).bit_length() if rows else 0
    else:
        step = max(ROW_BUCKET_STEP, 1 << ((rows - 1).bit_length() - 3))
        bucket = -(-rows // step) * step
    return max(rows, min(bucket, max_rows))


def kv_bytes_per_position(model) -> int:
    """Bytes of keys and values one position of one row takes in the model's K/V cache: every layer's
    `num_key_value_heads x head_dim`, twice, in the model's dtype (a composite config's text model's:
    DiffusionGemma)."""
    config = model.config.get_text_config()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * model.dtype.itemsize


def default_max_batch_positions(model, device: torch.device) -> int | None:
    """`ContinuousBatcher`'s `max_batch_positions` when neither it nor `max_batch_size` is given: on CUDA, for a
    bidirectional model, the positions whose K/V fit in `AUTO_BATCH_MEMORY_SHARE` of the device's free memory now;
    otherwise None (no budget: `max_batch_size x max_batch_width`). A bidirectional layout's K/V live only for its
    block (every block's first step recomputes them), so the cache holds the running layout's rows at its width:
    rows of short canvases take fewer positions, and more of them fit than rows of `max_batch_width` columns each.
    (Block-causal rows keep their K/V between blocks in slots of `max_batch_width` columns, `row_cache.RowKVStore`:
    their batch is counted in rows.)"""
    if device.type != "cuda" or model.diffusion_family.committed_kv_exact:
        return None
    return _free_kv_positions(model, device)


def _free_kv_positions(model, device: torch.device) -> int:
    """Positions (of one row) whose K/V fit in `AUTO_BATCH_MEMORY_SHARE` of the CUDA device's free memory now."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(AUTO_BATCH_MEMORY_SHARE * free) // kv_bytes_per_position(model)


def default_max_batch_size(model, max_batch_width: int, device: torch.device) -> int:
    """`ContinuousBatcher`'s `max_batch_size` when none is given: off CUDA `DEFAULT_MAX_BATCH_SIZE`; on CUDA the rows
    whose K/V (`max_batch_width` columns each; block-causal models: the row store's as much again) fit in
    `AUTO_BATCH_MEMORY_SHARE` of the device's free memory now, from 1 to `MAX_AUTO_BATCH_SIZE`."""
    if device.type != "cuda":
        return DEFAULT_MAX_BATCH_SIZE
    copies = 2 if model.diffusion_family.committed_kv_exact else 1
    return max(1, min(MAX_AUTO_BATCH_SIZE, _free_kv_positions(model, device) // (copies * max_batch_width)))


def attention_without_shape_plans(device: torch.device | str):
    """A context in which sdpa on `device` skips backends that plan per shape (cuDNN); a no-op off CUDA. torch's
    backend flags are process-wide: other threads' sdpa calls run without cuDNN meanwhile (the same attention by
    other kernels, rounded as those round)."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(_PLANLESS_SDPA_BACKENDS)


def settings_key(config: DiffusionGenerationConfig, without: tuple[str, ...] = ()) -> str:
    """Resolved settings as a key: rows may share a layout only when every setting (but `without`) is equal."""
    return json.dumps(
        {name: getattr(config, name) for name in config.field_names() if name not in without}, sort_keys=True
    )


def plan_request(model, request: EngineRequest, scheduler: LayoutScheduler, device: torch.device) -> EngineRequest:
    """Plan `request` as `generate()` plans a lone prompt, for an engine whose layouts `scheduler` bounds (its
    `max_batch_width` and `max_batch_positions`), its tokens on `device`; raises ValueError for what generate()
    refuses and for a row that could never fit."""
    config, prompt = request.config, list(request.prompt_ids)
    if not prompt:
        raise ValueError("`prompt_ids` is empty: a row needs at least one prompt token.")
    if config.kv_cache_dtype is not None:
        raise ValueError(
            f"`kv_cache_dtype={config.kv_cache_dtype!r}`: the serving engine keeps K/V in the model's dtype "
            "(rows' K/V move between layouts); use kv_cache_dtype=None."
        )
    plan = model.diffusion_family.plan([len(prompt)], len(prompt), config, torch.device("cpu"))
    if plan.canvas_width > scheduler.max_batch_width:
        raise ValueError(
            f"a prompt of {len(prompt)} tokens decoding {config.max_new_tokens} needs {plan.canvas_width} "
            f"columns, more than max_batch_width ({scheduler.max_batch_width})."
        )
    if scheduler.max_batch_positions is not None:  # the row alone at its widest layout: its last block
        last = plan.blocks[int(plan.last_block[0])]
        alone = kv_positions(1, scheduler.width_of([(*last, plan.canvas_width)]), config)
        if alone > scheduler.max_batch_positions:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens decoding {config.max_new_tokens} with cfg_scale "
                f"{config.cfg_scale} needs {alone} K/V positions alone, more than max_batch_positions "
                f"({scheduler.max_batch_positions})."
            )
    # What the run's rules refuse (e.g. a setting the model family does not take) fails this request now,
    # not the layout it would join.
    decoding_policies(model, config)
    tokens = torch.full((plan.canvas_width,), config.mask_token_id, dtype=torch.long)
    tokens[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    request.plan, request.tokens = plan, tokens.to(device)
    # A row's length and its total of steps only shape its own plan (`BlockPlan`): rows that differ only there
    # share a layout whenever their current blocks have the same length and steps (`scheduler.cohort_key`).
    request.settings = settings_key(config, without=("max_new_tokens", "steps"))
    return request


class ContinuousBatcher:
    """The running rows of one model and the requests waiting to join them (see the module doc): waiting requests
    queue in an `admission.Admission`, running rows are grouped into layouts by a `scheduler.LayoutScheduler`, and
    each layout is decoded by the `layout.LayoutRun` of its settings group.

    Args:
        model: a `DiffusionGenerationMixin` model.
        max_batch_size: rows decoded at once (at most; rows of different settings groups count together). Default
            (None): `default_max_batch_size`, on CUDA from the device's free memory (up to `MAX_AUTO_BATCH_SIZE`),
            elsewhere `DEFAULT_MAX_BATCH_SIZE`.
        max_batch_width: the widest layout (columns); the K/V cache holds `max_batch_size x max_batch_width`
            positions unless `max_batch_positions` says otherwise (block-causal models: `max_batch_size x
            max_batch_width` again in the rows' K/V store, `row_cache.RowKVStore`). Default: the model's context
            (its family's `context_length`), so any request that fits the context can run, alone if need be.
        max_batch_positions: None or an integer >= `max_batch_width`: the K/V cache's positions, a budget that a
            layout's rows x columns (padding rows included; twice the rows with classifier-free guidance) may not
            exceed, so that many rows of short canvases run where few wide ones would. None: no budget beyond
            `max_batch_size x max_batch_width`. Default (neither this nor `max_batch_size` given): on CUDA, for a
            bidirectional model, `default_max_batch_positions` (from the free memory; `max_batch_size` then
            `MAX_AUTO_BATCH_SIZE`), else None.
        width_granularity: layouts are rounded up to a multiple of this many columns, so that few CUDA-graph
            shapes are captured. Default: 64 on CUDA, 1 elsewhere (no graphs; and a row decoding alone then has no
            padding, so its float32 arithmetic is exactly `generate()`'s: masked padding columns change the order
            of attention's sums, which can flip a near-tie between two tokens).
        join_layout_min_rows: an integer n >= 1 (default `JOIN_LAYOUT_MIN_ROWS`): the rows of a request that
            starts at a boundary decode their first block in a layout of their own, first, when at least n other
            rows of their cohort run and no request waits that has not started (`LayoutScheduler.layouts`): its
            first block streams sooner, also beside a many-prompt request whose later rows still wait; the others
            wait that long. None: joining rows always decode their first block in their cohort's layout.
        bucket_rows: whether a layout's forwards run with a bucketed number of rows (`bucketed_rows`; the layout
            gets padding rows that commit nothing), so that CUDA graphs are captured for few row counts rather than
            for every one from 1 to `max_batch_size`. Default: on CUDA (graphs), off elsewhere (a padding row changes
            nothing in a row's tokens, but costs its arithmetic).
        max_refresh_positions: None (default: no slices) or an integer >= 1: a bidirectional model's layout whose
            canvases hold more positions (each block's first step recomputes whole canvases) is cut into slices
            (`scheduler.Slice`) of about equal positions, and between two layouts of a boundary waiting requests
            join the slices still to decode (`intake` brings the server's new requests first). Block-causal models
            never recompute whole canvases: they refuse it (ValueError). Off by default: it bounds the wait for a
            slice, not the time to first block, and costs throughput.

        max_request_rows: None (default) or an integer >= 1: the rows one request (`EngineRequest.group`) may hold
            at once, so that a many-prompt request leaves rows free for other requests, which then join at the next
            block boundary; None: `admission.request_share(max_batch_size)` (14 of 16 rows, 56 of 64). At least
            `max_batch_size` lets one request fill the batch (a later one then waits for one of its rows to end).

    `intake`: None, or a callable (set by the server) that hands the requests submitted since it was last called to
    `submit`; the engine calls it between two layouts of a boundary.
    """

    def __init__(
        self,
        model,
        *,
        max_batch_size: int | None = None,
        max_batch_width: int | None = None,
        max_batch_positions: int | None = None,
        width_granularity: int | None = None,
        join_layout_min_rows: int | None = JOIN_LAYOUT_MIN_ROWS,
        bucket_rows: bool | None = None,
        max_refresh_positions: int | None = None,
        max_request_rows: int | None = None,
    ):
        self.device = model.get_input_embeddings().weight.device
        self.model = model
        self.family = model.diffusion_family
        # Families whose committed K/V are exact (block-causal: LLaDA2.x) keep each row's K/V between blocks
        # (`row_cache.RowKVStore`) and lay out only the columns a block sees; the others recompute a row's canvas
        # at each block start.
        self.keeps_row_kv = self.family.committed_kv_exact
        if max_batch_width is None:
            max_batch_width = self.family.context_length(model.config)
        if width_granularity is None:
            width_granularity = 64 if self.device.type == "cuda" else 1
        if self.keeps_row_kv and max_refresh_positions is not None:
            raise ValueError(
                f"`max_refresh_positions` applies to models that refresh whole canvases; {type(model).__name__} is "
                f"{self.family.topology} and keeps its rows' exact K/V (its layouts recompute two blocks per row, never "
                "whole canvases): use None."
            )
        self.scheduler = LayoutScheduler.validated(
            max_batch_width,
            width_granularity,
            self.keeps_row_kv,
            max_refresh_positions=max_refresh_positions,
            join_layout_min_rows=join_layout_min_rows,
        )
        if bucket_rows is None:
            bucket_rows = self.device.type == "cuda"
        if not isinstance(bucket_rows, bool):
            raise ValueError(f"`bucket_rows` must be None, True or False, got {bucket_rows!r}.")
        if self.keeps_row_kv and not model.diffusion_packed_rows:
            # Joining rows whose K/V are kept are prefilled packed (`layout.PackedLayout`).
            raise ValueError(
                f"{type(model).__name__} keeps its rows' K/V, and its forward does not take packed rows "
                "(`diffusion_packed_rows`): continuous batching prefills such rows packed."
            )
        if max_batch_positions is None and max_batch_size is None:
            max_batch_positions = default_max_batch_positions(model, self.device)
            if max_batch_positions is not None:  # the budget bounds the K/V; a layout of one row always fits
                max_batch_positions = max(max_batch_positions, self.max_batch_width)
        self.bucket_rows = bucket_rows
        self.intake: Callable[[], None] | None = None
        if max_request_rows is not None and not (is_int(max_request_rows) and max_request_rows >= 1):
            raise ValueError(f"`max_request_rows` must be None or an integer >= 1, got {max_request_rows!r}.")
        self.max_request_rows = max_request_rows
        # The admission order: rows of different requests in turns, each request within its share of the rows.
        self.admission = Admission(lambda: self.max_batch_size, lambda: self.max_request_rows)
        self.running: list[EngineRequest] = []
        self.runner: LayoutRunner | None = None
        self.max_batch_size: int | None = None
        self.set_max_batch_positions(max_batch_positions)
        if max_batch_size is None:
            if max_batch_positions is not None:
                max_batch_size = MAX_AUTO_BATCH_SIZE if self.device.type == "cuda" else DEFAULT_MAX_BATCH_SIZE
            else:
                max_batch_size = default_max_batch_size(model, self.max_batch_width, self.device)
        self.set_max_batch_size(max_batch_size)
        self.forwards = 0  # model forwards made (one batched forward counts once)
        # Positions fed to the model by blocks' first steps (packed rows: their own; a layout's rows: rows x
        # columns, padding included): what rows recompute of their prefix (and joining rows' prefill).
        self.first_step_positions = 0
        self.layouts = 0  # layouts decoded (one per cohort per boundary)
        self.last_layout_sizes: list[int] = []  # rows of each layout of the last boundary

    @property
    def max_batch_width(self) -> int:
        return self.scheduler.max_batch_width

    @property
    def max_batch_positions(self) -> int | None:
        return self.scheduler.max_batch_positions

    @property
    def lock(self):
        return self.admission.lock

    @property
    def waiting(self):
        return self.admission.waiting

    def set_max_batch_size(self, rows: int) -> None:
        """Decode at most `rows` rows at once (before any request runs)."""
        if not is_int(rows) or rows < 1:
            raise ValueError(f"`max_batch_size` must be an integer >= 1 (or None for the default), got {rows!r}.")
        if self.running:
            raise RuntimeError("the batch size cannot change while rows run")
        self.max_batch_size = rows
        self._new_runner()

    def set_max_batch_positions(self, positions: int | None) -> None:
        """Hold at most `positions` K/V positions (None: no budget; before any request runs)."""
        if positions is not None and not (is_int(positions) and positions >= self.max_batch_width):
            raise ValueError(
                f"`max_batch_positions` must be None or an integer >= max_batch_width ({self.max_batch_width}), got "
                f"{positions!r}."
            )
        if self.running:
            raise RuntimeError("the K/V budget cannot change while rows run")
        self.scheduler.max_batch_positions = positions
        self._new_runner()

    def _new_runner(self) -> None:
        """A `LayoutRunner` for the current limits (no cache yet)."""
        if self.max_batch_size is None:
            return  # the constructor sets the batch size next
        if self.runner is not None:
            self.runner.release()
        # Block-causal rows' exact K/V between blocks, a slot per running row (buffers allocated at first use).
        store = RowKVStore(self.max_batch_size, self.max_batch_width) if self.keeps_row_kv else None
        bucket = bucketed_rows if self.bucket_rows else None
        positions = self.max_batch_positions
        self.runner = LayoutRunner(
            self.model, self.device, self.max_batch_size, self.max_batch_width, positions, store, bucket
        )

    # -- requests ---------------------------------------------------------------------------------------------
    def prepare(self, request: EngineRequest) -> EngineRequest:
        """Plan `request` as `generate()` plans a lone prompt (`plan_request`); ValueError for what it refuses."""
        return plan_request(self.model, request, self.scheduler, self.device)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request (any thread); it joins the batch at the next boundary where it fits."""
        if request.plan is None:
            self.prepare(request)
        self.admission.submit(request)

    def pending(self) -> int:
        return self.admission.pending()

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.admission.pending())

    def _admit(self, place: Callable[[EngineRequest], bool] | None = None) -> None:
        """Waiting requests join the running rows (`Admission.admit`) while a row is free and `place(head)` takes
        them (default: their cohort's layout still fits the cache)."""
        if place is None:
            place = lambda head: self.scheduler.fits_with_cohort(head, self.running)  # noqa: E731

        def join(head: EngineRequest) -> bool:
            if not place(head):
                return False
            self.running.append(head)
            return True

        # Rows that ended earlier in this boundary (`_join_queued`) no longer hold their place.
        taken = {row.slot for row in self.running if not row.ended}
        self.admission.admit([slot for slot in range(self.max_batch_size) if slot not in taken], join)

    def _between_layouts(self) -> None:
        """Between two layouts of a boundary: the server's new requests reach `waiting` (`intake`)."""
        if self.intake is not None:
            self.intake()

    def _join_queued(self, queue: list[list[EngineRequest]]) -> list[list[EngineRequest]]:
        """Between two layouts of a boundary: cancelled rows leave the layouts still to decode (`queue`), and
        waiting requests join the slices among them (`scheduler.Slice`), each the first slice of its cohort that
        its width still fits, while a row is free (`_admit`). Returns the queue without layouts left empty."""
        queue = [type(rows)(row for row in rows if not drop_cancelled(row)) for rows in queue]
        queue = [rows for rows in queue if rows]
        self._admit(lambda head: self.scheduler.into_a_slice(head, queue))
        return queue

    # -- decoding ---------------------------------------------------------------------------------------------
    def decode_boundary(self) -> int:
        """One block boundary: admit waiting requests, decode one block of every running row, report each row's
        update to its `on_block` and drop the rows that ended. Returns the number of rows decoded. A layout that
        fails (an exception in the model) ends its rows with the exception re-raised after the others ran."""
        self.running = [row for row in self.running if not drop_cancelled(row)]
        self._admit()
        decoded, failure = 0, None
        self.last_layout_sizes = []
        queue = self.scheduler.layouts(self.running, self.admission.opening, self.admission.unopened())
        while queue:
            rows = queue.pop(0)
            try:
                self._decode_layout(rows)
            except Exception as error:  # the other layouts still decode; these rows end with the error
                for row in rows:
                    row.ended = True
                    row.error = error
                failure = failure or error
                continue
            decoded += len(rows)
            if any(isinstance(layout, Slice) for layout in queue):
                self._between_layouts()
                queue = self._join_queued(queue)
        self.running = [row for row in self.running if not row.ended]
        self.runner.keep_only({row.settings for row in self.running})
        if failure is not None:
            raise failure
        return decoded

    def _decode_layout(self, rows: list[EngineRequest]) -> None:
        """Decode one block of the layout of `rows`, count its work and deliver each row's update (`on_block`,
        which may end the row)."""
        run = self.runner.run_for(rows[0])
        before, positions = run.machine.nfe, run.machine.first_step_positions
        # Layouts change shape at every join and leave: no attention backend that plans per shape.
        with torch.no_grad(), attention_without_shape_plans(run.device):
            updates = run.decode_block(rows, self.scheduler.layout_width(rows))
        self.forwards += run.machine.nfe - before
        self.first_step_positions += run.machine.first_step_positions - positions
        self.layouts += 1
        self.last_layout_sizes.append(len(rows))
        for row, update in zip(rows, updates, strict=True):
            stop = row.on_block(update)
            row.ended = update.ended or bool(stop) or row.cancelled.is_set()

    def graph_counts(self) -> dict[str, int]:
        """Steps the model's CUDA-graph runner ran eagerly, captured and replayed (zeros without graphs): how
        often the engine's layouts hit a captured shape."""
        return self.runner.graph_counts()

    def abandon(self) -> None:
        """Forget every waiting and running row (the server is shutting down: their owners are told) and give the
        model's CUDA-graph runner back."""
        self.admission.clear()
        self.running = []
        self.release()

    def release(self) -> None:
        """Give the model's CUDA-graph runner back (the captured graphs stay with the model for the next run of
        the same signature)."""
        self.runner.release()

    def run_until_done(self) -> None:
        """Decode boundaries until no row runs or waits (tests, offline use)."""
        while self.has_work():
            self.decode_boundary()
