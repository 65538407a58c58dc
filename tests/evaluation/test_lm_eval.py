"""lm-eval adapter (`hf_dllm.evaluation.lm_eval_model`) and LLaDA's Monte-Carlo log-likelihood (`hf_dllm.evaluation.likelihood`).

The estimator is checked against a direct, sample-by-sample computation and for its properties; the adapter runs
lm-eval's own `simple_evaluate` on the tiny local tasks of `tests/data/lm_eval_tasks`, offline.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hf_dllm.cli.completion_text import completion_text, stop_token_ids
from hf_dllm.evaluation.likelihood import draw_samples, greedy_matches, mc_loglikelihood, stratified_mask_counts
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer
from tests.conftest import FIXTURES, tiny_model
from tests.evaluation.eval_helpers import assert_responses_are, run_lm_eval
from tests.evaluation.test_evaluate import CHECKPOINT_SETTINGS, checkpoint_with_settings, direct_generation

TRAINED = FIXTURES / "llada-tiny-trained"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny trained checkpoint when it exists (with a tokenizer added if it lacks one), else a tiny random
    LLaDA saved with the character tokenizer."""
    if (TRAINED / "config.json").exists():
        if (TRAINED / "tokenizer.json").exists() or (TRAINED / "tokenizer_config.json").exists():
            return TRAINED
        path = tmp_path_factory.mktemp("trained") / "model"
        shutil.copytree(TRAINED, path)
    else:
        path = tmp_path_factory.mktemp("tiny") / "model"
        tiny_model(seed=0).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------- the estimator


def _requests(vocab: int, mask: int, lengths=((7, 3), (12, 1), (5, 6), (9, 4))):
    generator = torch.Generator().manual_seed(0)
    out = []
    for prompt_len, cont_len in lengths:
        ids = torch.randint(0, vocab, (prompt_len + cont_len,), generator=generator)
        ids[ids == mask] = (mask + 1) % vocab
        out.append((ids[:prompt_len].tolist(), ids[prompt_len:].tolist()))
    return out


def test_mask_counts_are_stratified():
    generator = torch.Generator().manual_seed(3)
    counts = stratified_mask_counts(length=5, num_samples=20, generator=generator)
    assert sorted(counts) == sorted(list(range(1, 6)) * 4)  # every count equally often
    samples = draw_samples([9, 9], [4, 5, 6, 7, 8], num_samples=10, mask_token_id=1, seed=0)
    for sample in samples:
        masked = [i for i, token in enumerate(sample.tokens[2:]) if token == 1]
        assert masked == sample.masked and len(masked) >= 1
        assert sample.weight == pytest.approx(5 / len(masked))
        assert sample.tokens[:2] == [9, 9]  # the prompt is never masked


def test_estimate_equals_sample_by_sample_computation(reference_model):
    """Batched, padded estimate == mean over the same samples of (L / l) * sum of masked cross-entropies,
    each computed alone."""
    mask = reference_model.generation_config.mask_token_id
    requests = _requests(reference_model.config.vocab_size, mask)
    estimates = mc_loglikelihood(reference_model, requests, num_samples=5, batch_size=7, seed=11)
    for index, (prompt, continuation) in enumerate(requests):
        total = 0.0
        for sample in draw_samples(prompt, continuation, 5, mask, seed=11, request=index):
            with torch.no_grad():
                logits = reference_model(torch.tensor([sample.tokens])).logits[0, len(prompt) :]
            log_probs = torch.log_softmax(logits.double(), dim=-1)
            total += sample.weight * -sum(log_probs[p, continuation[p]].item() for p in sample.masked)
        assert estimates[index] == pytest.approx(-total / 5, abs=1e-4)


def test_one_token_continuation_is_exact(reference_model):
    mask = reference_model.generation_config.mask_token_id
    prompt, token = [5, 17, 42, 99], 123
    estimate = mc_loglikelihood(reference_model, [(prompt, [token])], num_samples=3, batch_size=2)[0]
    with torch.no_grad():
        logits = reference_model(torch.tensor([prompt + [mask]])).logits[0, -1]
    assert estimate == pytest.approx(torch.log_softmax(logits.double(), -1)[token].item(), abs=1e-5)


