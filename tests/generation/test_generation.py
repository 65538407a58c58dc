"""`DiffusionGenerationConfig` and `generate()`: API, block plan, batch invariance, early stop, sampling, CFG,
special-token options, stopping criteria, and the mixin's interface for logit-shifted (Dream-style) models."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModel, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from hf_dllm import DiffusionGenerationConfig, LLaDAModelLM, plan_blocks
from hf_dllm.family_llada import LLADA, LLaDAFamily
from hf_dllm.family_llada2 import LLADA2
from tests.conftest import CACHE_MODES, REFERENCE_DIR, assert_cache_modes_agree, tiny_model

MASK, EOS = 310, 301  # reference fixture
POLICIES = {
    "fixed": dict(steps=8),
    "threshold": dict(threshold=0.9),
    "factor": dict(factor=1.0),
}


def random_prompt(length: int, seed: int, high: int = 300) -> torch.Tensor:
    return torch.randint(0, high, (1, length), generator=torch.Generator().manual_seed(seed))


def left_pad(prompts: list[torch.Tensor], pad_id: int = EOS) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - prompt.shape[1] :] = prompt[0]
        mask[i, width - prompt.shape[1] :] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------------------------
# DiffusionGenerationConfig
# ----------------------------------------------------------------------------------------------------------------

FULL_CONFIGS = {
    "schedule": dict(
        max_new_tokens=64,
        steps=16,
        block_length=8,
        temperature=0.5,
        do_sample=True,
        remasking="random",
        use_cache=False,
        dual_cache=False,
        cfg_scale=1.5,
        eos_early_stop=False,
        logits_eos_inf=True,
        confidence_eos_eot_inf=True,
        mask_token_id=5,
        eos_token_id=[6, 7],
        eot_token_id=8,
        pad_token_id=9,
        bos_token_id=10,
        return_dict_in_generate=True,
        disable_compile=True,
    ),
    "threshold": dict(max_new_tokens=48, block_length=16, threshold=0.75, mask_token_id=3, eos_token_id=0),
    "factor": dict(max_new_tokens=20, block_length=4, factor=1.5, use_cache=True, dual_cache=False),
}


@pytest.mark.parametrize("name", list(FULL_CONFIGS))
def test_generation_config_round_trip(tmp_path, name):
    fields = FULL_CONFIGS[name]
    config = DiffusionGenerationConfig(**fields)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    for key, value in fields.items():
        assert saved[key] == value, key
    loaded = DiffusionGenerationConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, DiffusionGenerationConfig)
    for key in DiffusionGenerationConfig.field_names():
        assert getattr(loaded, key) == getattr(config, key), key
    for key, value in fields.items():
        assert getattr(loaded, key) == value, key


def test_model_save_and_load_keeps_its_generation_config(tmp_path):
    model = tiny_model()
    model.generation_config.threshold = 0.8
    model.generation_config.block_length = 8
    model.generation_config.max_new_tokens = 24
    model.generation_config.dual_cache = False
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded.generation_config, DiffusionGenerationConfig)
    for key in DiffusionGenerationConfig.field_names():
        assert getattr(loaded.generation_config, key) == getattr(model.generation_config, key), key


INVALID_GENERATION_CONFIGS = [
    ("threshold", dict(threshold=0.5, factor=1.0)),
    ("factor", dict(threshold=0.5, factor=1.0)),
    ("threshold", dict(threshold=0.0)),
    ("threshold", dict(threshold=1.5)),
    ("threshold", dict(threshold=-0.2)),
    ("factor", dict(factor=0.0)),
    ("factor", dict(factor=-1.0)),
    ("remasking", dict(remasking="top_k")),
    ("steps", dict(steps=8, factor=1.0)),
    ("minimal_topk", dict(minimal_topk=0)),
    ("editing_threshold", dict(editing_threshold=-0.1)),
    ("editing_threshold", dict(editing_threshold=1.5)),
    ("max_post_steps", dict(max_post_steps=-1, editing_threshold=0.9)),
    ("num_to_transfer", dict(num_to_transfer=0, editing_threshold=0.9)),
    ("editing_threshold", dict(editing_threshold=0.9, remasking="random")),
    ("do_sample", dict(do_sample=True, temperature=0.0)),
    ("temperature", dict(do_sample=False, temperature=0.7)),
    ("temperature", dict(temperature=-0.5, do_sample=False)),
    ("cfg_scale", dict(cfg_scale=-1.0)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=-3)),
    ("block_length", dict(block_length=0)),
    ("steps", dict(steps=0)),
    ("steps", dict(steps=-4)),
    ("pad_token_id", dict(pad_token_id=5, mask_token_id=5)),
    ("min_p", dict(min_p=0.1)),
    ("num_beams", dict(num_beams=2)),
]


@pytest.mark.parametrize(
    "field, fields", INVALID_GENERATION_CONFIGS, ids=[f"{f}-{v}" for f, v in INVALID_GENERATION_CONFIGS]
)
def test_generation_config_rejects_invalid_values(field, fields):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        DiffusionGenerationConfig(**fields)


def test_steps_with_threshold_depends_on_the_family():
    """A config file is model-agnostic: `steps` with `threshold` is LLaDA2's rule (they combine) and a contradiction
    for bidirectional models, so the model's family (`DiffusionFamily.validate`) decides."""
    config = DiffusionGenerationConfig(steps=8, threshold=0.9)
    LLADA2.validate(config)
    with pytest.raises(ValueError, match=r"\bsteps\b.*threshold"):
        LLADA.validate(config)
    editing = DiffusionGenerationConfig(editing_threshold=0.9, threshold=0.9)
    LLADA2.validate(editing)
    with pytest.raises(ValueError, match=r"editing_threshold.*block-causal"):
        LLADA.validate(editing)
    with pytest.raises(ValueError, match=r"\bsteps\b.*editing_threshold"):
        LLADA2.validate(DiffusionGenerationConfig(editing_threshold=0.9, steps=8))
    with pytest.raises(ValueError, match=r"minimal_topk"):
        LLADA.validate(DiffusionGenerationConfig(minimal_topk=2))


