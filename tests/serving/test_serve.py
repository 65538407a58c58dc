"""`hf-dllm serve`: the OpenAI-compatible server, through the official `openai` client on 127.0.0.1.

"Correct" means: the text, usage and NFE a request gets are exactly those of a direct `model.generate()` on the
same prompt and parameters (rows of a padded batch never influence each other). The server here runs in this
process (uvicorn in a thread, free loopback port); one test starts the real `hf-dllm serve` command.
"""

from __future__ import annotations

import ast
import gc
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import FIXTURES, ROOT, save_checkpoint, tiny_model

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import hf_dllm.serving.server as server_module  # noqa: E402
from hf_dllm.serving.batching import Batcher, RowRequest  # noqa: E402
from hf_dllm.serving.engine import JOIN_LAYOUT_MIN_ROWS, ContinuousBatcher  # noqa: E402
from hf_dllm.serving.protocol import APIError, parse_generation_params  # noqa: E402
from hf_dllm.serving.server import create_app, frozen_heap, load_model  # noqa: E402

MODEL_NAME = "tiny"
TRAINED_DIR = FIXTURES / "llada-tiny-trained"
EOS, EOT = 0, 2  # character tokenizer ids
REPO = ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A generation_config.json whose settings differ from DiffusionGenerationConfig's defaults (block 32, 128 tokens, one
# token per step); its EOS ids are the tokenizer's stop tokens (EOS and EOT), as the tiny trained checkpoint's.
CHECKPOINT_SETTINGS = dict(block_length=8, max_new_tokens=24, threshold=0.9, eos_token_id=[EOS, EOT])


@pytest.fixture(scope="module")
def model_dir_with_settings(tmp_path_factory) -> Path:
    """The tiny random LLaDA with a generation_config.json of its own (`CHECKPOINT_SETTINGS`)."""
    path = tmp_path_factory.mktemp("llada-tiny-settings")
    model = tiny_model(seed=0)
    for name, value in CHECKPOINT_SETTINGS.items():
        setattr(model.generation_config, name, value)
    return save_checkpoint(model, path)


class RunningServer:
    def __init__(self, model_dir: Path, **app_kwargs):
        self.model, self.tokenizer = load_model(str(model_dir), dtype="float32", device="cpu")
        self.app = create_app(self.model, self.tokenizer, model_name=MODEL_NAME, **app_kwargs)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # timeout_keep_alive: the tests hold keep-alive connections across steps that a loaded 2-core machine can
        # stall for more than uvicorn's 5 s idle limit (a closed idle connection is not what they check).
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", timeout_keep_alive=60
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start within 30 s"
            time.sleep(0.02)

    @property
    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()["batching"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def serving(checkpoint: str, **app_kwargs):
    """A module fixture: a `RunningServer` on the checkpoint folder the fixture named `checkpoint` gives, stopped
    when the module is done (`tests.conftest.client` is its OpenAI client). A long batching window by default:
    concurrent requests are decoded in one generate() call."""

    @pytest.fixture(scope="module")
    def server(request):
        running = RunningServer(request.getfixturevalue(checkpoint), **{"max_batch_size": 8, **app_kwargs})
        yield running
        running.stop()

    return server


server = serving("model_dir")


@pytest.fixture(scope="module")
def load_server(server):
    """The load test's server: the tiny trained checkpoint when it exists, else the tiny random one."""
    if not (TRAINED_DIR / "config.json").exists():
        yield server
        return
    running = RunningServer(TRAINED_DIR, max_batch_size=8)
    yield running
    running.stop()


def generate_kwargs(model, max_tokens: int | None = None, **extra) -> dict:
    """The generate() fields a request with these fields names: the request's own fields only (the checkpoint's
    generation_config.json supplies the rest), and with `max_tokens` the decoded length, rounded up to whole
    blocks of the resolved `block_length`."""
    kwargs = dict(extra)
    if max_tokens is not None:
        block = model.resolve_generation_config(**extra).block_length
        kwargs["max_new_tokens"] = math.ceil(max_tokens / block) * block
    return kwargs


def settings(model, max_tokens: int | None = None, **extra):
    """The resolved settings the server decodes such a request with (a `RowRequest`'s `generation_config`)."""
    return model.resolve_generation_config(**generate_kwargs(model, max_tokens, **extra))


def direct(server, prompt_ids: list[int], max_tokens: int | None = None, **extra) -> tuple[str, int, int, str]:
    """(text, completion_tokens, nfe, finish_reason) of a direct model.generate() on one prompt."""
    stops = sorted(server.app.state.server.batcher.stop_token_ids)  # EOS and EOT
    out = server.model.generate(
        torch.tensor([prompt_ids]),
        eos_token_id=stops,  # generate() stops a row at EOT as well, as the server does
        return_dict_in_generate=True,
        **generate_kwargs(server.model, max_tokens, **extra),
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    if max_tokens is None:
        max_tokens = len(tokens)
    ends = [i for i, t in enumerate(tokens) if t in stops]
    end = min([max_tokens] + ends[:1])
    finish = "stop" if ends and ends[0] < max_tokens else "length"
    return server.tokenizer.decode(tokens[:end], skip_special_tokens=True), end, int(out.nfe_per_row[0]), finish


def assert_chat_and_its_stream_equal(client, messages, max_tokens: int, fields: dict, expected, block_length: int):
    """The chat completion and its stream both give `expected` = `direct(...)`'s (text, completion_tokens, nfe,
    finish_reason): the stream opens with the assistant role, sends one chunk per committed block (at most
    `block_length` characters with the character tokenizer), one finish reason, and usage in a last chunk without
    choices."""
    text, tokens, nfe, finish = expected
    request = dict(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, extra_body=fields)
    out = client.chat.completions.create(**request)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (text, finish)
    assert (out.usage.completion_tokens, out.usage.model_extra["nfe"]) == (tokens, nfe)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(content) == text and all(len(piece) <= block_length for piece in content)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == tokens
    assert chunks[-1].usage.model_extra["nfe"] == nfe


def assert_streamed_completion_equals(client, prompt: str, expected, **request) -> list:
    """A streamed completion of `prompt` gives `expected` = `direct(...)`'s (text, completion_tokens, nfe,
    finish_reason), its finish reason and usage in one final chunk. Returns the chunks."""
    text, tokens, nfe, finish = expected
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True, **request))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == finish
    assert (final[0].usage.completion_tokens, final[0].usage.model_extra["nfe"]) == (tokens, nfe)
    return chunks


