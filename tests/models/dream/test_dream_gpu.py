"""GPU tests of Dream's fast path (skipped without CUDA).

- Every greedy Dream rule (Dream's `maskgit_plus` / `topk_margin` / `entropy` schedule, also with `top_p` / `top_k`
  filtering, and Fast-dLLM's confidence threshold) runs its steps through CUDA graphs, and the graph path gives
  exactly the tokens and forward counts of the eager path (`disable_compile=True`) of the same dtype: without a
  cache (Dream's own sampler), with the prefix and the dual cache (Fast-dLLM's), at batch 1 and at batch 4 with
  left padding, with `sdpa` and with hf_dllm's attention backend (whose split-KV kernel runs for these block
  steps).
- The rules that draw random numbers (`origin`, `alg_temp` > 0) run eagerly.
- The fused Triton kernels (RMSNorm with the residual add, SiLU gate, RoPE with Dream's rounding writing K/V into
  the cache) run in Dream's forward on CUDA, with logits close to the PyTorch kernels'; the fused path (those
  kernels and the concatenated q/k/v and gate/up products) has a logit error against a float32 reference within 2x
  of PyTorch's own in the same dtype.
- The RoPE kernel equals Dream's PyTorch RoPE bit for bit in bf16/fp16 (it rounds where PyTorch rounds), also
  when it writes the keys/values into the cache and leaves the read-only columns alone.
- The concatenated projections keep the Hub's parameter names and save/reload exactly.
"""

from __future__ import annotations

import pytest
import torch

from hf_dllm import DreamConfig, DreamModel, kernels, triton_ops
from hf_dllm.cache import DiffusionKVCache
from hf_dllm.modeling_dream import apply_rotary_pos_emb, dream_rotary_cos_sin

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
    policy = model.diffusion_family.unmasking_policy(model.resolve_generation_config(**settings))
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
    calls = {"rms_norm": 0, "silu_mul": 0, "rounded_rotary": 0}
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
    # Per layer: two norms, one gate, one RoPE; the final norm.
    assert calls == {"rms_norm": 2 * layers + 1, "silu_mul": layers, "rounded_rotary": layers}
    real = mask.bool()
    assert (fused - plain)[real].abs().max() <= 0.05 * plain[real].abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rounded_rotary_equals_pytorch_and_writes_the_cache(dtype):
    torch.manual_seed(0)
    config = DreamConfig(hidden_size=28 * 128, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6)
    batch, length, heads, kv_heads, dim = 2, 33, 28, 4, 128
    qkv = torch.randn(batch, length, (heads + 2 * kv_heads) * dim, device=DEVICE, dtype=dtype) * 3
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)  # strided views, as in the model
    q, k, v = q.view(batch, length, heads, dim), k.view(batch, length, kv_heads, dim), v.view(batch, length, -1, dim)
    positions = torch.arange(length, device=DEVICE).expand(batch, -1) + torch.tensor([[0], [700]], device=DEVICE)
    cos, sin = dream_rotary_cos_sin(positions, config, dtype)
    theirs_q, theirs_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    ours_q, ours_k = triton_ops.rounded_rotary(q, k, v, cos, sin)
    if dtype == torch.float32:
        # float32: within 2x of PyTorch's own error against float64 (no fused multiply-add: equal in practice).
        ref_q, ref_k = apply_rotary_pos_emb(
            q.double().transpose(1, 2), k.double().transpose(1, 2), cos.double(), sin.double()
        )
        for ours, theirs, ref in ((ours_q.transpose(1, 2), theirs_q, ref_q), (ours_k, theirs_k, ref_k)):
            assert (ours.double() - ref).abs().max() <= 2 * (theirs.double() - ref).abs().max() + 1e-6
    else:
        assert torch.equal(ours_q.transpose(1, 2), theirs_q)
        assert torch.equal(ours_k, theirs_k)
    # Into a cache (3 rows held, 2 used; 600 columns) at scattered columns, the first (read-only) one skipped.
    cache_k = torch.full((3, kv_heads, 600, dim), 5.0, device=DEVICE, dtype=dtype)
    cache_v = torch.full_like(cache_k, 5.0)
    columns = torch.cat([torch.tensor([10], device=DEVICE), torch.arange(100, 100 + length - 1, device=DEVICE)])
    rotated_q, none = triton_ops.rounded_rotary(q, k, v, cos, sin, cache_k[:batch], cache_v[:batch], columns, skip=1)
    assert none is None and torch.equal(rotated_q, ours_q)
    expected_k, expected_v = torch.full_like(cache_k, 5.0), torch.full_like(cache_v, 5.0)
    expected_k[:batch, :, columns[1:]] = ours_k[:, :, 1:]
    expected_v[:batch, :, columns[1:]] = v.transpose(1, 2)[:, :, 1:]
    assert torch.equal(cache_k, expected_k) and torch.equal(cache_v, expected_v)