@pytest.mark.parametrize(
    "field, fields",
    [case for case in INVALID_GENERATION_CONFIGS if case[0] not in ("min_p", "num_beams")],
    ids=[f"{f}-{v}" for f, v in INVALID_GENERATION_CONFIGS if f not in ("min_p", "num_beams")],
)
def test_validate_rejects_invalid_values_set_after_construction(field, fields):
    config = DiffusionGenerationConfig()
    for key, value in fields.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        config.validate()


def test_default_generation_config_takes_special_ids_from_the_model_config():
    model = tiny_model(mask_token_id=5, eos_token_id=7, pad_token_id=8, bos_token_id=9)
    config = model.generation_config
    assert isinstance(config, DiffusionGenerationConfig)
    assert (config.mask_token_id, config.eos_token_id, config.pad_token_id, config.bos_token_id) == (5, 7, 8, 9)
    reference = AutoModel.from_pretrained(REFERENCE_DIR).generation_config
    assert (reference.mask_token_id, reference.eos_token_id, reference.pad_token_id) == (310, 301, 301)


def test_generation_config_diff_dict_pins_greedy_defaults():
    """`pipeline()` fills fields missing from `to_diff_dict()` with do_sample=True, temperature=0.7."""
    diff = tiny_model().generation_config.to_diff_dict()
    assert diff["do_sample"] is False
    assert diff["temperature"] == 0.0
    assert diff["max_new_tokens"] == 128


