"""Positions the continuous-batching engine computes in its blocks' full forwards, per layout of a replayed load
(issue #14): packed (what the engine runs, `packed.PackedRows`) against the padded layouts it replaced.

At the LLaDA-8B shape a boundary is mostly the dual cache's refresh forward over every row's whole canvas
(`benchmarks/bench_load.py`), which is compute-bound: its cost follows the positions
it computes. This script replays `bench_load.py`'s request distributions (prompts uniform in [128, 1024] tokens,
`max_tokens` uniform in [64, 512] rounded up to blocks of 32, 8 steps per block, dual cache) through the real
`ContinuousBatcher` on the CPU with bench_load.py's small random LLaDA (the shape does not change the layouts), arrivals counted
in boundaries (Poisson, `--arrivals-per-boundary`), and counts for every layout's first step:

- packed: the rows' canvases end to end (measured: the engine's `first_step_positions`);
- compact: every row at its own columns, padded to the longest canvas (the engine before packing);
- aligned: every row shifted so its current block is at one column, padded to the layout's width (the layout the
  block's later steps use; the engine's first version).

It does not time anything (the CPU's times say nothing of the GPU's): the GPU load benchmark is `bench_load.py`.

    python benchmarks/bench_engine_work.py [--requests 96] [--arrivals-per-boundary 0.9]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import OUTPUT_RANGE, PROMPT_RANGE, arrival_times, build_model, engine_requests, workload  # noqa: E402

from hf_dllm.serving.engine import ContinuousBatcher  # noqa: E402
from hf_dllm.serving.layout import LayoutRun  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--arrivals-per-boundary", type=float, default=0.9)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-batch-width", type=int, default=2560)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=list(PROMPT_RANGE))
    parser.add_argument("--output-range", type=int, nargs=2, default=list(OUTPUT_RANGE))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = build_model("small", "cpu", "float32")
    items = workload(model.config.vocab_size, args.requests, args.seed, args.prompt_range, args.output_range)
    requests = engine_requests(model, items)  # bench_load.py's prompts, lengths and settings
    # Arrivals counted in boundaries, the first after one gap (`arrival_times` starts at 0).
    arrivals = [int(at) for at in arrival_times(len(items) + 1, args.arrivals_per_boundary, args.seed)[1:]]

    layouts = []  # per layout: rows' canvases, the compact width and the aligned width
    decode_block = LayoutRun.decode_block

    def recorded(self, rows, width):
        canvases = [row.plan.canvas_width for row in rows]
        layouts.append(dict(rows=len(rows), canvases=canvases, aligned_width=width))
        return decode_block(self, rows, width)

    LayoutRun.decode_block = recorded
    engine = ContinuousBatcher(model, max_batch_size=args.max_batch_size, max_batch_width=args.max_batch_width)
    pending, boundaries = list(range(len(requests))), 0
    with torch.inference_mode():
        while pending or engine.has_work():
            while pending and arrivals[pending[0]] <= boundaries:
                engine.submit(requests[pending.pop(0)])
            engine.decode_boundary()
            boundaries += 1

    packed = sum(sum(layout["canvases"]) for layout in layouts)
    compact = sum(layout["rows"] * max(layout["canvases"]) for layout in layouts)
    aligned = sum(layout["rows"] * layout["aligned_width"] for layout in layouts)
    if packed != engine.first_step_positions:
        raise SystemExit(f"the engine computed {engine.first_step_positions} positions, the layouts hold {packed}")
    rows_per_layout = sum(layout["rows"] for layout in layouts) / len(layouts)
    print(
        f"{args.requests} requests, {boundaries} boundaries, {len(layouts)} layouts, "
        f"{rows_per_layout:.2f} rows per layout (max batch {args.max_batch_size})\n"
    )
    print("| first-step layout | positions per boundary | positions / packed |")
    print("|---|---|---|")
    for name, total in (("packed (now)", packed), ("compact (before)", compact), ("aligned", aligned)):
        print(f"| {name} | {total / boundaries:,.0f} | {total / packed:.2f} |")
    print(
        json.dumps(
            dict(
                requests=args.requests,
                arrivals_per_boundary=args.arrivals_per_boundary,
                boundaries=boundaries,
                layouts=len(layouts),
                rows_per_layout=rows_per_layout,
                positions=dict(packed=packed, compact=compact, aligned=aligned),
                compact_over_packed=compact / packed,
                aligned_over_packed=aligned / packed,
            )
        )
    )


if __name__ == "__main__":
    main()
