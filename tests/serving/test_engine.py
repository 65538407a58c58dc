"""The continuous-batching engine (`hf_dllm/serving/engine.py`, issue #14), on CPU in float32.

Every test drives `ContinuousBatcher` boundary by boundary: requests arrive at chosen boundaries (random
interleavings from fixed seeds), join the running batch, and each one's tokens and forwards must be those of
`generate()` for its prompt alone. Also: admission order and capacity, leaving at EOS / by the consumer, cancellation
while waiting and while running, slot reuse, mixed settings, the width limit, a failing layout, bad arguments.
"""

from __future__ import annotations

import json
import math
import random
import threading
from pathlib import Path

import pytest
import torch

from hf_dllm import DreamModel, LLaDA2MoeModelLM, LLaDAModelLM
from hf_dllm.serving.engine import (
    JOIN_LAYOUT_MIN_ROWS,
    ContinuousBatcher,
    attention_without_shape_plans,
)
from hf_dllm.serving.layout import LayoutRun
from hf_dllm.serving.rows import BlockUpdate, EngineRequest
from hf_dllm.step_machine import StepMachine
from tests.conftest import FIXTURES, tiny_model

TRAINED_DIR = FIXTURES / "llada-tiny-trained"


@pytest.fixture(scope="module")
def trained():
    return LLaDAModelLM.from_pretrained(TRAINED_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def random_llada():
    return tiny_model(seed=0)


class Recorder:
    """A request's consumer: collects its block updates."""

    def __init__(self, stop_after: int | None = None):
        self.updates: list[BlockUpdate] = []
        self.stop_after = stop_after

    def __call__(self, update: BlockUpdate) -> bool:
        self.updates.append(update)
        return self.stop_after is not None and len(self.updates) >= self.stop_after

    @property
    def tokens(self) -> list[int]:
        return [token for update in self.updates for token in update.new_tokens]


def request(model, prompt, recorder=None, **settings) -> EngineRequest:
    return EngineRequest(list(prompt), model.resolve_generation_config(**settings), recorder or Recorder())


def drive(engine: ContinuousBatcher, requests: list[EngineRequest], arrivals: list[int]) -> int:
    """Submit each request at its arrival boundary and decode until all are done; returns the boundaries made."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    boundary = 0
    while order or engine.has_work():
        while order and arrivals[order[0]] <= boundary:
            engine.submit(requests[order.pop(0)])
        engine.decode_boundary()
        boundary += 1
    return boundary


def assert_alone(model, requests: list[EngineRequest], alone: dict | None = None) -> None:
    """Each request's committed tokens and forwards equal `generate()` for its prompt alone. `alone`: `generate()`'s
    outputs of earlier calls with this `model`, by prompt and settings (filled here), for tests that check the same
    requests twice."""
    alone = {} if alone is None else alone
    for i, req in enumerate(requests):
        config = req.config
        key = (tuple(req.prompt_ids), config.to_json_string())
        if key not in alone:
            ids = torch.tensor([req.prompt_ids])
            alone[key] = model.generate(ids, generation_config=config, return_dict_in_generate=True)
        out = alone[key]
        recorder = req.on_block
        want = out.sequences[0, len(req.prompt_ids) :].tolist()
        assert recorder.updates[-1].ended, f"request {i} never ended"
        assert recorder.tokens == want[: len(recorder.tokens)], f"request {i}: tokens differ from generate() alone"
        assert recorder.updates[-1].nfe == int(out.nfe_per_row[0]), f"request {i}: NFE differs"
        assert req.generated.tolist() == want, f"request {i}: final canvas differs"


def random_prompts(rng: random.Random, count: int, low: int, high: int, longest: int = 20) -> list[list[int]]:
    return [[rng.randrange(low, high) for _ in range(rng.randrange(1, longest))] for _ in range(count)]


LLADA_SETTINGS = [
    dict(max_new_tokens=32, block_length=8, steps=32),
    dict(max_new_tokens=32, block_length=8, steps=16, use_cache=True, dual_cache=True),
    dict(max_new_tokens=32, block_length=8, threshold=0.9, use_cache=True, dual_cache=True),
    dict(max_new_tokens=32, block_length=8, threshold=0.7, use_cache=True, dual_cache=False),
    dict(max_new_tokens=24, block_length=8, factor=1.0),
    dict(max_new_tokens=32, block_length=8, threshold=0.9, eos_early_stop=True, eos_token_id=[0, 2]),
]


@pytest.mark.parametrize("setting", range(len(LLADA_SETTINGS)))
@pytest.mark.parametrize("seed", [0, 1])
def test_llada_rows_equal_generate_alone_under_random_arrivals(trained, setting, seed):
    rng = random.Random(seed * 100 + setting)
    prompts = random_prompts(rng, 8, 4, 60)
    requests = [request(trained, prompt, **LLADA_SETTINGS[setting]) for prompt in prompts]
    engine = ContinuousBatcher(trained, max_batch_size=4, max_batch_width=256)
    drive(engine, requests, [rng.randrange(0, 8) for _ in prompts])
    assert_alone(trained, requests)
    assert max(engine.last_layout_sizes, default=0) <= 4


@pytest.mark.parametrize("use_cache", [True, False], ids=["dual-cache", "no-cache"])
def test_full_forwards_run_packed_without_padding(trained, use_cache):
    """A block's forward over whole canvases (the dual cache's refresh; every step without a cache) runs on the
    rows packed end to end: it computes exactly the rows' canvases, however their lengths and blocks differ (the
    aligned layout would compute both rows at the longer one's columns and its misalignment), and stays exact."""
    settings = dict(max_new_tokens=32, block_length=8, threshold=0.9, eos_early_stop=False, use_cache=use_cache)
    short = request(trained, [5, 6, 7, 8, 9], **settings)
    long = request(trained, list(range(4, 44)), **dict(settings, max_new_tokens=24))
    engine = ContinuousBatcher(trained, max_batch_size=2, max_batch_width=256)
    engine.submit(short)
    engine.decode_boundary()
    engine.decode_boundary()
    engine.submit(long)
    before = engine.first_step_positions
    engine.decode_boundary()
    assert engine.last_layout_sizes == [2]
    assert short.plan.canvas_width + long.plan.canvas_width == 37 + 64
    assert engine.first_step_positions - before == 37 + 64
    # The aligned layout of the block's other steps: `short`'s block (at 21) moved to `long`'s (at 40), 2 x 64.
    assert engine.runner.runs[short.settings].canvas.x.shape == (2, 64)
    engine.run_until_done()
    assert_alone(trained, [short, long])


