"""The run as the one owner of block facts: `generate_blocks()` events (rows, committed spans, tokens, forwards per
row, ended rows, stop), the settings resolver, and policy objects passed to the loop."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteriaList, StopStringCriteria

from hf_dllm import DiffusionGenerationConfig, FixedSchedule, UnmaskingPolicy
from hf_dllm.cache import NoCache
from hf_dllm.generation_utils import BlockEvent, left_pad
from tests.conftest import tiny_model
from tests.models.llada2.test_llada2_integration import tiny_llada2

EOS, MASK = 0, 3


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 100, (n,), generator=generator).tolist() for n in lengths]


def collect(run) -> list[BlockEvent]:
    events = []
    for event in run:
        assert event.ended.dtype == torch.bool  # read while the run is at this block, as a consumer does
        events.append(event)
    return events


SETTINGS = [
    dict(max_new_tokens=24, block_length=8, steps=12, use_cache=False),
    dict(max_new_tokens=20, block_length=8, threshold=0.3, use_cache=True, dual_cache=True),
    dict(max_new_tokens=24, block_length=8, steps=96, use_cache=True, dual_cache=False),  # steps > max_new_tokens
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["steps", "threshold", "steps>tokens"])
@pytest.mark.parametrize("family", ["llada", "llada2"])
def test_events_cover_every_row_and_match_generate(family, settings):
    """Concatenating each row's `new_tokens()` over its events gives its generated tokens up to where it ended;
    the forwards per row at its end and the run's total are generate()'s (nfe, nfe_per_row)."""
    model = tiny_model(seed=1) if family == "llada" else tiny_llada2(seed=1)
    ids, mask = left_pad(prompts([5, 11, 8]), pad_token_id=EOS)
    kwargs = dict(settings, eos_early_stop=True, return_dict_in_generate=True)
    expected = model.generate(ids, attention_mask=mask, **kwargs)

    run = model.generate_blocks(ids, attention_mask=mask, **kwargs)
    events = collect(run)
    assert torch.equal(run.sequences, expected.sequences)
    assert run.nfe == expected.nfe == events[-1].forwards
    generated: dict[int, list[int]] = {row: [] for row in range(3)}
    ended_nfe: dict[int, int] = {}
    for event in events:
        assert len(event.rows) == len(event.committed) == len(event.previously_committed)
        for row, begin, end, tokens in zip(
            event.rows.tolist(),
            event.previously_committed.tolist(),
            event.committed.tolist(),
            event.new_tokens(),
            strict=True,
        ):
            assert row not in ended_nfe, "a row that ended appears in a later block"
            assert begin == len(generated[row]) and len(tokens) == end - begin
            generated[row] += tokens
        for row, ended, nfe in zip(event.rows.tolist(), event.ended.tolist(), event.nfe_per_row.tolist(), strict=True):
            if ended:
                ended_nfe[row] = nfe
    assert sorted(ended_nfe) == [0, 1, 2]
    assert [ended_nfe[row] for row in range(3)] == expected.nfe_per_row.tolist()
    width = ids.shape[1]
    for row, tokens in generated.items():
        assert tokens == expected.sequences[row, width : width + len(tokens)].tolist()
        assert MASK not in tokens


def test_llada2_rows_of_other_prompt_lengths_commit_other_spans():
    """Block-causal blocks are aligned to each row's own positions: the first block holds the prompt's tail, so rows
    whose prompt lengths differ modulo the block commit different numbers of positions in it (the server used to
    re-derive this)."""
    model = tiny_llada2(seed=2)
    ids, mask = left_pad(prompts([5, 8, 13]), pad_token_id=EOS)
    run = model.generate_blocks(ids, attention_mask=mask, max_new_tokens=16, block_length=8, eos_early_stop=False)
    first = next(iter(run))
    assert first.previously_committed.tolist() == [0, 0, 0]
    assert first.committed.tolist() == [3, 8, 3]  # 8 - 5 % 8, 8 - 8 % 8, 8 - 13 % 8


def test_event_stop_ends_rows_like_a_criterion_and_saves_forwards():
    model = tiny_model(seed=3)
    ids, mask = left_pad(prompts([6, 9]), pad_token_id=EOS)
    kwargs = dict(max_new_tokens=24, block_length=8, steps=12, eos_early_stop=False, return_dict_in_generate=True)
    full = model.generate(ids, attention_mask=mask, **kwargs)
    run = model.generate_blocks(ids, attention_mask=mask, **kwargs)
    for event in run:
        if event.block == 0:
            event.stop(event.rows == 0)
            assert event.ended.tolist() == [True, False]
    width = ids.shape[1]
    assert torch.equal(run.sequences[0, : width + 8], full.sequences[0, : width + 8])
    assert (run.sequences[0, width + 8 :] == EOS).all()
    assert torch.equal(run.sequences[1], full.sequences[1])
    assert run.nfe_per_row.tolist() == [4, 12] and run.nfe == 12


def test_event_stop_checks_its_mask():
    model = tiny_model(seed=3)
    run = model.generate_blocks(torch.tensor([prompts([6])[0]]), max_new_tokens=16, block_length=8, steps=8)
    event = next(iter(run))
    with pytest.raises(ValueError, match=r"\(1,\) bool mask"):
        event.stop(torch.tensor([True, False]))


def test_stock_stop_string_criteria_with_a_tokenizer(char_tokenizer):
    """transformers' `StopStringCriteria` (a tokenizer-level criterion) works unchanged on the committed prefix."""
    model = tiny_model(seed=4, vocab_size=len(char_tokenizer))
    ids = torch.tensor([char_tokenizer.encode("abc")])
    kwargs = dict(max_new_tokens=32, block_length=8, steps=32, eos_early_stop=False, return_dict_in_generate=True)
    full = model.generate(ids, **kwargs)
    generated = char_tokenizer.decode(full.sequences[0, 3:])
    text = char_tokenizer.decode(full.sequences[0, 3 + 9 : 3 + 11])  # inside the second block
    criteria = StoppingCriteriaList([StopStringCriteria(char_tokenizer, [text])])
    out = model.generate(ids, stopping_criteria=criteria, **kwargs)
    # The block holding the stop string's first occurrence is the last one decoded (the string lies inside the
    # block: a criterion asked only at the block's end would miss it).
    stop_block = (generated.index(text) + len(text) - 1) // 8 + 1
    assert stop_block <= 2
    assert torch.equal(out.sequences[0, : 3 + 8 * stop_block], full.sequences[0, : 3 + 8 * stop_block])
    assert out.nfe == 8 * stop_block < full.nfe
    assert text in char_tokenizer.decode(out.sequences[0, 3 : 3 + 8 * stop_block])
    assert (out.sequences[0, 3 + 8 * stop_block :] == EOS).all()


