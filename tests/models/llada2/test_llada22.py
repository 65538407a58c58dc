"""LLaDA2.2's Levenshtein editing (DELETE / SPLIT), exact against SGLang's `JointThresholdInDel`.

Fixtures: `tests/fixtures/llada22-tiny-ref` (README-reference.md, section `llada22-tiny-ref/`): a tiny `llada2_moe`
checkpoint whose config has `delete_token_id` / `split_token_id`, and 427 cases recorded from SGLang's own step.
`case.<name>` is the generated tokens cut after the first EOS; `nfe` counts SGLang's forwards, `persist_forwards` of
which only re-ran a finished block for its KV cache (the exact cache here recomputes it with the next block's first
forward instead, so this loop makes exactly `nfe - persist_forwards`).

Also: SGLang's unit test `TestJointThresholdInDel*` (test/registered/.../test_joint_threshold_indel.py), ported to
`LevenshteinEditing.step` on hand-made logits.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_dllm  # noqa: F401  (registers llada2_moe)
from hf_dllm import DiffusionGenerationConfig, LLaDA2MoeConfig, left_pad
from hf_dllm.block_loop import decoding_policies
from hf_dllm.decoding import ScheduledThreshold, TokenEditing
from hf_dllm.family import family_for_config
from hf_dllm.levenshtein_editing import LevenshteinEditing, apply_edit_operations
from tests.conftest import FIXTURES, reference_fixtures
from tests.models.llada2.test_llada2_integration import Recorder

LLADA22 = FIXTURES / "llada22-tiny-ref"
META = json.loads((LLADA22 / "cases.json").read_text())
CASES = META["cases"]
MASK, EOS = META["mask_token_id"], META["eos_token_id"]
DELETE, SPLIT = META["delete_token_id"], META["split_token_id"]
PROMPTS = ("p5", "p11", "p16", "p21")


model, expected = reference_fixtures(LLADA22, AutoModelForCausalLM)


def generate_kwargs(case: dict, **extra) -> dict:
    """The case's SGLang settings in hf_dllm terms."""
    ref = case["kwargs"]
    kwargs = dict(
        max_new_tokens=ref["max_new_tokens"],
        block_length=ref["block_size"],
        threshold=ref["threshold"],
        editing_threshold=ref["edit_threshold"],
        max_post_steps=ref["max_post_edit_steps"],
        eos_early_stop=True,
        temperature=0.0,
        eos_token_id=EOS,
        mask_token_id=MASK,
        return_dict_in_generate=True,
    )
    kwargs.update(extra)
    return kwargs


def assert_case(generated: torch.Tensor, nfe: int, case: dict, expected: dict) -> None:
    """`generated` `(max_new_tokens,)`: SGLang's tokens cut after the first EOS, EOS-filled after it; no MASK, DELETE
    or SPLIT anywhere; forwards: SGLang's without its persist forwards."""
    want = expected[f"case.{case['name']}"][0]
    count = want.shape[0]
    assert generated.shape[0] == case["kwargs"]["max_new_tokens"]
    differ = int((generated[:count] != want).sum())
    assert differ == 0, f"{case['name']}: {differ} tokens differ\n{generated.tolist()}\n{want.tolist()}"
    if count < generated.shape[0]:
        assert int(want[-1]) == EOS and (generated[count:] == EOS).all(), case["name"]
    assert not torch.isin(generated, torch.tensor([MASK, DELETE, SPLIT])).any(), case["name"]
    assert nfe <= case["nfe"], case["name"]
    assert nfe == case["nfe"] - case["persist_forwards"], (case["name"], nfe, case["nfe"], case["persist_forwards"])


# ----- fixture cases, batch 1, through generate() (exact cache, the default) -----
# The cases run below in left-padded batches without a cache, where each row must give the fixture's tokens and
# forwards, and here alone with the exact cache: every case of both with HF_DLLM_ALL_CASES=1; by default the suite's
# time budget runs a pairwise subset of each (`pairwise`), plus here each case whose EOS lies before
# `max_new_tokens` in a block SGLang cut at the length.
ALL_CASES = os.environ.get("HF_DLLM_ALL_CASES") == "1"


def pairwise(items: list, kinds) -> list:
    """A subset of `items` in which every pair of values of two of `kinds(item)` (a tuple: the prompt, each
    setting, each kind of outcome) that some item has is had by a chosen item too: chosen greedily, deterministic."""

    pairs = [{(a, x, b, y) for (a, x), (b, y) in itertools.combinations(enumerate(kinds(item)), 2)} for item in items]
    missing, chosen = set().union(*pairs), []
    while missing:
        best = max(range(len(items)), key=lambda index: len(pairs[index] & missing))
        chosen.append(items[best])
        missing -= pairs[best]
    return chosen


def case_kinds(case: dict) -> tuple:
    """The case's prompt, its five settings, and its outcome: EOS or length, any DELETE, SPLIT, anti-loop."""
    settings = tuple(case["kwargs"][name] for name in ("max_new_tokens", "block_size", "threshold"))
    settings += (case["kwargs"]["edit_threshold"], case["kwargs"]["max_post_edit_steps"])
    outcome = (case["finish"], case["deletes"] > 0, case["splits"] > 0, case["anti_loop"] > 0)
    return (case["prompt"], *settings, *outcome)


