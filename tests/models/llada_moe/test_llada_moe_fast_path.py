"""LLaDA-MoE's fast path (issue #63, item 4): FP8 weights through the family's skip list, and on CUDA the experts
on hf_dllm's Triton MoE kernels (LLaDA2's: `triton_moe.py` routing / alignment / combine, `grouped_gemm.py`'s
grouped products, bf16 or FP8), the reference fixture's cases exact in float32 on CUDA.

On the CPU: a model quantized by transformers' `FineGrainedFP8Config` with `fp8_quantization_config("llada_moe")`
keeps the `experts` list of Hub-named FP8 layers (not transformers' fused `FP8Experts`) and the router in the model's
dtype, computes what the dequantized weights compute, and stacks its FP8 weights and scales for the grouped kernel.
The fused kernels against the PyTorch path on the CPU run in Triton's interpreter (`test_llada2_kernels.py`).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from hf_dllm import fp8
from hf_dllm.configuration_llada_moe import LLaDAMoEConfig
from hf_dllm.kernels import set_kernel_mode
from hf_dllm.modeling_llada_moe import LLaDAMoEModelLM, rotary_cos_sin
from tests.conftest import FIXTURES, assert_quantized_from, random_weights_model
from tests.models.llada_moe.test_llada_moe import generate_kwargs

FIXTURE = FIXTURES / "lladamoe-tiny-ref"
BLOCK = (128, 128)


def random_config(**overrides) -> LLaDAMoEConfig:
    """A small LLaDA-MoE whose every projection is a whole number of 128 x 128 FP8 blocks (transformers leaves a
    narrower one unquantized but still expects its scales when loading): a dense first layer, then a MoE layer."""
    values = dict(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        expert_intermediate_size=128,
        dense_intermediate_size=256,
        vocab_size=320,
        moe_layer_freq=[0, 1],
        qk_layernorm=True,
        max_position_embeddings=256,
        pad_token_id=301,
        eos_token_id=301,
    )
    return LLaDAMoEConfig(**(values | overrides))


def random_model(config: LLaDAMoEConfig, dtype=torch.bfloat16, device="cpu") -> LLaDAMoEModelLM:
    """Random weights spread so that routing is not uniform."""
    return random_weights_model(LLaDAMoEModelLM, config, dtype=dtype, device=device, noise=0.05)


def quantized_copy(model: LLaDAMoEModelLM, device="cpu") -> LLaDAMoEModelLM:
    return LLaDAMoEModelLM.from_pretrained(
        None,
        config=model.config,
        state_dict=model.state_dict(),
        quantization_config=fp8.fp8_quantization_config("llada_moe"),
        dtype=model.dtype,
        device_map=device,
    ).eval()


def dequantized_copy(quantized: LLaDAMoEModelLM, device="cpu") -> LLaDAMoEModelLM:
    """A model of the same dtype whose weights are the quantized model's, dequantized."""
    state, plain = quantized.state_dict(), {}
    for name, tensor in state.items():
        if name.endswith("weight_scale_inv"):
            continue
        if tensor.dtype == fp8.FP8_DTYPE:
            tensor = fp8.dequantize(tensor, state[name + "_scale_inv"], BLOCK, quantized.dtype)
        plain[name] = tensor
    with torch.device(device):
        copy = LLaDAMoEModelLM._from_config(quantized.config, dtype=quantized.dtype).eval()
    copy.load_state_dict(plain)
    return copy


@pytest.fixture
def cpu_quantization(monkeypatch):
    # transformers quantizes on CUDA/XPU only; its quantization math is plain torch, so the CPU tests lift the check.
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)


