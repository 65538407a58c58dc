"""The model families `hf-dllm export` knows, keyed by a checkpoint's `model_type` (`MODEL_FAMILIES`): for each,
the package files exported as remote code, the `auto_map` and architectures written to `config.json`, the
generation defaults of `generation_config.json`, and the model-card template. Every other part of the exporter
reads the family from here (`model_family`). Also the exporter's error (`ExportError`) and its reader of SRC's JSON
files (`read_json_object`), which every other hub module uses.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path


class ExportError(ValueError):
    """Bad input to the exporter (SRC, DST, options) or package files that cannot run as remote code."""


def read_json_object(path: Path, hint: str = "") -> dict:
    """The JSON object in `path` (SRC's config.json, generation_config.json); an `ExportError` naming the file (and
    `hint`, what to do) otherwise."""
    suffix = f"; {hint}." if hint else "."
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExportError(f"{path} is not readable JSON: {error}{suffix}") from error
    if not isinstance(value, dict):
        raise ExportError(f"{path} must hold a JSON object{suffix}")
    return value


# Remote code every model family shares: the generation loop, its config, policies, caches, attention backends and
# kernels, reached from the model files through relative imports.
SHARED_REMOTE_CODE_FILES = (
    "generation_utils.py",
    "block_loop.py",
    "block_plan.py",
    "generation_config.py",
    "decoding.py",
    "cache.py",
    "packed.py",
    "attention.py",
    "triton_attention.py",
    "kernels.py",
    "fp8.py",
    "fp8_triton.py",
    "triton_ops.py",
    "graphs.py",
    "tensor_parallel.py",
)

# The family defaults of generation_config.json, written when SRC has no generation_config.json or with
# `--generation-defaults fast`. LLaDA: Fast-dLLM's parallel decoding (threshold 0.9) with the dual cache, greedy, in
# blocks of 32.
FAST_GENERATION_DEFAULTS = {
    "max_new_tokens": 256,
    "block_length": 32,
    "threshold": 0.9,
    "steps": None,
    "use_cache": True,
    "dual_cache": True,
    "do_sample": False,
    "temperature": 0.0,
    "remasking": "low_confidence",
    "eos_early_stop": True,
}
# LLaDA2.x: the decoding of LLaDA2's reference `generate()` and model cards (threshold 0.95, one token per step at
# least, blocks of 32, in-block EOS stop), greedy, with the exact KV cache (`dual_cache` changes nothing for
# block-causal models); the rest as LLaDA's.
LLADA2_GENERATION_DEFAULTS = {**FAST_GENERATION_DEFAULTS, "threshold": 0.95}
# Dream: its own sampler, as Dream's `diffusion_generate()` decodes (arXiv:2508.15487): the whole answer as one block
# of `max_new_tokens` positions, one token per step on Dream's timestep schedule with the default `alg` (`alg=None`:
# entropy, `decoding_dream.DEFAULT_DREAM_ALG`), no KV cache, every position decoded (no EOS stop); greedy. `alg` is
# left unset so that naming `threshold` in a call switches to Fast-dLLM's rule instead of contradicting an `alg`.
DREAM_GENERATION_DEFAULTS = {
    **FAST_GENERATION_DEFAULTS,
    "block_length": FAST_GENERATION_DEFAULTS["max_new_tokens"],
    "threshold": None,
    "use_cache": False,
    "eos_early_stop": False,
}
# Dream's `--generation-defaults fast`: Fast-dLLM's setting for Dream, which is LLaDA's fast defaults (threshold 0.9
# with `alg=None` is Fast-dLLM's threshold rule on Dream, `decoding_dream.DreamThreshold`; dual cache, blocks of 32).
DREAM_FAST_GENERATION_DEFAULTS = FAST_GENERATION_DEFAULTS

EOT_TOKEN = "<|eot_id|>"


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """What `hf-dllm export` writes for the checkpoints of one `model_type` (an entry of `MODEL_FAMILIES`).

    `remote_code_files` starts with the two modules `auto_map` points at (configuration, model); the others are
    reached from them through relative imports (`check_remote_code` verifies that the list is closed and that
    every file is reached). `AutoModel` and `AutoModelForCausalLM` both map to the model with the LM head and the
    diffusion `generate()`, as `import hf_dllm` registers them.
    """

    name: str  # in messages and model cards: "LLaDA", "LLaDA2.x"
    checkpoints: str  # the published checkpoints of the family, for messages
    config_module: str
    config_class: str
    model_module: str
    model_class: str
    remote_code_files: tuple[str, ...]
    generation_defaults: dict  # when SRC has no generation_config.json hf_dllm reads
    card_template: str  # in model_cards/
    generic_card: str  # the CARD_PRESETS entry `--card generic` means for this family
    eot_token: str | None  # end-of-turn token looked up in SRC's tokenizer.json (`eot_token_id`)
    # `--generation-defaults fast` (None: `generation_defaults`, which are then the family's fast setting).
    fast_generation_defaults: dict | None = None
    # Fields that only the original implementation's generation config has (Dream's `DreamGenerationConfig`:
    # `output_history`): a SRC generation_config.json holding one is that code's file, for its own sampler, which
    # hf_dllm does not read; the export then writes `generation_defaults`, as when SRC has none.
    original_generation_fields: tuple[str, ...] = ()

    @property
    def fast_defaults(self) -> dict:
        """What `--generation-defaults fast` writes."""
        return self.fast_generation_defaults if self.fast_generation_defaults is not None else self.generation_defaults

    @property
    def auto_map(self) -> dict[str, str]:
        model = f"{self.model_module}.{self.model_class}"
        return {
            "AutoConfig": f"{self.config_module}.{self.config_class}",
            "AutoModel": model,
            "AutoModelForCausalLM": model,
        }

    @property
    def architectures(self) -> list[str]:
        return [self.model_class]

    def classes(self) -> tuple[type, type]:
        """hf_dllm's config and model classes of this family (the exported files' classes, imported here)."""
        config = getattr(importlib.import_module(f"..{self.config_module}", __package__), self.config_class)
        model = getattr(importlib.import_module(f"..{self.model_module}", __package__), self.model_class)
        return config, model


# The exported families, keyed by SRC's `model_type`.
MODEL_FAMILIES: dict[str, ModelFamily] = {
    "llada": ModelFamily(
        name="LLaDA",
        checkpoints="GSAI-ML/LLaDA-8B-Base, LLaDA-8B-Instruct, LLaDA-1.5",
        config_module="configuration_llada",
        config_class="LLaDAConfig",
        model_module="modeling_llada",
        model_class="LLaDAModelLM",
        remote_code_files=(
            "configuration_llada.py",
            "modeling_llada.py",
            "llada_lean.py",  # the blocks as pure functions: the CPU path
            *SHARED_REMOTE_CODE_FILES,
        ),
        generation_defaults=FAST_GENERATION_DEFAULTS,
        card_template="template.md",
        generic_card="generic",
        eot_token=EOT_TOKEN,
    ),
    "llada2_moe": ModelFamily(
        name="LLaDA2.x",
        checkpoints="inclusionAI/LLaDA2.0-mini, LLaDA2.0-flash, LLaDA2.1-mini, LLaDA2.1-flash",
        config_module="configuration_llada2_moe",
        config_class="LLaDA2MoeConfig",
        model_module="modeling_llada2_moe",
        model_class="LLaDA2MoeModelLM",
        remote_code_files=(
            "configuration_llada2_moe.py",
            "modeling_llada2_moe.py",
            "llada2_moe_layer.py",  # the router, the experts and the sparse MoE block
            "triton_moe.py",  # the MoE layer's fused kernels
            "grouped_gemm.py",  # the experts' grouped products with FP8 weights
            *SHARED_REMOTE_CODE_FILES,
        ),
        generation_defaults=LLADA2_GENERATION_DEFAULTS,
        card_template="template-llada2.md",
        generic_card="generic-llada2",
        eot_token=None,
    ),
    # The Hub's auto_map has AutoConfig and AutoModel (DreamModel, the model with the head); AutoModelForCausalLM is
    # added, as `import hf_dllm` registers it (`hf-dllm serve` / `eval` load through it).
    "Dream": ModelFamily(
        name="Dream",
        checkpoints="Dream-org/Dream-v0-Instruct-7B, Dream-v0-Base-7B, Dream-Coder-v0-Instruct-7B, Dream-Coder-v0-Base-7B",
        config_module="configuration_dream",
        config_class="DreamConfig",
        model_module="modeling_dream",
        model_class="DreamModel",
        remote_code_files=(
            "configuration_dream.py",
            "modeling_dream.py",
            "decoding_dream.py",
            *SHARED_REMOTE_CODE_FILES,
        ),
        generation_defaults=DREAM_GENERATION_DEFAULTS,
        fast_generation_defaults=DREAM_FAST_GENERATION_DEFAULTS,
        original_generation_fields=("output_history",),
        card_template="template-dream.md",
        generic_card="generic-dream",
        eot_token=None,
    ),
}
DEFAULT_MODEL_TYPE = "llada"

# LLaDA's entries, under their historical names.
REMOTE_CODE_FILES = MODEL_FAMILIES["llada"].remote_code_files
AUTO_MAP = MODEL_FAMILIES["llada"].auto_map
ARCHITECTURES = MODEL_FAMILIES["llada"].architectures


def model_family(model_type: str) -> ModelFamily:
    """The `MODEL_FAMILIES` entry of `model_type`; an `ExportError` naming the supported types otherwise."""
    family = MODEL_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ExportError(f"model_type {model_type!r} is not one hf-dllm export supports; {_supported_types()}.")
    return family


def _supported_types() -> str:
    return "supported model_type values: " + ", ".join(
        f"{model_type!r} ({family.name}: {family.checkpoints})" for model_type, family in MODEL_FAMILIES.items()
    )
