"""LLaDA-MoE masked-diffusion MoE language model for transformers 5.

inclusionAI's LLaDA-MoE (`inclusionAI/LLaDA-MoE-7B-A1B-Base`, `-Instruct`, `-Instruct-TD`): a bidirectional mask
predictor, decoded like LLaDA, on an OLMoE-style MoE body. The module tree reproduces the Hub checkpoints' parameter
names (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `self_attn.{q,k}_norm`,
`model.layers.{i}.mlp.gate.weight`, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, dense layers'
`mlp.{gate,up,down}_proj`, the shared expert `model.layers.{i}.shared_expert.*`, `model.norm.weight`,
`lm_head.weight`), so `from_pretrained` reads the Hub's safetensors unchanged. The math follows the original
`modeling_lladamoe.py`:

- each layer `h = x + o_proj(attn(input_layernorm(x)))`, then `h + mlp(post_attention_layernorm(h))` (plus the
  shared expert of the same normed input in MoE layers, when there is one); RMS norms normalise in float32, cast
  back to the input dtype, then scale;
- attention: per-head RMS norm of queries and keys (`qk_layernorm`, one weight of size `head_dim` each) before
  RoPE, optional clamping (`clip_qkv`), partial rotate-half RoPE on the first `int(head_dim *
  partial_rotary_factor)` dims (cos/sin computed in float32, applied in the model dtype), grouped-query attention,
  **bidirectional** (no causal mask; a 2D padding mask hides padded keys), scale `1/sqrt(head_dim)`;
- MoE: router logits `gate(x)`, softmax in float32 (plus `expert_bias` if the config enables it), the
  `num_experts_per_tok` largest probabilities weight their experts' SwiGLU outputs **unnormalised** (the original
  hard-codes `norm_topk_prob` off), summed in the model dtype.

The routed experts (`LLaDAMoESparseMoeBlock`) run as a plain loop over the experts the tokens selected (each expert
on its own tokens, its output times the routing weight added in place: the original's arithmetic; always in
float32), or, in half precision, without host synchronisation (`generate()` then captures its steps in CUDA
graphs): where hf_dllm's Triton kernels run (CUDA), as LLaDA2's fused MoE kernels (`triton_moe.py`'s router,
alignment and combine, `grouped_gemm.py`'s grouped products, bf16 or FP8 weights; at a block step's few tokens the
router's product, top-k and alignment are one kernel, and the combine also computes the next layer's input norm),
elsewhere as torch's grouped GEMMs, both over stacked views of the same weights. FP8
(`fp8.fp8_quantization_config("llada_moe")`) quantizes every projection but the routers and the output head; its
layers run through `kernels.linear`.

Attention dispatches through transformers' `ALL_ATTENTION_FUNCTIONS` (`eager` is this file's reference function,
`sdpa`, `flex_attention`, `flash_attention_2`, ...; by default `llada_triton`, LLaDA's: the split-KV kernel on CUDA
block steps, sdpa elsewhere); a `packed.PackedRows` mask runs it once per packed row. Padding: a 2D
`attention_mask` masks padded keys and RoPE positions count from each row's first real token, so a left-padded row
computes what it computes alone. Caches: a `DiffusionKVCache` (`past_key_values`, written in place at
`cache_position`, attention over the whole sequence) gives `generate()` the prefix and dual caches of Fast-dLLM; a
transformers `DynamicCache` is appended to.

This file is exported verbatim as Hub remote code: relative imports only.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import TRITON_ATTENTION, register_attention_backends
from .cache import (
    KV_CACHE_DTYPES,
    DiffusionKVCache,
    FP8DiffusionKVCache,
    PositionTables,
    cache_output,
    output_cache,
    resolve_forward_positions,
)
from .configuration_llada_moe import LLaDAMoEConfig
from .family_llada_moe import LLADA_MOE
from .fp8 import QuantizesFromLoadDtype, fp8_block_size, fp8_kernel_supports, is_fp8_linear
from .generation_utils import DiffusionGenerationConfig, DiffusionGenerationMixin, select_positions
from .grouped_gemm import (
    ExpertDispatch,
    ExpertList,
    ExpertStacks,
    grouped_matmul,
    other_ranks_expert_keys,
)
from .kernels import ConcatenatedProjections, linear, use_fused_kernels
from .packed import run_attention
from .tensor_parallel import is_sharded
from .triton_moe import TRITON_AVAILABLE as MOE_KERNELS_AVAILABLE  # (`from .x import`: how the Hub finds the file)
from .triton_moe import (
    align_by_expert,
    combine,
    combine_and_norm,
    qk_norm_rope_to_cache,
    route_by,
)
from .triton_ops import rms_norm

register_attention_backends()


class LLaDAMoERMSNorm(nn.Module):
    """RMS norm as in the original (OLMoE's): normalise in float32, cast back to the input dtype, then scale."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(hidden_states):
            # The same arithmetic in one kernel (LLaDA2's `triton_ops.rms_norm`): eight PyTorch kernels otherwise.
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def add_and_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(hidden_states + residual), hidden_states + residual)`: one kernel where the fused kernels run."""
        if use_fused_kernels(hidden_states):
            return rms_norm(hidden_states, self.weight, self.variance_epsilon, residual=residual)
        total = hidden_states + residual
        return self(total), total

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def rotary_cos_sin(
    position_ids: torch.Tensor, config: LLaDAMoEConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for `position_ids` `(batch, q_len)`: cos, sin `(batch, q_len, rotary_width)` in `dtype`.

    As the original rotary embedding (transformers' default RoPE): inverse frequencies
    `rope_theta ** (-arange(0, dim, 2) / dim)` and angles in float32 (`dim` = `int(head_dim * partial_rotary_factor)`;
    an odd `dim` gives `dim + 1` rotated dims, as there), cast to the model dtype afterwards. Linear `rope_scaling`
    divides the frequencies by its factor."""
    dim = config.rotary_embedding_dim()
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "linear":
        inv_freq = inv_freq / scaling["factor"]
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first `cos.shape[-1]` dims of each head of q `(b, h, L, d)` and k `(b, h_kv, L, d)`; the
    remaining dims pass through. cos, sin `(b, L, rotary_dim)`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim == 0:  # `int(head_dim * partial_rotary_factor)` = 0: no frequency, nothing rotates
        return q, k
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`(batch, kv_heads, len, dim)` -> `(batch, kv_heads * n_rep, len, dim)` for grouped-query attention: key/value
    head j serves query heads `j * n_rep .. j * n_rep + n_rep - 1`."""
    if n_rep == 1:
        return hidden_states
    batch, kv_heads, length, dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(batch, kv_heads, n_rep, length, dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, length, dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention. query `(b, h, q, d)`, key/value `(b, h_kv, k, d)`, mask `(b, 1, q, k)` (bool, True =
    attend, or additive float). Returns the output `(b, q, h, d)` and the weights `(b, h, q, k)`. No causal mask:
    LLaDA-MoE is bidirectional."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
        else:
            weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


class LLaDAMoEAttention(ConcatenatedProjections):
    """Bidirectional multi-head attention with per-head q/k RMS norms, optional q/k/v clamping and partial RoPE.

    It is the `module` handed to the attention functions, hence `is_causal`, `num_key_value_groups`, `layer_idx`
    and `scaling` on it. With a `DiffusionKVCache` where the fused kernels run (`uses_fused_path`), q/k/v are one
    product (`ConcatenatedProjections`) and the q/k norms, RoPE and the cache write one kernel (LLaDA2's
    `triton_moe.qk_norm_rope_to_cache`, the same rounding points): two launches instead of about thirty."""

    # The layers multiplied as one matrix on the fused path (`ConcatenatedProjections`).
    _QKV = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config: LLaDAMoEConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # A mask predictor sees the whole sequence: no backend may add a causal mask of its own.
        self.is_causal = False
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout or 0.0
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.qk_layernorm:
            self.q_norm = LLaDAMoERMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = LLaDAMoERMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask=None,
        past_key_values: Cache | DiffusionKVCache | None = None,
        cache_position: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states `(batch, q_len, hidden)`; position_embeddings: cos, sin `(batch, q_len, rotary_dim)`."""
        batch, q_len, _ = hidden_states.shape
        if self.uses_fused_path(hidden_states, past_key_values, cache_position):
            query, key, value = self._fused_inputs(hidden_states, position_embeddings, past_key_values, cache_position)
        else:
            query = linear(self.q_proj, hidden_states).view(batch, q_len, self.num_heads, self.head_dim)
            key = linear(self.k_proj, hidden_states).view(batch, q_len, self.num_kv_heads, self.head_dim)
            value = linear(self.v_proj, hidden_states).view(batch, q_len, self.num_kv_heads, self.head_dim)
            if self.config.qk_layernorm:
                query, key = self.q_norm(query), self.k_norm(key)
            clip = self.config.clip_qkv
            if clip is not None:
                query, key, value = (t.clamp(min=-clip, max=clip) for t in (query, key, value))
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            cos, sin = position_embeddings
            query, key = apply_partial_rotary_pos_emb(query, key, cos, sin)
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, self.layer_idx, {"cache_position": cache_position})
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn = run_attention(  # a `PackedRows` mask: once per packed row, each row attending to itself
            attention_interface,
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return linear(self.o_proj, attn.reshape(batch, q_len, -1))

    def uses_fused_path(self, hidden_states: torch.Tensor, past_key_values, cache_position) -> bool:
        """Whether `forward` makes its attention inputs with `_fused_inputs`: a (bf16 / fp32) `DiffusionKVCache`
        written at `cache_position`, the fused kernels (`kernels.use_fused_kernels`), inference, no `clip_qkv` and a
        head size that is a power of two."""
        return (
            isinstance(past_key_values, DiffusionKVCache)
            and not isinstance(past_key_values, FP8DiffusionKVCache)
            and cache_position is not None
            and MOE_KERNELS_AVAILABLE
            and use_fused_kernels(hidden_states)
            and not self.training
            and self.config.clip_qkv is None
            and self.head_dim & (self.head_dim - 1) == 0
        )

    def _fused_inputs(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        past_key_values: DiffusionKVCache,
        cache_position: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention inputs as the unfused branch of `forward` makes them, in two launches: query `(batch,
        heads, q_len, head_dim)` (normed, rotated) and this layer's cache K/V `(batch, kv_heads, length, head_dim)`
        with the normed, rotated keys and the values written at `cache_position`."""
        batch = hidden_states.shape[0]
        keys, values = past_key_values.layer(self.layer_idx, batch, self.num_kv_heads, self.head_dim, hidden_states)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.config.qk_layernorm else (None, None)
        cos, sin = position_embeddings
        query = qk_norm_rope_to_cache(
            self.project(hidden_states, self._QKV),
            self.num_heads,
            self.num_kv_heads,
            *norms,
            self.config.rms_norm_eps,
            cos,
            sin,
            keys,
            values,
            cache_position,
        )
        return query, keys, values


class LLaDAMoEMLP(nn.Module):
    """SwiGLU MLP `down_proj(act(gate_proj(x)) * up_proj(x))`: a routed expert, the shared expert or a dense layer's."""

    def __init__(self, config: LLaDAMoEConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, self.act_fn(linear(self.gate_proj, x)) * linear(self.up_proj, x))


# Experts implementations (`config._experts_implementation`, transformers' `experts_implementation=` argument).
EXPERTS_EAGER = "eager"
EXPERTS_GROUPED_MM = "grouped_mm"
EXPERTS_IMPLEMENTATIONS = (EXPERTS_EAGER, EXPERTS_GROUPED_MM)


def _grouped_mm_function() -> Callable | None:
    """torch's grouped GEMM (`nn.functional.grouped_mm`, `torch._grouped_mm` before), or None where torch has none."""
    return getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class LLaDAMoESparseMoeBlock(nn.Module):
    """The routed experts of a MoE layer: `gate` (the router, `num_experts x hidden`, no bias) and `experts`.

    Routing as the original: softmax of the router logits in float32, plus `expert_bias` where the config enables
    it (a buffer, saved with the weights), the `num_experts_per_tok` largest values and their experts; those values,
    cast to the model dtype and **not renormalised**, weight the experts' outputs, which are added up per token in
    expert order.

    The experts run in one of three ways that compute the same thing (the last two up to rounding):

    - the loop (the reference, and always in float32, so a float32 model is the original's arithmetic): each
      expert that tokens chose, on its tokens; the per-expert counts are read on the host once per layer;
    - the fused kernels (`uses_fused_kernels`: half precision where hf_dllm's Triton kernels run, LLaDA2's): the
      router's top-k, the alignment of the (token, choice) pairs by expert and the weighted sum of each token's
      rows (in float32) are `triton_moe.py`'s kernels (for a block step's few tokens the router's product too),
      the gated up-projection and the down-projection `grouped_gemm.py`'s grouped
      products over the stacked weights (`stacks`), bf16 or FP8; no host synchronisation;
    - grouped (elsewhere, half-precision activations, `grouped_mm_dtypes`, where torch's grouped GEMM runs,
      without autograd): the pairs sorted by expert, two of torch's grouped GEMMs over the stacks, no host
      synchronisation.

    The stacks are the experts' weights stacked, the Hub-named parameters re-pointed to views of them (no second
    copy; `save_pretrained` still writes one tensor per name). `experts_implementation="eager"` keeps the loop.

    Under expert parallelism (`LLaDAMoEConfig.base_model_ep_plan`) `experts` (a `grouped_gemm.ExpertList`) keeps
    this rank's E / N experts and runs them (grouped or as the loop) through `expert_dispatch`, where transformers
    masks the other ranks' routes and sums the ranks' outputs; under tensor parallelism (the experts' widths split)
    the loop runs the sharded experts.
    """

    # Activation dtypes whose experts run grouped where torch's grouped GEMM can (float32 runs the loop).
    grouped_mm_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

    def __init__(self, config: LLaDAMoEConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = ExpertList(
            [LLaDAMoEMLP(config, config.expert_intermediate_size) for _ in range(self.num_experts)], config
        )
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        else:
            self.expert_bias = None
        # Expert parallelism's entry (`LLaDAMoEConfig.base_model_ep_plan`); after `experts` in the module tree.
        self.expert_dispatch = ExpertDispatch(self.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `(tokens, hidden)` -> routing weights `(tokens, top_k)` in x's dtype, the chosen experts `(tokens,
        top_k)` (most probable first) and the router logits `(tokens, num_experts)`."""
        router_logits = self.gate(x)
        probabilities = nn.functional.softmax(router_logits, dim=-1, dtype=torch.float32)
        if self.expert_bias is not None:
            probabilities = probabilities + self.expert_bias
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        return weights.to(x.dtype), experts, router_logits

    # Where the fused kernels run, `next_norm_weight`'s norm computed by the combine kernel rather than by a kernel
    # of its own.
    norm_in_combine = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None = None,
        next_norm_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """hidden_states `(batch, q_len, hidden)` -> (the weighted sum of the chosen experts' outputs, same shape,
        plus `residual` (same shape) when given: added, rounded, as `residual + output` rounds it, in the fused
        combine kernel; the router logits `(batch * q_len, num_experts)`). With `next_norm_weight` `(hidden,)` (and
        `residual`) a third element: the RMS norm of the output with that weight and `config.rms_norm_eps`, as
        `LLaDAMoERMSNorm` computes it, where the combine kernel computed it (`triton_moe.combine_and_norm`: the fused
        kernels run, the weight on the output's device and not sharded), else None (the norm is left to its module)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self.uses_fused_kernels(x):
            flat_residual = None if residual is None else residual.reshape(-1, shape[-1])
            norm_weight = next_norm_weight if self._fuses_norm(x, residual, next_norm_weight) else None
            out, router_logits, normed = self._experts_fused(x, flat_residual, norm_weight)
            out = out.view(shape), router_logits
            return out if next_norm_weight is None else (*out, None if normed is None else normed.view(shape))
        weights, experts, router_logits = self.route(x)
        if self.experts.partitioned:  # expert parallelism: this rank's experts, summed over the ranks
            out = self.expert_dispatch(x, experts, weights).view(shape)
        else:
            run = self._experts_grouped if self.uses_grouped_mm(x) else self._experts_loop
            out = run(x, weights, experts).view(shape)
        out = (out if residual is None else residual + out), router_logits
        return out if next_norm_weight is None else (*out, None)

    def _fuses_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None) -> bool:
        """Whether the fused path's combine kernel also computes the norm with `norm_weight` (see `forward`)."""
        if norm_weight is None or residual is None or not self.norm_in_combine:
            return False
        return norm_weight.device == x.device and not is_sharded(norm_weight)

    def _experts_loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The reference: `(tokens, hidden)` outputs, each expert run on the tokens that chose it."""
        out = torch.zeros_like(x)
        # The (token, choice) pairs sorted by expert (stably: each expert's tokens in order), and how many each expert
        # got (read on the host once per layer).
        chosen = experts.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        pair_tokens = order // self.top_k
        pair_weights = weights.reshape(-1)[order]
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        start = 0
        # Each expert that some token chose, in index order (the order the original adds them in), on its tokens.
        for expert_idx, count in enumerate(counts):
            if count == 0:
                continue
            tokens, token_weights = pair_tokens[start : start + count], pair_weights[start : start + count]
            expert_out = self.experts[expert_idx](x[tokens]) * token_weights[:, None]
            out.index_add_(0, tokens, expert_out.to(x.dtype))
            start += count
        return out

    def uses_fused_kernels(self, x: torch.Tensor) -> bool:
        """Whether the experts run as the fused kernels for activations `x` (see the class docstring): the fused
        kernels apply (`kernels.use_fused_kernels`: CUDA with Triton, or kernel mode "triton"; no autograd), not
        asked for the loop, half-precision activations, SiLU experts, no `expert_bias` (the original's routing
        weights include it; the kernel's do not), and plain expert weights in x's dtype or FP8 ones with block
        scales the grouped kernel takes."""
        if not MOE_KERNELS_AVAILABLE or x.dtype not in self.grouped_mm_dtypes or not use_fused_kernels(x):
            return False
        if getattr(self.config, "_experts_implementation", None) == EXPERTS_EAGER or self.expert_bias is not None:
            return False
        if self.experts.partitioned or is_sharded(self.experts[0].gate_proj.weight):  # expert / tensor parallel
            return False
        layer = self.experts[0].gate_proj
        if self.config.hidden_act not in ("silu", "swish") or (torch.is_grad_enabled() and layer.weight.requires_grad):
            return False
        if is_fp8_linear(layer):
            return fp8_kernel_supports(layer.weight, fp8_block_size(layer))
        return type(layer) is nn.Linear and "_hf_hook" not in layer.__dict__ and layer.weight.dtype == x.dtype

    def _experts_fused(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The fused kernels' `(tokens, hidden)` outputs for x `(tokens, hidden)`, the router logits `(tokens,
        num_experts)` and, with `norm_weight` (and `residual`), the RMS norm of the outputs (else None): the top-k of
        the float32 softmax (ties to the lower index), the pairs aligned by expert (`_fused_routing`), `silu(gate) *
        up` and the down-projection as grouped products over `stacks()`, each token's rows weighted by its
        probabilities rounded to x's dtype (as the original) and summed in float32 (`combine`, which also adds
        `residual` `(tokens, hidden)` when given; `combine_and_norm` with the norm)."""
        router_logits, weights, sorted_token, offsets, rows = self._fused_routing(x)
        stacks = self.stacks()
        gated = grouped_matmul(
            x, offsets, stacks.gate_up, stacks.gate_up_scale, stacks.block_size, rows_of=sorted_token, gated=True
        )
        expert_rows = grouped_matmul(gated, offsets, stacks.down, stacks.down_scale, stacks.block_size)
        if norm_weight is None:
            return combine(expert_rows, rows, weights, False, residual), router_logits, None
        out, normed = combine_and_norm(expert_rows, rows, weights, residual, norm_weight, self.config.rms_norm_eps)
        return out, router_logits, normed

    # Few tokens (`triton_moe.router_product_applies`): the router's product through `triton_moe.router_partials`
    # (the experts and the hidden size split across programs, the partial products added up in `route`'s kernel)
    # rather than cuBLAS's.
    router_product_in_routing_kernel = True

    def _fused_routing(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """For x `(tokens, hidden)`: the router logits `(tokens, num_experts)` in x's dtype, the routing weights
        `(tokens, top_k)` rounded to x's dtype, and the pairs aligned by expert (`triton_moe.align_by_expert`'s
        sorted_token, offsets, rows): the router's product (for few tokens where the router is a plain `nn.Linear` in
        x's dtype `triton_moe.router_partials`, whose partial products `route` adds up and rounds to x's dtype, else
        the router's own), `route` (one program per token) and `align_by_expert`; every kernel reads and writes the
        dtypes it is given (no cast kernels)."""
        routing = (None, 1, 1, self.top_k, "softmax", False, 1.0, x.dtype)
        router_logits, experts, weights = route_by(
            self.gate, x, *routing, product_in_kernel=self.router_product_in_routing_kernel
        )
        return router_logits, weights, *align_by_expert(experts, self.num_experts, False)

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether the experts run grouped for activations `x` (see the class docstring): not asked for the loop
        (`experts_implementation="eager"`), a dtype of `grouped_mm_dtypes` that the experts' weights have, no
        autograd graph to record, plain `nn.Linear` experts without hooks (not quantized or offloaded), row strides
        of 16 bytes, and torch's grouped GEMM for the device (CUDA: Hopper or newer; the CPU's)."""
        if getattr(self.config, "_experts_implementation", None) == EXPERTS_EAGER or _grouped_mm_function() is None:
            return False
        if self.experts.partitioned:  # expert parallelism: the experts' own grouped GEMMs where they run
            return self.experts.runs_grouped(x)
        first = self.experts[0]
        weight = first.gate_proj.weight
        if is_sharded(weight):  # tensor parallelism: the loop, through the sharded modules (their hooks reduce)
            return False
        if x.dtype not in self.grouped_mm_dtypes or weight.dtype != x.dtype or weight.device != x.device:
            return False
        if torch.is_grad_enabled() and weight.requires_grad:
            return False
        layers = (first, first.gate_proj, first.up_proj, first.down_proj)
        if any(type(layer) not in (LLaDAMoEMLP, nn.Linear) or "_hf_hook" in layer.__dict__ for layer in layers):
            return False
        size = weight.element_size()
        if (weight.shape[1] * size) % 16 or (weight.shape[0] * size) % 16:
            return False
        if x.device.type == "cuda":
            return torch.cuda.get_device_capability(x.device) >= (9, 0)
        return x.device.type == "cpu"

    def stacks(self) -> ExpertStacks:
        """The experts' weights stacked for the grouped products (`ExpertList.stacks`: gate_up `(E, 2I, H)`, down
        `(E, H, I)`, FP8 block scales), kept until `.to()` or the experts' weights are replaced."""
        return self.experts.stacks()

    def _experts_grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """`_experts_loop`'s outputs from two grouped GEMMs over `stacks()`, with no host synchronisation; each
        token's weighted expert outputs added in expert order, as the loop adds them."""
        grouped_mm = _grouped_mm_function()
        stacks = self.stacks()
        gate_up, down = stacks.gate_up, stacks.down
        tokens, hidden = x.shape
        chosen = experts.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        projected = grouped_mm(x[order // self.top_k], gate_up.transpose(1, 2), offs=offsets)
        gate, up = projected.chunk(2, dim=-1)
        activated = self.experts[0].act_fn(gate) * up
        sorted_out = grouped_mm(activated, down.transpose(1, 2), offs=offsets)
        # Back to (token, choice) order, weighted, then each token's choices in expert order.
        pairs = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out).view(tokens, self.top_k, hidden)
        pairs = pairs * weights.unsqueeze(-1)
        by_expert = experts.argsort(dim=-1)
        pairs = pairs.gather(1, by_expert.unsqueeze(-1).expand(-1, -1, hidden))
        out = torch.zeros_like(x)
        for choice in range(self.top_k):
            out = out + pairs[:, choice]
        return out


class LLaDAMoEDecoderLayer(GradientCheckpointingLayer):
    """`h = x + Attn(norm(x))`, then `h + MLP(norm(h))`: the routed experts (plus `shared_expert` when configured)
    where `moe_layer_freq[layer_idx]` is not 0, else a dense MLP."""

    def __init__(self, config: LLaDAMoEConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LLaDAMoEAttention(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp = LLaDAMoESparseMoeBlock(config)
            if config.shared_expert_intermediate_size is not None:
                # On the layer, not under `mlp` (the Hub's key names).
                self.shared_expert = LLaDAMoEMLP(config, config.shared_expert_intermediate_size)
        else:
            self.mlp = LLaDAMoEMLP(config, config.dense_intermediate_size)
        self.input_layernorm = LLaDAMoERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LLaDAMoERMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask=None,
        past_key_values: Cache | DiffusionKVCache | None = None,
        cache_position: torch.Tensor | None = None,
        normed_input: torch.Tensor | None = None,
        next_norm_weight: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns the new hidden states `(batch, q_len, hidden)`, the router logits (None in dense layers) and, where
        the MoE's combine kernel computed it, the RMS norm of the new hidden states with `next_norm_weight` `(hidden,)`
        (the next layer's input norm or the model's final norm; else None). `normed_input`: `input_layernorm(
        hidden_states)` when the previous layer returned it. Where the fused kernels run, the residual adds happen
        inside the post-attention norm's kernel and the MoE's combine kernel (the same sums, rounded as here)."""
        attn = self.self_attn(
            self.input_layernorm(hidden_states) if normed_input is None else normed_input,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            cache_position=cache_position,
            **kwargs,
        )
        normed, hidden_states = self.post_attention_layernorm.add_and_norm(attn, hidden_states)
        shared = getattr(self, "shared_expert", None)
        if not self.is_moe:
            return hidden_states + self.mlp(normed), None, None
        if shared is None:
            if next_norm_weight is None:
                return *self.mlp(normed, residual=hidden_states), None
            return self.mlp(normed, residual=hidden_states, next_norm_weight=next_norm_weight)
        mlp_out, router_logits = self.mlp(normed)
        return hidden_states + (mlp_out + shared(normed)), router_logits, None


class LLaDAMoEPreTrainedModel(QuantizesFromLoadDtype, PreTrainedModel):
    config_class = LLaDAMoEConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDAMoEDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _adjust_missing_and_unexpected_keys(self, loading_info, *args, **kwargs) -> None:
        # Under expert parallelism the other ranks' experts are dropped before loading: not unexpected.
        super()._adjust_missing_and_unexpected_keys(loading_info, *args, **kwargs)
        loading_info.unexpected_keys = set(loading_info.unexpected_keys) - other_ranks_expert_keys(
            self, loading_info.unexpected_keys
        )

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LLaDAMoESparseMoeBlock) and module.expert_bias is not None:
            init.zeros_(module.expert_bias)

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        # Unless asked otherwise, LLaDA-MoE runs hf_dllm's backend, as LLaDA does: the split-KV Triton kernel with
        # the key padding mask where it pays (block steps on CUDA), transformers' sdpa everywhere else (attention.py).
        if attn_implementation is None:
            attn_implementation = TRITON_ATTENTION
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers detects its own experts decorator; this model selects its experts path itself
        # (`LLaDAMoESparseMoeBlock.uses_grouped_mm`).
        return True

    def _check_and_adjust_experts_implementation(self, experts_implementation: str | None) -> str:
        """`experts_implementation`: "grouped_mm" (the default) runs the experts grouped where that applies (half
        precision on a GPU with torch's grouped GEMM; float32 runs the loop), "eager" always as the loop."""
        if experts_implementation is None:
            return EXPERTS_GROUPED_MM
        if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ValueError(
                f"{type(self).__name__} supports experts_implementation in {EXPERTS_IMPLEMENTATIONS}, got "
                f"{experts_implementation!r}."
            )
        return experts_implementation


class LLaDAMoEModel(LLaDAMoEPreTrainedModel):
    """The transformer: `embed_tokens`, `layers`, `norm`."""

    def __init__(self, config: LLaDAMoEConfig):
        super().__init__(config)
        pad = config.pad_token_id
        padding_idx = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx)
        self.layers = nn.ModuleList([LLaDAMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LLaDAMoERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        # RoPE tables where the cache bounds the positions (`cache.PositionTables`; on GPUs only, as LLaDA2's).
        self._rope_tables = PositionTables(self._rope_rows)
        self.post_init()

    def _rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary_cos_sin` of `positions` in `dtype`: what `_rope_tables` tabulates."""
        return rotary_cos_sin(positions, self.config, dtype)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | DiffusionKVCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        r"""
        Args:
            input_ids: `(batch, q_len)` token ids of the positions computed in this call.
            attention_mask: `(batch, kv_len)` with 1 for real tokens and 0 for padding, where `kv_len` counts every
                key this call attends to (cached ones included); or a prepared 4D mask, used as given.
            position_ids: `(batch, q_len)` RoPE positions; by default counted from each row's first real token.
            past_key_values: a `DynamicCache` (new keys are appended, as in transformers) or a `DiffusionKVCache`
                (new keys are written in place at `cache_position`, and attention covers the whole pre-allocated
                sequence, as the prefix/dual caches of Fast-dLLM need).
            cache_position: `(q_len,)` columns of the full sequence the inputs sit at.
            output_router_logits: also return each MoE layer's router logits `(batch * q_len, num_experts)`.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("LLaDAMoEModel.forward needs exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        past_key_values, cache_position, position_ids, mask_2d, _ = resolve_forward_positions(
            inputs_embeds, attention_mask, position_ids, past_key_values, use_cache, cache_position
        )
        if mask_2d is not None:
            attention_mask = create_bidirectional_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=mask_2d
            )
        bound = PositionTables.bound_of(past_key_values)
        if bound is None or position_ids.device.type == "cpu":
            position_embeddings = rotary_cos_sin(position_ids, self.config, inputs_embeds.dtype)
        else:  # rows of a table computed once (the same values): a lookup instead of ~12 kernels a step
            position_embeddings = self._rope_tables.lookup(position_ids, bound, inputs_embeds.dtype)

        hidden_states, normed = inputs_embeds, None
        all_hidden_states = () if output_hidden_states else None
        all_router_logits = () if output_router_logits else None
        # Each layer gets the norm after it (the next layer's input norm, the final norm last), which the MoE's
        # combine kernel computes with the residual add where it can (one kernel less per layer).
        after = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, after, strict=True):
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, router_logits, normed = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                cache_position=cache_position,
                normed_input=normed,
                next_norm_weight=next_norm.weight,
                **kwargs,
            )
            if output_router_logits and router_logits is not None:
                all_router_logits += (router_logits,)
        hidden_states = self.norm(hidden_states) if normed is None else normed
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return MoeModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=all_hidden_states,
            router_logits=all_router_logits,
            **cache_output(past_key_values if use_cache else None),
        )


