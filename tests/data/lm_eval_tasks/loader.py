"""Datasets of the tiny local lm-eval tasks (read from tests/data, next to this folder)."""

import json
from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parent.parent


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def generation_dataset(**kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("tiny_tasks.jsonl"))})


def choice_dataset(**kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("tiny_mc.jsonl"))})
