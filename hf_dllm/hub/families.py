"""The model families `hf-dllm export` knows: the registry of family objects (`hf_dllm.family.FAMILIES`, keyed by
family name), which hold every export fact (remote-code files, `auto_map`, architectures, generation defaults,
model-card template, end-of-turn token); `checkpoint_family` finds SRC's family from its config.json. Also the
exporter's error (`ExportError`) and its reader of SRC's JSON files (`read_json_object`), which every other hub
module uses.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..family import (
    FAMILIES,
    FAST_GENERATION_DEFAULTS,
    SHARED_REMOTE_CODE_FILES,
    DiffusionFamily,
    family_for_config,
    import_families,
)

import_families()  # every family, without its models (the exporter reads their facts, not their weights)


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


# The exported families, keyed by family name (`DiffusionFamily.name`).
MODEL_FAMILIES: dict[str, DiffusionFamily] = FAMILIES
DEFAULT_FAMILY = "llada"


def model_family(name: str) -> DiffusionFamily:
    """The registered family `name`; an `ExportError` naming the supported ones otherwise."""
    family = MODEL_FAMILIES.get(name) if isinstance(name, str) else None
    if family is None:
        raise ExportError(f"{name!r} is not a model family hf-dllm export supports; {supported_families()}.")
    return family


def checkpoint_family(config: dict) -> DiffusionFamily:
    """The family of a checkpoint's config.json (`family_for_config`: `architectures`, `auto_map`, then
    `model_type` and fields); an `ExportError` naming the supported families otherwise."""
    family = family_for_config(config)
    if family is None:
        raise ExportError(
            f"a checkpoint with model_type {config.get('model_type')!r} and architectures "
            f"{config.get('architectures')!r} is not of a model family hf-dllm export supports "
            f"({supported_families()})."
        )
    return family


def supported_families() -> str:
    return "supported families: " + ", ".join(
        f"{family.display_name} ({family.checkpoints})" for family in MODEL_FAMILIES.values()
    )


__all__ = [
    "DEFAULT_FAMILY",
    "FAST_GENERATION_DEFAULTS",
    "MODEL_FAMILIES",
    "SHARED_REMOTE_CODE_FILES",
    "ExportError",
    "checkpoint_family",
    "model_family",
    "read_json_object",
    "supported_families",
]