def test_plain_generation_config_is_converted():
    model = tiny_model()
    prompt = torch.randint(4, 100, (1, 5))
    ids = dict(mask_token_id=3, eos_token_id=0, pad_token_id=0)
    plain = GenerationConfig(max_new_tokens=8, block_length=4, threshold=0.5, **ids)
    via_config = model.generate(prompt, generation_config=plain)
    via_kwargs = model.generate(prompt, max_new_tokens=8, block_length=4, threshold=0.5)
    assert torch.equal(via_config, via_kwargs)
    # kwargs override the passed config
    override = model.generate(prompt, generation_config=plain, threshold=None, steps=2)
    assert torch.equal(override, model.generate(prompt, max_new_tokens=8, block_length=4, steps=2))
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, generation_config=GenerationConfig(max_new_tokens=8, top_k=4, **ids))


def test_passed_generation_config_inherits_the_model_special_ids():
    """transformers' convention (GenerationMixin._prepare_generation_config): fields a passed generation config
    leaves unset (None) come from the model's generation config, e.g. the special token ids."""
    model = tiny_model()
    prompt = torch.randint(4, 100, (1, 5))
    expected = model.generate(prompt, max_new_tokens=8, block_length=4)
    for config in (
        GenerationConfig(max_new_tokens=8, block_length=4),
        DiffusionGenerationConfig(max_new_tokens=8, block_length=4),
    ):
        assert torch.equal(model.generate(prompt, generation_config=config), expected)


# ----------------------------------------------------------------------------------------------------------------
# generate(): API
# ----------------------------------------------------------------------------------------------------------------


def test_generate_api(reference_model):
    prompt = random_prompt(6, seed=1)
    kwargs = dict(max_new_tokens=12, block_length=4, eos_early_stop=False)
    positional = reference_model.generate(prompt, **kwargs)
    keyword = reference_model.generate(input_ids=prompt, **kwargs)
    assert isinstance(positional, torch.Tensor) and positional.dtype == torch.long
    assert positional.shape == (1, 6 + 12)
    assert torch.equal(positional, keyword)
    assert torch.equal(positional[:, :6], prompt)
    assert not (positional == MASK).any()

    out = reference_model.generate(prompt, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, positional)
    assert isinstance(out.nfe, int) and not isinstance(out.nfe, bool)
    assert out.nfe_per_row.dtype == torch.long and out.nfe_per_row.shape == (1,)
    assert int(out.nfe_per_row[0]) == out.nfe

    with pytest.raises(ValueError, match="num_beams"):
        reference_model.generate(prompt, num_beams=2, **kwargs)


