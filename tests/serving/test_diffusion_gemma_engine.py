"""DiffusionGemma in the serving engine (continuous batching): canvases of different requests share a batch. The
engine lays rows out anew before each block (each row shifted so that its current canvas starts at a shared
column, its own positions, padding masked) and re-encodes each row's prefix into the emptied encoder cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from hf_dllm.serving.engine import ContinuousBatcher
from hf_dllm.serving.rows import EngineRequest
from tests.conftest import FIXTURES

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"
SETTINGS = dict(
    max_new_tokens=32, max_denoising_steps=6, sampler_config={"entropy_bound": 0.5}, confidence_threshold=1.0
)


@pytest.fixture(scope="module")
def gemma():
    return AutoModel.from_pretrained(GEMMA_DIR).eval()


class Recorder:
    def __init__(self):
        self.updates = []

    def __call__(self, update) -> bool:
        self.updates.append(update)
        return False

    @property
    def tokens(self) -> list[int]:
        return [token for update in self.updates for token in update.new_tokens]


def _requests(model, prompts):
    return [EngineRequest(prompt, model.resolve_generation_config(**SETTINGS), Recorder()) for prompt in prompts]


def test_requests_together_are_generate_of_the_batch(gemma):
    """Two requests of one length arriving together: the engine's layouts are `generate()`'s batch, draw for draw."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    requests = _requests(gemma, prompts)
    engine = ContinuousBatcher(gemma, max_batch_size=4, max_batch_width=128)
    torch.manual_seed(3)
    for request in requests:
        engine.submit(request)
    rows = []
    while engine.has_work():
        rows.append(engine.decode_boundary())
    assert rows == [2, 2]
    torch.manual_seed(3)
    out = gemma.generate(torch.tensor(prompts), **SETTINGS)
    assert [request.on_block.tokens for request in requests] == out.sequences[:, 5:].tolist()
    assert [request.on_block.updates[-1].nfe for request in requests] == out.nfe_per_row.tolist()


def test_canvases_of_requests_at_different_blocks_share_a_layout(gemma):
    """A request joining at the second boundary is decoded in the same layout as the first one's second canvas."""
    requests = _requests(gemma, [[5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11]])
    engine = ContinuousBatcher(gemma, max_batch_size=4, max_batch_width=128)
    engine.submit(requests[0])
    rows = [engine.decode_boundary()]
    engine.submit(requests[1])
    while engine.has_work():
        rows.append(engine.decode_boundary())
    assert rows == [1, 2, 1]
    for request in requests:
        assert len(request.on_block.tokens) == 32 and request.on_block.updates[-1].ended
        assert all(0 <= token < gemma.config.text_config.vocab_size for token in request.on_block.tokens)


def test_shifted_layout_forward_is_each_row_alone(gemma):
    """What a shared layout relies on: rows shifted right (padding masked, each row's own positions) give, through
    the loop's forward (encoder pass of the prefix, then the decoder on the canvas), each row's logits alone."""
    torch.manual_seed(0)
    prompts = [torch.randint(3, 300, (length,)) for length in (7, 20)]
    canvases = torch.randint(0, 320, (2, 16))
    width = 20 + 16
    x = torch.zeros(2, width, dtype=torch.long)
    key_mask = torch.zeros(2, width, dtype=torch.long)
    positions = torch.zeros(2, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        shift = 20 - len(prompt)
        x[row, shift:20], x[row, 20:] = prompt, canvases[row]
        key_mask[row, shift:] = 1
        positions[row] = (torch.arange(width) - shift).clamp(min=0)
    with torch.no_grad():
        cache = gemma._diffusion_new_cache(2, width)
        cache.set_length(width)
        columns = torch.arange(width)
        shared = gemma._diffusion_forward(x, key_mask.bool(), positions, cache, columns, None)
        for row, prompt in enumerate(prompts):
            alone_tokens = torch.cat([prompt, canvases[row]])[None]
            alone_cache = gemma._diffusion_new_cache(1, len(alone_tokens[0]))
            alone = gemma._diffusion_forward(
                alone_tokens,
                None,
                torch.arange(alone_tokens.shape[1])[None],
                alone_cache,
                torch.arange(alone_tokens.shape[1]),
                None,
            )
            torch.testing.assert_close(shared[row], alone[0], rtol=1e-4, atol=1e-4)
