"""Every code block of the README runs: the ```python blocks in this process (each in a fresh namespace, from the
repository root, on the CPU with the shipped tiny checkpoints), the ```bash blocks' `hf-dllm` commands through the
console script's `main`. A block preceded by `<!-- no-test: why -->` is skipped, and the skips are named here so
that none is added silently.

The exported-repo block names a Hub repo; it runs against a local export of `tests/fixtures/llada-tiny-trained`
(`hf_dllm.hub.export.export_checkpoint`), loaded through transformers' remote code."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent
README = ROOT / "README.md"
EXPORTED_REPO = "your-org/LLaDA-8B-Instruct-hf-dllm"
# The README's skipped blocks and why: a new skip must be added here on purpose.
EXPECTED_SKIPS = {
    "installs packages (.ci/run runs the second line)",
    "starts a server that keeps running; tests/serving/test_serve.py covers it",
    "lm-eval is an extra; tests/evaluation/test_lm_eval_docs_command.py runs this command as written",
}
BLOCK = re.compile(r"(?:<!--\s*no-test:\s*(?P<why>.*?)\s*-->\s*\n)?```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)


def readme_blocks() -> list[tuple[str, str, str | None, int]]:
    """`(lang, code, skip reason or None, line)` for each fenced block of the README, in order."""
    text = README.read_text()
    return [(m["lang"], m["code"], m["why"], text.count("\n", 0, m.start("lang")) + 1) for m in BLOCK.finditer(text)]


BLOCKS = readme_blocks()
PYTHON = [(code, line) for lang, code, why, line in BLOCKS if lang == "python" and why is None]
BASH = [(code, line) for lang, code, why, line in BLOCKS if lang == "bash" and why is None]


def test_only_the_expected_blocks_are_skipped():
    skipped = {why for _, _, why, _ in BLOCKS if why is not None}
    assert skipped == EXPECTED_SKIPS
    assert {lang for lang, *_ in BLOCKS} <= {"python", "bash"}, "a block in another language would go untested"
    assert len(PYTHON) >= 5 and len(BASH) >= 1


@pytest.fixture(scope="module")
def exported_repo(tmp_path_factory) -> Path:
    from hf_dllm.hub.export import export_checkpoint

    dst = tmp_path_factory.mktemp("readme") / "exported"
    with contextlib.redirect_stdout(io.StringIO()):
        export_checkpoint(ROOT / "tests" / "fixtures" / "llada-tiny-trained", dst)
    return dst


@pytest.mark.parametrize("code,line", PYTHON, ids=[f"line{line}" for _, line in PYTHON])
def test_python_block_runs(code, line, monkeypatch, request):
    if EXPORTED_REPO in code:
        code = code.replace(EXPORTED_REPO, str(request.getfixturevalue("exported_repo")))
    monkeypatch.chdir(ROOT)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    assert printed.getvalue().strip(), "every README block prints what it shows"
    if "reverse decoding" in code:  # the LLaDA quick start: the tiny model was trained for these answers
        assert "['gnidoced', 'aaegglnu']" in printed.getvalue()


@pytest.mark.parametrize("code,line", BASH, ids=[f"line{line}" for _, line in BASH])
def test_bash_block_runs(code, line, monkeypatch):
    """Each line is an `hf-dllm` command, run in this process through the console script's `main` (the same
    function, without a new interpreter's imports; tests/repository/test_cli_startup.py runs it in fresh ones)."""
    from hf_dllm_launcher import main

    monkeypatch.chdir(ROOT)
    for command in code.splitlines():
        argv = shlex.split(command, comments=True)
        assert argv[0] == "hf-dllm", f"README.md:{line}: only hf-dllm commands run here; mark others no-test"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(argv[1:]) == 0, f"README.md:{line}: {command}"
        assert printed.getvalue().strip()
        if argv[1] == "generate":  # the tiny model's answers to the README's prompts
            assert "olleh" in printed.getvalue() and "dlorw" in printed.getvalue()