# ---------------------------------------------------------------------------------------------------------------
# One settings resolver
# ---------------------------------------------------------------------------------------------------------------


def test_resolver_order_call_over_checkpoint_over_defaults():
    model = tiny_model()
    model.generation_config = DiffusionGenerationConfig(
        mask_token_id=3, eos_token_id=0, max_new_tokens=24, block_length=8, threshold=0.9
    )
    resolved = model.resolve_generation_config()
    assert (resolved.max_new_tokens, resolved.block_length, resolved.threshold) == (24, 8, 0.9)
    assert resolved.remasking == DiffusionGenerationConfig().remasking  # a field neither names: the default
    called = model.resolve_generation_config(max_new_tokens=16, steps=4)
    assert (called.max_new_tokens, called.block_length, called.steps, called.threshold) == (16, 8, 4, None)
    assert model.resolve_generation_config(temperature=0.7).do_sample is True
    base = GenerationConfig(max_new_tokens=40, block_length=8)
    from_base = model.resolve_generation_config(base)
    assert from_base.max_new_tokens == 40 and from_base.mask_token_id == 3  # special ids inherited from the model


def test_resolver_refuses_unknown_and_bad_fields():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"unknown generation settings \['block_size'\]"):
        model.resolve_generation_config(block_size=8)
    with pytest.raises(ValueError, match="threshold"):
        model.resolve_generation_config(threshold=1.5)
    # Another family's sampler fields (Dream's) are refused by the resolver, not at the first forward.
    with pytest.raises(ValueError, match=r"\['top_k'\] are settings of Dream's sampler"):
        model.resolve_generation_config(top_k=3)


