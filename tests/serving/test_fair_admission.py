"""A one-prompt request beside a many-prompt one (issue #66's fairness): it joins at the next block boundary and its
first block decodes in a layout of its own, so it finishes after exactly its forwards alone, each of one row, while
the many-prompt request's later rows share their layout (counted in forwards and rows, never in wall time)."""

from __future__ import annotations

import pytest
import torch

from hf_dllm.serving.admission import RoundRobinQueue
from hf_dllm.serving.engine import ContinuousBatcher
from hf_dllm.serving.rows import EngineRequest
from tests.conftest import tiny_model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_newcomer_decodes_apart_at_the_next_boundary_beside_a_many_prompt_request(device):
    """On CUDA too (CUDA graphs, bucketed rows, 64-column layouts): the same layouts and forwards; the tokens are
    compared with `generate()` on the CPU, where a lone row's layout is exactly `generate()`'s."""
    model = tiny_model(seed=0).to(device)
    engine = ContinuousBatcher(model, max_batch_size=16)  # the big request may hold 14 rows (`request_share`)
    prompt = torch.randint(4, 103, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    # 4 steps per block for every row (one cohort): the big rows 1 or 2 blocks, the victim 1 block.
    short, long = (model.resolve_generation_config(max_new_tokens=n, block_length=4, steps=n) for n in (4, 8))
    seen: list[tuple[str, int, list[int]]] = []  # (request, boundary, rows of each layout decoded so far)
    boundary = 0

    def on_block(name, tokens=None):
        def record(update):
            seen.append((name, boundary, list(engine.last_layout_sizes)))
            if tokens is not None:
                tokens.extend(update.new_tokens)

        return record

    for i in range(20):
        engine.submit(EngineRequest(prompt, long if i % 2 else short, on_block("big"), group="big"))
    engine.decode_boundary()  # 14 big rows; 7 of them end after this block, 7 go on to their second
    assert engine.last_layout_sizes == [14] and len(engine.running) == 7
    victim_tokens: list[int] = []
    victim = EngineRequest(prompt, short, on_block("victim", victim_tokens), group="victim")
    engine.submit(victim)
    forwards = engine.forwards
    boundary = 1
    engine.decode_boundary()
    victim_at = [(at, layouts) for name, at, layouts in seen if name == "victim"]
    # Next boundary, first layout, alone: the 6 big rows joining with it (block 0 of a request already decoding)
    # share the big request's layout instead of opening a layout of their own.
    assert victim_at == [(1, [1])] and victim.ended
    assert engine.last_layout_sizes == [1, 13]
    assert engine.forwards - forwards == 2 * 4  # the victim's 4 forwards, then the big rows' 4
    while engine.has_work():
        boundary += 1
        engine.decode_boundary()
    assert sum(name == "big" for name, _, _ in seen) == 20 + 10  # every big row's blocks, none lost
    out = model.generate(torch.tensor([prompt], device=device), generation_config=short, return_dict_in_generate=True)
    assert victim.nfe == int(out.nfe_per_row[0])
    if device == "cpu":
        assert victim_tokens == out.sequences[0, len(prompt) :].tolist()


def test_a_request_opens_once_and_is_forgotten_when_done():
    """`RoundRobinQueue`: a request's rows open it only in the turn its first row joined; a request with no row
    left waiting or running is forgotten at the next turn (no state grows with the requests served)."""
    queue = RoundRobinQueue(lambda: 16)
    rows = [EngineRequest([i], None, None, group="big") for i in range(3)]
    for row in rows[:2]:
        queue.append(row)
    queue.new_turn()
    first = queue.popleft()
    assert queue.opening(first) and not queue.unopened()
    queue.append(rows[2])
    late = EngineRequest([9], None, None, group="late")
    queue.append(late)
    assert queue.unopened()  # "late" waits, none of its rows taken
    queue.new_turn()
    taken = [queue.popleft(), queue.popleft(), queue.popleft()]
    assert taken == [rows[1], late, rows[2]]
    assert queue.opening(late) and not queue.opening(rows[1]) and not queue.unopened()
    for row in [first, *taken]:
        row.ended = True
    queue.new_turn()
    assert not queue._admitted and not queue._opened and not queue._requests and len(queue) == 0


def test_max_request_rows_caps_a_request_and_is_checked(model_dir, monkeypatch, capsys):
    """`max_request_rows` (`hf-dllm serve --max-rows-per-request`): one request holds at most that many rows; the
    default is `request_share`; anything but an integer >= 1 is refused before serving."""
    uvicorn = pytest.importorskip("uvicorn")

    from hf_dllm.serving import server as server_module

    model = tiny_model(seed=0)
    config = model.resolve_generation_config(max_new_tokens=4, block_length=4, steps=4)
    engine = ContinuousBatcher(model, max_batch_size=8, max_request_rows=3)
    for _ in range(5):
        engine.submit(EngineRequest([5, 6, 7], config, lambda update: None, group="big"))
    engine.decode_boundary()
    assert engine.last_layout_sizes == [3] and engine.pending() == 2
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_request_rows"):
            ContinuousBatcher(model, max_batch_size=8, max_request_rows=bad)
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    argv = [str(model_dir), "--threads", "1", "--device", "cpu"]
    assert server_module.main([*argv, "--max-rows-per-request", "5"]) == 0
    assert apps[0].state.server.batcher.engine.max_request_rows == 5
    assert ContinuousBatcher(model).max_request_rows is None  # the default: `request_share`
    assert server_module.main([*argv, "--max-rows-per-request", "0"]) == 2
    assert "--max-rows-per-request must be >= 1" in capsys.readouterr().err