def assert_concurrent_requests_exact(server, client, prompts: list[str], fields: dict, expected: list) -> None:
    """One client per prompt, all at once, 12 tokens each: each gets exactly `expected[i]` = `direct(...)`'s (text,
    completion_tokens, nfe, finish_reason) of the prompt alone, whichever block boundary it joined at (the run
    counts a row's forwards only while the row still decodes: the NFE it has alone); no error."""
    before = server.stats

    def ask(prompt):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, extra_body=fields)

    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(ask, prompts, timeout=120))
    after = server.stats
    for out, (text, tokens, nfe, finish) in zip(outs, expected, strict=True):
        choice = out.choices[0]
        assert (choice.text, choice.finish_reason, out.usage.completion_tokens) == (text, finish, tokens)
        assert out.usage.model_extra["nfe"] == nfe
    assert after["rows"] - before["rows"] == len(prompts)
    assert after["errors"] == before["errors"]


def prompt_ids(server, prompt: str) -> list[int]:
    return list(server.tokenizer(prompt)["input_ids"])


def chat_ids(server, messages) -> list[int]:
    encoded = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


# -- endpoints ---------------------------------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [model.id for model in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["max_batch_positions"] is None  # no K/V budget off CUDA by default


def test_the_heap_is_frozen_while_an_app_serves(model_dir, server, monkeypatch):
    """While an app serves, the objects of its start-up are frozen (no full collection walks them); the last app
    to stop unfreezes them, and one stopping while another serves does not."""
    assert gc.get_freeze_count() > 0  # the module's server runs
    # Whether the heap was unfrozen is asked of gc.unfreeze itself: the freeze count alone cannot say, since a frozen
    # object freed by reference counting leaves it (CI once saw 779,322 -> 779,320 with no unfreeze).
    unfreezes = []
    monkeypatch.setattr(gc, "unfreeze", lambda: unfreezes.append(True))
    second = RunningServer(model_dir, max_batch_size=2)
    second.stop()
    assert unfreezes == [] and gc.get_freeze_count() > 0


def test_frozen_heap_unfreezes_when_the_last_app_stops():
    serving, server_module._serving_apps = server_module._serving_apps, 0
    gc.unfreeze()
    try:
        with frozen_heap():
            assert gc.get_freeze_count() > 0
            with frozen_heap():
                pass
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
    finally:
        server_module._serving_apps = serving
        if serving:
            gc.freeze()


def test_completion_equals_generate(server, client):
    out = client.completions.create(
        model=MODEL_NAME, prompt="The cat sat", max_tokens=40, extra_body={"block_length": 16}
    )
    text, tokens, nfe, finish = direct(server, prompt_ids(server, "The cat sat"), 40, block_length=16)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (text, finish)
    assert out.usage.prompt_tokens == len(prompt_ids(server, "The cat sat"))
    assert out.usage.completion_tokens == tokens <= 40
    assert out.usage.total_tokens == out.usage.prompt_tokens + tokens
    assert out.usage.model_extra["nfe"] == nfe > 0


def test_default_parameters(server, client):
    """No dLLM field: the model's generation config (this checkpoint has no generation_config.json: the library's
    defaults, 128 tokens in blocks of 32, one token per step)."""
    out = client.completions.create(model=MODEL_NAME, prompt="abc")
    text, tokens, nfe, _ = direct(server, prompt_ids(server, "abc"))
    assert out.choices[0].text == text and out.usage.completion_tokens == tokens
    assert out.usage.model_extra["nfe"] == nfe


def test_chat_equals_generate(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32)
    text, tokens, nfe, finish = direct(server, chat_ids(server, messages), 32)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (text, finish)
    assert out.usage.prompt_tokens == len(chat_ids(server, messages))
    assert (out.usage.completion_tokens, out.usage.model_extra["nfe"]) == (tokens, nfe)


