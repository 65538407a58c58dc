"""GPU time of the LLaDA2 fused path's per-layer pieces where two implementations compete, at LLaDA2.0-mini's shapes
(hidden 2048, 256 experts top-8 + 1 shared, 16 / 4 heads of 128, block 32 against a 768-column cache), to set the
rules that pick between them:

- attention of a block step: the split-KV Triton kernel (`triton_attention.block_attention`, with the per-query
  mask) against sdpa on grouped queries (the `sdpa` path of `LLaDA2MoeAttention._fused_forward`, with its output
  layout copy), per batch size;
- the router's float32 logits: cuBLAS with the two casts the PyTorch path makes, the GEMM alone, and split-K as
  batched products summed in order (a candidate, not used), per token count;
- the alignment by expert: one program per expert against the chunked counting sort, per token count.

Each candidate is captured in a CUDA graph of 20 calls (as the generation loop replays steps) and timed over
replays with CUDA events. Prints tables and ends with one JSON line.

    python benchmarks/bench_llada2_kernels.py

`--attention-sweep BATCHES` times only the block step's attention, over the kernel's tile shapes, key splits and
`kv_end`, against sdpa as the model calls it, at LLaDA2.0-mini's shape or (`--attention-shape llada-8b`) LLaDA-8B's
(32 heads, bidirectional over the dual cache with a key padding mask): the measurements behind
`triton_attention.default_tiles` and the backends' dispatch rules.

    python benchmarks/bench_llada2_kernels.py --attention-sweep 32,16,8,1 [--attention-shape llada-8b]

`--llada-moe-router TOKENS` times only LLaDA-MoE-7B's few-token routing: the router product and `route` together,
cuBLAS's product against `triton_moe.router_partials` over 1-32 chunks of the hidden size (summed in `route`'s
kernel), each call on another router weight (none stays in L2): the measurement behind `router_splits`.

    python benchmarks/bench_llada2_kernels.py --llada-moe-router 1,32,64
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fp8_gemm import timed_us  # noqa: E402

from hf_dllm import triton_moe  # noqa: E402
from hf_dllm.cache import quantize_kv  # noqa: E402
from hf_dllm.modeling_llada2_moe import grouped_query_mask_for  # noqa: E402
from hf_dllm.triton_attention import AttentionTiles, block_attention  # noqa: E402


def graph_us(fn, calls: int = 20) -> float:
    """Microseconds per call of `fn()`, `calls` calls captured in a CUDA graph (`bench_fp8_gemm.timed_us`)."""
    return timed_us(fn, calls)


def attention_row(batch: int) -> dict:
    heads, kv_heads, dim, q_len, kv_len, block = 16, 4, 128, 32, 768, 32
    q = torch.randn(batch, heads, q_len, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, kv_len, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    columns = torch.arange(kv_len, device="cuda")
    positions = torch.arange(512, 512 + q_len, device="cuda")
    mask = (columns[None, :] // block <= positions[:, None] // block).expand(batch, 1, q_len, kv_len).clone()
    grouped = grouped_query_mask_for(mask, heads // kv_heads)
    additive = torch.zeros(grouped.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~grouped, float("-inf"))

    def split_kv():
        out = block_attention(q, k, v, mask[:, 0].expand(batch, q_len, kv_len), dim**-0.5)
        return out.reshape(batch, q_len, -1)

    def sdpa(attn_mask=grouped):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.view(batch, kv_heads, -1, dim), k, v, attn_mask=attn_mask, scale=dim**-0.5
        )
        return out.reshape(batch, heads, q_len, dim).transpose(1, 2).reshape(batch, q_len, -1)

    row = dict(batch=batch, split_kv_us=graph_us(split_kv), sdpa_us=graph_us(sdpa))
    row["sdpa_additive_mask_us"] = graph_us(lambda: sdpa(additive))
    reference = sdpa().float()
    row["split_kv_max_err"] = (split_kv().float() - reference).abs().max().item()
    row["additive_equal"] = bool(torch.equal(sdpa(additive), sdpa()))
    return row


# Tile shapes the attention sweep times (`--attention-sweep`): block_m, block_n, warps, stages; per shape.
SWEEP_TILES = {
    "llada2-mini": [
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (64, 32, 4, 3),
        (64, 128, 4, 2),
        (64, 128, 8, 2),
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 32, 8, 3),
        (128, 128, 8, 2),
    ],
    "llada-8b": [(32, 64, 4, 2), (32, 64, 4, 3), (32, 32, 4, 3), (32, 32, 4, 2), (32, 128, 4, 2), (32, 128, 4, 3)],
}
# More tiles for an FP8 cache (float8 K/V tiles are half the bytes: longer key tiles and more stages fit).
FP8_KV_EXTRA_TILES = [(32, 128, 8, 2), (32, 64, 4, 4), (32, 128, 4, 4), (32, 256, 8, 2)]
# Heads, key/value heads, and whether the step is block-causal (LLaDA2) or bidirectional over the whole cache.
SWEEP_SHAPES = {"llada2-mini": (16, 4, True), "llada-8b": (32, 32, False)}


def attention_sweep_rows(batch: int, shape: str = "llada2-mini", copies: int = 4) -> list[dict]:
    """The block step's attention at `batch`: 32 queries at column 512 of a 768-column cache, LLaDA2.0-mini's heads
    with its block-causal mask (or LLaDA-8B's, bidirectional with a key padding mask), for every tile shape of
    `SWEEP_TILES` x key splits (the default plan, 1, 2), with and without `kv_end` (block-causal only: the tiles past
    the block skipped), against sdpa as the model runs it (LLaDA2: on grouped queries). `copies` K/V copies are
    taken in turn so that the timed calls read them from memory, not from L2."""
    (heads, kv_heads, block_causal), dim, q_len, kv_len, block, q_start = SWEEP_SHAPES[shape], 128, 32, 768, 32, 512
    q = torch.randn(batch, heads, q_len, dim, device="cuda", dtype=torch.bfloat16)
    kv = [
        (
            torch.randn(batch, kv_heads, kv_len, dim, device="cuda", dtype=torch.bfloat16),
            torch.randn(batch, kv_heads, kv_len, dim, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(copies)
    ]
    columns = torch.arange(kv_len, device="cuda")
    positions = torch.arange(q_start, q_start + q_len, device="cuda")
    if block_causal:
        mask = (columns[None, :] // block <= positions[:, None] // block).expand(batch, 1, q_len, kv_len).clone()
        kernel_mask = mask[:, 0].expand(batch, q_len, kv_len)
        sdpa_mask = grouped_query_mask_for(mask, heads // kv_heads)
        kv_ends = [None, torch.full((batch,), q_start + q_len, device="cuda", dtype=torch.int32)]
    else:
        kernel_mask = torch.ones(batch, kv_len, device="cuda", dtype=torch.bool)
        kernel_mask[0, :100] = False  # one left-padded row
        sdpa_mask = kernel_mask[:, None, None, :]
        kv_ends = [None]

    def sdpa(k, v):
        if block_causal:  # grouped queries as multi-head attention, then the output layout copy
            out = torch.nn.functional.scaled_dot_product_attention(
                q.view(batch, kv_heads, -1, dim), k, v, attn_mask=sdpa_mask, scale=dim**-0.5
            )
            return out.reshape(batch, heads, q_len, dim).transpose(1, 2).reshape(batch, q_len, -1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=dim**-0.5)
        return out.transpose(1, 2).contiguous().reshape(batch, q_len, -1)

    reference = sdpa(*kv[0]).float()
    rows = [dict(shape=shape, batch=batch, kernel="sdpa", us=graph_us([functools.partial(sdpa, k, v) for k, v in kv]))]
    if not block_causal:  # an unpadded batch: sdpa without a mask (flash attention), as the model runs it then

        def maskless(k, v):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=dim**-0.5)
            return out.transpose(1, 2).contiguous().reshape(batch, q_len, -1)

        row = dict(shape=shape, batch=batch, kernel="sdpa_maskless")
        row["us"] = graph_us([functools.partial(maskless, k, v) for k, v in kv])
        rows.append(row)
    for block_m, block_n, warps, stages in SWEEP_TILES[shape]:
        tiles = AttentionTiles(block_m, block_n, warps, stages)
        for splits in (None, 1, 2):
            for end in kv_ends:

                def call(k, v, tiles=tiles, splits=splits, end=end):
                    return block_attention(q, k, v, kernel_mask, dim**-0.5, splits, kv_end=end, tiles=tiles)

                row = dict(shape=shape, batch=batch, kernel="split_kv", tiles=[block_m, block_n, warps, stages])
                row.update(splits=splits, kv_end=end is not None)
                try:
                    row["max_err"] = (call(*kv[0]).float().reshape(reference.shape) - reference).abs().max().item()
                    row["us"] = graph_us([functools.partial(call, k, v) for k, v in kv])
                except Exception as error:  # a tile shape that does not compile or fit (shared memory)
                    row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    if not block_causal:
        rows += fp8_kv_rows(q, kv, kernel_mask, reference, shape)
    return rows


def fp8_kv_rows(q, kv, kernel_mask, reference, shape: str) -> list[dict]:
    """The kernel over an FP8 cache (`kv_cache_dtype="fp8"`: float8 K/V with a scale per key, read in place) for
    every tile shape x key splits; `max_err` against sdpa over the model-dtype K/V (FP8 rounding included)."""
    batch, dim = q.shape[0], q.shape[-1]
    quantized = [(*quantize_kv(k), *quantize_kv(v)) for k, v in kv]
    rows = []
    for block_m, block_n, warps, stages in SWEEP_TILES[shape] + FP8_KV_EXTRA_TILES:
        tiles = AttentionTiles(block_m, block_n, warps, stages)
        for splits in (None, 1, 2, 3):

            def call(k8, k_scale, v8, v_scale, tiles=tiles, splits=splits):
                return block_attention(
                    q, k8, v8, kernel_mask, dim**-0.5, splits, tiles=tiles, k_scale=k_scale, v_scale=v_scale
                )

            row = dict(shape=shape, batch=batch, kernel="split_kv_fp8_kv", tiles=[block_m, block_n, warps, stages])
            row.update(splits=splits, kv_end=False)
            try:
                row["max_err"] = (call(*quantized[0]).float().reshape(reference.shape) - reference).abs().max().item()
                row["us"] = graph_us([functools.partial(call, *copy) for copy in quantized])
            except Exception as error:  # a tile shape that does not compile or fit (shared memory)
                row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def split_k_logits(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """The float32 router product as `splits` batched products over slices of the hidden dim, summed in order."""
    tokens, hidden = x.shape
    xs = x.float().view(tokens, splits, hidden // splits).transpose(0, 1)
    ws = weight.float().view(-1, splits, hidden // splits).permute(1, 2, 0)
    return torch.bmm(xs, ws).sum(0)


def router_row(tokens: int, weight: torch.Tensor) -> dict:
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    reference = torch.nn.functional.linear(x.double(), weight.double())
    cublas = torch.nn.functional.linear(x.float(), weight.float())
    x32, w32 = x.float(), weight.float()
    row = dict(
        tokens=tokens, cublas_with_casts_us=graph_us(lambda: torch.nn.functional.linear(x.float(), weight.float()))
    )
    row["cublas_gemm_only_us"] = graph_us(lambda: torch.nn.functional.linear(x32, w32))
    row["cublas_max_err"] = (cublas.double() - reference).abs().max().item()
    for splits in (2, 4, 8):
        row[f"split_k{splits}_with_casts_us"] = graph_us(functools.partial(split_k_logits, x, weight, splits))
        error = (split_k_logits(x, weight, splits).double() - reference).abs().max().item()
        row[f"split_k{splits}_max_err"] = error
    return row


def llada_moe_router_row(tokens: int, copies: int = 256) -> dict:
    """LLaDA-MoE-7B's few-token routing (hidden 2048, 64 experts top-8, bf16): the router's product and `route`
    together, as cuBLAS's product then `route`, and as `triton_moe.router_partials` over 1-32 chunks of the hidden
    size summed in `route`'s kernel; each call on another of `copies` router weights (64 MB in all: no weight stays
    in L2, as in a step, whose other weights evict it)."""
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    weights = [(torch.randn(64, 2048, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
    routing = (None, 1, 1, 8, "softmax", False, 1.0, torch.bfloat16)
    logits = torch.empty(tokens, 64, device="cuda", dtype=torch.bfloat16)

    def split(weight, splits):
        return triton_moe.route(triton_moe.router_partials(x, weight, splits), *routing, summed_logits=logits)

    row = dict(tokens=tokens, default_splits=triton_moe.router_splits(tokens, 64, 2048, x.device))
    row["cublas_route_us"] = timed_us(
        [functools.partial(lambda w: triton_moe.route(x @ w.T, *routing), w) for w in weights], copies
    )
    for splits in (1, 2, 4, 8, 16, 32):
        row[f"split{splits}_route_us"] = timed_us([functools.partial(split, w, splits) for w in weights], copies)
    return row


def align_row(tokens: int) -> dict:
    topk = torch.randint(0, 256, (tokens, 8), device="cuda")
    per_expert = triton_moe._align_per_expert(topk, 256, True)
    chunks = triton_moe._align_by_chunks(topk, 256, True)
    return dict(
        tokens=tokens,
        pairs=tokens * 9,
        per_expert_us=graph_us(lambda: triton_moe._align_per_expert(topk, 256, True)),
        chunks_us=graph_us(lambda: triton_moe._align_by_chunks(topk, 256, True)),
        equal=all(torch.equal(a, b) for a, b in zip(per_expert, chunks, strict=True)),
        # Candidates for the prefix-sum program's step (16 is used).
        chunks_scan_rows_4_us=graph_us(lambda: triton_moe._align_by_chunks(topk, 256, True, 4)),
        chunks_scan_rows_64_us=graph_us(lambda: triton_moe._align_by_chunks(topk, 256, True, 64)),
    )


def rows_of(fn, values: list[int], *args) -> list[dict]:
    rows = []
    for value in values:
        rows.append(fn(value, *args))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8,12,16,20,24,32,48,64")
    parser.add_argument("--tokens", default="32,64,128,256,512,1024,2048,16384")
    parser.add_argument(
        "--attention-sweep",
        default=None,
        help="batch sizes: time the attention's tile shapes, key splits and kv_end (only this)",
    )
    parser.add_argument("--attention-shape", choices=sorted(SWEEP_SHAPES), default="llada2-mini")
    parser.add_argument(
        "--llada-moe-router",
        default=None,
        help="token counts: time LLaDA-MoE-7B's router product + route, cuBLAS's vs split over the hidden size (only this)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(summary), flush=True)
    if args.attention_sweep:
        batches = [int(b) for b in args.attention_sweep.split(",")]
        sweep = [row for b in batches for row in attention_sweep_rows(b, args.attention_shape)]
        print(f"\n{args.attention_shape} attention per layer (us), best per batch:")
        for batch in sorted({row["batch"] for row in sweep}):
            timed = [row for row in sweep if row["batch"] == batch and "us" in row]
            sdpa = {row["kernel"]: row["us"] for row in timed if row["kernel"].startswith("sdpa")}
            print(f"batch {batch:>3}: " + ", ".join(f"{name} {us:.1f}" for name, us in sdpa.items()))
            for kernel in ("split_kv", "split_kv_fp8_kv"):
                kernels = sorted((row for row in timed if row["kernel"] == kernel), key=lambda row: row["us"])
                for row in kernels[:4]:
                    print(
                        f"    {kernel}: {row['us']:.1f} us tiles {row['tiles']} splits {row['splits']} "
                        f"kv_end {row['kv_end']}"
                    )
        summary["attention_sweep"] = sweep
        print(json.dumps(summary))
        return 0
    if args.llada_moe_router:
        summary["llada_moe_router"] = rows_of(llada_moe_router_row, [int(t) for t in args.llada_moe_router.split(",")])
        print("\nLLaDA-MoE router product + route (us): tokens, cuBLAS, split 1 / 2 / 4 / 8 / 16 / 32, default split")
        for r in summary["llada_moe_router"]:
            split = "".join(f"{r[f'split{k}_route_us']:>8.1f}" for k in (1, 2, 4, 8, 16, 32))
            print(f"{r['tokens']:>6}{r['cublas_route_us']:>8.1f}{split}{r['default_splits']:>8}")
        print(json.dumps(summary))
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    summary["attention"] = rows_of(attention_row, [int(b) for b in args.batches.split(",")])
    weight = (torch.randn(256, 2048, device="cuda") * 0.02).to(torch.bfloat16)
    summary["router"] = rows_of(router_row, tokens, weight)
    summary["align"] = rows_of(align_row, tokens)
    print("\nattention per layer (us): batch, split-KV, sdpa (bool mask), sdpa (additive mask)")
    for r in summary["attention"]:
        print(f"{r['batch']:>6}{r['split_kv_us']:>10.1f}{r['sdpa_us']:>10.1f}{r['sdpa_additive_mask_us']:>10.1f}")
    print("\nrouter logits (us): tokens, cuBLAS + casts, cuBLAS GEMM only, split-K 2 / 4 / 8 + casts")
    for r in summary["router"]:
        split = "".join(f"{r[f'split_k{k}_with_casts_us']:>10.1f}" for k in (2, 4, 8))
        print(f"{r['tokens']:>6}{r['cublas_with_casts_us']:>10.1f}{r['cublas_gemm_only_us']:>10.1f}{split}")
    print("\nalignment (us): tokens, per expert, chunks")
    for r in summary["align"]:
        print(f"{r['tokens']:>6}{r['per_expert_us']:>10.1f}{r['chunks_us']:>10.1f}  equal={r['equal']}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
