"""DiffusionGemma's fused path on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`, `HF_DLLM_KERNELS=triton`,
switched on before Triton compiles anything, hence subprocesses, run beside the in-process tests), float32, against
the PyTorch code:

- `rms_norm` (one kernel per norm, residual added) and `norm_rope` (an attention's per-head norm and RoPE) against
  the PyTorch ops; the decoder's attention on the Triton backend against SDPA;
- `fused_sample` (`triton_diffusion_gemma.py`): argmax exact, entropy and the self-conditioning probabilities within
  float32 rounding of a float64 reference, frozen rows' probabilities left as they were, one chunk or several per row
  (a vocabulary that is not a multiple of the chunk), a sample inside the vocabulary that takes a certain token; the
  sample exactly the Gumbel-max over every column from a numpy Philox (the kernel skips blocks that cannot win, on
  peaked rows; flat rows skip none), and the GPU's Philox (wide multiplies) tl.rand's;
- the experts through hf_dllm's Triton MoE kernels (`implementation="triton"`: GELU-gated grouped products) against
  the loop;
- one denoising step of the fixture model, fused against the PyTorch sampler from the same canvas: the same argmax,
  entropy, accepted positions and stopping decision, and the next step's logits from the fused path's
  self-conditioning probabilities equal to those from the processed logits; a seeded `generate()` on the fused path
  is reproducible and well formed (its draws are not `torch.multinomial`'s: the tokens are not the fixture's).

The sample's distribution is checked statistically on the GPU (`test_diffusion_gemma_fused_sampler_gpu.py`): the
interpreter runs a program in tens of milliseconds, too slow for the thousands of draws a chi-square test needs.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.conftest import ROOT, BackgroundJob

pytest.importorskip("triton", reason="the `triton` extra is not installed")

KERNEL_SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch, hf_dllm
    from hf_dllm.triton_diffusion_gemma import fused_sample
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaExperts

    def gumbel_max(x, cap, temperature, seed):
        # The draw over every column in float32 numpy (the interpreter's arithmetic): z as the kernels compute it,
        # u = Triton's `tl.rand(seed, row * vocab + column)` (Philox4x32-10, the first word, to [0, 1)).
        x = x.reshape(-1, x.shape[-1]).numpy().astype(np.float32)
        y = x * np.float32(1.0 / cap)
        z = np.float32(cap) * (np.float32(1) - np.float32(2) / (np.exp(np.float32(2) * y) + np.float32(1)))
        z = z / np.float32(temperature)
        offset = np.arange(x.size, dtype=np.uint64).reshape(x.shape)
        mask = np.uint64(0xFFFFFFFF)
        c0, c1, c2, c3 = offset & mask, offset >> np.uint64(32), np.zeros_like(offset), np.zeros_like(offset)
        k0, k1 = np.uint64(seed) & mask, (np.uint64(seed) >> np.uint64(32)) & mask
        for _ in range(10):
            hi_b, hi_a = np.uint64(0xCD9E8D57) * c2, np.uint64(0xD2511F53) * c0
            c0, c2 = (hi_b >> np.uint64(32)) ^ c1 ^ k0, (hi_a >> np.uint64(32)) ^ c3 ^ k1
            c1, c3 = hi_b & mask, hi_a & mask
            k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
        word = c0.astype(np.uint32).view(np.int32)
        u = np.where(word < 0, ~word, word).astype(np.float32) * np.float32(4.6566127342e-10)
        u = np.minimum(np.maximum(u, np.float32(1e-20)), np.float32(0.99999994))
        return torch.from_numpy((z - np.log(-np.log(u))).argmax(-1))

    torch.manual_seed(0)
    B, C, V = 2, 3, 300
    x = torch.randn(B, C, V) * 20
    x[0, 1, 7] = x[0, 1, 250] = 500.0  # equal after the cap: the first column is the argmax
    x[1, 2, 42] = 2000.0  # certain: every draw takes it
    z = (x.double() / 30).tanh() * 30 / 0.7
    want_entropy = torch.distributions.Categorical(logits=z).entropy()
    # Peaked rows (the finish kernel skips the blocks that cannot win the draw) and near-flat ones whose draws
    # mostly come from columns well below their max (blocks that must not be skipped).
    flat = torch.randn(1, 2, V) * 0.1
    flat[0, :, 3] = 4.0
    # The GPU's Philox (`_uniform`, wide multiplies; the interpreter's draws take tl.rand) is tl.rand bit for bit.
    from tests.models.diffusion_gemma.test_diffusion_gemma_fused_sampler_gpu import _uniform_and_rand

    offsets = torch.cat([torch.arange(64), torch.randint(0, 1 << 40, (64,))])
    ours, theirs = torch.empty(128), torch.empty(128)
    _uniform_and_rand[(1,)](torch.tensor([(1 << 62) - 3]), offsets, ours, theirs, BLOCK=128)
    assert torch.equal(ours, theirs), "the wide-multiply Philox"
    for splits, block, rows, temperature in ((None, 64, x, 0.2), (2, 128, x, 0.7), (None, 64, flat, 0.7)):
        sample, _, _ = fused_sample(rows, torch.tensor([temperature]), torch.tensor([123]), 30.0, splits=splits,
                                    block=block)
        want = gumbel_max(rows, 30.0, temperature, 123)
        assert torch.equal(sample.view(-1), want), (splits, temperature, sample, want)
    for splits, block in ((None, 64), (3, 64), (1, 512)):
        probabilities = torch.full((B, C, V), -1.0)
        sample, argmax, entropy = fused_sample(
            x, torch.tensor([0.7]), torch.tensor([123]), 30.0, probabilities, torch.tensor([False, True]),
            splits=splits, block=block,
        )
        assert torch.equal(argmax, z.argmax(-1)) and argmax[0, 1] == 7, (splits, argmax)
        assert (entropy.double() - want_entropy).abs().max() < 5e-6, (splits, (entropy.double() - want_entropy).abs().max())
        assert torch.allclose(probabilities[0].double(), z[0].softmax(-1), rtol=2e-5, atol=1e-8), splits
        assert (probabilities[1] == -1).all(), "a frozen row's probabilities are left as they were"
        assert ((sample >= 0) & (sample < V)).all() and sample[1, 2] == 42, (splits, sample)
    # No cap and no schedule: z is x itself.
    _, argmax, entropy = fused_sample(x[:, :1], torch.tensor([1.0]), torch.tensor([5]), None)
    want = torch.distributions.Categorical(logits=x[:, :1].double()).entropy()
    assert torch.equal(argmax, x[:, :1].argmax(-1)) and (entropy.double() - want).abs().max() < 5e-6

    # DiffusionGemma's RMS norm in one kernel, with and without weight and residual, against the PyTorch ops.
    from hf_dllm import kernels
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaRMSNorm

    for with_scale, add in ((True, False), (False, True), (True, True)):
        norm = DiffusionGemmaRMSNorm(48, eps=1e-6, with_scale=with_scale)
        if with_scale:
            norm.weight.data.normal_()
        h, residual = torch.randn(5, 3, 48), (torch.randn(5, 3, 48) if add else None)
        with torch.no_grad():
            fused = norm(h, residual=residual)
            kernels.set_kernel_mode("torch")
            plain = norm(h, residual=residual)
            kernels.set_kernel_mode("triton")
        assert (fused - plain).abs().max() < 2e-6, ("rms_norm", with_scale, add, (fused - plain).abs().max())

    # The attention's per-head norms and RoPE in one kernel each (sliding: default RoPE; full: proportional, keys
    # as values), on two rows with their own positions, against the PyTorch ops.
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaDecoder

    model_config = hf_dllm.DiffusionGemmaConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            sliding_window=4, num_experts=6, top_k_experts=2, moe_intermediate_size=24,
            layer_types=["sliding_attention", "full_attention"]),
        vision_config=None, canvas_length=8)
    decoder = DiffusionGemmaDecoder(model_config)
    for name, parameter in decoder.named_parameters():
        parameter.data.normal_(1.0 if "norm" in name else 0.0, 0.3)
    h, positions = torch.randn(2, 5, 32), torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    for index, kind in enumerate(model_config.text_config.layer_types):
        attention = decoder.layers[index].self_attn
        cos, sin = decoder.rope(positions, kind, h.dtype)
        with torch.no_grad():
            fused = attention(h, cos, sin, None, None, False)
            kernels.set_kernel_mode("torch")
            plain = attention(h, cos, sin, None, None, False)
            kernels.set_kernel_mode("triton")
        assert (fused - plain).abs().max() < 1e-5, ("norm_rope", kind, (fused - plain).abs().max())
        # The decoder's pass on the Triton attention (a key padding mask; grouped-query heads) against SDPA.
        padding = torch.tensor([[True] * 5, [False, True, True, True, True]])[:, None, None, :]
        with torch.no_grad():
            attention.backend = "triton"
            triton_out = attention(h, cos, sin, None, padding, False)
            attention.backend = "sdpa"
            sdpa_out = attention(h, cos, sin, None, padding, False)
        assert (triton_out - sdpa_out).abs().max() < 1e-5, ("attention", kind, (triton_out - sdpa_out).abs().max())

    # The experts: GELU-gated grouped products (Triton) against the loop.
    config = hf_dllm.DiffusionGemmaConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            sliding_window=4, num_experts=6, top_k_experts=2, moe_intermediate_size=24,
            layer_types=["sliding_attention", "full_attention"]),
        vision_config=None, canvas_length=8).text_config
    experts = DiffusionGemmaExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    h, index, weights = torch.randn(37, 32), torch.stack([torch.randperm(6)[:2] for _ in range(37)]), torch.rand(37, 2)
    with torch.no_grad():
        assert experts.chosen_implementation(h) == "triton"
        fused = experts(h, index, weights)
        experts.implementation = "loop"
        assert (fused - experts(h, index, weights)).abs().max() < 2e-5, "experts"

    # The router: softmax, top-k and renormalisation in one launch against torch's ops (same experts, same order).
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaRouter

    router = DiffusionGemmaRouter(config)
    for parameter in router.parameters():
        parameter.data.normal_(1.0, 0.5)
    with torch.no_grad():
        fused_weights, fused_index = router(h)
        kernels.set_kernel_mode("torch")
        weights, index = router(h)
        kernels.set_kernel_mode("triton")
    assert torch.equal(fused_index, index) and (fused_weights - weights).abs().max() < 1e-6, "router"

    # The GEMM attention's masked softmax in one launch, grouped-query heads, key and per-query masks, against SDPA.
    from hf_dllm.modeling_diffusion_gemma import gemm_attention

    for mask_rows, (query_heads, kv_heads) in ((None, (4, 4)), (1, (4, 2)), (5, (8, 1))):
        q, (k, v) = torch.randn(2, query_heads, 5, 16), torch.randn(2, 2, kv_heads, 9, 16)
        mask = None if mask_rows is None else torch.rand(2, 1, mask_rows, 9) > 0.3
        if mask is not None:
            mask[..., -1] = True
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.5, enable_gqa=query_heads != kv_heads
        )
        with torch.no_grad():
            assert (gemm_attention(q, k, v, mask, scale=0.5) - expected).abs().max() < 1e-5, ("gemm", mask_rows)
    print("ok")
    """
)

