"""`hf-dllm export SRC DST`: turn a local LLaDA, LLaDA2.x or Dream checkpoint into a Hub repo that runs hf_dllm's
code as remote code.

A user who has never installed hf_dllm then loads the repo with
`AutoModel.from_pretrained(repo, trust_remote_code=True)` and gets hf_dllm's model and diffusion `generate()`.

What is exported depends on SRC's `model_type`, through one table, `families.MODEL_FAMILIES` (`"llada"`: LLaDA-8B and its
family; `"llada2_moe"`: LLaDA2.0-mini / -flash, LLaDA2.1; `"Dream"`: Dream 7B and Dream-Coder 7B). What DST
receives (every rule is implemented here, once, and is what `tests/test_export.py`, `tests/test_llada2_export.py`
and `tests/test_dream_export.py` check):

- the weights: `model.safetensors`, or `model.safetensors.index.json` and every shard it names (likewise
  `pytorch_model.bin[.index.json]` when SRC has no safetensors); copied, or hard-linked with `--link`;
- the tokenizer files of SRC that exist (`TOKENIZER_FILES`), copied unchanged;
- `config.json`: SRC's `config.json` with every field kept, except `auto_map` and `architectures`, which are the
  family's (`ModelFamily.auto_map`, `ModelFamily.architectures`); written with sorted keys and an indent of 2;
- the remote code: the package's files named in the family's `remote_code_files`, copied byte for byte (never
  edited, never generated), after `check_remote_code` verified that transformers' dynamic-module loader accepts
  them and that the list is closed under their imports;
- `generation_config.json`: a `DiffusionGenerationConfig` decided by `resolve_generation_settings`, field by field:
  an exporter option (`--max-new-tokens`, `--block-length`, `--threshold`) > SRC's `generation_config.json`
  (validated for the family, as the model would read it) > the family's defaults (`generation_defaults`: Fast-dLLM's
  threshold 0.9 with the dual cache for LLaDA, LLaDA2's threshold 0.95 for LLaDA2.x, Dream's own sampler for Dream;
  used when SRC has no generation_config.json hf_dllm reads) or, with `--generation-defaults fast`, the family's
  fast defaults (`ModelFamily.fast_defaults`: the same for LLaDA and LLaDA2.x, Fast-dLLM's for Dream); special
  token ids from SRC's generation_config.json, else SRC's config.json and tokenizer (`special_token_ids`);
  serialised by transformers (`to_json_string`). The export prints the settings written and the origin of each
  (`GenerationSettings.summary`);
- `README.md`: the family's model card template (`model_cards/template.md`, `model_cards/template-llada2.md`,
  `model_cards/template-dream.md`) rendered with a preset of `cards.CARD_PRESETS`.

Nothing is half-written: every input is checked first, the repo is assembled in a temporary folder next to DST
(`.DST.export-PID-*`) and moved into place only when complete and verified (`verify_export`: every safetensors
header readable, every tensor's shape the config's, the tokenizer loads). Staging folders that a killed export left
behind are removed by the next export into the same DST (`clean_stale_staging`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import types
import warnings
from pathlib import Path

from ..cli.loading import QUANTIZATION_CHOICES
from .cards import (
    CARD_PRESETS,
    DEFAULT_REPO_ORG,
    MODEL_CARDS_DIR,
    card_preset,
    card_variables,
    read_card_template,
    render_card,
    resolve_card,
)
from .families import (
    DEFAULT_MODEL_TYPE,
    MODEL_FAMILIES,
    ExportError,
    ModelFamily,
    _supported_types,
    model_family,
)

# Names this module held before the family table and the card rendering moved out: they still import from here,
# with a FutureWarning (as the old module names do, `hf_dllm.MOVED_MODULES`).
_MOVED_NAMES = {
    **dict.fromkeys(
        (
            "ARCHITECTURES",
            "AUTO_MAP",
            "DREAM_FAST_GENERATION_DEFAULTS",
            "DREAM_GENERATION_DEFAULTS",
            "EOT_TOKEN",
            "FAST_GENERATION_DEFAULTS",
            "LLADA2_GENERATION_DEFAULTS",
            "REMOTE_CODE_FILES",
            "SHARED_REMOTE_CODE_FILES",
        ),
        "families",
    ),
    **dict.fromkeys(("CARD_TEMPLATE", "describe_decoding"), "cards"),
}


def __getattr__(name: str):
    module = _MOVED_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"`{__name__}.{name}` moved to `{__package__}.{module}`; import it from there (the old name will be removed).",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(f".{module}", __package__), name)


class _Unset:
    """Marks an exporter option that was not given (`threshold=None` means "no threshold")."""

    def __repr__(self) -> str:
        return "<not given>"


UNSET = _Unset()

# `--generation-defaults`: where generation_config.json's settings come from (the options override single fields on
# top of either). "source": SRC's generation_config.json, or the family's defaults (`ModelFamily.generation_defaults`)
# when SRC has none hf_dllm reads; "fast": the family's fast defaults (`ModelFamily.fast_defaults`), whatever SRC has.
GENERATION_DEFAULTS_CHOICES = ("source", "fast")
DEFAULT_GENERATION_DEFAULTS = "source"
# The exporter's options that set one field of generation_config.json: field -> command-line option.
GENERATION_OPTIONS = {
    "max_new_tokens": "--max-new-tokens",
    "block_length": "--block-length",
    "threshold": "--threshold",
}

# Packages the remote code may import outside a `try:` block: those every transformers user has. Anything else
# (triton, flash_attn, ...) must sit in `try:` (or under an `if is_..._available():` check), or transformers'
# `check_imports` refuses to load the model without it.
REMOTE_CODE_DEPENDENCIES = ("torch", "transformers")

# Weight layouts, in order of preference: (index file, single file). Shards are the files the index names.
WEIGHT_LAYOUTS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the flat package: the files exported as remote code


logger = logging.getLogger(__name__)  # hf_dllm.hub.export


# --- remote code ---------------------------------------------------------------------------------------------------


def check_remote_code(package_dir: str | os.PathLike = PACKAGE_DIR, model_type: str = DEFAULT_MODEL_TYPE) -> list[Path]:
    """Check the package files exported as remote code for `model_type` (its `ModelFamily.remote_code_files`);
    return their paths in that order.

    transformers copies a Hub repo's code into its module cache and imports it as a package, so each file must:
    exist; import only exported files relatively (`from .<module> import ...`, the form transformers follows to
    fetch them; `from . import <module>` is tolerated but invisible to transformers); never import `hf_dllm`;
    import nothing outside a `try:` block but the standard library and `REMOTE_CODE_DEPENDENCIES` (transformers'
    `check_imports` demands every such import); mention no other `from .x import` at the start of a line, even
    in a docstring (transformers finds relative imports with a regular expression); and be reachable from the
    `auto_map` modules through `from .<module> import` (transformers fetches only those). The list is thereby
    closed: no exported file imports a package file missing from it. Raises `ExportError` listing every violation.
    """
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    package_dir = Path(package_dir)
    family = model_family(model_type)
    files = family.remote_code_files
    missing = [name for name in files if not (package_dir / name).is_file()]
    if missing:
        raise ExportError(
            f"remote-code file(s) missing from the package ({package_dir}): {', '.join(missing)}. "
            f"The exported remote code of {family.name} is {', '.join(files)} "
            f"(hf_dllm.hub.families.MODEL_FAMILIES[{model_type!r}].remote_code_files)."
        )
    modules = {name.removesuffix(".py") for name in files}
    allowed = set(sys.stdlib_module_names) | set(REMOTE_CODE_DEPENDENCIES)
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for name in files:
        path = package_dir / name
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as error:
            problems.append(f"{name}: does not parse: {error}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                # `from .x import y` (what transformers follows), or `from . import x, y` of exported modules
                # (transformers does not see those: they must also be reached some other way, checked below).
                targets = [node.module] if node.module else [alias.name for alias in node.names]
                bad = [target for target in targets if "." in target or target not in modules]
                if node.level != 1 or bad:
                    written = "." * node.level + (node.module or "")
                    problems.append(
                        f"{name}:{node.lineno}: `from {written} import "
                        f"{', '.join(alias.name for alias in node.names)}`: remote code may only import exported "
                        f"files, as `from .<module> import ...`, <module> one of {sorted(modules)}."
                    )
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for imported in names:
                    if imported.split(".")[0] == "hf_dllm":
                        problems.append(
                            f"{name}:{node.lineno}: imports `{imported}`: remote code runs where hf_dllm is not "
                            "installed; use a relative import of an exported file."
                        )
        unguarded = sorted(set(get_imports(path)) - allowed - {"hf_dllm"})
        if unguarded:
            problems.append(
                f"{name}: imports {unguarded} outside a `try:` block: transformers' check_imports would refuse "
                f"to load the model without them. Only the standard library and {list(REMOTE_CODE_DEPENDENCIES)} "
                "may be imported unguarded; put optional imports in `try: ... except ImportError:`."
            )
        relative = set(get_relative_imports(path))
        unknown = sorted(relative - modules)
        if unknown:
            problems.append(
                f"{name}: transformers sees relative imports of {unknown} (it scans the text, docstrings "
                f"included), which are not exported files {sorted(modules)}; if they belong to the remote code, "
                f"add them to hf_dllm.hub.families.MODEL_FAMILIES[{model_type!r}].remote_code_files."
            )
        graph[name.removesuffix(".py")] = relative & modules
    if not problems:
        roots = {entry.split(".")[0] for entry in family.auto_map.values()}
        reachable = set(roots)
        todo = list(reachable)
        while todo:
            for module in graph.get(todo.pop(), ()):
                if module not in reachable:
                    reachable.add(module)
                    todo.append(module)
        unreachable = [name for name in files if name.removesuffix(".py") not in reachable]
        if unreachable:
            problems.append(
                f"{', '.join(unreachable)} not reached by relative imports from the auto_map modules "
                f"({', '.join(sorted(root + '.py' for root in roots))}): transformers would never download them "
                "from the Hub."
            )
    if problems:
        raise ExportError(
            "the package's remote-code files cannot be exported as they are (fix the package files; exported "
            "files are never edited):\n  - " + "\n  - ".join(problems)
        )
    return [package_dir / name for name in files]


# --- SRC ----------------------------------------------------------------------------------------------------------


def _read_json_object(path: Path, hint: str = "") -> dict:
    """The JSON object in `path`; an `ExportError` naming the file (and `hint`, what to do) otherwise."""
    suffix = f"; {hint}." if hint else "."
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExportError(f"{path} is not readable JSON: {error}{suffix}") from error
    if not isinstance(value, dict):
        raise ExportError(f"{path} must hold a JSON object{suffix}")
    return value


def read_source_config(src: Path) -> dict:
    """SRC's `config.json` as a dict, after checking that its `model_type` is one of `MODEL_FAMILIES` and that
    hf_dllm's config class of that family accepts it (a config the model cannot run is refused here)."""
    path = src / "config.json"
    if not path.is_file():
        raise ExportError(f"{src} has no config.json: SRC must be a LLaDA, LLaDA2.x or Dream checkpoint folder.")
    config = _read_json_object(path)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_FAMILIES:
        raise ExportError(
            f"{path} has model_type {model_type!r}: not a model family hf-dllm export supports ({_supported_types()})."
        )
    family = MODEL_FAMILIES[model_type]
    config_class, _ = family.classes()
    try:
        config_class.from_dict(config)
    except (TypeError, ValueError) as error:
        raise ExportError(f"{path} is not a {family.name} config hf_dllm can run: {error}") from error
    return config


