"""GPU tests of LLaDA2's fused MoE / attention kernels (`triton_moe.py`), skipped without CUDA.

- The router kernel chooses exactly the experts of the PyTorch gate (LLaDA2.0-mini's routing: 256 experts, top-8
  in 4 of 8 groups, sigmoid, expert bias in float32 or bfloat16), with weights within float32 rounding.
- Both alignments by expert equal a stable argsort; the combine equals the PyTorch weighted sum in bfloat16.
- The norm's float32 copy for the router is its output widened; the q/k norm + RoPE + cache write kernel matches
  the PyTorch ops at LLaDA2.0-mini's head layout.
- The split-KV attention with a mask per query row matches float64 attention.
- A bfloat16 model's logits through the fused path (prefill and a cached block step) err against the float32 PyTorch
  path within twice the bfloat16 PyTorch path's error, and `generate()` with CUDA graphs gives exactly the tokens of
  the same path run eagerly.
- Without an EOS id, a call of 8 blocks makes the host wait for the GPU as often as a call of 2.
"""

from __future__ import annotations

import pytest
import torch

import hf_dllm
from hf_dllm import kernels, triton_moe
from hf_dllm.cache import DiffusionKVCache
from hf_dllm.llada2_moe_layer import LLaDA2MoeGate
from tests.generation.test_gpu import assert_blocks_add_no_host_syncs

pytestmark = pytest.mark.gpu
MINI_ROUTING = dict(num_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8, routed_scaling_factor=2.5)


def tiny_config(**overrides) -> hf_dllm.LLaDA2MoeConfig:
    fields = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, moe_intermediate_size=64, num_shared_experts=1, first_k_dense_replace=1,
        partial_rotary_factor=0.5, use_qk_norm=True, moe_router_enable_expert_bias=True, mask_token_id=511,
        eos_token_id=510, pad_token_id=510, **MINI_ROUTING,
    )  # fmt: skip
    fields.update(overrides)
    return hf_dllm.LLaDA2MoeConfig(**fields)


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_router_kernel_chooses_the_gates_experts(score_function):
    torch.manual_seed(0)
    gate = LLaDA2MoeGate(tiny_config(hidden_size=2048, score_function=score_function)).cuda()
    gate.weight.data.normal_(0, 0.02)
    gate.expert_bias.normal_(0, 0.01)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    ref_index, ref_weight, ref_logits = gate(x)
    index, weight, logits = gate.fused_forward(x)
    assert torch.equal(logits, ref_logits)
    same = (index == ref_index).all(-1)
    if score_function == "sigmoid":  # CUDA's expf and IEEE division: the same scores, the same choice
        assert same.all(), f"{(~same).sum()} of 4096 tokens chose differently"
    else:  # softmax: the sum's order differs, so scores may differ in the last bit
        assert same.float().mean() > 0.999
    assert torch.allclose(weight[same], ref_weight[same], rtol=1e-5, atol=1e-6)
    # The router input in float32 as the fused norm writes it: the same logits, no cast.
    assert torch.equal(gate.fused_forward(x.float())[2], ref_logits)
    # A bfloat16 expert bias (a bfloat16 model's buffer) is read in its dtype and widened as PyTorch promotes it.
    gate.expert_bias = gate.expert_bias.bfloat16()
    ref_index, ref_weight, _ = gate(x)
    index, weight, _ = gate.fused_forward(x)
    same = (index == ref_index).all(-1)
    assert same.all() if score_function == "sigmoid" else same.float().mean() > 0.999
    assert torch.allclose(weight[same], ref_weight[same], rtol=1e-5, atol=1e-6)


