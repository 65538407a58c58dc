"""The split-KV attention's merge of its key splits (`triton_attention.block_attention`): folded into the attention
kernel (the last split program of a row tile merges; the default) and as a second kernel (`fold_merge=False`).

- Both give the same bits, over several splits, grouped-query heads, a key padding mask, a mask per query row with
  `kv_end`, skipped masked tiles, an FP8 cache and batch > 1; the folded call launches no second kernel, leaves its
  counters at zero, and gives the same bits when called again (CPU through Triton's interpreter, where the programs
  run one by one; on the GPU, where they run at once, also replayed in a CUDA graph).
- `merge_counters` keeps one zeroed buffer per device and owner, grown for a larger grid without dropping the smaller
  one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import interpreter_job

pytest.importorskip("triton", reason="the `triton` extra is not installed")

# (batch, heads, kv_heads, q_len, kv_len, dim, splits, mask): "keys" a (B, T) key padding mask with row 0
# left-padded, "queries" a block-causal (B, Lq, T) mask with `kv_end`, "skip" a (B, T) mask with skipped tiles,
# "chunks" the key padding mask with one warp (the folded merge takes a row tile in chunks: 16 rows of 64 here),
# "gap" masked keys skipped per row (`key_gap`) in even chunks, "gemma" that with DiffusionGemma's decoder tiles.
# On the CPU key tiles of 16 (few keys, several splits: interpreted programs are slow).
CPU_CASES = [
    (2, 4, 2, 5, 37, 16, 2, "keys"),
    (1, 4, 4, 8, 100, 32, 3, "keys"),
    (3, 4, 2, 8, 64, 16, 3, "queries"),
    (2, 2, 1, 20, 96, 16, 4, "skip"),
    (1, 4, 1, 8, 40, 64, 2, "chunks"),
    (2, 4, 2, 8, 96, 16, 3, "gap"),
]


def case_inputs(batch, heads, kv_heads, q_len, kv_len, dim, mask_kind, dtype, device, block_n=None):
    """q, k, v, the mask and `block_attention`'s keyword arguments (tiles, `kv_end`) of a case."""
    from hf_dllm.triton_attention import AttentionTiles, default_tiles

    q = torch.randn(batch, heads, q_len, dim, dtype=dtype, device=device)
    k, v = torch.randn(2, batch, kv_heads, kv_len, dim, dtype=dtype, device=device).unbind(0)
    tiles = default_tiles(heads // kv_heads * q_len)
    kwargs = dict(tiles=tiles if block_n is None else dataclasses.replace(tiles, block_n=block_n))
    if mask_kind == "queries":
        columns = torch.arange(kv_len, device=device)
        rows = torch.arange(kv_len - 2 * q_len, kv_len - q_len, device=device)
        mask = (columns[None, :] // q_len <= rows[:, None] // q_len).expand(batch, q_len, kv_len).clone()
        kwargs["kv_end"] = torch.full((batch,), kv_len - q_len, dtype=torch.int32, device=device)
    else:
        mask = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
        mask[0, : kv_len // 3] = False
        if mask_kind == "skip":
            mask[-1, 16:48] = False  # whole key tiles of 16 skipped
            kwargs["tiles"] = AttentionTiles(block_m=32, block_n=16, skip_masked=True)
        elif mask_kind == "chunks":
            kwargs["tiles"] = dataclasses.replace(kwargs["tiles"], num_warps=1)
        elif mask_kind in ("gap", "gemma"):  # a ring's unwritten slots, skipped (`key_gap`), in even chunks
            start = torch.tensor([kv_len // 2 - 8 * row for row in range(batch)], device=device)
            end = torch.full_like(start, kv_len * 4 // 5)
            for row in range(batch):
                mask[row, start[row] : end[row]] = False
            kwargs["key_gap"] = torch.stack([start, end], dim=1).to(torch.int32)
            if mask_kind == "gemma":  # DiffusionGemma's batch-1 sliding tiles
                from hf_dllm.modeling_diffusion_gemma import decoder_tiles

                kwargs["tiles"] = decoder_tiles(dim, batch)
            else:
                kwargs["tiles"] = dataclasses.replace(kwargs["tiles"], even_splits=True)
    mask[-1, ..., :3] = False
    return q, k, v, mask, kwargs


class CombineLaunches:
    """`_combine_splits_kernel` with its launches counted."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def check_fold_equals_two_launches(q, k, v, mask, splits, tiles, again=True, **kwargs) -> torch.Tensor:
    """The folded and the two-launch merge: the same bits, one launch against two (the keys were split), counters
    back at zero, and (with `again`) the folded call again gives the same bits. Returns the output."""
    from hf_dllm import triton_attention
    from hf_dllm.triton_attention import block_attention

    combine = CombineLaunches(triton_attention._combine_splits_kernel)
    triton_attention._combine_splits_kernel = combine
    try:
        folded = block_attention(q, k, v, mask, n_splits=splits, tiles=tiles, **kwargs)
        assert combine.count == 0, "the folded merge launched the combine kernel"
        unfolded = dataclasses.replace(tiles, fold_merge=False)
        two = block_attention(q, k, v, mask, n_splits=splits, tiles=unfolded, **kwargs)
        assert combine.count == 1, "the two-launch merge did not launch the combine kernel"
    finally:
        triton_attention._combine_splits_kernel = combine.kernel
    assert torch.equal(folded, two), ("folded != two launches", (folded.float() - two.float()).abs().max())
    counters = triton_attention._MERGE_COUNTERS[(q.device, None)]
    assert all(int(buffer.abs().sum()) == 0 for buffer in counters), "counters not back at zero"
    if again:
        assert torch.equal(block_attention(q, k, v, mask, n_splits=splits, tiles=tiles, **kwargs), folded), "again"
    return folded


INTERPRETER_SCRIPT = """
import torch
from hf_dllm.cache import quantize_kv
from tests.kernels.test_block_attention_merge import CPU_CASES, case_inputs, check_fold_equals_two_launches

torch.manual_seed(0)
# float16 once: the merge runs in float32 whatever the dtype (only its output is cast). Interpreted programs run
# one after another, so one repeated call shows the counters' reset.
for index, (batch, heads, kv_heads, q_len, kv_len, dim, splits, mask_kind) in enumerate(CPU_CASES):
    for dtype in (torch.float32, torch.float16) if index == 0 else (torch.float32,):
        q, k, v, mask, kwargs = case_inputs(batch, heads, kv_heads, q_len, kv_len, dim, mask_kind, dtype, "cpu", 16)
        out = check_fold_equals_two_launches(q, k, v, mask, splits, again=index == 0, **kwargs)
        assert out.isfinite().all(), (dtype, mask_kind)
# An FP8 cache (float8 K/V with a scale per key, read in place), float16 queries.
q, k, v, mask, kwargs = case_inputs(2, 4, 2, 8, 100, 16, "keys", torch.float16, "cpu", 16)
(k8, k_scale), (v8, v_scale) = quantize_kv(k.float()), quantize_kv(v.float())
check_fold_equals_two_launches(q, k8, v8, mask, 3, again=False, k_scale=k_scale, v_scale=v_scale, **kwargs)
# Past MAX_FOLDED_SPLITS the merge takes the second kernel, `fold_merge` or not: right (a 64-split merge) either way.
from hf_dllm import triton_attention
from tests.kernels.test_block_attention_merge import CombineLaunches
splits = triton_attention.MAX_FOLDED_SPLITS + 1
q, k, v, mask, kwargs = case_inputs(1, 2, 2, 4, 16 * splits, 16, "keys", torch.float32, "cpu", 16)
combine = triton_attention._combine_splits_kernel = CombineLaunches(triton_attention._combine_splits_kernel)
out = triton_attention.block_attention(q, k, v, mask, n_splits=splits, **kwargs)
assert combine.count == 1, "more splits than MAX_FOLDED_SPLITS folded"
scores = (q.double() @ k.double().transpose(-1, -2) / 4.0).masked_fill(~mask[:, None, None, :], float("-inf"))
assert (out.double() - (scores.softmax(-1) @ v.double()).transpose(1, 2)).abs().max() < 1e-5, "64-split merge"
print("merge checks passed")
"""

INTERPRETER_RUN = interpreter_job({"merge": INTERPRETER_SCRIPT}, timeout=300, HF_DLLM_KERNELS="triton")


@INTERPRETER_RUN.used_by
def test_folded_merge_equals_two_launches_in_interpreter():
    for result in INTERPRETER_RUN.results().values():
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "merge checks passed" in result.stdout


def test_merge_counters_grow_keep_every_buffer_and_are_never_made_in_a_capture(monkeypatch):
    from hf_dllm import triton_attention

    monkeypatch.setattr(triton_attention, "_MERGE_COUNTERS", {})
    device = torch.device("cpu")
    first = triton_attention.merge_counters(device, 16)
    assert first.dtype == torch.int32 and first.numel() >= 16 and not first.any()
    assert triton_attention.merge_counters(device, first.numel()) is first  # allocated once, not per call
    larger = triton_attention.merge_counters(device, first.numel() + 1)
    assert larger.numel() > first.numel() and not larger.any()
    # A CUDA graph captured on the smaller buffer still points at it: it stays referenced.
    assert triton_attention._MERGE_COUNTERS[(device, None)] == [first, larger]
    assert triton_attention.merge_counters(device, 16) is larger
    # An owner's counters are its own.
    owned = triton_attention.merge_counters(device, 16, owner=1234)
    assert owned is not larger and not owned.any() and triton_attention.merge_counters(device, 16, owner=1234) is owned
    # Inside a CUDA graph capture none is allocated (its zeroing would only run at replay): the caller merges in a
    # second kernel.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert triton_attention.merge_counters(torch.device("cuda", 0), 16) is None
    assert triton_attention._MERGE_COUNTERS[(torch.device("cuda", 0), None)] == []


# The shapes of the GPU tests of `block_attention` (`tests/generation/test_gpu.py`, LLaDA2.0-mini's block step in
# `test_llada2_kernels_gpu.py`), LLaDA-MoE-7B's batch-1 step (16 heads of 128, 32 queries, 384 keys) and
# DiffusionGemma-26B-A4B's batch-1 sliding layers (16 / 8 heads of 256, a 256-token canvas over a 1,023-slot ring).
GPU_CASES = [
    (1, 16, 16, 32, 384, 128, None, "keys"),
    (1, 32, 32, 32, 768, 128, None, "keys"),
    (8, 32, 32, 32, 800, 128, 3, "keys"),
    (2, 8, 2, 17, 300, 64, None, "keys"),
    (3, 4, 1, 5, 1000, 128, None, "keys"),
    (3, 16, 4, 32, 768, 128, 4, "queries"),
    (2, 4, 2, 32, 512, 128, 4, "skip"),
    (2, 8, 2, 32, 600, 128, 3, "gap"),
    (1, 16, 8, 256, 1279, 256, None, "gemma"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda case: "-".join(map(str, case)))
def test_folded_merge_equals_two_launches_on_gpu(case, dtype):
    """On the GPU the split programs run at once: the folded merge's last program must see every split's partials
    (the counter's acquire-release). The same bits as the two-launch merge (which launches the combine kernel: the
    keys were split), counters at zero, repeated calls equal."""
    batch, heads, kv_heads, q_len, kv_len, dim, splits, mask_kind = case
    if mask_kind == "gemma" and dtype == torch.float32:  # 295 KB of shared memory, over an H200's 227 KB
        pytest.skip("DiffusionGemma's decoder tiles are for half precision (float32 passes take SDPA)")
    torch.manual_seed(kv_len)
    q, k, v, mask, kwargs = case_inputs(batch, heads, kv_heads, q_len, kv_len, dim, mask_kind, dtype, "cuda")
    for _ in range(5):  # the programs' order changes from run to run
        check_fold_equals_two_launches(q, k, v, mask, splits, **kwargs)


@pytest.mark.gpu
def test_folded_merge_in_a_cuda_graph_equals_eager():
    """A CUDA graph of folded calls at two grid sizes sharing the counters (LLaDA-MoE-7B's batch-1 step; a batch-3
    grouped-query step), replayed on new inputs: every replay equals the eager two-launch merge bit for bit."""
    from hf_dllm import triton_attention
    from hf_dllm.triton_attention import block_attention, default_tiles

    torch.manual_seed(0)
    shapes = [(1, 16, 16, 32, 384, 128), (3, 16, 4, 32, 1000, 128)]
    inputs = []
    for batch, heads, kv_heads, q_len, kv_len, dim in shapes:
        q = torch.randn(batch, heads, q_len, dim, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn(2, batch, kv_heads, kv_len, dim, device="cuda", dtype=torch.bfloat16).unbind(0)
        inputs.append((q, k, v, default_tiles(heads // kv_heads * q_len)))

    def calls(fold: bool) -> list[torch.Tensor]:
        return [
            block_attention(q, k, v, tiles=dataclasses.replace(tiles, fold_merge=fold)) for q, k, v, tiles in inputs
        ]

    calls(True)  # compiled, and the counters allocated, before the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = calls(True)
    torch.cuda.current_stream().wait_stream(stream)
    counters = triton_attention._MERGE_COUNTERS[(torch.device("cuda", torch.cuda.current_device()), None)]
    for _ in range(3):
        for q, k, v, _tiles in inputs:
            for tensor in (q, k, v):
                tensor.normal_()
        graph.replay()
        expected = calls(False)
        torch.cuda.synchronize()
        assert all(map(torch.equal, outs, expected))
        assert all(int(buffer.abs().sum()) == 0 for buffer in counters)


@pytest.mark.gpu
def test_first_call_inside_a_capture_merges_in_a_second_kernel(monkeypatch):
    """No counters yet and the first call inside a CUDA graph capture: that call merges in a second kernel (no
    buffer allocated, whose zeroing would only run at replay), and the graph's replay equals the eager result."""
    from hf_dllm import triton_attention
    from hf_dllm.triton_attention import block_attention

    monkeypatch.setattr(triton_attention, "_MERGE_COUNTERS", {})
    torch.manual_seed(0)
    q = torch.randn(1, 16, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 16, 384, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
    tiles = dataclasses.replace(triton_attention.default_tiles(32), fold_merge=False)
    block_attention(q, k, v, tiles=tiles)  # compiled outside the capture; no counters made
    combine = CombineLaunches(triton_attention._combine_splits_kernel)
    monkeypatch.setattr(triton_attention, "_combine_splits_kernel", combine)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = block_attention(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    assert combine.count == 1 and not any(triton_attention._MERGE_COUNTERS.values())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, block_attention(q, k, v, tiles=tiles))
