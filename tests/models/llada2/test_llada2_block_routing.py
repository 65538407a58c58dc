"""LLaDA2.2's MoE block routing (config `block_size` / `expert_capacity`, `llada2_moe_layer.block_limited_topk`)
against a float32 reference written as a direct Python loop over rows, blocks and tokens: the gate (several block
sizes and capacities, partial first and last blocks, batches, with and without group-limited routing in the config
and expert bias, sigmoid and softmax), the MoE layer (grouped and loop experts) and whole-model forwards (prefill,
a cached block step at columns that are not block-aligned, a left-padded row, packed rows) against a per-token
computation; capacity = num_experts equals plain routing; at most `expert_capacity` experts per block; the fused
path (its router `fused_block_route` and a model's prefill and cached step, Triton interpreter) equals the PyTorch
path; config validation.

Semantics (SGLang PR #31768 / #31743 and the released LLaDA2.2 code as its review describes it): the block score
of an expert is the max over the block's tokens of its choice score (sigmoid score plus `expert_bias`); the
`expert_capacity` best experts of a block are allowed; each token takes its top-k of the allowed by choice score;
weights are the unbiased scores, normalised (`norm_topk_prob`) and times `routed_scaling_factor`; `n_group` /
`topk_group` are not applied. Blocks: each row's absolute positions, `position // block_size`, padding apart.
"""

from __future__ import annotations

import importlib.util
import json
import math
import textwrap

import pytest
import torch

from hf_dllm import LLaDA2MoeConfig, LLaDA2MoeModelLM
from hf_dllm.cache import DiffusionKVCache
from hf_dllm.llada2_moe_layer import (
    LLaDA2MoeGate,
    LLaDA2MoeSparseMoeBlock,
    RoutingBlocks,
    routing_blocks_for_packed,
    routing_blocks_for_positions,
)
from hf_dllm.packed import PackedRows
from tests.conftest import interpreter_job

ATOL = 2e-5

BASE = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=16,  # 16-byte aligned rows: the grouped products run on the CPU
    first_k_dense_replace=1,
    max_position_embeddings=128,
    mask_token_id=60,
    pad_token_id=0,
    eos_token_id=1,
)


def moe_config(**overrides) -> LLaDA2MoeConfig:
    fields = dict(BASE, num_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, block_size=4, expert_capacity=5)
    fields.update(overrides)
    return LLaDA2MoeConfig(**fields)


# ----------------------------------------------------------------------------------------------------------------
# The reference: a direct loop over rows, blocks and tokens (float32 scores; Python comparisons and sums)
# ----------------------------------------------------------------------------------------------------------------


