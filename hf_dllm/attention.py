"""hf_dllm's attention backend, registered with transformers' `AttentionInterface` and `AttentionMaskInterface`.

`attn_implementation="llada_triton"` (LLaDA's default in hf_dllm) runs `triton_attention.block_attention`, a
split-KV kernel for few queries against a long cached sequence with a key padding mask, where it pays: a block
step (at most 64 query rows per key/value head) whose (row, head) pairs alone would leave SMs idle. Measured on
an H200 at the LLaDA-8B shape (32 queries, 768 keys, one layer): batch 1 13 us vs 15 (sdpa), padded 17 vs 27;
batch 8 48 vs 32, padded 70 vs 52. Everything else (full-sequence forwards, batches that fill the GPU, CPU, no
Triton, dropout, a head size that is not a power of two >= 16) goes to transformers' `sdpa` with the same mask.
The rule depends on shapes only, so a CUDA-graph replay runs what the eager step ran.

transformers asks each backend for a mask in its own format through the mask interface; this backend takes the
key padding mask as `(B, 1, 1, T)` bool, so no `(q, T)` mask is ever materialised.

This file is exported as Hub remote code.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .cache import dequantize_kv
from .kernels import kernel_mode
from .triton_attention import TRITON_AVAILABLE, block_attention, num_sms

TRITON_ATTENTION = "llada_triton"


# Query rows per key/value head up to which the split-KV kernel is used (a block of 32 with up to 2 heads per group).
MAX_QUERY_ROWS = 64


def _kernel_applies(
    query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, fp8_kv: bool = False
) -> bool:
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    mode = kernel_mode()
    if not (
        TRITON_AVAILABLE
        and mode != "torch"
        and (query.is_cuda or mode == "triton")
        and dropout == 0.0
        # The kernel reads a key padding mask (B, 1, 1, T); a mask with a query dimension (LLaDA2's block-causal
        # mask) would be read from its first row only: sdpa honours every row.
        and (attention_mask is None or attention_mask.shape[-2] == 1)
        and dim >= 16
        and dim & (dim - 1) == 0
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and (heads // kv_heads) * q_len <= MAX_QUERY_ROWS
    ):
        return False
    # FP8 K/V: the kernel reads them in place at every batch size, where sdpa would need them dequantized first.
    return mode == "triton" or fp8_kv or batch * kv_heads < num_sms(query.device)


def key_padding_from_mask(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """`(B, T)` bool (True = attend) from a 4D key-padding mask: bool, or additive float (0 = attend)."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, 0, 0, :kv_len]
    if mask.dtype != torch.bool:
        mask = mask == 0
    return mask.expand(batch, kv_len)


def triton_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface signature: query `(B, Hq, Lq, D)`, key/value `(B, Hkv, T, D)` -> `(B, Lq, Hq, D)`.
    With `key_scale`/`value_scale` `(B, Hkv, T)`, key/value are an FP8 cache's (`fp8_attention_inputs`)."""
    fp8_kv = key_scale is not None
    if not _kernel_applies(query, key, attention_mask, dropout, fp8_kv):
        if fp8_kv:
            key, value = dequantize_kv(key, key_scale, query.dtype), dequantize_kv(value, value_scale, query.dtype)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
        )
    padding = key_padding_from_mask(attention_mask, query.shape[0], key.shape[2])
    return block_attention(query, key, value, padding, scaling, k_scale=key_scale, v_scale=value_scale), None


def fp8_attention_inputs(attn_implementation: str, keys, values, key_scales, value_scales, dtype: torch.dtype):
    """What an attention backend gets from an FP8 cache (`cache.FP8DiffusionKVCache.quantized_layer`): `(key, value,
    extra kwargs)`. hf_dllm's backend takes the float8 K/V and their scales and reads them in place; every other
    backend gets them dequantized to `dtype` (the layer's K/V, materialised for this call)."""
    if attn_implementation == TRITON_ATTENTION:
        return keys, values, {"key_scale": key_scales, "value_scale": value_scales}
    return dequantize_kv(keys, key_scales, dtype), dequantize_kv(values, value_scales, dtype), {}


def key_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """AttentionMaskInterface function: the 2D padding mask as `(B, 1, 1, kv_length)` bool, or None, for
    bidirectional attention; for a mask with structure along the queries (block-causal, causal) the full
    `(B, 1, q, kv)` bool mask, which the attention hands to sdpa. No host synchronisation, so it can be captured
    in a CUDA graph."""
    if mask_function is not None and mask_function is not bidirectional_mask_function:
        return sdpa_mask(
            batch_size,
            q_length,
            kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            device=kwargs.get("device", "cpu"),
        )
    if attention_mask is None:
        return None
    return attention_mask[:, None, None, kv_offset : kv_offset + kv_length].to(torch.bool)


def register_attention_backends() -> None:
    """Make `attn_implementation="llada_triton"` known to transformers (idempotent)."""
    AttentionInterface.register(TRITON_ATTENTION, triton_attention_forward)
    AttentionMaskInterface.register(TRITON_ATTENTION, key_padding_mask)
