"""LLaDA's CPU path: a decoder block as a pure function of plain weight tensors.

Where the Triton kernels do not run (the CPU: the demo, CI, laptops), a block step of a small LLaDA is bound by the
cost of each operation and each line of Python, not by arithmetic (`benchmarks/bench_generate.py --cpu`). So for
float32 inference the model runs each block as `lean_block(weights, ...)`: one function over a `LeanBlockWeights`
of the block's tensors (views of its parameters, gathered once by the block and re-checked at every forward in a
few microseconds), with the fewest operations that compute LLaDA's block (arXiv:2502.09992):
q/k/v and gate/up as one product each (the concatenated views the GPU path also uses), RoPE on q and k together,
the residual additions inside the output products (`addmm`), sdpa called directly. The module path (`forward` of
`LLaDALlamaBlock`) stays the reference; `tests/models/llada/test_cpu_path.py` compares the two.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .packed import PackedRows, attend_rows


class LeanBlockWeights(NamedTuple):
    """One block's tensors and sizes, as `lean_block` reads them: `*_t` are transposed views `(in, out)` of the
    weights (no copies), biases may be None. The block re-gathers it when a parameter was replaced."""

    layer_idx: int
    heads: int
    head_dim: int
    scaling: float
    attn_norm: torch.Tensor
    attn_norm_eps: float
    qkv_t: torch.Tensor
    qkv_bias: torch.Tensor | None
    attn_out_t: torch.Tensor
    attn_out_bias: torch.Tensor | None
    ff_norm: torch.Tensor
    ff_norm_eps: float
    gate_up_t: torch.Tensor
    gate_up_bias: torch.Tensor | None
    ff_out_t: torch.Tensor
    ff_out_bias: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]


def _product(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _residual_product(
    residual: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`residual + x @ weight_t (+ bias)`, the addition inside the product where there is no bias."""
    if bias is None:
        return torch.addmm(residual, x, weight_t)
    return residual + torch.addmm(bias, x, weight_t)


def lean_rotary(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables `(batch, q_len, head_dim)` as `lean_block` takes them (`rotary`): `(batch, q_len, 1, head_dim)`
    with the first half of sin negated, so that `x * cos + roll(x, head_dim / 2) * signed_sin` is
    `apply_rotary_pos_emb`'s `x * cos + rotate_half(x) * sin`, bit for bit (negation commutes with rounding)."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)


def select_rows(tensor: torch.Tensor, keep: slice | torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The positions `keep` (a slice or a 1D index) of `tensor` along `dim`."""
    if isinstance(keep, slice):
        return tensor[(slice(None),) * dim + (keep,)]
    return tensor.index_select(dim, keep.to(tensor.device))


def lean_block(
    weights: LeanBlockWeights,
    hidden_states: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | PackedRows | None,
    past_key_values,
    cache_position: torch.Tensor | None,
    keep: slice | torch.Tensor | None = None,
) -> torch.Tensor:
    """LLaDA's block, `x + Attn(norm(x))` then `x + W_out(act(W_gate norm(x)) * W_up norm(x))`, for float32
    inference with sdpa attention and multi-head attention (as many key/value heads as query heads).

    Args:
        hidden_states: `(batch, q_len, d_model)`.
        rotary: `(cos, signed_sin)` `(batch, q_len, 1, head_dim)`, sin's first half negated, so that
            `x * cos + roll(x, head_dim / 2) * signed_sin` is `x * cos + rotate_half(x) * sin` bit for bit.
        attention_mask: a 4D additive or boolean mask, None, or a `PackedRows` (attention within each packed row).
        past_key_values: a `DiffusionKVCache`, a `PackedRows` or None; new keys/values are written through its
            `update` at `cache_position`.
        keep: a slice or a 1D index of the `q_len` positions: only those positions' queries, attention and MLP are
            computed (keys and values of all of them still are), and the output is `(batch, kept, d_model)`: the
            last block of a forward whose logits are wanted at a few positions.

    Returns `(batch, q_len or kept, d_model)`.
    """
    batch, q_len, d_model = hidden_states.shape
    heads, head_dim = weights.heads, weights.head_dim
    # Rows as a 2D matrix: `mm`/`addmm` are what `linear` dispatches to, minus its reshapes.
    residual = hidden_states.reshape(batch * q_len, d_model)
    x = nn.functional.rms_norm(residual, (d_model,), weights.attn_norm, weights.attn_norm_eps)
    qkv = _product(x, weights.qkv_t, weights.qkv_bias).view(batch, q_len, 3 * heads, head_dim)
    cos, signed_sin = rotary
    query_key = qkv[:, :, : 2 * heads]
    query_key = query_key * cos + torch.roll(query_key, head_dim // 2, -1) * signed_sin
    query = query_key[:, :, :heads]
    key, value = query_key[:, :, heads:].transpose(1, 2), qkv[:, :, 2 * heads :].transpose(1, 2)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, weights.layer_idx, {"cache_position": cache_position})
    if keep is not None:
        query = select_rows(query, keep)
        residual = select_rows(hidden_states, keep).reshape(-1, d_model)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-2] > 1:
            attention_mask = select_rows(attention_mask, keep, dim=2)
        q_len = query.shape[1]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=weights.scaling).transpose(
            1, 2
        )

    attn = attend_rows(sdpa, query.transpose(1, 2), key, value, attention_mask)
    residual = _residual_product(
        residual, attn.reshape(batch * q_len, d_model), weights.attn_out_t, weights.attn_out_bias
    )
    x = nn.functional.rms_norm(residual, (d_model,), weights.ff_norm, weights.ff_norm_eps)
    gate_up = _product(x, weights.gate_up_t, weights.gate_up_bias)
    width = gate_up.shape[-1] // 2
    x = weights.act(gate_up[:, :width]) * gate_up[:, width:]
    return _residual_product(residual, x, weights.ff_out_t, weights.ff_out_bias).view(batch, q_len, d_model)
