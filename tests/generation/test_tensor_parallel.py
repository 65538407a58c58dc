"""Tensor parallelism through transformers' `tp_plan="auto"` (hf_dllm/tensor_parallel.py, the configs'
`base_model_tp_plan`): two processes (torchrun; gloo on CPU, NCCL on two GPUs) against one process.

On CPU in float32 the sharded models must give exactly the tokens of one process: the shards change only the order
of float32 sums (logits within 1e-4). On two GPUs in bfloat16 the sums' rounding differs between one GPU and the
shards, so the logits are compared with the project's bfloat16 tolerance (5% of the largest logit, as
test_gpu.py's Triton-vs-sdpa check) and tokens are not compared with one GPU; the two ranks' tokens must still be
identical, and the denoising steps must run as captured CUDA graphs (NCCL collectives inside).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TESTS, BackgroundJob

WORKER_PATH = TESTS / "tensor_parallel_worker.py"
_spec = importlib.util.spec_from_file_location("tensor_parallel_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def worker_command(out: Path, device: str, dtype: str, args: tuple = (), env: dict | None = None) -> tuple[list, dict]:
    """`tensor_parallel_worker.py` under `torchrun --nproc-per-node 2` (`args` after device and dtype, `env` on top
    of the process environment), the first rank's records saved to `out`: the command and its environment."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(env or {}),
    )
    if device == "cpu":  # on a machine with GPUs, transformers would place each rank's shard on its GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    return [*command, str(WORKER_PATH), str(out), device, dtype, *args], env


def run_worker(
    tmp_path: Path, device: str, dtype: str, timeout: int, args: tuple = (), env: dict | None = None
) -> dict:
    """`worker_command` run; returns what the first rank recorded."""
    out = tmp_path / "tp.pt"
    command, env = worker_command(out, device, dtype, args, env)
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return torch.load(out, weights_only=False)


# The two CPU ranks (gloo, float32), run beside the in-process tests.
CPU_RUN = BackgroundJob(
    lambda workdir: {"tp": worker_command(workdir / "tp.pt", "cpu", "float32")[0]},
    timeout=240,
    cwd=ROOT,
    env=worker_command(Path("tp.pt"), "cpu", "float32")[1],
)


@pytest.fixture(scope="module")
def cpu_results() -> dict:
    done = CPU_RUN.results()["tp"]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return torch.load(CPU_RUN.workdir / "tp.pt", weights_only=False)


@pytest.fixture(scope="module")
def single_process() -> dict:
    torch.set_num_threads(1)
    return {name: worker.record(worker.load(name, "cpu", torch.float32), name, "cpu") for name in worker.MODELS}