def test_estimate_is_deterministic_and_batch_invariant(reference_model):
    requests = _requests(reference_model.config.vocab_size, reference_model.generation_config.mask_token_id)
    one = mc_loglikelihood(reference_model, requests, num_samples=6, batch_size=1, seed=5)
    again = mc_loglikelihood(reference_model, requests, num_samples=6, batch_size=64, seed=5)
    reordered = mc_loglikelihood(reference_model, requests[::-1], num_samples=6, batch_size=5, seed=5)[::-1]
    other_seed = mc_loglikelihood(reference_model, requests, num_samples=6, batch_size=64, seed=6)
    torch.testing.assert_close(torch.tensor(one), torch.tensor(again), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(one), torch.tensor(reordered), atol=1e-4, rtol=0)
    assert one != other_seed  # the multi-token requests draw other masks
    assert all(value <= 0 for value in one)


def test_greedy_continuation_scores_higher_than_random(reference_model):
    mask = reference_model.generation_config.mask_token_id
    prompt = [5, 17, 42, 99, 7, 64]
    greedy = reference_model.generate(
        torch.tensor([prompt]), max_new_tokens=6, block_length=6, steps=6, use_cache=False, eos_early_stop=False
    )[0, len(prompt) :].tolist()
    generator = torch.Generator().manual_seed(1)
    randoms = [torch.randint(0, 300, (6,), generator=generator).tolist() for _ in range(3)]
    randoms = [[t if t != mask else t + 1 for t in r] for r in randoms]
    scores = mc_loglikelihood(reference_model, [(prompt, greedy)] + [(prompt, r) for r in randoms], num_samples=16)
    assert scores[0] > max(scores[1:])
    assert greedy_matches(reference_model, [(prompt, greedy), (prompt, randoms[0])]) == [True, False]


# ---------------------------------------------------------------------------------------------- lm-eval


@pytest.fixture(scope="module")
def lm_eval_module():
    pytest.importorskip("lm_eval")
    import hf_dllm.evaluation.lm_eval_model as module

    return module


def test_registered(lm_eval_module):
    from lm_eval.api.registry import get_model

    assert get_model("hf_dllm") is lm_eval_module.DiffusionEvalLM


class _Request:
    def __init__(self, *args):
        self.args = args


def test_adapter_methods(lm_eval_module, checkpoint):
    lm = lm_eval_module.DiffusionEvalLM(
        pretrained=str(checkpoint),
        dtype="float32",
        device="cpu",
        batch_size=3,
        mc_num=4,
        block_length=8,
        is_check_greedy=True,
    )
    with pytest.raises(ValueError, match="unknown model_args"):
        lm_eval_module.DiffusionEvalLM(pretrained=str(checkpoint), device="cpu", block_size=3)
    # `top_k` is a generation field (Dream's rules), refused for a model without them.
    with pytest.raises(ValueError, match="top_k"):
        lm_eval_module.DiffusionEvalLM(pretrained=str(checkpoint), device="cpu", top_k=3)

    # loglikelihood: the MC estimate of the encoded pair; empty continuation scores 0 and counts as greedy.
    context_ids, continuation_ids = lm._encode_pair("add 2+2 ", "4x")
    assert lm.tokenizer.decode(continuation_ids) == " 4x"  # the context's trailing space moved over
    (value, _), (empty, empty_greedy) = lm.loglikelihood([_Request("add 2+2 ", "4x"), _Request("abc", "")])
    expected = mc_loglikelihood(lm.model, [(context_ids, continuation_ids)], num_samples=4, seed=lm.seed)[0]
    assert value == pytest.approx(expected, abs=1e-5)
    assert (empty, empty_greedy) == (0.0, True)

    # is_check_greedy: the model's own one-token-per-step continuation is greedy.
    prompt = lm.tok_encode("copy abc")
    own = lm.model.generate(
        torch.tensor([prompt]), max_new_tokens=3, block_length=3, steps=3, use_cache=False, eos_early_stop=False
    )[0, len(prompt) :].tolist()
    if all(token not in lm.tokenizer.all_special_ids for token in own):
        text = lm.tokenizer.decode(own)
        if lm.tok_encode("copy abc" + text)[len(prompt) :] == own:
            assert lm.loglikelihood([_Request("copy abc", text)])[0][1] is True

    # loglikelihood_rolling: one window with the BOS token as context.
    (rolling,) = lm.loglikelihood_rolling([_Request("hello world")])
    tokens = lm.tok_encode("hello world", add_bos=False)
    expected = mc_loglikelihood(lm.model, [([lm._bos], tokens)], num_samples=4, seed=lm.seed)[0]
    assert rolling == pytest.approx(expected, abs=1e-5)

    # generate_until: until cuts the text, max_gen_toks sets the length, unknown options fail clearly.
    outputs = lm.generate_until(
        [_Request("add 1+2", {"until": ["\n"], "max_gen_toks": 8}), _Request("copy xy", {"max_gen_toks": 8})]
    )
    assert len(outputs) == 2 and all(isinstance(text, str) for text in outputs)
    assert "\n" not in outputs[0]
    with pytest.raises(ValueError, match="unknown generation_kwargs"):
        lm.generate_until([_Request("x", {"beam_width": 2})])


