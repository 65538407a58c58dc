"""The generation settings of the command lines, derived from the one description of the fields
(`generation_fields.GENERATION_FIELDS`, with the fields families register for their samplers): `hf-dllm eval` and
`hf-dllm generate` take every field that is a run's setting (`GenerationField.option`) as an option, `hf-dllm export`
the few it writes, and lm-eval's `model_args` are parsed with the same parsers.

A field's flag is `--` + its name with `-` for `_` (`--max-new-tokens`); a `bool` field is a pair
(`--use-cache` / `--no-use-cache`); a field with `choices` takes only those; a field with `none_option` also takes
`none` (the field set to None: `--threshold none`, no threshold rule). An option left out is absent from the parsed
namespace (`argparse.SUPPRESS`), so `--threshold none` (None) stays distinct from "not given".
"""

from __future__ import annotations

import argparse

from ..family import import_families
from ..generation_fields import GENERATION_FIELDS, GenerationField

import_families()  # the fields of every family's sampler are options too (Dream's `alg`, ...)

# Other flags of a field (LLaDA's evaluation calls `max_new_tokens` the generation length).
FLAG_ALIASES = {"max_new_tokens": ("--gen-length",)}
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def flag(name: str) -> str:
    """The command-line flag of the field `name`."""
    return "--" + name.replace("_", "-")


def option_fields() -> dict[str, GenerationField]:
    """The fields that are a run's settings (`GenerationField.option`), those of registered families included."""
    return {name: field for name, field in GENERATION_FIELDS.items() if field.option}


def parse_field_value(field: GenerationField, text: str):
    """The value of `field` a command line's `text` gives: `none` is None where the field takes it
    (`none_option`); a `bool` field takes true / false; else `field.type(text)`. Raises `ValueError` naming what the
    field takes."""
    if field.none_option and text.strip().lower() == "none":
        return None
    if field.type is bool:
        if text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
    else:
        try:
            return field.type(text)
        except ValueError:
            pass
    expected = _KIND_NAMES.get(field.type, field.type.__name__) + (" or 'none'" if field.none_option else "")
    raise ValueError(f"must be {expected}, got {text!r}")


def value_parser(field: GenerationField):
    """`parse_field_value` as an argparse `type`."""

    def parse(text: str):
        try:
            return parse_field_value(field, text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = field.type.__name__  # argparse names the type in its error messages
    return parse


def add_generation_argument(
    parser, field: GenerationField, default=argparse.SUPPRESS, help: str | None = None, aliases: bool = True
):
    """Add `field`'s option (and, with `aliases`, its `FLAG_ALIASES`) to `parser` (a parser or an argument group)."""
    flags = [flag(field.name), *(FLAG_ALIASES.get(field.name, ()) if aliases else ())]
    help = field.help if help is None else help
    if field.type is bool:
        return parser.add_argument(
            *flags, dest=field.name, action=argparse.BooleanOptionalAction, default=default, help=help
        )
    choices = (*field.choices, *((None,) if field.none_option else ())) if field.choices else None
    return parser.add_argument(
        *flags, dest=field.name, type=value_parser(field), choices=choices, default=default, help=help
    )


def add_generation_arguments(parser, fields: dict[str, GenerationField] | None = None) -> None:
    """Add an option for each of `fields` (default: `option_fields()`) to `parser`, none of them with a default."""
    for field in (option_fields() if fields is None else fields).values():
        add_generation_argument(parser, field)


def generation_arguments(args: argparse.Namespace) -> dict:
    """The generation fields the command line gave (`--threshold none` gives `threshold=None`)."""
    return {name: getattr(args, name) for name in GENERATION_FIELDS if hasattr(args, name)}


def coerce_field_values(values: dict) -> dict:
    """`values` (field -> value) with each text given for a field that is not a `str` field parsed as its command
    line's option would be (lm-eval's `model_args` arrive as text through Python's API); a text that does not parse
    is left for the config's validation to refuse, naming the field."""
    coerced = dict(values)
    for name, value in values.items():
        field = GENERATION_FIELDS.get(name)
        if field is not None and isinstance(value, str) and (field.type is not str or field.none_option):
            try:
                coerced[name] = parse_field_value(field, value)
            except ValueError:
                pass
    return coerced
