"""`benchmarks/bench_tp.py --cpu` (so CI runs the tensor-parallel benchmark): two gloo processes against one, LLaDA
and LLaDA2 in float32. The sharded runs must give one process's tokens on every rank, and each denoising step must
make the collectives the issue asks for (#64), counted at the dispatcher (`CollectiveCounter`): one all-reduce per
attention and one per MLP / MoE layer (LLaDA2's shared experts joined to the routed experts' all-reduce; no gather of
q/k/v), one gather for the output head and one broadcast of rank 0's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent


@pytest.fixture(scope="module")
def summary() -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_tp.py"), "--cpu"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["llada", "llada2"])
def test_bench_tp_cpu_ranks_agree_with_one_process(summary, model):
    (row,) = [row for row in summary["rows"] if row["model"] == model]
    assert row["ranks_agree"] and row["tokens_equal_single_gpu"] == 1.0
    assert row["nfe"][0] == row["nfe"][1] > 0


@pytest.mark.parametrize("model", ["llada", "llada2"])
def test_collectives_per_step(summary, model):
    (row,) = [row for row in summary["rows"] if row["model"] == model]
    forwards, layers = row["nfe"][1], row["layers"]
    assert row["tp_collectives"] == {
        "_c10d_functional.all_gather_into_tensor": forwards,  # the output head's logits
        "c10d.allreduce_": 2 * layers * forwards,  # attention, MLP / MoE
        "c10d.broadcast_": forwards,  # rank 0's tokens
    }
    assert row["tp_collectives_per_forward"] == 2 * layers + 2
