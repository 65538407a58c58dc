"""LLaDA masked-diffusion language model for transformers 5.

The module tree reproduces the Hub checkpoints' parameter names (`model.transformer.wte.weight`,
`model.transformer.blocks.{i}.q_proj.weight`, ..., `model.transformer.ff_out.weight`), so `from_pretrained` reads
`GSAI-ML/LLaDA-8B-*` safetensors unchanged. The math follows LLaDA's `LLaDALlamaBlock` (arXiv:2502.09992): RMS
norms computed in float32, RoPE in full precision, a SiLU-gated MLP, and **bidirectional** attention (a mask
predictor sees the whole sequence). Attention dispatches through transformers' `ALL_ATTENTION_FUNCTIONS`, so
`attn_implementation="eager" | "sdpa" | "flex_attention" | "flash_attention_2"` and the backends registered by
`attention.py` all run the same model.

Padding: a 2D `attention_mask` masks padded keys, and RoPE positions are counted from each row's first real
token, so a left-padded row computes what it computes alone.

This file is exported verbatim as Hub remote code: relative imports only.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as _global_module_hooks
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import triton_ops
from .attention import TRITON_ATTENTION, fp8_attention_inputs, register_attention_backends
from .cache import (
    KV_CACHE_DTYPES,
    DiffusionKVCache,
    FP8DiffusionKVCache,
    PositionTables,
    cache_output,
    output_cache,
    resolve_forward_positions,
)
from .configuration_llada import LLaDAConfig
from .family_llada import LLADA
from .fp8 import QuantizedRows, QuantizesFromLoadDtype, rms_norm_to_fp8, silu_mul_to_fp8
from .generation_utils import (
    DiffusionGenerationConfig,
    DiffusionGenerationMixin,
    select_positions,
)
from .kernels import ConcatenatedProjections, linear, linear_input_group, use_fused_kernels
from .llada_lean import LeanBlockWeights, lean_block, lean_rotary, select_rows
from .packed import PackedRows, run_attention
from .tensor_parallel import LocalHeadCounts, is_sharded

register_attention_backends()


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "relu": nn.functional.relu,
}


class LLaDARMSNorm(nn.Module):
    """RMS norm as in LLaDA: normalise in float32, cast back, then scale (and shift) in the input dtype."""

    def __init__(self, hidden_size: int, eps: float, affine: bool = True, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size)) if affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if affine and bias else None

    def _fused(self, hidden_states: torch.Tensor) -> bool:
        return self.bias is None and use_fused_kernels(hidden_states)

    def forward(self, hidden_states: torch.Tensor, fp8_group: int | None = None) -> torch.Tensor | QuantizedRows:
        """The normed `hidden_states`; with `fp8_group` (fused kernels only) written as `QuantizedRows` for an FP8
        w8a8 product (`kernels.linear_input_group`)."""
        if fp8_group is not None:
            return rms_norm_to_fp8(hidden_states, self.weight, self.eps, fp8_group)[0]
        if self._fused(hidden_states):
            return triton_ops.rms_norm(hidden_states, self.weight, self.eps)[0]
        if hidden_states.dtype == torch.float32 and self.bias is None:
            # One operation instead of six; the same float32 arithmetic (normalise, then scale).
            return nn.functional.rms_norm(hidden_states, hidden_states.shape[-1:], self.weight, self.eps)
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x.to(input_dtype)
        if self.weight is not None:
            x = self.weight * x
            if self.bias is not None:
                x = x + self.bias
        return x

    def add_and_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor, fp8_group: int | None = None
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """`(norm(hidden_states + residual), hidden_states + residual)`, in one kernel where fused kernels run (the
        first as `QuantizedRows` with `fp8_group`, as in `forward`)."""
        if fp8_group is not None:
            return rms_norm_to_fp8(hidden_states, self.weight, self.eps, fp8_group, residual=residual)
        if self._fused(hidden_states):
            return triton_ops.rms_norm(hidden_states, self.weight, self.eps, residual=residual)
        total = hidden_states + residual
        return self(total), total


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for `position_ids` `(batch, q_len)`: cos, sin of shape `(batch, q_len, head_dim)`, float32.

    Same formula and precision as LLaDA's `RotaryEmbedding` (inverse frequencies and angles in float32).
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full_precision: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q` `(batch, heads, q_len, head_dim)` and `k` `(batch, kv_heads, q_len, head_dim)`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    compute_dtype = torch.float32 if full_precision else q.dtype
    q_, k_ = q.to(compute_dtype), k.to(compute_dtype)
    cos, sin = cos.to(compute_dtype), sin.to(compute_dtype)
    q_out = q_ * cos + rotate_half(q_) * sin
    k_out = k_ * cos + rotate_half(k_) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


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
    """Reference attention. query `(b, h, q, d)`, key/value `(b, h_kv, k, d)`, additive mask `(b, 1, q, k)`.

    Returns the output `(b, q, h, d)` and the weights `(b, h, q, k)`. No causal mask: LLaDA is bidirectional.
    """
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


_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
_LEAN_MODULE_NAMES = (*_LINEAR_NAMES, "attn_norm", "ff_norm")


def _has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` does more than its `forward`: its hooks, accelerate's `_hf_hook` wrapper, or hooks
    on every module (`torch.nn.modules.module.register_module_forward_hook`, as profilers add)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or "_hf_hook" in module.__dict__
        or _global_module_hooks._global_forward_hooks
        or _global_module_hooks._global_forward_pre_hooks
    )


def _lean_sources(modules: dict[str, nn.Module]) -> tuple:
    """What a block's `LeanBlockWeights` were gathered from: `(name, layer, ((key, parameter, data_ptr), ...))` for
    each of its layers."""
    return tuple(
        (
            name,
            modules[name],
            tuple(
                (key, parameter, None if parameter is None else parameter.data_ptr())
                for key, parameter in modules[name]._parameters.items()
            ),
        )
        for name in _LEAN_MODULE_NAMES
    )


def _lean_sources_unchanged(modules: dict[str, nn.Module], sources: tuple) -> bool:
    """Whether the block still has the layers, parameters and storage of `sources` (`_lean_sources`), and no hooks on
    them: False once a layer or parameter was replaced or re-pointed (`.to()`, `param.data = ...`, quantizing or
    sharding), which the views would not see. In-place updates need nothing: the views see them. Runs at every
    forward, so it is written for speed (~1 us a layer)."""
    for name, layer, parameters in sources:
        if modules[name] is not layer or _has_hooks(layer):
            return False
        current = layer._parameters
        for key, parameter, pointer in parameters:
            if current.get(key) is not parameter or (parameter is not None and parameter.data_ptr() != pointer):
                return False
    return True


class LLaDALlamaBlock(LocalHeadCounts, ConcatenatedProjections):
    """One LLaDA block: `x + Attn(norm(x))`, then `x + W_out(act(W_gate norm(x)) * W_up norm(x))`.

    It is also the `module` handed to the attention functions, hence `is_causal`, `num_key_value_groups`,
    `layer_idx` and `scaling` on it.
    """

    # The layers multiplied as one matrix where the fused kernels run (`ConcatenatedProjections`).
    _QKV = ("q_proj", "k_proj", "v_proj")
    _GATE_UP = ("ff_proj", "up_proj")

    def __init__(self, config: LLaDAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = False
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        eps, affine, norm_bias = config.rms_norm_eps, config.layer_norm_with_affine, config.layer_norm_bias

        self.attn_norm = LLaDARMSNorm(config.d_model, eps, affine, norm_bias)
        self.ff_norm = LLaDARMSNorm(config.d_model, eps, affine, norm_bias)
        kv_dim = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=config.qkv_bias)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=config.include_bias)
        self.ff_proj = nn.Linear(config.d_model, config.intermediate_size, bias=config.include_bias)
        self.up_proj = nn.Linear(config.d_model, config.intermediate_size, bias=config.include_bias)
        self.ff_out = nn.Linear(config.intermediate_size, config.d_model, bias=config.include_bias)
        self.act = _ACTIVATIONS[config.activation_type]
        self.dropout = nn.Dropout(config.residual_dropout)
        self._lean_cache: tuple | None = None  # see `lean_weights`

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        cache_position: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states `(batch, q_len, d_model)`; position_embeddings: cos, sin `(batch, q_len, head_dim)`."""
        if not use_fused_kernels(hidden_states) and self._lean_call_applies(hidden_states, past_key_values, kwargs):
            weights = self.lean_weights()
            if weights is not None:
                rotary = lean_rotary(*position_embeddings)
                return lean_block(weights, hidden_states, rotary, attention_mask, past_key_values, cache_position)
        return self._module_forward(
            hidden_states, position_embeddings, attention_mask, past_key_values, cache_position, **kwargs
        )

    def _module_forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        cache_position: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """`forward` through the block's modules (the reference; quantized, sharded or hooked layers; the fused GPU
        kernels): `residual_stream_forward`'s two parts added."""
        mlp_out, stream = self.residual_stream_forward(
            hidden_states, None, position_embeddings, attention_mask, past_key_values, cache_position, **kwargs
        )
        return stream + mlp_out

    def residual_stream_forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        cache_position: torch.Tensor | None = None,
        keep: slice | torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on the residual stream `hidden_states + residual` (`residual` None: `hidden_states` alone),
        `(batch, q_len, d_model)` each, without its last residual add: returns `(mlp_out, stream)`, whose sum is what
        `forward` returns. `keep` (a slice or a 1D index of the `q_len` positions, as `llada_lean.lean_block`'s):
        only those positions' queries, attention and MLP are computed (keys and values of all of them still are),
        and both outputs are `(batch, kept, d_model)`: the last block of a forward whose logits are wanted at a few
        positions, e.g. a dual-cache refresh over the whole sequence that needs the current block's logits (at the
        LLaDA-8B shape, prompt 512 + 256: 86 % of the last block's products, 2.7 % of the forward's; at fewer rows
        the products may take other kernels, so the kept logits equal the full forward's up to their rounding).
        Where the fused kernels run, the model hands both to the next block's attention norm (or the final norm),
        which adds them as it reads them (`LLaDARMSNorm.add_and_norm`), so the sum is never written and read back by
        a kernel of its own: one pass over the hidden states fewer per block, a launch fewer at every block step, the
        same values (the norm rounds the sum to the hidden states' dtype before norming it, as a separate add
        would)."""
        batch, q_len, _ = hidden_states.shape
        fused = use_fused_kernels(hidden_states)
        group = self._fp8_input_group(self.attn_norm, hidden_states, self._QKV, fused)
        if residual is None:
            x = self.attn_norm(hidden_states, group)
        else:
            x, hidden_states = self.attn_norm.add_and_norm(hidden_states, residual, group)
        query, key, value = self._project_qkv(x, fused)
        cos, sin = position_embeddings
        if fused and self._rotary_kernel_applies() and isinstance(past_key_values, FP8DiffusionKVCache):
            # As below, into an FP8 cache: the kernel quantizes what it writes. A forward over the whole cache (a
            # block start's refresh) attends to its own K/V as computed; any other reads the float8 K/V.
            cached = past_key_values.quantized_layer(self.layer_idx, batch, self.num_kv_heads, self.head_dim, value)
            refresh = q_len == past_key_values.length
            rotated = triton_ops.rotary_to_cache(
                query, key, value, cos, sin, *cached[:2], cache_position, *cached[2:], keys_out=refresh
            )
            if refresh:
                query, key, value = (t.transpose(1, 2) for t in (*rotated, value))
            else:
                key, value, fp8_kwargs = fp8_attention_inputs(self.config._attn_implementation, *cached, query.dtype)
                query, kwargs = rotated.transpose(1, 2), {**kwargs, **fp8_kwargs}
        elif fused and self._rotary_kernel_applies() and isinstance(past_key_values, DiffusionKVCache):
            # RoPE, and the new keys/values written into the cache, in one kernel.
            cache_keys, cache_values = past_key_values.layer(
                self.layer_idx, batch, self.num_kv_heads, self.head_dim, value
            )
            query = triton_ops.rotary_to_cache(query, key, value, cos, sin, cache_keys, cache_values, cache_position)
            query, key, value = query.transpose(1, 2), cache_keys, cache_values
        else:
            if fused and self._rotary_kernel_applies():
                query, key = triton_ops.rotary(query, key, cos, sin)
                query, key = query.transpose(1, 2), key.transpose(1, 2)
            else:
                query, key = apply_rotary_pos_emb(
                    query.transpose(1, 2), key.transpose(1, 2), cos, sin, self.config.rope_full_precision
                )
            value = value.transpose(1, 2)
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, self.layer_idx, {"cache_position": cache_position})
        if keep is not None:
            query, hidden_states = select_rows(query, keep, dim=2), select_rows(hidden_states, keep)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-2] > 1:
                attention_mask = select_rows(attention_mask, keep, dim=2)
            q_len = query.shape[2]

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
        attn = self.dropout(linear(self.attn_out, attn.reshape(batch, q_len, -1)))
        group = self._fp8_input_group(self.ff_norm, attn, self._GATE_UP, fused)
        x, hidden_states = self.ff_norm.add_and_norm(attn, hidden_states, group)
        mlp_out = linear(self.ff_out, self._gated_activation(x, fused))
        return (self.dropout(mlp_out) if self.training else mlp_out), hidden_states

    def _fp8_input_group(self, norm: LLaDARMSNorm, x: torch.Tensor, names: tuple[str, ...], fused: bool) -> int | None:
        """Where the fused kernels run: the group in which `norm` may write its output quantized for the FP8
        product of the layers `names` (`ConcatenatedProjections.quantized_input_group`), saving the pass that
        would quantize it; else None (also when the norm has hooks, which expect a tensor)."""
        if not fused or self.training:
            return None
        group = self.quantized_input_group(x, names)  # None at once for layers that are not FP8
        return None if group is None or norm.bias is not None or _has_hooks(norm) else group

    def _lean_call_applies(self, hidden_states: torch.Tensor, past_key_values, kwargs: dict) -> bool:
        """Whether a forward can run its blocks as `llada_lean.lean_block` (the call's part, the same for every
        block of a forward): inference (no autograd, no dropout), float32, no extra attention arguments, a
        `DiffusionKVCache`, a `PackedRows` or no cache, full-precision RoPE, and attention through sdpa (the backend
        that runs wherever the Triton kernels do not)."""
        if not (
            hidden_states.dtype == torch.float32
            and not torch.is_grad_enabled()
            and not self.training
            and not kwargs
            and (past_key_values is None or isinstance(past_key_values, (DiffusionKVCache, PackedRows)))
        ):
            return False
        config = self.config
        return config.rope_full_precision and config._attn_implementation in ("sdpa", TRITON_ATTENTION)

    def lean_weights(self) -> LeanBlockWeights | None:
        """This block's tensors for `llada_lean.lean_block`, or None where it cannot compute the block: grouped-query
        attention, a hook on one of its layers (the lean path reads weights instead of calling modules), or layers
        that are not plain `nn.Linear` / bias-free `LLaDARMSNorm` (quantized or tensor-parallel-sharded
        replacements). Gathered once and again when a parameter was replaced. (A hook on the block itself runs
        when the block is called: `forward` then takes the lean path.)"""
        modules = self._modules  # not `self.q_proj`: nn.Module.__getattr__ costs a microsecond per name
        cached = self._lean_cache  # (sources, weights or None), see `_lean_sources`
        if cached is not None and _lean_sources_unchanged(modules, cached[0]):
            return cached[1]
        if any(_has_hooks(modules[name]) for name in _LEAN_MODULE_NAMES):
            return None
        weights = self._gather_lean_weights()
        # After the gathering: concatenating q/k/v and gate/up re-points those parameters.
        self._lean_cache = (_lean_sources(modules), weights)
        return weights

    def _gather_lean_weights(self) -> LeanBlockWeights | None:
        modules = self._modules
        applies = self.num_key_value_groups == 1
        for name in _LINEAR_NAMES:
            layer = modules[name]
            applies = applies and type(layer) is nn.Linear and not is_sharded(layer._parameters["weight"])
        for name in ("attn_norm", "ff_norm"):
            norm = modules[name]
            applies = applies and type(norm) is LLaDARMSNorm and norm.weight is not None and norm.bias is None
        if not applies:
            return None
        qkv, qkv_bias = self.concatenated(self._QKV)
        gate_up, gate_up_bias = self.concatenated(self._GATE_UP)
        attn_out, ff_out = modules["attn_out"], modules["ff_out"]
        return LeanBlockWeights(
            layer_idx=self.layer_idx,
            heads=self.num_heads,
            head_dim=self.head_dim,
            scaling=self.scaling,
            attn_norm=modules["attn_norm"].weight,
            attn_norm_eps=modules["attn_norm"].eps,
            qkv_t=qkv.t(),
            qkv_bias=qkv_bias,
            attn_out_t=attn_out.weight.t(),
            attn_out_bias=attn_out.bias,
            ff_norm=modules["ff_norm"].weight,
            ff_norm_eps=modules["ff_norm"].eps,
            gate_up_t=gate_up.t(),
            gate_up_bias=gate_up_bias,
            ff_out_t=ff_out.weight.t(),
            ff_out_bias=ff_out.bias,
            act=self.act,
        )

    def _project_qkv(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `(B, L, Hq, D)`, k and v `(B, L, Hkv, D)` (views of one product where the weights are fused)."""
        batch, q_len, _ = x.shape
        if fused:
            kv_width = self.num_kv_heads * self.head_dim
            query, key, value = self.project(x, self._QKV).split(
                [self.num_heads * self.head_dim, kv_width, kv_width], dim=-1
            )
        else:
            query, key, value = linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)
        return (
            query.view(batch, q_len, self.num_heads, self.head_dim),
            key.view(batch, q_len, self.num_kv_heads, self.head_dim),
            value.view(batch, q_len, self.num_kv_heads, self.head_dim),
        )

    def _gated_activation(self, x: torch.Tensor | QuantizedRows, fused: bool) -> torch.Tensor | QuantizedRows:
        """`act(W_gate x) * W_up x` `(..., intermediate_size)`; as `QuantizedRows` where `ff_out`'s FP8 product
        runs w8a8 (`kernels.linear_input_group`)."""
        if fused:
            gate, up = self.project(x, self._GATE_UP).chunk(2, dim=-1)
        else:
            gate, up = linear(self.ff_proj, x), linear(self.up_proj, x)
        if fused and self.config.activation_type == "silu":
            group = None if self.training else linear_input_group(self.ff_out, gate)
            return triton_ops.silu_mul(gate, up) if group is None else silu_mul_to_fp8(gate, up, group)
        return self.act(gate) * up

    def _rotary_kernel_applies(self) -> bool:
        half = self.head_dim // 2
        return self.config.rope_full_precision and half & (half - 1) == 0


