"""Dynamic batching for `hf-dllm serve`: one model, many concurrent requests, padded `generate()` calls.

Every prompt of a request becomes a `RowRequest`. A scheduler thread collects rows into batches:

- A batch holds rows whose generation parameters are equal (`RowRequest.key`: every `generate()` field except
  the prompt), so one `generate()` call decodes them all, and each row gets exactly what `generate()` gives it
  alone (rows of a call never influence each other; left padding is masked).
- The batch is formed from the group of the *oldest* waiting row: groups are served in FIFO order of their
  first row, so a request whose parameters differ from the crowd's still gets its turn (no starvation).
- After the oldest row arrives, the scheduler waits up to `batch_window_s` for more compatible rows, and stops
  waiting once `max_batch_size` of them are there.
- Up to `max_concurrent_batches` `generate()` calls run at once, each in its own thread (torch releases the GIL,
  so the event loop stays responsive). With 2 or more, a long batch does not hold back the rows behind it (one
  call at a time holds the model's CUDA-graph runner; `generate()` runs the others eagerly, with equal outputs).

One `BatchTracker` follows each call. It is both the call's `stopping_criteria` entry (called after every
committed block with the whole canvas) and its `streamer` (`put()` after every committed block):

- as a criterion it reads each row's newly committed block, cuts the text at the first EOS/EOT, at `max_tokens`
  or at a `stop` string, and returns True for rows that are done or whose client went away, so that they cost
  no more forwards;
- as a streamer it then hands each row's new text to the row's sink (one event per committed block), and the
  final result of rows that stopped early, whose NFE is already known for fixed-step schedules.

Rows still running when `generate()` returns get their result with `nfe_per_row` of the call.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from ..generation_utils import left_pad, plan_blocks

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


@dataclass(eq=False)
class RowRequest:
    """One prompt to decode. `generate_kwargs` are `generate()` fields; equal kwargs can share a call."""

    prompt_ids: list[int]
    generate_kwargs: dict
    max_tokens: int
    sink: Sink
    stop: tuple[str, ...] = ()
    stream: bool = False
    index: int = 0
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.generate_kwargs.items()))


class _RowState:
    __slots__ = ("tokens", "read", "text", "sent", "finish_reason", "completion_tokens", "stopped", "delivered", "nfe")

    def __init__(self):
        self.tokens: list[int] = []
        self.read = 0  # generated positions of the row already consumed
        self.text = ""
        self.sent = 0  # characters of `text` already streamed
        self.finish_reason: str | None = None  # set once the row's text is final
        self.completion_tokens = 0
        self.stopped = False  # the criterion stopped the row (no more forwards)
        self.delivered = False
        self.nfe: int | None = None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that must wait: a possible start of a stop string, or a partial
    multi-byte character (decoded as U+FFFD)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    while hold < len(text) and text[len(text) - hold - 1] == "\ufffd":
        hold += 1
    return hold


class BatchTracker(BaseStreamer):
    """Per-call bookkeeping of the rows of one `generate()` call (criterion + streamer, see module doc).

    Which generated positions are final after the call's k-th block depends on the model: a bidirectional model
    (LLaDA) decodes the same blocks, right after the (padded) prompts, for every row; a block-causal one (LLaDA2.x,
    `block_causal=True`) aligns blocks to each row's absolute positions, so the first block holds the prompt's
    tail and rows of other prompt lengths have committed other numbers of positions (`committed`).
    """

    def __init__(
        self, rows: list[RowRequest], tokenizer, stop_token_ids: set[int], prompt_len: int, block_causal: bool = False
    ):
        self.rows = rows
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.prompt_len = prompt_len
        self.block_causal = block_causal
        kwargs = rows[0].generate_kwargs
        self.max_new_tokens, self.block_length = kwargs["max_new_tokens"], kwargs["block_length"]
        self.blocks = None if block_causal else plan_blocks(self.max_new_tokens, self.block_length, kwargs.get("steps"))
        # With a fixed schedule every block takes a known number of forwards, so a row stopped after block k
        # has taken part in exactly the steps of blocks 0..k and can be answered at once. (A block-causal model's
        # first block, partly prompt, and its in-block EOS stop make a row's forwards known only to generate().)
        self.fixed_schedule = not block_causal and kwargs.get("threshold") is None and kwargs.get("factor") is None
        self.eos_early_stop = kwargs.get("eos_early_stop", True)
        self.states = [_RowState() for _ in rows]
        self.block_index = 0
        self.forwards = 0
        self.pending: list[tuple[RowRequest, tuple]] = []

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _count_tokens_of(self, tokens: list[int], text: str) -> int:
        """Largest k such that the first k tokens decode to no more than `text` (tokens before a stop string)."""
        low, high = 0, len(tokens)
        while low < high:
            mid = (low + high + 1) // 2
            if len(self._decode(tokens[:mid])) <= len(text):
                low = mid
            else:
                high = mid - 1
        return low

    def _consume(self, row: RowRequest, state: _RowState, block: list[int]) -> None:
        """Append a committed block to the row's text; set `finish_reason` once the text is final."""
        for token in block:
            if len(state.tokens) >= row.max_tokens:
                state.finish_reason = "length"
                break
            if token in self.stop_token_ids:
                state.finish_reason = "stop"
                break
            state.tokens.append(token)
        if state.finish_reason is None and len(state.tokens) >= row.max_tokens:
            state.finish_reason = "length"
        text = self._decode(state.tokens)
        state.completion_tokens = len(state.tokens)
        cut = min((i for i in (text.find(s) for s in row.stop) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
            state.finish_reason = "stop"
            state.completion_tokens = self._count_tokens_of(state.tokens, text)
        state.text = text
        if row.stream:
            end = len(text) if state.finish_reason else len(text) - _held_back(text, row.stop)
            end = max(end, state.sent)
            self.pending.append((row, ("delta", row.index, text[state.sent : end])))
            state.sent = end
        if state.finish_reason is not None:
            # EOS/EOT end the row only with eos_early_stop (else generate() decodes on, as asked); a stop string
            # or max_tokens always do.
            hit_eos = state.finish_reason == "stop" and cut < 0
            state.stopped = self.eos_early_stop or not hit_eos

    def _result(self, row: RowRequest, state: _RowState, nfe: int) -> tuple:
        if row.stream and state.sent < len(state.text):
            self.pending.append((row, ("delta", row.index, state.text[state.sent :])))
            state.sent = len(state.text)
        state.delivered = True
        state.nfe = nfe
        result = RowResult(
            text=state.text,
            finish_reason=state.finish_reason or "length",
            prompt_tokens=len(row.prompt_ids),
            completion_tokens=state.completion_tokens,
            nfe=nfe,
        )
        return ("done", row.index, result)

    def committed(self, row: RowRequest, block: int) -> int:
        """Generated positions of `row` that are final once the call's `block`-th block (0-based) is decoded."""
        if self.block_causal:
            prompt = len(row.prompt_ids)
            end = (prompt // self.block_length + block + 1) * self.block_length
            return min(self.max_new_tokens, end - prompt)
        offset, length, _ = self.blocks[block]
        return offset + length

    # -- stopping criterion: called by generate() after every committed block ---------------------------------
    def __call__(self, sequences: torch.Tensor, scores=None) -> torch.Tensor:
        block = self.block_index
        self.block_index += 1
        if self.fixed_schedule:
            self.forwards += self.blocks[block][2]
        generated = sequences[:, self.prompt_len :].cpu()
        stop = [False] * len(self.rows)
        for i, (row, state) in enumerate(zip(self.rows, self.states, strict=True)):
            if state.stopped or state.delivered:
                stop[i] = True
                continue
            if row.cancelled.is_set():
                stop[i] = state.stopped = True
                continue
            if state.finish_reason is None:
                end = self.committed(row, block)
                tokens, state.read = generated[i, state.read : end].tolist(), max(state.read, end)
                self._consume(row, state, tokens)
            stop[i] = state.stopped
            if state.stopped and self.fixed_schedule:
                self.pending.append((row, self._result(row, state, self.forwards)))
        return torch.tensor(stop, dtype=torch.bool)

    # -- streamer: put(prompt), put(block) after every committed block, end() ---------------------------------
    def put(self, value) -> None:
        self.flush()

    def end(self) -> None:
        self.flush()

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for row, event in pending:
            if not row.cancelled.is_set():
                row.sink(event)

    def finish(self, nfe_per_row: list[int]) -> list[dict]:
        """After generate(): answer the rows not answered yet; return one record per row for the stats."""
        records = []
        for row, state, nfe in zip(self.rows, self.states, nfe_per_row, strict=True):
            cancelled = row.cancelled.is_set() and not state.delivered
            if not state.delivered and not cancelled:
                self.pending.append((row, self._result(row, state, nfe)))
            records.append(
                dict(
                    request_id=row.request_id,
                    index=row.index,
                    nfe=nfe,
                    reported_nfe=state.nfe,
                    cancelled=cancelled,
                    finish_reason="cancelled" if cancelled else state.finish_reason,
                    completion_tokens=state.completion_tokens,
                )
            )
        self.flush()
        return records


class BatchStats:
    """Counters of the batcher, readable from any thread (`snapshot()`)."""

    def __init__(self, history: int = 512):
        self._lock = threading.Lock()
        self.batches = 0
        self.rows = 0
        self.cancelled_rows = 0
        self.forwards = 0
        self.nfe_mismatches = 0
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
                reported = record["reported_nfe"]
                self.nfe_mismatches += reported is not None and reported != record["nfe"]
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
                nfe_mismatches=self.nfe_mismatches,
                errors=self.errors,
                pending_rows=self.pending,
                running_rows=self.running_rows,
            )

    def find(self, request_id: str) -> list[dict]:
        with self._lock:
            return [record for record in self.records if record["request_id"] == request_id]


class Batcher:
    """Owns the model: queues `RowRequest`s and decodes them in batched `generate()` calls (see module doc)."""

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
        """Decode `batch` (rows with equal `generate_kwargs`) in one left-padded `generate()` call."""
        with self.stats._lock:
            self.stats.running_rows += len(batch)
        try:
            input_ids, attention_mask = left_pad([row.prompt_ids for row in batch], self.pad_token_id)
            prompt_len = input_ids.shape[1]
            device = self.model.get_input_embeddings().weight.device
            block_causal = bool(getattr(self.model, "diffusion_block_causal", False))
            tracker = BatchTracker(batch, self.tokenizer, self.stop_token_ids, prompt_len, block_causal)
            # A block-causal model stops a row inside a block at its EOS and fills the row with it after the first
            # one: with every stop token as EOS, an EOT ends the row there too, and costs no more forwards. (For a
            # bidirectional model this changes nothing: the tracker already stops such rows after the block.)
            eos = {"eos_token_id": sorted(self.stop_token_ids)} if block_causal and self.stop_token_ids else {}
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                streamer=tracker,
                stopping_criteria=[tracker],
                return_dict_in_generate=True,
                **eos,
                **batch[0].generate_kwargs,
            )
            records = tracker.finish(out.nfe_per_row.tolist())
            self.stats.record_batch(len(batch), int(out.nfe), records)
        except Exception as error:  # the server keeps serving: the rows of this call get the error
            logger.exception("generate() failed for a batch of %d rows", len(batch))
            with self.stats._lock:
                self.stats.errors += 1
            status = 400 if isinstance(error, (ValueError, TypeError)) else 500
            for row in batch:
                row.sink(("error", row.index, status, f"Generation failed: {error}"))
        finally:
            with self.stats._lock:
                self.stats.running_rows -= len(batch)
