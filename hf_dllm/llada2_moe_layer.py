"""The MoE layer of LLaDA2.x (`llada2_moe`): the router, the experts and the sparse MoE block.

Layers `>= first_k_dense_replace` of `modeling_llada2_moe.py` use `LLaDA2MoeSparseMoeBlock`; the dense layers and the
experts are `LLaDA2MoeMLP`. The math follows the original `modeling_llada2_moe.py` (arXiv:2512.15745; the Ling 2.0
body): a float32 router (`LLaDA2MoeGate`: sigmoid or softmax scores; `expert_bias` added for choosing experts only;
group-limited top-k; normalised weights times `routed_scaling_factor`), the chosen experts' outputs combined in
float32, plus the shared experts. Parameter names are the Hub checkpoints' (`mlp.gate.weight`,
`mlp.experts.{e}.gate_proj.weight`, `mlp.shared_experts.up_proj.weight`, ...).

The routed experts run as two grouped products over stacked views of the Hub-named expert weights, else as a loop
over the experts that received tokens; where the fused kernels run (`kernels.use_fused_kernels`: CUDA with Triton)
the router's top-k, the alignment by expert, the grouped products (`grouped_gemm.py`, bf16 or FP8 weights) and the
weighted combine with the shared expert and the residual are Triton kernels (`triton_moe.py`), with no host
synchronisation, also on tensor-parallel shards (the partial sums of the experts' slices reduced once per layer);
elsewhere the grouped products are `torch._grouped_mm` where torch provides it.

LLaDA2.2's *block routing* (config `block_size` and `expert_capacity`, `block_limited_topk`): per block of
`block_size` positions only `expert_capacity` experts may be chosen, so a block's tokens touch at most that many
experts; the grouped products take the routed expert ids as they are, and skip the experts no token chose. Where
the fused kernels run, its router is `fused_block_route` (three launches, no host synchronisation).

This file is exported verbatim as Hub remote code (with `modeling_llada2_moe.py`): relative imports only.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.utils.import_utils import is_torch_greater_or_equal

from . import triton_moe, triton_ops
from .configuration_llada2_moe import ROUTER_DTYPES, LLaDA2MoeConfig
from .fp8 import fp8_kernel_supports, is_fp8_linear
from .grouped_gemm import (
    ExpertDispatch,
    ExpertList,
    ExpertStacks,
    expert_fp8_block_size,
    grouped_matmul,
    stack_experts,
)
from .kernels import linear, use_fused_kernels
from .tensor_parallel import all_reduce_partial, is_sharded, local_shape, local_tensor, shard_range
from .triton_moe import TRITON_AVAILABLE as MOE_KERNELS_AVAILABLE  # (`from .x import`: how the Hub finds the file)
from .triton_moe import store_top_k  # None without Triton
from .triton_ops import dependent_launch, on_tensor_device, tl, triton  # None without Triton (CPU-only installs)

# Experts implementations (`config._experts_implementation`, transformers' `experts_implementation=` argument).
EXPERTS_EAGER = "eager"
EXPERTS_GROUPED_MM = "grouped_mm"
EXPERTS_IMPLEMENTATIONS = (EXPERTS_EAGER, EXPERTS_GROUPED_MM)


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

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` with this rank's slices of the weights, bypassing the sharded layers' hooks: under tensor
        parallelism a partial sum that the caller reduces with its own (one all-reduce for the routed and shared
        experts); `forward` itself when not sharded. x `(..., hidden)` -> `(..., hidden)`."""
        gate = nn.functional.linear(x, local_tensor(self.gate_proj.weight))
        up = nn.functional.linear(x, local_tensor(self.up_proj.weight))
        return nn.functional.linear(
            gated_activation(self.act_fn, gate, up, self.silu), local_tensor(self.down_proj.weight)
        )


def gated_activation(act_fn: Callable, gate: torch.Tensor, up: torch.Tensor, silu: bool) -> torch.Tensor:
    """`act(gate) * up`; with `silu` (the activation is SiLU) one fused kernel where the fused kernels apply."""
    if silu and use_fused_kernels(gate):
        return triton_ops.silu_mul(gate, up)
    return act_fn(gate) * up


# `torch.mm(a, b, out_dtype=torch.float32)` for bfloat16 / float16 operands on CUDA (torch >= 2.9).
_MM_OUT_DTYPE = is_torch_greater_or_equal("2.9", accept_dev=True)


