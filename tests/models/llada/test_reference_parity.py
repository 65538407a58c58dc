"""Every generation case recorded from LLaDA's and Fast-dLLM's reference code reproduces exactly.

Fixture: `tests/fixtures/llada-tiny-ref` (see README-reference.md). The reference's cached methods run one
wasted forward after a block is already complete; skipping it is allowed, so NFE may be lower, never higher.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import REFERENCE_DIR

CASES = json.loads((REFERENCE_DIR / "cases.json").read_text())["cases"]


def reference_kwargs(ref: dict) -> dict:
    """The arguments of LLaDA's reference `generate()` (`ref`: a recorded case's kwargs) that every reference
    translation shares, as generation-config fields: `steps` is the call's total, as the reference's."""
    kwargs = dict(
        max_new_tokens=ref["gen_length"],
        block_length=ref["block_length"],
        mask_token_id=ref["mask_id"],
        temperature=ref["temperature"],
        eos_early_stop=False,
        return_dict_in_generate=True,
    )
    if "threshold" in ref:
        kwargs["threshold"] = ref["threshold"]  # the reference ignores `steps` under a threshold
    else:
        kwargs["steps"] = ref["steps"]
    if "cfg_scale" in ref:
        kwargs["cfg_scale"] = ref["cfg_scale"]
    return kwargs


def generate_kwargs(case: dict) -> dict:
    """Translate the reference's kwargs and method name into generation-config fields."""
    kwargs = reference_kwargs(case["kwargs"])
    method = case["name"].split(".", 1)[1]
    if method.startswith("nocache") or method.startswith("cfg"):
        kwargs["use_cache"] = False
    elif method.startswith("prefix"):
        kwargs.update(use_cache=True, dual_cache=False)
    elif method.startswith("dual"):
        kwargs.update(use_cache=True, dual_cache=True)
    else:
        raise AssertionError(f"unknown reference method in {case['name']}")
    return kwargs


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_reference_case(case, reference_model, reference_expected):
    prompt = reference_expected[f"prompt.{case['prompt']}"]
    expected = reference_expected[f"case.{case['name']}"]
    out = reference_model.generate(prompt, **generate_kwargs(case))
    assert out.sequences.shape == expected.shape
    mismatches = (out.sequences != expected).sum().item()
    assert mismatches == 0, f"{mismatches} tokens differ from the reference"
    if case["nfe"] is not None:
        assert out.nfe <= case["nfe"]


def test_cached_methods_skip_the_wasted_forward(reference_model, reference_expected):
    """A threshold that commits a whole block in its first (full) forward needs no second forward."""
    prompt = reference_expected["prompt.p12"]
    out = reference_model.generate(
        prompt, max_new_tokens=32, block_length=8, threshold=1e-9, eos_early_stop=False, return_dict_in_generate=True
    )
    assert out.nfe == 4  # one forward per block
