"""`hf-dllm eval`: datasets loading, scoring, sharding, the end-to-end command, and its 2-process accelerate run.

Expected accuracies are known by construction: the dataset's answers are the model's own greedy outputs (computed
here with a direct `generate()` per prompt) for some rows and wrong for the others.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from hf_dllm.cli.completion_text import CompletionText, completion_text
from hf_dllm.evaluation import evaluate
from hf_dllm.evaluation.data import (
    answer_number,
    format_prompt,
    last_number,
    length_batches,
    load_examples,
    score,
    shard_batches,
)
from hf_dllm.generation_utils import DiffusionGenerationConfig
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer
from tests.conftest import DATA, FIXTURES, ROOT, BackgroundJob, tiny_model
from tests.evaluation.eval_helpers import eval_direct, load_checkpoint

TRAINED = FIXTURES / "llada-tiny-trained"
GENERATION = ["--max-new-tokens", "16", "--block-length", "8", "--steps", "8"]  # fixed schedule: NFE batch-invariant
# Keys of the summary that must not depend on the number of processes or on batching.
INVARIANT_KEYS = ("n", "correct", "accuracy", "generated_tokens", "mean_nfe", "tokens_per_forward", "generation_config")


def _random_digit_checkpoint(path: Path) -> Path:
    """A tiny random LLaDA saved with the character tokenizer, its digit logits scaled up so that its outputs mix
    digits and other characters (the `number` scorer then has numbers to find)."""
    tokenizer = build_char_tokenizer()
    model = tiny_model(seed=0)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    with torch.no_grad():
        model.get_output_embeddings().weight[digits] *= 1.5
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prepared_checkpoint(folder: Path) -> Path:
    """The tiny trained checkpoint when it exists (with a tokenizer added, in `folder`, if it lacks one), else the
    random one (in `folder`)."""
    if (TRAINED / "config.json").exists():
        if (TRAINED / "tokenizer.json").exists() or (TRAINED / "tokenizer_config.json").exists():
            return TRAINED
        shutil.copytree(TRAINED, folder)
        build_char_tokenizer().save_pretrained(folder)
        return folder
    return _random_digit_checkpoint(folder)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return prepared_checkpoint(tmp_path_factory.mktemp("checkpoint") / "model")


@pytest.fixture(scope="session")
def digit_checkpoint(tmp_path_factory) -> Path:
    """Always the random digit-heavy model: the trained one answers letter tasks and never writes a number."""
    return _random_digit_checkpoint(tmp_path_factory.mktemp("digits") / "model")


@pytest.fixture(scope="session")
def direct_predictions(checkpoint) -> list[dict]:
    return _direct_predictions(checkpoint)


@pytest.fixture(scope="session")
def digit_predictions(digit_checkpoint) -> list[dict]:
    return _direct_predictions(digit_checkpoint)


def _direct_predictions(checkpoint: Path) -> list[dict]:
    """For each question of tests/data/tiny_tasks.jsonl: the prediction and NFE of a direct generate() call on the
    chat-formatted prompt alone (batch 1, no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    config = model.generation_config
    stop = set(config.eos_token_ids) | {config.eot_token_id, tokenizer.eos_token_id}
    stop.add(tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    rows = []
    for line in (DATA / "tiny_tasks.jsonl").read_text().splitlines()[:8]:
        question = json.loads(line)["question"]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=16, block_length=8, steps=8, return_dict_in_generate=True)
        generated = out.sequences[0, ids.shape[1] :].tolist()
        cut = next((i for i, token in enumerate(generated) if token in stop), len(generated))
        prediction = tokenizer.decode(generated[:cut], skip_special_tokens=True)
        rows.append({"question": question, "prediction": prediction, "nfe": int(out.nfe_per_row[0])})
    return rows


# A checkpoint whose generation_config.json differs from the library's defaults (128 tokens, blocks of 32, one
# token per step): what `hf-dllm eval` / lm-eval use when no generation setting is given.
CHECKPOINT_SETTINGS = {"max_new_tokens": 24, "block_length": 8, "threshold": 0.9}


def checkpoint_with_settings(source: Path, destination: Path) -> Path:
    """A copy of `source` whose generation_config.json holds `CHECKPOINT_SETTINGS` (and a tokenizer)."""
    shutil.copytree(source, destination)
    if not (destination / "tokenizer_config.json").exists():
        build_char_tokenizer().save_pretrained(destination)
    config = json.loads((destination / "generation_config.json").read_text())
    config.update(CHECKPOINT_SETTINGS, steps=None, factor=None)
    (destination / "generation_config.json").write_text(json.dumps(config, indent=2))
    defaults = DiffusionGenerationConfig()
    assert all(getattr(defaults, name) != value for name, value in CHECKPOINT_SETTINGS.items())
    return destination


@pytest.fixture(scope="session")
def settings_checkpoint(checkpoint, tmp_path_factory) -> Path:
    return checkpoint_with_settings(checkpoint, tmp_path_factory.mktemp("settings") / "model")


def direct_generation(checkpoint: Path, ids: list[int], stops=(), **settings) -> tuple[str, int]:
    """(text, forwards of the row) of a plain `model.generate(prompt)`, cut by the shared completion text."""
    return eval_direct(*load_checkpoint(checkpoint), ids, stops, **settings)


def _chat_ids(checkpoint: Path, question: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _run(args: list[str]) -> dict:
    assert evaluate.main(args) == 0
    output = Path(args[args.index("--output-dir") + 1])
    predictions = [json.loads(line) for line in (output / "predictions.jsonl").read_text().splitlines()]
    return {"summary": json.loads((output / "summary.json").read_text()), "predictions": predictions}


def _run_eval(checkpoint: Path, dataset: Path, output: Path, *options: str) -> dict:
    """`_run` of `hf-dllm eval CHECKPOINT --dataset DATASET --dtype float32 --output-dir OUTPUT --quiet *options`."""
    source = [str(checkpoint), "--dataset", str(dataset), "--dtype", "float32"]
    return _run([*source, "--output-dir", str(output), "--quiet", *options])


# ---------------------------------------------------------------------------------------------- pieces


def test_scorers():
    assert score("  hello \n", "hello", "exact") and not score("hello!", "hello", "exact")
    assert last_number("so 3 apples, then 1,234.50 left") == "1234.50"
    assert last_number("no digits") is None
    assert answer_number("She has 5 + 7 = 12 apples.\n#### 12") == "12"
    assert score("The answer is 12.", "#### 12", "number")
    assert score("total: 1,234", "1234.0", "number")
    assert score("it is -3", "#### -3", "number")
    assert not score("12 or 13", "#### 12", "number")  # the last number counts
    assert not score("none", "#### 12", "number")
    with pytest.raises(ValueError, match="unknown scorer"):
        score("a", "a", "fuzzy")


def test_sharding_partitions_balances_and_keeps_batches_whole():
    lengths = [5, 1, 9, 3, 3, 7, 2, 8, 6, 4, 4]
    one_process = shard_batches(lengths, 2, rank=0, world_size=1)
    assert one_process == length_batches(range(len(lengths)), lengths, 2)
    flat = [i for batch in one_process for i in batch]
    assert [lengths[i] for i in flat] == sorted(lengths) and all(len(b) <= 2 for b in one_process)
    for world_size in (2, 3):
        shards = [shard_batches(lengths, 2, rank, world_size) for rank in range(world_size)]
        # Every batch of the one-process run goes, whole and unchanged, to exactly one process.
        assert sorted(b for shard in shards for b in shard) == sorted(one_process)
        sizes = [sum(lengths[i] for b in shard for i in b) for shard in shards]
        assert max(sizes) - min(sizes) <= 2 * max(lengths)


def test_shared_completion_text_cuts_at_stop_tokens_and_strings(char_tokenizer):
    """What the removed `cut_at_stops` / `decode_generated` did, now the shared `CompletionText`'s job: the text
    ends at the first stop token and at the first stop string, whichever comes first; a stop found in one block
    ends the completion (its later blocks are ignored)."""
    ids = char_tokenizer("abc\n\ndef.", add_special_tokens=False)["input_ids"]
    eos = char_tokenizer.eos_token_id
    assert completion_text(char_tokenizer, ids, {eos}, ["\n\n", "."]) == "abc"
    assert completion_text(char_tokenizer, ids, {eos}, ["."]) == "abc\n\ndef"
    assert completion_text(char_tokenizer, ids[:2] + [eos] + ids[2:], {eos}, ["."]) == "ab"
    completion = CompletionText(char_tokenizer, {eos}, ["d"])
    assert completion.extend(ids[:3]) is False and completion.text == "abc"
    assert completion.extend(ids[3:7]) is True and completion.text == "abc\n\n"
    assert completion.finish_reason == "stop" and completion.stop_string_found and completion.completion_tokens == 5
    assert completion.extend(ids[7:]) is True and completion.text == "abc\n\n"


def test_missing_local_dataset_is_file_not_found(checkpoint, tmp_path, capsys):
    """A local path that does not exist is reported as such, never sent to the Hub (a connection error)."""
    missing = tmp_path / "no" / "such.jsonl"
    for name in (str(missing), "./data.jsonl", "data/sub/tasks", "tasks.parquet"):
        with pytest.raises(FileNotFoundError, match="file not found") as error:
            load_examples(name)
        assert repr(name) in str(error.value)
    args = [str(checkpoint), "--dataset", str(missing), "--output-dir", str(tmp_path / "out")]
    assert evaluate.main(args) == 2
    err = capsys.readouterr().err
    assert "file not found" in err and str(missing) in err
    assert not (tmp_path / "out").exists()


def test_load_examples_local_formats(tmp_path):
    rows = load_examples(str(DATA / "tiny_tasks.jsonl"), limit=3)
    assert len(rows) == 3 and set(rows[0]) == {"question", "answer", "task"}
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "tiny.parquet"))
    assert load_examples(str(tmp_path / "tiny.parquet")) == rows
    assert (
        format_prompt(rows[0], "question", "Q: {question} ({task})") == f"Q: {rows[0]['question']} ({rows[0]['task']})"
    )
    with pytest.raises(ValueError, match="no field 'prompt'"):
        format_prompt(rows[0], "prompt")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown file type"):
        load_examples(str(tmp_path / "data.txt"))


