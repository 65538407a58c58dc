"""The LLaDA2.x family (inclusionAI/LLaDA2.0-mini, -flash, LLaDA2.1-mini, -flash; arXiv:2512.15745): block-causal
MoE models decoded as their reference `generate()` does: blocks aligned to absolute positions, LLaDA2.0's
scheduled threshold (`steps` combined with `threshold`), its in-block EOS stop, and LLaDA2.1's token editing.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from .family import FAST_GENERATION_DEFAULTS, BlockCausal, DiffusionFamily, register_family

# The unmasking rules (`decoding.py`, `levenshtein_editing.py`, which need torch) are imported where they are built:
# the family objects load without torch (`family.py`).


class LLaDA2Family(BlockCausal, DiffusionFamily):
    name = "llada2"
    display_name = "LLaDA2.x"
    checkpoints = "inclusionAI/LLaDA2.0-mini, LLaDA2.0-flash, LLaDA2.1-mini, LLaDA2.1-flash"
    architectures = ("LLaDA2MoeModelLM",)
    auto_map_configs = ("configuration_llada2_moe.LLaDA2MoeConfig",)
    model_types = ("llada2_moe",)

    config_module, config_class = "configuration_llada2_moe", "LLaDA2MoeConfig"
    model_module, model_class = "modeling_llada2_moe", "LLaDA2MoeModelLM"
    own_remote_code_files = (
        "configuration_llada2_moe.py",
        "modeling_llada2_moe.py",
        "family_llada2.py",
        "llada2_moe_layer.py",  # the router, the experts and the sparse MoE block
        "triton_moe.py",  # the MoE layer's fused kernels
        "grouped_gemm.py",  # the experts' grouped products with FP8 weights
        "levenshtein_editing.py",  # LLaDA2.2's editing rule
        "triton_levenshtein.py",  # its step as one Triton kernel
    )
    # The decoding of LLaDA2's reference `generate()` and model cards (threshold 0.95, one token per step at least,
    # blocks of 32, in-block EOS stop), greedy, with the exact KV cache.
    generation_defaults = {**FAST_GENERATION_DEFAULTS, "threshold": 0.95}
    card_template = "template-llada2.md"
    generic_card = "generic-llada2"
    # transformers replaces every module named `*.experts` with its fused `FP8Experts` (one 3D tensor per
    # projection), which LLaDA2's `experts` list of per-expert `{e}.{gate,up,down}_proj` layers (the Hub's names)
    # is not: the list itself is skipped, the layers in it are quantized one by one (as the Hub's pre-quantized MoE
    # checkpoints store them) and run stacked by `grouped_gemm.py`. Naming any module drops transformers' default
    # skips, hence the output head named again.
    fp8_modules_to_not_convert = ("lm_head", r".*\.experts$")
    supports_cfg = False  # the unconditional branch would need its own block-causal canvas

    def describes(self, config: dict) -> bool:
        return config.get("delete_token_id") is None and config.get("split_token_id") is None

    def validate(self, config) -> None:
        super().validate(config)
        if config.editing_threshold is not None:  # LLaDA2.1's token editing
            if config.steps is not None:
                raise ValueError("`steps` must be None with `editing_threshold`: `num_to_transfer` sets the pace.")
            if config.factor is not None:
                raise ValueError("`factor` cannot be combined with `editing_threshold`; use `threshold`.")

    def unmasking_policy(self, config, model_config=None):
        from .decoding import ConfidenceFactor, ScheduledThreshold, TokenEditing

        if config.factor is not None:
            return ConfidenceFactor(config.factor)
        if config.editing_threshold is not None:
            return TokenEditing(
                config.threshold, config.editing_threshold, config.num_to_transfer, config.max_post_steps
            )
        return ScheduledThreshold(config.threshold)

    def describe_decoding(self, fields: dict) -> str:
        """The decoding `fields` (generation_config.json's) give, in words, for a model card."""
        threshold, steps = fields["threshold"], fields["steps"]
        if fields["editing_threshold"] is not None:
            rule = (
                f"LLaDA2.1 token editing (`editing_threshold={fields['editing_threshold']}`, `threshold={threshold}`, "
                f"at least `num_to_transfer={fields['num_to_transfer']}` tokens per step)"
            )
        elif threshold is not None:
            schedule = "`steps=None`: at least one token per step" if steps is None else f"`steps={steps}`"
            rule = f"LLaDA2's threshold decoding (`threshold={threshold}`, {schedule})"
        elif steps is not None:
            rule = f"the schedule alone (`threshold=None`, the reference's threshold 1.0, `steps={steps}`)"
        else:
            rule = "one token per step (`threshold=None`, the reference's threshold 1.0)"
        cache = "" if fields["use_cache"] else ", without a cache"
        sampling = "greedy" if not fields["do_sample"] else f"sampling at temperature {fields['temperature']}"
        return f"{rule}{cache}, {sampling}, in blocks of {fields['block_length']}"


class LLaDA22Family(LLaDA2Family):
    """LLaDA2.2 (inclusionAI/LLaDA2.2-mini, -flash): LLaDA2's body and blocks, decoded with Levenshtein editing
    (`levenshtein_editing.py`, SGLang's `JointThresholdInDel`): mask-to-token and token-to-token edits plus the
    DELETE and SPLIT tokens its config names (`delete_token_id`, `split_token_id`), whether or not a call sets
    `editing_threshold` (unset: 0.0, SGLang's default, edit wherever the prediction differs). LLaDA2.0 / 2.1 rules
    would let DELETE / SPLIT ids through as text, so the settings that select them are refused."""

    name = "llada2.2"
    display_name = "LLaDA2.2"
    checkpoints = "inclusionAI/LLaDA2.2-mini, LLaDA2.2-flash"

    token_id_fields = (*LLaDA2Family.token_id_fields, "delete_token_id", "split_token_id")
    always_edits = True  # `max_post_steps` applies without `editing_threshold` (unset: 0.0)

    def describes(self, config: dict) -> bool:
        return config.get("delete_token_id") is not None and config.get("split_token_id") is not None

    def validate(self, config) -> None:
        from .levenshtein_editing import check_settings

        super().validate(config)
        check_settings(config)

    def unmasking_policy(self, config, model_config=None):
        from .levenshtein_editing import LevenshteinEditing

        editing = 0.0 if config.editing_threshold is None else config.editing_threshold
        return LevenshteinEditing(
            config.threshold,
            editing,
            config.max_post_steps,
            config.mask_token_id,
            model_config.delete_token_id,
            model_config.split_token_id,
        )

    def describe_decoding(self, fields: dict) -> str:
        editing = 0.0 if fields["editing_threshold"] is None else fields["editing_threshold"]
        rule = (
            f"LLaDA2.2 Levenshtein editing (`threshold={fields['threshold']}`, `editing_threshold={editing}`, "
            f"`max_post_steps={fields['max_post_steps']}`: tokens are also deleted and inserted)"
        )
        cache = "" if fields["use_cache"] else ", without a cache"
        return f"{rule}{cache}, greedy, in blocks of {fields['block_length']}"


LLADA2 = register_family(LLaDA2Family())
LLADA22 = register_family(LLaDA22Family())

__all__ = ["LLADA2", "LLADA22", "LLaDA22Family", "LLaDA2Family"]
