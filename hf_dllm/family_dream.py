"""The Dream family (Dream-org/Dream-v0-Instruct-7B, -Base-7B, Dream-Coder-v0; arXiv:2508.15487): a bidirectional
model adapted from an autoregressive one (logits at position i predict token i + 1), decoded with its own sampler
(`alg` on its timestep schedule; `decoding_dream.py`) or Fast-dLLM's rules, with the fields of Dream's sampler
(`alg`, `alg_temp`, `top_p`, `top_k`, `eps`) added to the generation config.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from .family import FAST_GENERATION_DEFAULTS, Bidirectional, DiffusionFamily, fast_dllm_policy, register_family
from .generation_fields import GenerationField, finite, is_int, register_generation_fields

# Dream's decoding algorithms (`alg`): its own four and Fast-dLLM's threshold variant of its sampler
# (`decoding_dream.py`, imported where a policy is built: the family objects load without torch, `family.py`).
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy", "confidence_threshold")
# The `alg` used when a call names none and no threshold: the one Dream's README uses.
DEFAULT_DREAM_ALG = "entropy"

# Dream's sampler (arXiv:2508.15487), as generation fields (registered below, `register_generation_fields`):
#     alg: one of `DREAM_ALGS`: `"maskgit_plus"` (confidence = top-1 probability), `"topk_margin"` (top-1 minus
#         top-2 probability), `"entropy"` (negative entropy), `"origin"` (each masked position committed with the
#         schedule's probability), each on Dream's timestep schedule (`steps`, `eps`); or `"confidence_threshold"`
#         (Fast-dLLM's threshold, with `threshold`).
#     alg_temp: > 0 samples the committed positions from softmax(confidence / alg_temp) instead of taking the most
#         confident ones.
#     top_p, top_k: nucleus / top-k filtering of the token distribution before sampling and before the confidences
#         are computed.
#     eps: end of Dream's timestep schedule `linspace(1, eps, steps + 1)`, in (0, 1).
_DREAM_FIELDS = (
    GenerationField("alg", str, None, "Dream's unmasking algorithm (default: entropy)", choices=DREAM_ALGS),
    GenerationField("alg_temp", float, None, "Dream: > 0 samples the committed positions (confidence / alg_temp)"),
    GenerationField("top_p", float, None, "Dream: nucleus filtering before sampling and confidences"),
    GenerationField("top_k", int, None, "Dream: top-k filtering before sampling and confidences"),
    GenerationField("eps", float, 1e-3, "Dream: end of the timestep schedule, in (0, 1)"),
)


def validate_dream_fields(config) -> None:
    """Dream's fields: values, and their contradictions with the other rules (`ValueError` naming the field)."""
    if config.alg is not None and config.alg not in DREAM_ALGS:
        raise ValueError(f"`alg` must be None or one of {DREAM_ALGS}, got {config.alg!r}.")
    if config.alg_temp is not None and (not finite(config.alg_temp) or config.alg_temp < 0):
        raise ValueError(
            f"`alg_temp` must be None or a finite number >= 0 (0 = most confident), got {config.alg_temp!r}."
        )
    if config.top_p is not None and (not finite(config.top_p) or not 0 < config.top_p <= 1):
        raise ValueError(f"`top_p` must be None or a number in (0, 1], got {config.top_p!r}.")
    if config.top_k is not None and (not is_int(config.top_k) or config.top_k <= 0):
        raise ValueError(f"`top_k` must be None or a positive integer, got {config.top_k!r}.")
    if not finite(config.eps) or not 0 < config.eps < 1:
        raise ValueError(
            f"`eps` must be a number in (0, 1) (the end of Dream's timestep schedule), got {config.eps!r}."
        )
    if config.alg == "confidence_threshold" and config.threshold is None:
        raise ValueError("`alg='confidence_threshold'` needs `threshold` (a number in (0, 1]).")
    if config.threshold is not None and config.alg not in (None, "confidence_threshold"):
        raise ValueError(
            f"`threshold` is the rule of `alg='confidence_threshold'`; it contradicts `alg={config.alg!r}` "
            "(set alg to None or 'confidence_threshold', or drop threshold)."
        )
    if config.factor is not None and config.alg is not None:
        raise ValueError(f"`factor` is its own rule: it contradicts `alg={config.alg!r}` (set alg to None).")
    if config.alg_temp and (config.threshold is not None or config.factor is not None):
        raise ValueError("`alg_temp` > 0 applies to Dream's scheduled algs only: not with `threshold`/`factor`.")


# Dream's fields by name (`GenerationField`s, owned by "Dream").
DREAM_FIELDS = register_generation_fields("Dream", _DREAM_FIELDS, validate_dream_fields)