def test_fp8_model_keeps_hub_names_and_matches_dequantized_weights(cpu_quantization, tmp_path):
    """Attention, dense MLP and every expert's layers in FP8 under the Hub's names; the router and the head in bf16;
    the logits those of the dequantized weights; the stacks of the grouped kernel hold the FP8 weights and scales
    (the experts' parameters are views of them); saved and loaded again, the same logits."""
    source = random_model(random_config())
    quantized = quantized_copy(source)
    assert_quantized_from(source.state_dict(), quantized.state_dict(), BLOCK)  # the source's weights, quantized once
    moe = quantized.model.layers[1].mlp
    assert isinstance(moe.experts, torch.nn.ModuleList)
    assert moe.gate.weight.dtype == torch.bfloat16 and quantized.lm_head.weight.dtype == torch.bfloat16
    for layer in (moe.experts[5].gate_proj, moe.experts[5].down_proj, quantized.model.layers[0].mlp.up_proj):
        assert fp8.is_fp8_linear(layer), layer
    assert quantized.model.layers[1].self_attn.q_proj.weight.dtype == fp8.FP8_DTYPE
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        logits = quantized(ids).logits.float()
        expected = dequantized_copy(quantized)(ids).logits.float()
    assert torch.allclose(logits, expected, atol=2e-2, rtol=0), (logits - expected).abs().max()

    stacks = moe.stacks()
    assert stacks.gate_up.dtype == fp8.FP8_DTYPE and stacks.block_size == BLOCK
    assert stacks.gate_up.shape == (8, 256, 128) and stacks.gate_up_scale.shape == (8, 2, 1)
    assert stacks.down_scale.shape == (8, 1, 1)
    assert moe.experts[3].up_proj.weight_scale_inv.data_ptr() == stacks.gate_up_scale[3, 1:].data_ptr()
    assert moe.experts[7].down_proj.weight.data_ptr() == stacks.down[7].data_ptr()

    quantized.save_pretrained(tmp_path / "fp8")
    reloaded = LLaDAMoEModelLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16).eval()
    assert fp8.is_fp8_linear(reloaded.model.layers[1].mlp.experts[6].up_proj)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits.float(), logits)


def test_fp8_model_generates_with_the_dual_cache(cpu_quantization):
    quantized = quantized_copy(random_model(random_config()))
    prompt = torch.randint(0, 300, (1, 8))
    out = quantized.generate(
        prompt, max_new_tokens=8, block_length=4, threshold=0.9, use_cache=True, dual_cache=True, mask_token_id=310
    )
    assert out.shape == (1, 16) and not (out == 310).any()


def test_next_norm_is_left_to_its_module_off_the_fused_path():
    """A MoE block asked for the next norm where the fused kernels do not run returns None for it (the next layer
    norms its input itself), and a decoder layer always returns (hidden states, router logits, next norm or None)."""
    model = random_model(random_config(), torch.float32)
    layer, x = model.model.layers[1], torch.randn(1, 5, 128)
    cos_sin = rotary_cos_sin(torch.arange(5)[None], model.config, torch.float32)
    with torch.no_grad():
        out, logits, normed = layer.mlp(x, residual=x, next_norm_weight=model.model.norm.weight)
        assert normed is None and logits.shape == (5, 8)
        for weight in (None, model.model.norm.weight):
            hidden, logits, normed = layer(x, cos_sin, next_norm_weight=weight)
            assert hidden.shape == x.shape and logits.shape == (5, 8) and normed is None


# ---------------------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------------------


def fixture_cases() -> list[dict]:
    return json.loads((FIXTURE / "cases.json").read_text())["cases"]


@pytest.mark.gpu
def test_gpu_fixture_cases_exact_in_float32():
    """Every recorded case of the Hub code + LLaDA's `generate()` (float32, CPU) on CUDA in float32: the reference's
    tokens, in no more forwards."""
    model = LLaDAMoEModelLM.from_pretrained(FIXTURE).cuda().eval()
    expected = load_file(FIXTURE / "expected.safetensors")
    failures = []
    for case in fixture_cases():
        prompt = expected[f"prompt.{case['prompt']}"].cuda()
        out = model.generate(prompt, **generate_kwargs(case))
        if not torch.equal(out.sequences.cpu(), expected[f"case.{case['name']}"]):
            failures.append(case["name"])
        elif case["nfe"] is not None and out.nfe > case["nfe"]:
            failures.append(f"{case['name']} (nfe {out.nfe} > {case['nfe']})")
    assert not failures, failures