def test_rows_of_different_lengths_and_rules_mix(trained):
    """Different `max_new_tokens` share a layout; different block lengths, steps or rules decode in their own
    layouts at the same boundary; all exact."""
    rng = random.Random(7)
    prompts = random_prompts(rng, 10, 4, 60)
    kinds = [
        dict(max_new_tokens=8, block_length=8, threshold=0.9, use_cache=True),
        dict(max_new_tokens=40, block_length=8, threshold=0.9, use_cache=True),
        dict(max_new_tokens=24, block_length=8, threshold=0.9, use_cache=True),
        dict(max_new_tokens=16, block_length=4, steps=8),
        dict(max_new_tokens=20, block_length=8, steps=10),  # a short last block of 4
    ]
    requests = [request(trained, prompt, **kinds[i % len(kinds)]) for i, prompt in enumerate(prompts)]
    engine = ContinuousBatcher(trained, max_batch_size=10, max_batch_width=256)
    drive(engine, requests, [rng.randrange(0, 4) for _ in prompts])
    assert_alone(trained, requests)


def test_rows_with_equal_steps_per_block_share_a_layout(trained):
    """`steps` is a total: 8 steps over 16 tokens and 16 over 32 are both 4 steps per block of 8, one layout."""
    short = request(trained, [5, 6], max_new_tokens=16, block_length=8, steps=8, eos_early_stop=False)
    long = request(trained, [7, 8, 9], max_new_tokens=32, block_length=8, steps=16, eos_early_stop=False)
    engine = ContinuousBatcher(trained, max_batch_size=4)
    engine.submit(short)
    engine.submit(long)
    engine.decode_boundary()
    assert engine.last_layout_sizes == [2] and engine.forwards == 4
    engine.run_until_done()
    assert_alone(trained, [short, long])


def test_random_model_rows_equal_generate_alone(random_llada):
    """A random model (many near-ties between tokens) under random arrivals, fixed steps and threshold."""
    rng = random.Random(3)
    for settings in (dict(max_new_tokens=32, block_length=8, steps=32), dict(max_new_tokens=24, block_length=8)):
        prompts = random_prompts(rng, 6, 4, 100)
        requests = [request(random_llada, prompt, **settings) for prompt in prompts]
        drive(ContinuousBatcher(random_llada, max_batch_size=3), requests, [rng.randrange(0, 5) for _ in prompts])
        assert_alone(random_llada, requests)


def test_a_lone_row_is_generate_exactly(random_llada):
    """One row alone has no padding off CUDA (width granularity 1): its arithmetic is generate()'s."""
    req = request(random_llada, [5, 17, 33, 8], max_new_tokens=48, block_length=16, eos_token_id=[0, 2])
    engine = ContinuousBatcher(random_llada, max_batch_size=2)
    assert engine.scheduler.width_granularity == 1
    drive(engine, [req], [0])
    assert_alone(random_llada, [req])


def llada2_settings(case: dict, prompt_length: int) -> dict:
    from tests.models.llada2.test_llada2_generation import generate_kwargs

    settings = generate_kwargs(case, prompt_length)
    settings.pop("return_dict_in_generate")
    return settings


@pytest.mark.parametrize("name", ["llada2-tiny-ref", "llada21-tiny-ref"])
def test_block_causal_rows_equal_generate_alone(name):
    """LLaDA2.0 / 2.1 (block-causal, editing): rows shifted by whole blocks, the prefix refreshed at each block's
    first step; every distinct recorded setting, random prompts and arrivals."""
    model = LLaDA2MoeModelLM.from_pretrained(FIXTURES / name).eval()
    cases = json.loads((FIXTURES / name / "cases.json").read_text())["cases"]
    rng = random.Random(11)
    seen = set()
    for case in cases:
        key = json.dumps({k: v for k, v in case["kwargs"].items() if k != "steps"}, sort_keys=True)
        if key in seen or len(seen) >= 6:
            continue
        seen.add(key)
        prompts = random_prompts(rng, 5, 4, 290)
        requests = [request(model, prompt, **llada2_settings(case, len(prompt))) for prompt in prompts]
        drive(ContinuousBatcher(model, max_batch_size=3), requests, [rng.randrange(0, 4) for _ in prompts])
        assert_alone(model, requests)


@pytest.fixture(scope="module")
def random_llada2():
    """A tiny random LLaDA2 (block-causal): varied tokens over every block (the reference fixtures mostly end at
    an early EOS), so continuing rows and their kept K/V are exercised."""
    from tests.models.llada2.test_llada2_integration import tiny_llada2

    return tiny_llada2(seed=4)


LLADA2_KINDS = [
    dict(max_new_tokens=40, block_length=8, threshold=0.5),
    dict(max_new_tokens=24, block_length=8, threshold=0.5),  # shares layouts with the first
    dict(max_new_tokens=32, block_length=16, threshold=0.6),
    dict(max_new_tokens=40, block_length=8, threshold=0.5, editing_threshold=0.5, max_post_steps=2),
    dict(max_new_tokens=32, block_length=8, steps=16),
]


@pytest.mark.parametrize("seed", [0, 1])
def test_block_causal_random_model_mixed_settings_equal_generate_alone(random_llada2, seed):
    """Rows of several settings groups (other block lengths, LLaDA2.1 editing) run at once: their layouts use the
    one cache in turn at every boundary, and each row's K/V survive that in its slot; rows join at other blocks
    with prompts longer and shorter than the running rows' (which then move to other columns), and wait for a
    slot; each row is exactly `generate()` alone."""
    rng = random.Random(20 + seed)
    prompts = random_prompts(rng, 10, 4, 100, longest=90)
    kinds = [dict(LLADA2_KINDS[i % len(LLADA2_KINDS)], eos_early_stop=False) for i in range(len(prompts))]
    requests = [request(random_llada2, prompt, **kind) for prompt, kind in zip(prompts, kinds, strict=True)]
    engine = ContinuousBatcher(random_llada2, max_batch_size=4)
    boundaries = drive(engine, requests, [rng.randrange(0, 10) for _ in prompts])
    assert engine.layouts > boundaries  # some boundaries decoded several layouts
    assert_alone(random_llada2, requests)


def test_block_causal_rows_under_a_kv_budget_equal_generate_alone(random_llada2, monkeypatch):
    """A K/V budget for a block-causal model: its layouts (the visible columns, in power-of-two widths) stay within
    it, rows laid end to end in the cache are saved to and loaded from their slots at their own columns, and
    each row is exactly `generate()` alone."""
    rng = random.Random(31)
    prompts = random_prompts(rng, 10, 4, 100, longest=60)
    kinds = [dict(LLADA2_KINDS[i % len(LLADA2_KINDS)], eos_early_stop=False) for i in range(len(prompts))]
    layouts = budget_layouts(monkeypatch)
    requests = [request(random_llada2, prompt, **kind) for prompt, kind in zip(prompts, kinds, strict=True)]
    engine = ContinuousBatcher(
        random_llada2,
        max_batch_size=8,
        max_batch_width=128,
        max_batch_positions=256,
        width_granularity=8,
        bucket_rows=True,
    )
    drive(engine, requests, [rng.randrange(0, 6) for _ in prompts])
    assert_alone(random_llada2, requests)
    assert all(padded * width <= 256 for _, padded, width in layouts), layouts
    assert max(rows for rows, _, _ in layouts) > 2


