"""Bad input to generate(): a clear error naming the argument and its allowed values, before any forward pass."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tests.conftest import tiny_config, tiny_model

VOCAB = 103  # tiny model: mask 3, eos 0, pad 0


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def forwards(model):
    """Counts forward passes of the model (and of its inner transformer) during the test."""
    count = {"n": 0}

    def hook(module, args, kwargs=None):
        count["n"] += 1

    handles = [model.register_forward_pre_hook(hook), model.model.register_forward_pre_hook(hook)]
    yield count
    for handle in handles:
        handle.remove()


PROMPT = torch.randint(4, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
GEN = dict(max_new_tokens=8, block_length=4)

# (id, kwargs for generate, exception, regex naming the argument and its allowed values)
BAD_INPUTS = [
    ("max_new_tokens=0", dict(max_new_tokens=0), ValueError, r"max_new_tokens.*positive integer"),
    ("max_new_tokens=-5", dict(max_new_tokens=-5), ValueError, r"max_new_tokens.*positive integer"),
    ("max_new_tokens=float", dict(max_new_tokens=8.0), (ValueError, TypeError), r"max_new_tokens.*integer"),
    ("block_length=0", dict(block_length=0), ValueError, r"block_length.*positive integer"),
    ("block_length=-4", dict(block_length=-4), ValueError, r"block_length.*positive integer"),
    ("steps=0", dict(steps=0), ValueError, r"steps.*positive integer"),
    ("steps=-1", dict(steps=-1), ValueError, r"steps.*positive integer"),
    ("steps<blocks", dict(max_new_tokens=16, block_length=4, steps=3), ValueError, r"steps.*number of blocks"),
    ("threshold=0", dict(threshold=0.0), ValueError, r"threshold.*\(0, 1\]"),
    ("threshold=1.5", dict(threshold=1.5), ValueError, r"threshold.*\(0, 1\]"),
    ("threshold=-0.1", dict(threshold=-0.1), ValueError, r"threshold.*\(0, 1\]"),
    ("threshold=str", dict(threshold="0.9"), (ValueError, TypeError), r"threshold"),
    ("factor=0", dict(factor=0.0), ValueError, r"factor.*> 0"),
    ("threshold+factor", dict(threshold=0.9, factor=1.0), ValueError, r"threshold.*factor|factor.*threshold"),
    ("steps+threshold", dict(steps=8, threshold=0.9), ValueError, r"steps.*threshold"),
    ("remasking", dict(remasking="entropy"), ValueError, r"remasking.*low_confidence.*random"),
    ("temperature<0", dict(temperature=-1.0), ValueError, r"temperature.*>= 0"),
    ("do_sample_vs_temperature", dict(do_sample=True), ValueError, r"do_sample.*temperature"),
    ("cfg_scale<0", dict(cfg_scale=-2.0), ValueError, r"cfg_scale.*\[0, 100\]"),
    ("cfg_scale=1e30", dict(cfg_scale=1e30), ValueError, r"cfg_scale.*\[0, 100\]"),
    ("block_length=10**20", dict(block_length=10**20), ValueError, r"block_length.*at most 1048576"),
    ("block_length>context", dict(max_new_tokens=8, block_length=4096), ValueError, r"block_length.*context of 512"),
    ("use_cache=str", dict(use_cache="yes"), (ValueError, TypeError), r"use_cache.*True or False"),
    ("mask_token_id=None", dict(mask_token_id=None), ValueError, rf"mask_token_id.*\[0, {VOCAB}\)"),
    ("mask_token_id=vocab", dict(mask_token_id=VOCAB), ValueError, rf"mask_token_id.*\[0, {VOCAB}\)"),
    ("mask_token_id<0", dict(mask_token_id=-3), ValueError, r"mask_token_id"),
    ("eos_token_id=vocab", dict(eos_token_id=VOCAB + 7), ValueError, rf"eos_token_id.*\[0, {VOCAB}\)"),
    ("pad==mask", dict(pad_token_id=3), ValueError, r"pad_token_id.*mask_token_id"),
    (
        "eos_early_stop_without_eos",
        dict(eos_token_id=None, eos_early_stop=True),
        ValueError,
        r"eos_early_stop.*eos_token_id",
    ),
    (
        "logits_eos_inf_without_eos",
        dict(eos_token_id=None, eos_early_stop=False, logits_eos_inf=True),
        ValueError,
        r"logits_eos_inf.*eos_token_id",
    ),
    ("unknown_kwarg", dict(top_k=5), ValueError, r"top_k.*threshold"),
    ("typo_kwarg", dict(max_new_token=8), ValueError, r"max_new_token\b"),
    ("input_ids+inputs", dict(input_ids=PROMPT), ValueError, r"input_ids"),
    (
        "attention_mask_shape",
        dict(attention_mask=torch.ones(2, 4, dtype=torch.long)),
        ValueError,
        r"attention_mask.*\(2, 5\)",
    ),
    ("attention_mask_1d", dict(attention_mask=torch.ones(5, dtype=torch.long)), ValueError, r"attention_mask"),
    ("attention_mask_values", dict(attention_mask=torch.full((2, 5), 2)), ValueError, r"attention_mask.*0.*1"),
    ("attention_mask_float", dict(attention_mask=torch.full((2, 5), 0.5)), ValueError, r"attention_mask.*0.*1"),
    ("generation_config_type", dict(generation_config={"threshold": 0.9}), TypeError, r"generation_config"),
    # Non-finite and out-of-range numbers (NaN passes `< 0` checks unnoticed; inf turns logits into NaN).
    ("temperature=nan", dict(temperature=float("nan")), ValueError, r"temperature.*finite number >= 0"),
    ("temperature=inf", dict(temperature=float("inf")), ValueError, r"temperature.*finite number >= 0"),
    ("temperature=10**400", dict(temperature=10**400), ValueError, r"temperature.*finite number >= 0"),
    ("cfg_scale=nan", dict(cfg_scale=float("nan")), ValueError, r"cfg_scale.*finite number in \[0, 100\]"),
    ("cfg_scale=inf", dict(cfg_scale=float("inf")), ValueError, r"cfg_scale.*finite number in \[0, 100\]"),
    ("factor=nan", dict(factor=float("nan")), ValueError, r"factor.*finite number > 0"),
    ("factor=inf", dict(factor=float("inf")), ValueError, r"factor.*finite number > 0"),
    ("threshold=nan", dict(threshold=float("nan")), ValueError, r"threshold.*\(0, 1\]"),
    ("max_new_tokens=10**9", dict(max_new_tokens=10**9), ValueError, r"max_new_tokens.*at most 1048576"),
    ("steps=10**9", dict(steps=10**9), ValueError, r"steps.*at most 1048576"),
    # Lengths no machine could allocate: 65536 rows x 2**20 positions of K/V cache.
    (
        "beyond_context",
        dict(inputs=torch.full((65536, 5), 7), max_new_tokens=2**20, block_length=256),
        ValueError,
        r"max_new_tokens.*context of 512 positions",
    ),
    # Special tokens that collide with the mask token.
    ("eos==mask", dict(eos_token_id=3), ValueError, r"eos_token_id\[0\].*mask_token_id"),
    ("eos_list_has_mask", dict(eos_token_id=[0, 3]), ValueError, r"eos_token_id\[1\].*mask_token_id"),
    ("eot==mask", dict(eot_token_id=3), ValueError, r"eot_token_id.*mask_token_id"),
    (
        "all_padding_row",
        dict(attention_mask=torch.tensor([[1] * 5, [0] * 5])),
        ValueError,
        r"attention_mask.*row 1.*all padding",
    ),
    (
        "attention_mask_meta",
        dict(attention_mask=torch.ones(2, 5, dtype=torch.long, device="meta")),
        ValueError,
        r"attention_mask.*meta",
    ),
    ("streamer_without_put", dict(streamer=object()), TypeError, r"streamer.*put\(\)"),
]


@pytest.mark.parametrize("kwargs, error, pattern", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_generate_argument_fails_before_any_forward(model, forwards, kwargs, error, pattern):
    call = {**GEN, **kwargs}
    prompt = call.pop("inputs", PROMPT)
    with pytest.raises(error, match=pattern):
        model.generate(prompt, **call)
    assert forwards["n"] == 0


BAD_PROMPTS = [
    ("empty_batch", torch.zeros(0, 5, dtype=torch.long), ValueError, r"input_ids.*batch"),
    ("3d", torch.randint(4, VOCAB, (1, 2, 5)), ValueError, r"input_ids.*\(batch, prompt_len\)"),
    ("float", torch.rand(2, 5) * 50, ValueError, r"input_ids.*integer"),
    ("bool", torch.ones(2, 5, dtype=torch.bool), ValueError, r"input_ids.*integer"),
    ("list", [[5, 6, 7]], TypeError, r"input_ids.*LongTensor"),
    ("id=vocab", torch.tensor([[5, 6, VOCAB]]), ValueError, rf"input_ids.*\[0, {VOCAB}\)"),
    ("id<0", torch.tensor([[5, -1, 6]]), ValueError, rf"input_ids.*\[0, {VOCAB}\)"),
    (
        "mask_token",
        torch.tensor([[5, 6, 7], [8, 3, 9]]),
        ValueError,
        r"input_ids.*mask token \(3\) at row 1, position 1",
    ),
    ("meta", torch.ones(2, 5, dtype=torch.long, device="meta"), ValueError, r"input_ids.*meta device"),
]


@pytest.mark.parametrize("prompt, error, pattern", [case[1:] for case in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompt_fails_before_any_forward(model, forwards, prompt, error, pattern):
    with pytest.raises(error, match=pattern):
        model.generate(prompt, **GEN)
    with pytest.raises(error, match=pattern):
        model.generate(input_ids=prompt, **GEN)
    assert forwards["n"] == 0


def test_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = tiny_model()
    with pytest.raises(ValueError, match="meta device"):
        model.generate(PROMPT, **GEN)


def test_bad_generation_config_object_fails_before_any_forward(model, forwards):
    config = GenerationConfig(max_new_tokens=8, block_length=4, mask_token_id=3, eos_token_id=0, threshold=2.0)
    with pytest.raises(ValueError, match=r"threshold.*\(0, 1\]"):
        model.generate(PROMPT, generation_config=config)
    assert forwards["n"] == 0


def test_valid_call_does_run_forwards(model, forwards):
    """The counter works: a valid call is counted (so the zero counts above mean something)."""
    model.generate(PROMPT, **GEN)
    assert forwards["n"] > 0


def test_model_state_is_unchanged_by_rejected_calls(model):
    before = model.generation_config.to_dict()
    with pytest.raises(ValueError):
        model.generate(PROMPT, threshold=3.0, **GEN)
    assert model.generation_config.to_dict() == before


def test_exceeding_the_context_is_refused_before_any_forward(monkeypatch):
    """The model's context (its family's `context_length`: LLaDA's `max_sequence_length`) bounds prompt +
    max_new_tokens: beyond it generate() raises a ValueError naming both numbers before any forward."""
    model = tiny_model(max_sequence_length=17)
    prompt = torch.randint(4, VOCAB, (1, 6))
    assert model.generate(prompt, max_new_tokens=8, block_length=4).shape == (1, 14)  # 14 <= 17
    assert model.generate(prompt, max_new_tokens=11, block_length=4).shape == (1, 17)  # exactly the context

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(model, "_diffusion_forward", no_forward)
    for new in (12, 10**6):
        with pytest.raises(ValueError, match=rf"6 tokens.*max_new_tokens.*\({new}\).*context of 17 positions"):
            model.generate(prompt, max_new_tokens=new, block_length=4)


def test_beyond_memory_is_refused_before_any_forward(monkeypatch):
    """Lengths within the context that no machine could allocate (65536 rows x 2**20 positions of K/V cache)."""
    model = tiny_model(max_sequence_length=2**21)
    monkeypatch.setattr(model, "_diffusion_forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("forward")))
    with pytest.raises(ValueError, match=r"max_new_tokens.*GiB"):
        model.generate(torch.full((65536, 5), 7), max_new_tokens=2**20, block_length=2**20)


def test_rope_scaling_extends_the_context():
    """A config that declares RoPE scaling (a `factor`) may run that many times its trained context."""
    from hf_dllm import DreamConfig
    from hf_dllm.family_dream import DREAM
    from hf_dllm.family_llada import LLADA

    assert LLADA.context_length(tiny_config(max_sequence_length=17)) == 17
    dream = DreamConfig(max_position_embeddings=100, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert DREAM.context_length(dream) == 400


def test_prompt_pad_token_id_falls_back_to_the_first_eos_then_zero():
    from hf_dllm import DiffusionGenerationConfig

    assert DiffusionGenerationConfig(pad_token_id=7, eos_token_id=[3, 4]).prompt_pad_token_id == 7
    assert DiffusionGenerationConfig(pad_token_id=None, eos_token_id=[3, 4]).prompt_pad_token_id == 3
    assert DiffusionGenerationConfig(pad_token_id=None, eos_token_id=None).prompt_pad_token_id == 0
