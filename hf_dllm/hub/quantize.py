"""`hf-dllm export --quantization fp8`: the exported repo holds FP8 weights with one scale per 128x128 block.

A user who loads a checkpoint with `from_pretrained(..., quantization_config=FineGrainedFP8Config())` gets its linear
weights quantized on the GPU at every load. Exporting them quantized instead writes the layout that transformers'
FP8 checkpoints (e.g. the DeepSeek-V3 family) use, which `from_pretrained` loads as pre-quantized with no option:

- each selected `<module>.weight` `(N, K)` stored as `float8_e4m3fn`, and `<module>.weight_scale_inv`
  `(N / 128, K / 128)` float32 beside it (the weight is `fp8 * weight_scale_inv` per block);
- `config.json`'s `quantization_config`: the `FineGrainedFP8Config` that loading with `--quantization fp8` uses
  (the family's `fp8_modules_to_not_convert`: LLaDA2.x keeps its head in bf16 and quantizes each expert's layers).

Which weights: exactly those transformers' own FP8 quantizer converts, asked on the family's model built on the
meta device (`fp8_weight_names`), so an exported checkpoint and an on-the-fly quantized load hold the same FP8
layers. How: `quantize_fp8_blocks` repeats the arithmetic of transformers' `Fp8Quantize` (the op that quantizes at
load time) step for step (`fp8.quantize_blocks`), so the stored values are the ones an on-the-fly load computes (tested bit for bit against
it, and on a GPU against a quantized load). Everything runs on the CPU, one weight file at a time: a GPU is needed to
*run* FP8 weights (transformers dequantizes them to bf16 when it loads them on a CPU), not to export them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..fp8 import FP8_DTYPE, quantize_blocks


class QuantizationError(ValueError):
    """A checkpoint that cannot be exported quantized (the message names the tensor or setting)."""


def fp8_weight_names(model_class, config, quantization_config) -> list[str]:
    """Names of the `.weight` tensors that transformers' quantizer for `quantization_config` turns into FP8 in a
    `model_class(config)`: the model is built on the meta device (no memory) and passed through the quantizer's own
    module replacement, and every layer that comes out with an FP8 weight and a `weight_scale_inv` is listed."""
    from transformers.quantizers import AutoHfQuantizer

    with torch.device("meta"):
        model = model_class(config)
    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=torch.bfloat16)
    return sorted(
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dtype == FP8_DTYPE
        and isinstance(getattr(module, "weight_scale_inv", None), torch.Tensor)
    )


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight (N, K)` -> `float8_e4m3fn (N, K)` and `weight_scale_inv (N / bn, K / bk)` float32: `fp8.quantize_blocks`
    (transformers' `Fp8Quantize` arithmetic) on whole blocks only. N and K must be multiples of the block
    (QuantizationError otherwise: the caller names the tensor). `block` None: one scale per matrix, `(1, 1)`."""
    block_m, block_n = _block(weight.shape, block)
    if weight.shape[0] % block_m or weight.shape[1] % block_n:
        raise QuantizationError(f"shape {list(weight.shape)} is not a multiple of the {block_m}x{block_n} FP8 block")
    return quantize_blocks(weight, (block_m, block_n))


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".weight_scale_inv"


def scale_shapes(
    weight_shapes: dict[str, tuple[int, ...]], names: list[str], block: tuple[int, int] | None
) -> dict[str, tuple[int, ...]]:
    """The `weight_scale_inv` tensors a checkpoint with the FP8 weights `names` (blocks of `block`; None: one per
    matrix) holds, with their shapes."""
    return {
        scale_name(name): tuple(
            size // b for size, b in zip(weight_shapes[name], _block(weight_shapes[name], block), strict=True)
        )
        for name in names
    }


def _block(shape, block) -> tuple[int, int]:
    # `weight_block_size=None` (transformers' per-tensor FP8): the whole matrix is one block.
    return tuple(shape[-2:]) if block is None else tuple(block)


def write_fp8_weights(
    src: Path, dst: Path, weight_files: list[str], names: list[str], block: tuple[int, int] | None
) -> None:
    """Write SRC's safetensors weight files (`weight_files`, index first if any) into DST with the tensors `names`
    quantized in blocks of `block` (`quantize_fp8_blocks`) and their scales added beside them (same shard; the index lists them)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if any(not name.endswith(".safetensors") and not name.endswith(".safetensors.index.json") for name in weight_files):
        raise QuantizationError(
            "--quantization fp8 exports safetensors checkpoints only; SRC has "
            f"{', '.join(weight_files)} (convert it with save_pretrained first)."
        )
    wanted, done, added = set(names), set(), {}
    for file_name in weight_files:
        if file_name.endswith(".index.json"):
            continue
        tensors = {}
        with safe_open(src / file_name, framework="pt") as weights:
            metadata = weights.metadata() or {}
            for key in weights.keys():
                tensor = weights.get_tensor(key)
                if key in wanted:
                    if tensor.dim() != 2 or not tensor.is_floating_point():
                        raise QuantizationError(f"{key} is not a 2D floating-point weight: {list(tensor.shape)}.")
                    try:
                        tensor, tensors[scale_name(key)] = quantize_fp8_blocks(tensor, block)
                    except QuantizationError as error:
                        raise QuantizationError(f"{key}: {error}; it cannot be stored as FP8.") from None
                    done.add(key)
                    added[scale_name(key)] = file_name
                tensors[key] = tensor
        save_file(tensors, dst / file_name, metadata={**metadata, "format": "pt"})
    if wanted - done:
        missing = ", ".join(sorted(wanted - done)[:5])
        raise QuantizationError(f"the weights to quantize are not all in SRC's weight files (missing: {missing}).")
    index = [name for name in weight_files if name.endswith(".index.json")]
    if index:
        data = json.loads((src / index[0]).read_text(encoding="utf-8"))
        data["weight_map"] = {**data["weight_map"], **added}
        data.setdefault("metadata", {}).pop("total_size", None)  # sizes changed; transformers does not need it
        (dst / index[0]).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
