"""`tensor_parallel.all_reduce`'s choice between PyTorch's symmetric-memory all-reduces and the process group's
collective (hf_dllm/tensor_parallel.py): the rule on CPU and, on two GPUs, the kernels' sums against NCCL's, also
captured in a CUDA graph. (On gloo the models' all-reduces fall back to the collective: the sharded runs of
tests/generation/test_tensor_parallel_collectives.py count them as `c10d.allreduce_`.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dllm import tensor_parallel
from hf_dllm.tensor_parallel import ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES, all_reduce_algorithm

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent
KIB = 1024


@pytest.mark.parametrize(
    "nbytes,dtype,world,choice,symmetric,expected",
    [
        (64 * KIB, torch.bfloat16, 2, "auto", True, "one_shot"),  # a batch-1 block step's activations
        (ONE_SHOT_MAX_BYTES, torch.float32, 4, "auto", True, "one_shot"),
        (ONE_SHOT_MAX_BYTES + 64, torch.bfloat16, 4, "auto", True, "two_shot"),
        (TWO_SHOT_MAX_BYTES + 64, torch.bfloat16, 2, "auto", True, "collective"),  # past the buffer: NCCL
        (ONE_SHOT_MAX_BYTES + 16, torch.bfloat16, 4, "auto", True, "collective"),  # not 16-byte words per rank
        (64 * KIB, torch.bfloat16, 2, "auto", False, "collective"),  # no symmetric buffer (CPU, gloo, refused)
        (64 * KIB, torch.float16, 2, "auto", True, "collective"),  # a dtype the kernels do not take
        (64 * KIB + 8, torch.bfloat16, 2, "auto", True, "collective"),  # not whole 16-byte words
        (64 * KIB, torch.bfloat16, 1, "auto", True, "collective"),
        (64 * KIB, torch.bfloat16, 2, "nccl", True, "collective"),
        (4 * ONE_SHOT_MAX_BYTES, torch.bfloat16, 2, "one_shot", True, "one_shot"),
        (64 * KIB, torch.bfloat16, 2, "two_shot", True, "two_shot"),
        (64 * KIB, torch.bfloat16, 2, "two_shot", False, "collective"),
    ],
)
def test_all_reduce_algorithm(nbytes, dtype, world, choice, symmetric, expected):
    assert all_reduce_algorithm(nbytes, dtype, world, choice, symmetric) == expected


def test_bad_choice_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="choice must be one of"):
        all_reduce_algorithm(64, torch.float32, 2, "nvls", True)
    monkeypatch.setenv(tensor_parallel.ALL_REDUCE_ENV, "multimem")
    with pytest.raises(ValueError, match="HF_DLLM_ALL_REDUCE must be one of"):
        tensor_parallel.all_reduce_choice()


def test_no_symmetric_memory_off_cuda():
    assert not tensor_parallel.symmetric_memory_available(torch.device("cpu"))


GPU_WORKER = """
import os, torch, torch.distributed as dist
from hf_dllm import tensor_parallel
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl")
group = dist.group.WORLD
for numel in (32 * 4096, 8 * 32 * 4096, 2 ** 23):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(numel, device="cuda", generator=torch.Generator("cuda").manual_seed(rank)).to(dtype)
        expected = x.clone(); dist.all_reduce(expected)
        for choice in ("one_shot", "two_shot", "auto"):
            os.environ["HF_DLLM_ALL_REDUCE"] = choice
            got = tensor_parallel.all_reduce(x.clone(), group)
            torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
        graph, static = torch.cuda.CUDAGraph(), x.clone()
        with torch.cuda.graph(graph):
            captured = tensor_parallel.all_reduce(static, group)
        graph.replay(); torch.cuda.synchronize()
        torch.testing.assert_close(captured.float(), expected.float(), rtol=1e-2, atol=1e-2)
assert tensor_parallel._symmetric_buffers[group.group_name] is not None
print("OK", rank, flush=True)
# NCCL's shutdown waits forever while a graph holding its collectives is alive: the graph goes first.
del graph, static, captured
torch.cuda.synchronize()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_symmetric_kernels_sum_as_nccl_and_capture(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(GPU_WORKER)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
