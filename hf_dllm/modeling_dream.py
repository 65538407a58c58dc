"""Dream masked-diffusion language model for transformers 5, generating through hf_dllm's one block loop.

Dream 7B (HKUNLP, arXiv:2508.15487) is initialised from Qwen2.5 and keeps its layout, so the module tree
reproduces the Hub checkpoints' parameter names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}`, `model.layers.{i}.self_attn.o_proj.weight`,
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.{input,post_attention}_layernorm.weight`,
`model.norm.weight`, `lm_head.weight`) and `from_pretrained` reads `Dream-org/Dream-v0-*` safetensors unchanged.
As on the Hub, `DreamModel` is the model with the LM head (what the Hub's `auto_map` gives `AutoModel`) and
`DreamBaseModel` the backbone.

The math is Qwen2's: RMS norms in float32, rotate-half RoPE with float32 angles applied in the model dtype, q/k/v
projections with biases, a SiLU-gated MLP, but **bidirectional** attention, and logits shifted by one: Dream was
adapted from an autoregressive model, so the logits at position i predict token i + 1 (its family's `logits_shift`
= 1; the generation loop reads the prediction of position j from position j - 1). Attention dispatches through
transformers' `ALL_ATTENTION_FUNCTIONS` (`"eager"`, the reference below; `"sdpa"`; `"flex_attention"`; and
hf_dllm's `"llada_triton"`, the default, which runs a split-KV kernel for block steps on CUDA and sdpa elsewhere).

On CUDA (with Triton installed) the RMS norms, with the residual add before them, the SiLU gate and RoPE run as
hf_dllm's fused Triton kernels (`kernels.py`, `triton_ops.py`; `HF_DLLM_KERNELS=torch` turns them off), with
PyTorch's rounding points: Dream rotates in the model dtype (each product and the sum rounded to bf16), and
`triton_ops.rounded_rotary` rounds there too (equal to the PyTorch code bit for bit), writing the rotated keys and
the values straight into a `DiffusionKVCache`. On that path q/k/v (with their biases) and gate/up are one matrix
product each (`ConcatenatedProjections`; the parameters, their names and `save_pretrained` stay the Hub's).

Padding: a 2D `attention_mask` masks padded keys, and RoPE positions are counted from each row's first real token,
so a left-padded row computes what it computes alone.

Decoding rules (Dream's `alg`s and Fast-dLLM's block variant of Dream's sampler, arXiv:2505.22618) are unmasking
policies in `decoding_dream.py`; the Dream family (`family_dream.py`) picks one from the generation settings
and `DreamModel.diffusion_generate` keeps Dream's own entry point and argument names.

This file is exported verbatim as Hub remote code: relative imports only.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import triton_ops
from .attention import TRITON_ATTENTION, register_attention_backends
from .cache import DiffusionKVCache, cache_output, output_cache, resolve_forward_positions
from .configuration_dream import DreamConfig
from .decoding_dream import DREAM_ALGS
from .family_dream import DREAM
from .fp8 import QuantizesFromLoadDtype
from .generation_utils import (
    DiffusionGenerateOutput,
    DiffusionGenerationConfig,
    DiffusionGenerationMixin,
    select_positions,
)
from .kernels import ConcatenatedProjections, linear, use_fused_kernels
from .packed import run_attention
from .tensor_parallel import LocalHeadCounts

register_attention_backends()


class DreamRMSNorm(nn.Module):
    """Qwen2's RMS norm: normalise in float32, cast back to the input dtype, then scale. Where the fused kernels run
    (`kernels.py`: CUDA tensors, Triton installed) one Triton kernel with the same rounding points does it, with the
    residual add before it fused in (`add_and_norm`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _fused(self, hidden_states: torch.Tensor) -> bool:
        # A weight of another dtype makes PyTorch promote the product (a float32 output for bf16 activations); the
        # kernel writes the activation dtype, so it runs only where the dtypes agree.
        return self.weight.dtype == hidden_states.dtype and use_fused_kernels(hidden_states)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._fused(hidden_states):
            return triton_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def add_and_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(hidden_states + residual), hidden_states + residual)`, in one kernel where fused kernels run."""
        if self._fused(hidden_states):
            return triton_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon, residual=residual)
        total = hidden_states + residual
        return self(total), total


def dream_rotary_cos_sin(
    position_ids: torch.Tensor, config: DreamConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for `position_ids` `(batch, q_len)`: cos, sin `(batch, q_len, head_dim)` in `dtype`.

    As Qwen2's (and Dream's) rotary embedding: inverse frequencies and angles in float32, the tables cast to the
    model dtype (so bf16 models rotate in bf16, as the reference does). Linear scaling divides the positions."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    positions = position_ids.float()
    scale = config.rope_position_scale()
    if scale != 1.0:
        positions = positions / scale
    angles = positions[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q` `(batch, heads, q_len, head_dim)` and `k` `(batch, kv_heads, q_len, head_dim)` by the tables
    `(batch, q_len, head_dim)`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`(batch, kv_heads, len, dim)` -> `(batch, kv_heads * n_rep, len, dim)` for grouped-query attention."""
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
    """Reference attention (Dream's `DreamAttention`). query `(b, h, q, d)`, key/value `(b, h_kv, k, d)`, mask
    `(b, 1, q or 1, k)` bool (True = attend) or additive float.

    Returns the output `(b, q, h, d)` and the weights `(b, h, q, k)`. No causal mask: Dream is bidirectional."""
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


class DreamAttention(LocalHeadCounts, ConcatenatedProjections):
    """Bidirectional multi-head attention with Qwen2's projections (q/k/v with bias, o without).

    It is the `module` handed to the attention functions, hence `is_causal`, `num_key_value_groups`, `layer_idx`
    and `scaling` on it. Where the fused kernels run, q/k/v are one product (`concatenated`) and RoPE is one
    kernel with PyTorch's rounding points that also writes the new keys/values into a `DiffusionKVCache`."""

    def __init__(self, config: DreamConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = False
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask=None,
        past_key_values=None,
        cache_position: torch.Tensor | None = None,
        cache_read_only: int = 0,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states `(batch, q_len, hidden)`; position_embeddings: cos, sin `(batch, q_len, head_dim)`.

        `cache_read_only`: the number of leading query positions whose keys/values are *not* written into a
        `DiffusionKVCache` (they attend, and their outputs are computed, but the cache keeps its entries for
        them). See `DreamModel._diffusion_forward`."""
        batch, q_len, _ = hidden_states.shape
        if cache_read_only and past_key_values is not None and not isinstance(past_key_values, DiffusionKVCache):
            raise TypeError("`cache_read_only` needs a DiffusionKVCache as `past_key_values`.")
        cos, sin = position_embeddings
        fused = use_fused_kernels(hidden_states)
        query, key, value = self._project_qkv(hidden_states, fused)
        if fused and self._rotary_kernel_applies(query, cos):
            if isinstance(past_key_values, DiffusionKVCache):
                # RoPE, and the new keys/values written into the cache (but the read-only columns'), in one kernel.
                cache_keys, cache_values = past_key_values.layer(
                    self.layer_idx, batch, self.num_kv_heads, self.head_dim, value
                )
                query, _ = triton_ops.rounded_rotary(
                    query, key, value, cos, sin, cache_keys, cache_values, cache_position, skip=cache_read_only
                )
                query, key, value = query.transpose(1, 2), cache_keys, cache_values
            else:
                query, key = triton_ops.rounded_rotary(query, key, value, cos, sin)
                query, value = query.transpose(1, 2), value.transpose(1, 2)
                if past_key_values is not None:
                    key, value = past_key_values.update(key, value, self.layer_idx, {"cache_position": cache_position})
        else:
            query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
            value = value.transpose(1, 2)
            if past_key_values is not None:
                if cache_read_only:
                    key, value = past_key_values.update(
                        key[:, :, cache_read_only:],
                        value[:, :, cache_read_only:],
                        self.layer_idx,
                        {"cache_position": cache_position[cache_read_only:]},
                    )
                else:
                    key, value = past_key_values.update(key, value, self.layer_idx, {"cache_position": cache_position})
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn = run_attention(  # a `PackedRows` mask: once per packed row
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
        return self.o_proj(attn.reshape(batch, q_len, -1))

    def _project_qkv(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `(B, L, Hq, D)`, k and v `(B, L, Hkv, D)` (views of one product where the kernels are fused)."""
        batch, q_len, _ = x.shape
        if fused:
            weight, bias = self.concatenated(("q_proj", "k_proj", "v_proj"))
            kv_width = self.num_kv_heads * self.head_dim
            query, key, value = nn.functional.linear(x, weight, bias).split(
                [self.num_heads * self.head_dim, kv_width, kv_width], dim=-1
            )
        else:
            query, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (
            query.view(batch, q_len, self.num_heads, self.head_dim),
            key.view(batch, q_len, self.num_kv_heads, self.head_dim),
            value.view(batch, q_len, self.num_kv_heads, self.head_dim),
        )

    def _rotary_kernel_applies(self, query: torch.Tensor, cos: torch.Tensor) -> bool:
        # The kernel works on halves of a power-of-two size, with tables in the activation dtype (otherwise PyTorch
        # would promote the products, which the kernel does not reproduce).
        half = self.head_dim // 2
        return half & (half - 1) == 0 and cos.dtype == query.dtype


class DreamMLP(ConcatenatedProjections):
    """`down(act(gate(x)) * up(x))`, no biases; gate/up are one product where the fused kernels run."""

    def __init__(self, config: DreamConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            weight, _ = self.concatenated(("gate_proj", "up_proj"))
            gate, up = nn.functional.linear(x, weight).chunk(2, dim=-1)
            if self.silu:
                # `silu(gate) * up` in one kernel, rounding where PyTorch rounds (silu's output, then the product).
                return self.down_proj(triton_ops.silu_mul(gate, up))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class DreamDecoderLayer(nn.Module):
    """`x + Attn(norm(x))`, then `x + MLP(norm(x))` (pre-norm, as Qwen2)."""

    def __init__(self, config: DreamConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DreamAttention(config, layer_idx)
        self.mlp = DreamMLP(config)
        self.input_layernorm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attention = self.self_attn(self.input_layernorm(hidden_states), **kwargs)
        x, hidden_states = self.post_attention_layernorm.add_and_norm(attention, hidden_states)
        return hidden_states + self.mlp(x)


class DreamPreTrainedModel(QuantizesFromLoadDtype, PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DreamDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        # Unless asked otherwise, hf_dllm's backend: the split-KV Triton kernel where it pays (block steps on CUDA),
        # transformers' sdpa everywhere else (see attention.py).
        if attn_implementation is None:
            attn_implementation = TRITON_ATTENTION
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)


class DreamBaseModel(DreamPreTrainedModel):
    """The transformer: `embed_tokens`, `layers`, `norm` (Qwen2 names)."""

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DreamDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

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
        cache_read_only: int = 0,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        Args:
            input_ids: `(batch, q_len)` token ids of the positions computed in this call.
            attention_mask: `(batch, kv_len)` with 1 for real tokens and 0 for padding, where `kv_len` counts
                every key this call attends to (cached ones included); or a prepared 4D mask; or a
                `packed.PackedRows` (also given as `past_key_values`): rows of different lengths end to end in one
                row `(1, T)`, each attending only to itself (padding-free forwards of the serving engine).
            position_ids: `(batch, q_len)` RoPE positions; by default counted from each row's first real token.
            past_key_values: a `DynamicCache` (new keys are appended, as in transformers) or a
                `DiffusionKVCache` (new keys are written in place at `cache_position`, and attention covers the
                whole pre-allocated sequence, as the prefix/dual caches of Fast-dLLM need).
            cache_position: `(q_len,)` columns of the full sequence the inputs sit at.
            cache_read_only: leading query positions whose K/V are not written into a `DiffusionKVCache`.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("DreamBaseModel.forward needs exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        past_key_values, cache_position, position_ids, mask_2d, _ = resolve_forward_positions(
            inputs_embeds, attention_mask, position_ids, past_key_values, use_cache, cache_position
        )
        position_embeddings = dream_rotary_cos_sin(position_ids, self.config, inputs_embeds.dtype)
        if mask_2d is not None:
            attention_mask = create_bidirectional_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=mask_2d
            )

        hidden_states = inputs_embeds
        all_hidden_states = () if output_hidden_states else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                cache_position=cache_position,
                cache_read_only=cache_read_only,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=all_hidden_states,
            **cache_output(past_key_values if use_cache else None),
        )


# Dream arguments this implementation does not provide, with the reason given in the error.
_DREAM_UNSUPPORTED = {
    "output_history": "the per-step canvases are not kept; iterate `model.generate_blocks(...)` for block events, "
    "or pass a streamer with `put_draft` to see every step",
    "generation_tokens_hook_func": "per-step hooks are not supported; use a custom `unmasking_policy`",
    "generation_logits_hook_func": "per-step hooks are not supported; use a custom `unmasking_policy`",
}


class DreamModel(DreamPreTrainedModel, DiffusionGenerationMixin):
    """Dream with its output head and the diffusion `generate()` (see `DiffusionGenerationMixin`).

    `forward` returns logits for every position (or those selected by `logits_to_keep`): Dream's logits at
    position i predict the token at position i + 1 (the family's `logits_shift` = 1).
    """

    generation_config_class = DiffusionGenerationConfig
    # Interface of DiffusionGenerationMixin: the family (Dream predicts position i + 1 from position i; its own
    # sampler), and attention layers that attend within each packed row (`packed.PackedRows`).
    diffusion_families = (DREAM,)
    diffusion_packed_rows = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Tensor parallelism (see `DreamConfig.base_model_tp_plan`): the head split by vocabulary rows, the logits
    # gathered so that every rank unmasks from the same logits.
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}  # the last pipeline stage, as transformers' Qwen2

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.vocab_size = config.vocab_size
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

    def get_decoder(self) -> DreamBaseModel:
        return self.model

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
        return_dict: bool | None = None,
        cache_read_only: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        r"""
        Same arguments as `DreamBaseModel.forward`, plus `logits_to_keep`: an `int` keeps the last n positions
        (0 keeps all), a `slice` or a 1D index tensor selects positions, so the `(…, vocab)` head runs only where
        logits are needed. Returns `CausalLMOutputWithPast` with `logits` `(batch, kept, vocab)`, unshifted (the
        logits at position i predict token i + 1).
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
            cache_read_only=cache_read_only,
            **kwargs,
        )
        logits = linear(self.lm_head, select_positions(outputs.last_hidden_state, logits_to_keep))
        output = CausalLMOutputWithPast(
            logits=logits, hidden_states=outputs.hidden_states, **cache_output(output_cache(outputs))
        )
        use_return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if use_return_dict else output.to_tuple()

    # DiffusionGenerationMixin hooks.
    def _diffusion_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask,
        position_ids: torch.Tensor,
        cache: DiffusionKVCache | None,
        cache_position: torch.Tensor,
        logits_slice,
        **forward_kwargs,
    ) -> torch.Tensor:
        """The loop's forward. With shifted logits the loop feeds one column more than the cache policy asks for,
        the one before the block, whose logits predict the block's first token. In a cached step that is not the
        block's full forward (fewer inputs than the cache holds) that column lies outside the recomputed range:
        its K/V stay those of the block's full forward, as in Fast-dLLM's prefix and dual caches, so it is fed as
        a read-only query (`cache_read_only=1`). The decision depends on shapes only (no host synchronisation)."""
        read_only = 1 if cache is not None and input_ids.shape[1] < cache.length else 0
        return super()._diffusion_forward(
            input_ids,
            attention_mask,
            position_ids,
            cache,
            cache_position,
            logits_slice,
            cache_read_only=read_only,
            **forward_kwargs,
        )

    @torch.no_grad()
    def diffusion_generate(
        self, inputs: torch.LongTensor | None = None, generation_config=None, **kwargs
    ) -> torch.LongTensor | DiffusionGenerateOutput:
        r"""Dream's own entry point (`model.diffusion_generate(input_ids, max_new_tokens=..., steps=..., alg=...)`)
        on the one generation loop, with Dream's argument names and defaults: the whole answer is one block
        (`block_length = max_new_tokens`), no KV cache, and no stop at EOS (every position is decoded), which is
        what Dream's sampler does (arXiv:2508.15487). Arguments:

            inputs / input_ids `(batch, prompt_len)`, attention_mask `(batch, prompt_len)` (left padding);
            max_new_tokens, or max_length (= prompt_len + max_new_tokens); steps; alg (one of
            `decoding_dream.DREAM_ALGS`); alg_temp; temperature; top_p; top_k; eps; the special token ids;
            return_dict_in_generate (or Dream's `return_dict`); num_return_sequences (each prompt repeated).

        Any other `generate()` field (`block_length`, `use_cache`, `threshold`, ...) passes through and overrides
        these defaults. `output_history` and the per-step hook functions are not supported (a `ValueError` says
        what to use instead). Returns what `generate()` returns (`DiffusionGenerateOutput` with `sequences` and
        `nfe` when a dict is asked for).
        """
        for name, reason in _DREAM_UNSUPPORTED.items():
            if kwargs.get(name):
                raise ValueError(f"diffusion_generate(): `{name}` is not supported: {reason}.")
            kwargs.pop(name, None)
        if "return_dict" in kwargs:
            kwargs.setdefault("return_dict_in_generate", kwargs.pop("return_dict"))
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if inputs is not None and "input_ids" in kwargs:
            raise ValueError("diffusion_generate(): pass the prompts once, as `inputs` or as `input_ids`.")
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                f"diffusion_generate(): `inputs` must be a (batch, prompt_len) torch.LongTensor, got "
                f"{type(input_ids).__name__}."
            )
        prompt_len = input_ids.shape[-1]
        max_length = kwargs.pop("max_length", None)
        if max_length is not None:
            if "max_new_tokens" in kwargs:
                raise ValueError("diffusion_generate(): pass `max_new_tokens` or `max_length`, not both.")
            if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= prompt_len:
                raise ValueError(
                    f"diffusion_generate(): `max_length` must be an integer > the prompt length ({prompt_len}), "
                    f"got {max_length!r}."
                )
            kwargs["max_new_tokens"] = max_length - prompt_len
        copies = kwargs.pop("num_return_sequences", 1)
        if not isinstance(copies, int) or isinstance(copies, bool) or copies < 1:
            raise ValueError(f"diffusion_generate(): `num_return_sequences` must be an integer >= 1, got {copies!r}.")
        attention_mask = kwargs.pop("attention_mask", None)
        if copies > 1:
            input_ids = input_ids.repeat_interleave(copies, dim=0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(copies, dim=0)
        if "alg" in kwargs and kwargs["alg"] not in DREAM_ALGS:
            raise ValueError(f"diffusion_generate(): `alg` must be one of {DREAM_ALGS}, got {kwargs['alg']!r}.")
        max_new_tokens = kwargs.get("max_new_tokens")
        if max_new_tokens is None:
            base = generation_config if generation_config is not None else self.generation_config
            max_new_tokens = getattr(base, "max_new_tokens", None)
        settings = {"use_cache": False, "eos_early_stop": False}
        if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens > 0:
            settings["block_length"] = max_new_tokens
        settings.update(kwargs)
        if attention_mask is not None:
            settings["attention_mask"] = attention_mask
        return self.generate(input_ids, generation_config, **settings)


__all__ = ["DreamBaseModel", "DreamModel", "DreamPreTrainedModel"]
