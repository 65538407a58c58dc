"""LLaDA2's fused MoE and attention paths on tensor-parallel shards (`tp_plan="auto"`, two processes), against one
process.

On the shards each rank's grouped expert GEMMs compute partial sums of the routed and the stacked shared expert:
the combine kernel adds the residual on one rank only and one all-reduce per MoE layer sums them
(`LLaDA2MoeSparseMoeBlock.fused_forward`); the fused q/k-norm + RoPE + cache-write kernel takes the rank's own heads
out of the gathered q/k/v projection (`LLaDA2MoeAttention._fused_forward`). On the CPU (gloo) the kernels run in
Triton's interpreter (`TRITON_INTERPRET=1`, `HF_DLLM_KERNELS=triton`), float32, against the PyTorch path of one
process: logits within the tolerance of tests/generation/test_tensor_parallel.py (1e-4), the same tokens, and each rank's
cache holding exactly its key/value heads. On two GPUs (marked) in bfloat16 against one GPU, with the tolerance of
tests/generation/test_tensor_parallel.py's GPU test.

The worker is tests/tensor_parallel_worker.py with the argument `fused` (`record_fused`); it also loads a tiny
LLaDA2 with two shared experts, which are not stacked with the routed ones (their own sharded modules run, added
after the all-reduce), and the fixture with sdpa attention (the fused path's grouped-query sdpa on the rank's heads).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the `triton` extra is not installed")

from tests.conftest import ROOT, BackgroundJob  # noqa: E402
from tests.generation.test_tensor_parallel import run_worker, worker, worker_command  # noqa: E402

SETTING = worker.FUSED_SETTINGS[0][0]
# The worker's cached steps (the fixture with its default `llada_triton` attention, with two shared experts, with
# sdpa) and their counts of fused calls.
CACHED_STEPS = ("cached_step", "two_shared_experts", "sdpa")
FUSED_CALLS = ("fused_calls", "two_shared_experts_fused_calls", "sdpa_fused_calls")


def two_shared_experts_model(directory: Path) -> Path:
    """The tiny LLaDA2 fixture with two shared experts (theirs random, fixed seed; every other weight the
    fixture's), saved to `directory`."""
    from hf_dllm import LLaDA2MoeModelLM

    fixture = worker.load("llada2", "cpu", torch.float32)
    config = copy.deepcopy(fixture.config)
    config.num_shared_experts = 2
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(config)
    state = {name: tensor for name, tensor in fixture.state_dict().items() if ".shared_experts." not in name}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and missing and all(".shared_experts." in name for name in missing), (missing, unexpected)
    model.save_pretrained(directory)
    return directory


def run_fused_worker(tmp_path: Path, device: str, dtype: str, extra: Path, timeout: int) -> dict:
    # On the CPU the kernels run in Triton's interpreter.
    env = dict(TRITON_INTERPRET="1", HF_DLLM_KERNELS="triton") if device == "cpu" else {}
    return run_worker(tmp_path, device, dtype, timeout, args=("fused", str(extra)), env=env)


def one_process(extra: Path, device: str, dtype: torch.dtype) -> dict:
    """What the worker records (`record_fused`), from one process."""
    return worker.record_fused(device, dtype, extra)[1]


@pytest.fixture(scope="module")
def extra_model(tmp_path_factory) -> Path:
    return two_shared_experts_model(tmp_path_factory.mktemp("llada2_two_shared"))


EXTRA_MODEL_SCRIPT = (
    "import sys; from pathlib import Path; from tests.kernels.test_tensor_parallel_fused import"
    " two_shared_experts_model; two_shared_experts_model(Path(sys.argv[1]))"
)


def cpu_commands(workdir: Path) -> dict[str, list[str]]:
    """The two-shared-experts model saved to `workdir`, then the two CPU ranks (kernels in Triton's interpreter)."""
    extra = workdir / "llada2_two_shared"
    torchrun, _ = worker_command(workdir / "tp.pt", "cpu", "float32", args=("fused", str(extra)))
    then_run = '"$0" -c "$1" "$2" && shift 2 && exec "$@"'
    return {"tp": ["sh", "-c", then_run, sys.executable, EXTRA_MODEL_SCRIPT, str(extra), *torchrun]}


CPU_RUN = BackgroundJob(
    cpu_commands,
    timeout=400,
    cwd=ROOT,
    env=worker_command(Path("tp.pt"), "cpu", "float32", env=dict(TRITON_INTERPRET="1", HF_DLLM_KERNELS="triton"))[1],
)


@pytest.fixture(scope="module")
def cpu_results() -> list:
    done = CPU_RUN.results()["tp"]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return torch.load(CPU_RUN.workdir / "tp.pt", weights_only=False)["llada2"]


@pytest.fixture(scope="module")
def single_process(cpu_results) -> dict:
    from hf_dllm import kernels

    mode = kernels.kernel_mode()
    kernels.set_kernel_mode("torch")  # the PyTorch path is the reference
    try:
        return one_process(CPU_RUN.workdir / "llada2_two_shared", "cpu", torch.float32)
    finally:
        kernels.set_kernel_mode(mode)


@CPU_RUN.used_by
def test_fused_paths_run_on_the_shards(cpu_results):
    # Before the fused paths were shard-aware both refused sharded weights and these counts were 0.
    for result in cpu_results:
        for model in FUSED_CALLS:
            assert result[model]["moe"] > 0 and result[model]["attention"] > 0, (model, result[model])


@CPU_RUN.used_by
def test_fused_shards_logits_equal_one_process(cpu_results, single_process):
    for rank, result in enumerate(cpu_results):
        torch.testing.assert_close(result["logits"], single_process["logits"], rtol=0, atol=1e-4)
        for forward in ("prefill", "step"):
            for model in CACHED_STEPS:
                ours, expected = result[model][forward], single_process[model][forward]
                torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4, msg=f"{model} {forward} rank {rank}")


