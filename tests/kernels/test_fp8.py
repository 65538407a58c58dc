"""FP8 weights (issue #13): LLaDA quantized through transformers' `FineGrainedFP8Config`, and hf_dllm's FP8 kernels.

- The kernels' error against the float32 product of the unquantized operands is within 2x of PyTorch's own FP8
  reference error (the same quantized operands dequantized and multiplied in float32), over shapes: on the GPU, and
  through Triton's interpreter on the CPU (tiny shapes).
- The quantized model (`from_pretrained(..., quantization_config=FineGrainedFP8Config())`) computes what a bf16
  model with the dequantized weights computes; the fused q/k/v and gate/up products multiply the concatenated FP8
  weights and scales (views: no copy, state_dict unchanged); on the GPU the CUDA-graph path gives the eager path's
  tokens.
- On the CPU, transformers refuses to quantize (it names the devices it needs).
"""

from __future__ import annotations

import functools
import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch

import hf_dllm
from hf_dllm import fp8, fp8_triton
from hf_dllm.kernels import set_kernel_mode
from tests.conftest import assert_quantized_from, interpreter_job, random_weights_model

BLOCK = (128, 128)


def tiny_config(**overrides) -> hf_dllm.LLaDAConfig:
    values = dict(
        d_model=256,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp_hidden_size=384,
        vocab_size=512,
        embedding_size=512,
        mask_token_id=500,
        eos_token_id=400,
        pad_token_id=400,
        max_sequence_length=256,
    )
    return hf_dllm.LLaDAConfig(**(values | overrides))


def quantized_model(config, device: str, monkeypatch=None, weight_block_size=BLOCK, quantize_head=False):
    """A random bf16 LLaDA and its FP8 copy made by transformers' quantizer (`from_pretrained` with a state dict);
    `weight_block_size=None`: one scale per matrix (per-tensor); `quantize_head`: the output head too
    (`modules_to_not_convert=[]`)."""
    from transformers import FineGrainedFP8Config

    torch.manual_seed(0)
    with torch.device(device):
        model = hf_dllm.LLaDAModelLM._from_config(config, dtype=torch.bfloat16).eval()
    if monkeypatch is not None:
        # transformers quantizes on CUDA/XPU only; its quantization math (Fp8Quantize) is plain torch, so the CPU
        # tests lift the device check to test hf_dllm's side of the model.
        from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

        monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    quantized = hf_dllm.LLaDAModelLM.from_pretrained(
        None,
        config=config,
        state_dict=model.state_dict(),
        quantization_config=FineGrainedFP8Config(
            weight_block_size=weight_block_size, modules_to_not_convert=[] if quantize_head else None
        ),
        dtype=torch.bfloat16,
        device_map=device,
    ).eval()
    return model, quantized


def dequantized_state(quantized) -> dict[str, torch.Tensor]:
    """The quantized model's state dict with every FP8 weight dequantized to bf16 and the block scales dropped."""
    state = quantized.state_dict()
    plain = {}
    for name, tensor in state.items():
        if name.endswith("weight_scale_inv"):
            continue
        if tensor.dtype == fp8.FP8_DTYPE:
            scale = state[name.removesuffix("weight") + "weight_scale_inv"]
            block = tuple(tensor.shape) if scale.numel() == 1 else BLOCK  # per-tensor: one block
            tensor = fp8.dequantize(tensor, scale.reshape(1, 1) if scale.numel() == 1 else scale, block, torch.bfloat16)
        plain[name] = tensor
    return plain


def dequantized_copy(quantized, config, device: str):
    """A bf16 LLaDA whose weights are the quantized model's, dequantized."""
    with torch.device(device):
        copy = hf_dllm.LLaDAModelLM._from_config(config, dtype=torch.bfloat16).eval()
    copy.load_state_dict(dequantized_state(quantized))
    return copy


def test_cpu_quantization_names_the_devices():
    from transformers import FineGrainedFP8Config

    if torch.cuda.is_available():
        pytest.skip("the CPU refusal shows only without a GPU")
    model = hf_dllm.LLaDAModelLM._from_config(tiny_config(), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="GPU or XPU"):
        hf_dllm.LLaDAModelLM.from_pretrained(
            None, config=model.config, state_dict=model.state_dict(), quantization_config=FineGrainedFP8Config()
        )


def test_quantization_config_quantizes_the_head_only_when_asked():
    """`fp8_quantization_config(..., quantize_head=True)` names no head among the modules to keep: transformers then
    drops its default skip of the output embeddings; a model type's other skips (LLaDA2's expert lists) stay."""
    assert fp8.fp8_quantization_config("llada").modules_to_not_convert is None  # transformers' defaults: head kept
    assert fp8.fp8_quantization_config("llada", quantize_head=True).modules_to_not_convert == []
    llada2 = fp8.fp8_quantization_config("llada2", "fp8-tensor", quantize_head=True)
    assert llada2.modules_to_not_convert == [r".*\.experts$"] and llada2.weight_block_size is None
    assert "lm_head" in fp8.fp8_quantization_config("llada2").modules_to_not_convert
    with pytest.raises(TypeError, match="quantize_head"):
        fp8.fp8_quantization_config("llada", quantize_head="yes")


@pytest.mark.parametrize("quantize_head", [False, True], ids=["bf16_head", "fp8_head"])
@pytest.mark.parametrize("weight_block_size", [BLOCK, None], ids=["blocks", "per_tensor"])
def test_quantized_llada_matches_dequantized_weights(monkeypatch, weight_block_size, quantize_head):
    """Block scales, or one scale per matrix (`FineGrainedFP8Config(weight_block_size=None)`, run by hf_dllm as rows
    scaled one by one; transformers' own `FP8Linear.forward` would fetch a Hub kernel); the output head in bf16
    (transformers' default) or in FP8 too (`modules_to_not_convert=[]`). The FP8 weights are the source's quantized
    once, bit for bit (not first rounded to FP8 as transformers < 5.23 did: `fp8.QuantizesFromLoadDtype`)."""
    config = tiny_config()
    model, quantized = quantized_model(config, "cpu", monkeypatch, weight_block_size, quantize_head)
    assert_quantized_from(model.state_dict(), quantized.state_dict(), weight_block_size)
    layers = quantized.model.transformer.blocks[0]
    assert layers.q_proj.weight.dtype == fp8.FP8_DTYPE and fp8.is_fp8_linear(layers.ff_out)
    if weight_block_size:
        assert layers.ff_out.weight_scale_inv.shape == (2, 3)
    else:
        assert layers.ff_out.block_size is None and layers.ff_out.weight_scale_inv.numel() == 1
        assert fp8.fp8_block_size(layers.ff_out) == (1, 384)
    head = quantized.model.transformer.ff_out
    assert fp8.is_fp8_linear(head) == quantize_head, head  # transformers keeps the head unless told otherwise
    reference = dequantized_copy(quantized, config, "cpu")
    ids = torch.randint(0, 400, (2, 24))
    with torch.no_grad():
        logits = quantized(ids).logits.float()
        expected = reference(ids).logits.float()
        original = model(ids).logits.float()
    assert torch.allclose(logits, expected, atol=1e-2, rtol=0), (logits - expected).abs().max()
    # Quantization changes the logits a little, not a lot (against the unquantized model).
    assert 0 < (logits - original).abs().max() < 0.25 * original.abs().max()


def test_fp8_placeholders_take_the_load_dtype_whatever_the_transformers_version(monkeypatch, tmp_path):
    """`fp8.QuantizesFromLoadDtype` forced on (it acts under transformers < 5.23 only): before an on-the-fly FP8
    load, exactly the FP8 weights the quantizer converts get placeholders in the load dtype, and the model still
    holds the source's weights quantized once; a pre-quantized checkpoint's FP8 tensors are left as stored."""
    changed, place = [], fp8.fp8_placeholders_in_load_dtype
    monkeypatch.setattr(fp8, "_casts_before_quantizing", lambda: True)
    monkeypatch.setattr(fp8, "fp8_placeholders_in_load_dtype", lambda *args: changed.extend(place(*args)))
    model, quantized = quantized_model(tiny_config(), "cpu", monkeypatch)
    state = quantized.state_dict()
    assert sorted(changed) == sorted(name for name, tensor in state.items() if tensor.dtype == fp8.FP8_DTYPE)
    assert_quantized_from(model.state_dict(), state, BLOCK)
    changed.clear()
    quantized.save_pretrained(tmp_path)
    reloaded = hf_dllm.LLaDAModelLM.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    assert changed == [] and reloaded.keys() == state.keys()


