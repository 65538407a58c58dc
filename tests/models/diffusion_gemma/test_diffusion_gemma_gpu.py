"""DiffusionGemma on CUDA: the forward agrees with the CPU reference logits, and generation is reproducible under a
seed and well formed (CUDA's random draws differ from the CPU's, so the CPU cases' tokens are not expected)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import hf_dllm  # noqa: F401  (registers the family)
from tests.conftest import FIXTURES

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"
CASES = {case["name"]: case for case in json.loads((GEMMA_DIR / "cases.json").read_text())["cases"]}

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gemma_cuda():
    return AutoModel.from_pretrained(GEMMA_DIR).eval().cuda()


@pytest.fixture(scope="module")
def expected():
    return load_file(GEMMA_DIR / "expected.safetensors")


def test_cuda_logits_match_cpu_reference(gemma_cuda, expected):
    with torch.no_grad():
        logits = gemma_cuda(
            input_ids=expected["logits.input_ids"].cuda(),
            decoder_input_ids=expected["logits.decoder_input_ids"].cuda(),
            self_conditioning_logits=expected["logits.self_conditioning_logits"].cuda(),
        ).logits
    torch.testing.assert_close(logits.cpu(), expected["logits.expected_sc"], rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("name", ["b2.g24.eos.s1", "p21.g32.cold.s2"])
def test_cuda_generation_is_seeded_and_well_formed(gemma_cuda, expected, name):
    case = CASES[name]
    prompt = expected[f"prompt.{case['prompt']}"].cuda()
    kwargs = dict(case["kwargs"])
    if case["attention_mask"]:
        kwargs["attention_mask"] = expected[f"attention_mask.{case['attention_mask']}"].cuda()
    runs = []
    for _ in range(2):
        torch.manual_seed(case["seed"])
        runs.append(gemma_cuda.generate(prompt, **kwargs))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    sequences = runs[0].sequences
    assert torch.equal(sequences[:, : prompt.shape[1]], prompt)
    assert (sequences.shape[1] - prompt.shape[1]) % 16 == 0
    assert runs[0].nfe <= kwargs["max_denoising_steps"] * (sequences.shape[1] - prompt.shape[1]) // 16
