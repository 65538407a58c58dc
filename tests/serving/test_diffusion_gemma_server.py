"""`hf-dllm serve` with DiffusionGemma: OpenAI completions and chat (streamed one canvas per chunk), the sampler's
fields as request fields, other families' fields answered with a 400 while the server keeps serving."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModel

from tests.conftest import FIXTURES

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"


@pytest.fixture(scope="module")
def client(tmp_path_factory, char_tokenizer):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from hf_dllm.serving.server import create_app, load_model

    path = tmp_path_factory.mktemp("gemma-served")
    AutoModel.from_pretrained(GEMMA_DIR).save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    model, tokenizer = load_model(str(path), dtype="float32", device="cpu")
    with TestClient(create_app(model, tokenizer, model_name="gemma", max_batch_size=4)) as client:
        yield client


def test_completion_and_refused_fields(client):
    body = {"model": "gemma", "prompt": "abc", "max_tokens": 20, "max_denoising_steps": 4, "t_min": 0.2}
    out = client.post("/v1/completions", json=body)
    assert out.status_code == 200, out.text
    usage = out.json()["usage"]
    assert usage["completion_tokens"] <= 20 and 0 < usage["nfe"] <= 2 * 4  # two canvases of at most 4 steps
    refused = client.post("/v1/completions", json={**body, "threshold": 0.9})
    assert refused.status_code == 400 and "LLaDA / Fast-dLLM" in refused.json()["error"]["message"]
    bad = client.post("/v1/completions", json={**body, "t_min": 0.9, "t_max": 0.5})
    assert bad.status_code == 400 and "t_max" in bad.json()["error"]["message"]
    assert client.post("/v1/completions", json=body).status_code == 200  # still serving


def test_streamed_chat_one_chunk_per_canvas(client):
    body = {
        "model": "gemma",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 32,
        "max_denoising_steps": 3,
        "stream": True,
    }
    out = client.post("/v1/chat/completions", json=body)
    assert out.status_code == 200
    chunks = [json.loads(line[6:]) for line in out.text.splitlines() if line.startswith("data: {")]
    content = [
        chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None
    ]
    assert 1 <= len(content) <= 2  # at most one chunk per canvas of 16 tokens
    assert chunks[-1]["usage"]["completion_tokens"] <= 32