@pytest.mark.parametrize(
    "extra",
    [
        {"threshold": 0.5},
        {"factor": 1.0},
        {"use_cache": False},
        {"use_dual_cache": False},
        {"steps": 8, "block_length": 8},
        {"remasking": "random", "steps": 16},
        {"cfg_scale": 1.0, "use_cache": False},
        {"eos_early_stop": False},
    ],
    ids=lambda extra: ",".join(f"{k}={v}" for k, v in extra.items()),
)
def test_dllm_parameters_through_extra_body(server, client, extra):
    out = client.completions.create(model=MODEL_NAME, prompt="x = 1 + ", max_tokens=16, extra_body=extra)
    reference = dict(extra)
    if "use_dual_cache" in reference:
        reference["dual_cache"] = reference.pop("use_dual_cache")
    if extra.get("remasking") == "random":  # random remasking draws from torch's RNG: compare lengths only
        assert out.usage.completion_tokens <= 16 and out.usage.model_extra["nfe"] > 0
        return
    text, tokens, nfe, _ = direct(server, prompt_ids(server, "x = 1 + "), 16, **reference)
    assert out.choices[0].text == text
    assert (out.usage.completion_tokens, out.usage.model_extra["nfe"]) == (tokens, nfe)


def test_several_prompts_in_one_request(server, client):
    prompts = ["one", "two two", "three three three"]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=16)
    assert [c.index for c in out.choices] == [0, 1, 2]
    expected = [direct(server, prompt_ids(server, p), 16) for p in prompts]
    assert [c.text for c in out.choices] == [e[0] for e in expected]
    assert out.usage.model_extra["nfe"] == sum(e[2] for e in expected)