@pytest.mark.parametrize("name", list(worker.MODELS))
@CPU_RUN.used_by
def test_shards_hold_half_the_heads(cpu_results, name):
    config_heads = {"llada": (4, 4), "llada2": (4, 2), "dream": (4, 2)}[name]
    for rank, result in enumerate(cpu_results[name]):
        heads, kv_heads, detail = result["local_heads"]
        assert (heads, kv_heads) == (config_heads[0] // 2, config_heads[1] // 2)
        if name in ("llada", "dream"):
            assert detail == (32, 64)  # q_proj's local rows: 2 heads of 16
        else:
            assert detail == (
                (2 * rank, 2 * rank + 2),
                (rank, rank + 1),
            )  # query heads, and the key/value head they read


@pytest.mark.parametrize("name", list(worker.MODELS))
@CPU_RUN.used_by
def test_sharded_logits_equal_one_process(cpu_results, single_process, name):
    expected = single_process[name]["logits"]
    for result in cpu_results[name]:
        assert result["logits"].shape == expected.shape
        torch.testing.assert_close(result["logits"], expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "name,setting", [(name, setting) for name, settings in worker.SETTINGS.items() for setting, _ in settings]
)
@CPU_RUN.used_by
def test_sharded_tokens_equal_one_process(cpu_results, single_process, name, setting):
    expected, expected_nfe = single_process[name]["generated"][setting]
    prompt_length = len(worker.PROMPTS[0])
    assert (expected[:, prompt_length:] != worker.COMMON["mask_token_id"]).all()
    for result in cpu_results[name]:
        sequences, nfe = result["generated"][setting]
        assert torch.equal(sequences, expected), (setting, sequences, expected)
        assert nfe == expected_nfe


@CPU_RUN.used_by
def test_experts_loop_equals_grouped_gemms_under_tensor_parallelism(cpu_results, single_process):
    # The loop calls the sharded expert modules (their hooks all-reduce); the grouped path reduces once itself.
    expected = single_process["llada2"]["generated"][worker.SETTINGS["llada2"][0][0]][0]
    for result in cpu_results["llada2"]:
        assert torch.equal(result["experts_loop"], expected)


@CPU_RUN.used_by
def test_ranks_sampling_with_different_seeds_keep_rank_zeros_tokens(cpu_results):
    first, second = (result["sampled"] for result in cpu_results["llada"])
    assert torch.equal(first, second)
    assert not torch.equal(first, cpu_results["llada"][0]["generated"]["no_cache"][0])  # it did sample
    assert (first[:, len(worker.PROMPTS[0]) :] != worker.COMMON["mask_token_id"]).all()


@pytest.mark.parametrize("name", list(worker.MODELS))
def test_plans_name_existing_modules(name):
    """Every entry of the tensor-parallel plans matches linear layers of the model (a misspelt entry would leave
    them unsharded without an error), and a declared pipeline plan names the base model's children."""
    import re

    model = worker.load(name, "cpu", torch.float32)
    base = model.base_model
    linear_names = [module_name for module_name, module in base.named_modules() if isinstance(module, torch.nn.Linear)]
    for pattern in model.config.base_model_tp_plan:
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        assert any(regex.match(module_name) for module_name in linear_names), pattern
    for module_name in type(model)._tp_plan or {}:
        assert isinstance(model.get_submodule(module_name), torch.nn.Linear), module_name
    for child in model.config.base_model_pp_plan or {}:
        assert hasattr(base, child), child
    for module_name in getattr(type(model), "_pp_plan", None) or {}:
        assert model.get_submodule(module_name) is not None, module_name
    # Pipeline plans for Dream only: LLaDA's base model has one child (`transformer`, the Hub's layout), and LLaDA2's
    # decoder layers return a tuple, which transformers' stage identities do not.
    assert model.supports_pp_plan == (name == "dream")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_bfloat16(tmp_path):
    results = run_worker(tmp_path, "cuda", "bfloat16", timeout=600)
    for name in worker.MODELS:
        single = worker.load(name, "cuda", torch.bfloat16)
        reference = worker.record(single, name, "cuda")
        # Whether this tiny model's steps are captured at all depends on the model and settings (the 8B shapes of
        # benchmarks/bench_tp.py are); tensor parallelism must not change it.
        single_graphs = bool(getattr(single, "_hf_dllm_step_graphs", None) and single._hf_dllm_step_graphs.steps)
        first, second = results[name]
        scale = reference["logits"].abs().max()
        for result in (first, second):
            assert (result["logits"] - reference["logits"]).abs().max() <= 0.05 * scale
            assert result["graphs_captured"] == single_graphs, "tensor parallelism changed CUDA-graph capture"
        for setting, _ in worker.SETTINGS[name]:
            assert torch.equal(first["generated"][setting][0], second["generated"][setting][0]), setting


def test_head_counts_follow_the_weights_when_they_are_replaced():
    """An attention layer's head counts are read from its q/k weights once, and again when the weights are
    replaced (as tensor-parallel or quantized loading replaces them)."""
    from tests.conftest import tiny_model

    block = tiny_model(seed=0).model.transformer.blocks[0]  # 4 query heads, 2 key/value heads of 16
    assert (block.num_heads, block.num_kv_heads, block.num_key_value_groups) == (4, 2, 2)
    block.q_proj.weight = torch.nn.Parameter(block.q_proj.weight[:32])  # this rank's 2 query heads
    block.k_proj = torch.nn.Linear(64, 16, bias=False)  # and 1 key/value head
    assert (block.num_heads, block.num_kv_heads, block.num_key_value_groups) == (2, 1, 2)
