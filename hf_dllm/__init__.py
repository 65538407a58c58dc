"""hf_dllm: masked-diffusion language models (LLaDA, LLaDA2.x, ...) in Hugging Face transformers.

`import hf_dllm` registers the LLaDA (`model_type="llada"`) and LLaDA2.x MoE (`"llada2_moe"`) classes with
`AutoConfig`, `AutoModel` and `AutoModelForCausalLM`, so a local checkpoint of either loads with
`AutoModel.from_pretrained(path)` and generates with `.generate(...)`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import DiffusionKVCache, DualCache, NoCache, PrefixCache
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
    DiffusionGenerateOutput,
    DiffusionGenerationConfig,
    DiffusionGenerationMixin,
    left_pad,
    plan_blocks,
)
from .modeling_llada import LLaDAModel, LLaDAModelLM, LLaDAPreTrainedModel
from .modeling_llada2_moe import LLaDA2MoeModel, LLaDA2MoeModelLM, LLaDA2MoePreTrainedModel

__version__ = "0.1.0"

AutoConfig.register(LLaDAConfig.model_type, LLaDAConfig, exist_ok=True)
AutoModel.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
AutoModelForCausalLM.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
# LLaDA2's Hub auto_map sends AutoModel to the backbone; hf_dllm maps it to the model with the LM head and the
# diffusion generate(), as for LLaDA (users call AutoModel.from_pretrained(...).generate(...)).
AutoConfig.register(LLaDA2MoeConfig.model_type, LLaDA2MoeConfig, exist_ok=True)
AutoModel.register(LLaDA2MoeConfig, LLaDA2MoeModelLM, exist_ok=True)
AutoModelForCausalLM.register(LLaDA2MoeConfig, LLaDA2MoeModelLM, exist_ok=True)

__all__ = [
    "BlockDiffusionRun",
    "ConfidenceFactor",
    "ConfidenceThreshold",
    "DiffusionGenerateOutput",
    "DiffusionGenerationConfig",
    "DiffusionGenerationMixin",
    "DiffusionKVCache",
    "DualCache",
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
