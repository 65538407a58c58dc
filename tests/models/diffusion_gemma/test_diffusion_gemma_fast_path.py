"""DiffusionGemma's fast path: the grouped expert GEMMs (no host synchronisation) against the loop that is exact
against transformers, per layer and through the whole model's logits; the static encoder cache decoding
transformers' tokens; on CUDA (`gpu`), the decoder's layers replayed from CUDA graphs against the eager step."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import hf_dllm  # noqa: F401  (registers the family)
from hf_dllm import decoding_diffusion_gemma
from hf_dllm.decoding_diffusion_gemma import EntropyBoundSampler
from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaStaticCache
from tests.models.diffusion_gemma.conftest import GEMMA_DIR


def _set_experts(model, implementation):
    for layer in model.model.decoder.layers:
        layer.experts.implementation = implementation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_the_loop(gemma, dtype):
    experts = copy.deepcopy(gemma.model.decoder.layers[0].experts).to(dtype)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, experts.gate_up_proj.shape[-1], generator=generator).to(dtype)
    index = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:2] for _ in range(24)])
    index[:5] = torch.tensor([0, 1])  # an expert nobody else picks stays empty in the grouped product
    weights = torch.rand(24, 2, generator=generator)
    with torch.no_grad():
        experts.implementation = "loop"
        loop = experts(x, index, weights)
        experts.implementation = "grouped"
        grouped = experts(x, index, weights)
    tolerance = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(grouped, loop, **tolerance)
    assert grouped.abs().max() > 0


@pytest.mark.parametrize("implementation", ["loop", "grouped"])
def test_off_rank_routes_give_this_ranks_share(gemma, implementation):
    """Under transformers' expert parallelism a rank holding experts [E/2, E) gets its routes by local id and the
    other rank's as id `num_experts` with weight 0 (`_is_expert_parallel`): the grouped path computes nothing for
    those (torch's grouped GEMM leaves their rows unwritten) and must give exactly the loop's sum over this rank's
    experts, which equals all experts with the other rank's weights zeroed."""
    full = copy.deepcopy(gemma.model.decoder.layers[0].experts)
    half = full.num_experts // 2
    share = copy.deepcopy(full)
    share.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[half:].clone())
    share.down_proj = torch.nn.Parameter(full.down_proj[half:].clone())
    share.num_experts, share._is_expert_parallel = half, True
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24, full.gate_up_proj.shape[-1], generator=generator)
    index = torch.stack([torch.randperm(full.num_experts, generator=generator)[:2] for _ in range(24)])
    index[:4] = torch.tensor([0, 1])  # tokens with no expert on this rank
    weights = torch.rand(24, 2, generator=generator)
    off_rank = index < half
    local_index = torch.where(off_rank, half, index - half)
    with torch.no_grad():
        full.implementation, share.implementation = "loop", implementation
        expected = full(x, index, weights.masked_fill(off_rank, 0.0))
        got = share(x, local_index, weights.masked_fill(off_rank, 0.0))
    assert share.chosen_implementation(x) == implementation
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert bool((got[:4] == 0).all()) and got[4:].abs().max() > 0


