"""`benchmarks/bench_diffusion_gemma.py --cpu` (so CI runs DiffusionGemma's benchmark): it ends with one JSON line,
hf_dllm decodes transformers' tokens under the same seed on the CPU, and every canvas of a random model takes its
`max_denoising_steps` in both."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import BENCHMARK_ENV, BENCHMARK_PRELOAD, BackgroundJob

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent


def bench_available() -> bool:
    try:
        return importlib.util.find_spec("transformers.models.diffusion_gemma") is not None
    except ImportError:
        return False


# Started at collection, beside the in-process tests (one of the two cores): the test waits for it only.
BENCH_RUN = BackgroundJob(
    lambda _workdir: {
        "bench": [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_diffusion_gemma.py"),
            "--cpu",
            "--batch-sizes",
            "2",
            "--steps",
            "2",
            "--new-tokens",
            "16",
            "--step-repeats",
            "1",
        ]
    },
    timeout=300,
    when=bench_available,
    preload=BENCHMARK_PRELOAD,  # forked from the benchmarks' fork server
    env=BENCHMARK_ENV,
)


@BENCH_RUN.used_by
def test_bench_diffusion_gemma_cpu():
    pytest.importorskip("transformers.models.diffusion_gemma")  # the reference (transformers >= 5.24)
    done = BENCH_RUN.results()["bench"]
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    models = {row["model"]: row for row in summary["rows"]}
    assert set(models) == {"hf_dllm", "transformers"}
    assert models["hf_dllm"]["tokens_equal_reference"] is True
    for row in models.values():
        assert row["steps_per_canvas"] == row["max_denoising_steps"] == 2
        assert row["tokens_per_s"] > 0
    assert set(summary["goals"]) == {"batch1_speedup_steps2", "batch1_step_over_floor", "batch32_peak_gb"}
    (step,) = summary["steps"]
    assert step["encoder_prompt_eager_ms"] > 0 and step["generate_host_syncs"] is None  # (syncs: counted on CUDA)