def test_stop_strings(server, client):
    full, _, _, _ = direct(server, prompt_ids(server, "Hello"), 32)
    assert len(full) > 4
    stop = full[3:5]
    cut = full[: full.index(stop)]
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=32, stop=[stop, "never-there"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    assert out.usage.completion_tokens == len(cut)  # character tokenizer: one token per character
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=32, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut


# -- usage.nfe: what the run made for the row, equal to generate() on the prompt alone ----------------------------


class StopStringCriterion:
    """A stopping criterion that ends a row once its text (cut at the first stop token) holds `stop`: what the
    server's stop strings do, for a direct generate()."""

    def __init__(self, tokenizer, prompt_len: int, stop: str, stop_ids):
        self.tokenizer, self.prompt_len, self.stop, self.stop_ids = tokenizer, prompt_len, stop, set(stop_ids)

    def __call__(self, input_ids, scores=None):
        found = []
        for row in input_ids[:, self.prompt_len :].tolist():
            end = next((i for i, token in enumerate(row) if token in self.stop_ids), len(row))
            found.append(self.stop in self.tokenizer.decode(row[:end], skip_special_tokens=True))
        return torch.tensor(found)


def alone(server, ids: list[int], max_tokens: int | None, stop: str | None = None, **fields):
    """(text, completion_tokens, nfe, finish_reason) of generate() on one prompt with the request's fields, stopped at
    the stop tokens (as EOS) and, with `stop`, once the text holds it."""
    model, tokenizer = server.model, server.tokenizer
    stops = sorted(server.app.state.server.batcher.stop_token_ids)
    criteria = [StopStringCriterion(tokenizer, len(ids), stop, stops)] if stop else None
    out = model.generate(
        torch.tensor([ids]),
        eos_token_id=stops,
        stopping_criteria=criteria,
        return_dict_in_generate=True,
        **generate_kwargs(model, max_tokens, **fields),
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    cap = len(tokens) if max_tokens is None else max_tokens
    end = min([cap] + [i for i, token in enumerate(tokens) if token in stops][:1])
    text = tokenizer.decode(tokens[:end], skip_special_tokens=True)
    finish = "stop" if end < cap else "length"
    if stop and stop in text:
        text, finish = text[: text.index(stop)], "stop"
        end = len(text)  # character tokenizer: one token per character
    return text, end, int(out.nfe_per_row[0]), finish


def early_stop_string(text: str) -> str:
    """A one-character stop string first found past the first third of `text` (so that it stops the row after a
    later block than the first, and before the last)."""
    for i in range(len(text) // 3, len(text)):
        if text[i] not in text[:i]:
            return text[i]
    raise AssertionError(f"no character of {text!r} appears first past its first third")


NFE_SETTINGS = [
    {"block_length": 8, "steps": 8},  # a fixed schedule, 2 steps a block
    {"block_length": 8, "steps": 96},  # more steps than positions: the run skips those that commit nothing
    {"block_length": 8, "threshold": 0.5},
    {"block_length": 8, "factor": 1.0},
    {"block_length": 8, "eos_early_stop": False},
]


@pytest.mark.parametrize("stop", [False, True], ids=["to-the-end", "stop-string"])
@pytest.mark.parametrize("fields", NFE_SETTINGS, ids=lambda fields: ",".join(f"{k}={v}" for k, v in fields.items()))
def test_usage_nfe_equals_generate_alone(server, client, fields, stop):
    """Two prompts in one request (one batched run): each choice's `nfe` and text are what generate() gives the
    prompt alone, also when a stop string ends a row early (the server stops it; generate() with an equivalent
    stopping criterion does too). Before the run owned these facts, the server counted a fixed schedule's planned
    steps: `steps=96` reported 24 forwards a block for blocks that took 8."""
    prompts = [prompt_ids(server, "Tell me a story"), prompt_ids(server, "The cat sat")]
    stop_string = None
    if stop:
        full_text, _, full_nfe, _ = alone(server, prompts[0], 32, **fields)
        stop_string = early_stop_string(full_text)
        stopped_nfe = alone(server, prompts[0], 32, stop_string, **fields)[2]
        assert stopped_nfe < full_nfe  # the stop string really ends the row early
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 32, **fields}
    if stop_string:
        body["stop"] = stop_string
    out = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    for ids, choice in zip(prompts, out["choices"], strict=True):
        text, tokens, nfe, finish = alone(server, ids, 32, stop_string, **fields)
        assert (choice["text"], choice["finish_reason"], choice["nfe"]) == (text, finish, nfe)
    assert out["usage"]["nfe"] == sum(alone(server, ids, 32, stop_string, **fields)[2] for ids in prompts)


@pytest.mark.parametrize("fields", [{}, {"block_length": 8, "steps": 96}, {"block_length": 8, "steps": 32}])
def test_usage_nfe_when_eos_ends_the_row(load_server, fields):
    """The tiny trained model writes EOS in its first block: the row ends there (eos_early_stop), and `nfe` is the
    forwards of that block only (8 with `steps=96`, which the server used to report as 24)."""
    server = load_server
    ids = prompt_ids(server, "The cat sat")
    text, tokens, nfe, finish = alone(server, ids, 32, **fields)
    assert finish == "stop" and nfe <= 8
    body = {"model": MODEL_NAME, "prompt": "The cat sat", "max_tokens": 32, **fields}
    out = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"], out["usage"]["completion_tokens"]) == (text, finish, tokens)
    assert choice["nfe"] == out["usage"]["nfe"] == nfe


# -- a request with no dLLM field is generate() with no keyword -----------------------------------------------------


settings_server = serving("model_dir_with_settings")


def test_default_request_equals_generate_without_kwargs(settings_server):
    """No dLLM field and no max_tokens: the checkpoint's generation_config.json decides (block 8, 24 tokens,
    threshold 0.9, not the library's block 32, 128 tokens, one token per step), and the completion and NFE are
    those of `model.generate(prompt)` with no keyword, for completions, several prompts and chat."""
    server = settings_server
    model, tokenizer = server.model, server.tokenizer
    assert {name: getattr(model.generation_config, name) for name in CHECKPOINT_SETTINGS} == CHECKPOINT_SETTINGS
    stops = set(server.app.state.server.batcher.stop_token_ids)
    assert stops == set(model.generation_config.eos_token_ids)

    def expected(ids):
        out = model.generate(torch.tensor([ids]), return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids) :].tolist()
        assert len(tokens) == 24
        end = next((i for i, token in enumerate(tokens) if token in stops), len(tokens))
        text = tokenizer.decode(tokens[:end], skip_special_tokens=True)
        return text, end, int(out.nfe_per_row[0]), "stop" if end < len(tokens) else "length"

    prompts = ["Tell me a story", "x = 1 + ", "abc"]
    out = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompts}, timeout=120
    ).json()
    for prompt, choice in zip(prompts, out["choices"], strict=True):
        text, tokens, nfe, finish = expected(prompt_ids(server, prompt))
        assert (choice["text"], choice["finish_reason"], choice["nfe"]) == (text, finish, nfe)
        assert nfe <= 24  # the checkpoint's 24 tokens, not the library's 128 (one token per step: 128 forwards)
    assert out["usage"]["completion_tokens"] == sum(expected(prompt_ids(server, p))[1] for p in prompts)
    messages = [{"role": "user", "content": "Hi there"}]
    out = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages}, timeout=120
    ).json()
    text, tokens, nfe, finish = expected(chat_ids(server, messages))
    assert (out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]) == (text, tokens)
    assert out["usage"]["nfe"] == nfe
    # Naming a field changes only that field: block 4 over the checkpoint's 24 tokens and threshold 0.9.
    ids = prompt_ids(server, "abc")
    out = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "abc", "block_length": 4},
        timeout=120,
    ).json()
    direct_out = model.generate(torch.tensor([ids]), block_length=4, return_dict_in_generate=True)
    assert out["usage"]["nfe"] == int(direct_out.nfe_per_row[0])


# -- streaming ---------------------------------------------------------------------------------------------------


