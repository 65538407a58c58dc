"""LLaDA2.x streamers on a tiny random LLaDA2 with the character tokenizer (`tiny_llada2`, which the other LLaDA2
tests build on); the Auto classes, the pipeline and `TextIteratorStreamer`: test_llada2_family.py."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import hf_dllm

GEN = dict(max_new_tokens=12, block_length=4, threshold=0.6)


def tiny_llada2_config(**overrides) -> hf_dllm.LLaDA2MoeConfig:
    """A small LLaDA2 config (8 experts top-2, a dense first layer) sized for the character tokenizer."""
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
    return hf_dllm.LLaDA2MoeConfig(**fields)


def tiny_llada2(seed: int = 0, **overrides) -> hf_dllm.LLaDA2MoeModelLM:
    torch.manual_seed(seed)
    return hf_dllm.LLaDA2MoeModelLM(tiny_llada2_config(**overrides)).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llada2(seed=4)


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
