"""Both expert products in one launch (`grouped_gemm.fused_expert_products`): a tile's down product waits on a
counter for its gate/up columns instead of a launch boundary.

- Against the two grouped launches with the same tile shape: the same bits, gated with SiLU and GELU, few and
  several rows per expert, experts without rows; the counters back at zero after each launch, a second call the
  same bits (CPU through Triton's interpreter, the programs one by one in id order).
- On a GPU (bf16, LLaDA-MoE-7B's batch-1 shapes, the programs at once): the same bits as the two launches with the
  pinned configs, eagerly and replayed from a CUDA graph many times (a counter left non-zero would hang or corrupt
  a later replay).
- `fused_experts_apply` takes half-precision weights without FP8 scales and few pairs only.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import interpreter_job

pytest.importorskip("triton", reason="the `triton` extra is not installed")

# (tokens, experts, top-k, hidden, inner, activation, shared): `shared` a shared expert stacked as the last group
# (every token's extra row, LLaDA2's `stack_shared`).
CPU_CASES = [
    (12, 8, 2, 128, 64, "silu", False),
    (32, 16, 4, 64, 128, "gelu_tanh", False),
    (5, 4, 4, 64, 64, "silu", False),
    (9, 8, 2, 64, 64, "silu", True),
]


def case(tokens, experts, top_k, hidden, inner, dtype, device, shared=False):
    """x, the aligned pairs (rows' tokens, groups' end offsets) and the stacked weights of a random routing."""
    from hf_dllm import triton_moe

    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    topk = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)])
    sorted_token, offsets, _ = triton_moe.align_by_expert(topk, experts, shared)
    groups = experts + shared
    gate_up = (torch.randn(groups, 2 * inner, hidden, device=device) * 0.05).to(dtype)
    down = (torch.randn(groups, hidden, inner, device=device) * 0.05).to(dtype)
    return x, sorted_token, offsets, gate_up, down


def two_launches(x, sorted_token, offsets, gate_up, down, activation, config):
    from hf_dllm import grouped_gemm

    gated = grouped_gemm.grouped_matmul(
        x, offsets, gate_up, rows_of=sorted_token, gated=True, config=config, activation=activation
    )
    return grouped_gemm.grouped_matmul(gated, offsets, down, config=config)


INTERPRETER_SCRIPT = """
import torch, triton
from hf_dllm import grouped_gemm, triton_attention
from tests.kernels.test_fused_experts import CPU_CASES, case, two_launches

torch.manual_seed(0)
config = triton.Config(dict(grouped_gemm.INTERPRETER_CONFIG), num_warps=4, num_stages=2)
for tokens, experts, top_k, hidden, inner, activation, shared in CPU_CASES:
    x, sorted_token, offsets, gate_up, down = case(
        tokens, experts, top_k, hidden, inner, torch.float16, "cpu", shared)
    want = two_launches(x, sorted_token, offsets, gate_up, down, activation, config)
    got = grouped_gemm.fused_expert_products(x, offsets, sorted_token, gate_up, down, activation)
    assert torch.equal(got, want), (tokens, (got.float() - want.float()).abs().max())
    assert want.abs().sum() > 0
    counters = triton_attention._MERGE_COUNTERS[x.device][-1]
    assert int(counters.abs().sum()) == 0, "counters left non-zero"
    again = grouped_gemm.fused_expert_products(x, offsets, sorted_token, gate_up, down, activation)
    assert torch.equal(again, got), "second call"
print("fused experts checks passed")
"""

INTERPRETER_RUN = interpreter_job({"fused": INTERPRETER_SCRIPT}, timeout=300)


@INTERPRETER_RUN.used_by
def test_fused_expert_products_equal_the_two_launches_in_the_interpreter():
    done = INTERPRETER_RUN.results()["fused"]
    assert done.returncode == 0 and "fused experts checks passed" in done.stdout, done.stderr[-4000:]


def test_fused_experts_apply_to_few_half_precision_pairs_without_scales():
    from hf_dllm import grouped_gemm
    from hf_dllm.grouped_gemm import ExpertStacks

    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    stacks = ExpertStacks(torch.zeros(2, 8, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 4, dtype=torch.bfloat16))
    assert grouped_gemm.fused_experts_apply(x, 8, stacks)
    assert not grouped_gemm.fused_experts_apply(x, grouped_gemm.FUSED_MAX_PAIRS + 1, stacks)
    assert not grouped_gemm.fused_experts_apply(x.float(), 8, stacks)
    scaled = stacks._replace(gate_up_scale=torch.ones(2, 1, 1))
    assert not grouped_gemm.fused_experts_apply(x, 8, scaled)


@pytest.mark.gpu
def test_fused_expert_products_on_gpu_equal_the_two_launches_and_replay():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from hf_dllm import grouped_gemm, triton_attention

    torch.manual_seed(0)
    kwargs, warps, stages = grouped_gemm.FUSED_CONFIG
    import triton

    config = triton.Config(dict(kwargs), num_warps=warps, num_stages=stages)
    for tokens, experts, top_k in ((32, 64, 8), (9, 64, 8), (64, 64, 8)):
        x, sorted_token, offsets, gate_up, down = case(tokens, experts, top_k, 2048, 1024, torch.bfloat16, "cuda")
        want = two_launches(x, sorted_token, offsets, gate_up, down, "silu", config)
        got = grouped_gemm.fused_expert_products(x, offsets, sorted_token, gate_up, down)
        assert torch.equal(got, want), (tokens, (got.float() - want.float()).abs().max())
        graph, static = torch.cuda.CUDAGraph(), x.clone()
        with torch.cuda.graph(graph):
            replayed = grouped_gemm.fused_expert_products(static, offsets, sorted_token, gate_up, down)
        for _ in range(50):
            static.copy_(torch.randn_like(x))
            graph.replay()
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, want), "replay"
        assert int(triton_attention._MERGE_COUNTERS[x.device][-1].abs().sum()) == 0
