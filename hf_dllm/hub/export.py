"""`hf-dllm export SRC DST`: turn a local checkpoint of any registered family (LLaDA, LLaDA-MoE, LLaDA2.x, Dream)
into a Hub repo that runs hf_dllm's code as remote code.

A user who has never installed hf_dllm then loads the repo with
`AutoModel.from_pretrained(repo, trust_remote_code=True)` and gets hf_dllm's model and diffusion `generate()`.

What is exported depends on SRC's model family (`families.checkpoint_family`: its `architectures`, `auto_map`, then
`model_type`), whose family object (`hf_dllm.family.DiffusionFamily`) holds every export fact. What DST
receives (every rule is implemented once, here or in the module named, and is what `tests/hub/test_export.py`,
`tests/models/llada2/test_llada2_export.py` and `tests/models/dream/test_dream_export.py` check):

- the weights: `model.safetensors`, or `model.safetensors.index.json` and every shard it names (likewise
  `pytorch_model.bin[.index.json]` when SRC has no safetensors); copied, or hard-linked with `--link`;
- the tokenizer files of SRC that exist (`TOKENIZER_FILES`), copied unchanged;
- `config.json`: SRC's `config.json` with every field kept, except `auto_map` and `architectures`, which are the
  family's (`DiffusionFamily.auto_map`, its `model_class`); written with sorted keys and an indent of 2;
- the remote code: the package's files named in the family's `remote_code_files`, copied byte for byte (never
  edited, never generated), after `remote_code.check_remote_code` verified that transformers' dynamic-module loader
  accepts them and that the list is closed under their imports;
- `generation_config.json`: a `DiffusionGenerationConfig` decided by `generation_settings.resolve_generation_settings`,
  field by field: an exporter option (`--max-new-tokens`, `--block-length`, `--threshold`) > SRC's
  `generation_config.json` (validated for the family, as the model would read it) > the family's defaults
  (`generation_defaults`: Fast-dLLM's threshold 0.9 with the dual cache for LLaDA, LLaDA2's threshold 0.95 for
  LLaDA2.x, Dream's own sampler for Dream; used when SRC has no generation_config.json hf_dllm reads) or, with
  `--generation-defaults fast`, the family's fast defaults (`DiffusionFamily.fast_defaults`: the same for LLaDA and
  LLaDA2.x, Fast-dLLM's for Dream); special token ids from SRC's generation_config.json, else SRC's config.json and
  tokenizer (`special_token_ids`); serialised by transformers (`to_json_string`). The export prints the settings
  written and the origin of each (`GenerationSettings.summary`);
- `README.md`: the family's model card template (`model_cards/template.md`, `model_cards/template-llada2.md`,
  `model_cards/template-dream.md`) rendered with a preset of `cards.CARD_PRESETS` and the settings written
  (`cards.render_preset_card`).

Nothing is half-written: every input is checked first, the repo is assembled in a temporary folder next to DST
(`.DST.export-PID-*`) and moved into place only when complete and verified (`verify.verify_export`: every
safetensors header readable, every tensor's shape the config's, the tokenizer loads). Staging folders that a killed
export left behind are removed by the next export into the same DST (`clean_stale_staging`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from ..cli.generation_options import add_generation_argument
from ..cli.loading import QUANTIZATION_CHOICES
from ..generation_fields import GENERATION_FIELDS
from .cards import CARD_PRESETS, card_preset, render_preset_card, resolve_card
from .families import MODEL_FAMILIES, ExportError, checkpoint_family, read_json_object, supported_families
from .generation_settings import (
    DEFAULT_GENERATION_DEFAULTS,
    EXPORT_FIELDS,
    GENERATION_DEFAULTS_CHOICES,
    UNSET,
    GenerationSettings,
    Unset,
    resolve_generation_settings,
)
from .remote_code import check_remote_code
from .verify import expected_tensor_shapes, listing, verify_export

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


logger = logging.getLogger(__name__)  # hf_dllm.hub.export


# --- SRC ----------------------------------------------------------------------------------------------------------


def read_source_config(src: Path) -> dict:
    """SRC's `config.json` as a dict, after checking that it is of a registered family (`checkpoint_family`) and that
    hf_dllm's config class of that family accepts it (a config the model cannot run is refused here)."""
    path = src / "config.json"
    if not path.is_file():
        raise ExportError(f"{src} has no config.json: SRC must be a checkpoint folder ({supported_families()}).")
    config = read_json_object(path)
    try:
        family = checkpoint_family(config)
    except ExportError as error:
        raise ExportError(f"{path}: {error}") from None
    config_class, _ = family.classes()
    try:
        config_class.from_dict(config)
    except (TypeError, ValueError) as error:
        raise ExportError(f"{path} is not a {family.display_name} config hf_dllm can run: {error}") from error
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
    family = checkpoint_family(config)
    ids = {
        name: config[name]
        for name in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")
        if config.get(name) is not None
    }
    if "mask_token_id" not in ids:
        config_class, _ = family.classes()
        mask = getattr(config_class.from_dict(config), "mask_token_id", None)  # DiffusionGemma has no mask token
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
    family (`checkpoint_family`)."""
    family = checkpoint_family(config)
    exported = dict(config)
    exported["auto_map"] = family.auto_map
    exported["architectures"] = [family.model_class]
    return json.dumps(exported, indent=2, sort_keys=True) + "\n"


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


def check_token_ids(config: dict, generation_config) -> None:
    """`ExportError` naming the field for a token id of SRC's config.json (the family's `token_id_fields`: mask, EOS,
    pad, BOS, LLaDA2.2's delete / split) or of the generation settings written outside the model's vocabulary (a
    LLaDA2 config.json without a mask id gets the full model's 156895, which a small vocabulary does not hold)."""
    from ..generation_config import SPECIAL_TOKEN_FIELDS

    family = checkpoint_family(config)
    config_class, _ = family.classes()
    model_config = config_class.from_dict(config)
    unset = [name for name in family.token_id_fields if config.get(name) is None]
    written = {f"generation_config.json's `{name}`": getattr(generation_config, name) for name in SPECIAL_TOKEN_FIELDS}
    try:
        family.check_token_ids(model_config)
    except ValueError as error:
        default = f" (SRC's config.json has no {', '.join(unset)}: the config class's default)" if unset else ""
        raise ExportError(f"config.json: {error}{default}") from None
    try:
        family.check_token_ids(model_config, written)
    except ValueError as error:
        raise ExportError(str(error)) from None


def file_system_error(error: OSError, dst: Path) -> ExportError:
    """One line for a file-system error while writing DST (read-only, full, permissions), naming the path."""
    path = error.filename or dst
    return ExportError(f"cannot write {path}: {error.strerror or error} ({dst} is left as it was).")


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

    config_class, model_class = checkpoint_family(config).classes()
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
            f"it: {listing(uneven)}."
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
    max_new_tokens: int | None | Unset = UNSET,
    block_length: int | None | Unset = UNSET,
    threshold: float | None | Unset = UNSET,
    quantization: str = "none",
    tokenizer: bool = True,
) -> ExportResult:
    """Export the checkpoint folder `src` (any registered family) as a Hub repo folder `dst` running hf_dllm's remote
    code.

    Args:
        src: a local checkpoint in the Hub's format: `config.json` of a registered family (`checkpoint_family`)
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
            fast defaults, `DiffusionFamily.fast_defaults`, whatever SRC has).
        max_new_tokens, block_length, threshold: override that one field of generation_config.json (not given: the
            value of SRC's generation_config.json or the family's). `threshold=None` writes no threshold (LLaDA's
            fixed schedule; for LLaDA2.x one token per step); naming `threshold` replaces the base's decoding rule
            (`steps`, `factor`), as in `generate()`. `resolve_generation_settings` decides the settings.
        quantization: `"none"` (the weights as SRC stores them) or `"fp8"`: the linear weights that transformers'
            `FineGrainedFP8Config` quantizes at load time are stored as FP8 with 128x128 block scales and
            config.json gets that `quantization_config`, so the repo loads pre-quantized (`hub/quantize.py`;
            safetensors SRC only, not with `link`).
        tokenizer: export SRC's tokenizer files (`TOKENIZER_FILES`), which must exist, load and have a chat template
            that parses; False (`--no-tokenizer`): export the model alone, without them.

    Returns an `ExportResult`: the sorted names of the files written to `dst` and the generation settings written,
    with the origin of each (also logged, at INFO, by the `hf_dllm.hub.export` logger). Raises `ExportError` on bad
    input (a token id of config.json or of the generation settings outside the vocabulary, non-finite weights, a
    missing tokenizer, a chat template that does not parse) and on a file-system error (a read-only or full
    destination: one line naming the path); `dst` is then left as it was and nothing is left beside it.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ExportError(f"SRC ({src}) is not a folder: pass a checkpoint folder ({supported_families()}).")
    # Before DST is checked: a killed run may have moved DST aside (restored here).
    for note in clean_stale_staging(dst):
        logger.warning(note)
    _check_dst(src, dst, overwrite)
    card_preset(card)  # an unknown preset is an error before anything else is read
    config = read_source_config(src)
    family = checkpoint_family(config).name
    fp8_names = _fp8_export_plan(config, quantization, link)
    card = resolve_card(card, family)
    weights = find_weights(src)
    tokenizer_files = [name for name in TOKENIZER_FILES if tokenizer and (src / name).is_file()]
    if tokenizer and not tokenizer_files:
        raise ExportError(
            f"{src} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): the repo could not be prompted or served. "
            "Add SRC's tokenizer, or pass --no-tokenizer (tokenizer=False) to export the model alone."
        )
    generation = resolve_generation_settings(
        family,
        src,
        special_ids=special_token_ids(src, config),
        generation_defaults=generation_defaults,
        max_new_tokens=max_new_tokens,
        block_length=block_length,
        threshold=threshold,
    )
    check_token_ids(config, generation.config)
    code = check_remote_code(family=family)  # the slowest check (seconds): after the cheap ones
    generated = {"config.json": export_config(config), "generation_config.json": generation.to_json_string()}
    generated["README.md"] = render_preset_card(card, repo_id, dst.resolve().name, generation.fields)

    try:
        dst.resolve().parent.mkdir(parents=True, exist_ok=True)
        pid_prefix = f".{dst.resolve().name}.%s-{os.getpid()}-"
        staging = Path(tempfile.mkdtemp(prefix=pid_prefix % "export", dir=dst.resolve().parent))
    except OSError as error:
        raise file_system_error(error, dst) from None
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
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError):
            raise file_system_error(error, dst) from None
        raise
    logger.info(generation.summary())
    return ExportResult(files=sorted(path.name for path in dst.iterdir()), generation=generation)


# --- command line ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dllm export",
        description="Turn a local checkpoint folder of a registered family ("
        + ", ".join(family.display_name for family in MODEL_FAMILIES.values())
        + ") into a Hub repo folder that runs "
        "hf_dllm's code as remote code: AutoModel.from_pretrained(repo, trust_remote_code=True) then works without "
        "hf_dllm installed.",
    )
    parser.add_argument(
        "src",
        metavar="SRC",
        help="checkpoint folder of a supported family (config.json + weights [+ tokenizer])",
    )
    parser.add_argument("dst", metavar="DST", help="folder to create (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--link", action="store_true", help="hard-link the weights instead of copying them")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument(
        "--no-tokenizer",
        dest="tokenizer",
        action="store_false",
        help="export the model without a tokenizer (by default SRC's tokenizer files are required and checked)",
    )
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
        # Families whose decoding has no such field (DiffusionGemma's sampler: no threshold) are left out.
        chosen = (
            (family, family.fast_defaults if fast_defaults else family.generation_defaults) for family in families
        )
        return ", ".join(f"{family.display_name} {defaults[name]}" for family, defaults in chosen if name in defaults)

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

    # Each option is the field's command-line option (its flag and type: `cli.generation_options`).
    extra_help = {
        "threshold": "; 'none' = no threshold: LLaDA's fixed schedule, for LLaDA2.x one token per step, for Dream its "
        "timestep schedule (alg). It replaces SRC's decoding rule (steps, factor), as generate(threshold=...) does"
    }
    for name in EXPORT_FIELDS:
        help_text = option_help(name) + extra_help.get(name, "")
        add_generation_argument(parser, GENERATION_FIELDS[name], default=UNSET, help=help_text, aliases=False)
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
            tokenizer=args.tokenizer,
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
