"""`hf-dllm serve` with a LLaDA-MoE model (bidirectional, decoded as LLaDA): completions and chat, streaming and
usage equal a direct `generate()` with the same parameters and LLaDA's decoding fields (threshold, factor, the
fixed schedule, prefix / dual cache, classifier-free guidance); concurrent requests of different prompt lengths
each get what they get alone; a bad dLLM field (or a LLaDA2-only one) gets an OpenAI-style 400 and the server keeps
serving. The server runs in this process on 127.0.0.1 (see tests/serving/test_serve.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The serve extra (fastapi, uvicorn): importing tests.serving.test_serve skips this module without it.
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import hf_dllm  # noqa: E402
from tests.conftest import save_checkpoint  # noqa: E402
from tests.models.llada_moe.test_llada_moe_family import char_llada_moe  # noqa: E402
from tests.serving.test_serve import (  # noqa: E402
    MODEL_NAME,
    alone,
    assert_chat_and_its_stream_equal,
    assert_concurrent_requests_exact,
    assert_error,
    assert_streamed_completion_equals,
    chat_ids,
    direct,
    early_stop_string,
    prompt_ids,
    serving,
)


@pytest.fixture(scope="module")
def llada_moe_dir(tmp_path_factory) -> Path:
    """A tiny random LLaDA-MoE with the character tokenizer, saved as a checkpoint folder. Seed 1: its texts vary
    from position to position and threshold 0.3 commits several tokens in some steps (parallel decoding runs)."""
    return save_checkpoint(char_llada_moe(seed=1), tmp_path_factory.mktemp("llada-moe-tiny-random"))


server = serving("llada_moe_dir")


def test_the_server_decodes_the_llada_moe_family_in_parallel(server):
    """The checkpoint loads as LLaDA-MoE, and threshold 0.3 commits several tokens in some forwards (fewer forwards
    than tokens): the threshold cases below run the parallel rule, not one token per step."""
    assert hf_dllm.family_for_config(server.model.config).name == "llada_moe"
    assert type(server.model).__name__ == "LLaDAMoEModelLM"
    _, tokens, nfe, _ = direct(server, prompt_ids(server, "Once upon a time"), 16, block_length=8, threshold=0.3)
    assert 0 < nfe < tokens == 16


LLADA_FIELDS = [
    {"block_length": 8, "threshold": 0.3},  # Fast-dLLM's threshold rule, dual cache (the default)
    {"block_length": 8, "threshold": 0.3, "use_dual_cache": False},  # the prefix cache
    {"block_length": 8, "factor": 1.0},  # Fast-dLLM's factor rule
    {"block_length": 8, "steps": 8, "use_cache": False},  # LLaDA's fixed schedule, 4 tokens a step, no cache
    {"block_length": 8, "steps": 8, "cfg_scale": 1.0, "use_cache": False},  # classifier-free guidance
]


@pytest.mark.parametrize("extra", LLADA_FIELDS, ids=lambda extra: ",".join(f"{k}={v}" for k, v in extra.items()))
def test_completion_equals_generate(server, client, extra):
    prompt = "abc"  # threshold 0.3 commits 16 tokens in 13 forwards (10 with the prefix cache)
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=14, extra_body=extra)
    reference = {("dual_cache" if k == "use_dual_cache" else k): v for k, v in extra.items()}
    text, tokens, nfe, finish = direct(server, prompt_ids(server, prompt), 14, **reference)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (text, finish)
    assert out.usage.prompt_tokens == len(prompt_ids(server, prompt))
    assert out.usage.completion_tokens == tokens <= 14
    assert out.usage.model_extra["nfe"] == nfe > 0


def test_two_prompts_with_a_stop_string_each_get_generate_alone(server):
    """Two prompts of one request (one padded run, other lengths) and a stop string that ends the first row early:
    each choice's text and `nfe` are what generate() gives the prompt alone, stopped by an equivalent criterion."""
    fields = {"block_length": 8, "threshold": 0.3}
    prompts = [prompt_ids(server, "Tell me a story"), prompt_ids(server, "Hi")]
    full_text, _, full_nfe, _ = alone(server, prompts[0], 24, **fields)
    stop = early_stop_string(full_text)
    assert alone(server, prompts[0], 24, stop, **fields)[2] < full_nfe  # the stop string really ends the row early
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 24, "stop": stop, **fields}
    out = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    expected = [alone(server, ids, 24, stop, **fields) for ids in prompts]
    for choice, (text, _, nfe, finish) in zip(out["choices"], expected, strict=True):
        assert (choice["text"], choice["finish_reason"], choice["nfe"]) == (text, finish, nfe)
    assert out["usage"]["completion_tokens"] == sum(e[1] for e in expected)
    assert out["usage"]["nfe"] == sum(e[2] for e in expected)