def reference_route(logits, bias, config, rows_positions):
    """Expert lists and weights per token. logits `(tokens, E)`; rows_positions: per token, (row, absolute position),
    the tokens of a row in order. Returns `(indices, weights)` as nested lists, tokens in order."""
    if config.score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        scores = torch.softmax(logits.float(), dim=-1)
    choice = scores if bias is None else scores + bias.float()
    scores, choice = scores.tolist(), choice.tolist()
    n_experts = len(scores[0])
    blocks: dict[tuple[int, int], list[int]] = {}
    for token, (row, position) in enumerate(rows_positions):
        blocks.setdefault((row, position // config.block_size), []).append(token)
    indices, weights = [None] * len(rows_positions), [None] * len(rows_positions)
    for tokens in blocks.values():
        block_score = [max(choice[t][e] for t in tokens) for e in range(n_experts)]
        allowed = sorted(range(n_experts), key=lambda e: -block_score[e])[: config.expert_capacity]
        for t in tokens:
            chosen = sorted(allowed, key=lambda e: -choice[t][e])[: config.num_experts_per_tok]
            w = [scores[t][e] for e in chosen]
            if config.num_experts_per_tok > 1 and config.norm_topk_prob:
                total = sum(w) + 1e-20
                w = [x / total for x in w]
            indices[t] = chosen
            weights[t] = [x * config.routed_scaling_factor for x in w]
    return indices, weights


def rows_positions_of(batch: int, columns: list[int]) -> list[tuple[int, int]]:
    return [(row, column) for row in range(batch) for column in columns]


def random_gate(config, seed: int) -> LLaDA2MoeGate:
    torch.manual_seed(seed)
    gate = LLaDA2MoeGate(config)
    gate.weight.data.normal_()
    if gate.expert_bias is not None:
        gate.expert_bias.normal_(0, 0.1)
    return gate


def assert_routing(index, weight, ref_index, ref_weight):
    assert index.tolist() == ref_index
    torch.testing.assert_close(weight, torch.tensor(ref_weight), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The gate
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "experts, top_k, capacity, block, groups, score, bias",
    [
        (16, 3, 5, 4, (4, 2), "sigmoid", True),  # group-limited fields in the config: not applied
        (16, 4, 4, 8, (1, 1), "sigmoid", True),  # capacity = top-k
        (24, 2, 7, 1, (4, 1), "sigmoid", False),  # blocks of one token
        (12, 3, 6, 5, (3, 3), "softmax", False),
        (16, 3, 16, 3, (4, 2), "sigmoid", True),  # capacity = num_experts
    ],
)
@pytest.mark.parametrize("batch, start, length", [(1, 0, 8), (3, 0, 13), (2, 6, 11), (2, 3, 1)])
def test_gate_matches_the_loop_reference(experts, top_k, capacity, block, groups, score, bias, batch, start, length):
    config = moe_config(
        num_experts=experts,
        num_experts_per_tok=top_k,
        expert_capacity=capacity,
        block_size=block,
        n_group=groups[0],
        topk_group=groups[1],
        score_function=score,
        moe_router_enable_expert_bias=bias,
    )
    gate = random_gate(config, seed=experts + block + length)
    x = torch.randn(batch * length, config.hidden_size)
    columns = torch.arange(start, start + length)  # partial first block (start) and last block
    blocks = routing_blocks_for_positions(columns.expand(batch, -1), block)
    index, weight, logits = gate(x, routing_blocks=blocks)
    ref = reference_route(logits, gate.expert_bias, config, rows_positions_of(batch, columns.tolist()))
    assert_routing(index, weight, *ref)
    # Without routing blocks: the tokens of the call in order, in blocks of `block_size` (one row from column 0).
    index, weight, _ = gate(x)
    assert_routing(
        index, weight, *reference_route(logits, gate.expert_bias, config, rows_positions_of(1, range(len(x))))
    )


def test_block_touches_at_most_capacity_experts_and_fewer_than_plain_routing():
    config = moe_config(
        num_experts=64, num_experts_per_tok=4, n_group=1, topk_group=1, block_size=16, expert_capacity=8
    )
    gate = random_gate(config, seed=1)
    batch, length = 3, 40
    blocks = routing_blocks_for_positions(torch.arange(length).expand(batch, -1), 16)
    index, _, logits = gate(torch.randn(batch * length, config.hidden_size), routing_blocks=blocks)
    plain = logits.sigmoid().add(gate.expert_bias).topk(4, dim=-1).indices
    touched, touched_plain = [], []
    for block in blocks.ids.unique():
        tokens = blocks.ids == block
        touched.append(index[tokens].unique().numel())
        touched_plain.append(plain[tokens].unique().numel())
    assert max(touched) <= 8 and min(touched) >= 4
    assert sum(touched) < sum(touched_plain)  # the point of block routing: fewer experts per block


def test_capacity_of_all_experts_is_plain_routing():
    for score, bias in (("sigmoid", True), ("softmax", False)):
        plain = moe_config(
            score_function=score,
            moe_router_enable_expert_bias=bias,
            topk_group=4,
            block_size=None,
            expert_capacity=None,
        )
        blocked = moe_config(score_function=score, moe_router_enable_expert_bias=bias, expert_capacity=16)
        gate, plain_gate = random_gate(blocked, seed=3), random_gate(plain, seed=3)
        assert gate.block_routing and not plain_gate.block_routing
        x = torch.randn(21, BASE["hidden_size"])
        blocks = routing_blocks_for_positions(torch.arange(3, 10).expand(3, -1), 4)
        for got, want in zip(gate(x, routing_blocks=blocks), plain_gate(x), strict=True):
            assert torch.equal(got, want)


def test_routing_blocks_of_positions_padding_and_packed_rows():
    blocks = routing_blocks_for_positions(torch.arange(6, 13).expand(2, -1), 4)  # blocks [6, 8), [8, 12), [12]
    assert blocks.ids.tolist() == [0, 0, 1, 1, 1, 1, 2, 4, 4, 5, 5, 5, 5, 6] and blocks.count == 2 * 4
    # Left padding (positions counted from the first real token, pads at 0): the pads get a block of their own.
    real = torch.tensor([[True] * 5, [False, False, True, True, True]])
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    blocks = routing_blocks_for_positions(positions, 2, real)
    assert blocks.ids.tolist() == [0, 0, 1, 1, 2, 9, 9, 5, 5, 6] and blocks.count == 2 * 5
    packed = routing_blocks_for_packed([5, 3], torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), 4)  # each row from 0
    assert packed.ids.tolist() == [0, 0, 0, 0, 1, 4, 4, 4] and packed.count == 2 * 4
    packed = routing_blocks_for_packed([5, 2], torch.tensor([2, 3, 4, 5, 6, 9, 10]), 4)
    assert packed.ids.tolist() == [0, 0, 1, 1, 1, 4, 4]


# ----------------------------------------------------------------------------------------------------------------
# The MoE layer and whole models, against per-token computations
# ----------------------------------------------------------------------------------------------------------------


def randomized_model(config, seed: int = 0) -> LLaDA2MoeModelLM:
    torch.manual_seed(seed)
    model = LLaDA2MoeModelLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.2 if "norm" in name else 0.05))
            if name.endswith("gate.weight"):
                param.normal_()  # a router that discriminates: blocks differ in their allowed experts
        for layer in model.model.layers:
            if isinstance(layer.mlp, LLaDA2MoeSparseMoeBlock) and layer.mlp.gate.expert_bias is not None:
                layer.mlp.gate.expert_bias.normal_(0, 0.1)
    return model


