"""DiffusionGemma with FP8 weights through `quantization_config` (`fp8.fp8_quantization_config("diffusion_gemma")`,
the family's `fp8_modules_to_not_convert`): attention, the dense MLP and the self-conditioning MLP in FP8 (128 x 128
block scales), run through hf_dllm's `kernels.linear`; the head (the tied embedding), the router and the experts'
3D tensors kept in the model's dtype.

CPU: the weights transformers' quantizer converts are exactly those; a model quantized on the fly computes what its
dequantized weights compute, within FP8's rounding of the source (error at most 16x bf16's against float32: e4m3
keeps 3 mantissa bits, bf16 7); `hf-dllm export --quantization fp8` writes those weights as FP8 with their scales
and loads again as the same FP8 layers with the same logits. GPU (marked `gpu`): the export loads as FP8 layers run by
hf_dllm's FP8 kernels, within the same bound of the bf16 source, and generates well-formed canvases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModel

import hf_dllm
from hf_dllm import fp8
from hf_dllm.hub.export import export_checkpoint
from hf_dllm.hub.quantize import fp8_weight_names, scale_name
from tests.conftest import FIXTURES, assert_quantized_from

# Per layer (and the decoder's self-conditioning MLP): what is FP8.
FP8_LAYERS = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
}  # fmt: skip
SELF_CONDITIONING = {f"model.decoder.self_conditioning.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")}


def block_divisible_config() -> hf_dllm.DiffusionGemmaConfig:
    """The fixture's config with widths that 128 x 128 FP8 blocks divide (hidden 128, heads of 64 / 128)."""
    config = json.loads((FIXTURES / "diffusion-gemma-tiny-ref" / "config.json").read_text())
    text = config["text_config"]
    text.update(hidden_size=128, intermediate_size=256, head_dim=64, moe_intermediate_size=128, vocab_size=384)
    text["per_layer_config"]["2"]["head_dim"] = 128
    config.update(boi_token_id=381, eoi_token_id=382, image_token_id=383)
    return hf_dllm.DiffusionGemmaConfig.from_dict(config)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A random bfloat16 DiffusionGemma of `block_divisible_config`, saved."""
    torch.manual_seed(0)
    model = hf_dllm.DiffusionGemmaForBlockDiffusion(block_divisible_config()).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("gemma-bf16")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def export(source, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma-fp8") / "export"
    export_checkpoint(source, path, quantization="fp8", tokenizer=False)
    return path


def inputs(device="cpu"):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 380, (2, 12), generator=generator)
    canvas = torch.randint(0, 380, (2, 16), generator=generator)
    return ids.to(device), canvas.to(device)


@torch.no_grad()
def logits(model, device="cpu") -> torch.Tensor:
    ids, canvas = inputs(device)
    return model(input_ids=ids, decoder_input_ids=canvas).logits.float()


def assert_fp8_error_bounded(got, source, device="cpu"):
    """`got` (FP8 weights) differs from the float32 source by more than bf16 does, and by at most 16x as much (mean
    absolute logit error)."""
    exact = logits(AutoModel.from_pretrained(source, dtype=torch.float32).eval().to(device), device)
    bf16 = logits(AutoModel.from_pretrained(source, dtype=torch.bfloat16).eval().to(device), device)
    bf16_error, fp8_error = (bf16 - exact).abs().mean(), (got - exact).abs().mean()
    assert bf16_error < fp8_error <= 16 * bf16_error, (float(fp8_error), float(bf16_error))


@pytest.fixture
def cpu_quantization(monkeypatch):
    # transformers quantizes on CUDA/XPU only; its quantization math is plain torch, so the CPU tests lift the check.
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)


def test_fp8_weights_follow_the_family_skip_list():
    config = block_divisible_config()
    names = set(
        fp8_weight_names(
            hf_dllm.DiffusionGemmaForBlockDiffusion, config, fp8.fp8_quantization_config("diffusion_gemma")
        )
    )
    layers = config.text_config.num_hidden_layers
    expected = {
        f"model.decoder.layers.{i}.{name}.weight"
        for i in range(layers)
        for name in FP8_LAYERS
        if not (name == "self_attn.v_proj" and config.text_config.layer_types[i] == "full_attention")
    }
    assert names == expected | SELF_CONDITIONING


def test_quantized_model_computes_its_fp8_weights(cpu_quantization, source, export):
    """Quantized on the fly (CPU): FP8 layers where the skip list allows, the rest in bf16; the export loads as the
    same FP8 layers (the source's weights quantized once, bit for bit) with the same logits; both within FP8's rounding
    of the source."""
    model = AutoModel.from_pretrained(
        source, dtype=torch.bfloat16, quantization_config=fp8.fp8_quantization_config("diffusion_gemma")
    ).eval()
    layer = model.model.decoder.layers[0]
    assert fp8.is_fp8_linear(layer.self_attn.q_proj) and fp8.is_fp8_linear(
        model.model.decoder.self_conditioning.up_proj
    )
    assert fp8.fp8_block_size(layer.mlp.down_proj) == (128, 128)
    assert layer.router.proj.weight.dtype == torch.bfloat16 and layer.experts.gate_up_proj.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    weights = load_file(next(source.glob("*.safetensors")))
    assert_quantized_from(weights, model.state_dict(), (128, 128))
    got = logits(model)
    loaded = AutoModel.from_pretrained(export, dtype=torch.bfloat16).eval()
    assert fp8.is_fp8_linear(loaded.model.decoder.layers[0].self_attn.q_proj)
    assert_quantized_from(weights, loaded.state_dict(), (128, 128))
    torch.testing.assert_close(logits(loaded), got, rtol=0, atol=1e-6)
    assert_fp8_error_bounded(got, source)
    torch.manual_seed(0)
    out = model.generate(inputs()[0], max_new_tokens=16, max_denoising_steps=4, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 28) and int(out.nfe) <= 4


def test_export_writes_the_fp8_weights_and_scales(source, export):
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == list(
        hf_dllm.family.registered_family("diffusion_gemma").fp8_modules_to_not_convert
    )
    names = set(
        fp8_weight_names(
            hf_dllm.DiffusionGemmaForBlockDiffusion,
            block_divisible_config(),
            fp8.fp8_quantization_config("diffusion_gemma"),
        )
    )
    with safe_open(next(export.glob("*.safetensors")), framework="pt") as weights:
        stored = {name: weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert {name for name, dtype in stored.items() if dtype == "F8_E4M3"} == names
    assert all(scale_name(name) in stored for name in names)


@pytest.mark.gpu
def test_fp8_export_runs_on_the_gpu_within_fp8_error(source, export):
    model = AutoModel.from_pretrained(export, dtype=torch.bfloat16, device_map="cuda").eval()
    assert fp8.is_fp8_linear(model.model.decoder.layers[0].self_attn.q_proj)
    assert_fp8_error_bounded(logits(model, "cuda"), source, "cuda")
    torch.manual_seed(0)
    out = model.generate(inputs("cuda")[0], max_new_tokens=32, max_denoising_steps=8, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 44) and int(out.nfe) <= 16
    assert bool((out.sequences[:, 12:] < 384).all())
