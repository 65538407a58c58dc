"""LLaDA2.2's Levenshtein editing on CUDA (issue #63: every fixture case token-exact on CPU and CUDA): a subset of
the SGLang-recorded cases of `tests/fixtures/llada22-tiny-ref` in float32 on CUDA, alone with the exact block cache
(the default; CUDA graphs on) and four prompts per left-padded batch without a cache, each with SGLang's tokens and
forwards (`test_llada22.py` runs every case on the CPU). `HF_DLLM_ALL_CASES=1` runs every case on CUDA too."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_dllm  # noqa: F401  (registers llada2_moe)
from tests.conftest import FIXTURES
from tests.models.llada2.test_llada22 import generate_kwargs

LLADA22 = FIXTURES / "llada22-tiny-ref"
META = json.loads((LLADA22 / "cases.json").read_text())
MASK, EOS = META["mask_token_id"], META["eos_token_id"]
FORBIDDEN = torch.tensor([MASK, META["delete_token_id"], META["split_token_id"]])
# Every eighth case, and each whose EOS lies past `max_new_tokens` in a block SGLang cut at the length.
SUBSET = [
    case
    for index, case in enumerate(META["cases"])
    if os.environ.get("HF_DLLM_ALL_CASES") == "1" or index % 8 == 0 or case["eos_after_length"]
]


def mismatch(generated: torch.Tensor, nfe: int, case: dict, expected: dict) -> str | None:
    """Why `generated` `(max_new_tokens,)` (CPU) and `nfe` are not SGLang's (None when they are): its tokens cut
    after the first EOS and EOS-filled after it, no MASK / DELETE / SPLIT, its forwards less the persist forwards."""
    want = expected[f"case.{case['name']}"][0]
    count = want.shape[0]
    if not torch.equal(generated[:count], want):
        return f"{case['name']}: {int((generated[:count] != want).sum())} tokens differ"
    if count < generated.shape[0] and not (generated[count:] == EOS).all():
        return f"{case['name']}: not EOS after the end"
    if torch.isin(generated, FORBIDDEN).any():
        return f"{case['name']}: a mask or edit token in the output"
    if nfe != case["nfe"] - case["persist_forwards"]:
        return f"{case['name']}: {nfe} forwards, SGLang {case['nfe']} - {case['persist_forwards']}"
    return None


@pytest.fixture(scope="module")
def model_and_expected():
    model = AutoModelForCausalLM.from_pretrained(LLADA22, dtype=torch.float32).cuda().eval()
    return model, load_file(LLADA22 / "expected.safetensors")


@pytest.mark.gpu
def test_gpu_cases_alone_with_the_exact_cache(model_and_expected):
    model, expected = model_and_expected
    failures = []
    for case in SUBSET:
        prompt = expected[f"prompt.{case['prompt']}"].cuda()
        out = model.generate(prompt, **generate_kwargs(case))
        failures.append(mismatch(out.sequences[0, prompt.shape[1] :].cpu(), out.nfe, case, expected))
    assert not [failure for failure in failures if failure], failures


@pytest.mark.gpu
def test_gpu_cases_in_left_padded_batches_without_cache(model_and_expected):
    model, expected = model_and_expected
    groups: dict[str, list[dict]] = defaultdict(list)
    for case in META["cases"]:
        groups[case["name"].split(".", 1)[1]].append(case)
    names = {case["name"] for case in SUBSET}
    failures = []
    chosen = [group for group in groups.values() if any(case["name"] in names for case in group)]
    for cases in chosen if os.environ.get("HF_DLLM_ALL_CASES") == "1" else chosen[:8]:
        prompts = [expected[f"prompt.{case['prompt']}"][0] for case in cases]
        width = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(prompts), width), EOS, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
        run = model.generate_blocks(
            ids.cuda(), attention_mask=mask.cuda(), **generate_kwargs(cases[0], use_cache=False)
        )
        for _ in run:
            pass
        for row, case in enumerate(cases):
            nfe = int(run.nfe_per_row[row])
            failures.append(mismatch(run.sequences[row, width:].cpu(), nfe, case, expected))
    assert not [failure for failure in failures if failure], failures


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_edit_candidates_match_the_pytorch_passes(dtype):
    """`triton_ops.edit_candidates` (the Levenshtein step's one read of the logits on CUDA) at a batch-1 block step's
    shape and LLaDA2.2's vocabulary and ids: the tokens of PyTorch's argmax passes, their softmax probabilities."""
    from hf_dllm.kernels import set_kernel_mode
    from hf_dllm.levenshtein_editing import LevenshteinEditing

    ids = dict(mask_token_id=156895, delete_token_id=156930, split_token_id=156931)
    policy = LevenshteinEditing(0.7, 0.5, 16, **ids)
    logits = torch.randn(1, 32, 157184, device="cuda").to(dtype)
    logits[0, 0, ids["mask_token_id"]] = 40.0  # MASK first, then DELETE, then SPLIT
    logits[0, 1, [ids["mask_token_id"], ids["delete_token_id"], ids["split_token_id"]]] = 40.0
    logits[0, 2, [3, 150000]] = 40.0  # a tie across splits: the first index
    fused = policy.candidates(logits)
    set_kernel_mode("torch")
    try:
        tokens, probability = policy.candidates(logits)
    finally:
        set_kernel_mode("auto")
    assert torch.equal(fused[0], tokens)
    assert torch.allclose(fused[1], probability, rtol=1e-5, atol=1e-7)
