"""LLaDA2's fused MoE / attention kernels (`triton_moe.py`) on the CPU through Triton's interpreter
(`TRITON_INTERPRET=1`, switched on before Triton compiles anything, hence subprocesses: two, side by side), float32,
against the PyTorch code: the router (group-limited top-k with expert bias in float32 or bfloat16, sigmoid and
softmax, a group size that is not a power of two, ties; half-precision logits and weights), both alignments by
expert (against a stable argsort), the one-program softmax routing + alignment (with and without the router's
product) against the routing then the alignment, the combine (and with the next norm), and a tiny model's prefill
and cached block step with every kernel on (`HF_DLLM_KERNELS=triton`) against the PyTorch path; LLaDA-MoE's experts
on the same kernels (float16; few and many tokens; the next norm in the combine) against its PyTorch path, and its
cached prefill and block step on the fused attention path (float32) against the PyTorch path.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.conftest import ROOT, BackgroundJob

pytest.importorskip("triton", reason="the `triton` extra is not installed")

# The kernels alone and the tiny models, two scripts run side by side (each takes about half of the time).
PRELUDE = """
import torch, hf_dllm

torch.manual_seed(0)
base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
            mask_token_id=63, eos_token_id=62, pad_token_id=62, routed_scaling_factor=2.5)
