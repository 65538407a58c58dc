"""Decoding quality on the tiny trained LLaDA (tests/fixtures/llada-tiny-trained): real confidences, real answers.

The checkpoint is trained by `examples/train_tiny.py` on the synthetic tasks of `hf_dllm.tiny_model.tasks`; the
prompts here are the first 48 of its held-out set (16 per task, never seen in training). Each prompt is decoded
alone (batch size 1), so NFE is that prompt's own number of forwards. Greedy decoding, max_new_tokens 32,
block length 8. The full grid of settings is `benchmarks/bench_quality.py`.

What this model shows (`benchmarks/RESULTS.md`, "bench_quality.py"): threshold 0.9 with the dual cache stays within 2 points
of one token per step, whether the baseline decodes without a cache (Fast-dLLM's baseline, LLaDA's own sampler) or
with the same dual cache, with at most 40% of its forwards.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from hf_dllm.tiny_model import tasks as st
from tests.conftest import FIXTURES, ROOT, BackgroundJob

TRAINED_DIR = FIXTURES / "llada-tiny-trained"
N_PROMPTS = 48
MAX_NEW_TOKENS = 32


# --- synthetic tasks: answers and checking ----------------------------------------------------------------------


def test_solve_each_task():
    assert st.solve("copy", "kfjwe") == "kfjwe"
    assert st.solve("reverse", "kfjwe") == "ewjfk"
    assert st.solve("sort", "kfjwe") == "efjkw"
    assert st.solve("add", "482+93") == "575"
    with pytest.raises(ValueError, match="unknown task"):
        st.solve("multiply", "2+2")


def test_correct_answer_scores_and_wrong_answer_does_not():
    example = st.Example("reverse", "reverse kfjwe", "ewjfk")
    assert st.is_correct(example, "ewjfk<|eot_id|><|endoftext|><|endoftext|>")
    assert st.is_correct(example, "ewjfk<|endoftext|>")
    assert st.is_correct(example, " ewjfk\n<|eot_id|>")  # surrounding whitespace is ignored
    assert not st.is_correct(example, "ewjf<|eot_id|>")  # too short
    assert not st.is_correct(example, "ewjfkk<|eot_id|>")  # too long
    assert not st.is_correct(example, "kfjwe<|eot_id|>")  # wrong
    assert not st.is_correct(example, "<|mdm_mask|>ewjfk")  # undecoded position
    assert not st.is_correct(example, "<|eot_id|>ewjfk")  # answer after the end of the turn


def test_examples_are_deterministic_and_checkable():
    assert st.training_examples(50, seed=3) == st.training_examples(50, seed=3)
    assert st.training_examples(50, seed=3) != st.training_examples(50, seed=4)
    for example in st.training_examples(200) + st.heldout_examples(60):
        assert example.task in st.TASKS
        assert st.solve(example.task, example.prompt.split(" ", 1)[1]) == example.answer
        assert st.is_correct(example, example.answer + "<|eot_id|>")


def test_heldout_set_is_disjoint_from_training():
    heldout = {e.prompt for e in st.heldout_examples(st.HELDOUT_SIZE)}
    assert len(heldout) == st.HELDOUT_SIZE
    training = {e.prompt for e in st.training_examples(20_000)}
    assert not heldout & training
    assert not st.heldout_prompts() & training


def test_chat_formatting_and_response_layout(char_tokenizer):
    text = st.chat_prompt(char_tokenizer, "copy abc")
    assert text.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\ncopy abc<|eot_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = st.response_ids(char_tokenizer, "abc", 8)
    eot = char_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert ids == char_tokenizer("abc", add_special_tokens=False).input_ids + [eot] + [char_tokenizer.eos_token_id] * 4
    batch = st.encode_prompts(char_tokenizer, ["copy abc", "reverse abcdefgh"])
    assert batch["input_ids"].shape[0] == 2
    assert batch["attention_mask"][0, 0] == 0  # left padding


# --- the trained checkpoint -------------------------------------------------------------------------------------


def load_trained():
    """(model, tokenizer, examples, encoded prompts) of the trained checkpoint's first `N_PROMPTS` held-out prompts."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(TRAINED_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(TRAINED_DIR)
    examples = st.heldout_examples(N_PROMPTS)
    encoded = [st.encode_prompts(tokenizer, [e.prompt]) for e in examples]
    return model, tokenizer, examples, encoded


@pytest.fixture(scope="module")
def trained():
    if not (TRAINED_DIR / "model.safetensors").exists():
        pytest.skip("tests/fixtures/llada-tiny-trained is missing (python examples/train_tiny.py)")
    # Batch-1 decoding of a 0.7M-parameter model is dominated by per-op overhead: one thread is several times
    # faster than two on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_trained()
    torch.set_num_threads(threads)


def setting_key(block_length: int = 8, **kwargs) -> str:
    return repr((block_length, *sorted(kwargs.items())))


