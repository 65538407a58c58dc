"""DiffusionGemma's denoising step against transformers' own step (`gemma_step.py`): the same canvas,
self-conditioning logits, step index, stopping history and injected draws give, in float32 on the CPU, the same
logits and exactly the same argmax, accepted set, next canvas and finished rows. The CUDA bfloat16 version is in
`test_diffusion_gemma_step_parity_gpu.py`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import hf_dllm  # noqa: F401  (registers the family)
from hf_dllm.decoding_diffusion_gemma import EntropyBoundSampler
from tests.conftest import FIXTURES
from tests.models.diffusion_gemma.gemma_step import (
    compare_decisions,
    fragile_positions,
    hf_dllm_step,
    make_inputs,
    skip_unless_reference_step_runs,
    transformers_step,
)

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"
# The fixture's `eb2` profile with a looser confidence threshold: several positions accepted per step, and a row
# that is stable can stop.
SETTINGS = dict(
    max_denoising_steps=8,
    sampler_config={"entropy_bound": 2.0},
    t_min=0.2,
    t_max=1.0,
    stability_threshold=1,
    confidence_threshold=0.8,
)


@pytest.fixture(scope="module")
def models():
    skip_unless_reference_step_runs()
    reference = pytest.importorskip("transformers.models.diffusion_gemma")
    return (
        AutoModel.from_pretrained(GEMMA_DIR).eval(),
        reference.DiffusionGemmaForBlockDiffusion.from_pretrained(GEMMA_DIR).eval(),
    )


@pytest.fixture(scope="module")
def expected():
    return load_file(GEMMA_DIR / "expected.safetensors")


def _inputs(expected, case):
    if case == "first":  # a canvas' first step: no self-conditioning, no history
        return make_inputs(expected["prompt.p21"], None, 320, 16, SETTINGS, steps_left=8, seed=0)
    # A padded batch mid-canvas: self-conditioning, row 0 frozen (finished earlier), row 1 live.
    return make_inputs(
        expected["prompt.b2"],
        expected["attention_mask.b2"],
        320,
        16,
        SETTINGS,
        steps_left=3,
        seed=1,
        finished=torch.tensor([True, False]),
    )


def _assert_same_step(ours, reference):
    torch.testing.assert_close(ours.logits, reference.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.processed, reference.processed, rtol=1e-5, atol=1e-5)
    for name in ("argmax", "canvas", "accepted", "finished"):
        assert torch.equal(getattr(ours, name), getattr(reference, name)), name


@pytest.mark.parametrize("case", ["first", "frozen_row"])
def test_step_matches_transformers_with_injected_draws(models, expected, case):
    ours_model, reference_model = models
    inputs = _inputs(expected, case)
    reference = transformers_step(reference_model, inputs)
    _assert_same_step(hf_dllm_step(ours_model, inputs), reference)
    live = ~inputs.finished
    accepted = reference.accepted[live]
    assert 0 < int(accepted.sum()) < accepted.numel()  # some sampled tokens kept, some renoised
    if case == "first":
        return
    assert torch.equal(reference.canvas[0], inputs.canvas[0])  # the finished row is frozen
    # Same history as the step's own argmax: the live row is stable, and confident at this temperature: it stops.
    stable = replace(inputs, history=reference.argmax[None].clone())
    reference = transformers_step(reference_model, stable)
    assert bool(reference.finished[live].all())
    _assert_same_step(hf_dllm_step(ours_model, stable), reference)


class _CumsumAcceptance(EntropyBoundSampler):
    """The README's deliberate bug: acceptance by `cumsum(H) <= bound` instead of the sum of the lower ones."""

    def accept(self, entropy):
        sorted_entropy, order = torch.sort(entropy, dim=-1)
        chosen = torch.cumsum(sorted_entropy, dim=-1) <= self.entropy_bound
        return torch.scatter(torch.zeros_like(chosen), -1, order, chosen)


def test_decision_check_catches_a_sampler_bug(models, expected):
    """The comparison is not vacuous: a wrong acceptance rule gives decisions that differ where no logit is near a
    boundary (the fragile-position analysis, with the actual logit difference, zero here, as tolerance)."""
    ours_model, reference_model = models
    inputs = _inputs(expected, "first")
    reference = transformers_step(reference_model, inputs)
    buggy = hf_dllm_step(ours_model, inputs, sampler_class=_CumsumAcceptance)
    fragile, rows = fragile_positions(reference, inputs, (buggy.processed - reference.processed).abs().amax(-1))
    assert int(fragile.sum()) == 0
    assert compare_decisions(buggy, reference, fragile, rows)["position_mismatches"] > 0
