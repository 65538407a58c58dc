"""Continuous batching for `hf-dllm serve`: one model, many concurrent requests, rows joining and leaving a running
batch at block boundaries (`engine.ContinuousBatcher`).

Every prompt of a request becomes a `RowRequest` carrying its resolved settings (`model.resolve_generation_config`
of the fields the request named: the checkpoint's `generation_config.json` supplies the rest). One scheduler
thread owns the model and the engine: it queues submitted rows, and at every block boundary the engine admits
waiting rows (oldest first, as long as a row and the cache's width are free), decodes one block of every running
row (rows whose settings differ only in `max_new_tokens` share a layout; other settings groups are decoded after
it at the same boundary) and reports each row's new tokens. A row's tokens and forwards are those of
`generate()` for its prompt alone (greedy settings; padding is masked, nothing else is shared).

`RowTracker` consumes a row's block updates: it appends the new tokens to the row's `CompletionText` (cut at a stop
token, a stop string or `max_tokens`), streams the new text, ends the row once its completion is over or its
client went away (the row leaves the batch at that boundary and its place is taken at the next), and delivers the
result with `nfe` = the row's forwards when it ended, counted by the engine.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cli.completion_text import CompletionText
from ..generation_config import DiffusionGenerationConfig
from .engine import ContinuousBatcher
from .rows import BlockUpdate, EngineRequest

logger = logging.getLogger("hf_dllm.serve")

# Events a row's sink receives (from the scheduler thread): ("delta", index, text), ("done", index, RowResult),
# ("error", index, http_status, message).
Sink = Callable[[tuple], None]


@dataclass
class RowResult:
    """What one prompt of a request produced."""

    text: str
    finish_reason: str  # "stop" (EOS/EOT or a stop string) or "length" (max_tokens reached)
    prompt_tokens: int
    completion_tokens: int
    nfe: int  # model forwards this row took part in


@dataclass(eq=False)
class RowRequest:
    """One prompt to decode with `generation_config` (resolved settings). `max_tokens` caps the returned tokens
    (None: the decoded length)."""

    prompt_ids: list[int]
    generation_config: DiffusionGenerationConfig
    max_tokens: int | None
    sink: Sink
    stop: tuple[str, ...] = ()
    stream: bool = False
    index: int = 0
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)


class RowTracker:
    """Consumes one row's block updates (see module doc): `on_block(update)` after every block the row decoded,
    returning whether the row should end there."""

    def __init__(self, row: RowRequest, tokenizer, stop_token_ids: set[int], stats: "BatchStats"):
        self.row = row
        self.stats = stats
        # An EOS/EOT ends the row's decoding only with `eos_early_stop` (else the run decodes on, as generate()
        # does, and the row ends with its last block); a stop string or max_tokens always do.
        self.eos_early_stop = row.generation_config.eos_early_stop
        self.completion = CompletionText(tokenizer, stop_token_ids, row.stop, row.max_tokens)
        self.sent = 0  # characters of the text already streamed
        self.finished = False  # the completion's text is final
        self.ended = False  # the row left the batch (result delivered, or cancelled)
        self.first_block_at: float | None = None

    def on_block(self, update: BlockUpdate) -> bool:
        row, completion = self.row, self.completion
        if self.first_block_at is None:
            self.first_block_at = time.monotonic()
        stop = False
        if row.cancelled.is_set():
            stop = True
        elif not self.finished:
            self.finished = completion.extend(update.new_tokens)
            if row.stream:
                end = max(completion.streamable(), self.sent)
                self._send(("delta", row.index, completion.text[self.sent : end]))
                self.sent = end
            if row.cancelled.is_set():  # the client went away while its text was sent
                stop = True
            elif self.finished:
                stop_token_only = completion.finish_reason == "stop" and not completion.stop_string_found
                stop = self.eos_early_stop or not stop_token_only
        if update.ended or stop:
            self.end(update.nfe)
        return stop

    def end(self, nfe: int) -> None:
        """The row left the batch: deliver its result (unless its client went away) and record it."""
        if self.ended:
            return
        self.ended = True
        row, completion = self.row, self.completion
        cancelled = row.cancelled.is_set()
        if not cancelled:
            if row.stream and self.sent < len(completion.text):
                self._send(("delta", row.index, completion.text[self.sent :]))
                self.sent = len(completion.text)
            result = RowResult(
                text=completion.text,
                finish_reason=completion.finish_reason or "length",
                prompt_tokens=len(row.prompt_ids),
                completion_tokens=completion.completion_tokens,
                nfe=nfe,
            )
            self._send(("done", row.index, result))
        self.stats.record_row(
            dict(
                request_id=row.request_id,
                index=row.index,
                nfe=nfe,
                cancelled=cancelled,
                finish_reason="cancelled" if cancelled else completion.finish_reason,
                completion_tokens=completion.completion_tokens,
                latency_s=time.monotonic() - row.arrival,
                first_block_s=None if self.first_block_at is None else self.first_block_at - row.arrival,
            )
        )

    def _send(self, event: tuple) -> None:
        if not self.row.cancelled.is_set():
            self.row.sink(event)


class BatchStats:
    """Counters of the batcher, readable from any thread (`snapshot()`)."""

    def __init__(self, history: int = 512):
        self._lock = threading.Lock()
        self.rows = 0  # rows that ended (result delivered or cancelled)
        self.cancelled_rows = 0
        self.forwards = 0
        # Positions (rows x columns) the blocks' first steps fed to the model (`ContinuousBatcher`'s counter).
        self.first_step_positions = 0
        self.graph_steps: dict[str, int] = {}  # the engine's `graph_counts()` at the last boundary
        self.errors = 0
        self.layout_sizes: dict[int, int] = {}
        self.boundaries = 0  # block boundaries decoded (every running row advanced one block)
        self.boundary_seconds = 0.0
        self.pending = 0
        self.running_rows = 0
        self.records: deque[dict] = deque(maxlen=history)

    def record_layout(self, size: int) -> None:
        with self._lock:
            self.layout_sizes[size] = self.layout_sizes.get(size, 0) + 1

    def record_row(self, record: dict) -> None:
        with self._lock:
            self.rows += 1
            self.cancelled_rows += record["cancelled"]
            self.records.append(record)

    def snapshot(self) -> dict:
        with self._lock:
            layouts = sum(self.layout_sizes.values())  # blocks decoded for a layout (one per group per boundary)
            return dict(
                layouts=layouts,
                rows=self.rows,
                mean_rows_per_layout=sum(size * count for size, count in self.layout_sizes.items()) / layouts
                if layouts
                else 0.0,
                layout_sizes={str(k): v for k, v in sorted(self.layout_sizes.items())},
                boundaries=self.boundaries,
                mean_boundary_s=self.boundary_seconds / self.boundaries if self.boundaries else 0.0,
                cancelled_rows=self.cancelled_rows,
                forwards=self.forwards,
                first_step_positions=self.first_step_positions,
                mean_first_step_positions_per_boundary=self.first_step_positions / self.boundaries
                if self.boundaries
                else 0.0,
                graph_steps=dict(self.graph_steps),
                errors=self.errors,
                pending_rows=self.pending,
                running_rows=self.running_rows,
            )

    def find(self, request_id: str) -> list[dict]:
        with self._lock:
            return [record for record in self.records if record["request_id"] == request_id]


class Batcher:
    """Owns the model: queues `RowRequest`s and decodes them with the continuous-batching engine in one scheduler
    thread (see module doc). `max_batch_size` rows run at once and `max_batch_width` bounds a layout's columns (the
    engine's defaults: `engine.ContinuousBatcher`; given alone, `max_batch_size` makes the K/V cache hold
    `max_batch_size x max_batch_width` positions). An `engine` made by the caller (`hf-dllm serve`, with every
    engine option; a tensor-parallel server's `MirroredEngine`) is used as made, with its own limits."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        stop_token_ids: set[int],
        max_batch_size: int | None = None,
        max_batch_width: int | None = None,
        engine: ContinuousBatcher | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        if engine is None:
            engine = ContinuousBatcher(model, max_batch_size=max_batch_size, max_batch_width=max_batch_width)
        self.engine = engine
        engine.intake = self._intake  # requests submitted during a boundary may join its slices still to decode
        self.family = model.diffusion_family
        self.stats = BatchStats()
        self._submitted: deque[RowRequest] = deque()
        # id(EngineRequest) -> the request and its row's tracker, until the row leaves the engine
        self._trackers: dict[int, tuple[EngineRequest, RowTracker]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def max_batch_size(self) -> int:
        return self.engine.max_batch_size

    @property
    def max_batch_width(self) -> int:
        return self.engine.max_batch_width

    @property
    def max_batch_positions(self) -> int | None:
        return self.engine.max_batch_positions

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._serve, name="hf-dllm-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop decoding after the current boundary; rows still queued or running get an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for row in self._drain():
            row.sink(("error", row.index, 503, "The server is shutting down."))

    def _drain(self) -> list[RowRequest]:
        """Rows not delivered yet (after the scheduler stopped)."""
        with self._cond:
            dropped = list(self._submitted)
            self._submitted.clear()
        dropped += [tracker.row for _, tracker in self._trackers.values() if not tracker.ended]
        self._trackers.clear()
        self.engine.abandon()
        return dropped

    def submit(self, rows: list[RowRequest]) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the batcher is stopped")
            self._submitted.extend(rows)
            self.stats.pending = len(self._submitted) + self.engine.pending()
            self._cond.notify_all()

    def notify(self) -> None:
        """Wake the scheduler (e.g. after a queued row was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def _enqueue(self, row: RowRequest) -> None:
        """Hand a submitted row to the engine (in the scheduler thread, which owns it)."""
        config = row.generation_config
        if self.family.cut_after_first_eos and self.stop_token_ids:
            # A family that cuts a row after its first EOS (block-causal: LLaDA2.x) may also stop it inside a block:
            # with every stop token as EOS, an EOT ends the row there too and costs no more forwards. (For a
            # bidirectional model this changes nothing: the tracker already ends such rows after the block.)
            config = self.model.resolve_generation_config(config, eos_token_id=sorted(self.stop_token_ids))
        tracker = RowTracker(row, self.tokenizer, self.stop_token_ids, self.stats)
        request = EngineRequest(row.prompt_ids, config, tracker.on_block, cancelled=row.cancelled, group=row.request_id)
        try:
            self.engine.submit(request)
        except (ValueError, TypeError) as error:  # what generate() would refuse: this row only
            row.sink(("error", row.index, 400, f"Generation failed: {error}"))
            return
        self._trackers[id(request)] = (request, tracker)
        request.on_cancel = tracker.end

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._submitted and not self.engine.has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            self._intake()
            self.decode_boundary()

    def _intake(self) -> None:
        """Hand the rows submitted meanwhile to the engine: before each boundary, and between two layouts of a
        boundary (the engine's `intake`)."""
        with self._cond:
            submitted = list(self._submitted)
            self._submitted.clear()
        for row in submitted:
            self._enqueue(row)

    def decode_boundary(self) -> None:
        """One block boundary of the engine; a failing layout gives its rows an error and the server keeps
        serving."""
        engine = self.engine
        forwards, positions, started = engine.forwards, engine.first_step_positions, time.monotonic()
        try:
            engine.decode_boundary()
        except Exception as error:
            logger.exception("generation failed for a layout of rows")
            with self.stats._lock:
                self.stats.errors += 1
            status = 400 if isinstance(error, (ValueError, TypeError)) else 500
            for request, tracker in self._trackers.values():
                if request.error is not None and not tracker.ended:
                    tracker.ended = True
                    tracker.row.sink(("error", tracker.row.index, status, f"Generation failed: {error}"))
        for size in engine.last_layout_sizes:
            self.stats.record_layout(size)
        with self.stats._lock:
            self.stats.boundaries += 1
            self.stats.boundary_seconds += time.monotonic() - started
            self.stats.forwards += engine.forwards - forwards
            self.stats.first_step_positions += engine.first_step_positions - positions
            self.stats.graph_steps = engine.graph_counts()
            self.stats.running_rows = len(engine.running)
            self.stats.pending = len(self._submitted) + len(engine.waiting)
        for key in [key for key, (request, _) in self._trackers.items() if request.ended]:
            del self._trackers[key]
