"""LLaDA2.x (`llada2_moe`) masked block-diffusion MoE language model for transformers 5.

The module tree reproduces the Hub checkpoints' parameter names (`model.word_embeddings.weight`,
`model.layers.{i}.attention.query_key_value.weight`, `model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...,
`lm_head.weight`), so `from_pretrained` reads `inclusionAI/LLaDA2.0-mini`, `-flash` and `LLaDA2.1-*` safetensors
unchanged. The math follows the original `modeling_llada2_moe.py` (arXiv:2512.15745; the Ling 2.0 body):

- RMS norms computed in float32, scaled in the model dtype; per-head RMS norm of queries and keys before RoPE;
- partial RoPE: rotate-half on the first `int(head_dim * partial_rotary_factor)` dims of each head, cos/sin
  computed in float32 and applied in the model dtype;
- grouped-query attention with a fused `query_key_value` projection (q, k, v rows in that order);
- layers `>= first_k_dense_replace` are MoE: a float32 router (sigmoid or softmax scores; `expert_bias` added for
  choosing experts only; group-limited top-k; normalised weights times `routed_scaling_factor`), the chosen
  experts' outputs combined in float32, plus the shared experts;
- **block-causal attention**: position i sees position j iff `j // block_length <= i // block_length`, the mask
  LLaDA2 is trained and decoded with (a block attends to itself and to every earlier block).

Attention dispatches through transformers' `ALL_ATTENTION_FUNCTIONS` (`eager`, `sdpa`, `flex_attention` and the
backends `attention.py` registers). The mask is built inside the forward, per call, from `cache_position` and a
block-causal mask function through transformers' mask interface (`ALL_MASK_ATTENTION_FUNCTIONS`: a BlockMask for
flex, sdpa's boolean `(B, 1, q, T)` mask for sdpa, eager and llada_triton), without host synchronisation for the
tensor masks, so a generation step that builds it can be captured in a CUDA graph.

The routed experts run as two grouped GEMMs (`torch._grouped_mm`) over stacked views of the Hub-named expert
weights where torch provides them, else as a loop over the experts that received tokens (`LLaDA2MoeSparseMoeBlock`).
Where the fused kernels run (`kernels.use_fused_kernels`: CUDA with Triton), the router's top-k, the alignment by
expert, the weighted combine with the shared expert (one more grouped-GEMM group) and the residual, the residual add
before the post-attention norm, and the q/k norms with RoPE and the cache write are Triton kernels
(`triton_moe.py`): ~25 kernels per layer instead of ~110, no host synchronisation. The default attention is
`llada_triton` (as LLaDA's): the split-KV kernel with the block-causal mask on CUDA block steps, sdpa elsewhere.

This file is exported verbatim as Hub remote code: relative imports only.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.import_utils import is_torch_greater_or_equal

from . import triton_moe, triton_ops
from .attention import TRITON_ATTENTION, register_attention_backends
from .cache import DiffusionKVCache, resolve_forward_positions
from .configuration_llada2_moe import ROUTER_DTYPES, LLaDA2MoeConfig
from .fp8 import is_fp8_linear
from .generation_utils import (
    DiffusionGenerationConfig,
    DiffusionGenerationMixin,
    select_positions,
)
from .kernels import linear, use_fused_kernels
from .tensor_parallel import all_reduce_partial, is_sharded, local_tensor, shard_range
from .triton_attention import block_attention, num_sms
from .triton_moe import TRITON_AVAILABLE as MOE_KERNELS_AVAILABLE  # (`from .x import`: how the Hub finds the file)

register_attention_backends()

# `llada_triton` runs its split-KV kernel on a block step while the (row, key/value head) pairs are at most this many
# per multiprocessor, sdpa on grouped queries beyond (`LLaDA2MoeAttention._block_attention_applies`). Measured on an
# H100 at LLaDA2.0-mini's shapes (4 key/value heads; `benchmarks/bench_llada2_kernels.py`): the kernel wins up to
# batch 16 (36.9 against 38.8 us per layer), sdpa from batch 20 (43.6 against 52.2; 56.2 against 70.8 at batch 32).
SPLIT_KV_KV_HEADS_PER_SM = 0.5

# Experts implementations (`config._experts_implementation`, transformers' `experts_implementation=` argument).
EXPERTS_EAGER = "eager"
EXPERTS_GROUPED_MM = "grouped_mm"
EXPERTS_IMPLEMENTATIONS = (EXPERTS_EAGER, EXPERTS_GROUPED_MM)


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


class LLaDA2MoeMLP(nn.Module):
    """SiLU-gated MLP `down(act(gate(x)) * up(x))`, no biases: the dense layers, each expert, the shared experts."""

    def __init__(self, config: LLaDA2MoeConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(self.gate_proj, x), linear(self.up_proj, x)
        return linear(self.down_proj, gated_activation(self.act_fn, gate, up, self.silu))


def gated_activation(act_fn: Callable, gate: torch.Tensor, up: torch.Tensor, silu: bool) -> torch.Tensor:
    """`act(gate) * up`; with `silu` (the activation is SiLU) one fused kernel where the fused kernels apply."""
    if silu and use_fused_kernels(gate):
        return triton_ops.silu_mul(gate, up)
    return act_fn(gate) * up


class LLaDA2MoeGate(nn.Module):
    """The router: `weight` `(num_experts, hidden)` and, with `moe_router_enable_expert_bias`, the buffer
    `expert_bias` `(num_experts,)` (updated by load balancing in training, never by gradients)."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.score_function = config.score_function
        self.norm_topk_prob = config.norm_topk_prob
        self.router_dtype = getattr(torch, ROUTER_DTYPES[config.router_dtype])
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    def group_limited_topk(self, scores: torch.Tensor) -> torch.Tensor:
        """Indices `(tokens, top_k)` of the best experts (descending), chosen within each token's `topk_group`
        best groups; a group's score is the sum of its two best experts' scores."""
        if self.topk_group < self.n_group:
            tokens = scores.shape[0]
            grouped = scores.view(tokens, self.n_group, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)
            scores = scores.masked_fill(~expert_mask, float("-inf"))
        return scores.topk(self.top_k, dim=-1).indices

    def router_logits(self, hidden_states: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """`(tokens, hidden)` -> `(tokens, num_experts)` in the router dtype. `router_input`: `hidden_states` already
        in the router dtype (the fused path's norm writes that copy: no cast kernel), or None."""
        if router_input is None:
            router_input = hidden_states.to(self.router_dtype)
        return nn.functional.linear(router_input, self.weight.to(self.router_dtype))

    def fused_forward(
        self, hidden_states: torch.Tensor, router_input: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `forward`, with everything after the logits product in one Triton kernel (`triton_moe.route`; on
        ties the lowest expert index wins). Needs a float32 router; `forward(..., fused=True)` calls it (so module
        hooks see it). `router_input`: as in `router_logits`."""
        logits = self.router_logits(hidden_states, router_input)
        index, weight = triton_moe.route(
            logits,
            self.expert_bias,
            self.n_group,
            self.topk_group,
            self.top_k,
            self.score_function,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )
        return index, weight, logits

    def forward(
        self, hidden_states: torch.Tensor, fused: bool = False, router_input: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states `(tokens, hidden)` -> expert indices `(tokens, top_k)`, their weights `(tokens, top_k)`
        and the router logits `(tokens, num_experts)`, both in the router dtype (float32). `fused`: through
        `fused_forward`. `router_input`: as in `router_logits`."""
        if fused:
            return self.fused_forward(hidden_states, router_input)
        logits = self.router_logits(hidden_states, router_input)
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits.float()).to(logits.dtype)
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
        # The bias steers which experts are chosen (load balancing) but not how much they weigh.
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        topk_idx = self.group_limited_topk(choice)
        topk_weight = scores.gather(1, topk_idx)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * self.routed_scaling_factor, logits


def _grouped_mm_function() -> Callable | None:
    return getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class LLaDA2MoeSparseMoeBlock(nn.Module):
    """Routed experts (`experts.{e}`, Hub-named `nn.Linear`s, so checkpoints load unchanged), the router (`gate`)
    and the shared experts (`shared_experts`).

    The routed part sorts the (token, expert) pairs by expert and runs each expert on its contiguous rows, in one
    of two ways that compute the same thing:

    - grouped GEMM (`experts_implementation="grouped_mm"`, the default, where torch's grouped GEMM runs for the
      device and dtype and no autograd graph is needed): two `grouped_mm` calls over stacked views of the
      experts' weights, no host synchronisation (CUDA-graph capturable);
    - loop (`"eager"`, and the fallback): one call per expert that received tokens, like transformers' Qwen2-MoE /
      DeepSeek-V3 eager paths; reading the per-expert counts synchronises with the host once per layer.

    The outputs are put back in (token, choice) order and combined in float32 with the routing weights, as the
    original `moe_infer` does.
    """

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.intermediate_size = config.moe_intermediate_size
        self.experts = nn.ModuleList(
            [LLaDA2MoeMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)]
        )
        self.gate = LLaDA2MoeGate(config)
        if config.num_shared_experts:
            self.shared_experts = LLaDA2MoeMLP(config, config.moe_intermediate_size * config.num_shared_experts)
        else:
            self.shared_experts = None
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act in ("silu", "swish")
        # Stacked expert weights for the grouped path (see `stacked_weights`); not part of state_dict.
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stack_check: list[tuple[torch.Tensor, int]] = []

    def _apply(self, fn, *args, **kwargs):
        # `.to()`, `.cuda()`, `.half()` give the parameters new storage: drop the old stacks with them.
        self._stacked = None
        return super()._apply(fn, *args, **kwargs)

    @property
    def stack_shared(self) -> bool:
        """One shared expert has the routed experts' shape: the fused path runs it as one more group of the grouped
        GEMMs (every token's last pair), its weights stacked after the routed experts'; not when it holds FP8
        weights (`--quantization fp8` keeps the routed experts in bf16 and quantizes the shared one)."""
        return (
            self.shared_experts is not None
            and self.config.num_shared_experts == 1
            and not is_fp8_linear(self.shared_experts.gate_proj)
        )

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`gate_up` `(E', 2 * I, H)` (each expert's gate rows, then its up rows) and `down` `(E', H, I)`, with
        `E' = E + 1` when the shared expert is stacked after the routed ones (`stack_shared`), else `E`.

        The experts' parameters are re-pointed to views of the stacks, so they cost no memory and stay in sync
        with in-place weight updates (`load_state_dict`, `copy_`); `save_pretrained` still stores one tensor per
        Hub name. The stacks are rebuilt after `.to()` and friends, and when the first or last expert's modules or
        parameters were replaced (checking every expert would cost milliseconds per layer in Python); replacing
        other single experts' weights out of place needs `refresh_stacked_weights()`."""
        if self._stacked is None or not self._stacks_are_current():
            self.refresh_stacked_weights()
        return self._stacked

    def _stacked_experts(self) -> list[LLaDA2MoeMLP]:
        return [*self.experts, self.shared_experts] if self.stack_shared else list(self.experts)

    def _sampled_weights(self) -> list[torch.Tensor]:
        sampled = [self.experts[0], self.experts[-1], *([self.shared_experts] if self.stack_shared else [])]
        return [linear.weight for expert in sampled for linear in (expert.gate_proj, expert.up_proj, expert.down_proj)]

    def _stacks_are_current(self) -> bool:
        # A different count means the shared expert joined or left the stacks (`stack_shared`, e.g. its layers were
        # replaced by FP8 ones): rebuild.
        weights = self._sampled_weights()
        return len(weights) == len(self._stack_check) and all(
            weight is sampled and local_tensor(weight).data_ptr() == pointer
            for weight, (sampled, pointer) in zip(weights, self._stack_check, strict=True)
        )

    def refresh_stacked_weights(self) -> None:
        """(Re)build the stacks of `stacked_weights` from the experts' current weights (under tensor parallelism,
        this rank's slices: `I` is then its share of the intermediate width)."""

        def local(linear: nn.Linear) -> torch.Tensor:
            return local_tensor(linear.weight).detach()

        experts = self._stacked_experts()
        gate_up = torch.stack([torch.cat([local(expert.gate_proj), local(expert.up_proj)]) for expert in experts])
        down = torch.stack([local(expert.down_proj) for expert in experts])
        inter = gate_up.shape[1] // 2
        for e, expert in enumerate(experts):
            local_tensor(expert.gate_proj.weight).data = gate_up[e, :inter]
            local_tensor(expert.up_proj.weight).data = gate_up[e, inter:]
            local_tensor(expert.down_proj.weight).data = down[e]
        self._stacked = (gate_up, down)
        self._stack_check = [(weight, local_tensor(weight).data_ptr()) for weight in self._sampled_weights()]

    def use_grouped_mm(self, hidden_states: torch.Tensor) -> bool:
        """Whether the routed experts run as grouped GEMMs for this input (see the class docstring)."""
        if getattr(self.config, "_experts_implementation", None) == EXPERTS_EAGER or _grouped_mm_function() is None:
            return False
        weight = self.experts[0].gate_proj.weight
        if torch.is_grad_enabled() and weight.requires_grad:
            return False  # the stacks are detached views: training takes the loop, which autograd follows
        weight = local_tensor(weight)  # this rank's slice under tensor parallelism
        if hidden_states.dtype != weight.dtype:
            return False
        # grouped_mm needs 16-byte aligned row strides of both operands.
        size = weight.element_size()
        if (self.config.hidden_size * size) % 16 or (weight.shape[0] * size) % 16:
            return False
        if weight.device.type == "cuda":
            # Grouped GEMM kernels: Hopper (sm90) with torch < 2.9, Ampere or newer from 2.9; bfloat16 kernels,
            # float16 and float32 too from torch 2.11 (checked on an H100).
            capability = torch.cuda.get_device_capability(weight.device)
            minimum = (8, 0) if is_torch_greater_or_equal("2.9", accept_dev=True) else (9, 0)
            dtype_ok = weight.dtype == torch.bfloat16 or (
                weight.dtype in (torch.float16, torch.float32) and is_torch_greater_or_equal("2.11", accept_dev=True)
            )
            return capability >= minimum and dtype_ok
        if weight.device.type == "cpu":
            return is_torch_greater_or_equal("2.9", accept_dev=True)
        return False

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states `(batch, len, hidden)` -> output `(batch, len, hidden)` and router logits
        `(batch * len, num_experts)`."""
        batch, length, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        topk_idx, topk_weight, router_logits = self.gate(x)
        flat_idx = topk_idx.reshape(-1)  # (tokens * top_k,): the expert of each (token, choice) pair
        order = flat_idx.argsort(stable=True)
        sorted_tokens = x[order // self.top_k]
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))
        grouped = self.use_grouped_mm(x)
        if grouped:
            sorted_out = self._experts_grouped_mm(sorted_tokens, counts)
        else:
            sorted_out = self._experts_loop(sorted_tokens, counts)
        pair_out = sorted_out.new_empty(sorted_out.shape).index_copy(0, order, sorted_out)
        routed = pair_out.view(-1, self.top_k, hidden).to(topk_weight.dtype) * topk_weight.unsqueeze(-1)
        out = routed.sum(dim=1)
        if grouped:
            # Tensor parallel: the grouped GEMMs ran this rank's slices of the experts (the loop calls the sharded
            # modules, whose hooks already summed): one all-reduce of the partial outputs, in the router dtype.
            out = all_reduce_partial(out, like=self.experts[0].down_proj.weight)
        out = out.to(x.dtype).view(batch, length, hidden)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out, router_logits

    def use_fused(self, hidden_states: torch.Tensor) -> bool:
        """Whether `fused_forward` runs for this input: the fused kernels apply (`kernels.py`), the grouped GEMMs
        run, the router is float32, the activation SiLU, and the experts are not split by tensor parallelism (the
        combine kernel adds the residual, which must come after the ranks' partial sums are reduced)."""
        return (
            MOE_KERNELS_AVAILABLE
            and not is_sharded(self.experts[0].down_proj.weight)
            and self.silu
            and self.gate.router_dtype == torch.float32
            and use_fused_kernels(hidden_states)
            and self.use_grouped_mm(hidden_states)
        )

    def fused_forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor, router_input: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual + forward(hidden_states)[0]` and the router logits, through the Triton kernels of
        `triton_moe.py` (router, alignment by expert, weighted combine with the shared expert and the residual) and
        two grouped GEMMs whose groups are the routed experts and the shared expert (`stack_shared`). No host
        synchronisation. hidden_states, residual `(batch, len, hidden)`; router_input: hidden_states in float32
        (the router's dtype) or None (cast here)."""
        batch, length, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        if router_input is not None:
            router_input = router_input.reshape(-1, hidden)
        topk_idx, topk_weight, router_logits = self.gate(x, fused=True, router_input=router_input)
        stacked_shared = self.shared_experts is not None and self.stack_shared
        sorted_token, offsets, rows = triton_moe.align_by_expert(topk_idx, self.num_experts, stacked_shared)
        grouped_mm = _grouped_mm_function()
        gate_up, down = self.stacked_weights()
        projected = grouped_mm(x.index_select(0, sorted_token), gate_up.transpose(1, 2), offs=offsets)
        gate, up = projected.chunk(2, dim=-1)
        expert_rows = grouped_mm(triton_ops.silu_mul(gate, up), down.transpose(1, 2), offs=offsets)
        residual = residual.reshape(-1, hidden)
        if self.shared_experts is None or stacked_shared:
            out = triton_moe.combine(expert_rows, rows, topk_weight, stacked_shared, residual)
        else:
            routed = triton_moe.combine(expert_rows, rows, topk_weight, False)
            out = residual + (routed + self.shared_experts(x))
        return out.view(batch, length, hidden), router_logits

    def _experts_loop(self, sorted_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert on its rows of `sorted_tokens` `(pairs, hidden)` (sorted by expert, `counts` `(E,)`)."""
        outputs = []
        start = 0
        for e, count in enumerate(counts.tolist()):  # one host synchronisation
            if count:
                outputs.append(self.experts[e](sorted_tokens[start : start + count]))
                start += count
        return torch.cat(outputs) if outputs else sorted_tokens.new_zeros(sorted_tokens.shape)

    def _experts_grouped_mm(self, sorted_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """As `_experts_loop`, as two grouped GEMMs over the stacked weights (no host synchronisation)."""
        grouped_mm = _grouped_mm_function()
        gate_up, down = self.stacked_weights()
        gate_up, down = gate_up[: self.num_experts], down[: self.num_experts]
        offsets = counts.cumsum(0).to(torch.int32)
        projected = grouped_mm(sorted_tokens, gate_up.transpose(1, 2), offs=offsets)
        gate, up = projected.chunk(2, dim=-1)
        return grouped_mm(
            gated_activation(self.act_fn, gate, up, self.silu).contiguous(), down.transpose(1, 2), offs=offsets
        )


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

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask=None,
        past_key_values: Cache | DiffusionKVCache | None = None,
        cache_position: torch.Tensor | None = None,
        grouped_query_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states `(batch, q_len, hidden)`; position_embeddings: cos, sin `(batch, q_len, rotary_dim)`;
        grouped_query_mask: `attention_mask` as `grouped_query_mask(attention_mask, n_rep)` gives it (made once per
        forward by the model) for the fused path."""
        batch, q_len, _ = hidden_states.shape
        implementation = self.config._attn_implementation
        if self.uses_fused_path(hidden_states, past_key_values):
            return self._fused_forward(
                hidden_states, position_embeddings, attention_mask, past_key_values, cache_position, grouped_query_mask
            )
        qkv = linear(self.query_key_value, hidden_states).view(batch, q_len, -1, self.head_dim)
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        query, key, value = qkv.split([heads, kv_heads, kv_heads], dim=2)
        (q_start, q_stop), (kv_start, kv_stop) = self.local_heads()
        if q_stop - q_start < heads:  # tensor parallel: the gathered projection holds every head, keep this rank's
            query = query[:, :, q_start:q_stop]
            key, value = key[:, :, kv_start:kv_stop], value[:, :, kv_start:kv_stop]
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if self.config.use_qk_norm:
            query, key = self.query_layernorm(query), self.key_layernorm(key)
        cos, sin = position_embeddings
        query, key = apply_partial_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx, {"cache_position": cache_position})

        if implementation == TRITON_ATTENTION and _has_query_dim(attention_mask):
            # attention.py's split-KV kernel reads a key padding mask `(B, 1, 1, T)` only (row 0 of any other
            # mask): a block-causal mask with a query dimension runs on sdpa, as that backend does everywhere else.
            attention_interface = sdpa_attention_forward
        else:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        attn, _ = attention_interface(
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
        """Whether `forward` takes `_fused_forward`: a `DiffusionKVCache`, the fused kernels, inference, and all
        heads on this rank (the fused kernel splits the q/k/v projection by the config's head counts; under tensor
        parallelism the gathered projection holds every rank's heads)."""
        return (
            isinstance(past_key_values, DiffusionKVCache)
            and not is_sharded(self.dense.weight)
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
    ) -> torch.Tensor:
        """`forward` with a `DiffusionKVCache` where the fused kernels run: q/k norms, partial RoPE and the cache
        write in one kernel (`triton_moe.qk_norm_rope_to_cache`); with sdpa and a boolean mask, grouped-query
        attention as multi-head attention of the `n_rep * q_len` queries of each key/value head, so the cached keys
        and values are read in place (sdpa with a mask would otherwise copy them `n_rep` times)."""
        batch, q_len, _ = hidden_states.shape
        keys, values = past_key_values.layer(self.layer_idx, batch, self.num_kv_heads, self.head_dim, hidden_states)
        norms = (self.query_layernorm, self.key_layernorm) if self.config.use_qk_norm else (None, None)
        cos, sin = position_embeddings
        query = triton_moe.qk_norm_rope_to_cache(
            linear(self.query_key_value, hidden_states),
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
        )
        implementation = self.config._attn_implementation
        if implementation == TRITON_ATTENTION and self._block_attention_applies(batch, attention_mask):
            # hf_dllm's split-KV kernel (`triton_attention.py`), each query row with its own mask row; it writes
            # `(B, L, Hq, D)`, the layout the output projection reads.
            mask = None if attention_mask is None else attention_mask[:, 0].expand(batch, q_len, keys.shape[2])
            attn = block_attention(query, keys, values, mask, self.scaling)
            return linear(self.dense, attn.reshape(batch, q_len, -1))
        if grouped_query_mask is None and uses_grouped_query_sdpa(implementation, attention_mask):
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
            if implementation == TRITON_ATTENTION and _has_query_dim(attention_mask):
                attention_interface = sdpa_attention_forward
            else:
                attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
            attn, _ = attention_interface(self, query, keys, values, attention_mask, dropout=0.0, scaling=self.scaling)
        return linear(self.dense, attn.reshape(batch, q_len, -1))

    def _block_attention_applies(self, batch: int, attention_mask) -> bool:
        """Whether the `llada_triton` backend runs its split-KV kernel here: a boolean 4D mask (or none), a head
        size the kernel takes, and at most `SPLIT_KV_KV_HEADS_PER_SM` (row, key/value head) pairs per
        multiprocessor (sdpa on grouped queries is faster beyond: measured by `benchmarks/bench_llada2_kernels.py`)."""
        mask_ok = attention_mask is None or (
            isinstance(attention_mask, torch.Tensor)
            and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4
        )
        weight = self.query_key_value.weight
        return (
            mask_ok
            and self.head_dim >= 16
            and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (not weight.is_cuda or batch * self.num_kv_heads <= SPLIT_KV_KV_HEADS_PER_SM * num_sms(weight.device))
        )


def uses_grouped_query_sdpa(implementation: str, attention_mask) -> bool:
    """Whether the fused attention runs sdpa on grouped queries (`grouped_query_mask_for`): sdpa (or llada_triton
    where its split-KV kernel does not run) with a boolean 4D mask."""
    return (
        implementation in ("sdpa", TRITON_ATTENTION)
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
    )


def grouped_query_mask_for(attention_mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The mask `(b, 1, q, T)` for the queries of one key/value head laid out as `n_rep * q` rows (row `r * q + i`
    is query `i` of the group's head `r`): `(b, 1, n_rep * q, T)`."""
    batch, _, q_len, kv_len = attention_mask.shape
    expanded = attention_mask[:, :, None].expand(batch, 1, n_rep, q_len, kv_len)
    return expanded.reshape(batch, 1, n_rep * q_len, kv_len)


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
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the new hidden states `(batch, q_len, hidden)` and the router logits (None in dense layers)."""
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
            if isinstance(self.mlp, LLaDA2MoeSparseMoeBlock) and self.mlp.use_fused(attn):
                # The norm also writes its output in float32 for the router (float32 logits, as the reference):
                # one cast kernel less per layer (~17 us at batch 32 on an H100).
                wide = attn.dtype != torch.float32
                normed, hidden_states, *router_input = triton_ops.rms_norm(
                    attn, norm.weight, norm.variance_epsilon, residual=hidden_states, float_copy=wide
                )
                return self.mlp.fused_forward(normed, hidden_states, router_input[0] if wide else None)
            normed, hidden_states = triton_ops.rms_norm(
                attn, norm.weight, norm.variance_epsilon, residual=hidden_states
            )
            mlp_out = self.mlp(normed)
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
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        router_logits = None
        if isinstance(mlp_out, tuple):
            mlp_out, router_logits = mlp_out
        return hidden_states + mlp_out, router_logits


class LLaDA2MoePreTrainedModel(PreTrainedModel):
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
        self.post_init()

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
                one. The 2D mask (or None) is combined with the block-causal mask of `block_length`.
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
        position_embeddings = rotary_cos_sin(position_ids, self.config, inputs_embeds.dtype)

        if attention_mask is None or mask_2d is not None:
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
        implementation = self.config._attn_implementation
        if (
            attention.uses_fused_path(inputs_embeds, past_key_values)
            and uses_grouped_query_sdpa(implementation, attention_mask)
            and not (
                implementation == TRITON_ATTENTION
                and attention._block_attention_applies(inputs_embeds.shape[0], attention_mask)
            )
        ):
            # Made once here, not in each layer (sdpa, or llada_triton where its split-KV kernel does not run).
            kwargs["grouped_query_mask"] = grouped_query_mask_for(attention_mask, attention.num_key_value_groups)
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
            past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
            router_logits=all_router_logits,
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
    # Interface of DiffusionGenerationMixin: position i predicts token i; attention is block-causal, so the
    # generation loop passes its block length and never needs keys after the current block.
    diffusion_logits_shift = 0
    diffusion_block_causal = True
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
        **kwargs,
    ) -> MoeCausalLMOutputWithPast | tuple:
        r"""
        Same arguments as `LLaDA2MoeModel.forward`, plus `logits_to_keep`: an `int` keeps the last n positions
        (0 keeps all), a `slice` or a 1D index tensor selects positions, so the `(…, vocab)` head runs only where
        logits are needed. Returns `MoeCausalLMOutputWithPast` with float32 `logits` `(batch, kept, vocab)`.
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
        logits = linear(self.lm_head, select_positions(hidden_states, logits_to_keep)).float()
        output = MoeCausalLMOutputWithPast(
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
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
        """The loop's forward: `forward`'s logits `(batch, kept, vocab)` without its float32 copy, in the model dtype
        (as LLaDA's and Dream's). The unmasking rules widen them to float32 where they compute
        (`decoding.propose_tokens`; the fused greedy kernel as it reads), so every token and confidence is the same;
        a batch-32 block step no longer writes and re-reads 0.64 GB of float32 logits."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            cache_position=cache_position,
            **forward_kwargs,
        )
        return linear(self.lm_head, select_positions(outputs.last_hidden_state, logits_slice))

    def _diffusion_step_capturable(self) -> bool:
        """Whether a denoising step can be captured in a CUDA graph: only if the MoE never synchronises with the
        host, i.e. runs torch's grouped GEMM in bfloat16 (the per-expert loop reads counts on the host, and torch's
        float16/float32 grouped GEMMs copy through the host)."""
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, LLaDA2MoeSparseMoeBlock)]
        if not blocks:
            return True
        weight = local_tensor(blocks[0].experts[0].gate_proj.weight)
        probe = weight.new_empty(0, weight.shape[1])
        return weight.dtype == torch.bfloat16 and blocks[0].use_grouped_mm(probe)

    def _diffusion_attention_mask(self, key_mask: torch.Tensor, q_len: int) -> torch.Tensor:
        """The `(rows, seq_len)` key padding mask unchanged: the block-causal mask depends on each step's
        `cache_position`, so the forward builds it (without host synchronisation)."""
        return key_mask


__all__ = ["LLaDA2MoeModel", "LLaDA2MoeModelLM", "LLaDA2MoePreTrainedModel"]
