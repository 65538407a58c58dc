"""GPU tests of the fast path (skipped without CUDA).

- The Triton kernels' error against a float64 reference is within 2x of PyTorch's own error in the same dtype
  (flash-attention's test rule), swept over shapes and dtypes, with key padding.
- The CUDA-graph path gives exactly the tokens of the eager path (`disable_compile=True`) of the same dtype, for
  every cache mode and unmasking rule, with left padding.
- Repeated `generate()` calls do not grow GPU memory.
- Where every block's steps are known in advance, the host never waits for the GPU between blocks.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import hf_dllm
from hf_dllm import kernels, triton_ops
from hf_dllm.modeling_llada import LLaDARMSNorm, apply_rotary_pos_emb, rotary_cos_sin
from hf_dllm.triton_attention import block_attention
from tests.conftest import random_weights_model

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


def reference_attention(q, k, v, key_padding):
    """float64 attention; q (B, H, L, D), k/v (B, Hkv, T, D) -> (B, L, H, D)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~key_padding[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch,heads,kv_heads,q_len,kv_len,dim",
    [
        (1, 32, 32, 32, 768, 128),
        (8, 32, 32, 32, 800, 128),
        (2, 8, 2, 17, 300, 64),
        (3, 4, 1, 5, 1000, 128),
        (32, 32, 32, 32, 768, 128),
    ],
)
def test_block_attention_error_within_twice_torch(dtype, batch, heads, kv_heads, q_len, kv_len, dim):
    torch.manual_seed(batch * 1000 + kv_len)
    q = torch.randn(batch, heads, q_len, dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, kv_len, dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv_heads, kv_len, dim, device="cuda", dtype=dtype)
    padding = torch.ones(batch, kv_len, dtype=torch.bool, device="cuda")
    padding[0, : kv_len // 3] = False
    reference = reference_attention(q, k, v, padding)
    ours = block_attention(q, k, v, padding)
    rep = heads // kv_heads
    theirs = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=padding[:, None, None, :]
    ).transpose(1, 2)
    our_error = (ours.double() - reference).abs().max().item()
    torch_error = (theirs.double() - reference).abs().max().item()
    assert our_error <= 2 * torch_error + 1e-6, (our_error, torch_error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(32, 4096), (1024, 4096), (7, 64)])
def test_fused_rms_norm_error_within_twice_torch(dtype, rows, width):
    torch.manual_seed(rows)
    x = torch.randn(rows, width, device="cuda", dtype=dtype)
    residual = torch.randn(rows, width, device="cuda", dtype=dtype)
    norm = LLaDARMSNorm(width, 1e-5).cuda().to(dtype)
    norm.weight.data.normal_(1.0, 0.1)
    total = x.double() + residual.double()
    reference = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    ours, our_total = triton_ops.rms_norm(x, norm.weight, 1e-5, residual=residual)
    hf_dllm.kernels.set_kernel_mode("torch")
    try:
        theirs, their_total = norm.add_and_norm(x, residual)
    finally:
        hf_dllm.kernels.set_kernel_mode("auto")
    assert torch.equal(our_total, their_total)
    our_error = (ours.double() - reference).abs().max().item()
    torch_error = (theirs.double() - reference).abs().max().item()
    assert our_error <= 2 * torch_error + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rotary_and_silu_error_within_twice_torch(dtype):
    torch.manual_seed(0)
    q = torch.randn(4, 32, 8, 128, device="cuda", dtype=dtype)
    k = torch.randn(4, 32, 2, 128, device="cuda", dtype=dtype)
    positions = torch.arange(32, device="cuda").expand(4, -1) + torch.arange(4, device="cuda")[:, None] * 100
    cos, sin = rotary_cos_sin(positions, 128, 500000.0)
    ours_q, ours_k = triton_ops.rotary(q, k, cos, sin)
    theirs_q, theirs_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    ref_q, ref_k = apply_rotary_pos_emb(
        q.double().transpose(1, 2), k.double().transpose(1, 2), cos.double(), sin.double()
    )
    for ours, theirs, ref in ((ours_q, theirs_q, ref_q), (ours_k, theirs_k, ref_k)):
        ours = ours.transpose(1, 2)
        assert (ours.double() - ref).abs().max() <= 2 * (theirs.double() - ref).abs().max() + 1e-6
    gate = torch.randn(64, 12288, device="cuda", dtype=dtype)
    up = torch.randn(64, 12288, device="cuda", dtype=dtype)
    reference = F.silu(gate.double()) * up.double()
    ours = triton_ops.silu_mul(gate, up)
    theirs = F.silu(gate) * up
    assert (ours.double() - reference).abs().max() <= 2 * (theirs.double() - reference).abs().max() + 1e-6


