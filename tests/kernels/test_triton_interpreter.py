"""The Triton kernels on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`), against the PyTorch code, in
LLaDA and Dream.

The interpreter must be switched on before Triton compiles anything, so the checks run in subprocesses (two, side by
side: the kernels, and the models). float32 and float16 only: the interpreter has no exact bfloat16 (bfloat16 is
covered by the GPU tests).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import interpreter_job

pytest.importorskip("triton", reason="the `triton` extra is not installed")

# Two scripts, run side by side (each takes about half of the time): the kernels (and one of Dream's recorded cases),
# and the models.
KERNELS_SCRIPT = textwrap.dedent(
    """
    import math, torch, hf_dllm
    from hf_dllm import triton_ops
    from hf_dllm.modeling_llada import LLaDARMSNorm, apply_rotary_pos_emb, rotary_cos_sin
    from hf_dllm.triton_attention import block_attention

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x, r = torch.randn(3, 5, 64, dtype=dtype), torch.randn(3, 5, 64, dtype=dtype)
        norm = LLaDARMSNorm(64, 1e-5).to(dtype)
        norm.weight.data.normal_(1, 0.1)
        hf_dllm.kernels.set_kernel_mode("torch")
        ref_normed, ref_total = norm.add_and_norm(x, r)
        hf_dllm.kernels.set_kernel_mode("triton")
        normed, total = norm.add_and_norm(x, r)
        assert torch.equal(total, ref_total)
        assert (normed.float() - ref_normed.float()).abs().max() <= tol * 4, "rms_norm"

        q, k = torch.randn(2, 7, 4, 16, dtype=dtype), torch.randn(2, 7, 2, 16, dtype=dtype)
        cos, sin = rotary_cos_sin(torch.arange(7).expand(2, -1) + torch.tensor([[0], [5]]), 16, 10000.0)
        q_out, k_out = triton_ops.rotary(q, k, cos, sin)
        q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        assert (q_out.transpose(1, 2).float() - q_ref.float()).abs().max() <= tol, "rotary q"
        assert (k_out.transpose(1, 2).float() - k_ref.float()).abs().max() <= tol, "rotary k"

        # RoPE writing K/V into the cache: the same values as `rotary`, per-row or shared cos/sin tables, more
        # heads than a program's chunk (a head per program below 512 tokens, 16 from 512), K/V at scattered columns.
        short = torch.tensor([9, 0, 3, 4, 5, 11, 2])
        runs = [(short, torch.arange(7).expand(1, -1)), (short, torch.arange(7).expand(2, -1) + torch.tensor([[0], [5]]))]
        if dtype == torch.float32:  # 512 tokens: the many-token chunking (interpreted programs are slow: once)
            runs.append((torch.randperm(260)[:256], torch.arange(256).expand(2, -1) + torch.tensor([[0], [3]])))
        for columns, positions in runs:
            length = len(columns)
            q, k, v = (torch.randn(2, length, h, 16, dtype=dtype) for h in (20, 4, 4))
            width = int(columns.max()) + 1
            cos, sin = rotary_cos_sin(positions, 16, 10000.0)
            cache_k, cache_v = torch.zeros(2, 4, width, 16, dtype=dtype), torch.zeros(2, 4, width, 16, dtype=dtype)
            q_out = triton_ops.rotary_to_cache(q, k, v, cos, sin, cache_k, cache_v, columns)
            # `rotary`'s values, which in the interpreter are PyTorch's RoPE bit for bit (numpy rounds each product and
            # sum as PyTorch does; checked on the short runs): PyTorch's is the 512-token run's reference, where
            # `rotary` would take 12,288 interpreted programs (one per head and token).
            q_ref, k_ref = (t.transpose(1, 2) for t in apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin))
            if length < 256:
                assert all(map(torch.equal, triton_ops.rotary(q, k, cos, sin), (q_ref, k_ref))), "rotary, bit for bit"
            assert torch.equal(q_out, q_ref), "rotary_to_cache q"
            assert torch.equal(cache_k[:, :, columns], k_ref.transpose(1, 2)), "rotary_to_cache keys"
            assert torch.equal(cache_v[:, :, columns], v.transpose(1, 2)), "rotary_to_cache values"
            untouched = torch.ones(width, dtype=torch.bool)
            untouched[columns] = False
            assert not cache_k[:, :, untouched].any() and not cache_v[:, :, untouched].any(), "rotary_to_cache columns"

        g, u = torch.randn(3, 100, dtype=dtype), torch.randn(3, 100, dtype=dtype)
        ref = torch.nn.functional.silu(g) * u
        assert (triton_ops.silu_mul(g, u).float() - ref.float()).abs().max() <= tol * 4, "silu_mul"
        # GELU's tanh approximation (DiffusionGemma's dense MLP) on the two halves of one projection (strided rows).
        gate_up = torch.randn(3, 200, dtype=dtype) * 3
        g, u = gate_up.chunk(2, dim=-1)
        ref = torch.nn.functional.gelu(g, approximate="tanh") * u
        assert (triton_ops.gated_mul(g, u, "gelu_tanh").float() - ref.float()).abs().max() <= tol * 4, "gelu_tanh"

        for batch, heads, kv_heads, q_len, kv_len, dim, splits in [(2, 4, 2, 5, 37, 16, None), (1, 4, 4, 8, 200, 32, 3)]:
            q = torch.randn(batch, heads, q_len, dim, dtype=dtype)
            k = torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype)
            v = torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype)
            padding = torch.ones(batch, kv_len, dtype=torch.bool)
            padding[0, :11] = False
            out = block_attention(q, k, v, padding, n_splits=splits)
            rep = heads // kv_heads
            scores = q.double() @ k.double().repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(dim)
            scores = scores.masked_fill(~padding[:, None, None, :], float("-inf"))
            ref = (scores.softmax(-1) @ v.double().repeat_interleave(rep, 1)).transpose(1, 2)
            assert (out.double() - ref).abs().max() <= tol * 2, ("attention", dtype, splits)

    # Dream: RoPE rounded as Dream's PyTorch code rounds it (equal), also written into a cache past a read-only column.
    from hf_dllm import DreamConfig
    from hf_dllm.modeling_dream import apply_rotary_pos_emb as dream_rope, dream_rotary_cos_sin
    for dtype in (torch.float32, torch.float16):
        qkv = torch.randn(2, 7, 8 * 16, dtype=dtype)
        q, k, v = (t.unflatten(-1, (-1, 16)) for t in qkv.split([64, 32, 32], dim=-1))
        config = DreamConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        cos, sin = dream_rotary_cos_sin(torch.arange(7).expand(2, -1) + torch.tensor([[0], [5]]), config, dtype)
        q_ref, k_ref = dream_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        q_out, k_out = triton_ops.rounded_rotary(q, k, v, cos, sin)
        assert torch.equal(q_out.transpose(1, 2), q_ref) and torch.equal(k_out, k_ref), "Dream rotary"
        cache_k, cache_v = torch.zeros(3, 2, 20, 16, dtype=dtype), torch.zeros(3, 2, 20, 16, dtype=dtype)
        columns = torch.tensor([2, 9, 10, 11, 12, 13, 14])
        triton_ops.rounded_rotary(q, k, v, cos, sin, cache_k[:2], cache_v[:2], columns, skip=1)
        expected_k, expected_v = torch.zeros_like(cache_k), torch.zeros_like(cache_v)
        expected_k[:2, :, columns[1:]] = k_ref[:, :, 1:]
        expected_v[:2, :, columns[1:]] = v.transpose(1, 2)[:, :, 1:]
        assert torch.equal(cache_k, expected_k) and torch.equal(cache_v, expected_v), "Dream rotary into the cache"

    # The greedy proposal against PyTorch: the same token (first index on ties, the excluded id never chosen) and the
    # probability within float32 rounding, over several chunks of the vocabulary and a partial last one, including
    # a row whose first chunk is all -inf (its online softmax once gave nan there).
    # The vocabulary in one program per row and split among 2 or 3 programs (merged by a second kernel): ties
    # across two splits go to the first index, a split whose columns are all -inf merges as nothing.
    for dtype, n_splits in ((torch.float32, 1), (torch.float16, 1), (torch.float32, 2), (torch.float16, None)):
        logits = (torch.randn(6, 9000) * 6).to(dtype)
        logits[0, 5] = logits[0].max() + 1  # the excluded id is the best: the runner-up must be chosen
        logits[1, :] = 0.5  # all tied: the first index
        logits[2, :4500] = float("-inf")
        logits[3, 8500] = logits[3].max() + 2  # the best in the last chunk
        logits[4, 4096] = logits[4, 100] = logits[4].max() + 1  # tied in two chunks: the first
        logits[5, :8192] = float("-inf")  # only the last chunk holds finite logits
        tokens, probability = triton_ops.greedy_propose(logits, 5, n_splits=n_splits)
        candidates = logits.float().clone()
        candidates[:, 5] = float("-inf")
        assert torch.equal(tokens, candidates.argmax(-1)), f"greedy token, {n_splits} splits"
        exact = torch.softmax(logits.double(), -1).gather(-1, tokens[:, None])[:, 0]
        assert (probability.double() - exact).abs().max() < 1e-6, f"greedy probability, {n_splits} splits"
    assert triton_ops.greedy_propose_splits(6, 9000) == 3 and triton_ops.greedy_propose_splits(2048, 9000) == 1

    # A mask-based step's decision in one launch (`triton_ops.commit_most_confident`, the policies' `fused_count`)
    # against PyTorch's (scatter, stable sort, ranks, count, commit, freeze, draft): the same block, draft and edit
    # flags for the fixed schedule, Fast-dLLM's threshold and LLaDA2.0's rule (with and without a threshold), logits
    # at every position or at candidate positions, tied confidences (a row of equal logits), a deferred token, a
    # frozen row, a zero count; NaN confidences ranked first, as the stable descending sort ranks them.
    from hf_dllm import decoding
    from hf_dllm.decoding import BlockProposal, ConfidenceFactor, ConfidenceThreshold, FixedSchedule
    from hf_dllm.decoding import ScheduledThreshold, StepRules, TokenEditing, denoise_step
    fused_calls = []
    launcher = triton_ops.commit_most_confident
    triton_ops.commit_most_confident = lambda *a, **k: fused_calls.append(1) or launcher(*a, **k)
    MASK, rows, L = 9, 4, 8
    for policy in (FixedSchedule(), ConfidenceThreshold(0.3), ScheduledThreshold(0.3), ScheduledThreshold(None)):
        policy.start_block(L, 4)
        for with_candidates in (False, True):
            block = torch.randint(0, 8, (rows, L))
            block[torch.rand(rows, L) < 0.6] = MASK
            block[0, :6] = MASK
            block[:, 6:] = torch.where(block[:, 6:] == MASK, 1, block[:, 6:])  # at most 6 masks: the candidates
            logits = torch.randn(rows, L, 12) * 2
            logits[1] = logits[1, :1]  # tied confidences
            candidates = torch.argsort((block != MASK).long(), dim=1, stable=True)[:, :6] if with_candidates else None
            logits = logits[:, :6] if with_candidates else logits
            step = dict(scheduled=torch.tensor([2, 1, 3, 0]), active=torch.tensor([True, True, False, True]))
            rules = StepRules(policy=policy, mask_token_id=MASK, deferred_token_ids=torch.tensor([4]))
            decided = []
            for mode in ("torch", "triton"):
                hf_dllm.kernels.set_kernel_mode(mode)
                decided.append(denoise_step(block, logits, rules, **step, candidates=candidates))
            assert all(torch.equal(a, b) for a, b in zip(*decided)), ("fused commit", type(policy).__name__)
    assert len(fused_calls) == 8, len(fused_calls)
    long_block = torch.full((1, triton_ops.COMMIT_MAX_POSITIONS + 1), MASK)  # longer blocks: PyTorch's sort
    denoise_step(long_block, torch.randn(1, long_block.shape[1], 12), rules, torch.tensor([1]))
    assert len(fused_calls) == 8 and not triton_ops.commit_applies(long_block.shape[1]), "long block"
    assert ConfidenceFactor(1.0).fused_commit_rule() is None and TokenEditing(0.9, 0.9, 1, 0).fused_commit_rule() is None
    block = torch.full((1, 6), MASK)
    probability = torch.tensor([[0.5, float("nan"), 0.7, float("nan"), 0.1, 0.7]])
    x0 = torch.arange(6)[None]
    proposal = BlockProposal(block, block == MASK, block == MASK, x0, probability, probability)
    for count in range(1, 6):
        want, _ = FixedSchedule().commit(proposal, torch.tensor([count]))
        got, draft, edited = launcher(block, x0, probability, None, torch.tensor([count]), None, MASK, 0)
        assert torch.equal(got, want) and not edited.any(), ("NaN ranks", count, got, want)
    triton_ops.commit_most_confident = launcher
    hf_dllm.kernels.set_kernel_mode("triton")

    # Dream's recorded Fast-dLLM prefix-cache case (with the dual-cache case in the other script: here the two scripts
    # take about as long).
    from hf_dllm import DreamModel
    from safetensors.torch import load_file
    hf_dllm.kernels.set_kernel_mode("triton")
    dream = DreamModel.from_pretrained("tests/fixtures/dream-tiny-ref")
    expected = load_file("tests/fixtures/dream-tiny-ref/expected.safetensors")
    out = dream.generate(
        expected["prompt.p12"], max_new_tokens=16, block_length=8, alg="entropy", steps=8, dual_cache=False,
        eos_early_stop=False,
    )
    assert torch.equal(out, expected["case.p12.blk.g16.prefix.s8"]), "Dream prefix-cache generation"
    print("kernel checks passed")
    """
)

MODELS_SCRIPT = textwrap.dedent(
    """
    import torch, hf_dllm
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_pretrained("tests/fixtures/llada-tiny-ref", attn_implementation="llada_triton")
    ids = torch.randint(0, 300, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        # Kept positions: the last block computes its queries, attention and MLP only there (rows into its `ff_out`).
        rows = []
        hook = model.model.transformer.blocks[-1].ff_out.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[1]))
        kept = model(ids, attention_mask=mask, logits_to_keep=slice(3, 9)).logits
        indexed = model(ids, attention_mask=mask, logits_to_keep=torch.tensor([0, 5, 11])).logits
        hook.remove()
        assert rows == [6, 3], rows
        assert (indexed - ours[:, [0, 5, 11]]).abs().max() < 1e-4, "kept positions by index"
        # A hooked block is called whole (the others leave their last residual add to the next norm,
        # `residual_stream_forward`): the same logits, bit for bit.
        hooks = [block.register_forward_hook(lambda *args: None) for block in model.model.transformer.blocks[1:]]
        hooked = model(ids, attention_mask=mask).logits
        for hook in hooks:
            hook.remove()
        hf_dllm.kernels.set_kernel_mode("torch")
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask).logits
    assert (ours - ref)[mask.bool()].abs().max() < 1e-4, "model logits"
    assert torch.equal(ours, hooked) and torch.equal(kept, ours[:, 3:9]), "residual adds left to the next norm"

    # A recorded reference case through the fused path with the dual cache (RoPE writing K/V into the cache).
    from safetensors.torch import load_file
    expected = load_file("tests/fixtures/llada-tiny-ref/expected.safetensors")
    hf_dllm.kernels.set_kernel_mode("triton")
    model.set_attn_implementation("llada_triton")
    out = model.generate(expected["prompt.p7"], max_new_tokens=32, block_length=8, threshold=0.5, eos_early_stop=False)
    assert torch.equal(out, expected["case.p7.dual.threshold0.5"]), "dual-cache generation"

    # Dream: the fused norms (residual add included), SiLU gate, RoPE and concatenated projections against PyTorch,
    # and a recorded Fast-dLLM case with the dual cache (the prefix-cache case is in the other script).
    from hf_dllm import DreamModel
    dream = DreamModel.from_pretrained("tests/fixtures/dream-tiny-ref")
    with torch.no_grad():
        ours = dream(ids, attention_mask=mask).logits
        hf_dllm.kernels.set_kernel_mode("torch")
        ref = dream(ids, attention_mask=mask).logits
    assert (ours - ref)[mask.bool()].abs().max() < 1e-4, "Dream logits"
    hf_dllm.kernels.set_kernel_mode("triton")
    expected = load_file("tests/fixtures/dream-tiny-ref/expected.safetensors")
    # (Two blocks: a block's cached prefix and suffix as with more, at half the interpreted forwards of 32 tokens.)
    out = dream.generate(
        expected["prompt.p12"], max_new_tokens=16, block_length=8, alg="confidence_threshold", threshold=0.7,
        dual_cache=True, eos_early_stop=False,
    )
    assert torch.equal(out, expected["case.p12.blk.g16.dual.t0.7"]), "Dream dual-cache generation"

    print("model checks passed")
    """
)


INTERPRETER_RUN = interpreter_job(
    {"kernel": KERNELS_SCRIPT, "model": MODELS_SCRIPT}, timeout=600, HF_DLLM_KERNELS="triton"
)


@INTERPRETER_RUN.used_by
def test_triton_kernels_match_pytorch_in_interpreter():
    for name, result in INTERPRETER_RUN.results().items():
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert f"{name} checks passed" in result.stdout