def test_fused_projection_concatenates_fp8_weights_and_scales(monkeypatch):
    config = tiny_config()
    _, quantized = quantized_model(config, "cpu", monkeypatch)
    block = quantized.model.transformer.blocks[0]
    names_before = set(quantized.state_dict())
    x = torch.randn(3, 5, config.d_model, dtype=torch.bfloat16)
    separate = torch.cat(
        [fp8.fp8_linear(x, *_fp8_args(getattr(block, n)), use_triton=False) for n in ("q_proj", "k_proj", "v_proj")],
        dim=-1,
    )
    fused = block.project(x, ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(fused, separate)
    weight, _ = block.concatenated(("q_proj", "k_proj", "v_proj"))
    scale = block._concatenated_parameter(("q_proj", "k_proj", "v_proj"), "weight_scale_inv")
    assert weight.dtype == fp8.FP8_DTYPE and weight.shape == (256 + 128 + 128, 256) and scale.shape == (4, 2)
    assert block.k_proj.weight.data_ptr() == weight.data_ptr() + 256 * 256  # views, no copy
    assert block.v_proj.weight_scale_inv.data_ptr() == scale.data_ptr() + 3 * 2 * 4
    assert set(quantized.state_dict()) == names_before


def _fp8_args(layer):
    return layer.weight, fp8.fp8_scales(layer), fp8.fp8_block_size(layer), layer.bias


def test_fused_projection_concatenates_per_tensor_scales_per_row(monkeypatch):
    config = tiny_config()
    _, quantized = quantized_model(config, "cpu", monkeypatch, weight_block_size=None)
    block = quantized.model.transformer.blocks[0]
    names = ("q_proj", "k_proj", "v_proj")
    layers = [getattr(block, n) for n in names]
    x = torch.randn(3, 5, config.d_model, dtype=torch.bfloat16)

    def separate():
        return torch.cat([fp8.fp8_linear(x, *_fp8_args(layer), use_triton=False) for layer in layers], dim=-1)

    assert torch.equal(block.project(x, names), separate())
    scales = block._concatenated_scales(names, layers)
    assert scales.shape == (512, 1) and scales.dtype == torch.float32
    for start, layer in zip((0, 256, 384), layers, strict=True):
        rows = scales[start : start + layer.weight.shape[0]]
        assert torch.equal(rows, layer.weight_scale_inv.float().reshape(1, 1).expand_as(rows))
    # A scale changed in place, or replaced, reaches the next product.
    with torch.no_grad():
        block.k_proj.weight_scale_inv.mul_(2)
    assert torch.equal(block.project(x, names), separate())
    block.v_proj.weight_scale_inv = torch.nn.Parameter(block.v_proj.weight_scale_inv.detach() * 3)
    assert torch.equal(block.project(x, names), separate())
    assert block._concatenated_scales(names, layers)[384:].unique().item() == block.v_proj.weight_scale_inv.item()


def test_row_scaled_products_need_a_gpu_with_fp8_tensor_cores():
    """Row scales (per-tensor layers) run `torch._scaled_mm` on GPUs that have it; elsewhere the PyTorch path, and
    no producer is asked to quantize activations for them."""
    x = torch.randn(4, 256)
    assert fp8.is_row_scaled((1, 256), 256) and not fp8.is_row_scaled((128, 128), 256)
    assert fp8.fp8_product_kernel(x, 128, 256, (1, 256)) == "torch"
    assert not fp8.fp8_kernel_supports(torch.zeros(128, 256).to(fp8.FP8_DTYPE), (1, 256))
    assert not fp8.fp8_kernel_supports(torch.zeros(128, 256).to(fp8.FP8_DTYPE), None)
    assert fp8.quantized_input_group(x, 128, 256, (1, 256)) is None
    w8 = (torch.randn(128, 256) * 100).to(fp8.FP8_DTYPE)
    scales = torch.full((128, 1), 0.01)
    out = fp8.fp8_linear(x, w8, scales, (1, 256))
    assert torch.allclose(out, x @ (w8.float() * 0.01).t(), atol=1e-5)


def test_bad_backend_is_refused():
    w8, scale = fp8.quantize_blocks(torch.randn(128, 128), BLOCK)
    with pytest.raises(ValueError, match="backend"):
        fp8.w8a8_matmul(torch.randn(4, 128), w8, scale, BLOCK, backend="cutlass")


def kernel_errors(x, weight, block, kernels):
    """Relative errors of each kernel against the exact float32 product, and PyTorch's FP8 reference errors."""
    exact = x.float() @ weight.float().t()
    w8, scale = fp8.quantize_blocks(weight, block)
    w_deq = fp8.dequantize(w8, scale, block, torch.float32)
    a8, a_scale = fp8_triton.quantize_rows(x, block[1]) if any(n.startswith("w8a8") for n in kernels) else (None, None)
    norm = exact.norm()
    refs = {"weight_only": ((x.float() @ w_deq.t()) - exact).norm() / norm}
    if a8 is not None:
        x_deq = (a8.float().unflatten(1, (-1, block[1])) * a_scale[:, :, None]).flatten(1)
        refs["w8a8"] = ((x_deq @ w_deq.t()) - exact).norm() / norm
    results = {}
    for name, backend in kernels.items():
        if name == "weight_only":
            out = fp8_triton.weight_only_matmul(x, w8, scale, block)
        elif backend == "few_rows":
            rows = fp8.QuantizedRows(*fp8_triton.quantize_rows(x, block[1]), x.shape, x.dtype)
            out = fp8.few_rows_w8a8_matmul(rows, w8, scale, block)
        else:
            out = fp8.w8a8_matmul(x, w8, scale, block, backend=backend)
        results[name] = ((out.float() - exact).norm() / norm).item(), refs[name.split(":")[0]].item()
    return results


def rowwise_errors(x, weight, bias=None, config=None):
    """The few-rows kernel's row-scaled product (`fp8.few_rows_w8a8_matmul` with block size `(1, K)`: one scale per
    weight row and per activation row) against the exact float32 product, and PyTorch's own reference error (both
    operands quantized the same way, dequantized, multiplied in float32)."""
    k_in = x.shape[1]
    exact = x.float() @ weight.float().t() + (0 if bias is None else bias.float())
    w8, row_scales = fp8.quantize_blocks(weight, (1, k_in))
    values, scales = fp8_triton.quantize_rows(x, k_in)
    rows = fp8.QuantizedRows(values, scales, x.shape, x.dtype)
    out = fp8.few_rows_w8a8_matmul(rows, w8, row_scales, (1, k_in), bias, config=config)
    reference_out = (values.float() * scales) @ (w8.float() * row_scales).t() + (0 if bias is None else bias.float())
    norm = exact.norm()
    return ((out.float() - exact).norm() / norm).item(), ((reference_out - exact).norm() / norm).item(), out


def row_magnitudes(rows: int) -> torch.Tensor:
    """`(rows, 1)` factors from 0.002 to 0.2, shuffled: rows whose scales differ, so that a kernel applying another
    row's scale is far off."""
    return torch.logspace(-2.7, -0.7, rows)[torch.randperm(rows)][:, None]


def block_magnitudes(n_out: int, k_in: int) -> torch.Tensor:
    """`(n_out, k_in)` factors, one per 128 x 128 block, from 0.002 to 0.2 over the blocks: weights whose block
    scales differ, so that a kernel applying the wrong block's scale is far off."""
    blocks = torch.logspace(-2.7, -0.7, -(-n_out // 128) * -(-k_in // 128)).view(-(-n_out // 128), -(-k_in // 128))
    return blocks[torch.randperm(blocks.shape[0])].repeat_interleave(128, 0)[:n_out].repeat_interleave(128, 1)[:, :k_in]


def fused_quantization_differences(device: str, dtype: torch.dtype) -> list[str]:
    """The kernels that write a w8a8 product's activations already quantized (`fp8.rms_norm_to_fp8` with and without
    the residual, `fp8.silu_mul_to_fp8`), and `quantize_rows`' own padding rows, against `fp8_triton.quantize_rows`
    of the unfused kernels' outputs padded with zero rows to a multiple of 16 (cuBLASLt's padding): the outputs
    whose bits differ, by name. Groups of 128 columns and of the whole row (row-scaled products), widths of a power
    of two and not."""
    differences = []
    for rows, width, group in [(5, 512, 128), (32, 1024, 128), (5, 512, 512), (3, 640, 640), (17, 2560, 2560)]:
        found = _fused_quantization_differences(device, dtype, rows, width, group)
        differences += [f"{name} group={group}" for name in found]
    return differences


def _fused_quantization_differences(device, dtype, rows: int, width: int, group: int) -> list[str]:
    from hf_dllm import triton_ops

    differences = []
    padding = (0, 0, 0, -rows % fp8.SCALED_MM_ROW_MULTIPLE)
    x = torch.randn(rows, width, device=device, dtype=dtype) * 3
    weight = torch.randn(width, device=device, dtype=dtype)
    for residual in (None, torch.randn_like(x)):
        (values, scales, shape, out_dtype), total = fp8.rms_norm_to_fp8(x, weight, 1e-5, group, residual=residual)
        normed, expected_total = triton_ops.rms_norm(x, weight, 1e-5, residual=residual)
        expected = fp8_triton.quantize_rows(torch.nn.functional.pad(normed, padding), group, scales_column_major=True)
        name = f"rms_norm rows={rows} residual={residual is not None}"
        # quantize_rows' own zero rows (the w8a8 path's padding) against the zero-padded input's.
        padded = fp8_triton.quantize_rows(
            normed, group, scales_column_major=True, row_multiple=fp8.SCALED_MM_ROW_MULTIPLE
        )
        if not torch.equal(padded[0].view(torch.uint8), expected[0].view(torch.uint8)):
            differences.append(f"quantize_rows rows={rows}: padded values")
        if not torch.equal(padded[1], expected[1]) or padded[1].stride() != expected[1].stride():
            differences.append(f"quantize_rows rows={rows}: padded scales")
        if not torch.equal(values.view(torch.uint8), expected[0].view(torch.uint8)):
            differences.append(f"{name}: values")
        if not torch.equal(scales, expected[1]) or scales.stride() != expected[1].stride():
            differences.append(f"{name}: scales")
        if not torch.equal(total, expected_total) or shape != x.shape or out_dtype != dtype:
            differences.append(f"{name}: sum, shape or dtype")
    gate, up = (torch.randn(rows, 2 * width, device=device, dtype=dtype) * 4).chunk(2, dim=-1)
    values, scales, _, _ = fp8.silu_mul_to_fp8(gate, up, group)
    silu = torch.nn.functional.pad(triton_ops.silu_mul(gate, up), padding)
    expected = fp8_triton.quantize_rows(silu, group, scales_column_major=True)
    if not torch.equal(values.view(torch.uint8), expected[0].view(torch.uint8)):
        differences.append(f"silu_mul rows={rows}: values")
    if not torch.equal(scales, expected[1]):
        differences.append(f"silu_mul rows={rows}: scales")
    return differences


def per_group_products(rows, weight, offsets, gated, dtype):
    """Each group's rows `(pairs, K)` times its weight `(groups, N, K)` with both in `dtype` (`offsets`: each group's
    end row; gated: `silu(gate) * up` of the weight's two halves), as float32."""
    starts = [0, *offsets.tolist()[:-1]]
    bounds = zip(starts, offsets.tolist(), strict=True)
    out = torch.cat([rows[a:b].to(dtype) @ weight[e].to(dtype).t() for e, (a, b) in enumerate(bounds)])
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out.float()


def grouped_errors(tokens, experts, top_k, k_in, n_out, gated, dtype, device="cpu", configs=(None,), fp8_weights=True):
    """`grouped_gemm.grouped_matmul`'s relative errors (one per config of `configs`, None: the autotuner's choice)
    against the exact float32 product of the unquantized weights, and PyTorch's reference error, for random routing
    of `tokens` tokens to `top_k` of `experts` experts: gated (gate/up with the SiLU gate, rows gathered) or not
    (down). FP8 weights: the reference is the dequantized weights' float32 product; `fp8_weights=False`: weights in
    `dtype`, the reference PyTorch's per-group products in `dtype`. A config that cannot launch (not
    `grouped_gemm.fits_shared_memory`, which the autotuner skips) gives None."""
    from hf_dllm import grouped_gemm, triton_moe

    x = torch.randn(tokens, k_in, device=device, dtype=dtype)
    topk = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)])
    sorted_token, offsets, _ = triton_moe.align_by_expert(topk, experts, False)
    rows = n_out * 2 if gated else n_out
    weight = torch.randn(experts, rows, k_in, device=device) * 0.02
    source = x[sorted_token] if gated else x[torch.arange(len(sorted_token), device=device) % tokens]
    if fp8_weights:
        # Each expert by 128 x 128 blocks; with a width a multiple of 128 the gate's and the up's rows never share a
        # block, so the scale rows are the gate's then the up's, as the model stacks its experts' scales.
        assert n_out % BLOCK[0] == 0
        stored = fp8.quantize_blocks(weight, BLOCK)
        reference_out = per_group_products(
            source, fp8.dequantize(*stored, BLOCK, torch.float32), offsets, gated, torch.float32
        )
        stored = (*stored, BLOCK)
    else:
        weight = weight.to(dtype)
        stored = (weight,)
        reference_out = per_group_products(source, weight, offsets, gated, dtype)
    truth = per_group_products(source, weight, offsets, gated, torch.float32)
    norm = truth.norm()
    reference = ((reference_out - truth).norm() / norm).item()
    errors = []
    for config in configs:
        if config is not None and not grouped_gemm.fits_shared_memory(
            config, x.element_size(), stored[0].element_size(), 128, gated, x.device
        ):
            errors.append(None)
            continue
        if gated:
            out = grouped_gemm.grouped_matmul(x, offsets, *stored, rows_of=sorted_token, gated=True, config=config)
        else:
            out = grouped_gemm.grouped_matmul(source.contiguous(), offsets, *stored, config=config)
        errors.append(((out.float() - truth).norm() / norm).item())
    return errors, reference


