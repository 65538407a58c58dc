"""`pipeline("text-generation")` with a LLaDA model and the character tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline

from tests.conftest import tiny_model

GEN = dict(max_new_tokens=8, block_length=4)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def pipe(model, char_tokenizer):
    return pipeline("text-generation", model=model, tokenizer=char_tokenizer)


def record_generate_calls(model, monkeypatch) -> list[dict]:
    """Records the kwargs of every model.generate() call (the pipeline calls it with the prompts' tensors)."""
    calls = []
    original = model.generate

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", recording)
    return calls


@pytest.fixture
def generate_calls(model, monkeypatch):
    return record_generate_calls(model, monkeypatch)


def new_text(model, tokenizer, text: str, **kwargs) -> str:
    encoded = tokenizer(text, return_tensors="pt")
    out = model.generate(**encoded, **kwargs)
    return tokenizer.decode(out[0, encoded.input_ids.shape[1] :], skip_special_tokens=True)


def test_string_prompt(pipe, model, char_tokenizer):
    result = pipe("Hello", **GEN)
    assert isinstance(result, list) and len(result) == 1
    assert result[0]["generated_text"] == "Hello" + new_text(model, char_tokenizer, "Hello", **GEN)


def test_return_full_text_false(pipe, model, char_tokenizer):
    result = pipe("Hello", return_full_text=False, **GEN)
    assert result[0]["generated_text"] == new_text(model, char_tokenizer, "Hello", **GEN)


def test_chat_messages(pipe, model, char_tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    result = pipe(messages, **GEN)[0]["generated_text"]
    assert result[:-1] == messages
    assert result[-1]["role"] == "assistant"
    prompt_ids = char_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids["input_ids"]
    assert char_tokenizer.decode(prompt_ids[0]).startswith("<|startoftext|><|start_header_id|>user")
    out = model.generate(prompt_ids, **GEN)
    expected = char_tokenizer.decode(out[0, prompt_ids.shape[1] :], skip_special_tokens=True)
    assert result[-1]["content"] == expected


def test_generation_kwargs_reach_generate(pipe, model, char_tokenizer, generate_calls):
    kwargs = dict(max_new_tokens=12, block_length=4, threshold=0.9, dual_cache=False)
    result = pipe("Hello", return_full_text=False, **kwargs)
    assert len(generate_calls) == 1
    for key, value in kwargs.items():
        assert generate_calls[0][key] == value, key
    assert result[0]["generated_text"] == new_text(model, char_tokenizer, "Hello", **kwargs)


def test_pipeline_defaults_do_not_switch_to_sampling(char_tokenizer, monkeypatch):
    """pipeline() adds do_sample=True, temperature=0.7, max_new_tokens=256 for fields missing from the model's
    generation config: none of them may reach generate()."""
    model = tiny_model(seed=4)
    model.generation_config.max_new_tokens = 12
    model.generation_config.block_length = 4
    diff = model.generation_config.to_diff_dict()
    assert diff["do_sample"] is False and diff["temperature"] == 0.0 and diff["max_new_tokens"] == 12
    pipe = pipeline("text-generation", model=model, tokenizer=char_tokenizer)
    calls = record_generate_calls(model, monkeypatch)
    torch.manual_seed(0)
    first = pipe("Hello", return_full_text=False)
    torch.manual_seed(1)
    second = pipe("Hello", return_full_text=False)
    assert first == second
    assert len(calls) == 2
    for call in calls:
        assert not call.get("do_sample", False)
        assert call.get("temperature", 0.0) == 0.0
        assert call.get("max_new_tokens", 12) == 12
    assert first[0]["generated_text"] == new_text(model, char_tokenizer, "Hello")
    assert len(first[0]["generated_text"]) <= 12  # one character per token: not the pipeline's 256
