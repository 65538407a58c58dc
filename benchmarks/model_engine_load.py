"""A cost model of the continuous-batching engine under `bench_load.py`'s load (issue #14): an estimate, not a
measurement. It replays the benchmark's requests (the same prompts, lengths and Poisson arrivals) through the
engine's scheduling (admission at block boundaries, at most `--max-batch-size` rows, one layout per boundary)
with each layout's time taken from H100 measurements at the LLaDA-8B shape (`bench_generate.py`, `profile_engine_boundary.py`):

- the block's first step, packed over the rows' whole canvases: 38,328 positions/s
  (`profile_engine_boundary.py`, packed without cuDNN);
- each later step (dual cache, 32 queries a row, CUDA graphs): 7.29 ms at 1 row, 13.96 ms at 8 (`bench_generate.py`
  batch 1 and 8), linear in between and beyond.

It leaves out what the model does not know: new-shape warm-ups and captures, host time, the HTTP server. Against
the measured runs, with the benchmark's arrivals (`--seeds 1`), it gives 913 tokens/s at 16 requests/s (measured
884.0) and a p99 time to first block of 0.66 s at 2 requests/s (measured 0.72), but 0.79 s at 2.4 (measured 1.57,
with cuDNN still planning the block steps' shapes).

It compares joining rows decoding their first block in the running rows' layout (`off`) with
`ContinuousBatcher.join_layout_min_rows` = n (in a layout of their own, first, when at least n others run and
nothing waits; the engine's default since it was measured, `JOIN_LAYOUT_MIN_ROWS`):

    python benchmarks/model_engine_load.py [--rates 1,2.2,2.4,3,16] [--join 4,8] [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import SHAPES, STEPS_PER_BLOCK, arrival_times, decoded_blocks, percentile, workload  # noqa: E402

from hf_dllm.family import registered_family  # noqa: E402

FIRST_STEP_POSITIONS_PER_S = 38_328.0
STEP_S_AT_1, STEP_S_AT_8 = 7.29e-3, 13.96e-3


def later_step_s(rows: int) -> float:
    return STEP_S_AT_1 + (rows - 1) * (STEP_S_AT_8 - STEP_S_AT_1) / 7


def layout_s(canvases: list[int]) -> float:
    """One block of a layout: the packed first step over every canvas, then the block's other steps."""
    return sum(canvases) / FIRST_STEP_POSITIONS_PER_S + (STEPS_PER_BLOCK - 1) * later_step_s(len(canvases))


def replay(items: list[dict], rate: float, seed: int, max_rows: int, join: int | None) -> dict:
    """Latency, time to first block and throughput of one rate's requests (arrivals as `bench_load.offered_load`)."""
    arrivals = arrival_times(len(items), rate, seed)
    llada = registered_family("llada")
    blocks = [decoded_blocks(item, llada) for item in items]
    canvas = [len(item["prompt"]) + item["max_tokens"] for item in items]
    now, waiting, running, decoded, first, done = 0.0, list(range(len(items))), [], {}, {}, {}
    while waiting or running:
        if not running and arrivals[waiting[0]] > now:
            now = arrivals[waiting[0]]
        while waiting and arrivals[waiting[0]] <= now and len(running) < max_rows:
            decoded[waiting[0]] = 0
            running.append(waiting.pop(0))
        joining = [i for i in running if decoded[i] == 0]
        queued = bool(waiting) and arrivals[waiting[0]] <= now
        layouts = [running]
        if join is not None and joining and not queued and len(running) - len(joining) >= join:
            layouts = [joining, [i for i in running if decoded[i] > 0]]
        for rows in layouts:
            now += layout_s([canvas[i] for i in rows])
            for i in rows:
                if decoded[i] == 0:
                    first[i] = now - arrivals[i]
                decoded[i] += 1
                if decoded[i] == blocks[i]:
                    done[i] = now - arrivals[i]
        running = [i for i in running if i not in done]
    span = max(arrivals[i] + done[i] for i in done) - arrivals[0]
    return dict(
        tokens_per_s=sum(item["max_tokens"] for item in items) / span,
        p99_latency_s=percentile(list(done.values()), 99),
        p50_first_block_s=percentile(list(first.values()), 50),
        p99_first_block_s=percentile(list(first.values()), 99),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1,2,2.2,2.4,3,16")
    parser.add_argument("--join", default="4,8", help="join_layout_min_rows values to compare with off")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=5, help="arrival seeds averaged (bench_load uses seed 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    items = workload(SHAPES["llada-8b"]["vocab_size"], args.requests, args.seed)
    policies = [None, *(int(n) for n in args.join.split(","))]
    results = {}
    print("| rate/s | join_layout_min_rows | tokens/s | p99 latency s | p50 TTFB s | p99 TTFB s |")
    print("|---|---|---|---|---|---|")
    for rate in (float(r) for r in args.rates.split(",")):
        for join in policies:
            runs = [replay(items, rate, args.seed + 1 + s, args.max_batch_size, join) for s in range(args.seeds)]
            mean = {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}
            results[f"{rate}/{join}"] = mean
            print(
                f"| {rate:g} | {join if join is not None else 'off'} | {mean['tokens_per_s']:.0f} | "
                f"{mean['p99_latency_s']:.2f} | {mean['p50_first_block_s']:.2f} | {mean['p99_first_block_s']:.2f} |"
            )
    print(json.dumps(dict(model="engine cost model, LLaDA-8B shape on an H100", seeds=args.seeds, results=results)))


if __name__ == "__main__":
    main()
