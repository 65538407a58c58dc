"""hf_dllm: masked-diffusion language models (LLaDA, ...) in Hugging Face transformers.

`import hf_dllm` registers the LLaDA classes with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`, so a
local LLaDA checkpoint loads with `AutoModel.from_pretrained(path)` and generates with `.generate(...)`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import DiffusionKVCache, DualCache, NoCache, PrefixCache
from .configuration_llada import LLaDAConfig
from .decoding import ConfidenceFactor, ConfidenceThreshold, FixedSchedule, UnmaskingPolicy
from .generation_utils import (
    BlockDiffusionRun,
    DiffusionGenerateOutput,
    DiffusionGenerationConfig,
    DiffusionGenerationMixin,
    left_pad,
    plan_blocks,
)
from .modeling_llada import LLaDAModel, LLaDAModelLM, LLaDAPreTrainedModel

__version__ = "0.1.0"

AutoConfig.register(LLaDAConfig.model_type, LLaDAConfig, exist_ok=True)
AutoModel.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
AutoModelForCausalLM.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)

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
    "LLaDAConfig",
    "LLaDAModel",
    "LLaDAModelLM",
    "LLaDAPreTrainedModel",
    "NoCache",
    "PrefixCache",
    "UnmaskingPolicy",
    "left_pad",
    "plan_blocks",
]
