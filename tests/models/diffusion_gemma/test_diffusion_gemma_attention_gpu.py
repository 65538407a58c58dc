"""DiffusionGemma's decoder attention on CUDA (bfloat16): `block_attention` at the 26B-A4B decoder shapes with the
tile options `DECODER_ATTENTION` may pick, against float32 (its error within 2x of bfloat16 SDPA's); `qkv_norm_rope`
writing into a cache's canvas slots; the fixture model's captured decoder step on the "triton"
backend (K/V written in place) equal to its eager step."""

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
