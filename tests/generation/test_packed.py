"""Padding-free forwards (`hf_dllm/packed.py`): rows packed end to end compute what each computes alone, and their
keys/values land in the cache at each row's own columns."""

from __future__ import annotations

import pytest
import torch

from hf_dllm.cache import DiffusionKVCache
from hf_dllm.packed import PackedRows
from tests.conftest import tiny_model
from tests.models.dream.test_dream_modeling import random_model as random_dream
from tests.models.dream.test_dream_modeling import tiny_config as tiny_dream_config
from tests.models.llada.test_cpu_path import count_lean_calls
from tests.models.llada2.test_llada2_integration import tiny_llada2

LENGTHS = [7, 12, 3]  # a row shorter than the kept span's end must still work (kept positions inside each row)
KEPT = 2  # logits kept per row (the engine keeps a block's)


def models():
    llada_sdpa = tiny_model(seed=3, n_kv_heads=4)  # multi-head: the CPU's lean block path applies
    llada_eager = tiny_model(seed=3)  # grouped-query attention, eager: the regular block path
    llada_eager.set_attn_implementation("eager")
    dream = random_dream(tiny_dream_config(), attn="sdpa", seed=4)
    llada2 = tiny_llada2(seed=5)  # block-causal: each packed row gets its own block-causal mask
    return {"llada-lean": llada_sdpa, "llada-eager": llada_eager, "dream": dream, "llada2": llada2}


@pytest.fixture(scope="module")
def families():
    return models()


def layers(model) -> int:
    return model.config.num_hidden_layers


@pytest.mark.parametrize("family", ["llada-lean", "llada-eager", "dream", "llada2"])
def test_packed_rows_compute_what_each_row_computes_alone(families, family, monkeypatch):
    """Logits at the kept positions and the keys/values written to the cache (each row at its row, shifted by its
    own offset) equal the row's own forward with a cache of its length, in float32 (LLaDA2: block-causal, blocks
    of 4, so rows end inside a block, at its end and after several)."""
    model = families[family]
    extra = dict(block_length=4) if family == "llada2" else {}
    lean_calls = count_lean_calls(monkeypatch)
    torch.manual_seed(0)
    rows = [torch.randint(4, 100, (length,)) for length in LENGTHS]
    kept = [torch.tensor([0, length - 1]) for length in LENGTHS]
    shifts = [4, 0, 9]
    width = max(s + n for s, n in zip(shifts, LENGTHS, strict=True))
    cache = DiffusionKVCache(layers(model), len(rows), width)
    columns = torch.cat([torch.arange(s, s + n) for s, n in zip(shifts, LENGTHS, strict=True)])
    offsets = torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)
    packing = PackedRows(LENGTHS, cache, columns, kept_per_row=KEPT)
    with torch.no_grad():
        packed = model._diffusion_forward(
            torch.cat(rows).unsqueeze(0),
            packing,
            torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0),
            packing,
            torch.arange(sum(LENGTHS)),
            torch.cat([offset + index for offset, index in zip(offsets, kept, strict=True)]),
            **extra,
        )
        assert packed.shape[:2] == (1, len(rows) * KEPT)
        packed = packed.view(len(rows), KEPT, -1)
        for i, (ids, index) in enumerate(zip(rows, kept, strict=True)):
            alone_cache = DiffusionKVCache(layers(model), 1, LENGTHS[i])
            alone = model._diffusion_forward(
                ids.unsqueeze(0),
                None,
                torch.arange(LENGTHS[i]).unsqueeze(0),
                alone_cache,
                torch.arange(LENGTHS[i]),
                index,
                **extra,
            )
            torch.testing.assert_close(packed[i], alone[0], rtol=1e-5, atol=1e-5)
            own = slice(shifts[i], shifts[i] + LENGTHS[i])
            for layer in range(layers(model)):
                torch.testing.assert_close(cache.keys[layer][i, :, own], alone_cache.keys[layer][0])
                torch.testing.assert_close(cache.values[layer][i, :, own], alone_cache.values[layer][0])
    assert (lean_calls[0] > 0) == (family == "llada-lean")  # both LLaDA block paths ran packed


def test_packed_rows_without_a_cache_and_every_position_kept(families):
    """Without a cache (the engine's uncached steps) and with every position's logits, each row still sees only
    itself: changing one row's tokens changes no other row's logits."""
    model = families["llada-eager"]
    torch.manual_seed(1)
    tokens = torch.randint(4, 100, (1, sum(LENGTHS)))
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    packing = PackedRows(LENGTHS)
    with torch.no_grad():
        before = model(input_ids=tokens, attention_mask=packing, position_ids=positions, past_key_values=packing).logits
        changed = tokens.clone()
        changed[0, : LENGTHS[0]] = 5  # the first row only
        after = model(input_ids=changed, attention_mask=packing, position_ids=positions, past_key_values=packing).logits
    assert not torch.allclose(before[0, : LENGTHS[0]], after[0, : LENGTHS[0]])
    torch.testing.assert_close(before[0, LENGTHS[0] :], after[0, LENGTHS[0] :], rtol=0, atol=0)


def test_packed_rows_refuse_what_they_cannot_describe():
    with pytest.raises(ValueError, match="at least one position"):
        PackedRows([3, 0])
    with pytest.raises(ValueError, match="go together"):
        PackedRows([3], cache=DiffusionKVCache(1, 1, 3))
    with pytest.raises(ValueError, match="columns"):
        PackedRows([3, 2], DiffusionKVCache(1, 2, 4), torch.arange(4))
    packing = PackedRows([2, 2], kept_per_row=1)
    query = torch.zeros(1, 1, 3, 4)  # neither all 4 positions nor the 2 kept ones
    with pytest.raises(ValueError, match="3 queries for 4 packed positions"):
        packing.attend(lambda q, k, v, mask: q.transpose(1, 2), query, torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4))
