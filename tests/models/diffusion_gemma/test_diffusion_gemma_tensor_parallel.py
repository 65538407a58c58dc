"""DiffusionGemma under transformers' tensor parallelism through its config's own `base_model_tp_plan`
(`tp_plan="auto"`), and with its `base_model_ep_plan` too (`tp_size=ep_size=ranks`): two and four processes
(torchrun, gloo, float32) against one process (`gemma_tp_worker.py`), the runs side by side. The shards
change only the order of float32 sums: logits within 1e-4, and under the same seed on every rank (identical draws)
the same tokens and the same per-row denoising steps as one process, rows ending at an EOS and stopping early
included."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from hf_dllm.tensor_parallel import ALL_PARALLEL_STYLES
from hf_dllm.triton_ops import TRITON_AVAILABLE
from tests.conftest import ROOT, BackgroundJob

WORKER = Path(__file__).with_name("gemma_tp_worker.py")
SETTINGS = ("eos", "cold")
CPU_SETTINGS = (*SETTINGS, "eos-static")  # (on the CPU the worker runs "eos" over the static cache too)
MODES = ("tp", "ep")
RANKS = (2, 4)  # the fixture's 4 query heads and 4 experts split up to 4 ways
RUNS = [(mode, ranks) for ranks in RANKS for mode in MODES]
EXPERT_PLAN = ALL_PARALLEL_STYLES is not None  # transformers >= 5.24


def _launch(ranks: int, saved: Path, device: str, dtype: str, modes, *extra: str) -> list[str]:
    """The launch of `gemma_tp_worker.py` over `ranks` processes recording the plans `modes` in turn, each saved to
    `saved` (its `{mode}` replaced by the plan's name)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"]
    return [*launcher, str(WORKER), str(saved), device, dtype, ",".join(modes), *extra]


def _command(workdir: Path, device: str = "cpu", dtype: str = "float32", runs=RUNS) -> dict:
    """(mode, ranks) -> one launch per plan, saving to `_saved(...)`."""
    return {(mode, ranks): _launch(ranks, _saved(workdir, mode, ranks), device, dtype, (mode,)) for mode, ranks in runs}


def _launches_by_ranks(workdir: Path, ranks=RANKS, *extra: str) -> dict:
    """ranks -> one launch on the CPU recording both plans in turn (the processes, their imports and one process's
    record shared), each saved to `_saved(...)`; the tensor plan alone without the expert plan's transformers."""
    modes = MODES if EXPERT_PLAN else ("tp",)
    return {n: _launch(n, _saved(workdir, "{mode}", n), "cpu", "float32", modes, *extra) for n in ranks}


def _skip_without_expert_plan(mode: str) -> None:
    if mode == "ep" and not EXPERT_PLAN:
        pytest.skip("expert parallelism needs transformers >= 5.24")


def _saved(workdir: Path, mode: str, ranks: int) -> Path:
    return workdir / f"gemma_{mode}_{ranks}.pt"


CPU_ENV = dict(
    os.environ,
    OMP_NUM_THREADS="1",
    CUDA_VISIBLE_DEVICES="",
    PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
)
CPU_RUN = BackgroundJob(_launches_by_ranks, timeout=420, cwd=ROOT, env=CPU_ENV)


# Both plans over the fused layers (Triton's interpreter, `HF_DLLM_KERNELS=triton`): the forward's logits only. Under
# the expert plan a rank's routes to the other rank's experts come with id `num_experts` (weight 0), which the
# grouped kernels must not read as an expert (it was an out-of-bounds read: a segmentation fault here, an illegal
# memory access on two GPUs).
FUSED_CPU_RUN = BackgroundJob(
    lambda workdir: _launches_by_ranks(workdir, (2,), "logits"),
    timeout=300,
    when=lambda: TRITON_AVAILABLE,
    cwd=ROOT,
    env=dict(CPU_ENV, HF_DLLM_KERNELS="triton", TRITON_INTERPRET="1"),
)


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="the `triton` extra is not installed")
@pytest.mark.parametrize("mode", MODES)
@FUSED_CPU_RUN.used_by
def test_plans_over_the_fused_layers_equal_one_process(mode):
    """The plans wrap the experts' forward to all-reduce their sum: the fused layer must let them sum it (the layer's
    end kernel takes the pairs' outputs only from unwrapped experts), and the sharded logits equal one process's."""
    _skip_without_expert_plan(mode)
    done = FUSED_CPU_RUN.results()[2]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    results = torch.load(_saved(FUSED_CPU_RUN.workdir, mode, 2), weights_only=False)
    assert results["single"]["kernel_mode"] == "triton" and not results["single"]["generated"]
    for rank in results["ranks"]:
        assert rank["kernel_mode"] == "triton"
        torch.testing.assert_close(rank["logits"], results["single"]["logits"], rtol=0, atol=1e-4)


@pytest.fixture(scope="module", params=RUNS, ids=[f"{mode}-{ranks}" for mode, ranks in RUNS])
def results(request) -> dict:
    mode, ranks = request.param
    _skip_without_expert_plan(mode)
    done = CPU_RUN.results()[ranks]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    saved = torch.load(_saved(CPU_RUN.workdir, mode, ranks), weights_only=False)
    assert len(saved["ranks"]) == ranks
    return {"mode": mode, **saved}