def direct_moe(mlp: LLaDA2MoeSparseMoeBlock, hidden_states: torch.Tensor, rows_positions) -> torch.Tensor:
    """The MoE layer token by token: reference routing, each chosen expert called on the token alone."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = torch.nn.functional.linear(x.float(), mlp.gate.weight.float())
    indices, weights = reference_route(logits, mlp.gate.expert_bias, mlp.config, rows_positions)
    out = []
    for t in range(len(x)):
        routed = sum(w * mlp.experts[e](x[t : t + 1]).float() for e, w in zip(indices[t], weights[t], strict=True))
        shared = mlp.shared_experts(x[t : t + 1]) if mlp.shared_experts is not None else 0
        out.append(routed.to(x.dtype) + shared)
    return torch.cat(out).view(hidden_states.shape)


def test_moe_layer_grouped_and_loop_match_the_direct_computation():
    config = moe_config(num_shared_experts=1)
    model = randomized_model(config)
    mlp = model.model.layers[1].mlp
    hidden = torch.randn(2, 9, config.hidden_size)
    want = direct_moe(mlp, hidden, rows_positions_of(2, list(range(9))))
    for experts in ("grouped_mm", "eager"):
        config._experts_implementation = experts
        with torch.no_grad():
            got, _ = mlp(hidden)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def capture_moe(model):
    """Forward hooks recording each MoE layer's (input, output) of each forward."""
    records = []
    handles = [
        layer.mlp.register_forward_hook(lambda module, args, out: records.append((module, args[0], out[0])))
        for layer in model.model.layers
        if isinstance(layer.mlp, LLaDA2MoeSparseMoeBlock)
    ]
    return records, handles


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_model_forward_routes_by_absolute_position_blocks(experts):
    """A prefill of 10 columns and a cached step at columns [10, 17) (not aligned to blocks of 4): each MoE layer's
    output equals the per-token computation with blocks of each row's absolute positions."""
    config = moe_config(num_shared_experts=1)
    model = randomized_model(config)
    model.set_experts_implementation(experts)
    ids = torch.randint(2, 59, (2, 17), generator=torch.Generator().manual_seed(0))
    cache = DiffusionKVCache(config.num_hidden_layers, 2, 17)
    records, handles = capture_moe(model)
    try:
        with torch.no_grad():
            model(ids[:, :10], past_key_values=cache, use_cache=True, cache_position=torch.arange(10), block_length=4)
            model(
                ids[:, 10:], past_key_values=cache, use_cache=True, cache_position=torch.arange(10, 17), block_length=4
            )
    finally:
        for handle in handles:
            handle.remove()
    layers = config.num_hidden_layers - config.first_k_dense_replace
    assert len(records) == 2 * layers
    for i, (module, hidden, out) in enumerate(records):
        columns = list(range(10)) if i < layers else list(range(10, 17))
        torch.testing.assert_close(out, direct_moe(module, hidden, rows_positions_of(2, columns)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("pad, block_length", [(4, 4), (3, 1)])
def test_left_padded_row_and_packed_rows_route_as_the_row_alone(pad, block_length):
    """A left-padded row routes (and computes) what it computes alone: its blocks follow its positions, and the
    padding is in none of them (padding of 3 with causal attention: only the routing could tell it apart). So do
    packed rows (the second at an offset of 10, not a multiple of the block)."""
    config = moe_config()
    model = randomized_model(config, seed=2)
    long, short = torch.randint(2, 59, (2, 10), generator=torch.Generator().manual_seed(1))
    short = short[: 10 - pad]
    ids = torch.stack([long, torch.cat([torch.zeros(pad, dtype=torch.long), short])])
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, block_length=block_length).logits
        alone = model(short[None], block_length=block_length).logits[0]
        torch.testing.assert_close(batched[1, pad:], alone, atol=ATOL, rtol=0)
        torch.testing.assert_close(
            batched[0], model(long[None], block_length=block_length).logits[0], atol=ATOL, rtol=0
        )
        packing = PackedRows([10, 10 - pad])
        positions = torch.cat([torch.arange(10), torch.arange(10 - pad)])[None]
        packed = model(torch.cat([long, short])[None], attention_mask=packing, past_key_values=packing,
                       position_ids=positions, block_length=block_length)  # fmt: skip
        torch.testing.assert_close(packed.logits[0, 10:], alone, atol=ATOL, rtol=0)
        # Packed rows writing a cache (their `rows` made with it).
        cache = DiffusionKVCache(config.num_hidden_layers, 2, 10)
        packing = PackedRows([10, 10 - pad], cache, positions[0])
        packed = model(torch.cat([long, short])[None], attention_mask=packing, past_key_values=packing,
                       position_ids=positions, block_length=block_length)  # fmt: skip
    torch.testing.assert_close(packed.logits[0, 10:], alone, atol=ATOL, rtol=0)


def test_model_with_capacity_of_all_experts_equals_the_plain_model():
    blocked = moe_config(expert_capacity=16, n_group=4, topk_group=4)
    plain = moe_config(expert_capacity=None, block_size=None, n_group=4, topk_group=4)
    ids = torch.randint(2, 59, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = randomized_model(blocked)(ids, block_length=4).logits
        want = randomized_model(plain)(ids, block_length=4).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_block_routing_changes_the_routing_when_capacity_is_tight():
    tight = moe_config(expert_capacity=3)
    plain = moe_config(expert_capacity=None, block_size=None)
    ids = torch.randint(2, 59, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = randomized_model(tight)(ids, block_length=4, output_router_logits=True)
        want = randomized_model(plain)(ids, block_length=4, output_router_logits=True)
    torch.testing.assert_close(got.router_logits[0], want.router_logits[0], atol=ATOL, rtol=0)  # same logits
    assert (got.logits - want.logits).abs().max() > 1e-3  # different experts


# ----------------------------------------------------------------------------------------------------------------
# The fused path (Triton's interpreter on the CPU)
# ----------------------------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch, hf_dllm
    from hf_dllm import kernels
    from hf_dllm.cache import DiffusionKVCache
    from hf_dllm.llada2_moe_layer import LLaDA2MoeGate, LLaDA2MoeSparseMoeBlock, routing_blocks_for_positions

    fused_calls = []
    fused_forward = LLaDA2MoeSparseMoeBlock.fused_forward
    def counting(self, *args, **kwargs):
        fused_calls.append(kwargs.get("routing_blocks"))
        return fused_forward(self, *args, **kwargs)
    LLaDA2MoeSparseMoeBlock.fused_forward = counting

    torch.manual_seed(0)
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, first_k_dense_replace=1,
                num_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, block_size=4, expert_capacity=5,
                mask_token_id=60, pad_token_id=0, eos_token_id=1)
    # The fused router (`fused_block_route`) against the PyTorch one: expert counts that are not powers of two,
    # sigmoid / softmax, with and without bias (and a bfloat16 one), capacity = top-k and = all experts, partial
    # blocks, padding, the tokens of the call in order; tied block maxima.
    for experts, top_k, capacity, block, score, bias in [
        (16, 3, 5, 4, "sigmoid", True), (24, 4, 4, 8, "sigmoid", True), (12, 2, 12, 3, "softmax", False),
        (20, 1, 6, 1, "sigmoid", False), (16, 8, 9, 5, "sigmoid", True),
    ]:
        config = hf_dllm.LLaDA2MoeConfig(**dict(base, num_experts=experts, num_experts_per_tok=top_k,
            expert_capacity=capacity, block_size=block, score_function=score, moe_router_enable_expert_bias=bias,
            n_group=4, topk_group=4))
        gate = LLaDA2MoeGate(config)
        gate.weight.data.normal_()
        if bias:
            gate.expert_bias.normal_(0, 0.1)
        x = torch.randn(2 * 7, 32)
        positions = torch.arange(6, 13).expand(2, -1)
        real = torch.ones(2, 7, dtype=torch.bool)
        real[1, :2] = False
        for blocks in (routing_blocks_for_positions(positions, block, real), None):
            (index, weight, logits), (ref_index, ref_weight, ref_logits) = (
                gate.fused_forward(x, blocks), gate(x, routing_blocks=blocks))
            assert torch.equal(index, ref_index), ("index", experts, capacity, block)
            assert torch.allclose(weight, ref_weight, rtol=1e-6, atol=1e-6), ("weight", experts, capacity, block)
            assert torch.equal(logits, ref_logits)
        if bias:
            gate.expert_bias = gate.expert_bias.bfloat16()
            index, weight, _ = gate.fused_forward(x)
            ref_index, ref_weight, _ = gate(x)
            assert torch.equal(index, ref_index) and torch.allclose(weight, ref_weight, rtol=1e-6, atol=1e-6), "bf16"
    # Every block maximum tied (a zero router and bias): the capacity goes to the lowest expert indices, and the
    # top-k among them too (torch.topk breaks such ties its own way: only the weights compare).
    gate.weight.data.zero_()
    gate.expert_bias.zero_()
    blocks = routing_blocks_for_positions(positions, block, real)
    (index, weight, _), (_, ref_weight, _) = gate.fused_forward(x, blocks), gate(x, routing_blocks=blocks)
    assert index.tolist() == [list(range(8))] * len(x) and torch.allclose(weight, ref_weight), "tied block maxima"

    for shared in (1, 2):  # the shared expert stacked with the routed ones (1) or apart (2)
        model = hf_dllm.LLaDA2MoeModelLM(hf_dllm.LLaDA2MoeConfig(**dict(base, num_shared_experts=shared))).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.add_(torch.randn_like(param) * (0.2 if "norm" in name else 0.05))
            model.model.layers[1].mlp.gate.weight.normal_()
            model.model.layers[1].mlp.gate.expert_bias.normal_(0, 0.1)
        ids, step = torch.randint(2, 59, (2, 10)), torch.randint(2, 59, (2, 6))
        results = {}
        for mode in ("torch", "triton"):
            kernels.set_kernel_mode(mode)
            cache = DiffusionKVCache(2, 2, 16)
            with torch.no_grad():
                prefill = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(10),
                                block_length=4).logits
                logits = model(step, past_key_values=cache, use_cache=True, cache_position=torch.arange(10, 16),
                               block_length=4).logits
            results[mode] = (prefill, logits)
        assert len(fused_calls) == 2 and all(blocks is not None for blocks in fused_calls), "the fused MoE path ran"
        fused_calls.clear()
        for name, ref, ours in zip(("prefill", "step"), results["torch"], results["triton"]):
            assert (ref - ours).abs().max() < 1e-5, (name, shared, (ref - ours).abs().max())
    print("ok")
    """
)


INTERPRETER_RUN = interpreter_job(
    {"fused": INTERPRETER_SCRIPT}, timeout=600, when=lambda: importlib.util.find_spec("triton") is not None
)


@INTERPRETER_RUN.used_by
def test_fused_path_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton", reason="the `triton` extra is not installed")
    done = INTERPRETER_RUN.results()["fused"]
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 1024])  # LLaDA2.2-mini's block step at batch 1 and 32
def test_fused_router_on_cuda_matches_pytorch_without_host_syncs_and_captures(tokens):
    """On a GPU at LLaDA2.2-mini's router shape (256 experts, top-8, capacity 48, blocks of 32): `fused_block_route`
    (two Triton kernels) equals the PyTorch router, never makes the host wait, and replays in a CUDA graph."""
    from tests.generation.test_gpu import host_sync_warnings, recorded_host_syncs

    config = moe_config(num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, block_size=32,
                        expert_capacity=48)  # fmt: skip
    gate = random_gate(config, seed=5).cuda()
    logits = torch.randn(tokens, 256, device="cuda")
    blocks = routing_blocks_for_positions(torch.arange(tokens, device="cuda").view(-1, 32) % 32 + 64, 32)
    ref_index, ref_weight = gate.route(logits, blocks)
    from hf_dllm.llada2_moe_layer import fused_block_route

    def fused():
        return fused_block_route(logits, gate.expert_bias, blocks, 48, 8, "sigmoid", True, config.routed_scaling_factor)

    index, weight = fused()
    assert torch.equal(index, ref_index)
    torch.testing.assert_close(weight, ref_weight, atol=1e-6, rtol=1e-6)
    with recorded_host_syncs() as caught:
        fused()
        gate.route(logits, blocks)
    assert not host_sync_warnings(caught), host_sync_warnings(caught)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused()
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    ref_index, _ = gate.route(logits, blocks)
    assert torch.equal(captured[0], ref_index)


# ----------------------------------------------------------------------------------------------------------------
# The config
# ----------------------------------------------------------------------------------------------------------------


def test_config_reads_saves_and_defaults(tmp_path):
    config = moe_config()
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["block_size"] == 4 and saved["expert_capacity"] == 5
    reloaded = LLaDA2MoeConfig.from_pretrained(tmp_path)
    assert (reloaded.block_size, reloaded.expert_capacity) == (4, 5) and reloaded.uses_block_routing()
    plain = LLaDA2MoeConfig()
    assert plain.block_size is None and plain.expert_capacity is None and not plain.uses_block_routing()
    assert not LLaDA2MoeGate(LLaDA2MoeConfig(**dict(BASE, num_experts=16, n_group=4))).block_routing


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("expert_capacity", dict(block_size=32, expert_capacity=None)),
        ("block_size", dict(block_size=None, expert_capacity=8)),
        ("block_size", dict(block_size=0)),
        ("block_size", dict(block_size=2.0)),
        ("block_size", dict(block_size=True)),
        ("expert_capacity", dict(expert_capacity=-1)),
        ("expert_capacity", dict(expert_capacity=2)),  # < num_experts_per_tok (3)
        ("expert_capacity", dict(expert_capacity=17)),  # > num_experts (16)
        ("expert_capacity", dict(num_experts=None, n_group=1)),  # a dense model
    ],
)
def test_config_validation_names_the_field(field, overrides):
    with pytest.raises(ValueError, match=rf"LLaDA2MoeConfig\.{field}\b"):
        moe_config(**overrides)


def test_reference_is_not_vacuous():
    """The reference loop itself: blocks restrict the choice (a hand-made case)."""
    config = moe_config(num_experts=4, num_experts_per_tok=1, expert_capacity=1, block_size=2, n_group=1, topk_group=1)
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    indices, weights = reference_route(logits, None, config, [(0, 0), (0, 1), (0, 2)])
    assert indices == [[0], [0], [2]]  # token 1 prefers expert 1, but its block allows expert 0 only
    assert math.isclose(weights[1][0], torch.sigmoid(torch.tensor(0.0)).item() * config.routed_scaling_factor)
    gate = LLaDA2MoeGate(config)
    index, _ = gate.route(logits, RoutingBlocks(torch.tensor([0, 0, 1]), 2))
    assert index.tolist() == indices
