"""Limits of `generate()` under hostile arguments (docs/limits.md): an empty prompt starts from the family's BOS or
is refused, `block_length` beyond `max_new_tokens` is clamped on bidirectional models and keeps the block grid on
block-causal ones, and every refusal comes before any forward."""

from __future__ import annotations

import pytest
import torch

import hf_dllm
from tests.conftest import FIXTURES

# (fixture, model class, extra generate() kwargs, the BOS the family starts an empty prompt from; None: refused)
FAMILIES = [
    ("llada-tiny-trained", "LLaDAModelLM", {}, 1),
    ("dream-tiny-ref", "DreamModel", {"mask_token_id": 310}, 301),
    ("llada2-tiny-ref", "LLaDA2MoeModelLM", {"mask_token_id": 310}, None),
    ("lladamoe-tiny-ref", "LLaDAMoEModelLM", {"mask_token_id": 310}, None),
]


def no_forward(*args, **kwargs):
    raise AssertionError("a forward ran")


@pytest.mark.parametrize("fixture, cls, extra, bos", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_an_empty_prompt_starts_from_the_bos_or_is_refused(fixture, cls, extra, bos, monkeypatch):
    model = getattr(hf_dllm, cls).from_pretrained(FIXTURES / fixture).eval()
    empty = torch.zeros(2, 0, dtype=torch.long)
    gen = dict(max_new_tokens=4, block_length=4, **extra)
    if bos is None:
        monkeypatch.setattr(model, "_diffusion_forward", no_forward)
        for prompt in (empty, None):
            with pytest.raises(ValueError, match=r"prompt is empty.*bos_token_id"):
                model.generate(prompt, **gen)
        return
    out = model.generate(empty, **gen)
    assert out.shape == (2, 5) and out[:, 0].tolist() == [bos, bos]
    # The same as asking with the BOS as the prompt, and as passing no prompt at all.
    assert torch.equal(out, model.generate(torch.full((2, 1), bos), **gen))
    assert torch.equal(out[:1], model.generate(None, **gen))


def test_block_length_beyond_max_new_tokens_is_one_block_on_bidirectional_models(make_tiny_model):
    model = make_tiny_model()
    prompt = torch.randint(4, 103, (1, 5), generator=torch.Generator().manual_seed(1))
    run = model.generate_blocks(prompt, max_new_tokens=6, block_length=500)
    assert [end - start for start, end in run.plan.blocks] == [6]  # clamped to max_new_tokens
    assert torch.equal(run.run(), model.generate(prompt, max_new_tokens=6, block_length=6))
