"""The continuous-batching engine on CUDA (skipped without it): the CUDA-graph step serves changing layouts, with
exactly the tokens of the eager engine of the same dtype, and float32 rows equal `generate()` alone."""

from __future__ import annotations

import random

import pytest
import torch

from hf_dllm import LLaDAModelLM
from hf_dllm.serving.engine import ContinuousBatcher
from tests.conftest import FIXTURES
from tests.serving.test_engine import budget_layouts, drive, request

pytestmark = pytest.mark.gpu


def decode(model, prompts, arrivals, settings, **limits):
    """Each prompt's tokens and forwards through the engine (`limits`: its batch limits, by default 4 rows of 256
    columns), requests arriving at the given boundaries."""
    engine = ContinuousBatcher(model, **(limits or dict(max_batch_size=4, max_batch_width=256)))
    requests = [request(model, prompt, **settings) for prompt in prompts]
    drive(engine, requests, arrivals)
    return [req.on_block.tokens for req in requests], [req.nfe for req in requests], engine


def assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, dtype, **limits):
    """The CUDA-graph engine's tokens and forwards equal the eager engine's; in float32, `generate()` alone's."""
    eager, eager_nfe, _ = decode(model, prompts, arrivals, dict(settings, disable_compile=True), **limits)
    assert graphs == eager and graph_nfe == eager_nfe
    if dtype == torch.float32:
        for prompt, got, nfe in zip(prompts, graphs, graph_nfe, strict=True):
            out = model.generate(torch.tensor([prompt], device="cuda"), return_dict_in_generate=True, **settings)
            assert got == out.sequences[0, len(prompt) :].tolist() and nfe == int(out.nfe_per_row[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "settings",
    [
        dict(max_new_tokens=32, block_length=8, steps=16, use_cache=True, dual_cache=True),
        dict(max_new_tokens=32, block_length=8, threshold=0.9, use_cache=True, dual_cache=False),
        dict(max_new_tokens=24, block_length=8, factor=1.0, use_cache=False),
    ],
)
def test_graph_engine_equals_eager_engine_and_generate(dtype, settings):
    model = LLaDAModelLM.from_pretrained(FIXTURES / "llada-tiny-trained", dtype=dtype).cuda().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 60) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    arrivals = [rng.randrange(0, 6) for _ in prompts]
    settings = dict(settings, eos_early_stop=False)
    graphs, graph_nfe, engine = decode(model, prompts, arrivals, settings)
    # A block's later steps run through graphs (its first step runs packed: the refresh, or the uncached forward).
    # A shape is captured at its second use; with threshold or factor decoding a block may end before its shape
    # repeats, so the same arrivals run again, replaying what the first run captured, with the same tokens.
    assert model._hf_dllm_step_graphs.steps, "the engine captured no CUDA graph"
    captured = engine.graph_counts()["captured"]
    again, again_nfe, engine = decode(model, prompts, arrivals, settings)
    counts = engine.graph_counts()
    assert captured > 0 and counts["replayed"] > 0, counts
    assert again == graphs and again_nfe == graph_nfe
    assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, dtype)


def cudnn_attention_kernels(run) -> list[str]:
    """Names of the cuDNN attention kernels the GPU ran during `run()`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [event.key for event in prof.key_averages() if "cudnn" in event.key.lower()]


def test_engine_attention_never_plans_per_shape():
    """Layouts change shape at every join and leave: the engine's forwards (packed and aligned, eager and captured)
    never run cuDNN's attention, which builds an execution plan per new shape (measured: a 16-row refresh at the
    LLaDA-8B shape took 1.0-1.7 s with new row lengths, 0.34-0.38 s without cuDNN)."""
    model = LLaDAModelLM.from_pretrained(FIXTURES / "llada-tiny-trained", dtype=torch.bfloat16).cuda().eval()
    query = torch.randn(4, model.config.n_heads, 300, model.config.d_model // model.config.n_heads).cuda().bfloat16()
    if not cudnn_attention_kernels(lambda: torch.nn.functional.scaled_dot_product_attention(query, query, query)):
        pytest.skip("sdpa does not pick cuDNN on this GPU and torch: nothing to keep the engine from")
    rng = random.Random(2)
    prompts = [[rng.randrange(4, 60) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    settings = dict(max_new_tokens=32, block_length=8, steps=16, use_cache=True, dual_cache=True)
    arrivals = [rng.randrange(0, 6) for _ in prompts]
    assert cudnn_attention_kernels(lambda: decode(model, prompts, arrivals, settings)) == []


def test_graph_memory_does_not_grow_under_changing_layouts():
    model = LLaDAModelLM.from_pretrained(FIXTURES / "llada-tiny-trained", dtype=torch.bfloat16).cuda().eval()
    rng = random.Random(1)
    settings = dict(max_new_tokens=32, block_length=8, steps=16, use_cache=True, dual_cache=True)
    prompts = [[rng.randrange(4, 60) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    decode(model, prompts, [rng.randrange(0, 6) for _ in prompts], settings)
    torch.cuda.synchronize()
    after_first = torch.cuda.memory_allocated()
    for _ in range(3):
        decode(model, prompts, [rng.randrange(0, 6) for _ in prompts], settings)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= after_first * 1.5 + (64 << 20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_causal_graph_engine_equals_eager_engine_and_generate(dtype):
    """LLaDA2 (block-causal: rows' exact K/V kept in the engine's store between blocks, joining rows prefilled in
    a forward of their own): the CUDA-graph engine gives the eager engine's tokens and forwards; float32 rows (the
    experts through the Triton grouped kernel, captured like bfloat16's) equal `generate()` alone."""
    from tests.models.llada2.test_llada2_integration import tiny_llada2

    model = tiny_llada2(seed=4).to("cuda", dtype)
    rng = random.Random(2)
    prompts = [[rng.randrange(4, 100) for _ in range(rng.randrange(1, 90))] for _ in range(8)]
    arrivals = [rng.randrange(0, 6) for _ in prompts]
    settings = dict(max_new_tokens=40, block_length=8, threshold=0.5, eos_early_stop=False)
    graphs, graph_nfe, engine = decode(model, prompts, arrivals, settings)
    with torch.no_grad():  # as the engine asks (grouped expert GEMMs, hence graphs, are off under autograd)
        capturable = model._diffusion_step_capturable()
    assert capturable  # the fused path's grouped kernel takes bfloat16 and float32 rows alike
    counts = engine.graph_counts()
    assert counts["captured"] > 0 and counts["replayed"] > 0, counts
    assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llada", "llada2"])