def test_streaming_completion_one_chunk_per_block(server, client):
    full = client.completions.create(
        model=MODEL_NAME, prompt="Once", max_tokens=40, extra_body={"block_length": 8, "eos_early_stop": False}
    )
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="Once",
            max_tokens=40,
            stream=True,
            extra_body={"block_length": 8, "eos_early_stop": False},
        )
    )
    content = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(final) == 1 and final[0].choices[0].finish_reason == full.choices[0].finish_reason
    text = full.choices[0].text
    # Blocks of 8 tokens up to the end of the text (an EOS ends the stream after its block).
    assert len(content) == min(5, full.usage.completion_tokens // 8 + 1)
    assert all(len(c.choices[0].text) <= 8 for c in content)
    assert "".join(c.choices[0].text for c in content) == text
    assert final[0].usage.completion_tokens == full.usage.completion_tokens
    assert final[0].usage.model_extra["nfe"] == full.usage.model_extra["nfe"]
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"


def test_streaming_chat(server, client):
    messages = [{"role": "user", "content": "Tell me"}]
    expected = direct(server, chat_ids(server, messages), 48, block_length=16)
    assert_chat_and_its_stream_equal(client, messages, 48, {"block_length": 16}, expected, block_length=16)


def test_raw_sse_ends_with_done(server):
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 8, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] <= 8


def sse_events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60, json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("include_usage", [True, False])
def test_usage_is_sent_once_per_stream(server, include_usage):
    """With `stream_options.include_usage` usage comes once, in OpenAI's last chunk with no choices (it used to
    come in the last finish chunk as well); without it, once, in the last finish chunk."""
    body = {"model": MODEL_NAME, "prompt": ["one", "two two"], "max_tokens": 16, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    events = sse_events(server, body)
    with_usage = [event for event in events if event.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is events[-1]
    if include_usage:
        assert events[-1]["choices"] == []
    else:
        assert events[-1]["choices"][0]["finish_reason"] is not None
    expected = [direct(server, prompt_ids(server, p), 16) for p in ["one", "two two"]]
    usage = with_usage[0]["usage"]
    assert usage["completion_tokens"] == sum(e[1] for e in expected)
    assert usage["nfe"] == sum(e[2] for e in expected)


# -- errors --------------------------------------------------------------------------------------------------------


def assert_error(response, status: int, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code


def test_malformed_json(server):
    url = f"{server.base_url}/v1/completions"
    response = httpx.post(url, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
    assert_error(response, 400, code="invalid_json")
    json_type = {"content-type": "application/json"}
    assert_error(httpx.post(url, content=b"[1, 2]", headers=json_type), 400, code="invalid_json")
    # A body not declared as JSON is refused unread (tests/serving/test_hostile.py has the other content types).
    assert_error(httpx.post(url, content=b"[1, 2]"), 415, code="unsupported_media_type")


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt="a", max_tokens=4)
    assert error.value.status_code == 404 and error.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"threshold": 1.5}, "threshold"),
        ({"threshold": 0.9, "factor": 1.0}, "threshold"),
        ({"threshold": 0.9, "steps": 32}, "steps"),
        ({"factor": -1}, "factor"),
        ({"block_length": 0}, "block_length"),
        ({"steps": 1, "max_tokens": 64}, "steps"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"remasking": "sideways"}, "remasking"),
        ({"use_cache": "yes"}, "use_cache"),
        ({"use_dual_cache": 1}, "use_dual_cache"),
        ({"cfg_scale": -0.5}, "cfg_scale"),
        ({"n": 2}, "n"),
        ({"top_p": 0.5}, "top_p"),
        ({"stop": 3}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2, 999]]}, "prompt"),
        ({"frobnicate": True}, "frobnicate"),
    ],
    ids=lambda value: json.dumps(value) if isinstance(value, dict) else str(value),
)
def test_invalid_parameters(server, fields, param):
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 8, **fields}
    assert_error(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30), 400, param=param)


def test_invalid_parameters_through_openai_client(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "a"}], extra_body={"threshold": 0}
        )
    assert error.value.status_code == 400 and "threshold" in error.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[])


def test_prompt_too_long(server, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt="a" * 500, max_tokens=64)
    assert error.value.code == "context_length_exceeded"
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 1000}
    assert_error(
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30),
        400,
        param="prompt",
        code="context_length_exceeded",
    )


def test_unknown_route_is_an_openai_error(server):
    response = httpx.get(f"{server.base_url}/v1/engines", timeout=10)
    assert response.status_code == 404 and "error" in response.json()


def test_server_keeps_serving_after_errors(server, client):
    for _ in range(3):
        httpx.post(f"{server.base_url}/v1/completions", content=b"{", timeout=10)
        httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "a", "block_length": -1}, timeout=10)
    out = client.completions.create(model=MODEL_NAME, prompt="still here", max_tokens=8)
    assert out.choices[0].text == direct(server, prompt_ids(server, "still here"), 8)[0]


def test_bad_requests_get_a_4xx_while_the_server_serves_others(server):
    """Bad requests sent at the same time as good ones (same batching window): each bad one gets its 400 naming
    the field before it is batched, and no good request is failed with it or lost."""
    good = [("one", 16), ("two two", 16), ("three", 8), ("four", 16)]
    bad = [
        ({"threshold": 1.5}, "threshold"),
        ({"steps": 1, "max_tokens": 64}, "steps"),
        ({"minimal_topk": 2}, "minimal_topk"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"block_length": -1}, "block_length"),
        ({"temperature": "hot"}, "temperature"),
    ]
    before = server.stats

    def ask(job):
        kind, payload = job
        if kind == "good":
            prompt, max_tokens = payload
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
        else:
            body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 8, **payload[0]}
        return kind, payload, httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)

    jobs = [("bad", b) for b in bad[:3]] + [("good", g) for g in good] + [("bad", b) for b in bad[3:]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(ask, jobs, timeout=120))
    for kind, payload, response in replies:
        if kind == "bad":
            assert_error(response, 400, param=payload[1])
        else:
            prompt, max_tokens = payload
            text, tokens, nfe, finish = direct(server, prompt_ids(server, prompt), max_tokens)
            choice = response.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"], choice["nfe"]) == (text, finish, nfe)
    after = server.stats
    assert after["errors"] == before["errors"] and after["rows"] - before["rows"] == len(good)


