"""Shared fixtures: the reference-format checkpoint, tiny random LLaDA models, the character tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_dllm
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE_DIR = FIXTURES / "llada-tiny-ref"


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The tests run tiny models: one intra-op thread is faster than two, which wait on each other on a busy
    2-core machine (a tiny forward measured 100x slower). Subprocesses the tests start set OMP_NUM_THREADS=1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_compile_for_flex(request):
    """Each flex_attention test compiles from scratch: once dynamo has compiled flex attention for one shape, it
    recompiles the next with dynamic shapes, and torch 2.13's CPU inductor emits C++ that does not compile for
    that (`cur_kvSplitSize0` undeclared)."""
    if "flex" in request.node.nodeid:
        torch._dynamo.reset()
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return REFERENCE_DIR


@pytest.fixture(scope="session")
def reference_model():
    """The reference-format tiny checkpoint (float32, sdpa), loaded through the Auto classes."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(REFERENCE_DIR).eval()


@pytest.fixture(scope="session")
def reference_expected() -> dict[str, torch.Tensor]:
    return load_file(REFERENCE_DIR / "expected.safetensors")


@pytest.fixture(scope="session")
def reference_cases() -> list[dict]:
    return json.loads((REFERENCE_DIR / "cases.json").read_text())["cases"]


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


def tiny_config(vocab_size: int = 103, **overrides) -> hf_dllm.LLaDAConfig:
    """A small LLaDA config (GQA 4 query / 2 kv heads) sized for the character tokenizer's vocabulary."""
    fields = dict(
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        mlp_hidden_size=128,
        vocab_size=vocab_size,
        embedding_size=vocab_size,
        max_sequence_length=512,
        mask_token_id=3,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=1,
    )
    fields.update(overrides)
    return hf_dllm.LLaDAConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> hf_dllm.LLaDAModelLM:
    torch.manual_seed(seed)
    return hf_dllm.LLaDAModelLM(tiny_config(**overrides)).eval()


@pytest.fixture
def make_tiny_model():
    return tiny_model
