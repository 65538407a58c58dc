"""Which waiting requests join the running batch, and in what order (`Admission`), for the continuous-batching
engine (`engine.ContinuousBatcher`).

The engine owns the running rows and what fits a layout; admission owns the queue of waiting requests and the
order in which they are offered: oldest first, and the first one that does not fit waits for room rather than be
passed (no starvation). A different order (e.g. round-robin across the requests' owners) changes `_next` only.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .rows import EngineRequest


def drop_cancelled(row: EngineRequest) -> bool:
    """Whether `row` leaves before decoding (cancelled, or ended); a cancelled row's `on_cancel` is told."""
    if row.cancelled.is_set() and not row.ended:
        row.ended = True
        if row.on_cancel is not None:
            row.on_cancel(row.nfe)
    return row.ended


class Admission:
    """The requests waiting to join a batch (`submit` from any thread; `admit` from the engine's).

    Attributes:
        lock (`threading.Lock`): guards `waiting` (the engine's tensor-parallel mirror guards its own state with it).
        waiting (`deque[EngineRequest]`): the queued requests, in submission order.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: deque[EngineRequest] = deque()

    def submit(self, request: EngineRequest) -> None:
        with self.lock:
            self.waiting.append(request)

    def pending(self) -> int:
        with self.lock:
            return len(self.waiting)

    def clear(self) -> None:
        with self.lock:
            self.waiting.clear()

    def admit(self, slots: list[int], join: Callable[[EngineRequest], bool]) -> None:
        """While `slots` (free row places, in order of use) has one, offer the next waiting request to `join`,
        which either takes it into the batch (True: it gets the first free slot) or not (False: admission stops
        there, the request keeps its place). Cancelled requests leave the queue first (`drop_cancelled`)."""
        with self.lock:
            if any(row.cancelled.is_set() for row in self.waiting):
                self.waiting = deque(row for row in self.waiting if not drop_cancelled(row))
            while slots and (head := self._next()) is not None and join(head):
                self.waiting.remove(head)
                head.slot = slots.pop(0)

    def _next(self) -> EngineRequest | None:
        """The request offered next (the lock is held): the oldest."""
        return self.waiting[0] if self.waiting else None
