"""`hf-dllm export --quantization fp8` (hf_dllm/hub/quantize.py): FP8 weights with 128x128 block scales, written
on the CPU in the layout transformers loads as pre-quantized.

On the CPU: the quantization is transformers' own arithmetic bit for bit; the exported weights are exactly the
layers transformers' FP8 quantizer converts (LLaDA2.x's head kept, each expert's layers quantized); the block scales rebuild every
weight within FP8's rounding; transformers loads the export (dequantized on a CPU) with logits close to the
source's; bad input is refused before anything is written. On a GPU (marked `gpu`): the export loads as FP8 layers
holding exactly what an on-the-fly `FineGrainedFP8Config` load computes, and generates the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hf_dllm
from hf_dllm.fp8 import FP8_MAX, dequantize, fp8_quantization_config
from hf_dllm.hub.export import export_checkpoint
from hf_dllm.hub.export import main as export_main
from hf_dllm.hub.families import ExportError
from hf_dllm.hub.quantize import FP8_DTYPE, quantize_fp8_blocks, scale_name
from tests.conftest import assert_quantized_from

BLOCK_WIDE = dict(mask_token_id=383, eos_token_id=382, pad_token_id=381)  # a vocabulary of 384 = 3 blocks

# The block an FP8 export writes: transformers' FineGrainedFP8Config default, as hf_dllm's config gives it.
FP8_BLOCK = tuple(fp8_quantization_config().weight_block_size)


def assert_within_half_a_step(weight: torch.Tensor, scale: torch.Tensor, original: torch.Tensor, name: str) -> None:
    """FP8 `weight` with its block `scale` dequantizes to `original` within half a step of each block's largest
    value (e4m3 keeps 3 mantissa bits: 2^-4 relative to the block's FP8 max)."""
    rebuilt = dequantize(weight, scale, FP8_BLOCK, torch.float32).cpu()
    bound = scale.cpu().repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1) * FP8_MAX * 2**-4
    assert ((rebuilt - original.float().cpu()).abs() <= bound).all(), name


def llada_source(path: Path, **overrides) -> Path:
    """A random bf16 LLaDA whose widths the FP8 block divides, saved as a safetensors checkpoint."""
    fields = dict(d_model=128, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=256, vocab_size=384)
    fields.update(embedding_size=384, max_sequence_length=256, bos_token_id=1, **BLOCK_WIDE)
    fields.update(overrides)
    torch.manual_seed(0)
    hf_dllm.LLaDAModelLM(hf_dllm.LLaDAConfig(**fields)).to(torch.bfloat16).save_pretrained(path)
    return path


def llada2_source(path: Path) -> Path:
    """A random bf16 LLaDA2 (dense first layer, 4 experts + a shared one) with block-divisible widths."""
    config = hf_dllm.LLaDA2MoeConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, num_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=256, **BLOCK_WIDE,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_dllm.LLaDA2MoeModelLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def assert_reloads_close_to(src: Path, dst: Path) -> None:
    """The LLaDA export `dst` (dequantized by transformers on a CPU) gives logits other than, and within 10 % of
    the largest of, the source `src`'s."""
    ids = torch.randint(0, 380, (1, 24), generator=torch.Generator().manual_seed(0))
    source = hf_dllm.LLaDAModelLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    loaded = hf_dllm.LLaDAModelLM.from_pretrained(dst, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want, got = source(ids).logits.float(), loaded(ids).logits.float()
    assert not torch.equal(want, got) and (got - want).abs().max() <= 0.1 * want.abs().max()


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            out.update({name: weights.get_tensor(name) for name in weights.keys()})
    return out


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (384, 128)])
def test_block_quantization_is_transformers_arithmetic(shape):
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import FineGrainedFP8Config

    torch.manual_seed(sum(shape))
    weight = (torch.randn(shape) * torch.logspace(-3, 1, shape[1])).to(torch.bfloat16)
    weight[:128, :128] = 0  # an all-zero block keeps scale 1
    quantizer = type("Quantizer", (), {"quantization_config": FineGrainedFP8Config(weight_block_size=list(FP8_BLOCK))})
    expected = finegrained.Fp8Quantize(quantizer).convert({"layer.weight": weight})
    quantized, scale_inv = quantize_fp8_blocks(weight, FP8_BLOCK)
    assert quantized.dtype == FP8_DTYPE and scale_inv.dtype == torch.float32
    assert torch.equal(quantized.view(torch.uint8), expected["layer.weight"].view(torch.uint8))
    assert torch.equal(scale_inv, expected["layer.weight_scale_inv"])
    assert torch.equal(scale_inv[0, 0], torch.tensor(1.0))


