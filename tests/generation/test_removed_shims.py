"""The 0.1 compatibility shims are gone: old module names, names re-exported from `hub.export`, the deprecated
`denoise_block_step` and the server's `--num-threads` flag fail plainly instead of warning."""

from __future__ import annotations

import importlib

import pytest

import hf_dllm
from hf_dllm import decoding
from hf_dllm.hub import export
from hf_dllm.serving import server


@pytest.mark.parametrize("old_name", ["serve", "evaluate", "export", "lm_eval_model", "char_tokenizer"])
def test_moved_module_names_no_longer_import(old_name):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"hf_dllm.{old_name}")


def test_no_import_hook_or_moved_names_remain():
    assert not hasattr(hf_dllm, "MOVED_MODULES")
    assert not hasattr(decoding, "denoise_block_step")
    for name in ("SHARED_REMOTE_CODE_FILES", "describe_decoding", "PACKAGE_DIR", "GENERATION_OPTIONS"):
        with pytest.raises(AttributeError, match=name):
            getattr(export, name)


def test_serve_rejects_the_old_num_threads_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        server.build_parser().parse_args(["model", "--num-threads", "1"])
    assert exit_info.value.code == 2 and "--num-threads" in capsys.readouterr().err
    assert server.build_parser().parse_args(["model", "--threads", "1"]).threads == 1