@pytest.mark.parametrize("seed", [0, 1])
def test_block_causal_layouts_hold_the_visible_columns_in_power_of_two_widths(random_llada2, seed, monkeypatch):
    """With `width_granularity > 1` (CUDA's default: graphs), a block-causal layout holds only the columns up to
    its block's end (its steps see no later column), rounded up to a power-of-two multiple of the granularity and
    capped at `max_batch_width`, so few step shapes arise; rows that end early (an EOS) before their canvas fits the
    layout keep the rest of their canvas filled as `generate()` fills it; each row is `generate()` alone."""
    widths = []
    decode_block = LayoutRun.decode_block

    def recorded(self, rows, width):
        starts = [row.plan.blocks[row.block][0] for row in rows]
        visible = max(starts) + max(end - start for start, end in (row.plan.blocks[row.block] for row in rows))
        canvas = max(starts) + max(row.plan.canvas_width - start for row, start in zip(rows, starts, strict=True))
        widths.append((width, visible, canvas))
        return decode_block(self, rows, width)

    monkeypatch.setattr(LayoutRun, "decode_block", recorded)
    rng = random.Random(40 + seed)
    prompts = random_prompts(rng, 8, 4, 100, longest=60)
    # Frequent tokens as EOS, so rows end early at blocks whose layout is narrower than their canvas.
    kinds = [dict(LLADA2_KINDS[i % 3], eos_early_stop=True, eos_token_id=[14, 37, 83]) for i in range(len(prompts))]
    requests = [request(random_llada2, prompt, **kind) for prompt, kind in zip(prompts, kinds, strict=True)]
    engine = ContinuousBatcher(random_llada2, max_batch_size=4, max_batch_width=120, width_granularity=8)
    drive(engine, requests, [rng.randrange(0, 6) for _ in prompts])
    for width, visible, _ in widths:
        assert width == min(8 * 2 ** math.ceil(math.log2(visible / 8)), 120), (width, visible)
    assert any(width < canvas for width, _, canvas in widths)  # the canvases' rest is left out
    ended_early = [req for req in requests if req.block < len(req.plan.blocks)]
    assert ended_early, "no row ended at an EOS before its last block"
    assert_alone(random_llada2, requests)


def recorded_forward_rows(monkeypatch) -> list[int]:
    """The rows of every forward a layout runs through its step function (what a CUDA graph's shape holds)."""
    rows = []
    step = StepMachine.step

    def recorded(self, tokens, *args, **kwargs):
        rows.append(tokens.shape[0])
        return step(self, tokens, *args, **kwargs)

    monkeypatch.setattr(StepMachine, "step", recorded)
    return rows


