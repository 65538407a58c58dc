"""Which weight-only FP8 kernel for a block step's products (issue #13, item 2): a sweep over tile shapes, split-K,
warps, pipeline stages and two formulations, at the LLaDA-8B products' shapes and a block step's rows.

`hf_dllm/fp8.py`'s `weight_only_matmul` reads the FP8 weight (128x128 block scales, transformers'
`FineGrainedFP8Config` layout) and multiplies in bf16 after scaling each 128-column slice of the partial product.
In the end-to-end step it streamed weights at ~1.46 TB/s (bf16 cuBLAS: ~2.05 TB/s), so the sweep asks which
variant streams fastest:

- `mma`: the kernel's formulation, `dot(x (BLOCK_M x K), w^T)`: at 32 rows Triton uses Ampere-style MMAs.
- `swap`: `dot(w (BLOCK_N x K), x^T)`, the weight's rows as the MMA's M (>= 64 lets Hopper's wgmma run), the
  transposed tile stored.
- `fp16`: either formulation multiplying in fp16 instead of bf16 (the FP8 -> fp16 conversion is one instruction per
  two values on Hopper, FP8 -> bf16 goes through fp32; bf16 activations convert to fp16 exactly below 65504 in
  magnitude, so this is a measurement of the conversion's cost, not a proposal to change the numerics).

Times are GPU time per product, `--repeats` products captured in one CUDA graph, rotating over 4 weight copies so
that no weight is still in L2 (as in a step, where every product reads a new weight). Prints the best variants per
shape and ends with one JSON line.

    python benchmarks/sweep_fp8_weight_only.py [--rows 32,256] [--shapes qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dllm import fp8  # noqa: E402
from hf_dllm.triton_ops import tl, triton  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@triton.jit
def _sweep_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr,
    FP16: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * per_split
    k_last = tl.minimum(k_first + per_split, k_tiles)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m = offs_m < M
    in_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] + k_first * BLOCK_K
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] + k_first * BLOCK_K
    scale_ptrs = scale_ptr + (offs_n // SCALE_N) * stride_sn
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_last):
        x = tl.load(x_ptrs, mask=in_m[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=in_n[:, None], other=0.0)
        scale = tl.load(scale_ptrs + (k * BLOCK_K) // SCALE_K, mask=in_n, other=0.0)
        if FP16:
            x = x.to(tl.float16)
            w = w.to(tl.float16)
        else:
            w = w.to(x.dtype)
        if SWAP:
            acc += tl.dot(w, tl.trans(x)) * scale[:, None]
        else:
            acc += tl.dot(x, tl.trans(w)) * scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP:
        result = tl.trans(acc)
    else:
        result = acc
    mask = in_m[:, None] & in_n[None, :]
    if SPLIT_K == 1:
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        partial_ptrs = partial_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(partial_ptrs, result, mask=mask)


def sweep_call(x, w8, scale, out, partials, cfg):
    rows, cols = x.shape
    n_out = w8.shape[0]
    grid = (triton.cdiv(n_out, cfg["BLOCK_N"]), triton.cdiv(rows, cfg["BLOCK_M"]), cfg["SPLIT_K"])
    _sweep_kernel[grid](
        x,
        w8,
        scale,
        out,
        partials,
        rows,
        n_out,
        cols,
        x.stride(0),
        w8.stride(0),
        scale.stride(0),
        out.stride(0),
        SCALE_N=128,
        SCALE_K=128,
        BLOCK_K=128,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        SPLIT_K=cfg["SPLIT_K"],
        SWAP=cfg["SWAP"],
        FP16=cfg["FP16"],
        num_warps=cfg["warps"],
        num_stages=cfg["stages"],
    )
    if cfg["SPLIT_K"] > 1:
        block = 1024
        fp8._sum_splits_kernel[(triton.cdiv(rows * n_out, block),)](
            partials, out, out, rows, n_out, cfg["SPLIT_K"], HAS_BIAS=False, BLOCK=block
        )
    return out


def graph_us(calls, repeats: int) -> float:
    """GPU time per call: `repeats` calls (rotating over `calls`) in one CUDA graph, median of 5 replays."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(repeats):
                calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeats)
    return statistics.median(times)