def test_grouped_experts_model_logits(gemma):
    expected = load_file(GEMMA_DIR / "expected.safetensors")
    inputs = dict(
        input_ids=expected["logits.input_ids"],
        decoder_input_ids=expected["logits.decoder_input_ids"],
        self_conditioning_logits=expected["logits.self_conditioning_logits"],
    )
    try:
        _set_experts(gemma, "grouped")
        with torch.no_grad():
            logits = gemma(**inputs).logits
    finally:
        _set_experts(gemma, None)
    torch.testing.assert_close(logits, expected["logits.expected_sc"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation", ["cutlass", "triton"])  # triton: not on CPU tensors outside the interpreter
def test_bad_experts_implementation_is_refused(gemma, implementation):
    experts = gemma.model.decoder.layers[0].experts
    experts.implementation = implementation
    try:
        with pytest.raises(ValueError, match="implementation"):
            experts(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))
    finally:
        experts.implementation = None


CASES = {case["name"]: case for case in json.loads((GEMMA_DIR / "cases.json").read_text())["cases"]}


def generate_case(model, name: str, expected: dict):
    """`model.generate()` on fixture case `name` (its prompt, mask, kwargs and seed): the `generate()` output."""
    case = CASES[name]
    kwargs = dict(case["kwargs"])
    if case["attention_mask"]:
        kwargs["attention_mask"] = expected[f"attention_mask.{case['attention_mask']}"]
    torch.manual_seed(case["seed"])
    return model.generate(expected[f"prompt.{case['prompt']}"], return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("name", ["p21.g32.defaults.s3", "b2.g32.eos.s1"])
def test_static_cache_reproduces_transformers_cases(gemma, name):
    """The static cache (ring buffers for the sliding layers: window 8, prompts of 21 columns wrap them; empty
    slots masked) decodes transformers' tokens, as the dynamic cache does."""
    expected = load_file(GEMMA_DIR / "expected.safetensors")
    caches = []
    original = gemma._diffusion_new_cache

    def spy(*args, **kw):
        caches.append(original(*args, **kw))
        return caches[-1]

    gemma.static_cache, gemma._diffusion_new_cache = True, spy
    try:
        out = generate_case(gemma, name, expected)
    finally:
        gemma.static_cache = None
        del gemma._diffusion_new_cache
    assert isinstance(caches[0], DiffusionGemmaStaticCache)
    assert torch.equal(out.sequences, expected[f"case.{name}"])


def test_generate_reuses_its_static_cache_and_reproduces_transformers_cases(gemma):
    """generate()'s static cache is the model's across calls (so captured decoder graphs replay): emptied, it
    decodes transformers' tokens again, also for a call with fewer columns (p21.g32 then p5.g16: more slots than
    columns, the empty ones masked); another batch size gets a new cache; the serving engine's (max_positions)
    is never the held one."""
    expected = load_file(GEMMA_DIR / "expected.safetensors")
    gemma.static_cache, gemma._generate_cache = True, None
    caches = []
    try:
        for name in ("p21.g32.defaults.s3", "p21.g32.defaults.s3", "p5.g16.defaults.s1", "b2.g32.eos.s1"):
            out = generate_case(gemma, name, expected)
            assert torch.equal(out.sequences, expected[f"case.{name}"]), name
            caches.append((gemma._generate_cache, gemma._generate_cache.version))
        assert caches[0] == caches[1] == caches[2]  # the same object, buffers never reallocated
        assert caches[3][0] is not caches[0][0]
        served = gemma._diffusion_new_cache(1, 16, max_positions=64)
        assert served is not gemma._generate_cache
    finally:
        gemma.static_cache, gemma._generate_cache = None, None


@pytest.mark.parametrize("mask_kind", ["none", "keys", "queries"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
def test_gemm_attention_equals_sdpa(mask_kind, heads):
    """`gemm_attention` (grouped-query heads, key or per-query masks) equals float32 SDPA up to rounding."""
    from hf_dllm.modeling_diffusion_gemma import gemm_attention

    torch.manual_seed(0)
    (query_heads, kv_heads), batch, length, keys, dim = heads, 2, 5, 9, 16
    query = torch.randn(batch, query_heads, length, dim)
    key, value = torch.randn(2, batch, kv_heads, keys, dim)
    mask = {
        "none": None,
        "keys": torch.rand(batch, 1, 1, keys) > 0.3,
        "queries": torch.rand(batch, 1, length, keys) > 0.3,
    }[mask_kind]
    if mask is not None:
        mask[..., -1] = True  # every query sees a key
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=0.5, enable_gqa=query_heads != kv_heads
    )
    torch.testing.assert_close(gemm_attention(query, key, value, mask, scale=0.5), expected, rtol=1e-5, atol=1e-5)


def test_static_cache_refuses_columns_past_its_capacity(gemma):
    cache = DiffusionGemmaStaticCache(gemma.config.text_config, capacity=8)
    with pytest.raises(ValueError, match="holds 8 columns"):
        gemma.encode(torch.ones(1, 9, dtype=torch.long), torch.arange(9), torch.ones(1, 9, dtype=torch.bool), cache)


@pytest.mark.gpu
def test_cuda_captured_decoder_step_equals_eager(gemma_cuda_bf16):
    """A denoising step (decoder + sampler) with the decoder's layers replayed from a CUDA graph equals the eager
    step: logits, and with the same injected draws (same seed) the accepted set's next canvas, at two canvases
    (the encoder rewrites the static cache in place between them)."""
    model = gemma_cuda_bf16
    text, canvas = model.config.text_config, model.config.canvas_length
    cache = model._diffusion_new_cache(2, 64)
    assert isinstance(cache, DiffusionGemmaStaticCache)
    generator = torch.Generator(device="cuda").manual_seed(0)
    start = 0
    for width in (21, canvas):  # the prompt, then a canvas
        tokens = torch.randint(3, text.vocab_size, (2, width), device="cuda", generator=generator)
        columns = torch.arange(start, start + width, device="cuda")
        model.encode(tokens, columns, torch.ones(2, width, dtype=torch.bool, device="cuda"), cache)
        start += width
        block = torch.randint(3, text.vocab_size, (2, canvas), device="cuda", generator=generator)
        positions = torch.arange(start, start + canvas, device="cuda")
        signal = torch.randn(2, canvas, text.vocab_size, device="cuda", generator=generator)
        results = {}
        for captured in (False, True, True):  # eager, capture, replay
            model.capture_decoder = captured
            # The PyTorch sampler (it takes the capped logits `decode` gives by default; the fused one is tested in
            # test_diffusion_gemma_fused_sampler_gpu.py).
            sampler = EntropyBoundSampler(text.vocab_size, 8, 0.5, 0.4, 0.8, 1, 0.005, fused=False)
            sampler.initial_block(2, canvas, torch.device("cuda"))
            sampler.step_index = 3
            with torch.no_grad():
                logits = model.decode(block, positions, cache, signal, padded=False)
                kept = logits.clone()  # the sampler divides its logits in place
                torch.manual_seed(7)
                next_canvas = sampler.denoise(block, logits, None, None)[0]
            results.setdefault(captured, []).append((kept, next_canvas))
        model.capture_decoder = True
        eager = results[False][0]
        for logits, next_canvas in results[True]:
            torch.testing.assert_close(logits, eager[0], rtol=0, atol=1e-5)
            assert torch.equal(next_canvas, eager[1])
    assert model._graphs is not None and model._graphs.entries


@pytest.mark.gpu
def test_cuda_generate_with_graphs_equals_eager(gemma_cuda_bf16):
    """generate() on CUDA (static cache, grouped experts, captured decoder layers) decodes the eager run's tokens
    under the same seed (the random draws are eager in both)."""
    model = gemma_cuda_bf16
    prompt = torch.randint(3, 300, (2, 21), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    runs = []
    for captured in (False, True):
        model.capture_decoder = captured
        torch.manual_seed(5)
        runs.append(model.generate(prompt, max_new_tokens=48, max_denoising_steps=6, return_dict_in_generate=True))
    model.capture_decoder = True
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].nfe == runs[1].nfe


@pytest.mark.parametrize("name", ["p21.g32.defaults.s3", "b2.g32.eos.s1"])
def test_row_chunked_sampler_and_head_reproduce_transformers_cases(gemma, monkeypatch, name):
    """Chunks of 5 rows (of a 320-token vocabulary) in the sampler (softmax, multinomial, entropy), the
    self-conditioning signal and the soft-capped head: on the CPU the draws and sums are the unchunked ones, so
    transformers' tokens come out (on a GPU the chunks bound the float32 temporaries of large batches)."""
    monkeypatch.setattr(decoding_diffusion_gemma, "ROW_CHUNK_ELEMENTS", 320 * 5)
    assert len(decoding_diffusion_gemma.row_chunks(32, 320)) == 7
    expected = load_file(GEMMA_DIR / "expected.safetensors")
    out = generate_case(gemma, name, expected)
    assert torch.equal(out.sequences, expected[f"case.{name}"])


def test_fused_sampler_is_refused_where_its_kernels_cannot_run():
    """`fused=True` on CPU tensors outside Triton's interpreter: a ValueError naming `fused` before any compute;
    `fused=None` takes the PyTorch path there; a bad value is refused."""
    sampler = EntropyBoundSampler(320, 4, 0.1, 0.4, 0.8, 1, 0.005, fused=None)
    sampler.initial_block(1, 16, torch.device("cpu"))
    assert not sampler.fused_active and "self_conditioning_logits" in sampler.forward_inputs()
    if decoding_diffusion_gemma.TRITON_AVAILABLE:
        with pytest.raises(ValueError, match="fused"):
            EntropyBoundSampler(320, 4, 0.1, 0.4, 0.8, 1, 0.005, fused=True).initial_block(1, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="fused"):
        EntropyBoundSampler(320, 4, 0.1, 0.4, 0.8, 1, 0.005, fused="yes")


@pytest.mark.parametrize("name, steps", [("b2.g16.cold.s1", None), ("b2.g16.cold.s1", 3)])
def test_lagged_stop_check_runs_at_most_one_more_forward(gemma, monkeypatch, name, steps):
    """`stop_check_lag` 1 (what CUDA uses: the next step is queued before the host reads whether rows are left),
    forced on the CPU: the canvas decodes the same tokens (transformers' for the fixture case, whose rows stop
    early), each row's forwards are the same, and the run makes one forward more when rows stopped early, none
    when the step limit ended the canvas."""
    expected = load_file(GEMMA_DIR / "expected.safetensors")
    case = CASES[name]
    kwargs = dict(case["kwargs"], attention_mask=expected[f"attention_mask.{case['attention_mask']}"])
    if steps is not None:
        kwargs["max_denoising_steps"] = steps
    runs = []
    for lag in (0, 1):
        monkeypatch.setattr(EntropyBoundSampler, "stop_check_lag", lambda self, device, lag=lag: lag)
        torch.manual_seed(case["seed"])
        runs.append(gemma.generate(expected[f"prompt.{case['prompt']}"], return_dict_in_generate=True, **kwargs))
    plain, lagged = runs
    if steps is None:
        assert torch.equal(plain.sequences, expected[f"case.{name}"]) and plain.nfe == case["nfe"] < 24
    assert torch.equal(plain.sequences, lagged.sequences)
    assert torch.equal(plain.nfe_per_row, lagged.nfe_per_row)
    assert lagged.nfe == plain.nfe + (1 if steps is None else 0), (plain.nfe, lagged.nfe)
