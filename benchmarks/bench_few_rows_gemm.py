"""A block step's bf16 products at its few rows (issue #63): hf_dllm's few-rows kernel (`fp8_triton.few_rows_matmul`:
split-K, the weight tile as the MMA's M, float32 sums) against cuBLAS (`torch.nn.functional.linear`), on every
family's weights, the shapes taken from the benchmarks' model tables: LLaDA-8B (`bench_generate.LLADA_8B`),
LLaDA2.0-mini (`bench_llada2.LLADA2_MINI`: attention, dense first layer), Dream-7B (`bench_dream.DREAM_7B`),
LLaDA-MoE-7B-A1B (`bench_llada_moe.LLADA_MOE_7B`: attention; its experts are grouped products) and DiffusionGemma
26B-A4B (`bench_diffusion_gemma.GEMMA_26B_A4B`: a sliding layer's attention). q/k/v are one concatenated product, as
the models run them (`kernels.ConcatenatedProjections`).

Each product reads its weight from memory, not from L2: `--weight-copies` copies (default: enough for 256 MiB, 5x an
H200's L2) taken in turn. Times: GPU time per call, calls captured in one CUDA graph as a block step runs them (the
median of 5 replays, `bench_fp8_gemm.timed_us`). The floor: the weight's bytes over the device's copy bandwidth.
Every few-rows time includes the kernel that adds up its split-K partial sums; the config the autotuner chose is
reported. `kernels.few_rows_applies` says which shapes the models run it on now (the `rule` column): its range,
`kernels.FEW_ROWS_MIN_WEIGHT_BYTES` to `FEW_ROWS_MAX_WEIGHT_BYTES`, is to be set from this table.

Prints a table (us, speed-up over cuBLAS, error relative to the float32 product) and ends with one JSON line.

    python benchmarks/bench_few_rows_gemm.py                # 32 and 64 rows
    python benchmarks/bench_few_rows_gemm.py --rows 32 --shapes lladamoe_qkv,lladamoe_o --sweep   # every config
    python benchmarks/bench_few_rows_gemm.py --cpu          # tiny float16 shapes, the kernel in Triton's interpreter

`--cpu`: the kernel through Triton's interpreter (float16: the interpreter multiplies bfloat16 operands as their
raw bits) on tiny shapes, in seconds; checks that the script runs and the products agree, timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if "--cpu" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported (below, through hf_dllm)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_diffusion_gemma import GEMMA_26B_A4B  # noqa: E402
from bench_dream import DREAM_7B  # noqa: E402
from bench_generate import LLADA_8B, copy_bandwidth  # noqa: E402
from bench_llada2 import LLADA2_MINI  # noqa: E402
from bench_llada_moe import LLADA_MOE_7B  # noqa: E402

from hf_dllm import fp8_triton, kernels  # noqa: E402
from hf_dllm.triton_ops import TRITON_AVAILABLE  # noqa: E402


def attention_shapes(config: dict) -> dict:
    """(N, K) of the concatenated q/k/v product and of the output projection of a transformers-style config."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim)}


def mlp_shapes(config: dict) -> dict:
    """(N, K) of a dense MLP's concatenated gate/up product and of its down projection."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    return {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def family_shapes() -> dict:
    """name: (N, K) of each family's block-step products through `kernels.linear` (q/k/v concatenated)."""
    llada = dict(
        hidden_size=LLADA_8B["d_model"],
        num_attention_heads=LLADA_8B["n_heads"],
        num_key_value_heads=LLADA_8B["n_kv_heads"],
        intermediate_size=LLADA_8B["mlp_hidden_size"],
    )
    families = {
        "llada8b": {**attention_shapes(llada), **mlp_shapes(llada)},
        "llada2": {**attention_shapes(LLADA2_MINI), **mlp_shapes(LLADA2_MINI)},  # the dense first layer's MLP
        "dream": {**attention_shapes(DREAM_7B), **mlp_shapes(DREAM_7B)},
        "lladamoe": attention_shapes(LLADA_MOE_7B),
        "gemma": attention_shapes(GEMMA_26B_A4B),  # a sliding layer's
    }
    return {f"{family}_{name}": shape for family, shapes in families.items() for name, shape in shapes.items()}


