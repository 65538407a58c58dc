"""Which implementation runs LLaDA's elementwise ops (RMSNorm, RoPE, SiLU gate): chosen once, logged once.

- `auto` (default): the fused Triton kernels of `triton_ops.py` for CUDA tensors when Triton is installed,
  PyTorch otherwise (CPU, no Triton, or when autograd needs the graph: the kernels have no backward).
- `torch`: always PyTorch. `triton`: always Triton (on CPU this needs `TRITON_INTERPRET=1`; used by tests).

Override with the environment variable `HF_DLLM_KERNELS` or `set_kernel_mode()`. The same choice holds with and
without CUDA graphs, so graph capture never changes outputs.

This file is exported as Hub remote code.
"""

from __future__ import annotations

import os

import torch
from transformers.utils import logging

from .triton_ops import TRITON_AVAILABLE

logger = logging.get_logger(__name__)

KERNEL_MODES = ("auto", "torch", "triton")
_mode = os.environ.get("HF_DLLM_KERNELS", "auto")
_logged: set[str] = set()


def set_kernel_mode(mode: str) -> None:
    """Select `auto`, `torch` or `triton` kernels for the elementwise ops (see module docstring)."""
    global _mode
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode must be one of {KERNEL_MODES}, got {mode!r}.")
    if mode == "triton" and not TRITON_AVAILABLE:
        raise ValueError("kernel mode 'triton' needs the `triton` package (pip install hf-dllm[triton]).")
    _mode = mode
    _logged.clear()


def kernel_mode() -> str:
    if _mode not in KERNEL_MODES:
        raise ValueError(f"HF_DLLM_KERNELS must be one of {KERNEL_MODES}, got {_mode!r}.")
    return _mode


def use_fused_kernels(tensor: torch.Tensor) -> bool:
    """Whether the fused Triton kernels handle this activation tensor."""
    mode = kernel_mode()
    if mode == "torch" or not TRITON_AVAILABLE:
        chosen = False
    elif torch.is_grad_enabled() and tensor.requires_grad:
        chosen = False
    else:
        chosen = mode == "triton" or tensor.is_cuda
    key = f"{tensor.device.type}:{chosen}"
    if key not in _logged:
        _logged.add(key)
        logger.info(
            f"hf_dllm: {'Triton' if chosen else 'PyTorch'} kernels for RMSNorm/RoPE/SiLU on {tensor.device.type}"
        )
    return chosen