# The special tokens of the random GPU models (vocabulary 1000).
GPU_TOKENS = dict(mask_token_id=999, eos_token_id=998, pad_token_id=997)


def sharp_random_model(model_class, config, attn: str, dtype, device: str = "cuda"):
    """A random model with a sharper head than random init (x40), so that confidences spread over (0, 1) and
    thresholds commit in parallel."""
    return random_weights_model(
        model_class, config, dtype=dtype, device=device, head_scale=40, attn_implementation=attn
    )


def gpu_model(attn: str = "sdpa", dtype=torch.bfloat16) -> hf_dllm.LLaDAModelLM:
    config = hf_dllm.LLaDAConfig(
        d_model=512,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        mlp_hidden_size=1024,
        vocab_size=1000,
        embedding_size=1024,
        max_sequence_length=1024,
        **GPU_TOKENS,
    )
    return sharp_random_model(hf_dllm.LLaDAModelLM, config, attn, dtype)


def padded_prompts(lengths, vocab=990):
    torch.manual_seed(sum(lengths))
    width = max(lengths)
    ids = torch.full((len(lengths), width), 997, device="cuda")
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device="cuda")
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(0, vocab, (length,), device="cuda")
        mask[row, width - length :] = 1
    return ids, mask


@pytest.mark.parametrize("attn", ["sdpa", "llada_triton"])
@pytest.mark.parametrize("cache", [(False, False), (True, False), (True, True)], ids=["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", [{}, {"threshold": 0.7}, {"factor": 1.0}], ids=["fixed", "threshold", "factor"])
def test_graph_path_tokens_equal_eager(attn, cache, rule):
    model = gpu_model(attn)
    ids, mask = padded_prompts([5, 19, 12])
    kwargs = dict(
        max_new_tokens=48,
        block_length=16,
        use_cache=cache[0],
        dual_cache=cache[1],
        eos_early_stop=False,
        return_dict_in_generate=True,
        **rule,
    )
    fast = model.generate(ids, attention_mask=mask, **kwargs)
    again = model.generate(ids, attention_mask=mask, **kwargs)  # replays graphs captured by the first call
    eager = model.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
    assert model._hf_dllm_step_graphs.steps, "the fast path captured no CUDA graph"
    assert torch.equal(fast.sequences, eager.sequences)
    assert torch.equal(again.sequences, eager.sequences)
    assert fast.nfe == eager.nfe


def test_block_start_forward_is_one_graph_replayed_by_later_blocks():
    """The dual cache's full forward has the same shapes at every block start: one graph, captured at the second
    block and replayed by the later ones within the first call, with the eager path's tokens."""
    model = gpu_model()
    ids, mask = padded_prompts([5, 19])
    kwargs = dict(
        max_new_tokens=64, block_length=16, use_cache=True, dual_cache=True, eos_early_stop=False,
        return_dict_in_generate=True,
    )  # fmt: skip
    fast = model.generate(ids, attention_mask=mask, **kwargs)
    assert len(model._hf_dllm_step_graphs.steps) == 2  # the block-start forward and the block step
    eager = model.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
    assert torch.equal(fast.sequences, eager.sequences)
    assert fast.nfe == eager.nfe


def test_graph_path_with_eos_stop_equals_eager():
    model = gpu_model()
    ids, mask = padded_prompts([4, 9, 7, 11])
    kwargs = dict(
        max_new_tokens=64, block_length=8, threshold=0.8, eos_token_id=[5, 6, 7], return_dict_in_generate=True
    )
    fast = model.generate(ids, attention_mask=mask, **kwargs)
    eager = model.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
    assert torch.equal(fast.sequences, eager.sequences)
    assert torch.equal(fast.nfe_per_row, eager.nfe_per_row)


def test_memory_does_not_grow_across_calls():
    model = gpu_model()
    ids, mask = padded_prompts([6, 13])
    kwargs = dict(max_new_tokens=64, block_length=16, eos_early_stop=False)
    allocated = []
    for _ in range(5):
        model.generate(ids, attention_mask=mask, **kwargs)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[-1] <= allocated[1], allocated


def test_triton_backend_logits_close_to_sdpa():
    sdpa, triton_model = gpu_model("sdpa"), gpu_model("llada_triton")
    ids, mask = padded_prompts([7, 30])
    with torch.no_grad():
        a = sdpa(ids, attention_mask=mask).logits.float()
        b = triton_model(ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert (a - b)[real].abs().max() <= 0.05 * a[real].abs().max()


def test_concurrent_calls_give_the_tokens_of_sequential_calls():
    """Only one call holds the model's graph runner; others run eagerly with their own cache."""
    import threading

    model = gpu_model()
    ids, mask = padded_prompts([5, 9])
    kwargs = dict(max_new_tokens=32, block_length=16, threshold=0.7, eos_early_stop=False)
    expected = model.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
    results = [None] * 4

    def work(i):
        results[i] = model.generate(ids, attention_mask=mask, **kwargs)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(result, expected) for result in results)


def test_fused_projections_save_and_reload_exactly(tmp_path):
    model = gpu_model()
    ids, mask = padded_prompts([6])
    model.generate(ids, attention_mask=mask, max_new_tokens=16, block_length=16)
    block = model.model.transformer.blocks[0]
    assert block._concatenated, "generate() multiplied no concatenated projection"
    fused, _ = block.concatenated(("q_proj", "k_proj", "v_proj"))
    assert block.q_proj.weight.data_ptr() == fused.data_ptr()  # the parameters are views of the fused buffer
    model.save_pretrained(tmp_path)
    reloaded = hf_dllm.LLaDAModelLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_graphs_replayed_by_a_later_call_keep_their_constants():
    """A graph captured in one call and replayed in the next reads the token ids it suppresses/defers by address:
    they must outlive the call that captured it."""
    import gc

    model = gpu_model()
    ids, mask = padded_prompts([5, 11])
    kwargs = dict(
        max_new_tokens=48,
        block_length=16,
        threshold=0.7,
        eos_token_id=[5, 6],
        eot_token_id=7,
        logits_eos_inf=True,
        confidence_eos_eot_inf=True,
        eos_early_stop=False,
    )
    first = model.generate(ids, attention_mask=mask, **kwargs)
    gc.collect()
    torch.cuda.empty_cache()
    clutter = [torch.full((4096,), 3, device="cuda") for _ in range(64)]  # reuse freed blocks
    second = model.generate(ids, attention_mask=mask, **kwargs)
    eager = model.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
    del clutter
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert not torch.isin(second[:, ids.shape[1] :], torch.tensor([5, 6], device="cuda")).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "rows,vocab,n_splits", [(32, 126464, None), (32, 157184, 1), (1024, 157184, None), (7, 1000, None)]
)
def test_greedy_propose_matches_torch(dtype, rows, vocab, n_splits):
    """Same argmax as torch (first index on ties, the excluded id never chosen); the probability's error against
    a float64 softmax within 2x of torch's float32 error (plus float32 rounding of the result). Few rows split the
    vocabulary (`greedy_propose_splits`), or run one program per row (`n_splits=1`)."""
    torch.manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda") * 6).to(dtype)
    logits[0, 5] = logits[0].max() + 1  # the excluded id is the best: the runner-up must be chosen
    logits[1, :] = 0.5  # all tied: the first index
    if rows > 2:
        logits[2, vocab - 1] = logits[2, 3] = logits[2].max() + 1  # tied in the first and last split: the first
    tokens, probability = triton_ops.greedy_propose(logits, 5, n_splits=n_splits)
    candidates = logits.float().clone()
    candidates[:, 5] = float("-inf")
    expected = candidates.argmax(-1)
    assert torch.equal(tokens, expected)
    exact = torch.softmax(logits.double(), -1).gather(-1, expected[:, None])[:, 0]
    theirs = torch.exp(logits.float().gather(-1, expected[:, None])[:, 0] - torch.logsumexp(logits.float(), -1))
    assert (probability.double() - exact).abs().max() <= 2 * (theirs.double() - exact).abs().max() + 1e-7


