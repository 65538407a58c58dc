"""Which grouped GEMM runs LLaDA2.0-mini's experts fastest? (issues "The LLaDA 2.x family" item 7, and #13 item 1)

The two grouped products of a MoE layer take most of a block step. This benchmark times, at LLaDA2.0-mini's shapes
(257 groups: 256 routed experts of 512 plus the shared expert; gate/up `(257, 1024, 2048)`, down `(257, 2048, 512)`;
`tokens` tokens routed top-8 at random plus every token's shared-expert row, in expert order as
`triton_moe.align_by_expert` gives them; 32 tokens = a batch-1 block step, 1024 = batch 32), or with `--shape
llada-moe` LLaDA-MoE-7B-A1B's (64 experts of 1024, no shared expert, the tokens routed top-8 among 10 experts, as a
block step's tokens concentrate), or with `--shape diffusion-gemma` DiffusionGemma-26B-A4B's (128 experts of 704
over 2816, GELU gate, no shared expert, routed among all: 256 tokens = a batch-1 canvas), each replayed from a CUDA
graph:

- bf16 weights, `torch._grouped_mm` as the fused path calls it: the gather of the rows, gate/up, the SiLU gate
  (`triton_ops.silu_mul`), down;
- bf16 weights, hf_dllm's `grouped_gemm.grouped_matmul` (the gather and the SiLU gate fused in);
- FP8 weights with 128 x 128 block scales, `grouped_matmul`: the autotuner's choice, and (`--sweep fp8,bf16`,
  at the `--sweep-tokens` counts) every config of `grouped_configs()` and of `EXTRA_CONFIGS` (deeper pipelines,
  other warp counts, steps of 64 columns) with tiles of up to 64 rows that fits the shared memory, in FP8 (where the
  widths are whole 128-column blocks) and in bf16, each printed as it is timed;

against each product's weight-read floor (bytes of the groups that received rows, bf16 or FP8 plus scales, over the
measured copy bandwidth). Prints a table, the config each bf16 `grouped_matmul` ran (the autotuner's, or
`grouped_gemm.PINNED_CONFIGS`' where one is pinned) and ends with one JSON line.

    python benchmarks/bench_llada2_moe_gemm.py --tokens 32,256,1024
    python benchmarks/bench_llada2_moe_gemm.py --shape llada-moe --tokens 32 --sweep bf16
    python benchmarks/bench_llada2_moe_gemm.py --shape diffusion-gemma --tokens 256 --sweep bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from bench_generate import copy_bandwidth  # the rate every benchmark's weight-read floor divides by
from bench_llada2_kernels import graph_us  # the same timing as the kernel benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dllm import fp8, grouped_gemm, triton_moe, triton_ops  # noqa: E402

BLOCK = (128, 128)


class Shape(NamedTuple):
    """A MoE layer's experts: routed `experts` of width `inter` over `hidden`, `top_k` per token, plus a shared
    expert (`shared`); each step's tokens choose among `distinct` experts (all of them: uniform random routing)."""

    experts: int
    hidden: int
    inter: int
    top_k: int
    shared: bool
    distinct: int
    activation: str = "silu"


SHAPES = {
    "llada2-mini": Shape(256, 2048, 512, 8, True, 256),
    # LLaDA-MoE-7B-A1B: a batch-1 block step's 32 tokens chose ~9.2 distinct experts per layer (bench_llada_moe.py).
    "llada-moe": Shape(64, 2048, 1024, 8, False, 10),
    # DiffusionGemma 26B-A4B: 128 experts of width 704 over 2816, GELU gate; a canvas' 256 tokens touch them all.
    "diffusion-gemma": Shape(128, 2816, 704, 8, False, 128, "gelu_tanh"),
}

