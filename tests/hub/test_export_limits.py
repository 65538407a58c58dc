"""`hf-dllm export` refuses repos that would load and then fail (issue #66, #65; docs/limits.md): non-finite
weights, no tokenizer (unless `--no-tokenizer`), a chat template that does not parse, a token id outside the
vocabulary; file-system errors are one line naming the path. Nothing is left at the destination or beside it."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dllm.hub import export
from hf_dllm.hub.export import export_checkpoint
from hf_dllm.hub.families import ExportError
from tests.conftest import FIXTURES, save_checkpoint, tiny_model


@pytest.fixture(scope="module")
def remote_code() -> list[Path]:
    return export.check_remote_code(family="llada")


@pytest.fixture(autouse=True)
def checked_remote_code(monkeypatch, remote_code):
    """The remote-code check (seconds per export, tested in tests/hub/test_export.py) made once for the module."""
    monkeypatch.setattr(export, "check_remote_code", lambda family: remote_code)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny random LLaDA with the character tokenizer (and its chat template)."""
    return save_checkpoint(tiny_model(seed=0), tmp_path_factory.mktemp("src") / "llada")


def copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


def assert_nothing_left(dst: Path) -> None:
    assert not dst.exists()
    assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]


def nan_weights(src: Path) -> None:
    weights = load_file(src / "model.safetensors")
    name = sorted(weights)[1]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[7] = float("nan")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})


def inf_weights(src: Path) -> None:
    weights = load_file(src / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name] = weights[name].to(torch.bfloat16)
    weights[name].view(-1)[-1] = float("-inf")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})


def no_tokenizer(src: Path) -> None:
    for name in export.TOKENIZER_FILES:
        (src / name).unlink(missing_ok=True)


def broken_chat_template(src: Path) -> None:
    (src / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }")


def eos_outside_vocabulary(src: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "eos_token_id": 4096}))
    (src / "generation_config.json").unlink(missing_ok=True)


FAULTS = [
    ("nan_weight", nan_weights, r"NaN or infinite values in .*weight"),
    ("inf_bf16_weight", inf_weights, r"NaN or infinite values in .*weight"),
    ("no_tokenizer", no_tokenizer, r"no tokenizer files.*--no-tokenizer"),
    ("chat_template", broken_chat_template, r"chat template does not parse: TemplateSyntaxError"),
    (
        "eos_outside_vocabulary",
        eos_outside_vocabulary,
        r"config.json: `eos_token_id` is 4096, outside the vocabulary of 103",
    ),
]


@pytest.mark.parametrize("fault, pattern", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_a_broken_repo_is_refused_and_nothing_is_left(source, tmp_path, fault, pattern):
    src = copy(source, tmp_path)
    fault(src)
    dst = tmp_path / "out"
    with pytest.raises(ExportError, match=pattern):
        export_checkpoint(src, dst)
    assert_nothing_left(dst)


def test_no_tokenizer_exports_the_model_alone(source, tmp_path):
    result = export_checkpoint(source, tmp_path / "out", tokenizer=False)
    assert not set(result.files) & set(export.TOKENIZER_FILES)
    assert export.main([str(source), str(tmp_path / "cli"), "--no-tokenizer"]) == 0


def test_llada2_without_a_mask_id_in_its_vocabulary_is_refused(tmp_path, capsys):
    """The Hub's LLaDA2 config.json has no mask_token_id; the config class's default (156895) is outside a 320-token
    vocabulary: refused at export, naming the field, not at generate() time (issue #65)."""
    dst = tmp_path / "out"
    assert export.main([str(FIXTURES / "llada21-tiny-ref"), str(dst), "--no-tokenizer"]) == 1
    error = capsys.readouterr().err
    assert "config.json: `mask_token_id` is 156895, outside the vocabulary of 320 tokens" in error, error
    assert error.count("\n") == 1
    assert_nothing_left(dst)


@pytest.mark.parametrize(
    "where, failure",
    [
        ("tempfile.mkdtemp", OSError(errno.EROFS, "Read-only file system", "/dst/.out.export-1")),
        ("shutil.copyfile", OSError(errno.ENOSPC, "No space left on device", "/dst/.out.export-1/model.safetensors")),
    ],
    ids=["read_only", "full"],
)
def test_file_system_errors_are_one_line_naming_the_path(source, tmp_path, monkeypatch, capsys, where, failure):
    module, name = where.split(".")

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(getattr(export, module), name, fail)
    dst = tmp_path / "out"
    assert export.main([str(source), str(dst)]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "Traceback" not in error, error
    assert f"cannot write {failure.filename}: {failure.strerror}" in error
    assert_nothing_left(dst)
