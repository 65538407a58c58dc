"""LLaDA2.x everywhere LLaDA goes: Auto classes, `pipeline("text-generation")` (batched, left-padded prompts) and
streamers, on a tiny random LLaDA2 with the character tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, TextIteratorStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

import hf_dllm

GEN = dict(max_new_tokens=12, block_length=4, threshold=0.6)


def tiny_llada2(seed: int = 0, **overrides) -> hf_dllm.LLaDA2MoeModelLM:
    fields = dict(
        vocab_size=103,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        partial_rotary_factor=0.5,
        num_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        num_shared_experts=1,
        moe_intermediate_size=24,
        first_k_dense_replace=1,
        mask_token_id=3,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=1,
        max_position_embeddings=256,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    return hf_dllm.LLaDA2MoeModelLM(hf_dllm.LLaDA2MoeConfig(**fields)).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llada2(seed=4)


def test_auto_classes_load_a_saved_llada2(tmp_path, model):
    model.save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is hf_dllm.LLaDA2MoeConfig
    for auto in (AutoModel, AutoModelForCausalLM):
        loaded = auto.from_pretrained(tmp_path).eval()
        assert type(loaded) is hf_dllm.LLaDA2MoeModelLM
        prompt = torch.tensor([[5, 6, 7, 8, 9]])
        assert torch.equal(loaded.generate(prompt, **GEN), model.generate(prompt, **GEN))


def test_pipeline_batches_equal_single_calls(model, char_tokenizer):
    pipe = pipeline("text-generation", model=model, tokenizer=char_tokenizer)
    prompts = ["Hi", "Good morning, world", "abc"]  # lengths 2, 19, 3: different offsets inside a block of 4
    batched = pipe(prompts, batch_size=3, **GEN)
    singles = [pipe(prompt, **GEN) for prompt in prompts]
    assert [b[0]["generated_text"] for b in batched] == [s[0]["generated_text"] for s in singles]
    encoded = char_tokenizer("abc", return_tensors="pt")
    out = model.generate(**encoded, **GEN)
    expected = "abc" + char_tokenizer.decode(out[0, encoded.input_ids.shape[1] :], skip_special_tokens=True)
    assert singles[2][0]["generated_text"] == expected


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("prompt_length", [5, 8], ids=["tail_in_first_block", "aligned"])
def test_streamer_gets_each_committed_block(model, prompt_length):
    """The prompt, then the generated positions of each decoded block (the first block holds the prompt's tail
    when the prompt is not a multiple of the block length), then end(); together they are the output."""
    prompt = torch.arange(10, 10 + prompt_length)[None]
    recorder = Recorder()
    out = model.generate(prompt, streamer=recorder, eos_early_stop=False, **GEN)
    assert recorder.ended and torch.equal(recorder.puts[0], prompt)
    pieces = recorder.puts[1:]
    assert torch.equal(torch.cat(pieces, dim=1), out[:, prompt_length:])
    first_block = 4 - prompt_length % 4
    assert pieces[0].shape[1] == first_block
    assert all(piece.shape[1] == 4 for piece in pieces[1:-1])


def test_text_iterator_streamer(model, char_tokenizer):
    encoded = char_tokenizer("Hello", return_tensors="pt")
    streamer = TextIteratorStreamer(char_tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(**encoded, streamer=streamer, **GEN)
    text = "".join(streamer)
    assert text == char_tokenizer.decode(out[0, encoded.input_ids.shape[1] :], skip_special_tokens=True)