def test_cancelled_row_is_stopped_and_its_partner_is_served(model_dir):
    """Two rows decoding together; the first one's client goes away after its first block: that row leaves the
    batch there (no more forwards, no result), and its partner gets exactly what generate() gives it alone."""
    model, tokenizer = load_model(str(model_dir), dtype="float32", device="cpu")
    batcher = Batcher(model, tokenizer, stop_token_ids={EOS, EOT}, max_batch_size=2)
    config = settings(model, 32, block_length=8, eos_early_stop=False)
    events: dict[str, list] = {"gone": [], "kept": []}
    rows = {}

    def sink(name):
        def receive(event):
            events[name].append(event)
            if name == "gone" and event[0] == "delta":
                rows["gone"].cancelled.set()  # the client disconnects after its first block

        return receive

    rows["gone"] = RowRequest([5, 6, 7], config, 32, sink("gone"), stream=True, index=0)
    rows["kept"] = RowRequest([8, 9], config, 32, sink("kept"), stream=True, index=1)
    for row in rows.values():
        batcher._enqueue(row)
    while batcher.engine.has_work():
        batcher.decode_boundary()
    assert [event[0] for event in events["gone"]] == ["delta"]  # nothing after it left
    kept = [event for event in events["kept"] if event[0] == "done"]
    assert len(kept) == 1 and [event[0] for event in events["kept"]].count("delta") == 4
    alone_out = model.generate(
        torch.tensor([[8, 9]]),
        return_dict_in_generate=True,
        **generate_kwargs(model, 32, block_length=8, eos_early_stop=False),
    )
    tokens = alone_out.sequences[0, 2:].tolist()
    end = next((i for i, token in enumerate(tokens) if token in (EOS, EOT)), 32)
    assert kept[0][2].text == tokenizer.decode(tokens[:end], skip_special_tokens=True)
    assert kept[0][2].nfe == int(alone_out.nfe_per_row[0]) == 32
    records = {record["index"]: record for record in batcher.stats.records}
    assert records[0]["cancelled"] and records[0]["nfe"] == 8  # stopped after its first block of 8 steps
    assert not records[1]["cancelled"] and records[1]["nfe"] == 32
    assert batcher.stats.snapshot()["forwards"] == 32 and batcher.stats.cancelled_rows == 1
    assert batcher.stats.snapshot()["layout_sizes"] == {"2": 1, "1": 3}


# -- disconnects, batching -----------------------------------------------------------------------------------------


def test_disconnect_mid_stream_stops_the_row(server, client):
    """A streaming client that goes away after one block: its row stops costing forwards at the next block."""
    before = server.stats
    fields = {"max_tokens": 256, "block_length": 16, "eos_early_stop": False}
    full_nfe = 256  # one token per step, 16 blocks
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL_NAME, "prompt": "long story", "stream": True, **fields},
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # first committed block received; close the connection
    deadline = time.monotonic() + 60
    while server.stats["cancelled_rows"] == before["cancelled_rows"]:
        assert time.monotonic() < deadline, "the disconnected row was never stopped"
        time.sleep(0.05)
    records = [r for r in server.app.state.server.batcher.stats.records if r["cancelled"]]
    assert records[-1]["nfe"] < full_nfe
    # The slot is free: later requests are served, and correctly.
    out = client.completions.create(model=MODEL_NAME, prompt="after", max_tokens=16)
    assert out.choices[0].text == direct(server, prompt_ids(server, "after"), 16)[0]


def test_a_short_request_joins_a_running_long_one_and_leaves_first(model_dir):
    """A request that arrives while a long one decodes joins it at the next block boundary (it does not wait for
    the long one to end) and leaves as soon as it is done."""
    model, tokenizer = load_model(str(model_dir), dtype="float32", device="cpu")
    batcher = Batcher(model, tokenizer, stop_token_ids={EOS, EOT}, max_batch_size=4)
    finished = []
    done = threading.Event()

    def sink(name):
        def receive(event):
            if event[0] in ("done", "error"):
                finished.append((name, event[0]))
                if len(finished) == 2:
                    done.set()

        return receive

    batcher.start()
    try:
        long_config = settings(model, 384, block_length=32, eos_early_stop=False)
        long_row = RowRequest([5, 6, 7], long_config, 384, sink("long"))
        # The same settings but max_new_tokens: the short row shares the long one's layout.
        short_row = RowRequest([8, 9], settings(model, 32, block_length=32, eos_early_stop=False), 32, sink("short"))
        batcher.submit([long_row])
        time.sleep(0.05)
        batcher.submit([short_row])
        assert done.wait(120)
    finally:
        batcher.stop()
    assert finished == [("short", "done"), ("long", "done")]
    sizes = batcher.stats.snapshot()["layout_sizes"]
    assert sizes.get("2") == 1 and sum(sizes.values()) == 12  # one block together; 12 blocks of the long row


