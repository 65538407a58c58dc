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

`ContinuousBatcher` owns the running rows: `submit()` queues requests (any thread), `decode_boundary()` admits
waiting requests that fit, decodes one block of every running row and reports each row's new tokens to its
`on_block` callback, which may end the row (a stop string, a disconnected client); rows that ended leave and
their places are taken at the next boundary. `serving.batching` runs it in a thread for `hf-dllm serve`.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..generation_config import DiffusionGenerationConfig, is_int
from ..step_machine import decoding_policies
from .admission import RoundRobinQueue
from .layout import LayoutRun, kv_positions
from .row_cache import RowKVStore
from .rows import EngineRequest

# sdpa backends for the engine's forwards, whose shapes keep changing (packed rows, layouts of changing rows and
# widths): every one but cuDNN's. cuDNN builds (and may compile) an execution plan per new shape: on an H100 a
# refresh forward of 16 packed rows (LLaDA-8B shape) took 1.0-1.7 s when one or two rows' lengths were new and 0.33 s
# when none was; without cuDNN 0.34-0.38 s either way (`benchmarks/profile_engine_boundary.py`). Flash and
# memory-efficient attention need no plan.
_PLANLESS_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Joining rows decode their first block apart once this many others of their cohort run (`ContinuousBatcher`).
# Measured on an H100 (LLaDA-8B shape, `benchmarks/bench_load.py`, 2.4 requests/s = 80 % of the peak; RESULTS.md,
# continuous batching, session 9): p99 time to first block 0.66-0.69 s with 8, against 0.95-1.15 s with joining rows
# in the layout and 1.90 s with 4 (which slowed the others enough to fill the batch, so arrivals queued), for
# 4-5 % more p99 latency than in the layout.
JOIN_LAYOUT_MIN_ROWS = 8

# Rows decoded at once by default (`ContinuousBatcher`, `hf-dllm serve --max-batch-size`) off CUDA.
DEFAULT_MAX_BATCH_SIZE = 16

# On CUDA the default is as many rows as the engine's K/V for `max_batch_width` columns each (the layout cache, and a
# block-causal model's row store as much again) fit in this share of the device's free memory, at most
# `MAX_AUTO_BATCH_SIZE` rows: the rest is left for activations and CUDA graphs. (A bidirectional model's default is
# a budget of positions in that share instead, `default_max_batch_positions`.) A batch that fills makes arrivals
# wait whole boundaries for a place, so the time to first block is bounded only while the batch has room.
# Measured on an H100 (LLaDA2.0-mini shape, random bf16 weights, 2560 columns; RESULTS.md, continuous batching,
# session 18): max batch 128 (26.8 GB of K/V) peaked at 5,668 tokens/s with 61.4 GB in use, and at 77 % of that
# peak its p99 time to first block was 0.97 s against 3 boundaries (1.12 s); with max batch 16 the peak was 2,403
# tokens/s and at 76 % of it the p99 time to first block 0.98 s against 0.46 s (session 17).
AUTO_BATCH_MEMORY_SHARE = 0.6
MAX_AUTO_BATCH_SIZE = 128