@pytest.fixture(scope="module")
def settings_checkpoint(checkpoint, tmp_path_factory) -> Path:
    return checkpoint_with_settings(checkpoint, tmp_path_factory.mktemp("lm-settings") / "model")


def test_settings_resolution_order(lm_eval_module, settings_checkpoint, monkeypatch):
    """A request's generation_kwargs > model_args > the checkpoint's generation_config.json > the library's
    defaults, resolved by the model's one resolver (lm-eval adds no length or rule of its own)."""
    lm = lm_eval_module.DiffusionEvalLM(pretrained=str(settings_checkpoint), device="cpu", dtype="float32")
    assert {name: getattr(lm.base_config, name) for name in CHECKPOINT_SETTINGS} == CHECKPOINT_SETTINGS

    def config(gen_kwargs, model=lm):
        return model.request_config(model._request_settings(gen_kwargs)[1])

    greedy = config({"until": ["\n"], "do_sample": False})  # lm-eval's greedy request: the checkpoint's settings
    assert (greedy.max_new_tokens, greedy.block_length, greedy.threshold, greedy.do_sample) == (24, 8, 0.9, False)
    assert config({"max_gen_toks": 8}).max_new_tokens == 8
    sampled = config({"temperature": 0.5})  # the resolver's temperature -> do_sample rule
    assert sampled.do_sample is True and sampled.temperature == 0.5
    assert config({"do_sample": False, "temperature": 0.0}).do_sample is False
    assert config({"do_sample": False, "temperature": 0.7}).temperature == 0.0  # greedy, as transformers does

    # model_args over the checkpoint; the request over model_args (its decoding rule replaces theirs); gen_length
    # in model_args is the user's canvas and beats a task's max_gen_toks.
    lm2 = lm_eval_module.DiffusionEvalLM(pretrained=lm.model, tokenizer=lm.tokenizer, block_length=4, gen_length=16)
    assert (lm2.base_config.block_length, lm2.base_config.max_new_tokens, lm2.base_config.threshold) == (4, 16, 0.9)
    request = config({"max_gen_toks": 8, "block_length": 8, "steps": 16}, lm2)
    assert (request.block_length, request.max_new_tokens, request.steps, request.threshold) == (8, 16, 16, None)
    assert config({"threshold": None}, lm2).threshold is None

    # Bad values: a ValueError naming the setting, before any forward.
    monkeypatch.setattr(lm.model, "generate_blocks", lambda *a, **k: pytest.fail("generated before validating"))
    with pytest.raises(ValueError, match="threshold"):
        lm.generate_until([_Request("x", {"until": []}), _Request("y", {"threshold": 2.0})])
    with pytest.raises(ValueError, match="until"):
        lm.generate_until([_Request("x", {"until": [3]})])
    with pytest.raises(ValueError, match="gen_length"):
        lm_eval_module.DiffusionEvalLM(pretrained=lm.model, tokenizer=lm.tokenizer, gen_length=8, max_new_tokens=16)


