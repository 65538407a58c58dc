"""An accepted canvas' encoder pass and the next canvas' first decoder pass as one pass through the layers
(`DiffusionGemmaForBlockDiffusion.encode_and_decode`, `fuse_canvas_passes`; each layer's weights read once for
both):

- where it applies (`fuses_canvas_passes`): switched on, a canvas' worth of columns to encode, a static cache, the
  fused kernels, no autograd;
- `generate()` over a static cache switched on hands it, at every canvas after the first, what the two passes
  apart take (the same tokens and forwards);
- in Triton's interpreter (CPU, float32, `HF_DLLM_KERNELS=triton`; a subprocess beside the in-process tests): the
  fixture model's pair pass (a left-padded row, a sliding ring that wraps; the Triton experts summed in the layers'
  end kernels) gives the two passes' logits and leaves the same cache;
- on CUDA (bfloat16): the pair pass within 2x the two passes' error against float32, and its CUDA graph's replay
  equal to its eager call.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion, DiffusionGemmaStaticCache
from tests.conftest import FIXTURES, interpreter_job

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"


def test_generate_hands_the_pair_what_the_two_passes_take(gemma, monkeypatch):
    """`generate()` over a static cache with the pair pass applying: at every canvas after the first, the loop's
    step goes through `encode_and_decode` with the arguments that, given to `encode` then `decode`, decode the
    tokens and forwards of the two passes apart (the pair itself stands in as those two calls here: its kernels
    run in the interpreter test below)."""
    canvas = gemma.config.canvas_length
    calls = []

    def pair(self, ids, columns, valid, cache, positions, end, following, following_positions, padded, **inputs):
        calls.append((ids.shape, int(columns[0]), end, padded, sorted(inputs)))
        self.encode(ids, columns, valid, cache, positions, end)
        return self.decode(following, following_positions, cache, padded=padded, **inputs)

    monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "static_cache", True)
    monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "encode_and_decode", pair)
    monkeypatch.setattr(
        DiffusionGemmaForBlockDiffusion,
        "fuses_canvas_passes",
        lambda self, ids, cache: (
            self.fuse_canvas_passes and ids.shape[1] == canvas and isinstance(cache, DiffusionGemmaStaticCache)
        ),
    )
    ids = torch.randint(3, gemma.config.text_config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    runs = {}
    for fuse in (False, True):
        monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "fuse_canvas_passes", fuse)
        calls.clear()
        torch.manual_seed(3)
        out = gemma.generate(
            ids, attention_mask=mask, max_new_tokens=3 * canvas, max_denoising_steps=2, return_dict_in_generate=True
        )
        runs[fuse] = (out.sequences, int(out.nfe), list(calls))
    assert runs[False][2] == [] and len(runs[True][2]) == 2, runs[True][2]  # canvases 2 and 3
    for index, (shape, first, end, padded, inputs) in enumerate(runs[True][2]):
        assert shape == (2, canvas) and first == 5 + index * canvas and end == first + canvas and padded
        assert inputs == ["self_conditioning_logits"]  # the CPU sampler's (None at a canvas' first step)
    assert torch.equal(runs[False][0], runs[True][0]) and runs[False][1] == runs[True][1]


def test_fused_canvas_passes_only_where_they_apply(gemma, monkeypatch):
    """`fuses_canvas_passes`: on by default, only for a canvas' worth of columns over a static cache where the
    fused kernels run and autograd is off; off with `fuse_canvas_passes` off."""
    from hf_dllm import modeling_diffusion_gemma

    text, canvas = gemma.config.text_config, gemma.config.canvas_length
    static = DiffusionGemmaStaticCache(text, capacity=64, canvas_length=canvas)
    ids = torch.zeros(1, canvas, dtype=torch.long)
    monkeypatch.setattr(modeling_diffusion_gemma, "use_fused_kernels", lambda tensor: True)
    with torch.no_grad():
        assert gemma.fuses_canvas_passes(ids, static)
        monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "fuse_canvas_passes", False)
        assert not gemma.fuses_canvas_passes(ids, static)
        monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "fuse_canvas_passes", True)
        assert not gemma.fuses_canvas_passes(ids[:, :-1], static)  # a prompt's columns, not a canvas'
        assert not gemma.fuses_canvas_passes(ids, gemma.new_encoder_cache())
        monkeypatch.setattr(modeling_diffusion_gemma, "use_fused_kernels", lambda tensor: False)
        assert not gemma.fuses_canvas_passes(ids, static)
    monkeypatch.setattr(modeling_diffusion_gemma, "use_fused_kernels", lambda tensor: True)
    with torch.enable_grad():
        assert not gemma.fuses_canvas_passes(ids, static)


PAIR_SCRIPT = textwrap.dedent(
    """
    import torch
    from transformers import AutoModel
    import hf_dllm
    from hf_dllm import kernels, modeling_diffusion_gemma
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion, DiffusionGemmaStaticCache

    model = AutoModel.from_pretrained(GEMMA_DIR).eval()
    text, canvas = model.config.text_config, model.config.canvas_length
    kernels.set_kernel_mode("triton")
    torch.manual_seed(0)
    batch, prompt_len = 2, 6  # prompt + canvas columns wrap the sliding window's ring
    assert prompt_len + canvas > text.sliding_window
    prompt = torch.randint(3, text.vocab_size, (batch, prompt_len))
    valid = torch.ones(batch, prompt_len, dtype=torch.bool)
    valid[1, :2] = False
    accepted, following = (torch.randint(3, text.vocab_size, (batch, canvas)) for _ in range(2))
    columns = torch.arange(prompt_len, prompt_len + canvas)
    every = torch.ones(batch, canvas, dtype=torch.bool)
    pairs = []
    forward_pair = modeling_diffusion_gemma.DiffusionGemmaLayer.forward_pair
    modeling_diffusion_gemma.DiffusionGemmaLayer.forward_pair = (
        lambda self, *a, **k: (pairs.append(1), forward_pair(self, *a, **k))[1]
    )


    def run(fused):
        cache = DiffusionGemmaStaticCache(text, capacity=64, canvas_length=canvas)
        with torch.no_grad():
            model.encode(prompt, torch.arange(prompt_len), valid, cache)
            end = prompt_len + canvas
            if fused:
                logits = model.encode_and_decode(
                    accepted, columns, every, cache, columns.expand(batch, -1), end, following, columns + canvas, True
                )
            else:
                model.encode(accepted, columns, every, cache, columns.expand(batch, -1), end)
                logits = model.decode(following, columns + canvas, cache, padded=True)
        return logits, cache


    for layer in model.model.decoder.layers:
        layer.experts.implementation = "triton"  # (the pairs' outputs summed in each half's end kernel)
    (want, want_cache), (got, cache) = run(False), run(True)
    assert len(pairs) == text.num_hidden_layers, pairs
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max().item()
    assert cache.length == want_cache.length == prompt_len + canvas
    for layer in range(text.num_hidden_layers):
        for mine, theirs in ((cache.storage_keys, want_cache.storage_keys),
                             (cache.storage_values, want_cache.storage_values)):
            assert (mine[layer] - theirs[layer]).abs().max() < 1e-5, layer
        assert torch.equal(cache.columns[layer], want_cache.columns[layer])
        assert torch.equal(cache.valid[layer], want_cache.valid[layer])

    print("ok")
    """
)

PAIR_RUN = interpreter_job(
    {"pair": f"GEMMA_DIR = {str(GEMMA_DIR)!r}\n" + PAIR_SCRIPT}, timeout=600, HF_DLLM_KERNELS="triton"
)


@PAIR_RUN.used_by
def test_pair_pass_equals_the_two_passes_in_the_interpreter():
    pytest.importorskip("triton", reason="the `triton` extra is not installed")
    done = PAIR_RUN.results()["pair"]
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


@pytest.mark.gpu
def test_cuda_pair_pass_within_bf16_of_the_two_passes_and_replayed_equal(gemma_cuda_bf16):
    """The fixture model in bfloat16 on CUDA (Triton experts, static cache): the pair pass' logits against a float32
    copy's two passes err within 2x the bfloat16 two passes' error; captured and replayed, they equal the eager
    pair pass'."""
    from transformers import AutoModel

    model = gemma_cuda_bf16
    reference = AutoModel.from_pretrained(GEMMA_DIR, dtype=torch.float32).eval().cuda()
    text, canvas = model.config.text_config, model.config.canvas_length
    generator = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(3, text.vocab_size, (2, 6), device="cuda", generator=generator)
    accepted, following = (
        torch.randint(3, text.vocab_size, (2, canvas), device="cuda", generator=generator) for _ in range(2)
    )
    valid = torch.ones(2, 6, dtype=torch.bool, device="cuda")
    valid[1, :2] = False
    columns = torch.arange(6, 6 + canvas, device="cuda")
    every = torch.ones(2, canvas, dtype=torch.bool, device="cuda")

    def two_passes(m):
        cache = m._diffusion_new_cache(2, 6 + 2 * canvas)
        m.encode(prompt, torch.arange(6, device="cuda"), valid, cache)
        m.encode(accepted, columns, every, cache, columns.expand(2, -1), 6 + canvas)
        return m.decode(following, columns + canvas, cache, padded=True).float()

    cache = model._diffusion_new_cache(2, 6 + 2 * canvas)  # one cache: its graphs live as long as its buffers
    fused = []
    with torch.no_grad():
        exact, apart = two_passes(reference), two_passes(model)
        model._graphs = None
        for captured in (False, True, True):  # eager, capture (its first call runs eagerly), replay
            model.capture_decoder = model.capture_encoder = captured
            cache.set_length(0)
            model.encode(prompt, torch.arange(6, device="cuda"), valid, cache, end=6)
            logits = model.encode_and_decode(
                accepted, columns, every, cache, columns.expand(2, -1), 6 + canvas, following, columns + canvas, True
            )
            fused.append(logits.float().clone())
        replays = dict(model._graphs.replays)
    model.capture_decoder = model.capture_encoder = True
    model._graphs = None
    assert replays.get("encoder_decoder_layers") == 1, replays
    bar = 2 * (apart - exact).abs().max().item() + 1e-4
    assert (fused[0] - exact).abs().max().item() <= bar
    for logits in fused[1:]:
        torch.testing.assert_close(logits, fused[0], rtol=0, atol=1e-5)
