"""The continuous-batching engine (what `hf-dllm serve` decodes with) running LLaDA-MoE on CUDA (skipped without
it): in bfloat16 (the experts as the fused Triton kernels) the CUDA-graph engine's tokens and forwards equal the
eager engine's; in float32 (the experts' loop, never captured) rows equal `generate()` alone; also with sliced
layouts (`max_refresh_positions`)."""

from __future__ import annotations

import random

import pytest
import torch

from hf_dllm import LLaDAMoEModelLM
from tests.conftest import FIXTURES
from tests.serving.test_engine_gpu import assert_equals_eager_engine_and_generate, decode

pytestmark = pytest.mark.gpu

MASK = 310  # the reference fixture's mask id (its Hub config names none)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "settings, limits",
    [
        (dict(max_new_tokens=32, block_length=8, threshold=0.7, dual_cache=True), {}),
        (dict(max_new_tokens=32, block_length=8, steps=16, dual_cache=False), {}),
        (
            dict(max_new_tokens=24, block_length=8, threshold=0.7, dual_cache=True),
            dict(max_batch_size=6, max_batch_width=256, join_layout_min_rows=None, max_refresh_positions=64),
        ),
    ],
    ids=["threshold-dual", "steps-prefix", "threshold-sliced"],
)
def test_graph_engine_equals_eager_engine_and_generate(dtype, settings, limits):
    model = LLaDAMoEModelLM.from_pretrained(FIXTURES / "lladamoe-tiny-ref", dtype=dtype).cuda().eval()
    if dtype == torch.bfloat16:
        x = torch.zeros(1, model.config.hidden_size, dtype=dtype, device="cuda")
        with torch.no_grad():
            assert model.model.layers[0].mlp.uses_fused_kernels(x)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    arrivals = [rng.randrange(0, 4) for _ in prompts]
    settings = dict(settings, use_cache=True, eos_early_stop=False, mask_token_id=MASK)
    graphs, graph_nfe, engine = decode(model, prompts, arrivals, settings, **limits)
    # A shape is captured at its second use: the same arrivals run again, replaying what the first run captured.
    again, again_nfe, engine = decode(model, prompts, arrivals, settings, **limits)
    counts = engine.graph_counts()
    if dtype == torch.bfloat16:
        assert counts["replayed"] > 0, counts
    else:  # float32 experts run as the loop, which reads per-expert counts on the host: no step is captured
        assert not model._diffusion_step_capturable() and counts["captured"] == 0, counts
    assert again == graphs and again_nfe == graph_nfe
    assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, dtype, **limits)