def _expected_plan(n: int, block: int, steps: int | None) -> list[tuple[int, int]]:
    lengths = [block] * (n // block) + ([n % block] if n % block else [])
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return list(zip(offsets, lengths, strict=True))


def test_plan_blocks_properties():
    for n in range(1, 41):
        for block in range(1, n + 2):
            layout = _expected_plan(n, block, None)
            plan = plan_blocks(n, block, None)
            assert [(o, length) for o, length, _ in plan] == layout
            assert [s for _, _, s in plan] == [length for _, length in layout]  # one token per step
            blocks = len(layout)
            for steps in range(blocks, 2 * n + 2):
                plan = plan_blocks(n, block, steps)
                assert [(o, length) for o, length, _ in plan] == layout
                counts = [s for _, _, s in plan]
                assert sum(counts) == steps, (n, block, steps)
                assert min(counts) >= 1, (n, block, steps)
                shares = [steps * length / n for _, length in layout]
                if min(shares) >= 1:  # nobody had to borrow: each block gets its share, rounded
                    assert all(abs(c - s) < 1 for c, s in zip(counts, shares, strict=True)), (n, block, steps, counts)
                if n % block == 0 and steps % blocks == 0:  # LLaDA's even split
                    assert counts == [steps // blocks] * blocks
            with pytest.raises(ValueError, match="steps"):
                plan_blocks(n, block, blocks - 1) if blocks > 1 else plan_blocks(n, block, 0)


@pytest.mark.parametrize("steps", [None, 5, 9, 40])
def test_last_block_shorter(reference_model, steps):
    prompt = random_prompt(5, seed=2)
    out = reference_model.generate(
        prompt,
        max_new_tokens=10,
        block_length=4,
        steps=steps,
        use_cache=False,
        eos_early_stop=False,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (1, 15)
    assert not (out.sequences == MASK).any()
    plan = plan_blocks(10, 4, steps)
    assert [length for _, length, _ in plan] == [4, 4, 2]
    # A block of L masks over s steps commits L // s (+1) per step; steps that would commit nothing are skipped.
    assert out.nfe == sum(min(length, s) for _, length, s in plan)


@pytest.mark.parametrize("cache", list(CACHE_MODES))
def test_steps_none_is_one_token_per_step(reference_model, cache):
    prompt = random_prompt(7, seed=3)
    out = reference_model.generate(
        prompt,
        max_new_tokens=12,
        block_length=4,
        eos_early_stop=False,
        return_dict_in_generate=True,
        **CACHE_MODES[cache],
    )
    assert out.nfe == 12


# ----------------------------------------------------------------------------------------------------------------
# Batch invariance
# ----------------------------------------------------------------------------------------------------------------

BATCH_LENGTHS = (5, 9, 12)


@pytest.mark.parametrize("eos_early_stop", [False, True], ids=["no_stop", "eos_stop"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("cache", list(CACHE_MODES))
def test_left_padded_batch_rows_equal_rows_alone(reference_model, cache, policy, eos_early_stop):
    prompts = [random_prompt(n, seed=10 + n) for n in BATCH_LENGTHS]
    ids, mask = left_pad(prompts)
    kwargs = dict(
        max_new_tokens=16,
        block_length=8,
        eos_early_stop=eos_early_stop,
        return_dict_in_generate=True,
        **CACHE_MODES[cache],
        **POLICIES[policy],
    )
    if eos_early_stop:
        # Make one row stop after its first block while the others run on: an EOS id taken from that row's first
        # block that no other row ever generates.
        free = reference_model.generate(ids, attention_mask=mask, **{**kwargs, "eos_early_stop": False})
        generated = free.sequences[:, ids.shape[1] :]
        kwargs["eos_token_id"] = next(
            int(token)
            for row in range(3)
            for token in generated[row, :8]
            if not any(token in generated[other] for other in range(3) if other != row)
        )
    batched = reference_model.generate(ids, attention_mask=mask, **kwargs)
    width = ids.shape[1]
    assert batched.sequences.shape == (3, width + 16)
    assert torch.equal(batched.sequences[:, :width], ids)
    stopped_early = 0
    for i, prompt in enumerate(prompts):
        alone = reference_model.generate(prompt, **kwargs)
        assert torch.equal(batched.sequences[i, width - prompt.shape[1] :], alone.sequences[0]), f"row {i}"
        # A row counts the forwards it needed: those it makes alone, whatever its partners need.
        assert int(batched.nfe_per_row[i]) == alone.nfe
        stopped_early += int(alone.nfe < batched.nfe)
    assert batched.nfe >= int(batched.nfe_per_row.max())
    if eos_early_stop:
        assert stopped_early >= 1, "no row stopped early: the EOS case is not exercised"


# ----------------------------------------------------------------------------------------------------------------
# EOS early stop and stopping criteria
# ----------------------------------------------------------------------------------------------------------------

STOP_KWARGS = dict(max_new_tokens=32, block_length=8, steps=16, use_cache=False, return_dict_in_generate=True)


def _first_new_token(tokens: list[int], block: int, exclude: set[int]) -> int:
    """A token that appears in block `block` (of 8) but in no earlier block and not in `exclude`."""
    earlier = set(tokens[: 8 * block])
    for token in tokens[8 * block : 8 * (block + 1)]:
        if token not in earlier and token not in exclude:
            return token
    pytest.skip("no suitable token in this output")


def test_eos_early_stop_single_row(reference_model):
    prompt = random_prompt(7, seed=20)
    full = reference_model.generate(prompt, eos_early_stop=False, **STOP_KWARGS)
    generated = full.sequences[0, 7:].tolist()
    eos = _first_new_token(generated, block=1, exclude=set())
    stopped = reference_model.generate(prompt, eos_early_stop=True, eos_token_id=eos, **STOP_KWARGS)
    assert torch.equal(stopped.sequences[0, : 7 + 16], full.sequences[0, : 7 + 16])
    assert (stopped.sequences[0, 7 + 16 :] == eos).all()
    assert stopped.nfe == 8 < full.nfe == 16  # two blocks of 4 steps
    assert stopped.nfe_per_row.tolist() == [8]


def test_eos_early_stop_batch(reference_model):
    prompts = [random_prompt(7, seed=21), random_prompt(7, seed=22)]
    ids = torch.cat(prompts)
    full = reference_model.generate(ids, eos_early_stop=False, **STOP_KWARGS)
    row0, row1 = full.sequences[0, 7:].tolist(), full.sequences[1, 7:].tolist()

    # Row 0 stops after its first block, row 1 never meets the EOS and runs to the end.
    eos0 = _first_new_token(row0, block=0, exclude=set(row1))
    out = reference_model.generate(ids, eos_early_stop=True, eos_token_id=eos0, **STOP_KWARGS)
    assert torch.equal(out.sequences[0, : 7 + 8], full.sequences[0, : 7 + 8])
    assert (out.sequences[0, 7 + 8 :] == eos0).all()
    assert torch.equal(out.sequences[1], full.sequences[1])
    assert out.nfe_per_row.tolist() == [4, 16]
    assert out.nfe == 16

    # Both rows stop (row 0 after block 0, row 1 after block 1): the call ends early.
    eos1 = _first_new_token(row1, block=1, exclude={eos0})
    out = reference_model.generate(ids, eos_early_stop=True, eos_token_id=[eos0, eos1], **STOP_KWARGS)
    assert torch.equal(out.sequences[0, : 7 + 8], full.sequences[0, : 7 + 8])
    assert torch.equal(out.sequences[1, : 7 + 16], full.sequences[1, : 7 + 16])
    assert (out.sequences[1, 7 + 16 :] == eos0).all()  # filled with the first EOS id
    assert out.nfe_per_row.tolist() == [4, 8]
    assert out.nfe == 8 < full.nfe


class StopRowsStartingWith(StoppingCriteria):
    """Stops the rows whose prompt starts with `token`; records every `input_ids` it is shown."""

    def __init__(self, token: int):
        self.token = token
        self.seen: list[torch.Tensor] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.clone())
        return input_ids[:, 0] == self.token


def test_stopping_criteria_see_the_committed_prefix_and_stop_a_row(reference_model):
    ids = torch.cat([random_prompt(7, seed=23), random_prompt(7, seed=24)])
    assert ids[0, 0] != ids[1, 0]
    full = reference_model.generate(ids, eos_early_stop=False, **STOP_KWARGS)
    criterion = StopRowsStartingWith(int(ids[0, 0]))
    out = reference_model.generate(
        ids, eos_early_stop=False, stopping_criteria=StoppingCriteriaList([criterion]), **STOP_KWARGS
    )
    assert torch.equal(out.sequences[0, : 7 + 8], full.sequences[0, : 7 + 8])
    assert (out.sequences[0, 7 + 8 :] == EOS).all()
    assert torch.equal(out.sequences[1], full.sequences[1])
    assert out.nfe_per_row.tolist() == [4, 16]
    # transformers' semantics: asked once per committed token with the prompt and the committed tokens, never a
    # mask token; a row that a criterion stopped is not asked again (it still ends with its block).
    shapes = [(2, 7 + 1)] + [(1, 7 + k) for k in range(2, 33)]
    assert [tuple(seen.shape) for seen in criterion.seen] == shapes
    assert torch.equal(criterion.seen[0], full.sequences[:, : 7 + 1])
    assert torch.equal(criterion.seen[-1], full.sequences[1:, :])
    assert not any((seen == MASK).any() for seen in criterion.seen)


def test_stock_max_length_criteria_stops_after_the_block_reaching_it(reference_model):
    """`MaxLengthCriteria(30)` on a prompt of 7 and 32 new tokens in blocks of 8: the committed prefix reaches 30
    tokens with the third block (7 + 24 = 31), so the fourth block is not decoded (the whole-canvas criterion of
    before stopped after the first block)."""
    from transformers import MaxLengthCriteria

    ids = random_prompt(7, seed=23)
    full = reference_model.generate(ids, eos_early_stop=False, **STOP_KWARGS)
    out = reference_model.generate(
        ids, eos_early_stop=False, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(30)]), **STOP_KWARGS
    )
    assert torch.equal(out.sequences[0, : 7 + 24], full.sequences[0, : 7 + 24])
    assert (out.sequences[0, 7 + 24 :] == EOS).all()
    assert out.nfe == 12  # three blocks of 4 steps
    untouched = reference_model.generate(
        ids, eos_early_stop=False, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(7 + 32)]), **STOP_KWARGS
    )
    assert torch.equal(untouched.sequences, full.sequences) and untouched.nfe == full.nfe