def find_weights(src: Path) -> list[str]:
    """Names of SRC's weight files (index first, then shards), per `WEIGHT_LAYOUTS`."""
    for index_name, single_name in WEIGHT_LAYOUTS:
        index = src / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                raise ExportError(f"{index} is not a valid weight index (JSON with a `weight_map`): {error}") from error
            bad = [shard for shard in shards if not isinstance(shard, str) or "/" in shard or "\\" in shard]
            if bad or not shards:
                raise ExportError(f"{index} must name at least one shard file in SRC, got {bad or shards}.")
            missing = [shard for shard in shards if not (src / shard).is_file()]
            if missing:
                raise ExportError(f"{index} names shard(s) missing from {src}: {', '.join(missing)}.")
            return [index_name, *shards]
        if (src / single_name).is_file():
            return [single_name]
    layouts = " or ".join(f"{single} (or {index} with its shards)" for index, single in WEIGHT_LAYOUTS)
    raise ExportError(f"{src} has no weights: expected {layouts}.")


def _added_token_id(src: Path, content: str) -> int | None:
    """Id of `content` among the added tokens of SRC's `tokenizer.json`, if it has one."""
    path = src / "tokenizer.json"
    if not path.is_file() or not content:
        return None
    try:
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    for token in added:
        if isinstance(token, dict) and token.get("content") == content and isinstance(token.get("id"), int):
            return token["id"]
    return None