class LLaDAMoEModelLM(LLaDAMoEPreTrainedModel, DiffusionGenerationMixin):
    """LLaDA-MoE with its output head and the diffusion `generate()` (see `DiffusionGenerationMixin`): one block
    loop with every LLaDA decoding option (fixed steps, `threshold`, `factor`, `cfg_scale`, no / prefix / dual
    cache, left-padded batches).

    `forward` returns logits (in the model dtype, as the original) for every position or those selected by
    `logits_to_keep`; the logits at position i predict the token at position i itself (no shift)."""

    generation_config_class = DiffusionGenerationConfig
    # Interface of DiffusionGenerationMixin: the family (bidirectional, position i predicts token i, decoded as LLaDA).
    diffusion_families = (LLADA_MOE,)
    # Attention layers attend within each packed row (`packed.PackedRows`): padding-free engine refresh forwards.
    diffusion_packed_rows = True
    # The attention reads any cache through `update` (an FP8 cache's K/V dequantized): `kv_cache_dtype="fp8"` works.
    diffusion_kv_cache_dtypes = KV_CACHE_DTYPES
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LLaDAMoEConfig):
        super().__init__(config)
        self.model = LLaDAMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | DiffusionKVCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        logits_to_keep: int | slice | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast | tuple:
        r"""
        Same arguments as `LLaDAMoEModel.forward`, plus `logits_to_keep`: an `int` keeps the last n positions (0
        keeps all), a `slice` or a 1D index tensor selects positions, so the `(…, vocab)` head runs only where logits
        are needed. Returns `MoeCausalLMOutputWithPast` with `logits` `(batch, kept, vocab)`.
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache_position=cache_position,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        logits = linear(self.lm_head, select_positions(outputs.last_hidden_state, logits_to_keep))
        output = MoeCausalLMOutputWithPast(
            logits=logits,
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
            **cache_output(output_cache(outputs)),
        )
        use_return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if use_return_dict else output.to_tuple()

    def _diffusion_step_capturable(self) -> bool:
        """Whether a denoising step can be captured in a CUDA graph: only where the experts run fused or grouped for
        the model's activations (`LLaDAMoESparseMoeBlock.uses_fused_kernels`, `uses_grouped_mm`); the loop reads the
        per-expert counts on the host."""
        blocks = [layer.mlp for layer in self.model.layers if layer.is_moe]
        if not blocks:
            return True
        embedding = self.model.embed_tokens.weight  # the activations' dtype and device
        x = embedding.new_empty(0, embedding.shape[1])
        return all(block.uses_fused_kernels(x) or block.uses_grouped_mm(x) for block in blocks)


__all__ = ["LLaDAMoEModel", "LLaDAMoEModelLM", "LLaDAMoEPreTrainedModel"]
