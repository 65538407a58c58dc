"""Which FP8 matrix product for which shape (issue #13): the GEMMs of an LLaDA-8B block step and refresh forward
(and of LLaDA2.0-mini's attention and dense first layer), FP8 weights with 128x128 block scales (transformers'
`FineGrainedFP8Config` layout) against bf16 `F.linear`.

Kernels (`hf_dllm/fp8.py`, `hf_dllm/fp8_triton.py`): `weight_only` (FP8 weight scaled in registers, bf16 MMA),
`w8a8_triton` (activations quantized per row and 128 columns, block-scaled FP8 MMA in Triton), `w8a8_scaled_mm` (the
same quantization, cuBLASLt's block-scaled `torch._scaled_mm`), `w8a8_few_rows` (the same quantization, hf_dllm's Triton
FP8 kernel for a block step's few rows: split-K, the weight tile as the MMA's M), the last two also without the
quantization (`scaled_mm_gemm_only`, `few_rows_gemm_only`: activations quantized beforehand, as LLaDA's RMSNorm and SiLU
gate write them), `rowwise_gemm_only` / `few_rows_rowwise_gemm_only` (`--quantization fp8-tensor`'s row-scaled weights,
activations quantized beforehand: cuBLASLt's `torch._scaled_mm`, or the few-rows kernel's row-scaled variant), and, for
reference, transformers' own `finegrained_fp8_linear` (a Hub kernel: reported as unavailable when it cannot be fetched)
and `torch._scaled_mm` with row-wise scales (a different weight quantization: the best cuBLASLt FP8 does on these
shapes). Rows: 32 x batch (block steps at batch 1 / 8 / 32) and the full-sequence refresh forwards (768 x batch). Times:
GPU time per call, `--repeats` calls captured in one CUDA graph (the way a block step runs them), median of 5 replays.

Prints a table (us, TB/s of weight bytes, TFLOP/s; error relative to the fp32 product) and ends with one JSON line.

    python benchmarks/bench_fp8_gemm.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dllm import fp8, fp8_triton  # noqa: E402

SHAPES = {  # name: (N, K) of LLaDA-8B, then of LLaDA2.0-mini's attention and dense first layer
    "q/o": (4096, 4096),
    "qkv": (12288, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (126464, 4096),
    "llada2_qkv": (3072, 2048),
    "llada2_o": (2048, 2048),
    "llada2_gate_up": (10240, 2048),
    "llada2_down": (2048, 5120),
}


def timed_us(fn, repeats: int) -> float:
    """GPU time of one call: `repeats` calls captured in a CUDA graph (as a block step runs them), the median of 5
    replays over `repeats`. Eager timing would measure Python's launch overhead at these sizes, not the kernels.
    `fn`: a call, or a list of calls taken in turn (e.g. over weight copies, so that no weight stays in L2)."""
    calls = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    for _ in range(3):  # warm-up: autotuning, compilation, cuBLAS handles
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # allocations on the capture stream before capture
            call()
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
    del graph
    return statistics.median(times)


def rowwise_scaled_mm(x, weight):
    """Reference: cuBLASLt FP8 with one scale per activation row and per weight row (not the Hub's block layout)."""
    w_scale = weight.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / fp8.FP8_MAX
    w8 = (weight.float() / w_scale).to(fp8.FP8_DTYPE)

    def run():
        x_scale = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / fp8.FP8_MAX
        x8 = (x.float() / x_scale).to(fp8.FP8_DTYPE)
        return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=x.dtype)

    return run


def scaled_mm_gemm_only(x, w8, scale, block):
    """cuBLASLt's block-scaled product alone, the activations quantized beforehand (`w8a8_scaled_mm` less its
    quantization kernel, which a norm or SiLU kernel could write fused)."""
    a, a_scale = fp8_triton.quantize_rows(x, block[1], scales_column_major=True)
    return lambda: fp8._scaled_mm_blockwise(a, a_scale, w8, scale, None, x.dtype)


