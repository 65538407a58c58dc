"""Lets `lm_eval --model hf_dllm ...` find hf_dllm's model with released lm-evaluation-harness (0.4.x).

lm-eval resolves `--model` names from a fixed table (`lm_eval/models/__init__.py`) and discovers no plugins, so a
package cannot add a model name by declaring an entry point. `hf_dllm_lm_eval.pth`, installed beside this module,
imports it at interpreter start. It then waits: once `lm_eval.models` has been imported (lm-eval imports it before
resolving a model name), `hf_dllm` is added to lm-eval's model registry as a lazy placeholder
(`hf_dllm.evaluation.lm_eval_model:DiffusionEvalLM`), so torch and hf_dllm load only when that model is asked for.

Cost for every other Python process: one string comparison per module import that reaches the import system, no
import of lm-eval, torch or hf_dllm. Set `HF_DLLM_LM_EVAL_HOOK=0` to turn the hook off; `hf-dllm lm-eval ...` takes
the same arguments without it. This file must stay importable without hf_dllm's dependencies.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

MODEL_NAME = "hf_dllm"
MODEL_TARGET = "hf_dllm.evaluation.lm_eval_model:DiffusionEvalLM"
WATCHED_MODULE = "lm_eval.models"


def register() -> None:
    """Add `hf_dllm` to lm-eval's model registry (a lazy "module:Class" placeholder) unless a name is there."""
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of `lm_eval.models`, then `register()`."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            register()
        except Exception:  # noqa: BLE001 - an lm-eval without this registry must still import
            pass

    def __getattr__(self, name):  # resource readers, get_code, ...
        return getattr(self._loader, name)


class _LmEvalModelsFinder(importlib.abc.MetaPathFinder):
    """One-shot finder: wraps the loader of `lm_eval.models` found by the rest of `sys.meta_path`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != WATCHED_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install() -> None:
    """Called by the `.pth` file at interpreter start."""
    if os.environ.get("HF_DLLM_LM_EVAL_HOOK", "1").lower() in ("0", "false", "no", "off"):
        return
    if WATCHED_MODULE in sys.modules:
        register()
    elif not any(isinstance(finder, _LmEvalModelsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LmEvalModelsFinder())
