"""`hf-dllm serve`, `hf-dllm eval` and the lm-eval adapter with a tiny Dream model: what a request (or an evaluated
prompt) gets is exactly what a direct `generate()` gives it, with the checkpoint's generation_config.json when it
names nothing; Dream's sampler fields (`alg`, `alg_temp`, `top_p`, `top_k`, `eps`) are request fields, eval options
and lm-eval model_args for Dream and refused for LLaDA; streaming, batching of prompts of different lengths and
`usage.nfe` work as for LLaDA. The server runs in this process on 127.0.0.1 (see tests/serving/test_serve.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# The serve extra (fastapi, uvicorn): importing tests.serving.test_serve skips this module without it.
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hf_dllm import DiffusionGenerationConfig  # noqa: E402
from hf_dllm.evaluation import evaluate  # noqa: E402
from hf_dllm.serving.protocol import APIError, parse_generation_params, sampler_fields  # noqa: E402
from tests.conftest import save_checkpoint, tiny_model  # noqa: E402
from tests.evaluation.eval_helpers import (  # noqa: E402
    assert_eval_equals_generate,
    assert_responses_are,
    chat_prompt_ids,
    eval_direct,
    load_checkpoint,
    run_lm_eval,
)
from tests.models.dream.test_dream_generation import char_dream  # noqa: E402
from tests.serving.test_serve import (  # noqa: E402
    MODEL_NAME,
    assert_chat_and_its_stream_equal,
    assert_concurrent_requests_exact,
    assert_error,
    assert_streamed_completion_equals,
    chat_ids,
    direct,
    prompt_ids,
    serving,
)

DREAM_FIELDS = ("alg", "alg_temp", "top_p", "top_k", "eps")
# The checkpoint's own settings, each unlike DiffusionGenerationConfig's defaults: Dream's own sampler (one block of
# 24 positions, no cache, every position decoded) with the top-k margin on 12 steps.
CHECKPOINT_SETTINGS = dict(
    max_new_tokens=24, block_length=24, steps=12, alg="topk_margin", use_cache=False, eos_early_stop=False
)


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory) -> Path:
    """A tiny random Dream with the character tokenizer and a generation_config.json of its own."""
    model = char_dream(seed=3)
    ids = {name: getattr(model.generation_config, name) for name in ("mask_token_id", "eos_token_id", "pad_token_id")}
    model.generation_config = DiffusionGenerationConfig(**CHECKPOINT_SETTINGS, **ids, bos_token_id=1)
    return save_checkpoint(model, tmp_path_factory.mktemp("dream-tiny-random"))


server = serving("dream_dir")


# --- hf-dllm serve ------------------------------------------------------------------------------------------------


def test_request_without_dllm_fields_is_generate_without_kwargs(server, client):
    """No dLLM field, no max_tokens: the checkpoint's settings, exactly `model.generate(prompt)`."""
    ids = prompt_ids(server, "The cat sat")
    tokens = server.model.generate(torch.tensor([ids]))[0, len(ids) :].tolist()
    assert len(tokens) == CHECKPOINT_SETTINGS["max_new_tokens"]
    stops = server.app.state.server.batcher.stop_token_ids
    end = next((i for i, token in enumerate(tokens) if token in stops), len(tokens))
    out = client.completions.create(model=MODEL_NAME, prompt="The cat sat")
    assert out.choices[0].text == server.tokenizer.decode(tokens[:end], skip_special_tokens=True)
    assert out.usage.completion_tokens == end
    nfe = server.model.generate(torch.tensor([ids]), return_dict_in_generate=True).nfe
    assert out.usage.model_extra["nfe"] == out.choices[0].model_extra["nfe"] == nfe > 0


DREAM_REQUESTS = [
    {"alg": "maskgit_plus", "steps": 8, "block_length": 8},  # Dream's schedule in blocks, no cache (checkpoint's)
    {"alg": "entropy", "eps": 0.05, "steps": 6, "use_cache": True, "dual_cache": False},  # Fast-dLLM's prefix cache
    {"alg": "confidence_threshold", "threshold": 0.7, "block_length": 8, "use_cache": True},  # Fast-dLLM's dual
    {"alg": "topk_margin", "top_k": 5, "top_p": 0.8, "block_length": 8, "steps": 8},  # filters shape the confidence
    # A threshold replaces the checkpoint's rule, but not its alg="topk_margin": the request names the threshold's.
    {"alg": "confidence_threshold", "threshold": 0.6, "block_length": 8},
]


@pytest.mark.parametrize("extra", DREAM_REQUESTS, ids=lambda extra: ",".join(f"{k}={v}" for k, v in extra.items()))
def test_completion_with_dreams_fields_equals_generate(server, client, extra):
    prompt = "Once upon"
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=14, extra_body=extra)
    text, tokens, nfe, finish = direct(server, prompt_ids(server, prompt), 14, **extra)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason, out.usage.completion_tokens) == (text, finish, tokens)
    assert out.usage.model_extra["nfe"] == nfe > 0


