"""DiffusionGemma's fast path on the CPU: the grouped expert GEMMs (no host synchronisation) against the loop that is
exact against transformers, per layer and through the whole model's logits; a bad `implementation` is refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import hf_dllm  # noqa: F401  (registers the family)

FIXTURES = next(p for p in Path(__file__).resolve().parents if p.name == "tests") / "fixtures"
GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"


@pytest.fixture(scope="module")
def gemma():
    return AutoModel.from_pretrained(GEMMA_DIR).eval()


def _set_experts(model, implementation):
    for layer in model.model.decoder.layers:
        layer.experts.implementation = implementation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_the_loop(gemma, dtype):
    experts = copy.deepcopy(gemma.model.decoder.layers[0].experts).to(dtype)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, experts.gate_up_proj.shape[-1], generator=generator).to(dtype)
    index = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:2] for _ in range(24)])
    index[:5] = torch.tensor([0, 1])  # an expert nobody else picks stays empty in the grouped product
    weights = torch.rand(24, 2, generator=generator)
    with torch.no_grad():
        experts.implementation = "loop"
        loop = experts(x, index, weights)
        experts.implementation = "grouped"
        grouped = experts(x, index, weights)
    tolerance = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(grouped, loop, **tolerance)
    assert grouped.abs().max() > 0


def test_grouped_experts_model_logits(gemma):
    expected = load_file(GEMMA_DIR / "expected.safetensors")
    inputs = dict(
        input_ids=expected["logits.input_ids"],
        decoder_input_ids=expected["logits.decoder_input_ids"],
        self_conditioning_logits=expected["logits.self_conditioning_logits"],
    )
    try:
        _set_experts(gemma, "grouped")
        with torch.no_grad():
            logits = gemma(**inputs).logits
    finally:
        _set_experts(gemma, None)
    torch.testing.assert_close(logits, expected["logits.expected_sc"], rtol=1e-4, atol=1e-4)


def test_bad_experts_implementation_is_refused(gemma):
    experts = gemma.model.decoder.layers[0].experts
    experts.implementation = "triton"
    try:
        with pytest.raises(ValueError, match="implementation"):
            experts(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))
    finally:
        experts.implementation = None