# Two scripts, run side by side (each takes about half of the time): the kernels alone, and a tiny quantized model.
INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from hf_dllm import fp8, fp8_triton
    from tests.kernels.test_fp8 import block_magnitudes, kernel_errors
    torch.manual_seed(0)
    for rows, n_out, k_in in [(5, 256, 256), (33, 384, 128)]:
        x = torch.randn(rows, k_in, dtype=torch.float16)
        weight = torch.randn(n_out, k_in) * 0.02
        kernels = {"weight_only": None, "w8a8": "triton", "w8a8:few_rows": "few_rows"}
        for name, (error, reference) in kernel_errors(x, weight, (128, 128), kernels).items():
            assert error <= 2 * reference + 1e-3, (name, rows, error, reference)
    # The few-rows w8a8 kernel without a split, with 128-row weight tiles and several row tiles, and with a split of
    # more parts than some ranges have k tiles.
    for config, (rows, n_out, k_in) in [
        ({"BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 1}, (20, 384, 256)),
        ({"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 4}, (3, 128, 640)),
    ]:
        fp8_triton.INTERPRETER_CONFIGS["few_rows_w8a8"] = config
        x = torch.randn(rows, k_in, dtype=torch.float16)
        weight = torch.randn(n_out, k_in) * block_magnitudes(n_out, k_in)
        error, reference = kernel_errors(x, weight, (128, 128), {"w8a8:few_rows": "few_rows"})["w8a8:few_rows"]
        assert error <= 2 * reference + 1e-3, ("few_rows", config, error, reference)
    # The few-rows kernel's row-scaled variant (one scale per weight row and per activation row, `fp8-tensor`): k tiles
    # that do not divide K, a split with more parts than some ranges have k tiles, no split, several row tiles, a bias.
    from tests.kernels.test_fp8 import row_magnitudes, rowwise_errors
    for config, (rows, n_out, k_in), with_bias in [
        ({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}, (5, 192, 320), False),
        ({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}, (20, 256, 256), True),
        ({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 4}, (3, 128, 96), True),
    ]:
        fp8_triton.INTERPRETER_CONFIGS["few_rows_rowwise"] = config
        x = (torch.randn(rows, k_in) * row_magnitudes(rows) * 50).to(torch.float16)
        weight = torch.randn(n_out, k_in) * row_magnitudes(n_out)
        bias = torch.randn(n_out, dtype=torch.float16) * 0.1 if with_bias else None
        error, reference, _ = rowwise_errors(x, weight, bias)
        assert error <= 2 * reference + 1e-3, ("few_rows rowwise", config, error, reference)
    # The weight-only kernel's other formulation (weight tile times transposed activations) and no split.
    fp8_triton.INTERPRETER_CONFIGS["weight_only"] = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "SWAP": True}
    for rows, n_out, k_in in [(5, 256, 256), (33, 384, 128)]:
        x = torch.randn(rows, k_in, dtype=torch.float16)
        weight = torch.randn(n_out, k_in) * 0.02
        error, reference = kernel_errors(x, weight, (128, 128), {"weight_only": None})["weight_only"]
        assert error <= 2 * reference + 1e-3, ("weight_only swapped", rows, error, reference)
    # The experts' grouped FP8 products (grouped_gemm.py), both formulations and two tile heights: groups of one
    # tile, of several, empty ones; gate/up with the SiLU gate (rows gathered) and down.
    from hf_dllm import grouped_gemm
    from tests.kernels.test_fp8 import grouped_errors
    # N_FASTEST: the grid's axes swapped; K_DIVISOR 2: steps of 64 columns within a 128-column scale block.
    for tile in ({"BLOCK_M": 16, "BLOCK_N": 64, "SWAP": False}, {"BLOCK_M": 16, "BLOCK_N": 64, "SWAP": True},
                 {"BLOCK_M": 32, "BLOCK_N": 32, "SWAP": False},
                 {"BLOCK_M": 16, "BLOCK_N": 64, "SWAP": True, "N_FASTEST": True},
                 {"BLOCK_M": 16, "BLOCK_N": 64, "SWAP": True, "N_FASTEST": True, "K_DIVISOR": 2}):
        grouped_gemm.INTERPRETER_CONFIG.update(tile)
        for tokens, experts, top_k, k_in, n_out, gated in [
            (7, 6, 2, 256, 128, True), (40, 5, 3, 128, 256, False), (40, 3, 2, 128, 128, True),
        ]:
            (error,), reference = grouped_errors(tokens, experts, top_k, k_in, n_out, gated, torch.float16)
            assert error <= 2 * reference + 1e-3, ("grouped", tile, tokens, experts, gated, error, reference)
    # One scale per row (row-scaled products): max |x| / 448 of the whole row, widths of a power of two and not.
    for rows, cols in [(7, 640), (20, 256), (2, 3000)]:
        x = torch.randn(rows, cols, dtype=torch.bfloat16) * torch.logspace(-2, 2, rows)[:, None]
        values, scales = fp8_triton.quantize_rows(x, cols)
        assert scales.shape == (rows, 1) and values.shape == x.shape, (scales.shape, values.shape)
        expected = x.float().abs().amax(1, keepdim=True) / 448.0
        assert torch.allclose(scales, expected, rtol=1e-6, atol=0), (scales - expected).abs().max()
    # The split-K products' autotuners time a config with the kernel adding up its partial sums (their post_hook, run
    # inside each timed call): the sum of the split's partials (+ bias) into out, nothing for an unsplit config.
    for kernel in (
        fp8_triton._weight_only_kernel, fp8_triton._few_rows_w8a8_kernel, fp8_triton._few_rows_rowwise_kernel
    ):
        assert kernel.post_hook is fp8_triton._add_up_timed_splits, kernel
    partials, bias = torch.randn(4, 3, 10), torch.randn(10)
    for split, has_bias in [(3, True), (2, False), (1, True)]:
        out = torch.zeros(3, 10)
        nargs = {"SPLIT_K": split, "HAS_BIAS": has_bias, "bias_ptr": bias, "partial_ptr": partials, "out_ptr": out}
        fp8_triton._add_up_timed_splits(nargs)
        expected = torch.zeros(3, 10)
        if split > 1:
            for part in partials[:split]:
                expected = expected + part
            expected = expected + bias if has_bias else expected
        assert torch.equal(out, expected), (split, has_bias, (out - expected).abs().max())
    # RMSNorm and SiLU-mul writing their output quantized: the bits quantize_rows gives their unfused output.
    from tests.kernels.test_fp8 import fused_quantization_differences
    assert not fused_quantization_differences("cpu", torch.bfloat16), fused_quantization_differences("cpu", torch.bfloat16)

    print("ok")
    """
)

INTERPRETER_MODEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from hf_dllm import fp8, fp8_triton, grouped_gemm
    torch.manual_seed(0)
    # The weight-only config the kernels script ends with (one script once ran both).
    fp8_triton.INTERPRETER_CONFIGS["weight_only"] = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 1, "SWAP": True}

    # A float32 LLaDA2 with FP8 experts: the fused path (routing kernels, the grouped FP8 products, the combine)
    # against the PyTorch path (each expert's layers, dequantized), prefill and a cached block step.
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from hf_dllm import kernels
    from hf_dllm.cache import DiffusionKVCache
    from tests.kernels.test_fp8 import llada2_config, llada2_quantized_model
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    grouped_gemm.INTERPRETER_CONFIG.update(BLOCK_M=16, BLOCK_N=64, SWAP=False, N_FASTEST=False, K_DIVISOR=1)
    config = llada2_config(num_experts=6, n_group=3, topk_group=2, num_hidden_layers=3)
    _, model = llada2_quantized_model(config, dtype=torch.float32)
    moe = model.model.layers[1].mlp
    ids = torch.randint(2, 59, (2, 24))
    logits = {}
    for mode in ("torch", "triton"):
        kernels.set_kernel_mode(mode)
        with torch.no_grad():
            assert moe.use_fused(torch.zeros(1, 128)) == (mode == "triton"), mode
            full = model(ids, block_length=8).logits
            cache = DiffusionKVCache(3, 2, 24)
            model(ids[:, :16], block_length=8, past_key_values=cache, use_cache=True, cache_position=torch.arange(16))
            step = model(ids[:, 16:], block_length=8, past_key_values=cache, use_cache=True,
                         cache_position=torch.arange(16, 24)).logits
        logits[mode] = (full, step)
    for name, out, expected in zip(("full", "step"), logits["triton"], logits["torch"]):
        assert torch.allclose(out, expected, atol=2e-3, rtol=0), (name, (out - expected).abs().max())
    print("ok")
    """
)


INTERPRETER_RUN = interpreter_job(
    {"kernels": INTERPRETER_SCRIPT, "model": INTERPRETER_MODEL_SCRIPT},
    timeout=300,
    when=lambda: importlib.util.find_spec("triton") is not None and not torch.cuda.is_available(),
)


@INTERPRETER_RUN.used_by
def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU-only check: with a GPU the kernels are tested compiled (the gpu tests)")
    for name, result in INTERPRETER_RUN.results().items():
        assert result.returncode == 0 and "ok" in result.stdout, (name, result.stderr[-3000:])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 200, 2048])