def bf16_errors(config: LLaDAMoEConfig, ids: torch.Tensor) -> tuple[float, float, LLaDAMoEModelLM]:
    """(max |logits - float32 logits|) of a bf16 model with the experts as the loop (PyTorch) and through the fused
    kernels, the same weights; and the fused model."""
    reference = random_model(config, torch.float32, "cuda")
    # Each its own config: `_from_config` writes `experts_implementation` into the config it is given.
    eager = LLaDAMoEModelLM._from_config(copy.deepcopy(config), dtype=torch.bfloat16, experts_implementation="eager")
    eager = eager.cuda().eval()
    fused = LLaDAMoEModelLM._from_config(copy.deepcopy(config), dtype=torch.bfloat16).cuda().eval()
    state = {name: tensor.to(torch.bfloat16) for name, tensor in reference.state_dict().items()}
    eager.load_state_dict(state)
    fused.load_state_dict(state)
    with torch.no_grad():
        want = reference(ids).logits.float()
        eager_error = float((eager(ids).logits.float() - want).abs().max())
        fused_error = float((fused(ids).logits.float() - want).abs().max())
    return eager_error, fused_error, fused


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 512])
def test_gpu_fused_experts_error_within_twice_pytorch_bf16(tokens):
    """bf16 through the Triton kernels vs float32: within 2x of PyTorch's own bf16 loop's error (as the
    flash-attention tests); 64 experts top-8 as the real model, few and many tokens (both alignments)."""
    set_kernel_mode("auto")
    config = random_config(num_experts=64, num_experts_per_tok=8, hidden_size=256, expert_intermediate_size=128)
    ids = torch.randint(0, 300, (1, tokens), device="cuda")
    eager_error, fused_error, fused = bf16_errors(config, ids)
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():  # as generate() runs: the fused kernels have no backward
        assert fused.model.layers[1].mlp.uses_fused_kernels(x) and fused._diffusion_step_capturable()
    assert fused_error <= 2 * eager_error + 1e-3, (fused_error, eager_error)


