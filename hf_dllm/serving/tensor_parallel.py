"""`hf-dllm serve` on a tensor-parallel model (`torchrun --nproc-per-node N -m hf_dllm serve MODEL --tp-plan auto`):
rank 0 serves HTTP and schedules; the other ranks decode the same layouts in lockstep, with no HTTP of their own.

Every rank must run the same forwards in the same order (each forward's collectives pair up across ranks). The
continuous-batching engine (`engine.ContinuousBatcher`) is deterministic given three things that only rank 0 sees,
so rank 0 sends them over a gloo group (CPU messages; the GPUs' NCCL group carries only the model's collectives):

1. at every block boundary, before anything is decided, and between two layouts of a boundary while a slice is still
   to decode (where waiting requests may join it, `scheduler.Slice`): the requests submitted since the last such
   message (prompt ids and resolved settings, in submission order) and the requests cancelled since then;
2. after every block of every row: whether the row ends there (`on_block`'s answer on rank 0: a stop string,
   `max_tokens`, a client gone);
3. at shutdown: a message that ends the followers' loop.

Cancellations reach the engine only through (1): rank 0's engine requests carry their own `cancelled` event, set
when the boundary message is made, so a client that disconnects mid-boundary cannot make rank 0 decide otherwise
than the followers.
"""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from .engine import ContinuousBatcher
from .rows import EngineRequest

# The followers wait for the next request for as long as the server runs: no timeout on the control group.
CONTROL_TIMEOUT = timedelta(days=365)


def control_group():
    """A gloo group of every rank for the scheduling messages (call on every rank, in the same order)."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


class MirroredEngine(ContinuousBatcher):
    """`ContinuousBatcher` whose decisions rank 0 shares with the other ranks of `group` (module doc). On rank 0
    it is the server's engine (`Batcher(engine=...)`); on the others `follow()` decodes until rank 0 shuts down."""

    def __init__(self, model, group, **kwargs):
        super().__init__(model, **kwargs)
        # Every rank lays out the same rows: a batch size or K/V budget derived from each rank's free memory
        # (`default_max_batch_size`, `default_max_batch_positions`) may differ between ranks, so all take the
        # smallest. (They count every K/V head, where a rank holds 1/N of them: on the safe side.) Every rank has a
        # budget or none (the same options, the same kind of device): 0 stands for none.
        limits = torch.tensor([self.max_batch_size, self.max_batch_positions or 0])
        dist.all_reduce(limits, op=dist.ReduceOp.MIN, group=group)
        self.set_max_batch_size(int(limits[0]))
        self.set_max_batch_positions(int(limits[1]) or None)
        self.group = group
        self.leader = dist.get_rank(group) == 0
        self.source = dist.get_global_rank(group, 0)
        self._ids = itertools.count()
        self._unsent: list[tuple[int, list[int], object, object]] = []  # rank 0: submitted, not yet announced
        self._live: dict[int, EngineRequest] = {}  # id -> request, until it ends
        self._client_cancelled: dict[int, threading.Event] = {}  # rank 0: the HTTP side's events

    def _send(self, message):
        box = [message]
        dist.broadcast_object_list(box, src=self.source, group=self.group)
        return box[0]

    # -- rank 0 -------------------------------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        if not self.leader:
            raise RuntimeError("only rank 0 takes requests; the other ranks follow()")
        if request.plan is None:
            self.prepare(request)  # a refused request raises here, before anything is announced
        number = next(self._ids)
        self._client_cancelled[number] = request.cancelled
        request.cancelled = threading.Event()  # set only when a boundary message says so
        decide = request.on_block

        def on_block(update):
            return self._send(bool(decide(update)))

        request.on_block = on_block
        with self.lock:
            self._unsent.append((number, list(request.prompt_ids), request.config, request.group))
            self._live[number] = request
        super().submit(request)

    def decode_boundary(self) -> int:
        if not self.leader:
            raise RuntimeError("the other ranks decode boundaries in follow()")
        self._announce()
        try:
            return super().decode_boundary()
        finally:
            self._forget_ended()

    def _announce(self) -> None:
        """Rank 0: tell the other ranks what was submitted and cancelled since the last message (and cancel
        those here now, at the same point of the schedule)."""
        with self.lock:
            submitted, self._unsent = self._unsent, []
            cancelled = [n for n, event in self._client_cancelled.items() if event.is_set() and n in self._live]
        for number in cancelled:
            self._live[number].cancelled.set()
            del self._client_cancelled[number]
        self._send({"submitted": submitted, "cancelled": cancelled})

    def _between_layouts(self) -> None:
        if self.leader:
            super()._between_layouts()  # the server's new requests: `submit` queues them to announce
            self._announce()
        else:
            self._apply(self._send(None))

    def abandon(self) -> None:
        if self.leader:
            self._send(None)  # the followers' loop ends
        super().abandon()

    # -- other ranks ----------------------------------------------------------------------------------------------
    def follow(self) -> None:
        """Decode every boundary rank 0 decodes, until it shuts down (call on every rank but 0)."""
        if self.leader:
            raise RuntimeError("rank 0 serves; follow() is for the other ranks")
        while (message := self._send(None)) is not None:
            self._apply(message)
            try:
                ContinuousBatcher.decode_boundary(self)
            except Exception:  # rank 0 failed the same layout: it reports the error, the followers go on
                pass
            self._forget_ended()
        ContinuousBatcher.abandon(self)

    def _apply(self, message: dict) -> None:
        """Another rank: queue the requests rank 0 announced and cancel those it cancelled."""
        # The request's group too: rows are admitted in turns by request (`admission.py`), the same turns here.
        for number, prompt_ids, config, group in message["submitted"]:
            request = EngineRequest(prompt_ids, config, lambda update: self._send(None), group=group)
            self._live[number] = request
            ContinuousBatcher.submit(self, request)
        for number in message["cancelled"]:
            self._live[number].cancelled.set()

    def _forget_ended(self) -> None:
        for number in [n for n, request in self._live.items() if request.ended]:
            del self._live[number]
            self._client_cancelled.pop(number, None)