@pytest.mark.parametrize("n_out,k_in", [(4096, 4096), (384, 256), (640, 1536), (1024, 12288)])
def test_row_scaled_product_error_within_twice_torch_fp8_reference(rows, n_out, k_in):
    """Per-tensor weights (row scales) times activations quantized per row through `torch._scaled_mm` with fast
    accumulation, against the float32 product of the unquantized operands: within twice PyTorch's own error (the
    same quantized operands dequantized and multiplied in float32), bias added."""
    torch.manual_seed(rows)
    x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n_out, k_in, device="cuda") * 0.02
    bias = torch.randn(n_out, device="cuda", dtype=torch.bfloat16)
    if fp8.fp8_product_kernel(x, n_out, k_in, (1, k_in)) != "rowwise":
        pytest.skip("torch's row-scaled FP8 product is not available on this GPU / torch")
    scale = weight.abs().amax() / fp8.FP8_MAX
    w8 = (weight / scale).to(fp8.FP8_DTYPE)
    row_scales = scale.reshape(1, 1).expand(n_out, 1).contiguous()
    exact = x.float() @ weight.float().t() + bias.float()
    a8, a_scale = fp8_triton.quantize_rows(x, k_in)
    x_deq = a8.float() * a_scale
    reference = ((x_deq @ (w8.float() * scale).t() + bias.float()) - exact).norm() / exact.norm()
    out = fp8.fp8_linear(x, w8, row_scales, (1, k_in), bias)
    error = (out.float() - exact).norm() / exact.norm()
    assert error <= 2 * reference + 1e-3, (error.item(), reference.item())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 200, 2048])
@pytest.mark.parametrize("n_out,k_in", [(4096, 4096), (384, 256), (640, 1536)])
def test_kernel_error_within_twice_torch_fp8_reference(rows, n_out, k_in):
    torch.manual_seed(rows)
    x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n_out, k_in, device="cuda") * 0.02
    kernels = {"weight_only": None, "w8a8": "triton"}
    if fp8.cublaslt_takes(x, n_out, k_in, BLOCK):
        kernels["w8a8:scaled_mm"] = "scaled_mm"
    if rows <= fp8.FEW_ROWS_W8A8_MAX_ROWS:
        kernels["w8a8:few_rows"] = "few_rows"
    for name, (error, reference) in kernel_errors(x, weight, BLOCK, kernels).items():
        # bf16 output rounding (2^-9) is added to the float32 reference's error.
        assert error <= 2 * reference + 2e-3, (name, error, reference)


@pytest.mark.parametrize("rows", [5, 32, 200])
def test_weight_only_autotuning_times_one_unsplit_config_in_float32(rows):
    """float32 activations are multiplied in full float32 (CUDA cores, for exactness): the autotuner gets one
    unsplit config of the rows' tiles; bfloat16 keeps every config of those tiles (splits only at few rows)."""
    configs = fp8_triton.weight_only_configs()
    for dtype in (torch.float32, torch.bfloat16):
        kept = fp8_triton._prune_weight_only(configs, {"M": rows, "x_ptr": torch.empty(1, dtype=dtype)})
        assert {c.kwargs["BLOCK_M"] for c in kept} <= {
            fp8_triton._row_tile(rows, 128),
            fp8_triton._row_tile(rows, 128) // 2,
        }
        if dtype == torch.float32:
            (config,) = kept
            assert config.kwargs["SPLIT_K"] == 1
        else:
            assert len(kept) > 1 and (rows <= 64) == any(c.kwargs["SPLIT_K"] > 1 for c in kept)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [5, 32, 200])