def test_chat_and_streaming_equal_generate(server, client):
    messages = [{"role": "user", "content": "Tell me"}]
    extra = {"block_length": 8, "threshold": 0.3}
    expected = direct(server, chat_ids(server, messages), 16, **extra)
    assert_chat_and_its_stream_equal(client, messages, 16, extra, expected, block_length=8)


def test_streamed_completion_equals_the_whole_one(server, client):
    fields = {"block_length": 8, "eos_early_stop": False, "threshold": 0.3, "use_dual_cache": False}
    prompt = "Once upon a time"
    reference = {("dual_cache" if k == "use_dual_cache" else k): v for k, v in fields.items()}
    expected = direct(server, prompt_ids(server, prompt), 24, **reference)
    chunks = assert_streamed_completion_equals(client, prompt, expected, max_tokens=24, extra_body=fields)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # one chunk per committed block


def test_concurrent_requests_of_different_lengths_each_get_what_they_get_alone(server, client):
    """Two clients at once, prompts of 2 and 15 tokens (other offsets inside a block of 8): each gets exactly what
    it gets alone, whichever block boundary it joined at."""
    prompts = ["Hi", "Tell me a story"]
    fields = {"block_length": 8, "threshold": 0.3}
    expected = [direct(server, prompt_ids(server, prompt), 12, **fields) for prompt in prompts]
    assert expected[0][0] != expected[1][0]  # rows that could be swapped or mixed would show it
    assert_concurrent_requests_exact(server, client, prompts, fields, expected)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"threshold": 1.5}, "threshold"),
        ({"threshold": 0.9, "steps": 8}, "steps"),  # LLaDA's rules: steps or a parallel rule, not both
        ({"factor": 0.5, "threshold": 0.5}, "threshold"),
        ({"block_length": 0}, "block_length"),
        ({"steps": 1, "max_tokens": 24, "block_length": 8}, "steps"),  # fewer steps than the 3 blocks
        ({"use_dual_cache": "no"}, "use_dual_cache"),
        ({"editing_threshold": 0.5}, "editing_threshold"),  # LLaDA2.1's token editing: not a bidirectional rule
        ({"minimal_topk": 2}, "minimal_topk"),
    ],
    ids=lambda value: json.dumps(value) if isinstance(value, dict) else str(value),
)
def test_invalid_dllm_fields_get_a_400_and_the_server_keeps_serving(server, client, fields, param):
    body = {"model": MODEL_NAME, "prompt": "abcde", "max_tokens": 8, **fields}
    assert_error(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30), 400, param=param)
    out = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=8, extra_body={"threshold": 0.3})
    assert out.choices[0].text == direct(server, prompt_ids(server, "abc"), 8, threshold=0.3)[0]
    assert server.stats["errors"] == 0


def test_cli_serves_the_checkpoint_with_sliced_layouts(llada_moe_dir, monkeypatch):
    """`hf-dllm serve CHECKPOINT --max-refresh-positions N` loads the LLaDA-MoE and hands N to the engine: a
    bidirectional model's layouts may be cut into slices (refused for a block-causal one)."""
    import uvicorn

    from hf_dllm.serving import server as server_module

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    argv = [str(llada_moe_dir), "--threads", "1", "--dtype", "float32", "--device", "cpu"]
    assert server_module.main([*argv, "--max-refresh-positions", "64"]) == 0
    served = apps[0].state.server
    assert type(served.model).__name__ == "LLaDAMoEModelLM"
    assert served.batcher.engine.scheduler.max_refresh_positions == 64
