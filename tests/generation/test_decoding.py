"""Unmasking policies against brute force: unit tests of the rules, and every denoising step of real generate() calls
checked against the rule it claims to follow (recorded through the mixin's `_diffusion_forward`)."""

from __future__ import annotations

import pytest
import torch

from hf_dllm import (
    ConfidenceFactor,
    ConfidenceThreshold,
    FixedSchedule,
    ScheduledThreshold,
    TokenEditing,
    UnmaskingPolicy,
    plan_blocks,
)
from hf_dllm.decoding import (
    DEFERRED,
    NOT_MASKED,
    StepRules,
    commit_most_confident,
    denoise_step,
    propose_tokens,
    rank_by_confidence,
)
from tests.conftest import CACHE_MODES

MASK = 310  # reference fixture


# ----------------------------------------------------------------------------------------------------------------
# Brute-force rules
# ----------------------------------------------------------------------------------------------------------------


def brute_factor(confidences: list[float], factor: float) -> int:
    """Largest n with (n + 1) * (1 - c_n) < factor (c_n = n-th largest), at least one."""
    ordered = sorted(confidences, reverse=True)
    best = 1
    for n in range(1, len(ordered) + 1):
        if (n + 1) * (1.0 - ordered[n - 1]) < factor:
            best = n
    return best


def brute_threshold(confidences: list[float], threshold: float) -> int:
    return max(1, sum(c >= threshold for c in confidences))