def test_stock_eos_token_criteria_stops_at_a_token_inside_a_block(reference_model):
    """`EosTokenCriteria(t)` looks at the last token of the sequence; it is asked for every committed position
    (as an autoregressive generate() asks it after every token), so a row stops after the first block holding t."""
    from transformers.generation.stopping_criteria import EosTokenCriteria

    ids = random_prompt(7, seed=23)
    full = reference_model.generate(ids, eos_early_stop=False, **STOP_KWARGS)
    token = int(full.sequences[0, 7 + 8 + 3])  # inside the second block
    stop_block = (full.sequences[0, 7:] == token).long().argmax().item() // 8 + 1
    criteria = StoppingCriteriaList([EosTokenCriteria(token)])
    out = reference_model.generate(ids, eos_early_stop=False, stopping_criteria=criteria, **STOP_KWARGS)
    assert torch.equal(out.sequences[0, : 7 + 8 * stop_block], full.sequences[0, : 7 + 8 * stop_block])
    assert (out.sequences[0, 7 + 8 * stop_block :] == EOS).all()
    assert out.nfe == 4 * stop_block < full.nfe


def test_a_criterion_returning_a_wrong_shape_is_an_error(reference_model):
    ids = torch.cat([random_prompt(7, seed=23), random_prompt(7, seed=24)])

    def three_rows(input_ids, scores):
        return torch.zeros(3, dtype=torch.bool)

    with pytest.raises(ValueError, match=r"stopping criterion returned shape \(3,\)"):
        reference_model.generate(ids, stopping_criteria=[three_rows], **STOP_KWARGS)