class LLaDAPreTrainedModel(QuantizesFromLoadDtype, PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["LLaDALlamaBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        # Unless asked otherwise, LLaDA runs hf_dllm's backend: the split-KV Triton kernel where it pays (block
        # steps on CUDA), transformers' sdpa everywhere else (see attention.py).
        if attn_implementation is None:
            attn_implementation = TRITON_ATTENTION
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)


class LLaDAModel(LLaDAPreTrainedModel):
    """The transformer: `transformer.wte`, `transformer.blocks`, `transformer.ln_f` and, unless
    `weight_tying`, the output head `transformer.ff_out` (owned here because the Hub checkpoints put it here)."""

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        modules = {
            "wte": nn.Embedding(config.padded_vocab_size, config.d_model),
            "emb_drop": nn.Dropout(config.embedding_dropout),
            "blocks": nn.ModuleList([LLaDALlamaBlock(config, i) for i in range(config.n_layers)]),
            "ln_f": LLaDARMSNorm(
                config.d_model, config.rms_norm_eps, config.layer_norm_with_affine, config.layer_norm_bias
            ),
        }
        if not config.weight_tying:
            modules["ff_out"] = nn.Linear(config.d_model, config.padded_vocab_size, bias=config.include_bias)
        self.transformer = nn.ModuleDict(modules)
        # RoPE tables (`cache.PositionTables`): cos, sin `(n, head_dim)`, and `lean_rotary`'s cos and signed sin side
        # by side `(n, 2, head_dim)`.
        self._rope_tables = PositionTables(self._rope_rows)
        self.post_init()

    def _rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """What `_rope_tables` tabulates for `positions` `(1, n)`, in float32 whatever `dtype`: `rotary_cos_sin`'s
        cos and sin, and `lean_rotary`'s tables side by side (one lookup for `lean`)."""
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        return cos, sin, torch.cat(lean_rotary(cos, sin), dim=2)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def _rotary_cos_sin(
        self, position_ids: torch.Tensor, lean: bool = False, bound: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary_cos_sin` for `position_ids` `(batch, q_len)`, or with `lean` the tables `lean_block` applies:
        `lean_rotary`'s `(batch, q_len, 1, head_dim)`. Rows of tables of positions `[0, n)` computed once (the same
        float32 values; a step then costs a lookup instead of ~8 kernels) where a bound on the positions is known:
        on the CPU the largest position (reading it costs no device synchronisation there), elsewhere `bound`
        (`PositionTables.bound_of`); without one, computed per call."""
        if position_ids.device.type == "cpu":
            bound = int(position_ids.max()) + 1 if position_ids.numel() else 0
        if bound is None:
            cos_sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
            return lean_rotary(*cos_sin) if lean else cos_sin
        cos, sin, signed = self._rope_tables.covering(bound, position_ids.device, torch.float32)
        if lean:
            rows = signed[position_ids]
            return rows[:, :, :1], rows[:, :, 1:]
        return cos[position_ids], sin[position_ids]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final hidden states `(..., d_model)` -> logits `(..., embedding_size)`."""
        if self.config.weight_tying:
            logits = nn.functional.linear(hidden_states, self.transformer.wte.weight)
        else:
            logits = linear(self.transformer.ff_out, hidden_states)
        if self.config.scale_logits:
            logits = logits * (self.config.d_model**-0.5)
        return logits

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
        positions_to_keep: slice | torch.Tensor | None = None,
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
            positions_to_keep: a slice or a 1D index of the `q_len` positions: `last_hidden_state` holds only
                those `(batch, kept, d_model)`, and the last block computes its queries, attention and MLP only
                there where it can (`llada_lean.lean_block` on the CPU, `residual_stream_forward` where the fused
                kernels run; not a hooked block). Not with `output_hidden_states`.
        """
        hidden_states, past_key_values, all_hidden_states = self._forward_hidden(
            input_ids,
            attention_mask,
            position_ids,
            past_key_values,
            inputs_embeds,
            use_cache,
            cache_position,
            output_hidden_states,
            positions_to_keep,
            **kwargs,
        )
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, **cache_output(past_key_values)
        )

    def _forward_hidden(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        past_key_values,
        inputs_embeds: torch.Tensor | None,
        use_cache: bool | None,
        cache_position: torch.LongTensor | None,
        output_hidden_states: bool | None,
        positions_to_keep: slice | torch.Tensor | None,
        **kwargs,
    ) -> tuple[torch.Tensor, Cache | DiffusionKVCache | None, tuple | None]:
        """`forward`'s work: (last hidden states, the cache when `use_cache`, every layer's hidden states or None)."""
        if positions_to_keep is not None and output_hidden_states:
            raise ValueError("`positions_to_keep` cannot be combined with `output_hidden_states`.")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("LLaDAModel.forward needs exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.transformer.wte(input_ids)
        past_key_values, cache_position, position_ids, mask_2d, _ = resolve_forward_positions(
            inputs_embeds, attention_mask, position_ids, past_key_values, use_cache, cache_position
        )

        if mask_2d is not None:
            attention_mask = create_bidirectional_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=mask_2d
            )

        hidden_states = inputs_embeds
        if self.config.input_emb_norm:
            hidden_states = hidden_states * (self.config.d_model**0.5)
        blocks = self.transformer.blocks
        lean_call = not use_fused_kernels(hidden_states) and blocks[0]._lean_call_applies(
            hidden_states, past_key_values, kwargs
        )
        emb_drop = self.transformer.emb_drop
        if emb_drop.training or _has_hooks(emb_drop):  # otherwise the identity
            hidden_states = emb_drop(hidden_states)
        all_hidden_states = () if output_hidden_states else None
        # Where the fused kernels run, each block leaves its last residual add to the next norm
        # (`residual_stream_forward`); `residual` is the part of the hidden states not yet added to `hidden_states`.
        defer_residual = use_fused_kernels(hidden_states) and not output_hidden_states
        residual = None
        last_index = len(blocks) - 1
        position_embeddings = rotary = None  # RoPE tables, made once per forward for the blocks that need them
        rope_bound = PositionTables.bound_of(past_key_values)
        for index, block in enumerate(blocks):
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            weights = block.lean_weights() if lean_call and not _has_hooks(block) else None
            if weights is not None:
                if rotary is None:
                    rotary = self._rotary_cos_sin(position_ids, lean=True, bound=rope_bound)
                last = index == last_index
                hidden_states = lean_block(
                    weights,
                    hidden_states,
                    rotary,
                    attention_mask,
                    past_key_values,
                    cache_position,
                    keep=positions_to_keep if last else None,
                )
                if last:
                    positions_to_keep = None  # the block kept them
                continue
            if position_embeddings is None:
                position_embeddings = self._rotary_cos_sin(position_ids, bound=rope_bound)
            if defer_residual and not _has_hooks(block):
                last = index == last_index
                hidden_states, residual = block.residual_stream_forward(
                    hidden_states,
                    residual,
                    position_embeddings,
                    attention_mask=attention_mask,
                    past_key_values=past_key_values,
                    cache_position=cache_position,
                    keep=positions_to_keep if last else None,
                    **kwargs,
                )
                if last:
                    positions_to_keep = None  # the block kept them
                continue
            if residual is not None:  # a hooked block sees, and returns, the whole hidden states
                hidden_states, residual = hidden_states + residual, None
            # Where the lean path was asked and refused, the block's modules, without asking again.
            run_block = block._module_forward if lean_call and not _has_hooks(block) else block
            hidden_states = run_block(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                cache_position=cache_position,
                **kwargs,
            )
        if positions_to_keep is not None:
            hidden_states = select_rows(hidden_states, positions_to_keep)
            residual = None if residual is None else select_rows(residual, positions_to_keep)
        ln_f = self.transformer.ln_f
        if residual is not None and not _has_hooks(ln_f):
            hidden_states = ln_f.add_and_norm(hidden_states, residual)[0]
        else:
            hidden_states = ln_f(hidden_states if residual is None else hidden_states + residual)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return hidden_states, past_key_values if use_cache else None, all_hidden_states


class LLaDAModelLM(LLaDAPreTrainedModel, DiffusionGenerationMixin):
    """LLaDA with its output head and the diffusion `generate()` (see `DiffusionGenerationMixin`).

    `forward` returns logits for every position (or those selected by `logits_to_keep`): LLaDA's logits at
    position i predict the token at position i itself (no shift), as a mask predictor does.
    """

    generation_config_class = DiffusionGenerationConfig
    # Interface of DiffusionGenerationMixin: the family (bidirectional, position i predicts token i).
    diffusion_families = (LLADA,)
    # Attention layers attend within each packed row (`packed.PackedRows`): padding-free engine refresh forwards.
    diffusion_packed_rows = True
    # Every attention path reads an FP8 cache: the fused one through `rotary_to_cache` and the split-KV kernel,
    # the others through `FP8DiffusionKVCache.update` (dequantized K/V).
    diffusion_kv_cache_dtypes = KV_CACHE_DTYPES

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.transformer.wte = value

    def get_output_embeddings(self) -> nn.Module | None:
        return None if self.config.weight_tying else self.model.transformer.ff_out

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
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        r"""
        Same arguments as `LLaDAModel.forward`, plus `logits_to_keep`: an `int` keeps the last n positions
        (0 keeps all), a `slice` or a 1D index tensor selects positions, so the `(…, embedding_size)` head runs
        only where logits are needed. Returns `CausalLMOutputWithPast` with `logits` `(batch, kept, vocab)`.
        """
        keep = None if output_hidden_states else _positions_to_keep(logits_to_keep)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache_position=cache_position,
            output_hidden_states=output_hidden_states,
            positions_to_keep=keep,
            **kwargs,
        )
        logits = self._kept_logits(outputs.last_hidden_state, logits_to_keep, keep)
        output = CausalLMOutputWithPast(
            logits=logits, hidden_states=outputs.hidden_states, **cache_output(output_cache(outputs))
        )
        use_return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if use_return_dict else output.to_tuple()

    def _diffusion_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask,
        position_ids: torch.Tensor,
        cache,
        cache_position: torch.Tensor,
        logits_slice,
        **forward_kwargs,
    ) -> torch.Tensor:
        """The generation loop's forward (`DiffusionGenerationMixin._diffusion_forward`): the logits of `forward`
        without building its output dataclasses, which cost tens of microseconds of a tiny model's ~1 ms CPU step.
        Through `forward` where a hook or a subclass's own `forward` expects it to be called."""
        if (
            forward_kwargs
            or type(self).forward is not LLaDAModelLM.forward
            or type(self.model).forward is not LLaDAModel.forward
            or _has_hooks(self)
            or _has_hooks(self.model)
        ):
            return super()._diffusion_forward(
                input_ids, attention_mask, position_ids, cache, cache_position, logits_slice, **forward_kwargs
            )
        keep = _positions_to_keep(logits_slice)
        hidden_states, _, _ = self.model._forward_hidden(
            input_ids, attention_mask, position_ids, cache, None, cache is not None, cache_position, None, keep
        )
        return self._kept_logits(hidden_states, logits_slice, keep)

    def _kept_logits(self, hidden_states: torch.Tensor, logits_to_keep, kept) -> torch.Tensor:
        """Logits of the positions `logits_to_keep` selects; `kept`: the positions the model kept already (its last
        block computed only them, `_positions_to_keep`), or None."""
        if kept is None:
            hidden_states = select_positions(hidden_states, logits_to_keep)
        return self.model.compute_logits(hidden_states)


def _positions_to_keep(logits_to_keep: int | slice | torch.Tensor) -> slice | torch.Tensor | None:
    """The positions of `logits_to_keep` the model itself can keep (its last block then computes only them): a slice
    or a 1D index; None for all positions or an index of another form."""
    if isinstance(logits_to_keep, int):
        return slice(-logits_to_keep, None) if logits_to_keep > 0 else None
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() != 1:
        return None
    return logits_to_keep


__all__ = ["LLaDAModel", "LLaDAModelLM", "LLaDAPreTrainedModel"]
