"""`hf-dllm eval` and the lm-eval adapter with a tiny LLaDA-MoE (bidirectional, decoded as LLaDA): predictions and
NFE equal a direct `generate()` per prompt with LLaDA's decoding fields; lm-eval's generation and multiple-choice
tasks run, the log-likelihoods being LLaDA's Monte-Carlo estimate on the MoE's forward; the adapter's context is
the family's (`max_position_embeddings`), not dense LLaDA's `max_sequence_length`."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_dllm.evaluation.likelihood import mc_loglikelihood
from tests.conftest import save_checkpoint
from tests.evaluation.eval_helpers import (
    assert_eval_equals_generate,
    assert_responses_are,
    eval_direct,
    load_checkpoint,
    run_lm_eval,
)
from tests.models.llada_moe.test_llada_moe import random_config, random_model

# Fast-dLLM's threshold rule over blocks of 8 with the dual cache (LLaDA-MoE's default cache): at seed 1, 0.2
# commits the questions' 16 tokens in 9 to 15 forwards, so the rows of a padded batch end their blocks apart.
SETTINGS = {"max_new_tokens": 16, "block_length": 8, "threshold": 0.2}
CONTEXT = 96  # max_position_embeddings of the tiny model: prompts longer than it minus the canvas are cut


@pytest.fixture(scope="module")
def llada_moe_checkpoint(tmp_path_factory) -> Path:
    """A tiny random LLaDA-MoE for the character tokenizer (vocabulary 103, mask 3, EOS/pad 0, BOS 1) with a short
    context, saved with the tokenizer."""
    config = random_config(
        vocab_size=103, mask_token_id=3, eos_token_id=0, pad_token_id=0, bos_token_id=1, max_position_embeddings=CONTEXT
    )
    return save_checkpoint(random_model(config, seed=1), tmp_path_factory.mktemp("llada-moe-eval") / "model")


@pytest.fixture(scope="module")
def loaded(llada_moe_checkpoint):
    return load_checkpoint(llada_moe_checkpoint)


class Request:
    def __init__(self, *args):
        self.args = args


def test_hf_dllm_eval_runs_llada_moe(llada_moe_checkpoint, loaded, tmp_path):
    model, tokenizer = loaded
    assert type(model).__name__ == "LLaDAMoEModelLM"
    options = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    _, summary = assert_eval_equals_generate(llada_moe_checkpoint, model, tokenizer, tmp_path, SETTINGS, options)
    assert summary["generation_config"]["threshold"] == 0.2 and summary["generation_config"]["dual_cache"] is True
    # LLaDA's fixed schedule without a cache: another rule, other predictions and forwards, still generate()'s.
    fixed = {"max_new_tokens": 16, "block_length": 8, "steps": 8, "use_cache": False}
    options = ["--max-new-tokens=16", "--block-length=8", "--steps=8", "--no-use-cache"]
    (tmp_path / "fixed").mkdir()
    _, summary = assert_eval_equals_generate(llada_moe_checkpoint, model, tokenizer, tmp_path / "fixed", fixed, options)
    assert (summary["generation_config"]["steps"], summary["generation_config"]["use_cache"]) == (8, False)


def test_lm_eval_runs_llada_moe(llada_moe_checkpoint, loaded):
    pytest.importorskip("lm_eval")
    from hf_dllm.evaluation.lm_eval_model import DiffusionEvalLM

    model, tokenizer = loaded
    settings = "dtype=float32,block_length=8,threshold=0.2,mc_num=4"
    results = run_lm_eval(
        llada_moe_checkpoint, settings, ["hf_dllm_tiny_gen", "hf_dllm_tiny_mc"], batch_size=3, limit=3
    )
    assert 0.0 <= results["results"]["hf_dllm_tiny_gen"]["exact_match,none"] <= 1.0
    assert 0.0 <= results["results"]["hf_dllm_tiny_mc"]["acc,none"] <= 1.0
    samples = results["samples"]["hf_dllm_tiny_gen"]
    assert len(samples) == 3
    assert_responses_are(
        samples,
        tokenizer,
        lambda ids, gen_kwargs: eval_direct(
            model, tokenizer, ids, gen_kwargs["until"], **{**SETTINGS, "max_new_tokens": gen_kwargs["max_gen_toks"]}
        )[0],
    )
    # Each choice's score is the Monte-Carlo estimate (4 samples, the adapter's seed) of its encoded pair.
    lm = DiffusionEvalLM(pretrained=model, tokenizer=tokenizer, device="cpu", mc_num=4)
    choices = results["samples"]["hf_dllm_tiny_mc"]
    assert len(choices) == 3
    for sample in choices:
        pairs = [lm._encode_pair(*arguments) for arguments in sample["arguments"]]
        expected = mc_loglikelihood(model, pairs, num_samples=4, seed=lm.seed, mask_token_id=3)
        assert [resp[0][0] for resp in sample["resps"]] == pytest.approx(expected, abs=1e-5)
        assert all(value < 0 for value in expected)


def test_lm_eval_adapter_cuts_prompts_to_the_family_context(loaded):
    """LLaDA-MoE's context is `max_position_embeddings` (the family's `context_length`): a prompt that leaves no
    room for the canvas is cut to its last `context - max_new_tokens` tokens for generation, and a log-likelihood
    pair to its last `context` tokens. (The adapter used to read dense LLaDA's `max_sequence_length`, absent here, and so assumed
    4096 positions: generate() refused the 112 positions of such a prompt.)"""
    pytest.importorskip("lm_eval")
    from hf_dllm.evaluation.lm_eval_model import DiffusionEvalLM

    model, tokenizer = loaded
    lm = DiffusionEvalLM(pretrained=model, tokenizer=tokenizer, device="cpu", mc_num=2, **SETTINGS)
    assert lm.max_length == CONTEXT
    context = "add 12+34 and then " * 5  # 95 characters: 96 tokens with the BOS
    ids = lm.tok_encode(context)
    assert len(ids) + SETTINGS["max_new_tokens"] > CONTEXT
    (text,) = lm.generate_until([Request(context, {"until": ["\n"]})])
    assert text == eval_direct(model, tokenizer, ids[-(CONTEXT - 16) :], ["\n"], **SETTINGS)[0]
    ((value, _),) = lm.loglikelihood([Request(context, " 46")])
    prompt, continuation = lm._encode_pair(context, " 46")
    kept = (prompt[-(CONTEXT - len(continuation)) :], continuation)
    assert value == pytest.approx(mc_loglikelihood(model, [kept], num_samples=2, seed=lm.seed, mask_token_id=3)[0])
    # model_args' max_length still overrides the config's.
    assert DiffusionEvalLM(pretrained=model, tokenizer=tokenizer, device="cpu", max_length=50).max_length == 50
