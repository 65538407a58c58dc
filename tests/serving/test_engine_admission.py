"""The engine's side of admission (`serving.admission.Admission`), without a model: rows of no request in arrival
order, the head that does not fit waits and nobody passes it, each admitted row gets the first free slot, cancelled
rows leave the queue (their owner told) before anything is offered. (The order across requests, `RoundRobinQueue`,
is `test_server_limits.py`'s.)"""

from __future__ import annotations

from hf_dllm.serving.admission import Admission
from hf_dllm.serving.rows import EngineRequest


def request(name: str, cancelled: list | None = None) -> EngineRequest:
    row = EngineRequest([1], None, lambda update: None)
    row.name = name
    if cancelled is not None:
        row.on_cancel = lambda nfe: cancelled.append(name)
    return row


def test_oldest_first_into_free_slots_and_the_head_is_never_passed():
    admission = Admission(lambda: 16)
    rows = [request(name) for name in "abcd"]
    for row in rows:
        admission.submit(row)
    offered, joined = [], []

    def join(row):
        offered.append(row.name)
        if row.name == "c":  # c does not fit: it waits, and d behind it is not offered
            return False
        joined.append(row)
        return True

    slots = [3, 5, 7]
    admission.admit(slots, join)
    assert offered == ["a", "b", "c"] and [row.slot for row in joined] == [3, 5] and slots == [7]
    assert [row.name for row in admission.waiting] == ["c", "d"] and admission.pending() == 2
    admission.admit([], join)  # no free slot: nothing is offered
    assert offered == ["a", "b", "c"]


def test_cancelled_requests_leave_before_anything_is_offered():
    told: list[str] = []
    admission = Admission(lambda: 16)
    rows = [request(name, told) for name in "abc"]
    for row in rows:
        admission.submit(row)
    rows[0].cancelled.set()
    offered = []
    admission.admit([0], lambda row: offered.append(row.name) or True)
    assert told == ["a"] and rows[0].ended and offered == ["b"] and rows[1].slot == 0
    assert [row.name for row in admission.waiting] == ["c"]
    admission.clear()
    assert admission.pending() == 0
