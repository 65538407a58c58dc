"""LLaDA2.2's fused Levenshtein step (`triton_levenshtein.levenshtein_step`) on CUDA: bit-identical to the PyTorch
step over many random block states (`levenshtein_states.py`: up to 8 rows, blocks of 8 to 64, the three
`max_post_steps` regimes, float32 and bfloat16 logits, LLaDA2.2's vocabulary size), one launch after
`edit_candidates`' two, no host synchronisation, and the same results replayed from a CUDA graph.
(`test_llada22_fused_step.py` runs the same comparison under Triton's interpreter on the CPU.)"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hf_dllm.levenshtein_editing import LevenshteinEditing
from tests.models.llada2.levenshtein_states import (
    DELETE,
    MASK,
    SPLIT,
    compare_anti_loop_choices,
    compare_steps,
    random_state,
)

SETTINGS = ((0, 0.7, 0.0), (2, 0.1, 0.5), (16, 0.9, 0.9), (16, 0.7, 0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, length", [(1, 32), (3, 8), (4, 64), (8, 32)])
def test_gpu_fused_step_matches_pytorch_on_random_states(rows, length):
    taken = Counter()
    for seed in range(12):
        for max_post_steps, threshold, editing_threshold in SETTINGS:
            dtype = torch.bfloat16 if seed % 2 else torch.float32
            taken.update(
                compare_steps(rows, length, max_post_steps, threshold, editing_threshold, seed, "cuda", dtype=dtype)
            )
    assert all(taken[name] > 0 for name in ("delete", "split", "anti_loop", "final_cleanup", "finished")), taken


@pytest.mark.gpu
def test_gpu_fused_step_anti_loop_choices():
    compare_anti_loop_choices("cuda")


@pytest.mark.gpu
def test_gpu_fused_step_at_llada22_vocabulary():
    """LLaDA2.2's 157,184 logits per position (the anti-loop's argmax over 154 chunks)."""
    taken = Counter()
    for seed in range(4):
        taken.update(compare_steps(1, 32, 16, 0.7, 0.5, seed, "cuda", vocab=157184, dtype=torch.bfloat16))
    assert taken["anti_loop"] > 0, taken


def fresh_state(rows: int = 2, length: int = 32):
    rule = LevenshteinEditing(0.7, 0.5, 16, MASK, DELETE, SPLIT)
    rule.start_block(length, 1)
    block, generated, logits, state = random_state(rule, rows, length, torch.Generator().manual_seed(3), "cuda")
    saved = {name: value.clone() for name, value in state.items()}
    return rule, block, generated, logits.bfloat16(), state, saved


def restore(rule, state, saved):
    for name, value in saved.items():
        state[name].copy_(value)
    rule._totals.zero_()


@pytest.mark.gpu
def test_gpu_fused_step_is_three_launches_without_host_syncs():
    from tests.generation.test_gpu import count_host_syncs

    rule, block, generated, logits, state, saved = fresh_state()
    rule.step(block, logits, generated, state)  # compiled
    restore(rule, state, saved)
    assert count_host_syncs(lambda: rule.step(block, logits, generated, state)) == 0
    restore(rule, state, saved)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        rule.step(block, logits, generated, state)
        torch.cuda.synchronize()
    kernels = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 3, kernels  # edit_candidates' two, the step's one


@pytest.mark.gpu
def test_gpu_fused_step_replays_from_a_cuda_graph():
    rule, block, generated, logits, state, saved = fresh_state()
    eager = rule.step(block, logits, generated, state)
    eager_state = {name: value.clone() for name, value in state.items()}
    eager_totals = rule._totals.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        restore(rule, state, saved)
        rule.step(block, logits, generated, state)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rule.step(block, logits, generated, state)
    for _ in range(2):  # replays read and write the same buffers
        restore(rule, state, saved)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(ours, ref) for ours, ref in zip(captured, eager, strict=True))
        assert all(torch.equal(state[name], eager_state[name]) for name in state)
        assert torch.equal(rule._totals, eager_totals)