@pytest.mark.parametrize("length,with_candidates", [(32, False), (32, True), (64, True)])
def test_fused_commit_decides_as_pytorch_at_a_block_step(monkeypatch, length, with_candidates):
    """`triton_ops.commit_most_confident` (the mask-based policies' step decision in one launch) at a batch-8 step of
    32- and 64-position blocks (one warp, eight): the same block, draft and edit flags as the PyTorch commit, for
    every policy rule (fixed schedule, Fast-dLLM's threshold 0.9, LLaDA2.0's rule), with tied confidences and a
    frozen row, without a host synchronisation."""
    from hf_dllm.decoding import ConfidenceThreshold, FixedSchedule, ScheduledThreshold, StepRules, denoise_step

    torch.manual_seed(0)
    rows, mask, bound = 8, 126335, 3 * length // 4
    block = torch.randint(0, 1000, (rows, length), device="cuda")
    block[torch.rand(rows, length, device="cuda") < 0.5] = mask
    tail = block[:, bound:]
    block[:, bound:] = torch.where(tail == mask, 7, tail)  # at most `bound` masks: the candidates
    logits = torch.randn(rows, length, 126464, device="cuda").bfloat16() * 4
    logits[1] = logits[1, :1]  # tied confidences
    candidates = None
    if with_candidates:
        candidates = torch.argsort((block != mask).long(), dim=1, stable=True)[:, :bound]
        logits = logits.gather(1, candidates[..., None].expand(-1, -1, logits.shape[-1]))
    step = dict(scheduled=torch.full((rows,), 2, device="cuda"), active=torch.arange(rows, device="cuda") != 3)
    calls, launcher = [], triton_ops.commit_most_confident
    monkeypatch.setattr(triton_ops, "commit_most_confident", lambda *a, **k: calls.append(1) or launcher(*a, **k))
    for policy in (FixedSchedule(), ConfidenceThreshold(0.9), ScheduledThreshold(0.9)):
        policy.start_block(length, 16)
        rules = StepRules(policy=policy, mask_token_id=mask)
        decided = []
        for mode in ("torch", "auto"):
            kernels.set_kernel_mode(mode)
            try:
                decided.append(denoise_step(block, logits, rules, **step, candidates=candidates))
            finally:
                kernels.set_kernel_mode("auto")
        assert all(torch.equal(a, b) for a, b in zip(*decided, strict=True)), type(policy).__name__
        assert len(calls) == 1, "the fused decision ran once, in the auto mode's step"
        assert count_host_syncs(lambda r=rules: denoise_step(block, logits, r, **step, candidates=candidates)) == 0
        calls.clear()  # (after the sync count's step, which runs the fused decision too)


