"""DiffusionGemma's attention on CUDA (bfloat16): `block_attention` at the 26B-A4B decoder shapes with the tile
options `DECODER_ATTENTION` may pick, and at its encoder's (a mask per query) with `ENCODER_ATTENTION`'s, against
float32 (its error within 2x of bfloat16 SDPA's); the fixture model's encoder passes on the "triton" backend, captured
equal to eager; `qkv_norm_rope` writing into a cache's canvas slots; the fixture model's captured decoder step on the
"triton" backend (K/V written in place) equal to its eager step."""

from __future__ import annotations

import pytest
import torch

from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaStaticCache, decoder_tiles
from hf_dllm.triton_attention import AttentionTiles, block_attention

pytest.importorskip("triton", reason="the `triton` extra is not installed")

# (query heads, key/value heads, head_dim, cached slots): the 26B-A4B's sliding and full layers.
SHAPES = {"sliding": (16, 8, 256, 1023), "full": (16, 2, 512, 1024)}


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_block_attention_error_at_the_26b_decoder_shapes(kind, batch):
    """A 256-token canvas over the cache's slots (the first 40% written, rows left-padded by their own amounts)
    and its own keys: every tile option's error against float32 within 2x of SDPA's (bfloat16, additive mask)."""
    heads, kv_heads, dim, slots = SHAPES[kind]
    generator = torch.Generator(device="cuda").manual_seed(batch)
    # Unit-spread scores (DiffusionGemma's scale is 1): queries scaled by dim^-0.5.
    q = (torch.randn(batch, heads, 256, dim, device="cuda", generator=generator) * dim**-0.5).bfloat16()
    k = torch.randn(batch, kv_heads, slots + 256, dim, device="cuda", generator=generator).bfloat16()
    v = torch.randn(batch, kv_heads, slots + 256, dim, device="cuda", generator=generator).bfloat16()
    valid = torch.zeros(batch, slots + 256, dtype=torch.bool, device="cuda")
    for row in range(batch):
        valid[row, (37 * row) % 128 : int(0.4 * slots)] = True
    valid[:, slots:] = True
    group = heads // kv_heads
    scores = q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    exact = (scores.softmax(-1) @ v.float().repeat_interleave(group, 1)).transpose(1, 2)
    additive = torch.zeros(valid.shape, dtype=torch.bfloat16, device="cuda").masked_fill_(~valid, float("-inf"))
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=additive[:, None, None, :], scale=1.0, enable_gqa=True
    ).transpose(1, 2)
    bar = 2 * (sdpa.float() - exact).abs().max().item() + 1e-4
    tables = decoder_tiles(dim, batch)
    for tiles in (
        tables,
        AttentionTiles(**dict(tables.__dict__, skip_masked=True)),
        AttentionTiles(**dict(tables.__dict__, skip_masked=True, splits=1)),
        AttentionTiles(block_m=64 if dim <= 256 else 32, block_n=32, num_warps=8, skip_masked=True),
    ):
        out = block_attention(q, k, v, valid, scale=1.0, tiles=tiles)
        error = (out.float() - exact).abs().max().item()
        assert error <= bar, (tiles, error, bar)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_block_attention_error_at_the_26b_encoder_shapes(kind, batch):
    """The encoder's pass over an accepted 256-token canvas: its mask per query (`encoder_key_mask`: causal, within
    the 1,024-column window in sliding layers) over the cache's slots (a sliding ring that has wrapped, columns in
    slot order c mod 1,023; a full layer's first 640 columns; rows left-padded by their own amounts) and its own
    keys, through `block_attention` with `ENCODER_ATTENTION`'s tiles and the decoder's: the error against float32
    within 2x of SDPA's (bfloat16, the same mask)."""
    from types import SimpleNamespace

    from hf_dllm.modeling_diffusion_gemma import ENCODER_ATTENTION, attention_choice, encoder_key_mask

    heads, kv_heads, dim, slots = SHAPES[kind]
    written, window = (1100, 1024) if kind == "sliding" else (640, None)
    generator = torch.Generator(device="cuda").manual_seed(batch)
    slot_columns = torch.full((slots,), -1, dtype=torch.long, device="cuda")
    for column in range(max(0, written - slots), written):
        slot_columns[column % slots if kind == "sliding" else column] = column
    slot_valid = (slot_columns >= 0).expand(batch, -1).clone()
    for row in range(batch):
        slot_valid[row] &= slot_columns >= (37 * row) % 128
    columns = torch.arange(written, written + 256, device="cuda")
    cache = SimpleNamespace(columns=[slot_columns], valid=[slot_valid])
    mask = encoder_key_mask(cache, 0, columns, torch.ones(batch, 256, dtype=torch.bool, device="cuda"), window)
    q = (torch.randn(batch, heads, 256, dim, device="cuda", generator=generator) * dim**-0.5).bfloat16()
    k = torch.randn(batch, kv_heads, slots + 256, dim, device="cuda", generator=generator).bfloat16()
    v = torch.randn(batch, kv_heads, slots + 256, dim, device="cuda", generator=generator).bfloat16()
    group = heads // kv_heads
    scores = q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)
    scores.masked_fill_(~mask, float("-inf"))
    exact = (scores.softmax(-1) @ v.float().repeat_interleave(group, 1)).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True
    ).transpose(1, 2)
    bar = 2 * (sdpa.float() - exact).abs().max().item() + 1e-4
    for tiles in (attention_choice(dim, batch, ENCODER_ATTENTION)[1], decoder_tiles(dim, batch)):
        out = block_attention(q, k, v, mask[:, 0], scale=1.0, tiles=tiles)
        error = (out.float() - exact).abs().max().item()
        assert error <= bar, (tiles, error, bar)


