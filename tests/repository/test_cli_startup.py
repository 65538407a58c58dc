"""`hf-dllm --help` and `hf-dllm COMMAND --help` answer without importing torch or transformers (the console
script's launcher, `hf_dllm_launcher`), and print exactly the help of the fully imported package, whose families
register fields of their own (Dream's `alg`, ...). docs/decisions/cli-startup.md."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import hf_dllm  # noqa: F401  (this process: every family registered, as before the launcher existed)
from hf_dllm.cli import COMMANDS, asks_for_help, main
from tests.conftest import run_side_by_side

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = "100"  # argparse wraps help at the terminal's width: the same in both processes
# Runs one argument list through the console script's entry point in a fresh process and prints as JSON its exit
# code, its help and the heavy modules imported by then (one process per command: no command's imports help another).
PROBE = """
import contextlib, io, json, sys
import hf_dllm_launcher
text = io.StringIO()
with contextlib.redirect_stdout(text):
    code = hf_dllm_launcher.main(json.loads(sys.argv[1]))
imported = sorted(name for name in ("torch", "transformers", "hf_dllm.modeling_llada") if name in sys.modules)
print(json.dumps([code, text.getvalue(), imported]))
"""
HELP_ARGS = [["--help"], *([name, "--help"] for name in COMMANDS), ["generate", "-h", "--prompt", "x"]]


@pytest.fixture(scope="module")
def launcher_helps() -> dict:
    """ " ".join(args) -> [exit code, help, heavy modules imported], from the launcher."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": COLUMNS}
    commands = {" ".join(args): [sys.executable, "-c", PROBE, json.dumps(args)] for args in HELP_ARGS}
    done = run_side_by_side(commands, timeout=120, env=env)
    assert all(process.returncode == 0 for process in done.values()), {k: p.stderr for k, p in done.items()}
    return {name: json.loads(process.stdout) for name, process in done.items()}


def test_help_imports_neither_torch_nor_transformers(launcher_helps):
    assert {name: imported for name, (_, _, imported) in launcher_helps.items() if imported} == {}


@pytest.mark.parametrize("args", HELP_ARGS, ids=" ".join)
def test_launcher_help_is_the_full_packages(args, launcher_helps, monkeypatch, capsys):
    """Each help, printed by the launcher without torch, is the one this process (the whole package imported, as
    `python -m hf_dllm` does) prints: every option, family fields included."""
    monkeypatch.setenv("COLUMNS", COLUMNS)
    monkeypatch.setattr(sys, "argv", ["hf-dllm"])  # lm-eval's parser reads it
    code = main(args)
    expected = capsys.readouterr().out
    assert launcher_helps[" ".join(args)][:2] == [code, expected]
    assert code == 0 and expected.startswith("usage:")
    if args[0] in ("generate", "eval"):
        assert "--alg {" in expected and "--t-max" in expected  # Dream's and DiffusionGemma's fields


@pytest.mark.parametrize(
    "args, asked", [(["--help"], True), (["m", "-h"], True), (["m", "--", "-h"], False), (["--helpful"], False)]
)
def test_asks_for_help(args, asked):
    assert asks_for_help(args) is asked