class DreamFamily(Bidirectional, DiffusionFamily):
    name = "dream"
    display_name = "Dream"
    checkpoints = "Dream-org/Dream-v0-Instruct-7B, Dream-v0-Base-7B, Dream-Coder-v0-Instruct-7B, Dream-Coder-v0-Base-7B"
    architectures = ("DreamModel",)
    auto_map_configs = ("configuration_dream.DreamConfig",)
    model_types = ("Dream",)

    config_module, config_class = "configuration_dream", "DreamConfig"
    model_module, model_class = "modeling_dream", "DreamModel"
    own_remote_code_files = ("configuration_dream.py", "modeling_dream.py", "family_dream.py", "decoding_dream.py")
    # Dream's own sampler, as its `diffusion_generate()` decodes: the whole answer as one block of `max_new_tokens`
    # positions, one token per step on Dream's timestep schedule with the default `alg` (`alg=None`: entropy), no KV
    # cache, every position decoded (no EOS stop); greedy. `alg` is left unset so that naming `threshold` in a call
    # switches to Fast-dLLM's rule instead of contradicting an `alg`.
    generation_defaults = {
        **FAST_GENERATION_DEFAULTS,
        "block_length": FAST_GENERATION_DEFAULTS["max_new_tokens"],
        "threshold": None,
        "use_cache": False,
        "eos_early_stop": False,
    }
    # `--generation-defaults fast`: Fast-dLLM's setting for Dream, which is LLaDA's fast defaults (threshold 0.9 with
    # `alg=None` is Fast-dLLM's threshold rule on Dream, `decoding_dream.DreamThreshold`; dual cache, blocks of 32).
    fast_generation_defaults = FAST_GENERATION_DEFAULTS
    card_template = "template-dream.md"
    generic_card = "generic-dream"
    logits_shift = 1
    supports_cfg = False  # LLaDA's guidance masks the prompt of a mask predictor; Dream's logits are shifted
    own_generation_fields = tuple(DREAM_FIELDS)
    # Fields of Dream's own `DreamGenerationConfig` that hf_dllm does not provide, at their no-op values.
    original_generation_fields = {"output_history": False, "num_return_sequences": 1}

    def unmasking_policy(self, config, model_config=None):
        """Dream's rules (`decoding_dream.make_dream_policy`); Fast-dLLM's factor rule for `factor`."""
        from .decoding_dream import make_dream_policy

        return make_dream_policy(config) or fast_dllm_policy(config)

    def describe_decoding(self, fields: dict) -> str:
        """The decoding `fields` (generation_config.json's) give, in words, for a model card: Dream's rules (`alg`
        on its timestep schedule, or Fast-dLLM's threshold / factor), its cache, sampling and blocks."""
        threshold, factor, steps, alg = fields["threshold"], fields["factor"], fields["steps"], fields["alg"]
        if threshold is not None:
            rule = f"Fast-dLLM's threshold rule (`threshold={threshold}`)"
        elif factor is not None:
            rule = f"Fast-dLLM's factor rule (`factor={factor}`)"
        else:
            named = f'`alg="{alg}"`' if alg is not None else f'`alg=None`: "{DEFAULT_DREAM_ALG}"'
            schedule = "one token per step" if steps is None else f"`steps={steps}` in all"
            positions = f", positions sampled at `alg_temp={fields['alg_temp']}`" if fields["alg_temp"] else ""
            rule = f"Dream's timestep schedule ({named}, {schedule}{positions})"
        if fields["use_cache"]:
            cache = "the dual cache" if fields["dual_cache"] else "the prefix cache"
        else:
            cache = "no KV cache"
        if fields["do_sample"]:
            filters = "".join(f", `{name}={fields[name]}`" for name in ("top_p", "top_k") if fields[name] is not None)
            sampling = f"sampling at temperature {fields['temperature']}{filters}"
        else:
            sampling = "greedy"
        one_block = fields["block_length"] >= fields["max_new_tokens"]
        blocks = "the whole answer as one block" if one_block else f"in blocks of {fields['block_length']}"
        if threshold is not None and fields["use_cache"] and fields["dual_cache"] and not fields["do_sample"]:
            setting = ": the fast setting of Fast-dLLM"
        elif threshold is None and factor is None and not fields["use_cache"] and one_block:
            setting = ": Dream's own sampler, as its `diffusion_generate()`"
        else:
            setting = ""
        return f"{rule} with {cache}, {sampling}, {blocks}{setting}"


DREAM = register_family(DreamFamily())

__all__ = ["DEFAULT_DREAM_ALG", "DREAM", "DREAM_ALGS", "DREAM_FIELDS", "DreamFamily", "validate_dream_fields"]