MODEL_SCRIPT = textwrap.dedent(
    """
    import torch, hf_dllm
    from transformers import AutoModel
    from hf_dllm.decoding_diffusion_gemma import EntropyBoundSampler

    from hf_dllm import kernels

    # The model's own kernels (norms, experts) are the other script's: here the PyTorch model and the fused sampler.
    kernels.set_kernel_mode("torch")
    model = AutoModel.from_pretrained(sys_argv_dir).eval()
    text, canvas = model.config.text_config, model.config.canvas_length

    def sampler(fused, steps=4):
        return EntropyBoundSampler(text.vocab_size, steps, 0.1, 0.4, 0.8, 1, 0.5, softcap=30.0, fused=fused)

    torch.manual_seed(0)
    prompt = torch.randint(0, text.vocab_size - 1, (2, 7))
    positions = torch.arange(7, 7 + canvas)
    results = {}
    with torch.no_grad():
        cache = model.new_encoder_cache()
        model.encode(prompt, torch.arange(7), torch.ones(2, 7, dtype=torch.bool), cache)
        block = torch.randint(0, text.vocab_size, (2, canvas))
        for fused in (False, True):
            policy = sampler(fused)
            policy.initial_block(2, canvas, "cpu")
            assert policy.fused_active == fused
            entropies, accept = [], policy.accept
            policy.accept = lambda entropy: (entropies.append(entropy.clone()), accept(entropy))[1]
            steps = []
            for _ in range(2):  # the second step is self-conditioned
                logits = model.decode(block, positions, cache, **policy.forward_inputs())
                _, argmax, _ = policy.denoise(block, logits, None, None)
                steps.append((argmax.clone(), policy.finished.clone(), entropies[-1], accept(entropies[-1])))
            results[fused] = (steps, policy)
        (ref_steps, ref), (fused_steps, fused) = results[False], results[True]
        for (a, f, e, accepted), (b, g, h, accepted_fused) in zip(ref_steps, fused_steps):
            assert torch.equal(a, b) and torch.equal(f, g), "argmax / finished"
            assert (e - h).abs().max() < 1e-5, ("entropy", (e - h).abs().max())
            assert torch.equal(accepted, accepted_fused), "accepted positions"
        # The next step's logits: from the fused path's probabilities as from the processed logits.
        from_logits = model.decode(block, positions, cache, self_conditioning_logits=ref.self_conditioning)
        from_probabilities = model.decode(block, positions, cache, self_conditioning_probabilities=fused.probabilities)
        assert (from_logits - from_probabilities).abs().max() < 1e-4, (from_logits - from_probabilities).abs().max()
        raw = model.decode(block, positions, cache, capped_logits=False)
        capped = model.decode(block, positions, cache)
        assert (raw.div(30).tanh().mul(30) - capped).abs().max() < 1e-5, "raw head output"

        # generate() on the fused path: seeded, reproducible, well formed.
        runs = []
        for _ in range(2):
            torch.manual_seed(3)
            runs.append(model.generate(prompt, max_new_tokens=32, max_denoising_steps=3,
                                       unmasking_policy=sampler(True, steps=3), return_dict_in_generate=True))
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        out = runs[0].sequences
        assert torch.equal(out[:, :7], prompt) and out.shape == (2, 7 + 32) and (out[:, 7:] < text.vocab_size).all()
        assert runs[0].nfe <= 6
    print("ok")
    """
)


FUSED_RUN = BackgroundJob(
    lambda _workdir: {
        "kernels": [sys.executable, "-c", KERNEL_SCRIPT],
        "model": [
            sys.executable,
            "-c",
            f"sys_argv_dir = {str(ROOT / 'tests' / 'fixtures' / 'diffusion-gemma-tiny-ref')!r}\n" + MODEL_SCRIPT,
        ],
    },
    timeout=600,
    cwd=ROOT,
    env=dict(os.environ, TRITON_INTERPRET="1", HF_DLLM_KERNELS="triton", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
)


@FUSED_RUN.used_by
def test_fused_sampler_and_experts_in_the_interpreter():
    for name, done in FUSED_RUN.results().items():
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (name, done.stderr[-4000:])
