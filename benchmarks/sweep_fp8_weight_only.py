"""Which weight-only FP8 kernel config for a block step's products (issue #13, item 2): a sweep of
`hf_dllm/fp8_triton.py`'s `_weight_only_kernel` over tile widths, split-K, warps, pipeline stages and its two
formulations, at the LLaDA-8B products' shapes and a block step's rows.

`weight_only_matmul` reads the FP8 weight (128x128 block scales, transformers' `FineGrainedFP8Config` layout), scales
each weight tile in registers and multiplies in bf16 (it once scaled each tile's partial product
instead; the first run of this sweep timed that version). Formulations:

- `SWAP=False`: `dot(x (BLOCK_M x K), w^T)`: at 32 rows Triton uses Ampere-style MMAs.
- `SWAP=True`: `dot(w (BLOCK_N x K), x^T)`, the weight's rows as the MMA's M, the transposed tile stored.

Each config runs through `weight_only_matmul(config=...)`, so the sweep times the kernel the model runs. Times are GPU
time per product (`bench_fp8_gemm.timed_us`: `--repeats` products captured in one CUDA graph), rotating over 4 weight
copies so that no weight is still in L2 (as in a step, where every product reads a new weight). Prints the best
configs per shape and ends with one JSON line. (The first run also timed an fp16-MMA
variant with a copy of the kernel; it is not a numerics the project uses, so it is not swept here.)

    python benchmarks/sweep_fp8_weight_only.py [--rows 32,256] [--shapes qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_gemm import timed_us  # noqa: E402
from bench_generate import copy_bandwidth  # noqa: E402

from hf_dllm import fp8, fp8_triton  # noqa: E402
from hf_dllm.triton_ops import triton  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
BLOCK = (128, 128)


def configs(rows: int) -> list:
    """The grid swept at `rows` (BLOCK_M: the smallest tile >= the rows, as the autotuner's pruning keeps)."""
    block_m = max(16, triton.next_power_of_2(min(rows, 64)))
    return [
        triton.Config(
            {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split, "SWAP": swap}, num_warps=4, num_stages=stages
        )
        for swap, block_n, split, stages in itertools.product((False, True), (32, 64, 128), (1, 2, 4), (3, 6))
        if not (swap and block_n < 64) and (rows <= 64 or split == 1)
    ]


def describe(config) -> dict:
    return dict(config.kwargs, warps=config.num_warps, stages=config.num_stages)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument(
        "--bandwidth", type=float, default=None, help="TB/s for the floor column (default: the measured copy's)"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if args.bandwidth is None:
        args.bandwidth = copy_bandwidth(device) / 1e12
    results, started = [], time.time()
    for name in args.shapes.split(","):
        n_out, k_in = SHAPES[name]
        torch.manual_seed(0)
        copies = []
        for _ in range(4):
            weight = torch.randn(n_out, k_in, device=device, dtype=torch.bfloat16) * 0.02
            copies.append((weight, *fp8.quantize_blocks(weight, BLOCK)))
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k_in, device=device, dtype=torch.bfloat16)
            reference = fp8_triton.weight_only_matmul(x, copies[0][1], copies[0][2], BLOCK)
            base = dict(shape=name, rows=rows, floor_us=n_out * k_in / (args.bandwidth * 1e12) * 1e6)
            cublas = timed_us([functools.partial(torch.nn.functional.linear, x, w) for w, _, _ in copies], args.repeats)
            current = timed_us(
                [functools.partial(fp8_triton.weight_only_matmul, x, w8, s, BLOCK) for _, w8, s in copies], args.repeats
            )
            results.append(dict(base, kernel="bf16_cublas", us=cublas, tb_s=2 * n_out * k_in / cublas / 1e6))
            results.append(dict(base, kernel="weight_only_autotuned", us=current, tb_s=n_out * k_in / current / 1e6))
            print(json.dumps(results[-2]), json.dumps(results[-1]), flush=True)
            for config in configs(rows):
                row = dict(base, kernel="sweep", cfg=describe(config))
                try:
                    got = fp8_triton.weight_only_matmul(x, copies[0][1], copies[0][2], BLOCK, config=config)
                    row["error"] = ((got.float() - reference.float()).norm() / reference.float().norm()).item()
                    calls = [
                        functools.partial(fp8_triton.weight_only_matmul, x, w8, scale, BLOCK, config=config)
                        for _, w8, scale in copies
                    ]
                    row["us"] = timed_us(calls, args.repeats)
                    row["tb_s"] = n_out * k_in / row["us"] / 1e6
                except Exception as exc:  # noqa: BLE001  (a config that does not compile is a result)
                    row["failure"] = f"{type(exc).__name__}: {exc}"[:120]
                results.append(row)
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
                f"({fixed['bf16_cublas']['tb_s']:.2f})  autotuned {fixed['weight_only_autotuned']['us']:7.1f} "
                f"({fixed['weight_only_autotuned']['tb_s']:.2f})"
            )
            for r in sweep[:6]:
                print(f"      {r['us']:7.1f} ({r['tb_s']:.2f})  err {r['error']:.1e}  {r['cfg']}")
            for swap in (False, True):
                kind = [r for r in sweep if r["cfg"]["SWAP"] == swap]
                if kind:
                    print(f"      best SWAP={swap}: {kind[0]['us']:.1f} us {kind[0]['cfg']}")
            if sweep:
                best[f"{name}:{rows}"] = dict(us=sweep[0]["us"], tb_s=sweep[0]["tb_s"], cfg=sweep[0]["cfg"])
    print(json.dumps({"device": torch.cuda.get_device_name(device), "best": best, "rows": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