# With bucketed rows (CUDA graphs), a layout's forwards run with 1, 2, 4 or 8 rows, then a multiple of this many
# up to 32 rows, and above 32 four buckets per doubling (steps of 8 up to 64, of 16 up to 128, ...), so that a large
# max batch does not multiply the captured shapes (a bucket every 4 rows up to 128 rows meant 36 row counts).
# Measured on an H100 (LLaDA2.0-mini shape, `benchmarks/bench_load.py`; RESULTS.md, continuous batching, session
# 17): at max batch 32, steps of 4 and 8 gave the same peak (2,984 and 2,983-3,041 tokens/s, against 2,703 with
# no buckets); at max batch 16, where 9 rows pad to 16 with steps of 8, the peak was 2,403 tokens/s with 4 and
# 2,271 with 8 (2,434 with no buckets).
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
    their batch is counted in rows.) Measured on an H100 (LLaDA-8B shape at the default width, 4,096 columns;
    RESULTS.md, continuous batching, session 32): the same memory held 19 rows of full width, or 78,204 positions in
    which up to 48 rows ran; at ~80 % of the peak the p99 time to first block fell from 2.00-3.19 s to 1.00-1.21 s
    (the batch no longer filled), p50 latency rose from 3.2-5.4 s to 4.6-6.8 s, the peak was unchanged."""
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


def cohort_key(row: EngineRequest) -> tuple:
    """Rows of equal keys share a layout: the same settings (but `max_new_tokens` and `steps`), and current blocks
    of the same length and number of steps."""
    start, end = row.plan.blocks[row.block]
    return (row.settings, end - start, int(row.plan.block_steps[0, row.block]))


class Slice(list):
    """The rows of a layout cut from a larger one (`ContinuousBatcher._slices`): waiting requests may join it while
    its boundary runs. (Other layouts take no one mid-boundary: a joining row would wait out a whole cohort's
    layout, and a block-causal layout, never cut, would take its joining rows' prefill into the continuing rows'
    block; measured slower for both model kinds, RESULTS.md, continuous batching, session 19.)"""


class ContinuousBatcher:
    """The running rows of one model and the requests waiting to join them (see the module doc).

    Args:
        model: a `DiffusionGenerationMixin` model.
        max_batch_size: rows decoded at once (at most; rows of different settings groups count together). Default
            (None): `default_max_batch_size`, on CUDA from the device's free memory (up to `MAX_AUTO_BATCH_SIZE`),
            elsewhere `DEFAULT_MAX_BATCH_SIZE`.
        max_batch_width: the widest layout (columns); the K/V cache holds `max_batch_size x max_batch_width`
            positions unless `max_batch_positions` says otherwise (block-causal models: `max_batch_size x
            max_batch_width` again in the rows' K/V store, `row_cache.RowKVStore`). Default: the model's context
            (its family's `context_length`), so any request that fits the context can run, alone
            if need be.
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
        join_layout_min_rows: an integer n >= 1 (default `JOIN_LAYOUT_MIN_ROWS`): at a boundary where nothing is
            left waiting, joining rows decode their first block in a layout of their own, before the others, when
            at least n other rows of their cohort are running. Their first block then streams after their prefill
            and one block of steps at their own batch size, not the whole batch's; the others wait that long, and
            the boundary makes one more layout. None: joining rows always decode their first block in their
            cohort's layout.
        bucket_rows: whether a layout's forwards run with a bucketed number of rows (`bucketed_rows`; the layout
            gets padding rows that commit nothing), so that CUDA graphs are captured for few row counts rather than
            for every one from 1 to `max_batch_size`. Default: on CUDA (graphs), off elsewhere (a padding row changes
            nothing in a row's tokens, but costs its arithmetic).
        max_refresh_positions: None (default: no slices) or an integer >= 1. The rows of a bidirectional model
            recompute their whole canvases at every block's first step (the refresh); a layout whose canvases hold
            more positions than this is cut into slices (`Slice`) of about equal positions, none above it (unless
            one row alone is), each decoded as a layout of its own, and between two layouts of a boundary waiting
            requests join the slices still to decode (`intake` brings the server's new requests first): an arrival
            waits out one slice rather than the whole batch's refresh. Block-causal models' layouts recompute two
            blocks per row (their K/V are stored), never whole canvases: they refuse it (ValueError). Off by
            default: measured on an H100 (LLaDA-8B shape, 80-85 % of the peak; RESULTS.md, continuous batching,
            session 19), slices of 16,384 positions kept the p99 time to first block within 3 boundaries in 7 of 8
            rates against 1 of 2 without, but mostly because the boundaries grew (more layouts, each with its own
            steps): the p99 time to first block itself was no shorter (0.78-1.75 s against 0.85-0.90 s), p50
            latency rose 13-41 % and the peak fell 1-5 %; slices of 8,192 lost 8 % of the peak.

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
    ):
        self.device = model.get_input_embeddings().weight.device
        if width_granularity is None:
            width_granularity = 64 if self.device.type == "cuda" else 1
        if bucket_rows is None:
            bucket_rows = self.device.type == "cuda"
        if not isinstance(bucket_rows, bool):
            raise ValueError(f"`bucket_rows` must be None, True or False, got {bucket_rows!r}.")
        if not is_int(width_granularity) or width_granularity < 1:
            raise ValueError(f"`width_granularity` must be None or an integer >= 1, got {width_granularity!r}.")
        if join_layout_min_rows is not None and not (is_int(join_layout_min_rows) and join_layout_min_rows >= 1):
            raise ValueError(f"`join_layout_min_rows` must be None or an integer >= 1, got {join_layout_min_rows!r}.")
        if max_refresh_positions is not None and not (is_int(max_refresh_positions) and max_refresh_positions >= 1):
            raise ValueError(f"`max_refresh_positions` must be None or an integer >= 1, got {max_refresh_positions!r}.")
        if max_batch_width is None:
            max_batch_width = model.diffusion_family.context_length(model.config)
        if not isinstance(max_batch_width, int) or isinstance(max_batch_width, bool) or max_batch_width < 1:
            raise ValueError(f"`max_batch_width` must be an integer >= 1, got {max_batch_width!r}.")
        if max_batch_positions is None and max_batch_size is None:
            max_batch_positions = default_max_batch_positions(model, self.device)
            if max_batch_positions is not None:  # the budget bounds the K/V; a layout of one row always fits
                max_batch_positions = max(max_batch_positions, max_batch_width)
        self.model = model
        self.max_batch_width = max_batch_width
        self.width_granularity = width_granularity
        self.join_layout_min_rows = join_layout_min_rows
        self.bucket_rows = bucket_rows
        self.family = model.diffusion_family
        # Families whose committed K/V are exact (block-causal: LLaDA2.x) keep each row's K/V between blocks
        # (`row_cache.RowKVStore`) and lay out only the columns a block sees; the others recompute a row's canvas
        # at each block start.
        self.keeps_row_kv = self.family.committed_kv_exact
        if self.keeps_row_kv and max_refresh_positions is not None:
            raise ValueError(
                f"`max_refresh_positions` applies to models that refresh whole canvases; {type(model).__name__} is "
                f"{self.family.topology} and keeps its rows' exact K/V (its layouts recompute two blocks per row, never "
                "whole canvases): use None."
            )
        self.max_refresh_positions = max_refresh_positions
        self.intake: Callable[[], None] | None = None
        if self.keeps_row_kv and not model.diffusion_packed_rows:
            # Joining rows whose K/V are kept are prefilled packed (`layout.PackedLayout`).
            raise ValueError(
                f"{type(model).__name__} keeps its rows' K/V, and its forward does not take packed rows "
                "(`diffusion_packed_rows`): continuous batching prefills such rows packed."
            )
        # The admission order: rows of different requests in turns, each request within its share of the rows.
        self.waiting = RoundRobinQueue(lambda: self.max_batch_size)
        self.running: list[EngineRequest] = []
        self.runs: dict[str, LayoutRun] = {}
        self.cache = None
        self.set_max_batch_positions(max_batch_positions)
        if max_batch_size is None:
            if max_batch_positions is not None:
                max_batch_size = MAX_AUTO_BATCH_SIZE if self.device.type == "cuda" else DEFAULT_MAX_BATCH_SIZE
            else:
                max_batch_size = default_max_batch_size(model, max_batch_width, self.device)
        self.set_max_batch_size(max_batch_size)
        self.lock = threading.Lock()
        self.forwards = 0  # model forwards made (one batched forward counts once)
        # Positions fed to the model by blocks' first steps (packed rows: their own; a layout's rows: rows x
        # columns, padding included): what rows recompute of their prefix (and joining rows' prefill).
        self.first_step_positions = 0
        self.layouts = 0  # layouts decoded (one per cohort per boundary)
        self.last_layout_sizes: list[int] = []  # rows of each layout of the last boundary

    def set_max_batch_size(self, rows: int) -> None:
        """Decode at most `rows` rows at once (before any request runs)."""
        if not is_int(rows) or rows < 1:
            raise ValueError(f"`max_batch_size` must be an integer >= 1 (or None for the default), got {rows!r}.")
        if self.running:
            raise RuntimeError("the batch size cannot change while rows run")
        self.max_batch_size = rows
        # Block-causal rows' exact K/V between blocks, a slot per running row (buffers allocated at first use).
        self.store = RowKVStore(rows, self.max_batch_width) if self.keeps_row_kv else None

    def set_max_batch_positions(self, positions: int | None) -> None:
        """Hold at most `positions` K/V positions (None: no budget; before any request runs)."""
        if positions is not None and not (is_int(positions) and positions >= self.max_batch_width):
            raise ValueError(
                f"`max_batch_positions` must be None or an integer >= max_batch_width ({self.max_batch_width}), got "
                f"{positions!r}."
            )
        if self.running:
            raise RuntimeError("the K/V budget cannot change while rows run")
        self.max_batch_positions = positions
        self.cache = None

    # -- requests ---------------------------------------------------------------------------------------------
    def prepare(self, request: EngineRequest) -> EngineRequest:
        """Plan `request` as `generate()` plans a lone prompt; raises ValueError for what generate() refuses."""
        config, prompt = request.config, list(request.prompt_ids)
        if not prompt:
            raise ValueError("`prompt_ids` is empty: a row needs at least one prompt token.")
        if config.kv_cache_dtype is not None:
            raise ValueError(
                f"`kv_cache_dtype={config.kv_cache_dtype!r}`: the serving engine keeps K/V in the model's dtype "
                "(rows' K/V move between layouts); use kv_cache_dtype=None."
            )
        plan = self.family.plan([len(prompt)], len(prompt), config, torch.device("cpu"))
        if plan.canvas_width > self.max_batch_width:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens decoding {config.max_new_tokens} needs {plan.canvas_width} "
                f"columns, more than max_batch_width ({self.max_batch_width})."
            )
        if self.max_batch_positions is not None:  # the row alone at its widest layout: its last block
            last = plan.blocks[int(plan.last_block[0])]
            alone = kv_positions(1, self._width_of([(*last, plan.canvas_width)]), config)
            if alone > self.max_batch_positions:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens decoding {config.max_new_tokens} with cfg_scale "
                    f"{config.cfg_scale} needs {alone} K/V positions alone, more than max_batch_positions "
                    f"({self.max_batch_positions})."
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
        longest rest of a canvas after it, rounded up to `width_granularity` (at most `max_batch_width`).

        Block-causal rows with `width_granularity > 1` (CUDA graphs): only the columns up to the block's end, as a
        power-of-two multiple of `width_granularity`. Their steps never see a later column (the block-causal mask,
        and the split-KV kernel reads no key past the last one visible), so the rest of the canvases would only
        multiply the step shapes: with widths in steps of 64 a server met a new shape at every other boundary and
        ran a fifth of its steps eagerly or capturing (H100, LLaDA2.0-mini shape; RESULTS.md, continuous batching,
        session 16). With granularity 1 (off CUDA) the layout keeps whole canvases: a row alone is then laid out as
        `generate()` lays it out, so its float32 arithmetic is exactly `generate()`'s."""
        return self._width_of([(*row.plan.blocks[row.block], row.plan.canvas_width) for row in rows])

    def _width_of(self, spans: list[tuple[int, int, int]]) -> int:
        """`layout_width` of rows given as `(block start, block end, canvas width)`, one per row."""
        starts = [start for start, _, _ in spans]
        granularity = self.width_granularity
        if self.keeps_row_kv and granularity > 1:
            width = max(starts) + max(end - start for start, end, _ in spans)
            rounded = granularity << (-(-width // granularity) - 1).bit_length()
        else:
            width = max(starts) + max(canvas - start for start, _, canvas in spans)
            rounded = -(-width // granularity) * granularity
        return max(width, min(rounded, self.max_batch_width))

    def _admit(self, place: Callable[[EngineRequest], bool] | None = None) -> None:
        """Waiting rows join in their admission order (`waiting`: the rows of different requests in turns), while
        there is a free row and `place(head)` takes the head (default: its layout fits the cache); the head waits for
        room rather than be passed (no starvation)."""
        if place is None:
            place = self._fits_partners
        with self.lock:
            if any(row.cancelled.is_set() for row in self.waiting):
                self.waiting.discard_if(self._drop_cancelled)
            # Rows that ended earlier in this boundary (`_join_queued`) no longer hold their place.
            free = sorted(set(range(self.max_batch_size)) - {row.slot for row in self.running if not row.ended})
            while self.waiting and free and place(self.waiting[0]):
                head = self.waiting.popleft()
                head.slot = free.pop(0)
                self.running.append(head)

    def fits_one_layout(self, rows: list[EngineRequest]) -> bool:
        """Whether `rows` (one cohort) fit one layout: at most `max_batch_width` columns and, with a budget,
        `max_batch_positions` K/V positions (rows x columns, padding rows aside; twice the rows with classifier-free
        guidance). One row always fits: `prepare` refuses a request that would not, alone."""
        width = self.layout_width(rows)
        if width > self.max_batch_width:
            return False
        return (
            self.max_batch_positions is None
            or kv_positions(len(rows), width, rows[0].config) <= self.max_batch_positions
        )

    def _fits_partners(self, head: EngineRequest) -> bool:
        """Whether `head` and the running rows of its cohort fit one layout (`fits_one_layout`)."""
        partners = [row for row in self.running if cohort_key(row) == cohort_key(head)]
        return not partners or self.fits_one_layout([*partners, head])

    def _between_layouts(self) -> None:
        """Between two layouts of a boundary: the server's new requests reach `waiting` (`intake`)."""
        if self.intake is not None:
            self.intake()

    def _join_queued(self, queue: list[list[EngineRequest]]) -> list[list[EngineRequest]]:
        """Between two layouts of a boundary: cancelled rows leave the layouts still to decode (`queue`), and
        waiting requests join the slices among them (`Slice`), oldest first, each the first slice of its cohort
        that its width still fits, while a row is free (`_admit`). Returns the queue without layouts left empty."""
        queue = [type(rows)(row for row in rows if not self._drop_cancelled(row)) for rows in queue]
        queue = [rows for rows in queue if rows]

        def into_a_slice(head: EngineRequest) -> bool:
            key = cohort_key(head)
            for rows in queue:
                if isinstance(rows, Slice) and cohort_key(rows[0]) == key and self.fits_one_layout([*rows, head]):
                    rows.append(head)
                    return True
            return False

        self._admit(into_a_slice)
        return queue

    def _cohorts(self) -> list[list[EngineRequest]]:
        """The running rows grouped into layouts (cohorts), each split further where it would exceed the cache's
        width; in order of their oldest row, except that joining rows decoding apart (`join_layout_min_rows`)
        come first."""
        groups: dict[tuple, list[EngineRequest]] = {}
        for row in self.running:
            groups.setdefault(cohort_key(row), []).append(row)
        apart = self.join_layout_min_rows is not None and not self.pending()
        first, layouts = [], []
        for rows in groups.values():
            joining = [row for row in rows if row.block == 0]
            if apart and joining and len(rows) - len(joining) >= self.join_layout_min_rows:
                first += self._split(joining)
                rows = [row for row in rows if row.block > 0]
            layouts += self._split(rows)
        return first + layouts

    def _split(self, rows: list[EngineRequest]) -> list[list[EngineRequest]]:
        """`rows` in order, split into layouts that fit (`fits_one_layout`), each cut further into slices of about
        equal refresh positions (`max_refresh_positions`)."""
        layouts, current = [], []
        for row in rows:
            if current and not self.fits_one_layout([*current, row]):
                layouts.append(current)
                current = []
            current.append(row)
        layouts.append(current)
        return [piece for layout in layouts for piece in self._slices(layout)]

    def _slices(self, rows: list[EngineRequest]) -> list[list[EngineRequest]]:
        """`rows` (one layout) in order, cut into slices whose canvases hold at most `max_refresh_positions`
        positions (a row alone may hold more), of about equal positions: the k-th slice ends where the running
        total reaches k shares, a share being the total over the fewest slices the budget allows."""
        budget = self.max_refresh_positions
        positions = [row.plan.canvas_width for row in rows]
        total = sum(positions)
        if budget is None or total <= budget:
            return [rows]
        share = total / -(-total // budget)
        slices, current, held, done = [], [], 0, 0
        for row, size in zip(rows, positions, strict=True):
            if current and held + size > budget:
                slices.append(current)
                current, held = [], 0
            current.append(row)
            held += size
            done += size
            if done >= share * (len(slices) + 1):  # cut at the running total's shares, so slices stay even
                slices.append(current)
                current, held = [], 0
        if current:
            slices.append(current)
        return [Slice(rows) for rows in slices] if len(slices) > 1 else slices

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
                bucketed_rows if self.bucket_rows else None,
                self.max_batch_positions,
            )
            self.runs[row.settings] = run
        return run

    def _shared_cache(self, rows: int):
        if self.cache is None or self.cache.max_batch_size < rows:
            self.cache = self.model._diffusion_new_cache(
                rows, self.max_batch_width, max_positions=self.max_batch_positions
            )
            # A row's positions count its own columns, narrower than the cache's (`cache.PositionTables`).
            self.cache.positions_below_length = True
        return self.cache

    def decode_boundary(self) -> int:
        """One block boundary: admit waiting requests, decode one block of every running row, report each row's
        update to its `on_block` and drop the rows that ended. Returns the number of rows decoded. A layout that
        fails (an exception in the model) ends its rows with the exception re-raised after the others ran."""
        self.running = [row for row in self.running if not self._drop_cancelled(row)]
        self._admit()
        decoded, failure = 0, None
        self.last_layout_sizes = []
        queue = self._cohorts()
        while queue:
            rows = queue.pop(0)
            try:
                run = self._run_for(rows[0])
                before, positions = run.machine.nfe, run.machine.first_step_positions
                # Layouts change shape at every join and leave: no attention backend that plans per shape.
                with torch.no_grad(), attention_without_shape_plans(run.device):
                    updates = run.decode_block(rows, self.layout_width(rows))
            except Exception as error:  # the other layouts still decode; these rows end with the error
                for row in rows:
                    row.ended = True
                    row.error = error
                failure = failure or error
                continue
            self.forwards += run.machine.nfe - before
            self.first_step_positions += run.machine.first_step_positions - positions
            self.layouts += 1
            self.last_layout_sizes.append(len(rows))
            decoded += len(rows)
            for row, update in zip(rows, updates, strict=True):
                stop = row.on_block(update)
                row.ended = update.ended or bool(stop) or row.cancelled.is_set()
            if any(isinstance(layout, Slice) for layout in queue):
                self._between_layouts()
                queue = self._join_queued(queue)
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