def configs(rows: int):
    block_m = max(16, triton.next_power_of_2(min(rows, 64)))
    for swap, fp16, block_n, split, warps, stages in itertools.product(
        (False, True), (False, True), (32, 64, 128), (1, 2, 4), (4,), (3, 6)
    ):
        if swap and block_n < 64:
            continue
        yield dict(SWAP=swap, FP16=fp16, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split, warps=warps, stages=stages)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--bandwidth", type=float, default=3.0, help="TB/s, for the floor column")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    block = (128, 128)
    results, started = [], time.time()
    for name in args.shapes.split(","):
        n_out, k_in = SHAPES[name]
        torch.manual_seed(0)
        copies = []
        for _ in range(4):
            weight = torch.randn(n_out, k_in, device=device, dtype=torch.bfloat16) * 0.02
            copies.append((weight, *fp8.quantize_blocks(weight, block)))
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k_in, device=device, dtype=torch.bfloat16)
            reference = fp8.weight_only_matmul(x, copies[0][1], copies[0][2], block)
            floor_us = n_out * k_in / (args.bandwidth * 1e12) * 1e6
            base = dict(shape=name, rows=rows, floor_us=floor_us)
            cublas = graph_us([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w, _, _ in copies], args.repeats)
            current = graph_us(
                [lambda w8=w8, s=s, x=x: fp8.weight_only_matmul(x, w8, s, block) for _, w8, s in copies], args.repeats
            )
            results.append(dict(base, kernel="bf16_cublas", us=cublas, tb_s=2 * n_out * k_in / cublas / 1e6))
            results.append(dict(base, kernel="weight_only_now", us=current, tb_s=n_out * k_in / current / 1e6))
            print(json.dumps(results[-2]), json.dumps(results[-1]), flush=True)
            out = torch.empty(rows, n_out, device=device, dtype=torch.bfloat16)
            partials = torch.empty(4, rows, n_out, device=device, dtype=torch.float32)
            for cfg in configs(rows):
                try:
                    got = sweep_call(x, copies[0][1], copies[0][2], out, partials, cfg).clone()
                    error = ((got.float() - reference.float()).norm() / reference.float().norm()).item()
                    us = graph_us(
                        [
                            lambda w8=w8, s=s, x=x, o=out, p=partials, c=cfg: sweep_call(x, w8, s, o, p, c)
                            for _, w8, s in copies
                        ],
                        args.repeats,
                    )
                except Exception as exc:  # noqa: BLE001  (a config that does not compile is a result)
                    results.append(dict(base, kernel="sweep", cfg=cfg, error=f"{type(exc).__name__}: {exc}"[:120]))
                    continue
                results.append(dict(base, kernel="sweep", cfg=cfg, us=us, tb_s=n_out * k_in / us / 1e6, error=error))
            del x, out, partials
        del copies
        torch.cuda.empty_cache()
        print(f"[{name} done, {time.time() - started:.0f} s]", flush=True)

    print(f"\n{torch.cuda.get_device_name(device)}: us per product (weight TB/s)")
    best = {}
    for name in args.shapes.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            mine = [r for r in results if r["shape"] == name and r["rows"] == rows]
            sweep = sorted((r for r in mine if r["kernel"] == "sweep" and "us" in r), key=lambda r: r["us"])
            fixed = {r["kernel"]: r for r in mine if r["kernel"] != "sweep"}
            print(
                f"{name:<8}{rows:>5}  floor {mine[0]['floor_us']:6.1f}  cuBLAS bf16 {fixed['bf16_cublas']['us']:7.1f} "
                f"({fixed['bf16_cublas']['tb_s']:.2f})  weight_only now {fixed['weight_only_now']['us']:7.1f} "
                f"({fixed['weight_only_now']['tb_s']:.2f})"
            )
            for r in sweep[:6]:
                print(f"      {r['us']:7.1f} ({r['tb_s']:.2f})  err {r['error']:.1e}  {r['cfg']}")
            for label, keep in (
                ("mma bf16", (False, False)),
                ("swap bf16", (True, False)),
                ("mma fp16", (False, True)),
            ):
                kind = [r for r in sweep if (r["cfg"]["SWAP"], r["cfg"]["FP16"]) == keep]
                if kind:
                    print(f"      best {label}: {kind[0]['us']:.1f} us {kind[0]['cfg']}")
            if sweep:
                best[f"{name}:{rows}"] = dict(us=sweep[0]["us"], tb_s=sweep[0]["tb_s"], cfg=sweep[0]["cfg"])
    print(json.dumps({"device": torch.cuda.get_device_name(device), "best": best, "rows": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
