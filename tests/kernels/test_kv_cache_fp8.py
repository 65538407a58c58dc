"""`kv_cache_dtype="fp8"`: K/V cached as float8 e4m3 with a float32 scale per (row, head, position)
(`cache.FP8DiffusionKVCache`), written by `update` (any backend) or by the fused RoPE kernel, read dequantized or in
place by the split-KV attention kernel."""

from __future__ import annotations

import importlib.util
import math
import textwrap

import pytest
import torch
from transformers import AutoModel

import hf_dllm
from hf_dllm.cache import FP8_E4M3_MAX, DiffusionKVCache, FP8DiffusionKVCache, NoCache, dequantize_kv, quantize_kv
from tests.conftest import FIXTURES, interpreter_job

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def e4m3_values() -> torch.Tensor:
    """Every finite float8 e4m3 value, sorted."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)].unique()


def test_quantize_kv_rounds_each_vector_to_the_nearest_e4m3_value_of_its_scale():
    torch.manual_seed(0)
    states = torch.randn(3, 2, 7, 16) * torch.logspace(-3, 2, 7)[None, None, :, None]
    states[0, 1, 3] = 0.0  # an all-zero vector: scale 1, zeros back
    quantized, scale = quantize_kv(states)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == states.shape
    assert scale.dtype == torch.float32 and scale.shape == states.shape[:-1]
    assert scale[0, 1, 3] == 1 and not quantized[0, 1, 3].float().any()
    # The largest |value| of every vector maps to 448 exactly; every value to the nearest point of the grid.
    nonzero = states.abs().amax(-1) > 0
    assert torch.allclose(scale[nonzero], states.abs().amax(-1)[nonzero] / FP8_E4M3_MAX)
    assert (quantized.float().abs().amax(-1)[nonzero] == FP8_E4M3_MAX).all()
    grid = e4m3_values()
    scaled = states / scale.unsqueeze(-1)
    nearest = (scaled.unsqueeze(-1) - grid).abs().min(-1).values
    assert torch.equal((scaled - quantized.float()).abs(), nearest)
    # So a dequantized vector is within half a grid step of the original: 2**-4 relative above 2**-6 * scale.
    error = (dequantize_kv(quantized, scale, torch.float32) - states).abs()
    bound = torch.maximum(states.abs() * 2**-4, scale.unsqueeze(-1) * 2**-10)
    assert (error <= bound * 1.0001).all()


def test_fp8_cache_writes_columns_keeps_rows_and_returns_dequantized_kv():
    torch.manual_seed(0)
    cache = FP8DiffusionKVCache(num_layers=2, max_batch_size=3, max_length=10)
    keys, values = torch.randn(3, 2, 10, 8), torch.randn(3, 2, 10, 8)
    # A forward over the whole cache attends to its own K/V as computed; the cache holds them quantized.
    full_keys, full_values = cache.update(keys, values, 1)
    assert full_keys is keys and full_values is values
    assert cache.keys[1].dtype == torch.float8_e4m3fn and cache.keys[1].element_size() == 1
    assert cache.keys[0] is None  # layers are allocated at their first write
    assert torch.equal(cache.keys[1].view(torch.uint8), quantize_kv(keys)[0].view(torch.uint8))
    assert torch.equal(cache.value_scales[1], quantize_kv(values)[1])

    new = torch.randn(3, 2, 2, 8) * 5
    columns = torch.tensor([3, 7])
    full_keys, _ = cache.update(new, new, 1, {"cache_position": columns})
    expected = keys.clone()
    expected[:, :, columns] = new
    assert torch.equal(full_keys, dequantize_kv(*quantize_kv(expected), torch.float32))

    # Rows leaving the batch (EOS): the scales move with their vectors.
    cache.keep_rows(torch.tensor([2, 0]))
    kept, _ = cache.update(new[[2, 0]], new[[2, 0]], 1, {"cache_position": columns})
    assert torch.equal(kept, dequantize_kv(*quantize_kv(expected[[2, 0]]), torch.float32))
    with pytest.raises(TypeError, match="quantized_layer"):
        cache.layer(1, 1, 2, 8, keys)


@pytest.fixture(scope="module")
def trained():
    return AutoModel.from_pretrained(FIXTURES / "llada-tiny-trained").eval()


@pytest.mark.parametrize("setting", [dict(dual_cache=True), dict(dual_cache=False), dict(threshold=0.9)])
def test_generate_with_an_fp8_cache_uses_it_and_stays_close(trained, setting):
    """The run keeps its K/V in float8 (the setting is not ignored), the step's logits move by the FP8 rounding
    only, and on the trained tiny model the tokens stay those of the float32 cache."""
    torch.manual_seed(0)
    ids = torch.randint(5, trained.config.vocab_size - 20, (4, 20))
    kwargs = dict(max_new_tokens=32, block_length=8, eos_early_stop=False, **setting)
    run = trained.generate_blocks(ids, kv_cache_dtype="fp8", **kwargs)
    assert isinstance(run.cache, FP8DiffusionKVCache)
    fp8 = run.run()
    assert all(k is None or k.dtype == torch.float8_e4m3fn for k in run.cache.keys)
    reference = trained.generate(ids, **kwargs)
    assert (fp8[:, 20:] == reference[:, 20:]).float().mean() >= 0.9

    # One dual-cache step's logits: the FP8 cache's differ from the float32 cache's, by little (6 layers: ~6 % of
    # the largest logit), and pick the same token almost everywhere.
    logits = {}
    canvas = torch.cat([ids, torch.full((4, 32), trained.generation_config.mask_token_id)], 1)
    positions, block = torch.arange(52), torch.arange(20, 28)
    with torch.no_grad():
        for kv in (None, "fp8"):
            cache = trained._diffusion_new_cache(4, 52, kv)
            trained._diffusion_forward(canvas, None, positions.expand(4, -1), cache, positions, slice(20, 28))
            logits[kv] = trained._diffusion_forward(
                canvas[:, block], None, block.expand(4, -1), cache, block, slice(None)
            )
    difference = (logits["fp8"] - logits[None]).abs().max() / logits[None].abs().max()
    assert 0 < difference < 0.15
    assert (logits["fp8"].argmax(-1) == logits[None].argmax(-1)).float().mean() >= 0.9


def test_kv_cache_dtype_is_checked_before_any_forward(trained):
    ids = torch.randint(5, 90, (1, 8))
    with pytest.raises(ValueError, match=r"`kv_cache_dtype` must be one of \(None, 'fp8'\)"):
        trained.generate(ids, max_new_tokens=8, kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="needs `use_cache=True`"):
        trained.generate(ids, max_new_tokens=8, use_cache=False, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="cache policy NoCache keeps none"):
        trained.generate(ids, max_new_tokens=8, kv_cache_dtype="fp8", cache_policy=NoCache())
    for name in ("llada2-tiny-ref", "dream-tiny-ref"):
        other = AutoModel.from_pretrained(FIXTURES / name)
        with pytest.raises(ValueError, match=r"`kv_cache_dtype='fp8'` is not supported by \w+"):
            other.generate(ids % 50 + 1, max_new_tokens=8, kv_cache_dtype="fp8")
    # The continuous-batching engine keeps K/V in the model's dtype: it refuses the request, not silently.
    from hf_dllm.serving.engine import ContinuousBatcher, EngineRequest

    engine = ContinuousBatcher(trained, max_batch_size=2)
    config = trained.resolve_generation_config(max_new_tokens=8, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="serving engine keeps K/V in the model's dtype"):
        engine.prepare(EngineRequest(prompt_ids=[5, 6, 7], config=config, on_block=lambda update: None))


def test_fp8_cache_halves_the_cache_bytes():
    like = torch.empty(0, dtype=torch.bfloat16)
    plain, fp8 = DiffusionKVCache(1, 4, 256), FP8DiffusionKVCache(1, 4, 256)
    plain.layer(0, 4, 8, 128, like)
    fp8.quantized_layer(0, 4, 8, 128, like)

    def cache_bytes(cache) -> int:
        buffers = [
            cache.keys[0],
            cache.values[0],
            *getattr(cache, "key_scales", []),
            *getattr(cache, "value_scales", []),
        ]
        return sum(b.numel() * b.element_size() for b in buffers if b is not None)

    # float8 vectors plus one float32 scale per 128 values: (128 + 4) / 256 of the bfloat16 bytes.
    assert cache_bytes(fp8) * 256 == cache_bytes(plain) * 132


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import math, torch, hf_dllm
    from hf_dllm import triton_ops
    from hf_dllm.cache import quantize_kv, dequantize_kv
    from hf_dllm.modeling_llada import apply_rotary_pos_emb, rotary_cos_sin
    from hf_dllm.triton_attention import block_attention

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        # RoPE writing quantized K/V: the bits of `quantize_kv` on the rotated keys (rounded to k's dtype) and on
        # the values, at scattered columns; a head per program (few tokens) and chunks of heads (512 tokens).
        runs = [(torch.tensor([9, 0, 3, 4, 5, 11, 2]), (20, 4))]
        if dtype == torch.float32:  # 2 x 256 tokens: chunks of heads (interpreted programs are slow: once)
            runs.append((torch.randperm(300)[:256], (3, 3)))
        for columns, heads in runs:
            length = len(columns)
            q, k, v = (torch.randn(2, length, h, 16, dtype=dtype) * 3 for h in (heads[0], heads[1], heads[1]))
            k[0, 1, 0] = 0  # an all-zero key: scale 1
            width = int(columns.max()) + 1
            cos, sin = rotary_cos_sin(torch.arange(length).expand(2, -1), 16, 10000.0)
            cache_k = torch.zeros(2, heads[1], width, 16, dtype=torch.float8_e4m3fn)
            cache_v = torch.zeros_like(cache_k)
            key_scales, value_scales = torch.zeros(2, heads[1], width), torch.zeros(2, heads[1], width)
            q_out = triton_ops.rotary_to_cache(q, k, v, cos, sin, cache_k, cache_v, columns, key_scales, value_scales)
            if length < 256:
                q_ref, k_ref = triton_ops.rotary(q, k, cos, sin)
            else:  # PyTorch's RoPE: `rotary`'s bits (tests/kernels/test_triton_interpreter.py), without its 12,288 programs
                q_ref, k_ref = (t.transpose(1, 2) for t in apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin))
            assert torch.equal(q_out, q_ref), "fp8 rotary_to_cache q"
            for cache, scales, states in ((cache_k, key_scales, k_ref.transpose(1, 2)), (cache_v, value_scales, v.transpose(1, 2))):
                expected, expected_scales = quantize_kv(states)
                assert torch.equal(cache[:, :, columns].view(torch.uint8), expected.view(torch.uint8)), "fp8 bits"
                assert torch.equal(scales[:, :, columns], expected_scales), "fp8 scales"
                untouched = torch.ones(width, dtype=torch.bool)
                untouched[columns] = False
                assert not cache[:, :, untouched].view(torch.uint8).any() and not scales[:, :, untouched].any()
            if length < 256:  # the rotated keys out as well (a refresh forward): the same cache, and `rotary`'s keys
                caches = [torch.zeros_like(t) for t in (cache_k, cache_v, key_scales, value_scales)]
                q_out, k_out = triton_ops.rotary_to_cache(q, k, v, cos, sin, *caches[:2], columns, *caches[2:], keys_out=True)
                assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref), "fp8 rotary_to_cache keys_out"
                for written, expected in zip(caches, (cache_k, cache_v, key_scales, value_scales)):
                    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8)), "keys_out cache"

        # The split-KV kernel reading FP8 K/V in place: float64 attention over the dequantized K/V.
        for batch, heads, kv_heads, q_len, kv_len, dim, splits in [(2, 4, 2, 5, 37, 16, None), (1, 4, 4, 8, 200, 32, 3)]:
            q = torch.randn(batch, heads, q_len, dim, dtype=dtype)
            k8, k_scale = quantize_kv(torch.randn(batch, kv_heads, kv_len, dim) * 4)
            v8, v_scale = quantize_kv(torch.randn(batch, kv_heads, kv_len, dim))
            padding = torch.ones(batch, kv_len, dtype=torch.bool)
            padding[0, :11] = False
            out = block_attention(q, k8, v8, padding, n_splits=splits, k_scale=k_scale, v_scale=v_scale)
            rep = heads // kv_heads
            keys = dequantize_kv(k8, k_scale, torch.float64).repeat_interleave(rep, 1)
            values = dequantize_kv(v8, v_scale, torch.float64).repeat_interleave(rep, 1)
            scores = (q.double() @ keys.transpose(-1, -2) / math.sqrt(dim)).masked_fill(~padding[:, None, None, :], -math.inf)
            ref = (scores.softmax(-1) @ values).transpose(1, 2)
            tol = 1e-5 if dtype == torch.float32 else 4e-3
            assert (out.double() - ref).abs().max() <= tol, ("fp8 attention", dtype, splits)

    print("fp8 interpreter checks passed")
    """
)


