"""The lm-eval command of docs/evaluation.md runs as written, offline, on the shipped tiny model and tasks; the
shipped tasks' datasets are the tiny model's held-out examples; lm-eval's git call prints nothing outside a checkout."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import BackgroundJob

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent
TASKS_DIR = ROOT / "hf_dllm" / "tiny_model" / "lm_eval_tasks"


def docs_command() -> list[str]:
    text = (ROOT / "docs" / "evaluation.md").read_text()
    block = re.search(r"<!-- tested: [^\n]*-->\n```bash\n(.*?)```", text, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))


def test_the_shipped_tasks_are_the_held_out_examples(monkeypatch):
    pytest.importorskip("datasets")
    from hf_dllm.tiny_model.tasks import heldout_examples

    monkeypatch.syspath_prepend(str(TASKS_DIR))
    import loader

    generation = loader.generation_dataset()["test"]
    assert [row["question"] for row in generation] == [e.prompt for e in heldout_examples(len(generation))]
    answers = {row["question"]: row["answer"] for row in generation}
    choice = loader.choice_dataset()["test"]
    assert len(choice) > len(generation) // 2
    for row in choice:
        assert len(set(row["choices"])) == 3 and row["choices"][row["label"]] == answers[row["question"]]


def test_lm_evals_git_call_is_quiet_outside_a_checkout(tmp_path, monkeypatch, capfd):
    pytest.importorskip("lm_eval")
    import lm_eval.evaluator

    import hf_dllm.evaluation.lm_eval_model  # noqa: F401  registers the model and quiets the git call

    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert lm_eval.evaluator.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err


def docs_command_run(workdir: Path) -> dict:
    # `hf-dllm` is the console script's launcher (which initialises the package only once the command runs).
    return {"docs": [sys.executable, "-m", "hf_dllm_launcher", *docs_command()[1:]]}


# Started at collection, beside the in-process tests (one of the two cores): the test waits for it only.
DOCS_RUN = BackgroundJob(
    docs_command_run,
    timeout=300,
    when=lambda: importlib.util.find_spec("lm_eval") is not None,
    cwd=ROOT,
    env={
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    },
)


@pytest.mark.slow
@DOCS_RUN.used_by
def test_the_docs_lm_eval_command_runs_offline():
    pytest.importorskip("lm_eval")
    command = docs_command()
    assert command[:2] == ["hf-dllm", "lm-eval"]
    model_args = command[command.index("--model_args") + 1].split(",")
    assert any(arg.startswith("mc_num=") for arg in model_args)  # never lm-eval's costly default (128)
    done = DOCS_RUN.results()["docs"]
    assert done.returncode == 0, done.stderr[-3000:]
    scores = dict(re.findall(r"\|(tiny_synthetic_\w+)\s*\|.*?\|[a-z_]+\s*\|.\s*\|([0-9.]+)\|", done.stdout))
    assert set(scores) == {"tiny_synthetic_gen", "tiny_synthetic_mc"}, done.stdout
    assert float(scores["tiny_synthetic_gen"]) >= 0.75  # the trained model answers its held-out prompts
    assert 0.0 <= float(scores["tiny_synthetic_mc"]) <= 1.0
    assert "fatal" not in done.stderr
