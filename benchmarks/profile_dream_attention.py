"""One Dream-7B dual-cache block step's attention (28 query / 4 key-value heads of 128, 33 query rows, 768 keys,
batch 1, bf16) on the GPU: transformers' `sdpa` (what `llada_triton` runs at this shape: 7 heads per group x 33 rows
> `attention.MAX_QUERY_ROWS`) against hf_dllm's split-KV `block_attention` (which tiles the 231 rows in 64-row
tiles). Data for deciding whether Dream should raise the row limit; prints one JSON line.

    python benchmarks/profile_dream_attention.py
"""

from __future__ import annotations

import functools
import json
import types

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_dllm.triton_attention import block_attention


def time_graph(fn, iters: int = 200) -> float:
    """Microseconds per call of `fn` replayed in a CUDA graph of `iters` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * iters)


def main() -> None:
    torch.manual_seed(0)
    results = {}
    for q_len, kv_len in ((33, 768), (33, 2048)):
        q = torch.randn(1, q_len, 28, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, 4, kv_len, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        padding = torch.ones(1, kv_len, dtype=torch.bool, device="cuda")
        mask = padding[:, None, None, :]
        module = types.SimpleNamespace(is_causal=False, num_key_value_groups=7, training=False)
        ours = block_attention(q, k, v, padding)
        theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=128**-0.5, is_causal=False)
        error = (ours.float() - theirs.float()).abs().max().item()
        sdpa = functools.partial(sdpa_attention_forward, module, q, k, v, mask, scaling=128**-0.5, is_causal=False)
        results[f"q{q_len}_kv{kv_len}"] = {
            "sdpa_us": round(time_graph(sdpa), 2),
            "block_attention_us": round(time_graph(functools.partial(block_attention, q, k, v, padding)), 2),
            "max_abs_diff": error,
        }
    print(json.dumps({"device": torch.cuda.get_device_name(), "dream_block_step_attention": results}))


if __name__ == "__main__":
    main()
