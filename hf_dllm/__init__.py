"""hf_dllm: masked-diffusion language models (LLaDA, LLaDA2.x, ...) in Hugging Face transformers.

`import hf_dllm` registers every model family's classes (LLaDA, LLaDA-MoE, LLaDA2.0/2.1/2.2, Dream, DiffusionGemma: one family object
each, `family.py`) with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`, so a local checkpoint of any loads with
`AutoModel.from_pretrained(path)` and generates with `.generate(...)`; a `model_type` two families share (LLaDA-MoE's
Hub config says "llada") is told apart by `architectures` / `auto_map` / fields.

Layout: the flat files of this folder are the ones exported verbatim as Hub remote code (models, configs, the
generation loop and its policies, caches, attention backends, kernels). The applications built on them live in
subpackages and are never exported: `serving/` (`hf-dllm serve`), `evaluation/` (`hf-dllm eval`, `lm-eval`),
`hub/` (`hf-dllm export`, model cards), `cli/` (the `hf-dllm` command and what its commands share) and
`tiny_model/` (the tasks and tokenizer of the project's tiny trained model).

The `hf-dllm` console script (`hf_dllm_launcher.py`, outside this package) runs this file only when a command runs,
so that `--help` answers without torch or transformers (docs/decisions/cli-startup.md).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import CachePolicy, DiffusionKVCache, DualCache, ExactBlockCache, NoCache, PrefixCache
from .configuration_diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaTextConfig
from .configuration_dream import DreamConfig
from .configuration_llada import LLaDAConfig
from .configuration_llada2_moe import LLaDA2MoeConfig
from .configuration_llada_moe import LLaDAMoEConfig
from .decoding import (
    ConfidenceFactor,
    ConfidenceThreshold,
    FixedSchedule,
    ScheduledThreshold,
    TokenEditing,
    UnmaskingPolicy,
)
from .family import FAMILIES, DiffusionFamily, family_for_config, register_family
from .generation_utils import (
    BlockDiffusionRun,
    BlockEvent,
    DiffusionGenerateOutput,
    DiffusionGenerationConfig,
    DiffusionGenerationMixin,
    left_pad,
    plan_blocks,
)
from .modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion, DiffusionGemmaPreTrainedModel
from .modeling_dream import DreamBaseModel, DreamModel, DreamPreTrainedModel
from .modeling_llada import LLaDAModel, LLaDAModelLM, LLaDAPreTrainedModel
from .modeling_llada2_moe import LLaDA2MoeModel, LLaDA2MoeModelLM, LLaDA2MoePreTrainedModel
from .modeling_llada_moe import LLaDAMoEModel, LLaDAMoEModelLM, LLaDAMoEPreTrainedModel

__version__ = "0.1.0"

def _dispatching_config(config_classes: list[type]) -> type:
    """A config class for AutoConfig's `model_type` entry shared by families with different config classes
    (LLaDA-MoE's Hub config says "llada", as dense LLaDA's does): `from_dict` builds the class of the family the
    config describes (`family_for_config`: `architectures`, `auto_map`, then fields); built directly
    (`AutoConfig.for_model`), it is the first family's class. Either way no instance of the dispatcher exists."""

    def from_dict(cls, config_dict, **kwargs):
        family = family_for_config(config_dict)
        config_class = family.classes()[0] if family is not None else config_classes[0]
        return config_class.from_dict(config_dict, **kwargs)

    base = config_classes[0]

    def __new__(cls, *args, **kwargs):
        return base(*args, **kwargs)

    return type(
        base.__name__, (base,), {"from_dict": classmethod(from_dict), "__new__": __new__, "__module__": base.__module__}
    )


def register_auto_classes() -> None:
    """Register every family's config and model with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`, so that
    `AutoModel.from_pretrained(path)` gives hf_dllm's model with the diffusion `generate()` (LLaDA2's Hub auto_map
    sends AutoModel to the backbone: hf_dllm maps it to the model with the LM head, as for LLaDA and Dream)."""
    by_type: dict[str, list[type]] = {}
    for family in FAMILIES.values():
        config_class, model_class = family.classes()
        AutoModel.register(config_class, model_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        classes = by_type.setdefault(config_class.model_type, [])
        if config_class not in classes:
            classes.append(config_class)
    for model_type, classes in by_type.items():
        config_class = classes[0] if len(classes) == 1 else _dispatching_config(classes)
        AutoConfig.register(model_type, config_class, exist_ok=True)


register_auto_classes()

__all__ = [
    "BlockDiffusionRun",
    "BlockEvent",
    "CachePolicy",
    "ConfidenceFactor",
    "ConfidenceThreshold",
    "DiffusionGemmaConfig",
    "DiffusionGemmaForBlockDiffusion",
    "DiffusionGemmaPreTrainedModel",
    "DiffusionGemmaTextConfig",
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
    "LLaDAMoEConfig",
    "LLaDAMoEModel",
    "LLaDAMoEModelLM",
    "LLaDAMoEPreTrainedModel",
    "DiffusionFamily",
    "FAMILIES",
    "family_for_config",
    "register_family",
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
