"""DiffusionGemma (Google's block-diffusion Gemma 4 MoE, `google/diffusiongemma-26B-A4B-it`) for hf_dllm.

The model is one Gemma 4 MoE text transformer used twice (weights shared, LM head tied to the embedding):

- the **encoder** runs it causally (sliding-window causal in the sliding layers) over the prompt, then over each
  accepted canvas, appending their K/V to a cache (`DiffusionGemmaEncoderCache`: sliding layers keep only the last
  `sliding_window - 1` positions, full layers everything);
- the **decoder** runs it bidirectionally on the canvas being denoised (`canvas_length` tokens), its queries
  attending to the cached K/V plus the canvas' own (never written to the cache), with self-conditioning: its input
  is `post_norm(embed(canvas) + mlp(pre_norm(softmax(s) @ E * sqrt(hidden))))` for the previous step's processed
  logits `s` (zero signal at a canvas' first step). Logits are soft-capped at 30.

A layer: `x += post_attention_layernorm(attn(input_layernorm(x)))`, then from that residual r a dense gated-GELU MLP
and the MoE in parallel, `x = (r + post_feedforward_layernorm(h_mlp + h_moe)) * layer_scalar`. Attention has
q/k RMS norms, RoPE (proportional, partial, in full layers), scaling 1.0, values RMS-normed without scale (full
layers use their unnormalised keys as values). Parameter names are the Hub's (`model.decoder.*`; the encoder owns
only its `layer_scalar` buffers); the vision tower's weights are ignored on load (hf_dllm does not run images).

`forward(input_ids, decoder_input_ids, self_conditioning_logits, ...)` is transformers' interface (encode the
prompt into a fresh cache, denoise one canvas); `generate()` is hf_dllm's block loop (`generation_utils.py`) with
the family's sampler (`decoding_diffusion_gemma.py`).

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.utils import ModelOutput, cached_file

from . import triton_diffusion_gemma, triton_moe, triton_ops  # (kernels where Triton is installed: `use_fused_kernels`)
from .configuration_diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaTextConfig
from .decoding_diffusion_gemma import row_chunks
from .family_diffusion_gemma import DIFFUSION_GEMMA
from .fp8 import QuantizesFromLoadDtype
from .generation_config import DiffusionGenerationConfig
from .generation_utils import DiffusionGenerationMixin
from .grouped_gemm import grouped_matmul, zero_rows_past
from .kernels import (
    ConcatenatedProjections,
    kernel_mode,
    linear,
    returns_its_forward,
    use_fused_kernels,
)
from .tensor_parallel import is_sharded, local_shape, whole_tensor
from .triton_attention import AttentionTiles, block_attention
from .triton_moe import TRITON_AVAILABLE as MOE_KERNELS_AVAILABLE  # (`from .x import`: how the Hub finds the file)

# transformers' activation names that the Triton gated kernels compute (`triton_ops.GATE_ACTIVATIONS`: the experts'
# gated product, the dense MLP's `gated_mul`).
TRITON_GATE_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}

IMAGE_INPUTS = ("pixel_values", "image_position_ids", "mm_token_type_ids", "mm_encoder_outputs")


@dataclass
class DiffusionGemmaOutput(ModelOutput):
    """`logits` `(batch, canvas_length, vocab)` (float32, soft-capped) and the encoder `cache` the forward wrote."""

    logits: torch.Tensor | None = None
    cache: object = None


class DiffusionGemmaRMSNorm(nn.Module):
    """`x * (mean(x^2) + eps)^-0.5 * weight` in float32 (the weight is not offset by 1); no weight with
    `with_scale=False`."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The norm of `hidden_states` `(..., dim)`, plus `residual` (its shape) if given, times `scale` `(1,)` if
        given (a layer's `layer_scalar`); one Triton kernel where hf_dllm's fused kernels run
        (`kernels.use_fused_kernels`: the same float32 ops, rounded once, then as PyTorch rounds the sum and the
        product; the PyTorch ops launch about eight kernels per norm, eleven norms per layer)."""
        weight = self.weight if self.with_scale else None
        if use_fused_kernels(hidden_states) and not (torch.is_grad_enabled() and hidden_states.requires_grad):
            # A scale of another dtype would promote the product (PyTorch's type promotion): multiplied apart.
            folded = scale if scale is None or scale.dtype == hidden_states.dtype else None
            out = triton_diffusion_gemma.rms_norm(hidden_states, weight, self.eps, residual, folded)
            return out if folded is scale else out * scale
        x = hidden_states.float()
        x = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if weight is not None:
            x = x * weight.float()
        x = x.type_as(hidden_states)
        x = x if residual is None else residual + x
        return x if scale is None else x * scale


def rope_inverse_frequencies(config: DiffusionGemmaTextConfig, layer_type: str, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies `(head_dim // 2,)` of a layer type: "default" over `head_dim *
    partial_rotary_factor` dimensions, or "proportional" (Gemma 4: the first `partial_rotary_factor` of the angles
    rotate, the rest have frequency 0, the encoding stays `head_dim` wide)."""
    params = config.rope_parameters[layer_type]
    base, proportion = params["rope_theta"], params.get("partial_rotary_factor", 1.0)
    kind = params.get("rope_type", "default")
    if kind == "default":
        dim = int(head_dim * proportion)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "proportional":
        angles = int(proportion * head_dim // 2)
        rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / params.get("factor", 1.0)
    raise ValueError(f"rope_parameters[{layer_type!r}]: rope_type {kind!r} is not supported (default, proportional).")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# The decoder's attention backend (`DiffusionGemmaAttention.backends`) and the Triton kernel's tiles, on CUDA in
# half precision, per (head_dim, batch class): the 26B-A4B's sliding layers (16 query / 8 key-value heads of 256, a
# 1,023-slot ring + the 256-token canvas: each key/value head has 2 x 256 query rows) and full layers (2 key-value
# heads of 512: 8 x 256 rows). A batch takes the largest class not above it. What it rests on (H200,
# `python benchmarks/bench_diffusion_gemma_attention.py --kinds sliding,full --batch-sizes 1,8 --valid 0.75
# --stages 2 --splits 1,4`, 3/4 of the ring written, us a layer): sliding, batch 1: Triton 128 x 64 tiles, 8 warps,
# 4 key splits asked 36.3 (`block_attention` rounds a chunk up to a power of two of key tiles: over the 1,279 keys
# that is 3 chunks of 8 tiles) against cuDNN SDPA with the additive mask 76.5 (39.5 unmasked); batch 8: SDPA 184
# against the best Triton tiles' 201; full, batch 1 / 8: "gemm" 68 / 490 against the best Triton tiles' 93 and
# SDPA's math path 457 (cuDNN has no kernel for heads of 512). Batch 32 was not swept: it keeps the batch-8 choice.
# `even_splits` (sliding, batch 1): 4 chunks of 5 tiles over the 1,279 keys, not 3 of 8. With the splits merged in
# the kernel (`fold_merge`, the default), the batch-1 sliding attention takes 37 us a layer against 67 with a second
# merge kernel, 30 against 60 with the ring's unwritten slots skipped (512 of 1,023 written; same bits): the captured
# batch-1 step 16.39 ms against 17.13 (`bench_diffusion_gemma.py` times it with the merge apart).
DECODER_BATCH_CLASSES = (1, 8, 32)
DECODER_ATTENTION: dict[tuple[int, int], tuple[str, AttentionTiles]] = {
    (256, 1): ("triton", AttentionTiles(block_m=128, block_n=64, num_warps=8, splits=4, even_splits=True)),
    (256, 8): ("sdpa", AttentionTiles(block_m=32, block_n=32, num_warps=4)),
    (256, 32): ("sdpa", AttentionTiles(block_m=32, block_n=32, num_warps=4)),
    (512, 1): ("gemm", AttentionTiles(block_m=16, block_n=32, num_warps=8)),
    (512, 8): ("gemm", AttentionTiles(block_m=16, block_n=32, num_warps=8)),
    (512, 32): ("gemm", AttentionTiles(block_m=16, block_n=32, num_warps=8)),
}


# The encoder's passes (over a prompt, over an accepted canvas: a causal, in sliding layers windowed, mask per query),
# keyed as `DECODER_ATTENTION`: SDPA for heads its fused kernels take (`FUSED_SDPA_HEAD_DIM`), "gemm" for wider ones
# (its math fallback for heads of 512 took 0.52 ms a layer at batch 1 on an H200); "triton" runs
# `triton_attention.block_attention` with the mask per query: at batch 1 the sliding layers' (the 26B-A4B's captured
# encoder passes on an H200: over the prompt 21.3 ms against SDPA's 22.5, over a canvas 15.7 against 18.0; at batch 8
# and 32 slower: 105.5 / 409.2 ms over the prompt against 92.5 / 342.8; `bench_diffusion_gemma.py` times both).
ENCODER_ATTENTION: dict[tuple[int, int], tuple[str, AttentionTiles]] = {
    (256, 1): ("triton", DECODER_ATTENTION[256, 1][1]),
    (256, 8): ("sdpa", DECODER_ATTENTION[256, 8][1]),
    (256, 32): ("sdpa", DECODER_ATTENTION[256, 32][1]),
    (512, 1): ("gemm", DECODER_ATTENTION[512, 1][1]),
    (512, 8): ("gemm", DECODER_ATTENTION[512, 8][1]),
    (512, 32): ("gemm", DECODER_ATTENTION[512, 32][1]),
}


def attention_choice(head_dim: int, batch: int, table: dict = DECODER_ATTENTION) -> tuple[str, AttentionTiles]:
    """(backend, Triton tiles) of `table` (`DECODER_ATTENTION`, or `ENCODER_ATTENTION`, keyed alike) for a pass of
    `batch` rows with heads of `head_dim`; head widths outside the table (other checkpoints' shapes) take the
    nearest wider entry's (or the widest's)."""
    batch_class = max([size for size in DECODER_BATCH_CLASSES if size <= batch], default=DECODER_BATCH_CLASSES[0])
    widths = sorted({width for width, _ in table})
    width = next((w for w in widths if w >= head_dim), widths[-1])
    return table[(width, batch_class)]


def decoder_tiles(head_dim: int, batch: int = 1) -> AttentionTiles:
    """`block_attention`'s tiles for a decoder pass (`DECODER_ATTENTION`)."""
    return attention_choice(head_dim, batch)[1]


# The widest heads torch's fused SDPA kernels (flash, memory-efficient, cuDNN) take on an H100/H200; wider ones
# (DiffusionGemma's full layers: 512) fall back to the float32 math path.
FUSED_SDPA_HEAD_DIM = 256


def gemm_attention(query, key, value, mask, scale: float = 1.0) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v with grouped-query heads, `(B, Hq, T, D)` from query `(B, Hq, T, D)`, key
    and value `(B, Hkv, S, D)` (query head h reads key/value head h // (Hq / Hkv), as SDPA's `enable_gqa`) and a
    boolean mask broadcastable to `(B, 1, T, S)` (None: every key). The scores come out of a tensor-core product in
    float32 (`torch.bmm(..., out_dtype=float32)`: the same products and float32 sums as SDPA's math path, which
    upcasts its inputs first), the softmax is float32, the probabilities meet the values in the inputs' dtype.
    Float32 inputs take plain float32 products (`bmm`'s `out_dtype` is CUDA's)."""
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    q = query.reshape(batch * kv_heads, group * length, dim)
    k = key.reshape(batch * kv_heads, keys, dim).transpose(1, 2)
    if query.dtype == torch.float32:
        scores = torch.bmm(q, k)
    else:
        scores = torch.bmm(q, k, out_dtype=torch.float32)
    if scale != 1.0:
        scores.mul_(scale)
    scores = scores.view(batch, kv_heads, group, length, keys)
    if use_fused_kernels(scores) and not torch.is_grad_enabled():
        probabilities = triton_diffusion_gemma.masked_softmax(scores, mask, length, value.dtype)
    else:
        if mask is not None:
            scores.masked_fill_(~mask.unsqueeze(2), float("-inf"))  # (B, 1, 1, T or 1, S)
        probabilities = scores.softmax(-1).to(value.dtype)
    probabilities = probabilities.view(batch * kv_heads, group * length, keys)
    output = torch.bmm(probabilities, value.reshape(batch * kv_heads, keys, dim))
    return output.view(batch, heads, length, dim)


class DiffusionGemmaAttention(ConcatenatedProjections):
    """Gemma 4 attention of one layer; `forward` gets the K/V to attend to besides its own (the cache) and says
    whether to store its own (encoder) or not (decoder). Where the fused kernels run, q/k/v (q/k in full layers,
    whose values are their keys) are one product (`ConcatenatedProjections`) and every head's norm and RoPE one
    kernel (`triton_diffusion_gemma.qkv_norm_rope`), writing keys and values into a static cache's canvas slots.

    `backend` "sdpa" (torch's `scaled_dot_product_attention`; at the 26B-A4B shape its full layers' heads of 512
    have no fused kernel on an H200 and fall back to the float32 math path, ~0.5 ms a layer), "gemm"
    (`gemm_attention`: the same float32 scores and softmax from two bfloat16 tensor-core products, every pass) or
    "triton": the decoder's pass through hf_dllm's Triton attention (`triton_attention.block_attention`; CUDA, or
    the interpreter), the encoder's on `encoder_backend`'s (per-query causal masks). None (default): the decoder's
    from `DECODER_ATTENTION` (per head width and batch) on CUDA in half precision, else "sdpa"; the encoder's
    `encoder_backend` (`ENCODER_ATTENTION`, keyed alike: "gemm" on CUDA for heads wider than SDPA's fused kernels
    take, `FUSED_SDPA_HEAD_DIM`, else "sdpa"). Set for every layer with
    `DiffusionGemmaForBlockDiffusion.set_decoder_attention`."""

    backends = ("sdpa", "gemm", "triton")

    def __init__(self, config: DiffusionGemmaTextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.head_dim, self.num_key_value_heads = config.layer_attention(layer_idx)
        self.num_heads = config.num_attention_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = (
            nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=False) if self.is_sliding else None
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = DiffusionGemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DiffusionGemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.v_norm = DiffusionGemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps, with_scale=False)
        self.backend: str | None = None

    def chosen_backend(self, hidden_states: torch.Tensor) -> str:
        """The backend of a decoder pass over this input (see the class docstring): the one set, else on CUDA in
        half precision `DECODER_ATTENTION`'s for the heads' width and the batch, else "sdpa"."""
        if self.backend is not None:
            return self.backend
        if not hidden_states.is_cuda or hidden_states.dtype == torch.float32:
            return "sdpa"
        return attention_choice(self.head_dim, hidden_states.shape[0])[0]

    def encoder_backend(self, hidden_states: torch.Tensor) -> str:
        """The backend of an encoder pass over this input (a mask per query): on CUDA in half precision
        `ENCODER_ATTENTION`'s for the heads' width and the batch, else "sdpa"."""
        if not hidden_states.is_cuda or hidden_states.dtype == torch.float32:
            return "sdpa"
        return attention_choice(self.head_dim, hidden_states.shape[0], ENCODER_ATTENTION)[0]

    def forward(self, hidden_states, cos, sin, cache, mask, write_cache: bool, key_gap=None) -> torch.Tensor:
        """hidden_states `(B, T, hidden)`; cos, sin `(B, T, head_dim)`; mask `(B, 1, T, cached + T)` bool or None
        (every key), for the "sdpa" backend also additive (0 / -inf in the query's dtype, `decoder_key_mask`);
        `key_gap` `(B, 2)` int32 or None: keys masked for every query that the "triton" backend need not read
        (`decoder_key_gap`);
        `cache` the encoder cache (None: no cached keys); `write_cache`: append this pass's K/V (encoder) or only
        read the cache (decoder)."""
        fused = use_fused_kernels(hidden_states) and not torch.is_grad_enabled()
        projected = self.project_qkv(hidden_states, fused)
        output = self.attend_projected(hidden_states, *projected, cos, sin, cache, mask, write_cache, key_gap, fused)
        return linear(self.o_proj, output)

    def forward_pair(self, states, rows: int, encoder_rope, decoder_rope, cache, masks, key_gap=None):
        """The encoder's pass over an accepted canvas (the first `rows` rows of `states` `(2B, C, hidden)`) and the
        decoder's over the next canvas (the others) in one: one q/k/v product and one o-product over both; the
        encoder's attention (its K/V written into `cache`, then kept in its slots) before the decoder's (which reads
        them). `encoder_rope`, `decoder_rope`: (cos, sin) each; `masks`: (the encoder's, the decoder's). Returns
        both outputs `(2B, C, hidden)`."""
        fused = use_fused_kernels(states) and not torch.is_grad_enabled()
        projected = self.project_qkv(states, fused)
        outputs = [
            self.attend_projected(
                states[part], *(tensor[part] for tensor in projected), *rope, cache, mask, write, gap, fused
            )  # fmt: skip
            for part, rope, mask, write, gap in (
                (slice(0, rows), encoder_rope, masks[0], True, None),
                (slice(rows, None), decoder_rope, masks[1], False, key_gap),
            )
        ]
        return linear(self.o_proj, torch.cat(outputs))

    def attend_projected(
        self, hidden_states, raw_query, raw_key, value, cos, sin, cache, mask, write_cache: bool, key_gap, fused: bool
    ) -> torch.Tensor:
        """`forward` after the q/k/v projection (`project_qkv`), before the o-projection: the heads' norms and RoPE,
        the cache's keys and values (this pass's written where `write_cache`), the attention `(B, T, H * D)`."""
        length = hidden_states.shape[1]
        if fused:
            # Every head's norm and RoPE, queries, keys and values, in one launch (the PyTorch ops: ~6 kernels per
            # tensor); keys and values straight into the static cache's canvas slots where it has them
            # (`canvas_slots`: no copy after).
            slots = None if cache is None else cache.canvas_slots(self.layer_idx, length)
            query, key, value = triton_diffusion_gemma.qkv_norm_rope(
                raw_query,
                raw_key,
                value,
                (self.q_norm.weight, self.k_norm.weight),
                (self.q_norm.eps, self.k_norm.eps, self.v_norm.eps),
                cos,
                sin,
                *(slots or ()),
            )
        else:
            query = self.q_norm(raw_query)
            cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
            query = (query * cos + rotate_half(query) * sin).transpose(1, 2)
            key = self.k_norm(raw_key)
            key = (key * cos + rotate_half(key) * sin).transpose(1, 2)
            value = self.v_norm(value).transpose(1, 2)
        if cache is not None:
            key, value = cache.keys_values(self.layer_idx, key, value, write_cache)
        output = self.attend(hidden_states, query, key, value, mask, write_cache, key_gap)
        if cache is not None and write_cache:
            cache.end_write(self.layer_idx)  # (a ring's oldest slots are overwritten only once they have been read)
        return output

    def attend(self, hidden_states, query, key, value, mask, write_cache: bool, key_gap=None) -> torch.Tensor:
        """Attention of query `(B, H, T, D)` over key, value `(B, Hkv, S, D)` on the chosen backend, as the
        o-projection reads it: `(B, T, H * D)`."""
        batch, length, _ = hidden_states.shape
        backend = self.chosen_backend(hidden_states)
        per_query = mask is not None and mask.shape[2] != 1
        encoder = (write_cache and self.backend is None) or (backend == "triton" and (write_cache or per_query))
        if encoder:
            backend = self.encoder_backend(hidden_states)
        if backend == "gemm":
            output = gemm_attention(query, key, value, mask)
            return output.transpose(1, 2).reshape(batch, length, -1)
        if backend == "triton":
            # hf_dllm's Triton attention (float32 scores and softmax, grouped-query heads sharing their K/V loads)
            # with the decoder's key padding mask or the encoder's mask per query; written (B, T, H, D), what the
            # o-projection reads (no transpose copy).
            padding = None if mask is None else mask[:, 0] if per_query else mask[:, 0, 0, :]
            table = ENCODER_ATTENTION if encoder else DECODER_ATTENTION
            tiles = attention_choice(self.head_dim, batch, table)[1]
            output = block_attention(query, key, value, padding, scale=1.0, tiles=tiles, key_gap=key_gap)
            return output.reshape(batch, length, -1)
        output = nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=1.0, enable_gqa=self.num_heads != self.num_key_value_heads
        )
        return output.transpose(1, 2).reshape(batch, length, -1)

    def project_qkv(self, hidden_states: torch.Tensor, fused: bool) -> tuple[torch.Tensor, ...]:
        """query `(B, T, heads, head_dim)`, key and value `(B, T, kv_heads, head_dim)` (value is key in full
        layers) of hidden_states `(B, T, hidden)`: with `fused`, views of one product where it is one
        (`multiplies_as_one`; this rank's heads under tensor parallelism: the column shards concatenate per rank)."""
        batch, length, _ = hidden_states.shape
        shape = (batch, length, -1, self.head_dim)
        names = ("q_proj", "k_proj", "v_proj") if self.v_proj is not None else ("q_proj", "k_proj")
        if fused and self.multiplies_as_one(names):
            widths = [local_shape(self._modules[name].weight)[0] for name in names]
            parts = [part.view(shape) for part in self.project(hidden_states, names).split(widths, dim=-1)]
            return parts[0], parts[1], parts[-1]
        raw_query = linear(self.q_proj, hidden_states).view(shape)
        raw_key = linear(self.k_proj, hidden_states).view(shape)
        value = linear(self.v_proj, hidden_states).view(shape) if self.v_proj is not None else raw_key
        return raw_query, raw_key, value


class DiffusionGemmaMLP(ConcatenatedProjections):
    """`down(act(gate(x)) * up(x))`, no biases; gate/up are one product where the fused kernels run
    (`ConcatenatedProjections`; FP8 layers only where their scale blocks allow it: the 26B-A4B's 2,112 rows do
    not divide into blocks of 128, those run apart), and act(gate) * up one launch there (`triton_ops.gated_mul`,
    PyTorch's rounding points) for the activations it computes (`TRITON_GATE_ACTIVATIONS`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[activation]
        self.gate_activation = TRITON_GATE_ACTIVATIONS.get(activation)  # None: the fused path keeps act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        names = ("gate_proj", "up_proj")
        fused = use_fused_kernels(x) and not torch.is_grad_enabled()
        if fused and self.multiplies_as_one(names):
            gate, up = self.project(x, names).chunk(2, dim=-1)
        else:
            gate, up = linear(self.gate_proj, x), linear(self.up_proj, x)
        if fused and self.gate_activation is not None:
            return linear(self.down_proj, triton_ops.gated_mul(gate, up, self.gate_activation))
        return linear(self.down_proj, self.act_fn(gate) * up)


class DiffusionGemmaRouter(nn.Module):
    """Top-k routing on the residual: RMS-normed without weight, times `scale * hidden^-0.5`, projected, softmax in
    float32, top-k renormalised, times `per_expert_scale` of the chosen experts."""

    def __init__(self, config: DiffusionGemmaTextConfig):
        super().__init__()
        self.top_k = config.top_k_experts
        self.scalar_root_size = config.hidden_size**-0.5
        self.norm = DiffusionGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self._norm_weight = (None, None)  # (`scale`'s storage and version, `fused_norm_weight`)

    def fused_norm_weight(self) -> torch.Tensor:
        """`scale * hidden^-0.5` `(hidden,)` in float32: the fused path's norm weight, computed once and again only
        when `scale` is replaced (`.to()`, loading) or changed in place (its version counter)."""
        scale = self.scale
        key = (scale.data_ptr(), scale.device, scale._version)
        if self._norm_weight[0] != key:
            with torch.inference_mode(False):  # a plain tensor, whatever mode the first call runs in
                self._norm_weight = (key, scale.detach().float() * self.scalar_root_size)
        return self._norm_weight[1]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights `(T, top_k)` float32, experts `(T, top_k)` int64) of `hidden_states` `(T, hidden)`. Where the
        fused kernels run, three launches instead of seven: the norm with the weight `scale * hidden^-0.5` (rounded
        once instead of after each product), the product, and softmax, top-k, renormalisation and the per-expert
        scale in one (`triton_moe.route`: ties to the lowest index)."""
        if use_fused_kernels(hidden_states) and not torch.is_grad_enabled():
            return self.route_normed(
                triton_diffusion_gemma.rms_norm(hidden_states, self.fused_norm_weight(), self.norm.eps)
            )
        scores = self.proj(self.norm(hidden_states) * self.scale * self.scalar_root_size)
        probabilities = nn.functional.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probabilities, k=self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index

    # Up to this many tokens (a batch-1 canvas: 256) the router's product is `triton_moe.router_partials` (16 x 16
    # tiles of tokens x experts over the programs, summed and rounded to the activations' dtype in `route`'s kernel)
    # rather than cuBLAS's split-K product and its reduction kernel: one launch fewer on the path to the experts, where
    # the side stream's MLP holds the multiprocessors (`bench_diffusion_gemma.py` times the step with it off).
    product_in_routing_kernel = True
    product_max_tokens = 256

    def route_normed(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused path after its norm: `forward`'s result from `normed` `(T, hidden)`, the input normed with
        `fused_norm_weight` (by `forward`, or by the layer's kernel that norms it beside the MLP's and experts'
        inputs)."""
        _, index, weights = triton_moe.route_by(
            self.proj,
            normed,
            expert_bias=None,
            n_group=1,
            topk_group=1,
            top_k=self.top_k,
            score_function="softmax",
            normalize=True,
            routed_scaling_factor=1.0,
            product_in_kernel=self.product_in_routing_kernel,
            max_tokens=self.product_max_tokens,
            expert_scale=self.per_expert_scale,
        )
        return weights, index


def _grouped_mm_function():
    """torch's grouped GEMM (`nn.functional.grouped_mm`, or `torch._grouped_mm` before it was public), or None."""
    return getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class DiffusionGemmaExperts(nn.Module):
    """The experts as 3D tensors (the Hub's layout): `gate_up_proj` `(E, 2I, H)` (each expert's gate rows, then its
    up rows), `down_proj` `(E, H, I)`.

    Three implementations: the loop over the selected experts (transformers' eager order; one host synchronisation
    to list them: exact against transformers on the CPU); torch's grouped GEMMs over the expert-sorted rows
    ("grouped"); hf_dllm's Triton kernels ("triton": `triton_moe.align_by_expert`, `grouped_gemm.grouped_matmul` with
    the row gather fused into the gate/up product's loads and the GELU gate into its epilogue, `triton_moe.combine`;
    the kernels LLaDA2's experts run, tuned for few rows per expert: a 256-token canvas gives each of the 128
    experts ~16 of its 2,048 (token, choice) pairs). Neither grouped path synchronises with the host, so a step can
    be captured in a CUDA graph; both sum a token's experts in float32 in slot order. `implementation` None picks
    "triton" where hf_dllm's fused kernels run (`kernels.use_fused_kernels`: CUDA tensors with Triton installed,
    or `HF_DLLM_KERNELS=triton`), else "grouped" on CUDA in bfloat16 without autograd, else the loop."""

    implementations = (None, "loop", "grouped", "triton")

    def __init__(self, config: DiffusionGemmaTextConfig):
        super().__init__()
        experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.act_fn = ACT2FN[config.hidden_activation]
        self.gate_activation = TRITON_GATE_ACTIVATIONS.get(config.hidden_activation)
        self.implementation = None

    def chosen_implementation(self, hidden_states: torch.Tensor) -> str:
        """The implementation `forward` runs for this input (see the class docstring)."""
        if self.implementation not in self.implementations:
            raise ValueError(f"`implementation` must be one of {self.implementations}, got {self.implementation!r}.")
        if self.implementation == "triton" and not (
            MOE_KERNELS_AVAILABLE and (hidden_states.is_cuda or kernel_mode() == "triton")
        ):
            raise ValueError(
                "experts `implementation` 'triton' runs on CUDA tensors with Triton installed (or in Triton's "
                "interpreter with HF_DLLM_KERNELS=triton); use 'loop' or 'grouped' here."
            )
        # Expert parallelism whose routes name this rank's experts by local id and the others' by `num_experts`
        # (transformers' `_is_expert_parallel`): every implementation takes them (`off_rank_routes`). Any other
        # partition of the experts (a share of them, ids unknown) only the loop, which skips ids it does not hold.
        partitioned = not self.off_rank_routes and self.gate_up_proj.shape[0] != self.num_experts
        if partitioned and self.implementation not in (None, "loop"):
            raise ValueError(
                f"experts `implementation` {self.implementation!r} needs every expert on this rank; under expert "
                "parallelism use 'loop' (or None)."
            )
        if self.implementation is not None:
            return self.implementation
        if partitioned:  # the grouped paths index experts by their global id
            return "loop"
        no_autograd = not (torch.is_grad_enabled() and self.gate_up_proj.requires_grad)
        if (
            no_autograd
            and MOE_KERNELS_AVAILABLE
            and self.gate_activation is not None
            and hidden_states.dtype == self.gate_up_proj.dtype
            and use_fused_kernels(hidden_states)
        ):
            return "triton"
        if (
            hidden_states.is_cuda
            and hidden_states.dtype == torch.bfloat16 == self.gate_up_proj.dtype
            and _grouped_mm_function() is not None
            and no_autograd
        ):
            return "grouped"
        return "loop"

    @property
    def off_rank_routes(self) -> bool:
        """Whether routes may name expert `num_experts`: another rank's, with weight 0 (transformers' expert
        parallelism sets `_is_expert_parallel`, with `num_experts` this rank's count). The grouped paths sort those
        pairs into a last group (`route_groups`), compute nothing for them and give them zero outputs."""
        return bool(getattr(self, "_is_expert_parallel", False))

    @property
    def route_groups(self) -> int:
        """The groups the grouped paths sort the pairs into: one per expert, and the other ranks'
        (`off_rank_routes`)."""
        return self.num_experts + int(self.off_rank_routes)

    def hands_pairs_back(self, hidden_states: torch.Tensor) -> bool:
        """Whether `forward(..., combine=False)` may replace this call's summed output by the pairs' outputs: the
        "triton" implementation, and nothing reads the sum in between (`kernels.returns_its_forward`: tensor and
        expert parallelism wrap `forward` to all-reduce it; a forward hook expects it)."""
        return returns_its_forward(self) and self.chosen_implementation(hidden_states) == "triton"

    def uses_grouped(self, hidden_states: torch.Tensor) -> bool:
        """Whether `forward` runs without a host synchronisation for this input (grouped GEMMs, torch's or ours)."""
        return self.chosen_implementation(hidden_states) != "loop"

    def forward(self, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, combine: bool = True):
        """hidden_states `(N, H)`, index / weights `(N, k)` -> `(N, H)`: each token's experts' outputs, weighted and
        summed (in expert order by the loop, as transformers' eager experts; in slot order, float32, grouped).
        `combine=False` (the "triton" implementation only): `triton_pairs`' (pair outputs, rows) instead, for a
        kernel that sums them itself (`DiffusionGemmaLayer.fused_feedforward`); through this call, so that the
        module's hooks see every call."""
        implementation = self.chosen_implementation(hidden_states)
        if not combine:
            if implementation != "triton":
                raise ValueError(f"`combine=False` needs the 'triton' implementation, not {implementation!r}.")
            return self.triton_pairs(hidden_states, index)
        if implementation == "triton":
            return self.triton_forward(hidden_states, index, weights)
        if implementation == "grouped":
            return self.grouped_forward(hidden_states, index, weights)
        output = torch.zeros_like(hidden_states)
        for expert in index.unique().tolist():
            if expert >= self.gate_up_proj.shape[0]:  # expert parallelism: another rank's expert (weight 0)
                continue
            token, slot = torch.where(index == expert)
            gate, up = nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            out = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            output.index_add_(0, token, (out * weights[token, slot, None]).to(output.dtype))
        return output

    def grouped_forward(self, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As `forward`, as two grouped GEMMs over the (token, choice) pairs sorted by expert; no host sync."""
        grouped_mm = _grouped_mm_function()
        if grouped_mm is None:
            raise RuntimeError("the grouped experts need torch's grouped_mm (torch >= 2.9).")
        tokens, top_k = index.shape
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)
        rows = hidden_states[order // top_k]
        counts = torch.zeros(self.route_groups, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read its size on the host
        offsets = counts.cumsum(0).to(torch.int32)[: self.num_experts]
        gate, up = grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        out = grouped_mm((self.act_fn(gate) * up).contiguous(), self.down_proj.transpose(1, 2), offs=offsets)
        out = zero_rows_past(out, offsets[-1]) if self.off_rank_routes else out
        pairs = out.new_empty(out.shape).index_copy(0, order, out).view(tokens, top_k, -1)
        return (pairs.float() * weights[..., None].float()).sum(dim=1).to(hidden_states.dtype)

    def triton_forward(self, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As `forward`, through hf_dllm's Triton kernels (the class docstring); no host sync. The products round
        as the grouped path (each product and the activation to the activations' dtype)."""
        expert_rows, rows = self.triton_pairs(hidden_states, index)
        return triton_moe.combine(expert_rows, rows, weights.float(), False)

    def triton_pairs(self, hidden_states: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`triton_forward` before its combine: each (token, choice) pair's expert output `(N * k, H)` in expert
        order and, per token, its pairs' rows there `(N, k)` (`triton_moe.combine`'s inputs)."""
        if self.gate_activation is None:
            raise ValueError(
                f"the Triton experts compute {sorted(TRITON_GATE_ACTIVATIONS)} gates, not {self.act_fn!r}: use "
                "implementation 'grouped' or 'loop'."
            )
        sorted_token, offsets, rows = triton_moe.align_by_expert(index, self.route_groups, False)
        offsets = offsets[: self.num_experts]
        gated = grouped_matmul(
            hidden_states.contiguous(), offsets, self.gate_up_proj, rows_of=sorted_token, gated=True,
            activation=self.gate_activation,
        )  # fmt: skip
        out = grouped_matmul(gated, offsets, self.down_proj)
        return (zero_rows_past(out, offsets[-1]) if self.off_rank_routes else out), rows


# One stream per CUDA device and priority for work beside the main stream (`DiffusionGemmaLayer`'s dense MLP), of
# `SIDE_STREAM_PRIORITY` (-1, high: its kernels are scheduled first as multiprocessors free up; 0: the main
# stream's). At a batch-1 step of the 26B-A4B, the high-priority MLP's products take every multiprocessor for ~20 us
# and hold up the router's product, which the experts wait for (`bench_diffusion_gemma.py` times both priorities).
SIDE_STREAM_PRIORITY = -1
_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The device's side stream of `SIDE_STREAM_PRIORITY`, made at the first call outside a CUDA graph capture;
    None inside a capture before that."""
    key = (device, SIDE_STREAM_PRIORITY)
    stream = _SIDE_STREAMS.get(key)
    if stream is None and not torch.cuda.is_current_stream_capturing():
        stream = _SIDE_STREAMS[key] = torch.cuda.Stream(device, priority=SIDE_STREAM_PRIORITY)
    return stream


class DiffusionGemmaLayer(nn.Module):
    """One layer of the shared text transformer (the decoder's; the encoder passes its own `layer_scalar`)."""

    def __init__(self, config: DiffusionGemmaTextConfig, layer_idx: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DiffusionGemmaAttention(config, layer_idx)
        self.mlp = DiffusionGemmaMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.router = DiffusionGemmaRouter(config)
        self.experts = DiffusionGemmaExperts(config)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
        ):
            setattr(self, name, DiffusionGemmaRMSNorm(hidden, eps=eps))
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(
        self, x, cos, sin, cache, mask, write_cache: bool, layer_scalar=None, attention_only=False, key_gap=None,
        normed_input=None, next_norm=None,
    ):  # fmt: skip
        """The layer on `x` `(B, T, hidden)` (`normed_input`: its `input_layernorm`, where the previous layer's end
        kernel computed it). With `next_norm` (the next layer's `input_layernorm`): (output, its norm by `next_norm`
        where the end kernel computed it, else None)."""
        attention = self.self_attn(
            self.input_layernorm(x) if normed_input is None else normed_input, cos, sin, cache, mask, write_cache,
            key_gap,
        )  # fmt: skip
        if attention_only:  # the encoder's last layer: only its K/V are read
            return self.post_attention_layernorm(attention, residual=x)
        scalar = self.layer_scalar if layer_scalar is None else layer_scalar
        if self.norms_fuse(attention, x, scalar):
            return self.fused_feedforward(attention, x, scalar, next_norm)
        residual = self.post_attention_layernorm(attention, residual=x)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(residual)))
        flat = residual.reshape(-1, residual.shape[-1])
        weights, index = self.router(flat)
        moe = self.experts(self.pre_feedforward_layernorm_2(flat), index, weights).reshape(residual.shape)
        out = self.post_feedforward_layernorm(
            self.post_feedforward_layernorm_2(moe, residual=dense), residual=residual, scale=scalar
        )
        return out if next_norm is None else (out, None)

    # The experts' weighted sum inside the layer's end kernel (`post_feedforward_norms`' `experts`) where the experts
    # run as hf_dllm's Triton kernels: the same bits as `triton_moe.combine`, one launch and one (tokens, hidden) round
    # trip fewer per layer (`bench_diffusion_gemma.py` times the step without it too).
    combine_in_end_kernel = True
    # The next layer's input norm computed by this layer's end kernel (`forward`'s `next_norm`), where its weight
    # and eps allow: one launch fewer per layer.
    norm_in_end_kernel = True
    # The dense MLP on a side stream of high priority (`side_stream`), beside the router and the experts: the two
    # branches meet only at the end kernel, so in a captured step the MLP's small products (latency-bound at a
    # canvas' 256 rows) run while the experts stream their weights (26B-A4B batch-1 step on an H200: 16.18 -> 16.02
    # ms; `bench_diffusion_gemma.py` times the step with it off too).
    dense_mlp_beside_experts = True
    # The side stream forked after the router's product and routing rather than before them: the router then has
    # the multiprocessors to itself instead of waiting behind the high-priority MLP's products, and the MLP still
    # runs beside the experts' alignment and products (`bench_diffusion_gemma.py` times the step forked before).
    dense_mlp_after_routing = True

    def mlp_on_side_stream(self, x: torch.Tensor) -> torch.cuda.Stream | None:
        """The stream `fused_feedforward` runs the dense MLP on (None: inline): with `dense_mlp_beside_experts`, on
        CUDA, for an MLP that returns its `forward`'s output (`kernels.returns_its_forward`: tensor parallelism's
        all-reduce stays on the main stream, so that two collectives never run on two streams at once) and has no
        pre-hook, its own or a projection's (it would run on the side stream), once the device has its side stream
        (made outside a CUDA graph capture)."""
        if not self.dense_mlp_beside_experts or not x.is_cuda:
            return None
        return side_stream(x.device) if returns_its_forward(self.mlp, allow_pre_hooks=False) else None

    def _dense_mlp_forked(self, dense_in: torch.Tensor, side: torch.cuda.Stream) -> torch.Tensor:
        """The dense MLP launched on the side stream after the current stream's work so far (joined before the end
        kernel: a captured step holds two graph branches)."""
        side.wait_stream(torch.cuda.current_stream(dense_in.device))
        with torch.cuda.stream(side):
            return self.mlp(dense_in)

    def norms_fuse(self, attention: torch.Tensor, x: torch.Tensor, scalar: torch.Tensor) -> bool:
        """Whether `fused_feedforward` runs: the fused kernels, no autograd, one dtype."""
        return use_fused_kernels(x) and not torch.is_grad_enabled() and attention.dtype == x.dtype == scalar.dtype

    def forward_pair(
        self, x, rows: int, encoder_rope, decoder_rope, cache, masks, encoder_scalar, attention_only, key_gap=None,
        normed=None, next_norm=None,
    ):  # fmt: skip
        """The layer for the encoder's pass over an accepted canvas and the decoder's over the next canvas at once
        (`DiffusionGemmaForBlockDiffusion.encoder_decoder_layers`), on their inputs stacked on the batch `x`
        `(2B, C, hidden)`, the encoder's the first `rows`: the attention by `DiffusionGemmaAttention.forward_pair`,
        the feed-forward over both (one read of the weights), each with its own layer scalar (the encoder's
        `encoder_scalar`). `normed`: `x`'s input norm, where the previous layer's end kernel computed it;
        `attention_only`: the encoder's last layer, whose feed-forward nobody reads (the decoder's alone runs, its
        output alone returned). Returns (output, its norm by `next_norm` or None)."""
        normed = self.input_layernorm(x) if normed is None else normed
        attention = self.self_attn.forward_pair(normed, rows, encoder_rope, decoder_rope, cache, masks, key_gap)
        if attention_only:  # (the last layer: no next norm)
            return self.fused_feedforward(attention[rows:], x[rows:], self.layer_scalar), None
        out = self.fused_feedforward(attention, x, self.layer_scalar, next_norm, (rows, encoder_scalar))
        return out if next_norm is not None else (out, None)

    def fused_feedforward(
        self, attention: torch.Tensor, x: torch.Tensor, scalar: torch.Tensor, next_norm=None, first_rows=None
    ):
        """`forward` after the attention, its seven norms (and the layer scalar) in two launches: after the
        attention, the residual and the MLP's, experts' and router's inputs from one kernel; at the end, the three
        post-feed-forward norms and the scalar from one. The same float32 ops and rounding points as the separate
        norm kernels (all the layer's norms share the config's eps). `first_rows`: (n, another scalar) for the
        first n batch rows (the end kernel launched once per scalar: `forward_pair`)."""
        hidden = x.shape[-1]
        residual, dense_in, moe_in, router_in = triton_diffusion_gemma.post_attention_norms(
            attention,
            x,
            self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps,
            (
                self.pre_feedforward_layernorm.weight,
                self.pre_feedforward_layernorm_2.weight,
                self.router.fused_norm_weight(),
            ),
        )
        side = self.mlp_on_side_stream(x)
        fork_first = side is not None and not self.dense_mlp_after_routing
        if fork_first:
            dense = self._dense_mlp_forked(dense_in, side)
        weights, index = self.router.route_normed(router_in.view(-1, hidden))
        if side is not None and not fork_first:
            dense = self._dense_mlp_forked(dense_in, side)
        moe_in = moe_in.view(-1, hidden)
        experts = None
        if self.combine_in_end_kernel and self.experts.hands_pairs_back(moe_in):
            moe, rows = self.experts(moe_in, index, weights, combine=False)
            experts = (rows, weights.float())
        else:
            moe = self.experts(moe_in, index, weights).view(x.shape)
        if side is None:
            dense = self.mlp(dense_in)
        else:
            # No record_stream: `dense_in` (made on the main stream) stays referenced past the join; `dense` (made
            # on the side stream) is read on the main one after it, and once freed only side-stream work can reuse
            # its memory, all of which waits at the next fork for this layer's end kernel.
            torch.cuda.current_stream(x.device).wait_stream(side)
        norms = (self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2, self.post_feedforward_layernorm)
        folds_next = (
            next_norm is not None
            and self.norm_in_end_kernel
            and next_norm.with_scale
            and next_norm.eps == norms[-1].eps
            and next_norm.weight.device == x.device
            and not is_sharded(next_norm.weight)
        )
        norm_weights = tuple(norm.weight for norm in norms)
        next_weight = next_norm.weight if folds_next else None
        if first_rows is None:
            out = triton_diffusion_gemma.post_feedforward_norms(
                dense, moe, residual, norm_weights, norms[-1].eps, scalar, experts, next_weight
            )
        else:  # per part of the rows, each with its scalar (the experts' output rows shared: their rows index it)
            first, first_scalar = first_rows
            tokens = first * x.shape[1]
            parts = [
                triton_diffusion_gemma.post_feedforward_norms(
                    dense[part],
                    moe if experts is not None else moe[part],
                    residual[part],
                    norm_weights,
                    norms[-1].eps,
                    part_scalar,
                    None if experts is None else (experts[0][flat], experts[1][flat]),
                    next_weight,
                )
                for part, flat, part_scalar in (
                    (slice(0, first), slice(0, tokens), first_scalar),
                    (slice(first, None), slice(tokens, None), scalar),
                )
            ]
            out = tuple(map(torch.cat, zip(*parts, strict=True))) if folds_next else torch.cat(parts)
        if next_norm is None:
            return out
        return out if folds_next else (out, None)


class DiffusionGemmaSelfConditioning(DiffusionGemmaMLP):
    """`post_norm(inputs_embeds + mlp(pre_norm(signal)))`, `post_norm` without weight: the MLP is
    `DiffusionGemmaMLP`'s (gated GELU, no bias; gate/up one product and the gate one launch where the fused kernels
    run), its layers named as the Hub's (`gate_proj`, `up_proj`, `down_proj` on this module)."""

    def __init__(self, config: DiffusionGemmaTextConfig):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_activation)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_norm = DiffusionGemmaRMSNorm(hidden, eps=eps)
        self.post_norm = DiffusionGemmaRMSNorm(hidden, eps=eps, with_scale=False)

    def forward(self, inputs_embeds: torch.Tensor, signal: torch.Tensor | None) -> torch.Tensor:
        if signal is None:  # a canvas' first step: the zero signal adds exactly zero
            return self.post_norm(inputs_embeds)
        return self.post_norm(inputs_embeds + super().forward(self.pre_norm(signal)))


class DiffusionGemmaEncoderCache:
    """The encoder's K/V per layer `(B, kv_heads, T, head_dim)`, with each cached position's column and whether it
    is a real token (`valid`, `(B, T)`: left padding is not). Sliding layers keep the last `sliding_window - 1`
    positions (all the next query's window can see), full layers all (transformers' `DynamicCache` semantics).
    The decoder reads it (`write=False`: the canvas' K/V are appended for the pass only)."""

    def __init__(self, config: DiffusionGemmaTextConfig):
        layers = config.num_hidden_layers
        self.sliding = [kind == "sliding_attention" for kind in config.layer_types]
        self.window = config.sliding_window
        self.keys: list = [None] * layers
        self.values: list = [None] * layers
        self.columns: list = [None] * layers
        self.valid: list = [None] * layers
        self.length = 0  # columns encoded so far
        self.max_batch_size = 1 << 30  # rows are the inputs' (the serving engine asks)

    def set_length(self, width: int) -> None:
        """A new layout of rows (the serving engine's, before each block): nothing cached yet, every prefix is
        encoded again at the block's first step."""
        layers = len(self.sliding)
        self.keys, self.values, self.columns, self.valid = ([None] * layers for _ in range(4))
        self.length = 0

    def prepare(self, batch: int, dtype: torch.dtype, device: torch.device, end: int) -> None:
        """Before an encoder pass of `batch` rows whose last column is `end - 1`: what may read host values (the
        static cache's capacity check and allocation), never inside a captured pass."""

    def begin_write(self, columns: torch.Tensor) -> None:
        """The columns `(T,)` of the encoder pass now starting (where the static cache's `keys_values` writes; a
        tensor op, so a captured pass gives its static buffer)."""

    def decoder_mask(self, layer: int, canvas: torch.Tensor, padded: bool) -> torch.Tensor | None:
        """The decoder's key mask `(B, 1, 1, cached + C)` bool over layer `layer`'s cache and the canvas `(B, C)`
        (None: every key, where no row is `padded`)."""
        if not padded or self.valid[layer] is None:
            return None
        canvas_keys = torch.ones(canvas.shape, dtype=torch.bool, device=canvas.device)
        return torch.cat([self.valid[layer], canvas_keys], dim=1)[:, None, None, :]

    def canvas_slots(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a pass of `length` tokens may write its own keys and values `(B, kv_heads, length, head_dim)` for
        `keys_values` to read in place (no copy), or None (`keys_values` concatenates)."""
        return None

    def end_write(self, layer: int) -> None:
        """After an encoder pass's attention in `layer` (`keys_values(..., write=True)` came before it)."""

    def keys_values(self, layer: int, key, value, write: bool):
        if self.keys[layer] is not None:
            key = torch.cat([self.keys[layer], key], dim=-2)
            value = torch.cat([self.values[layer], value], dim=-2)
        if write:
            keep = -(self.window - 1) if self.sliding[layer] else 0
            self.keys[layer], self.values[layer] = key[:, :, keep:], value[:, :, keep:]
        return key, value

    def record(self, columns: torch.Tensor, valid: torch.Tensor) -> None:
        """After an encoder pass over `columns` `(T,)` with `valid` `(B, T)`: keep each layer's column facts in step
        with its K/V (no host read: `encode` then sets `length`)."""
        for layer, sliding in enumerate(self.sliding):
            if self.columns[layer] is not None:
                all_columns = torch.cat([self.columns[layer], columns])
                all_valid = torch.cat([self.valid[layer], valid], dim=1)
            else:
                all_columns, all_valid = columns, valid
            keep = -(self.window - 1) if sliding else 0
            self.columns[layer], self.valid[layer] = all_columns[keep:], all_valid[:, keep:]

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows `index` `(k,)` long."""
        for store in (self.keys, self.values, self.valid):
            for layer, tensor in enumerate(store):
                if tensor is not None:
                    store[layer] = tensor.index_select(0, index)


class DiffusionGemmaStaticCache(DiffusionGemmaEncoderCache):
    """The encoder cache in preallocated buffers written in place (`index_copy_`), so that the decoder's step reads
    the same tensors at every step of every canvas (a CUDA graph of it stays valid): per layer K/V `(B, kv_heads,
    S, head_dim)` with S = `sliding_window - 1` for sliding layers (a ring: column c in slot c mod S, so the last S
    columns, the ones the dynamic cache keeps) and `capacity` columns for full layers; each slot's column and
    validity (`columns` `(S,)`, `valid` `(B, S)`; empty slots invalid). Keys sit in slot order, not column order:
    masks are built from the columns, so attention sees the same keys as the dynamic cache's (the sum in another
    order: equal up to rounding). The decoder masks empty slots at every step. `version` changes whenever the
    buffers are reallocated (another batch, more columns, rows dropped): captured passes (`CacheGraphs`) key on
    it. An encoder pass's writes (`keys_values` / `end_write` at the columns `begin_write` gave, `record`) are
    tensor ops on the buffers, so a replayed pass writes where the eager one would."""

    _versions = iter(range(1 << 62))

    def __init__(
        self,
        config: DiffusionGemmaTextConfig,
        capacity: int,
        canvas_length: int = 0,
        heads: list[tuple[int, int]] | None = None,
    ):
        super().__init__(config)
        self.capacity = capacity
        # Slots after each layer's own where a pass of up to `canvas_length` tokens puts its K/V, so that it reads
        # one buffer instead of a concatenation of the cache and its own (a copy of the whole cache per layer and
        # pass: ~1.3 ms of a batch-1 step of the 26B-A4B shape on an H200), the decoder's at every step and the
        # encoder's over an accepted canvas (which then keeps them in the cache's slots, `end_write`).
        self.canvas_length = canvas_length
        self.storage_keys: list = [None] * len(self.sliding)
        self.storage_values: list = [None] * len(self.sliding)
        # (head_dim, key/value heads) per layer: this rank's heads under tensor parallelism (`heads`, from the
        # model's layers: `DiffusionGemmaForBlockDiffusion.cache_heads`), else the config's.
        self.head = heads or [config.layer_attention(layer) for layer in range(len(self.sliding))]
        if len(self.head) != len(self.sliding):
            raise ValueError(
                f"`heads` must give one (head_dim, kv_heads) per layer ({len(self.sliding)}), got {heads}."
            )
        self.version = next(self._versions)

    def slots(self, layer: int) -> int:
        return self.window - 1 if self.sliding[layer] else self.capacity

    def fits(self, batch: int, columns: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether its buffers hold `batch` rows of `columns` columns in `dtype` on `device` (a run may reuse it)."""
        keys = self.keys[0]
        return (
            keys is not None
            and keys.shape[0] == batch
            and self.capacity >= columns
            and keys.dtype == dtype
            and keys.device == device
        )

    def prepare(self, batch: int, dtype: torch.dtype, device: torch.device, end: int) -> None:
        if not all(self.sliding) and end > self.capacity:
            raise ValueError(
                f"DiffusionGemmaStaticCache holds {self.capacity} columns, an encoder pass writes column {end - 1}."
            )
        if self.keys[0] is not None and self.keys[0].shape[0] == batch:
            return
        with torch.inference_mode(False):  # plain tensors: a later call, outside inference mode, reuses them
            self._allocate(batch, dtype, device)
        self.version = next(self._versions)

    def begin_write(self, columns: torch.Tensor) -> None:
        self._pending_columns = columns

    def _allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        for layer in range(len(self.sliding)):
            head_dim, heads = self.head[layer]
            slots = self.slots(layer)
            shape = (batch, heads, slots + self.canvas_length, head_dim)
            self.storage_keys[layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.storage_values[layer] = torch.zeros(shape, dtype=dtype, device=device)
            self._view_slots(layer)
            self.columns[layer] = torch.full((slots,), -1, dtype=torch.long, device=device)
            self.valid[layer] = torch.zeros(batch, slots, dtype=torch.bool, device=device)

    def set_length(self, width: int) -> None:
        if width > self.capacity:
            self.capacity = width
            self.keys[0] = None  # reallocated at the next `prepare`
        if self.keys[0] is not None:
            for layer in range(len(self.sliding)):
                self.columns[layer].fill_(-1)
                self.valid[layer].fill_(False)
        self.length = 0

    def _write_at(self, layer: int, columns: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The slots `(n,)` of the last n of `columns` that the layer keeps, and n."""
        slots = self.slots(layer)
        kept = min(columns.shape[0], slots)
        last = columns[-kept:]
        return (last % slots if self.sliding[layer] else last), kept

    def _view_slots(self, layer: int) -> None:
        """`keys` / `values` of `layer`: views of its storage's cache slots (written in place)."""
        slots = self.slots(layer)
        self.keys[layer] = self.storage_keys[layer][:, :, :slots]
        self.values[layer] = self.storage_values[layer][:, :, :slots]

    def canvas_slots(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if length > self.canvas_length or self.storage_keys[layer] is None:
            return None
        slots = self.slots(layer)
        return (
            self.storage_keys[layer][:, :, slots : slots + length],
            self.storage_values[layer][:, :, slots : slots + length],
        )

    def keys_values(self, layer: int, key, value, write: bool):
        length = key.shape[-2]
        slots = self.canvas_slots(layer, length)
        if slots is not None:
            # A pass of up to `canvas_length` tokens (the decoder's; the encoder's over an accepted canvas): its K/V
            # in the slots after the cache's, the cache and them read as one buffer, in the concatenation's order.
            # Copied there unless already written in place (the fused norm/RoPE kernel's output). An encoder pass
            # keeps them in the cache's slots at `end_write`, after its attention read the slots they replace.
            for own, target in zip((key, value), slots, strict=True):
                if own.data_ptr() != target.data_ptr():
                    target.copy_(own)
            end = self.slots(layer) + length
            return self.storage_keys[layer][:, :, :end], self.storage_values[layer][:, :, :end]
        all_keys = torch.cat([self.keys[layer], key], dim=-2)
        all_values = torch.cat([self.values[layer], value], dim=-2)
        if write:
            slots, kept = self._write_at(layer, self._pending_columns)
            self.keys[layer].index_copy_(2, slots, key[:, :, -kept:])
            self.values[layer].index_copy_(2, slots, value[:, :, -kept:])
        return all_keys, all_values

    def end_write(self, layer: int) -> None:
        length = self._pending_columns.shape[0]
        if self.canvas_slots(layer, length) is None:
            return  # written by `keys_values` (after its concatenation)
        slots, kept = self._write_at(layer, self._pending_columns)
        end = self.slots(layer) + length
        self.keys[layer].index_copy_(2, slots, self.storage_keys[layer][:, :, end - kept : end])
        self.values[layer].index_copy_(2, slots, self.storage_values[layer][:, :, end - kept : end])

    def decoder_mask(self, layer: int, canvas: torch.Tensor, padded: bool) -> torch.Tensor:
        canvas_keys = torch.ones(canvas.shape, dtype=torch.bool, device=canvas.device)
        return torch.cat([self.valid[layer], canvas_keys], dim=1)[:, None, None, :]

    def record(self, columns: torch.Tensor, valid: torch.Tensor) -> None:
        for layer in range(len(self.sliding)):
            slots, kept = self._write_at(layer, columns)
            self.columns[layer].index_copy_(0, slots, columns[-kept:])
            self.valid[layer].index_copy_(1, slots, valid[:, -kept:])

    def keep_rows(self, index: torch.Tensor) -> None:
        for layer in range(len(self.sliding)):
            if self.storage_keys[layer] is not None:
                self.storage_keys[layer] = self.storage_keys[layer].index_select(0, index)
                self.storage_values[layer] = self.storage_values[layer].index_select(0, index)
                self._view_slots(layer)
                self.valid[layer] = self.valid[layer].index_select(0, index)
        self.version = next(self._versions)


class CacheGraphs:
    """CUDA graphs of the passes over one static cache (`DiffusionGemmaStaticCache`): the decoder's layers
    (`decoder_layers`, every denoising step) and the encoder's pass (`encoder_layers`) over an accepted canvas and
    over a prompt whose shape `seen_before` admits, each
    a pure tensor function of its inputs and the cache's buffers, which stay in place between steps, canvases and
    `generate()` calls; a new cache or new buffers (its `version`) drop the graphs. One graph per function and
    input shapes / dtypes (and constants such as `padded`), all in one memory pool: a graph's returned output is
    valid until the next replay of any of them (`decode` reads it at once). What reads host values (the cache's
    capacity check, its `length`), the embeddings, the self-conditioning signal, the LM head and the sampler's random
    draws run eagerly around the graphs: they are a few large kernels, while the layers are a pass's hundreds of
    small launches.

    The first call of a key runs the function eagerly on copies of its inputs (the call's result, and the
    capture's warm-up: kernel selection, Triton compilation and autotuning, workspaces), then captures it on those
    copies (nothing runs while capturing); later calls copy their inputs into them and replay. An eager first call
    instead of warm-up calls before the capture: the encoder's pass writes the cache in place (its sliding layers'
    rings overwrite the oldest columns), so running it twice would not be running it once."""

    def __init__(self):
        self.cache_key = None
        self.entries: dict = {}
        self.pool = None
        self.seen_once: set = set()  # `seen_before`'s shapes seen once, and how many it admitted
        self.admitted = 0
        self.replays: dict[str, int] = {}  # per function name, over the object's life (benchmarks, tests)

    @staticmethod
    def applies(model, x: torch.Tensor, cache) -> bool:
        """On CUDA, without autograd, over a static cache, every layer's experts grouped (no host sync)."""
        return (
            x.is_cuda
            and isinstance(cache, DiffusionGemmaStaticCache)
            and not torch.is_grad_enabled()
            and not torch.cuda.is_current_stream_capturing()
            and all(layer.experts.uses_grouped(x) for layer in model.model.decoder.layers)
        )

    def _follow(self, cache) -> None:
        """Drop every graph (and what `seen_before` counted) when `cache` is another cache or has new buffers."""
        if self.cache_key != (id(cache), cache.version):
            self.cache_key = (id(cache), cache.version)
            self.entries.clear()
            self.pool = None  # the dropped graphs' pool is released with them: capturing into it again is an error
            self.seen_once, self.admitted = set(), 0

    @staticmethod
    def _key(function, inputs: tuple[torch.Tensor, ...], constants: tuple = ()) -> tuple:
        # The kernel mode too: a graph keeps the kernels it was captured with (`set_kernel_mode` must not replay it).
        shapes = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
        return (function.__name__, constants, kernel_mode(), shapes)

    def seen_before(self, function, cache, inputs: tuple[torch.Tensor, ...], limit: int) -> bool:
        """Whether `function`'s pass on inputs of these shapes should go through `run`: its graph exists, or its
        shape was seen once before and fewer than `limit` shapes were admitted this way (each is then captured by
        that `run`). A shape's first pass only counts it (the caller runs it eagerly: no capture for a one-off)."""
        self._follow(cache)
        key = self._key(function, inputs)
        if key in self.entries:
            return True
        if key in self.seen_once and self.admitted < limit:
            self.seen_once.discard(key)
            self.admitted += 1
            return True
        if len(self.seen_once) >= 1024:  # many one-off shapes (a server's prompts): forget them, not grow
            self.seen_once.clear()
        self.seen_once.add(key)
        return False

    def run(self, function, cache, inputs: tuple[torch.Tensor, ...], *constants):
        """`function(*inputs, cache, *constants)`, replayed from its graph after the first call of its key."""
        self._follow(cache)
        key = self._key(function, inputs, constants)
        entry = self.entries.get(key)
        if entry is None:
            with torch.inference_mode(False):  # plain tensors: a later call outside inference mode copies into them
                static = tuple(tensor.clone() for tensor in inputs)
            output = function(*static, cache, *constants)
            self.entries[key] = (*self._capture(function, static, cache, constants), static)
            return output
        graph, output, static = entry
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value)
        graph.replay()
        self.replays[function.__name__] = self.replays.get(function.__name__, 0) + 1
        return output

    def _capture(self, function, static: tuple, cache, constants: tuple):
        """(the graph of `function` on the static inputs `static`, its output)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = function(*static, cache, *constants)
        self.pool = graph.pool()
        return graph, output


class DiffusionGemmaEncoderLayer(nn.Module):
    """The encoder's own part of a layer: its `layer_scalar` buffer (buffers are not tied to the decoder's)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("layer_scalar", torch.ones(1))


class DiffusionGemmaEncoderLanguageModel(nn.Module):
    def __init__(self, config: DiffusionGemmaTextConfig):
        super().__init__()
        self.layers = nn.ModuleList(DiffusionGemmaEncoderLayer() for _ in range(config.num_hidden_layers))


class DiffusionGemmaEncoder(nn.Module):
    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.language_model = DiffusionGemmaEncoderLanguageModel(config.text_config)


class DiffusionGemmaDecoder(nn.Module):
    """The shared text transformer: embedding (scaled by sqrt(hidden)), layers, final norm, and the decoder's
    self-conditioning block."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        text = config.text_config
        self.config = text
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size, text.pad_token_id)
        self.layers = nn.ModuleList(DiffusionGemmaLayer(text, i) for i in range(text.num_hidden_layers))
        self.norm = DiffusionGemmaRMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        self.self_conditioning = DiffusionGemmaSelfConditioning(text)
        self._embed_scales: dict = {}  # `embed_scale`'s tensors per (dtype, device)
        for layer_type, frequencies in self.rope_frequencies().items():
            self.register_buffer(f"{layer_type}_inv_freq", frequencies, persistent=False)

    def rope_frequencies(self) -> dict[str, torch.Tensor]:
        """Each layer type's RoPE inverse frequencies (non-persistent buffers, remade after loading)."""
        text = self.config
        return {
            kind: rope_inverse_frequencies(text, kind, text.layer_attention(text.layer_types.index(kind))[0])
            for kind in sorted(set(text.layer_types))
        }

    def embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """sqrt(hidden) as a 0-dim tensor in `dtype` on the embedding's device, as transformers multiplies by it (in
        bfloat16 it rounds). Made once per dtype and device: a tensor made from a Python number on a GPU is a copy
        from pageable memory, which makes the host wait for all queued work (at every pass)."""
        device = self.embed_tokens.weight.device
        scale = self._embed_scales.get((dtype, device))
        if scale is None:
            with torch.inference_mode(False):  # a plain tensor: autograd may save it in a later call
                scale = torch.tensor(self.config.hidden_size**0.5, dtype=dtype, device=device)
            self._embed_scales[(dtype, device)] = scale
        return scale

    def rope(self, positions: torch.Tensor, layer_type: str, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `(B, T, head_dim)` at `positions` `(B, T)` (or `(T,)`, shared: `(1, T, head_dim)`)."""
        positions = positions if positions.dim() == 2 else positions.unsqueeze(0)
        frequencies = positions[..., None].float() * getattr(self, f"{layer_type}_inv_freq").float()
        angles = torch.cat((frequencies, frequencies), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def decoder_key_mask(cache, layer: int, x: torch.Tensor, padded: bool, additive: bool) -> torch.Tensor | None:
    """The decoder's key mask `(B, 1, 1, cached + C)` over layer `layer`'s cache and the canvas `x` `(B, C, hidden)`
    (`cache.decoder_mask`; None: every key), for every layer of its kind: the caches keep the same slots and
    validity in all the sliding layers, and in all the full ones (they are written by the same columns). Bool for
    the GEMM and Triton attention, or with `additive` 0 / -inf in x's dtype for SDPA, which otherwise converts a
    bool mask in every layer (a few small kernels each: ~6 us of a layer at batch 1 on an H200)."""
    mask = cache.decoder_mask(layer, x[..., 0], padded)
    if mask is None or not additive:
        return mask
    # Rows in storage 16 elements aligned: SDPA's memory-efficient kernel copies a mask whose strides are not (the
    # 26B-A4B's sliding layers read 1,023 + 256 keys) into a padded one at every call.
    keys = mask.shape[-1]
    storage = torch.zeros(*mask.shape[:-1], -(-keys // 16) * 16, dtype=x.dtype, device=x.device)
    return storage[..., :keys].masked_fill_(~mask, float("-inf"))


# Where the decoder's Triton attention skips the cache's unwritten slots (`decoder_key_gap`); off: it reads them,
# masked.
SKIP_UNWRITTEN_SLOTS = True


def decoder_key_gap(cache, layer: int, backend: str) -> torch.Tensor | None:
    """The keys `(B, 2)` int32 [start, end) of layer `layer`'s cache that every query of the decoder's pass sees
    masked and the "triton" backend need not read: a static cache's slots after the last written one, per row (a
    sliding layer's ring: none once it has wrapped; a full layer's columns not yet reached; the canvas keys come
    after the slots). None elsewhere (other backends, the dynamic cache) or with `SKIP_UNWRITTEN_SLOTS` off. A few
    tensor ops, once per decoder pass and layer kind (the layers of a kind share their slots' validity, as
    `decoder_key_mask`)."""
    if not SKIP_UNWRITTEN_SLOTS or backend != "triton" or not isinstance(cache, DiffusionGemmaStaticCache):
        return None
    valid = cache.valid[layer]
    return None if valid is None else unwritten_slots(valid)


def unwritten_slots(valid: torch.Tensor) -> torch.Tensor:
    """valid `(B, slots)` bool, a cache's written slots -> `(B, 2)` int32 [start, end): each row's slots after its
    last written one (start 0 where none is written; empty, start = end, where the last slot is)."""
    slots = valid.shape[1]
    after_last = (valid * torch.arange(1, slots + 1, device=valid.device)).amax(dim=1)
    return torch.stack([after_last, torch.full_like(after_last, slots)], dim=1).to(torch.int32)


def encoder_key_mask(cache, layer: int, columns: torch.Tensor, valid: torch.Tensor, window: int | None) -> torch.Tensor:
    """The encoder's mask `(B, 1, T, cached + T)` bool over layer `layer`'s cache and the pass' own keys at `columns`
    `(T,)` (`valid` `(B, T)`: real tokens): a query sees the valid keys at its column or before, and within `window`
    columns in sliding layers (None: no window). One mask serves every layer of its kind: the caches keep the same
    columns and validity in all the sliding layers, and in all the full ones (`decoder_key_mask`), and a pass
    records its columns only after its last layer. Bool whatever the layer's backend (SDPA converts it in each
    layer: an additive mask made once would save that, given which backend each layer's encoder pass runs)."""
    key_columns, key_valid = columns, valid
    if cache.columns[layer] is not None:
        key_columns = torch.cat([cache.columns[layer], columns])
        key_valid = torch.cat([cache.valid[layer], valid], dim=1)
    visible = key_columns[None, :] <= columns[:, None]
    if window is not None:
        visible = visible & (key_columns[None, :] > columns[:, None] - window)
    return _valid_rows(visible[None] & key_valid[:, None, :])[:, None]


def _valid_rows(mask: torch.Tensor) -> torch.Tensor:
    """A query that may attend to no key (a padding position) attends to all instead: its output is never read,
    and an empty softmax would put NaN into K/V that later (masked) reads multiply by zero."""
    return mask | ~mask.any(-1, keepdim=True)


class DiffusionGemmaModel(nn.Module):
    """`encoder` (its layer scalars) and `decoder` (the shared text transformer), as the Hub names them."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.encoder = DiffusionGemmaEncoder(config)
        self.decoder = DiffusionGemmaDecoder(config)
        # The text config's tensor / expert parallel plans, under the decoder that holds the layers (the encoder
        # runs the same modules): what transformers' `tp_plan="auto"` collects from a base model's children.
        text = config.text_config
        self._tp_plan = {f"decoder.{name}": style for name, style in (text.base_model_tp_plan or {}).items()}
        self._ep_plan = {f"decoder.{name}": style for name, style in (text.base_model_ep_plan or {}).items()}


class DiffusionGemmaPreTrainedModel(QuantizesFromLoadDtype, PreTrainedModel):
    config_class = DiffusionGemmaConfig
    config: DiffusionGemmaConfig
    base_model_prefix = "model"
    _no_split_modules = ["DiffusionGemmaLayer"]
    _supports_sdpa = True
    # The vision tower and its projection are the checkpoint's but hf_dllm runs no image: left out on load, silently.
    _keys_to_ignore_on_load_unexpected = [r"^model\.encoder\.vision_tower\.", r"^model\.encoder\.embed_vision\."]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(mean=0.0, std=std)
        elif isinstance(module, DiffusionGemmaRMSNorm) and module.with_scale:
            module.weight.fill_(1.0)
        elif isinstance(module, DiffusionGemmaRouter):
            module.scale.fill_(1.0)
            module.per_expert_scale.fill_(1.0)
        elif isinstance(module, DiffusionGemmaExperts):
            module.gate_up_proj.normal_(mean=0.0, std=std)
            module.down_proj.normal_(mean=0.0, std=std)
        elif isinstance(module, (DiffusionGemmaLayer, DiffusionGemmaEncoderLayer)):
            module.layer_scalar.fill_(1.0)
        if isinstance(module, DiffusionGemmaDecoder):
            for kind, frequencies in module.rope_frequencies().items():
                getattr(module, f"{kind}_inv_freq").copy_(frequencies)


class DiffusionGemmaForBlockDiffusion(DiffusionGemmaPreTrainedModel, DiffusionGenerationMixin):
    """DiffusionGemma with its LM head (the embedding) and hf_dllm's `generate()`.

    `forward(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=...)` is transformers' call: the
    encoder writes the prompt into a fresh cache (or `cache`'s), the decoder denoises the canvas `(B, C)` at the
    positions after it; returns soft-capped float32 logits `(B, C, vocab)`.
    """

    _tied_weights_keys = {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    # generate()'s encoder cache: static (`DiffusionGemmaStaticCache`) or not; None: static on CUDA (the CPU keeps
    # the dynamic one, whose sums are in transformers' order). `capture_decoder`: the decoder's layers as CUDA
    # graphs where `CacheGraphs.applies`; `capture_encoder`: the encoder's passes too: over an accepted canvas
    # always, over a prompt from the second pass of its shape on (a one-off prompt length costs no capture), for at
    # most `prompt_graphs` prompt shapes per cache (a server's many lengths do not pile up graphs).
    static_cache: bool | None = None
    capture_decoder: bool = True
    capture_encoder: bool = True
    prompt_graphs: int = 4
    # An accepted canvas' encoder pass and the next canvas' first decoder pass as one pass through the layers
    # (`encode_and_decode`, where `fuses_canvas_passes`): each layer's weights read once for both instead of twice
    # (the canvas pass replays at 18 ms beside a 16 ms step at the 26B-A4B's batch 1 on an H200: 928 tokens/s
    # against 909 with the passes apart at 16 steps a canvas; `bench_diffusion_gemma.py`'s `hf_dllm apart` rows).
    fuse_canvas_passes: bool = True
    # The sampler's per-step inputs of a decoder pass (`decode`'s keywords, `EntropyBoundSampler.forward_inputs`).
    decoder_inputs = ("self_conditioning_logits", "self_conditioning_probabilities", "capped_logits")
    # No plan for the head: it is the input embedding, which stays whole on every rank (the tie wins over a column
    # plan, whose gather would then concatenate whole copies: logits of 2 x vocab columns).
    _tp_plan = {}
    diffusion_families = (DIFFUSION_GEMMA,)

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__(config)
        text = config.text_config
        self.model = DiffusionGemmaModel(config)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.final_logit_softcapping = text.final_logit_softcapping
        self._graphs = None  # `CacheGraphs`, made at the first captured pass
        self._generate_cache = None  # generate()'s static cache, reused by the next call (`_diffusion_new_cache`)
        self.generation_config = DiffusionGenerationConfig(**DIFFUSION_GEMMA.model_generation_defaults(config))
        self.post_init()

    def set_decoder_attention(self, backend: str) -> None:
        """Every layer's attention: "sdpa", "gemm" or "triton" (`DiffusionGemmaAttention`), or None (the default
        choice per layer); captured graphs are dropped (they hold the other kernels)."""
        if backend is not None and backend not in DiffusionGemmaAttention.backends:
            raise ValueError(f"`backend` must be one of {DiffusionGemmaAttention.backends} or None, got {backend!r}.")
        if backend == "triton" and not MOE_KERNELS_AVAILABLE:
            raise ValueError("the Triton attention needs the `triton` package (pip install hf-dllm[triton]).")
        for layer in self.model.decoder.layers:
            layer.self_attn.backend = backend
        self._graphs = None

    def get_input_embeddings(self):
        return self.model.decoder.embed_tokens

    def set_input_embeddings(self, value):
        self.model.decoder.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    # -- the two passes ---------------------------------------------------------------------------------------
    def encode(self, input_ids, columns, valid, cache, positions=None, end: int | None = None) -> None:
        """Encoder pass: run the text transformer causally on `input_ids` `(B, T)` at columns `columns` `(T,)`
        (causality and sliding windows count columns), keys `valid` `(B, T)` bool, RoPE at `positions` `(B, T)`
        (default: the columns; transformers' positions, left padding shifting a row's), appending every layer's
        K/V to `cache`. `end`: `columns[-1] + 1` where the caller knows it on the host (None: read from the device,
        which waits for the queued work). The layers of a pass over `canvas_length` columns (an accepted canvas)
        run as a CUDA graph where `CacheGraphs.applies` (`capture_encoder`), those of a prompt's pass from the
        second pass of its shape on (`prompt_graphs`)."""
        x = self.encoder_input(input_ids)
        end = int(columns[-1]) + 1 if end is None else end
        cache.prepare(input_ids.shape[0], x.dtype, x.device, end)
        positions = columns if positions is None else positions
        canvas = x.shape[1] == self.config.canvas_length
        inputs = (x, columns, valid, positions)
        graphs = self._cache_graphs() if self.capture_encoder and CacheGraphs.applies(self, x, cache) else None
        if graphs is not None and (
            canvas or graphs.seen_before(self.encoder_layers, cache, inputs, self.prompt_graphs)
        ):
            graphs.run(self.encoder_layers, cache, inputs)
        else:
            self.encoder_layers(*inputs, cache)
        cache.length = end

    def encoder_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's first layer's input `(B, T, hidden)`: the tokens' scaled embeddings."""
        decoder = self.model.decoder
        return decoder.embed_tokens(input_ids) * decoder.embed_scale(decoder.embed_tokens.weight.dtype)

    def encoder_layers(self, x, columns, valid, positions, cache) -> None:
        """The encoder's layers on its input `x` `(B, T, hidden)` (`encode`'s other arguments), writing the K/V and
        the columns' facts into `cache` (after its `prepare`): a pure tensor function of them and the cache's
        tensors, what `CacheGraphs` captures over a static cache."""
        decoder, text = self.model.decoder, self.config.text_config
        cache.begin_write(columns)
        rope = {kind: decoder.rope(positions, kind, x.dtype) for kind in set(text.layer_types)}
        masks = self.encoder_masks(cache, columns, valid)
        last = len(decoder.layers) - 1
        for index, layer in enumerate(decoder.layers):
            kind = text.layer_types[index]
            scalar = self.model.encoder.language_model.layers[index].layer_scalar
            x = layer(x, *rope[kind], cache, masks[kind], True, scalar, attention_only=index == last)
        cache.record(columns, valid)

    def encoder_masks(self, cache, columns: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """An encoder pass' masks over `cache` (`encoder_key_mask`), per layer kind (once per kind, not per
        layer: the layers of a kind keep the same columns)."""
        text = self.config.text_config
        return {
            kind: encoder_key_mask(
                cache,
                text.layer_types.index(kind),
                columns,
                valid,
                text.sliding_window if kind == "sliding_attention" else None,
            )  # fmt: skip
            for kind in set(text.layer_types)
        }

    def decoder_mask_and_gap(self, index: int, x: torch.Tensor, cache, padded: bool, seen: dict) -> tuple:
        """A decoder pass' key mask (`decoder_key_mask`, additive for SDPA) and key gap (`decoder_key_gap`) at layer
        `index` for its input `x`, built once per layer kind and backend (kept in `seen`, one dict per pass)."""
        kind = self.config.text_config.layer_types[index]
        backend = self.model.decoder.layers[index].self_attn.chosen_backend(x)
        if (kind, backend) not in seen:
            first = self.config.text_config.layer_types.index(kind)
            mask = decoder_key_mask(cache, first, x, padded, additive=backend == "sdpa")
            seen[kind, backend] = (mask, decoder_key_gap(cache, first, backend))
        return seen[kind, backend]

    def _cache_graphs(self) -> CacheGraphs:
        if self._graphs is None:
            self._graphs = CacheGraphs()
        return self._graphs

    def decode(
        self,
        canvas: torch.Tensor,
        positions: torch.Tensor,
        cache,
        self_conditioning_logits=None,
        padded=True,
        self_conditioning_probabilities=None,
        capped_logits=True,
    ):
        """Decoder pass: logits `(B, C, vocab)` (float32, soft-capped) for the canvas `canvas` `(B, C)` at positions
        `positions` `(C,)` or `(B, C)`, attending bidirectionally to `cache`'s K/V (padding hidden where `padded`) and
        its own; `self_conditioning_logits` `(B, C, vocab)`: the previous step's processed logits (None: zero
        signal), or `self_conditioning_probabilities` `(B, C, vocab)`: their softmax already in the weights' dtype
        (the fused sampler's). `capped_logits=False`: the LM head's raw output in the weights' dtype instead (the
        fused sampler caps it). The layers run as a CUDA graph where `CacheGraphs.applies` (a static cache on CUDA,
        grouped experts; `capture_decoder`)."""
        x = self.decoder_input(canvas, self_conditioning_logits, self_conditioning_probabilities)
        if self.capture_decoder and CacheGraphs.applies(self, x, cache):
            hidden = self._cache_graphs().run(self.decoder_layers, cache, (x, positions), padded)
        else:
            hidden = self.decoder_layers(x, positions, cache, padded)
        if not capped_logits:
            return self.head_product(hidden)
        return self.head_logits(hidden)

    def decoder_input(self, canvas, self_conditioning_logits=None, self_conditioning_probabilities=None):
        """The decoder's first layer's input `(B, C, hidden)`: the canvas' embeddings with the self-conditioning
        signal (`decode`'s arguments)."""
        decoder = self.model.decoder
        weight = whole_tensor(decoder.embed_tokens.weight)  # (whole on every rank: see `head_product`)
        scale = decoder.embed_scale(weight.dtype)
        x = decoder.embed_tokens(canvas) * scale
        signal = None
        if self_conditioning_logits is not None and self_conditioning_probabilities is not None:
            raise ValueError("Pass `self_conditioning_logits` or `self_conditioning_probabilities`, not both.")
        if self_conditioning_probabilities is not None:
            flat = self_conditioning_probabilities.reshape(-1, self_conditioning_probabilities.shape[-1])
            signal = (torch.matmul(flat.to(weight.dtype), weight) * scale.to(x.dtype)).view(x.shape)
        elif self_conditioning_logits is not None:
            # softmax(s) @ E * sqrt(hidden), by chunks of rows (`row_chunks`: no whole float32 softmax copy).
            flat = self_conditioning_logits.reshape(-1, self_conditioning_logits.shape[-1])
            signal = x.new_empty(x.shape).view(flat.shape[0], -1)
            for part in row_chunks(*flat.shape):
                soft = flat[part].softmax(dim=-1, dtype=torch.float32).to(weight.dtype)
                signal[part] = torch.matmul(soft, weight) * scale.to(x.dtype)
            signal = signal.view(x.shape)
        return decoder.self_conditioning(x, signal)

    def head_product(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's raw output `(..., vocab)` in the weights' dtype, its weight whole on every rank under a
        parallel plan: the head has none (the tie to the input embedding wins), but transformers 5.17's tensor
        parallelism makes the tied weight a `DTensor`, which a product with plain activations refuses."""
        weight = whole_tensor(self.lm_head.weight)
        return self.lm_head(hidden) if weight is self.lm_head.weight else nn.functional.linear(hidden, weight)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`cap * tanh(lm_head(hidden) / cap)` in float32 `(B, C, vocab)` from `hidden` `(B, C, hidden)`, by chunks
        of rows (`row_chunks`: the head's output in the weights' dtype never whole beside its float32 copy)."""
        cap = self.final_logit_softcapping
        flat = hidden.reshape(-1, hidden.shape[-1])
        vocab = self.lm_head.weight.shape[0]
        logits = torch.empty(flat.shape[0], vocab, dtype=torch.float32, device=hidden.device)
        for part in row_chunks(flat.shape[0], vocab):
            logits[part] = self.head_product(flat[part]).float().div_(cap).tanh_().mul_(cap)
        return logits.view(*hidden.shape[:-1], vocab)

    def decoder_layers(self, x: torch.Tensor, positions: torch.Tensor, cache, padded: bool) -> torch.Tensor:
        """The decoder's layers and final norm on its input `x` `(B, C, hidden)` (a pure tensor function of `x`,
        `positions` and the cache's tensors: what `CacheGraphs` captures)."""
        decoder, text = self.model.decoder, self.config.text_config
        rope = {kind: decoder.rope(positions, kind, x.dtype) for kind in set(text.layer_types)}
        seen: dict = {}
        normed = None  # the next layer's input norm, where its predecessor's end kernel computed it
        for index, layer in enumerate(decoder.layers):
            mask, gap = self.decoder_mask_and_gap(index, x, cache, padded, seen)
            # The next layer's input norm from this layer's end kernel where it can (`norm_in_end_kernel`).
            next_norm = decoder.layers[index + 1].input_layernorm if index + 1 < len(decoder.layers) else None
            out = layer(
                x, *rope[text.layer_types[index]], cache, mask, False, key_gap=gap, normed_input=normed,
                next_norm=next_norm,
            )  # fmt: skip
            x, normed = out if next_norm is not None else (out, None)
        return decoder.norm(x)

    def encode_and_decode(
        self, input_ids, columns, valid, cache, positions, end: int, canvas, canvas_positions, padded: bool,
        **decoder_kwargs,
    ) -> torch.Tensor:  # fmt: skip
        """`encode(input_ids, columns, valid, cache, positions, end)` over an accepted canvas (`canvas_length`
        columns) and then `decode(canvas, canvas_positions, cache, ...)` over the next, as one pass through the
        layers (`encoder_decoder_layers`: each layer's weights read once for both); the same result up to the
        products' rounding. Only where `fuses_canvas_passes` says so."""
        x_encoder = self.encoder_input(input_ids)
        cache.prepare(input_ids.shape[0], x_encoder.dtype, x_encoder.device, end)
        capped = decoder_kwargs.pop("capped_logits", True)
        x_decoder = self.decoder_input(canvas, **decoder_kwargs)
        inputs = (x_encoder, columns, valid, positions, x_decoder, canvas_positions)
        if self.capture_decoder and self.capture_encoder and CacheGraphs.applies(self, x_decoder, cache):
            hidden = self._cache_graphs().run(self.encoder_decoder_layers, cache, inputs, padded)
        else:
            hidden = self.encoder_decoder_layers(*inputs, cache, padded)
        cache.length = end
        return self.head_logits(hidden) if capped else self.head_product(hidden)

    def fuses_canvas_passes(self, input_ids: torch.Tensor, cache) -> bool:
        """Whether `_diffusion_forward` runs an accepted canvas' encoder pass `input_ids` `(B, C)` and the next
        canvas' first decoder pass as one (`encode_and_decode`): `fuse_canvas_passes` on, the fused kernels (which
        the pair's layers run), a static cache (whose canvas slots both passes write in turn), no autograd."""
        return (
            self.fuse_canvas_passes
            and input_ids.shape[1] == self.config.canvas_length
            and isinstance(cache, DiffusionGemmaStaticCache)
            and use_fused_kernels(input_ids)
            and not torch.is_grad_enabled()
        )

    def encoder_decoder_layers(self, x_encoder, columns, valid, positions, x_decoder, canvas_positions, cache, padded):
        """`encoder_layers` on `x_encoder` and `decoder_layers` on `x_decoder` (both `(B, C, hidden)`) in one pass
        through the layers (`DiffusionGemmaLayer.forward_pair`): per layer the encoder's attention writes its K/V
        before the decoder's reads them. The encoder's masks are built before its columns are recorded, the
        decoder's after (as the two passes apart see the cache). Returns the decoder's final hidden states."""
        decoder, text = self.model.decoder, self.config.text_config
        kinds = sorted(set(text.layer_types))
        cache.begin_write(columns)
        encoder_rope = {kind: decoder.rope(positions, kind, x_encoder.dtype) for kind in kinds}
        decoder_rope = {kind: decoder.rope(canvas_positions, kind, x_decoder.dtype) for kind in kinds}
        encoder_masks = self.encoder_masks(cache, columns, valid)
        cache.record(columns, valid)
        x, rows, seen, normed = torch.cat([x_encoder, x_decoder]), x_encoder.shape[0], {}, None
        last = len(decoder.layers) - 1
        for index, layer in enumerate(decoder.layers):
            kind = text.layer_types[index]
            mask, gap = self.decoder_mask_and_gap(index, x_decoder, cache, padded, seen)
            scalar = self.model.encoder.language_model.layers[index].layer_scalar
            next_norm = decoder.layers[index + 1].input_layernorm if index < last else None
            x, normed = layer.forward_pair(
                x, rows, encoder_rope[kind], decoder_rope[kind], cache, (encoder_masks[kind], mask), scalar,
                index == last, gap, normed, next_norm,
            )  # fmt: skip
        return decoder.norm(x)  # (the last layer returned the decoder's rows alone)

    def new_encoder_cache(self) -> DiffusionGemmaEncoderCache:
        return DiffusionGemmaEncoderCache(self.config.text_config)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DiffusionGemmaEncoderCache | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        self_conditioning_logits: torch.Tensor | None = None,
        **kwargs,
    ) -> DiffusionGemmaOutput:
        """transformers' call: encode `input_ids` `(B, T)` (left-padded per `attention_mask`) into `cache` (a
        fresh one by default), then denoise `decoder_input_ids` `(B, C)` (required: hf_dllm draws no canvas here)
        at the positions after the cached ones. Returns `logits` `(B, C, vocab)` and the `cache`."""
        images = sorted(name for name in IMAGE_INPUTS if kwargs.get(name) is not None)
        if images:
            raise ValueError(f"{images}: hf_dllm's DiffusionGemma runs text only (the vision tower is not loaded).")
        unknown = sorted(
            name for name, value in kwargs.items() if value is not None and name not in ("use_cache", "return_dict")
        )
        if unknown:
            raise TypeError(f"DiffusionGemmaForBlockDiffusion.forward() got unexpected arguments {unknown}.")
        if decoder_input_ids is None:
            raise ValueError("`decoder_input_ids` (the canvas `(batch, canvas_length)`) is required.")
        if cache is None:
            if input_ids is None:
                raise ValueError("Either `input_ids` or `cache` must be provided.")
            cache = self.new_encoder_cache()
        padded = False
        if input_ids is not None:
            valid = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
            if attention_mask is not None:
                valid = attention_mask[:, -input_ids.shape[1] :].bool()
                padded = not bool(valid.all())
            end = cache.length + input_ids.shape[1]
            columns = torch.arange(cache.length, end, device=input_ids.device)
            self.encode(input_ids, columns, valid, cache, end=end)
        length = decoder_input_ids.shape[1]
        columns = torch.arange(cache.length, cache.length + length, device=decoder_input_ids.device)
        logits = self.decode(decoder_input_ids, columns, cache, self_conditioning_logits, padded=padded)
        return DiffusionGemmaOutput(logits=logits, cache=cache)

    # -- hf_dllm's loop ---------------------------------------------------------------------------------------
    def adjust_generation_fn(
        self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, *args, **kwargs
    ):
        """As `DiffusionGenerationMixin.adjust_generation_fn`; fields a generation_config.json leaves unset take
        transformers' defaults where they differ from hf_dllm's (`original_defaults`: `max_new_tokens` 256)."""
        super().adjust_generation_fn(
            generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, *args, **kwargs
        )
        if generation_config is None and pretrained_model_name_or_path is not None:
            loading = {
                k: kwargs[k] for k in ("cache_dir", "local_files_only", "token", "revision", "subfolder") if k in kwargs
            }
            path = cached_file(
                pretrained_model_name_or_path,
                "generation_config.json",
                _raise_exceptions_for_missing_entries=False,
                **loading,
            )
            written = json.loads(Path(path).read_text()) if path is not None else {}
            for name, value in DIFFUSION_GEMMA.original_defaults.items():
                if written.get(name) is None:
                    setattr(self.generation_config, name, value)

    def _diffusion_new_cache(self, batch_size, max_length, kv_cache_dtype=None, max_positions=None):
        """The encoder cache of a run: static on CUDA (`static_cache`). `generate()`'s calls (no `max_positions`)
        reuse the model's last static cache, emptied, when it has `batch_size` rows and room for `max_length`
        columns, as transformers' static caches are reused: its buffers stay in place, so the captured graphs
        (`CacheGraphs`, keyed on the cache) replay instead of being captured again at every call (~0.3 s
        at the 26B-A4B shape). Like transformers' static cache, this makes concurrent `generate()` calls on one
        model object unsafe. The serving engine (`max_positions` given) keeps a cache of its own."""
        static = self.static_cache if self.static_cache is not None else self.device.type == "cuda"
        if not static:
            return self.new_encoder_cache()
        held = self._generate_cache if max_positions is None else None
        if held is not None and held.fits(batch_size, max_length, self.dtype, self.device):
            held.set_length(0)
            return held
        cache = DiffusionGemmaStaticCache(
            self.config.text_config, max_length, self.config.canvas_length, heads=self.cache_heads()
        )
        if max_positions is None:
            self._generate_cache = cache
        return cache

    def cache_heads(self) -> list[tuple[int, int]]:
        """(head_dim, key/value heads) per layer as this rank holds them (`DiffusionGemmaStaticCache`'s `heads`):
        under tensor parallelism each rank computes and caches its own share of the key/value heads."""
        heads = []
        for layer in self.model.decoder.layers:
            attention = layer.self_attn
            heads.append((attention.head_dim, local_shape(attention.k_proj.weight)[0] // attention.head_dim))
        return heads

    def _diffusion_attention_mask(self, key_mask: torch.Tensor, q_len: int):
        # The forward reads which columns are real tokens; the masks are built per pass from them.
        return key_mask.bool()

    def _diffusion_step_capturable(self) -> bool:
        # The loop's own step graphs (greedy steps) do not apply: the sampler draws random numbers and a canvas'
        # first step runs the encoder; the layers of both passes are captured by the model itself (`CacheGraphs`).
        return False

    def _diffusion_forward(
        self, input_ids, attention_mask, position_ids, cache, cache_position, logits_slice, **forward_kwargs
    ) -> torch.Tensor:
        """A step of the loop (`EncoderPrefixCache`): `input_ids` and `position_ids` `(B, q)` are the consecutive
        columns `cache_position` `(q,)`, the canvas being the last `canvas_length`; at a canvas' first step the columns
        before it that the cache does not hold yet (the prompt, the previous canvas; after the serving engine's
        `set_length`, the whole prefix) are encoded first. `attention_mask` `(B, width)` bool: real tokens (None:
        all); `self_conditioning_logits` or `self_conditioning_probabilities` and `capped_logits` in
        `forward_kwargs` (the sampler's, `EntropyBoundSampler.forward_inputs`)."""
        length = self.config.canvas_length
        # The one host read of a canvas' first step (none at later steps): the first fed column; the columns are
        # consecutive, so the encoder's end (the canvas' first column) follows without another.
        first = int(cache_position[0]) if input_ids.shape[1] > length else None
        start = None if first is None else cache.length - first
        if start is not None and start < input_ids.shape[1] - length:
            columns = cache_position[start:-length]
            valid = (
                attention_mask[:, columns]
                if attention_mask is not None
                else torch.ones(input_ids.shape[0], len(columns), dtype=torch.bool, device=input_ids.device)
            )
            end = first + input_ids.shape[1] - length
            encoded = input_ids[:, start:-length]
            if self.fuses_canvas_passes(encoded, cache):
                return self.encode_and_decode(
                    encoded, columns, valid, cache, position_ids[:, start:-length], end, input_ids[:, -length:],
                    position_ids[:, -length:], attention_mask is not None,
                    **{name: forward_kwargs[name] for name in self.decoder_inputs if name in forward_kwargs},
                )  # fmt: skip
            self.encode(encoded, columns, valid, cache, position_ids[:, start:-length], end)
        return self.decode(
            input_ids[:, -length:],
            position_ids[:, -length:],
            cache,
            forward_kwargs.get("self_conditioning_logits"),
            padded=attention_mask is not None,
            self_conditioning_probabilities=forward_kwargs.get("self_conditioning_probabilities"),
            capped_logits=forward_kwargs.get("capped_logits", True),
        )

    def resolve_generation_config(self, generation_config=None, **fields) -> DiffusionGenerationConfig:
        """As `DiffusionGenerationMixin.resolve_generation_config`, with DiffusionGemma's rules
        (`DiffusionGemmaFamily.complete`): canvases of `canvas_length`, `max_new_tokens` rounded up to whole
        canvases (the output is not cut, as transformers'), transformers' defaults for unset sampler fields."""
        images = sorted(name for name in IMAGE_INPUTS if name in fields)
        if images:
            raise ValueError(f"{images}: hf_dllm's DiffusionGemma runs text only (image inputs are not supported).")
        config = DiffusionGenerationMixin.resolve_generation_config(self, generation_config, **fields)
        # The exporter resolves settings on a stand-in without a model config: it writes them as set (unset sampler
        # fields stay None, transformers' defaults at call time).
        model_config = getattr(self, "config", None)
        return config if model_config is None else DIFFUSION_GEMMA.complete(config, model_config, fields)

    @torch.no_grad()
    def generate(
        self,
        inputs=None,
        generation_config=None,
        streamer=None,
        stopping_criteria=None,
        unmasking_policy=None,
        **kwargs,
    ):
        """hf_dllm's `generate()` (the block loop) with DiffusionGemma's sampler: every argument of transformers'
        `DiffusionGemmaForBlockDiffusion.generate` that hf_dllm provides (`max_new_tokens`, `max_denoising_steps`,
        `sampler_config`, `t_min`, `t_max`, `stability_threshold`, `confidence_threshold`, `eos_token_id`,
        `pad_token_id`, `attention_mask`, `return_dict_in_generate`, `streamer`). Reproduces transformers' draws
        under the same seed. Sequences stop at the last canvas decoded (every row ended at an EOS: fewer canvases),
        as transformers'. `unmasking_policy`: a sampler object replacing the family's (`EntropyBoundSampler`)."""
        run = self.generate_blocks(
            inputs, generation_config, streamer, stopping_criteria, unmasking_policy=unmasking_policy, **kwargs
        )
        sequences = run.run()[:, : run.block_end]
        if run.config.return_dict_in_generate:
            from .generation_utils import DiffusionGenerateOutput

            return DiffusionGenerateOutput(sequences=sequences, nfe=run.nfe, nfe_per_row=run.nfe_per_row)
        return sequences


__all__ = [
    "CacheGraphs",
    "DiffusionGemmaEncoderCache",
    "DiffusionGemmaForBlockDiffusion",
    "DiffusionGemmaPreTrainedModel",
    "DiffusionGemmaStaticCache",
]
