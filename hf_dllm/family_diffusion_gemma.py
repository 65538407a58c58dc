"""The DiffusionGemma family (google/diffusiongemma-26B-A4B-it): encoder-decoder block diffusion. A causal encoder
writes the prompt and each accepted canvas into the K/V cache; a bidirectional decoder denoises the next canvas
(`canvas_length` tokens, from random tokens, not masks) with DiffusionGemma's sampler (`decoding_diffusion_gemma.py`:
entropy-bound acceptance, renoising, a linear temperature schedule, self-conditioning, a stable-and-confident stop).

Its sampler's settings are generation fields under transformers' names (`max_denoising_steps`, `sampler_config`,
`t_min`, `t_max`, `stability_threshold`, `confidence_threshold`), so a DiffusionGemma user's `generate()` call and
`generation_config.json` work unchanged; LLaDA's and Fast-dLLM's decoding fields (`steps`, `threshold`, `factor`,
`temperature`, `remasking`, ...) are refused.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .family import DiffusionFamily, register_family
from .generation_fields import GENERATION_FIELDS, GenerationField, finite, is_int, register_generation_fields

if TYPE_CHECKING:
    import torch

    from .block_plan import BlockPlan

# The sampler (`decoding_diffusion_gemma.py`, which needs torch) is imported where it is built: the family objects
# load without torch (`family.py`).

# transformers' global defaults (`DiffusionGemmaGenerationConfig._get_default_generation_params`), used where
# neither the call nor generation_config.json sets a field.
SAMPLER_DEFAULTS = {
    "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}

SAMPLER_CLASS = "EntropyBoundSamplerConfig"
# Fields a call may set to None: no temperature schedule (either of t_min / t_max: the logits as they are), no
# stable-and-confident stop (either threshold: every canvas takes `max_denoising_steps` steps).
OPTIONAL_SAMPLER_FIELDS = ("t_min", "t_max", "stability_threshold", "confidence_threshold")
_FIELDS = (
    GenerationField("max_denoising_steps", int, None, "DiffusionGemma: denoising steps per canvas at most (48)"),
    # transformers' `EntropyBoundSamplerConfig(entropy_bound=x)`, or its serialized dict; kept as that dict.
    GenerationField("sampler_config", dict, None, "DiffusionGemma: the sampler ({'entropy_bound': 0.1})", option=False),
    GenerationField("t_min", float, None, "DiffusionGemma: temperature at the last denoising step (0.4)"),
    GenerationField("t_max", float, None, "DiffusionGemma: temperature at the first denoising step (0.8)"),
    GenerationField("stability_threshold", int, None, "DiffusionGemma: steps the argmax must be unchanged (1)"),
    GenerationField("confidence_threshold", float, None, "DiffusionGemma: mean entropy below which a canvas stops"),
)
# Core fields of LLaDA / Fast-dLLM decoding that DiffusionGemma's sampler does not read: refused away from their
# defaults (a value there would be silently ignored).
FOREIGN_CORE_FIELDS = (
    "steps",
    "threshold",
    "factor",
    "temperature",
    "do_sample",
    "remasking",
    "cfg_scale",
    "minimal_topk",
    "editing_threshold",
    "max_post_steps",
    "num_to_transfer",
    "kv_cache_dtype",
    "logits_eos_inf",
    "confidence_eos_eot_inf",
    "eot_token_id",
)


def sampler_dict(value) -> dict | None:
    """`sampler_config` as transformers serializes it (`{"_cls_name": "EntropyBoundSamplerConfig",
    "entropy_bound": x}`), from that dict, a dict without `_cls_name`, or an `EntropyBoundSamplerConfig` object
    (transformers' or any with `entropy_bound`); `ValueError` otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict):
        if type(value).__name__ != SAMPLER_CLASS or not hasattr(value, "entropy_bound"):
            raise ValueError(
                f"`sampler_config` must be an EntropyBoundSamplerConfig (or its dict {{'entropy_bound': x}}), got "
                f"{type(value).__name__}."
            )
        value = {"entropy_bound": value.entropy_bound}
    name = value.get("_cls_name", SAMPLER_CLASS)
    extra = sorted(set(value) - {"_cls_name", "entropy_bound"})
    if name != SAMPLER_CLASS or extra or "entropy_bound" not in value:
        raise ValueError(
            f"`sampler_config` must be {SAMPLER_CLASS}(entropy_bound=x) (the only sampler), got {value!r}."
        )
    bound = value["entropy_bound"]
    if not finite(bound) or bound <= 0:
        raise ValueError(f"`sampler_config.entropy_bound` must be a finite number > 0, got {bound!r}.")
    return {"_cls_name": SAMPLER_CLASS, "entropy_bound": float(bound)}


def validate_diffusion_gemma_fields(config) -> None:
    """DiffusionGemma's fields (`ValueError` naming the field): their values (None: transformers' default) and
    `t_max > t_min`."""
    config.sampler_config = sampler_dict(config.sampler_config)
    steps = config.max_denoising_steps
    if steps is not None and (not is_int(steps) or not 0 < steps <= 1 << 20):
        raise ValueError(f"`max_denoising_steps` must be None or a positive integer, got {steps!r}.")
    for name in ("t_min", "t_max"):
        value = getattr(config, name)
        if value is not None and (not finite(value) or value < 0):
            raise ValueError(f"`{name}` must be None or a finite number >= 0, got {value!r}.")
    if config.t_min is not None and config.t_max is not None and not config.t_max > config.t_min:
        raise ValueError(
            f"`t_max` ({config.t_max}) must be greater than `t_min` ({config.t_min}): the schedule cools down."
        )
    if config.stability_threshold is not None and (
        not is_int(config.stability_threshold) or config.stability_threshold < 0
    ):
        raise ValueError(f"`stability_threshold` must be None or an integer >= 0, got {config.stability_threshold!r}.")
    confidence = config.confidence_threshold
    if confidence is not None and (not finite(confidence) or confidence <= 0):
        raise ValueError(f"`confidence_threshold` must be None or a finite number > 0, got {confidence!r}.")


DIFFUSION_GEMMA_FIELDS = register_generation_fields("DiffusionGemma", _FIELDS, validate_diffusion_gemma_fields)


class EncoderDecoderBlocks:
    """Topology of encoder-decoder block diffusion (DiffusionGemma): canvases start right after the prompts and are
    whole (`max_new_tokens` is rounded up to canvases); a causal encoder writes the committed columns' K/V once
    (exact, `EncoderPrefixCache`) and the decoder sees them and the canvas; positions are columns (left padding
    shifts a row's positions, as transformers does); an EOS ends its row and what follows it is padding."""

    topology = "encoder-decoder"
    # The encoder's K/V of committed columns are exact, but the serving engine keeps no row store of this cache
    # (sliding layers): it re-encodes a row's prefix at each block's first step, as for bidirectional models.
    committed_kv_exact = False
    scores_likelihood = False
    cut_after_first_eos = True
    # The canvas starts from the sampler's tokens, not from a mask token (`DiffusionFamily.masked_canvas`).
    masked_canvas = False

    def validate_topology(self, config) -> None:
        return None

    def plan(self, prompt_lengths: list[int], prompt_width: int, config, device) -> BlockPlan:
        from .block_plan import plan_bidirectional

        return plan_bidirectional(prompt_width, len(prompt_lengths), config, device)

    def lay_out(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, plan: BlockPlan, config):
        import torch

        batch, width = input_ids.shape
        device = input_ids.device
        x = torch.full((batch, plan.canvas_width), config.mask_token_id, dtype=torch.long, device=device)
        x[:, :width] = input_ids
        positions = torch.arange(plan.canvas_width, device=device).expand(batch, -1)
        if attention_mask is None:
            return x, None, positions
        generated = torch.ones(batch, plan.canvas_width - width, dtype=attention_mask.dtype, device=device)
        return x, torch.cat([attention_mask, generated], dim=1), positions

    def decoded_length(self, max_tokens: int, config) -> int:
        return -(-max_tokens // config.block_length) * config.block_length

    def forward_kwargs(self, config) -> dict:
        return {}

    def cache_policy(self, config):
        from .decoding_diffusion_gemma import EncoderPrefixCache

        return EncoderPrefixCache()

    def eos_ends_row(self, config) -> bool:
        return True

    def stops_inside_block(self, config, unmasking) -> bool:
        return False

    def fill_token_id(self, config) -> int:
        """What follows a row's first EOS, and its later canvases: padding (transformers' `pad_token_id`, which an
        EOS needs; without an EOS no row ends before the last canvas, and undecoded columns keep their mark)."""
        return config.pad_token_id if config.pad_token_id is not None else config.mask_token_id


class DiffusionGemmaFamily(EncoderDecoderBlocks, DiffusionFamily):
    name = "diffusion_gemma"
    display_name = "DiffusionGemma"
    checkpoints = "google/diffusiongemma-26B-A4B-it"
    architectures = ("DiffusionGemmaForBlockDiffusion",)
    auto_map_configs = ("configuration_diffusion_gemma.DiffusionGemmaConfig",)
    model_types = ("diffusion_gemma",)

    config_module, config_class = "configuration_diffusion_gemma", "DiffusionGemmaConfig"
    model_module, model_class = "modeling_diffusion_gemma", "DiffusionGemmaForBlockDiffusion"
    own_remote_code_files = (
        "configuration_diffusion_gemma.py",
        "modeling_diffusion_gemma.py",
        "family_diffusion_gemma.py",
        "decoding_diffusion_gemma.py",
        "triton_diffusion_gemma.py",
        "triton_moe.py",
        "grouped_gemm.py",
    )
    generation_defaults = {"max_new_tokens": 256, **{name: None for name in SAMPLER_DEFAULTS}}
    # Shared files its model never reaches (the masked-diffusion models' attention backends and packed rows):
    # transformers' remote-code loader downloads only what relative imports reach.
    unreached_shared_files = ("packed.py", "attention.py")

    @property
    def remote_code_files(self) -> tuple[str, ...]:
        return tuple(name for name in super().remote_code_files if name not in self.unreached_shared_files)

    supports_cfg = False
    # FP8 (`fp8.fp8_quantization_config`, `--quantization fp8`): attention, the dense MLP and the self-conditioning
    # MLP in FP8 (their products through `kernels.linear`). Kept in the model's dtype: the head (it is the input
    # embedding, tied), the router (the expert choice), and the experts' stacked 3D tensors (named, transformers
    # would swap the module for its `FP8Experts`, whose kernels it fetches from the Hub at the first call).
    fp8_modules_to_not_convert = ("lm_head", r".*\.router\.proj$", r".*\.experts$")
    original_defaults = {"max_new_tokens": 256}
    card_template = "template-diffusion-gemma.md"
    generic_card = "generic-diffusion-gemma"
    own_generation_fields = tuple(DIFFUSION_GEMMA_FIELDS)

    def validate(self, config) -> None:
        super().validate(config)
        foreign = [name for name in FOREIGN_CORE_FIELDS if getattr(config, name) != GENERATION_FIELDS[name].default]
        if foreign:
            raise ValueError(
                f"{foreign} are settings of LLaDA / Fast-dLLM decoding, which DiffusionGemma models do not use: leave "
                "them unset (this model's sampler reads max_denoising_steps, sampler_config, t_min, t_max, "
                "stability_threshold and confidence_threshold)."
            )

    # The composite config's own token ids (its text config's are checked through `check_token_ids`).
    token_id_fields = ("boi_token_id", "eoi_token_id", "image_token_id")

    def vocabulary_size(self, model_config) -> int:
        return model_config.text_config.vocab_size

    def check_token_ids(self, model_config, others: dict | None = None) -> None:
        """As `DiffusionFamily.check_token_ids`, over the text config's EOS / pad / BOS too; the generation
        settings' `mask_token_id` is left out: this family has no mask token, and its undecoded mark is
        `vocab_size` (outside the vocabulary on purpose)."""
        text = model_config.text_config
        fields = {
            f"text_config's `{name}`": getattr(text, name, None)
            for name in ("eos_token_id", "pad_token_id", "bos_token_id")
        }
        kept = {label: value for label, value in (others or {}).items() if "mask_token_id" not in label}
        super().check_token_ids(model_config, {**fields, **kept})

    def model_generation_defaults(self, model_config) -> dict:
        """A model's generation config before any generation_config.json: transformers' `max_new_tokens`, no EOS
        (transformers' `generate()` does not read the text config's), canvases of `canvas_length`."""
        return {
            "max_new_tokens": 256,
            "block_length": model_config.canvas_length,
            "mask_token_id": model_config.text_config.vocab_size,
            "eos_early_stop": False,
        }

    def complete(self, config, model_config, fields: dict):
        """The settings of a call on a model (after `resolve_generation_config`): canvases of the model's
        `canvas_length` (`block_length` may only repeat it), `max_new_tokens` rounded up to whole canvases,
        transformers' defaults for the sampler fields left unset, the placeholder of undecoded columns
        (`mask_token_id` = vocab size: never fed to the model), and the EOS rule (an EOS always ends its row, the
        rest of the row being `pad_token_id`: the text config's when the call sets none)."""
        canvas = model_config.canvas_length
        if "block_length" in fields and fields["block_length"] != canvas:
            raise ValueError(
                f"`block_length` is the model's `canvas_length` ({canvas}) for DiffusionGemma, got "
                f"{fields['block_length']!r}."
            )
        config.block_length = canvas
        config.max_new_tokens = -(-config.max_new_tokens // canvas) * canvas
        for name, default in SAMPLER_DEFAULTS.items():
            # A call that names None turns the schedule or the stopping rule off, as in transformers (where None in
            # generation_config.json means the default); the steps and the sampler cannot be off.
            if getattr(config, name) is None and not (name in OPTIONAL_SAMPLER_FIELDS and name in fields):
                setattr(config, name, dict(default) if isinstance(default, dict) else default)
        if config.t_min is not None and config.t_max is not None and config.t_max <= config.t_min:
            raise ValueError(f"`t_max` ({config.t_max}) must be greater than `t_min` ({config.t_min}).")
        config.mask_token_id = model_config.text_config.vocab_size
        has_eos = bool(config.eos_token_ids)
        if fields.get("eos_early_stop") is False and has_eos:
            raise ValueError(
                "`eos_early_stop=False`: DiffusionGemma always ends a row at its first EOS (transformers' rule)."
            )
        config.eos_early_stop = has_eos
        if has_eos and config.pad_token_id is None:
            # transformers would keep decoding an ended row's later canvases and show them; hf_dllm ends the row
            # and shows padding (the text config's), else its EOS.
            pad = model_config.text_config.pad_token_id
            config.pad_token_id = pad if pad is not None else config.eos_token_ids[0]
        return config

    def unmasking_policy(self, config, model_config=None):
        from .decoding_diffusion_gemma import EntropyBoundSampler

        return EntropyBoundSampler(
            vocab_size=model_config.text_config.vocab_size,
            max_denoising_steps=config.max_denoising_steps,
            entropy_bound=config.sampler_config["entropy_bound"],
            t_min=config.t_min,
            t_max=config.t_max,
            stability_threshold=config.stability_threshold,
            confidence_threshold=config.confidence_threshold,
            softcap=model_config.text_config.final_logit_softcapping,
        )

    def describe_decoding(self, fields: dict) -> str:
        """The decoding `fields` (generation_config.json's) give, in words, for a model card."""
        values = {
            name: fields.get(name) if fields.get(name) is not None else SAMPLER_DEFAULTS[name]
            for name in SAMPLER_DEFAULTS
        }
        return (
            f"DiffusionGemma's sampler: at most {values['max_denoising_steps']} denoising steps per canvas, entropy "
            f"bound {values['sampler_config']['entropy_bound']}, temperature {values['t_max']} -> {values['t_min']}, "
            f"stop when stable for {values['stability_threshold']} step(s) and mean entropy < "
            f"{values['confidence_threshold']}"
        )


DIFFUSION_GEMMA = register_family(DiffusionGemmaFamily())

__all__ = [
    "DIFFUSION_GEMMA",
    "SAMPLER_DEFAULTS",
    "DIFFUSION_GEMMA_FIELDS",
    "DiffusionGemmaFamily",
    "EncoderDecoderBlocks",
    "sampler_dict",
    "validate_diffusion_gemma_fields",
]