def test_graph_engine_under_a_kv_budget_equals_eager_engine_and_generate(dtype, family, monkeypatch):
    """A K/V budget (`max_batch_positions`): layouts of many narrow rows or few wide ones, laid end to end in the
    cache, padded to their row bucket or to what the budget holds at their width; the CUDA-graph steps (captured
    per rows x width, each over its own view of the buffers) give the eager engine's tokens and forwards, and
    float32 rows equal `generate()` alone."""
    from tests.models.llada2.test_llada2_integration import tiny_llada2

    if family == "llada":
        model = LLaDAModelLM.from_pretrained(FIXTURES / "llada-tiny-trained", dtype=dtype).cuda().eval()
        settings = dict(max_new_tokens=32, block_length=8, steps=16, use_cache=True, dual_cache=True)
        longest = 60
    else:
        model = tiny_llada2(seed=4).to("cuda", dtype)
        settings = dict(max_new_tokens=40, block_length=8, threshold=0.5)
        longest = 90
    settings = dict(settings, eos_early_stop=False)
    limits = dict(max_batch_size=8, max_batch_width=256, max_batch_positions=512)
    rng = random.Random(5)
    prompts = [
        [rng.randrange(4, 60) for _ in range(rng.choice([rng.randrange(1, 20)] * 3 + [longest]))] for _ in range(12)
    ]
    arrivals = [rng.randrange(0, 6) for _ in prompts]
    layouts = budget_layouts(monkeypatch)
    graphs, graph_nfe, engine = decode(model, prompts, arrivals, settings, **limits)
    assert all(padded * width <= 512 for _, padded, width in layouts), layouts
    assert max(rows for rows, _, _ in layouts) > 512 // 256  # narrow rows share what two full rows would take
    again, again_nfe, engine = decode(model, prompts, arrivals, settings, **limits)  # replays what was captured
    counts = engine.graph_counts()
    assert counts["replayed"] > 0, counts
    assert again == graphs and again_nfe == graph_nfe
    assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, dtype, **limits)


def test_engines_of_other_budgets_do_not_share_a_graph_runners_cache():
    """A model's CUDA-graph runner keeps the K/V cache its graphs read: an engine of a larger budget after one of a
    smaller budget gets a runner (and cache) of its own, so its wider layouts fit, with the eager engine's tokens."""
    model = LLaDAModelLM.from_pretrained(FIXTURES / "llada-tiny-trained", dtype=torch.bfloat16).cuda().eval()
    settings = dict(max_new_tokens=32, block_length=8, steps=16, use_cache=True, dual_cache=True, eos_early_stop=False)
    rng = random.Random(6)
    prompts = [[rng.randrange(4, 60) for _ in range(rng.randrange(30, 60))] for _ in range(8)]  # 128 columns each
    arrivals = [0] * len(prompts)
    decode(model, prompts, arrivals, settings, max_batch_size=8, max_batch_width=256, max_batch_positions=256)
    limits = dict(max_batch_size=8, max_batch_width=256, max_batch_positions=1024)
    graphs, graph_nfe, engine = decode(model, prompts, arrivals, settings, **limits)
    assert engine.last_layout_sizes == [8]  # 8 rows of 128 columns: four times the first engine's budget
    assert_equals_eager_engine_and_generate(
        model, prompts, arrivals, settings, graphs, graph_nfe, torch.bfloat16, **limits
    )
