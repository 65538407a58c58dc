"""Logits only where masks can be left (`StepMachine._logit_slots`): when the unmasking rule bounds how many
masked positions an active row can still hold (`UnmaskingPolicy.masked_bound`), a block step computes the LM head
at that many positions per row (its masked ones first) instead of the whole block. The tokens and forwards must be
exactly those of the full-block logits (float32, CPU), for every rule that bounds its masks; rules that read other
positions (token editing, Dream's) never take the path.

The path is forced here (`MIN_CANDIDATE_POSITIONS = 0`, one position of granularity) so that tiny batches take it;
the same generation with it off is the reference.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hf_dllm import LLaDA2MoeModelLM, step_machine
from hf_dllm.decoding import ConfidenceFactor, ConfidenceThreshold, FixedSchedule, ScheduledThreshold, TokenEditing
from hf_dllm.generation_utils import left_pad
from tests.conftest import FIXTURES


def record_logit_rows(model, monkeypatch) -> list[int]:
    """Positions per row of every logits tensor the loop's forward returns."""
    seen, forward = [], model._diffusion_forward

    def recording(*args, **kwargs):
        logits = forward(*args, **kwargs)
        seen.append(logits.shape[1])
        return logits

    monkeypatch.setattr(model, "_diffusion_forward", recording)
    return seen


def generate_both_ways(model, monkeypatch, input_ids, **kwargs):
    """(full-block run, candidate run): each `(output, logits positions per forward)`."""
    runs = []
    for minimum, granularity in ((10**9, 8), (0, 1)):
        monkeypatch.setattr(step_machine, "MIN_CANDIDATE_POSITIONS", minimum)
        monkeypatch.setattr(step_machine, "CANDIDATE_GRANULARITY", granularity)
        with monkeypatch.context() as patch:
            seen = record_logit_rows(model, patch)
            out = model.generate(input_ids, return_dict_in_generate=True, **kwargs)
        runs.append((out, seen))
    return runs


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad([prompt.tolist() for prompt in prompts], pad)


LLADA_SETTINGS = {
    "schedule": dict(steps=16),
    "schedule_uneven": dict(steps=12),
    "threshold": dict(threshold=0.9),
    "factor": dict(factor=0.2),
}


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("setting", list(LLADA_SETTINGS), ids=list(LLADA_SETTINGS))
def test_llada_tokens_equal_full_block_logits(reference_model, reference_expected, monkeypatch, setting, cache):
    prompts = [reference_expected["prompt.p7"][0], reference_expected["prompt.p12"][0]]
    ids, mask = left_padded(prompts, pad=0)
    kwargs = dict(
        max_new_tokens=24,
        block_length=8,
        use_cache=cache != "none",
        dual_cache=cache == "dual",
        attention_mask=mask,
        **LLADA_SETTINGS[setting],
    )
    (full, full_rows), (fast, fast_rows) = generate_both_ways(reference_model, monkeypatch, ids, **kwargs)
    assert torch.equal(fast.sequences, full.sequences)
    assert torch.equal(fast.nfe_per_row, full.nfe_per_row) and fast.nfe == full.nfe
    assert set(full_rows) == {8}
    assert sum(fast_rows) < sum(full_rows) and min(fast_rows) < 8  # the path was taken