def few_rows(x, w8, scale, block, prequantized: bool):
    """hf_dllm's few-rows w8a8 kernel, with the activations' quantization (`quantize_rows`) or without it (the
    activations quantized beforehand, as LLaDA's RMSNorm and SiLU gate write them)."""
    if prequantized:
        rows = fp8.QuantizedRows(*fp8_triton.quantize_rows(x, block[1]), x.shape, x.dtype)
        return lambda: fp8.few_rows_w8a8_matmul(rows, w8, scale, block)

    def run():
        return fp8.few_rows_w8a8_matmul(
            fp8.QuantizedRows(*fp8_triton.quantize_rows(x, block[1]), x.shape, x.dtype), w8, scale, block
        )

    return run


def row_scaled(x, weight, few_rows: bool):
    """The products of `--quantization fp8-tensor` (one scale per weight row, activations one scale per row,
    quantized beforehand as LLaDA's RMSNorm and SiLU gate write them): cuBLASLt's `torch._scaled_mm`
    (`fp8.rowwise_matmul`) or the few-rows kernel's row-scaled variant."""
    k_in = x.shape[1]
    w8, row_scales = fp8.quantize_blocks(weight, (1, k_in))
    rows = fp8.QuantizedRows(
        *fp8_triton.quantize_rows(x, k_in, row_multiple=fp8.SCALED_MM_ROW_MULTIPLE), x.shape, x.dtype
    )
    if few_rows:
        return lambda: fp8.few_rows_w8a8_matmul(rows, w8, row_scales, (1, k_in))
    return lambda: fp8.rowwise_matmul(rows, w8, row_scales)