def test_gpu_weight_only_product_of_float32_activations_is_float32_exact(rows):
    """A float32 model with FP8 weights: the weight-only kernel multiplies float32 activations by the dequantized
    weight in full float32 (`input_precision="ieee"`), not TF32 (10 mantissa bits, a relative error near 1e-3 at
    these sizes), through the autotuner's one unsplit config (`_prune_weight_only`)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 1536, device="cuda")
    w8, scale = fp8.quantize_blocks(torch.randn(640, 1536, device="cuda") * 0.02, BLOCK)
    bias = torch.randn(640, device="cuda")
    out = fp8_triton.weight_only_matmul(x, w8, scale, BLOCK, bias)
    assert out.dtype == torch.float32
    exact = x.double() @ fp8.dequantize(w8, scale, BLOCK, torch.float64).t() + bias.double()
    error = ((out.double() - exact).norm() / exact.norm()).item()
    assert error < 1e-5, error


@pytest.mark.gpu
@pytest.mark.parametrize("n_out,k_in", [(4096, 4096), (640, 1536)])
def test_every_weight_only_config_within_twice_torch_fp8_reference(n_out, k_in):
    """Each config the autotuner may pick at a block step's rows (both formulations, every split), compiled."""
    torch.manual_seed(1)
    x = torch.randn(32, k_in, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n_out, k_in, device="cuda") * 0.02
    exact = x.float() @ weight.float().t()
    w8, scale = fp8.quantize_blocks(weight, BLOCK)
    reference = ((x.float() @ fp8.dequantize(w8, scale, BLOCK, torch.float32).t()) - exact).norm() / exact.norm()
    configs = [c for c in fp8_triton.weight_only_configs() if c.kwargs["BLOCK_M"] == 32]
    assert {c.kwargs["SWAP"] for c in configs} == {False, True}
    product = functools.partial(fp8_triton.weight_only_matmul, x, w8, scale, BLOCK)
    assert_every_config_close(configs, product, exact, reference)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [32, 64, 5])
@pytest.mark.parametrize("n_out,k_in", [(4096, 4096), (640, 1536)])
def test_every_few_rows_w8a8_config_within_twice_torch_fp8_reference(rows, n_out, k_in):
    """Each config the autotuner may pick for a block step's rows (every tile and split), compiled, against
    PyTorch's w8a8 reference (activations and weight quantized, dequantized, multiplied in float32)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n_out, k_in, device="cuda") * block_magnitudes(n_out, k_in).cuda()
    exact = x.float() @ weight.float().t()
    w8, scale = fp8.quantize_blocks(weight, BLOCK)
    values, scales = fp8_triton.quantize_rows(x, 128)
    x_deq = (values.float().unflatten(1, (-1, 128)) * scales[:, :, None]).flatten(1)
    reference = ((x_deq @ fp8.dequantize(w8, scale, BLOCK, torch.float32).t()) - exact).norm() / exact.norm()
    quantized = fp8.QuantizedRows(values, scales, x.shape, x.dtype)
    configs = fp8_triton._prune_few_rows(fp8_triton.few_rows_w8a8_configs(), {"M": rows})
    assert {c.kwargs["SPLIT_K"] for c in configs} == {1, 2, 4, 8} and {c.kwargs["BLOCK_N"] for c in configs} == {
        64,
        128,
    }
    product = functools.partial(fp8.few_rows_w8a8_matmul, quantized, w8, scale, BLOCK)
    assert_every_config_close(configs, product, exact, reference)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [32, 64, 5])
@pytest.mark.parametrize("n_out,k_in", [(4096, 4096), (640, 1536), (1024, 12288)])
def test_every_few_rows_rowwise_config_within_twice_torch_fp8_reference(rows, n_out, k_in):
    """Each config the autotuner may pick for the row-scaled few-rows kernel at a block step's rows (every tile,
    k tile and split), compiled, against PyTorch's row-scaled w8a8 reference; a split's sums are added up in a fixed
    order (the same bits again)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n_out, k_in, device="cuda") * row_magnitudes(n_out).cuda()
    configs = fp8_triton._prune_few_rows(fp8_triton.few_rows_rowwise_configs(), {"M": rows})
    assert {c.kwargs["SPLIT_K"] for c in configs} == {1, 2, 4, 8} and {c.kwargs["BLOCK_K"] for c in configs} == {
        128,
        256,
    }
    for config in configs:
        error, reference, out = rowwise_errors(x, weight, config=config)
        assert error <= 2 * reference + 2e-3, (config, error, reference)
        assert_deterministic(lambda c=config: rowwise_errors(x, weight, config=c)[2], out)


@pytest.mark.gpu
def test_row_scaled_few_rows_go_to_the_few_rows_kernel(monkeypatch):
    """Row-scaled weights at a block step's rows take the few-rows kernel (activations quantized one scale per row
    by their producer), above `FEW_ROWS_W8A8_MAX_ROWS` rows cuBLASLt's row-scaled product; `FEW_ROWS_ROWWISE` off
    sends all of them to cuBLASLt."""
    rows = fp8.FEW_ROWS_W8A8_MAX_ROWS
    few, many = torch.zeros(rows, 4096, device="cuda"), torch.zeros(rows + 1, 4096, device="cuda")
    fp8_cores = torch.cuda.get_device_capability() >= (8, 9)
    assert fp8.fp8_product_kernel(few, 12288, 4096, (1, 4096)) == ("few_rows" if fp8_cores else "torch")
    assert fp8.fp8_product_kernel(many, 12288, 4096, (1, 4096)) == ("rowwise" if fp8_cores else "torch")
    if fp8_cores:
        assert fp8.quantized_input_group(few, 12288, 4096, (1, 4096)) == 4096
    monkeypatch.setattr(fp8, "FEW_ROWS_ROWWISE", False)
    assert fp8.fp8_product_kernel(few, 12288, 4096, (1, 4096)) == ("rowwise" if fp8_cores else "torch")


