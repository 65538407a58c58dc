"""LLaDA forward: attention backends, padding, the diffusion K/V cache, DynamicCache, logits_to_keep, outputs."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_dllm import DiffusionKVCache
from hf_dllm.cache import OUTPUT_CACHE_FIELD, output_cache
from tests.conftest import FIXTURES, tiny_model

ATOL = 2e-5  # float32


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 100, (batch, length), generator=generator)


def logits_with(model, attn_implementation: str, *args, **kwargs) -> torch.Tensor:
    previous = model.config._attn_implementation
    model.set_attn_implementation(attn_implementation)
    try:
        with torch.no_grad():
            return model(*args, **kwargs).logits
    finally:
        model.set_attn_implementation(previous)


def padded_batch(rows: list[torch.Tensor], side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        if side == "left":
            ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
        else:
            ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return ids, mask


@pytest.fixture(scope="module")
def model():
    return tiny_model()


# ----------------------------------------------------------------------------------------------------------------
# Attention backends and padding
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", [False, True])
def test_eager_and_sdpa_agree(model, padding):
    ids = random_ids(3, 13)
    mask = None
    if padding:
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        mask[2, :9] = 0
    eager = logits_with(model, "eager", ids, attention_mask=mask)
    sdpa = logits_with(model, "sdpa", ids, attention_mask=mask)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(eager[real], sdpa[real], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_compute_what_they_compute_alone(model, attn_implementation, side):
    rows = [random_ids(1, n, seed=n)[0] for n in (11, 4, 7)]
    ids, mask = padded_batch(rows, side)
    batched = logits_with(model, attn_implementation, ids, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = logits_with(model, attn_implementation, row[None])
        torch.testing.assert_close(batched[i][mask[i].bool()], alone[0], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_padding_holes_are_skipped_by_positions_and_attention(model, attn_implementation):
    """Any padding works: real tokens get consecutive RoPE positions and never see the pads."""
    row = random_ids(1, 6, seed=3)[0]
    ids = torch.tensor([[row[0], row[1], 0, 0, row[2], row[3], 0, row[4], row[5]]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 1]])
    holes = logits_with(model, attn_implementation, ids, attention_mask=mask)
    alone = logits_with(model, attn_implementation, row[None])
    torch.testing.assert_close(holes[0][mask[0].bool()], alone[0], atol=ATOL, rtol=1e-5)


@pytest.mark.slow
def test_flex_attention_agrees_with_eager_with_and_without_padding(model):
    rows = [random_ids(1, n, seed=n)[0] for n in (12, 5)]
    ids, mask = padded_batch(rows)
    eager_padded = logits_with(model, "eager", ids, attention_mask=mask)
    flex_padded = logits_with(model, "flex_attention", ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(flex_padded[real], eager_padded[real], atol=ATOL, rtol=1e-5)
    # The short row, padded, equals the short row alone (flex).
    alone = logits_with(model, "eager", rows[1][None])
    torch.testing.assert_close(flex_padded[1][real[1]], alone[0], atol=ATOL, rtol=1e-5)
    # No padding at all (no mask).
    torch.testing.assert_close(
        logits_with(model, "flex_attention", ids), logits_with(model, "eager", ids), atol=ATOL, rtol=1e-5
    )


def test_attention_is_bidirectional(model):
    """Changing the last token changes the logits of the first position (a causal model would not)."""
    ids = random_ids(1, 8)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1 - 4) % 96 + 4
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits[0, 0], model(changed).logits[0, 0])


# ----------------------------------------------------------------------------------------------------------------
# DiffusionKVCache: a partial forward over cached K/V of the same tokens equals the full forward
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("style", ["dual", "prefix"])
def test_diffusion_cache_slice_matches_full_forward(model, attn_implementation, padding, style):
    batch, length = 2, 16
    ids = random_ids(batch, length, seed=5)
    mask = None
    if padding:
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
    start, end = (6, 11) if style == "dual" else (6, length)
    previous = model.config._attn_implementation
    model.set_attn_implementation(attn_implementation)
    try:
        with torch.no_grad():
            full = model(ids, attention_mask=mask).logits
            cache = DiffusionKVCache(model.config.num_hidden_layers, batch, length)
            filled = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            keys_after_fill = [k.clone() for k in cache.keys]
            part = model(
                ids[:, start:end],
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(start, end),
            ).logits
            uncached_part = model(ids[:, start:end]).logits
    finally:
        model.set_attn_implementation(previous)
    torch.testing.assert_close(filled, full, atol=ATOL, rtol=1e-5)
    assert part.shape == (batch, end - start, full.shape[-1])
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(part[real[:, start:end]], full[:, start:end][real[:, start:end]], atol=ATOL, rtol=1e-5)
    # Rewriting the slice with the same tokens leaves the cache as the full forward filled it.
    assert cache.get_seq_length() == length
    for before, after in zip(keys_after_fill, cache.keys, strict=True):
        torch.testing.assert_close(after, before, atol=ATOL, rtol=1e-5)
    # Non-vacuity: without the cached context the slice computes something else.
    assert not torch.allclose(uncached_part, full[:, start:end], atol=1e-3)


def test_diffusion_cache_partial_forward_needs_cache_position(model):
    cache = DiffusionKVCache(model.config.num_hidden_layers, 1, 10)
    ids = random_ids(1, 10)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="cache_position"):
            model(ids[:, 2:5], past_key_values=cache)


def test_diffusion_cache_uses_the_first_rows_for_a_smaller_batch(model):
    ids = random_ids(3, 12, seed=9)
    cache = DiffusionKVCache(model.config.num_hidden_layers, 3, 12)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        full = model(ids[:2]).logits
        model(ids[:2], past_key_values=cache)  # a full forward of fewer rows rewrites the first rows
        part = model(ids[:2, 3:8], past_key_values=cache, cache_position=torch.arange(3, 8)).logits
    torch.testing.assert_close(part, full[:, 3:8], atol=ATOL, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# DynamicCache: appending positions to cached ones
# ----------------------------------------------------------------------------------------------------------------


def test_dynamic_cache_append_one_layer_equals_full_forward():
    """With one layer, K/V only depend on each token and its position: prefix K/V computed alone are those of the
    full forward, so appended positions get exactly the full forward's logits."""
    model = tiny_model(n_layers=1)
    ids = random_ids(2, 14, seed=2)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :9], use_cache=True)
        assert isinstance(output_cache(out), DynamicCache)
        assert output_cache(out).get_seq_length() == 9
        appended = model(ids[:, 9:], past_key_values=output_cache(out), use_cache=True)
    assert output_cache(appended).get_seq_length() == 14
    torch.testing.assert_close(appended.logits, full[:, 9:], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", ["llada", "dream", "llada2"])
def test_outputs_hold_the_cache_under_the_installed_transformers_name(family, monkeypatch):
    """transformers renamed the outputs' `past_key_values` to `cache` (5.2x), warning when the old name builds or
    reads an output: the models' outputs (base model and LM) carry the cache under the installed name, without
    that warning, in `generate()` too."""

    from transformers import AutoModel
    from transformers.utils import generic

    warnings = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a, **k: warnings.append(message))
    fixtures = FIXTURES
    model = {
        "llada": lambda: tiny_model(n_layers=1),
        "dream": lambda: AutoModel.from_pretrained(fixtures / "dream-tiny-ref").eval(),
        "llada2": lambda: AutoModel.from_pretrained(fixtures / "llada2-tiny-ref").eval(),
    }[family]()
    ids = random_ids(1, 8)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        base = model.base_model(ids, use_cache=True)
    assert OUTPUT_CACHE_FIELD in out.keys() and OUTPUT_CACHE_FIELD in base.keys()
    assert output_cache(out) is not None and output_cache(out).get_seq_length() == 8
    # (The LLaDA2 fixture's mask id is the Hub model's, outside its tiny vocabulary.)
    model.generate(ids, max_new_tokens=8, block_length=8, steps=8, mask_token_id=model.config.vocab_size - 1)
    assert not [message for message in warnings if "deprecated" in message], warnings


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_dynamic_cache_append_equals_prefix_blind_mask(model, attn_implementation):
    """Deeper models: caching the prefix first means the prefix never saw the suffix. That is a full forward with
    a 4D mask where prefix queries do not attend to suffix keys."""
    length, prefix = 13, 8
    ids = random_ids(2, length, seed=4)
    allowed = torch.ones(length, length, dtype=torch.bool)
    allowed[:prefix, prefix:] = False
    mask4d = allowed[None, None].expand(2, 1, length, length)
    previous = model.config._attn_implementation
    model.set_attn_implementation(attn_implementation)
    try:
        with torch.no_grad():
            expected = model(ids, attention_mask=mask4d).logits
            first = model(ids[:, :prefix], use_cache=True)
            appended = model(ids[:, prefix:], past_key_values=output_cache(first), use_cache=True).logits
            full = model(ids).logits
    finally:
        model.set_attn_implementation(previous)
    torch.testing.assert_close(first.logits, expected[:, :prefix], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(appended, expected[:, prefix:], atol=ATOL, rtol=1e-5)
    assert not torch.allclose(appended, full[:, prefix:], atol=1e-3)  # the 4D mask mattered


# ----------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------


def test_logits_to_keep(model):
    ids = random_ids(2, 10)
    with torch.no_grad():
        full = model(ids).logits
        assert full.shape == (2, 10, model.config.padded_vocab_size)
        torch.testing.assert_close(model(ids, logits_to_keep=0).logits, full, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(model(ids, logits_to_keep=3).logits, full[:, -3:], atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(model(ids, logits_to_keep=1).logits, full[:, -1:], atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(model(ids, logits_to_keep=slice(2, 6)).logits, full[:, 2:6], atol=ATOL, rtol=1e-5)
        index = torch.tensor([0, 4, 9])
        torch.testing.assert_close(model(ids, logits_to_keep=index).logits, full[:, index], atol=ATOL, rtol=1e-5)


def test_return_dict_false_returns_a_tuple(model):
    ids = random_ids(1, 6)
    with torch.no_grad():
        expected = model(ids).logits
        out = model(ids, return_dict=False)
        assert isinstance(out, tuple)
        torch.testing.assert_close(out[0], expected, atol=0, rtol=0)
        with_cache = model(ids, use_cache=True, return_dict=False)
    assert isinstance(with_cache, tuple)
    torch.testing.assert_close(with_cache[0], expected, atol=0, rtol=0)
    assert isinstance(with_cache[1], DynamicCache)


def test_inputs_embeds_and_hidden_states(model):
    ids = random_ids(2, 7)
    with torch.no_grad():
        by_ids = model(ids, output_hidden_states=True)
        by_embeds = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
        with pytest.raises(ValueError, match="input_ids"):
            model()
        with pytest.raises(ValueError, match="inputs_embeds"):
            model(ids, inputs_embeds=model.get_input_embeddings()(ids))
    torch.testing.assert_close(by_embeds, by_ids.logits, atol=0, rtol=0)
    assert len(by_ids.hidden_states) == model.config.n_layers + 1
    torch.testing.assert_close(
        model.model.compute_logits(by_ids.hidden_states[-1]), by_ids.logits, atol=ATOL, rtol=1e-5
    )


@pytest.mark.parametrize("family", ["llada", "dream", "llada2"])
def test_every_family_reads_cache_arguments_alike(family):
    """One derivation of cache positions, position ids and the 2D mask's width (`cache.resolve_forward_positions`)
    for every model: a 2D mask that does not cover the call's keys is refused, and a call through a new
    DynamicCache (positions from the cache's length) gives the logits of the call without one."""
    from transformers import DynamicCache

    from tests.models.dream.test_dream_modeling import random_model, tiny_config
    from tests.models.llada2.test_llada2_integration import tiny_llada2

    makers = {"llada": tiny_model, "dream": lambda seed: random_model(tiny_config(), seed=seed), "llada2": tiny_llada2}
    model = makers[family](seed=3)
    ids = torch.randint(5, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match=r"must cover the keys of this call: shape \(2, 10\)"):
        model(input_ids=ids, attention_mask=mask[:, :7])
    extra = {"block_length": 10} if family == "llada2" else {}
    full = model(input_ids=ids, attention_mask=mask, **extra).logits
    cache = DynamicCache()
    cached = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, **extra).logits
    assert torch.allclose(cached, full, atol=1e-5)
    assert cache.get_seq_length() == 10
