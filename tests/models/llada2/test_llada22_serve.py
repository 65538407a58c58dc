"""`hf-dllm serve` with a LLaDA2.2 model (Levenshtein editing): completions and chat, streaming and usage equal a
direct `generate()` with the same fields, with no DELETE / SPLIT text; a stream sends committed blocks only, so its
pieces add up to the whole text (nothing streamed is deleted or split later); LLaDA2.2's fields (`editing_threshold`
including 0.0, `max_post_steps`, `threshold`) pass through the protocol, the settings its rule cannot honour are a
400 naming the field, and the server keeps serving; concurrent requests of different prompt lengths each get what
they get alone. The server runs in this process on 127.0.0.1 (tests/serving/test_serve.py); the tiny model is
test_llada22_apps.py's (its DELETE / SPLIT rows scaled so that both are written).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The serve extra (fastapi, uvicorn): importing tests.serving.test_serve skips this module without it.
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hf_dllm.serving.protocol import parse_generation_params  # noqa: E402
from tests.conftest import save_checkpoint  # noqa: E402
from tests.models.llada2.test_llada2_serve import direct  # noqa: E402
from tests.models.llada2.test_llada22_apps import (  # noqa: E402
    assert_no_edit_text,
    edit_totals,
    tiny_llada22,
)
from tests.serving.test_serve import (  # noqa: E402
    MODEL_NAME,
    assert_chat_and_its_stream_equal,
    assert_concurrent_requests_exact,
    assert_error,
    assert_streamed_completion_equals,
    chat_ids,
    prompt_ids,
    serving,
)


@pytest.fixture(scope="module")
def llada22_dir(tmp_path_factory) -> Path:
    """The tiny LLaDA2.2 with the character tokenizer, saved as a checkpoint folder."""
    return save_checkpoint(tiny_llada22(), tmp_path_factory.mktemp("llada22-tiny-random"))


server = serving("llada22_dir")


def assert_edited(server, ids: list[int], max_tokens: int, **fields) -> None:
    """Decoding `ids` alone with the request's fields wrote DELETE or SPLIT (and left none in the output)."""
    stops = sorted(server.app.state.server.batcher.stop_token_ids)
    totals = edit_totals(server.model, [ids], eos_token_id=stops, **{**fields, "max_new_tokens": max_tokens})
    assert totals["deletes"] + totals["splits"] > 0, totals


LLADA22_FIELDS = [
    {"block_length": 4, "threshold": 0.6},  # editing_threshold unset: 0.0, SGLang's default
    {"block_length": 4, "threshold": 0.6, "editing_threshold": 0.0, "max_post_steps": 2},
    {"block_length": 4, "threshold": 0.7, "max_post_steps": 0},  # the final cleanup right after the last mask
    {"block_length": 8, "threshold": 0.5, "editing_threshold": 0.5, "use_cache": False},
    {"block_length": 4, "threshold": None, "eos_early_stop": False},  # the floor alone: 1 + introduced masks
]


@pytest.mark.parametrize("extra", LLADA22_FIELDS, ids=lambda extra: ",".join(f"{k}={v}" for k, v in extra.items()))
def test_completion_equals_generate(server, client, extra):
    prompt = "The cat sat"  # 11 tokens: the first block holds the prompt's tail
    ids = prompt_ids(server, prompt)
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=14, extra_body=extra)
    text, tokens, nfe, finish = direct(server, ids, 14, **extra)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (text, finish)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == tokens <= 14
    assert out.usage.model_extra["nfe"] == nfe > 0
    assert_no_edit_text(choice.text)
    if not extra.get("editing_threshold"):  # the random model's predictions never reach 0.5: no token edits there
        assert_edited(server, ids, 14, **extra)