class RoutingBlocks(NamedTuple):
    """The routing block of each token of a forward (LLaDA2.2's block routing): ids `(tokens,)` long in
    `[0, count)`, the tokens of one block sharing one id, and count, a bound on the number of blocks known on the
    host (some ids may hold no token: such blocks choose experts that no token uses). Made once per forward
    (`routing_blocks_for_positions`, `routing_blocks_for_packed`) and read by every MoE layer."""

    ids: torch.Tensor
    count: int


def routing_blocks_for_positions(
    positions: torch.Tensor, block_size: int, real: torch.Tensor | None = None
) -> RoutingBlocks:
    """The routing blocks of a `(batch, q_len)` forward: the token at position p of row r is in block
    `(r, p // block_size)` (absolute positions, in multiples of `block_size`, each row on its own; a forward that
    starts or ends inside a block holds that block's tokens of this forward only). positions `(batch, q_len)`: the
    RoPE positions (consecutive over each row's real tokens); real `(batch, q_len)` bool or None: False for padding,
    which gets a block of its own per row, so that a left-padded row routes as it does alone. No host
    synchronisation."""
    batch, q_len = positions.shape
    rows = torch.arange(batch, device=positions.device)[:, None].expand(batch, q_len)
    return _routing_blocks(rows.reshape(-1), positions.reshape(-1), None if real is None else real.reshape(-1),
                           batch, q_len, block_size)  # fmt: skip


def routing_blocks_for_packed(
    lengths: list[int], positions: torch.Tensor, block_size: int, rows: torch.Tensor | None = None
) -> RoutingBlocks:
    """The routing blocks of rows of `lengths` positions packed end to end (`packed.PackedRows`), positions
    `(sum(lengths),)` each row's own (RoPE) positions: blocked as `routing_blocks_for_positions` blocks the row
    alone. rows: each position's row `(sum(lengths),)` (`PackedRows.rows`), or None: made on the device (one fill
    per row, no host-to-device copy, so a captured forward may make it)."""
    if rows is None:
        rows = torch.cat(
            [
                torch.full((length,), row, dtype=torch.long, device=positions.device)
                for row, length in enumerate(lengths)
            ]
        )
    return _routing_blocks(rows, positions, None, len(lengths), max(lengths), block_size)


def _routing_blocks(
    rows: torch.Tensor, positions: torch.Tensor, real: torch.Tensor | None, num_rows: int, length: int, block: int
) -> RoutingBlocks:
    """Token t (of row `rows[t]`, at `positions[t]`) -> id `row * per_row + positions[t] // block - first`, `first`
    the row's first block of a real token; padding -> the row's last id. `per_row`: the blocks that `length`
    consecutive positions can touch, plus the padding's (a row's blocks past that bound, which consecutive positions
    never reach, share its last real block)."""
    per_row = (length - 1) // block + 3 if length else 2
    block_of = positions.long() // block
    if real is None:
        real = torch.ones_like(block_of, dtype=torch.bool)
    sentinel = torch.iinfo(torch.long).max
    first = torch.full((num_rows,), sentinel, dtype=torch.long, device=positions.device)
    first.scatter_reduce_(0, rows, block_of.masked_fill(~real, sentinel), reduce="amin")
    local = (block_of - first[rows]).clamp(0, per_row - 2).masked_fill(~real, per_row - 1)
    return RoutingBlocks(rows * per_row + local, num_rows * per_row)


