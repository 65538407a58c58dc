"""The order in which waiting rows join the continuous batch: in turns across requests.

A request with many prompts (`/v1/completions` takes up to `--max-prompts-per-request`) arrives as many rows at
once. Joined oldest-row-first, they all went ahead of any request that came a moment later: one 64-prompt request
made a one-prompt request wait 11.5 s on a CPU (0.02 s alone; issue #66). `RoundRobinQueue` keeps one queue per
request and admits their heads in turns (round robin over requests, in the order they first arrived), so a request
waits for at most one row of each request ahead of it, the scheduling of vLLM's and SGLang's fair-share policies
reduced to its simplest form. Rows of one request keep their order.

The engine asks only what a deque of rows gives (`append`, `popleft`, `[0]`, `len`, iteration, `clear`) and
`discard_if` for cancelled rows; any object with those methods is an admission policy.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator


class RoundRobinQueue:
    """Waiting rows grouped by their request (`row.group`; None: a request of its own), served in turns: the head
    is the oldest row of the request whose turn it is; taking it moves that request to the back of the rotation."""

    def __init__(self) -> None:
        self._requests: OrderedDict[object, deque] = OrderedDict()
        self._count = 0

    @staticmethod
    def _key(row) -> object:
        group = getattr(row, "group", None)
        return ("row", id(row)) if group is None else ("request", group)

    def append(self, row) -> None:
        self._requests.setdefault(self._key(row), deque()).append(row)
        self._count += 1

    def __getitem__(self, index: int):
        if index != 0 or not self._count:
            raise IndexError("RoundRobinQueue gives only its head, [0]")
        return next(iter(self._requests.values()))[0]

    def popleft(self):
        if not self._count:
            raise IndexError("pop from an empty RoundRobinQueue")
        key, rows = next(iter(self._requests.items()))
        row = rows.popleft()
        self._count -= 1
        if rows:
            self._requests.move_to_end(key)  # its next row waits for one row of every other request
        else:
            del self._requests[key]
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
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator:
        """Every waiting row, request by request (not in admission order)."""
        for rows in list(self._requests.values()):
            yield from rows
