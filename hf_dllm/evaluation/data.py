"""Data side of `hf-dllm eval`: loading a dataset with `datasets`, building prompts, scoring, sharding.

Kept free of model code so that each piece can be tested alone. `datasets` is imported inside `load_examples`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")


def load_examples(
    dataset: str,
    split: str | None = None,
    config_name: str | None = None,
    limit: int | None = None,
) -> list[dict]:
    """Rows of a dataset as dicts.

    `dataset` is a local file (`.json`, `.jsonl`, `.parquet`, `.csv`, `.arrow`), a local directory `datasets` can
    read, or a Hub name (`openai/gsm8k` with `config_name="main"`). A local file has a single split, `train`, unless
    `split` names another one. `limit` keeps the first rows. Without `datasets` installed, local JSON / JSONL
    files are still read (with the standard library).
    """
    path = Path(dataset).expanduser()
    if not path.exists() and _looks_local(dataset):
        raise FileNotFoundError(
            f"--dataset {dataset!r}: file not found (no such local file or folder; a Hub dataset is named "
            "`name` or `owner/name`)."
        )
    try:
        import datasets
    except ImportError:
        if path.is_file() and path.suffix.lower() in (".json", ".jsonl"):
            return _read_json_rows(path, limit)  # a machine without `datasets` can still read local JSON
        raise ImportError("hf-dllm eval needs `datasets` (pip install 'hf-dllm[eval]') for this dataset.") from None
    if path.is_file():
        builder = LOCAL_FORMATS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"{dataset}: unknown file type {path.suffix!r}; local datasets can be {sorted(LOCAL_FORMATS)}."
            )
        split = split or "train"
        data = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    elif path.is_dir():
        data = datasets.load_dataset(str(path), config_name, split=split or "train")
    else:
        data = datasets.load_dataset(dataset, config_name, split=split or "test")
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return [dict(row) for row in data]


def _looks_local(dataset: str) -> bool:
    """Whether `dataset` names a local path rather than a Hub dataset (`name` or `owner/name`): a path with a
    file extension `load_examples` reads, a path starting with `.`, `/` or `~`, or one with more than one `/`."""
    return (
        Path(dataset).suffix.lower() in LOCAL_FORMATS
        or dataset.startswith((".", "/", "~"))
        or dataset.count("/") > 1
        or "\\" in dataset
    )


def _read_json_rows(path: Path, limit: int | None) -> list[dict]:
    import json

    text = path.read_text()
    if path.suffix.lower() == ".jsonl" or not text.lstrip().startswith("["):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = json.loads(text)
    return rows[:limit] if limit is not None else rows


def format_prompt(example: dict, prompt_field: str, template: str | None = None) -> str:
    """The user message of an example: `template.format(**example)` when a template is given, else the field."""
    if template is not None:
        try:
            return template.format(**example)
        except KeyError as error:
            raise ValueError(
                f"--prompt-template names the field {error} that the dataset lacks (fields: {sorted(example)})."
            ) from None
    if prompt_field not in example:
        raise ValueError(
            f"the dataset has no field {prompt_field!r} (fields: {sorted(example)}); choose one with --prompt-field."
        )
    return str(example[prompt_field])


def build_prompt(tokenizer, user_text: str, use_chat_template: bool = True, system_prompt: str | None = None):
    """Token ids of the prompt: the tokenizer's chat template with a generation prompt when it has one (and
    `use_chat_template`), else the plain text with the tokenizer's own special tokens."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": user_text}
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = f"{system_prompt}\n\n{user_text}" if system_prompt else user_text
    return tokenizer(text)["input_ids"]


# ---------------------------------------------------------------------------------------------------- scoring


def last_number(text: str) -> str | None:
    """The last number written in `text` (`1,234.5` -> `1234.5`), or None."""
    found = _NUMBER.findall(str(text))
    return found[-1].replace(",", "") if found else None


def answer_number(answer) -> str | None:
    """The reference number of an answer: the text after GSM8K's `####` when present, its last number."""
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return last_number(text)


def _same_number(a: str, b: str) -> bool:
    x, y = float(a), float(b)
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def score(prediction: str, answer, scorer: str) -> bool:
    """`exact`: stripped strings are equal. `number`: the prediction's last number equals the answer's number."""
    if scorer == "exact":
        return str(prediction).strip() == str(answer).strip()
    if scorer == "number":
        predicted, expected = last_number(prediction), answer_number(answer)
        return predicted is not None and expected is not None and _same_number(predicted, expected)
    raise ValueError(f"unknown scorer {scorer!r}; choose 'exact' or 'number'.")


SCORERS = ("exact", "number")


# ---------------------------------------------------------------------------------------------------- sharding


def process_state(device: str | None = None):
    """accelerate's `PartialState`, CPU-only when asked (`device="cpu"`, `ACCELERATE_USE_CPU`) or when there is no
    GPU: launched processes on a CPU-only machine (`accelerate launch --multi_gpu --num_processes N`, `torchrun`)
    then form a gloo group instead of each running alone."""
    import os

    import torch
    from accelerate import PartialState

    use_cpu = (
        (device is not None and str(device).startswith("cpu"))
        or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
        or not torch.cuda.is_available()
    )
    return PartialState(cpu=use_cpu)


def shard_batches(lengths: Sequence[int], batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """The batches this process evaluates: the batches of one process (`length_batches` over all examples) dealt
    round-robin, so every process gets the same mix of short and long prompts. A batch holds the same rows whatever
    the number of processes, so padding, rounding (bf16 kernels pick by shape) and lockstep NFE are those of the
    one-process run. Deterministic; the shards partition the data."""
    return length_batches(range(len(lengths)), lengths, batch_size)[rank::world_size]


def length_batches(indices: Sequence[int], lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Consecutive batches of `batch_size` indices after sorting by prompt length, so padding stays small."""
    ordered = sorted(indices, key=lambda i: (lengths[i], i))
    return [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]