# ----------------------------------------------------------------------------------------------------------------
# Sampling, remasking, classifier-free guidance, EOS options
# ----------------------------------------------------------------------------------------------------------------


def test_temperature_sampling_is_seeded():
    model = tiny_model()
    prompt = torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=16, block_length=8, temperature=1.0, eos_early_stop=False)
    torch.manual_seed(0)
    first = model.generate(prompt, **kwargs)
    torch.manual_seed(0)
    again = model.generate(prompt, **kwargs)
    torch.manual_seed(1)
    other = model.generate(prompt, **kwargs)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert not (first == model.generation_config.mask_token_id).any()
    greedy = model.generate(prompt, max_new_tokens=16, block_length=8, eos_early_stop=False)
    assert not torch.equal(first, greedy)


def test_random_remasking(reference_model):
    prompt = random_prompt(6, seed=30)
    kwargs = dict(
        max_new_tokens=16,
        block_length=8,
        steps=16,
        remasking="random",
        eos_early_stop=False,
        use_cache=False,
        return_dict_in_generate=True,
    )
    outs = []
    for seed in (0, 0, 1, 2, 3):
        torch.manual_seed(seed)
        outs.append(reference_model.generate(prompt, **kwargs))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(out.nfe == 16 and not (out.sequences == MASK).any() for out in outs)
    confident = reference_model.generate(prompt, **{**kwargs, "remasking": "low_confidence"}).sequences
    # The commit order is random, so outputs depend on the seed and differ from confidence ordering.
    assert len({tuple(out.sequences[0].tolist()) for out in outs[1:]}) > 1
    assert any(not torch.equal(out.sequences, confident) for out in outs)