def decode(trained, block_length: int = 8, **kwargs) -> dict:
    """Answers, correctness and per-prompt NFE of one setting over the test prompts."""
    model, tokenizer, examples, encoded = trained
    answers, correct, nfe = [], [], []
    with torch.no_grad():
        for example, batch in zip(examples, encoded, strict=True):
            out = model.generate(
                **batch,
                max_new_tokens=MAX_NEW_TOKENS,
                block_length=block_length,
                return_dict_in_generate=True,
                **kwargs,
            )
            response = st.decode_responses(tokenizer, out.sequences, batch["input_ids"].shape[1])[0]
            answers.append(st.extract_answer(response))
            correct.append(st.is_correct(example, response))
            nfe.append(out.nfe)
    return {
        "answers": answers,
        "accuracy": sum(correct) / len(correct),
        "mean_nfe": sum(nfe) / len(nfe),
        "nfe": nfe,
    }


def decode_all(trained, block_length: int = 8, **kwargs) -> dict:
    """`decode` of one setting: from the background run when it decoded that setting, else here (memoized)."""
    key = setting_key(block_length, **kwargs)
    if key not in _RUNS:
        _RUNS.update(background_runs())
    if key not in _RUNS:
        _RUNS[key] = decode(trained, block_length, **kwargs)
    return _RUNS[key]


_RUNS: dict = {}


ONE_TOKEN_DUAL = dict(threshold=None, factor=None, use_cache=True, dual_cache=True)
ONE_TOKEN_NO_CACHE = dict(threshold=None, factor=None, use_cache=False)
THRESHOLD_09_DUAL = dict(threshold=0.9, factor=None, use_cache=True, dual_cache=True)


# Every setting the tests below decode (48 prompts each, batch 1: most of this file's time), decoded in two
# subprocesses started at collection beside the in-process tests, which use one of the two cores; the tests only
# wait for the results. Both are forked from one process that imported this module (`preload`).
SETTINGS = [
    [
        dict(eos_early_stop=False, **ONE_TOKEN_NO_CACHE),
        dict(eos_early_stop=True, **ONE_TOKEN_NO_CACHE),
        dict(eos_early_stop=True, threshold=0.9, factor=None, use_cache=False),
        dict(block_length=32, **ONE_TOKEN_DUAL),
        dict(block_length=32, **THRESHOLD_09_DUAL),
    ],
    [
        dict(eos_early_stop=False, **ONE_TOKEN_DUAL),
        dict(eos_early_stop=True, **ONE_TOKEN_DUAL),
        dict(eos_early_stop=False, **THRESHOLD_09_DUAL),
        dict(eos_early_stop=True, **THRESHOLD_09_DUAL),
        *(dict(block_length=32, threshold=None, factor=f, use_cache=True, dual_cache=True) for f in (0.5, 1.0, 2.0)),
    ],
]
DECODE_SCRIPT = """
import json, sys
import torch
from tests.generation.test_quality import SETTINGS, decode, load_trained, setting_key
torch.set_num_threads(1)
trained = load_trained()
runs = {setting_key(**s): decode(trained, **s) for s in SETTINGS[int(sys.argv[1])]}
print(json.dumps(runs))
"""
DECODE_RUN = BackgroundJob(
    lambda _workdir: {str(i): [sys.executable, "-c", DECODE_SCRIPT, str(i)] for i in range(len(SETTINGS))},
    timeout=600,
    when=lambda: (TRAINED_DIR / "model.safetensors").exists(),
    preload=("torch", "hf_dllm", "tests.generation.test_quality"),
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"),
)


def background_runs() -> dict:
    runs = {}
    for done in DECODE_RUN.results().values():
        assert done.returncode == 0, done.stderr[-3000:]
        runs.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def test_checkpoint_format_and_generation_config(trained):
    model, tokenizer, _, _ = trained
    config = model.config
    assert config.model_type == "llada"
    assert config.vocab_size == len(tokenizer) == 103
    assert config.mask_token_id == tokenizer.mask_token_id
    gen = model.generation_config
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert gen.mask_token_id == tokenizer.mask_token_id
    assert gen.eot_token_id == eot
    assert gen.eos_token_ids[0] == tokenizer.eos_token_id and eot in gen.eos_token_ids
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


@DECODE_RUN.used_by
def test_one_token_per_step_is_accurate(trained):
    """The model really solves the held-out tasks: sequential decoding is (nearly) always right."""
    assert decode_all(trained, eos_early_stop=True, **ONE_TOKEN_NO_CACHE)["accuracy"] >= 0.95
    assert decode_all(trained, eos_early_stop=True, **ONE_TOKEN_DUAL)["accuracy"] >= 0.95


