"""LLaDA2.x (`llada2_moe`) masked block-diffusion MoE language model for transformers 5.

The module tree reproduces the Hub checkpoints' parameter names (`model.word_embeddings.weight`,
`model.layers.{i}.attention.query_key_value.weight`, `model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...,
`lm_head.weight`), so `from_pretrained` reads `inclusionAI/LLaDA2.0-mini`, `-flash` and `LLaDA2.1-*` safetensors
unchanged. The math follows the original `modeling_llada2_moe.py` (arXiv:2512.15745; the Ling 2.0 body):

- RMS norms computed in float32, scaled in the model dtype; per-head RMS norm of queries and keys before RoPE;
- partial RoPE: rotate-half on the first `int(head_dim * partial_rotary_factor)` dims of each head, cos/sin
  computed in float32 and applied in the model dtype;
- grouped-query attention with a fused `query_key_value` projection (q, k, v rows in that order);
- layers `>= first_k_dense_replace` are MoE (`llada2_moe_layer.py`): a float32 router (sigmoid or softmax scores;
  `expert_bias` added for choosing experts only; group-limited top-k, or LLaDA2.2's block routing where the config
  sets `block_size` / `expert_capacity`, each row's blocks of `block_size` absolute positions made once per forward;
  normalised weights times `routed_scaling_factor`), the chosen experts' outputs combined in float32, plus the
  shared experts;
- **block-causal attention**: position i sees position j iff `j // block_length <= i // block_length`, the mask
  LLaDA2 is trained and decoded with (a block attends to itself and to every earlier block).

Attention dispatches through transformers' `ALL_ATTENTION_FUNCTIONS` (`eager`, `sdpa`, `flex_attention` and the
backends `attention.py` registers). The mask is built inside the forward, per call, from `cache_position` and a
block-causal mask function through transformers' mask interface (`ALL_MASK_ATTENTION_FUNCTIONS`: a BlockMask for
flex, sdpa's boolean `(B, 1, q, T)` mask for sdpa, eager and llada_triton), without host synchronisation for the
tensor masks, so a generation step that builds it can be captured in a CUDA graph.

The routed experts run as two grouped GEMMs (`torch._grouped_mm`) over stacked views of the Hub-named expert
weights where torch provides them, else as a loop over the experts that received tokens (`LLaDA2MoeSparseMoeBlock`,
`llada2_moe_layer.py`).
Where the fused kernels run (`kernels.use_fused_kernels`: CUDA with Triton), the router's top-k, the alignment by
expert, the weighted combine with the shared expert (one more grouped-GEMM group) and the residual, the residual add
before the post-attention norm, and the q/k norms with RoPE and the cache write are Triton kernels
(`triton_moe.py`): ~25 kernels per layer instead of ~110, no host synchronisation; on tensor-parallel shards as well
(each rank's heads and expert slices, one all-reduce of the MoE's partial sums). The default attention is
`llada_triton` (as LLaDA's): the split-KV kernel with the block-causal mask on CUDA block steps, sdpa elsewhere.

This file is exported verbatim as Hub remote code: relative imports only.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import triton_moe, triton_ops
from .attention import TRITON_ATTENTION, register_attention_backends
from .cache import DiffusionKVCache, PositionTables, cache_output, output_cache, resolve_forward_positions
from .configuration_llada2_moe import LLaDA2MoeConfig
from .family_llada2 import LLADA2, LLADA22
from .fp8 import QuantizesFromLoadDtype
from .generation_utils import (
    DiffusionGenerationConfig,
    DiffusionGenerationMixin,
    select_positions,
)
from .grouped_gemm import other_ranks_expert_keys
from .kernels import linear, use_fused_kernels
from .llada2_moe_layer import (
    EXPERTS_GROUPED_MM,
    EXPERTS_IMPLEMENTATIONS,
    LLaDA2MoeGate,
    LLaDA2MoeMLP,
    LLaDA2MoeSparseMoeBlock,
    RoutingBlocks,
    routing_blocks_for_packed,
    routing_blocks_for_positions,
)
from .packed import PackedRows, run_attention
from .tensor_parallel import is_sharded, local_tensor, shard_range
from .triton_attention import block_attention, num_sms
from .triton_moe import TRITON_AVAILABLE as MOE_KERNELS_AVAILABLE  # (`from .x import`: how the Hub finds the file)

register_attention_backends()

# `llada_triton` runs its split-KV kernel on a block step (at most `BLOCK_STEP_QUERY_ROWS` query rows per key/value
# head) at every batch size: with the tiles of grouped queries and `kv_end` it beats sdpa on grouped queries from
# batch 1 to 32 on an H100 at LLaDA2.0-mini's shapes (8.6 against 31.6 us per layer at batch 1, 24.7 against 57.0 at
# batch 32; `triton_attention.GROUPED_QUERY_TILES`). Forwards of more queries (a prefill) take it while the (row,
# key/value head) pairs are at most `SPLIT_KV_KV_HEADS_PER_SM` per multiprocessor, sdpa beyond.
BLOCK_STEP_QUERY_ROWS = 128
SPLIT_KV_KV_HEADS_PER_SM = 0.5


class LLaDA2MoeRMSNorm(nn.Module):
    """RMS norm as in LLaDA2: normalise in float32, cast back to the input dtype, then scale."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(hidden_states):
            # The same arithmetic in one kernel (LLaDA's, `kernels.py`): eight PyTorch kernels per norm otherwise.
            return triton_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(input_dtype)


