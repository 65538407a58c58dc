"""Expert parallelism through transformers' own plans (`distributed_config=DistributedConfig(tp_size=N, ep_size=N)`;
the configs' `base_model_ep_plan`, `tensor_parallel.EXPERTS_STYLE`, `grouped_gemm.ExpertList`): 2 and 4 gloo
processes on CPU against one process, for LLaDA2 (with and without LLaDA2.2's block routing) and LLaDA-MoE (also
under tensor parallelism: its plan splits only the experts).

In float32 each rank's experts run on the whole batch and one all-reduce sums the layer's outputs, so the tokens
must equal one process's exactly (logits within 1e-4: only the order of float32 sums changes), and every rank must
hold exactly its 1/N of the routed experts' bytes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TESTS, BackgroundJob

_spec = importlib.util.spec_from_file_location("expert_parallel_worker", TESTS / "expert_parallel_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

# 2 ranks: every case, run by tests/generation/test_tensor_parallel.py's job (tensor_parallel_worker.py runs these cases
# after its own, in the same processes); 4 ranks: LLaDA2 (2 of its 8 experts per rank, attention split over 4 ranks
# with 2 key/value heads), a job of its own.
from tests.generation.test_tensor_parallel import CPU_RUN  # noqa: E402

RANKS = {2: list(worker.CASES), 4: ["llada2"]}
ENV = dict(
    os.environ,
    OMP_NUM_THREADS="1",
    CUDA_VISIBLE_DEVICES="",  # on a machine with GPUs, transformers would place each rank on its GPU
    PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
)


def worker_command(ranks: int, out: Path, device: str = "cpu", dtype: str = "float32") -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"]
    return [*command, str(TESTS / "expert_parallel_worker.py"), str(out), device, dtype, *RANKS[ranks]]


FOUR_RANKS = BackgroundJob(lambda workdir: {"ep": worker_command(4, workdir / "ep.pt")}, timeout=300, cwd=ROOT, env=ENV)
JOBS = {2: (CPU_RUN, "tp", "tp.pt"), 4: (FOUR_RANKS, "ep", "ep.pt")}
CASES = [(ranks, case) for ranks, cases in RANKS.items() for case in cases]


def sharded(ranks: int) -> dict:
    job, name, file = JOBS[ranks]
    done = job.results()[name]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return torch.load(job.workdir / file, weights_only=False)


@pytest.fixture(scope="module")
def single_process() -> dict:
    torch.set_num_threads(1)
    records = {
        case: worker.record(worker.load(case, "cpu", torch.float32), case, "cpu")
        for case in worker.CASES
        if case not in worker.TENSOR_PARALLEL
    }
    return dict(records, llada_moe_tensor=records["llada_moe"])  # the same model in one process


def uses_jobs(test):
    for job, _, _ in JOBS.values():
        test = job.used_by(test)
    return test


@pytest.mark.parametrize("ranks,case", CASES)
@uses_jobs
def test_expert_parallel_equals_one_process(single_process, ranks, case):
    expected = single_process[case]
    for result in sharded(ranks)[f"ep:{case}"]:
        torch.testing.assert_close(result["logits"], expected["logits"], rtol=0, atol=1e-4)
        for setting, (sequences, nfe) in expected["generated"].items():
            assert torch.equal(result["generated"][setting][0], sequences), setting
            assert result["generated"][setting][1] == nfe
        # The experts as a loop (`experts_implementation="eager"`) instead of torch's grouped GEMMs.
        assert torch.equal(result["experts_loop"], expected["experts_loop"])


@pytest.mark.parametrize("ranks,case", CASES)
@uses_jobs
def test_each_rank_holds_its_share_of_the_experts(single_process, ranks, case):
    expected = single_process[case]
    experts = [count for _, count in expected["kept"]]
    for rank, result in enumerate(sharded(ranks)[f"ep:{case}"]):
        if case in worker.TENSOR_PARALLEL:  # every expert kept, a slice of each
            assert result["kept"] == expected["kept"]
        else:
            assert result["kept"] == [(rank * count // ranks, count // ranks) for count in experts]
        assert result["bytes"]["experts"] * ranks == expected["bytes"]["experts"]
        assert result["bytes"]["total"] - result["bytes"]["experts"] <= expected["bytes"]["total"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.skipif(
    __import__("hf_dllm.tensor_parallel").tensor_parallel.ALL_PARALLEL_STYLES is None,
    reason="expert parallelism needs transformers >= 5.24",
)
def test_two_gpus_bfloat16(tmp_path):
    """NCCL (and the symmetric-memory all-reduce where it runs), bfloat16: the ranks' tokens identical, logits within
    the project's bfloat16 tolerance of one GPU's (5% of the largest logit), CUDA-graph capture as on one GPU (but
    for LLaDA-MoE under tensor parallelism)."""
    import subprocess

    out = tmp_path / "ep.pt"
    command = worker_command(2, out, "cuda", "bfloat16")
    env = dict(ENV, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    env.pop("CUDA_VISIBLE_DEVICES")
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    results = torch.load(out, weights_only=False)
    for case in worker.CASES:
        single = worker.load(case, "cuda", torch.bfloat16)
        reference = worker.record(single, case, "cuda")
        first, second = results[f"ep:{case}"]
        scale = reference["logits"].abs().max()
        # LLaDA-MoE's tensor-parallel experts run as a loop over the sharded modules, which reads the per-expert
        # counts on the host (`uses_grouped_mm`): its steps stay eager.
        graphs = reference["graphs_captured"] and case not in worker.TENSOR_PARALLEL
        for result in (first, second):
            assert (result["logits"] - reference["logits"]).abs().max() <= 0.05 * scale, case
            assert result["graphs_captured"] == graphs, case
        for setting in reference["generated"]:
            assert torch.equal(first["generated"][setting][0], second["generated"][setting][0]), (case, setting)
        del single


@pytest.mark.parametrize("case", ["llada2", "llada_moe"])
def test_expert_parallel_plans_name_the_expert_modules(case):
    """The configs' expert-parallel plans name the style tensor_parallel.py registers with transformers and modules
    that exist (a misspelt rule would leave every expert on every rank)."""
    import re

    from hf_dllm.grouped_gemm import ExpertDispatch, ExpertList
    from hf_dllm.tensor_parallel import EXPERTS_STYLE

    model = worker.load(case, "cpu", torch.float32)
    plan = model.config.base_model_ep_plan
    assert sorted(plan.values()) == sorted([EXPERTS_STYLE, "ep_dispatch_experts"])
    kinds = {EXPERTS_STYLE: ExpertList, "ep_dispatch_experts": ExpertDispatch}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        matched = [module for name, module in model.base_model.named_modules() if regex.match(name)]
        assert matched and all(isinstance(module, kinds[style]) for module in matched), pattern
    # The dispatch module comes after its list: transformers applies the rules in module order.
    names = [name for name, _ in model.base_model.named_modules()]
    first_moe = next(name for name in names if name.endswith(".experts"))
    assert names.index(first_moe.replace(".experts", ".expert_dispatch")) > names.index(first_moe)


def test_uneven_expert_split_is_refused():
    from hf_dllm.grouped_gemm import ExpertList

    experts = ExpertList([torch.nn.Linear(2, 2) for _ in range(6)], config=None)
    with pytest.raises(ValueError, match="ep_size must divide 6, got 4"):
        experts.keep_local_experts(0, 4)
    experts.keep_local_experts(1, 3)
    assert (experts.first, experts.num_experts, experts.partitioned) == (2, 2, True)
    assert [len(list(expert.parameters())) for expert in experts] == [0, 0, 2, 2, 0, 0]


@pytest.mark.parametrize(
    "batch,choice,expected",
    [(1, None, "tensor"), (4, None, "expert"), (32, None, "expert"), (32, "tensor", "tensor"), (1, "expert", "expert")],
)
def test_moe_parallelism_rule(monkeypatch, batch, choice, expected):
    """LLaDA2.x's 256 experts, top-8, blocks of 32: tensor parallelism below 4 (token, expert) pairs per expert per
    step (batch 1: 1), expert parallelism from there; a given choice (or `HF_DLLM_MOE_PARALLEL`) wins."""
    from types import SimpleNamespace

    from hf_dllm.tensor_parallel import MOE_PARALLEL_ENV, moe_parallelism

    config = SimpleNamespace(num_experts=256, num_experts_per_tok=8)
    monkeypatch.delenv(MOE_PARALLEL_ENV, raising=False)
    assert moe_parallelism(config, batch, 32, choice) == expected
    monkeypatch.setenv(MOE_PARALLEL_ENV, "tensor")
    assert moe_parallelism(config, batch, 32) == "tensor"


@pytest.mark.parametrize(
    "arguments,message",
    [
        ((4, 32, "data"), "must be one of"),
        ((0, 32, None), "batch_size must be a positive integer"),
        ((1, 2.0, None), "tokens_per_row must be a positive integer"),
    ],
)
def test_moe_parallelism_refuses_bad_arguments(arguments, message):
    from types import SimpleNamespace

    from hf_dllm.tensor_parallel import moe_parallelism, parallel_load_kwargs

    with pytest.raises(ValueError, match=message):
        moe_parallelism(SimpleNamespace(num_experts=8, num_experts_per_tok=2), *arguments)
    with pytest.raises(ValueError, match="needs an MoE config"):
        moe_parallelism(SimpleNamespace(), 1, 32)
    with pytest.raises(ValueError, match="'tensor' or 'expert'"):
        parallel_load_kwargs("pipeline", 2)
