"""LLaDA2.x through the shared family tests (`tests/models/family_tester.py`)."""

from __future__ import annotations

import torch

import hf_dllm
from tests.conftest import FIXTURES
from tests.models.family_tester import FamilyTester
from tests.models.llada2.test_llada2_integration import tiny_llada2


class TestLLaDA2Family(FamilyTester):
    family = "llada2"
    model_class = hf_dllm.LLaDA2MoeModelLM
    config_class = hf_dllm.LLaDA2MoeConfig
    fixture = FIXTURES / "llada2-tiny-ref"
    remote_code_head = (
        "configuration_llada2_moe.py",
        "modeling_llada2_moe.py",
        "family_llada2.py",
        "llada2_moe_layer.py",
        "triton_moe.py",
        "grouped_gemm.py",
        "levenshtein_editing.py",
        "triton_levenshtein.py",
    )
    unreached_file = "configuration_llada.py"
    export_config_fields = {"mask_token_id": 310}  # the reference runs pass it to generate()
    attn_implementations = ("eager", "sdpa", "llada_triton")
    tiny_model = staticmethod(tiny_llada2)

    def reference_inputs(self, expected):
        """The fixture's logits are the original code's under its block-causal mask (blocks of 8), given as a 4D
        boolean mask."""
        length = expected["logits.input_ids"].shape[1]
        return {
            "input_ids": expected["logits.input_ids"],
            "attention_mask": expected["logits.attention_mask"],
            "position_ids": torch.arange(length)[None],
        }
