"""`benchmarks/bench_flash.py --cpu` (so CI runs the flash-shape benchmark): the LLaDA2.0-flash structure, tiny, over 2
gloo processes, each batch size under the layout `tensor_parallel.moe_parallelism` picks (batch 1: tensor
parallelism, batch 2: expert parallelism). Every row must decode one process's tokens on every rank, with the
collectives of one all-reduce per attention and per MLP / MoE layer, and a per-GPU floor that counts the experts the
rank holds."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import BENCHMARK_ENV, BENCHMARK_PRELOAD, ROOT, BackgroundJob

FLASH = BackgroundJob(
    lambda workdir: {"flash": [sys.executable, str(ROOT / "benchmarks" / "bench_flash.py"), "--cpu"]},
    timeout=300,
    cwd=ROOT,
    preload=BENCHMARK_PRELOAD,  # forked from the benchmarks' fork server
    env=BENCHMARK_ENV,
)


@pytest.fixture(scope="module")
def summary() -> dict:
    done = FLASH.results()["flash"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@FLASH.used_by
def test_each_batch_runs_under_the_rules_layout(summary):
    assert summary["rule_picks"] == {"1": "tensor", "2": "expert"}
    layouts = {(row["batch"], row["tokens_per_step"]): row["parallel"] for row in summary["rows"]}
    assert layouts == {(1, 1): "tensor", (1, 2): "tensor", (2, 1): "expert", (2, 2): "expert"}
    assert all(row["rule_pick"] for row in summary["rows"])


@pytest.mark.parametrize("batch,per_step", [(1, 1), (1, 2), (2, 1), (2, 2)])
@FLASH.used_by
def test_rows_decode_one_process_tokens_on_every_rank(summary, batch, per_step):
    (row,) = [r for r in summary["rows"] if (r["batch"], r["tokens_per_step"]) == (batch, per_step)]
    assert row["ranks_agree"] and row["tokens_equal_one_process"]
    assert row["nfe"] == 8 // per_step


@FLASH.used_by
def test_collectives_and_floor_per_layout(summary):
    layers = summary["layers"]
    for row in summary["rows"]:
        if row["collectives_per_forward"] is not None:  # each layout's first row
            assert row["collectives_per_forward"] == 2 * layers + 2, row["parallel"]
        assert 0 < row["floor_gb"] <= summary["weight_gb_per_gpu"][row["parallel"]]  # a part of what a GPU holds
    assert {row["parallel"] for row in summary["rows"] if row["collectives_per_forward"] is not None} == {
        "tensor",
        "expert",
    }


def test_floor_counts_the_touched_experts_this_rank_holds():
    """Under expert parallelism a rank's floor holds, of the experts a step touched, those in its range, whole."""
    import importlib.util

    import torch

    import hf_dllm

    spec = importlib.util.spec_from_file_location("bench_flash", ROOT / "benchmarks" / "bench_flash.py")
    bench_flash = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_flash)
    config = hf_dllm.LLaDA2MoeConfig(**dict(bench_flash.CPU_FLASH, mask_token_id=1000, eos_token_id=999))
    model = hf_dllm.LLaDA2MoeModelLM._from_config(config, dtype=torch.float32)
    routed = [torch.tensor([0, 3, 9, 15])]  # the one MoE layer (layer 0 is dense)
    whole = bench_flash.step_read_floor_bytes(model, routed, batch=1)
    expert_bytes = sum(p.numel() * 4 for p in model.model.layers[1].mlp.experts[0].parameters())
    model.model.layers[1].mlp.experts.keep_local_experts(1, 2)  # experts 8..15: 9 and 15 of those touched
    assert bench_flash.step_read_floor_bytes(model, routed, batch=1) == whole - 2 * expert_bytes