@pytest.mark.gpu
def test_gpu_fused_attention_path_error_within_twice_pytorch_bf16():
    """A cached prefill and block step (the dual cache's forwards) in bf16 on the fused path (one q/k/v product,
    q/k norms + RoPE + cache write in one kernel, fused norms and residual adds, fused experts) against float32:
    within 2x of the PyTorch path's own bf16 error (`HF_DLLM_KERNELS=torch`), logits and the cached keys."""
    from hf_dllm.cache import DiffusionKVCache

    config = random_config(num_experts=64, num_experts_per_tok=8, partial_rotary_factor=0.5)
    reference = random_model(config, torch.float32, "cuda")
    model = LLaDAMoEModelLM._from_config(copy.deepcopy(config), dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict({name: tensor.to(torch.bfloat16) for name, tensor in reference.state_dict().items()})
    ids, block = torch.randint(0, 300, (1, 64), device="cuda"), torch.randint(0, 300, (1, 32), device="cuda")

    def run(net, mode: str) -> tuple[list[torch.Tensor], bool]:
        set_kernel_mode(mode)
        cache = DiffusionKVCache(2, 1, 96)
        with torch.no_grad():
            prefill = net(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(64, device="cuda"))
            step = net(block, past_key_values=cache, use_cache=True, cache_position=torch.arange(64, 96, device="cuda"))
            uses_fused = net.model.layers[1].self_attn.uses_fused_path(step.logits, cache, torch.arange(1))
        return [prefill.logits.float(), step.logits.float(), cache.keys[1].float()], uses_fused

    try:
        want, _ = run(reference, "auto")
        plain, plain_fused = run(model, "torch")
        fused, fused_path = run(model, "auto")
    finally:
        set_kernel_mode("auto")
    assert fused_path and not plain_fused
    for name, w, p, f in zip(("prefill", "step", "keys"), want, plain, fused, strict=True):
        assert (f - w).abs().max() <= 2 * (p - w).abs().max() + 1e-3, (name, (f - w).abs().max(), (p - w).abs().max())


@pytest.mark.gpu
def test_gpu_fused_graph_steps_equal_eager_steps():
    """With the fused experts a step has no host synchronisation: generate() captures CUDA graphs, and the graphs'
    tokens are the eager steps' (dual cache, threshold)."""
    model = random_model(random_config(num_experts=64, num_experts_per_tok=8), torch.bfloat16, "cuda")
    prompt = torch.randint(0, 300, (1, 24), device="cuda")
    settings = dict(max_new_tokens=64, block_length=32, threshold=0.9, use_cache=True, dual_cache=True)
    graphs = model.generate(prompt, mask_token_id=310, **settings)
    eager = model.generate(prompt, mask_token_id=310, disable_compile=True, **settings)
    assert torch.equal(graphs, eager)
    assert model._hf_dllm_step_graphs.counts["replayed"] > 0


@pytest.mark.gpu
def test_gpu_fp8_model_runs_the_fused_kernels_and_generates():
    """transformers' FP8 quantization on CUDA: the experts run through the grouped FP8 kernel (the fused path), the
    logits close to the dequantized weights', and generate() decodes every position with graphs as without."""
    model = random_model(random_config(num_experts=64, num_experts_per_tok=8), torch.bfloat16, "cuda")
    quantized = quantized_copy(model, "cuda")
    x = torch.zeros(1, 128, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        assert quantized.model.layers[1].mlp.uses_fused_kernels(x)
    ids = torch.randint(0, 300, (2, 32), device="cuda")
    with torch.no_grad():
        logits = quantized(ids).logits.float()
        expected = dequantized_copy(quantized, "cuda")(ids).logits.float()
    assert float((logits - expected).abs().max()) < 1e-1  # the kernel also quantizes activations to FP8
    prompt = ids[:1, :16]
    settings = dict(max_new_tokens=32, block_length=16, threshold=0.9, use_cache=True, dual_cache=True)
    graphs = quantized.generate(prompt, mask_token_id=310, **settings)
    eager = quantized.generate(prompt, mask_token_id=310, disable_compile=True, **settings)
    assert graphs.shape == (1, 48) and not (graphs == 310).any() and torch.equal(graphs, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 64])
def test_gpu_router_product_at_the_7b_shape(tokens):
    """A block step's router product at LLaDA-MoE-7B's shape (hidden 2048, 64 experts, bf16) through
    `triton_moe.router_partials` (the hidden size split over programs: 16 chunks at 1 and 32 tokens on an H200, 8 at
    64) summed and rounded in `route`'s kernel: the partials' sum within float32 rounding of the float64 product
    (chunks of at most 256 columns), the logits that sum rounded once to bf16 (the in-order float32 sum), within one
    bf16 rounding of cuBLAS's product and as close to the exact product, and the experts `route` picks from them
    those it picks from cuBLAS's wherever cuBLAS's 8th and 9th logits are more than two roundings apart."""
    from hf_dllm import triton_moe

    torch.manual_seed(0)
    x = torch.randn(tokens, 2048, dtype=torch.bfloat16, device="cuda")
    gate = (torch.randn(64, 2048, device="cuda") * 0.02).bfloat16()
    partials, cublas = triton_moe.router_partials(x, gate), x @ gate.T
    assert partials.shape[0] == triton_moe.router_splits(tokens, 64, 2048, x.device) > 1
    logits = torch.empty_like(cublas)
    index, _ = triton_moe.route(partials, None, 1, 1, 8, "softmax", False, 1.0, torch.bfloat16, summed_logits=logits)
    exact = x.double() @ gate.double().T
    # (2**-23 a step: an MMA's float32 accumulation may truncate rather than round)
    bound = (256 + partials.shape[0]) * 2**-23 * (x.double().abs() @ gate.double().abs().T)
    assert ((partials.double().sum(0) - exact).abs() <= bound).all()
    summed = partials[0].clone()
    for part in partials[1:]:
        summed += part
    assert torch.equal(logits, summed.bfloat16())
    rounding = cublas.float().abs().max() * 2**-7
    assert (logits.float() - cublas.float()).abs().max() <= rounding
    assert (logits.double() - exact).abs().max() <= 2 * (cublas.double() - exact).abs().max() + 1e-6
    want, _ = triton_moe.route(cublas, None, 1, 1, 8, "softmax", False, 1.0, torch.bfloat16)
    ranked = cublas.float().sort(-1, descending=True).values
    clear = (ranked[:, 7] - ranked[:, 8]) > 2 * rounding
    assert clear.any() and torch.equal(index[clear].sort(-1).values, want[clear].sort(-1).values)


@pytest.mark.gpu
def test_gpu_block_step_grouped_products_take_the_pinned_configs():
    """At LLaDA-MoE-7B's batch-1 block step shape (32 tokens top-8 over 64 experts of width 1024, hidden 2048,
    bf16) the experts' grouped products run `grouped_gemm.PINNED_CONFIGS`' configs (printed), with results equal to
    the same configs passed explicitly."""
    from hf_dllm import grouped_gemm, triton_moe

    torch.manual_seed(0)
    pool = torch.randperm(64, device="cuda")[:10]
    topk = torch.stack([pool[torch.randperm(10, device="cuda")[:8]] for _ in range(32)])
    sorted_token, offsets, _ = triton_moe.align_by_expert(topk, 64, False)
    x = torch.randn(32, 2048, device="cuda", dtype=torch.bfloat16)
    gate_up = (torch.randn(64, 2048, 2048, device="cuda") * 0.02).bfloat16()
    down = (torch.randn(64, 2048, 1024, device="cuda") * 0.02).bfloat16()
    gated = grouped_gemm.grouped_matmul(x, offsets, gate_up, rows_of=sorted_token, gated=True)
    chosen = [grouped_gemm._grouped_kernel.best_config]
    out = grouped_gemm.grouped_matmul(gated, offsets, down)
    chosen.append(grouped_gemm._grouped_kernel.best_config)
    print("grouped configs (gate/up, down):", *chosen)
    pins = [grouped_gemm.pinned_config(True, 1024, 2048, 64, 256, torch.bfloat16)]
    pins.append(grouped_gemm.pinned_config(False, 2048, 1024, 64, 256, torch.bfloat16))
    assert [str(c) for c in chosen] == [str(c) for c in pins]
    again = grouped_gemm.grouped_matmul(x, offsets, gate_up, rows_of=sorted_token, gated=True, config=pins[0])
    assert torch.equal(gated, again)
    assert torch.equal(out, grouped_gemm.grouped_matmul(gated, offsets, down, config=pins[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 512])
def test_gpu_combine_and_norm_equals_combine_then_norm(tokens):
    """The combine with the next layer's norm (one program per token, bf16, hidden 2048) gives `combine`'s sum and
    `triton_ops.rms_norm`'s normed rows bit for bit (the same rounding points and row reduction)."""
    from hf_dllm import triton_moe, triton_ops

    torch.manual_seed(0)
    topk = torch.stack([torch.randperm(64, device="cuda")[:8] for _ in range(tokens)])
    _, _, rows = triton_moe.align_by_expert(topk, 64, False)
    expert_rows = torch.randn(tokens * 8, 2048, dtype=torch.bfloat16, device="cuda")
    weight = torch.rand(tokens, 8, device="cuda").bfloat16()
    residual = torch.randn(tokens, 2048, dtype=torch.bfloat16, device="cuda")
    norm_weight = (torch.rand(2048, device="cuda") + 0.5).bfloat16()
    total, normed = triton_moe.combine_and_norm(expert_rows, rows, weight, residual, norm_weight, 1e-6)
    want = triton_moe.combine(expert_rows, rows, weight, False, residual)
    assert torch.equal(total, want)
    assert torch.equal(normed, triton_ops.rms_norm(want, norm_weight, 1e-6)[0])