def llada_schedule(length: int, steps: int) -> list[int]:
    """LLaDA's get_num_transfer_tokens for one block, steps that transfer nothing dropped."""
    counts = torch.full((steps,), length // steps, dtype=torch.long)
    counts[: length % steps] += 1
    return [int(c) for c in counts if c > 0]


def no_schedule(batch: int) -> torch.Tensor:
    """The `scheduled` argument of confidence-driven policies (they ignore it)."""
    return torch.zeros(batch, dtype=torch.long)


def random_confidences(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Mostly high confidences, so that the factor / threshold rules commit various numbers of positions.
    confidence = 1.0 - torch.rand(batch, length, generator=generator) ** 2 * torch.rand(batch, 1, generator=generator)
    masked = torch.rand(batch, length, generator=generator) < 0.7
    masked[:, 0] = True  # every row has at least one masked position
    return torch.where(masked, confidence, NOT_MASKED), masked


@pytest.mark.parametrize("factor", [0.3, 0.5, 1.0, 2.0, 4.0])
def test_factor_rule_matches_brute_force(factor):
    confidence, masked = random_confidences(400, 16, seed=int(factor * 10))
    sorted_confidence, _ = rank_by_confidence(confidence)
    counts = ConfidenceFactor(factor).num_to_commit(sorted_confidence, no_schedule(400))
    assert counts.dtype == torch.long and counts.shape == (400,)
    expected = [brute_factor(confidence[b][masked[b]].tolist(), factor) for b in range(400)]
    assert counts.tolist() == expected
    assert len(set(expected)) > 3  # the rule made various decisions


@pytest.mark.parametrize("threshold", [0.2, 0.7, 0.95, 1.0])
def test_threshold_rule_matches_brute_force(threshold):
    confidence, masked = random_confidences(400, 16, seed=int(threshold * 100))
    sorted_confidence, _ = rank_by_confidence(confidence)
    counts = ConfidenceThreshold(threshold).num_to_commit(sorted_confidence, no_schedule(400))
    expected = [brute_threshold(confidence[b][masked[b]].tolist(), threshold) for b in range(400)]
    assert counts.tolist() == expected


def test_fixed_schedule_matches_llada():
    policy = FixedSchedule()
    for length in range(1, 21):
        for steps in range(1, 26):
            policy.start_block(length, steps)
            expected = llada_schedule(length, steps)
            assert policy.steps_for_block() == len(expected)
            got = [policy.scheduled_count(step) for step in range(len(expected))]
            assert got == expected
            scheduled = torch.tensor([got[-1]] * 3)
            assert torch.equal(policy.num_to_commit(torch.zeros(3, length), scheduled), scheduled)
            assert sum(got) == length


def test_rank_by_confidence_is_a_stable_descending_sort():
    generator = torch.Generator().manual_seed(0)
    confidence = torch.randint(0, 4, (50, 9), generator=generator).float() / 4  # many ties
    confidence[confidence == 0] = NOT_MASKED
    sorted_confidence, ranks = rank_by_confidence(confidence)
    for b in range(50):
        values = confidence[b].tolist()
        order = sorted(range(9), key=lambda i: (-values[i], i))
        assert sorted_confidence[b].tolist() == [values[i] for i in order]
        assert [order.index(i) for i in range(9)] == ranks[b].tolist()


def test_commit_most_confident_commits_the_best_masked_positions():
    confidence, masked = random_confidences(100, 12, seed=3)
    _, ranks = rank_by_confidence(confidence)
    counts = torch.randint(1, 15, (100,), generator=torch.Generator().manual_seed(4))
    commit = commit_most_confident(ranks, masked, counts)
    for b in range(100):
        chosen = commit[b].nonzero().flatten().tolist()
        assert len(chosen) == min(int(counts[b]), int(masked[b].sum()))
        assert all(masked[b, i] for i in chosen)
        best = sorted(masked[b].nonzero().flatten().tolist(), key=lambda i: (-float(confidence[b, i]), i))
        assert sorted(chosen) == sorted(best[: len(chosen)])


def test_propose_tokens_greedy_confidences_and_special_ids():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 6, 20, generator=generator) * 3
    masked = torch.rand(3, 6, generator=generator) < 0.6
    x0, confidence = propose_tokens(logits, masked)
    probs = torch.softmax(logits, -1)
    assert torch.equal(x0, logits.argmax(-1))
    torch.testing.assert_close(confidence[masked], probs.max(-1).values[masked])
    assert (confidence[~masked] == NOT_MASKED).all()

    suppressed = x0.flatten()[:3].unique()
    x0_s, _ = propose_tokens(logits, masked, suppressed_token_ids=suppressed)
    assert not torch.isin(x0_s, suppressed).any()

    deferred = x0.flatten()[:2].unique()
    x0_d, conf_d = propose_tokens(logits, masked, deferred_token_ids=deferred)
    assert torch.equal(x0_d, x0)
    special = torch.isin(x0, deferred) & masked
    assert special.any()
    assert (conf_d[special] == DEFERRED).all()
    assert torch.equal(conf_d[masked & ~special], confidence[masked & ~special])

    torch.manual_seed(0)
    _, random_conf = propose_tokens(logits, masked, remasking="random")
    assert ((random_conf[masked] >= 0) & (random_conf[masked] < 1)).all()
    assert (random_conf[~masked] == NOT_MASKED).all()


def test_gumbel_sampling_follows_the_softmax_at_temperature_one():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(1, 6000, 3).clone()
    masked = torch.ones(1, 6000, dtype=torch.bool)
    torch.manual_seed(0)
    x0, _ = propose_tokens(logits, masked, temperature=1.0)
    frequencies = torch.bincount(x0.flatten(), minlength=3).float() / 6000
    torch.testing.assert_close(frequencies, probs, atol=0.03, rtol=0)
    torch.manual_seed(0)
    again, _ = propose_tokens(logits, masked, temperature=1.0)
    assert torch.equal(x0, again)


def test_denoise_step_draft_shows_candidates():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 8, 30, generator=generator) * 2
    logits[..., 29] = float("-inf")  # the mask token is never a candidate here
    block = torch.full((2, 8), 29)
    block[:, ::3] = 7  # already decoded
    policy = FixedSchedule()
    policy.start_block(8, 4)
    new_block, draft, edited = denoise_step(block, logits, StepRules(policy, mask_token_id=29), torch.tensor([2, 2]))
    assert not edited.any()  # FixedSchedule never edits a committed token
    masked = block == 29
    committed = masked & (new_block != 29)
    assert (committed.sum(-1) == 2).all()
    assert torch.equal(new_block[~masked], block[~masked])
    assert torch.equal(draft, torch.where(new_block == 29, logits.argmax(-1), new_block))
    assert not (draft == 29).any()


# ----------------------------------------------------------------------------------------------------------------
# Every step of real generate() calls
# ----------------------------------------------------------------------------------------------------------------


MAX_FORWARDS = 400


