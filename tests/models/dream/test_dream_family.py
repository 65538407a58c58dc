"""Dream through the shared family tests (`tests/models/family_tester.py`)."""

from __future__ import annotations

import hf_dllm
from tests.conftest import FIXTURES
from tests.models.dream.test_dream_generation import char_dream
from tests.models.family_tester import FamilyTester


class TestDreamFamily(FamilyTester):
    family = "dream"
    model_class = hf_dllm.DreamModel
    config_class = hf_dllm.DreamConfig
    fixture = FIXTURES / "dream-tiny-ref"
    remote_code_head = ("configuration_dream.py", "modeling_dream.py", "family_dream.py", "decoding_dream.py")
    unreached_file = "configuration_llada.py"
    other_card, other_card_family = "llada-8b-instruct", "LLaDA"
    attn_implementations = ("eager", "sdpa", "llada_triton")
    tiny_model = staticmethod(char_dream)
