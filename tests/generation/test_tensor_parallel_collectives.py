"""`benchmarks/bench_tp.py --cpu` (so CI runs the tensor-parallel benchmark): two gloo processes against one, LLaDA
and LLaDA2 in float32. The sharded runs must give one process's tokens on every rank, and each denoising step must
make the collectives the issue asks for (#64), counted at the dispatcher (`CollectiveCounter`): one all-reduce per
attention and one per MLP / MoE layer (LLaDA2's shared experts joined to the routed experts' all-reduce; no gather of
q/k/v), one gather of the proposal each rank reduced from its slice of the output head's logits (not of the logits)
and one broadcast of rank 0's tokens."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import BackgroundJob

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent


# Started at collection, beside the in-process tests (one of the two cores): the tests wait for it only.
BENCH_RUN = BackgroundJob(
    lambda _workdir: {"bench_tp": [sys.executable, str(ROOT / "benchmarks" / "bench_tp.py"), "--cpu"]},
    timeout=300,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", CUDA_VISIBLE_DEVICES=""),
)


@pytest.fixture(scope="module")
def summary() -> dict:
    result = BENCH_RUN.results()["bench_tp"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


LAYOUTS = [("llada", "tensor"), ("llada2", "tensor"), ("llada2", "expert")]


@pytest.mark.parametrize("model,parallel", LAYOUTS)
def test_bench_tp_cpu_ranks_agree_with_one_process(summary, model, parallel):
    (row,) = [row for row in summary["rows"] if (row["model"], row["parallel"]) == (model, parallel)]
    assert row["ranks_agree"] and row["tokens_equal_single_gpu"] == 1.0
    assert row["nfe"][0] == row["nfe"][1] > 0


def test_bench_tp_cpu_reports_the_moe_layout(summary):
    """LLaDA2 sharded both ways, the rule's pick (batch 1 x 4 tokens x top-8 over 16 experts: 2 pairs per expert,
    below the rule's 4: tensor) and the faster layout reported; expert parallelism holds the same share of the
    weights per rank as tensor parallelism (half the experts whole instead of half of each)."""
    choice = summary["moe_parallelism"]["llada2_batch1"]
    assert choice["rule"] == "tensor" and choice["faster"] in ("tensor", "expert")
    assert set(choice["step_ms"]) == {"tensor", "expert"}
    weights = {row["parallel"]: row["tp_weight_gb_per_gpu"] for row in summary["rows"] if row["model"] == "llada2"}
    assert weights["expert"] <= weights["tensor"] * 1.05


@pytest.mark.parametrize("model,parallel", LAYOUTS)
def test_collectives_per_step(summary, model, parallel):
    """Also under expert parallelism: transformers' one all-reduce of the routed experts per MoE layer, with the
    shared expert's partial sums in it."""
    (row,) = [row for row in summary["rows"] if (row["model"], row["parallel"]) == (model, parallel)]
    forwards, layers = row["nfe"][1], row["layers"]
    assert row["tp_collectives"] == {
        "c10d._allgather_base_": forwards,  # each rank's proposal from its vocabulary slice (not the logits)
        "c10d.allreduce_": 2 * layers * forwards,  # attention, MLP / MoE
        "c10d.broadcast_": forwards,  # rank 0's tokens
    }
    assert row["tp_collectives_per_forward"] == 2 * layers + 2


@pytest.mark.parametrize(
    "suppressed,deferred,mask_id",
    [(None, None, None), ([3, 17], [9], 11), ([0, 29], None, 12)],  # ids on both sides of the slices' bounds
)
def test_sharded_proposal_equals_the_whole_vocabulary(monkeypatch, suppressed, deferred, mask_id):
    """`propose_tokens_sharded` on three uneven vocabulary slices (the gather stubbed with the three ranks' reduced
    values) gives every rank `propose_tokens`' tokens and confidences over the whole vocabulary, ties included."""
    import torch

    from hf_dllm import decoding, tensor_parallel

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 30, generator=generator)
    logits[0, 0, 7] = logits[0, 0, 21] = logits[0, 0].max() + 1  # a tie across slices: the lower id wins
    logits[1, 2, 11] = logits[1, 2, 12] = logits[1, 2].max() + 2  # the best token is the mask (one mask id)
    masked = torch.rand(2, 5, generator=generator) > 0.3

    def as_ids(ids):
        return None if ids is None else torch.tensor(ids)

    expected = decoding.propose_tokens(
        logits, masked, 0.0, "low_confidence", as_ids(suppressed), as_ids(deferred), mask_id
    )
    bounds = [(0, 10), (10, 21), (21, 30)]
    stats = []

    def record(tensor, group):
        stats.append(tensor)
        return tensor.unsqueeze(0).expand(len(bounds), *tensor.shape)

    monkeypatch.setattr(tensor_parallel, "all_gather_stacked", record)

    def arguments(start: int, stop: int) -> tuple:
        shard = tensor_parallel.VocabShard(start, stop - start, None)
        return logits[..., start:stop], shard, masked, as_ids(suppressed), as_ids(deferred), mask_id

    for start, stop in bounds:
        decoding.propose_tokens_sharded(*arguments(start, stop))
    monkeypatch.setattr(tensor_parallel, "all_gather_stacked", lambda tensor, group: torch.stack(stats))
    for start, stop in bounds:
        x0, confidence = decoding.propose_tokens_sharded(*arguments(start, stop))
        assert torch.equal(x0, expected[0])
        torch.testing.assert_close(confidence, expected[1], rtol=1e-6, atol=1e-7)


# These tests read the job's summary: it starts at collection and the module runs after the others.
BENCH_RUN.used_by(test_bench_tp_cpu_ranks_agree_with_one_process)
BENCH_RUN.used_by(test_collectives_per_step)
