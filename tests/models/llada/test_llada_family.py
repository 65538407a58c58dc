"""LLaDA through the shared family tests (`tests/models/family_tester.py`)."""

from __future__ import annotations

import hf_dllm
from tests.conftest import REFERENCE_DIR, tiny_model
from tests.models.family_tester import FamilyTester


class TestLLaDAFamily(FamilyTester):
    family = "llada"
    model_class = hf_dllm.LLaDAModelLM
    config_class = hf_dllm.LLaDAConfig
    fixture = REFERENCE_DIR
    remote_code_head = ("configuration_llada.py", "modeling_llada.py", "family_llada.py", "llada_lean.py")
    tiny_model = staticmethod(tiny_model)
