"""The tiny reference-format DiffusionGemma checkpoint as fixtures (one model per test module)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

import hf_dllm  # noqa: F401  (registers the family)
from tests.conftest import FIXTURES

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"


@pytest.fixture(scope="module")
def gemma():
    """The checkpoint in float32 on the CPU."""
    return AutoModel.from_pretrained(GEMMA_DIR).eval()


@pytest.fixture(scope="module")
def gemma_cuda_bf16():
    """The checkpoint in bfloat16 on CUDA (skips without CUDA)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return AutoModel.from_pretrained(GEMMA_DIR, dtype=torch.bfloat16).eval().cuda()
