"""A request's generation field given as JSON `null` is that field set to None, as `generate(field=None)` sets it;
a field left out comes from the checkpoint's generation_config.json. `"threshold": null` therefore turns off the
tiny trained checkpoint's threshold rule (0.9), and the server decodes what `generate(threshold=None)` decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from hf_dllm.generation_config import GENERATION_FIELDS  # noqa: E402
from hf_dllm.generation_utils import DECODING_RULE_FIELDS  # noqa: E402
from hf_dllm.serving.protocol import DLLM_FIELDS, APIError, parse_generation_params  # noqa: E402
from hf_dllm.serving.server import create_app, load_model  # noqa: E402

TRAINED = next(p for p in Path(__file__).resolve().parents if p.name == "tests") / "fixtures" / "llada-tiny-trained"
# The nullable request fields of the schema: a None default (the rule or option is off).
NULLABLE = sorted(name for name in set(DLLM_FIELDS.values()) if GENERATION_FIELDS[name].default is None)


@pytest.fixture(scope="module")
def trained():
    model, tokenizer = load_model(str(TRAINED), dtype="float32", device="cpu")
    assert model.generation_config.threshold == 0.9  # what `null` must switch off
    return model, tokenizer


def test_the_nullable_fields_are_the_decoding_rules_and_editing():
    assert {"steps", "threshold", "factor", "editing_threshold"} <= set(NULLABLE)


@pytest.mark.parametrize("name", NULLABLE)
def test_null_is_none_as_in_generate(trained, name):
    model, _ = trained
    params = parse_generation_params({"prompt": "a", name: None}, model, chat=False)
    assert params.fields == {name: None}
    assert params.config == model.resolve_generation_config(**{name: None})
    assert getattr(params.config, name) is None
    # Naming a decoding rule (None too) replaces the checkpoint's threshold rule; other fields leave it.
    assert params.config.threshold == (None if name in DECODING_RULE_FIELDS else 0.9)


def test_null_for_a_field_without_none_is_a_400_naming_it(trained):
    model, _ = trained
    with pytest.raises(APIError) as error:
        parse_generation_params({"prompt": "a", "block_length": None}, model, chat=False)
    assert error.value.status == 400 and error.value.param == "block_length"


def test_threshold_null_request_matches_generate_threshold_none(trained):
    model, tokenizer = trained
    prompt = "12+7="
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    without_rule = model.generate(ids, threshold=None, return_dict_in_generate=True)
    with_rule = model.generate(ids, return_dict_in_generate=True)
    assert int(without_rule.nfe) > int(with_rule.nfe)  # one token per step costs more forwards than 0.9
    with TestClient(create_app(model, tokenizer, model_name="tiny")) as client:
        null = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "threshold": None}).json()
        absent = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt}).json()
    assert null["usage"]["nfe"] == int(without_rule.nfe_per_row[0])
    assert absent["usage"]["nfe"] == int(with_rule.nfe_per_row[0])
    tokens = without_rule.sequences[0, ids.shape[1] :].tolist()
    stops = [t for t in (0, 2) if t in tokens]
    end = min(tokens.index(t) for t in stops) if stops else len(tokens)
    assert null["choices"][0]["text"] == tokenizer.decode(tokens[:end], skip_special_tokens=True)


# Dream's own sampler fields (request fields of a Dream model), each set by the checkpoint here.
DREAM_CHECKPOINT = {"alg": "topk_margin", "alg_temp": 0.5, "top_p": 0.9, "top_k": 5}


@pytest.fixture(scope="module")
def dream():
    from transformers import AutoModel

    model = AutoModel.from_pretrained(TRAINED.parent / "dream-tiny-ref", dtype=torch.float32).eval()
    for name, value in DREAM_CHECKPOINT.items():
        setattr(model.generation_config, name, value)
    return model


@pytest.mark.parametrize("name", sorted(DREAM_CHECKPOINT))
def test_null_switches_off_a_dream_sampler_field(dream, name):
    assert GENERATION_FIELDS[name].default is None and name in dream.diffusion_family.own_generation_fields
    config = parse_generation_params({"prompt": "a", name: None}, dream, chat=False).config
    assert config == dream.resolve_generation_config(**{name: None})
    assert {field: getattr(config, field) for field in DREAM_CHECKPOINT} == {**DREAM_CHECKPOINT, name: None}
