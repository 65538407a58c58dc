"""LLaDA-MoE through the applications: `hf-dllm export` (its family's files, config and card; the exported repo
loads and generates as remote code in a process without hf_dllm), the continuous-batching engine (rows equal
`generate()` alone) and the Monte-Carlo log-likelihood (as LLaDA's, on its own forward)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import hf_dllm
from hf_dllm.evaluation.likelihood import mc_loglikelihood
from hf_dllm.hub.export import export_checkpoint
from hf_dllm.hub.families import MODEL_FAMILIES
from hf_dllm.serving.engine import ContinuousBatcher
from tests.conftest import FIXTURES, generate_cases, run_without_hf_dllm, with_mask_id
from tests.serving.test_engine import assert_alone, drive, recorded_layouts, request

FIXTURE = FIXTURES / "lladamoe-tiny-ref"
MASK, EOS = 310, 301
FAMILY = MODEL_FAMILIES["llada_moe"]


@pytest.fixture(scope="module")
def model():
    return hf_dllm.LLaDAMoEModelLM.from_pretrained(FIXTURE).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("lladamoe-export") / "exported"
    src = with_mask_id(FIXTURE, tmp_path_factory.mktemp("lladamoe-src") / "src")
    export_checkpoint(src, dst, generation_defaults="fast", tokenizer=False)
    return dst


def cases() -> list[dict]:
    prompt = [[5, 17, 42, 99, 7, 3]]
    common = dict(max_new_tokens=16, block_length=8, mask_token_id=MASK, return_dict_in_generate=True)
    return [
        {"name": "steps", "input_ids": prompt, "kwargs": {**common, "steps": 8, "use_cache": False}},
        {"name": "dual", "input_ids": prompt, "kwargs": {**common, "threshold": 0.7}},
        {"name": "prefix", "input_ids": prompt, "kwargs": {**common, "threshold": 0.7, "dual_cache": False}},
        {"name": "cfg", "input_ids": prompt, "kwargs": {**common, "steps": 8, "cfg_scale": 1.5, "use_cache": False}},
        {
            "name": "padded",
            "input_ids": [[EOS, EOS, 5, 17, 42], [9, 8, 7, 6, 5]],
            "attention_mask": [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]],
            "kwargs": {**common, "threshold": 0.9},
        },
    ]


CHILD = r"""
from transformers import AutoConfig, AutoModel

record("no_hf_dllm", no_hf_dllm)
config = AutoConfig.from_pretrained(spec["repo"], trust_remote_code=True)
out["config_class"] = type(config).__name__
model = AutoModel.from_pretrained(spec["repo"], trust_remote_code=True).eval()
out["model"] = describe(model)
out["tokens"] = generate_cases(model, spec["cases"])
"""


def test_export_writes_the_family_config_and_card(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llada"  # the Hub's, kept: the family is told by architectures / auto_map
    card = (exported / "README.md").read_text()
    assert "the LLaDA-MoE model" in card and "`configuration_llada_moe.py`" in card
    assert "configuration_llada.py" not in card
    assert hf_dllm.family_for_config(config).name == "llada_moe"


@pytest.mark.slow
def test_exported_repo_generates_as_remote_code_without_hf_dllm(exported, model, tmp_path):
    result = run_without_hf_dllm(tmp_path, CHILD, {"repo": str(exported), "cases": cases()})
    assert result["no_hf_dllm"] and not result["errors"], result["errors"]
    assert result["config_class"] == "LLaDAMoEConfig"
    info = result["model"]
    assert info["class"] == "LLaDAMoEModelLM" and info["family"] == "llada_moe"
    assert info["class_module"].startswith("transformers_modules.")
    assert result["tokens"] == generate_cases(model, cases())


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_rows_equal_generate_alone(model, seed):
    rng = random.Random(seed)
    settings = [
        dict(max_new_tokens=16, block_length=8, steps=16),
        dict(max_new_tokens=16, block_length=8, threshold=0.7),
        dict(max_new_tokens=16, block_length=8, threshold=0.9, dual_cache=False),
        dict(max_new_tokens=16, block_length=8, factor=1.0),
    ]
    requests = [
        request(model, [rng.randrange(3, 300) for _ in range(rng.randrange(2, 12))], mask_token_id=MASK, **kw)
        for kw in settings
    ]
    drive(ContinuousBatcher(model, max_batch_size=3), requests, [rng.randrange(0, 3) for _ in requests])
    assert_alone(model, requests)


def test_engine_slices_of_bounded_refresh_equal_generate_alone(model, monkeypatch):
    """`max_refresh_positions` (`hf-dllm serve --max-refresh-positions`) cuts a bidirectional model's layouts into
    slices: a LLaDA-MoE layout of six canvases over 60 positions is decoded in several, each row `generate()` alone
    (routing per token: a row's experts do not depend on the rows it shares a forward with)."""
    layouts = recorded_layouts(monkeypatch)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    settings = dict(max_new_tokens=16, block_length=8, threshold=0.7, mask_token_id=MASK)
    requests = [request(model, prompt, **settings) for prompt in prompts]
    engine = ContinuousBatcher(model, max_batch_size=6, join_layout_min_rows=None, max_refresh_positions=60)
    boundaries = drive(engine, requests, [0, 0, 0, 0, 1, 1])
    assert len(layouts) > boundaries, "no layout was cut"
    assert_alone(model, requests)


def test_likelihood_runs_on_the_bidirectional_family(model):
    prompt, continuation = [5, 17, 42], [99]
    (estimate,) = mc_loglikelihood(model, [(prompt, continuation)], num_samples=1, mask_token_id=MASK)
    ids = torch.tensor([prompt + [MASK]])
    with torch.no_grad():
        expected = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)[continuation[0]]
    assert estimate == pytest.approx(float(expected), abs=1e-4)