def test_generate_with_no_kwargs_uses_the_resolved_checkpoint_settings():
    model = tiny_model(seed=5)
    model.generation_config = DiffusionGenerationConfig(
        mask_token_id=3, eos_token_id=0, max_new_tokens=16, block_length=8, steps=8
    )
    ids = torch.tensor([prompts([7])[0]])
    out = model.generate(ids, return_dict_in_generate=True)
    explicit = model.generate(ids, generation_config=model.resolve_generation_config(), return_dict_in_generate=True)
    assert out.sequences.shape == (1, 7 + 16) and out.nfe == 8
    assert torch.equal(out.sequences, explicit.sequences)


# ---------------------------------------------------------------------------------------------------------------
# Policy objects
# ---------------------------------------------------------------------------------------------------------------


class LeftToRight(UnmaskingPolicy):
    """A new rule written as one class: commit the leftmost masked position, one per step."""

    def num_to_commit(self, sorted_confidence, scheduled):
        return torch.ones_like(scheduled)

    def commit(self, proposal, scheduled):
        first = proposal.masked & (proposal.masked.long().cumsum(-1) == 1)
        return torch.where(first, proposal.x0, proposal.block), torch.zeros_like(scheduled, dtype=torch.bool)

    def steps_for_block(self):
        return self.block_length  # one step per position, known in advance


def test_a_new_unmasking_policy_is_one_class():
    model = tiny_model(seed=6)
    ids = torch.tensor([prompts([6])[0]])
    run = model.generate_blocks(ids, max_new_tokens=16, block_length=8, use_cache=False, unmasking_policy=LeftToRight())
    run.run()
    assert run.nfe == 16
    # Left to right with greedy candidates: each token is the argmax given the committed prefix and masks after it.
    x = torch.cat([ids, torch.full((1, 16), MASK)], dim=1)
    for position in range(6, 22):
        logits = model(x).logits
        x[0, position] = logits[0, position].argmax()
    assert torch.equal(run.sequences, x)


def test_policy_objects_replace_the_named_ones_and_are_type_checked():
    model = tiny_model(seed=6)
    ids = torch.tensor([prompts([6])[0]])
    named = model.generate(ids, max_new_tokens=16, block_length=8, steps=8, use_cache=False)
    policy = model.generate(
        ids, max_new_tokens=16, block_length=8, steps=8, use_cache=True, unmasking_policy=FixedSchedule(),
        cache_policy=NoCache(),
    )  # fmt: skip
    assert torch.equal(named, policy)
    with pytest.raises(TypeError, match="unmasking_policy"):
        model.generate(ids, max_new_tokens=16, unmasking_policy="fixed")
    with pytest.raises(TypeError, match="cache_policy"):
        model.generate(ids, max_new_tokens=16, cache_policy=object())


def test_iterating_a_run_needs_no_no_grad_and_leaves_the_callers_grad_mode():
    """The run does its own work without autograd (no graph kept alive by the canvas or cache), while the
    consumer's code between events keeps grad mode on."""
    model = tiny_model(seed=7)
    assert all(parameter.requires_grad for parameter in model.parameters())
    kwargs = dict(max_new_tokens=16, block_length=8, steps=8, use_cache=True, dual_cache=True)
    run = model.generate_blocks(torch.tensor([prompts([6])[0]]), **kwargs)
    assert torch.is_grad_enabled()
    for _ in run:
        assert torch.is_grad_enabled()
        # The K/V the step wrote carry no autograd graph (with grad on they would require grad).
        assert not any(keys.requires_grad for keys in run.cache.keys if keys is not None)
    assert run.cache.keys[0] is not None
