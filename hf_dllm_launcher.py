"""The `hf-dllm` console script: `hf-dllm --help` and `hf-dllm COMMAND --help` answer without importing torch or
transformers.

`import hf_dllm` registers every model family with transformers' Auto classes, which imports both (seconds). This
launcher puts the `hf_dllm` package in `sys.modules` without running its `__init__`, so that the command line
(`hf_dllm.cli`) and the torch-free modules its options come from import alone; the package's `__init__` runs,
into the same module object, before a command runs (`hf_dllm.cli.main`'s `load_package`). Once it has run,
everything is as after a plain `import hf_dllm`. `python -m hf_dllm_launcher` is the same command;
`python -m hf_dllm` imports the package first (docs/decisions/cli-startup.md).
"""

from __future__ import annotations

import importlib.util
import sys

# The package this launcher put in `sys.modules` uninitialised, by name, until a command runs (`load_package`).
_DEFERRED: dict = {}


def main(argv: list[str] | None = None) -> int:
    if "hf_dllm" not in sys.modules:
        spec = importlib.util.find_spec("hf_dllm")
        package = importlib.util.module_from_spec(spec)
        sys.modules["hf_dllm"] = _DEFERRED["hf_dllm"] = package
    from hf_dllm.cli import main as run

    return run(argv, load_package=load_package)


def load_package() -> None:
    """Run the `hf_dllm` package's `__init__` into the module this launcher deferred (a no-op once it has run, or
    where the package was imported as usual)."""
    package = _DEFERRED.pop("hf_dllm", None)
    if package is not None:
        package.__spec__.loader.exec_module(package)


if __name__ == "__main__":
    sys.exit(main())