@pytest.mark.parametrize(
    "family, settings",
    [
        ("llada", dict(LLADA_SETTINGS[1], eos_early_stop=False)),  # dual cache, every step known in advance
        ("llada", dict(LLADA_SETTINGS[3], eos_early_stop=False)),  # threshold: steps until no row has a mask
        ("llada", dict(LLADA_SETTINGS[0], eos_early_stop=False)),  # no cache: every step packed (eager)
        ("llada2", None),  # every LLaDA2 kind (editing, in-block EOS stop) with EOS tokens frequent
    ],
    ids=["llada-dual", "llada-threshold-eos", "llada-no-cache", "llada2-kinds"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_bucketed_rows_pad_every_stepped_forward_and_change_no_row(
    trained, random_llada2, family, settings, seed, monkeypatch
):
    """`bucket_rows=True` (CUDA's default, for few graph shapes): every forward a layout steps runs with 1, 2, 4,
    8 or a multiple of 4 rows (at most `max_batch_size`), the layout padded with rows that commit nothing; each row
    is still `generate()` alone, with its forwards, and no padding row delays a layout (the same forwards as
    without padding)."""
    from hf_dllm.serving.engine import bucketed_rows

    model = trained if family == "llada" else random_llada2
    rng = random.Random(50 + seed)
    prompts = random_prompts(rng, 14, 4, 100, longest=40)
    if family == "llada":
        kinds = [settings] * len(prompts)
    else:
        eos = dict(eos_early_stop=True, eos_token_id=[14, 37, 83])
        kinds = [dict(LLADA2_KINDS[i % len(LLADA2_KINDS)], **eos) for i in range(len(prompts))]
    arrivals = sorted(rng.randrange(0, 8) for _ in prompts)
    forwards, alone = {}, {}
    for bucket in (False, True):
        rows = recorded_forward_rows(monkeypatch)
        requests = [request(model, prompt, **kind) for prompt, kind in zip(prompts, kinds, strict=True)]
        engine = ContinuousBatcher(model, max_batch_size=12, bucket_rows=bucket, width_granularity=8)
        drive(engine, requests, arrivals)
        forwards[bucket] = engine.forwards
        assert_alone(model, requests, alone)  # the same requests both times: generate() alone once each
        if bucket:
            assert rows and all(count in (1, 2, 4, 8, 12) for count in rows), sorted(set(rows))
            assert any(bucketed_rows(count, 12) != count for count in range(1, 13))
        else:
            unpadded = sorted(set(rows))
    assert any(count not in (1, 2, 4, 8, 12) for count in unpadded), "no layout needed padding"
    assert forwards[True] == forwards[False]


def test_bucketed_rows():
    from hf_dllm.serving.engine import bucketed_rows

    assert [bucketed_rows(k, 32) for k in range(14)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 16]
    assert [bucketed_rows(k, 32) for k in (16, 17, 24, 25, 32)] == [16, 20, 24, 28, 32]
    assert [bucketed_rows(k, 18) for k in (13, 17, 18)] == [16, 18, 18]
    assert [bucketed_rows(k, 128) for k in (33, 40, 41, 64, 65, 81, 128)] == [40, 40, 48, 64, 80, 96, 128]
    assert len({bucketed_rows(k, 128) for k in range(1, 129)}) == 4 + 6 + 4 + 4  # 36 with steps of 4 throughout
    assert all(k <= bucketed_rows(k, 256) <= k * 4 // 3 + 2 for k in range(9, 257))
    assert bucketed_rows(3, 3) == 3


@pytest.mark.parametrize("family", ["llada", "llada2", "dream"])
def test_kv_bytes_per_position_is_what_the_cache_holds(trained, random_llada2, family):
    """`kv_bytes_per_position` (the memory-derived batch size's unit) equals the bytes of every layer's K/V buffers
    of a cache a forward filled, per row and column."""
    from hf_dllm.serving.engine import kv_bytes_per_position

    if family == "dream":
        model = DreamModel.from_pretrained(FIXTURES / "dream-tiny-ref").eval()
    else:
        model = trained if family == "llada" else random_llada2
    engine = ContinuousBatcher(model, max_batch_size=3)
    settings = dict(use_cache=True) if family == "dream" else {}
    rows = [request(model, [5, 6, 7, 8], max_new_tokens=8, block_length=4, steps=4, **settings) for _ in range(2)]
    for row in rows:
        engine.submit(row)
    engine.run_until_done()
    cache = engine.runner.cache
    held = sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values] if t is not None)
    assert held == cache.max_batch_size * cache.max_length * kv_bytes_per_position(model)


def test_default_max_batch_size_from_free_memory(trained, random_llada2, monkeypatch):
    """No `max_batch_size`: 16 off CUDA; on CUDA the rows whose K/V of `max_batch_width` columns (block-causal:
    twice, the row store) fit in `AUTO_BATCH_MEMORY_SHARE` of the free memory, between 1 and `MAX_AUTO_BATCH_SIZE`."""
    from hf_dllm.serving import engine as engine_module

    assert ContinuousBatcher(trained).max_batch_size == engine_module.DEFAULT_MAX_BATCH_SIZE == 16
    cuda = torch.device("cuda")
    for model, copies in ((trained, 1), (random_llada2, 2)):
        row = copies * engine_module.kv_bytes_per_position(model) * 100
        for free, rows in ((row * 10, 6), (row * 1000, 128), (row // 2, 1)):
            monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 2 * free))
            assert engine_module.default_max_batch_size(model, 100, cuda) == rows
    # The mirrored engines of tensor parallelism agree on one size; it changes only while no row runs.
    engine = ContinuousBatcher(random_llada2)
    engine.set_max_batch_size(5)
    assert engine.max_batch_size == engine.runner.store.slots == 5
    engine.submit(request(random_llada2, [5, 6, 7], max_new_tokens=8, block_length=4, steps=4))
    engine.decode_boundary()
    with pytest.raises(RuntimeError, match="batch size"):
        engine.set_max_batch_size(4)


def test_cache_budget_lays_narrow_rows_end_to_end():
    """A `DiffusionKVCache` with `max_positions` holds rows of the current length end to end: as many rows as
    the positions allow (at most `max_batch_size`), each row's K/V apart from the others', the views contiguous and
    at the buffers' start; more rows than fit, or a budget below one full row, are refused."""
    from hf_dllm.cache import DiffusionKVCache, FP8DiffusionKVCache

    with pytest.raises(ValueError, match="max_positions"):
        DiffusionKVCache(1, 8, 64, max_positions=63)
    like = torch.zeros(1, 2, 1, 4)
    for cache_class in (DiffusionKVCache, FP8DiffusionKVCache):
        cache = cache_class(2, 8, 64, max_positions=200)  # 4 rows of 64 columns allocated (256 positions)
        allocate = cache.quantized_layer if cache_class is FP8DiffusionKVCache else cache.layer
        allocate(0, 1, 2, 4, like)
        assert cache.keys[0].shape[:3] == (4, 2, 64) and cache.rows_at_length() == 4
        buffers = [buffer[0] for buffer in cache._buffer_lists()]
        for length, rows in ((64, 4), (32, 8), (20, 8), (50, 5)):
            cache.set_length(length)
            assert cache.rows_at_length() == rows
            views = cache.layer_rows(0)
            for view, buffer in zip(views, buffers, strict=True):
                assert view.shape[:3] == (rows, 2, length) and view.is_contiguous()
                assert view.data_ptr() == buffer.data_ptr()
            with pytest.raises(ValueError, match=f"holds {rows} rows of {length} columns"):
                allocate(0, rows + 1, 2, 4, like)
            if cache_class is DiffusionKVCache:
                views[0].copy_(torch.arange(rows).view(rows, 1, 1, 1).expand_as(views[0]))
                assert [int(views[0][i].min()) for i in range(rows)] == list(range(rows))  # no two rows overlap


def budget_layouts(monkeypatch) -> list[tuple[int, int, int]]:
    """Every layout the engine decodes: (rows, rows with padding, width)."""
    layouts = []
    with_padding = LayoutRun._with_padding_rows

    def recorded(self, rows, joining, width):
        layout = with_padding(self, rows, joining, width)
        layouts.append((len(rows), len(layout), width))
        return layout

    monkeypatch.setattr(LayoutRun, "_with_padding_rows", recorded)
    return layouts


@pytest.fixture(scope="module")
def kv_budget_alone() -> dict:
    """`generate()` alone of the KV-budget test's requests, by seed: its two layouts (unpadded, bucketed) decode the
    same requests, so each is generated alone once."""
    return {}


@pytest.mark.parametrize("bucket", [False, True], ids=["unpadded", "bucketed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_kv_budget_runs_more_narrow_rows_and_never_exceeds_it(trained, bucket, seed, monkeypatch, kv_budget_alone):
    """`max_batch_positions`: a layout's rows x width (padding rows included) never exceed the budget, so more
    rows of short canvases run at once than the budget holds rows of `max_batch_width` columns; every row is still
    `generate()` alone, tokens and forwards. (A layout over the budget would fail: the cache refuses the rows.)"""
    rng = random.Random(70 + seed)
    settings = dict(max_new_tokens=24, block_length=8, steps=24, use_cache=True, dual_cache=True, eos_early_stop=False)
    # Mostly short prompts (canvases of ~26-48 columns) and a few long ones (up to 118).
    prompts = [
        [rng.randrange(4, 60) for _ in range(rng.choice([rng.randrange(2, 24)] * 3 + [rng.randrange(60, 95)]))]
        for _ in range(14)
    ]
    layouts = budget_layouts(monkeypatch)
    requests = [request(trained, prompt, **settings) for prompt in prompts]
    engine = ContinuousBatcher(
        trained,
        max_batch_size=12,
        max_batch_width=128,
        max_batch_positions=256,
        width_granularity=8,
        bucket_rows=bucket,
        join_layout_min_rows=None,
    )
    drive(engine, requests, sorted(rng.randrange(0, 4) for _ in prompts))
    assert_alone(trained, requests, kv_budget_alone.setdefault(seed, {}))
    assert layouts and all(padded * width <= 256 for _, padded, width in layouts), layouts
    assert max(rows for rows, _, _ in layouts) > 256 // 128  # narrow rows share what two full rows would take
    if bucket:  # padded to the row bucket, or to as many rows as the budget holds at the layout's width
        from hf_dllm.serving.engine import bucketed_rows

        fits = [min(12, 256 // width) for _, _, width in layouts]
        buckets = [bucketed_rows(rows, 12) for rows, _, _ in layouts]
        assert all(p in (b, f) for (_, p, _), b, f in zip(layouts, buckets, fits, strict=True)), layouts


def test_kv_budget_caps_padding_rows(trained, monkeypatch):
    """With bucketed rows, a layout is padded to its row bucket when the budget holds it at the layout's width,
    else to as many rows as it holds; the rows stay `generate()` alone."""
    settings = dict(max_new_tokens=16, block_length=8, steps=16, eos_early_stop=False)
    layouts = budget_layouts(monkeypatch)
    for count, prompt_length, padded in ((3, 20, 4), (5, 28, 5)):  # widths 36 -> 40 and 44 -> 48 columns
        engine = ContinuousBatcher(
            trained,
            max_batch_size=12,
            max_batch_width=64,
            max_batch_positions=256,
            width_granularity=8,
            bucket_rows=True,
        )
        requests = [request(trained, list(range(4, 4 + prompt_length)), **settings) for _ in range(count)]
        drive(engine, requests, [0] * count)
        assert_alone(trained, requests)
        assert {layout[:2] for layout in layouts} == {(count, padded)}, layouts  # bucket 4 x 40; 8 x 48 > 256
        layouts.clear()


def test_kv_budget_holds_back_what_does_not_fit(trained):
    """The oldest waiting request that would take its cohort's layout over the budget waits (no one passes it)
    until rows leave; classifier-free guidance counts twice the rows; a request that could not fit alone is
    refused at submit."""
    settings = dict(max_new_tokens=16, block_length=8, steps=16, eos_early_stop=False)
    engine = ContinuousBatcher(trained, max_batch_size=8, max_batch_width=64, max_batch_positions=96)
    first = request(trained, list(range(4, 34)), **settings)  # 30 + 16 columns
    second = request(trained, [5, 6], **settings)  # aligned at the first row's block start: 2 x 48 = 96 fit
    third = request(trained, [7, 8, 9], **settings)  # 3 rows would take 3 x 48 > 96
    for row in (first, second, third):
        engine.submit(row)
    engine.decode_boundary()
    assert engine.last_layout_sizes == [2] and engine.pending() == 1
    engine.run_until_done()
    assert_alone(trained, [first, second, third])
    guided = dict(settings, cfg_scale=1.0)
    with pytest.raises(ValueError, match="max_batch_positions"):  # 2 x (40 + 16) > 96
        engine.submit(request(trained, list(range(4, 44)), **guided))
    engine.submit(request(trained, [5, 6], **guided))  # 2 x 24 columns: fits
    engine.run_until_done()


def test_default_kv_budget_from_free_memory(trained, random_llada2, monkeypatch):
    """No `max_batch_size` nor `max_batch_positions`: on CUDA a bidirectional model gets a budget of the positions
    whose K/V fit in `AUTO_BATCH_MEMORY_SHARE` of the free memory (at least `max_batch_width`), with
    `MAX_AUTO_BATCH_SIZE` rows; a block-causal model (rows keep K/V slots of `max_batch_width` columns) and any model
    off CUDA get none (rows x width, as before). The budget changes only while no row runs."""
    from hf_dllm.serving import engine as engine_module

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    per_position = engine_module.kv_bytes_per_position(trained)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (per_position * 1000, per_position * 2000))
    assert engine_module.default_max_batch_positions(trained, cuda) == 600
    assert engine_module.default_max_batch_positions(random_llada2, cuda) is None
    assert engine_module.default_max_batch_positions(trained, cpu) is None
    engine = ContinuousBatcher(trained, max_batch_width=64)
    assert engine.max_batch_positions is None and engine.max_batch_size == engine_module.DEFAULT_MAX_BATCH_SIZE
    engine.set_max_batch_positions(300)
    assert engine.max_batch_positions == 300
    with pytest.raises(ValueError, match="max_batch_positions"):
        engine.set_max_batch_positions(63)
    engine.submit(request(trained, [5, 6, 7], max_new_tokens=16, block_length=8, steps=16, eos_early_stop=False))
    engine.decode_boundary()
    with pytest.raises(RuntimeError, match="budget"):
        engine.set_max_batch_positions(200)


def exact_kv(model, tokens: torch.Tensor, length: int, block_length: int):
    """The K/V of a row's first `length` columns (whole blocks of committed tokens), from one plain forward."""
    cache = model._diffusion_new_cache(1, length)
    model(tokens[None, :length], past_key_values=cache, use_cache=True, block_length=block_length)
    return cache


def test_block_causal_rows_keep_exact_kv_and_recompute_only_the_previous_block(random_llada2):
    """A row prefills once (its prompt and first block, at its own columns); at later blocks it recomputes only its
    previous block and the block, also when a row with a longer prompt joins and moves it to other columns. Its
    slot holds its committed columns' exact K/V."""
    settings = dict(max_new_tokens=48, block_length=8, threshold=0.5, eos_early_stop=False)
    first = request(random_llada2, [5, 6, 7, 8, 9], **settings)
    late = request(random_llada2, list(range(4, 64)), **settings)
    engine = ContinuousBatcher(random_llada2, max_batch_size=4)

    def positions_of_boundary():
        before = engine.first_step_positions
        engine.decode_boundary()
        return engine.first_step_positions - before

    engine.submit(first)
    assert positions_of_boundary() == 8  # prompt of 5 and the first block: columns [0, 8)
    assert positions_of_boundary() == 16  # previous block and block, [0, 16)
    assert positions_of_boundary() == 16  # [8, 24), not the prefix [0, 24)
    engine.submit(late)  # 60 tokens: its first block is [56, 64); `first` (at [24, 32)) moves right by 32
    forwards, first_nfe = engine.forwards, first.nfe
    assert positions_of_boundary() == 64 + 16  # the joining row's prefill, apart from the continuing row's forward
    assert engine.last_layout_sizes == [2]
    # Each row took part in one of the first step's two forwards: one forward more than the rows' longest block.
    assert engine.forwards - forwards == max(first.nfe - first_nfe, late.nfe) + 1
    assert positions_of_boundary() == 2 * 16
    for row in (first, late):
        committed = row.plan.blocks[row.block][0] - 8  # columns whose K/V are final once the block before ran
        want = exact_kv(random_llada2, row.tokens, committed, 8)
        for layer in range(random_llada2.config.num_hidden_layers):
            for got, expected in ((engine.runner.store.keys, want.keys), (engine.runner.store.values, want.values)):
                torch.testing.assert_close(got[layer][row.slot, :committed], expected[layer][0].transpose(0, 1))
    engine.run_until_done()
    assert_alone(random_llada2, [first, late])


def test_block_causal_rows_joining_together_are_prefilled_packed(random_llada2):
    """Rows joining at one boundary are prefilled (prompt and first block, each at its own columns) in one forward
    of their columns packed end to end: a short prompt does not pay for a long one's."""
    settings = dict(max_new_tokens=24, block_length=8, threshold=0.5, eos_early_stop=False)
    short, long = request(random_llada2, [5, 6, 7, 8, 9], **settings), request(random_llada2, [9] * 30, **settings)
    engine = ContinuousBatcher(random_llada2, max_batch_size=2)
    engine.submit(short)
    engine.submit(long)
    engine.decode_boundary()
    assert engine.last_layout_sizes == [2]
    assert engine.first_step_positions == 8 + 32  # [0, 8) and [0, 32): their first blocks' ends
    engine.run_until_done()
    assert_alone(random_llada2, [short, long])


def test_block_causal_cancelled_rows_slot_goes_to_a_joining_row(random_llada2):
    """A cancelled row leaves its slot; a row joining at the next boundary takes it (and overwrites its K/V) while
    the other row continues from its own slot; both exact."""
    settings = dict(max_new_tokens=40, block_length=8, threshold=0.5, eos_early_stop=False)
    cancelled, partner = request(random_llada2, [5, 6, 7], **settings), request(random_llada2, [9] * 20, **settings)
    joining = request(random_llada2, list(range(10, 60)), **settings)
    engine = ContinuousBatcher(random_llada2, max_batch_size=2)
    engine.submit(cancelled)
    engine.submit(partner)
    engine.submit(joining)  # waits: no slot free
    engine.decode_boundary()
    engine.decode_boundary()
    assert not joining.on_block.updates
    slot = cancelled.slot
    cancelled.cancelled.set()
    engine.decode_boundary()
    assert joining.slot == slot and engine.last_layout_sizes == [2] and len(joining.on_block.updates) == 1
    engine.run_until_done()
    assert_alone(random_llada2, [partner, joining])


def test_dream_rows_equal_generate_alone():
    model = DreamModel.from_pretrained(FIXTURES / "dream-tiny-ref").eval()
    vocab = model.config.vocab_size
    rng = random.Random(5)
    for settings in (
        dict(max_new_tokens=16, steps=16, alg="entropy", block_length=16, use_cache=False),
        dict(
            max_new_tokens=24,
            block_length=8,
            use_cache=True,
            dual_cache=True,
            alg="confidence_threshold",
            threshold=0.5,
        ),
        dict(max_new_tokens=24, block_length=8, use_cache=True, dual_cache=False, steps=24, alg="maskgit_plus"),
    ):
        settings = dict(settings, temperature=0.0, eos_early_stop=False)
        prompts = random_prompts(rng, 5, 4, vocab - 10, longest=12)
        requests = [request(model, prompt, **settings) for prompt in prompts]
        drive(ContinuousBatcher(model, max_batch_size=3), requests, [rng.randrange(0, 4) for _ in prompts])
        assert_alone(model, requests)


# -- admission, leaving, cancellation ---------------------------------------------------------------------------


def test_admission_is_oldest_first_and_places_are_reused(trained):
    """With one place, requests run one after another in arrival order; each takes the place its predecessor left
    (the cache is allocated once)."""
    engine = ContinuousBatcher(trained, max_batch_size=1)
    finished = []

    def recorder(name):
        def on_block(update):
            if update.ended:
                finished.append(name)

        return on_block

    requests = [
        EngineRequest([5 + i, 9], trained.resolve_generation_config(max_new_tokens=16, block_length=8), recorder(i))
        for i in range(4)
    ]
    for req in requests:
        engine.submit(req)
    engine.decode_boundary()
    cache = engine.runner.cache
    sizes = []
    while engine.has_work():
        engine.decode_boundary()
        sizes.append(engine.last_layout_sizes)
    assert finished == [0, 1, 2, 3]
    assert all(layout == [1] for layout in sizes)
    assert engine.runner.cache is cache or cache is None


def test_a_late_request_joins_at_the_next_boundary(trained):
    settings = dict(max_new_tokens=64, block_length=8, steps=64, eos_early_stop=False)
    long, late = request(trained, [5, 6, 7], **settings), request(trained, [8, 9], **settings)
    engine = ContinuousBatcher(trained, max_batch_size=4)
    engine.submit(long)
    engine.decode_boundary()
    engine.decode_boundary()
    engine.submit(late)
    engine.decode_boundary()
    assert engine.last_layout_sizes == [2]  # joined at once, not after the long one ended
    assert len(late.on_block.updates) == 1 and len(long.on_block.updates) == 3
    engine.run_until_done()
    assert_alone(trained, [long, late])


def test_consumer_ends_a_row_and_its_place_is_taken(trained):
    """`on_block` returning True ends the row after that block (no more forwards); a waiting request takes its
    place at the next boundary."""
    settings = dict(max_new_tokens=32, block_length=8, steps=32, eos_early_stop=False)
    stopped = request(trained, [5, 6], Recorder(stop_after=1), **settings)
    waiting = request(trained, [7, 8], **settings)
    engine = ContinuousBatcher(trained, max_batch_size=1)
    engine.submit(stopped)
    engine.submit(waiting)
    engine.decode_boundary()
    assert stopped.ended and stopped.nfe == 8 and not waiting.on_block.updates
    engine.decode_boundary()
    assert len(waiting.on_block.updates) == 1 and len(stopped.on_block.updates) == 1
    engine.run_until_done()
    assert_alone(trained, [waiting])


def test_cancelled_rows_leave_waiting_or_running(trained):
    settings = dict(max_new_tokens=32, block_length=8, steps=32, eos_early_stop=False)
    told = {}
    running, waiting, partner = (request(trained, [5 + i, 6], **settings) for i in range(3))
    for name, req in (("running", running), ("waiting", waiting)):
        req.on_cancel = lambda nfe, name=name: told.__setitem__(name, nfe)
    engine = ContinuousBatcher(trained, max_batch_size=2)
    engine.submit(running)
    engine.submit(partner)
    engine.submit(waiting)
    engine.decode_boundary()
    running.cancelled.set()
    waiting.cancelled.set()
    engine.decode_boundary()
    assert told == {"running": 8, "waiting": 0}
    assert len(running.on_block.updates) == 1 and not waiting.on_block.updates
    assert engine.last_layout_sizes == [1]  # the partner decodes on alone
    engine.run_until_done()
    assert_alone(trained, [partner])


def test_width_limit_splits_layouts_and_holds_back_what_does_not_fit(trained):
    """Rows whose aligned layout would exceed `max_batch_width` do not share it: the head of the queue waits for
    room (no starvation of the oldest), and the tokens stay exact."""
    settings = dict(max_new_tokens=16, block_length=8, steps=16, eos_early_stop=False)
    long_prompt = request(trained, list(range(4, 44)), **settings)  # 40 + 16 columns
    short = request(trained, [5, 6], **settings)  # 2 + 16
    engine = ContinuousBatcher(trained, max_batch_size=4, max_batch_width=60)
    engine.submit(long_prompt)
    engine.decode_boundary()
    engine.submit(short)  # aligned at the long row's block start (48): 48 + 16 > 60
    engine.decode_boundary()
    assert engine.last_layout_sizes == [1]
    engine.run_until_done()
    assert_alone(trained, [long_prompt, short])
    with pytest.raises(ValueError, match="max_batch_width"):
        engine.submit(request(trained, list(range(4, 60)), **settings))


def test_a_failing_layout_ends_only_its_rows(trained, monkeypatch):
    """An exception in one settings group's layout ends its rows with the error; the other group decodes on."""
    good = request(trained, [5, 6], max_new_tokens=16, block_length=8, steps=16, eos_early_stop=False)
    bad = request(trained, [7, 8], max_new_tokens=16, block_length=4, steps=16, eos_early_stop=False)
    engine = ContinuousBatcher(trained, max_batch_size=4)
    engine.submit(good)
    engine.submit(bad)
    from hf_dllm.serving import engine as engine_module

    original = engine_module.LayoutRun.decode_block

    def failing(self, rows, width):
        if rows[0] is bad:
            raise RuntimeError("boom")
        return original(self, rows, width)

    monkeypatch.setattr(engine_module.LayoutRun, "decode_block", failing)
    with pytest.raises(RuntimeError, match="boom"):
        engine.decode_boundary()
    assert bad.ended and isinstance(bad.error, RuntimeError) and not good.ended
    engine.run_until_done()
    assert_alone(trained, [good])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(max_batch_size=True), "max_batch_size"),
        (dict(max_batch_width=0), "max_batch_width"),
        (dict(width_granularity=-1), "width_granularity"),
        (dict(join_layout_min_rows=0), "join_layout_min_rows"),
        (dict(join_layout_min_rows=2.0), "join_layout_min_rows"),
        (dict(max_refresh_positions=0), "max_refresh_positions"),
        (dict(max_refresh_positions="64"), "max_refresh_positions"),
        (dict(max_batch_width=64, max_batch_positions=63), "max_batch_positions"),
        (dict(max_batch_width=64, max_batch_positions=100.0), "max_batch_positions"),
    ],
)
def test_bad_arguments_are_refused(trained, kwargs, name):
    with pytest.raises(ValueError, match=name):
        ContinuousBatcher(trained, **kwargs)


def test_empty_prompt_is_refused(trained):
    engine = ContinuousBatcher(trained)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.submit(request(trained, [], max_new_tokens=8, block_length=8))


def test_submit_from_another_thread(trained):
    """`submit` is safe from any thread while the engine decodes in its own."""
    engine = ContinuousBatcher(trained, max_batch_size=4)
    settings = dict(max_new_tokens=16, block_length=8, steps=16)
    requests = [request(trained, [5 + i, 6], **settings) for i in range(6)]
    threads = [threading.Thread(target=engine.submit, args=(req,)) for req in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    engine.run_until_done()
    assert_alone(trained, requests)


def test_engine_is_not_exported():
    """The engine is an application (serving), not Hub remote code: it lives in a subpackage."""
    assert Path(__import__("hf_dllm.serving.engine").serving.engine.__file__).parent.name == "serving"


def test_settings_the_family_refuses_fail_at_submit():
    """A setting the model family's rules refuse (Dream: LLaDA's random remasking) fails that request when it is
    submitted, never the layout it would have joined."""
    model = DreamModel.from_pretrained(FIXTURES / "dream-tiny-ref").eval()
    engine = ContinuousBatcher(model)
    with pytest.raises(ValueError, match="remasking"):
        engine.submit(request(model, [5, 6], max_new_tokens=8, block_length=8, remasking="random"))
    assert not engine.has_work()


def test_step_capturability_is_asked_without_autograd():
    """A run asks the model whether its steps can be captured in the mode they run in (no autograd), whatever the
    caller's mode: LLaDA2's grouped expert GEMMs (what makes its steps capturable) are off while autograd records,
    and the engine's scheduler sets its runs up with autograd on (the server then ran every LLaDA2 step eagerly)."""
    from tests.models.llada2.test_llada2_integration import tiny_llada2

    model = tiny_llada2(seed=0).to(torch.bfloat16)  # LLaDA2 captures its steps in bfloat16
    with torch.no_grad():
        if not model.model.layers[1].mlp.use_grouped_mm(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)):
            pytest.skip("torch has no grouped GEMM on this CPU")
    config = model.resolve_generation_config(max_new_tokens=8, block_length=4)
    with torch.enable_grad():
        assert not model._diffusion_step_capturable()  # asked under autograd, as the engine's thread would
        run = LayoutRun(
            model, config, max_rows=2, max_width=32, device=torch.device("cpu"), shared_cache=lambda r: None
        )
        assert run.machine.step_capturable()


def recorded_layouts(monkeypatch) -> list[list[tuple[int, int]]]:
    """Every layout the engine decodes, as (request id, block index) of its rows, in order."""
    layouts = []
    decode_block = LayoutRun.decode_block

    def recorded(self, rows, width):
        layouts.append([(id(row), row.block) for row in rows])
        return decode_block(self, rows, width)

    monkeypatch.setattr(LayoutRun, "decode_block", recorded)
    return layouts


# Arrivals (boundary of each request) and LLaDA dual-cache settings of the join-layout tests.
JOIN_ARRIVALS = [0, 0, 0, 1, 2, 2, 4, 5]
JOIN_DUAL = dict(max_new_tokens=32, block_length=8, steps=16, use_cache=True, dual_cache=True, eos_early_stop=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_joining_rows_decode_apart_first_and_equal_generate_alone(trained, random_llada2, seed, monkeypatch):
    """`join_layout_min_rows`: at a boundary with nothing waiting, joining rows decode their first block in a
    layout of their own before the others (when enough others run); each row is still `generate()` alone (LLaDA
    with the dual cache, and block-causal LLaDA2 rows, whose K/V slots and packed prefill this splits)."""
    layouts = recorded_layouts(monkeypatch)
    rng = random.Random(30 + seed)
    cases = [
        (trained, JOIN_DUAL),
        (random_llada2, dict(max_new_tokens=40, block_length=8, threshold=0.5, eos_early_stop=False)),
    ]
    for model, settings in cases:
        layouts.clear()
        prompts = random_prompts(rng, 8, 4, 60)
        requests = [request(model, prompt, **settings) for prompt in prompts]
        engine = ContinuousBatcher(model, max_batch_size=8, join_layout_min_rows=2)
        drive(engine, requests, JOIN_ARRIVALS)
        assert_alone(model, requests)
        apart = [
            i
            for i, layout in enumerate(layouts)
            if all(block == 0 for _, block in layout) and i + 1 < len(layouts) and layouts[i + 1][0][1] > 0
        ]
        assert apart, "no boundary decoded its joining rows apart"
        for i in apart:  # the joining rows' layout came first, then the others' (at least 2), none at block 0
            assert len(layouts[i + 1]) >= 2 and all(block > 0 for _, block in layouts[i + 1])


def test_joining_rows_share_the_layout_when_the_rule_is_off(trained, monkeypatch):
    """`join_layout_min_rows=None`: joining rows decode their first block with the running rows, so a boundary
    is one layout per cohort; the default is `JOIN_LAYOUT_MIN_ROWS`, which splits the same arrivals."""
    assert ContinuousBatcher(trained).scheduler.join_layout_min_rows == JOIN_LAYOUT_MIN_ROWS
    layouts = recorded_layouts(monkeypatch)
    prompts = random_prompts(random.Random(30), 8, 4, 60)
    sizes, boundaries = {}, {}
    for rule in (None, 2):
        layouts.clear()
        requests = [request(trained, prompt, **JOIN_DUAL) for prompt in prompts]
        engine = ContinuousBatcher(trained, max_batch_size=8, join_layout_min_rows=rule)
        boundaries[rule] = drive(engine, requests, JOIN_ARRIVALS)
        assert_alone(trained, requests)
        sizes[rule] = [len(layout) for layout in layouts]
    assert len(sizes[None]) == boundaries[None], sizes  # one layout per boundary: joining rows never apart
    assert len(sizes[2]) > boundaries[2] and sum(sizes[None]) == sum(sizes[2]), sizes


def test_joining_rows_stay_in_the_layout_while_requests_wait(trained, monkeypatch):
    """With requests left waiting (a full batch) the engine favours throughput: joining rows share the layout."""
    layouts = recorded_layouts(monkeypatch)
    settings = dict(block_length=8, use_cache=True, dual_cache=True, eos_early_stop=False)
    lengths = [(8, 40), (8, 16), (8, 16), (8, 16)]  # the first row runs longest; the others free their place
    requests = [  # 4 steps per block for all: one cohort
        request(trained, [5 + i] * prompt, **dict(settings, max_new_tokens=new, steps=new // 2))
        for i, (prompt, new) in enumerate(lengths)
    ]
    engine = ContinuousBatcher(trained, max_batch_size=2, join_layout_min_rows=1)
    drive(engine, requests, [0, 0, 0, 0])
    assert_alone(trained, requests)
    assert all(len(layout) == 2 for layout in layouts[:4]), layouts


def test_attention_without_shape_plans_turns_off_cudnn_on_cuda_only():
    """Forwards whose shapes keep changing (packed rows, the engine's layouts) skip cuDNN's sdpa, which builds a
    plan per new shape; the flags come back afterwards, and other devices are left alone."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_without_shape_plans("cuda"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_without_shape_plans("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize(
    "settings", [JOIN_DUAL, dict(max_new_tokens=24, block_length=8, steps=12)], ids=["dual", "none"]
)
def test_large_layouts_are_cut_into_slices_of_bounded_refresh(trained, monkeypatch, settings):
    """`max_refresh_positions`: a layout whose canvases hold more positions is decoded as slices, each within the
    budget (or one row), cut in order into about equal parts; every row is still `generate()` alone. Off by default;
    block-causal models (never sliced) refuse it."""
    from tests.models.llada2.test_llada2_integration import tiny_llada2

    assert ContinuousBatcher(trained).scheduler.max_refresh_positions is None
    with pytest.raises(ValueError, match="max_refresh_positions.*block-causal"):
        ContinuousBatcher(tiny_llada2(seed=0), max_refresh_positions=8)
    layouts = recorded_layouts(monkeypatch)
    prompts = random_prompts(random.Random(7), 8, 4, 60, longest=30)
    requests = [request(trained, prompt, **settings) for prompt in prompts]
    budget = 150
    engine = ContinuousBatcher(trained, max_batch_size=8, join_layout_min_rows=None, max_refresh_positions=budget)
    boundaries = drive(engine, requests, [0] * 8)
    assert_alone(trained, requests)
    canvas = {id(req): req.plan.canvas_width for req in requests}
    sizes = [sum(canvas[key] for key, _ in layout) for layout in layouts]
    assert len(layouts) > boundaries, "no layout was cut"
    assert all(size <= budget or len(layout) == 1 for size, layout in zip(sizes, layouts, strict=True)), sizes
    # The first boundary decodes all 8 rows in the fewest slices the budget allows, about equal.
    total = sum(canvas.values())
    first = sizes[: -(-total // budget)]
    assert sum(first) == total and max(first) - min(first) <= max(canvas.values()), sizes


def test_waiting_requests_join_the_layouts_still_to_decode(trained, monkeypatch):
    """Between two layouts of a boundary the engine calls `intake` (the server's new requests) and waiting
    requests join the next layout of their cohort that their width fits: requests submitted during a boundary
    decode their first block in that boundary, in order, each `generate()` alone; a row cancelled meanwhile leaves
    the layouts still to decode at once."""
    layouts = recorded_layouts(monkeypatch)
    prompts = random_prompts(random.Random(11), 6, 4, 60, longest=30)
    running = [request(trained, prompt, **JOIN_DUAL) for prompt in prompts[:4]]
    late = [request(trained, prompt, **JOIN_DUAL) for prompt in prompts[4:]]
    # Canvases of 33-61 columns: no two rows fit 60 positions, so each slice is one row.
    engine = ContinuousBatcher(trained, max_batch_size=6, join_layout_min_rows=None, max_refresh_positions=60)
    for req in running:
        engine.submit(req)
    calls = []

    def intake():
        calls.append(len(layouts))
        if len(calls) == 1:  # after the boundary's first layout: two requests arrive, a running row is cancelled
            for req in late:
                engine.submit(req)
            running[-1].cancelled.set()

    engine.intake = intake
    engine.decode_boundary()
    assert calls[0] == 1 and layouts[0] == [(id(running[0]), 0)]
    joined = [key for layout in layouts[1:] for key, block in layout if block == 0]
    assert [key for key in joined if key in {id(req) for req in late}] == [id(req) for req in late]
    assert id(running[-1]) not in joined and running[-1].ended and running[-1].nfe == 0
    assert [len(req.on_block.updates) for req in late] == [1, 1]
    engine.run_until_done()
    assert_alone(trained, running[:-1] + late)


def test_a_request_that_fits_no_queued_layout_waits_for_the_next_boundary(trained, monkeypatch):
    """A request whose settings no layout still to decode shares (another cohort) joins at the next boundary, and
    the requests behind it wait too (oldest first)."""
    recorded_layouts(monkeypatch)
    running = [request(trained, [5 + i] * 30, **JOIN_DUAL) for i in range(3)]
    other = request(trained, [9, 9], max_new_tokens=16, block_length=4, steps=8)
    behind = request(trained, [8, 8], **JOIN_DUAL)
    engine = ContinuousBatcher(trained, max_batch_size=8, join_layout_min_rows=None, max_refresh_positions=70)
    for req in running:
        engine.submit(req)
    submitted = []

    def intake():
        if not submitted:
            submitted.append(True)
            engine.submit(other)
            engine.submit(behind)

    engine.intake = intake
    engine.decode_boundary()
    assert len(engine.last_layout_sizes) == 3 and not other.on_block.updates and not behind.on_block.updates
    engine.decode_boundary()
    assert len(other.on_block.updates) == 1 and len(behind.on_block.updates) == 1
    engine.run_until_done()
    assert_alone(trained, [*running, other, behind])


def test_only_slices_take_requests_during_a_boundary(trained, monkeypatch):
    """A layout that was not cut (here: one per settings group, no budget) takes no request during its boundary:
    with no slice still to decode the engine does not even ask for new requests (`intake`), and a request arriving
    meanwhile decodes at the next boundary although its group's layout was still to decode."""
    layouts = recorded_layouts(monkeypatch)
    first = request(trained, [5, 6, 7], max_new_tokens=16, block_length=4, steps=8)
    second = request(trained, [8, 9], **JOIN_DUAL)
    late = request(trained, [7, 7], **JOIN_DUAL)
    engine = ContinuousBatcher(trained, max_batch_size=4, join_layout_min_rows=None, max_refresh_positions=None)
    engine.submit(first)
    engine.submit(second)
    arrivals = [late]
    engine.intake = lambda: arrivals and engine.submit(arrivals.pop())
    engine.decode_boundary()
    assert layouts == [[(id(first), 0)], [(id(second), 0)]] and arrivals == [late]
    engine.submit(late)
    engine.decode_boundary()
    assert len(late.on_block.updates) == 1
    engine.run_until_done()
    assert_alone(trained, [first, second, late])