# generate() with an FP8 dual cache in the interpreter: the fused path (RoPE kernel quantizing, split-KV kernel reading
# float8), the fused write with sdpa, and the module path give the same tokens.
INTERPRETER_MODEL_SCRIPT = textwrap.dedent(
    """
    import torch, hf_dllm
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_pretrained("tests/fixtures/llada-tiny-trained", attn_implementation="llada_triton")
    ids = torch.randint(5, 90, (2, 18))
    kwargs = dict(max_new_tokens=8, block_length=4, eos_early_stop=False, kv_cache_dtype="fp8")
    fused = model.generate(ids, **kwargs)
    model.set_attn_implementation("sdpa")  # the fused RoPE write with another backend: K/V dequantized for it
    assert torch.equal(fused, model.generate(ids, **kwargs)), "fp8 dual-cache generation, fused path with sdpa"
    hf_dllm.kernels.set_kernel_mode("torch")
    assert torch.equal(fused, model.generate(ids, **kwargs)), "fp8 dual-cache generation"
    print("fp8 interpreter checks passed")
    """
)


INTERPRETER_RUN = interpreter_job(
    {"kernels": INTERPRETER_SCRIPT, "model": INTERPRETER_MODEL_SCRIPT},
    timeout=600,
    when=lambda: importlib.util.find_spec("triton") is not None,
    HF_DLLM_KERNELS="triton",
)