def test_few_rows_rule_for_block_and_row_scales(monkeypatch):
    """`few_rows_w8a8_applies`, the one rule for both scalings, as on a GPU with FP8 tensor cores (faked, so that
    it runs here): row scales take every shape up to `FEW_ROWS_W8A8_MAX_ROWS` rows (unless `FEW_ROWS_ROWWISE` is
    off), block scales deep or much wider weights only; never on the CPU."""
    monkeypatch.setattr(fp8, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(fp8, "_fp8_tensor_cores", lambda index: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    rows = fp8.FEW_ROWS_W8A8_MAX_ROWS
    for n_out, k_in in [(4096, 4096), (12288, 4096), (24576, 4096), (4096, 12288)]:
        per_row = (1, k_in)
        assert fp8.few_rows_w8a8_applies(rows, n_out, k_in, per_row, cuda)
        assert not fp8.few_rows_w8a8_applies(rows + 1, n_out, k_in, per_row, cuda)
        assert not fp8.few_rows_w8a8_applies(rows, n_out, k_in, per_row, cpu)
        deep_or_widest = k_in > n_out or n_out >= fp8.FEW_ROWS_W8A8_MIN_WIDTH_RATIO * k_in
        assert fp8.few_rows_w8a8_applies(32, n_out, k_in, BLOCK, cuda) == deep_or_widest
    monkeypatch.setattr(fp8, "FEW_ROWS_ROWWISE", False)
    assert not fp8.few_rows_w8a8_applies(32, 4096, 4096, (1, 4096), cuda)
    assert fp8.few_rows_w8a8_applies(32, 4096, 12288, BLOCK, cuda)
    monkeypatch.setattr(fp8, "_fp8_tensor_cores", lambda index: False)
    assert not fp8.few_rows_w8a8_applies(32, 4096, 12288, (1, 12288), cuda)


def assert_deterministic(product, out):
    """A few-rows product run again gives `out` bit for bit (splits are added up in a fixed order)."""
    for _ in range(2):
        assert torch.equal(product(), out)


def assert_every_config_close(configs, product, exact: torch.Tensor, reference: torch.Tensor) -> None:
    """Each config's `product(config=config)` within twice the PyTorch reference's relative error `reference` from
    `exact` (plus 2e-3), and the same bits when run again."""
    for config in configs:
        out = product(config=config)
        error = (out.float() - exact).norm() / exact.norm()
        assert error <= 2 * reference + 2e-3, (config, error.item(), reference.item())
        assert_deterministic(lambda c=config: product(config=c), out)


@pytest.mark.gpu
def test_few_rows_w8a8_applies_to_few_rows_of_deep_or_widest_weights():
    """The measured rule: up to `FEW_ROWS_W8A8_MAX_ROWS` rows, 128 x 128 blocks, weights deeper than wide (LLaDA's
    down) or at least `FEW_ROWS_W8A8_MIN_WIDTH_RATIO` times wider than deep (gate/up), FP8 tensor cores; and the
    kernel `fp8_product_kernel` names for the others."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fp8_cores = torch.cuda.get_device_capability() >= (8, 9)
    assert fp8.few_rows_w8a8_applies(32, 4096, 12288, BLOCK, cuda) == fp8_cores  # down
    assert fp8.few_rows_w8a8_applies(32, 24576, 4096, BLOCK, cuda) == fp8_cores  # gate/up: 6x
    assert fp8.few_rows_w8a8_applies(1, 24576, 4096, BLOCK, cuda) == fp8_cores
    assert not fp8.few_rows_w8a8_applies(32, 12288, 4096, BLOCK, cuda)  # fused q/k/v: 3x, cuBLASLt
    assert not fp8.few_rows_w8a8_applies(32, 4096, 4096, BLOCK, cuda)  # output projection: weight-only
    rows = fp8.FEW_ROWS_W8A8_MAX_ROWS
    assert not fp8.few_rows_w8a8_applies(rows + 1, 4096, 12288, BLOCK, cuda)
    assert not fp8.few_rows_w8a8_applies(32, 4096, 12288, (64, 64), cuda)
    assert not fp8.few_rows_w8a8_applies(32, 4096, 12288, BLOCK, cpu)
    x = torch.zeros(32, 4096, device="cuda", dtype=torch.bfloat16)
    assert fp8.fp8_product_kernel(x, 4096, 4096, BLOCK) == "weight_only"
    if fp8.cublaslt_takes(x, 12288, 4096, BLOCK):
        assert fp8.fp8_product_kernel(x, 12288, 4096, BLOCK) == "scaled_mm"
    if fp8_cores:
        assert fp8.fp8_product_kernel(x, 24576, 4096, BLOCK) == "few_rows"
        assert fp8.quantized_input_group(x, 24576, 4096, BLOCK) == 128
    assert fp8.quantized_input_group(x, 4096, 4096, BLOCK) is None  # the weight-only kernel takes bf16 rows


def test_weight_only_kernel_takes_few_rows_of_weights_not_much_wider_than_deep():
    """The measured rule (`fp8.W8A8_MIN_WIDTH_RATIO`): up to `WEIGHT_ONLY_MAX_ROWS` rows the weight-only kernel,
    except for weights at least three times wider than deep where cuBLASLt's block-scaled product is available;
    beyond, always w8a8."""
    rows = fp8.WEIGHT_ONLY_MAX_ROWS
    assert fp8.weight_only_applies(32, 4096, 4096, cublaslt=True)  # LLaDA-8B's output projection
    assert fp8.weight_only_applies(rows, 4096, 12288, cublaslt=True)  # down
    assert fp8.weight_only_applies(32, 3072, 2048, cublaslt=True)  # LLaDA2.0-mini's fused q/k/v: 1.5x
    assert not fp8.weight_only_applies(32, 12288, 4096, cublaslt=True)  # LLaDA-8B's fused q/k/v: 3x
    assert not fp8.weight_only_applies(rows, 24576, 4096, cublaslt=True)  # gate/up
    assert fp8.weight_only_applies(32, 24576, 4096, cublaslt=False)  # no cuBLASLt block scaling: the Triton kernel
    assert not fp8.weight_only_applies(rows + 1, 4096, 4096, cublaslt=True)
    assert not fp8.weight_only_applies(rows + 1, 4096, 4096, cublaslt=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 32, 200])
@pytest.mark.parametrize("n_out,k_in", [(640, 512), (256, 1024)])
def test_fp8_linear_dispatch_with_bias_matches_torch_path(rows, n_out, k_in, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(2, rows, k_in, device="cuda", dtype=torch.bfloat16)
    w8, scale = fp8.quantize_blocks(torch.randn(n_out, k_in, device="cuda") * 0.02, BLOCK)
    bias = torch.randn(n_out, device="cuda", dtype=torch.bfloat16)
    few_rows_calls = []
    original = fp8.few_rows_w8a8_matmul

    def counted(*args, **kwargs):
        few_rows_calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(fp8, "few_rows_w8a8_matmul", counted)
    out = fp8.fp8_linear(x, w8, scale, BLOCK, bias)
    monkeypatch.undo()
    few_rows = fp8.few_rows_w8a8_applies(2 * rows, n_out, k_in, BLOCK, x.device)
    fp8_cores = torch.cuda.get_device_capability() >= (8, 9)
    assert few_rows == (2 * rows <= fp8.FEW_ROWS_W8A8_MAX_ROWS and k_in > n_out and fp8_cores)
    assert few_rows_calls == ([(2 * rows, k_in)] if few_rows else [])
    expected = fp8.fp8_linear(x, w8, scale, BLOCK, bias, use_triton=False)
    assert out.shape == (2, rows, n_out)
    # A wide weight (4x) at few rows: cuBLASLt's block-scaled product on SM90, within w8a8's tolerance.
    wide8, wide_scale = fp8.quantize_blocks(torch.randn(4 * k_in, k_in, device="cuda") * 0.02, BLOCK)
    wide = fp8.fp8_linear(x, wide8, wide_scale, BLOCK)
    wide_expected = fp8.fp8_linear(x, wide8, wide_scale, BLOCK, use_triton=False)
    assert (wide.float() - wide_expected.float()).abs().max() < 0.15 * wide_expected.float().abs().max()
    weight_only = not few_rows and fp8.weight_only_applies(2 * rows, n_out, k_in, cublaslt=True)  # neither is wide
    tolerance = 0.02 if weight_only else 0.15  # w8a8 also quantizes the activations
    assert (out.float() - expected.float()).abs().max() < tolerance * expected.float().abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_head", [False, True], ids=["bf16_head", "fp8_head"])
@pytest.mark.parametrize("weight_block_size", [BLOCK, None], ids=["blocks", "per_tensor"])
def test_gpu_quantized_generate_graph_equals_eager_and_torch_path(weight_block_size, quantize_head):
    config = tiny_config()
    _, quantized = quantized_model(config, "cuda", weight_block_size=weight_block_size, quantize_head=quantize_head)
    assert fp8.is_fp8_linear(quantized.model.transformer.ff_out) == quantize_head
    reference = dequantized_copy(quantized, config, "cuda")
    ids = torch.randint(0, 400, (2, 40), device="cuda")
    with torch.no_grad():
        fused = quantized(ids).logits.float()
        set_kernel_mode("torch")
        try:
            unfused = quantized(ids).logits.float()
        finally:
            set_kernel_mode("auto")
        expected = reference(ids).logits.float()
    # Per tensor the activations are quantized with one scale per row (256 columns here), not per 128 columns:
    # a coarser rounding (measured 0.064 of the largest logit on an H100), checked per product against PyTorch's own
    # FP8 reference in `test_row_scaled_product_error_within_twice_torch_fp8_reference`. An FP8 head quantizes the
    # final hidden states too, an error no later layer averages (block scales: 0.050 measured on an H100).
    tolerance = 0.05 if weight_block_size and not quantize_head else 0.08
    assert (fused - expected).abs().max() < tolerance * expected.abs().max()
    assert (unfused - expected).abs().max() < 0.05 * expected.abs().max()
    prompts = torch.randint(0, 400, (3, 21), device="cuda")
    for dual in (False, True):
        kwargs = dict(max_new_tokens=32, block_length=16, steps=16, use_cache=True, dual_cache=dual)
        graphed = quantized.generate(prompts, **kwargs)
        eager = quantized.generate(prompts, disable_compile=True, **kwargs)
        assert torch.equal(graphed, eager)


@pytest.mark.gpu
def test_gpu_fused_activation_quantization_writes_quantize_rows_bits():
    for dtype in (torch.bfloat16, torch.float16):
        assert not fused_quantization_differences("cuda", dtype), dtype


@pytest.mark.gpu
@pytest.mark.parametrize("weight_block_size", [BLOCK, None], ids=["blocks", "per_tensor"])
def test_gpu_fused_activation_quantization_changes_no_logit_and_no_token(monkeypatch, weight_block_size):
    """LLaDA with widths cuBLASLt's block-scaled product takes: the norms and the SiLU gate write the w8a8 products'
    activations quantized (counted: the fused producers really run, in the full forward and in graph-captured steps
    of a batch large enough for w8a8), and the logits and tokens are those of the unfused path, bit for bit."""
    from hf_dllm import modeling_llada

    config = tiny_config(d_model=512, n_heads=4, n_kv_heads=2, mlp_hidden_size=1024)
    _, quantized = quantized_model(config, "cuda", weight_block_size=weight_block_size)
    block = BLOCK if weight_block_size else (1, 512)
    # The rule at the forward's 80 rows (block steps of this batch take other kernels at block scales).
    if fp8.fp8_product_kernel(torch.zeros(80, 512, device="cuda"), 1024, 512, block) not in ("scaled_mm", "rowwise"):
        pytest.skip("cuBLASLt's block-scaled or torch's row-scaled FP8 product is not available on this GPU / torch")
    calls = {"norm": 0, "silu": 0}
    for name, key in (("rms_norm_to_fp8", "norm"), ("silu_mul_to_fp8", "silu")):
        original = getattr(modeling_llada, name)

        def counted(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(modeling_llada, name, counted)
    ids = torch.randint(0, 400, (2, 40), device="cuda")
    prompts = torch.randint(0, 400, (4, 21), device="cuda")
    kwargs = dict(max_new_tokens=32, block_length=16, steps=16, use_cache=True, dual_cache=True)
    results = {}
    for fuse in (True, False):
        monkeypatch.setattr(fp8, "FUSE_ACTIVATION_QUANTIZATION", fuse)
        with torch.no_grad():
            logits = quantized(ids).logits
        results[fuse] = (
            logits,
            quantized.generate(prompts, **kwargs),
            quantized.generate(prompts, disable_compile=True, **kwargs),
        )
        if fuse:
            # Two norms and one gate per layer in the forward over 80 rows, and in the generation's forwards.
            assert calls["norm"] > 2 * config.n_layers and calls["silu"] > config.n_layers, calls
            fused_calls = dict(calls)
    assert calls == fused_calls, "unfused runs must not call the fused producers"
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[True][2])  # graphs and eager, fused
    assert torch.equal(results[True][1], results[False][1])


@pytest.mark.gpu
@pytest.mark.parametrize("weight_block_size", ["bf16", BLOCK, None], ids=["bf16", "blocks", "per_tensor"])
def test_gpu_residual_adds_left_to_the_next_norm_change_no_logit_and_no_token(weight_block_size, monkeypatch):
    """Each block leaves its last residual add to the next norm (`residual_stream_forward`; counted: blocks handed a
    stream not yet added); a hooked block is called whole and adds its own. Logits (80 rows: w8a8 products) and
    tokens (batch 1, blocks of 16: the few-rows kernels; batch 4) are those of the hooked model, bit for bit.

    A forward keeping a few positions' logits computes the last block's queries, attention and MLP only there
    (`keep`), at fewer rows, where the products may take other kernels (other float32 sums) than at all of them:
    the bitwise comparison keeps every position in that block and selects after it, and the kept path itself is
    checked against the full logits within the products' rounding."""
    from hf_dllm.llada_lean import select_rows
    from hf_dllm.modeling_llada import LLaDALlamaBlock

    deferred_calls = []  # blocks handed a residual stream not yet added
    original = LLaDALlamaBlock.residual_stream_forward

    def counted(block, hidden_states, residual, *args, keep=None, **kwargs):
        deferred_calls.append(residual is not None)
        mlp_out, stream = original(block, hidden_states, residual, *args, **kwargs)
        if keep is None:
            return mlp_out, stream
        return select_rows(mlp_out, keep), select_rows(stream, keep)

    config = tiny_config(d_model=512, n_heads=4, n_kv_heads=2, mlp_hidden_size=1024)
    if weight_block_size == "bf16":
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = hf_dllm.LLaDAModelLM._from_config(config, dtype=torch.bfloat16).eval()
    else:
        _, model = quantized_model(config, "cuda", weight_block_size=weight_block_size)
    ids = torch.randint(0, 400, (2, 40), device="cuda")
    with torch.no_grad():
        full, kept = model(ids).logits.float(), model(ids, logits_to_keep=slice(5, 21)).logits.float()
    # Block scales: at the 32 kept rows the last block's products run weight-only (activations not quantized), at
    # all 80 rows w8a8 (measured 0.038 of the largest logit on an H100); row scales quantize the activations at both.
    tolerance = 0.06 if weight_block_size == BLOCK else 0.02
    assert (kept - full[:, 5:21]).abs().max() < tolerance * full.abs().max()
    monkeypatch.setattr(LLaDALlamaBlock, "residual_stream_forward", counted)
    kwargs = dict(max_new_tokens=32, block_length=16, steps=16, use_cache=True, dual_cache=True)
    results = []
    for hooked in (False, True):
        blocks = model.model.transformer.blocks if hooked else []
        hooks = [block.register_forward_hook(lambda *args: None) for block in blocks]
        with torch.no_grad():
            outputs = [model(ids).logits, model(ids, logits_to_keep=slice(5, 21)).logits]
        for batch in (1, 4):
            prompts = torch.randint(
                0, 400, (batch, 21), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
            )
            outputs += [model.generate(prompts, **kwargs), model.generate(prompts, disable_compile=True, **kwargs)]
        for hook in hooks:
            hook.remove()
        results.append(outputs)
        assert any(deferred_calls) != hooked, deferred_calls.count(True)
        deferred_calls.clear()
    assert torch.equal(results[0][1], results[0][0][:, 5:21])
    for deferred, whole in zip(*results, strict=True):
        assert torch.equal(deferred, whole)


def save_with_tokenizer(model, path: Path) -> Path:
    from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer

    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def test_loading_flag_refuses_cpu_and_unknown_values(tmp_path):
    import argparse

    from hf_dllm.cli.loading import add_model_arguments, load_model, model_arguments

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert model_arguments(parser.parse_args(["--quantization", "fp8"]))["quantization"] == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])
    folder = save_with_tokenizer(
        hf_dllm.LLaDAModelLM._from_config(
            tiny_config(vocab_size=103, embedding_size=103, mask_token_id=3, eos_token_id=0, pad_token_id=0)
        ),
        tmp_path / "ckpt",
    )
    with pytest.raises(ValueError, match="--quantization must be one of none, fp8, fp8-tensor"):
        load_model(folder, device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        load_model(folder, device="cpu", quantization="fp8")


@pytest.mark.parametrize("weight_block_size", [BLOCK, None], ids=["blocks", "per_tensor"])
def test_prequantized_checkpoint_round_trip(tmp_path, monkeypatch, weight_block_size):
    # A checkpoint saved quantized (the Hub's `weight` + `weight_scale_inv` layout) reloads without a config: on
    # the CPU transformers dequantizes it to bf16, which must equal our dequantization.
    config = tiny_config()
    _, quantized = quantized_model(config, "cpu", monkeypatch, weight_block_size=weight_block_size)
    quantized.save_pretrained(tmp_path / "fp8")
    monkeypatch.undo()
    reloaded = hf_dllm.LLaDAModelLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16).eval()
    reference = dequantized_copy(quantized, config, "cpu")
    ids = torch.randint(0, 400, (1, 12))
    with torch.no_grad():
        if torch.cuda.is_available():
            pytest.skip("on a GPU the checkpoint loads in FP8 (see the GPU test)")
        assert torch.allclose(reloaded(ids).logits.float(), reference(ids).logits.float(), atol=1e-2, rtol=0)