_PAIRWISE = {case["name"] for case in pairwise(CASES, case_kinds)}
ALONE = [case for case in CASES if ALL_CASES or case["name"] in _PAIRWISE or case["eos_after_length"]]


@pytest.mark.parametrize("case", ALONE, ids=[case["name"] for case in ALONE])
def test_case_alone(model, expected, case):
    prompt = expected[f"prompt.{case['prompt']}"]
    out = model.generate(prompt, **generate_kwargs(case))
    assert torch.equal(out.sequences[0, : prompt.shape[1]], prompt[0])
    assert_case(out.sequences[0, prompt.shape[1] :], out.nfe, case, expected)


# ----- the same cases, four prompts per left-padded batch, without a cache -----

GROUPS: dict[str, list[dict]] = defaultdict(list)
for _case in CASES:
    GROUPS[_case["name"].split(".", 1)[1]].append(_case)


def left_padded(expected, names):
    return left_pad([expected[f"prompt.{name}"][0].tolist() for name in names], EOS)


def run_group(model, expected, cases, use_cache):
    ids, mask = left_padded(expected, [case["prompt"] for case in cases])
    run = model.generate_blocks(ids, attention_mask=mask, **generate_kwargs(cases[0], use_cache=use_cache))
    for _ in run:
        pass
    assert isinstance(run.unmasking, LevenshteinEditing)
    width = ids.shape[1]
    for row, case in enumerate(cases):
        assert_case(run.sequences[row, width:], int(run.nfe_per_row[row]), case, expected)
    return run


def batched_groups() -> list[str]:
    """Every group with HF_DLLM_ALL_CASES=1; by default a pairwise subset (14 of 108): every pair of values of two
    settings (length, block, threshold, edit threshold, post steps) or kinds of outcome over the group's rows (an EOS,
    a DELETE, a SPLIT, an anti-loop re-sample) is run, each group with all four prompts: the suite's time budget."""
    if ALL_CASES:
        return list(GROUPS)

    def kinds(group: str) -> tuple:
        rows = [case_kinds(case) for case in GROUPS[group]]
        return (*rows[0][1:6], *(any(row[index] not in ("length", False) for row in rows) for index in range(6, 10)))

    chosen = set(pairwise(list(GROUPS), kinds))
    return [group for group in GROUPS if group in chosen]


BATCHED = batched_groups()


@pytest.mark.parametrize("group", BATCHED, ids=BATCHED)
def test_cases_batched_without_cache(model, expected, group):
    """Each row of a left-padded batch gets the tokens (and forwards) it gets alone, i.e. SGLang's; the DELETE /
    SPLIT tokens consumed and the anti-loop re-samples add up to SGLang's counts over the rows."""
    cases = GROUPS[group]
    run = run_group(model, expected, cases, use_cache=False)
    totals = run.unmasking.totals()
    for name in ("deletes", "splits", "anti_loop"):
        assert totals[name] == sum(case[name] for case in cases), name


# The groups with the most edits, batched with the exact cache too.
BUSY_GROUPS = sorted(GROUPS, key=lambda g: -sum(c["deletes"] + c["splits"] + c["anti_loop"] for c in GROUPS[g]))[:8]


@pytest.mark.parametrize("group", BUSY_GROUPS, ids=BUSY_GROUPS)
def test_busy_cases_batched_with_exact_cache(model, expected, group):
    run_group(model, expected, GROUPS[group], use_cache=True)


def test_fixture_counts_cover_the_rule():
    """The fixtures exercise DELETE, SPLIT, the anti-loop, EOS and every max_post_steps regime."""
    assert len(CASES) == 427
    assert sum(case["deletes"] > 0 for case in CASES) > 100 and sum(case["splits"] > 0 for case in CASES) > 100
    assert sum(case["anti_loop"] > 0 for case in CASES) > 100
    assert sum(case["finish"] == "eos" for case in CASES) > 50
    assert any(case["eos_after_length"] for case in CASES)
    assert {case["kwargs"]["max_post_edit_steps"] for case in CASES} == {0, 2, 16}
    assert {case["kwargs"]["edit_threshold"] for case in CASES} == {0.0, 0.5, 0.9}


# ----- cache: a finished block's K/V are those of its final tokens -----


def busiest(predicate=lambda case: True):
    return max(
        (case for case in CASES if predicate(case)), key=lambda case: case["deletes"] + case["splits"] + case["nfe"]
    )