def test_dreams_fields_are_resolved_for_dream_and_refused_for_llada(server):
    dream, llada = server.model, tiny_model(seed=0)
    assert sampler_fields(dream) == DREAM_FIELDS and sampler_fields(llada) == ()
    body = {"prompt": "a", "alg": "maskgit_plus", "alg_temp": 0.5, "top_p": 0.9, "top_k": 7, "eps": 0.01}
    params = parse_generation_params({**body, "temperature": 0.7}, dream, chat=False)
    config = params.config
    assert (config.alg, config.alg_temp, config.top_p, config.top_k, config.eps) == ("maskgit_plus", 0.5, 0.9, 7, 0.01)
    assert config.do_sample and config.steps == CHECKPOINT_SETTINGS["steps"]  # the rest: the checkpoint's
    assert params.fields == {k: v for k, v in body.items() if k != "prompt"} | {"temperature": 0.7}
    # OpenAI's neutral top_p is Dream's setting, passed on (a no-op at 1).
    assert parse_generation_params({"top_p": 1}, dream, chat=True).config.top_p == 1
    for fields, param, message in [
        ({"alg": "greedy"}, "alg", "`alg` must be None or one of"),
        ({"top_k": 0}, "top_k", "`top_k` must be None or a positive integer"),
        ({"top_p": 0}, "top_p", "`top_p` must be None or a number in (0, 1]"),
        ({"eps": 1.5}, "eps", "`eps` must be a number in (0, 1)"),
        ({"alg_temp": -1}, "alg_temp", "`alg_temp` must be None or a finite number >= 0"),
        ({"alg": "entropy", "threshold": 0.9}, "threshold", "contradicts `alg='entropy'`"),
        ({"threshold": 0.9}, "threshold", "contradicts `alg='topk_margin'`"),  # the checkpoint's alg
        ({"alg": "confidence_threshold"}, "alg", "needs `threshold`"),
        ({"minimal_topk": 2}, "minimal_topk", "only applies to block-causal models"),
        ({"cfg_scale": 1.0}, "cfg_scale", "not supported by Dream models"),
    ]:
        with pytest.raises(APIError) as error:
            parse_generation_params(fields, dream, chat=False)
        assert (error.value.status, error.value.param) == (400, param), fields
        assert message in error.value.message, (fields, error.value.message)
    # LLaDA has no such sampler: Dream's names are unknown request fields, and top_p keeps OpenAI's neutral value.
    for fields, param, message in [
        ({"alg": "entropy"}, "alg", "Unrecognized request argument supplied: alg"),
        ({"top_k": 5, "eps": 0.1}, "eps", "Unrecognized request argument supplied: eps, top_k"),
        ({"top_p": 0.9}, "top_p", "`top_p`=0.9 is not supported by this server"),
    ]:
        with pytest.raises(APIError) as error:
            parse_generation_params(fields, llada, chat=False)
        assert (error.value.status, error.value.param) == (400, param) and message in error.value.message
    assert parse_generation_params({"top_p": 1}, llada, chat=False).config.top_p is None


@pytest.mark.parametrize(
    "fields, param",
    [({"alg": "greedy"}, "alg"), ({"top_k": 2.5}, "top_k"), ({"eps": 0}, "eps"), ({"seed": 3}, "seed")],
    ids=lambda value: json.dumps(value) if isinstance(value, dict) else str(value),
)
def test_invalid_dream_fields_are_400(server, fields, param):
    body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 8, **fields}
    assert_error(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30), 400, param=param)


def test_a_rule_dream_lacks_is_refused_and_the_server_serves_on(server, client):
    """`remasking="random"` is LLaDA's: Dream's rules refuse it when the run starts (before any forward), which the
    client gets as a 400 naming it; other requests are served as before."""
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=8, extra_body={"remasking": "random"})
    assert "`remasking='random'` is LLaDA's" in error.value.message
    out = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=8)
    assert out.choices[0].text == direct(server, prompt_ids(server, "abc"), 8)[0]


def test_chat_and_streaming_equal_generate(server, client):
    messages = [{"role": "user", "content": "Tell me"}]
    extra = {"block_length": 4, "alg": "confidence_threshold", "threshold": 0.6, "use_cache": True}
    fields = {**extra, "eos_early_stop": True}  # a stop token ends the row after its block
    expected = direct(server, chat_ids(server, messages), 16, **fields)
    assert_chat_and_its_stream_equal(client, messages, 16, fields, expected, block_length=4)


def test_streamed_completion_equals_the_whole_one(server, client):
    prompt = "Once upon a time"
    expected = direct(server, prompt_ids(server, prompt), None)  # the checkpoint's settings
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected[0], expected[3])
    assert_streamed_completion_equals(client, prompt, expected)


