"""LLaDA2.x generation through the one block loop: the recorded cases of the reference `generate()` (LLaDA2.0 and
LLaDA2.1 with token editing; one per setting by default, every one with HF_DLLM_ALL_CASES=1) reproduce exactly,
with and without the exact KV cache, and batches of prompts of different lengths give each row what it gives alone.

Fixtures: `tests/fixtures/llada2-tiny-ref`, `tests/fixtures/llada21-tiny-ref` (see README-reference.md). The
reference returns only the generated tokens, cut after the first EOS; `generate()` returns prompt + all
`max_new_tokens` positions, EOS-filled after the first EOS (the reference's cut), so the comparison is on the
reference's tokens and the EOS fill after them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hf_dllm import DiffusionGenerationConfig, LLaDA2MoeModelLM, left_pad
from tests.conftest import FIXTURES, reference_fixtures

LLADA2 = FIXTURES / "llada2-tiny-ref"
LLADA21 = FIXTURES / "llada21-tiny-ref"
CASES2 = json.loads((LLADA2 / "cases.json").read_text())["cases"]
CASES21 = json.loads((LLADA21 / "cases.json").read_text())["cases"]
MASK, EOS = 310, 301


llada2, expected2 = reference_fixtures(LLADA2, LLaDA2MoeModelLM)
llada21, expected21 = reference_fixtures(LLADA21, LLaDA2MoeModelLM)


def decoded_blocks(prompt_length: int, new_tokens: int, block_length: int) -> int:
    """Blocks the reference decodes: the one holding the prompt's end up to the one holding the last position."""
    return -(-(prompt_length + new_tokens) // block_length) - prompt_length // block_length


def generate_kwargs(case: dict, prompt_length: int) -> dict:
    """The reference's kwargs in `DiffusionGenerationConfig` terms: `steps` is the call's total (the reference's is
    per block), the reference's `threshold=1.0` (never met: it compares with `>`) is `threshold=None`."""
    ref = case["kwargs"]
    kwargs = dict(
        max_new_tokens=ref["gen_length"],
        block_length=ref["block_length"],
        threshold=None if ref["threshold"] >= 1.0 else ref["threshold"],
        eos_early_stop=ref["eos_early_stop"],
        eos_token_id=ref["eos_id"],
        mask_token_id=ref["mask_id"],
        temperature=ref["temperature"],
        return_dict_in_generate=True,
    )
    if "editing_threshold" in ref:
        kwargs.update(
            editing_threshold=ref["editing_threshold"],
            max_post_steps=ref["max_post_steps"],
            num_to_transfer=ref["num_to_transfer"],
        )
    else:
        blocks = decoded_blocks(prompt_length, ref["gen_length"], ref["block_length"])
        kwargs.update(steps=ref["steps"] * blocks, minimal_topk=ref["minimal_topk"])
    return kwargs


def assert_reference_tokens(sequences: torch.Tensor, prompt_length: int, expected: torch.Tensor) -> None:
    """`sequences` `(1, P + N)` holds the reference's tokens after the prompt, then EOS if they end with one."""
    generated = sequences[0, prompt_length:]
    count = expected.shape[1]
    assert torch.equal(generated[:count], expected[0]), f"{int((generated[:count] != expected[0]).sum())} differ"
    if count < generated.shape[0]:
        assert int(expected[0, -1]) == EOS, "the reference stopped early without an EOS"
        assert (generated[count:] == EOS).all()


def one_case_per_setting(cases: list[dict], first_prompt: int = 0) -> list[dict]:
    """One case per setting, the prompts taken in turn from the `first_prompt`-th: the recorded grid is every
    setting on each of four prompts."""
    settings = {}
    for case in cases:
        settings.setdefault(json.dumps(case["kwargs"], sort_keys=True), []).append(case)
    return [group[(first_prompt + index) % len(group)] for index, group in enumerate(settings.values())]


@pytest.mark.parametrize("use_cache", [True, False], ids=["exact_cache", "no_cache"])
@pytest.mark.parametrize("fixture", ["llada2", "llada21"], ids=["llada2.0", "llada2.1_editing"])
def test_reference_cases(fixture, use_cache, request):
    """Recorded cases with the exact cache, whose forwards are the reference's (one per step, just on fewer
    positions): the same count where the reference stops at EOS. (LLaDA2.1's reference without `eos_early_stop`
    decodes every block after an EOS too; here a row ends after the block with its first EOS, which cannot change
    any more: fewer forwards, same tokens.) Without a cache, one case per setting; with the exact cache (the path
    generate() takes) one case per setting too, on other prompts (the suite's time budget), every case with
    HF_DLLM_ALL_CASES=1."""
    model, expected = request.getfixturevalue(fixture), request.getfixturevalue(f"expected{fixture[5:]}")
    cases = CASES2 if fixture == "llada2" else CASES21
    if not use_cache:
        cases = one_case_per_setting(cases)
    elif os.environ.get("HF_DLLM_ALL_CASES") != "1":
        cases = one_case_per_setting(cases, first_prompt=2)
    failures = []
    for case in cases:
        prompt = expected[f"prompt.{case['prompt']}"]
        out = model.generate(prompt, use_cache=use_cache, **generate_kwargs(case, prompt.shape[1]))
        try:
            assert_reference_tokens(out.sequences, prompt.shape[1], expected[f"case.{case['name']}"])
            assert out.nfe <= case["nfe"], f"nfe {out.nfe} > reference {case['nfe']}"
            if use_cache and (fixture == "llada2" or case["kwargs"]["eos_early_stop"]):
                assert out.nfe == case["nfe"], f"nfe {out.nfe} != reference {case['nfe']}"
        except AssertionError as error:
            failures.append(f"{case['name']}: {error}")
    assert not failures, f"{len(failures)}/{len(cases)} cases differ:\n" + "\n".join(failures[:20])


BATCH_SETTINGS = {
    "schedule": dict(steps=24, threshold=None),
    "threshold": dict(threshold=0.7),
    "steps+threshold": dict(steps=12, threshold=0.9),
    "editing": dict(threshold=0.7, editing_threshold=0.6, max_post_steps=3),
}


@pytest.mark.parametrize("use_cache", [True, False], ids=["exact_cache", "no_cache"])
@pytest.mark.parametrize("eos_early_stop", [False, True], ids=["no_stop", "eos_stop"])
@pytest.mark.parametrize("setting", list(BATCH_SETTINGS), ids=list(BATCH_SETTINGS))
def test_left_padded_batch_rows_equal_rows_alone(llada2, expected2, setting, eos_early_stop, use_cache):
    """Prompts of lengths 5, 11, 16 and 21 (different offsets inside a block of 8, one a multiple of it) in one
    left-padded batch: each row gets the tokens and the forward count it gets alone."""
    prompts = [expected2[f"prompt.{name}"][0] for name in ("p5", "p11", "p16", "p21")]
    ids, mask = left_pad([prompt.tolist() for prompt in prompts], EOS)
    width = ids.shape[1]
    kwargs = dict(
        max_new_tokens=30,
        block_length=8,
        mask_token_id=MASK,
        eos_token_id=EOS,
        eos_early_stop=eos_early_stop,
        use_cache=use_cache,
        return_dict_in_generate=True,
        **BATCH_SETTINGS[setting],
    )
    batched = llada2.generate(ids, attention_mask=mask, **kwargs)
    assert batched.sequences.shape == (len(prompts), width + 30)
    assert torch.equal(batched.sequences[:, :width], ids)
    for row, prompt in enumerate(prompts):
        alone = llada2.generate(prompt[None], **kwargs)
        assert torch.equal(batched.sequences[row, width:], alone.sequences[0, len(prompt) :]), f"row {row}"
        assert int(batched.nfe_per_row[row]) == alone.nfe, f"row {row}"
    assert batched.nfe >= int(batched.nfe_per_row.max())


def test_rows_stopped_at_eos_cost_no_more_forwards(llada2, expected2):
    """A row whose block holds an EOS stops after that block, with `eos_early_stop` or not (a block-causal model
    cannot change it later, and the reference cuts its output there); the rest is EOS-filled."""
    prompt = expected2["prompt.p16"]  # blocks of 8 aligned to positions: generated offsets 0-7, 8-15, ...
    common = dict(max_new_tokens=48, block_length=8, threshold=0.7, eos_early_stop=False, mask_token_id=MASK)
    free = llada2.generate(prompt, eos_token_id=7, return_dict_in_generate=True, **common)
    generated = free.sequences[0, 16:].tolist()
    # An EOS id first generated after the first two blocks.
    first = next(i for i, token in enumerate(generated) if i >= 16 and token not in generated[:i])
    eos = generated[first]
    out = llada2.generate(prompt, eos_token_id=eos, return_dict_in_generate=True, **common)
    assert out.sequences[0, 16 : 16 + first + 1].tolist() == generated[: first + 1]
    assert (out.sequences[0, 16 + first + 1 :] == eos).all()
    assert out.nfe < free.nfe


def test_exact_cache_equals_recompute_over_settings(llada2, expected2):
    """The exact cache is not an approximation: tokens equal the full recompute in float32."""
    prompt = expected2["prompt.p16"]
    for kwargs in (dict(block_length=4, steps=40), dict(block_length=16, threshold=0.5), dict(block_length=8)):
        common = dict(max_new_tokens=40, mask_token_id=MASK, eos_token_id=EOS, eos_early_stop=False, **kwargs)
        cached = llada2.generate(prompt, use_cache=True, **common)
        recomputed = llada2.generate(prompt, use_cache=False, **common)
        assert torch.equal(cached, recomputed), kwargs


def test_loop_forward_skips_the_float32_logits_copy(expected2):
    """The loop's forward returns the logits in the model dtype; widened, they are `forward`'s float32 logits bit for
    bit (what every unmasking rule computes from), so tokens do not change."""
    model = LLaDA2MoeModelLM.from_pretrained(LLADA2, dtype=torch.bfloat16).eval()
    ids = expected2["prompt.p16"]
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    keep = torch.arange(4, 12)
    with torch.no_grad():
        loop = model._diffusion_forward(ids, None, positions, None, torch.arange(ids.shape[1]), keep, block_length=4)
        logits = model(ids, position_ids=positions, logits_to_keep=keep, block_length=4).logits
    assert loop.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(loop.float(), logits)


def test_loop_forward_runs_forward_hooks(expected2):
    """The loop's forward goes through `forward` (only its logits' dtype differs): a hook on the model sees every
    forward of `generate()`."""
    model = LLaDA2MoeModelLM.from_pretrained(LLADA2).eval()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    out = model.generate(
        expected2["prompt.p16"],
        max_new_tokens=8,
        block_length=4,
        steps=4,
        mask_token_id=MASK,
        return_dict_in_generate=True,
    )
    assert len(calls) == out.nfe > 0


BAD_LLADA2_INPUTS = [
    (dict(cfg_scale=1.5), "cfg_scale"),
    (dict(steps=3, max_new_tokens=32, block_length=8), "steps"),  # 4 blocks need at least 4 steps
    (dict(editing_threshold=0.9, steps=8), "steps"),
    (dict(minimal_topk=64, max_new_tokens=32), "minimal_topk"),
    (dict(editing_threshold=1.5), "editing_threshold"),
    (dict(num_to_transfer=2), "num_to_transfer"),
    (dict(factor=1.0, editing_threshold=0.9), "factor"),
]


@pytest.mark.parametrize("kwargs, name", BAD_LLADA2_INPUTS, ids=[name for _, name in BAD_LLADA2_INPUTS])
def test_bad_inputs_raise_before_any_forward(llada2, kwargs, name, monkeypatch):
    def no_forward(*args, **kw):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(llada2, "_diffusion_forward", no_forward)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        llada2.generate(torch.tensor([[5, 6, 7]]), mask_token_id=MASK, **kwargs)


def test_editing_arguments_on_a_bidirectional_model_raise(reference_model):
    with pytest.raises(ValueError, match="editing_threshold"):
        reference_model.generate(torch.tensor([[5, 6, 7]]), editing_threshold=0.9)


def test_generation_config_json_with_steps_and_threshold_loads(tmp_path, llada2):
    """A LLaDA2 generation_config.json may combine steps and threshold (its rule); the model accepts it."""
    DiffusionGenerationConfig(steps=16, threshold=0.95, block_length=8, mask_token_id=MASK).save_pretrained(tmp_path)
    config = DiffusionGenerationConfig.from_pretrained(tmp_path)
    out = llada2.generate(torch.tensor([[5, 6, 7]]), generation_config=config, max_new_tokens=16)
    assert out.shape == (1, 19)