@pytest.mark.parametrize("eos_early_stop", [False, True], ids=["full", "eos-early-stop"])
@pytest.mark.parametrize("baseline", [ONE_TOKEN_NO_CACHE, ONE_TOKEN_DUAL], ids=["vs-no-cache", "vs-dual-cache"])
@DECODE_RUN.used_by
def test_threshold_09_dual_cache_keeps_accuracy_with_few_forwards(trained, baseline, eos_early_stop):
    """Fast-dLLM's claim (arXiv:2505.22618, Sec. 4): threshold 0.9 with the dual cache within 2 points of one token
    per step, with at most 40% of its forwards."""
    base = decode_all(trained, eos_early_stop=eos_early_stop, **baseline)
    fast = decode_all(trained, eos_early_stop=eos_early_stop, **THRESHOLD_09_DUAL)
    assert fast["accuracy"] >= base["accuracy"] - 0.02, (fast["accuracy"], base["accuracy"])
    assert fast["mean_nfe"] <= 0.4 * base["mean_nfe"], (fast["mean_nfe"], base["mean_nfe"])


@DECODE_RUN.used_by
def test_threshold_09_without_cache_matches_one_token_per_step(trained):
    """Parallel unmasking at 0.9 costs no accuracy by itself (no cache on either side)."""
    base = decode_all(trained, eos_early_stop=True, **ONE_TOKEN_NO_CACHE)
    fast = decode_all(trained, eos_early_stop=True, threshold=0.9, factor=None, use_cache=False)
    assert fast["accuracy"] >= base["accuracy"] - 0.02
    assert fast["mean_nfe"] <= 0.4 * base["mean_nfe"]


@pytest.mark.parametrize("setting", [ONE_TOKEN_DUAL, THRESHOLD_09_DUAL], ids=["one-token-per-step", "threshold-0.9"])
@DECODE_RUN.used_by
def test_eos_early_stop_lowers_nfe_and_changes_no_answer(trained, setting):
    full = decode_all(trained, eos_early_stop=False, **setting)
    early = decode_all(trained, eos_early_stop=True, **setting)
    assert early["answers"] == full["answers"]
    assert early["mean_nfe"] < full["mean_nfe"]
    assert all(e <= f for e, f in zip(early["nfe"], full["nfe"], strict=True))


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
@DECODE_RUN.used_by
def test_factor_decoding_nfe_between_threshold_and_one_token_per_step(trained, factor):
    """Fast-dLLM's factor rule (commit the n most confident tokens while (n + 1)(1 - c_n) < f) lies between
    threshold 0.9 and one token per step in forwards, in one block of 32 (Fast-dLLM's block length). In blocks of 8
    this model is so confident that every rule takes about one forward per block (`benchmarks/bench_quality.py`)."""
    base = decode_all(trained, block_length=32, **ONE_TOKEN_DUAL)
    threshold = decode_all(trained, block_length=32, **THRESHOLD_09_DUAL)
    fast = decode_all(trained, block_length=32, threshold=None, factor=factor, use_cache=True, dual_cache=True)
    assert threshold["mean_nfe"] <= fast["mean_nfe"] <= base["mean_nfe"], (
        threshold["mean_nfe"],
        fast["mean_nfe"],
        base["mean_nfe"],
    )
    assert fast["accuracy"] >= base["accuracy"] - 0.02


# --- the training script ----------------------------------------------------------------------------------------


def test_training_is_deterministic(tmp_path):
    """Two short runs of examples/train_tiny.py with the same seed give identical weights."""
    pytest.importorskip("datasets")
    pytest.importorskip("tqdm")
    import importlib.util

    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    small = [
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--d-model",
        "32",
        "--n-layers",
        "1",
        "--n-heads",
        "2",
        "--n-kv-heads",
        "1",
        "--mlp-hidden-size",
        "64",
        "--warmup",
        "1",
        "--eval",
        "0",
        "--no-progress",
    ]
    weights = []
    for name in ("a", "b"):
        out = train_tiny.train(train_tiny.parse_args(small + ["--output", str(tmp_path / name)]))
        weights.append(load_file(out / "model.safetensors"))
        assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=0, atol=0)
    other = train_tiny.train(train_tiny.parse_args(small + ["--seed", "1", "--output", str(tmp_path / "c")]))
    assert any(not torch.equal(weights[0][key], value) for key, value in load_file(other / "model.safetensors").items())
    # --embedding-size pads the embedding and the output head (as the Hub's LLaDA checkpoints pad theirs: 128 rows
    # let FP8 128 x 128 blocks take the head); fewer rows than the vocabulary are refused before training.
    padded = train_tiny.train(
        train_tiny.parse_args(small + ["--embedding-size", "128", "--output", str(tmp_path / "d")])
    )
    assert load_file(padded / "model.safetensors")["model.transformer.ff_out.weight"].shape == (128, 32)
    with pytest.raises(ValueError, match="embedding_size"):
        train_tiny.train(train_tiny.parse_args(small + ["--embedding-size", "50", "--output", str(tmp_path / "e")]))
    assert not (tmp_path / "e").exists()