def test_half_precision_router_gives_the_float32_logits():
    """A bfloat16 gate weight and bfloat16 inputs (a bfloat16 model) are multiplied on the tensor cores with float32
    output: the float32 product of the widened operands up to the order of the sums, and the same experts for all
    but near-tied tokens; the norm then writes no float32 copy for it."""
    torch.manual_seed(0)
    gate = LLaDA2MoeGate(tiny_config(hidden_size=2048)).cuda()
    gate.weight.data.normal_(0, 0.02)
    gate.expert_bias.normal_(0, 0.01)
    gate.to(torch.bfloat16)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    assert gate.takes_input_dtype(torch.bfloat16, x.device)
    assert not gate.takes_input_dtype(torch.float32, x.device)
    float_logits = torch.nn.functional.linear(x.float(), gate.weight.float())
    index, _, logits = gate.fused_forward(x)
    assert logits.dtype == torch.float32
    assert (logits - float_logits).abs().max() <= 1e-5 * float_logits.abs().max()
    ref_index, _, _ = gate(x.float())  # the float32 product the weight's float32 copy gives (PyTorch path)
    same = (index == ref_index).all(-1)
    assert same.float().mean() > 0.999, f"{(~same).sum()} of 4096 tokens chose differently"


@pytest.mark.parametrize("tokens", [1, 100, 1024, 16384])
def test_both_alignments_agree(tokens):
    torch.manual_seed(tokens)
    topk = torch.randint(0, 256, (tokens, 8), device="cuda")
    for shared in (False, True):
        per_expert = triton_moe._align_per_expert(topk, 256, shared)
        chunks = triton_moe._align_by_chunks(topk, 256, shared)
        for a, b in zip(per_expert, chunks, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("tokens", [1, 32, 1024, 4096])
@pytest.mark.parametrize("shared", [False, True])
def test_align_and_combine(tokens, shared):
    torch.manual_seed(tokens)
    topk = torch.randint(0, 256, (tokens, 8), device="cuda")
    sorted_token, offsets, rows = triton_moe.align_by_expert(topk, 256, shared)
    per_token = 8 + shared
    flat = torch.cat([topk, torch.full((tokens, 1), 256, device="cuda")], 1) if shared else topk
    order = flat.reshape(-1).argsort(stable=True)
    assert torch.equal(sorted_token, order // per_token)
    assert torch.equal(offsets.long(), torch.bincount(flat.reshape(-1), minlength=256 + shared).cumsum(0))
    assert torch.equal(rows, order.argsort().view(tokens, per_token))
    expert_rows = torch.randn(tokens * per_token, 2048, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(tokens, 8, device="cuda")
    residual = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    out = triton_moe.combine(expert_rows, rows, weight, shared, residual)
    routed = (expert_rows[rows[:, :8]].float() * weight[..., None]).sum(1).to(torch.bfloat16)
    ref = residual + (routed + expert_rows[rows[:, 8]] if shared else routed)
    assert (out.float() - ref.float()).abs().max() <= 0.07  # one bfloat16 step at |x| ~ 8, summation order


def test_rms_norm_float_copy_is_the_output_widened():
    from hf_dllm import triton_ops

    torch.manual_seed(0)
    x, residual = torch.randn(2, 1024, 2048, device="cuda", dtype=torch.bfloat16).unbind(0)
    weight = torch.rand(2048, device="cuda", dtype=torch.bfloat16)
    normed, total, wide = triton_ops.rms_norm(x, weight, 1e-6, residual=residual, float_copy=True)
    ref_normed, ref_total = triton_ops.rms_norm(x, weight, 1e-6, residual=residual)
    assert torch.equal(normed, ref_normed) and torch.equal(total, ref_total)
    assert wide.dtype == torch.float32 and torch.equal(wide, normed.float())


def test_qk_norm_rope_to_cache_matches_pytorch():
    """The fused q/k norm + partial RoPE + cache write at LLaDA2.0-mini's head layout (16 q heads, 4 k/v heads of 128,
    64 rotary dims; several heads per program) against the PyTorch ops: the same values up to rounding, keys and
    values at the right cache columns, other columns untouched."""
    from hf_dllm.modeling_llada2_moe import apply_partial_rotary_pos_emb, rotary_cos_sin

    torch.manual_seed(0)
    batch, q_len, heads, kv_heads, dim, columns, eps = 3, 32, 16, 4, 128, 96, 1e-6
    qkv = torch.randn(batch, q_len, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
    q_weight, k_weight = (torch.rand(2, dim, device="cuda") + 0.5).to(torch.bfloat16).unbind(0)
    position = torch.arange(40, 40 + q_len, device="cuda")
    cos, sin = rotary_cos_sin(position.expand(batch, q_len), tiny_config(head_dim=dim), torch.bfloat16)
    keys = torch.zeros(batch, kv_heads, columns, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    query = triton_moe.qk_norm_rope_to_cache(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin, keys, values,
                                             position)  # fmt: skip

    def rms_norm(x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    q, k, v = qkv.view(batch, q_len, -1, dim).split([heads, kv_heads, kv_heads], dim=2)
    ref_q, ref_k = apply_partial_rotary_pos_emb(
        rms_norm(q.transpose(1, 2), q_weight), rms_norm(k.transpose(1, 2), k_weight), cos, sin
    )
    for ours, ref in ((query, ref_q), (keys[:, :, 40:72], ref_k)):
        # A misplaced head or column would be off by O(1) nearly everywhere; rounding, by an ulp of a term here and
        # there (a difference of two rounded products can cancel).
        error = (ours.float() - ref.float()).abs()
        assert error.max() <= 0.25 and error.mean() <= 2e-2, (error.max(), error.mean(), (ours == ref).float().mean())
    assert torch.equal(values[:, :, 40:72], v.transpose(1, 2))
    assert not keys[:, :, :40].any() and not keys[:, :, 72:].any() and not values[:, :, 72:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("batch", [3, 32])  # 32: LLaDA2.0-mini's batch-32 step, where the keys are not split
@pytest.mark.parametrize("with_kv_end", [False, True])
def test_block_attention_with_a_mask_per_query(dtype, splits, batch, with_kv_end):
    """LLaDA2.0-mini's block step (16 / 4 heads of 128, 32 queries at column 512 of 768, block-causal, one row
    left-padded) through the grouped-query tiles, with and without `kv_end`: within twice the error of PyTorch's
    attention in the same dtype against float64 (a float32 floor of 1e-5)."""
    from hf_dllm.modeling_llada2_moe import visible_key_end
    from hf_dllm.triton_attention import block_attention

    torch.manual_seed(batch)
    q = torch.randn(batch, 16, 32, 128, device="cuda", dtype=dtype)
    k, v = torch.randn(2, batch, 4, 768, 128, device="cuda", dtype=dtype).unbind(0)
    columns, rows = torch.arange(768, device="cuda"), torch.arange(512, 544, device="cuda")
    mask = (columns[None, :] // 32 <= rows[:, None] // 32).expand(batch, 32, 768).clone()
    mask[1, :, :100] = False
    kv_end = visible_key_end(mask[:, None]) if with_kv_end else None
    if with_kv_end:
        assert kv_end.tolist() == [544] * batch
    out = block_attention(q, k, v, mask, n_splits=splits, kv_end=kv_end)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask[:, None], enable_gqa=True
    ).transpose(1, 2)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    torch_error = (torch_out.transpose(1, 2).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * torch_error + 1e-5


def run_block_steps(model, ids, block):
    """Logits of a prefill `(3, 64)` and of a cached block step `(3, 32)`, and layer 2's cached keys."""
    cache = DiffusionKVCache(3, 3, 96)
    with torch.no_grad():
        prefill = model(
            ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(64, device="cuda"), block_length=32
        ).logits
        step = model(
            block,
            past_key_values=cache,
            use_cache=True,
            block_length=32,
            cache_position=torch.arange(64, 96, device="cuda"),
        ).logits
    return prefill.float(), step.float(), cache.keys[2][:, :, :96].float()


@pytest.mark.parametrize("attn_implementation", ["llada_triton", "sdpa"])
@pytest.mark.parametrize("num_shared_experts", [1, 2])
def test_fused_model_error_within_twice_the_pytorch_paths(num_shared_experts, attn_implementation):
    """bfloat16 logits (prefill and a cached block step) and cached keys through the fused path: their error against
    the float32 PyTorch path is within twice the bfloat16 PyTorch path's own error (flash-attention's test rule;
    exact token equality is not a bfloat16 property)."""
    torch.manual_seed(0)
    model = hf_dllm.LLaDA2MoeModelLM(tiny_config(num_shared_experts=num_shared_experts))
    model.set_attn_implementation(attn_implementation)
    for name, param in model.named_parameters():
        if "layernorm" in name:
            param.data.normal_(1, 0.2)
    model = model.to("cuda").eval()
    ids, block = torch.randint(0, 500, (3, 64), device="cuda"), torch.randint(0, 500, (3, 32), device="cuda")
    try:
        kernels.set_kernel_mode("torch")
        reference = run_block_steps(model, ids, block)
        model.to(torch.bfloat16)
        pytorch_bf16 = run_block_steps(model, ids, block)
        kernels.set_kernel_mode("triton")
        fused_bf16 = run_block_steps(model, ids, block)
    finally:
        kernels.set_kernel_mode("auto")
    for name, ref, torch_out, fused_out in zip(
        ("prefill", "step", "keys"), reference, pytorch_bf16, fused_bf16, strict=True
    ):
        torch_error = (torch_out - ref).abs().max().item()
        fused_error = (fused_out - ref).abs().max().item()
        assert fused_error <= 2 * torch_error + 1e-3 * ref.abs().max().item(), (name, fused_error, torch_error)


def test_graphs_equal_eager_through_the_fused_path():
    torch.manual_seed(0)
    model = hf_dllm.LLaDA2MoeModelLM(tiny_config()).to("cuda", torch.bfloat16).eval()
    prompts = torch.randint(0, 500, (2, 40), device="cuda")
    kwargs = dict(max_new_tokens=64, block_length=32, steps=32, mask_token_id=511, eos_early_stop=False)
    graphs = model.generate(prompts, **kwargs)
    eager = model.generate(prompts, **kwargs, disable_compile=True)
    assert torch.equal(graphs, eager)


def test_no_host_synchronisation_between_blocks_without_eos():
    """Block-causal rows end after a block holding an EOS (one host check per block); without an EOS id every
    block's steps are known in advance and the host never waits for the GPU between blocks."""
    torch.manual_seed(0)
    model = hf_dllm.LLaDA2MoeModelLM(tiny_config(eos_token_id=None)).to("cuda", torch.bfloat16).eval()
    prompts = torch.randint(0, 500, (2, 40), device="cuda")

    def call(blocks: int):
        return lambda: model.generate(
            prompts, max_new_tokens=32 * blocks, block_length=32, steps=32 * blocks, mask_token_id=511,
            eos_early_stop=False,
        )  # fmt: skip

    assert_blocks_add_no_host_syncs(call)


@pytest.mark.parametrize("tokens", [32, 1024])
def test_every_grouped_config_in_bf16_within_twice_torch_error(tokens):
    """The experts' grouped bf16 products (`grouped_gemm.grouped_matmul`, every config the autotuner may pick that
    fits the shared memory in bf16, in both grid orders, the pinned ones, and its own choice) at LLaDA2.0-mini's
    widths (64 experts, top-8; gate/up with the SiLU gate and the rows gathered, down): the error against the
    float32 product within twice PyTorch's bf16 per-group products' error."""
    from hf_dllm import grouped_gemm
    from tests.kernels.test_fp8 import grouped_errors

    configs = [None, *grouped_gemm.autotuned_configs()]  # the pins outside grouped_configs() too
    for gated, k_in, n_out in ((True, 2048, 512), (False, 512, 2048)):
        torch.manual_seed(tokens)
        errors, reference = grouped_errors(
            tokens, 64, 8, k_in, n_out, gated, torch.bfloat16, "cuda", configs, fp8_weights=False
        )
        assert errors[0] is not None and sum(e is not None for e in errors) > len(configs) // 2
        for config, error in zip(configs, errors, strict=True):
            assert error is None or error <= 2 * reference + 1e-3, (gated, config, error, reference)
