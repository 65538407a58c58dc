"""`benchmarks/bench_diffusion_gemma.py --cpu` (so CI runs DiffusionGemma's benchmark): it ends with one JSON line,
hf_dllm decodes transformers' tokens under the same seed on the CPU, and every canvas of a random model takes its
`max_denoising_steps` in both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent


def test_bench_diffusion_gemma_cpu():
    pytest.importorskip("transformers.models.diffusion_gemma")  # the reference (transformers >= 5.24)
    done = subprocess.run(
        [
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
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    models = {row["model"]: row for row in summary["rows"]}
    assert set(models) == {"hf_dllm", "transformers"}
    assert models["hf_dllm"]["tokens_equal_reference"] is True
    for row in models.values():
        assert row["steps_per_canvas"] == row["max_denoising_steps"] == 2
        assert row["tokens_per_s"] > 0
    assert set(summary["goals"]) == {"batch1_speedup_steps2", "batch1_step_over_floor", "batch32_peak_gb"}