def block_limited_topk(choice: torch.Tensor, blocks: RoutingBlocks, capacity: int, top_k: int) -> torch.Tensor:
    """LLaDA2.2's block routing: indices `(tokens, top_k)` of each token's best experts (descending choice score)
    among the `capacity` experts allowed in its block.

    choice `(tokens, E)`: the scores experts are chosen by (sigmoid or softmax scores plus `expert_bias`). Per
    block (`blocks`), an expert's block score is the max of its choice scores over the block's tokens; the
    `capacity` experts of highest block score are allowed; each token then takes its top-k of the allowed experts
    (the others masked to -inf). The caller (`LLaDA2MoeGate.route`) weighs them by their unbiased scores,
    normalised (`norm_topk_prob`) and times `routed_scaling_factor`, as without block routing.

    Sources. SGLang, sgl-project/sglang commit 3af84232856d59bfa1e4275adc6beb003ed1bcdc,
    `python/sglang/srt/models/llada2.py` (`_block_aggregation_kernel`, `_token_topk_kernel`, `block_topk_triton`,
    `LLaDA2MoeSparseMoeBlock._forward_router_experts`) and `test/manual/layers/moe/test_block_topk_triton.py`
    (PRs #31743 / #31768, "LLaDA2.2 Block Routing MoE support"): block score = max over the block of
    `sigmoid(logit) + expert_bias`; `expert_capacity` experts per block; per-token top-k among them by the same
    biased score; weights = the unbiased sigmoid scores of the chosen, sum-normalised, times
    `routed_scaling_factor` (applied by SGLang's MoE runner); `n_group` / `topk_group` not applied; the last block
    may be partial. The #31768 review (2026-07-28) describes the released `inclusionAI/LLaDA2.2-flash`
    `modeling_llada2_moe.py` (lines 244-275) the same way: `torch.topk` on the unmodified biased scores for the
    block capacity and the tokens, disallowed experts masked with -inf, the unbiased sigmoid weights normalised
    by their sum (SGLang's kernels subtract `3e-7 * expert index` to break ties, which the review found changes
    the chosen experts; not done here).

    Readings of ours where the sources are silent or differ: blocks are each row's absolute positions
    `position // block_size`, padding apart (`RoutingBlocks`; SGLang chunks the flattened tokens of a forward in
    order and asserts whole blocks, which is the same for forwards of whole position-aligned blocks per request,
    as LLaDA2.2 decodes with `block_length = block_size`); a forward over part of a block (a prefill ending in a
    prompt's tail, a `block_length` smaller than `block_size`) routes that block by its tokens in the forward;
    softmax scores are handled as sigmoid ones (LLaDA2.2 uses sigmoid); group-limited routing is dropped under
    block routing (to restore it, restrict `masked` below with `LLaDA2MoeGate.group_limited_topk`'s group mask,
    keeping at least `top_k` experts, and the same in `_block_route_kernel`); ties as `torch.topk` here, the
    lowest index in `fused_block_route`.

    Written with scatter / top-k / gather over all blocks at once: no host synchronisation (CUDA-graph
    capturable), and each block touches at most `capacity` experts."""
    n_experts = choice.shape[1]
    block_scores = choice.new_full((blocks.count, n_experts), float("-inf"))
    block_scores.scatter_reduce_(0, blocks.ids[:, None].expand(-1, n_experts), choice, reduce="amax")
    allowed_idx = block_scores.topk(capacity, dim=-1).indices
    allowed = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(1, allowed_idx, True)
    masked = choice.masked_fill(~allowed[blocks.ids], float("-inf"))
    return masked.topk(top_k, dim=-1).indices