def test_exact_cache_keeps_final_tokens_kv(model, expected):
    """With `use_cache=True`, the last K/V written at every column of every block that a later block attends came
    from that column's final token (SGLang's persist forward, step 14, done by the next block's first forward), and
    tokens equal `use_cache=False`'s."""
    case = busiest(lambda c: c["finish"] == "length" and c["kwargs"]["block_size"] == 8 and c["splits"] > 0)
    prompt = expected[f"prompt.{case['prompt']}"]
    fed: dict[int, int] = {}
    forward = model._diffusion_forward

    def spy(tokens, attention_mask, positions, cache, cache_position, logits_index, **kwargs):
        for column, token in zip(cache_position.tolist(), tokens[0].tolist(), strict=True):
            fed[column] = token
        return forward(tokens, attention_mask, positions, cache, cache_position, logits_index, **kwargs)

    model._diffusion_forward = spy
    try:
        cached = model.generate(prompt, **generate_kwargs(case, use_cache=True))
    finally:
        del model._diffusion_forward
    uncached = model.generate(prompt, **generate_kwargs(case, use_cache=False))
    assert torch.equal(cached.sequences, uncached.sequences)
    assert cached.nfe == uncached.nfe == case["nfe"] - case["persist_forwards"]
    block = case["kwargs"]["block_size"]
    sequence = cached.sequences[0].tolist()
    last_block_start = (len(sequence) - 1) // block * block
    assert last_block_start > block
    for column in range(last_block_start):
        assert fed[column] == sequence[column], column


# ----- settings -----


def test_editing_threshold_zero_is_accepted():
    config = DiffusionGenerationConfig(editing_threshold=0.0)
    config.validate()
    assert config.editing_threshold == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="editing_threshold"):
            DiffusionGenerationConfig(editing_threshold=bad).validate()


def test_model_with_edit_tokens_uses_levenshtein_editing_by_default(model, expected):
    """Without `editing_threshold`, a checkpoint with DELETE / SPLIT ids still decodes with LLaDA2.2's rule
    (SGLang's default `edit_threshold` 0.0): LLaDA2.0's rules would emit DELETE / SPLIT as text."""
    config = model.resolve_generation_config(mask_token_id=MASK, eos_token_id=EOS, threshold=0.7)
    _, unmasking = decoding_policies(model, config)
    assert isinstance(unmasking, LevenshteinEditing)
    assert (unmasking.editing_threshold, unmasking.max_post_steps) == (0.0, 16)
    for prompt in PROMPTS:
        ids = expected[f"prompt.{prompt}"]
        common = dict(max_new_tokens=32, block_length=8, threshold=0.7, mask_token_id=MASK, eos_token_id=EOS)
        default = model.generate(ids, **common)
        explicit = model.generate(ids, editing_threshold=0.0, max_post_steps=16, **common)
        assert torch.equal(default, explicit)
        assert not torch.isin(default, torch.tensor([MASK, DELETE, SPLIT])).any()
    # Matches the fixture case with those settings.
    case = next(c for c in CASES if c["name"] == "p11.g32.b8.t0.7.e0.0.p16")
    out = model.generate(expected["prompt.p11"], **generate_kwargs(case, editing_threshold=None, max_post_steps=16))
    assert_case(out.sequences[0, 11:], out.nfe, case, expected)


def test_model_without_edit_tokens_keeps_llada2_rules():
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llada2-tiny-ref").eval()
    assert getattr(model.config, "delete_token_id", None) is None
    plain = model.resolve_generation_config(mask_token_id=MASK, threshold=0.7)
    assert levenshtein_policy(model.config, plain) is None
    assert type(decoding_policies(model, plain)[1]) is ScheduledThreshold
    editing = model.resolve_generation_config(mask_token_id=MASK, threshold=0.7, editing_threshold=0.5)
    assert type(decoding_policies(model, editing)[1]) is TokenEditing


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(steps=8), "steps"),
        (dict(temperature=0.7), "temperature"),
        (dict(logits_eos_inf=True), "logits_eos_inf"),
        (dict(editing_threshold=0.5, num_to_transfer=2), "num_to_transfer"),
        (dict(mask_token_id=DELETE), "mask_token_id"),
    ],
)
def test_settings_the_rule_cannot_honour_raise(model, kwargs, name, monkeypatch):
    def no_forward(*args, **kw):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(model, "_diffusion_forward", no_forward)
    settings = dict(mask_token_id=MASK, eos_token_id=EOS, max_new_tokens=16, block_length=8) | kwargs
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        model.generate(torch.tensor([[5, 6, 7]]), **settings)


def test_user_policy_replaces_the_family_rule(model, expected):
    """`unmasking_policy=` wins over the config's edit tokens (then DELETE / SPLIT are plain ids)."""
    ids = expected["prompt.p11"]
    out = model.generate(
        ids, max_new_tokens=16, block_length=8, mask_token_id=MASK, unmasking_policy=ScheduledThreshold(0.7)
    )
    assert out.shape == (1, 27)


# ----- EOS and streaming -----


def test_eos_never_stops_a_block_early_and_cuts_the_output(model, expected):
    """Cases that finish at EOS: same tokens and forwards with `eos_early_stop=False` (a row ends after the block
    holding its first EOS either way; the block itself runs to the end, edits included), output EOS-filled after
    the first EOS, also where SGLang returns tokens past it (`eos_after_length`)."""
    eos_cases = [case for case in CASES if case["finish"] == "eos"]
    chosen = [case for case in eos_cases if case["eos_after_length"]][:3] + eos_cases[:3]
    for case in chosen:
        prompt = expected[f"prompt.{case['prompt']}"]
        out = model.generate(prompt, **generate_kwargs(case, eos_early_stop=False))
        assert_case(out.sequences[0, prompt.shape[1] :], out.nfe, case, expected)
        raw = expected[f"raw.{case['name']}"][0]
        first_eos = int((raw == EOS).nonzero()[0])
        assert out.sequences[0, prompt.shape[1] + first_eos] == EOS


