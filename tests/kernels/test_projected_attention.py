"""The split-KV attention on projected inputs (`triton_attention.ProjectedQK`): the kernel makes the queries and
writes the block's keys and values into the cache itself (the q/k norms and RoPE of `qk_norm_rope_to_cache`).

- Against `qk_norm_rope_to_cache` then `block_attention`: the same cache bits, and the same output bits in Triton's
  interpreter (CPU; neither contracts products into fused multiply-adds there), over one and several key splits,
  the block's columns inside one split and across two, grouped-query heads with several row tiles, batch > 1, a key
  padding mask, a mask per query row with `kv_end`, skipped masked tiles, no q/k norm, full and partial RoPE, a
  tensor-parallel rank's heads of the projection, float32 and float16.
- On a GPU (bf16, float32; the attention's own arithmetic may round differently from the unprojected launch's):
  the same cache bits, and the output's error against a float64 reference within 2x of the two-launch path's.
- Bad inputs (an FP8 cache, `key_gap`, a cache that does not hold the projection's heads, a bad cache_position)
  are refused with a `ValueError` before any launch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import interpreter_job

pytest.importorskip("triton", reason="the `triton` extra is not installed")

# (batch, q heads, kv heads, q_len, kv_len, dim, rotary, splits, first column, mask, norm, tensor-parallel heads):
# "keys" a (B, T) key padding mask with row 0 left-padded, "queries" a (B, Lq, T) mask with `kv_end`, "skip" a (B, T)
# mask with skipped tiles; the block's columns start at `first column` (None: scattered over the keys).
CASES = [
    (2, 4, 2, 8, 64, 16, 8, 3, 24, "keys", True, False),
    (1, 4, 4, 8, 100, 32, 32, 1, 90, "keys", True, False),
    (2, 4, 1, 8, 48, 16, 16, 2, 12, "keys", False, True),
    (1, 8, 2, 8, 80, 16, 8, 4, None, "keys", True, False),
    (3, 4, 2, 8, 64, 16, 8, 3, 40, "queries", True, False),
    (2, 2, 1, 20, 96, 16, 8, 4, 60, "skip", True, False),
]


def case_inputs(case, dtype, device, block_n=16):
    """The projected inputs, two copies of a cache holding earlier keys, the mask and `block_attention`'s kwargs."""
    from hf_dllm.triton_attention import AttentionTiles, ProjectedQK, default_tiles

    batch, heads, kv_heads, q_len, kv_len, dim, rotary, splits, first, mask_kind, norm, sharded = case
    # A tensor-parallel rank: its heads are the second half of a projection with twice the heads.
    all_q, all_k = (2 * heads, 2 * kv_heads) if sharded else (heads, kv_heads)
    qkv = torch.randn(batch, q_len, (all_q + 2 * all_k) * dim, device=device).to(dtype)
    cos, sin = (torch.randn(batch, q_len, rotary, device=device).to(dtype) for _ in range(2))
    weights = (torch.rand(dim, device=device).to(dtype) + 0.5, torch.rand(dim, device=device).to(dtype) + 0.5)
    if first is None:
        position = torch.randperm(kv_len, device=device)[:q_len]
    else:
        position = torch.arange(first, first + q_len, device=device)
    projected = ProjectedQK(
        qkv, heads, kv_heads, *(weights if norm else (None, None)), 1e-6, cos, sin, position,
        (all_q, all_k) if sharded else None, (heads, kv_heads) if sharded else (0, 0),
    )  # fmt: skip
    keys, values = (torch.randn(batch, kv_heads, kv_len, dim, device=device).to(dtype) for _ in range(2))
    tiles = dataclasses.replace(default_tiles(heads // kv_heads * q_len), block_n=block_n, block_m=16)
    kwargs = dict(tiles=tiles, n_splits=splits)
    if mask_kind == "queries":
        columns = torch.arange(kv_len, device=device)
        rows = torch.arange(kv_len - 2 * q_len, kv_len - q_len, device=device)
        mask = (columns[None, :] // q_len <= rows[:, None] // q_len).expand(batch, q_len, kv_len).clone()
        kwargs["kv_end"] = torch.full((batch,), kv_len - q_len, dtype=torch.int32, device=device)
    else:
        mask = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
        mask[0, : min(kv_len // 4, int(position.min()))] = False
        if mask_kind == "skip":
            mask[-1, 16:48] = False  # whole key tiles of 16 skipped
            kwargs["tiles"] = AttentionTiles(block_m=16, block_n=16, skip_masked=True)
    caches = [(keys.clone(), values.clone()) for _ in range(2)]
    return projected, caches, mask, kwargs


def both_paths(projected, caches, mask, kwargs):
    """The output of the projected launch and of `qk_norm_rope_to_cache` then `block_attention` (each on its own
    copy of the cache)."""
    from hf_dllm import triton_moe
    from hf_dllm.triton_attention import block_attention

    inside = block_attention(projected, *caches[0], mask, **kwargs)
    query = triton_moe.projected_to_cache(projected, *caches[1])
    apart = block_attention(query, *caches[1], mask, **kwargs)
    return inside, apart


INTERPRETER_SCRIPT = """
import torch
from hf_dllm.triton_attention import block_attention
from tests.kernels.test_projected_attention import CASES, both_paths, case_inputs

torch.manual_seed(0)
for index, case in enumerate(CASES):
    for dtype in (torch.float32, torch.float16) if index == 0 else (torch.float32,):
        projected, caches, mask, kwargs = case_inputs(case, dtype, "cpu")
        written = caches[0][0].clone()
        inside, apart = both_paths(projected, caches, mask, kwargs)
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1]), ("cache", case)
        assert not torch.equal(caches[0][0], written), ("no keys written", case)
        assert torch.equal(inside, apart), ("output", case, dtype, (inside - apart).abs().max())
        assert inside.isfinite().all(), case
print("projected checks passed")
"""

INTERPRETER_RUN = interpreter_job({"projected": INTERPRETER_SCRIPT}, timeout=300, HF_DLLM_KERNELS="triton")


@INTERPRETER_RUN.used_by
def test_projected_attention_equals_the_two_launches_in_the_interpreter():
    done = INTERPRETER_RUN.results()["projected"]
    assert done.returncode == 0 and "projected checks passed" in done.stdout, done.stderr[-4000:]


def test_projected_attention_refuses_bad_inputs():
    from hf_dllm.triton_attention import block_attention

    projected, caches, mask, kwargs = case_inputs(CASES[0], torch.float32, "cpu")
    keys, values = caches[0]
    gap = torch.zeros(2, 2, dtype=torch.int32)
    scale = torch.ones(keys.shape[:3])
    for bad_kwargs, words in (
        (dict(key_gap=gap), "key_gap"),
        (dict(k_scale=scale, v_scale=scale), "FP8"),
    ):
        with pytest.raises(ValueError, match=words):
            block_attention(projected, keys, values, mask, **bad_kwargs)
    with pytest.raises(ValueError, match="do not hold"):
        block_attention(projected, keys[:, :1], values[:, :1], mask)
    with pytest.raises(ValueError, match="cache_position"):
        block_attention(projected._replace(cache_position=projected.cache_position[:3]), keys, values, mask)
    with pytest.raises(ValueError, match="first_heads"):
        block_attention(projected._replace(first_heads=(3, 0)), keys, values, mask)
    assert torch.equal(keys, caches[1][0]), "a refused call wrote the cache"


def reference_attention(projected, keys, values, mask, kv_end=None) -> torch.Tensor:
    """Float64 attention `(B, L, Hq, D)` of the two-launch path's queries over the written cache."""
    from hf_dllm import triton_moe

    query = triton_moe.projected_to_cache(projected, keys.clone(), values.clone()).double()
    n_rep = query.shape[1] // keys.shape[1]
    k, v = (t.double().repeat_interleave(n_rep, dim=1) for t in (keys, values))
    scores = query @ k.transpose(-1, -2) * query.shape[-1] ** -0.5
    visible = mask[:, None, None, :] if mask.dim() == 2 else mask[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_projected_attention_on_gpu(case, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    projected, caches, mask, kwargs = case_inputs(case, dtype, "cuda")
    inside, apart = both_paths(projected, caches, mask, kwargs)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1]), "cache bits"
    want = reference_attention(projected, *caches[1], mask)
    error_inside = (inside.double() - want).abs().max().item()
    error_apart = (apart.double() - want).abs().max().item()
    assert error_inside <= 2 * error_apart + (1e-6 if dtype == torch.float32 else 1e-3), (error_inside, error_apart)
