"""What the families' `hf-dllm eval` and lm-eval tests share: a direct `generate()` cut as the evaluators cut it,
the end-to-end `hf-dllm eval` run on the tiny questions, and lm-eval's `simple_evaluate` on the tiny local tasks
(`tests/data/lm_eval_tasks`, offline)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hf_dllm.cli.completion_text import completion_text, stop_token_ids
from hf_dllm.evaluation import evaluate
from tests.conftest import DATA

TASKS_DIR = DATA / "lm_eval_tasks"
QUESTIONS = [json.loads(line)["question"] for line in (DATA / "tiny_tasks.jsonl").read_text().splitlines()[:5]]


def load_checkpoint(path: Path):
    """(model, tokenizer) of a checkpoint folder, as the evaluators load it on CPU (float32, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def eval_direct(model, tokenizer, ids: list[int], until: Sequence[str] = (), **settings) -> tuple[str, int]:
    """(prediction, nfe) of a direct generate() on one prompt, cut as the evaluators cut it."""
    out = model.generate(torch.tensor([ids]), return_dict_in_generate=True, **settings)
    stops = stop_token_ids(model.generation_config, tokenizer)
    text = completion_text(tokenizer, out.sequences[0, len(ids) :].tolist(), stops, list(until))
    return text, int(out.nfe_per_row[0])


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """`question` as one user turn of the chat template, with the generation prompt (what `hf-dllm eval` sends)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_eval_equals_generate(
    checkpoint: Path, model, tokenizer, tmp_path: Path, settings: dict, options: list[str]
) -> tuple[list[str], dict]:
    """`hf-dllm eval CHECKPOINT *options` on `QUESTIONS` in padded batches of 3, the answers the direct
    `generate(**settings)` predictions on odd rows and wrong on even ones: each row gets the tokens and the forwards
    it gets alone, and the scores follow. Returns the command's arguments without `--output-dir` (for further runs)
    and the run's summary."""
    expected = [eval_direct(model, tokenizer, chat_prompt_ids(tokenizer, q), **settings) for q in QUESTIONS]
    rows = [
        {"question": q, "answer": p if i % 2 else p + "#"}
        for i, (q, (p, _)) in enumerate(zip(QUESTIONS, expected, strict=True))
    ]
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = [str(checkpoint), "--dataset", str(dataset), "--batch-size", "3", "--dtype", "float32", "--quiet"]
    assert evaluate.main([*args, "--output-dir", str(tmp_path / "out"), *options]) == 0
    predictions = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(p["prediction"], p["nfe"]) for p in predictions] == expected
    assert [p["correct"] for p in predictions] == [i % 2 == 1 for i in range(len(rows))]
    assert summary["accuracy"] == 2 / 5
    return args, summary


def run_lm_eval(checkpoint: Path, model_args: str, tasks: Sequence[str], batch_size: int, limit: int) -> dict:
    """lm-eval's `simple_evaluate` with `model="hf_dllm"` on the tiny local tasks, on CPU, with the chat template and
    the samples logged. Imports the adapter, which registers `hf_dllm` with lm-eval (else a file run alone finds
    no such model unless an earlier test imported it)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import hf_dllm.evaluation.lm_eval_model  # noqa: F401

    return lm_eval.simple_evaluate(
        model="hf_dllm",
        model_args=f"pretrained={checkpoint},{model_args}",
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        batch_size=batch_size,
        device="cpu",
        limit=limit,
        apply_chat_template=True,
        log_samples=True,
    )


def assert_responses_are(samples: list[dict], tokenizer, expected: Callable[[list[int], dict], str]) -> None:
    """Each logged sample's response is `expected(ids, gen_kwargs)` of its context's token ids and its request."""
    for sample in samples:
        context, gen_kwargs = sample["arguments"][0]
        ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        assert sample["resps"][0][0] == expected(ids, gen_kwargs)
