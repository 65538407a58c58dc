"""The order in which waiting rows join the continuous batch: in turns across requests.

A request with many prompts (`/v1/completions` takes up to `--max-prompts-per-request`) arrives as many rows at
once. Joined oldest-row-first, they all went ahead of any request that came a moment later: one 64-prompt request
made a one-prompt request wait 11.5 s on a CPU (0.02 s alone; issue #66). `RoundRobinQueue` keeps one queue per
request and admits their heads in turns (round robin over requests, in the order they first arrived), so a request
waits for at most one row of each request ahead of it, the scheduling of vLLM's and SGLang's fair-share policies
reduced to its simplest form. Rows of one request keep their order.

Turns alone still let the first many-prompt request fill every row of the batch, and a later request then waits for
one of them to finish (a whole generation). So a request's rows may hold at most `request_share(capacity)` of the
batch's rows at once (`capacity - max(1, capacity // 8)`: 14 of 16, 56 of 64; the engine's `max_request_rows`, `hf-dllm
serve --max-rows-per-request`, sets another share): the rest stays free for the rows of
other requests, which join at the next block boundary. This costs a lone many-prompt request an eighth of the batch
(its remaining rows join as its first ones finish); rows without a request (`group` None) are not capped.

A request whose first rows join at a boundary is *opening* there (`RoundRobinQueue.opening`): the scheduler may
decode their first block in a layout of their own (`scheduler.LayoutScheduler.layouts`, `join_layout_min_rows`),
so that a one-prompt request next to a many-prompt one streams after one block at its own batch size, not at the
whole batch's; the many-prompt request's later rows do not open it again.

`Admission` is the engine's side of it (`engine.ContinuousBatcher.admission`): the lock, the queue, the cancelled
rows' leaving, and `admit`, which offers the queue's head to the engine while a row is free. The queue is asked what
a deque of rows gives (`append`, `popleft`, `[0]`, `bool`, `len`, iteration, `clear`), `discard_if` for cancelled
rows, and `new_turn`, `opening` and `unopened` for opening requests; any object with those methods is an admission
policy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from .rows import EngineRequest


def request_key(row) -> object:
    """The request `row` belongs to: its `group`, or the row itself when it has none."""
    group = getattr(row, "group", None)
    return ("row", id(row)) if group is None else ("request", group)


def request_share(capacity: int) -> int:
    """Rows of the batch one request may hold at once when the batch has `capacity` rows (at least 1)."""
    return max(1, capacity - max(1, capacity // 8))


class RoundRobinQueue:
    """Waiting rows grouped by their request (`row.group`; None: a request of its own), served in turns: the head
    is the oldest row of the next request in the rotation that holds fewer running rows than its share (`share()`,
    or where that is None `request_share(capacity())`; no limit without either); taking it moves that request to
    the back of the rotation. `bool(queue)`: whether there is such a head (`len(queue)` counts every waiting row)."""

    def __init__(
        self, capacity: Callable[[], int] | None = None, share: Callable[[], int | None] | None = None
    ) -> None:
        self._requests: OrderedDict[object, deque] = OrderedDict()
        self._count = 0
        self._capacity, self._share = capacity, share
        self._admitted: dict[object, list] = {}  # request -> its rows taken from the queue (until they end)
        self._opened: dict[object, int] = {}  # request -> the turn its first row was taken in (until it is done)
        self._turn = 0

    _key = staticmethod(request_key)

    def new_turn(self) -> None:
        """A new admission turn (a block boundary) begins: requests with no row left waiting or running are
        forgotten, and rows taken from now on open their request only if none of its rows was taken before."""
        self._turn += 1
        for key in list(self._admitted):
            self._running(key)
        for key in [key for key in self._opened if key not in self._admitted and key not in self._requests]:
            del self._opened[key]

    def opening(self, row) -> bool:
        """Whether `row`'s request took its first row in this turn (`new_turn`): its first block is still to come."""
        return self._opened.get(self._key(row)) == self._turn

    def unopened(self) -> bool:
        """Whether a request waits none of whose rows was taken yet (a request still to start)."""
        return any(key not in self._opened for key in self._requests)

    def append(self, row) -> None:
        self._requests.setdefault(self._key(row), deque()).append(row)
        self._count += 1

    def _running(self, key) -> int:
        rows = self._admitted.get(key)
        if rows is None:
            return 0
        rows[:] = [row for row in rows if not getattr(row, "ended", False)]
        if not rows:
            del self._admitted[key]
        return len(rows)

    def _head(self):
        """`(request, its rows)` whose oldest row is the head, or None."""
        share = None if self._share is None else self._share()
        if share is None and self._capacity is not None:
            share = request_share(self._capacity())
        for key, rows in self._requests.items():
            if share is None or key[0] == "row" or self._running(key) < share:
                return key, rows
        return None

    def __getitem__(self, index: int):
        head = self._head() if index == 0 else None
        if head is None:
            raise IndexError("RoundRobinQueue gives only its head, [0], while there is one")
        return head[1][0]

    def popleft(self):
        head = self._head()
        if head is None:
            raise IndexError("pop from a RoundRobinQueue without a head")
        key, rows = head
        row = rows.popleft()
        self._count -= 1
        if rows:
            self._requests.move_to_end(key)  # its next row waits for one row of every other request
        else:
            del self._requests[key]
        self._admitted.setdefault(key, []).append(row)
        self._opened.setdefault(key, self._turn)
        return row

    def discard_if(self, drop: Callable[[object], bool]) -> None:
        """Remove every row for which `drop(row)` is True (it may act on the row: the engine's cancellations)."""
        for key in list(self._requests):
            kept = deque(row for row in self._requests[key] if not drop(row))
            self._count -= len(self._requests[key]) - len(kept)
            if kept:
                self._requests[key] = kept
            else:
                del self._requests[key]

    def clear(self) -> None:
        self._requests.clear()
        self._admitted.clear()
        self._opened.clear()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._head() is not None

    def __iter__(self) -> Iterator:
        """Every waiting row, request by request (not in admission order)."""
        for rows in list(self._requests.values()):
            yield from rows


