"""The continuous-batching engine on CUDA (skipped without it): the CUDA-graph step serves changing layouts, with
exactly the tokens of the eager engine of the same dtype, and float32 rows equal `generate()` alone."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FIXTURES
from test_engine import drive, request

from hf_dllm import LLaDAModelLM
from hf_dllm.serving.engine import ContinuousBatcher

pytestmark = pytest.mark.gpu


def decode(model, prompts, arrivals, settings):
    """Each prompt's tokens and forwards through the engine, requests arriving at the given boundaries."""
    engine = ContinuousBatcher(model, max_batch_size=4, max_batch_width=256)
    requests = [request(model, prompt, **settings) for prompt in prompts]
    drive(engine, requests, arrivals)
    return [req.on_block.tokens for req in requests], [req.nfe for req in requests], engine


def assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, dtype):
    """The CUDA-graph engine's tokens and forwards equal the eager engine's; in float32, `generate()` alone's."""
    eager, eager_nfe, _ = decode(model, prompts, arrivals, dict(settings, disable_compile=True))
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
    counts = engine.graph_counts()
    # A block's later steps replay graphs (its first step runs packed: the refresh, or the uncached forward).
    assert model._hf_dllm_step_graphs.steps, "the engine captured no CUDA graph"
    assert counts["captured"] > 0 and counts["replayed"] > 0, counts
    assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, dtype)


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
    a forward of their own): the CUDA-graph engine gives the eager engine's tokens and forwards; float32 rows (eager:
    the MoE's grouped GEMM is captured in bfloat16 only) equal `generate()` alone."""
    from test_llada2_integration import tiny_llada2

    model = tiny_llada2(seed=4).to("cuda", dtype)
    rng = random.Random(2)
    prompts = [[rng.randrange(4, 100) for _ in range(rng.randrange(1, 90))] for _ in range(8)]
    arrivals = [rng.randrange(0, 6) for _ in prompts]
    settings = dict(max_new_tokens=40, block_length=8, threshold=0.5, eos_early_stop=False)
    graphs, graph_nfe, engine = decode(model, prompts, arrivals, settings)
    with torch.no_grad():  # as the engine asks (grouped expert GEMMs, hence graphs, are off under autograd)
        capturable = model._diffusion_step_capturable()
    assert capturable == (dtype == torch.bfloat16)
    if capturable:
        counts = engine.graph_counts()
        assert counts["captured"] > 0 and counts["replayed"] > 0, counts
    assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, dtype)
