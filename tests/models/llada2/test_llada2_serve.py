"""`hf-dllm serve` with a LLaDA2.x model (block-causal): completions and chat, streaming and usage equal a direct
`generate()` with the same parameters; LLaDA2's fields (`steps` with `threshold`, `minimal_topk`, LLaDA2.1's
`editing_threshold`, `max_post_steps`, `num_to_transfer`) are accepted where the protocol passes dLLM fields, and
refused for LLaDA; concurrent requests of different prompt lengths share one padded `generate()` and each gets
what it gets alone. The server runs in this process on 127.0.0.1 (see tests/serving/test_serve.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# The serve extra (fastapi, uvicorn): importing tests.serving.test_serve skips this module without it.
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hf_dllm.serving.protocol import APIError, parse_generation_params  # noqa: E402
from tests.conftest import save_checkpoint, tiny_model  # noqa: E402
from tests.models.llada2.test_llada2_integration import tiny_llada2  # noqa: E402
from tests.serving.test_serve import (  # noqa: E402
    MODEL_NAME,
    StopStringCriterion,
    assert_chat_and_its_stream_equal,
    assert_concurrent_requests_exact,
    assert_error,
    assert_streamed_completion_equals,
    chat_ids,
    early_stop_string,
    prompt_ids,
    serving,
)


@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory) -> Path:
    """A tiny random LLaDA2 with the character tokenizer, saved as a checkpoint folder."""
    return save_checkpoint(tiny_llada2(seed=2), tmp_path_factory.mktemp("llada2-tiny-random"))


server = serving("llada2_dir")


def direct(server, ids: list[int], max_tokens: int, **extra) -> tuple[str, int, int, str]:
    """(text, completion_tokens, nfe, finish_reason) of a direct generate() on one prompt with the request's fields
    (the model's generation config supplies the rest, as for the server): for a block-causal model,
    `max_new_tokens=max_tokens` (no rounding to whole blocks), and every stop token (EOS, EOT) as EOS, as the server
    passes them."""
    stops = sorted(server.app.state.server.batcher.stop_token_ids)
    out = server.model.generate(
        torch.tensor([ids]),
        eos_token_id=stops,
        return_dict_in_generate=True,
        **{**extra, "max_new_tokens": max_tokens},
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    end = next((i for i, token in enumerate(tokens) if token in stops), max_tokens)
    finish = "stop" if end < max_tokens else "length"
    return server.tokenizer.decode(tokens[:end], skip_special_tokens=True), end, int(out.nfe_per_row[0]), finish


LLADA2_FIELDS = [
    {"block_length": 4, "threshold": 0.6, "steps": 8},  # LLaDA2's rule: steps with threshold
    {"block_length": 4},  # threshold None: the schedule alone, one token per step
    {"block_length": 8, "threshold": 0.5, "editing_threshold": 0.5, "max_post_steps": 2, "num_to_transfer": 2},
    {"block_length": 4, "minimal_topk": 5, "use_cache": False},  # at most 14 // 5 = 2 steps a block
    {"block_length": 4, "threshold": 0.7, "eos_early_stop": False},
]


@pytest.mark.parametrize("extra", LLADA2_FIELDS, ids=lambda extra: ",".join(f"{k}={v}" for k, v in extra.items()))
def test_completion_equals_generate(server, client, extra):
    prompt = "The cat sat"  # 11 tokens: the first block holds the prompt's tail
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=14, extra_body=extra)
    text, tokens, nfe, finish = direct(server, prompt_ids(server, prompt), 14, **extra)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (text, finish)
    assert out.usage.prompt_tokens == len(prompt_ids(server, prompt))
    assert out.usage.completion_tokens == tokens <= 14
    assert out.usage.model_extra["nfe"] == nfe > 0


@pytest.mark.parametrize(
    "extra",
    [{"block_length": 4}, {"block_length": 4, "threshold": 0.6, "steps": 8}, {"block_length": 4, "steps": 40}],
    ids=lambda extra: ",".join(f"{k}={v}" for k, v in extra.items()),
)
def test_usage_nfe_with_an_early_stop_string_equals_generate_alone(server, extra):
    """A stop string ends each row of a two-prompt request early (prompts of other lengths: other block offsets);
    each choice's `nfe` is what generate() gives the prompt alone, stopped by an equivalent criterion."""
    stops = sorted(server.app.state.server.batcher.stop_token_ids)
    prompts = [prompt_ids(server, "The cat sat"), prompt_ids(server, "Tell me a story")]

    def alone(ids, stop=None):
        criteria = [StopStringCriterion(server.tokenizer, len(ids), stop, stops)] if stop else None
        out = server.model.generate(
            torch.tensor([ids]),
            eos_token_id=stops,
            stopping_criteria=criteria,
            return_dict_in_generate=True,
            **{**extra, "max_new_tokens": 16},
        )
        tokens = out.sequences[0, len(ids) :].tolist()
        end = next((i for i, token in enumerate(tokens) if token in stops), 16)
        text = server.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        return (text[: text.index(stop)] if stop and stop in text else text), int(out.nfe_per_row[0])

    full_text, full_nfe = alone(prompts[0])
    stop = early_stop_string(full_text)
    assert alone(prompts[0], stop)[1] < full_nfe  # the stop string really ends the row early
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 16, "stop": stop, **extra}
    out = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    for ids, choice in zip(prompts, out["choices"], strict=True):
        assert (choice["text"], choice["nfe"]) == alone(ids, stop)


