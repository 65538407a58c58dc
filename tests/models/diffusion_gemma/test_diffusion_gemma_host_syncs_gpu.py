"""DiffusionGemma on CUDA without host synchronisations (torch's sync debug mode), on a small random model in
bfloat16 (hf_dllm's fused kernels, the static cache, the full layers' wide heads on the "gemm" attention):

- the encoder's pass over a prompt (eager) and over an accepted canvas (its CUDA graph), and steady-state denoising
  steps (the decoder's graph, self-conditioning, the fused sampler) make none ("error" mode raises at the first);
- a `generate()` call makes as many with 8 denoising steps per canvas as with 4: a step adds none (the stop
  decision reads an event recorded with its flag, which the mode does not count, and waits for the step before).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import hf_dllm
from hf_dllm.decoding_diffusion_gemma import EntropyBoundSampler
from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion, DiffusionGemmaStaticCache
from tests.generation.test_gpu import count_host_syncs

pytestmark = pytest.mark.gpu

PROMPT, CANVAS = 40, 16


@pytest.fixture(scope="module")
def model():
    config = hf_dllm.DiffusionGemmaConfig(
        text_config=dict(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, global_head_dim=512,
            num_global_key_value_heads=1, sliding_window=32, num_experts=16, top_k_experts=4,
            moe_intermediate_size=128, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        vision_config=None, canvas_length=CANVAS)  # fmt: skip
    torch.manual_seed(0)
    return DiffusionGemmaForBlockDiffusion(config).to(device="cuda", dtype=torch.bfloat16).eval()


@contextlib.contextmanager
def syncs_raise():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_encoder_passes_and_steady_steps_do_not_synchronize(model):
    text = model.config.text_config
    sampler = EntropyBoundSampler(text.vocab_size, 1 << 20, 0.1, 0.4, 0.8, 1, 0.005, text.final_logit_softcapping)
    prompt = torch.randint(0, text.vocab_size, (1, PROMPT), device="cuda")
    valid = torch.ones(1, PROMPT, dtype=torch.bool, device="cuda")
    columns = torch.arange(PROMPT, device="cuda")
    positions = torch.arange(PROMPT, PROMPT + CANVAS, device="cuda")
    canvas_valid = torch.ones(1, CANVAS, dtype=torch.bool, device="cuda")
    with torch.no_grad():
        model.encode(prompt, columns, valid, DiffusionGemmaStaticCache(text, PROMPT + 2 * CANVAS, CANVAS), end=PROMPT)
        cache = DiffusionGemmaStaticCache(text, PROMPT + 2 * CANVAS, CANVAS)  # (compiled and tuned above)
        cache.prepare(1, model.dtype, model.device, PROMPT)  # allocated before, as by generate()'s first run
        with syncs_raise():
            model.encode(prompt, columns, valid, cache, end=PROMPT)
        assert sampler.uses_fused(torch.device("cuda"))
        block = sampler.initial_block(1, CANVAS, "cuda")

        def step(block):
            logits = model.decode(block, positions, cache, padded=False, **sampler.forward_inputs())
            return sampler.denoise(block, logits, None, None)[0]

        for _ in range(3):  # unconditioned, then self-conditioned; the decoder's graph captured at the first
            block = step(block)
        with syncs_raise():
            for _ in range(2):
                block = step(block)
        replays = model._graphs.replays.get("decoder_layers", 0)
        assert replays >= 4, model._graphs.replays

        def canvas_pass():
            model.encode(block, positions, canvas_valid, cache, positions[None], end=PROMPT + CANVAS)

        canvas_pass()  # captured
        with syncs_raise():
            canvas_pass()
        assert model._graphs.replays.get("encoder_layers", 0) >= 1
    assert cache.length == PROMPT + CANVAS


def test_generate_steps_add_no_syncs(model):
    prompt = torch.randint(0, model.config.text_config.vocab_size, (1, PROMPT), device="cuda")

    def call(steps: int):
        # No stable-and-confident stop: every canvas takes `steps` steps.
        return lambda: model.generate(
            prompt, max_new_tokens=2 * CANVAS, max_denoising_steps=steps, confidence_threshold=None
        )

    for steps in (4, 8, 4, 8):  # graphs captured, the static cache reused
        call(steps)()
    # Steady state (min of 3): growing the cache of pinned buffers may synchronise once in a while.
    few = min(count_host_syncs(call(4)) for _ in range(3))
    many = min(count_host_syncs(call(8)) for _ in range(3))
    assert many == few, (few, many)
