"""Everything is declared in pyproject.toml. This file only adds `hf_dllm_lm_eval.pth` to the top level of the
installed distribution (site-packages), for regular and editable installs alike, which pyproject metadata cannot
express. The .pth file loads `_hf_dllm_lm_eval`, which registers `lm_eval --model hf_dllm` (see that module)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "hf_dllm_lm_eval.pth"
PTH_SOURCE = Path(__file__).resolve().parent / PTH


class BuildPyWithPth(build_py):
    """Regular wheels: the .pth file goes to the root of build_lib, which becomes site-packages."""

    def run(self):
        super().run()
        self.copy_file(str(PTH_SOURCE), str(Path(self.build_lib) / PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class _StrategyWithPth:
    """Wraps setuptools' editable strategy (a .pth path entry or an import finder) to add our .pth file too."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __call__(self, wheel, files, mapping):
        result = self._strategy(wheel, files, mapping)
        wheel.writestr(PTH, PTH_SOURCE.read_text())
        return result

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._strategy.__exit__(*exc_info)


class EditableWheelWithPth(editable_wheel):
    """`pip install -e .`: editable wheels hold only setuptools' own path hook, so add the .pth file to it."""

    def _select_strategy(self, *args, **kwargs):
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