def test_llada22_fields_pass_through_the_protocol(server):
    """`editing_threshold` 0.0 stays 0.0 (not dropped as falsy), `max_post_steps` needs no `editing_threshold`:
    LLaDA2.2's rule always edits."""
    body = {"prompt": "a", "max_tokens": 10, "threshold": 0.8, "editing_threshold": 0.0, "max_post_steps": 3}
    config = parse_generation_params(body, server.model, chat=False).config
    assert (config.threshold, config.editing_threshold, config.max_post_steps) == (0.8, 0.0, 3)
    assert config.max_new_tokens == 10  # block-causal: no rounding to whole blocks
    config = parse_generation_params({"max_tokens": 10, "max_post_steps": 0}, server.model, chat=False).config
    assert (config.editing_threshold, config.max_post_steps) == (None, 0)


def test_chat_and_streaming_equal_generate(server, client):
    messages = [{"role": "user", "content": "Tell me"}]
    extra = {"block_length": 4, "threshold": 0.6, "editing_threshold": 0.0}
    expected = direct(server, chat_ids(server, messages), 16, **extra)
    assert_chat_and_its_stream_equal(client, messages, 16, extra, expected, block_length=4)
    assert_no_edit_text(expected[0])
    assert_edited(server, chat_ids(server, messages), 16, **extra)


def test_streamed_completion_is_the_whole_one(server, client):
    """Block by block, each piece committed text: together exactly the whole completion (a piece later deleted or
    split would leave the concatenation different from it)."""
    fields = {"block_length": 4, "eos_early_stop": False, "threshold": 0.7, "max_post_steps": 2}
    prompt = "Once upon a time"
    expected = direct(server, prompt_ids(server, prompt), 20, **fields)
    chunks = assert_streamed_completion_equals(client, prompt, expected, max_tokens=20, extra_body=fields)
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(pieces) > 2 and all(len(piece) <= 4 for piece in pieces)
    assert_no_edit_text(expected[0])
    assert_edited(server, prompt_ids(server, prompt), 20, **fields)


def test_concurrent_requests_of_different_lengths(server, client):
    """Two clients at once, prompts of 2 and 11 tokens (other offsets inside a block of 4): each gets exactly what
    it gets alone, edits included."""
    prompts = ["Hi", "The cat sat"]
    fields = {"block_length": 4, "threshold": 0.6, "editing_threshold": 0.0, "max_post_steps": 2}
    expected = [direct(server, prompt_ids(server, prompt), 12, **fields) for prompt in prompts]
    assert_concurrent_requests_exact(server, client, prompts, fields, expected)
    assert_no_edit_text(*(e[0] for e in expected))
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12, extra_body=fields)
    assert [choice.text for choice in out.choices] == [e[0] for e in expected]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"editing_threshold": 1.5}, "editing_threshold"),
        ({"editing_threshold": -0.1}, "editing_threshold"),
        ({"max_post_steps": -1}, "max_post_steps"),
        ({"steps": 8}, "steps"),  # the rule has no schedule
        ({"factor": 1.0}, "factor"),
        ({"num_to_transfer": 2}, "num_to_transfer"),  # LLaDA2.1's pace
        ({"temperature": 0.5}, "temperature"),  # greedy only
        ({"remasking": "random"}, "remasking"),
    ],
    ids=lambda value: json.dumps(value) if isinstance(value, dict) else str(value),
)
def test_invalid_llada22_parameters(server, fields, param):
    body = {"model": MODEL_NAME, "prompt": "abcde", "max_tokens": 8, **fields}
    assert_error(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30), 400, param=param)


def test_server_keeps_serving_after_refused_fields(server, client):
    fields = {"block_length": 4, "threshold": 0.6}
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt="abcd", max_tokens=8, extra_body={**fields, "steps": 4})
    assert error.value.status_code == 400 and "Levenshtein" in error.value.message
    out = client.completions.create(model=MODEL_NAME, prompt="abcd", max_tokens=8, extra_body=fields)
    assert out.choices[0].text == direct(server, prompt_ids(server, "abcd"), 8, **fields)[0]
    assert server.stats["errors"] == 0
