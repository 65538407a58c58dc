"""What the families' `hf-dllm export` tests share: the written generation settings, a refused export, and the checks
of an exported repo loaded in a fresh process without hf_dllm (`tests.conftest.run_without_hf_dllm`, whose child
script's `load_with_remote_code` / `run_pipeline` record what these checks read)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import hf_dllm
from hf_dllm.hub.export import export_checkpoint
from hf_dllm.hub.families import MODEL_FAMILIES, ExportError
from tests.conftest import generate_cases, run_without_hf_dllm

GENERATION_METADATA = {"transformers_version", "_from_model_config"}


def written_fields(folder: Path) -> dict:
    """generation_config.json of `folder`, as the model reads it, without transformers' metadata."""
    config = hf_dllm.DiffusionGenerationConfig.from_pretrained(folder)
    return {name: getattr(config, name) for name in config.field_names()}


def assert_generation_config_file(folder: Path, expected: dict) -> None:
    """generation_config.json of `folder` holds exactly the fields of `expected` that are not None (besides
    transformers' metadata)."""
    written = json.loads((folder / "generation_config.json").read_text())
    assert {k: v for k, v in written.items() if k not in GENERATION_METADATA} == {
        k: v for k, v in expected.items() if v is not None
    }


def with_generation_config(source: Path, folder: Path, fields: dict | str) -> Path:
    """A copy of the checkpoint `source` at `folder` whose generation_config.json has `fields` set (a str: the file's
    whole text). Returns that file's path."""
    shutil.copytree(source, folder)
    path = folder / "generation_config.json"
    text = fields if isinstance(fields, str) else json.dumps({**json.loads(path.read_text()), **fields})
    path.write_text(text)
    return path


def assert_export_refused(src: Path, dst: Path, match: str, **options) -> pytest.ExceptionInfo:
    """`export_checkpoint(src, dst, **options)` raises an ExportError matching `match` and leaves no `dst`."""
    with pytest.raises(ExportError, match=match) as error:
        export_checkpoint(src, dst, **options)
    assert not dst.exists()
    return error


def run_export_child(root: Path, child: str, spec: dict) -> dict:
    """`run_without_hf_dllm`, checked: the child could not import hf_dllm and recorded no error."""
    result = run_without_hf_dllm(root, child, spec)
    assert result["no_hf_dllm"], "the child process could import hf_dllm"
    assert not result["errors"], "\n".join(result["errors"])
    return result


def assert_remote_model(info: dict, family: str) -> None:
    """`describe()` of a model the child loaded with remote code: the family's class from its exported modeling file
    (`auto_map`), with generate() and hf_dllm's DiffusionGenerationConfig from the exported generation_config.py."""
    auto_map = MODEL_FAMILIES[family].auto_map
    modeling, class_name = auto_map["AutoModel"].split(".")
    assert info["class"] == class_name and info["has_generate"] and info["family"] == family
    assert info["class_module"].startswith("transformers_modules.") and info["class_module"].endswith(f".{modeling}")
    assert info["config_module"].startswith("transformers_modules.")
    assert info["config_module"].endswith("." + auto_map["AutoConfig"].split(".")[0])
    assert info["generation_config_class"] == "DiffusionGenerationConfig"
    assert info["generation_config_module"].startswith("transformers_modules.")
    assert info["generation_config_module"].endswith(".generation_config")


def assert_remote_loads(result: dict, family: str, defaults: dict) -> dict:
    """The child's AutoModel, AutoModelForCausalLM and reference-fixture models (`run_export_child`'s result) are
    the family's remote classes (`assert_remote_model`), its AutoConfig the exported configuration module, and the
    AutoModel's generation config holds the family's `defaults`. Returns that generation config."""
    for loaded in ("auto_model", "auto_causal", "reference_model"):
        assert_remote_model(result[loaded], family)
    assert result["auto_config_module"].endswith("." + MODEL_FAMILIES[family].auto_map["AutoConfig"].split(".")[0])
    written = result["auto_model"]["generation_config"]
    assert {key: written[key] for key in defaults} == defaults
    return written


def remote_tokens_are_hf_dllms(tokens: dict, model_class: type, exported: Path, cases: list[dict]):
    """The child's `generate_cases` of `cases` (`tokens`) are hf_dllm's on the same exported folder. Returns
    hf_dllm's model of it and its tokens."""
    model = model_class.from_pretrained(exported).eval()
    expected = generate_cases(model, cases)
    assert tokens == expected
    return model, expected


def assert_padded_rows_alone(model, case: dict, sequences: list[list[int]]) -> None:
    """Each row of the padded batch `case` (generate_cases' form) generated `sequences[row]`'s new tokens, what the
    row's prompt gives alone."""
    for row, (ids, keep) in enumerate(zip(case["input_ids"], case["attention_mask"], strict=True)):
        prompt = [token for token, real in zip(ids, keep, strict=True) if real]
        alone = model.generate(torch.tensor([prompt]), **case["kwargs"]).sequences[0, len(prompt) :]
        assert sequences[row][len(ids) :] == alone.tolist()


def assert_kept_settings_generate_alike(tokens_kept: list, model_class: type, source: Path, prompt: list, new: int):
    """The export of a checkpoint with its own generation_config.json, loaded without hf_dllm, generated
    `tokens_kept` on `prompt` with no arguments: what the source's generate() gives with none (`new` tokens)."""
    expected = model_class.from_pretrained(source).eval().generate(torch.tensor(prompt))
    assert expected.shape[1] == len(prompt[0]) + new
    assert tokens_kept == expected.tolist()


def assert_pipeline_matches(remote: dict, exported: Path, model_class: type, **settings) -> str:
    """The child's `run_pipeline(exported, settings)` gave what `pipeline("text-generation")` gives here: the same
    class and generation config class, the same text for "Hello" (with `settings`) and the same chat reply. Returns
    the text."""
    from transformers import pipeline

    generator = pipeline("text-generation", model=str(exported))
    assert type(generator.model) is model_class
    assert remote["class"] == model_class.__name__
    assert remote["generation_config_class"] == "DiffusionGenerationConfig"
    local = generator("Hello", **settings)[0]["generated_text"]
    assert remote["text"] == local and local.startswith("Hello")
    chat = generator([{"role": "user", "content": "Hi"}], max_new_tokens=8)[0]["generated_text"][-1]
    assert remote["chat"] == chat and chat["role"] == "assistant"
    return local