CPU_SHAPES = {"tiny_qkv": (384, 128), "tiny_o": (128, 128), "tiny_deep": (96, 320)}


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.float() - exact).norm() / exact.norm()).item()


def chosen_config() -> str:
    """The config the few-rows autotuner chose for the shape it ran last (the interpreter's fixed one on the CPU)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return json.dumps(fp8_triton.INTERPRETER_CONFIGS["few_rows_16bit"])
    best = fp8_triton._few_rows_16bit_kernel.best_config
    return json.dumps(dict(best.kwargs, warps=best.num_warps, stages=best.num_stages))


def operands(n_out: int, k_in: int, rows: int, args, device, dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The weight copies taken in turn (`--weight-copies`, by default enough for 256 MiB; one on the CPU) and x."""
    weight_bytes = n_out * k_in * torch.finfo(dtype).bits // 8
    copies = 1 if args.cpu else args.weight_copies or max(2, math.ceil(256 * 2**20 / weight_bytes))
    torch.manual_seed(0)
    weights = [(torch.randn(n_out, k_in, device=device) * 0.02).to(dtype) for _ in range(copies)]
    return weights, torch.randn(rows, k_in, device=device).to(dtype)


def measure(name: str, n_out: int, k_in: int, rows: int, args, device, dtype, bandwidth) -> dict:
    weights, x = operands(n_out, k_in, rows, args, device, dtype)
    weight_bytes = weights[0].numel() * weights[0].element_size()
    exact = x.float() @ weights[0].float().t()
    row = dict(
        shape=name,
        rows=rows,
        n=n_out,
        k=k_in,
        weight_mib=weight_bytes / 2**20,
        copies=len(weights),
        rule=kernels.few_rows_applies(rows, n_out, k_in, dtype, torch.device(device)),
    )
    if bandwidth:
        row["floor_us"] = weight_bytes / bandwidth * 1e6
    row["cublas_error"] = relative_error(torch.nn.functional.linear(x, weights[0]), exact)
    if not TRITON_AVAILABLE:
        row["few_rows_error"] = "triton is not installed"
        return row
    row["few_rows_error"] = relative_error(fp8_triton.few_rows_matmul(x, weights[0]), exact)
    row["config"] = chosen_config()
    if args.cpu:  # the interpreter's wall time: a check that it runs, not a measurement
        start = time.perf_counter()
        fp8_triton.few_rows_matmul(x, weights[0])
        row["few_rows_interpreter_s"] = time.perf_counter() - start
        return row
    from bench_fp8_gemm import timed_us

    row["cublas_us"] = timed_us([lambda w=w: torch.nn.functional.linear(x, w) for w in weights], args.repeats)
    row["few_rows_us"] = timed_us([lambda w=w: fp8_triton.few_rows_matmul(x, w) for w in weights], args.repeats)
    row["speedup"] = row["cublas_us"] / row["few_rows_us"]
    return row


def sweep(name: str, n_out: int, k_in: int, rows: int, args, dtype) -> list[dict]:
    """Every config of `fp8_triton.few_rows_16bit_configs()` for these rows' tile (as the autotuner prunes them),
    timed as `measure` times the autotuned kernel (split sums included, weights rotated), fastest first."""
    from bench_fp8_gemm import timed_us
    from triton.runtime.errors import OutOfResources

    weights, x = operands(n_out, k_in, rows, args, "cuda", dtype)

    timings = []
    for config in fp8_triton.few_rows_16bit_configs():
        if config.kwargs["BLOCK_M"] != fp8_triton._row_tile(rows, 64):
            continue
        calls = [lambda w=w, c=config: fp8_triton.few_rows_matmul(x, w, config=c) for w in weights]
        try:
            us = timed_us(calls, args.repeats)
        except (OutOfResources, RuntimeError) as error:  # too much shared memory, say
            us = f"{type(error).__name__}"
        timings.append(dict(shape=name, rows=rows, config=dict(config.kwargs, stages=config.num_stages), us=us))
    return sorted(timings, key=lambda t: (isinstance(t["us"], str), t["us"] if isinstance(t["us"], float) else 0))