def record_steps(model, monkeypatch, suppress_mask: bool = True) -> list[dict]:
    """Record, for every forward of generate(), the block's tokens before the step and the block's logits.

    `suppress_mask` sets the mask token's logit to -inf in what the loop receives (and what is recorded): the tiny
    reference model sometimes predicts [MASK] itself, which would make generate() loop forever (see
    test_generation_terminates_when_the_model_predicts_the_mask_token); the rule checks here are about the rules.
    More than MAX_FORWARDS forwards raise instead of hanging.
    """
    calls: list[dict] = []
    original = model._diffusion_forward

    def spy(input_ids, attention_mask, position_ids, cache, cache_position, logits_slice):
        if len(calls) >= MAX_FORWARDS:
            raise RuntimeError(f"generate() made more than {MAX_FORWARDS} forwards: it does not terminate")
        logits = original(input_ids, attention_mask, position_ids, cache, cache_position, logits_slice)
        if suppress_mask:
            logits = logits.clone()
            logits[..., MASK] = float("-inf")
        positions = cache_position[logits_slice]
        calls.append(
            dict(
                block=input_ids[:, logits_slice].clone(),
                start=int(positions[0]),
                end=int(positions[-1]) + 1,
                logits=logits.float().clone(),
            )
        )
        return logits

    monkeypatch.setattr(model, "_diffusion_forward", spy)
    return calls


def steps_of(calls: list[dict], sequences: torch.Tensor):
    """Yield (block start, step index within block, tokens before, tokens after, logits) for every step."""
    step = 0
    for k, call in enumerate(calls):
        same_block_next = k + 1 < len(calls) and calls[k + 1]["start"] == call["start"]
        after = calls[k + 1]["block"] if same_block_next else sequences[:, call["start"] : call["end"]]
        yield call["start"], step, call["block"], after, call["logits"]
        step = step + 1 if same_block_next else 0


def check_step(before, after, logits, expected_count, special=None):
    """Greedy step checks for one row: commits `expected_count(confidences of masked)` positions, the most
    confident ones, with their argmax candidates; returns how many it committed."""
    masked = before == MASK
    if not masked.any():
        assert torch.equal(after, before)
        return 0
    probs = torch.softmax(logits, -1)
    confidence, candidate = probs.max(-1)
    committed = masked & (after != MASK)
    assert torch.equal(after[~committed], before[~committed])
    assert torch.equal(after[committed], candidate[committed])
    n = int(committed.sum())
    assert n == min(expected_count(confidence[masked].tolist()), int(masked.sum()))
    if special is None and (masked & ~committed).any():
        assert confidence[committed].min() >= confidence[masked & ~committed].max() - 1e-6
    return n


@pytest.mark.parametrize(
    "policy",
    [dict(steps=6), dict(steps=16), dict(threshold=0.7), dict(factor=1.0), dict(factor=2.5)],
    ids=["steps6", "steps16", "threshold0.7", "factor1", "factor2.5"],
)
@pytest.mark.parametrize("cache", list(CACHE_MODES))
def test_every_step_follows_its_rule(reference_model, monkeypatch, cache, policy):
    prompts = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(7))
    calls = record_steps(reference_model, monkeypatch)
    out = reference_model.generate(
        prompts,
        max_new_tokens=20,
        block_length=8,
        eos_early_stop=False,
        return_dict_in_generate=True,
        **CACHE_MODES[cache],
        **policy,
    )
    assert out.nfe == len(calls)
    plan = {7 + offset: (length, steps) for offset, length, steps in plan_blocks(20, 8, policy.get("steps"))}
    counts = []
    for start, step, before, after, logits in steps_of(calls, out.sequences):
        if "threshold" in policy:
            rule = lambda c: brute_threshold(c, policy["threshold"])  # noqa: E731
        elif "factor" in policy:
            rule = lambda c: brute_factor(c, policy["factor"])  # noqa: E731
        else:
            scheduled = llada_schedule(*plan[start])[step]
            rule = lambda c, s=scheduled: s  # noqa: E731
        for row in range(2):
            counts.append(check_step(before[row], after[row], logits[row], rule))
    assert not (out.sequences == MASK).any()
    if "steps" not in policy:
        assert max(counts) > 1, "the rule never committed more than one position"
        assert out.nfe < 20


def test_confidence_eos_eot_inf_commits_eos_and_eot_last(reference_model, monkeypatch):
    prompt = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(8))
    kwargs = dict(
        max_new_tokens=16, block_length=8, steps=16, use_cache=False, eos_early_stop=False, return_dict_in_generate=True
    )
    free = reference_model.generate(prompt, **kwargs).sequences[0, 6:]
    values, frequency = free.unique(return_counts=True)
    eos, eot = (int(v) for v in values[frequency.argsort(descending=True)[:2]])
    special = torch.tensor([eos, eot])

    def violations(flag: bool) -> tuple[int, int]:
        calls = record_steps(reference_model, monkeypatch)
        out = reference_model.generate(
            prompt, eos_token_id=eos, eot_token_id=eot, confidence_eos_eot_inf=flag, **kwargs
        )
        bad = special_commits = 0
        for _, _, before, after, logits in steps_of(calls, out.sequences):
            masked = before[0] == MASK
            committed = masked & (after[0] != MASK)
            candidate = logits[0].argmax(-1)
            is_special = torch.isin(candidate, special)
            special_commits += int((committed & is_special).sum())
            # A special candidate committed while an ordinary candidate stays masked.
            if (committed & is_special).any() and (masked & ~committed & ~is_special).any():
                bad += 1
            assert int(committed.sum()) == 1  # the schedule is kept: one token per step
        monkeypatch.undo()
        return bad, special_commits

    bad_with_flag, special_with_flag = violations(True)
    bad_without, _ = violations(False)
    assert bad_with_flag == 0
    assert special_with_flag > 0  # specials do get committed, last
    assert bad_without > 0  # without the option, the order differs: the test is not vacuous