@CPU_RUN.used_by
def test_plans_shard_attention_and_experts(results):
    """Every attention layer holds its share of the heads; under the expert plan each rank holds its share of the
    experts (under the tensor plan all of them, each as much narrower)."""
    single, ranks = results["single"], len(results["ranks"])
    for rank in results["ranks"]:
        assert rank["q_rows"] == [rows // ranks for rows in single["q_rows"]]
        expected = [n // ranks for n in single["experts"]] if results["mode"] == "ep" else single["experts"]
        assert rank["experts"] == expected


@CPU_RUN.used_by
def test_static_cache_holds_this_ranks_heads(results):
    """The static cache (CUDA's default) holds each rank's key/value heads, not the config's: a buffer of all of them
    broadcasts a rank's heads into every slot, which the fused norm/RoPE kernel refuses on the GPU."""
    single, ranks = results["single"]["cache_heads"], len(results["ranks"])
    assert single and all(heads >= ranks for heads in single)
    for rank in results["ranks"]:
        assert rank["cache_heads"] == [heads // ranks for heads in single]


@CPU_RUN.used_by
def test_sharded_logits_equal_one_process(results):
    for rank in results["ranks"]:
        torch.testing.assert_close(rank["logits"], results["single"]["logits"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("setting", CPU_SETTINGS)
@CPU_RUN.used_by
def test_sharded_tokens_equal_one_process(results, setting):
    sequences, steps = results["single"]["generated"][setting]
    for rank in results["ranks"]:
        assert torch.equal(rank["generated"][setting][0], sequences)
        assert torch.equal(rank["generated"][setting][1], steps)
    if setting.startswith("eos"):  # row 0 ended at its EOS in its first canvas: its second is padding, row 1's not
        assert bool((sequences[0, -16:] == 0).all()) and not bool((sequences[1, -16:] == 0).all())
    if setting == "cold":  # the rows stopped early, after different numbers of steps
        assert steps.max() < 12 and steps[0] != steps[1]


def test_plans_are_the_configs_and_name_existing_modules():
    """The model's tensor / expert parallel plans are its text config's own (under the decoder, which holds the
    layers), and every entry matches a module or parameter (a misspelt one would leave it unsharded silently)."""
    import re

    from transformers import AutoConfig, AutoModel

    import hf_dllm  # noqa: F401

    config = AutoConfig.from_pretrained(ROOT / "tests" / "fixtures" / "diffusion-gemma-tiny-ref")
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    names = {re.sub(r"\.\d+(\.|$)", r".*\1", name) for name, _ in [*model.named_modules(), *model.named_parameters()]}
    for plan, own in (
        (model.tp_plan, config.text_config.base_model_tp_plan),
        (model.ep_plan, config.text_config.base_model_ep_plan),
    ):
        assert plan == {f"model.decoder.{name}": style for name, style in own.items()}
        assert set(plan) <= names, sorted(set(plan) - names)


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "ranks"), RUNS, ids=[f"{mode}-{ranks}" for mode, ranks in RUNS])
def test_gpus_bfloat16(tmp_path, mode, ranks):
    """Both plans on two and four GPUs (NCCL, bfloat16, the fast path: static cache, CUDA graphs, fused sampler):
    the sums' rounding differs between one GPU and the shards, so the logits' error against one float32 process is
    bounded by one GPU's own bfloat16 error (within 2x), and tokens are not compared with one GPU; the ranks draw the
    same numbers, so their tokens and steps must be identical, and the passes run as CUDA graphs as on one GPU."""
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA devices")
    _skip_without_expert_plan(mode)
    import subprocess

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", NCCL_NVLS_ENABLE="0")
    command = _command(tmp_path, "cuda", "bfloat16", [(mode, ranks)])[mode, ranks]
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired as hung:  # the ranks dump their stacks first (`gemma_tp_worker.HANG_AFTER_S`)
        pytest.fail(f"the ranks did not finish:\n{(hung.stderr or b'').decode(errors='replace')[-12000:]}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    results = torch.load(_saved(tmp_path, mode, ranks), weights_only=False)
    single, (first, *others) = results["single"], results["ranks"]
    assert single["graphs"], "one GPU did not capture the decoder's passes"
    # Each run's error against one float32 process: the shards add a rounding per sum (each rank's bf16 partial),
    # so a rank's error may exceed one GPU's own bfloat16 error, within 2x of it (a wrong shard is far beyond it).
    reference = results["reference_logits"]
    own_error = (single["logits"] - reference).abs().max()
    for rank in (first, *others):
        error = (rank["logits"] - reference).abs().max()
        assert error <= 2 * own_error, f"sharded error {error:.4f}, one GPU's {own_error:.4f} (float32: 0)"
        assert rank["graphs"], "the sharded model did not capture the decoder's passes"
    for name in SETTINGS:
        for other in others:
            assert torch.equal(first["generated"][name][0], other["generated"][name][0]), name
            assert torch.equal(first["generated"][name][1], other["generated"][name][1]), name
