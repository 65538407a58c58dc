"""The `hf-dllm` commands' help texts: each default is printed once, and `export` names every family it exports."""

from __future__ import annotations

import argparse

import pytest

from hf_dllm import FAMILIES
from hf_dllm.cli import COMMANDS, _usage
from hf_dllm.hub import export


def rendered_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    formatter = parser._get_formatter()
    return {action.dest: formatter._expand_help(action) for action in parser._actions if action.help}


def test_serve_help_prints_each_default_once():
    pytest.importorskip("fastapi")
    from hf_dllm.serving import server

    parser = server.build_parser()
    helps = rendered_helps(parser)
    assert not [dest for dest, text in helps.items() if text.count("(default") > 1]
    assert "(default: None)" not in parser.format_help()
    assert "(default: 8000)" in helps["port"] and "(default: info)" in helps["log_level"]
    # With no formatter adding them, each option with a default worth printing states it in its help.
    stated = {action.dest for action in parser._actions if action.default not in (None, False, argparse.SUPPRESS)}
    assert not [dest for dest in stated if "default" not in helps.get(dest, "default")]


def test_export_help_names_every_family():
    description = export.build_parser().description
    assert all(family.display_name in description for family in FAMILIES.values())
    assert "LLaDA checkpoint" not in COMMANDS["export"][1] and "any family" in _usage()
