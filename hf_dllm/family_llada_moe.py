"""The LLaDA-MoE family (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct, -Instruct-TD): a bidirectional masked
diffusion model with an OLMoE-style MoE body, decoded as LLaDA is (LLaDA's fixed schedule, Fast-dLLM's threshold
and factor rules, prefix / dual caches, classifier-free guidance).

Its Hub `config.json` says `model_type` "llada", as dense LLaDA's does: the registry tells them apart by
`architectures` (`LLaDAMoEModelLM`) and `auto_map` (`configuration_lladamoe.LLaDAConfig`), then by fields
(`num_experts`).

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from .family import FAST_GENERATION_DEFAULTS, register_family
from .family_llada import LLaDAFamily


class LLaDAMoEFamily(LLaDAFamily):
    name = "llada_moe"
    display_name = "LLaDA-MoE"
    checkpoints = "inclusionAI/LLaDA-MoE-7B-A1B-Base, LLaDA-MoE-7B-A1B-Instruct, LLaDA-MoE-7B-A1B-Instruct-TD"
    architectures = ("LLaDAMoEModelLM",)
    auto_map_configs = ("configuration_lladamoe.LLaDAConfig", "configuration_llada_moe.LLaDAMoEConfig")
    model_types = ("llada",)

    config_module, config_class = "configuration_llada_moe", "LLaDAMoEConfig"
    model_module, model_class = "modeling_llada_moe", "LLaDAMoEModelLM"
    own_remote_code_files = (
        "configuration_llada_moe.py",
        "modeling_llada_moe.py",
        "family_llada_moe.py",
        "family_llada.py",
        "triton_moe.py",
        "grouped_gemm.py",
    )
    generation_defaults = FAST_GENERATION_DEFAULTS
    context_length_field = "max_position_embeddings"
    eot_token = None  # the Hub tokenizer's end of turn is its EOS
    card_template = "template.md"
    generic_card = "generic-llada-moe"
    # As LLaDA2's (`family_llada2.py`): the `experts` list of Hub-named per-expert layers is not transformers'
    # fused `*.experts` module, so the list is skipped and its layers quantized one by one; the router (`mlp.gate`,
    # 64 x hidden) stays in the model's dtype, so FP8 does not change which experts run.
    fp8_modules_to_not_convert = ("lm_head", r".*\.experts$", r".*\.mlp\.gate$")

    def describes(self, config: dict) -> bool:
        return "num_experts" in config

    def vocabulary_size(self, model_config) -> int:
        return model_config.vocab_size  # no padded embedding, unlike dense LLaDA


LLADA_MOE = register_family(LLaDAMoEFamily())

__all__ = ["LLADA_MOE", "LLaDAMoEFamily"]
