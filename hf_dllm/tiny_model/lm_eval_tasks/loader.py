"""Datasets of the tiny model's lm-eval tasks: its held-out synthetic examples (`hf_dllm.tiny_model.tasks`), built in
memory (offline, deterministic). lm-eval loads this file by path from the task YAML files beside it."""

from __future__ import annotations

import datasets

from hf_dllm.tiny_model.tasks import TASKS, heldout_examples, solve

SIZE = 96  # held-out prompts per split (tasks in turn); a run takes `--limit` of them


def generation_dataset(**kwargs) -> datasets.DatasetDict:
    """The held-out prompts with their exact answers (`question`, `answer`, `task`)."""
    rows = [{"question": e.prompt, "answer": e.answer, "task": e.task} for e in heldout_examples(SIZE)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def choice_dataset(**kwargs) -> datasets.DatasetDict:
    """The held-out prompts as multiple choice: the answers of every string task on the prompt's argument (the
    right one is the asked task's); prompts where two tasks agree (a sorted or repeated argument) are left out."""
    rows = []
    for example in heldout_examples(SIZE):
        argument = example.prompt.split(" ", 1)[1]
        choices = [solve(task, argument) for task in TASKS]
        if len(set(choices)) == len(choices):
            rows.append({"question": example.prompt, "choices": choices, "label": TASKS.index(example.task)})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