def print_table(results: list[dict], title: str) -> None:
    print()
    print(title)
    print(
        f"{'shape':<16}{'rows':>5}{'MiB':>7}{'rule':>6}{'floor':>8}{'cuBLAS':>8}{'few':>8}{'x':>6}"
        f"{'err cuBLAS':>12}{'err few':>10}  config"
    )
    for r in results:
        floor = f"{r['floor_us']:.1f}" if "floor_us" in r else "-"
        cublas = f"{r['cublas_us']:.1f}" if "cublas_us" in r else "-"
        few = f"{r['few_rows_us']:.1f}" if "few_rows_us" in r else "-"
        speedup = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        few_error = r["few_rows_error"]
        few_error = f"{few_error:.1e}" if isinstance(few_error, float) else few_error
        print(
            f"{r['shape']:<16}{r['rows']:>5}{r['weight_mib']:>7.1f}{'yes' if r['rule'] else 'no':>6}{floor:>8}"
            f"{cublas:>8}{few:>8}{speedup:>6}{r['cublas_error']:>12.1e}{few_error:>10}  {r.get('config', '')}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny float16 shapes through Triton's interpreter (CI)")
    parser.add_argument("--rows", default="32,64", help="comma list of row counts (a block step: 32 x batch)")
    parser.add_argument("--shapes", default=None, help="comma list of the shapes to run (default: all)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument(
        "--weight-copies", type=int, default=0, help="weights taken in turn (default: enough for 256 MiB, past L2)"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time every config on the selected shapes (the five fastest printed per shape; all in the JSON)",
    )
    args = parser.parse_args(argv)
    if args.cpu:
        device, dtype, shapes, bandwidth = "cpu", torch.float16, CPU_SHAPES, None
        rows_list = [5, 33]
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --cpu)")
        device, dtype, shapes = "cuda", getattr(torch, args.dtype), family_shapes()
        rows_list = [int(r) for r in args.rows.split(",")]
        bandwidth = copy_bandwidth(torch.device(device))
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(shapes)
        if unknown:
            parser.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(shapes)}")
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    results = []
    for name, (n_out, k_in) in shapes.items():
        for rows in rows_list:
            row = measure(name, n_out, k_in, rows, args, device, dtype, bandwidth)
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.cpu:
        title = f"CPU, Triton's interpreter, {dtype}: errors only (timings mean nothing)"
    else:
        title = (
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {dtype}, copy bandwidth "
            f"{bandwidth / 1e12:.2f} TB/s: us per call, weight read from memory"
        )
    print_table(results, title)
    swept = []
    if args.sweep and not args.cpu:
        for name, (n_out, k_in) in shapes.items():
            for rows in rows_list:
                timings = sweep(name, n_out, k_in, rows, args, dtype)
                swept.extend(timings)
                print(f"{name} x {rows} rows, fastest configs (us):")
                for t in timings[:5]:
                    print(f"    {t['us'] if isinstance(t['us'], str) else round(t['us'], 2)}  {t['config']}")
    timed = [r for r in results if "speedup" in r]
    faster = sorted({r["weight_mib"] for r in timed if r["speedup"] > 1.0})
    summary = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "dtype": str(dtype),
        "rule_range_mib": [kernels.FEW_ROWS_MIN_WEIGHT_BYTES / 2**20, kernels.FEW_ROWS_MAX_WEIGHT_BYTES / 2**20],
        "rule_max_rows": kernels.FEW_ROWS_MAX_ROWS,
        "speedup": {f"{r['shape']}:{r['rows']}": round(r["speedup"], 3) for r in timed},
        "few_rows_faster_weight_mib": faster,
        "slower_under_rule": [f"{r['shape']}:{r['rows']}" for r in timed if r["rule"] and r["speedup"] < 1.0],
        "max_error_ratio": max(
            (r["few_rows_error"] / r["cublas_error"] for r in results if isinstance(r["few_rows_error"], float)),
            default=None,
        ),
        "rows": results,
        "sweep": swept,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
