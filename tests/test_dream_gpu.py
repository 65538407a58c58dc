"""GPU tests of Dream's fast path (skipped without CUDA).

- Every greedy Dream rule (Dream's `maskgit_plus` / `topk_margin` / `entropy` schedule, also with `top_p` / `top_k`
  filtering, and Fast-dLLM's confidence threshold) runs its steps through CUDA graphs, and the graph path gives
  exactly the tokens and forward counts of the eager path (`disable_compile=True`) of the same dtype: without a
  cache (Dream's own sampler), with the prefix and the dual cache (Fast-dLLM's), at batch 1 and at batch 4 with
  left padding, with `sdpa` and with hf_dllm's attention backend (whose split-KV kernel runs for these block
  steps).
- The rules that draw random numbers (`origin`, `alg_temp` > 0) run eagerly.
- The fused Triton kernels (RMSNorm with the residual add, SiLU gate) run in Dream's forward on CUDA, with logits
  close to the PyTorch kernels'.
"""

from __future__ import annotations

import pytest
import torch

from hf_dllm import DreamConfig, DreamModel, kernels, triton_ops

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
MASK, EOS, PAD = 999, 998, 997

RULES = {
    "maskgit_plus": dict(alg="maskgit_plus", steps=16),
    "topk_margin": dict(alg="topk_margin", steps=16),
    "entropy": dict(alg="entropy", steps=16),
    "entropy-top_p": dict(alg="entropy", steps=16, top_p=0.9),
    "threshold": dict(alg="confidence_threshold", threshold=0.7),
    "threshold-top_k": dict(threshold=0.7, top_k=20),
}
CACHES = {"none": dict(use_cache=False), "prefix": dict(dual_cache=False), "dual": dict(dual_cache=True)}
BATCHES = {"batch1": [11], "batch4-padded": [5, 19, 12, 9]}


def gpu_dream(attn: str, dtype=torch.bfloat16) -> DreamModel:
    """A small Dream (head size 64, 4 query heads per key/value head) with random weights on the device."""
    config = DreamConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=1e6,
        max_position_embeddings=1024,
        mask_token_id=MASK,
        eos_token_id=EOS,
        bos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = DreamModel._from_config(config, dtype=dtype, attn_implementation=attn)
    # A sharper head than random init so that confidences spread over (0, 1) and thresholds commit in parallel.
    model.lm_head.weight.data *= 40
    return model.eval()


@pytest.fixture(scope="module", params=["sdpa", "llada_triton"])
def dream(request):
    return gpu_dream(request.param)


def padded_prompts(lengths: list[int], vocab: int = 990) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts `(batch, longest)` and their attention mask."""
    torch.manual_seed(sum(lengths))
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, device=DEVICE)
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device=DEVICE)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(0, vocab, (length,), device=DEVICE)
        mask[row, width - length :] = 1
    return ids, mask


def forget_graphs(model: DreamModel) -> None:
    """Drop the model's graph runner, so that what a later call captures is its own."""
    runner = getattr(model, "_hf_dllm_step_graphs", None)
    if runner is not None:
        runner.release()
    model._hf_dllm_step_graphs = None


def assert_graphs_used(model: DreamModel, settings: dict) -> None:
    """The last call ran its steps through captured graphs of this rule (the runner's signature carries the
    policy's graph key)."""
    runner = getattr(model, "_hf_dllm_step_graphs", None)
    assert runner is not None and runner.steps, "the fast path captured no CUDA graph"
    policy = model._diffusion_unmasking_policy(model.resolve_generation_config(**settings))
    assert policy.graph_key() in runner.signature


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("rule", list(RULES))
def test_graph_path_tokens_equal_eager(dream, rule, cache, batch):
    ids, mask = padded_prompts(BATCHES[batch])
    kwargs = dict(
        max_new_tokens=32,
        block_length=8,
        eos_early_stop=False,
        return_dict_in_generate=True,
        **RULES[rule],
        **CACHES[cache],
    )
    mask = mask if len(BATCHES[batch]) > 1 else None
    forget_graphs(dream)
    fast = dream.generate(ids, attention_mask=mask, **kwargs)
    again = dream.generate(ids, attention_mask=mask, **kwargs)  # replays the graphs the first call captured
    assert_graphs_used(dream, kwargs)
    eager = dream.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
    assert not bool((eager.sequences == MASK).any())
    assert torch.equal(fast.sequences, eager.sequences)
    assert torch.equal(again.sequences, eager.sequences)
    assert fast.nfe == eager.nfe and torch.equal(fast.nfe_per_row, eager.nfe_per_row)


@pytest.mark.parametrize("settings", [dict(alg="origin", steps=16), dict(alg="entropy", steps=16, alg_temp=0.5)])
def test_random_rules_run_eagerly(dream, settings):
    ids, _ = padded_prompts([7])
    forget_graphs(dream)
    torch.manual_seed(0)
    out = dream.generate(ids, max_new_tokens=16, block_length=8, eos_early_stop=False, **settings)
    assert getattr(dream, "_hf_dllm_step_graphs", None) is None
    assert not bool((out == MASK).any())


def test_fused_kernels_run_and_logits_close_to_pytorch(monkeypatch):
    model = gpu_dream("sdpa")
    ids, mask = padded_prompts([7, 30])
    calls = {"rms_norm": 0, "silu_mul": 0}
    for name in calls:
        kernel = getattr(triton_ops, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_ops, name, counted)
    mode = kernels.kernel_mode()
    with torch.no_grad():
        fused = model(ids, attention_mask=mask).logits.float()
        kernels.set_kernel_mode("torch")
        try:
            plain = model(ids, attention_mask=mask).logits.float()
        finally:
            kernels.set_kernel_mode(mode)
    layers = model.config.num_hidden_layers
    assert calls == {"rms_norm": 2 * layers + 1, "silu_mul": layers}  # per layer: two norms, one gate; final norm
    real = mask.bool()
    assert (fused - plain)[real].abs().max() <= 0.05 * plain[real].abs().max()