@pytest.mark.parametrize("attn", ["sdpa", "llada_triton"])
def test_fused_path_logit_error_within_twice_torch(attn):
    """The fused path (concatenated q/k/v and gate/up products, the Triton norms / gate / RoPE) in bf16 against
    the same weights in float32 with PyTorch kernels: its error is within 2x of PyTorch's bf16 error, on a forward
    without cache and on a dual-cache block step (the read-only column included)."""
    model = gpu_dream(attn)
    reference = gpu_dream("sdpa", dtype=torch.float32)
    reference.load_state_dict({name: tensor.float() for name, tensor in model.state_dict().items()})
    ids, mask = padded_prompts([40, 29])
    mode = kernels.kernel_mode()

    def run(net, kernel_mode, block=None):
        kernels.set_kernel_mode(kernel_mode)
        try:
            with torch.no_grad():
                if block is None:
                    return net(ids, attention_mask=mask).logits.float()
                # A dual-cache block step: the full forward fills the cache, then 9 columns (the one before the
                # block read-only) are recomputed against it.
                cache = DiffusionKVCache(net.config.num_hidden_layers, ids.shape[0], ids.shape[1])
                cache.set_length(ids.shape[1])
                net(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
                columns = torch.arange(block - 1, block + 8, device=DEVICE)
                step = ids.clone()
                step[:, block:] = MASK
                return net(
                    step[:, columns],
                    attention_mask=mask,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=columns,
                    cache_read_only=1,
                ).logits.float()
        finally:
            kernels.set_kernel_mode(mode)

    real = mask.bool()
    for block in (None, 24):
        exact = run(reference, "torch", block)
        ours = run(model, "auto", block)
        theirs = run(model, "torch", block)
        rows = real if block is None else real[:, block - 1 : block + 8]
        our_error = (ours - exact)[rows].abs().max().item()
        torch_error = (theirs - exact)[rows].abs().max().item()
        assert our_error <= 2 * torch_error + 1e-3, (block, our_error, torch_error)


def test_concatenated_projections_keep_names_and_save_reload_exactly(tmp_path):
    model = gpu_dream("llada_triton")
    names = list(model.state_dict())
    ids, _ = padded_prompts([6])
    model.generate(ids, max_new_tokens=16, block_length=8, threshold=0.9, dual_cache=True)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention._concatenated, "generate() multiplied no concatenated projection"
    weight, bias = attention.concatenated(("q_proj", "k_proj", "v_proj"))
    assert attention.q_proj.weight.data_ptr() == weight.data_ptr()  # the parameters are views of the concatenation
    kv_width = attention.num_kv_heads * attention.head_dim
    assert attention.v_proj.bias.data_ptr() == bias[bias.numel() - kv_width :].data_ptr()
    gate_up, _ = mlp.concatenated(("gate_proj", "up_proj"))
    assert mlp.up_proj.weight.data_ptr() == gate_up[model.config.intermediate_size :].data_ptr()
    assert list(model.state_dict()) == names
    model.save_pretrained(tmp_path)
    reloaded = DreamModel.from_pretrained(tmp_path, dtype=torch.bfloat16).to(DEVICE)
    for (name, a), (other, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert name == other and torch.equal(a, b), name
