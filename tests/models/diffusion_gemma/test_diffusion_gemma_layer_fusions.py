"""DiffusionGemma's decoder layer in fewer kernels: the key masks built once per decoder pass and layer kind (equal
to every layer's own, whose cache validity is the same across a kind), additive for SDPA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

import hf_dllm  # noqa: F401  (registers the family)
from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaStaticCache, decoder_key_mask
from tests.conftest import FIXTURES

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"


@pytest.fixture(scope="module")
def gemma():
    return AutoModel.from_pretrained(GEMMA_DIR).eval()


@pytest.mark.parametrize("static", [False, True])
def test_key_masks_built_once_per_kind_equal_every_layers_mask(gemma, static):
    """Two encoder passes of a left-padded batch (21 then 2 columns: the sliding window of 8 wraps its ring) leave
    every sliding layer with the same cache validity, and the full layer(s) too; the mask of a kind's first layer
    is every layer's, and its additive form is 0 where a key is visible, -inf where not."""
    text = gemma.config.text_config
    cache = DiffusionGemmaStaticCache(text, 64, gemma.config.canvas_length) if static else gemma.new_encoder_cache()
    valid = torch.ones(2, 21, dtype=torch.bool)
    valid[0, :18] = False  # row 0 left-padded into the sliding layers' window
    tokens = torch.randint(3, text.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gemma.encode(tokens, torch.arange(21), valid, cache)
        gemma.encode(tokens[:, :2], torch.arange(21, 23), torch.ones(2, 2, dtype=torch.bool), cache)
    x = torch.zeros(2, gemma.config.canvas_length, text.hidden_size)
    kinds = sorted(set(text.layer_types))
    assert kinds == ["full_attention", "sliding_attention"]
    for kind in kinds:
        layers = [index for index, layer_kind in enumerate(text.layer_types) if layer_kind == kind]
        first = layers[0]
        shared = decoder_key_mask(cache, first, x, True, additive=False)
        additive = decoder_key_mask(cache, first, x, True, additive=True)
        assert shared.dtype == torch.bool and shared.shape == (2, 1, 1, cache.valid[first].shape[1] + x.shape[1])
        assert shared[0].sum() < shared[1].sum()  # row 0's padding is hidden
        assert bool(shared[..., -x.shape[1] :].all())  # the canvas' own keys are seen
        assert additive.dtype == x.dtype and torch.equal(additive == 0, shared)
        assert bool((additive[~shared] == float("-inf")).all())
        for index in layers:
            assert torch.equal(cache.valid[index], cache.valid[first]), (kind, index)
            assert torch.equal(cache.decoder_mask(index, x[..., 0], True), shared), (kind, index)
    if not static:  # the dynamic cache without padding: no mask at all
        assert decoder_key_mask(cache, 0, x, False, additive=True) is None
