"""Dream through the one block loop reproduces every recorded reference case token for token, with a forward count
never above the reference's: Dream's own `diffusion_generate` (`maskgit_plus`, `topk_margin`, `entropy`; one block,
no cache) and Fast-dLLM's block variant with the prefix and dual caches (threshold and fixed steps).

Fixture: `tests/fixtures/dream-tiny-ref` (see README-reference.md, "Reference fixtures for Dream"). The reference
returns the prompt and every generated position (no EOS handling), as `generate(..., eos_early_stop=False)` does.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_dllm import DreamModel
from tests.conftest import FIXTURES, reference_fixtures

DREAM = FIXTURES / "dream-tiny-ref"
CASES = json.loads((DREAM / "cases.json").read_text())["cases"]


dream, expected = reference_fixtures(DREAM, DreamModel)


def generate_kwargs(case: dict) -> dict:
    """The call that must reproduce `case`, in `generate()` terms (Dream's names for Dream's settings)."""
    ref = case["kwargs"]
    kwargs = dict(max_new_tokens=ref["max_new_tokens"], temperature=ref["temperature"], eos_early_stop=False)
    if case["function"] == "diffusion_generate":
        kwargs.update(block_length=ref["max_new_tokens"], use_cache=False)
    else:
        kwargs.update(block_length=ref["block_length"], use_cache=True, dual_cache=ref["dual_cache"])
    if ref["alg"] == "confidence_threshold":
        kwargs.update(alg="confidence_threshold", threshold=ref["threshold"])
    else:
        kwargs.update(steps=ref["steps"], alg=ref["alg"], alg_temp=ref["alg_temp"])
    return kwargs


def test_the_fixture_covers_both_references():
    functions = [case["function"] for case in CASES]
    assert (functions.count("diffusion_generate"), functions.count("fastdllm_block")) == (72, 60)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_reference_case(dream, expected, case):
    prompt = expected[f"prompt.{case['prompt']}"]
    out = dream.generate(prompt, return_dict_in_generate=True, **generate_kwargs(case))
    reference = expected[f"case.{case['name']}"]
    assert out.sequences.shape == reference.shape
    assert torch.equal(out.sequences, reference), (out.sequences != reference).nonzero().tolist()
    assert out.nfe <= case["nfe"]
    assert out.nfe_per_row.tolist() == [out.nfe] * prompt.shape[0]


@pytest.mark.parametrize(
    "case", [case for case in CASES if case["function"] == "diffusion_generate" and case["kwargs"]["steps"] == 16]
)
def test_diffusion_generate_alias_reproduces_dream(dream, expected, case):
    """Dream's own entry point with Dream's arguments exactly as recorded (no hf_dllm settings)."""
    out = dream.diffusion_generate(expected[f"prompt.{case['prompt']}"], **case["kwargs"])
    assert torch.equal(out.sequences, expected[f"case.{case['name']}"])
    assert out.nfe <= case["nfe"]