def test_chat_and_streaming_equal_generate(server, client):
    messages = [{"role": "user", "content": "Tell me"}]
    extra = {"block_length": 4, "threshold": 0.6, "steps": 12}
    expected = direct(server, chat_ids(server, messages), 16, **extra)
    assert_chat_and_its_stream_equal(client, messages, 16, extra, expected, block_length=4)


def test_streamed_completion_equals_the_whole_one(server, client):
    fields = {"block_length": 4, "eos_early_stop": False, "threshold": 0.7}
    prompt = "Once upon a time"
    expected = direct(server, prompt_ids(server, prompt), 20, **fields)
    assert_streamed_completion_equals(client, prompt, expected, max_tokens=20, extra_body=fields)


def test_concurrent_requests_of_different_lengths_share_layouts(server, client):
    """Two clients at once, prompts of 2 and 11 tokens (other offsets inside a block of 4): each gets exactly what it
    gets alone, whichever block boundary each joined at; two prompts of one request decode in shared layouts."""
    prompts = ["Hi", "The cat sat"]
    fields = {"block_length": 4, "threshold": 0.6}
    expected = [direct(server, prompt_ids(server, prompt), 12, **fields) for prompt in prompts]
    assert_concurrent_requests_exact(server, client, prompts, fields, expected)
    # One request with both prompts is the same padded call: the same texts.
    shared = server.stats["layout_sizes"].get("2", 0)
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12, extra_body=fields)
    assert [choice.text for choice in out.choices] == [e[0] for e in expected]
    assert server.stats["layout_sizes"].get("2", 0) > shared


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"editing_threshold": 0.5, "steps": 8}, "steps"),  # editing sets the pace
        ({"factor": 1.0, "steps": 8}, "steps"),  # only threshold combines with steps
        ({"editing_threshold": 1.5}, "editing_threshold"),
        ({"max_post_steps": 4}, "max_post_steps"),  # editing fields without editing
        ({"num_to_transfer": 0, "editing_threshold": 0.5}, "num_to_transfer"),
        ({"minimal_topk": 9}, "minimal_topk"),  # caps a block's steps at max_tokens // minimal_topk = 0
        ({"minimal_topk": 0}, "minimal_topk"),
        ({"steps": 2, "block_length": 4}, "steps"),  # fewer steps than the prompt's blocks (it ends inside one)
    ],
    ids=lambda value: json.dumps(value) if isinstance(value, dict) else str(value),
)
def test_invalid_llada2_parameters(server, fields, param):
    body = {"model": MODEL_NAME, "prompt": "abcde", "max_tokens": 8, **fields}
    assert_error(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30), 400, param=param)


def test_server_keeps_serving_after_refused_steps(server, client):
    """`steps` is checked against each prompt's blocks before the row joins a batch: 2 steps for 8 tokens in
    blocks of 4 suit a block-aligned prompt, not one ending inside a block."""
    fields = {"steps": 2, "block_length": 4, "threshold": 0.6}
    out = client.completions.create(model=MODEL_NAME, prompt="abcd", max_tokens=8, extra_body=fields)
    assert out.choices[0].text == direct(server, prompt_ids(server, "abcd"), 8, **fields)[0]
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt=["abcd", "abcde"], max_tokens=8, extra_body=fields)
    assert error.value.status_code == 400 and "a prompt of 5 tokens decodes (3" in error.value.message
    assert server.stats["errors"] == 0


def test_steps_with_threshold_accepted_for_llada2_refused_for_llada(server):
    """The protocol's rules are the resolver's for the model's attention: LLaDA2 (block-causal) combines `steps` with
    `threshold` and takes the LLaDA2-only fields; for LLaDA (bidirectional) they are a 400 naming the field."""
    llada2, llada = server.model, tiny_model(seed=0)
    body = {"prompt": "a", "max_tokens": 10, "block_length": 4, "steps": 8, "threshold": 0.9}
    params = parse_generation_params(body, llada2, chat=False)
    assert params.config.steps == 8 and params.config.threshold == 0.9
    assert params.config.max_new_tokens == 10  # decoded as is: no rounding to whole blocks
    editing = {"prompt": "a", "max_tokens": 10, "editing_threshold": 0.5, "max_post_steps": 4, "num_to_transfer": 2}
    params = parse_generation_params(editing, llada2, chat=False)
    assert (params.config.editing_threshold, params.config.num_to_transfer) == (0.5, 2)
    assert parse_generation_params({"max_tokens": 10}, llada, False).config.max_new_tokens == 32
    for fields, param in [
        (body, "steps"),
        (editing, "editing_threshold"),
        ({"minimal_topk": 2}, "minimal_topk"),
        ({"max_post_steps": 4}, "max_post_steps"),
    ]:
        with pytest.raises(APIError) as error:
            parse_generation_params(fields, llada, chat=False)
        assert error.value.status == 400 and error.value.param == param, fields


def test_cli_refuses_slices_for_a_block_causal_model(llada2_dir, monkeypatch, capsys):
    """`--max-refresh-positions` cuts bidirectional models' layouts; a block-causal model's layouts recompute two
    blocks per row, so the option is refused with a clear message (exit 2), not ignored."""
    import uvicorn

    from hf_dllm.serving import server as server_module

    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: pytest.fail("the server started"))
    argv = [str(llada2_dir), "--threads", "1", "--dtype", "float32", "--device", "cpu"]
    assert server_module.main([*argv, "--max-refresh-positions", "4096"]) == 2
    error = capsys.readouterr().err
    assert "max_refresh_positions" in error and "block-causal" in error
