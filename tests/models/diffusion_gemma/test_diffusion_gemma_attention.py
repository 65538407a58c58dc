"""DiffusionGemma's decoder attention on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`, switched on
before Triton compiles anything, hence subprocesses beside the in-process tests), float32:

- `triton_attention.block_attention` at the decoder's layout in small (grouped-query heads, a ring cache partly
  empty, a left-padded row, a key chunk masked whole) against float64 SDPA, for the tile options the decoder's
  sweep times (`skip_masked`, fixed or even `splits`, row tiles of 16 to 128) and with key gaps (`key_gap`);
- `qkv_norm_rope` (an attention's norms and RoPE in one launch) against the PyTorch ops, shared and per-row RoPE
  tables; its keys and values written into a static cache's canvas slots (strided views) bit for bit what it
  writes on its own, refusing an `out` of the wrong shape, dtype or layout;
- the fixture model's encode + decode over a static cache on the fused path with the "triton" backend against the
  PyTorch path with SDPA: the same logits and caches, both passes' keys and values written in place
  (`canvas_slots`; the encoder's kept in the ring at `end_write`), every layer skipping its unwritten slots
  (`key_gap`: a sliding layer's ring, a full layer's columns not yet written) with the logits of reading them all;
  and with the encoder's passes (over the prompt, then over the accepted canvas) on the Triton attention as well
  (`ENCODER_ATTENTION`), its mask per query.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import FIXTURES, interpreter_job

pytest.importorskip("triton", reason="the `triton` extra is not installed")


def test_key_chunks_power_of_two_or_even():
    """The key chunks of `block_attention`: by default tiles per chunk a power of two (1,279 keys asked in 4 chunks of
    64-key tiles: 3 chunks of 8 tiles); `even_splits`: the asked chunks of the fewest whole tiles (4 of 5). Either
    way the chunks cover every key and none is empty."""
    from hf_dllm.triton_attention import key_chunks

    assert key_chunks(1279, 4, 64) == (8, 3) and key_chunks(1279, 4, 64, even=True) == (5, 4)
    assert key_chunks(1024, 4, 64) == key_chunks(1024, 4, 64, even=True) == (4, 4)
    for kv_len in (1, 63, 64, 65, 384, 1279, 5000):
        for n_splits in (1, 2, 3, 4, 7):
            for block_n in (16, 64):
                for even in (False, True):
                    tiles, chunks = key_chunks(kv_len, n_splits, block_n, even)
                    assert (
                        1 <= chunks <= n_splits and (chunks - 1) * tiles * block_n < kv_len <= chunks * tiles * block_n
                    )
                    if not even:
                        assert tiles & (tiles - 1) == 0
                    elif tiles > 1:  # the fewest tiles: one fewer per chunk would not cover the keys in n_splits
                        assert n_splits * (tiles - 1) * block_n < kv_len


def test_encoder_backend_follows_its_table_on_cuda_half_precision(monkeypatch):
    """`encoder_backend`: on CUDA in half precision `ENCODER_ATTENTION`'s backend for the heads' width (the nearest
    wider entry) and the batch class; SDPA on the CPU and in float32, whatever the table says."""
    from types import SimpleNamespace

    import torch

    from hf_dllm import modeling_diffusion_gemma
    from hf_dllm.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    config = DiffusionGemmaTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    sliding, full = (modeling_diffusion_gemma.DiffusionGemmaAttention(config, layer) for layer in (0, 1))

    def hidden(batch, cuda=True, dtype=torch.bfloat16):
        return SimpleNamespace(shape=(batch, 8, 64), is_cuda=cuda, dtype=dtype)

    assert [sliding.encoder_backend(hidden(b)) for b in (1, 8, 32)] == ["triton", "sdpa", "sdpa"]
    assert [full.encoder_backend(hidden(b)) for b in (1, 8, 32)] == ["triton", "sdpa", "sdpa"]  # the 256 entries
    table = modeling_diffusion_gemma.ENCODER_ATTENTION
    monkeypatch.setitem(table, (256, 1), ("sdpa", table[256, 1][1]))
    monkeypatch.setitem(table, (256, 8), ("triton", table[256, 8][1]))
    assert [sliding.encoder_backend(hidden(b)) for b in (1, 7, 8, 31, 32)] == ["sdpa"] * 2 + ["triton"] * 2 + ["sdpa"]
    assert sliding.encoder_backend(hidden(8, cuda=False)) == "sdpa"
    assert sliding.encoder_backend(hidden(8, dtype=torch.float32)) == "sdpa"
    monkeypatch.setitem(table, (512, 1), ("triton", table[512, 1][1]))
    sliding.head_dim = 300  # wider than 256: the 512 entries
    assert sliding.encoder_backend(hidden(1)) == "triton" and full.encoder_backend(hidden(1)) == "sdpa"


KERNELS_SCRIPT = textwrap.dedent(
    """
    import torch
    from hf_dllm.triton_attention import AttentionTiles, block_attention
    from hf_dllm.triton_diffusion_gemma import qkv_norm_rope

    torch.manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # The decoder's shape in small: 2 query heads per key/value head, a ring of 40 slots (partly empty: slots 12..39,
    # and a whole empty chunk) + 8 canvas keys; row 1 left-padded (its first 5 slots invalid).
    B, Hq, Hkv, L, S, D = 2, 4, 2, 8, 40, 16
    q, k, v = torch.randn(B, Hq, L, D), torch.randn(B, Hkv, S + L, D), torch.randn(B, Hkv, S + L, D)
    mask = torch.ones(B, S + L, dtype=torch.bool)
    mask[:, 12:S] = False
    mask[1, :5] = False
    want = sdpa(q.double(), k.double(), v.double(), attn_mask=mask[:, None, None, :], enable_gqa=True).transpose(1, 2)
    configs = [
        AttentionTiles(block_m=16, block_n=16),
        AttentionTiles(block_m=16, block_n=16, skip_masked=True),
        AttentionTiles(block_m=64, block_n=16, skip_masked=True, splits=1),  # every row of a K/V head in one tile
        AttentionTiles(block_m=32, block_n=8, skip_masked=True, splits=6),  # chunks of 8 keys: 12..39 masked whole
        AttentionTiles(block_m=128, block_n=32, num_warps=8, splits=2),
        AttentionTiles(block_m=32, block_n=8, splits=2, even_splits=True),  # chunks of 3 tiles (a power of two: 4)
    ]
    for tiles in configs:
        out = block_attention(q, k, v, mask, scale=1.0 / D**0.5, tiles=tiles)
        assert out.shape == (B, L, Hq, D) and out.is_contiguous()
        error = (out.double() - want).abs().max().item()
        assert error < 1e-5, (tiles, error)
    # A key gap (the ring's unwritten tail, masked too): the chunks split the other keys; per-row gaps, an empty one.
    for gap in ([[12, 40], [12, 40]], [[12, 40], [20, 40]], [[40, 40], [0, 0]]):
        key_gap = torch.tensor(gap, dtype=torch.int32)
        for tiles in (
            AttentionTiles(block_m=16, block_n=8, splits=3),
            AttentionTiles(block_m=32, block_n=8, splits=1),
            AttentionTiles(block_m=16, block_n=16, splits=4, skip_masked=True),
        ):
            out = block_attention(q, k, v, mask, scale=1.0 / D**0.5, tiles=tiles, key_gap=key_gap)
            error = (out.double() - want).abs().max().item()
            assert error < 1e-5, ("gap", gap, tiles, error)
    for bad, kwargs in (
        (torch.tensor([[12, 40], [12, 40]]), {}),  # int64
        (torch.tensor([[12, 40]], dtype=torch.int32), {}),  # one row for two
        (torch.tensor([[12, 40], [12, 40]], dtype=torch.int32), {"kv_end": torch.full((B,), S + L, dtype=torch.int32)}),
    ):
        try:
            block_attention(q, k, v, mask, key_gap=bad, **kwargs)
        except ValueError as error:
            assert "key_gap" in str(error)
        else:
            raise AssertionError(("key_gap taken", bad.dtype, tuple(bad.shape), list(kwargs)))
    try:
        block_attention(q, k, v, mask, tiles=AttentionTiles(block_m=16, block_n=16, splits=0))
    except ValueError as error:
        assert "splits" in str(error)
    else:
        raise AssertionError("splits=0 was taken")
    # No mask: skip_masked has nothing to test and must not read one.
    out = block_attention(q, k, v, None, tiles=AttentionTiles(block_m=32, block_n=16, skip_masked=True))
    assert (out.double() - sdpa(q.double(), k.double(), v.double(), enable_gqa=True).transpose(1, 2)).abs().max() < 1e-5

    # An attention's norms and RoPE in one launch (values: the keys' tensor normed without scale, as full layers
    # do) against the PyTorch ops, with shared and per-row tables (left padding shifts a row's positions); keys and
    # values into a cache's canvas slots (strided views) bit for bit what it writes on its own, nothing else.
    def plain(x, weight, eps, cos, sin):
        y = x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + eps, -0.5)
        y = (y if weight is None else y * weight.float()).to(x.dtype)
        if cos is not None:
            y = y * cos[:, :, None] + torch.cat((-y[..., D // 2 :], y[..., : D // 2]), -1) * sin[:, :, None]
        return y.transpose(1, 2)

    query, x = torch.randn(B, L, Hq, D), torch.randn(B, L, Hkv, D)
    q_weight, weight = torch.randn(D), torch.randn(D)
    for cos, sin in ((torch.randn(1, L, D), torch.randn(1, L, D)), (torch.randn(B, L, D), torch.randn(B, L, D))):
        eps = (1e-6, 1e-5, 1e-4)
        alone = qkv_norm_rope(query, x, x, (q_weight, weight), eps, cos, sin)
        for got, want in zip(alone, (plain(query, q_weight, eps[0], cos, sin), plain(x, weight, eps[1], cos, sin),
                                     plain(x, None, eps[2], None, None)), strict=True):
            assert got.is_contiguous() and (got - want).abs().max() < 1e-5, (got - want).abs().max()
        keys, values = (torch.full((B, Hkv, S + L, D), float("nan")) for _ in range(2))
        got = qkv_norm_rope(query, x, x, (q_weight, weight), eps, cos, sin, keys[:, :, S:], values[:, :, S:])
        assert got[1].data_ptr() == keys[:, :, S:].data_ptr() and got[2].data_ptr() == values[:, :, S:].data_ptr()
        assert torch.equal(keys[:, :, S:], alone[1]) and torch.equal(values[:, :, S:], alone[2])
        assert keys[:, :, :S].isnan().all() and values[:, :, :S].isnan().all()
    for bad in (keys[:, :, S + 1 :], keys[:, :, S:].double(), keys.transpose(-1, -2)[:, :, :, S:]):
        try:
            qkv_norm_rope(query, x, x, (q_weight, weight), eps, cos, sin, bad)
        except ValueError as error:
            assert "`out`" in str(error)
        else:
            raise AssertionError(f"qkv_norm_rope took key_out {tuple(bad.shape)} {bad.dtype}")
    print("ok")
    """
)

MODEL_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from transformers import AutoModel
    import hf_dllm
    from hf_dllm import kernels, triton_diffusion_gemma
    from hf_dllm import modeling_diffusion_gemma
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaStaticCache

    gaps = []  # the decoder's Triton attention calls' key gaps (None: every key read)
    block_attention = modeling_diffusion_gemma.block_attention
    modeling_diffusion_gemma.block_attention = lambda *a, key_gap=None, **k: (
        gaps.append(None if key_gap is None else key_gap.tolist()), block_attention(*a, key_gap=key_gap, **k))[1]
    model = AutoModel.from_pretrained(GEMMA_DIR).eval()
    text = model.config.text_config
    canvas_length = model.config.canvas_length
    torch.manual_seed(0)
    writes = []
    qkv_norm_rope = triton_diffusion_gemma.qkv_norm_rope
    triton_diffusion_gemma.qkv_norm_rope = lambda *a: (writes.append(len(a) == 9), qkv_norm_rope(*a))[1]


    def run(mode, backend, ids, attention_mask, canvas):
        kernels.set_kernel_mode(mode)
        model.set_decoder_attention(backend)
        cache = DiffusionGemmaStaticCache(text, capacity=64, canvas_length=canvas_length)
        writes.clear()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention_mask, cache=cache, decoder_input_ids=canvas).logits
        return logits, cache, list(writes)


    for layer in model.model.decoder.layers:  # (the Triton experts are tested elsewhere: the interpreter is slow)
        layer.experts.implementation = "loop"
    # A prompt shorter than the sliding window (its ring partly empty) and one that wraps it; row 1 left-padded.
    for prompt_len in (4, 11):
        ids = torch.randint(3, text.vocab_size, (2, prompt_len))
        attention_mask = torch.ones_like(ids)
        attention_mask[1, :2] = 0
        canvas = torch.randint(3, text.vocab_size, (2, canvas_length))
        want, want_cache, _ = run("torch", "sdpa", ids, attention_mask, canvas)
        gaps.clear()
        logits, cache, wrote = run("triton", "triton", ids, attention_mask, canvas)
        error = (logits - want).abs().max().item()
        assert error < 1e-4, (prompt_len, error)
        # Every layer skips its slots after the prompt: the sliding layers' ring (none once it wrapped), the full
        # layers' columns up to the capacity (64).
        slots = text.sliding_window - 1
        sliding = [kind == "sliding_attention" for kind in text.layer_types]
        want_gaps = [[[min(prompt_len, slots), slots]] * 2 if kind else [[prompt_len, 64]] * 2 for kind in sliding]
        assert gaps == want_gaps and not all(sliding), (prompt_len, gaps)
        modeling_diffusion_gemma.SKIP_UNWRITTEN_SLOTS = False
        gaps.clear()
        every_key, _, _ = run("triton", "triton", ids, attention_mask, canvas)
        modeling_diffusion_gemma.SKIP_UNWRITTEN_SLOTS = True
        assert gaps == [None] * text.num_hidden_layers, (prompt_len, gaps)
        assert (every_key - logits).abs().max() < 1e-4, (prompt_len, (every_key - logits).abs().max().item())
        # Both passes (the encoder's over a prompt no longer than the canvas, the decoder's) wrote their keys and
        # values straight into the canvas slots (each layer's one norm/RoPE launch given them), and the caches
        # hold what the PyTorch path copied there.
        assert wrote == [True] * 2 * text.num_hidden_layers, wrote
        for layer in range(text.num_hidden_layers):
            for mine, theirs in ((cache.storage_keys, want_cache.storage_keys),
                                 (cache.storage_values, want_cache.storage_values)):
                assert (mine[layer] - theirs[layer]).abs().max() < 1e-5, (prompt_len, layer)
        # The encoder's passes on the Triton attention too (`ENCODER_ATTENTION` "triton": its mask per query,
        # causal and in sliding layers windowed), over the prompt and then over the accepted canvas (its keys in
        # the canvas slots, kept in the ring at `end_write`), the next canvas decoded after: the PyTorch path's
        # logits and caches. (The prompt that wraps the ring only: the interpreter is slow.)
        if prompt_len != 11:
            continue
        attention_class = modeling_diffusion_gemma.DiffusionGemmaAttention
        encoder_backend = attention_class.encoder_backend
        columns = torch.arange(prompt_len, prompt_len + canvas_length)
        following = torch.randint(3, text.vocab_size, (2, canvas_length))
        after = {}
        for mode, backend, encoder in (("torch", "sdpa", encoder_backend), ("triton", "triton", "triton")):
            attention_class.encoder_backend = encoder if callable(encoder) else lambda self, hidden: encoder
            gaps.clear()
            first, cache, _ = run(mode, backend, ids, attention_mask, canvas)
            with torch.no_grad():
                model.encode(canvas, columns, torch.ones(2, canvas_length, dtype=torch.bool), cache)
                second = model.decode(following, columns + canvas_length, cache)
            after[mode] = (first, second, cache, len(gaps))
        attention_class.encoder_backend = encoder_backend
        (first, second, want_cache, _), (mine_first, mine_second, cache, calls) = after["torch"], after["triton"]
        assert calls == 4 * text.num_hidden_layers, calls  # two encoder and two decoder passes, every layer
        for a, b in ((mine_first, first), (mine_second, second)):
            assert (a - b).abs().max() < 1e-4, (prompt_len, (a - b).abs().max().item())
        for layer in range(text.num_hidden_layers):
            for mine, theirs in ((cache.storage_keys, want_cache.storage_keys),
                                 (cache.storage_values, want_cache.storage_values)):
                assert (mine[layer] - theirs[layer]).abs().max() < 1e-5, (prompt_len, layer)
    print("ok")
    """
)

ATTENTION_RUN = interpreter_job(
    {
        "kernels": KERNELS_SCRIPT,
        "model": f"GEMMA_DIR = {str(FIXTURES / 'diffusion-gemma-tiny-ref')!r}\n" + MODEL_SCRIPT,
    },
    timeout=600,
    HF_DLLM_KERNELS="triton",
)


@ATTENTION_RUN.used_by
@pytest.mark.parametrize("name", ["kernels", "model"])
def test_decoder_attention_in_the_interpreter(name):
    done = ATTENTION_RUN.results()[name]
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (name, done.stderr[-4000:])