"""

KERNELS_SCRIPT = PRELUDE + textwrap.dedent(
    """
    import itertools
    from hf_dllm import triton_moe
    from hf_dllm.llada2_moe_layer import LLaDA2MoeGate

    for experts, groups, top_groups, top_k, score, bias in [
        (16, 4, 2, 4, "sigmoid", True), (32, 8, 4, 8, "sigmoid", False), (12, 4, 2, 3, "softmax", True),
        (8, 1, 1, 2, "sigmoid", True), (6, 2, 1, 1, "sigmoid", True),
    ]:
        config = hf_dllm.LLaDA2MoeConfig(**base, num_experts=experts, n_group=groups, topk_group=top_groups,
            num_experts_per_tok=top_k, score_function=score, moe_router_enable_expert_bias=bias)
        gate = LLaDA2MoeGate(config)
        gate.weight.data.normal_()
        if bias:
            gate.expert_bias.normal_(0, 0.1)
        x = torch.randn(37, 32)
        ref_index, ref_weight, _ = gate(x)
        index, weight, _ = gate.fused_forward(x)
        assert torch.equal(index, ref_index), ("route index", experts, groups)
        assert torch.allclose(weight, ref_weight, rtol=1e-6, atol=1e-6), ("route weight", experts, groups)
        if bias:  # a bfloat16 bias (a bfloat16 model's buffer) is read in its dtype, widened as PyTorch promotes it
            gate.expert_bias = gate.expert_bias.bfloat16()
            ref_index, ref_weight, _ = gate(x)
            index, weight, _ = gate.fused_forward(x)
            assert torch.equal(index, ref_index) and torch.allclose(weight, ref_weight, rtol=1e-6, atol=1e-6), "bf16 bias"

    # Ties (every score equal): a valid top-k, lowest indices first, in the first groups.
    index, weight = triton_moe.route(torch.zeros(3, 16), None, 4, 2, 4, "sigmoid", True, 1.0)
    assert index.tolist() == [[0, 1, 2, 3]] * 3 and torch.equal(weight, torch.full((3, 4), 0.25)), index
    # Tied group scores: groups 1 and 3 tie for the best; the lower one wins, and group-limited choice holds.
    logits = torch.full((1, 8), -5.0)
    logits[0, [2, 3, 6, 7]] = 3.0
    index, _ = triton_moe.route(logits, None, 4, 1, 2, "sigmoid", True, 1.0)
    assert index.tolist() == [[2, 3]], index

    # Half-precision logits read as they are, weights stored in the dtype asked: `.float()` before and `.to()` after.
    logits = torch.randn(7, 12)
    index, weight = triton_moe.route(logits, None, 4, 2, 3, "softmax", False, 1.0)
    half_index, half_weight = triton_moe.route(logits.half(), None, 4, 2, 3, "softmax", False, 1.0, torch.float16)
    want_index, want_weight = triton_moe.route(logits.half().float(), None, 4, 2, 3, "softmax", False, 1.0)
    assert torch.equal(half_index, want_index) and torch.equal(half_weight, want_weight.half()), "route dtypes"

    # The router's product for few tokens (LLaDA-MoE's block steps) as partial products over chunks of the hidden
    # size that `route` adds up, rounds and routes from: on values whose products and sums are exact in any order (so
    # the logits are too), over token and expert counts that fill a tile, cross one or stop short, hidden sizes that
    # the chunks split evenly or not (chunks wholly past the end: zero partials).
    for tokens, experts, hidden, splits in ((32, 64, 256, 4), (5, 16, 200, 3), (17, 40, 96, 5)):
        x, gate = (torch.randint(-2, 3, shape).half() / 4 for shape in ((tokens, hidden), (experts, hidden)))
        partials = triton_moe.router_partials(x, gate, splits)
        assert partials.shape == (splits, tokens, experts) and partials.dtype == torch.float32, partials.shape
        logits = torch.empty(tokens, experts, dtype=torch.float16)
        routed = triton_moe.route(partials, None, 1, 1, 2, "softmax", False, 1.0, torch.float16, summed_logits=logits)
        want = triton_moe.route(x @ gate.T, None, 1, 1, 2, "softmax", False, 1.0, torch.float16)
        assert torch.equal(logits, x @ gate.T), ("router_partials", tokens, experts, hidden, splits)
        assert all(torch.equal(a, b) for a, b in zip(routed, want)), ("route of partials", tokens, experts, splits)
    # Random values: the partials within float32 rounding of the float64 product (each chunk's sum of at most 128
    # terms), `route` adds them in chunk order and rounds the sum once, to the logits' dtype.
    x, gate = torch.randn(32, 512).half(), (torch.randn(64, 512) * 0.05).half()
    partials = triton_moe.router_partials(x, gate, 4)
    exact = x.double() @ gate.double().T
    bound = 132 * 2**-24 * (x.double().abs() @ gate.double().abs().T)
    assert ((partials.double().sum(0) - exact).abs() <= bound).all(), "router_partials rounding"
    summed = partials[0].clone()
    for part in partials[1:]:
        summed += part
    logits = torch.empty(32, 64, dtype=torch.float16)  # (the interpreter's casts to bfloat16 truncate)
    triton_moe.route(partials, None, 1, 1, 1, "softmax", False, 1.0, torch.float16, summed_logits=logits)
    assert torch.equal(logits, summed.half()), "route's sum of the partials"
    for bad_x, bad_gate, splits in (
        (x.float(), gate.float(), None), (x, gate[:, :100], None), (torch.zeros(80, 512).half(), gate, None),
        (x, gate, 0), (x, gate, True), (x, gate, 513),
    ):
        try:
            triton_moe.router_partials(bad_x, bad_gate, splits)
        except ValueError as error:
            assert "router_partials" in str(error), error
        else:
            raise AssertionError(f"bad router_partials input accepted: {splits}")
    for bad_logits, bad_sum in ((partials[0], logits), (partials.half(), logits), (partials, logits[:5]), (partials, None)):
        try:
            triton_moe.route(bad_logits, None, 1, 1, 8, "softmax", False, 1.0, summed_logits=bad_sum)
        except ValueError as error:
            assert "logits" in str(error), error
        else:
            raise AssertionError("bad route partials accepted")

    # The norm's float32 copy of its output (the fused path feeds it to the router): the output widened, exactly.
    from hf_dllm import triton_ops
    x, r, w = torch.randn(5, 40).bfloat16(), torch.randn(5, 40).bfloat16(), torch.rand(40).bfloat16()
    normed, total, wide = triton_ops.rms_norm(x, w, 1e-6, residual=r, float_copy=True)
    assert [torch.equal(a, b) for a, b in zip((normed, total), triton_ops.rms_norm(x, w, 1e-6, residual=r))] == [True] * 2
    assert wide.dtype == torch.float32 and torch.equal(wide, normed.float()), "rms_norm float_copy"

    # LLaDA2.2's edit candidates (argmax over all tokens, without MASK, without MASK / DELETE / SPLIT, and their
    # softmax probabilities) in one read of the logits, against the policy's PyTorch passes: one program per row and
    # the vocabulary split over programs (a tie across splits), first index on ties, float32 and float16 logits.
    from hf_dllm.levenshtein_editing import LevenshteinEditing
    from hf_dllm import kernels
    policy = LevenshteinEditing(0.7, 0.5, 4, mask_token_id=7, delete_token_id=8, split_token_id=9)
    logits = torch.randn(3, 4, 9000)
    logits[0, 0, 7] = logits[0, 1, 7] = 50.0  # MASK is the argmax, then DELETE in the second row
    logits[0, 1, 8] = 49.0
    logits[1, 0, [100, 200]] = 60.0  # a tie: the first
    logits[1, 1] = 0.0  # every token tied
    logits[2, 0, [4095, 8500]] = 70.0  # a tie across chunks and splits
    for dtype, splits in itertools.product((torch.float32, torch.float16), (1, 3)):
        kernels.set_kernel_mode("torch")
        want_tokens, want_probability = policy.candidates(logits.to(dtype))
        tokens, probability = triton_ops.edit_candidates(logits.to(dtype), 7, 8, 9, n_splits=splits)
        assert torch.equal(tokens, want_tokens), ("edit candidates", dtype, splits)
        assert torch.allclose(probability, want_probability, rtol=1e-5, atol=1e-7), ("edit probabilities", dtype)
    kernels.set_kernel_mode("triton")
    assert torch.equal(policy.candidates(logits)[0], want_tokens), "edit candidates on the fused path"
    kernels.set_kernel_mode("auto")

    # The alignment by expert, both implementations (one program per expert; the chunked counting sort, here over
    # one partial chunk and over several chunks of 128 pairs), against a stable argsort.
    for (tokens, experts), shared, align in itertools.product(
        [(9, 16), (70, 16), (300, 40)], (False, True),
        (triton_moe.align_by_expert, triton_moe._align_per_expert, triton_moe._align_by_chunks),
    ):
        topk = torch.randint(0, experts, (tokens, 4))
        sorted_token, offsets, rows = align(topk, experts, shared)
        per_token = 4 + shared
        flat = torch.cat([topk, torch.full((tokens, 1), experts)], 1).reshape(-1) if shared else topk.reshape(-1)
        order = flat.argsort(stable=True)
        assert torch.equal(sorted_token, order // per_token), ("align order", tokens, align)
        counts = torch.bincount(flat, minlength=experts + shared)
        assert torch.equal(offsets.long(), counts.cumsum(0)), ("align offsets", tokens, align)
        assert torch.equal(rows, order.argsort().view(tokens, per_token)), ("align rows", tokens, align)

    for shared in (False, True):
        topk = torch.randint(0, 16, (9, 4))
        sorted_token, offsets, rows = triton_moe.align_by_expert(topk, 16, shared)
        per_token = 4 + shared
        expert_rows, weight, residual = torch.randn(9 * per_token, 24), torch.rand(9, 4), torch.randn(9, 24)
        out = triton_moe.combine(expert_rows, rows, weight, shared, residual)
        ref = (expert_rows[rows[:, :4]] * weight[..., None]).sum(1)
        ref = residual + (ref + expert_rows[rows[:, 4]] if shared else ref)
        assert torch.allclose(out, ref, atol=1e-6), "combine"
        # Half-precision weights (LLaDA-MoE's, rounded to the activations' dtype) are widened in the kernel.
        half_rows, half_weight, half_residual = expert_rows.half(), weight.half(), residual.half()
        widened = triton_moe.combine(half_rows, rows, half_weight.float(), shared, half_residual)
        assert torch.equal(triton_moe.combine(half_rows, rows, half_weight, shared, half_residual), widened), "combine"

    # The combine plus the next norm of its output, one program per token (LLaDA-MoE): both as the two kernels.
    for dtype in (torch.float32, torch.float16):
        topk = torch.randint(0, 16, (9, 4))
        _, _, rows = triton_moe.align_by_expert(topk, 16, False)
        expert_rows, weight, residual = (torch.randn(shape).to(dtype) for shape in ((36, 40), (9, 4), (9, 40)))
        norm_weight = (torch.rand(40) + 0.5).to(dtype)
        total, normed = triton_moe.combine_and_norm(expert_rows, rows, weight, residual, norm_weight, 1e-6)
        want = triton_moe.combine(expert_rows, rows, weight, False, residual)
        assert torch.equal(total, want) and torch.equal(normed, triton_ops.rms_norm(want, norm_weight, 1e-6)[0]), dtype

    # The q/k norm + RoPE + cache write on some of the projection's heads (a tensor-parallel rank's: query heads
    # [2, 4) and key/value head 1 of 4 and 2) equals the kernel on a projection holding only those heads; bad head
    # ranges are refused.
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 16)
    q_weight, k_weight, cos, sin = torch.rand(16) + 0.5, torch.rand(16) + 0.5, torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    position = torch.tensor([5, 6, 7])
    caches = [(torch.zeros(2, 1, 9, 16), torch.zeros(2, 1, 9, 16)) for _ in range(2)]
    heads = qkv.view(2, 3, 8, 16)
    own = torch.cat([heads[:, :, 2:4], heads[:, :, 5:6], heads[:, :, 7:8]], dim=2).reshape(2, 3, -1)
    query = triton_moe.qk_norm_rope_to_cache(qkv, 2, 1, q_weight, k_weight, 1e-6, cos, sin, *caches[0], position,
                                             projection_heads=(4, 2), first_heads=(2, 1))  # fmt: skip
    expected = triton_moe.qk_norm_rope_to_cache(own, 2, 1, q_weight, k_weight, 1e-6, cos, sin, *caches[1], position)
    assert torch.equal(query, expected) and all(map(torch.equal, caches[0], caches[1])), "qk_norm_rope heads"
    assert caches[0][0][:, :, 5:8].abs().sum() > 0 and caches[0][1][:, :, :5].abs().sum() == 0, "cache columns"
    for bad in ((3, 1), (2, 2), (-1, 0)):
        try:
            triton_moe.qk_norm_rope_to_cache(qkv, 2, 1, q_weight, k_weight, 1e-6, cos, sin, *caches[0], position,
                                             projection_heads=(4, 2), first_heads=bad)  # fmt: skip
        except ValueError as error:
            assert "first_heads" in str(error), error
        else:
            raise AssertionError(("bad first_heads accepted", bad))

    # The split-KV attention with a mask per query row (LLaDA2's block-causal mask), against masked softmax.
    from hf_dllm.triton_attention import AttentionTiles, block_attention
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    columns, rows = torch.arange(40), torch.arange(8, 16)
    mask = (columns[None, :] // 4 <= rows[:, None] // 4).expand(2, 8, 40).clone()
    mask[1, :, :3] = False  # left padding of row 1
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4.0

    def masked_attention(mask):
        ref = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
        return ref.transpose(1, 2)

    # Key tiles of 16, `kv_end` 16 for row 0 and 20 for row 1 (inside a tile; with 3 splits, inside the second):
    # the key tiles wholly past it hold NaN, which a kernel reading them would spread to the output (0 * NaN).
    kv_end = torch.tensor([16, 20], dtype=torch.int32)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for row, first_skipped in ((0, 16), (1, 32)):
        poisoned_k[row, :, first_skipped:] = poisoned_v[row, :, first_skipped:] = float("nan")
    small_tiles = AttentionTiles(block_m=16, block_n=16)
    for splits in (None, 1, 3):
        out = block_attention(q, k, v, mask, n_splits=splits)
        assert torch.allclose(out, masked_attention(mask), atol=1e-5), ("per-query mask", splits)
        out = block_attention(q, poisoned_k, poisoned_v, mask, n_splits=splits, kv_end=kv_end, tiles=small_tiles)
        assert torch.allclose(out, masked_attention(mask), atol=1e-5), ("kv_end", splits)
    for bad in (kv_end.long(), kv_end[:1]):
        try:
            block_attention(q, k, v, mask, kv_end=bad)
        except ValueError as error:
            assert "kv_end" in str(error), error
        else:
            raise AssertionError(("bad kv_end accepted", bad.dtype, bad.shape))

    print("ok")
    """
)

MODELS_SCRIPT = PRELUDE + textwrap.dedent(
    """
    from hf_dllm import kernels, triton_moe
    from hf_dllm.cache import DiffusionKVCache

    # A tiny model: prefill of three blocks, then a cached block step, every kernel against the PyTorch path.
    def prefill_and_step(model):
        # Per kernel mode: the prefill's logits, the step's logits, the last layer's cache, the router logits.
        ids, block = torch.randint(0, 60, (2, 12)), torch.randint(0, 60, (2, 4))
        results = {}
        for mode in ("torch", "triton"):
            kernels.set_kernel_mode(mode)
            cache = DiffusionKVCache(2, 2, 16)
            with torch.no_grad():
                prefill = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(12),
                                block_length=4).logits
                step = model(block, past_key_values=cache, use_cache=True, cache_position=torch.arange(12, 16),
                             block_length=4, output_router_logits=True)
            results[mode] = (prefill, step.logits, cache.keys[1], cache.values[1], step.router_logits[0])
        return results

    for shared_experts in (1, 2):
        config = hf_dllm.LLaDA2MoeConfig(**dict(base, head_dim=16), intermediate_size=48, num_hidden_layers=2,
            num_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3, moe_intermediate_size=8,
            num_shared_experts=shared_experts, first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True,
            moe_router_enable_expert_bias=True)
        model = hf_dllm.LLaDA2MoeModelLM(config).eval()
        assert model.config._attn_implementation == "llada_triton"  # the default: split-KV kernel where it runs
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.data.normal_(1, 0.2)
        model.model.layers[1].mlp.gate.expert_bias.normal_(0, 0.1)
        results = prefill_and_step(model)
        for name, ref, ours in zip(("prefill", "step", "keys", "values", "router"), results["torch"], results["triton"]):
            assert (ref - ours).abs().max() < 1e-5, (name, shared_experts, (ref - ours).abs().max())

    # The sdpa backend's grouped-query path, with sdpa returning a non-contiguous layout as CUDA's float32
    # memory-efficient kernel does (the path once failed there on a `view`).
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = (
        lambda *args, **kwargs: sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2))
    model = hf_dllm.LLaDA2MoeModelLM._from_config(config, attn_implementation="sdpa").eval()
    results = prefill_and_step(model)
    for name, ref, ours in zip(("prefill", "step", "keys", "values", "router"), results["torch"], results["triton"]):
        assert (ref - ours).abs().max() < 1e-5, ("sdpa", name, (ref - ours).abs().max())
    torch.nn.functional.scaled_dot_product_attention = sdpa

    # LLaDA-MoE's experts on the same kernels (route, alignment, grouped products, combine; float16: its fused path
    # is for half precision, and the interpreter has no exact bfloat16) against its PyTorch path and float32.
    moe_config = hf_dllm.LLaDAMoEConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, num_experts=8,
        num_experts_per_tok=2, expert_intermediate_size=32, dense_intermediate_size=64, vocab_size=64,
        moe_layer_freq=[0, 1], pad_token_id=62, eos_token_id=62)
    reference = hf_dllm.LLaDAMoEModelLM._from_config(moe_config).eval()
    half = hf_dllm.LLaDAMoEModelLM._from_config(moe_config, dtype=torch.float16).eval()
    half.load_state_dict({name: tensor.half() for name, tensor in reference.state_dict().items()})
    ids, x, moe = torch.randint(0, 60, (2, 12)), torch.randn(40, 64, dtype=torch.float16), half.model.layers[1].mlp
    with torch.no_grad():
        want = reference(ids).logits
        kernels.set_kernel_mode("torch")
        assert not moe.uses_fused_kernels(x)
        plain, plain_moe = half(ids).logits.float(), moe(x)[0].float()
        kernels.set_kernel_mode("triton")
        assert moe.uses_fused_kernels(x) and half._diffusion_step_capturable()
        fused, fused_moe = half(ids).logits.float(), moe(x)[0].float()
    assert (fused_moe - plain_moe).abs().max() < 2e-3, (fused_moe - plain_moe).abs().max()
    assert (fused - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-3, "llada-moe"
    # The routing's fused forms: few tokens with `router_partials` (above) or PyTorch's product, many tokens with
    # PyTorch's; then `route` and `align_by_expert`: the same as the PyTorch path.
    many = torch.randn(300, 64, dtype=torch.float16)
    assert triton_moe.router_product_applies(40) and not triton_moe.router_product_applies(300)
    for tokens, product_in_kernel in ((x, False), (many, True)):
        type(moe).router_product_in_routing_kernel = product_in_kernel
        with torch.no_grad():
            kernels.set_kernel_mode("torch")
            plain_moe, plain_logits = moe(tokens)
            kernels.set_kernel_mode("triton")
            fused_moe, fused_logits = moe(tokens)
        assert torch.equal(fused_logits, plain_logits), ("router logits", len(tokens))
        assert (fused_moe.float() - plain_moe.float()).abs().max() < 2e-3, ("llada-moe routing", len(tokens))
    type(moe).router_product_in_routing_kernel = True
    # The MoE layer's combine kernel computing the final norm (the last layer's next norm): the logits unchanged,
    # the block's forward hooks called (the norm's weight is an argument of its forward).
    calls = []
    moe.register_forward_hook(lambda module, args, output: calls.append(len(output)))
    with torch.no_grad():
        type(moe).norm_in_combine = False
        apart = half(ids).logits
        type(moe).norm_in_combine = True
        assert torch.equal(half(ids).logits, apart), "llada-moe norm in combine"
        assert moe(x, residual=x, next_norm_weight=half.model.norm.weight)[2] is not None
    assert calls == [3, 3, 3], calls

    # LLaDA-MoE's cached forwards on the fused path (one q/k/v product, q/k norms + partial RoPE + cache write in one
    # kernel, the norms' residual adds fused), float32: a prefill, then a block step, against the PyTorch path.
    moe_config = hf_dllm.LLaDAMoEConfig(**{**moe_config.to_dict(), "qk_layernorm": True, "partial_rotary_factor": 0.5})
    model = hf_dllm.LLaDAMoEModelLM._from_config(moe_config, dtype=torch.float32).eval()
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.normal_(1, 0.2)
    ids, block, results = torch.randint(0, 60, (2, 12)), torch.randint(0, 60, (2, 4)), {}
    for mode in ("torch", "triton"):
        kernels.set_kernel_mode(mode)
        cache = DiffusionKVCache(2, 2, 16)
        with torch.no_grad():
            prefill = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(12)).logits
            step = model(block, past_key_values=cache, use_cache=True, cache_position=torch.arange(12, 16)).logits
        fused_path = model.model.layers[1].self_attn.uses_fused_path(prefill, cache, torch.arange(4))
        results[mode] = (prefill, step, cache.keys[1], cache.values[1], fused_path)
    assert results["triton"][-1] and not results["torch"][-1], "llada-moe fused attention path"
    for name, ref, ours in zip(("prefill", "step", "keys", "values"), results["torch"], results["triton"]):
        assert (ref - ours).abs().max() < 1e-5, ("llada-moe cached", name, (ref - ours).abs().max())
    print("ok")
    """
)


INTERPRETER_RUN = BackgroundJob(
    lambda _workdir: {
        name: [sys.executable, "-c", script]
        for name, script in (("kernels", KERNELS_SCRIPT), ("models", MODELS_SCRIPT))
    },
    timeout=600,
    cwd=ROOT,
    env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
)


@INTERPRETER_RUN.used_by
def test_llada2_kernels_in_the_interpreter():
    for name, done in INTERPRETER_RUN.results().items():
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (name, done.stderr[-4000:])


def test_grouped_autotuning_keeps_a_config_that_fits_the_shared_memory(monkeypatch):
    """Many rows per expert allow only 64- and 128-row tiles, none of which fits an H100's shared memory in float32
    (gated: a row tile and two weight tiles per stage): float32 (multiplied on the CUDA cores, for exactness) gets
    the config of the smallest footprint alone, so the autotuner never launches a config that cannot run and times
    one; bfloat16 keeps the allowed tiles alone."""
    import torch

    from hf_dllm import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "_shared_memory_bytes", lambda device: 232448)  # an H100's opt-in maximum

    configs = grouped_gemm.grouped_configs()
    for dtype, fallback in ((torch.float32, True), (torch.bfloat16, False)):
        named = dict(ROWS_BUCKET=4096, n_groups=9, N=1024, K=2048)
        named.update(x_ptr=torch.empty(1, dtype=dtype), w_ptr=torch.empty(1, dtype=dtype))
        kept = grouped_gemm._prune_grouped(configs, named, BLOCK_K=128, GATED=True, HAS_SCALE=False)
        small = [c for c in kept if c.kwargs["BLOCK_M"] not in (64, 128)]
        assert bool(small) == fallback
        if fallback:
            (extra,) = kept
            assert grouped_gemm.footprint_bytes(extra, 4, 4, 128, True) <= 232448


@pytest.mark.parametrize(
    "gated, n, k, groups, pairs, weight_dtype, pinned",
    [
        # LLaDA-MoE-7B's batch-1 block step, bf16: the H200 sweep's best configs alone.
        (True, 1024, 2048, 64, 256, "bfloat16", dict(BLOCK_M=32, BLOCK_N=64, SWAP=True, N_FASTEST=True, K_DIVISOR=2)),
        (False, 2048, 1024, 64, 200, "bfloat16", dict(BLOCK_M=32, BLOCK_N=64, SWAP=True, N_FASTEST=True, K_DIVISOR=2)),
        # DiffusionGemma-26B-A4B's batch-1 canvas: its down product.
        (False, 2816, 704, 128, 2048, "bfloat16", dict(BLOCK_M=32, BLOCK_N=64, SWAP=True, N_FASTEST=True, K_DIVISOR=2)),
        # Not covered by those sweeps: batch 2 (512 pairs), FP8 weights, LLaDA2.0-mini's 257 groups, float16, the
        # canvas' gate/up (the autotuner's pick was the sweep's best), a batch-8 canvas.
        (True, 1024, 2048, 64, 512, "bfloat16", None),
        (False, 2048, 1024, 64, 256, "float8_e4m3fn", None),
        (True, 512, 2048, 257, 256, "bfloat16", None),
        (True, 1024, 2048, 64, 256, "float16", None),
        (True, 704, 2816, 128, 2048, "bfloat16", None),
        (False, 2816, 704, 128, 16384, "bfloat16", None),
    ],
)
def test_grouped_products_take_the_pinned_config_only_where_swept(
    monkeypatch, gated, n, k, groups, pairs, weight_dtype, pinned
):
    """`grouped_gemm.PINNED_CONFIGS`: a product of the swept shape, dtype and rows bucket gets the swept best config
    alone (a 4-warp, 4-stage config stepping 64 columns: outside `grouped_configs()`, in the autotuner's list only
    as a pin); any other keeps the autotuner's pruned candidates, none of them a config that is there only as a
    pin."""
    import torch

    from hf_dllm import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "_shared_memory_bytes", lambda device: 232448)  # an H100's / H200's maximum
    x = torch.empty(1, dtype=torch.float16 if weight_dtype == "float16" else torch.bfloat16)
    w = torch.empty(1, dtype=getattr(torch, weight_dtype))
    named = dict(ROWS_BUCKET=grouped_gemm.rows_bucket(pairs), n_groups=groups, N=n, K=k, x_ptr=x, w_ptr=w)
    fp8 = weight_dtype.startswith("float8")
    configs = grouped_gemm.autotuned_configs()
    listed = [(c.kwargs, c.num_warps, c.num_stages) for c in grouped_gemm.grouped_configs()]
    kept = grouped_gemm._prune_grouped(configs, named, BLOCK_K=128, GATED=gated, HAS_SCALE=fp8)
    found = grouped_gemm.pinned_config(gated, n, k, groups, named["ROWS_BUCKET"], w.dtype)
    if pinned is None:
        assert len(kept) > 1 and found is None
        assert all((c.kwargs, c.num_warps, c.num_stages) in listed for c in kept)
    else:
        assert [(c.kwargs, c.num_warps, c.num_stages) for c in kept] == [(pinned, 4, 4)] and kept == [found]
        assert (pinned, 4, 4) not in listed and found in configs


def test_rows_bucket_gives_few_autotuning_keys_that_bound_the_rows():
    """The grouped kernels' autotuning key (`grouped_gemm.rows_bucket`): never below the rows (the prune's grid
    check counts tiles from it), a power of two each, and from 2**16 rows on only powers of 16, so a serving
    engine's packed prefills of any size meet few new keys (each one times every config)."""
    import torch

    from hf_dllm import grouped_gemm

    buckets = {pairs: grouped_gemm.rows_bucket(pairs) for pairs in range(1, 1 << 21, 997)}
    assert all(pairs <= bucket < 16 * pairs + 16 for pairs, bucket in buckets.items())
    assert all(bucket & (bucket - 1) == 0 for bucket in buckets.values())
    large = {bucket for pairs, bucket in buckets.items() if pairs > grouped_gemm.FINE_ROWS_BUCKETS}
    assert large == {1 << 20, 1 << 24}
    assert grouped_gemm.rows_bucket(grouped_gemm.FINE_ROWS_BUCKETS) == grouped_gemm.FINE_ROWS_BUCKETS
    # Above the fine buckets the pruned configs are the same for every key (64- and 128-row tiles).
    named = dict(x_ptr=torch.empty(1, dtype=torch.bfloat16), w_ptr=torch.empty(1, dtype=torch.bfloat16), n_groups=256)
    named.update(N=1024, K=2048)
    configs = grouped_gemm.grouped_configs()
    prune = grouped_gemm._prune_grouped
    kept = [
        {str(c) for c in prune(configs, dict(named, ROWS_BUCKET=key), BLOCK_K=128, GATED=True, HAS_SCALE=False)}
        for key in (1 << 17, 1 << 20, 1 << 24)
    ]
    assert kept[0] == kept[1] and kept[2] <= kept[1]