def rotary_cos_sin(
    position_ids: torch.Tensor, config: LLaDA2MoeConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for `position_ids` `(batch, q_len)`: cos, sin `(batch, q_len, rotary_dim)` in `dtype`.

    As the original rotary embedding: inverse frequencies and angles in float32 (`rotary_dim` =
    `int(head_dim * partial_rotary_factor)`), cast to the model dtype afterwards. Linear `rope_scaling` divides
    the frequencies by its factor.
    """
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
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)


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
    """Reference attention. query `(b, h, q, d)`, key/value `(b, h_kv, k, d)`, mask `(b, 1, q, k)` (bool, True =
    attend, or additive float). Returns the output `(b, q, h, d)` and the weights `(b, h, q, k)`.

    The causal structure is entirely in the mask (block-causal for LLaDA2), never implied by the backend."""
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


def block_causal_mask_function(block_length: int, kv_shift: int | torch.Tensor = 0) -> Callable:
    """transformers mask function: query column `q_idx` may attend key column `kv_idx + kv_shift` iff the key's
    block is not after the query's (`(kv_idx + kv_shift) // block_length <= q_idx // block_length`).

    `kv_shift` turns key indices into absolute columns when the keys are not the cache's columns `[0, kv_len)` (a
    forward without cache whose inputs start at column `cache_position[0]`). Index arithmetic only, so it runs
    broadcast (sdpa / eager masks), compiled (flex BlockMask) and under CUDA-graph capture alike."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx + kv_shift) // block_length <= q_idx // block_length

    return inner_mask


