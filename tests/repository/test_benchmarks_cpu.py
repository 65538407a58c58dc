"""Every `benchmarks/bench_*.py` runs in its quick `--cpu` mode and ends with a JSON line (the developers' guide:
each benchmark prints a table and ends with ONE JSON line, with a `--cpu` mode CI runs). The benchmarks run side by
side, single-threaded, in one module fixture (most of each run is start-up: on 2 cores two take little more than
one); each has its own test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import BENCHMARK_ENV, BENCHMARK_PRELOAD, BackgroundJob

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent
BENCHMARKS = sorted(path.name for path in (ROOT / "benchmarks").glob("bench_*.py"))
# Benchmarks not run here: GPU kernels only, no --cpu mode, or a --cpu mode too slow for the suite.
NOT_ON_CPU = {
    "bench_fp8_gemm.py": "FP8 GEMM kernels: CUDA only (compute capability >= 8.9), no CPU path",
    "bench_llada2_kernels.py": "Triton kernels captured in CUDA graphs: CUDA only",
    "bench_llada2_moe_gemm.py": "grouped GEMM kernels (Triton, torch._grouped_mm) in CUDA graphs: CUDA only",
    "bench_hostile.py": "its --cpu mode starts the real server and takes 1-2 minutes on 2 cores; its HTTP cases are "
    "tests/serving/test_hostile.py's, its fairness rule tests/serving/test_fair_admission.py",
    "bench_llada2.py": "its --cpu mode took 413 s (133 s of CPU) on the 2-core test machine (logits over a "
    "157184-token vocabulary at every forward, batch 1 and 4, 3 repeats): too slow for the suite",
    "bench_tp.py": "run by tests/generation/test_tensor_parallel_collectives.py, which also checks its figures",
    "bench_diffusion_gemma.py": "run by tests/generation/test_bench_diffusion_gemma.py, which also checks its tokens",
    "bench_flash.py": "run by tests/generation/test_bench_flash.py, which also checks its tokens and layouts",
}
ON_CPU = [name for name in BENCHMARKS if name not in NOT_ON_CPU]


def test_every_benchmark_is_run_or_skipped_with_a_reason():
    assert set(NOT_ON_CPU) <= set(BENCHMARKS), set(NOT_ON_CPU) - set(BENCHMARKS)
    assert ON_CPU


def cpu_commands(workdir: Path) -> dict:
    return {name: [sys.executable, str(ROOT / "benchmarks" / name), "--cpu"] for name in ON_CPU}


# Started at collection, beside the in-process tests (which use one of the two cores): the test waits for them only.
# Each benchmark runs forked from one process that imported hf_dllm (`preload`: the import is most of a --cpu run);
# the Triton-interpreter ones set TRITON_INTERPRET before anything imports Triton, so they start processes of their
# own.
CPU_RUNS = BackgroundJob(
    cpu_commands,
    timeout=900,
    preload=BENCHMARK_PRELOAD,
    unforked=("bench_diffusion_gemma_attention.py", "bench_diffusion_gemma_kernels.py"),
    env=BENCHMARK_ENV,
)


@pytest.mark.slow
@CPU_RUNS.used_by
@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_cpu_mode_ends_with_a_json_line(name):
    if name in NOT_ON_CPU:
        pytest.skip(NOT_ON_CPU[name])
    done = CPU_RUNS.results()[name]
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, done.stderr[-3000:]
    assert isinstance(json.loads(lines[-1]), dict)  # the summary, last (some also print a JSON line per row)