def test_cli_reports_bad_arguments(checkpoint, tmp_path, capsys):
    dataset = str(DATA / "tiny_tasks.jsonl")
    assert (
        evaluate.main(
            [
                str(checkpoint),
                "--dataset",
                dataset,
                "--answer-field",
                "solution",
                "--limit",
                "2",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "no field 'solution'" in capsys.readouterr().err
    assert (
        evaluate.main(
            [str(checkpoint), "--dataset", dataset, "--threshold", "1.5", "--limit", "2", "--output-dir", str(tmp_path)]
        )
        == 2
    )
    assert "threshold" in capsys.readouterr().err
    # Loading flags are the shared ones (`hf_dllm.cli.loading`): same names, same errors.
    common = [str(checkpoint), "--dataset", dataset, "--limit", "2", "--output-dir", str(tmp_path)]
    assert evaluate.main([*common, "--dtype", "int8"]) == 2
    assert "--dtype must be one of auto, bfloat16, float16, float32" in capsys.readouterr().err
    assert evaluate.main([*common, "--threads", "0"]) == 2
    assert "--threads must be a positive integer" in capsys.readouterr().err
    common[0] = str(tmp_path / "no-model")
    assert evaluate.main(common) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err
    for flag in ("--revision", "--threads", "--device-map", "--attn-implementation", "--tokenizer"):
        assert flag in evaluate.build_parser().format_help()


def test_generation_options_threshold_none():
    """`--threshold none` names the field with the value None (no threshold rule), as `hf-dllm export` accepts it;
    a left-out option is absent (the checkpoint's value stays); a non-number is refused by the parser."""
    parser = evaluate.build_parser()
    base = ["MODEL", "--dataset", "d.jsonl"]
    assert evaluate.generation_kwargs(parser.parse_args(base)) == {}
    assert evaluate.generation_kwargs(parser.parse_args([*base, "--threshold", "none"])) == {"threshold": None}
    assert evaluate.generation_kwargs(parser.parse_args([*base, "--threshold", "0.7", "--steps", "None"])) == {
        "threshold": 0.7,
        "steps": None,
    }
    assert evaluate.generation_kwargs(parser.parse_args([*base, "--no-use-cache", "--gen-length", "8"])) == {
        "use_cache": False,
        "max_new_tokens": 8,
    }
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--threshold", "high"])
    # The FP8 K/V cache, as generate()'s kv_cache_dtype; other values are refused by the parser.
    assert evaluate.generation_kwargs(parser.parse_args([*base, "--kv-cache-dtype", "fp8"])) == {
        "kv_cache_dtype": "fp8"
    }
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--kv-cache-dtype", "fp16"])
    # The CPU thread count is a loading flag; by default torch's own (benchmarks/bench_threads.py: fastest here).
    assert parser.parse_args(base).threads is None and parser.parse_args([*base, "--threads", "2"]).threads == 2


# ---------------------------------------------------------------------------------------------- end to end


def test_eval_exact_scorer_matches_generate(checkpoint, direct_predictions, tmp_path):
    rows = [
        {"question": row["question"], "answer": row["prediction"] if i % 2 == 0 else row["prediction"] + "#"}
        for i, row in enumerate(direct_predictions)
    ]
    dataset = _write_jsonl(tmp_path / "exact.jsonl", rows)
    result = _run_eval(checkpoint, dataset, tmp_path / "out", "--scorer", "exact", "--batch-size", "3", *GENERATION)
    predictions, summary = result["predictions"], result["summary"]
    assert [p["index"] for p in predictions] == list(range(len(rows)))
    assert [p["prediction"] for p in predictions] == [row["prediction"] for row in direct_predictions]
    assert [p["correct"] for p in predictions] == [i % 2 == 0 for i in range(len(rows))]
    assert [p["nfe"] for p in predictions] == [row["nfe"] for row in direct_predictions]
    assert summary["n"] == len(rows) and summary["correct"] == (len(rows) + 1) // 2
    assert summary["accuracy"] == pytest.approx(((len(rows) + 1) // 2) / len(rows))
    assert summary["mean_nfe"] == pytest.approx(sum(row["nfe"] for row in direct_predictions) / len(rows))
    assert summary["tokens_per_forward"] == pytest.approx(
        summary["generated_tokens"] / sum(row["nfe"] for row in direct_predictions)
    )
    assert summary["tokens_per_second"] > 0 and summary["num_processes"] == 1
    assert summary["generation_config"]["steps"] == 8 and summary["generation_config"]["block_length"] == 8
    assert {"hf_dllm", "transformers", "torch"} <= set(summary["versions"])
    assert summary["settings"]["batch_size"] == 3 and summary["settings"]["chat_template"] is True


def test_eval_number_scorer(digit_checkpoint, digit_predictions, tmp_path):
    rows, expected = [], []
    for i, row in enumerate(digit_predictions):
        number = last_number(row["prediction"])
        if number is not None and i % 3 != 0:
            rows.append({"question": row["question"], "answer": f"work...\n#### {number}"})
            expected.append(True)
        else:  # a 17-digit number cannot appear in 16 generated characters
            rows.append({"question": row["question"], "answer": "#### 12345678901234567"})
            expected.append(False)
    assert any(expected) and not all(expected)  # both outcomes are exercised
    dataset = _write_jsonl(tmp_path / "number.jsonl", rows)
    result = _run_eval(
        digit_checkpoint, dataset, tmp_path / "out", "--scorer", "number", "--batch-size", "4", *GENERATION
    )
    assert [p["correct"] for p in result["predictions"]] == expected
    assert result["summary"]["accuracy"] == pytest.approx(sum(expected) / len(expected))


def test_eval_without_generation_flags_uses_the_checkpoint_settings(settings_checkpoint, tmp_path):
    """No generation flag: predictions and forwards are exactly those of `model.generate(prompt)` with the
    checkpoint's generation_config.json (24 tokens, blocks of 8, threshold 0.9), not the library's defaults."""
    questions = [json.loads(line)["question"] for line in (DATA / "tiny_tasks.jsonl").read_text().splitlines()[:5]]
    expected = [direct_generation(settings_checkpoint, _chat_ids(settings_checkpoint, q)) for q in questions]
    dataset = _write_jsonl(tmp_path / "data.jsonl", [{"question": q, "answer": "?"} for q in questions])
    result = _run(
        [str(settings_checkpoint), "--dataset", str(dataset), "--batch-size", "2", "--dtype", "float32"]
        + ["--output-dir", str(tmp_path / "out"), "--quiet"]
    )
    assert [(p["prediction"], p["nfe"]) for p in result["predictions"]] == expected
    config = result["summary"]["generation_config"]
    assert {name: config[name] for name in CHECKPOINT_SETTINGS} == CHECKPOINT_SETTINGS
    assert config["steps"] is None and config["factor"] is None


def test_eval_threshold_none_runs_the_fixed_schedule(settings_checkpoint, tmp_path):
    """`--threshold none` on a checkpoint with threshold 0.9: one token per step, as generate(threshold=None)."""
    question = json.loads((DATA / "tiny_tasks.jsonl").read_text().splitlines()[0])["question"]
    settings = dict(threshold=None, max_new_tokens=16, eos_early_stop=False)
    expected = direct_generation(settings_checkpoint, _chat_ids(settings_checkpoint, question), **settings)
    assert expected[1] == 16  # one token per step over 16 tokens (the checkpoint's threshold would need fewer)
    dataset = _write_jsonl(tmp_path / "data.jsonl", [{"question": question, "answer": "?"}])
    try:
        result = _run(
            [str(settings_checkpoint), "--dataset", str(dataset), "--dtype", "float32", "--threshold", "none"]
            + ["--max-new-tokens", "16", "--no-eos-early-stop", "--output-dir", str(tmp_path / "out"), "--quiet"]
            + ["--threads", "2"]
        )
        assert torch.get_num_threads() == 2 and result["summary"]["settings"]["threads"] == 2
    finally:
        torch.set_num_threads(1)
    (prediction,) = result["predictions"]
    assert prediction["prediction"] == expected[0]
    # The row is stopped once its completion is over (its stop token committed): no forwards after that block.
    assert prediction["nfe"] <= expected[1]
    config = result["summary"]["generation_config"]
    assert config["threshold"] is None and config["steps"] is None and config["block_length"] == 8


def test_eval_stop_strings_stop_rows_and_save_forwards(digit_checkpoint, digit_predictions, tmp_path):
    """`--stop`: each prediction is the direct generate() text cut at the first stop string; a row whose stop string
    appears in its first block is stopped there (fewer forwards than generate() spends), the others spend the
    same; the generated-token count ends at the cut."""
    longest = max(digit_predictions, key=lambda row: len(row["prediction"]))["prediction"]
    stop = longest[2]  # a character some prediction holds early
    rows = [{"question": row["question"], "answer": "?"} for row in digit_predictions]
    dataset = _write_jsonl(tmp_path / "data.jsonl", rows)
    result = _run(
        [str(digit_checkpoint), "--dataset", str(dataset), "--batch-size", "3", "--dtype", "float32", "--stop", stop]
        + ["--output-dir", str(tmp_path / "out"), "--quiet", *GENERATION]
    )
    saved = 0
    for record, direct in zip(result["predictions"], digit_predictions, strict=True):
        cut = direct["prediction"].find(stop)
        assert record["prediction"] == (direct["prediction"][:cut] if cut >= 0 else direct["prediction"])
        if 0 <= cut < 8 and direct["nfe"] > 4:  # found in the first block (8 tokens, 4 steps) of a longer row
            assert record["nfe"] == 4
            saved += 1
        else:
            assert record["nfe"] == direct["nfe"]
        if cut >= 0:
            assert record["new_tokens"] == cut
    assert saved >= 1


def two_process_rows(predictions: list[dict]) -> list[dict]:
    """The two-process run's dataset: every third answer wrong, the others the direct prediction."""
    return [{"question": r["question"], "answer": r["prediction"] if i % 3 else "x"} for i, r in enumerate(predictions)]


def eval_arguments(checkpoint: Path, dataset: Path) -> list[str]:
    return [
        str(checkpoint),
        "--dataset",
        str(dataset),
        "--batch-size",
        "2",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--quiet",
        *GENERATION,
    ]


# `accelerate launch --num_processes 2` of `hf-dllm eval` on the dataset of `two_process_rows` (written by this
# script from the direct predictions, as the test writes its own), the output in WORKDIR/two. `--multi_gpu` is
# accelerate's torchrun launcher; with `--device cpu` the processes form a CPU (gloo) group. (`accelerate launch
# --cpu` starts a single process unless it is given an MPI hostfile.)
TWO_PROCESS_SCRIPT = """
import subprocess, sys
from pathlib import Path
import torch
from tests.evaluation.test_evaluate import (
    ROOT, _direct_predictions, _write_jsonl, eval_arguments, prepared_checkpoint, two_process_rows,
)
torch.set_num_threads(1)
workdir = Path(sys.argv[1])
checkpoint = prepared_checkpoint(workdir / "checkpoint")
dataset = _write_jsonl(workdir / "data.jsonl", two_process_rows(_direct_predictions(checkpoint)))
launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_dllm.cli", "eval"]
done = subprocess.run([*launch, *eval_arguments(checkpoint, dataset), "--output-dir", str(workdir / "two")], cwd=ROOT)
sys.exit(done.returncode)
"""
# Started at collection, beside the in-process tests (one of the two cores): the test waits for it only.
TWO_PROCESS_RUN = BackgroundJob(
    lambda workdir: {"two": [sys.executable, "-c", TWO_PROCESS_SCRIPT, str(workdir)]},
    timeout=300,
    env={
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    },
)


@pytest.mark.slow
@TWO_PROCESS_RUN.used_by
def test_two_processes_give_the_same_summary(checkpoint, direct_predictions, tmp_path):
    """`accelerate launch --num_processes 2` (CPU processes, gloo) shards the data and gathers the same results."""
    done = TWO_PROCESS_RUN.results()["two"]
    assert done.returncode == 0, done.stderr[-3000:]
    dataset = TWO_PROCESS_RUN.workdir / "data.jsonl"
    assert [json.loads(x) for x in dataset.read_text().splitlines()] == two_process_rows(direct_predictions)
    single = _run([*eval_arguments(checkpoint, dataset), "--output-dir", str(tmp_path / "one")])
    two_dir = TWO_PROCESS_RUN.workdir / "two"
    two = {
        "summary": json.loads((two_dir / "summary.json").read_text()),
        "predictions": [json.loads(x) for x in (two_dir / "predictions.jsonl").read_text().splitlines()],
    }
    assert two["summary"]["num_processes"] == 2
    assert [p["examples"] for p in two["summary"]["per_process"]] == [4, 4]
    assert two["predictions"] == single["predictions"]
    for key in INVARIANT_KEYS:
        assert two["summary"][key] == single["summary"][key], key


# ---------------------------------------------------------------------------------------------- model parallel


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("decoding", [dict(threshold=0.9), dict(steps=8)], ids=["threshold", "steps"])
def test_model_split_over_two_gpus_generates_the_same_tokens(decoding):
    """A model whose blocks sit on two GPUs (accelerate's dispatch, as `device_map="auto"` does) generates the
    tokens of the single-GPU model, with every cache mode and left padding."""
    from accelerate import dispatch_model

    model = tiny_model(seed=1, n_layers=4).to(device="cuda:0", dtype=torch.bfloat16)
    prompts = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :5] = 0
    modes = {"none": dict(use_cache=False), "prefix": dict(use_cache=True, dual_cache=False), "dual": {}}
    settings = dict(max_new_tokens=16, block_length=8, eos_early_stop=False, **decoding)

    def generate_all(m):
        device = m.get_input_embeddings().weight.device
        return {
            name: m.generate(prompts.to(device), attention_mask=attention_mask.to(device), **settings, **kwargs).cpu()
            for name, kwargs in modes.items()
        }

    single = generate_all(model)
    device_map = {"model.transformer.wte": 0, "model.transformer.emb_drop": 0}
    device_map.update({f"model.transformer.blocks.{i}": 0 if i < 2 else 1 for i in range(4)})
    device_map.update({"model.transformer.ln_f": 1, "model.transformer.ff_out": 1})
    split = dispatch_model(model, device_map, skip_keys=model._skip_keys_device_placement)
    assert split.model.transformer.blocks[3].q_proj.weight.device == torch.device("cuda:1")
    results = generate_all(split)
    for name in modes:
        assert torch.equal(results[name], single[name]), name
