"""The generation_config.json of an export, decided field by field in one place (`resolve_generation_settings`): an
exporter option > SRC's generation_config.json > the family's defaults; special token ids from SRC. The result,
`GenerationSettings`, also says where each field came from (`summary`), and its fields are what the model card
documents.
"""

from __future__ import annotations

import dataclasses
import os
import types
from pathlib import Path

from ..cli.generation_options import flag
from .families import DEFAULT_FAMILY, ExportError, model_family, read_json_object


class Unset:
    """Marks an exporter option that was not given (`threshold=None` means "no threshold")."""

    def __repr__(self) -> str:
        return "<not given>"


UNSET = Unset()

# `--generation-defaults`: where generation_config.json's settings come from (the options override single fields on
# top of either). "source": SRC's generation_config.json, or the family's defaults (`ModelFamily.generation_defaults`)
# when SRC has none hf_dllm reads; "fast": the family's fast defaults (`ModelFamily.fast_defaults`), whatever SRC has.
GENERATION_DEFAULTS_CHOICES = ("source", "fast")
DEFAULT_GENERATION_DEFAULTS = "source"
# The fields of generation_config.json the exporter has an option for; each option is the field's command-line
# option (`cli.generation_options`: its flag and its type, from `GENERATION_FIELDS`).
EXPORT_FIELDS = ("max_new_tokens", "block_length", "threshold")
# Field -> command-line option.
GENERATION_OPTIONS = {name: flag(name) for name in EXPORT_FIELDS}


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
    family: str  # `DiffusionFamily.display_name`, for messages
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


# What an error about SRC's generation_config.json says to do.
_SOURCE_GENERATION_HINT = (
    "fix or remove it, or pass --generation-defaults fast (generation_defaults='fast') to write the family's "
    "defaults instead"
)


def _read_source_generation_config(src: Path, family):
    """SRC's generation_config.json read as hf_dllm's model reads it (`DiffusionGenerationConfig.from_pretrained`),
    validated for the family (`DiffusionFamily.validate`)."""
    from ..generation_config import DiffusionGenerationConfig

    try:
        config = DiffusionGenerationConfig.from_pretrained(src)
        family.validate(config)
    except (OSError, TypeError, ValueError) as error:
        raise ExportError(
            f"{src / 'generation_config.json'} is not a generation config a {family.display_name} model can use: {error} "
            f"({_SOURCE_GENERATION_HINT})."
        ) from error
    return config


def resolve_generation_settings(
    family: str = DEFAULT_FAMILY,
    src: str | os.PathLike | None = None,
    *,
    special_ids: dict | None = None,
    generation_defaults: str = DEFAULT_GENERATION_DEFAULTS,
    max_new_tokens: int | None | Unset = UNSET,
    block_length: int | None | Unset = UNSET,
    threshold: float | None | Unset = UNSET,
) -> GenerationSettings:
    """The generation_config.json of an export of `src`, a checkpoint of the model family named `family`, and where each field came from:
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
    from ..generation_config import GENERATION_FIELDS, SPECIAL_TOKEN_FIELDS, DiffusionGenerationConfig
    from ..generation_utils import DECODING_RULE_FIELDS

    if generation_defaults not in GENERATION_DEFAULTS_CHOICES:
        raise ExportError(
            f"--generation-defaults (generation_defaults) must be one of {', '.join(GENERATION_DEFAULTS_CHOICES)}, "
            f"got {generation_defaults!r}."
        )
    given = dict(zip(EXPORT_FIELDS, (max_new_tokens, block_length, threshold), strict=True))
    # None is "not given" but where None is a value of the field (`threshold=None`: no threshold).
    options = {
        name: value
        for name, value in given.items()
        if value is not UNSET and (value is not None or GENERATION_FIELDS[name].none_option)
    }
    for name, value in options.items():
        try:
            DiffusionGenerationConfig(**{name: value})
        except ValueError as error:
            raise ExportError(f"{GENERATION_OPTIONS[name]} ({name}={value!r}): {error}") from error

    family = model_family(family)
    _, model_class = family.classes()
    source = None
    notes: list[str] = []
    source_path = Path(src) / "generation_config.json" if src is not None else None
    use_source = generation_defaults == "source" and source_path is not None and source_path.is_file()
    # The fields the file sets (read once: whether it is the original code's own file, and each field's origin).
    written = read_json_object(source_path, _SOURCE_GENERATION_HINT) if use_source else {}
    if use_source and family.original_generation_fields:
        original = sorted(set(written) & set(family.original_generation_fields))
        if original:  # the original code's own file (e.g. Dream's), not settings hf_dllm reads
            use_source = False
            notes.append(
                f"{source_path} is the original {family.display_name} code's generation config (it has {original}), "
                f"for its own sampler, not hf_dllm's: the {family.display_name} family's defaults were written instead "
                "(--generation-defaults fast for the fast ones)."
            )
    if use_source:
        source = _read_source_generation_config(Path(src), family)
        for name, value in family.original_defaults.items():  # what the original implementation reads there
            if written.get(name) is None:
                setattr(source, name, value)
        base = source
        base_text = f"{source_path}"

        def base_origin(name: str) -> str:
            if name in written:
                return "source"
            return "family default" if name in family.original_defaults else "default"

    else:
        defaults = family.fast_defaults if generation_defaults == "fast" else family.generation_defaults
        base = DiffusionGenerationConfig(**defaults)
        base_text = f"the {family.display_name} family's {'fast ' if generation_defaults == 'fast' else ''}defaults"

        def base_origin(name: str) -> str:
            return "family default" if name in defaults else "default"

    # The model's resolver reads only these attributes of the model: run it on the base config alone.
    holder = types.SimpleNamespace(
        generation_config=base,
        diffusion_family=family,
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
        family.validate(config)
    except ValueError as error:
        raise ExportError(f"invalid generation settings for {base_text}: {error}") from error
    headline = tuple(dict.fromkeys([*family.generation_defaults, *family.fast_defaults]))
    return GenerationSettings(
        config=config, origins=origins, family=family.display_name, headline=headline, notes=tuple(notes)
    )
