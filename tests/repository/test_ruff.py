"""The linter of the developers' guide: `ruff check` (pyproject.toml's configuration) finds nothing in the tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent


def ruff_command() -> list[str] | None:
    """`ruff` of this interpreter's environment (the `[dev]` extra), else one on PATH; None when neither exists."""
    beside = Path(sys.executable).parent / "ruff"
    found = str(beside) if beside.exists() else shutil.which("ruff")
    return [found] if found else None


def test_ruff_check_is_clean():
    command = ruff_command()
    if command is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    done = subprocess.run([*command, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
