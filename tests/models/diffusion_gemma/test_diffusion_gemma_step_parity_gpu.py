"""DiffusionGemma's denoising step on CUDA in bfloat16 against transformers' own step (`gemma_step.py`), same inputs
and injected draws (seed parity of whole runs is not expected on the GPU: another generator, bf16 rounding):

- logits: per position (max over the vocabulary), ours' error against transformers' float32 step is within 2x of
  transformers' own bfloat16 error (mean and 90th percentile);
- decisions (argmax, accepted set, next canvas, finished rows) equal to transformers' bfloat16 step wherever the
  two steps' actual logit difference cannot reach a decision boundary (`fragile_positions`);
- and overall, where it can: ours differs from transformers' bf16 step at no more positions than 2x transformers'
  own bf16-vs-float32 changes (+1% of the positions).

The tiny fixture's logits are large (sharpened, |l| up to the soft cap 30), so bf16 moves them by ~0.3 and most
positions count as near a boundary: the last bound is the one that carries weight there. The report is printed
(`pytest -s`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import hf_dllm  # noqa: F401  (registers the family)
from tests.conftest import FIXTURES
from tests.models.diffusion_gemma.gemma_step import bf16_step_report, make_inputs, skip_unless_reference_step_runs

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"
SETTINGS = dict(
    max_denoising_steps=16,
    sampler_config={"entropy_bound": 0.5},
    t_min=0.4,
    t_max=0.8,
    stability_threshold=1,
    confidence_threshold=1.0,
)

pytestmark = pytest.mark.gpu


def test_bf16_step_matches_transformers_within_its_own_error():
    skip_unless_reference_step_runs()
    reference = pytest.importorskip("transformers.models.diffusion_gemma")
    tf_class = reference.DiffusionGemmaForBlockDiffusion
    ours = AutoModel.from_pretrained(GEMMA_DIR, dtype=torch.bfloat16).eval().cuda()
    tf_bf16 = tf_class.from_pretrained(GEMMA_DIR, dtype=torch.bfloat16).eval().cuda()
    tf_fp32 = tf_class.from_pretrained(GEMMA_DIR).eval().cuda()
    expected = load_file(GEMMA_DIR / "expected.safetensors")
    cases = []
    for prompt, mask in (("b2", expected["attention_mask.b2"]), ("p21", None)):
        for seed in range(4):
            for steps_left in (16, 7, 2):
                finished = torch.tensor([seed % 2 == 1, False]) if prompt == "b2" and steps_left < 16 else None
                inputs = make_inputs(
                    expected[f"prompt.{prompt}"], mask, 320, 16, SETTINGS, steps_left, seed=seed, finished=finished
                )
                cases.append(inputs.to("cuda"))
    report = bf16_step_report(ours, tf_bf16, tf_fp32, cases)
    print("\nDiffusionGemma bf16 step parity:", json.dumps(report))
    assert report["ours_logit_error_mean"] <= 2 * report["transformers_logit_error_mean"] + 1e-3
    for ours_q, reference_q in zip(
        report["ours_logit_error_q50_q90"], report["transformers_logit_error_q50_q90"], strict=True
    ):
        assert ours_q <= 2 * reference_q + 1e-3
    assert report["position_mismatches"] == 0 and report["row_mismatches"] == 0
    assert report["ours_vs_bf16"] <= 2 * report["bf16_vs_fp32"] + 0.01 * report["positions"]
