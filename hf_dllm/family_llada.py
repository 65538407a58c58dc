"""The LLaDA family (GSAI-ML/LLaDA-8B-Base, -Instruct, LLaDA-1.5; arXiv:2502.09992): bidirectional attention, LLaDA's
fixed schedule or Fast-dLLM's threshold / factor rules (arXiv:2505.22618), prefix / dual caches, classifier-free
guidance.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from .family import FAST_GENERATION_DEFAULTS, Bidirectional, DiffusionFamily, fast_dllm_policy, register_family

EOT_TOKEN = "<|eot_id|>"


class LLaDAFamily(Bidirectional, DiffusionFamily):
    name = "llada"
    display_name = "LLaDA"
    checkpoints = "GSAI-ML/LLaDA-8B-Base, LLaDA-8B-Instruct, LLaDA-1.5"
    architectures = ("LLaDAModelLM",)
    auto_map_configs = ("configuration_llada.LLaDAConfig",)
    model_types = ("llada",)

    config_module, config_class = "configuration_llada", "LLaDAConfig"
    model_module, model_class = "modeling_llada", "LLaDAModelLM"
    own_remote_code_files = (
        "configuration_llada.py",
        "modeling_llada.py",
        "family_llada.py",
        "llada_lean.py",  # the blocks as pure functions: the CPU path
    )
    generation_defaults = FAST_GENERATION_DEFAULTS
    eot_token = EOT_TOKEN
    context_length_field = "max_sequence_length"  # LLaDA's config names it as OLMo does

    def vocabulary_size(self, model_config) -> int:
        return model_config.padded_vocab_size  # `embedding_size`, padded beyond the tokenizer's `vocab_size`

    def describes(self, config: dict) -> bool:
        # Dense LLaDA's config names its sizes as OLMo does (`d_model`, `n_layers`); LLaDA-MoE's Hub config has the
        # same `model_type` with transformers' names (`hidden_size`, `num_experts`).
        return "num_experts" not in config

    def unmasking_policy(self, config, model_config=None):
        return fast_dllm_policy(config)

    def describe_decoding(self, fields: dict) -> str:
        """The decoding `fields` (generation_config.json's) give, in words, for a model card."""
        threshold, factor, steps = fields["threshold"], fields["factor"], fields["steps"]
        if threshold is not None:
            rule = f"threshold decoding (`threshold={threshold}`)"
        elif factor is not None:
            rule = f"factor decoding (`factor={factor}`)"
        elif steps is not None:
            rule = f"LLaDA's fixed schedule (`steps={steps}` in all; `threshold=None`)"
        else:
            rule = "LLaDA's fixed schedule (one token per step; `threshold=None`)"
        cache = (
            ("the dual cache" if fields["dual_cache"] else "the prefix cache") if fields["use_cache"] else "no cache"
        )
        fast = threshold is not None and fields["use_cache"] and fields["dual_cache"] and not fields["do_sample"]
        sampling = "greedy" if not fields["do_sample"] else f"sampling at temperature {fields['temperature']}"
        setting = ": the fast setting of Fast-dLLM" if fast else ""
        return f"{rule} with {cache}, {sampling}, in blocks of {fields['block_length']}{setting}"


LLADA = register_family(LLaDAFamily())

__all__ = ["LLADA", "LLaDAFamily"]