def test_loading_model_args_are_the_shared_loader(lm_eval_module, settings_checkpoint, tmp_path):
    """model_args map onto `hf_dllm.cli.loading.load_model`: same names, same errors as `hf-dllm eval`'s flags."""
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        lm_eval_module.DiffusionEvalLM(pretrained=str(tmp_path / "missing"), device="cpu")
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, float16, float32"):
        lm_eval_module.DiffusionEvalLM(pretrained=str(settings_checkpoint), device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        lm_eval_module.DiffusionEvalLM(pretrained=str(settings_checkpoint), device="cpu", threads=0)
    try:
        lm = lm_eval_module.DiffusionEvalLM(pretrained=str(settings_checkpoint), device="cpu", threads=2)
        assert torch.get_num_threads() == 2 and lm.model.dtype == torch.float32
    finally:
        torch.set_num_threads(1)


def test_lm_eval_without_settings_generates_as_the_checkpoint(lm_eval_module, settings_checkpoint):
    """No generation setting anywhere (a task without max_gen_toks, no model_args): each response is exactly the
    text of `model.generate(prompt)` with the checkpoint's generation_config.json, cut at the task's `until`."""
    from transformers import AutoTokenizer

    results = run_lm_eval(settings_checkpoint, "dtype=float32", ["hf_dllm_tiny_gen_defaults"], batch_size=2, limit=4)
    tokenizer = AutoTokenizer.from_pretrained(settings_checkpoint)
    samples = results["samples"]["hf_dllm_tiny_gen_defaults"]
    assert len(samples) == 4

    def expected(ids, gen_kwargs):
        assert "max_gen_toks" not in gen_kwargs
        return direct_generation(settings_checkpoint, ids, gen_kwargs["until"])[0]

    assert_responses_are(samples, tokenizer, expected)


@pytest.mark.skipif(not (TRAINED / "config.json").exists(), reason="needs the tiny trained checkpoint")
def test_model_args_decoding_rule_replaces_the_checkpoint_default(lm_eval_module):
    """model_args are merged as generate() merges kwargs: `steps` replaces the checkpoint's default threshold 0.9
    instead of contradicting it, and naming two rules at once is still an error."""
    lm = lm_eval_module.DiffusionEvalLM(pretrained=str(TRAINED), device="cpu", steps=8)
    assert lm.model.generation_config.threshold == 0.9
    assert (lm.base_config.steps, lm.base_config.threshold, lm.base_config.factor) == (8, None, None)
    with pytest.raises(ValueError, match="steps"):
        lm_eval_module.DiffusionEvalLM(pretrained=str(TRAINED), device="cpu", steps=8, threshold=0.5)


def test_simple_evaluate_on_local_tasks(lm_eval_module, checkpoint):
    """`simple_evaluate(model="hf_dllm")` runs both request types; generations equal direct generate() output
    cut at the task's stop sequences."""
    settings = "dtype=float32,block_length=8,threshold=0.9,mc_num=4"
    results = run_lm_eval(checkpoint, settings, ["hf_dllm_tiny_gen", "hf_dllm_tiny_mc"], batch_size=3, limit=4)
    assert 0.0 <= results["results"]["hf_dllm_tiny_gen"]["exact_match,none"] <= 1.0
    assert 0.0 <= results["results"]["hf_dllm_tiny_mc"]["acc,none"] <= 1.0
    for sample in results["samples"]["hf_dllm_tiny_mc"]:
        assert all(resp[0][0] <= 0 for resp in sample["resps"])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    stop_ids = stop_token_ids(model.generation_config, tokenizer)
    samples = results["samples"]["hf_dllm_tiny_gen"]
    assert len(samples) == 4

    def expected(ids, gen_kwargs):
        assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id  # chat template, one BOS
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=gen_kwargs["max_gen_toks"], block_length=8, threshold=0.9
        )
        return completion_text(tokenizer, out[0, len(ids) :].tolist(), stop_ids, gen_kwargs["until"])

    assert_responses_are(samples, tokenizer, expected)
