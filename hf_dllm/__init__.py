"""hf_dllm: masked-diffusion language models (LLaDA, LLaDA2.x, ...) in Hugging Face transformers.

`import hf_dllm` registers the LLaDA (`model_type="llada"`), LLaDA2.x MoE (`"llada2_moe"`) and Dream (`"Dream"`) classes with
`AutoConfig`, `AutoModel` and `AutoModelForCausalLM`, so a local checkpoint of either loads with
`AutoModel.from_pretrained(path)` and generates with `.generate(...)`.

Layout: the flat files of this folder are the ones exported verbatim as Hub remote code (models, configs, the
generation loop and its policies, caches, attention backends, kernels). The applications built on them live in
subpackages and are never exported: `serving/` (`hf-dllm serve`), `evaluation/` (`hf-dllm eval`, `lm-eval`),
`hub/` (`hf-dllm export`, model cards), `cli/` (the `hf-dllm` command and what its commands share) and
`tiny_model/` (the tasks and tokenizer of the project's tiny trained model).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import CachePolicy, DiffusionKVCache, DualCache, ExactBlockCache, NoCache, PrefixCache
from .configuration_dream import DreamConfig
from .configuration_llada import LLaDAConfig
from .configuration_llada2_moe import LLaDA2MoeConfig
from .decoding import (
    ConfidenceFactor,
    ConfidenceThreshold,
    FixedSchedule,
    ScheduledThreshold,
    TokenEditing,
    UnmaskingPolicy,
)
from .generation_utils import (
    BlockDiffusionRun,
    BlockEvent,
    DiffusionGenerateOutput,
    DiffusionGenerationConfig,
    DiffusionGenerationMixin,
    left_pad,
    plan_blocks,
)
from .modeling_dream import DreamBaseModel, DreamModel, DreamPreTrainedModel
from .modeling_llada import LLaDAModel, LLaDAModelLM, LLaDAPreTrainedModel
from .modeling_llada2_moe import LLaDA2MoeModel, LLaDA2MoeModelLM, LLaDA2MoePreTrainedModel

__version__ = "0.1.0"

# Modules that moved into the application subpackages: the old names still import, with a FutureWarning.
MOVED_MODULES = {
    "serve": "serving.server",
    "serve_batching": "serving.batching",
    "serve_protocol": "serving.protocol",
    "evaluate": "evaluation.evaluate",
    "eval_data": "evaluation.data",
    "eval_likelihood": "evaluation.likelihood",
    "lm_eval_model": "evaluation.lm_eval_model",
    "export": "hub.export",
    "synthetic_tasks": "tiny_model.tasks",
    "char_tokenizer": "tiny_model.char_tokenizer",
}


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new_name: str):
        self.new_name = new_name

    def create_module(self, spec):
        warnings.warn(
            f"`{spec.name}` moved to `{self.new_name}`; import it from there (the old name will be removed).",
            FutureWarning,
            stacklevel=4,
        )
        module = importlib.import_module(self.new_name)
        self.original_attributes = {name: getattr(module, name) for name in ("__spec__", "__loader__")}
        return module

    def exec_module(self, module) -> None:
        # The module is already executed; the import system stamped the old name's spec on it: undo that.
        for name, value in self.original_attributes.items():
            setattr(module, name, value)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """`import hf_dllm.serve` (an old module name) gives the module at its new place."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(f"{__name__}.{MOVED_MODULES[name]}"))


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())

AutoConfig.register(LLaDAConfig.model_type, LLaDAConfig, exist_ok=True)
AutoModel.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
AutoModelForCausalLM.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
# LLaDA2's Hub auto_map sends AutoModel to the backbone; hf_dllm maps it to the model with the LM head and the
# diffusion generate(), as for LLaDA (users call AutoModel.from_pretrained(...).generate(...)).
AutoConfig.register(LLaDA2MoeConfig.model_type, LLaDA2MoeConfig, exist_ok=True)
AutoModel.register(LLaDA2MoeConfig, LLaDA2MoeModelLM, exist_ok=True)
AutoModelForCausalLM.register(LLaDA2MoeConfig, LLaDA2MoeModelLM, exist_ok=True)
# Dream (`model_type="Dream"`): as on the Hub, AutoModel gives `DreamModel`, the model with the LM head.
AutoConfig.register(DreamConfig.model_type, DreamConfig, exist_ok=True)
AutoModel.register(DreamConfig, DreamModel, exist_ok=True)
AutoModelForCausalLM.register(DreamConfig, DreamModel, exist_ok=True)

__all__ = [
    "BlockDiffusionRun",
    "BlockEvent",
    "CachePolicy",
    "ConfidenceFactor",
    "ConfidenceThreshold",
    "DiffusionGenerateOutput",
    "DiffusionGenerationConfig",
    "DiffusionGenerationMixin",
    "DiffusionKVCache",
    "DreamBaseModel",
    "DreamConfig",
    "DreamModel",
    "DreamPreTrainedModel",
    "DualCache",
    "ExactBlockCache",
    "FixedSchedule",
    "LLaDA2MoeConfig",
    "LLaDA2MoeModel",
    "LLaDA2MoeModelLM",
    "LLaDA2MoePreTrainedModel",
    "LLaDAConfig",
    "LLaDAModel",
    "LLaDAModelLM",
    "LLaDAPreTrainedModel",
    "NoCache",
    "PrefixCache",
    "ScheduledThreshold",
    "TokenEditing",
    "UnmaskingPolicy",
    "left_pad",
    "plan_blocks",
]