@pytest.mark.parametrize("cache", list(CACHE_MODES))
def test_cfg_works_with_every_cache_mode(reference_model, cache):
    prompts = [random_prompt(5, seed=40), random_prompt(9, seed=41)]
    ids, mask = left_pad(prompts)
    kwargs = dict(
        max_new_tokens=16,
        block_length=8,
        steps=8,
        cfg_scale=1.5,
        eos_early_stop=False,
        return_dict_in_generate=True,
        **CACHE_MODES[cache],
    )
    batched = reference_model.generate(ids, attention_mask=mask, **kwargs)
    assert not (batched.sequences == MASK).any()
    assert batched.nfe == 8
    for i, prompt in enumerate(prompts):
        alone = reference_model.generate(prompt, **kwargs).sequences
        assert torch.equal(batched.sequences[i, ids.shape[1] - prompt.shape[1] :], alone[0])
    without = reference_model.generate(ids, attention_mask=mask, **{**kwargs, "cfg_scale": 0.0}).sequences
    assert not torch.equal(without, batched.sequences)


def test_cfg_one_forward_per_block_is_the_same_in_every_cache_mode(reference_model):
    """A threshold that commits a whole block in its first (full) forward makes the cache modes identical."""
    prompt = random_prompt(7, seed=42)
    assert_cache_modes_agree(
        reference_model, prompt, 2, max_new_tokens=16, block_length=8, threshold=1e-9, cfg_scale=2.0
    )


def _most_frequent(tokens: torch.Tensor) -> int:
    values, counts = tokens.unique(return_counts=True)
    return int(values[counts.argmax()])


def test_logits_eos_inf_never_produces_eos(reference_model):
    prompt = random_prompt(8, seed=50)
    kwargs = dict(max_new_tokens=16, block_length=8, steps=16, use_cache=False, return_dict_in_generate=True)
    free = reference_model.generate(prompt, eos_early_stop=False, **kwargs)
    eos = _most_frequent(free.sequences[0, 8:])
    banned = reference_model.generate(prompt, eos_token_id=eos, logits_eos_inf=True, eos_early_stop=False, **kwargs)
    assert not (banned.sequences[0, 8:] == eos).any()
    assert not (banned.sequences == MASK).any()
    stop = reference_model.generate(prompt, eos_token_id=eos, logits_eos_inf=True, eos_early_stop=True, **kwargs)
    assert torch.equal(stop.sequences, banned.sequences)
    assert stop.nfe == banned.nfe == 16


# ----------------------------------------------------------------------------------------------------------------
# The mixin's model interface: a model whose logits are shifted by one (Dream-style)
# ----------------------------------------------------------------------------------------------------------------


class ShiftedLLaDAFamily(LLaDAFamily):
    """LLaDA with Dream's logits shift: a family differs from another in its family object only."""

    logits_shift = 1