def candidate_kernels(x, weight, w8, scale, block) -> dict:
    """name -> a maker of a call computing `x @ weight.T` (bf16) or with the FP8 weight `w8` and its block scales.
    Makers, not calls: some prepare operands (quantized copies), which only the kernels that run should pay for."""
    return {
        "bf16": lambda: lambda: torch.nn.functional.linear(x, weight),
        "weight_only": lambda: lambda: fp8_triton.weight_only_matmul(x, w8, scale, block),
        "w8a8_triton": lambda: lambda: fp8.w8a8_matmul(x, w8, scale, block, backend="triton"),
        "w8a8_scaled_mm": lambda: lambda: fp8.w8a8_matmul(x, w8, scale, block, backend="scaled_mm"),
        "scaled_mm_gemm_only": lambda: scaled_mm_gemm_only(x, w8, scale, block),
        "w8a8_few_rows": lambda: few_rows(x, w8, scale, block, prequantized=False),
        "few_rows_gemm_only": lambda: few_rows(x, w8, scale, block, prequantized=True),
        "transformers_hub": lambda: lambda: _transformers_linear(x, w8, scale, block),
        "rowwise_scaled_mm": lambda: rowwise_scaled_mm(x, weight),
        "rowwise_gemm_only": lambda: row_scaled(x, weight, few_rows=False),
        "few_rows_rowwise_gemm_only": lambda: row_scaled(x, weight, few_rows=True),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,256,1024,768,6144,24576")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kernels", default=None, help="comma list of the kernels to run (default: all)")
    parser.add_argument(
        "--weight-copies",
        type=int,
        default=1,
        help="weights (and their FP8 copies) taken in turn, so that a product reads its weight from memory, not L2 "
        "(a step reads each weight once; 4 x 16 MB exceeds the H100's 50 MB L2)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    selected = None if args.kernels is None else set(args.kernels.split(","))
    device = torch.device("cuda")
    block = (128, 128)
    results = []
    for name in args.shapes.split(","):
        n_out, k_in = SHAPES[name]
        torch.manual_seed(0)
        weights = [
            torch.randn(n_out, k_in, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(args.weight_copies)
        ]
        quantized = [fp8.quantize_blocks(w, block) for w in weights]
        weight, (w8, scale) = weights[0], quantized[0]
        for rows in [int(r) for r in args.rows.split(",")]:
            if name.endswith("lm_head") and rows > 1024:
                continue  # the head runs on the block's positions only
            x = torch.randn(rows, k_in, device=device, dtype=torch.bfloat16)
            exact = x.float() @ weight.float().t()
            # PyTorch's own FP8 references: the quantized weight dequantized in fp32 (weight-only), and with the
            # activations quantized the same way (w8a8), both multiplied in fp32; the same with one scale per row
            # of each (the row-scaled kernels').
            w_deq = fp8.dequantize(w8, scale, block, torch.float32)
            a8, a_scale = fp8_triton.quantize_rows(x, 128)
            x_deq = (a8.float().unflatten(1, (-1, 128)) * a_scale[:, :, None]).flatten(1)
            w8_rows, row_scales = fp8.quantize_blocks(weight, (1, k_in))
            a8_rows, a_row_scales = fp8_triton.quantize_rows(x, k_in)
            row_scaled = (a8_rows.float() * a_row_scales) @ (w8_rows.float() * row_scales).t()
            ref_error = {
                name: (product - exact).norm().item() / exact.norm().item()
                for name, product in (
                    ("weight_only", x.float() @ w_deq.t()),
                    ("w8a8", x_deq @ w_deq.t()),
                    ("w8a8_row_scaled", row_scaled),
                )
            }
            del w_deq, x_deq, w8_rows, row_scaled
            makers = candidate_kernels(x, weight, w8, scale, block)
            copies = [candidate_kernels(x, w, *q, block) for w, q in zip(weights[1:], quantized[1:], strict=True)]
            for kernel, make in makers.items():
                if selected is not None and kernel not in selected:
                    continue
                row = dict(shape=name, rows=rows, n=n_out, k=k_in, kernel=kernel)
                try:  # a kernel this GPU or torch lacks fails in its maker or its call: a result here
                    fn = make()
                    out = fn()
                    row["rel_error"] = (out.float() - exact).norm().item() / exact.norm().item()
                    row["us"] = timed_us([fn, *(others[kernel]() for others in copies)], args.repeats)
                except Exception as error:  # noqa: BLE001  (an unavailable kernel is a result here)
                    row["error"] = f"{type(error).__name__}: {error}"[:160]
                    results.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                bytes_w = n_out * k_in * (2 if kernel == "bf16" else 1)
                row["weight_tb_s"] = bytes_w / (row["us"] * 1e-6) / 1e12
                row["tflop_s"] = 2 * rows * n_out * k_in / (row["us"] * 1e-6) / 1e12
                ref_kind = "weight_only" if kernel == "weight_only" else "w8a8"
                if kernel.startswith(("rowwise", "few_rows_rowwise")):
                    ref_kind = "w8a8_row_scaled"
                if kernel != "bf16":
                    row["torch_ref_error"] = ref_error[ref_kind]
                results.append(row)
                print(json.dumps(row), flush=True)
            del x, exact, makers, copies

    print()
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: us (weight TB/s | TFLOP/s) [rel. error]")
    by_key = {}
    for r in results:
        by_key.setdefault((r["shape"], r["rows"]), {})[r["kernel"]] = r
    names = list(dict.fromkeys(r["kernel"] for r in results))
    print(f"{'shape':<9}{'rows':>6}" + "".join(f"{n:>30}" for n in names))
    for (shape, rows), cells in by_key.items():
        line = f"{shape:<9}{rows:>6}"
        for n in names:
            r = cells.get(n)
            if r is None or "us" not in r:
                line += f"{'n/a':>30}"
            else:
                line += f"{r['us']:>9.1f} ({r['weight_tb_s']:.2f}|{r['tflop_s']:>5.0f}) [{r['rel_error']:.1e}]".rjust(
                    30
                )
        print(line)
    best = {}
    for (shape, rows), cells in by_key.items():
        timed = {n: r["us"] for n, r in cells.items() if "us" in r and n != "bf16" and "rowwise" not in n}
        if timed:
            best[f"{shape}:{rows}"] = min(timed, key=timed.get)
    print(json.dumps({"device": torch.cuda.get_device_name(device), "best_block_fp8": best, "rows": results}))
    return 0


def _transformers_linear(x, w8, scale, block):
    from transformers.integrations.finegrained_fp8 import finegrained_fp8_linear

    return finegrained_fp8_linear(x, w8, scale, list(block))


if __name__ == "__main__":
    sys.exit(main())