def test_streamer_sees_only_committed_tokens(model, expected):
    """A `TextStreamer`-style `put` gets the prompt, then committed tokens only: never MASK, DELETE or SPLIT, and
    never a token that changes later (edits happen inside the block under way, which is not streamed)."""
    for case in (busiest(lambda c: c["finish"] == "eos"), busiest(lambda c: c["finish"] == "length")):
        prompt = expected[f"prompt.{case['prompt']}"]
        streamer = Recorder()
        out = model.generate(prompt, streamer=streamer, **generate_kwargs(case))
        assert streamer.ended and torch.equal(streamer.puts[0], prompt)
        streamed = torch.cat([chunk.reshape(1, -1) for chunk in streamer.puts[1:]], dim=1)[0]
        assert not torch.isin(streamed, torch.tensor([MASK, DELETE, SPLIT])).any()
        assert torch.equal(streamed, out.sequences[0, prompt.shape[1] :])
        assert len(streamer.puts) > 2  # block by block


# ----- config ids -----


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(delete_token_id=True, split_token_id=10), "delete_token_id"),
        (dict(delete_token_id=1.5, split_token_id=10), "delete_token_id"),
        (dict(delete_token_id=-1, split_token_id=10), "delete_token_id"),
        (dict(delete_token_id=9, split_token_id=320), "split_token_id"),
        (dict(delete_token_id=9, split_token_id=9), "split_token_id"),
        (dict(delete_token_id=310, split_token_id=10, mask_token_id=310), "delete_token_id"),
        (dict(delete_token_id=9, split_token_id=310, mask_token_id=310), "split_token_id"),
        (dict(delete_token_id=9), "split_token_id"),
        (dict(split_token_id=10), "delete_token_id"),
    ],
    ids=[
        "bool",
        "float",
        "negative",
        "upper_bound",
        "same",
        "delete_is_mask",
        "split_is_mask",
        "no_split",
        "no_delete",
    ],
)
def test_bad_edit_token_ids_raise(fields, name):
    """SGLang's `test_invalid_checkpoint_edit_token_ids_are_rejected` / `..._incomplete_...`: a ValueError naming
    the field, at load time."""
    base = json.loads((LLADA22 / "config.json").read_text())
    for key in ("delete_token_id", "split_token_id"):
        base.pop(key)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        LLaDA2MoeConfig(**{**base, **fields})