class ShiftedLLaDA(LLaDAModelLM):
    """Logits at position i predict token i + 1: logits'[i] = logits[i + 1] (the last position has none: NaN)."""

    diffusion_families = (ShiftedLLaDAFamily(),)

    def forward(self, *args, logits_to_keep=0, return_dict=None, **kwargs):
        out = super().forward(*args, logits_to_keep=0, return_dict=True, **kwargs)
        logits = out.logits
        shifted = torch.cat([logits[:, 1:], torch.full_like(logits[:, :1], float("nan"))], dim=1)
        if isinstance(logits_to_keep, int):
            keep = slice(-logits_to_keep, None) if logits_to_keep > 0 else slice(None)
        else:
            keep = logits_to_keep
        out.logits = shifted[:, keep]
        return out


@pytest.fixture(scope="module")
def shifted_pair_1layer():
    """One layer: K/V of a position depend only on its token, so recomputing the position before the block (which
    a shifted model needs) gives the cached values exactly, and every cache mode must match the unshifted model."""
    plain = LLaDAModelLM.from_pretrained(REFERENCE_DIR, n_layers=1).eval()
    shifted = ShiftedLLaDA.from_pretrained(REFERENCE_DIR, n_layers=1).eval()
    return plain, shifted


def test_shifted_model_forward_is_shifted(shifted_pair_1layer):
    plain, shifted = shifted_pair_1layer
    ids = random_prompt(9, seed=60)
    with torch.no_grad():
        torch.testing.assert_close(shifted(ids).logits[:, :-1], plain(ids).logits[:, 1:], rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["fixed", "threshold"])
@pytest.mark.parametrize("cache", list(CACHE_MODES))
def test_shifted_model_generates_what_the_unshifted_model_generates(shifted_pair_1layer, cache, policy):
    plain, shifted = shifted_pair_1layer
    prompts = [random_prompt(4, seed=61), random_prompt(8, seed=62)]
    ids, mask = left_pad(prompts)
    kwargs = dict(
        max_new_tokens=16,
        block_length=8,
        eos_early_stop=False,
        return_dict_in_generate=True,
        **CACHE_MODES[cache],
        **POLICIES[policy],
    )
    expected = plain.generate(ids, attention_mask=mask, **kwargs)
    out = shifted.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.nfe == expected.nfe


def test_shifted_model_no_cache_two_layers(reference_model):
    shifted = ShiftedLLaDA.from_pretrained(REFERENCE_DIR).eval()
    prompt = random_prompt(6, seed=63)
    for policy in POLICIES.values():
        kwargs = dict(max_new_tokens=16, block_length=8, use_cache=False, eos_early_stop=False, **policy)
        assert torch.equal(shifted.generate(prompt, **kwargs), reference_model.generate(prompt, **kwargs))
    with pytest.raises(ValueError, match="cfg_scale"):
        shifted.generate(prompt, max_new_tokens=8, cfg_scale=1.0)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_every_block_start_full_forward_has_one_graph_key(reference_model, monkeypatch, cache):
    """A CUDA graph is keyed by its step's shapes only (every column index is an input), so the full forward at
    each block start (the same shapes in every block) is one graph, captured once and replayed by later blocks."""
    from hf_dllm.step_machine import StepMachine

    keys: dict[int, set] = {0: set(), 1: set()}
    original = StepMachine.step_inputs

    def recording(self, canvas, block_start, block_end, step, active, generated, rows=None):
        inputs, key = original(self, canvas, block_start, block_end, step, active, generated, rows)
        keys[min(step, 1)].add(key)
        return inputs, key

    monkeypatch.setattr(StepMachine, "step_inputs", recording)
    out = reference_model.generate(
        random_prompt(9, 3), max_new_tokens=32, block_length=8, steps=16, eos_early_stop=False,
        return_dict_in_generate=True, **CACHE_MODES[cache],
    )  # fmt: skip
    assert out.nfe == 16
    assert len(keys[0]) == 1, keys[0]  # 4 blocks, one full-forward shape
    # Dual cache: later steps compute the block alone (one shape); prefix cache: the block and what follows it.
    assert len(keys[1]) == (1 if cache == "dual" else 4), keys[1]
