"""`hf-dllm eval` and the lm-eval adapter with a tiny LLaDA2.x (block-causal) model: predictions and NFE equal a
direct `generate()` per prompt with LLaDA2's arguments (`steps` with `threshold`, token editing); LLaDA's
Monte-Carlo log-likelihood refuses block-causal models with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_dllm.evaluation import evaluate
from hf_dllm.evaluation.likelihood import mc_loglikelihood
from tests.conftest import save_checkpoint
from tests.evaluation.eval_helpers import (
    assert_eval_equals_generate,
    assert_responses_are,
    eval_direct,
    load_checkpoint,
    run_lm_eval,
)
from tests.models.llada2.test_llada2_integration import tiny_llada2

# LLaDA2's rule: 8 steps over the call's blocks of 4 (2 or 3 of them for 8 tokens), each committing every position
# above 0.6 or its scheduled count.
SETTINGS = {"max_new_tokens": 8, "block_length": 4, "threshold": 0.6, "steps": 8}


@pytest.fixture(scope="module")
def llada2_checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tiny_llada2(seed=2), tmp_path_factory.mktemp("llada2-eval") / "model")


@pytest.fixture(scope="module")
def loaded(llada2_checkpoint):
    return load_checkpoint(llada2_checkpoint)


def test_hf_dllm_eval_runs_llada2(llada2_checkpoint, loaded, tmp_path):
    model, tokenizer = loaded
    options = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    args, summary = assert_eval_equals_generate(llada2_checkpoint, model, tokenizer, tmp_path, SETTINGS, options)
    assert summary["generation_config"]["steps"] == 8 and summary["generation_config"]["threshold"] == 0.6
    # The LLaDA2.1 fields are options too; a contradiction is refused before any work (exit 2).
    editing = [*args, "--output-dir", str(tmp_path / "edit"), "--max-new-tokens", "8", "--block-length"]
    editing += ["4", "--editing-threshold", "0.5", "--max-post-steps", "2", "--num-to-transfer", "2"]
    assert evaluate.main(editing) == 0
    config = json.loads((tmp_path / "edit" / "summary.json").read_text())["generation_config"]
    assert (config["editing_threshold"], config["max_post_steps"], config["num_to_transfer"]) == (0.5, 2, 2)
    assert evaluate.main([*editing, "--steps", "8"]) == 2


def test_lm_eval_runs_llada2(llada2_checkpoint, loaded):
    pytest.importorskip("lm_eval")
    from hf_dllm.evaluation.lm_eval_model import DiffusionEvalLM

    model, tokenizer = loaded
    settings = "dtype=float32,block_length=4,threshold=0.6,steps=8,gen_length=8"
    results = run_lm_eval(llada2_checkpoint, settings, ["hf_dllm_tiny_gen"], batch_size=3, limit=3)
    assert 0.0 <= results["results"]["hf_dllm_tiny_gen"]["exact_match,none"] <= 1.0
    samples = results["samples"]["hf_dllm_tiny_gen"]
    assert len(samples) == 3
    assert_responses_are(
        samples,
        tokenizer,
        lambda ids, gen_kwargs: eval_direct(model, tokenizer, ids, gen_kwargs["until"], **SETTINGS)[0],
    )

    # LLaDA2.1's editing fields in model_args; the log-likelihood estimator is LLaDA's only.
    lm = DiffusionEvalLM(pretrained=model, tokenizer=tokenizer, device="cpu", editing_threshold=0.5, max_post_steps=2)
    assert (lm.base_config.editing_threshold, lm.base_config.max_post_steps) == (0.5, 2)

    class Request:
        def __init__(self, *args):
            self.args = args

    (text,) = lm.generate_until([Request("copy ab", {"until": ["\n"], "max_gen_toks": 8, "block_length": 4})])
    ids = lm.tok_encode("copy ab")
    expected = eval_direct(
        model, tokenizer, ids, ["\n"], max_new_tokens=8, block_length=4, editing_threshold=0.5, max_post_steps=2
    )
    assert text == expected[0]
    with pytest.raises(NotImplementedError, match="block-causal"):
        lm.loglikelihood([Request("add 2+2 ", "4")])
    with pytest.raises(NotImplementedError, match="block-causal"):
        mc_loglikelihood(model, [([5, 6], [7])], num_samples=1)