def _tokenizer_bos(src: Path) -> int | None:
    path = src / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        bos = json.loads(path.read_text(encoding="utf-8")).get("bos_token")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    if isinstance(bos, dict):
        bos = bos.get("content")
    return _added_token_id(src, bos) if isinstance(bos, str) else None


def special_token_ids(src: Path, config: dict) -> dict:
    """Special token ids for generation_config.json.

    `mask_token_id`, `eos_token_id`, `pad_token_id` and `bos_token_id` come from SRC's config.json where set; a
    missing `mask_token_id` is the family's config class default, which the model uses (the Hub's LLaDA2.x configs
    have none: 156895, `<|mask|>`); a missing `bos_token_id` comes from SRC's tokenizer (its `bos_token`), and
    `eot_token_id` is the id of the family's end-of-turn token (LLaDA's `<|eot_id|>`) in SRC's `tokenizer.json` when
    it has that token.
    """
    family = model_family(config.get("model_type"))
    ids = {
        name: config[name]
        for name in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")
        if config.get(name) is not None
    }
    if "mask_token_id" not in ids:
        config_class, _ = family.classes()
        mask = config_class.from_dict(config).mask_token_id
        if mask is not None:
            ids["mask_token_id"] = mask
    if "bos_token_id" not in ids:
        bos = _tokenizer_bos(src)
        if bos is not None:
            ids["bos_token_id"] = bos
    eot = _added_token_id(src, family.eot_token) if family.eot_token else None
    if eot is not None:
        ids["eot_token_id"] = eot
    return ids


# --- what DST receives ----------------------------------------------------------------------------------------------


def export_config(config: dict) -> str:
    """config.json of the exported repo: SRC's fields, with `auto_map` and `architectures` set to those of its
    family (`MODEL_FAMILIES[config["model_type"]]`)."""
    family = model_family(config.get("model_type"))
    exported = dict(config)
    exported["auto_map"] = family.auto_map
    exported["architectures"] = family.architectures
    return json.dumps(exported, indent=2, sort_keys=True) + "\n"


# Where a field of the exported generation_config.json came from (`GenerationSettings.origins`), besides
# "option --<name>" (an exporter option, `GENERATION_OPTIONS`).
ORIGIN_TEXT = {
    "source": "SRC's generation_config.json",
    "family default": "the family's default",
    "default": "DiffusionGenerationConfig's default",
    "checkpoint": "SRC's config.json / tokenizer",
}


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """What the exported generation_config.json holds (`config`, a `DiffusionGenerationConfig`) and where each of
    its fields came from (`origins`: field -> "option --<name>", "source", "family default", "default" or
    "checkpoint"; see `ORIGIN_TEXT`)."""

    config: object
    origins: dict[str, str]
    family: str  # `ModelFamily.name`, for messages
    headline: tuple[str, ...]  # the fields `summary` always lists (those of the family's defaults)
    notes: tuple[str, ...] = ()  # what `summary` says after the fields (e.g. a SRC file that was not read)

    @property
    def fields(self) -> dict:
        """Every field but the special token ids (what the model card documents)."""
        from ..generation_config import SPECIAL_TOKEN_FIELDS

        return {
            name: getattr(self.config, name) for name in self.config.field_names() if name not in SPECIAL_TOKEN_FIELDS
        }

    def to_json_string(self) -> str:
        return self.config.to_json_string()

    def summary(self) -> str:
        """The fields written, one a line with its origin: the family's generation fields, the options, the special
        token ids and every other field that differs from DiffusionGenerationConfig's default."""
        from ..generation_config import SPECIAL_TOKEN_FIELDS, DiffusionGenerationConfig

        plain = DiffusionGenerationConfig()
        listed = [
            name
            for name, origin in self.origins.items()
            if name in self.headline
            or origin in ("checkpoint", "source")
            and name in SPECIAL_TOKEN_FIELDS
            or origin.startswith("option")
            or getattr(self.config, name) != getattr(plain, name)
        ]
        width = max(len(f"{name} = {getattr(self.config, name)!r}") for name in listed)
        lines = [f"generation_config.json ({self.family}):"]
        for name in listed:
            setting = f"{name} = {getattr(self.config, name)!r}"
            origin = self.origins[name]
            lines.append(f"  {setting:<{width}}  <- {ORIGIN_TEXT.get(origin, origin)}")
        lines.append("  (every other field: DiffusionGenerationConfig's default)")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _validate_for_model(config, model_class) -> None:
    """`config.validate()` with what the family's model class says about its rules (attention, own sampler)."""
    config.validate(
        block_causal=model_class.diffusion_block_causal, sampler_fields=model_class.diffusion_sampler_fields
    )