def test_random_remasking_keeps_the_schedule_but_not_the_confidence_order(reference_model, monkeypatch):
    prompt = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(9))
    out_of_order = 0
    for seed in range(3):
        calls = record_steps(reference_model, monkeypatch)
        torch.manual_seed(seed)
        out = reference_model.generate(
            prompt,
            max_new_tokens=16,
            block_length=8,
            steps=8,
            remasking="random",
            use_cache=False,
            eos_early_stop=False,
        )
        for _, _, before, after, logits in steps_of(calls, out):
            masked = before[0] == MASK
            committed = masked & (after[0] != MASK)
            assert int(committed.sum()) == 2  # 8 positions over 4 steps
            assert torch.equal(after[0][committed], logits[0].argmax(-1)[committed])
            confidence = torch.softmax(logits[0], -1).max(-1).values
            remaining = masked & ~committed
            if remaining.any() and confidence[committed].min() < confidence[remaining].max():
                out_of_order += 1
        monkeypatch.undo()
    assert out_of_order > 0


@pytest.mark.parametrize(
    "policy", [dict(steps=8), dict(threshold=0.9), dict(factor=1.0)], ids=["steps", "threshold", "factor"]
)
def test_generation_terminates_when_the_model_predicts_the_mask_token(reference_model, monkeypatch, policy):
    """[MASK] is not a token to generate. If the model's best candidate at a position is [MASK] itself, committing
    it leaves the position masked: the output must still hold no [MASK] and confidence-driven policies (which run
    until the block has no mask) must terminate."""
    original = reference_model._diffusion_forward
    forwards = []

    def mask_loving(input_ids, attention_mask, position_ids, cache, cache_position, logits_slice):
        if len(forwards) >= MAX_FORWARDS:
            raise RuntimeError(f"generate() made more than {MAX_FORWARDS} forwards: it does not terminate")
        forwards.append(1)
        logits = original(input_ids, attention_mask, position_ids, cache, cache_position, logits_slice).clone()
        logits[:, -1, MASK] = logits[:, -1].max(-1).values + 5.0  # the last block position prefers [MASK]
        return logits

    monkeypatch.setattr(reference_model, "_diffusion_forward", mask_loving)
    prompt = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(11))
    out = reference_model.generate(
        prompt, max_new_tokens=16, block_length=8, use_cache=False, eos_early_stop=False, **policy
    )
    assert out.shape == (1, 22)
    assert not (out[:, 6:] == MASK).any()


def test_graph_key_names_the_captured_step_and_is_never_inherited():
    """The loop captures a policy's step in a CUDA graph only when its own class says the step is capturable; the
    key carries the constants the graph bakes in, so policies with other constants never share a graph."""
    assert FixedSchedule().graph_key() == ("FixedSchedule",)
    assert ConfidenceThreshold(0.9).graph_key() == ("ConfidenceThreshold", 0.9)
    assert ConfidenceThreshold(0.9).graph_key() != ConfidenceThreshold(0.8).graph_key()
    assert ConfidenceFactor(1.0).graph_key() == ("ConfidenceFactor", 1.0)
    assert ScheduledThreshold(0.95).graph_key() == ("ScheduledThreshold", 0.95)
    assert TokenEditing(0.5, 0.9, 1, 16).graph_key() == ("TokenEditing", 0.5, 0.9)

    class StricterThreshold(ConfidenceThreshold):
        def num_to_commit(self, sorted_confidence, scheduled):
            return (sorted_confidence > self.threshold).sum(-1).clamp(min=1)

    assert StricterThreshold(0.9).graph_key() is None  # runs eagerly until it says otherwise
    assert UnmaskingPolicy().graph_key() is None
