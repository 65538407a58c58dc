"""LLaDA-MoE through the shared family tests (`tests/models/family_tester.py`)."""

from __future__ import annotations

import hf_dllm
from tests.conftest import FIXTURES
from tests.models.family_tester import FamilyTester
from tests.models.llada_moe.test_llada_moe import random_config, random_model


def char_llada_moe(seed: int = 0) -> hf_dllm.LLaDAMoEModelLM:
    """A random LLaDA-MoE sized for the character tokenizer (vocabulary 103, mask 3, EOS/pad 0, BOS 1)."""
    config = random_config(vocab_size=103, mask_token_id=3, eos_token_id=0, pad_token_id=0, bos_token_id=1)
    return random_model(config, seed=seed)


class TestLLaDAMoEFamily(FamilyTester):
    family = "llada_moe"
    model_class = hf_dllm.LLaDAMoEModelLM
    config_class = hf_dllm.LLaDAMoEConfig
    fixture = FIXTURES / "lladamoe-tiny-ref"
    remote_code_head = (
        "configuration_llada_moe.py",
        "modeling_llada_moe.py",
        "family_llada_moe.py",
        "family_llada.py",
        "triton_moe.py",
        "grouped_gemm.py",
    )
    tiny_model = staticmethod(char_llada_moe)
    export_config_fields = {"mask_token_id": 310}  # the reference runs pass it to generate()