@pytest.mark.gpu
def test_captured_encoder_passes_on_triton_equal_eager(gemma_cuda_bf16, monkeypatch):
    """With `ENCODER_ATTENTION` on "triton" for every width, the fixture model's encoder passes (a left-padded
    prompt, then an accepted canvas) run `block_attention` with their masks per query, and the canvas pass captured
    and replayed from a CUDA graph writes the eager pass's keys and values and leads to its next decoder logits."""
    from hf_dllm import modeling_diffusion_gemma

    model = gemma_cuda_bf16
    text, canvas = model.config.text_config, model.config.canvas_length
    calls = []
    attention = modeling_diffusion_gemma.block_attention

    def counted(*args, **kwargs):  # the mask's dims: 3 for a mask per query (the encoder's)
        calls.append(None if args[3] is None else args[3].dim())
        return attention(*args, **kwargs)

    monkeypatch.setattr(modeling_diffusion_gemma, "block_attention", counted)
    for key, (_, tiles) in list(modeling_diffusion_gemma.ENCODER_ATTENTION.items()):
        monkeypatch.setitem(modeling_diffusion_gemma.ENCODER_ATTENTION, key, ("triton", tiles))
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(3, text.vocab_size, (2, 5 + canvas), device="cuda", generator=generator)
    valid = torch.ones(2, 5 + canvas, dtype=torch.bool, device="cuda")
    valid[1, :2] = False
    following = torch.randint(3, text.vocab_size, (2, canvas), device="cuda", generator=generator)
    columns = torch.arange(5, 5 + canvas, device="cuda")
    cache = model._diffusion_new_cache(2, 5 + 2 * canvas)  # one cache: its graphs live as long as its buffers
    model._graphs = None
    results = []
    try:
        # Eager; then the canvas pass captured (its first call runs eagerly) and the prompt's counted; then the
        # canvas pass replayed (and the prompt's captured). Every round writes the same columns from an emptied
        # cache, as generate() begins.
        for captured in (False, True, True):
            model.capture_encoder = captured
            with torch.no_grad():
                cache.set_length(0)
                model.encode(tokens[:, :5], torch.arange(5, device="cuda"), valid[:, :5], cache, end=5)
                model.encode(tokens[:, 5:], columns, valid[:, 5:], cache)
                logits = model.decode(following, columns + canvas, cache)
            results.append(
                (logits.clone(), [key.clone() for key in cache.storage_keys], [v.clone() for v in cache.valid])
            )
        replays = dict(model._graphs.replays)
    finally:
        model.capture_encoder = True
        model._graphs = None
    assert replays.get("encoder_layers"), replays
    assert 3 in calls, calls  # the encoder's masks per query reached the Triton attention
    # Every key a query may read is the eager pass' bit for bit: the written slots (the cache's `valid`) and the
    # canvas slots after them. Left padding's slots (row 1's first two columns) hold what their fully masked queries
    # made of nothing, which no query reads: eager and captured passes may differ there. (A sliding layer's ring
    # holds only the last columns: the canvas pass has overwritten the padding's slots there.)
    padding_left_out = 0
    for logits, keys, valid in results[1:]:
        torch.testing.assert_close(logits, results[0][0], rtol=0, atol=1e-5)
        for layer, (mine, eager) in enumerate(zip(keys, results[0][1], strict=True)):
            assert torch.equal(valid[layer], results[0][2][layer])
            canvas_slots = valid[layer].new_ones(valid[layer].shape[0], mine.shape[2] - valid[layer].shape[1])
            read = torch.cat([valid[layer], canvas_slots], dim=1)
            padding_left_out += int((read[0] & ~read[1]).sum())  # row 1's padding: written in row 0
            torch.testing.assert_close(mine.transpose(1, 2)[read], eager.transpose(1, 2)[read], rtol=0, atol=0)
    assert padding_left_out > 0  # the full-attention layers keep row 1's padding slots


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [256, 512])
def test_qkv_norm_rope_writes_into_canvas_slots(head_dim):
    """`qkv_norm_rope` (bfloat16, the 26B-A4B's head widths) with its keys and values written into a cache's canvas
    slots (strided views) writes bit for bit what it writes on its own, and nothing else of the storage; its
    queries within bfloat16 rounding of the PyTorch ops' (of the RoPE terms' size: their sum may cancel)."""
    from hf_dllm.modeling_diffusion_gemma import rotate_half
    from hf_dllm.triton_diffusion_gemma import qkv_norm_rope

    kv_heads = 8 if head_dim == 256 else 2
    query = torch.randn(2, 256, 16, head_dim, device="cuda").bfloat16()
    x = torch.randn(2, 256, kv_heads, head_dim, device="cuda").bfloat16()
    weights = torch.randn(head_dim, device="cuda"), torch.randn(head_dim, device="cuda")
    cos = torch.randn(1, 256, head_dim, device="cuda").bfloat16()
    sin = torch.randn(1, 256, head_dim, device="cuda").bfloat16()
    keys = torch.zeros(2, kv_heads, 1023 + 256, head_dim, device="cuda", dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    eps = (1e-6, 1e-6, 1e-6)
    alone = qkv_norm_rope(query, x, x, weights, eps, cos, sin)
    qkv_norm_rope(query, x, x, weights, eps, cos, sin, keys[:, :, 1023:], values[:, :, 1023:])
    assert torch.equal(keys[:, :, 1023:], alone[1]) and torch.equal(values[:, :, 1023:], alone[2])
    assert not keys[:, :, :1023].any() and not values[:, :, :1023].any()
    normed = query.float() * torch.pow(query.float().pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
    normed = (normed * weights[0]).bfloat16()
    terms = normed * cos[:, :, None], rotate_half(normed) * sin[:, :, None]
    want = (terms[0] + terms[1]).transpose(1, 2).float()
    size = (terms[0].float().abs() + terms[1].float().abs()).transpose(1, 2)  # (the sum may cancel)
    assert ((alone[0].float() - want).abs() <= size * 2**-6 + 1e-6).all()


@pytest.mark.gpu
def test_captured_triton_decoder_step_equals_eager(gemma_cuda_bf16):
    """The fixture model's decoder on the "triton" backend over a static cache (its K/V written into the canvas
    slots by the norm kernel), a left-padded row: the step captured and replayed from a CUDA graph gives the eager
    step's logits."""
    model = gemma_cuda_bf16
    text, canvas = model.config.text_config, model.config.canvas_length
    cache = model._diffusion_new_cache(2, 64)
    assert isinstance(cache, DiffusionGemmaStaticCache)
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(3, text.vocab_size, (2, 5), device="cuda", generator=generator)
    valid = torch.ones(2, 5, dtype=torch.bool, device="cuda")
    valid[1, :2] = False
    with torch.no_grad():  # as generate() runs it (the fused path, which writes the canvas slots)
        model.encode(tokens, torch.arange(5, device="cuda"), valid, cache)
    block = torch.randint(3, text.vocab_size, (2, canvas), device="cuda", generator=generator)
    positions = torch.arange(5, 5 + canvas, device="cuda")
    results = []
    try:
        model.set_decoder_attention("triton")  # (drops captured graphs: once, before the three passes)
        for captured in (False, True, True):  # eager, capture (its first call runs eagerly), replay
            model.capture_decoder = captured
            with torch.no_grad():
                results.append(model.decode(block, positions, cache).clone())
        replays = dict(model._graphs.replays)
    finally:
        model.set_decoder_attention(None)
        model.capture_decoder = True
    assert replays.get("decoder_layers") == 1, replays
    for logits in results[1:]:
        torch.testing.assert_close(logits, results[0], rtol=0, atol=1e-5)