@contextlib.contextmanager
def recorded_host_syncs():
    """The warnings of torch's sync debug mode (one each time the host waits for the GPU) while the block runs, in
    the list it yields; the GPU is synchronized first."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(0)


def count_host_syncs(fn) -> int:
    """How many times `fn()` made the host wait for the GPU (torch's sync debug mode warns at each)."""
    with recorded_host_syncs() as caught:
        fn()
    return len(host_sync_warnings(caught))


def host_sync_warnings(caught) -> list[str]:
    """The recorded warnings that are torch's "called a synchronizing CUDA operation" (not its one-time notice, at
    the first `set_sync_debug_mode` of a process, that the mode "does not yet detect all synchronizing
    operations"), as `file:line: message`."""
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "called a synchronizing" in str(w.message)]


def assert_blocks_add_no_host_syncs(call) -> None:
    """`call(blocks)` returns a generate() call decoding `blocks` blocks: once every step's graph is captured, 8
    blocks make the host wait for the GPU as often as 2."""
    for blocks in (2, 8, 2, 8):  # capture every step's graph first
        call(blocks)()
    # Steady state (min of 3): growing the cache of pinned buffers may synchronise once in a while.
    assert min(count_host_syncs(call(8)) for _ in range(3)) == min(count_host_syncs(call(2)) for _ in range(3))


def test_upload_does_not_wait_for_the_gpu():
    """`kernels.upload` returns while queued GPU work still runs; a plain `.to("cuda")` of pageable memory waits."""
    host, device = torch.arange(7), torch.device("cuda")
    kernels.upload(host, device)  # the first pinned buffer is allocated here; later uploads reuse cached ones

    def host_seconds(copy) -> tuple[float, torch.Tensor]:
        torch.cuda.synchronize()
        torch.cuda._sleep(2 * 10**8)  # ~0.1 s of queued GPU work
        start = time.perf_counter()
        copied = copy()
        return time.perf_counter() - start, copied

    uploaded_after, uploaded = host_seconds(lambda: kernels.upload(host, device))
    pageable_after, _ = host_seconds(lambda: host.to(device))
    assert uploaded.is_cuda and torch.equal(uploaded.cpu(), host)
    assert pageable_after > 0.05 and uploaded_after < pageable_after / 10, (uploaded_after, pageable_after)


@pytest.mark.parametrize("cache", [(False, False), (True, True)], ids=["none", "dual"])
def test_no_host_synchronisation_between_blocks(cache):
    """A fixed schedule without EOS stop knows every block's steps in advance: a call of 8 blocks makes the host
    wait for the GPU as often as a call of 2 (the uploads at block boundaries go through pinned memory)."""
    model = gpu_model()
    ids, mask = padded_prompts([40, 33])
    use_cache, dual_cache = cache

    def call(blocks: int):
        return lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=32 * blocks, block_length=32, steps=32 * blocks,
            use_cache=use_cache, dual_cache=dual_cache, eos_early_stop=False,
        )  # fmt: skip

    assert_blocks_add_no_host_syncs(call)
