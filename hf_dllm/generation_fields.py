"""The fields of `DiffusionGenerationConfig`, described once (`GENERATION_FIELDS`: type, default, values, one-line
help) for the config and for every application that exposes them: the command lines' options, lm-eval's
`model_args`, the server's request fields, the exporter's options.

Imports neither torch nor transformers, so that `hf-dllm COMMAND --help` builds its options without them
(docs/decisions/cli-startup.md). This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

import copy
import dataclasses
import math

REMASKING_STRATEGIES = ("low_confidence", "random")
# The `kv_cache_dtype` values (`cache.KV_CACHE_CLASSES` holds the K/V store of each): None keeps K/V in the model's
# dtype, "fp8" stores them as float8 e4m3 with a scale per position and head.
KV_CACHE_DTYPES = (None, "fp8")


@dataclasses.dataclass(frozen=True)
class GenerationField:
    """One field of `DiffusionGenerationConfig`, described once for every application that exposes it: the command
    lines (`hf-dllm eval` / `generate` options, `hf-dllm export`'s), lm-eval's `model_args`, the server's request
    fields (`GENERATION_FIELDS`).

    name: the field (a command-line flag is `--` + name with `-` for `_`).
    type: `int`, `float`, `str` or `bool`: what a command line's text is parsed as (`dict` for a structured value,
        which is then no `option`: DiffusionGemma's `sampler_config`).
    default: the value of a config that does not set it.
    help: one line, for `--help`.
    choices: the fixed set of values other than None it takes (empty: any value of `type` that `validate` accepts).
    none_option: a command line may give `none` for None (e.g. `--threshold none`: no threshold rule).
    special_token: a special token id (the model's, from its config and tokenizer; no application option).
    option: a setting a run chooses: an option of the command lines, a `model_args` of lm-eval and a request field
        of the server. False for special token ids, for `do_sample` (it follows `temperature`) and for
        `return_dict_in_generate` (the form of `generate()`'s output).
    request: with `option`, also a request field of `hf-dllm serve`.
    owner: the family whose sampler the field belongs to (`register_generation_fields`); None for the fields of
        `DiffusionGenerationConfig` itself.
    """

    name: str
    type: type
    default: object
    help: str
    choices: tuple = ()
    none_option: bool = False
    special_token: bool = False
    option: bool = True
    request: bool = True
    owner: str | None = None


_F = GenerationField
# Every field of DiffusionGenerationConfig. Nothing else is accepted, by the config or by `generate()`: an unknown
# name is an error, never a silent no-op. Families add the fields of their own samplers (`register_generation_fields`).
GENERATION_FIELDS: dict[str, GenerationField] = {
    field.name: field
    for field in (
        _F("max_new_tokens", int, 128, "generated positions"),
        _F("steps", int, None, "denoising steps over all blocks ('none': one token per step)", none_option=True),
        _F("block_length", int, 32, "positions per block, decoded left to right"),
        _F("temperature", float, 0.0, "0 = greedy; > 0 samples (Gumbel-max)"),
        _F("do_sample", bool, False, "sample (True iff temperature > 0; follows temperature)", option=False),
        _F("remasking", str, "low_confidence", "which masked positions a step commits", choices=REMASKING_STRATEGIES),
        _F(
            "threshold",
            float,
            None,
            "Fast-dLLM threshold decoding, 0 < tau <= 1 ('none': no threshold rule)",
            none_option=True,
        ),
        _F("factor", float, None, "Fast-dLLM factor decoding, > 0 ('none': no factor rule)", none_option=True),
        _F("use_cache", bool, True, "reuse K/V outside the block"),
        _F("dual_cache", bool, True, "with use_cache, also reuse the suffix's K/V"),
        _F(
            "kv_cache_dtype",
            str,
            None,
            "store cached K/V as fp8 (default: the model's dtype)",
            choices=tuple(name for name in KV_CACHE_DTYPES if name is not None),
            request=False,  # the serving engine keeps K/V in the model's dtype (rows' K/V move between layouts)
        ),
        _F("cfg_scale", float, 0.0, "classifier-free guidance scale (0 = off)"),
        _F("minimal_topk", int, 1, "block-causal models: steps of a block at most max_new_tokens // minimal_topk"),
        _F("editing_threshold", float, None, "LLaDA2.1 token editing: re-decode above this probability"),
        _F("max_post_steps", int, 16, "token editing: forwards after a block's last mask"),
        _F("num_to_transfer", int, 1, "token editing: masked positions a step commits at least"),
        _F("eos_early_stop", bool, True, "a row stops once its committed blocks hold an EOS"),
        _F("logits_eos_inf", bool, False, "EOS logits set to -inf (never proposed)", request=False),
        _F("confidence_eos_eot_inf", bool, False, "EOS/EOT candidates committed last", request=False),
        *(
            _F(name, int, None, f"special token id: {name}", special_token=True, option=False)
            for name in ("mask_token_id", "eos_token_id", "eot_token_id", "pad_token_id", "bos_token_id")
        ),
        _F("return_dict_in_generate", bool, False, "return a DiffusionGenerateOutput", option=False),
        # A process-wide debugging switch: not per request.
        _F("disable_compile", bool, False, "no CUDA-graph capture of the denoising step (debugging)", request=False),
    )
}
_CORE_FIELDS = frozenset(GENERATION_FIELDS)
# Validators of the fields a family's own sampler adds (`register_generation_fields`), by owner.
FIELD_VALIDATORS: dict = {}
# LLaDA2.1 token editing (block-causal models only); non-default values need `editing_threshold`.
EDITING_FIELDS = ("editing_threshold", "max_post_steps", "num_to_transfer")
SPECIAL_TOKEN_FIELDS = tuple(name for name, field in GENERATION_FIELDS.items() if field.special_token)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value) -> bool:
    """A finite int or float: NaN passes every comparison unnoticed (`nan < 0` is False) and inf turns logits into
    NaN; an int beyond float range makes math.isfinite raise OverflowError."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def register_generation_fields(owner: str, fields, validate) -> dict[str, GenerationField]:
    """Add the generation fields of a family's own sampler (`fields`: `GenerationField`s, their `owner` set here to
    `owner`) to `DiffusionGenerationConfig` and to every application's options, with `validate(config)` raising a
    `ValueError` for bad values of them. Registering `owner` again replaces its fields. A family that does not own
    them refuses them away from their defaults (`DiffusionFamily.validate`). Returns the registered fields by name."""
    fields = {field.name: dataclasses.replace(field, owner=owner) for field in fields}
    clash = sorted(set(fields) & _CORE_FIELDS)
    if clash:
        raise ValueError(f"{owner}: {clash} are DiffusionGenerationConfig's own fields.")
    taken = sorted(name for name in fields if name in GENERATION_FIELDS and GENERATION_FIELDS[name].owner != owner)
    if taken:
        raise ValueError(f"{owner}: {taken} are registered by {GENERATION_FIELDS[taken[0]].owner} already.")
    for name in [name for name, field in GENERATION_FIELDS.items() if field.owner == owner]:
        del GENERATION_FIELDS[name]
    GENERATION_FIELDS.update(fields)
    FIELD_VALIDATORS[owner] = validate
    return fields


def generation_field_defaults(exclude_core: bool = False) -> dict:
    """Every field of `DiffusionGenerationConfig` with its default (`exclude_core`: only the fields families
    registered)."""
    return {
        name: copy.deepcopy(field.default)
        for name, field in GENERATION_FIELDS.items()
        if not (exclude_core and name in _CORE_FIELDS)
    }


__all__ = [
    "EDITING_FIELDS",
    "FIELD_VALIDATORS",
    "GENERATION_FIELDS",
    "KV_CACHE_DTYPES",
    "REMASKING_STRATEGIES",
    "SPECIAL_TOKEN_FIELDS",
    "GenerationField",
    "finite",
    "generation_field_defaults",
    "is_int",
    "is_number",
    "register_generation_fields",
]
