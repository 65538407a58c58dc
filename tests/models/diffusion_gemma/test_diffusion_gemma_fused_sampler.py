"""DiffusionGemma's fused path on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`, `HF_DLLM_KERNELS=triton`,
switched on before Triton compiles anything, hence subprocesses, run beside the in-process tests), float32, against
the PyTorch code:

- `rms_norm` (one kernel per norm, residual added) and `norm_rope` (an attention's per-head norm and RoPE) against
  the PyTorch ops; the decoder's attention on the Triton backend against SDPA;
- `fused_sample` (`triton_diffusion_gemma.py`): argmax exact, entropy and the self-conditioning probabilities within
  float32 rounding of a float64 reference, frozen rows' probabilities left as they were, one chunk or several per row
  (a vocabulary that is not a multiple of the chunk), a sample inside the vocabulary that takes a certain token; the
  sample the float64 inverse CDF at the row's Philox uniform (`sampler_reference.py`) but where the uniform lies
  within float32 rounding of a boundary (rows counted, rare), on rows whose chunks hold no mass first, in the middle
  or last, of one drawable column, flat or certain, under several chunkings, cap on and off, temperatures; one seed
  one sample, another seed others; the scan's fallback (a chunk claimed past its columns' recomputed sum takes its
  last column of probability > 0) with every row written;
- the experts through hf_dllm's Triton MoE kernels (`implementation="triton"`: GELU-gated grouped products) against
  the loop;
- one denoising step of the fixture model, fused against the PyTorch sampler from the same canvas: the same argmax,
  entropy, accepted positions and stopping decision, and the next step's logits from the fused path's
  self-conditioning probabilities equal to those from the processed logits; a seeded `generate()` on the fused path
  is reproducible and well formed (its draws are not `torch.multinomial`'s: the tokens are not the fixture's).

The kernel's draws' distribution is checked statistically on the GPU (`test_diffusion_gemma_fused_sampler_gpu.py`):
the interpreter runs a program in milliseconds, too slow for the many draws of one distribution a chi-square test
needs; here the uniforms through the reference inverse CDF are.
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
    import torch, hf_dllm
    from hf_dllm.triton_diffusion_gemma import _finish_kernel, _partials_kernel, fused_sample
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaExperts
    from tests.models.diffusion_gemma.sampler_reference import (
        inverse_cdf, philox_uniforms, processed, within_its_interval,
    )

    torch.manual_seed(0)
    B, C, V = 2, 3, 300
    x = torch.randn(B, C, V) * 20
    x[0, 1, 7] = x[0, 1, 250] = 500.0  # equal after the cap: the first column is the argmax
    x[1, 2, 42] = 2000.0  # the likeliest by far (p = 0.78 at T 0.7, 0.999 at T 0.2)
    z = (x.double() / 30).tanh() * 30 / 0.7
    want_entropy = torch.distributions.Categorical(logits=z).entropy()
    # Rows that stress the chunks' claims (chunks of 64 or 128 columns below): chunks of probability 0 first, in the
    # middle and last; one column of probability > 0 (the first; the last); half the columns of probability 0; the
    # last column the likeliest; most mass in one chunk; flat; certain.
    hard = torch.randn(1, 10, V) * 3
    hard[0, 0, :128] = hard[0, 1, 128:256] = hard[0, 2, 256:] = hard[0, 3, :-1] = hard[0, 4, 1:] = -1e4
    hard[0, 5, torch.rand(V) < 0.5] = -1e4
    hard[0, 6, -1] = 12.0
    hard[0, 7, 130:140] += 8.0
    hard[0, 8] *= 0.01
    hard[0, 9, 3] = 3000.0
    # The draw is the inverse CDF at the row's Philox uniform: the float64 reference's wherever u is not within 1e-6
    # of a cumulative probability (there float32 rounding may take the next column: such rows are counted, and
    # none may be outside that), every sample inside its interval widened by 1e-6 and of drawable probability.
    draws, near_rows = {}, 0
    for rows, cap, temperature, splits, block, seed in (
        (x, 30.0, 0.2, None, 64, 123), (x, 30.0, 0.7, 2, 128, 1 << 45), (hard, None, 1.0, 3, 64, 7),
        (hard, 30.0, 0.5, 5, 32, 8), (hard, None, 1.0, 1, 1024, 7),
    ):  # fmt: skip
        sample = fused_sample(rows, torch.tensor([temperature]), torch.tensor([seed]), cap, splits=splits,
                              block=block)[0].view(-1)
        z_rows, u = processed(rows, cap, temperature), philox_uniforms(seed, sample.numel())
        draw, near = inverse_cdf(z_rows, u, 1e-6)
        assert torch.equal(sample[~near], draw[~near]), (splits, temperature, sample, draw)
        assert within_its_interval(z_rows, u, sample, 1e-6).all(), (splits, temperature, sample)
        near_rows += int(near.sum())
        draws[seed, cap, splits] = sample
    assert near_rows <= 2, near_rows  # expected well under 1 in these 42 rows (zones 2e-6 wide, 300 at most a row)
    # One seed, one sample (chunked otherwise too, but for rows within rounding of a boundary); another seed draws
    # otherwise somewhere.
    def hard_draw(seed, splits=3, block=64):
        return fused_sample(hard, torch.tensor([1.0]), torch.tensor([seed]), None, splits=splits, block=block)[0]

    assert torch.equal(hard_draw(7).view(-1), draws[7, None, 3])
    assert torch.equal(draws[7, None, 3], draws[7, None, 1]) and not torch.equal(hard_draw(9).view(-1), draws[7, None, 3])
    # The uniforms through the float64 inverse CDF follow softmax: 200,000 rows of a 16-token distribution,
    # chi-square with 15 degrees of freedom below 37.70 (p = 0.001). (The kernel's own draws, many per
    # distribution, are counted on the GPU: the interpreter runs a program in milliseconds.)
    logits = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 4.0, 3.5, 1.2, 0.7, 0.2, -2.0, 2.2])
    draw, _ = inverse_cdf(logits.expand(200_000, 16), philox_uniforms(11, 200_000), 0.0)
    expected = logits.double().softmax(-1) * 200_000
    chi_square = float(((torch.bincount(draw, minlength=16) - expected) ** 2 / expected).sum())
    assert chi_square < 37.70, chi_square
    # The scan's fallback: chunk 0's sum inflated by 1000 (as if rounding had left its columns' recomputed sum
    # below t), so a t in [54, 1054) claims it and its columns' running sum never exceeds t: the chunk's last column
    # of probability > 0 (53: columns 54..63 have none), never one of probability 0. Every row written once (the
    # buffer starts at -1), by the chunk that claims it.
    rows, columns = 16, 128
    flat_zero = torch.zeros(rows, columns)
    flat_zero[:, 54:64] = -1e4
    one, seed = torch.tensor([1.0]), torch.tensor([5])  # its 16 uniforms land in all three ranges
    partial, index = torch.empty(rows, 2, 4), torch.empty(rows, 2, dtype=torch.int32)
    _partials_kernel[(rows, 2)](flat_zero, one, partial, index, columns, 64, 2, 1.0, 1.0, HAS_CAP=False, BLOCK=32)
    assert torch.equal(partial[:, :, 1], torch.tensor([[54.0, 64.0]] * rows))
    partial[:, 0, 1] += 1000.0
    sample, entropy, argmax = torch.full((rows,), -1), torch.empty(rows), torch.empty(rows, dtype=torch.long)
    _finish_kernel[(rows, 2)](
        flat_zero, one, seed, partial, index, sample, entropy, argmax, entropy, entropy, columns, 64, 2, 64, 1.0, 1.0,
        HAS_CAP=False, HAS_FROZEN=False, WRITE_PROBABILITIES=False, BLOCK=32, BLOCK_S=2,
    )  # fmt: skip
    t = philox_uniforms(5, rows) * 1118.0
    want = torch.where(t < 54, t.floor(), torch.where(t < 1054, 53.0, 64 + (t - 1054).floor())).long()
    assert (t < 54).any() and ((t >= 54) & (t < 1054)).any() and (t >= 1054).any(), t
    assert torch.equal(sample, want), (sample, want)
    x_draw, near = inverse_cdf(processed(x, 30.0, 0.7), philox_uniforms(123, B * C), 1e-6)
    assert not near.any()
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
        assert torch.equal(sample.view(-1), x_draw), (splits, sample)  # x's rows: none near a boundary
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
