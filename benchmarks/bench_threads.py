"""CPU threads of `hf-dllm eval`: generation time with `--threads 1` against `--threads 2` (torch's default on a
2-core machine), interleaved, several repeats, each run a fresh `python -m hf_dllm eval` process.

    python benchmarks/bench_threads.py [--repeats 5] [--batch-sizes 1,8] [--examples 48] [--model DIR]

The model is the tiny trained LLaDA (`tests/fixtures/llada-tiny-trained`) when present, else the tiny random one
`tests/conftest.py` builds, saved with the character tokenizer. The dataset is `tests/data/tiny_tasks.jsonl`
repeated to `--examples` rows; generation settings are the checkpoint's. The time is the command's own
`generation_seconds` (model loading and start-up excluded). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINED = ROOT / "tests" / "fixtures" / "llada-tiny-trained"
TASKS = ROOT / "tests" / "data" / "tiny_tasks.jsonl"


def _model(workdir: Path) -> Path:
    if (TRAINED / "config.json").exists():
        return TRAINED
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_model

    from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer

    path = workdir / "tiny"
    tiny_model(seed=0).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def _run(model: Path, dataset: Path, output: Path, threads: int, batch_size: int) -> float:
    command = [sys.executable, "-m", "hf_dllm", "eval", str(model), "--dataset", str(dataset), "--quiet"]
    command += ["--device", "cpu", "--dtype", "float32", "--threads", str(threads), "--batch-size", str(batch_size)]
    command += ["--output-dir", str(output)]
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    summary = json.loads((output / "summary.json").read_text())
    assert summary["settings"]["threads"] == threads
    return float(summary["generation_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cpu", action="store_true", help="quick check (CI): 1 repeat, batch 8, 8 examples")
    args = parser.parse_args()
    if args.cpu:
        args.repeats, args.batch_sizes, args.examples = 1, "8", min(args.examples, 8)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    thread_counts = [int(x) for x in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = Path(args.model) if args.model else _model(workdir)
        lines = TASKS.read_text().splitlines()
        dataset = workdir / "data.jsonl"
        dataset.write_text("".join(lines[i % len(lines)] + "\n" for i in range(args.examples)))
        times: dict[tuple[int, int], list[float]] = {(b, t): [] for b in batch_sizes for t in thread_counts}
        for repeat in range(args.repeats):
            for batch_size in batch_sizes:
                # Interleaved, order alternating per repeat, so drifts of the machine hit both counts alike.
                order = thread_counts if repeat % 2 == 0 else thread_counts[::-1]
                for threads in order:
                    seconds = _run(model, dataset, workdir / "out", threads, batch_size)
                    times[batch_size, threads].append(seconds)
    print(f"machine: {os.cpu_count()} cores; model: {model.name}; {args.examples} examples; {args.repeats} repeats")
    print("| batch | threads | median s | min s | max s |")
    print("|---|---|---|---|---|")
    rows = []
    for (batch_size, threads), values in times.items():
        median = statistics.median(values)
        print(f"| {batch_size} | {threads} | {median:.3f} | {min(values):.3f} | {max(values):.3f} |")
        rows.append({"batch_size": batch_size, "threads": threads, "median_s": median, "runs_s": values})
    faster = {}
    for batch_size in batch_sizes:
        best = min(thread_counts, key=lambda t: statistics.median(times[batch_size, t]))
        faster[str(batch_size)] = best
    print(json.dumps({"cpu_count": os.cpu_count(), "model": str(model), "rows": rows, "fastest_threads": faster}))


if __name__ == "__main__":
    main()
