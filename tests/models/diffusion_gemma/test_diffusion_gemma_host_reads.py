"""DiffusionGemma's passes read no tensor value on the host (on a GPU each read makes the host wait for all queued
work): the encoder's pass over a prompt and over a canvas, and denoising steps (decoder and PyTorch sampler), over
the static cache with the grouped experts (the GPU's path), with a left-padded row; a canvas' first step through the
loop's `_diffusion_forward` reads one value (its first column). Recorded on the CPU by a dispatch mode (the aten ops
that read values); `test_diffusion_gemma_host_syncs_gpu.py` checks the same on CUDA with torch's sync debug mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_dllm
from hf_dllm.decoding_diffusion_gemma import EntropyBoundSampler
from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion

# aten ops whose result needs a tensor's value on the host (`.item()`, `int()`, `bool()`, data-dependent shapes).
HOST_READS = {
    "_local_scalar_dense",
    "nonzero",
    "equal",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
}
PROMPT, CANVAS = 11, 8


class HostReads(TorchDispatchMode):
    """The host-reading aten ops run inside it, in `reads`."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READS:
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model():
    config = hf_dllm.DiffusionGemmaConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            sliding_window=4, num_experts=6, top_k_experts=2, moe_intermediate_size=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        vision_config=None, canvas_length=CANVAS)  # fmt: skip
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(config).to(torch.bfloat16).eval()
    model.static_cache = True
    for layer in model.model.decoder.layers:
        layer.experts.implementation = "grouped"  # the loop over experts lists them on the host
    return model


def prompt_inputs():
    prompt = torch.randint(0, 64, (2, PROMPT))
    valid = torch.ones(2, PROMPT, dtype=torch.bool)
    valid[1, :3] = False  # a left-padded row: the masks hide its padding
    return prompt, valid


def test_passes_and_steps_read_nothing_on_the_host(model):
    text = model.config.text_config
    sampler = EntropyBoundSampler(text.vocab_size, 8, 0.1, 0.4, 0.8, 1, 0.005, text.final_logit_softcapping, False)
    prompt, valid = prompt_inputs()
    positions = torch.arange(PROMPT, PROMPT + CANVAS)
    reads = {}
    with torch.no_grad():
        cache = model._diffusion_new_cache(2, PROMPT + 2 * CANVAS)
        with HostReads() as recorded:
            model.encode(prompt, torch.arange(PROMPT), valid, cache, end=PROMPT)
        reads["prompt pass"] = recorded.reads
        block = sampler.initial_block(2, CANVAS, "cpu")
        for step in range(3):  # the first without self-conditioning, then with it
            with HostReads() as recorded:
                logits = model.decode(block, positions, cache, padded=True, **sampler.forward_inputs())
                block = sampler.denoise(block, logits, None, None)[0]
            reads[f"step {step}"] = recorded.reads
        with HostReads() as recorded:
            model.encode(block, positions, torch.ones(2, CANVAS, dtype=torch.bool), cache, end=PROMPT + CANVAS)
        reads["canvas pass"] = recorded.reads
    assert cache.length == PROMPT + CANVAS
    assert all(not read for read in reads.values()), reads


def test_a_canvas_first_step_reads_one_value(model):
    """The loop's first step of a canvas (the prompt and the canvas fed): one read, the first fed column, from which
    the encoder's end follows (`cache.length`); the logits are those of the separate passes."""
    prompt, valid = prompt_inputs()
    canvas = torch.randint(0, 64, (2, CANVAS))
    width = PROMPT + CANVAS
    tokens, mask = torch.cat([prompt, canvas], 1), torch.cat([valid, torch.ones(2, CANVAS, dtype=torch.bool)], 1)
    positions = (torch.arange(width) - (~valid).sum(1, keepdim=True)).clamp(min=0)
    with torch.no_grad():
        cache = model._diffusion_new_cache(2, width)
        with HostReads() as recorded:
            logits = model._diffusion_forward(tokens, mask, positions, cache, torch.arange(width), None)
        assert recorded.reads == ["_local_scalar_dense"] and cache.length == PROMPT
        apart = model._diffusion_new_cache(2, width)
        model.encode(prompt, torch.arange(PROMPT), valid, apart, positions[:, :PROMPT])
        assert apart.length == PROMPT
        expected = model.decode(canvas, positions[:, PROMPT:], apart, padded=True)
    assert torch.equal(logits, expected)