def test_a_row_submitted_during_a_sliced_boundary_joins_it_and_is_delivered(model_dir):
    """With slices (`--max-refresh-positions`), a row the server receives while a boundary runs is handed to the
    engine between two slices (`Batcher._intake`), decodes its first block in that boundary, and, a one-block row,
    is delivered and forgotten there (no tracker left); its text is `generate()`'s alone."""
    model, tokenizer = load_model(str(model_dir), dtype="float32", device="cpu")
    engine = ContinuousBatcher(model, max_batch_size=4, max_refresh_positions=16, join_layout_min_rows=None)
    batcher = Batcher(model, tokenizer, stop_token_ids={EOS, EOT}, engine=engine)
    events: dict[str, list] = {"long0": [], "long1": [], "short": []}

    def sink(name):
        return events[name].append

    for i in range(2):  # canvases of 35 positions: a slice each
        batcher._enqueue(RowRequest([5 + i, 6, 7], settings(model, 32, block_length=8), 32, sink(f"long{i}")))
    short = RowRequest([8, 9], settings(model, 8, block_length=8), 8, sink("short"))
    intake = engine.intake
    arrivals = [short]

    def arriving():  # the client's request comes in while the first slice decodes
        if arrivals:
            batcher.submit([arrivals.pop()])
        intake()

    engine.intake = arriving
    batcher.decode_boundary()
    assert [event[0] for event in events["short"]] == ["done"] and not arrivals
    assert len(batcher._trackers) == 2  # the long rows' only
    while engine.has_work():
        batcher.decode_boundary()
    out = model.generate(
        torch.tensor([[8, 9]]), return_dict_in_generate=True, **generate_kwargs(model, 8, block_length=8)
    )
    tokens = out.sequences[0, 2:].tolist()
    end = next((i for i, token in enumerate(tokens) if token in (EOS, EOT)), 8)
    assert events["short"][0][2].text == tokenizer.decode(tokens[:end], skip_special_tokens=True)
    assert not batcher._trackers and all(events[f"long{i}"][-1][0] == "done" for i in range(2))