def _has_query_dim(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[-2] != 1


def block_mask_from_bool(mask: torch.Tensor, batch: int):
    """A flex `BlockMask` equal to the bool mask `(batch or 1, 1, q_len, kv_len)` (True = attend)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = mask.expand(batch, 1, *mask.shape[2:])

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return mask[batch_idx, 0, q_idx, kv_idx]

    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=mask.shape[2], KV_LEN=mask.shape[3], device=mask.device)


class LLaDA2MoeAttention(nn.Module):
    """Multi-head attention with a fused `query_key_value` projection, per-head q/k RMS norms and partial RoPE.

    It is the `module` handed to the attention functions, hence `is_causal`, `num_key_value_groups`,
    `layer_idx` and `scaling` on it."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # Block-causal attention comes entirely from the mask: no backend may add a causal mask of its own.
        self.is_causal = False
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout or 0.0
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.query_key_value = nn.Linear(
            config.hidden_size, (heads + 2 * kv_heads) * self.head_dim, bias=config.use_qkv_bias
        )
        if config.use_qk_norm:
            self.query_layernorm = LLaDA2MoeRMSNorm(self.head_dim, config.rms_norm_eps)
            self.key_layernorm = LLaDA2MoeRMSNorm(self.head_dim, config.rms_norm_eps)
        self.dense = nn.Linear(heads * self.head_dim, config.hidden_size, bias=config.use_bias)
        self._local_heads: tuple[torch.Tensor, tuple[tuple[int, int], tuple[int, int]]] | None = None  # local_heads
        self._local_projection: tuple | None = None  # (weight, its pointer and heads, local_projection())

    # This rank's heads, read from the columns of `dense` it holds: all heads unless tensor parallelism split them.
    @property
    def num_heads(self) -> int:
        (start, stop), _ = self.local_heads()
        return stop - start

    @property
    def num_kv_heads(self) -> int:
        _, (start, stop) = self.local_heads()
        return stop - start

    @property
    def num_key_value_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def local_heads(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """`[start, stop)` of this rank's query heads and of the key/value heads they read (grouped-query attention:
        query head h reads key/value head `h // (heads / kv_heads)`; several ranks may read the same one).

        Derived from `dense.weight` once and kept until that parameter is replaced (tensor parallelism swaps it for
        a sharded one when loading): the head counts are read several times per layer and forward."""
        weight = self.dense.weight
        if self._local_heads is not None and self._local_heads[0] is weight:
            return self._local_heads[1]
        heads = self._derive_local_heads(weight)
        self._local_heads = (weight, heads)
        return heads

    def _derive_local_heads(self, weight: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
        start, stop = shard_range(weight, 1)
        q_start, q_stop = start // self.head_dim, stop // self.head_dim
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        kv_start, kv_stop = q_start // group, (q_stop - 1) // group + 1
        count = q_stop - q_start
        if q_start % count or (count % group if count >= group else group % count):
            raise ValueError(
                f"Tensor parallelism gives this rank query heads [{q_start}, {q_stop}), which do not split the "
                f"key/value groups of {group} heads evenly: use a number of ranks that divides "
                f"num_attention_heads ({self.config.num_attention_heads}) and divides or is divided by "
                f"num_key_value_heads ({self.config.num_key_value_heads})."
            )
        return (q_start, q_stop), (kv_start, kv_stop)

    def project_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
        """The q/k/v projection of `hidden_states` `(batch, q_len, hidden)`: `(qkv (batch, q_len, (Hq + 2 Hkv) *
        head_dim), (Hq, Hkv) the heads it holds, (first query head, first key/value head) of this rank's among
        them)`.

        Under tensor parallelism the projection is replicated (`LLaDA2MoeConfig.base_model_tp_plan`) and each rank
        multiplies only the rows of its own heads (`local_projection`): no collective, and only this rank's share of
        the weight is read. A projection whose output is gathered (a plan that splits it) holds every head."""
        heads = (self.config.num_attention_heads, self.config.num_key_value_heads)
        (q_start, _), (kv_start, _) = self.local_heads()
        if self.num_heads == heads[0] or is_sharded(self.query_key_value.weight):
            return linear(self.query_key_value, hidden_states), heads, (q_start, kv_start)
        weight, bias = self.local_projection()
        return nn.functional.linear(hidden_states, weight, bias), (self.num_heads, self.num_kv_heads), (0, 0)

    def local_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight `((Hq_local + 2 Hkv_local) * head_dim, hidden)`, bias or None): the rows of the replicated
        `query_key_value` for this rank's query heads, then its key/value heads' keys, then their values. Made once
        and kept until the parameter or its storage is replaced."""
        weight, bias = local_tensor(self.query_key_value.weight), self.query_key_value.bias
        key = (weight.data_ptr(), self.local_heads())
        cached = self._local_projection
        if cached is not None and cached[0] is weight and cached[1] == key:
            return cached[2]
        (q_start, q_stop), (kv_start, kv_stop) = self.local_heads()
        heads, kv_heads, size = self.config.num_attention_heads, self.config.num_key_value_heads, self.head_dim
        rows = torch.cat(
            [
                torch.arange(q_start * size, q_stop * size),
                torch.arange((heads + kv_start) * size, (heads + kv_stop) * size),
                torch.arange((heads + kv_heads + kv_start) * size, (heads + kv_heads + kv_stop) * size),
            ]
        ).to(weight.device)
        with torch.inference_mode(False), torch.no_grad():
            projection = (weight[rows].contiguous(), None if bias is None else local_tensor(bias)[rows].contiguous())
        self._local_projection = (weight, key, projection)
        return projection

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask=None,
        past_key_values: Cache | DiffusionKVCache | None = None,
        cache_position: torch.Tensor | None = None,
        grouped_query_mask: torch.Tensor | None = None,
        kv_end: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states `(batch, q_len, hidden)`; position_embeddings: cos, sin `(batch, q_len, rotary_dim)`;
        grouped_query_mask: `attention_mask` as `grouped_query_mask(attention_mask, n_rep)` gives it, and kv_end
        `(batch,)`: `visible_key_end(attention_mask)` (each made once per forward by the model) for the fused path."""
        batch, q_len, _ = hidden_states.shape
        implementation = self.config._attn_implementation
        if self.uses_fused_path(hidden_states, past_key_values):
            return self._fused_forward(
                hidden_states,
                position_embeddings,
                attention_mask,
                past_key_values,
                cache_position,
                grouped_query_mask,
                kv_end,
            )
        qkv, (heads, kv_heads), (q_first, kv_first) = self.project_qkv(hidden_states)
        query, key, value = qkv.view(batch, q_len, -1, self.head_dim).split([heads, kv_heads, kv_heads], dim=2)
        q_count, kv_count = self.num_heads, self.num_kv_heads
        if q_count < heads:  # the projection holds more heads than this rank's (a gathered projection): keep its own
            query = query[:, :, q_first : q_first + q_count]
            key, value = key[:, :, kv_first : kv_first + kv_count], value[:, :, kv_first : kv_first + kv_count]
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if self.config.use_qk_norm:
            query, key = self.query_layernorm(query), self.key_layernorm(key)
        cos, sin = position_embeddings
        query, key = apply_partial_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx, {"cache_position": cache_position})

        def interface(module, query, key, value, mask, **kw):  # the backend's function for this mask
            return attention_function(implementation, mask)(module, query, key, value, mask, **kw)

        attn = run_attention(  # a `PackedRows` mask: once per packed row, with its block-causal mask
            interface,
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return linear(self.dense, attn.reshape(batch, q_len, -1))

    def uses_fused_path(self, hidden_states: torch.Tensor, past_key_values) -> bool:
        """Whether `forward` takes `_fused_forward`: a `DiffusionKVCache`, the fused kernels, inference, and a head
        size that is a power of two. Under tensor parallelism too: the fused kernel takes this rank's heads
        (`local_heads`) out of the gathered q/k/v projection."""
        return (
            isinstance(past_key_values, DiffusionKVCache)
            and MOE_KERNELS_AVAILABLE
            and use_fused_kernels(hidden_states)
            and not self.training
            and self.head_dim & (self.head_dim - 1) == 0
        )

    def _fused_forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask,
        past_key_values: DiffusionKVCache,
        cache_position: torch.Tensor,
        grouped_query_mask: torch.Tensor | None,
        kv_end: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` with a `DiffusionKVCache` where the fused kernels run: q/k norms, partial RoPE and the cache
        write in one kernel (`triton_moe.qk_norm_rope_to_cache`); with sdpa and a boolean mask, grouped-query
        attention as multi-head attention of the `n_rep * q_len` queries of each key/value head, so the cached keys
        and values are read in place (sdpa with a mask would otherwise copy them `n_rep` times)."""
        batch, q_len, _ = hidden_states.shape
        keys, values = past_key_values.layer(self.layer_idx, batch, self.num_kv_heads, self.head_dim, hidden_states)
        norms = (self.query_layernorm, self.key_layernorm) if self.config.use_qk_norm else (None, None)
        cos, sin = position_embeddings
        # The kernel reads this rank's query heads and the key/value heads they use out of the projection's heads.
        qkv, projection_heads, first_heads = self.project_qkv(hidden_states)
        query = triton_moe.qk_norm_rope_to_cache(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            None if norms[0] is None else norms[0].weight,
            None if norms[1] is None else norms[1].weight,
            self.config.rms_norm_eps,
            cos,
            sin,
            keys,
            values,
            cache_position,
            projection_heads=projection_heads,
            first_heads=first_heads,
        )
        if self.split_kv_applies(hidden_states, attention_mask):
            # hf_dllm's split-KV kernel (`triton_attention.py`), each query row with its own mask row; it writes
            # `(B, L, Hq, D)`, the layout the output projection reads.
            mask = None if attention_mask is None else attention_mask[:, 0].expand(batch, q_len, keys.shape[2])
            if kv_end is None and attention_mask is not None:
                kv_end = visible_key_end(attention_mask)
            attn = block_attention(query, keys, values, mask, self.scaling, kv_end=kv_end)
            return linear(self.dense, attn.reshape(batch, q_len, -1))
        if grouped_query_mask is None and self.grouped_query_sdpa_applies(hidden_states, attention_mask):
            grouped_query_mask = grouped_query_mask_for(attention_mask, self.num_key_value_groups)
        if grouped_query_mask is not None:
            n_rep = self.num_key_value_groups
            attn = nn.functional.scaled_dot_product_attention(
                query.view(batch, self.num_kv_heads, n_rep * q_len, self.head_dim),
                keys,
                values,
                attn_mask=grouped_query_mask,
                scale=self.scaling,
            )
            # reshape, not view: sdpa may return a non-contiguous layout (CUDA float32 memory-efficient attention).
            attn = attn.reshape(batch, self.num_heads, q_len, self.head_dim).transpose(1, 2)
        else:
            attention_interface = attention_function(self.config._attn_implementation, attention_mask)
            attn, _ = attention_interface(self, query, keys, values, attention_mask, dropout=0.0, scaling=self.scaling)
        return linear(self.dense, attn.reshape(batch, q_len, -1))

    def split_kv_applies(self, hidden_states: torch.Tensor, attention_mask) -> bool:
        """Whether the fused path runs the `llada_triton` backend's split-KV kernel for these activations `(batch,
        q_len, hidden)`: that backend, a boolean 4D mask (or none), a head size and an activation dtype the kernel
        takes (the weights' may be FP8), and a block step (`BLOCK_STEP_QUERY_ROWS`) or at most
        `SPLIT_KV_KV_HEADS_PER_SM` (row, key/value head) pairs per multiprocessor (measured by
        `benchmarks/bench_llada2_kernels.py`)."""
        mask_ok = attention_mask is None or _is_boolean_4d(attention_mask)
        batch, q_len, _ = hidden_states.shape
        device = hidden_states.device
        return (
            self.config._attn_implementation == TRITON_ATTENTION
            and mask_ok
            and self.head_dim >= 16
            and hidden_states.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (
                device.type != "cuda"
                or self.num_key_value_groups * q_len <= BLOCK_STEP_QUERY_ROWS
                or batch * self.num_kv_heads <= SPLIT_KV_KV_HEADS_PER_SM * num_sms(device)
            )
        )

    def grouped_query_sdpa_applies(self, hidden_states: torch.Tensor, attention_mask) -> bool:
        """Whether the fused path runs sdpa on grouped queries (`grouped_query_mask_for`) for these activations:
        sdpa, or llada_triton where its split-KV kernel does not run (`split_kv_applies`), with a boolean
        4D mask."""
        implementation = self.config._attn_implementation
        if implementation not in ("sdpa", TRITON_ATTENTION) or not _is_boolean_4d(attention_mask):
            return False
        return not self.split_kv_applies(hidden_states, attention_mask)


def attention_function(implementation: str, attention_mask) -> Callable:
    """The attention function of `implementation` for this mask. attention.py's split-KV kernel reads a key padding
    mask `(B, 1, 1, T)` only (row 0 of any other mask): with `llada_triton`, a block-causal mask with a query
    dimension runs on sdpa, as that backend does everywhere else."""
    if implementation == TRITON_ATTENTION and _has_query_dim(attention_mask):
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)


def visible_key_end(attention_mask: torch.Tensor) -> torch.Tensor:
    """`(batch,)` int32: one past the last key column that any query of the row attends to in the boolean mask
    `(batch, 1, q, T)`. The split-KV kernel never reads the key tiles from there on (a block-causal step's later
    blocks, whose columns the cache holds but no query of the block sees)."""
    seen = attention_mask.any(dim=-2)[:, 0]
    columns = torch.arange(1, seen.shape[-1] + 1, device=seen.device, dtype=torch.int32)
    return (seen * columns).amax(dim=-1).to(torch.int32)


def _is_boolean_4d(attention_mask) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool and attention_mask.dim() == 4


def grouped_query_mask_for(attention_mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The mask `(b, 1, q, T)` (boolean or additive) for the queries of one key/value head laid out as `n_rep * q`
    rows (row `r * q + i` is query `i` of the group's head `r`): `(b, 1, n_rep * q, T)`."""
    batch, _, q_len, kv_len = attention_mask.shape
    expanded = attention_mask[:, :, None].expand(batch, 1, n_rep, q_len, kv_len)
    return expanded.reshape(batch, 1, n_rep * q_len, kv_len)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as sdpa's additive form in `dtype`: 0 where True, the dtype's lowest value
    elsewhere (finite, as transformers' eager masks: a query row with no key left, e.g. left padding in a prefill,
    averages the keys instead of dividing 0 by 0; every other row gets exactly the weights of -inf)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


class LLaDA2MoeDecoderLayer(GradientCheckpointingLayer):
    """`x + Attn(norm(x))`, then `x + MLP(norm(x))` with a dense MLP or the MoE block (`mlp`)."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.attention = LLaDA2MoeAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = LLaDA2MoeSparseMoeBlock(config)
        else:
            self.mlp = LLaDA2MoeMLP(config, config.intermediate_size)
        self.input_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask=None,
        past_key_values: Cache | DiffusionKVCache | None = None,
        cache_position: torch.Tensor | None = None,
        routing_blocks: RoutingBlocks | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the new hidden states `(batch, q_len, hidden)` and the router logits (None in dense layers).
        routing_blocks: the tokens' MoE routing blocks (LLaDA2.2's block routing; the model makes them)."""
        moe_kwargs = {"routing_blocks": routing_blocks} if isinstance(self.mlp, LLaDA2MoeSparseMoeBlock) else {}
        if use_fused_kernels(hidden_states):
            # The residual adds fused into the post-attention norm and into the MoE's combine kernel.
            attn = self.attention(
                self.input_layernorm(hidden_states),
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                cache_position=cache_position,
                **kwargs,
            )
            norm = self.post_attention_layernorm
            fused_moe = isinstance(self.mlp, LLaDA2MoeSparseMoeBlock) and self.mlp.use_fused(attn)
            # For the fused MoE the norm also writes its output in float32 where the router would cast it (float32
            # logits, as the reference): one cast kernel less per layer (~17 us at batch 32 on an H100).
            wide = fused_moe and self.mlp.gate.needs_float32_copy(attn.dtype, attn.device)
            normed, hidden_states, *router_input = triton_ops.rms_norm(
                attn, norm.weight, norm.variance_epsilon, residual=hidden_states, float_copy=wide
            )
            if fused_moe:
                return self.mlp.fused_forward(normed, hidden_states, router_input[0] if wide else None, **moe_kwargs)
            mlp_out = self.mlp(normed, **moe_kwargs)
            router_logits = None
            if isinstance(mlp_out, tuple):
                mlp_out, router_logits = mlp_out
            return hidden_states + mlp_out, router_logits
        hidden_states = hidden_states + self.attention(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            cache_position=cache_position,
            **kwargs,
        )
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states), **moe_kwargs)
        router_logits = None
        if isinstance(mlp_out, tuple):
            mlp_out, router_logits = mlp_out
        return hidden_states + mlp_out, router_logits


class LLaDA2MoePreTrainedModel(QuantizesFromLoadDtype, PreTrainedModel):
    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    # FlashAttention takes a key padding mask at most: it cannot express the block-causal mask.
    _supports_flash_attn = False
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
        if isinstance(module, LLaDA2MoeGate):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.expert_bias is not None:
                init.zeros_(module.expert_bias)

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        # Unless asked otherwise, LLaDA2 runs hf_dllm's backend, as LLaDA does: on CUDA block steps the split-KV
        # Triton kernel with the block-causal mask, transformers' sdpa everywhere else (see `LLaDA2MoeAttention`).
        if attn_implementation is None:
            attn_implementation = TRITON_ATTENTION
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers detects its own experts decorator; this model selects its experts path itself (see
        # `LLaDA2MoeSparseMoeBlock`).
        return True

    def _check_and_adjust_experts_implementation(self, experts_implementation: str | None) -> str:
        if experts_implementation is None:
            return EXPERTS_GROUPED_MM
        if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ValueError(
                f"{type(self).__name__} supports experts_implementation in {EXPERTS_IMPLEMENTATIONS}, got "
                f"{experts_implementation!r}."
            )
        return experts_implementation


class LLaDA2MoeModel(LLaDA2MoePreTrainedModel):
    """The transformer: `word_embeddings`, `layers`, `norm`."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        pad = config.pad_token_id
        padding_idx = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx)
        self.layers = nn.ModuleList([LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LLaDA2MoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        # RoPE tables where the cache bounds the positions (`cache.PositionTables`; on GPUs: on the CPU a table's
        # vectorised cos could round differently from the per-call one at a few positions).
        self._rope_tables = PositionTables(self._rope_rows)
        self.post_init()

    def _rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary_cos_sin` of `positions` in `dtype`: what `_rope_tables` tabulates."""
        return rotary_cos_sin(positions, self.config, dtype)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.word_embeddings = value

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
        block_length: int | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        r"""
        Args:
            input_ids: `(batch, q_len)` token ids of the positions computed in this call.
            attention_mask: either a prepared 4D mask, used as given (bool `(batch, 1, q_len, kv_len)` with True =
                attend, additive float, or a flex `BlockMask`); or a 2D key padding mask `(batch, kv_len)` (1 real,
                0 padding) over the keys this call attends to: columns `[0, kv_len)` of the cache with a
                `past_key_values` (its whole buffer for a `DiffusionKVCache`), this call's own columns without
                one. The 2D mask (or None) is combined with the block-causal mask of `block_length`. Or a
                `packed.PackedRows` (also given as `past_key_values`): rows end to end in one row `(1, T)`, each
                with the block-causal mask of a row alone at columns `[0, length)`.
            position_ids: `(batch, q_len)` RoPE positions; by default counted from each row's first real key in
                the 2D mask, else `cache_position`.
            past_key_values: a `DynamicCache` (new keys are appended, as in transformers) or a `DiffusionKVCache`
                (new keys are written in place at `cache_position`; attention covers the whole pre-allocated
                sequence, and the block-causal mask hides every block after the query's).
            cache_position: `(q_len,)` columns of the full sequence the inputs sit at (consecutive).
            block_length: block size of the block-causal mask: column i sees column j iff
                `j // block_length <= i // block_length`. `None` = 1 (plain causal attention).
            output_router_logits: also return each MoE layer's router logits `(batch * q_len, num_experts)`.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("LLaDA2MoeModel.forward needs exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        # Key columns this call attends to: [0, kv_length) of the cache, or its own inputs without one.
        past_key_values, cache_position, position_ids, mask_2d, kv_length = resolve_forward_positions(
            inputs_embeds, attention_mask, position_ids, past_key_values, use_cache, cache_position
        )
        bound = PositionTables.bound_of(past_key_values)
        if bound is None or position_ids.device.type == "cpu":
            position_embeddings = rotary_cos_sin(position_ids, self.config, inputs_embeds.dtype)
        else:  # rows of a table computed once (the same values): a lookup instead of ~12 kernels a step
            position_embeddings = self._rope_tables.lookup(position_ids, bound, inputs_embeds.dtype)

        if getattr(self.config, "block_size", None) is not None and getattr(self.config, "expert_capacity", None):
            # LLaDA2.2's block routing: each row's blocks of `block_size` absolute positions, padding apart (made
            # once per forward, without host synchronisation).
            if isinstance(attention_mask, PackedRows):
                rows = getattr(attention_mask, "rows", None)  # made with its cache's columns, else here
                kwargs["routing_blocks"] = routing_blocks_for_packed(
                    attention_mask.lengths, position_ids[0], self.config.block_size, rows
                )
            else:
                real = None
                if mask_2d is not None:
                    real = mask_2d if past_key_values is None else mask_2d[:, cache_position]
                    real = real.to(device=inputs_embeds.device, dtype=torch.bool)
                positions = position_ids.expand(inputs_embeds.shape[0], -1)
                kwargs["routing_blocks"] = routing_blocks_for_positions(positions, self.config.block_size, real)
        if isinstance(attention_mask, PackedRows):  # each packed row at its own columns [0, length), alone
            attention_mask = attention_mask.with_row_masks(
                lambda length: self._block_causal_mask(
                    None,
                    inputs_embeds[:, :length],
                    torch.arange(length, device=inputs_embeds.device),
                    length,
                    True,
                    block_length,
                )
            )
        elif attention_mask is None or mask_2d is not None:
            attention_mask = self._block_causal_mask(
                mask_2d, inputs_embeds, cache_position, kv_length, past_key_values is None, block_length
            )
        elif (
            isinstance(attention_mask, torch.Tensor)
            and attention_mask.dtype == torch.bool
            and self.config._attn_implementation == "flex_attention"
        ):
            # flex would add a tensor mask to the scores (and its compiled CPU kernel crashes on one): a boolean
            # mask becomes the BlockMask it describes.
            attention_mask = block_mask_from_bool(attention_mask, inputs_embeds.shape[0])

        hidden_states = inputs_embeds
        all_hidden_states = () if output_hidden_states else None
        all_router_logits = () if output_router_logits else None
        attention = self.layers[0].attention
        if attention.uses_fused_path(inputs_embeds, past_key_values) and attention.grouped_query_sdpa_applies(
            inputs_embeds, attention_mask
        ):
            # Made once here, not in each layer, and additive: sdpa would turn a boolean mask into one in every layer
            # (on an H100 at LLaDA2.0-mini's batch-32 block step: ~7 us a layer, and 47.5 against 56.5 us of attention).
            kwargs["grouped_query_mask"] = grouped_query_mask_for(
                additive_mask(attention_mask, inputs_embeds.dtype), attention.num_key_value_groups
            )
        elif (
            attention.uses_fused_path(inputs_embeds, past_key_values)
            and attention_mask is not None
            and attention.split_kv_applies(inputs_embeds, attention_mask)
        ):
            kwargs["kv_end"] = visible_key_end(attention_mask)  # once here, not in each layer
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, router_logits = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                cache_position=cache_position,
                **kwargs,
            )
            if output_router_logits and router_logits is not None:
                all_router_logits += (router_logits,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return MoeModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=all_hidden_states,
            router_logits=all_router_logits,
            **cache_output(past_key_values if use_cache else None),
        )

    def _block_causal_mask(
        self,
        key_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor,
        cache_position: torch.Tensor,
        kv_length: int,
        keys_are_inputs: bool,
        block_length: int | None,
    ):
        """The block-causal mask (AND the key padding `key_mask` `(batch, kv_length)`) in the format of the
        configured attention backend, from transformers' mask interface.

        Queries sit at columns `cache_position` (`q_offset = cache_position[0]`, a device tensor: reading it would
        synchronise); keys are columns `[0, kv_length)`, or the inputs' own columns when `keys_are_inputs`. Never
        skipped (a None mask would let sdpa choose bidirectional attention)."""
        block = 1 if block_length is None else block_length
        if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
            raise ValueError(f"`block_length` must be a positive integer or None, got {block_length!r}.")
        q_offset = cache_position[0]
        mask_function = block_causal_mask_function(block, q_offset if keys_are_inputs else 0)
        implementation = self.config._attn_implementation
        if implementation in (TRITON_ATTENTION, "eager") or implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
            # sdpa's boolean mask `(B, 1, q, T)` serves: llada_triton, whose own mask function builds key padding
            # masks `(B, 1, 1, T)` only (and whose attention hands such masks to sdpa); eager, whose reference
            # attention here takes boolean masks (transformers' `eager_mask` adds a float conversion that some
            # transformers 5 releases do with a host-to-device copy, which breaks CUDA-graph capture); and
            # backends registered without a mask function.
            mask_interface = sdpa_mask
        else:
            mask_interface = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
        if key_mask is not None:
            key_mask = key_mask.to(device=inputs_embeds.device, dtype=torch.bool)
        return mask_interface(
            batch_size=inputs_embeds.shape[0],
            q_length=inputs_embeds.shape[1],
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=0,
            mask_function=mask_function,
            attention_mask=key_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            dtype=inputs_embeds.dtype,
            config=self.config,
            use_vmap=False,
            device=inputs_embeds.device,
        )


class LLaDA2MoeModelLM(LLaDA2MoePreTrainedModel, DiffusionGenerationMixin):
    """LLaDA2.x with its output head and the diffusion `generate()` (see `DiffusionGenerationMixin`).

    `forward` returns float32 logits (as the original) for every position or those selected by `logits_to_keep`;
    the logits at position i predict the token at position i itself (no shift).
    """

    generation_config_class = DiffusionGenerationConfig
    # Interface of DiffusionGenerationMixin: the family (block-causal attention: the generation loop passes its
    # block length and never needs keys after the current block; position i predicts token i).
    diffusion_families = (LLADA2, LLADA22)
    # Attention layers attend within each packed row (`packed.PackedRows`), each with its block-causal mask.
    diffusion_packed_rows = True
    _tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}
    # Tensor parallelism (see `LLaDA2MoeConfig.base_model_tp_plan`): the head split by vocabulary rows, the logits
    # gathered, so every rank unmasks from the same logits.
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.model = LLaDA2MoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.word_embeddings = value

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
        return_dict: bool | None = None,
        block_length: int | None = None,
        output_router_logits: bool | None = None,
        float_logits: bool = True,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast | tuple:
        r"""
        Same arguments as `LLaDA2MoeModel.forward`, plus `logits_to_keep`: an `int` keeps the last n positions
        (0 keeps all), a `slice` or a 1D index tensor selects positions, so the `(…, vocab)` head runs only where
        logits are needed. Returns `MoeCausalLMOutputWithPast` with `logits` `(batch, kept, vocab)`: float32 (as the
        Hub's model returns them), or with `float_logits=False` in the model dtype (the generation loop's).
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
            block_length=block_length,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        logits = linear(self.lm_head, select_positions(hidden_states, logits_to_keep))
        if float_logits:
            logits = logits.float()
        output = MoeCausalLMOutputWithPast(
            logits=logits,
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
            **cache_output(output_cache(outputs)),
        )
        use_return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if use_return_dict else output.to_tuple()

    # DiffusionGenerationMixin hooks.
    def _diffusion_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask,
        position_ids: torch.Tensor,
        cache: Cache | DiffusionKVCache | None,
        cache_position: torch.Tensor,
        logits_slice,
        **forward_kwargs,
    ) -> torch.Tensor:
        """The loop's forward: `forward`'s logits without their float32 copy, in the model dtype (as LLaDA's and
        Dream's). The unmasking rules widen them to float32 where they compute (`decoding.propose_tokens`; the fused
        greedy kernel as it reads), so every token and confidence is the same; a batch-32 block step no longer writes
        and re-reads 0.64 GB of float32 logits."""
        return super()._diffusion_forward(
            input_ids,
            attention_mask,
            position_ids,
            cache,
            cache_position,
            logits_slice,
            float_logits=False,
            **forward_kwargs,
        )

    def _diffusion_step_capturable(self) -> bool:
        """Whether a denoising step can be captured in a CUDA graph: only if the MoE never synchronises with the
        host for the model's activations (`LLaDA2MoeSparseMoeBlock.never_synchronizes`: the fused path, or torch's
        grouped GEMM in bfloat16)."""
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, LLaDA2MoeSparseMoeBlock)]
        if not blocks:
            return True
        embedding = local_tensor(self.model.word_embeddings.weight)  # the activations' dtype and device
        return blocks[0].never_synchronizes(embedding.new_empty(0, embedding.shape[1]))

    def _diffusion_attention_mask(self, key_mask: torch.Tensor, q_len: int) -> torch.Tensor:
        """The `(rows, seq_len)` key padding mask unchanged: the block-causal mask depends on each step's
        `cache_position`, so the forward builds it (without host synchronisation)."""
        return key_mask


__all__ = ["LLaDA2MoeModel", "LLaDA2MoeModelLM", "LLaDA2MoePreTrainedModel"]