def test_attention_tiles_and_key_splits_follow_the_measured_rules():
    """The split-KV attention's tiles and key splits (`triton_attention.default_tiles`, `plan_splits`) as measured
    on an H100 (132 SMs): grouped queries (LLaDA2.0-mini's 4 x 32 rows in 64-row tiles) keep their keys split below
    half a program per SM (batch 8: 5 splits) and unsplit from there (batch 16); one head per group (LLaDA-8B,
    which runs the kernel up to batch 4) always as planned."""
    from hf_dllm.triton_attention import GROUPED_QUERY_TILES, default_tiles, plan_splits

    one_head = default_tiles(32)
    assert one_head.block_m == 32 and default_tiles(16).block_m == 16
    assert default_tiles(64) is GROUPED_QUERY_TILES and default_tiles(128) is GROUPED_QUERY_TILES

    def splits(batch, kv_heads, tiles, rows):
        m_tiles = -(-rows // tiles.block_m)
        return plan_splits(batch, kv_heads, m_tiles, 768, tiles.block_n, 132, tiles.one_split_from)

    assert [splits(b, 32, one_head, 32) for b in (1, 4)] == [6, 3]
    assert [splits(b, 4, GROUPED_QUERY_TILES, 128) for b in (1, 8, 16, 32)] == [12, 5, 1, 1]