@pytest.mark.gpu
def test_gpu_load_model_fp8_and_prequantized(tmp_path):
    from hf_dllm.cli.loading import load_model

    config = tiny_config(vocab_size=103, embedding_size=103, mask_token_id=3, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    folder = save_with_tokenizer(hf_dllm.LLaDAModelLM._from_config(config, dtype=torch.bfloat16), tmp_path / "bf16")
    model, tokenizer = load_model(folder, quantization="fp8", device="cuda")
    assert model.model.transformer.blocks[0].q_proj.weight.dtype == fp8.FP8_DTYPE
    assert model.device.type == "cuda"
    prompts = torch.randint(4, 100, (2, 10), device="cuda")
    out = model.generate(prompts, max_new_tokens=16, block_length=8, steps=8, use_cache=True, dual_cache=True)
    model.save_pretrained(tmp_path / "fp8")
    reloaded = hf_dllm.LLaDAModelLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, device_map="cuda")
    assert reloaded.model.transformer.blocks[1].ff_out.weight.dtype == fp8.FP8_DTYPE
    again = reloaded.generate(prompts, max_new_tokens=16, block_length=8, steps=8, use_cache=True, dual_cache=True)
    assert torch.equal(out, again)


def llada2_config(**overrides):
    """A tiny LLaDA2 MoE whose expert widths FP8 block scaling accepts (multiples of 128)."""
    from hf_dllm import LLaDA2MoeConfig

    values = dict(
        vocab_size=61,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=128,
        max_position_embeddings=128,
        mask_token_id=60,
        pad_token_id=0,
        eos_token_id=1,
        first_k_dense_replace=1,
        num_shared_experts=1,
    )
    return LLaDA2MoeConfig(**(values | overrides))


def llada2_quantized_model(config, dtype=torch.bfloat16, device: str = "cpu"):
    """A random LLaDA2 (weights spread so that routing is not uniform) and its FP8 copy made by transformers'
    quantizer with hf_dllm's skip list (`fp8_quantization_config`). On the CPU the caller lifts transformers'
    device check (see `quantized_model`)."""
    from hf_dllm import LLaDA2MoeModelLM

    model = random_weights_model(LLaDA2MoeModelLM, config, dtype=dtype, device=device, noise=0.05)
    quantized = LLaDA2MoeModelLM.from_pretrained(
        None,
        config=config,
        state_dict=model.state_dict(),
        quantization_config=fp8.fp8_quantization_config("llada2"),
        dtype=dtype,
        device_map=device,
    ).eval()
    return model, quantized


def llada2_dequantized_copy(quantized, config, dtype=torch.bfloat16, device: str = "cpu"):
    from hf_dllm import LLaDA2MoeModelLM

    with torch.device(device):
        reference = LLaDA2MoeModelLM._from_config(config, dtype=dtype).eval()
    state = {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in dequantized_state(quantized).items()
    }
    reference.load_state_dict(state)
    return reference