@INTERPRETER_RUN.used_by
def test_fp8_cache_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="the `triton` extra is not installed")
    for name, result in INTERPRETER_RUN.results().items():
        assert result.returncode == 0, (name, result.stdout[-3000:] + result.stderr[-3000:])
        assert "fp8 interpreter checks passed" in result.stdout, name


@gpu
@needs_cuda
@pytest.mark.parametrize("columns", [32, 768])
def test_rotary_to_cache_quantizes_as_quantize_kv_on_the_gpu(columns):
    from hf_dllm import triton_ops
    from hf_dllm.modeling_llada import rotary_cos_sin

    torch.manual_seed(0)
    device = "cuda"
    q, k, v = (torch.randn(4, columns, h, 128, device=device, dtype=torch.bfloat16) * 2 for h in (32, 32, 32))
    cos, sin = rotary_cos_sin(torch.arange(columns, device=device).expand(4, -1), 128, 500000.0)
    cache_k = torch.zeros(4, 32, 800, 128, device=device, dtype=torch.float8_e4m3fn)
    cache_v = torch.zeros_like(cache_k)
    key_scales, value_scales = (torch.zeros(4, 32, 800, device=device) for _ in range(2))
    position = torch.arange(columns, device=device) + 800 - columns
    triton_ops.rotary_to_cache(q, k, v, cos, sin, cache_k, cache_v, position, key_scales, value_scales)
    _, k_ref = triton_ops.rotary(q, k, cos, sin)
    for cache, scales, states in (
        (cache_k, key_scales, k_ref.transpose(1, 2)),
        (cache_v, value_scales, v.transpose(1, 2)),
    ):
        expected, expected_scales = quantize_kv(states)
        assert torch.equal(cache[:, :, position].view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(scales[:, :, position], expected_scales)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "batch,kv_len,splits,q_size",
    [(1, 768, None, 1), (8, 768, None, 1), (32, 768, 1, 1), (3, 300, 4, 1), (2, 96, 1, 3e5)],
)
def test_fp8_block_attention_within_twice_torchs_error(batch, kv_len, splits, q_size):
    """The kernel over float8 K/V against float64 attention over the same dequantized K/V: within twice the error of
    PyTorch's sdpa over the dequantized K/V in bfloat16. The kernel multiplies in fp16: queries beyond fp16's range
    (`q_size` 3e5) are scaled into it by a power of two."""
    from hf_dllm.triton_attention import block_attention

    torch.manual_seed(batch)
    device = "cuda"
    q = (torch.randn(batch, 32, 32, 128, device=device) * q_size).to(torch.bfloat16)
    k8, k_scale = quantize_kv(torch.randn(batch, 32, kv_len, 128, device=device) * 3)
    v8, v_scale = quantize_kv(torch.randn(batch, 32, kv_len, 128, device=device))
    padding = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    padding[0, : kv_len // 3] = False
    out = block_attention(q, k8, v8, padding, n_splits=splits, k_scale=k_scale, v_scale=v_scale)
    keys, values = dequantize_kv(k8, k_scale, torch.float64), dequantize_kv(v8, v_scale, torch.float64)
    mask = padding[:, None, None, :]
    scores = (q.double() @ keys.transpose(-1, -2) / math.sqrt(128)).masked_fill(~mask, -math.inf)
    reference = (scores.softmax(-1) @ values).transpose(1, 2)
    torch_out = torch.nn.functional.scaled_dot_product_attention(
        q, dequantize_kv(k8, k_scale, torch.bfloat16), dequantize_kv(v8, v_scale, torch.bfloat16), attn_mask=mask
    ).transpose(1, 2)
    torch_error = (torch_out.double() - reference).abs().max().item()
    assert (out.double() - reference).abs().max().item() <= 2 * torch_error + 1e-6


@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 32])
def test_fp8_cache_graph_steps_equal_eager_on_the_gpu(batch):
    """A bf16 LLaDA with an FP8 dual cache: CUDA-graph steps give the eager steps' tokens; at batch 32 the step's
    attention is the split-KV kernel reading float8 (sdpa would need the cache dequantized)."""
    from hf_dllm.attention import _kernel_applies

    torch.manual_seed(0)
    config = hf_dllm.LLaDAConfig(
        d_model=512, n_layers=2, n_heads=8, n_kv_heads=8, mlp_hidden_size=1024, vocab_size=512, mask_token_id=500
    )
    model = hf_dllm.LLaDAModelLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 400, (batch, 40), device="cuda")
    kwargs = dict(max_new_tokens=32, block_length=16, eos_early_stop=False, kv_cache_dtype="fp8")
    graphs = model.generate(ids, **kwargs)
    eager = model.generate(ids, **kwargs, disable_compile=True)
    assert torch.equal(graphs, eager)
    q = torch.empty(batch, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(batch, 8, 72, 64, device="cuda", dtype=torch.float8_e4m3fn)
    assert _kernel_applies(q, k, None, 0.0, fp8_kv=True)