def drop_cancelled(row: EngineRequest) -> bool:
    """Whether `row` leaves before decoding (cancelled, or ended); a cancelled row's `on_cancel` is told."""
    if row.cancelled.is_set() and not row.ended:
        row.ended = True
        if row.on_cancel is not None:
            row.on_cancel(row.nfe)
    return row.ended


class Admission:
    """The rows waiting to join a batch of `capacity()` rows, each request holding at most `share()` of them (None:
    `request_share`), `submit` from any thread, `admit` from the engine's.

    Attributes:
        lock (`threading.Lock`): guards `waiting` (the engine's tensor-parallel mirror guards its own state with it).
        waiting (`RoundRobinQueue`): the queued rows, in admission order.
    """

    def __init__(self, capacity: Callable[[], int], share: Callable[[], int | None] | None = None):
        self.lock = threading.Lock()
        self.waiting = RoundRobinQueue(capacity, share)

    def submit(self, row: EngineRequest) -> None:
        with self.lock:
            self.waiting.append(row)

    def pending(self) -> int:
        with self.lock:
            return len(self.waiting)

    def opening(self, row: EngineRequest) -> bool:
        """Whether `row` joined in its request's first turn (engine thread, after `admit`)."""
        with self.lock:
            return self.waiting.opening(row)

    def unopened(self) -> bool:
        """Whether a request waits none of whose rows has joined yet."""
        with self.lock:
            return self.waiting.unopened()

    def clear(self) -> None:
        with self.lock:
            self.waiting.clear()

    def admit(self, slots: list[int], join: Callable[[EngineRequest], bool]) -> None:
        """While `slots` (free row places, in order of use) has one, offer the queue's head to `join`, which either
        takes it into the batch (True: it gets the first free slot) or not (False: admission stops there and the
        head keeps its place: no starvation). Cancelled rows leave the queue first (`drop_cancelled`)."""
        with self.lock:
            self.waiting.new_turn()
            if any(row.cancelled.is_set() for row in self.waiting):
                self.waiting.discard_if(drop_cancelled)
            while slots and self.waiting and join(self.waiting[0]):
                self.waiting.popleft().slot = slots.pop(0)