def test_llada2_quantized_matches_dequantized_weights(monkeypatch, tmp_path):
    # LLaDA2 MoE with hf_dllm's skip list (`FP8_MODULES_TO_NOT_CONVERT`): attention, dense MLP, every routed expert's
    # layers and the shared experts in FP8 under the Hub's names; the head bf16, and the `experts` list not swapped
    # for transformers' fused FP8Experts.
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from hf_dllm import LLaDA2MoeModelLM

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    config = llada2_config()
    model, quantized = llada2_quantized_model(config)
    assert_quantized_from(model.state_dict(), quantized.state_dict(), BLOCK)
    moe = quantized.model.layers[1].mlp
    assert isinstance(moe.experts, torch.nn.ModuleList) and quantized.lm_head.weight.dtype == torch.bfloat16
    for expert in [*moe.experts, moe.shared_experts]:
        for layer in (expert.gate_proj, expert.up_proj, expert.down_proj):
            assert fp8.is_fp8_linear(layer), layer
    assert quantized.model.layers[0].mlp.down_proj.weight.dtype == fp8.FP8_DTYPE
    assert quantized.model.layers[0].attention.query_key_value.weight.dtype == fp8.FP8_DTYPE
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in quantized.state_dict()
    reference = llada2_dequantized_copy(quantized, config)
    ids = torch.randint(2, 59, (2, 16))
    with torch.no_grad():
        logits = quantized(ids, block_length=4).logits.float()
        expected = reference(ids, block_length=4).logits.float()
    assert torch.allclose(logits, expected, atol=2e-2, rtol=0), (logits - expected).abs().max()

    # The stacks of the grouped path hold the FP8 weights and scales; the experts' parameters are views of them.
    stacks = moe.stacked_weights()
    assert stacks.gate_up.dtype == fp8.FP8_DTYPE and stacks.block_size == BLOCK
    assert stacks.gate_up.shape == (5, 256, 128) and stacks.gate_up_scale.shape == (5, 2, 1)  # 4 routed + shared
    assert stacks.down_scale.shape == (5, 1, 1)
    assert moe.experts[2].up_proj.weight_scale_inv.data_ptr() == stacks.gate_up_scale[2, 1:].data_ptr()
    assert moe.shared_experts.down_proj.weight.data_ptr() == stacks.down[4].data_ptr()

    # Saved and loaded again: the Hub's pre-quantized layout (one weight and scale per expert layer), same logits.
    quantized.save_pretrained(tmp_path / "fp8")
    reloaded = LLaDA2MoeModelLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16).eval()
    assert fp8.is_fp8_linear(reloaded.model.layers[1].mlp.experts[3].down_proj)
    with torch.no_grad():
        assert torch.equal(reloaded(ids, block_length=4).logits.float(), logits)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 1024])
def test_every_grouped_config_within_twice_torch_fp8_reference(tokens):
    """The experts' grouped FP8 products at LLaDA2.0-mini's widths (64 of its 256 experts, top-8), each config the
    autotuner may pick and its own choice, compiled: gate/up with the SiLU gate, and down."""
    from hf_dllm import grouped_gemm

    configs = [None, *grouped_gemm.grouped_configs()]
    for gated, k_in, n_out in ((True, 2048, 512), (False, 512, 2048)):
        torch.manual_seed(tokens)
        errors, reference = grouped_errors(tokens, 64, 8, k_in, n_out, gated, torch.bfloat16, "cuda", configs)
        assert None not in errors  # every config fits the shared memory with FP8 weights
        for config, error in zip(configs, errors, strict=True):
            # bf16 output rounding (2^-9) is added to the float32 reference's error.
            assert error <= 2 * reference + 2e-3, (gated, config, error, reference)


@pytest.mark.gpu
def test_gpu_llada2_fp8_experts_graph_equals_eager_and_torch_path():
    """A bf16 LLaDA2 with FP8 experts on the GPU, against a float32 copy holding the dequantized weights: the fused
    MoE layer (the grouped FP8 kernel) errs within twice the PyTorch path's error (each expert's layers, dequantized
    to bf16; same input, so the same experts); the whole model too, at 64 rows (the weight-only products of a block
    step: more rows also quantize the activations); generate()'s CUDA graphs give the eager path's tokens."""
    config = llada2_config(num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, num_hidden_layers=3)
    _, quantized = llada2_quantized_model(config, device="cuda")
    moe = quantized.model.layers[1].mlp
    reference = llada2_dequantized_copy(quantized, config, dtype=torch.float32, device="cuda")

    def relative_errors(run, *inputs):
        # (fused error, PyTorch path error) of bf16 `run(quantized, ...)` against float32 `run(reference, ...)` on
        # the PyTorch path.
        with torch.no_grad():
            fused = run(quantized, *inputs).float()
            set_kernel_mode("torch")
            try:
                unfused = run(quantized, *inputs).float()
                expected = run(reference, *(x.float() if x.is_floating_point() else x for x in inputs)).float()
            finally:
                set_kernel_mode("auto")
        return [((out - expected).norm() / expected.norm()).item() for out in (fused, unfused)]

    def moe_output(model, x):  # the MoE layer alone, as the decoder layer calls it (the fused path adds a residual)
        block, hidden = model.model.layers[1].mlp, x[None]
        if block.use_fused(hidden):
            return block.fused_forward(hidden, torch.zeros_like(hidden))[0]
        return block(hidden)[0]

    with torch.no_grad():  # as generate() asks (FP8 parameters require grad after loading)
        assert moe.use_fused(torch.zeros(1, 128, device="cuda", dtype=torch.bfloat16))
        assert quantized._diffusion_step_capturable()
    x = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16)
    fused_error, unfused_error = relative_errors(moe_output, x)
    assert fused_error <= 2 * unfused_error + 1e-3, ("layer", fused_error, unfused_error)
    ids = torch.randint(2, 59, (2, 32), device="cuda")
    fused_error, unfused_error = relative_errors(lambda model, ids: model(ids, block_length=8).logits, ids)
    assert fused_error <= 2 * unfused_error + 1e-3, ("model", fused_error, unfused_error)
    prompts = torch.randint(2, 59, (3, 21), device="cuda")
    kwargs = dict(max_new_tokens=32, block_length=8, steps=32, eos_early_stop=False)
    graphed = quantized.generate(prompts, **kwargs)
    eager = quantized.generate(prompts, disable_compile=True, **kwargs)
    assert torch.equal(graphed, eager)


def test_quantize_blocks_of_stacked_weights_quantizes_each_alone():
    torch.manual_seed(0)
    weight = torch.randn(3, 200, 300)
    w8, scale = fp8.quantize_blocks(weight, BLOCK)
    assert w8.shape == (3, 200, 300) and scale.shape == (3, 2, 3)
    dequantized = fp8.dequantize(w8, scale, BLOCK, torch.float32)
    for expert in range(3):
        alone, alone_scale = fp8.quantize_blocks(weight[expert], BLOCK)
        assert torch.equal(w8[expert].float(), alone.float()) and torch.equal(scale[expert], alone_scale)
        assert torch.equal(dequantized[expert], fp8.dequantize(alone, alone_scale, BLOCK, torch.float32))


def test_grouped_matmul_refuses_bad_operands():
    pytest.importorskip("triton")
    from hf_dllm import grouped_gemm

    x, offsets = torch.randn(6, 128), torch.tensor([2, 6], dtype=torch.int32)
    w8, scale = fp8.quantize_blocks(torch.randn(2, 128, 128), BLOCK)
    with pytest.raises(ValueError, match="offsets must have shape"):
        grouped_gemm.grouped_matmul(x, offsets[:1], w8, scale, BLOCK)
    with pytest.raises(ValueError, match="x has 64 columns"):
        grouped_gemm.grouped_matmul(x[:, :64], offsets, w8, scale, BLOCK)
    with pytest.raises(ValueError, match="given together"):
        grouped_gemm.grouped_matmul(x, offsets, w8, scale)
    with pytest.raises(ValueError, match="must have x's dtype"):
        grouped_gemm.grouped_matmul(x, offsets, w8.to(torch.bfloat16))
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        grouped_gemm.grouped_matmul(x, offsets, w8, scale, BLOCK, gated=True)  # gated: gate and up scale rows


def test_head_suffixed_quantization_names():
    """`FP8_QUANTIZATIONS` = the schemes and each with `+head` (the CLI's `--quantization`); `fp8_config_for` gives
    transformers' config of the scheme, the head converted too with `+head`, and refuses `+head` on a head tied to
    the input embedding (a config object or its `config.json` dict)."""
    from hf_dllm.cli.loading import QUANTIZATION_CHOICES

    assert fp8.FP8_QUANTIZATIONS == ("fp8", "fp8-tensor", "fp8+head", "fp8-tensor+head")
    assert QUANTIZATION_CHOICES == ("none", *fp8.FP8_QUANTIZATIONS)
    assert fp8.split_head_suffix("fp8-tensor+head") == ("fp8-tensor", True)
    with pytest.raises(ValueError, match="fp8, fp8-tensor, fp8\\+head"):
        fp8.split_head_suffix("fp8+tail")
    untied = {"model_type": "llada2_moe", "tie_word_embeddings": False}
    body = fp8.fp8_config_for(untied, "fp8-tensor")
    assert body.weight_block_size is None and "lm_head" in body.modules_to_not_convert
    with_head = fp8.fp8_config_for(hf_dllm.LLaDA2MoeConfig(tie_word_embeddings=False), "fp8+head")
    assert "lm_head" not in with_head.modules_to_not_convert and with_head.weight_block_size == (128, 128)
    for tied in ({"model_type": "llada", "weight_tying": True}, hf_dllm.LLaDA2MoeConfig(tie_word_embeddings=True)):
        with pytest.raises(ValueError, match="ties it to its input embedding"):
            fp8.fp8_config_for(tied, "fp8-tensor+head")
        fp8.fp8_config_for(tied, "fp8-tensor")