@pytest.fixture(scope="module")
def llada_export(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    src = llada_source(root / "src")
    assert export_main([str(src), str(root / "dst"), "--quantization", "fp8", "--no-tokenizer"]) == 0
    return src, root / "dst"


def test_llada_export_quantizes_the_block_linears_and_keeps_the_rest(llada_export):
    src, dst = llada_export
    original, exported = tensors(src), tensors(dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == list(FP8_BLOCK)
    fp8 = sorted(name for name, tensor in exported.items() if tensor.dtype == FP8_DTYPE)
    linears = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
    assert fp8 == sorted(f"model.transformer.blocks.{i}.{name}.weight" for i in range(2) for name in linears)
    assert set(exported) == set(original) | {scale_name(name) for name in fp8}
    for name, tensor in original.items():
        if name in fp8:
            scale = exported[scale_name(name)]
            assert scale.shape == (tensor.shape[0] // FP8_BLOCK[0], tensor.shape[1] // FP8_BLOCK[1])
            assert_within_half_a_step(exported[name], scale, tensor, name)
        else:  # the embedding, the output head (transformers' quantizer keeps the last layer), the norms
            assert torch.equal(exported[name], tensor), name


def test_llada_export_loads_with_transformers_close_to_the_source(llada_export):
    # On a CPU transformers dequantizes a pre-quantized FP8 checkpoint to bf16 (it cannot run FP8 here).
    if torch.cuda.is_available():
        pytest.skip("with a GPU the export loads in FP8 (the GPU test below)")
    src, dst = llada_export
    ids = torch.randint(0, 380, (1, 24), generator=torch.Generator().manual_seed(0))
    # (bf16: transformers' CPU dequantization gives bf16 weights whatever `dtype` asks.)
    source = hf_dllm.LLaDAModelLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    loaded = hf_dllm.LLaDAModelLM.from_pretrained(dst, dtype=torch.bfloat16).eval()
    block = loaded.model.transformer.blocks[0]
    assert block.q_proj.weight.dtype != FP8_DTYPE  # dequantized on the CPU
    with torch.no_grad():
        expected, got = source(ids).logits.float(), loaded(ids).logits.float()
    assert not torch.equal(expected, got)  # the weights did change
    assert (got - expected).abs().max() <= 0.1 * expected.abs().max()


def test_llada2_export_quantizes_each_expert_and_keeps_the_head_in_bf16(tmp_path):
    src = llada2_source(tmp_path / "src")
    export_checkpoint(src, tmp_path / "dst", quantization="fp8", tokenizer=False)
    exported = tensors(tmp_path / "dst")
    fp8 = {name for name, tensor in exported.items() if tensor.dtype == FP8_DTYPE}
    assert fp8, "nothing was quantized"
    assert not any(name.startswith("lm_head") for name in fp8)
    for expert in range(4):  # the Hub's per-expert names, as pre-quantized MoE checkpoints store them
        for layer in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{expert}.{layer}.weight" in fp8
    assert "model.layers.0.mlp.gate_proj.weight" in fp8  # the dense first layer
    assert "model.layers.1.attention.query_key_value.weight" in fp8
    assert any(".shared_experts." in name for name in fp8)
    assert all(scale_name(name) in exported for name in fp8)


def test_bad_quantization_requests_are_refused_before_writing(tmp_path, llada_export):
    src, dst = llada_export
    with pytest.raises(
        ExportError,
        match=r"--quantization must be one of none, fp8, fp8-tensor, fp8\+head, fp8-tensor\+head, got 'int4'",
    ):
        export_checkpoint(src, tmp_path / "a", quantization="int4", tokenizer=False)
    with pytest.raises(ExportError, match="--link cannot be combined"):
        export_checkpoint(src, tmp_path / "b", quantization="fp8", link=True, tokenizer=False)
    with pytest.raises(ExportError, match="already quantized"):
        export_checkpoint(dst, tmp_path / "c", quantization="fp8", tokenizer=False)
    narrow = llada_source(tmp_path / "narrow", d_model=64, n_heads=2, mlp_hidden_size=128)
    with pytest.raises(ExportError, match=r"not multiples of it: .*blocks\.0\.q_proj\.weight \[64, 64\]"):
        export_checkpoint(narrow, tmp_path / "d", quantization="fp8", tokenizer=False)
    assert not any((tmp_path / name).exists() for name in "abcd")
    assert (
        export_main([str(src), str(tmp_path / "e"), "--quantization", "int4", "--no-tokenizer"]) == 2
    )  # argparse's usage error


def test_exported_fp8_checkpoint_reexports_unchanged(tmp_path, llada_export):
    # A pre-quantized SRC exports as it is (its block scales are expected tensors, not unknown ones).
    _, dst = llada_export
    export_checkpoint(dst, tmp_path / "again", tokenizer=False)
    assert tensors(tmp_path / "again").keys() == tensors(dst).keys()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_export_loads_as_fp8_layers_like_an_on_the_fly_quantized_load(llada_export):
    """The export loads pre-quantized on a GPU: FP8 layers where an on-the-fly `FineGrainedFP8Config` load has
    them, both holding the source weights quantized once, bit for bit (under transformers < 5.23 through
    `fp8.QuantizesFromLoadDtype`), within half an FP8 step per block, and it generates through hf_dllm's FP8
    kernels."""
    from transformers import FineGrainedFP8Config

    src, dst = llada_export
    source = hf_dllm.LLaDAModelLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    fly = hf_dllm.LLaDAModelLM.from_pretrained(
        src, dtype=torch.bfloat16, device_map={"": "cuda"}, quantization_config=FineGrainedFP8Config()
    ).eval()
    loaded = hf_dllm.LLaDAModelLM.from_pretrained(dst, dtype=torch.bfloat16, device_map={"": "cuda"}).eval()
    fly_state, loaded_state, source_state = fly.state_dict(), loaded.state_dict(), source.state_dict()
    assert fly_state.keys() == loaded_state.keys()
    quantized = [name for name, tensor in loaded_state.items() if tensor.dtype == FP8_DTYPE]
    assert quantized == [name for name, tensor in fly_state.items() if tensor.dtype == FP8_DTYPE]
    for name in quantized:
        scale = loaded_state[scale_name(name)]
        assert_within_half_a_step(loaded_state[name], scale, source_state[name], name)
    for state in (fly_state, loaded_state):
        assert_quantized_from(source_state, {name: tensor.cpu() for name, tensor in state.items()}, FP8_BLOCK)
    ids = torch.randint(0, 380, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = loaded.generate(ids, max_new_tokens=32, block_length=16, eos_early_stop=False, return_dict_in_generate=True)
    assert out.nfe == 32 and (out.sequences[:, 16:] != BLOCK_WIDE["mask_token_id"]).all()
    with torch.no_grad():
        expected = source.cuda()(ids).logits.float()
        got = loaded(ids).logits.float()
    assert (got - expected).abs().max() <= 0.1 * expected.abs().max()


def test_per_tensor_export_is_transformers_arithmetic_and_reloads(tmp_path):
    """`--quantization fp8-tensor`: one scale per matrix (`FineGrainedFP8Config(weight_block_size=None)`), the
    bits transformers' quantizer writes; the export reloads (dequantized on a CPU) close to the source, and
    re-exports unchanged (its `(1, 1)` scales are expected tensors)."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import FineGrainedFP8Config

    src = llada_source(tmp_path / "src")
    assert export_main([str(src), str(tmp_path / "dst"), "--quantization", "fp8-tensor", "--no-tokenizer"]) == 0
    original, exported = tensors(src), tensors(tmp_path / "dst")
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] is None
    quantizer = type("Quantizer", (), {"quantization_config": FineGrainedFP8Config(weight_block_size=None)})
    name = "model.transformer.blocks.1.ff_proj.weight"
    expected = finegrained.Fp8Quantize(quantizer).convert({name: original[name]})
    assert torch.equal(exported[name].view(torch.uint8), expected[name].view(torch.uint8))
    assert torch.equal(exported[scale_name(name)], expected[scale_name(name)].reshape(1, 1))
    assert all(exported[scale_name(n)].shape == (1, 1) for n in exported if exported[n].dtype == FP8_DTYPE)
    assert_reloads_close_to(src, tmp_path / "dst")
    export_checkpoint(tmp_path / "dst", tmp_path / "again", tokenizer=False)
    assert tensors(tmp_path / "again").keys() == exported.keys()


def test_an_fp8_checkpoint_is_checked_with_its_own_block_size():
    """A pre-quantized SRC with another `weight_block_size` than the default expects scales of that block."""
    from hf_dllm.hub.verify import expected_tensor_shapes

    config = hf_dllm.LLaDAConfig(
        d_model=128, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=256, vocab_size=384, embedding_size=384,
        max_sequence_length=256, bos_token_id=1, **BLOCK_WIDE,
    ).to_dict()  # fmt: skip
    for block in ([128, 128], [64, 32]):
        config["quantization_config"] = dict(quant_method="fp8", weight_block_size=block)
        required, _ = expected_tensor_shapes(config)
        assert required["model.transformer.blocks.0.ff_proj.weight_scale_inv"] == (256 // block[0], 128 // block[1])


def test_head_export_quantizes_the_output_head_too(tmp_path):
    """`--quantization fp8+head`: the output head is stored in FP8 with its block scales as well (transformers'
    `modules_to_not_convert=[]`, written to the export's config), and the export reloads close to the source; a head
    tied to the input embedding is refused before anything is written."""
    src = llada_source(tmp_path / "src")
    assert export_main([str(src), str(tmp_path / "dst"), "--quantization", "fp8+head", "--no-tokenizer"]) == 0
    original, exported = tensors(src), tensors(tmp_path / "dst")
    head = "model.transformer.ff_out.weight"
    assert exported[head].dtype == FP8_DTYPE
    assert_within_half_a_step(exported[head], exported[scale_name(head)], original[head], head)
    assert exported["model.transformer.wte.weight"].dtype == torch.bfloat16  # the embedding stays as it was
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == []
    if not torch.cuda.is_available():  # on a CPU transformers dequantizes the FP8 layers, the head among them
        assert_reloads_close_to(src, tmp_path / "dst")

    tied = tmp_path / "tied"
    config = hf_dllm.LLaDA2MoeConfig.from_pretrained(llada2_source(tmp_path / "llada2"))
    config.tie_word_embeddings = True
    hf_dllm.LLaDA2MoeModelLM(config).to(torch.bfloat16).save_pretrained(tied)
    with pytest.raises(ExportError, match="ties it to its input embedding"):
        export_checkpoint(tied, tmp_path / "tied_dst", quantization="fp8+head", tokenizer=False)
    assert not (tmp_path / "tied_dst").exists()
    export_checkpoint(tied, tmp_path / "tied_body", quantization="fp8", tokenizer=False)  # the body alone is fine