# What an error about SRC's generation_config.json says to do.
_SOURCE_GENERATION_HINT = (
    "fix or remove it, or pass --generation-defaults fast (generation_defaults='fast') to write the family's "
    "defaults instead"
)


def _read_source_generation_config(src: Path, family: ModelFamily, model_class):
    """SRC's generation_config.json read as hf_dllm's model reads it (`DiffusionGenerationConfig.from_pretrained`),
    validated for the family's model; returns `(config, the field names the file sets)`."""
    from ..generation_config import DiffusionGenerationConfig

    path = src / "generation_config.json"
    hint = _SOURCE_GENERATION_HINT
    written = _read_json_object(path, hint)
    try:
        config = DiffusionGenerationConfig.from_pretrained(src)
        _validate_for_model(config, model_class)
    except (OSError, TypeError, ValueError) as error:
        raise ExportError(
            f"{path} is not a generation config a {family.name} model can use: {error} ({hint})."
        ) from error
    return config, set(written)


def resolve_generation_settings(
    model_type: str = DEFAULT_MODEL_TYPE,
    src: str | os.PathLike | None = None,
    *,
    special_ids: dict | None = None,
    generation_defaults: str = DEFAULT_GENERATION_DEFAULTS,
    max_new_tokens: int | None | _Unset = UNSET,
    block_length: int | None | _Unset = UNSET,
    threshold: float | None | _Unset = UNSET,
) -> GenerationSettings:
    """The generation_config.json of an export of the `model_type` checkpoint `src`, and where each field came from:
    the one place its settings are decided.

    Per field: an export option (`max_new_tokens`, `block_length`, `threshold`; None or `UNSET` = not given, except
    `threshold=None`, which means no threshold) > SRC's generation_config.json (`generation_defaults="source"`, the
    default; read as the model reads it, a field it leaves unset being DiffusionGenerationConfig's default) > the
    family's defaults (`ModelFamily.generation_defaults`, when SRC has no generation_config.json or has the original
    code's own, `ModelFamily.original_generation_fields`; with `generation_defaults="fast"`,
    `ModelFamily.fast_defaults`). The options are merged by the model's own resolver
    (`resolve_generation_config`), as `generate()` merges its arguments: naming `threshold` replaces the base's
    decoding rule (`steps`, `factor`). Special token ids: those SRC's generation_config.json sets (when it is the
    base), else `special_ids` (from SRC's config.json and tokenizer, `special_token_ids`).

    Raises `ExportError` naming the option or the file for an invalid value, before anything is written.
    """
    from ..generation_config import SPECIAL_TOKEN_FIELDS, DiffusionGenerationConfig
    from ..generation_utils import DECODING_RULE_FIELDS

    if generation_defaults not in GENERATION_DEFAULTS_CHOICES:
        raise ExportError(
            f"--generation-defaults (generation_defaults) must be one of {', '.join(GENERATION_DEFAULTS_CHOICES)}, "
            f"got {generation_defaults!r}."
        )
    given = {"max_new_tokens": max_new_tokens, "block_length": block_length, "threshold": threshold}
    options = {
        name: value
        for name, value in given.items()
        if value is not UNSET and (value is not None or name == "threshold")
    }
    for name, value in options.items():
        try:
            DiffusionGenerationConfig(**{name: value})
        except ValueError as error:
            raise ExportError(f"{GENERATION_OPTIONS[name]} ({name}={value!r}): {error}") from error

    family = model_family(model_type)
    _, model_class = family.classes()
    source = None
    notes: list[str] = []
    source_path = Path(src) / "generation_config.json" if src is not None else None
    use_source = generation_defaults == "source" and source_path is not None and source_path.is_file()
    if use_source and family.original_generation_fields:
        written = _read_json_object(source_path, _SOURCE_GENERATION_HINT)
        original = sorted(set(written) & set(family.original_generation_fields))
        if original:  # the original code's own file (e.g. Dream's), not settings hf_dllm reads
            use_source = False
            notes.append(
                f"{source_path} is the original {family.name} code's generation config (it has {original}), for "
                f"its own sampler, not hf_dllm's: the {family.name} family's defaults were written instead "
                "(--generation-defaults fast for the fast ones)."
            )
    if use_source:
        source, set_by_source = _read_source_generation_config(Path(src), family, model_class)
        base = source
        base_text = f"{source_path}"

        def base_origin(name: str) -> str:
            return "source" if name in set_by_source else "default"

    else:
        defaults = family.fast_defaults if generation_defaults == "fast" else family.generation_defaults
        base = DiffusionGenerationConfig(**defaults)
        base_text = f"the {family.name} family's {'fast ' if generation_defaults == 'fast' else ''}defaults"

        def base_origin(name: str) -> str:
            return "family default" if name in defaults else "default"

    # The model's resolver reads only these attributes of the model: run it on the base config alone.
    holder = types.SimpleNamespace(
        generation_config=base,
        diffusion_block_causal=model_class.diffusion_block_causal,
        diffusion_sampler_fields=model_class.diffusion_sampler_fields,
        diffusion_kv_cache_dtypes=model_class.diffusion_kv_cache_dtypes,
    )
    flags = " ".join(f"{GENERATION_OPTIONS[name]} {value}" for name, value in options.items())
    try:
        resolved = model_class.resolve_generation_config(holder, **options)
    except ValueError as error:
        raise ExportError(f"{flags} on top of {base_text} give invalid generation settings: {error}") from error

    origins: dict[str, str] = {}
    fields = {}
    for name in DiffusionGenerationConfig.field_names():
        if name in SPECIAL_TOKEN_FIELDS:
            continue
        fields[name] = getattr(resolved, name)
        if name in options:
            origins[name] = f"option {GENERATION_OPTIONS[name]}"
        elif fields[name] != getattr(base, name):  # the base's decoding rule, replaced by the option naming one
            origins[name] = "option " + " ".join(
                GENERATION_OPTIONS[rule] for rule in DECODING_RULE_FIELDS & options.keys()
            )
        else:
            origins[name] = base_origin(name)
    ids = {}
    for name in SPECIAL_TOKEN_FIELDS:
        from_source = getattr(source, name, None)
        if from_source is not None:
            ids[name], origins[name] = from_source, "source"
        elif (special_ids or {}).get(name) is not None:
            ids[name], origins[name] = special_ids[name], "checkpoint"
    try:
        config = DiffusionGenerationConfig(**fields, **ids)
        _validate_for_model(config, model_class)
    except ValueError as error:
        raise ExportError(f"invalid generation settings for {base_text}: {error}") from error
    headline = tuple(dict.fromkeys([*family.generation_defaults, *family.fast_defaults]))
    return GenerationSettings(config=config, origins=origins, family=family.name, headline=headline, notes=tuple(notes))


