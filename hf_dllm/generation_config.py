"""`DiffusionGenerationConfig`: the parameters of block-diffusion `generate()`, saved as `generation_config.json`.

Every field is a decoding choice of LLaDA (arXiv:2502.09992) or Fast-dLLM (arXiv:2505.22618); the config accepts
nothing else, so an unknown or unsupported parameter is an error instead of a silent no-op, and `validate()` rejects
contradictions (threshold with factor, steps with a confidence rule, sampling without temperature, ...).

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

import copy

import transformers
from transformers import GenerationConfig

from .generation_fields import (
    FIELD_VALIDATORS,
    GENERATION_FIELDS,
    KV_CACHE_DTYPES,
    REMASKING_STRATEGIES,
    SPECIAL_TOKEN_FIELDS,
    GenerationField,
    finite,
    generation_field_defaults,
    is_int,
    is_number,
    register_generation_fields,
)

# Upper bound of `max_new_tokens` and `steps`: far beyond any model's context (LLaDA: 4096 positions), yet small
# enough that a typo such as 10**9 is an error naming the field instead of a multi-gigabyte allocation.
MAX_GENERATION_LENGTH = 1 << 20
# The largest `cfg_scale`: guidance multiplies the conditional-minus-unconditional logit gap by 1 + cfg_scale (LLaDA
# App. B.3 uses scales up to a few units); past 100 the result is the gap's argmax alone, and scales far beyond
# overflow half-precision logits into inf / NaN.
MAX_CFG_SCALE = 100.0
_METADATA_FIELDS = ("transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash")


class DiffusionGenerationConfig(GenerationConfig):
    r"""
    Generation parameters of `DiffusionGenerationMixin.generate`. Saved as and loaded from `generation_config.json`.

    Length and schedule:
        max_new_tokens (`int`, 128): generated positions (all decoded unless `eos_early_stop` ends a row).
        block_length (`int`, 32): positions per block (at most 2**20 and the model's context); blocks are decoded
            left to right. When `max_new_tokens` is not a multiple of it, the last block is shorter; a
            `block_length` above `max_new_tokens` is clamped to it on bidirectional models (one block), while
            block-causal models keep their trained block grid (docs/limits.md).
        steps (`int`, *optional*): total denoising steps over all blocks, spread over blocks in proportion to their
            length (`floor(steps * end_b / max_new_tokens)` minus the same at the block's start, at least 1 per
            block). `None` = one token per step (`steps = max_new_tokens`). For bidirectional models (LLaDA) it
            must be `None` with `threshold`/`factor`, whose steps are decided by confidence; for block-causal
            models (LLaDA2) `steps` and `threshold` combine as in their reference `generate()` (each step commits
            every position above the threshold if that is at least the step's scheduled count, else the scheduled
            count). `steps`, `threshold` and `factor` are one choice: passing one of them to `generate()` replaces
            the rule of the base config.
        minimal_topk (`int`, 1): block-causal models: the steps of a block are capped at
            `max_new_tokens // minimal_topk` (LLaDA2's `minimal_topk`).

    Unmasking (which masked positions a step commits):
        remasking (`str`, `"low_confidence"`): `"low_confidence"` commits the most confident candidates,
            `"random"` random ones (LLaDA Sec. 2.4).
        threshold (`float`, *optional*): Fast-dLLM threshold decoding, 0 < tau <= 1.
        factor (`float`, *optional*): Fast-dLLM factor decoding, > 0.
        temperature (`float`, 0.0): 0 = greedy; > 0 samples with float64 Gumbel-max as LLaDA does.
        do_sample (`bool`, False): must agree with `temperature` (True iff temperature > 0); passing only
            `temperature` to `generate()` sets it.
        cfg_scale (`float`, 0.0): unsupervised classifier-free guidance (LLaDA App. B.3), in [0, 100]; the
            unconditional branch masks the prompt.
        logits_eos_inf (`bool`): EOS logits set to -inf, so EOS is never proposed (LLaDA App. B.4).
        confidence_eos_eot_inf (`bool`): EOS/EOT candidates get the lowest confidence, so they are committed last
            (LLaDA App. B.4). EOS ids come from `eos_token_id`, EOT from `eot_token_id`.

    Token editing (LLaDA2.1, block-causal models only):
        editing_threshold (`float`, *optional*): turns editing on: a committed (non-prompt) position of the current
            block whose new prediction differs and has probability > `editing_threshold` is re-decoded. Each step
            then commits `num_to_transfer` masked positions (or every one above `threshold`, if more), and `steps`
            must be None.
        max_post_steps (`int`, 16): editing forwards a block may make after its last mask is committed.
        num_to_transfer (`int`, 1): masked positions each step commits at least (with editing).
        Away from their defaults, these two need editing on: `editing_threshold` set, or a family whose rule always
        edits (LLaDA2.2; `DiffusionFamily.always_edits`).

    Caching (Fast-dLLM Sec. 3.2):
        use_cache (`bool`, True): reuse K/V of positions outside the block within a block. For block-causal
            models (LLaDA2) the cache is exact: committed blocks' K/V are written once and never change.
        dual_cache (`bool`, True): with `use_cache`, also reuse the suffix (only the block is recomputed).
            Block-causal models never attend to the suffix, so for them the prefix and dual caches are the same
            exact cache and this flag changes nothing.
        kv_cache_dtype (`str`, *optional*): None keeps cached K/V in the model's dtype; `"fp8"` stores them as
            float8 e4m3 with a float32 scale per position and head (`cache.FP8DiffusionKVCache`): about half the
            cache memory, an approximation (each vector keeps 3 mantissa bits relative to its largest value). Needs
            `use_cache` and a model that supports it (`DiffusionGenerationMixin.diffusion_kv_cache_dtypes`).

    Stopping and output:
        eos_early_stop (`bool`, True): once a row's committed blocks hold an EOS, the row stops, its remaining
            positions are filled with EOS, and it costs no more forwards.
        return_dict_in_generate (`bool`, False): return a `DiffusionGenerateOutput` (`sequences`, `nfe`).
        disable_compile (`bool`, False): turn off CUDA-graph capture of the denoising step (debugging).

    A family's own sampler adds fields of its own (`register_generation_fields`; Dream's `alg`, `alg_temp`,
    `top_p`, `top_k`, `eps`: `family_dream.py`); the other families refuse them away from their defaults.

    Each field's type, default, values and one-line help are written once, in `GENERATION_FIELDS`; the command
    lines, the server's request fields, lm-eval's `model_args` and the exporter's options derive from it.

    Special tokens: `mask_token_id`, `eos_token_id` (int or list), `eot_token_id`, `pad_token_id`, `bos_token_id`.
    """

    def __init__(self, **kwargs):
        # GenerationConfig.__init__ is not called on purpose: its autoregressive fields (beams, top-k, ...) would
        # be accepted and silently ignored by the diffusion loop.
        for name, field in GENERATION_FIELDS.items():
            setattr(self, name, kwargs.pop(name, copy.deepcopy(field.default)))
        self._from_model_config = kwargs.pop("_from_model_config", False)
        self._commit_hash = kwargs.pop("_commit_hash", None)
        self.transformers_version = kwargs.pop("transformers_version", transformers.__version__)
        if kwargs:
            raise ValueError(
                f"DiffusionGenerationConfig got unknown fields {sorted(kwargs)}; "
                f"the fields are {sorted(GENERATION_FIELDS)}."
            )
        self.validate()

    @classmethod
    def from_model_config(cls, model_config) -> "DiffusionGenerationConfig":
        """Default generation config of a model: special token ids from its config, other fields default."""
        config_dict = model_config if isinstance(model_config, dict) else model_config.to_dict()
        ids = {name: config_dict.get(name) for name in SPECIAL_TOKEN_FIELDS}
        return cls(**{name: value for name, value in ids.items() if value is not None}, _from_model_config=True)

    @classmethod
    def from_generation_config(cls, generation_config: GenerationConfig) -> "DiffusionGenerationConfig":
        """Convert a plain `GenerationConfig`: its set fields must all be diffusion fields."""
        if isinstance(generation_config, cls):
            return copy.deepcopy(generation_config)
        fields = {
            key: value
            for key, value in generation_config.to_dict().items()
            if value is not None and key not in _METADATA_FIELDS
        }
        return cls(**fields)

    def inherit_special_tokens(self, source: GenerationConfig) -> None:
        """Take the special token ids this config leaves unset from `source` (the model's generation config), as
        transformers does for a passed or foreign config."""
        for name in SPECIAL_TOKEN_FIELDS:
            if getattr(self, name) is None:
                setattr(self, name, getattr(source, name, None))

    @staticmethod
    def field_names() -> tuple[str, ...]:
        return tuple(GENERATION_FIELDS)

    def to_dict(self) -> dict:
        """As `GenerationConfig.to_dict`, without the fields of a family's own sampler (`register_generation_fields`)
        left at their defaults: a saved config then loads where that family is not installed (a Hub repo of
        another family's remote code)."""
        output = super().to_dict()
        for name, default in generation_field_defaults(exclude_core=True).items():
            if name in output and output[name] == default:
                del output[name]
        return output

    def to_diff_dict(self) -> dict:
        # Every diffusion field counts as set: `pipeline()` adds its own defaults (do_sample=True,
        # temperature=0.7, max_new_tokens=256) for fields missing here, which would silently switch to sampling.
        return {key: value for key, value in self.to_dict().items() if value is not None}

    def get_generation_mode(self, *args, **kwargs):
        raise NotImplementedError("DiffusionGenerationConfig has a single mode: block diffusion.")

    def validate(self, strict: bool = False, **kwargs) -> None:
        """Raise a `ValueError` naming the field and its allowed values for any invalid value or contradiction.

        These are the model-agnostic checks (a config file fits any model); the rules of a model's family (whether
        `steps` combines with `threshold`, token editing, fields of another family's sampler) are its family's
        (`DiffusionFamily.validate`), checked when a model resolves a call's settings."""
        for name in ("max_new_tokens", "block_length"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.steps is not None and (not is_int(self.steps) or self.steps <= 0):
            raise ValueError(f"`steps` must be None or a positive integer, got {self.steps!r}.")
        for name in ("max_new_tokens", "block_length", "steps"):
            value = getattr(self, name)
            if value is not None and value > MAX_GENERATION_LENGTH:
                raise ValueError(f"`{name}` must be at most {MAX_GENERATION_LENGTH} (2**20), got {value!r}.")
        if not finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"`temperature` must be a finite number >= 0 (0 = greedy), got {self.temperature!r}.")
        if not finite(self.cfg_scale) or not 0 <= self.cfg_scale <= MAX_CFG_SCALE:
            raise ValueError(
                f"`cfg_scale` must be a finite number in [0, {MAX_CFG_SCALE:g}] (0 = off), got {self.cfg_scale!r}."
            )
        if self.remasking not in REMASKING_STRATEGIES:
            raise ValueError(f"`remasking` must be one of {REMASKING_STRATEGIES}, got {self.remasking!r}.")
        if self.threshold is not None and (not finite(self.threshold) or not 0 < self.threshold <= 1):
            raise ValueError(f"`threshold` must be None or a number in (0, 1], got {self.threshold!r}.")
        if self.factor is not None and (not finite(self.factor) or self.factor <= 0):
            raise ValueError(f"`factor` must be None or a finite number > 0, got {self.factor!r}.")
        if self.threshold is not None and self.factor is not None:
            raise ValueError("`threshold` and `factor` are alternative unmasking rules: set at most one of them.")
        if not is_int(self.minimal_topk) or self.minimal_topk <= 0:
            raise ValueError(f"`minimal_topk` must be a positive integer, got {self.minimal_topk!r}.")
        if self.editing_threshold is not None and (
            not is_number(self.editing_threshold) or not 0 <= self.editing_threshold <= 1
        ):
            # 0 edits wherever the prediction differs (SGLang's LLaDA2.2 default).
            raise ValueError(f"`editing_threshold` must be None or a number in [0, 1], got {self.editing_threshold!r}.")
        for name in ("max_post_steps", "num_to_transfer"):
            value = getattr(self, name)
            if not is_int(value) or value < (0 if name == "max_post_steps" else 1):
                bound = ">= 0" if name == "max_post_steps" else ">= 1"
                raise ValueError(f"`{name}` must be an integer {bound}, got {value!r}.")
        if self.factor is not None and self.steps is not None:
            raise ValueError("`steps` must be None with `factor`: confidence decides how many steps a block takes.")
        if self.editing_threshold is not None and self.remasking != "low_confidence":
            raise ValueError("`editing_threshold` needs remasking='low_confidence' (it compares model confidences).")
        adaptive = "threshold" if self.threshold is not None else "factor" if self.factor is not None else None
        if adaptive and self.remasking != "low_confidence":
            raise ValueError(f"`{adaptive}` needs remasking='low_confidence' (it compares model confidences).")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"`kv_cache_dtype` must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}.")
        if self.kv_cache_dtype is not None and self.use_cache is False:
            raise ValueError(f"`kv_cache_dtype={self.kv_cache_dtype!r}` needs `use_cache=True` (no K/V is cached).")
        for validate_fields in FIELD_VALIDATORS.values():
            validate_fields(self)
        for name in (name for name, field in GENERATION_FIELDS.items() if field.type is bool and not field.owner):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.do_sample != (self.temperature > 0):
            raise ValueError(
                f"`do_sample={self.do_sample}` contradicts `temperature={self.temperature}`: sampling happens iff "
                "temperature > 0 (set temperature > 0 to sample, or 0 with do_sample=False for greedy)."
            )
        for name in ("mask_token_id", "eot_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"`{name}` must be None or an integer >= 0, got {value!r}.")
        eos = self.eos_token_id
        if eos is not None and not (
            (is_int(eos) and eos >= 0) or (isinstance(eos, list) and eos and all(is_int(i) and i >= 0 for i in eos))
        ):
            raise ValueError(f"`eos_token_id` must be None, an integer >= 0 or a list of them, got {eos!r}.")
        if self.mask_token_id is not None and self.mask_token_id == self.pad_token_id:
            raise ValueError(
                f"`pad_token_id` ({self.pad_token_id}) must differ from `mask_token_id`: padding would be "
                "mistaken for positions to denoise."
            )

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if is_int(self.eos_token_id) else list(self.eos_token_id)

    @property
    def prompt_pad_token_id(self) -> int:
        """The id that left-pads a batch of prompts: `pad_token_id`, else the first EOS id, else 0 (padded positions
        are masked out of attention, so any id other than the mask token does; `validate` rejects pad == mask)."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return (self.eos_token_ids or [0])[0]


__all__ = [
    "GENERATION_FIELDS",
    "DiffusionGenerationConfig",
    "GenerationField",
    "REMASKING_STRATEGIES",
    "generation_field_defaults",
    "register_generation_fields",
]