def test_concurrent_requests_of_different_lengths_are_exact(server, client):
    """Two clients at once, prompts of 2 and 11 tokens: each gets exactly what it gets alone, whichever boundary it
    joined at (Dream's padding-aware positions)."""
    prompts = ["Hi", "The cat sat"]
    fields = {"block_length": 4, "alg": "entropy", "steps": 6}
    expected = [direct(server, prompt_ids(server, prompt), 12, **fields) for prompt in prompts]
    assert_concurrent_requests_exact(server, client, prompts, fields, expected)


# --- hf-dllm eval and lm-eval -------------------------------------------------------------------------------------

# Dream's sampler through the evaluators: the entropy rule on 6 steps in blocks of 4, Fast-dLLM's prefix cache.
EVAL_SETTINGS = {"max_new_tokens": 8, "block_length": 4, "steps": 6, "alg": "entropy", "eps": 0.01, "dual_cache": False}


@pytest.fixture(scope="module")
def loaded(dream_dir):
    return load_checkpoint(dream_dir)


def test_hf_dllm_eval_runs_dream(dream_dir, loaded, tmp_path):
    model, tokenizer = loaded
    options = [f"--{name.replace('_', '-')}={value}" for name, value in EVAL_SETTINGS.items() if name != "dual_cache"]
    options += ["--use-cache", "--no-dual-cache"]
    settings = {"use_cache": True, **EVAL_SETTINGS}
    args, summary = assert_eval_equals_generate(dream_dir, model, tokenizer, tmp_path, settings, options)
    config = summary["generation_config"]
    assert (config["alg"], config["eps"], config["steps"], config["dual_cache"]) == ("entropy", 0.01, 6, False)
    # No option: the checkpoint's settings (Dream's own sampler in one block of 24), as generate() without kwargs.
    assert evaluate.main([*args, "--output-dir", str(tmp_path / "plain"), "--limit", "2"]) == 0
    plain = [json.loads(line) for line in (tmp_path / "plain" / "predictions.jsonl").read_text().splitlines()]
    for record in plain:
        ids = chat_prompt_ids(tokenizer, record["prompt"])
        assert (record["prediction"], record["nfe"]) == eval_direct(model, tokenizer, ids)
    # Bad Dream settings are refused before any work (exit 2); an unknown alg by the option parser.
    assert evaluate.main([*args, "--output-dir", str(tmp_path / "bad"), "--alg", "entropy", "--threshold", "0.9"]) == 2
    with pytest.raises(SystemExit):
        evaluate.main([*args, "--alg", "greedy"])


def test_hf_dllm_eval_refuses_dreams_options_for_llada(model_dir, tmp_path, capsys):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n")
    args = [str(model_dir), "--dataset", str(dataset), "--output-dir", str(tmp_path / "out"), "--quiet"]
    assert evaluate.main([*args, "--top-k", "5"]) == 2
    assert "['top_k'] are settings of Dream's sampler, which LLaDA models do not use" in capsys.readouterr().err


def test_lm_eval_runs_dream(dream_dir, loaded):
    pytest.importorskip("lm_eval")
    model, tokenizer = loaded
    settings = "dtype=float32,block_length=4,steps=6,alg=topk_margin,top_k=9,gen_length=8"
    results = run_lm_eval(dream_dir, settings, ["hf_dllm_tiny_gen"], batch_size=3, limit=3)
    samples = results["samples"]["hf_dllm_tiny_gen"]
    assert len(samples) == 3
    kwargs = dict(max_new_tokens=8, block_length=4, steps=6, alg="topk_margin", top_k=9)
    assert_responses_are(
        samples, tokenizer, lambda ids, gen_kwargs: eval_direct(model, tokenizer, ids, gen_kwargs["until"], **kwargs)[0]
    )
    assert results["results"]["hf_dllm_tiny_gen"]["exact_match,none"] == pytest.approx(
        sum(sample["exact_match"] for sample in samples) / 3
    )

    # LLaDA's Monte-Carlo log-likelihood runs on Dream's shifted logits: with one continuation token and one
    # sample it is exact, the log-probability of the token read at the position before it.
    from hf_dllm.evaluation.lm_eval_model import DiffusionEvalLM

    lm = DiffusionEvalLM(pretrained=model, tokenizer=tokenizer, device="cpu", mc_num=1, alg="entropy")

    class Request:
        def __init__(self, *args):
            self.args = args

    [(score, _)] = lm.loglikelihood([Request("add 2+2 =", "4")])
    context, continuation = lm._encode_pair("add 2+2 =", "4")
    assert len(continuation) == 1
    masked = torch.tensor([context + [model.generation_config.mask_token_id]])
    with torch.no_grad():
        logits = model(masked).logits[0, len(context) - 1]
    assert score == pytest.approx(float(torch.log_softmax(logits.double(), -1)[continuation[0]]), abs=1e-5)
