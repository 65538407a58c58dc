"""Dynamic batching for `hf-dllm serve`: one model, many concurrent requests, padded block-diffusion runs.

Every prompt of a request becomes a `RowRequest` carrying its resolved settings (`model.resolve_generation_config`
of the fields the request named: the checkpoint's `generation_config.json` supplies the rest). A scheduler thread
collects rows into batches:

- A batch holds rows whose resolved settings are equal (`RowRequest.key`), so one run decodes them all, and each
  row gets exactly what `generate()` gives it alone (rows of a run never influence each other; left padding is
  masked).
- The batch is formed from the group of the *oldest* waiting row: groups are served in FIFO order of their
  first row, so a request whose parameters differ from the crowd's still gets its turn (no starvation).
- After the oldest row arrives, the scheduler waits up to `batch_window_s` for more compatible rows, and stops
  waiting once `max_batch_size` of them are there.
- Up to `max_concurrent_batches` runs go at once, each in its own thread (torch releases the GIL, so the event
  loop stays responsive). With 2 or more, a long batch does not hold back the rows behind it (one run at a time
  holds the model's CUDA-graph runner; the others run eagerly, with equal outputs).

A batch is one `model.generate_blocks(...)` run; `BatchTracker` consumes its `BlockEvent`s. After every committed
block it appends each row's new tokens to the row's `CompletionText` (cut at a stop token, a stop string or
`max_tokens`), streams the row's new text, stops (`event.stop`) rows whose completion is over or whose client went
away, so that they cost no more forwards, and delivers the result of every row that ended with the block (by the
run's own rules or by that stop) with `nfe` = the run's `nfe_per_row` for the row, which is final once it ended.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cli.completion_text import CompletionText
from ..generation_config import DiffusionGenerationConfig
from ..generation_utils import BlockEvent, left_pad

logger = logging.getLogger("hf_dllm.serve")

# Events a row's sink receives (from a worker thread): ("delta", index, text), ("done", index, RowResult),
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


def settings_key(config: DiffusionGenerationConfig) -> str:
    """The batching key of resolved settings: every field, so rows share a run only when it is the same run."""
    return json.dumps({name: getattr(config, name) for name in config.field_names()}, sort_keys=True)


@dataclass(eq=False)
class RowRequest:
    """One prompt to decode with `generation_config` (resolved settings); rows with equal settings share a run.
    `max_tokens` caps the returned tokens (None: the decoded length)."""

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
    key: str = field(init=False)

    def __post_init__(self):
        self.key = settings_key(self.generation_config)


class _RowState:
    __slots__ = ("completion", "sent", "finished", "ended", "cancelled", "nfe")

    def __init__(self, completion: CompletionText):
        self.completion = completion
        self.sent = 0  # characters of the text already streamed
        self.finished = False  # the completion's text is final
        self.ended = False  # the row left the run (result delivered, or cancelled)
        self.cancelled = False
        self.nfe: int | None = None


class BatchTracker:
    """Consumes the `BlockEvent`s of one run (see module doc): `consume(event)` after every committed block, then
    `finish(nfe_per_row)` once the run is over."""

    def __init__(self, rows: list[RowRequest], tokenizer, stop_token_ids: set[int]):
        self.rows = rows
        # An EOS/EOT ends the row's decoding only with `eos_early_stop` (else the run decodes on, as asked, and the
        # row ends with its last block); a stop string or max_tokens always do.
        self.eos_early_stop = rows[0].generation_config.eos_early_stop
        self.states = [_RowState(CompletionText(tokenizer, stop_token_ids, row.stop, row.max_tokens)) for row in rows]

    def consume(self, event: BlockEvent) -> None:
        """One committed block: extend, stream and stop the rows it decoded; deliver the rows that ended."""
        batch_rows = event.rows.tolist()
        stop = [False] * len(batch_rows)
        new_tokens = event.new_tokens()
        for i, batch_row in enumerate(batch_rows):
            row, state = self.rows[batch_row], self.states[batch_row]
            if row.cancelled.is_set():
                state.cancelled = stop[i] = True
                continue
            if state.finished:
                continue
            completion = state.completion
            state.finished = completion.extend(new_tokens[i])
            if row.stream:
                end = max(completion.streamable(), state.sent)
                self._send(row, ("delta", row.index, completion.text[state.sent : end]))
                state.sent = end
            if row.cancelled.is_set():  # the client went away while its text was sent
                state.cancelled = stop[i] = True
            elif state.finished:
                stop_token_only = completion.finish_reason == "stop" and not completion.stop_string_found
                stop[i] = self.eos_early_stop or not stop_token_only
        if any(stop):
            event.stop(stop)
        ended, nfe = event.ended.tolist(), event.nfe_per_row.tolist()
        for i, batch_row in enumerate(batch_rows):
            if ended[i]:
                self._end(batch_row, nfe[i])

    def _end(self, batch_row: int, nfe: int) -> None:
        row, state = self.rows[batch_row], self.states[batch_row]
        if state.ended:
            return
        state.ended, state.nfe = True, nfe
        if row.cancelled.is_set():
            state.cancelled = True
            return
        completion = state.completion
        if row.stream and state.sent < len(completion.text):
            self._send(row, ("delta", row.index, completion.text[state.sent :]))
            state.sent = len(completion.text)
        result = RowResult(
            text=completion.text,
            finish_reason=completion.finish_reason or "length",
            prompt_tokens=len(row.prompt_ids),
            completion_tokens=completion.completion_tokens,
            nfe=nfe,
        )
        self._send(row, ("done", row.index, result))

    @staticmethod
    def _send(row: RowRequest, event: tuple) -> None:
        if not row.cancelled.is_set():
            row.sink(event)

    def finish(self, nfe_per_row: list[int]) -> list[dict]:
        """After the run: end the rows not ended yet (none, when the run yielded every block); return one record
        per row for the stats."""
        for batch_row, nfe in enumerate(nfe_per_row):
            self._end(batch_row, nfe)
        return [
            dict(
                request_id=row.request_id,
                index=row.index,
                nfe=state.nfe,
                cancelled=state.cancelled,
                finish_reason="cancelled" if state.cancelled else state.completion.finish_reason,
                completion_tokens=state.completion.completion_tokens,
            )
            for row, state in zip(self.rows, self.states, strict=True)
        ]


class BatchStats:
    """Counters of the batcher, readable from any thread (`snapshot()`)."""

    def __init__(self, history: int = 512):
        self._lock = threading.Lock()
        self.batches = 0
        self.rows = 0
        self.cancelled_rows = 0
        self.forwards = 0
        self.errors = 0
        self.batch_sizes: dict[int, int] = {}
        self.pending = 0
        self.running_rows = 0
        self.records: deque[dict] = deque(maxlen=history)

    def record_batch(self, size: int, forwards: int, records: list[dict]) -> None:
        with self._lock:
            self.batches += 1
            self.rows += size
            self.forwards += forwards
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
            for record in records:
                self.cancelled_rows += record["cancelled"]
                self.records.append(record)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(
                batches=self.batches,
                rows=self.rows,
                mean_batch_size=self.rows / self.batches if self.batches else 0.0,
                batch_sizes={str(k): v for k, v in sorted(self.batch_sizes.items())},
                cancelled_rows=self.cancelled_rows,
                forwards=self.forwards,
                errors=self.errors,
                pending_rows=self.pending,
                running_rows=self.running_rows,
            )

    def find(self, request_id: str) -> list[dict]:
        with self._lock:
            return [record for record in self.records if record["request_id"] == request_id]


class Batcher:
    """Owns the model: queues `RowRequest`s and decodes them in batched runs (see module doc)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        stop_token_ids: set[int],
        pad_token_id: int,
        max_batch_size: int = 8,
        batch_window_s: float = 0.01,
        max_concurrent_batches: int = 1,
    ):
        if max_batch_size < 1 or max_concurrent_batches < 1 or batch_window_s < 0:
            raise ValueError("max_batch_size and max_concurrent_batches must be >= 1, batch_window_s >= 0.")
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.stats = BatchStats()
        self._pending: deque[RowRequest] = deque()
        self._cond = threading.Condition()
        self._slots = threading.Semaphore(max_concurrent_batches)
        self._workers: set[threading.Thread] = set()
        self._stopping = False
        self._scheduler: threading.Thread | None = None

    def start(self) -> None:
        if self._scheduler is None:
            self._stopping = False
            self._scheduler = threading.Thread(target=self._schedule, name="hf-dllm-scheduler", daemon=True)
            self._scheduler.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking batches; running ones finish; rows still queued get an error."""
        with self._cond:
            self._stopping = True
            dropped = list(self._pending)
            self._pending.clear()
            self.stats.pending = 0
            self._cond.notify_all()
        for row in dropped:
            row.sink(("error", row.index, 503, "The server is shutting down."))
        if self._scheduler is not None:
            self._scheduler.join(timeout)
            self._scheduler = None
        for worker in list(self._workers):
            worker.join(timeout)

    def submit(self, rows: list[RowRequest]) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the batcher is stopped")
            self._pending.extend(rows)
            self.stats.pending = len(self._pending)
            self._cond.notify_all()

    def notify(self) -> None:
        """Wake the scheduler (e.g. after a queued row was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def _next_batch(self) -> list[RowRequest] | None:
        with self._cond:
            while True:
                if any(row.cancelled.is_set() for row in self._pending):
                    self._pending = deque(row for row in self._pending if not row.cancelled.is_set())
                    self.stats.pending = len(self._pending)
                if self._stopping:
                    return None
                if not self._pending:
                    self._cond.wait()
                    continue
                head = self._pending[0]
                group = [row for row in self._pending if row.key == head.key][: self.max_batch_size]
                wait = head.arrival + self.batch_window_s - time.monotonic()
                if len(group) >= self.max_batch_size or wait <= 0:
                    chosen = set(map(id, group))
                    self._pending = deque(row for row in self._pending if id(row) not in chosen)
                    self.stats.pending = len(self._pending)
                    return group
                self._cond.wait(wait)

    def _schedule(self) -> None:
        while True:
            self._slots.acquire()
            batch = self._next_batch()
            if batch is None:
                self._slots.release()
                return
            worker = threading.Thread(target=self._work, args=(batch,), name="hf-dllm-batch", daemon=True)
            self._workers.add(worker)
            worker.start()

    def _work(self, batch: list[RowRequest]) -> None:
        try:
            self.run_batch(batch)
        finally:
            self._workers.discard(threading.current_thread())
            self._slots.release()

    def run_batch(self, batch: list[RowRequest]) -> None:
        """Decode `batch` (rows with equal settings) in one left-padded `model.generate_blocks()` run, consuming
        its block events (`BatchTracker`)."""
        with self.stats._lock:
            self.stats.running_rows += len(batch)
        tracker = None
        try:
            input_ids, attention_mask = left_pad([row.prompt_ids for row in batch], self.pad_token_id)
            device = self.model.get_input_embeddings().weight.device
            block_causal = bool(getattr(self.model, "diffusion_block_causal", False))
            tracker = BatchTracker(batch, self.tokenizer, self.stop_token_ids)
            # A block-causal model stops a row inside a block at its EOS and fills the row with it after the first
            # one: with every stop token as EOS, an EOT ends the row there too, and costs no more forwards. (For a
            # bidirectional model this changes nothing: the tracker already stops such rows after the block.)
            eos = {"eos_token_id": sorted(self.stop_token_ids)} if block_causal and self.stop_token_ids else {}
            run = self.model.generate_blocks(
                input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=batch[0].generation_config,
                **eos,
            )
            for event in run:
                tracker.consume(event)
            records = tracker.finish(run.nfe_per_row.tolist())
            self.stats.record_batch(len(batch), int(run.nfe), records)
        except Exception as error:  # the server keeps serving: the rows of this run still waiting get the error
            logger.exception("generation failed for a batch of %d rows", len(batch))
            with self.stats._lock:
                self.stats.errors += 1
            status = 400 if isinstance(error, (ValueError, TypeError)) else 500
            for i, row in enumerate(batch):
                if tracker is None or not tracker.states[i].ended:
                    row.sink(("error", row.index, status, f"Generation failed: {error}"))
        finally:
            with self.stats._lock:
                self.stats.running_rows -= len(batch)