def render_preset_card(card: str, repo_id: str | None = None, dst_name: str = "") -> str:
    """The model card of preset `card` with its family's default generation settings (what `model_cards/<file>`
    holds; an export renders the settings it writes)."""
    preset = card_preset(card)
    family = model_family(preset["model_type"])
    name = preset["model_name"] or dst_name
    repo_id = repo_id or f"{DEFAULT_REPO_ORG}/{name}-hf-dllm"
    variables = card_variables(card, repo_id, dst_name, resolve_generation_settings(preset["model_type"]).fields)
    return render_card(read_card_template(family.card_template), variables)


def write_preset_cards() -> list[Path]:
    """Regenerate `model_cards/<file>` of every preset that has one (after editing a template or a preset)."""
    written = []
    for card, preset in CARD_PRESETS.items():
        if preset["file"]:
            path = MODEL_CARDS_DIR / preset["file"]
            path.write_text(render_preset_card(card), encoding="utf-8")
            written.append(path)
    return written


# --- verifying what was written --------------------------------------------------------------------------------------


def expected_tensor_shapes(config: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The checkpoint's tensor names and shapes that `config` implies, from the state dict of the family's model
    built on the meta device (no memory; the Hub's names are the model's): `(required, tied)`, where `tied` are the
    weights the model ties to another one (LLaDA2.x's `lm_head.weight` with `tie_word_embeddings`), which a
    checkpoint may store or leave out (`save_pretrained` leaves them out; transformers ties them on loading)."""
    import torch

    config_class, model_class = model_family(config.get("model_type")).classes()
    with torch.device("meta"):
        model = model_class(config_class.from_dict(config))
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    tied_names = set(getattr(model, "all_tied_weights_keys", None) or {})
    required = {name: shape for name, shape in shapes.items() if name not in tied_names}
    tied = {name: shape for name, shape in shapes.items() if name in tied_names}
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "fp8":
        # An FP8 checkpoint (`hf-dllm export --quantization fp8`, or one saved quantized): a block-scale tensor beside
        # every weight transformers' FP8 quantizer converts.
        from transformers import FineGrainedFP8Config

        from .quantize import fp8_weight_names, scale_shapes

        quantization_config = FineGrainedFP8Config.from_dict(quantization)
        names = fp8_weight_names(model_class, config_class.from_dict(config), quantization_config)
        required.update(scale_shapes(shapes, names, quantization_config.weight_block_size))
    return required, tied


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors of one weight file, from its header (safetensors: nothing else is read;
    a truncated or garbage file fails here)."""
    if path.name.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as weights:
                return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
        except (SafetensorError, OSError, ValueError) as error:
            raise ExportError(f"{path.name} is not a readable safetensors file: {error}") from error
    import torch

    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # mapped: nothing read yet
    except Exception:  # torch.load raises many kinds on a corrupt file (pickle, zip, runtime)
        try:  # files of torch < 1.6 (not zip) cannot be mapped: read them
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ExportError(f"{path.name} is not a readable PyTorch weights file: {error}") from error
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ExportError(f"{path.name} must hold a state dict (tensor names to tensors).")
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def _listing(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def verify_export(folder: Path, config: dict, weights: list[str], tokenizer_files: list[str]) -> None:
    """Check the assembled repo `folder` before it is moved into place; raises `ExportError` naming the problem.

    Every weight file's header must be readable, the tensors together must be exactly those the config implies
    (`expected_tensor_shapes`: tied weights may be stored or not), each with the config's shape and, for an index,
    in the shard it names; and when tokenizer files were exported, `AutoTokenizer` must load them.
    """
    found: dict[str, tuple[int, ...]] = {}
    shard_of: dict[str, str] = {}
    for name in weights:
        if name.endswith(".index.json"):
            continue
        for tensor, shape in _tensor_shapes(folder / name).items():
            if tensor in found:
                raise ExportError(f"tensor {tensor} is stored twice ({shard_of[tensor]} and {name}).")
            found[tensor], shard_of[tensor] = shape, name
    index = [name for name in weights if name.endswith(".index.json")]
    if index:
        weight_map = json.loads((folder / index[0]).read_text(encoding="utf-8"))["weight_map"]
        wrong = [tensor for tensor, shard in weight_map.items() if shard_of.get(tensor) != shard]
        unlisted = set(found) - set(weight_map)
        if wrong or unlisted:
            raise ExportError(
                f"{index[0]} does not match its shards: {_listing(wrong)} not in the shard it names"
                + (f"; {_listing(unlisted)} in no entry" if unlisted else "")
                + "."
            )
    required, tied = expected_tensor_shapes(config)
    expected = {**required, **tied}
    problems = []
    missing = set(required) - set(found)
    if missing:
        problems.append(f"missing from the weights: {_listing(missing)}")
    unexpected = set(found) - set(expected)
    if unexpected:
        problems.append(f"in the weights but not in a model of this config: {_listing(unexpected)}")
    mismatched = [
        f"{name} is {list(found[name])}, the config gives {list(shape)}"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    if mismatched:
        problems.append("shapes differ from config.json: " + "; ".join(mismatched[:5]))
    if problems:
        raise ExportError("the weights do not match config.json: " + "; ".join(problems) + ".")
    if tokenizer_files:
        from transformers import AutoTokenizer

        try:
            AutoTokenizer.from_pretrained(folder)
        except Exception as error:  # tokenizers, json, sentencepiece and transformers each raise their own kinds
            raise ExportError(
                f"the tokenizer files ({', '.join(tokenizer_files)}) do not load: {type(error).__name__}: {error}"
            ) from error


# --- staging folders of killed exports ------------------------------------------------------------------------------

# `.DST.export-PID-xxxx` (the repo being assembled) and `.DST.old-PID-xxxx` (the previous DST while the new one moves
# in): PID is the exporting process, so a later export can tell a killed run's leftovers from a running one.
_STAGING = re.compile(r"\.(export|old)-(?:(\d+)-)?[^/]*$")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, run by another user
        return True
    return True


def clean_stale_staging(dst: Path) -> list[str]:
    """Remove the staging folders of earlier exports into `dst` whose process is gone; return what was done.

    A killed run leaves `.DST.export-*` (removed) and, if it died while swapping folders, `.DST.old-*` holding the
    previous DST: it is moved back to DST when DST is missing, removed otherwise. Folders of a process still running
    (another export) and folders without a process id (older hf_dllm) are left and reported.
    """
    dst = dst.resolve()
    notes = []
    if not dst.parent.is_dir():
        return notes
    prefix = f".{dst.name}."
    for path in sorted(dst.parent.iterdir()):
        match = _STAGING.match(path.name[len(prefix) - 1 :]) if path.name.startswith(prefix) else None
        if match is None or not path.is_dir() or path.is_symlink():
            continue
        kind, pid = match.group(1), match.group(2)
        if pid is None or _process_alive(int(pid)):
            who = "an export that may still be running" if pid else "an earlier hf_dllm export"
            notes.append(f"left {path} (made by {who}); remove it if no export into {dst} is running.")
        elif kind == "old" and not dst.exists():
            path.rename(dst)
            notes.append(f"restored {dst} from {path}, which an export killed while replacing it left behind.")
        else:
            shutil.rmtree(path, ignore_errors=True)
            notes.append(f"removed {path}, left by an export (process {pid}) that was killed.")
    return notes


# --- the export -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What `export_checkpoint` wrote: the sorted file names of DST and the generation settings of its
    generation_config.json, with their origins (`generation.summary()` says it in words)."""

    files: list[str]
    generation: GenerationSettings


def _check_dst(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.resolve() == src.resolve():
        raise ExportError(f"DST ({dst}) is SRC: export into a new folder.")
    if src.resolve().is_relative_to(dst.resolve()):
        raise ExportError(f"DST ({dst}) contains SRC ({src}): export into a folder outside SRC's parents.")
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise ExportError(f"DST ({dst}) exists and is not a folder.")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ExportError(f"DST ({dst}) exists and is not empty: pass --overwrite (overwrite=True) to replace it.")


# `--quantization`: the choices of `hf-dllm serve` / `generate` / `eval`'s loading flag (cli/loading.py).
EXPORT_QUANTIZATION_CHOICES = QUANTIZATION_CHOICES


def _fp8_export_plan(config: dict, quantization: str, link: bool) -> list[str] | None:
    """For `quantization="fp8"` / `"fp8-tensor"` (`+head`: the output head too): the weights to store as FP8 (and
    `config` gets their `quantization_config`); None for `"none"`. ExportError for what cannot be exported
    quantized."""
    if quantization not in EXPORT_QUANTIZATION_CHOICES:
        raise ExportError(
            f"--quantization must be one of {', '.join(EXPORT_QUANTIZATION_CHOICES)}, got {quantization!r}."
        )
    if quantization == "none":
        return None
    if config.get("quantization_config") is not None:
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        raise ExportError(f"SRC is already quantized (quant_method {method!r}); export it without --quantization.")
    if link:
        raise ExportError(
            f"--link cannot be combined with --quantization {quantization}: the quantized weights are new files."
        )
    from ..fp8 import fp8_config_for
    from .quantize import fp8_weight_names

    config_class, model_class = model_family(config["model_type"]).classes()
    try:
        quantization_config = fp8_config_for(config, quantization)
    except ValueError as error:
        raise ExportError(str(error)) from None
    names = fp8_weight_names(model_class, config_class.from_dict(config), quantization_config)
    if not names:
        raise ExportError(
            f"--quantization {quantization}: transformers' FP8 quantizer converts no layer of this model."
        )
    required, _ = expected_tensor_shapes(config)
    block = quantization_config.weight_block_size
    uneven = [
        f"{name} {list(required[name])}"
        for name in names
        if block is not None and (required[name][0] % block[0] or required[name][1] % block[1])
    ]
    if uneven:
        raise ExportError(
            f"--quantization fp8 stores whole {block[0]}x{block[1]} blocks, but these weights are not multiples of "
            f"it: {_listing(uneven)}."
        )
    config["quantization_config"] = quantization_config.to_dict()
    return names


def _place(source: Path, target: Path, link: bool) -> None:
    if link:
        try:
            os.link(source, target)
        except OSError as error:
            raise ExportError(
                f"cannot hard-link {source} to {target} ({error.strerror}): --link needs SRC and DST on the same "
                "file system; export without --link to copy."
            ) from error
    else:
        shutil.copyfile(source, target)


def export_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    link: bool = False,
    overwrite: bool = False,
    card: str = "generic",
    repo_id: str | None = None,
    generation_defaults: str = DEFAULT_GENERATION_DEFAULTS,
    max_new_tokens: int | None | _Unset = UNSET,
    block_length: int | None | _Unset = UNSET,
    threshold: float | None | _Unset = UNSET,
    quantization: str = "none",
) -> ExportResult:
    """Export the LLaDA, LLaDA2.x or Dream checkpoint folder `src` as a Hub repo folder `dst` running hf_dllm's
    remote code.

    Args:
        src: a local checkpoint in the Hub's format: `config.json` with a `model_type` of `MODEL_FAMILIES`
            (`"llada"`, `"llada2_moe"`, `"Dream"`), the weights, and usually the tokenizer.
        dst: the folder to create. It may exist if empty; a non-empty one is replaced only with `overwrite`.
        link: hard-link the weights instead of copying them (same file system only).
        overwrite: replace a non-empty `dst`.
        card: model-card preset (`CARD_PRESETS`) of SRC's family: "llada-8b-instruct", "llada-8b-base",
            "llada-1.5"; "llada2.0-mini", "llada2.0-flash", "llada2.1-mini"; "dream-v0-instruct-7b",
            "dream-coder-v0-instruct-7b"; "generic" (the family's generic card).
        repo_id: the Hub repo id the card's usage examples load (default `your-org/<name>-hf-dllm`).
        generation_defaults: where generation_config.json's settings come from: "source" (SRC's
            generation_config.json, the family's defaults when SRC has none hf_dllm reads) or "fast" (the family's
            fast defaults, `ModelFamily.fast_defaults`, whatever SRC has).
        max_new_tokens, block_length, threshold: override that one field of generation_config.json (not given: the
            value of SRC's generation_config.json or the family's). `threshold=None` writes no threshold (LLaDA's
            fixed schedule; for LLaDA2.x one token per step); naming `threshold` replaces the base's decoding rule
            (`steps`, `factor`), as in `generate()`. `resolve_generation_settings` decides the settings.
        quantization: `"none"` (the weights as SRC stores them) or `"fp8"`: the linear weights that transformers'
            `FineGrainedFP8Config` quantizes at load time are stored as FP8 with 128x128 block scales and
            config.json gets that `quantization_config`, so the repo loads pre-quantized (`hub/quantize.py`;
            safetensors SRC only, not with `link`).

    Returns an `ExportResult`: the sorted names of the files written to `dst` and the generation settings written,
    with the origin of each (also logged, at INFO, by the `hf_dllm.hub.export` logger). Raises `ExportError` on bad
    input; `dst` is then left as it was.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ExportError(f"SRC ({src}) is not a folder: pass a LLaDA, LLaDA2.x or Dream checkpoint folder.")
    # Before DST is checked: a killed run may have moved DST aside (restored here).
    for note in clean_stale_staging(dst):
        logger.warning(note)
    _check_dst(src, dst, overwrite)
    card_preset(card)  # an unknown preset is an error before anything else is read
    config = read_source_config(src)
    model_type = config["model_type"]
    family = MODEL_FAMILIES[model_type]
    fp8_names = _fp8_export_plan(config, quantization, link)
    card = resolve_card(card, model_type)
    weights = find_weights(src)
    code = check_remote_code(model_type=model_type)
    tokenizer_files = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    generation = resolve_generation_settings(
        model_type,
        src,
        special_ids=special_token_ids(src, config),
        generation_defaults=generation_defaults,
        max_new_tokens=max_new_tokens,
        block_length=block_length,
        threshold=threshold,
    )
    generated = {"config.json": export_config(config), "generation_config.json": generation.to_json_string()}
    name = CARD_PRESETS[card]["model_name"] or dst.resolve().name
    repo_id = repo_id or f"{DEFAULT_REPO_ORG}/{name}-hf-dllm"
    generated["README.md"] = render_card(
        read_card_template(family.card_template), card_variables(card, repo_id, dst.resolve().name, generation.fields)
    )

    dst.resolve().parent.mkdir(parents=True, exist_ok=True)
    pid_prefix = f".{dst.resolve().name}.%s-{os.getpid()}-"
    staging = Path(tempfile.mkdtemp(prefix=pid_prefix % "export", dir=dst.resolve().parent))
    try:
        if fp8_names is None:
            for file_name in weights:
                _place(src / file_name, staging / file_name, link)
        else:
            from .quantize import QuantizationError, write_fp8_weights

            try:
                # What the config says (None: one scale per matrix).
                block = config["quantization_config"].get("weight_block_size")
                write_fp8_weights(src, staging, weights, fp8_names, block)
            except QuantizationError as error:
                raise ExportError(str(error)) from error
        for file_name in tokenizer_files:
            shutil.copyfile(src / file_name, staging / file_name)
        for path in code:
            shutil.copyfile(path, staging / path.name)
        for file_name, text in generated.items():
            (staging / file_name).write_text(text, encoding="utf-8")
        verify_export(staging, config, weights, tokenizer_files)
        staging.chmod(0o755)
        if dst.is_dir():
            old = Path(tempfile.mkdtemp(prefix=pid_prefix % "old", dir=dst.resolve().parent))
            old.rmdir()
            dst.rename(old)
            try:
                staging.rename(dst)
            except OSError:
                old.rename(dst)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(generation.summary())
    return ExportResult(files=sorted(path.name for path in dst.iterdir()), generation=generation)


# --- command line ----------------------------------------------------------------------------------------------


def _threshold(value: str) -> float | None:
    if value.lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1] or 'none', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dllm export",
        description="Turn a local LLaDA, LLaDA2.x or Dream checkpoint folder into a Hub repo folder that runs "
        "hf_dllm's code as remote code: AutoModel.from_pretrained(repo, trust_remote_code=True) then works without "
        "hf_dllm installed.",
    )
    parser.add_argument(
        "src",
        metavar="SRC",
        help="checkpoint folder (config.json with model_type llada, llada2_moe or Dream + weights [+ tokenizer])",
    )
    parser.add_argument("dst", metavar="DST", help="folder to create (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--link", action="store_true", help="hard-link the weights instead of copying them")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument(
        "--card",
        choices=sorted(CARD_PRESETS),
        default="generic",
        help="model card preset for README.md, of SRC's family (generic: the family's generic card)",
    )
    parser.add_argument("--repo-id", help="Hub repo id used in the card's examples (default your-org/<name>-hf-dllm)")
    parser.add_argument(
        "--quantization",
        choices=EXPORT_QUANTIZATION_CHOICES,
        default="none",
        help="fp8: store the linear weights that transformers' FineGrainedFP8Config quantizes as FP8 with 128x128 "
        "block scales (the repo then loads pre-quantized on a GPU; LLaDA2.x keeps its experts and head in bf16); "
        "none (default): the weights as SRC stores them",
    )
    families = MODEL_FAMILIES.values()
    llada = MODEL_FAMILIES["llada"].fast_defaults
    fast = ", ".join(f"{name}={value}" for name, value in llada.items() if name != "threshold")

    def per_family(name: str, fast_defaults: bool) -> str:
        return ", ".join(
            f"{family.name} {(family.fast_defaults if fast_defaults else family.generation_defaults)[name]}"
            for family in families
        )

    parser.add_argument(
        "--generation-defaults",
        choices=GENERATION_DEFAULTS_CHOICES,
        default=DEFAULT_GENERATION_DEFAULTS,
        help="where generation_config.json's settings come from: 'source' (default) keeps SRC's "
        "generation_config.json (the family's defaults when SRC has none: LLaDA's and LLaDA2.x's are their fast "
        "ones, Dream's its own sampler in one block of max_new_tokens without a cache); 'fast' writes the family's "
        f"fast defaults whatever SRC has (threshold {per_family('threshold', True)}; {fast}). "
        "--max-new-tokens, --block-length and --threshold override single fields on top of either",
    )

    def option_help(name: str) -> str:
        return (
            f"{name} written to generation_config.json (default: SRC's, else the family's: {per_family(name, False)})"
        )

    parser.add_argument("--max-new-tokens", type=int, default=UNSET, help=option_help("max_new_tokens"))
    parser.add_argument("--block-length", type=int, default=UNSET, help=option_help("block_length"))
    parser.add_argument(
        "--threshold",
        type=_threshold,
        default=UNSET,
        help=option_help("threshold") + "; 'none' = no threshold: LLaDA's fixed schedule, for LLaDA2.x one token per "
        "step, for Dream its timestep schedule (alg). It replaces SRC's decoding rule (steps, factor), as "
        "generate(threshold=...) does",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error argparse already reported
        return int(exit_.code or 0)
    if not logger.handlers:  # the notes of `clean_stale_staging`, on stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("hf-dllm export: %(message)s"))
        logger.addHandler(handler)
    try:
        result = export_checkpoint(
            args.src,
            args.dst,
            link=args.link,
            overwrite=args.overwrite,
            card=args.card,
            repo_id=args.repo_id,
            generation_defaults=args.generation_defaults,
            max_new_tokens=args.max_new_tokens,
            block_length=args.block_length,
            threshold=args.threshold,
            quantization=args.quantization,
        )
    except ExportError as error:
        print(f"hf-dllm export: error: {error}", file=sys.stderr)
        return 1
    print(f"Exported {args.src} to {args.dst}: {', '.join(result.files)}")
    print(result.generation.summary())
    print(f"Upload it with: hf upload {args.repo_id or '<your-org>/<repo-name>'} {args.dst} .")
    return 0


if __name__ == "__main__":
    sys.exit(main())