def test_edit_token_ids_round_trip(tmp_path):
    config = LLaDA2MoeConfig.from_pretrained(LLADA22)
    assert (config.delete_token_id, config.split_token_id) == (DELETE, SPLIT)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["delete_token_id"], saved["split_token_id"]) == (DELETE, SPLIT)
    plain = LLaDA2MoeConfig.from_pretrained(FIXTURES / "llada2-tiny-ref")
    assert plain.delete_token_id is None and plain.split_token_id is None
    plain.save_pretrained(tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert saved.get("delete_token_id") is None and saved.get("split_token_id") is None
    assert LLaDA2MoeConfig.from_pretrained(tmp_path / "plain").delete_token_id is None


# ----- SGLang's TestJointThresholdInDel, on LevenshteinEditing.step -----

S_MASK, S_DELETE, S_SPLIT, VOCAB = 0, 1, 2, 12


def policy(threshold=0.5, edit_threshold=0.0, max_post_steps=2):
    return LevenshteinEditing(threshold, edit_threshold, max_post_steps, S_MASK, S_DELETE, S_SPLIT)


def prompt_mask(block: torch.Tensor) -> torch.Tensor:
    """SGLang's fallback prompt: the block's leading non-MASK run (its tests pass no explicit prompt mask)."""
    prompt_lens = (block != S_MASK).cumprod(dim=1).sum(dim=1)
    return torch.arange(block.shape[1]).unsqueeze(0) < prompt_lens.unsqueeze(1)


def start(rule: LevenshteinEditing, blocks):
    block = torch.tensor(blocks)
    generated = ~prompt_mask(block)
    state = rule.init_state(block, generated)
    return block, generated, state


def make_logits(rows, vocab_size=VOCAB):
    """Logits from rows of token ids ordered from most to least likely (SGLang's helper), batched `(1, B, V)`."""
    logits = torch.full((len(rows), vocab_size), -20.0)
    for row_index, candidates in enumerate(rows):
        for rank, token_id in enumerate(candidates):
            logits[row_index, token_id] = 10.0 - rank
    return logits.unsqueeze(0)


def step(rule, block, generated, state, logits):
    """One step; returns the new block and SGLang's `done` (no further forward: finished, and nothing changed that a
    persist forward would have to write)."""
    new, _, changed = rule.step(block, logits, generated, state)
    return new, (state["finished"] & ~changed).tolist()


def history(state, row, index):
    return {token for token in state["hist"][row, index].tolist() if token >= 0}


def test_sglang_initial_state_and_step_limits():
    rule = policy(max_post_steps=3)
    block, generated, state = start(rule, [[3, 4, S_MASK, S_MASK, S_MASK, S_MASK]])
    assert generated.tolist() == [[False, False, True, True, True, True]]
    assert state["orig"].tolist() == [[False, False, True, True, True, True]]
    assert int(state["updates"][0]) == 0
    assert rule.max_regular_updates(6) == 9
    assert rule.max_updates(6) == 11


def test_sglang_prompt_is_the_contiguous_prefix_not_every_initial_non_mask():
    block, generated, state = start(policy(), [[3, S_MASK, 4, S_MASK, S_MASK]])
    assert generated.tolist() == [[False, True, True, True, True]]
    assert state["orig"].tolist() == [[False, True, False, True, True]]


@pytest.mark.parametrize("value", [-34, 1.5, True])
def test_sglang_invalid_max_post_edit_steps_is_rejected(value):
    with pytest.raises(ValueError, match="max_post_steps must be a non-negative integer"):
        policy(max_post_steps=value)
    with pytest.raises(ValueError, match="max_post_steps"):
        DiffusionGenerationConfig(max_post_steps=value, editing_threshold=0.5).validate()


def test_sglang_missing_edit_token_ids():
    """SGLang refuses the algorithm without edit ids; here a config without them simply keeps LLaDA2's rules, and
    the rule itself refuses to be built without them."""
    generation = DiffusionGenerationConfig(mask_token_id=S_MASK)
    assert levenshtein_policy(LLaDA2MoeConfig(vocab_size=320), generation) is None
    with pytest.raises(ValueError, match="delete_token_id"):
        LevenshteinEditing(0.5, 0.0, 2, S_MASK, None, S_SPLIT)


def test_sglang_checkpoint_metadata_enables_indel():
    config = LLaDA2MoeConfig(vocab_size=320, delete_token_id=9, split_token_id=10)
    rule = levenshtein_policy(config, DiffusionGenerationConfig(mask_token_id=S_MASK))
    assert isinstance(rule, LevenshteinEditing)
    assert (rule.delete_token_id, rule.split_token_id, rule.mask_token_id) == (9, 10, S_MASK)


def levenshtein_policy(model_config, generation):
    """The rule the model config's family decodes `generation` with, if it is LLaDA2.2's (else None)."""
    family = family_for_config(model_config)
    family.validate(generation)
    rule = family.unmasking_policy(generation, model_config)
    return rule if isinstance(rule, LevenshteinEditing) else None


def edits(new, old, orig, prompt_len):
    length = len(new)
    generated = torch.arange(length).unsqueeze(0) >= prompt_len
    tokens, flags = apply_edit_operations(
        torch.tensor([new]), torch.tensor([old]), torch.tensor([orig]), generated, S_MASK, S_DELETE, S_SPLIT
    )
    return tokens[0].tolist(), flags[0].tolist()


def test_sglang_mixed_edits_preserve_prompt_and_original_mask_flags():
    old = [S_DELETE, S_SPLIT, 3, 4, 5, 6, S_MASK, S_MASK]
    new = [S_DELETE, S_SPLIT, 3, S_DELETE, S_SPLIT, 6, S_MASK, S_MASK]
    orig = [False, False, True, False, True, False, False, False]
    tokens, flags = edits(new, old, orig, 2)
    assert tokens == [S_DELETE, S_SPLIT, 3, S_MASK, 5, 6, S_MASK, S_MASK]
    assert flags == [False, False, True, False, True, False, False, False]


def test_sglang_delete_pads_only_the_generated_suffix():
    old = [S_DELETE, S_SPLIT, 3, 4, 5, 6]
    new = [S_DELETE, S_SPLIT, S_DELETE, S_DELETE, S_DELETE, S_DELETE]
    tokens, flags = edits(new, old, [False] * 6, 2)
    assert tokens == [S_DELETE, S_SPLIT, S_MASK, S_MASK, S_MASK, S_MASK]
    assert flags == [False] * 6


def test_sglang_split_truncates_only_the_generated_suffix():
    old = [S_DELETE, S_SPLIT, 3, 4, 5, 6]
    new = [S_DELETE, S_SPLIT, S_SPLIT, S_SPLIT, S_SPLIT, S_SPLIT]
    tokens, flags = edits(new, old, [False, False, True, False, True, False], 2)
    assert tokens == [S_DELETE, S_SPLIT, S_MASK, 3, S_MASK, 4]
    assert flags == [False, False, False, True, False, False]


def test_sglang_step_never_interprets_reserved_prompt_tokens_as_edits():
    rule = policy()
    block, generated, state = start(rule, [[S_DELETE, S_SPLIT, S_MASK, S_MASK, S_MASK]])
    logits = make_logits([[5, S_DELETE], [6, S_SPLIT], [S_DELETE, 7], [8], [9]])
    new, _ = step(rule, block, generated, state, logits)
    assert new[0, :2].tolist() == [S_DELETE, S_SPLIT]
    assert generated.tolist() == [[False, False, True, True, True]]


def test_sglang_split_and_delete_move_original_mask_flags_in_step():
    rule = policy()
    block, generated, state = start(rule, [[3, S_MASK, S_MASK, S_MASK, S_MASK]])
    logits = make_logits([[3], [S_SPLIT, 5], [S_DELETE, 6], [7], [8]])
    new, _ = step(rule, block, generated, state, logits)
    assert new.tolist() == [[3, S_MASK, S_MASK, 7, 8]]
    assert state["orig"].tolist() == [[False, False, True, True, True]]


def test_sglang_original_mask_to_mask_uses_non_mask_fallback():
    rule = policy(threshold=1.1)
    block, generated, state = start(rule, [[3, S_MASK, 4]])
    new, done = step(rule, block, generated, state, make_logits([[3], [S_MASK, 5], [4]]))
    assert done == [False]
    assert new.tolist() == [[3, 5, 4]]


def test_sglang_fallback_confidence_is_recomputed_for_threshold_selection():
    rule = policy(threshold=0.6)
    block, generated, state = start(rule, [[3, S_MASK, S_MASK, 4]])
    logits = torch.zeros((1, 4, VOCAB))
    logits[0, 0, 3] = 10
    logits[0, 1, S_MASK] = 10
    logits[0, 1, 5] = 0
    logits[0, 2, 6] = 4
    logits[0, 3, 4] = 10
    new, _ = step(rule, block, generated, state, logits)
    assert new.tolist() == [[3, S_MASK, 6, 4]]


def test_sglang_introduced_mask_quota_selects_an_unresolved_original_mask():
    rule = policy(threshold=1.1)
    block, generated, state = start(rule, [[3, S_MASK, S_MASK, S_MASK, S_MASK]])
    state["orig"].copy_(torch.tensor([[False, True, True, False, False]]))
    logits = torch.zeros((1, 5, VOCAB))
    logits[0, 0, 3] = 10
    for position, score in zip([3, 4, 1, 2], [9, 8, 7, 6], strict=True):
        logits[0, position, position + 4] = score
    new, _ = step(rule, block, generated, state, logits)
    assert new.tolist() == [[3, 5, S_MASK, 7, 8]]


def test_sglang_split_can_preserve_one_unresolved_original_mask():
    rule = policy(threshold=1.1)
    block, generated, state = start(rule, [[3, S_MASK, 4, 4]])
    unresolved_before = int((state["orig"] & (block == S_MASK)).sum())
    new, done = step(rule, block, generated, state, make_logits([[3], [S_SPLIT, 5], [4], [4]]))
    assert done == [False]
    assert new.tolist() == [[3, S_MASK, S_MASK, 4]]
    assert state["orig"].tolist() == [[False, False, True, False]]
    assert unresolved_before == 1 and int((state["orig"] & (new == S_MASK)).sum()) == 1
    assert int(state["updates"][0]) == 1
    assert not bool(state["finished"][0])


def test_sglang_ordinary_introduced_mask_to_mask_can_wait_for_final_cleanup():
    rule = policy(max_post_steps=2)
    block, generated, state = start(rule, [[3, S_MASK, S_MASK, S_MASK]])
    state["orig"].zero_()
    new, done = step(rule, block, generated, state, make_logits([[3], [S_MASK, 5], [S_MASK, 6], [S_MASK, 7]]))
    assert done == [False]
    assert new.tolist() == [[3, S_MASK, S_MASK, S_MASK]]
    assert int(state["post"][0]) == 1


def test_sglang_ordinary_round_fills_all_introduced_masks_with_token_predictions():
    rule = policy()
    block, generated, state = start(rule, [[3, S_MASK, S_MASK, S_MASK]])
    state["orig"].zero_()
    new, _ = step(rule, block, generated, state, make_logits([[3], [5], [6], [7]]))
    assert new.tolist() == [[3, 5, 6, 7]]


def test_sglang_t2t_respects_prompt_and_edit_threshold():
    rule = policy(edit_threshold=0.9)
    block, generated, state = start(rule, [[3, S_MASK, 4, S_MASK]])
    logits = torch.zeros((1, 4, VOCAB))
    logits[0, 0, 5] = 10
    logits[0, 1, 7] = 10
    logits[0, 2, 6] = 0.1
    logits[0, 3, 8] = 10
    new, _ = step(rule, block, generated, state, logits)
    assert new.tolist() == [[3, 7, 4, 8]]


def test_sglang_t2t_edits_confident_generated_token():
    rule = policy(edit_threshold=0.9)
    block, generated, state = start(rule, [[3, S_MASK, 4, S_MASK]])
    new, _ = step(rule, block, generated, state, make_logits([[5], [7], [6], [8]]))
    assert new.tolist() == [[3, 7, 6, 8]]


def test_sglang_budget_one_final_cleanup_scrubs_all_reserved_tokens():
    rule = policy(max_post_steps=1)
    block, generated, state = start(rule, [[3, S_MASK, S_MASK, 4]])
    state["orig"].zero_()
    logits = make_logits([[S_DELETE, 8], [S_MASK, 5], [S_DELETE, 6], [S_SPLIT, 7]])
    new, done = step(rule, block, generated, state, logits)
    assert done == [False]  # SGLang's persist forward follows; this loop's next block recomputes the K/V
    assert new.tolist() == [[3, 5, 6, 7]]
    assert bool(state["finished"][0])
    assert not torch.isin(new[0, 1:], torch.tensor([S_MASK, S_DELETE, S_SPLIT])).any()
    again, done = step(rule, new, generated, state, make_logits([[3], [5], [6], [7]]))
    assert done == [True]
    assert torch.equal(again, new)


def test_sglang_hard_limit_final_cleanup_resolves_all_mask_tokens():
    rule = policy(max_post_steps=2)
    block, generated, state = start(rule, [[3, S_MASK, S_MASK]])
    state["updates"].fill_(rule.max_regular_updates(3))
    logits = torch.zeros((1, 3, VOCAB))
    logits[0, 0, 3] = 1.0
    logits[0, 1, S_MASK] = 0.3
    logits[0, 1, S_SPLIT] = 0.2
    logits[0, 1, 5] = 0.1
    logits[0, 2, S_MASK] = 0.4
    logits[0, 2, S_DELETE] = 0.3
    logits[0, 2, 6] = 0.2
    assert (logits[0, 1:].softmax(-1).max(-1).values < rule.threshold).all()
    new, done = step(rule, block, generated, state, logits)
    assert int(state["updates"][0]) == rule.max_regular_updates(3) + 1
    assert done == [False]
    assert new.tolist() == [[3, 5, 6]]
    assert bool(state["finished"][0])


def test_sglang_stable_terminal_step_finishes_immediately():
    rule = policy()
    block, generated, state = start(rule, [[3, 4, 5]])
    _, done = step(rule, block, generated, state, make_logits([[3], [4], [5]]))
    assert done == [True]
    assert bool(state["finished"][0])


def test_sglang_batch_requests_finish_independently():
    rule = policy(max_post_steps=0)
    block, generated, state = start(rule, [[3, 4, 5], [3, S_MASK, 4]])
    state["orig"][1] = False
    logits = torch.cat([make_logits([[3], [4], [5]]), make_logits([[3], [S_MASK, 6], [4]])])
    new, done = step(rule, block, generated, state, logits)
    assert done == [True, False]
    assert state["finished"].tolist() == [True, True]
    assert new[1].tolist() == [3, 6, 4]


def test_sglang_fdfo_budget_zero_cleans_up_while_resolving_last_original_mask():
    """SGLang's first-done-first-out scheduling test, as steps: the row without masks is done at once; the other's
    first step fills its last original mask and is the final cleanup (SPLIT / DELETE scrubbed); a further step
    changes nothing."""
    rule = policy(max_post_steps=0)
    block, generated, state = start(rule, [[3, 4, 5], [3, S_MASK, 4]])
    logits = torch.cat([make_logits([[3], [4], [5]]), make_logits([[3], [S_SPLIT, 6], [S_DELETE, 7]])])
    new, done = step(rule, block, generated, state, logits)
    assert done == [True, False]
    assert new[1].tolist() == [3, 6, 7]
    assert int(state["updates"][1]) == 1 and int(state["post"][1]) == 0
    assert bool(state["finished"][1])
    again, done = step(
        rule, new, generated, state, torch.cat([make_logits([[3], [4], [5]]), make_logits([[3], [6], [7]])])
    )
    assert done == [True, True]
    assert torch.equal(again, new)


def test_sglang_fdfo_budget_one_uses_first_post_edit_round_for_cleanup():
    rule = policy(max_post_steps=1)
    block, generated, state = start(rule, [[3, S_MASK, 4]])
    new, done = step(rule, block, generated, state, make_logits([[3], [6], [4]]))
    assert done == [False] and new.tolist() == [[3, 6, 4]]
    assert int(state["post"][0]) == 0 and not bool(state["finished"][0])
    new, done = step(rule, new, generated, state, make_logits([[3], [S_DELETE, 7], [S_SPLIT, 8]]))
    assert done == [False] and new.tolist() == [[3, 7, 8]]
    assert int(state["post"][0]) == 1 and bool(state["finished"][0])
    again, done = step(rule, new, generated, state, make_logits([[3], [7], [8]]))
    assert done == [True] and torch.equal(again, new)


def test_sglang_repeated_original_mask_state_never_resamples_mask():
    rule = policy(threshold=1.1)
    block, generated, state = start(rule, [[3, S_MASK, 4]])
    state["seen"][0, 0] = block[0]  # (3, MASK, 4) was seen before
    state["seen_count"][0] = 1
    state["hist"][0, 1, -1] = 5  # 5 was written at index 1 before
    new, _ = step(rule, block, generated, state, make_logits([[3], [5, S_MASK, 6], [4]]))
    assert new.tolist() == [[3, 6, 4]]
    assert history(state, 0, 1) == {5, 6}


def test_step_is_free_of_host_synchronisation():
    """The step reads no tensor value on the host (CUDA-graph capturable): it runs under a tensor subclass check
    that fails on `.item()`, `.tolist()` and `bool()`."""
    rule = policy(max_post_steps=1)
    block, generated, state = start(rule, [[3, S_MASK, S_MASK, 4], [3, 4, S_MASK, S_MASK]])
    logits = torch.cat(
        [make_logits([[S_DELETE, 8], [S_MASK, 5], [S_SPLIT, 6], [S_SPLIT, 7]]), make_logits([[3], [4], [S_SPLIT], [9]])]
    )

    class NoSync(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
                raise AssertionError(f"host synchronisation: {name}")
            return super().__torch_function__(func, types, args, kwargs or {})

    guarded = {name: value.as_subclass(NoSync) for name, value in state.items()}
    new, _, _ = rule.step(block.as_subclass(NoSync), logits.as_subclass(NoSync), generated.as_subclass(NoSync), guarded)
    assert new.shape == block.shape


@pytest.mark.gpu
def test_cuda_graphs_match_eager_and_fixtures(expected):
    """On CUDA the step is captured as a CUDA graph (its state buffers are the runner's, so graphs replayed by a
    later call read live memory): the busiest cases, three calls each, give SGLang's tokens and forwards, as the
    eager step does. (Checked on an H200 for all 427 cases alone and batched, graphs and eager.)"""
    gpu_model = AutoModelForCausalLM.from_pretrained(LLADA22).eval().cuda()
    cases = sorted(CASES, key=lambda c: -(c["deletes"] + c["splits"] + c["anti_loop"]))[:12]
    for case in cases:
        prompt = expected[f"prompt.{case['prompt']}"].cuda()
        for disable_compile in (False, False, False, True):
            out = gpu_model.generate(prompt, **generate_kwargs(case, disable_compile=disable_compile))
            assert_case(out.sequences[0, prompt.shape[1] :].cpu(), out.nfe, case, expected)
        assert gpu_model._hf_dllm_step_graphs.counts["replayed"] > 0


# ----- export: the LLaDA2.2 fields survive, and the repo decodes with Levenshtein editing as remote code -----

EXPORT_CHILD = r"""
from transformers import AutoModelForCausalLM

record("no_hf_dllm", no_hf_dllm)
model = AutoModelForCausalLM.from_pretrained(spec["repo"], trust_remote_code=True).eval()
out["model"] = describe(model)
out["tokens"] = generate_cases(model, spec["cases"])
"""


@pytest.mark.slow
def test_export_keeps_the_edit_tokens_and_decodes_as_remote_code(model, expected, tmp_path):
    from hf_dllm.hub.export import export_checkpoint
    from tests.conftest import generate_cases, run_without_hf_dllm, with_mask_id

    repo = tmp_path / "llada22-export"
    export_checkpoint(with_mask_id(FIXTURES / "llada22-tiny-ref", tmp_path / "src"), repo, tokenizer=False)
    config = json.loads((repo / "config.json").read_text())
    assert (config["delete_token_id"], config["split_token_id"]) == (DELETE, SPLIT)
    assert family_for_config(config).name == "llada2.2" and (repo / "levenshtein_editing.py").is_file()
    chosen = [case for case in CASES if case["deletes"] and case["splits"]][:3]
    cases = [
        {
            "name": case["name"],
            "input_ids": expected[f"prompt.{case['prompt']}"].tolist(),
            "kwargs": generate_kwargs(case),
        }
        for case in chosen
    ]
    (tmp_path / "child").mkdir()
    result = run_without_hf_dllm(tmp_path / "child", EXPORT_CHILD, {"repo": str(repo), "cases": cases})
    assert result["no_hf_dllm"] and not result["errors"], result["errors"]
    assert result["model"]["family"] == "llada2.2"
    assert result["tokens"] == generate_cases(model, cases)
    for case in chosen:
        prompt = expected[f"prompt.{case['prompt']}"]
        tokens = torch.tensor(result["tokens"][case["name"]]["sequences"][0][prompt.shape[1] :])
        assert_case(tokens, result["tokens"][case["name"]]["nfe"], case, expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_rows_equal_generate_alone(model, seed):
    """The serving engine's continuous batching (rows joining at block boundaries, laid out per block) gives each
    LLaDA2.2 row the tokens and forwards of `generate()` alone."""
    import random

    from hf_dllm.serving.engine import ContinuousBatcher
    from tests.serving.test_engine import assert_alone, drive, request

    rng = random.Random(seed)
    settings = [
        dict(max_new_tokens=32, block_length=8, threshold=0.7),
        dict(max_new_tokens=32, block_length=8, threshold=0.5, editing_threshold=0.5, max_post_steps=2),
        dict(max_new_tokens=16, block_length=16, threshold=0.95, editing_threshold=0.9, use_cache=False),
    ]
    requests = [
        request(
            model,
            [rng.randrange(3, 300) for _ in range(rng.randrange(2, 20))],
            mask_token_id=MASK,
            eos_token_id=EOS,
            **kw,
        )
        for kw in settings
    ]
    drive(ContinuousBatcher(model, max_batch_size=2), requests, [rng.randrange(0, 3) for _ in requests])
    assert_alone(model, requests)