# Configs the `--sweep` times besides `grouped_gemm.grouped_configs()`: deeper pipelines and other warp counts at
# the few-row tiles, which the autotuner's list leaves out (each would cost every autotuned key its compile).
# K_DIVISOR 2 (steps of 64 columns, not the launch's 128 for bf16 weights): twice the loop's iterations over the
# same bytes, e.g. 11 whole ones over DiffusionGemma's down product's 704 columns instead of 5 and a half-masked one.
EXTRA_CONFIGS = [
    (dict(BLOCK_M=block_m, BLOCK_N=block_n, SWAP=swap, N_FASTEST=False), warps, stages)
    for block_m in (16, 32)
    for block_n, warps, stages in ((32, 4, 6), (64, 4, 5), (64, 8, 4), (128, 4, 4), (128, 8, 3), (256, 8, 3))
    for swap in (False, True)
] + [
    (dict(BLOCK_M=32, BLOCK_N=block_n, SWAP=swap, N_FASTEST=n_fastest, K_DIVISOR=2), warps, stages)
    for block_n, warps, stages in ((64, 4, 4), (64, 4, 6), (128, 4, 4), (128, 4, 6), (128, 8, 5), (256, 8, 4))
    for swap in (False, True)
    for n_fastest in (False, True)
]


def shape_row(tokens: int, bandwidth: float, sweep: list[str], shape: Shape = SHAPES["llada2-mini"]) -> dict:
    """One token count's timings (and, with `sweep`, the configs of `grouped_gemm.grouped_configs()` in those
    dtypes)."""
    experts, hidden, inter, top_k = shape.experts, shape.hidden, shape.inter, shape.top_k
    groups = experts + shape.shared
    pool = torch.randperm(experts, device="cuda")[: max(shape.distinct, top_k)]
    topk = torch.stack([pool[torch.randperm(len(pool), device="cuda")[:top_k]] for _ in range(tokens)])
    sorted_token, offsets, _ = triton_moe.align_by_expert(topk, experts, shape.shared)
    used = int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = (torch.randn(groups, 2 * inter, hidden, device="cuda") * 0.02).to(torch.bfloat16)
    down = (torch.randn(groups, hidden, inter, device="cuda") * 0.02).to(torch.bfloat16)
    # Widths are multiples of 128: gate/up's scale rows are the gate's then the up's, as the model stacks them.
    gate_up8, gate_up_scale = fp8.quantize_blocks(gate_up, BLOCK)
    down8, down_scale = fp8.quantize_blocks(down, BLOCK)
    pairs = sorted_token.shape[0]
    hidden_rows = torch.randn(pairs, inter, device="cuda", dtype=torch.bfloat16)

    activation = shape.activation

    def torch_gate_up():
        projected = torch._grouped_mm(x.index_select(0, sorted_token), gate_up.transpose(1, 2), offs=offsets)
        gate, up = projected.chunk(2, dim=-1)
        if activation == "silu":
            return triton_ops.silu_mul(gate, up)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    # FP8 with 128 x 128 blocks where the width is whole blocks (the gate's scale rows must end where the up's start).
    fp8_fits = inter % BLOCK[0] == 0

    candidates = {
        "gate_up": {
            "grouped_mm_bf16": torch_gate_up,
            "triton_bf16": lambda: grouped_gemm.grouped_matmul(
                x, offsets, gate_up, rows_of=sorted_token, gated=True, activation=activation
            ),
            "triton_fp8": lambda: grouped_gemm.grouped_matmul(
                x, offsets, gate_up8, gate_up_scale, BLOCK, rows_of=sorted_token, gated=True, activation=activation
            ),
        },
        "down": {
            "grouped_mm_bf16": lambda: torch._grouped_mm(hidden_rows, down.transpose(1, 2), offs=offsets),
            "triton_bf16": lambda: grouped_gemm.grouped_matmul(hidden_rows, offsets, down),
            "triton_fp8": lambda: grouped_gemm.grouped_matmul(hidden_rows, offsets, down8, down_scale, BLOCK),
        },
    }
    row = dict(tokens=tokens, pairs=pairs, groups_used=used)
    for gemm, fns in candidates.items():
        n, k = (2 * inter, hidden) if gemm == "gate_up" else (hidden, inter)
        row[f"{gemm}_floor_bf16_us"] = 1e6 * used * n * k * 2 / bandwidth
        row[f"{gemm}_floor_fp8_us"] = 1e6 * used * (n * k + (n // 128) * (k // 128) * 4) / bandwidth
        reference = fns["grouped_mm_bf16"]().float()
        for name, fn in fns.items():
            if name.endswith("fp8") and not fp8_fits:
                row[f"{gemm}_{name}_us"] = float("nan")
                continue
            out = fn()  # autotunes outside the graph
            if name.startswith("triton"):  # the config that ran: the autotuner's, or `grouped_gemm.PINNED_CONFIGS`'
                row[f"{gemm}_{name}_config"] = str(grouped_gemm._grouped_kernel.best_config)
            row[f"{gemm}_{name}_us"] = graph_us(fn, calls=10)
            row[f"{gemm}_{name}_rel_err"] = ((out.float() - reference).norm() / reference.norm()).item()
        for dtype in sweep:
            # The FP8 weights and scales, or the bf16 weights without.
            weights = {
                ("gate_up", "fp8"): (gate_up8, gate_up_scale, BLOCK),
                ("down", "fp8"): (down8, down_scale, BLOCK),
                ("gate_up", "bf16"): (gate_up, None, None),
                ("down", "bf16"): (down, None, None),
            }[gemm, dtype]
            w_bytes = weights[0].element_size()
            if dtype == "fp8" and not fp8_fits:
                continue
            extras = [triton.Config(kwargs, num_warps=w, num_stages=st) for kwargs, w, st in EXTRA_CONFIGS]
            for config in grouped_gemm.grouped_configs() + extras:
                name = f"{dtype}_" + "_".join(f"{key}{value}" for key, value in config.kwargs.items())
                name += f"_w{config.num_warps}s{config.num_stages}"
                # 128-row tiles are never chosen at a block step's rows; configs that cannot launch are not compiled.
                fits = grouped_gemm.fits_shared_memory(config, 2, w_bytes, 128, gemm == "gate_up", x.device)
                if config.kwargs["BLOCK_M"] == 128 or not fits:
                    continue
                if gemm == "gate_up":
                    fn = lambda c=config, w=weights: grouped_gemm.grouped_matmul(  # noqa: E731
                        x, offsets, *w, rows_of=sorted_token, gated=True, config=c, activation=activation
                    )
                else:
                    fn = lambda c=config, w=weights: grouped_gemm.grouped_matmul(  # noqa: E731
                        hidden_rows, offsets, *w, config=c
                    )
                try:
                    out = fn()
                    entry = round(graph_us(fn, calls=10), 1)
                    tolerance = 0.1 if dtype == "fp8" else 0.01  # FP8's quantization error is ~4 %
                    if (out.float() - reference).norm() > tolerance * reference.norm():
                        entry = "wrong result"
                except Exception as failure:  # a config that does not fit (shared memory): recorded, skipped
                    entry = f"failed: {type(failure).__name__}"
                row.setdefault(f"{gemm}_sweep_us", {})[name] = entry
                print(json.dumps({"tokens": tokens, "gemm": gemm, "config": name, "us": entry}), flush=True)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="32,1024", help="comma list of tokens per step (32 x batch)")
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="fp8",
        default="",
        help="also time every config of these weights (fp8, bf16 or fp8,bf16)",
    )
    parser.add_argument("--sweep-tokens", default="", help="sweep at these token counts only (default: all)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llada2-mini", help="the experts' shape")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape}
    summary["copy_bandwidth_tb_s"] = bandwidth / 1e12
    print(json.dumps(summary), flush=True)
    sweep = [dtype for dtype in args.sweep.split(",") if dtype]
    if set(sweep) - {"fp8", "bf16"}:
        parser.error(f"--sweep takes fp8 and/or bf16, got {args.sweep!r}")
    sweep_tokens = {int(t) for t in args.sweep_tokens.split(",")} if args.sweep_tokens else None
    summary["rows"] = [
        shape_row(
            int(t), bandwidth, sweep if sweep_tokens is None or int(t) in sweep_tokens else [], SHAPES[args.shape]
        )
        for t in args.tokens.split(",")
    ]
    print("\ntokens gemm     floor bf16  grouped_mm  triton bf16  floor fp8  triton fp8  (us)")
    for r in summary["rows"]:
        for gemm in ("gate_up", "down"):
            print(
                f"{r['tokens']:>6} {gemm:<8}{r[f'{gemm}_floor_bf16_us']:>11.1f}{r[f'{gemm}_grouped_mm_bf16_us']:>12.1f}"
                f"{r[f'{gemm}_triton_bf16_us']:>13.1f}{r[f'{gemm}_floor_fp8_us']:>11.1f}{r[f'{gemm}_triton_fp8_us']:>12.1f}"
            )
    for r in summary["rows"]:
        for gemm in ("gate_up", "down"):
            print(f"{r['tokens']:>6} {gemm:<8}bf16 config: {r[f'{gemm}_triton_bf16_config']}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
