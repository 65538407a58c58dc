"""GPU time of DiffusionGemma's fused sampler and dense-MLP gate kernels (issue #67's step against its floor):

- `triton_diffusion_gemma.fused_sample` over a bf16 canvas of 256 positions x 262,144 tokens at batch 1 / 8 / 32,
  soft cap 30, temperature 0.6, the self-conditioning probabilities written (as a denoising step calls it), on two
  kinds of logits: `flat` (N(0, 1): a random head's, as the model benchmark's) and `peaked` (N(0, 4) with one token
  per row 25 above: a trained head's confident rows). The draw is an inverse CDF from one uniform per row: only the
  chunk that holds the row's sample scans for it, up to the sample, whatever the logits. Per row: microseconds per
  call and GB/s of logits read (rows x vocab x 2 bytes over the call's time, the figure to hold against the
  device's ~4.3 TB/s: the kernels read the logits twice and write the probabilities once);
- `triton_ops.gated_mul(gate, up, "gelu_tanh")` against PyTorch's `gelu(gate, approximate="tanh") * up` on the
  halves of a gate/up product of the 26B-A4B's dense MLP (width 2,112) for 256 / 2,048 / 8,192 rows.

Each call is captured in a CUDA graph (`bench_fp8_gemm.timed_us`) and timed over replays with CUDA events. Prints
a table and ends with one JSON line.

    python benchmarks/bench_diffusion_gemma_kernels.py             # one H200, under a minute
    python benchmarks/bench_diffusion_gemma_kernels.py --cpu       # tiny shapes in Triton's interpreter, seconds
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

if "--cpu" in sys.argv:  # before Triton is imported: the kernels run in its interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dllm import triton_ops  # noqa: E402
from hf_dllm.triton_diffusion_gemma import fused_sample  # noqa: E402

CAP, TEMPERATURE = 30.0, 0.6


def logits_of(kind: str, rows: int, vocab: int, device) -> torch.Tensor:
    """`(1, rows, vocab)` bf16 head outputs: `flat` N(0, 1); `peaked` N(0, 4) with one random token per row +25."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, rows, vocab, device=device, generator=generator)
    if kind == "peaked":
        x *= 2
        top = torch.randint(0, vocab, (1, rows, 1), device=device, generator=generator)
        x.scatter_add_(-1, top, torch.full((1, rows, 1), 25.0, device=device))
    return x.bfloat16()


def timed(fn, gpu: bool) -> float:
    """Microseconds per call: CUDA-graph replays on the GPU (`bench_fp8_gemm.timed_us`), one call's wall clock on
    the CPU."""
    if gpu:
        from bench_fp8_gemm import timed_us

        return timed_us(fn, 5)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def sampler_rows(batches: list[int], canvas: int, vocab: int, device, gpu: bool) -> list[dict]:
    rows = []
    for kind in ("flat", "peaked"):
        for batch in batches:
            x = logits_of(kind, batch * canvas, vocab, device).view(batch, canvas, vocab)
            probabilities = torch.empty_like(x)
            temperature = torch.tensor([TEMPERATURE], device=device)
            seed = torch.tensor([7], device=device)
            us = timed(functools.partial(fused_sample, x, temperature, seed, CAP, probabilities), gpu)
            rows.append(dict(kind=kind, batch=batch, us=round(us, 1), logits_gb_s=round(x.numel() * 2 / us / 1e3, 1)))
    return rows


def gelu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """PyTorch's two ops, as the MLP's unfused path runs them."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def gate_rows(token_counts: list[int], width: int, device, gpu: bool) -> list[dict]:
    rows = []
    for tokens in token_counts:
        gate, up = torch.randn(tokens, 2 * width, device=device).bfloat16().chunk(2, dim=-1)
        if not gpu:
            gate, up = gate.float(), up.float()  # the interpreter has no exact bfloat16
        fused = timed(functools.partial(triton_ops.gated_mul, gate, up, "gelu_tanh"), gpu)
        torch_us = timed(functools.partial(gelu_gate, gate, up), gpu)
        rows.append(dict(tokens=tokens, width=width, fused_us=round(fused, 1), torch_us=round(torch_us, 1)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes in Triton's interpreter (seconds)")
    parser.add_argument("--batch-sizes", default=None, help="comma list (GPU 1,8,32; CPU 1)")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("no GPU: run with --cpu (Triton's interpreter)")
    device = torch.device("cuda" if gpu else "cpu")
    batches = [int(b) for b in (args.batch_sizes or ("1,8,32" if gpu else "1")).split(",")]
    canvas, vocab = (256, 262_144) if gpu else (2, 2048)
    sampler = sampler_rows(batches, canvas, vocab, device, gpu)
    gate = gate_rows([256, 2048, 8192] if gpu else [4], 2112 if gpu else 64, device, gpu)

    print(f"fused_sample: {canvas} positions x {vocab} tokens per batch row, bf16, cap {CAP}, T {TEMPERATURE}")
    print(f"{'logits':>7} {'batch':>5} {'us':>10} {'GB/s read':>10}")
    for row in sampler:
        print(f"{row['kind']:>7} {row['batch']:5d} {row['us']:10.1f} {row['logits_gb_s']:10.1f}")
    print(f"\nGELU gate x up, width {gate[0]['width']}")
    print(f"{'tokens':>7} {'fused us':>9} {'torch us':>9}")
    for row in gate:
        print(f"{row['tokens']:7d} {row['fused_us']:9.1f} {row['torch_us']:9.1f}")
    summary = dict(device=torch.cuda.get_device_name() if gpu else "cpu (interpreter)", sampler=sampler, gelu_gate=gate)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
