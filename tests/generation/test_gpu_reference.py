"""GPU tests of the reference parity and of LLaDA2's fast path (skipped without CUDA).

- Every recorded reference case (LLaDA, LLaDA2.0, LLaDA2.1) reproduces on CUDA in float32, with transformers' sdpa
  and with hf_dllm's `llada_triton` backend, CUDA graphs on.
- LLaDA2's CUDA-graph path gives exactly the tokens of its eager path (`disable_compile=True`) in bf16, for the
  exact cache and the full recompute, every decoding rule, with left padding; and on a model split over two GPUs
  the tokens of one GPU.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import hf_dllm
from tests.conftest import REFERENCE_DIR
from tests.generation.test_gpu import GPU_TOKENS, padded_prompts, sharp_random_model
from tests.models.llada.test_reference_parity import CASES as LLADA_CASES
from tests.models.llada.test_reference_parity import generate_kwargs as llada_kwargs
from tests.models.llada2.test_llada2_generation import CASES2, CASES21, LLADA2, LLADA21, assert_reference_tokens
from tests.models.llada2.test_llada2_generation import generate_kwargs as llada2_kwargs

pytestmark = pytest.mark.gpu
BACKENDS = ["sdpa", "llada_triton"]


@pytest.mark.parametrize("attn", BACKENDS)
def test_llada_reference_cases_on_cuda(attn):
    model = AutoModel.from_pretrained(REFERENCE_DIR, attn_implementation=attn).cuda().eval()
    expected = load_file(REFERENCE_DIR / "expected.safetensors")
    failures = []
    for case in LLADA_CASES:
        out = model.generate(expected[f"prompt.{case['prompt']}"].cuda(), **llada_kwargs(case))
        if not torch.equal(out.sequences.cpu(), expected[f"case.{case['name']}"]):
            failures.append(case["name"])
        elif case["nfe"] is not None and out.nfe > case["nfe"]:
            failures.append(f"{case['name']} (nfe {out.nfe} > {case['nfe']})")
    assert not failures, failures


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize("fixture", ["llada2", "llada21"])
def test_llada2_reference_cases_on_cuda(attn, fixture):
    folder, cases = (LLADA2, CASES2) if fixture == "llada2" else (LLADA21, CASES21)
    model = hf_dllm.LLaDA2MoeModelLM.from_pretrained(folder, attn_implementation=attn).cuda().eval()
    expected = load_file(folder / "expected.safetensors")
    failures = []
    for case in cases:
        prompt = expected[f"prompt.{case['prompt']}"]
        out = model.generate(prompt.cuda(), **llada2_kwargs(case, prompt.shape[1]))
        try:
            assert_reference_tokens(out.sequences.cpu(), prompt.shape[1], expected[f"case.{case['name']}"])
            assert out.nfe <= case["nfe"]
        except AssertionError as error:
            failures.append(f"{case['name']}: {error}")
    assert not failures, failures


def gpu_llada2(attn: str = "sdpa", dtype=torch.bfloat16, device: str = "cuda") -> hf_dllm.LLaDA2MoeModelLM:
    config = hf_dllm.LLaDA2MoeConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=128,
        num_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=1024,
        **GPU_TOKENS,
    )
    return sharp_random_model(hf_dllm.LLaDA2MoeModelLM, config, attn, dtype, device)


RULES = {
    "schedule": dict(steps=24),
    "threshold": dict(threshold=0.7),
    "steps+threshold": dict(steps=12, threshold=0.9),
    "editing": dict(threshold=0.7, editing_threshold=0.8, max_post_steps=4),
}


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize("use_cache", [True, False], ids=["exact_cache", "no_cache"])
@pytest.mark.parametrize("rule", list(RULES), ids=list(RULES))
def test_llada2_graph_path_tokens_equal_eager(attn, use_cache, rule):
    model = gpu_llada2(attn)
    ids, mask = padded_prompts([5, 19, 12])
    kwargs = dict(max_new_tokens=40, block_length=8, use_cache=use_cache, return_dict_in_generate=True, **RULES[rule])
    fast = model.generate(ids, attention_mask=mask, **kwargs)
    again = model.generate(ids, attention_mask=mask, **kwargs)  # replays graphs captured by the first call
    eager = model.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
    assert model._hf_dllm_step_graphs.steps, "the fast path captured no CUDA graph"
    assert torch.equal(fast.sequences, eager.sequences)
    assert torch.equal(again.sequences, eager.sequences)
    assert torch.equal(fast.nfe_per_row, eager.nfe_per_row)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("placement", ["auto", "by hand"])
def test_llada2_split_over_two_gpus_generates_the_same_tokens(tmp_path, placement):
    """The layers of a LLaDA2 model on two GPUs, placed by `device_map="auto"` (accelerate, by `_no_split_modules`,
    GPU 0 given room for about half of the weights) or by hand: generation (threshold, steps, LLaDA2.1 editing; the
    exact block-causal cache) gives the one-GPU tokens."""
    model = gpu_llada2(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    if placement == "auto":
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        options = dict(device_map="auto", max_memory={0: weights // 2, 1: 4 * weights})
    else:
        layers = model.config.num_hidden_layers
        device_map = {"model.word_embeddings": 0, "model.norm": 1, "lm_head": 1}
        device_map.update({f"model.layers.{i}": 0 if i < layers // 2 else 1 for i in range(layers)})
        options = dict(device_map=device_map)
    split = hf_dllm.LLaDA2MoeModelLM.from_pretrained(tmp_path, **options).eval()
    placed = {device for name, device in split.hf_device_map.items() if name.startswith("model.layers")}
    assert placed == {0, 1}, split.hf_device_map
    ids, mask = padded_prompts([7, 13])
    for kwargs in (dict(threshold=0.7), dict(steps=20), dict(threshold=0.7, editing_threshold=0.8)):
        common = dict(max_new_tokens=40, block_length=8, **kwargs)
        assert torch.equal(
            split.generate(ids, attention_mask=mask, **common).cpu(),
            model.generate(ids, attention_mask=mask, **common).cpu(),
        ), kwargs
