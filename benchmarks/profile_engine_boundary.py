"""Where a continuous-batching boundary's time goes (issue #14): the same saturated request set decoded by the
engine with its blocks' first steps packed (`packed.PackedRows`, the default) and aligned (every row padded to the
layout's width), boundaries timed one by one, then one packed first step under the profiler.

    python benchmarks/profile_engine_boundary.py [--shape llada-8b] [--requests 48] [--boundaries 12]

Prints a table per mode (boundary seconds, first-step seconds, positions) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import OUTPUT_RANGE, PROMPT_RANGE, build_model, engine_requests, workload  # noqa: E402

from hf_dllm.serving.engine import ContinuousBatcher  # noqa: E402
from hf_dllm.serving.layout import LayoutRun  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_mode(model, args, packed: bool) -> dict:
    """Decode `args.boundaries` boundaries (after `args.warmup`) of all requests submitted at once."""
    model.diffusion_packed_rows = packed  # instance attribute: the class's flag for this run only
    first_step_s = []  # of the boundary being decoded
    run_step = LayoutRun.run_step

    def timed_step(self, block_start, block_end, step, active=None, generated=None):
        """`LayoutRun.run_step`, the block's first step timed (packed or aligned, whichever the run takes)."""
        if step != 0:
            return run_step(self, block_start, block_end, step, active, generated)
        sync()
        start = time.perf_counter()
        out = run_step(self, block_start, block_end, step, active, generated)
        sync()
        first_step_s.append(time.perf_counter() - start)
        return out

    LayoutRun.run_step = timed_step
    engine = ContinuousBatcher(model, max_batch_size=args.max_batch_size, max_batch_width=args.max_batch_width)
    items = workload(model.config.vocab_size, args.requests, args.seed, args.prompt_range, args.output_range)
    for request in engine_requests(model, items):
        engine.submit(request)
    result = dict(boundary_s=[], first_step_s=[], positions=[], rows=[])
    try:
        with torch.inference_mode():
            for index in range(args.warmup + args.boundaries):
                first_step_s.clear()
                before = engine.first_step_positions
                sync()
                start = time.perf_counter()
                engine.decode_boundary()
                sync()
                if index >= args.warmup:
                    result["boundary_s"].append(time.perf_counter() - start)
                    result["first_step_s"].append(sum(first_step_s))
                    result["positions"].append(engine.first_step_positions - before)
                    result["rows"].append(sum(engine.last_layout_sizes))
            if packed and args.profile:
                profile_boundary(engine)
    finally:
        LayoutRun.run_step = run_step
        engine.release()
        del model.diffusion_packed_rows
    return result


def profile_boundary(engine) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.decode_boundary()
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llada-8b")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--boundaries", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-batch-width", type=int, default=2560)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=list(PROMPT_RANGE))
    parser.add_argument("--output-range", type=int, nargs=2, default=list(OUTPUT_RANGE))
    parser.add_argument("--modes", default="packed,aligned")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.shape, device, "bfloat16" if device == "cuda" else "float32")
    results = {}
    print("| mode | boundary | rows | first-step positions | boundary s | first step s | rest s |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        result = run_mode(model, args, packed=mode == "packed")
        results[mode] = result
        for i, (b, f, p, r) in enumerate(
            zip(result["boundary_s"], result["first_step_s"], result["positions"], result["rows"], strict=True)
        ):
            print(f"| {mode} | {i} | {r} | {p} | {b:.3f} | {f:.3f} | {b - f:.3f} |")
        total = sum(result["boundary_s"])
        result["mean_boundary_s"] = total / len(result["boundary_s"])
        result["first_step_share"] = sum(result["first_step_s"]) / total
        positions = sum(result["positions"])
        result["first_step_positions_per_s"] = positions / sum(result["first_step_s"])
        print(
            f"{mode}: mean boundary {result['mean_boundary_s']:.3f} s, first steps {result['first_step_share']:.0%}"
            f" of it, {result['first_step_positions_per_s']:,.0f} first-step positions/s"
        )
    print(
        json.dumps(
            dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", shape=args.shape, results=results)
        )
    )


if __name__ == "__main__":
    main()