if MOE_KERNELS_AVAILABLE:
    from .triton_ops import wait_for_previous_kernel

    @triton.jit
    def _choice_scores(logits_ptr, bias_ptr, expert, valid, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                       LIBDEVICE: tl.constexpr):  # fmt: skip
        # One token's scores and choice scores, as `triton_moe.route` computes them (PyTorch's sigmoid bit for bit).
        x = tl.load(logits_ptr + expert, mask=valid, other=float("-inf"))
        if SIGMOID:
            if LIBDEVICE:
                e = tl.extra.libdevice.exp(-x)
            else:
                e = tl.exp(-x)
            scores = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + e)
        else:
            shifted = x - tl.max(x, axis=0)
            if LIBDEVICE:
                shifted = tl.extra.libdevice.exp(shifted)
            else:
                shifted = tl.exp(shifted)
            scores = shifted / tl.sum(shifted, axis=0)
        scores = tl.where(valid, scores, float("-inf"))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        return scores, tl.where(valid, choice, float("-inf"))

    @triton.jit
    def _block_max_kernel(logits_ptr, bias_ptr, ids_ptr, block_ptr, n_experts, SIGMOID: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
        # One program per token: its choice scores into its block's maxima (float atomic max: order-independent).
        wait_for_previous_kernel()
        token = tl.program_id(0).to(tl.int64)
        expert = tl.arange(0, BLOCK_E)
        valid = expert < n_experts
        _, choice = _choice_scores(
            logits_ptr + token * n_experts, bias_ptr, expert, valid, SIGMOID, HAS_BIAS, LIBDEVICE
        )
        block = tl.load(ids_ptr + token).to(tl.int64)
        tl.atomic_max(block_ptr + block * n_experts + expert, choice, mask=valid)

    @triton.jit
    def _block_route_kernel(logits_ptr, bias_ptr, ids_ptr, block_ptr, index_ptr, weight_ptr, n_experts, capacity,
                            scale, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr,
                            NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                            RANK_CHUNK: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
        # One program per token: its block's `capacity` best experts by block maximum (ties: the lowest index), then
        # its top-k of them by choice score and their weights, as `triton_moe.route`'s top-k.
        wait_for_previous_kernel()
        token = tl.program_id(0).to(tl.int64)
        expert = tl.arange(0, BLOCK_E)
        valid = expert < n_experts
        scores, choice = _choice_scores(
            logits_ptr + token * n_experts, bias_ptr, expert, valid, SIGMOID, HAS_BIAS, LIBDEVICE
        )
        block = tl.load(ids_ptr + token).to(tl.int64)
        block_row = block_ptr + block * n_experts
        block_score = tl.load(block_row + expert, mask=valid, other=float("-inf"))
        lanes = tl.where(valid, expert, 2147483647)
        # An expert is among its block's `capacity` best when fewer experts precede it (a higher block maximum, or
        # the same one and a lower index): its rank, counted against RANK_CHUNK experts at a time, all ranks at
        # once (a loop of `capacity` dependent max / min reductions took 13.5 us per token at 48 of 256 experts).
        rank = tl.zeros([BLOCK_E], dtype=tl.int32)
        for start in range(0, n_experts, RANK_CHUNK):
            other = start + tl.arange(0, RANK_CHUNK)
            other_valid = other < n_experts
            other_score = tl.load(block_row + other, mask=other_valid, other=float("-inf"))[None, :]
            other_lane = tl.where(other_valid, other, 2147483647)[None, :]
            mine = block_score[:, None]
            before = (other_score > mine) | ((other_score == mine) & (other_lane < lanes[:, None]))
            rank += tl.sum(before.to(tl.int32), axis=1)
        choice = tl.where(valid & (rank < capacity), choice, float("-inf"))
        # (no per-expert scales: index_ptr stands for their pointer, never read)
        store_top_k(
            choice, scores, lanes, index_ptr, weight_ptr, token, scale, index_ptr, TOP_K, NORMALIZE, BLOCK_K, False
        )


@on_tensor_device
def fused_block_route(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    blocks: RoutingBlocks,
    capacity: int,
    top_k: int,
    score_function: str,
    normalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_limited_topk` and the weights of `LLaDA2MoeGate.route` in three launches (the block maxima's
    buffer, a per-token kernel of atomic maxima, a per-token selection kernel) instead of ~17 PyTorch kernels, no
    host synchronisation: the fused path's router under block routing. logits `(tokens, E)` float32 -> indices
    `(tokens, top_k)` int64 in descending choice score (ties: the lowest index, here and in a block's capacity)
    and weights `(tokens, top_k)` float32, as `triton_moe.route`."""
    tokens, n_experts = logits.shape
    logits = logits.contiguous().float()
    index = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    weight = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    if tokens == 0:
        return index, weight
    block_scores = torch.full((blocks.count, n_experts), float("-inf"), dtype=torch.float32, device=logits.device)
    bias = expert_bias.contiguous() if expert_bias is not None else logits  # read in its dtype: no cast kernel
    ids = blocks.ids.contiguous()
    flags = dict(SIGMOID=score_function == "sigmoid", HAS_BIAS=expert_bias is not None, LIBDEVICE=logits.is_cuda)
    block_e = triton.next_power_of_2(n_experts)
    _block_max_kernel[(tokens,)](
        logits, bias, ids, block_scores, n_experts, BLOCK_E=block_e, num_warps=1, **flags, **dependent_launch()
    )
    _block_route_kernel[(tokens,)](
        logits,
        bias,
        ids,
        block_scores,
        index,
        weight,
        n_experts,
        capacity,
        float(routed_scaling_factor),
        TOP_K=top_k,
        NORMALIZE=normalize and top_k > 1,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        RANK_CHUNK=min(16, block_e),
        num_warps=4,
        **flags,
        **dependent_launch(),
    )
    return index, weight


class LLaDA2MoeGate(nn.Module):
    """The router: `weight` `(num_experts, hidden)` and, with `moe_router_enable_expert_bias`, the buffer
    `expert_bias` `(num_experts,)` (updated by load balancing in training, never by gradients).

    With the config's `block_size` and `expert_capacity` (LLaDA2.2, `block_routing`) the experts are chosen by
    `block_limited_topk` per routing block (`RoutingBlocks`; without them, the tokens of the call in order, in
    blocks of `block_size`) instead of by group-limited top-k; the weights are computed as without it."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.score_function = config.score_function
        self.block_size = getattr(config, "block_size", None)
        self.expert_capacity = getattr(config, "expert_capacity", None)
        self.block_routing = self.block_size is not None and self.expert_capacity is not None
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

    def block_routing_topk(self, choice: torch.Tensor, routing_blocks: RoutingBlocks | None) -> torch.Tensor:
        """Indices `(tokens, top_k)` under block routing (`block_limited_topk`); `routing_blocks` None: the tokens
        of this call in order, in blocks of `block_size` (the last one partial)."""
        blocks = self.default_routing_blocks(choice.shape[0], choice.device, routing_blocks)
        return block_limited_topk(choice, blocks, self.expert_capacity, self.top_k)

    def default_routing_blocks(
        self, tokens: int, device: torch.device, routing_blocks: RoutingBlocks | None
    ) -> RoutingBlocks:
        """`routing_blocks`, or for None the `tokens` of the call in order, in blocks of `block_size`."""
        if routing_blocks is not None:
            return routing_blocks
        ids = torch.arange(tokens, device=device) // self.block_size
        return RoutingBlocks(ids, max(1, -(-tokens // self.block_size)))

    def takes_input_dtype(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `router_logits` multiplies inputs of `dtype` as they are: a float32 router whose weight has that
        half-precision dtype, on CUDA. The float32 logits then come from one tensor-core product with float32
        output and accumulation (`torch.mm(..., out_dtype=torch.float32)`): a product of two bfloat16 (or float16)
        values is exact in float32, so these are the reference's float32 logits up to the order of the sums, with
        no float32 copy of either operand (on an H100 at LLaDA2.0-mini's batch-32 block step the float32 product
        took 31 us a layer plus the weight's cast)."""
        return (
            self.router_dtype == torch.float32
            and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16)
            and self.weight.dtype == dtype
            and _MM_OUT_DTYPE
        )

    def needs_float32_copy(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `router_logits` would cast inputs of `dtype` to float32: a float32 router that does not take them
        as they are (`takes_input_dtype`). The fused norm then writes its output in float32 too (`rms_norm`'s
        `float_copy`), so the cast costs no kernel."""
        return (
            self.router_dtype == torch.float32 and dtype != torch.float32 and not self.takes_input_dtype(dtype, device)
        )

    def router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`(tokens, hidden)` -> `(tokens, num_experts)` in the router dtype (`hidden_states` already in it, as the
        fused path's norm writes them, costs no cast; see `takes_input_dtype` for half-precision inputs)."""
        if self.takes_input_dtype(hidden_states.dtype, hidden_states.device):
            return torch.mm(hidden_states, self.weight.t(), out_dtype=torch.float32)
        return nn.functional.linear(hidden_states.to(self.router_dtype), self.weight.to(self.router_dtype))

    def fused_forward(
        self, hidden_states: torch.Tensor, routing_blocks: RoutingBlocks | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `forward`, with everything after the logits product in one Triton kernel (`triton_moe.route`; on
        ties the lowest expert index wins). Needs a float32 router; `forward(..., fused=True)` calls it (so module
        hooks see it). Under block routing, `fused_block_route` (three launches, no host synchronisation): its
        expert ids feed the same fused alignment and grouped products."""
        logits = self.router_logits(hidden_states)
        if self.block_routing:
            index, weight = fused_block_route(
                logits,
                self.expert_bias,
                self.default_routing_blocks(logits.shape[0], logits.device, routing_blocks),
                self.expert_capacity,
                self.top_k,
                self.score_function,
                self.norm_topk_prob,
                self.routed_scaling_factor,
            )
            return index, weight, logits
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
        self, hidden_states: torch.Tensor, fused: bool = False, routing_blocks: RoutingBlocks | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states `(tokens, hidden)` -> expert indices `(tokens, top_k)`, their weights `(tokens, top_k)`
        and the router logits `(tokens, num_experts)`, both in the router dtype (float32). `fused`: through
        `fused_forward`. routing_blocks: the tokens' routing blocks under block routing (ignored without it)."""
        if fused:
            return self.fused_forward(hidden_states, routing_blocks)
        logits = self.router_logits(hidden_states)
        return (*self.route(logits, routing_blocks), logits)

    def route(
        self, logits: torch.Tensor, routing_blocks: RoutingBlocks | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference routing after the logits product: logits `(tokens, num_experts)` -> expert indices and
        weights `(tokens, top_k)`."""
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits.float()).to(logits.dtype)
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
        # The bias steers which experts are chosen (load balancing) but not how much they weigh.
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.block_routing:
            topk_idx = self.block_routing_topk(choice, routing_blocks)
        else:
            topk_idx = self.group_limited_topk(choice)
        topk_weight = scores.gather(1, topk_idx)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * self.routed_scaling_factor


def _grouped_mm_function() -> Callable | None:
    return getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class LLaDA2MoeSparseMoeBlock(nn.Module):
    """Routed experts (`experts.{e}`, Hub-named `nn.Linear`s, so checkpoints load unchanged), the router (`gate`)
    and the shared experts (`shared_experts`).

    The routed part sorts the (token, expert) pairs by expert and runs each expert on its contiguous rows, in one
    of two ways that compute the same thing:

    - grouped (`experts_implementation="grouped_mm"`, the default, where no autograd graph is needed): two
      grouped products over stacked views of the experts' weights, no host synchronisation (CUDA-graph
      capturable). Where the fused kernels run (`fused_forward`), `grouped_gemm.py`'s Triton kernel: on an H100 at
      LLaDA2.0-mini's shapes it beat `torch._grouped_mm` (with its gather and SiLU kernels) by 12-24 % at a
      batch-1 block step and 1-10 % at batch 32 (`benchmarks/bench_llada2_moe_gemm.py`), and it takes FP8
      experts; elsewhere torch's grouped GEMM where it runs for the device and dtype;
    - loop (`"eager"`, and the fallback): one call per expert that received tokens, like transformers' Qwen2-MoE /
      DeepSeek-V3 eager paths; reading the per-expert counts synchronises with the host once per layer.

    FP8 experts (each expert's layers quantized by transformers' `FineGrainedFP8Config`, or a pre-quantized
    checkpoint's `weight_scale_inv`) run as `grouped_gemm.py`'s FP8 products over the stacked FP8 weights and
    scales where the fused kernels run, else as the loop (their weights dequantized per product).

    The outputs are put back in (token, choice) order and combined in float32 with the routing weights, as the
    original `moe_infer` does.

    Under expert parallelism (`LLaDA2MoeConfig.base_model_ep_plan`) `experts` (a `grouped_gemm.ExpertList`) keeps
    this rank's E / N experts and `forward` hands them the routing through `expert_dispatch`, where transformers
    masks the other ranks' routes and sums the ranks' outputs (with the tensor-parallel shared expert's partial
    sums: one all-reduce per layer); the fused path is not taken.
    """

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.intermediate_size = config.moe_intermediate_size
        self.experts = ExpertList(
            [LLaDA2MoeMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)], config
        )
        self.gate = LLaDA2MoeGate(config)
        if config.num_shared_experts:
            self.shared_experts = LLaDA2MoeMLP(config, config.moe_intermediate_size * config.num_shared_experts)
        else:
            self.shared_experts = None
        # Expert parallelism's entry (`LLaDA2MoeConfig.base_model_ep_plan`); after `experts` in the module tree.
        self.expert_dispatch = ExpertDispatch(self.experts, self.shared_experts)
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act in ("silu", "swish")
        # Stacked expert weights for the grouped path (see `stacked_weights`); not part of state_dict.
        self._stacked: ExpertStacks | None = None
        self._stack_check: list[tuple[torch.Tensor, int]] = []

    def _apply(self, fn, *args, **kwargs):
        # `.to()`, `.cuda()`, `.half()` give the parameters new storage: drop the old stacks with them.
        self._stacked = None
        return super()._apply(fn, *args, **kwargs)

    @property
    def stack_shared(self) -> bool:
        """One shared expert has the routed experts' shape: the fused path runs it as one more group of the grouped
        GEMMs (every token's last pair), its weights stacked after the routed experts'; not when only one of them
        holds FP8 weights (or they have different block sizes), nor when tensor parallelism splits it otherwise than
        the routed experts (its partial sums are reduced with theirs)."""
        if self.shared_experts is None or self.config.num_shared_experts != 1:
            return False
        routed = self.experts[0]
        if expert_fp8_block_size(self.shared_experts.gate_proj) != expert_fp8_block_size(routed.gate_proj):
            return False
        return all(
            is_sharded(getattr(self.shared_experts, name).weight) == is_sharded(getattr(routed, name).weight)
            and local_shape(getattr(self.shared_experts, name).weight) == local_shape(getattr(routed, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj")
        )

    def stacked_weights(self) -> ExpertStacks:
        """The experts' weights stacked (`ExpertStacks`: gate_up `(E', 2 * I, H)`, down `(E', H, I)` and FP8 block
        scales), with `E' = E + 1` when the shared expert is stacked after the routed ones (`stack_shared`), else
        `E`.

        The experts' parameters (and FP8 scales) are re-pointed to views of the stacks, so they cost no memory and
        stay in sync
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
        # The shared expert's too, stacked or not: replacing its layers (FP8 ones, tensor-parallel shards) is what
        # changes `stack_shared`, which is decided once per build of the stacks.
        sampled = [
            self.experts[0],
            self.experts[-1],
            *([self.shared_experts] if self.shared_experts is not None else []),
        ]
        return [linear.weight for expert in sampled for linear in (expert.gate_proj, expert.up_proj, expert.down_proj)]

    def _stacks_are_current(self) -> bool:
        weights = self._sampled_weights()  # fewer when the shared expert was removed
        return len(weights) == len(self._stack_check) and all(
            weight is sampled and local_tensor(weight).data_ptr() == pointer
            for weight, (sampled, pointer) in zip(weights, self._stack_check, strict=True)
        )

    def refresh_stacked_weights(self) -> None:
        """(Re)build the stacks of `stacked_weights` from the experts' current weights (under tensor parallelism,
        this rank's slices: `I` is then its share of the intermediate width)."""

        self._stacked = stack_experts(self._stacked_experts())
        self._stack_check = [(weight, local_tensor(weight).data_ptr()) for weight in self._sampled_weights()]

    def _grouped_allowed(self) -> bool:
        """Whether the experts may run grouped over the stacks at all: not asked to run as the loop
        (`experts_implementation="eager"`), and no autograd graph is needed (the stacks are detached views:
        training takes the loop, which autograd follows)."""
        if getattr(self.config, "_experts_implementation", None) == EXPERTS_EAGER:
            return False
        return not (torch.is_grad_enabled() and self.experts[0].gate_proj.weight.requires_grad)

    def use_grouped_mm(self, hidden_states: torch.Tensor) -> bool:
        """Whether the routed experts run as torch's grouped GEMMs for this input (see the class docstring)."""
        if not self._grouped_allowed() or _grouped_mm_function() is None or self.experts.partitioned:
            return False
        weight = local_tensor(self.experts[0].gate_proj.weight)  # this rank's slice under tensor parallelism
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

    def routing_blocks(self, hidden_states: torch.Tensor, routing_blocks: RoutingBlocks | None) -> RoutingBlocks | None:
        """The routing blocks the gate takes for hidden_states `(batch, len, hidden)`: None without block routing;
        `routing_blocks` as given (the model makes them from the inputs' positions); else each row at positions
        `[0, len)` (`routing_blocks_for_positions`)."""
        if not self.gate.block_routing:
            return None
        if routing_blocks is not None:
            return routing_blocks
        batch, length, _ = hidden_states.shape
        positions = torch.arange(length, device=hidden_states.device).expand(batch, length)
        return routing_blocks_for_positions(positions, self.gate.block_size)

    def forward(
        self, hidden_states: torch.Tensor, routing_blocks: RoutingBlocks | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states `(batch, len, hidden)` -> output `(batch, len, hidden)` and router logits
        `(batch * len, num_experts)`. routing_blocks: the tokens' routing blocks under block routing (see
        `routing_blocks`)."""
        batch, length, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        topk_idx, topk_weight, router_logits = self.gate(
            x, routing_blocks=self.routing_blocks(hidden_states, routing_blocks)
        )
        if self.experts.partitioned:  # expert parallelism: this rank's experts, summed over the ranks
            out = self.expert_dispatch(x, topk_idx, topk_weight).view(batch, length, hidden)
            shared = None if self.expert_dispatch.joins_shared else self.shared_experts
            return (out if shared is None else out + shared(hidden_states)), router_logits
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
        shared = self.shared_experts
        down_weight = self.experts[0].down_proj.weight
        if grouped and is_sharded(down_weight):
            # Tensor parallel: the grouped GEMMs ran this rank's slices of the experts (the loop calls the sharded
            # modules, whose hooks already summed): one all-reduce of the partial outputs, in the router dtype, with
            # the shared experts' partial output in it.
            if shared is not None:
                out = out + shared.partial_forward(x).to(out.dtype)
                shared = None
            out = all_reduce_partial(out, like=down_weight)
        out = out.to(x.dtype).view(batch, length, hidden)
        if shared is not None:
            out = out + shared(hidden_states)
        return out, router_logits

    def use_grouped_kernel(self, hidden_states: torch.Tensor) -> bool:
        """Whether the routed experts can run as `grouped_gemm.py`'s products for this input: grouped runs are
        allowed (`_grouped_allowed`), the fused kernels apply, and the experts hold weights in the activations'
        dtype or FP8 weights the kernel takes (block scales; not sharded: FP8 and tensor parallelism are not
        combined). Per-tensor FP8 experts run one by one (`kernels.linear`)."""
        if self.experts.partitioned:  # expert parallelism: `forward` through `expert_dispatch`
            return False
        layer = self.experts[0].gate_proj
        if not self._grouped_allowed() or not use_fused_kernels(hidden_states):
            return False
        if is_fp8_linear(layer):
            return fp8_kernel_supports(layer.weight, layer.block_size) and not is_sharded(layer.weight)
        return local_tensor(layer.weight).dtype == hidden_states.dtype

    def use_fused(self, hidden_states: torch.Tensor) -> bool:
        """Whether `fused_forward` runs for this input: the fused kernels apply (`kernels.py`), the grouped
        kernel runs the experts (`use_grouped_kernel`), the router is float32 and the activation SiLU (with or
        without tensor parallelism)."""
        return (
            MOE_KERNELS_AVAILABLE
            and self.silu
            and self.gate.router_dtype == torch.float32
            and self.use_grouped_kernel(hidden_states)
        )

    def never_synchronizes(self, hidden_states: torch.Tensor) -> bool:
        """Whether `forward` / `fused_forward` run for this input without a host synchronisation (so a step can be
        captured in a CUDA graph): the fused path, or torch's grouped GEMM in bfloat16 (its float16 / float32
        kernels copy through the host; the per-expert loop reads the counts on the host)."""
        if self.use_fused(hidden_states):
            return True
        if self.experts.partitioned:
            return hidden_states.device.type == "cuda" and self.experts.runs_grouped(hidden_states)
        return hidden_states.dtype == torch.bfloat16 and self.use_grouped_mm(hidden_states)

    def fused_forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        router_input: torch.Tensor | None = None,
        routing_blocks: RoutingBlocks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual + forward(hidden_states)[0]` and the router logits, through the Triton kernels of
        `triton_moe.py` (router, alignment by expert, weighted combine with the shared expert and the residual) and
        the two grouped products of `grouped_gemm.py` (the gather of the rows and the SiLU gate fused into the
        first one's loads and epilogue; FP8 or not) whose groups are the routed experts and the shared expert
        (`stack_shared`). No host synchronisation. hidden_states, residual `(batch, len, hidden)`; router_input:
        hidden_states in float32 (the router's dtype) or None (cast here).

        Under tensor parallelism (Megatron-LM's MLP split, arXiv:1909.08053) the GEMMs run this rank's slices of the
        experts' intermediate width, so the combined rows are partial sums: one all-reduce per layer sums them, and
        only the rank holding the first slice adds the residual before it, so the sum holds it once (no extra
        kernel; in bfloat16 the residual is rounded once more, in the all-reduce). A shared expert outside the
        stacks runs its own (sharded, self-reducing) modules and is added after the all-reduce."""
        batch, length, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        router_x = x if router_input is None else router_input.reshape(-1, hidden)
        blocks = self.routing_blocks(hidden_states, routing_blocks)
        topk_idx, topk_weight, router_logits = self.gate(router_x, fused=True, routing_blocks=blocks)
        stacks = self.stacked_weights()
        stacked_shared = stacks.gate_up.shape[0] > self.num_experts  # `stack_shared`, as decided with the stacks
        sorted_token, offsets, rows = triton_moe.align_by_expert(topk_idx, self.num_experts, stacked_shared)
        hidden_rows = grouped_matmul(
            x, offsets, stacks.gate_up, stacks.gate_up_scale, stacks.block_size, rows_of=sorted_token, gated=True
        )
        expert_rows = grouped_matmul(hidden_rows, offsets, stacks.down, stacks.down_scale, stacks.block_size)
        residual = residual.reshape(-1, hidden)
        down_weight = self.experts[0].down_proj.weight  # split by its columns (`rowwise`) under tensor parallelism
        shared_apart = self.shared_experts is not None and not stacked_shared
        adds_residual = not shared_apart and shard_range(down_weight, 1)[0] == 0  # every rank when not sharded
        out = triton_moe.combine(expert_rows, rows, topk_weight, stacked_shared, residual if adds_residual else None)
        if shared_apart and is_sharded(down_weight):  # its partial output joins the routed experts' all-reduce
            out = all_reduce_partial(out + self.shared_experts.partial_forward(x).to(out.dtype), like=down_weight)
            out = residual + out
        else:
            out = all_reduce_partial(out, like=down_weight)
            if shared_apart:
                out = residual + (out + self.shared_experts(x))
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
        stacks = self.stacked_weights()
        gate_up, down = stacks.gate_up[: self.num_experts], stacks.down[: self.num_experts]
        offsets = counts.cumsum(0).to(torch.int32)
        projected = grouped_mm(sorted_tokens, gate_up.transpose(1, 2), offs=offsets)
        gate, up = projected.chunk(2, dim=-1)
        return grouped_mm(
            gated_activation(self.act_fn, gate, up, self.silu).contiguous(), down.transpose(1, 2), offs=offsets
        )