def test_load_32_concurrent_clients(load_server):
    """32 clients at once (half streaming, two parameter groups): every answer exact and complete, none lost."""
    server = load_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [f"question {i}: " + "xyz"[: i % 3 + 1] * (i % 4 + 1) for i in range(8)]
    groups = [{"block_length": 16}, {"block_length": 16, "threshold": 0.7}]
    expected = {
        (p, g): direct(server, prompt_ids(server, prompts[p]), 32, **groups[g]) for p in range(8) for g in range(2)
    }
    before = server.stats

    def one_client(i: int):
        p, g, stream = i % 8, (i // 8) % 2, i % 2 == 1
        kwargs = dict(model=MODEL_NAME, prompt=prompts[p], max_tokens=32, extra_body=groups[g])
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
            return i, text, final[0].choices[0].finish_reason, final[0].usage
        out = client.completions.create(**kwargs)
        return i, out.choices[0].text, out.choices[0].finish_reason, out.usage

    start = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one_client, range(32), timeout=120))
    elapsed = time.monotonic() - start
    assert sorted(r[0] for r in results) == list(range(32))  # none lost
    for i, text, finish, usage in results:
        group = (i // 8) % 2
        want_text, want_tokens, want_nfe, want_finish = expected[(i % 8, group)]
        assert (text, finish) == (want_text, want_finish), f"client {i}"
        assert usage.completion_tokens == want_tokens, f"client {i}"
        # The run counts a row's forwards only while its rule still has work in the block (a row done early
        # under a confidence rule is computed with its partners but not counted): the NFE it has alone.
        assert usage.model_extra["nfe"] == want_nfe, f"client {i}"
    after = server.stats
    layouts, rows = after["layouts"] - before["layouts"], after["rows"] - before["rows"]
    assert rows == 32 and after["errors"] == 0
    assert after["mean_rows_per_layout"] > 1, "no request was decoded with another"
    print(f"\n32 clients: {32 / elapsed:.1f} requests/s, {layouts} layouts decoded")


# -- protocol and packaging -----------------------------------------------------------------------------------------


def test_parse_resolves_only_the_named_fields(server, model_dir_with_settings):
    """The protocol applies no defaults of its own: a request's settings are `resolve_generation_config` of the
    fields it named, over the checkpoint's generation_config.json; `max_tokens` rounds up to whole blocks."""
    model = server.model
    params = parse_generation_params({"prompt": "a"}, model, chat=False)
    assert params.fields == {} and params.stop == () and not params.stream
    assert params.config.to_dict() == model.resolve_generation_config().to_dict()
    assert params.max_tokens == params.config.max_new_tokens == 128
    params = parse_generation_params({"max_tokens": 40, "temperature": 0.5, "use_dual_cache": False}, model, False)
    assert params.max_tokens == 40 and params.config.max_new_tokens == 64
    assert params.config.do_sample and not params.config.dual_cache  # the resolver's temperature -> do_sample
    with pytest.raises(APIError) as error:
        parse_generation_params({"dual_cache": True, "use_dual_cache": False}, model, False)
    assert error.value.param == "dual_cache"
    # A checkpoint whose generation_config.json differs from the library's defaults.
    custom, _ = load_model(str(model_dir_with_settings), dtype="float32", device="cpu")
    params = parse_generation_params({"prompt": "a"}, custom, chat=False)
    config = params.config
    assert (config.block_length, config.max_new_tokens, config.threshold, config.steps) == (8, 24, 0.9, None)
    assert params.max_tokens == 24
    params = parse_generation_params({"max_tokens": 10, "steps": 16}, custom, chat=False)
    # Naming one decoding rule replaces the checkpoint's; the block length is still the checkpoint's.
    assert (params.config.threshold, params.config.steps, params.config.max_new_tokens) == (None, 16, 16)
    with pytest.raises(APIError) as error:
        parse_generation_params({"max_tokens": 10, "steps": 16, "threshold": 0.5}, custom, chat=False)
    assert error.value.param == "steps"


def test_web_framework_imported_only_inside_serve():
    """`import hf_dllm` never needs fastapi/uvicorn: no module imports them at module level (serve.py does it
    inside its functions), so the `serve` extra stays optional."""
    web = {"fastapi", "uvicorn", "starlette"}
    for path in sorted((REPO / "hf_dllm").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not {name.split(".")[0] for name in names} & web, f"{path.name} imports {names} at module level"


def test_cli_serve_help_prints_the_defaults(capsys):
    """`hf-dllm serve --help` prints every option with its default (argparse formats each help with `%`)."""
    from hf_dllm.serving.server import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "60 % of the GPU's free memory, at most 128; elsewhere 16" in text


def wait_until_healthy(process: subprocess.Popen, port: int, timeout: float = 90) -> None:
    """Wait until the `hf-dllm serve` command `process` answers /health on `port`; fail with its output if it exits
    first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.stdout.read().decode()
        assert time.monotonic() < deadline, f"hf-dllm serve did not come up within {timeout} s"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def test_cli_serve_command(model_dir):
    """`python -m hf_dllm serve MODEL --port P` answers on 127.0.0.1 and stops on SIGTERM."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hf_dllm",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            "cli-model",
            "--max-batch-size",
            "4",
            "--max-batch-width",
            "256",
            "--threads",  # the shared loading flags
            "1",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until_healthy(process, port)
        cli_client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert cli_client.models.list().data[0].id == "cli-model"
        out = cli_client.completions.create(model="cli-model", prompt="hi", max_tokens=8)
        assert out.usage.completion_tokens <= 8 and out.usage.model_extra["nfe"] > 0
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.mark.parametrize(
    ("flag", "name", "expected"),
    [
        ([], "join_layout_min_rows", JOIN_LAYOUT_MIN_ROWS),
        (["--join-layout-min-rows", "3"], "join_layout_min_rows", 3),
        (["--join-layout-min-rows", "off"], "join_layout_min_rows", None),
        ([], "max_refresh_positions", None),
        (["--max-refresh-positions", "4096"], "max_refresh_positions", 4096),
        (["--max-refresh-positions", "off"], "max_refresh_positions", None),
        ([], "max_batch_positions", None),  # off CUDA: no budget by default
        (["--max-batch-width", "256", "--max-batch-positions", "1024"], "max_batch_positions", 1024),
    ],
)
def test_cli_engine_options_reach_the_engine(model_dir, monkeypatch, flag, name, expected):
    """`hf-dllm serve --join-layout-min-rows {N,off}` and `--max-refresh-positions {N,off}` (default: the engine's
    rule, and no slices) set the engine's rules for joining rows and for slicing layouts."""
    import uvicorn

    from hf_dllm.serving import server as server_module

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    argv = [str(model_dir), "--threads", "1", "--dtype", "float32", "--device", "cpu", *flag]
    assert server_module.main(argv) == 0
    assert getattr(apps[0].state.server.batcher.engine.scheduler, name) == expected


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-batch-positions", "0"], "--max-batch-positions must be >= 1"),
        (["--max-batch-width", "256", "--max-batch-positions", "255"], "`max_batch_positions` must be None or an"),
    ],
)
def test_cli_refuses_a_kv_budget_below_one_row(model_dir, monkeypatch, capsys, flags, message):
    """`hf-dllm serve --max-batch-positions N` below 1, or below --max-batch-width (a row of every column must
    fit), exits with 2 and says why, before serving."""
    import uvicorn

    from hf_dllm.serving import server as server_module

    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: pytest.fail("served"))
    argv = [str(model_dir), "--threads", "1", "--dtype", "float32", "--device", "cpu", *flags]
    assert server_module.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--join-layout-min-rows", "--max-refresh-positions"])
@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", ""])
def test_cli_engine_options_refuse_other_values(flag, value, capsys):
    from hf_dllm.serving.server import build_parser

    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["model", flag, value])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert flag in error and "an integer >= 1 or 'off'" in error