@CPU_RUN.used_by
def test_fused_shards_cache_their_own_key_value_heads(cpu_results, single_process):
    for rank, result in enumerate(cpu_results):
        step = result["cached_step"]
        assert step["kv_heads"] == (rank, rank + 1)  # 2 key/value heads over 2 ranks
        start, stop = step["kv_heads"]
        for name in ("keys", "values"):
            expected = single_process["cached_step"][name][:, start:stop]
            torch.testing.assert_close(step[name], expected, rtol=0, atol=1e-5, msg=f"{name} rank {rank}")


@CPU_RUN.used_by
def test_fused_shards_tokens_equal_one_process(cpu_results, single_process):
    expected, expected_nfe = single_process["generated"][SETTING]
    assert (expected[:, len(worker.PROMPTS[0]) :] != worker.COMMON["mask_token_id"]).all()
    for result in cpu_results:
        sequences, nfe = result["generated"][SETTING]
        assert torch.equal(sequences, expected), (sequences, expected)
        assert nfe == expected_nfe


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_fused_bfloat16(tmp_path, extra_model):
    first, second = run_fused_worker(tmp_path, "cuda", "bfloat16", extra_model, timeout=600)["llada2"]
    reference = one_process(extra_model, "cuda", torch.bfloat16)  # one GPU: the fused path too
    for result in (first, second):
        for model in FUSED_CALLS:
            assert result[model]["moe"] > 0 and result[model]["attention"] > 0, (model, result[model])
        pairs = [(result["logits"], reference["logits"])]
        pairs += [(result[m][f], reference[m][f]) for m in CACHED_STEPS for f in ("prefill", "step")]
        for ours, expected in pairs:
            assert (ours - expected).abs().max() <= 0.05 * expected.abs().max()
    # Every rank decodes the same tokens (rank 0's, broadcast each step).
    assert torch.equal(first["generated"][SETTING][0], second["generated"][SETTING][0])