@pytest.mark.parametrize("eos_early_stop", [False, True], ids=["no_stop", "eos_stop"])
@pytest.mark.parametrize("threshold", [None, 0.95])
@pytest.mark.parametrize("use_cache", [True, False], ids=["exact_cache", "no_cache"])
def test_llada2_tokens_equal_full_block_logits(monkeypatch, threshold, eos_early_stop, use_cache):
    model = LLaDA2MoeModelLM.from_pretrained(FIXTURES / "llada2-tiny-ref").eval()
    expected = load_file(FIXTURES / "llada2-tiny-ref" / "expected.safetensors")
    ids, mask = left_padded([expected[f"prompt.{name}"][0] for name in ("p5", "p11", "p21")], pad=301)
    kwargs = dict(
        max_new_tokens=30,
        block_length=8,
        steps=16,
        threshold=threshold,
        mask_token_id=310,
        eos_token_id=301,
        eos_early_stop=eos_early_stop,
        use_cache=use_cache,
        attention_mask=mask,
    )
    (full, _), (fast, fast_rows) = generate_both_ways(model, monkeypatch, ids, **kwargs)
    assert torch.equal(fast.sequences, full.sequences)
    assert torch.equal(fast.nfe_per_row, full.nfe_per_row) and fast.nfe == full.nfe
    assert min(fast_rows) < 8


def test_rules_that_read_other_positions_keep_full_block_logits(monkeypatch):
    """LLaDA2.1's token editing re-decodes committed positions: it needs every position's logits."""
    model = LLaDA2MoeModelLM.from_pretrained(FIXTURES / "llada21-tiny-ref").eval()
    expected = load_file(FIXTURES / "llada21-tiny-ref" / "expected.safetensors")
    prompt = expected["prompt.p11"]
    kwargs = dict(max_new_tokens=16, block_length=8, threshold=0.95, editing_threshold=0.5, mask_token_id=310)
    (full, full_rows), (fast, fast_rows) = generate_both_ways(model, monkeypatch, prompt[:1], **kwargs)
    assert torch.equal(fast.sequences, full.sequences)
    assert set(fast_rows) == set(full_rows) == {8}


def test_masked_bounds_of_the_rules():
    schedule = FixedSchedule()
    schedule.start_block(8, 3)  # commits 3, 3, 2
    assert [schedule.masked_bound(step) for step in range(4)] == [8, 5, 2, 0]
    scheduled = ScheduledThreshold(0.9)
    scheduled.start_block(8, torch.tensor([3, 8]))  # rows commit at least 3, 3, 2 / 1 per step
    assert [scheduled.masked_bound(step) for step in range(4)] == [8, 7, 6, 5]
    for rule in (ConfidenceThreshold(0.9), ConfidenceFactor(1.0)):
        rule.start_block(8, 1)
        assert [rule.masked_bound(step) for step in (0, 3, 9)] == [8, 5, 0]
    editing = TokenEditing(None, 0.5, 1, 4)
    editing.start_block(8, 8)
    assert editing.masked_bound(0) is None  # inherits the bound, not the right to use it

    class OwnConfidence(ConfidenceThreshold):  # e.g. Dream's rules: they read the block's logits
        pass

    own = OwnConfidence(0.9)
    own.start_block(8, 1)
    assert own.masked_bound(1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llada", "llada2"])
def test_gpu_graphs_with_candidates_equal_full_block_logits(family, monkeypatch, make_tiny_model):
    """On CUDA with CUDA graphs (the candidate steps are captured per size): a float32 batch of 8 x block 32 (the
    default threshold, 256 positions) gives the tokens of full-block logits, and bfloat16 graphs those of the same
    candidate steps run eagerly."""
    if family == "llada":
        model = make_tiny_model(seed=0)
        kwargs = dict(max_new_tokens=64, block_length=32, steps=64)
    else:
        from tests.models.llada2.test_llada2_integration import tiny_llada2

        model = tiny_llada2(seed=0)
        kwargs = dict(max_new_tokens=64, block_length=32, steps=64, eos_early_stop=False)
    model = model.to("cuda").eval()
    prompts = torch.randint(5, 90, (8, 40), device="cuda")
    full, fast = generate_both_ways(model, monkeypatch, prompts, **kwargs)
    monkeypatch.undo()
    assert torch.equal(fast[0].sequences, full[0].sequences)
    assert min(fast[1]) < 32
    model.to(torch.bfloat16)
    graphs = model.generate(prompts, **kwargs)
    eager = model.generate(prompts, **kwargs, disable_compile=True)
    assert torch.equal(graphs, eager)
