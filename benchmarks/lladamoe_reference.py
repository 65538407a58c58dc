"""Loads the LLaDA-MoE reference for `bench_llada_moe.py` from a folder given on the command line (never committed
here): the Hub's modeling code (`modeling_lladamoe.py`, `configuration_lladamoe.py`; ZHZisZZ/dllm carries a copy
under `dllm/pipelines/llada/models/`) and LLaDA's reference `generate()` (`generate.py` of ML-GSAI/LLaDA). Copy
them with

    git -C <dllm checkout> show HEAD:dllm/pipelines/llada/models/modeling_lladamoe.py > REF/modeling_lladamoe.py
    git -C <dllm checkout> show HEAD:dllm/pipelines/llada/models/configuration_lladamoe.py > REF/configuration_lladamoe.py
    git -C <LLaDA checkout> show HEAD:generate.py > REF/generate.py

The files are imported as the package `lladamoe_reference_code` (the modeling file imports its configuration
relatively); nothing in them is changed. The modeling file was written for transformers 4: under transformers 5
two names it imports are gone, and `_shim_transformers_4` puts back what it reads of them, changing nothing that
runs here: `AttentionMaskConverter` (used only with a padding mask, which batch-1 runs never pass: a stand-in that
refuses to run) and RoPE's "default" initialisation (`inv_freq = theta ** (-arange(0, dim, 2) / dim)` over the
rotary dims, attention scaling 1).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

REFERENCE_FILES = ("modeling_lladamoe.py", "configuration_lladamoe.py", "generate.py")
PACKAGE = "lladamoe_reference_code"


def _default_rope_parameters(config, device=None, seq_len=None, **kwargs):
    import torch

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_theta**exponents), 1.0


def _shim_transformers_4() -> None:
    """What the Hub's transformers-4 modeling file imports and transformers 5 no longer has (module doc)."""
    import transformers
    from transformers import modeling_rope_utils

    modeling_rope_utils.ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope_parameters)
    try:
        import transformers.modeling_attn_mask_utils  # noqa: F401
    except ImportError:
        module = types.ModuleType("transformers.modeling_attn_mask_utils")

        class AttentionMaskConverter:
            def __init__(self, *args, **kwargs):
                raise NotImplementedError("padding masks are not benchmarked (benchmarks/lladamoe_reference.py)")

        module.AttentionMaskConverter = AttentionMaskConverter
        sys.modules[module.__name__] = module
        transformers.modeling_attn_mask_utils = module


def load_reference(code_dir: Path):
    """(the Hub's `LLaDAMoEModelLM` class, its `LLaDAMoEConfig` class, LLaDA's `generate` function)."""
    code_dir = Path(code_dir)
    missing = [name for name in REFERENCE_FILES if not (code_dir / name).is_file()]
    if missing:
        raise ValueError(f"--reference {code_dir} lacks {missing} (see benchmarks/lladamoe_reference.py).")
    _shim_transformers_4()
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(code_dir)]
    sys.modules[PACKAGE] = package
    modeling = importlib.import_module(f"{PACKAGE}.modeling_lladamoe")
    configuration = importlib.import_module(f"{PACKAGE}.configuration_lladamoe")
    generate = importlib.import_module(f"{PACKAGE}.generate")
    return modeling.LLaDAMoEModelLM, configuration.LLaDAMoEConfig, generate.generate


def reference_model(model_class, config_class, ours):
    """The Hub model class with `ours`' config fields and weights (the same parameter names), on its device and in
    its dtype, sdpa attention."""
    fields = {k: v for k, v in ours.config.to_dict().items() if k not in ("architectures", "auto_map", "model_type")}
    config = config_class(**fields)
    config._attn_implementation = "sdpa"
    import torch

    with torch.device(ours.device):
        reference = model_class(config).to(ours.dtype)
    missing, unexpected = reference.load_state_dict(ours.state_dict(), strict=False)
    missing = [name for name in missing if "rotary" not in name]
    if missing or unexpected:
        raise RuntimeError(f"reference weights do not line up: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return reference.eval()
