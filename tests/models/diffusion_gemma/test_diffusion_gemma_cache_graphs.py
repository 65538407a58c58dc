"""DiffusionGemma's CUDA graphs over the static encoder cache (`CacheGraphs`): the decoder's layers at every step and
the encoder's pass over each accepted canvas. On the CPU: the flags' defaults, that nothing is captured, the
runner's keys and invalidation, and the encoder's canvas pass run through the runner with a stand-in graph that
re-runs the function on its static inputs at each replay (what a replay must amount to: the pass reads nothing but
those inputs and the cache's buffers). On CUDA (`gpu`): the real graphs, bit for bit against the eager pass."""

from __future__ import annotations

import pytest
import torch

import hf_dllm  # noqa: F401  (registers the family)
from hf_dllm.modeling_diffusion_gemma import CacheGraphs, DiffusionGemmaForBlockDiffusion, DiffusionGemmaStaticCache


class RerunGraph:
    """A stand-in for a captured graph: `replay` runs the function again on the static inputs, into the output
    buffer the capture returned (`decoder_layers`, the test function: shaped as the first input; the encoder's pass
    returns nothing)."""

    def __init__(self, function, static, cache, constants):
        self.function, self.static, self.cache, self.constants = function, static, cache, constants
        self.output = None if function.__name__ == "encoder_layers" else torch.empty_like(static[0])

    def replay(self):
        result = self.function(*self.static, self.cache, *self.constants)
        if self.output is not None:
            self.output.copy_(result)


@pytest.fixture
def rerun_graphs(monkeypatch):
    """`CacheGraphs` applying on the CPU with `RerunGraph`s for graphs; yields the list of captures."""
    captures = []

    def capture(self, function, static, cache, constants):
        captures.append(RerunGraph(function, static, cache, constants))
        return captures[-1], captures[-1].output

    monkeypatch.setattr(CacheGraphs, "_capture", capture)
    monkeypatch.setattr(CacheGraphs, "applies", staticmethod(lambda model, x, cache: True))
    return captures


class Versioned:
    version = 0


def scaled(x, cache, factor):
    return x * factor + cache.version


def test_capture_flags_default_on_and_the_cpu_captures_nothing(gemma):
    """Both passes are captured by default where `CacheGraphs.applies`; on the CPU it never does, not even over
    the static cache: a generate() of two canvases (one canvas pass) captures nothing."""
    assert DiffusionGemmaForBlockDiffusion.capture_decoder is True
    assert DiffusionGemmaForBlockDiffusion.capture_encoder is True
    gemma.static_cache, gemma._generate_cache, gemma._graphs = True, None, None
    try:
        out = gemma.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=32, max_denoising_steps=2).sequences
        cache = gemma._generate_cache
        assert isinstance(cache, DiffusionGemmaStaticCache) and out.shape[1] == 5 + 32
        assert not CacheGraphs.applies(gemma, torch.zeros(1, 16, 64), cache)
    finally:
        gemma.static_cache, gemma._generate_cache = None, None
    assert gemma._graphs is None


def test_runner_keys_its_graphs_and_drops_them_with_the_cache_buffers(rerun_graphs):
    """The first call of a key runs eagerly and captures; later calls of the key copy their inputs in and replay;
    another shape, dtype or constant is another graph; another cache, or new buffers (`version`), drop them all."""
    runner, cache = CacheGraphs(), Versioned()
    first = torch.arange(6.0).view(2, 3)
    assert torch.equal(runner.run(scaled, cache, (first,), 2.0), first * 2)
    assert len(rerun_graphs) == 1 and runner.replays == {}
    second = first + 10
    replayed = runner.run(scaled, cache, (second,), 2.0)
    assert torch.equal(replayed, second * 2) and replayed is rerun_graphs[0].output
    assert len(rerun_graphs) == 1 and runner.replays == {"scaled": 1}
    runner.run(scaled, cache, (first.double(),), 2.0)
    runner.run(scaled, cache, (first[:1],), 2.0)
    runner.run(scaled, cache, (first,), 3.0)
    assert len(rerun_graphs) == len(runner.entries) == 4
    cache.version = 1
    assert torch.equal(runner.run(scaled, cache, (second,), 2.0), second * 2 + 1)
    assert len(rerun_graphs) == 5 and len(runner.entries) == 1
    runner.run(scaled, Versioned(), (second,), 2.0)  # another cache (same version)
    assert len(rerun_graphs) == 6 and len(runner.entries) == 1


def encode_canvases_both_ways(model, device, batch=2, canvases=3):
    """Encode a prompt (eager, 21 columns) then `canvases` canvases into two static caches, one with
    `capture_encoder` and one without, asserting after each pass that their K/V, columns, valid and length are
    equal exactly. Left padding in the first row; positions `(B, T)` as generate() gives them."""
    text, canvas = model.config.text_config, model.config.canvas_length
    width = 21 + canvases * canvas
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(3, text.vocab_size, (batch, width), device=device, generator=generator)
    valid = torch.ones(batch, width, dtype=torch.bool, device=device)
    valid[0, :4] = False
    positions = (torch.arange(width, device=device) - (~valid).sum(1, keepdim=True)).clamp(min=0)
    caches = [DiffusionGemmaStaticCache(text, width, canvas) for _ in range(2)]
    try:
        for start, end in [(0, 21)] + [(21 + i * canvas, 21 + (i + 1) * canvas) for i in range(canvases)]:
            columns = torch.arange(start, end, device=device)
            for cache, captured in zip(caches, (True, False), strict=True):
                model.capture_encoder = captured
                with torch.no_grad():
                    model.encode(tokens[:, start:end], columns, valid[:, start:end], cache, positions[:, start:end])
            for store in ("keys", "values", "columns", "valid"):
                for layer, (mine, eager) in enumerate(
                    zip(getattr(caches[0], store), getattr(caches[1], store), strict=True)
                ):
                    assert torch.equal(mine, eager), (store, layer, start)
            assert caches[0].length == caches[1].length == end
    finally:
        model.capture_encoder = True
    return caches


def generate_both_ways(model, device):
    """generate() of 3 canvases with the encoder's canvas pass captured and eager (the decoder's as the model
    has it), same seed: the sequences and step counts, captured run first."""
    prompt = torch.randint(3, 300, (2, 21), device=device, generator=torch.Generator(device=device).manual_seed(1))
    runs = []
    try:
        for captured in (True, False):
            model.capture_encoder = captured
            torch.manual_seed(5)
            runs.append(model.generate(prompt, max_new_tokens=48, max_denoising_steps=6, return_dict_in_generate=True))
    finally:
        model.capture_encoder = True
    assert runs[0].sequences.shape[1] == 21 + 48  # three canvases: the first two encoded (capture, replay)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].nfe == runs[1].nfe


def test_encoder_canvas_pass_through_the_runner_equals_the_eager_pass(gemma, rerun_graphs):
    """The canvas passes through the runner (eager first, then replays from the static inputs) write what the
    eager passes write; the prompt's pass (21 columns) is not captured."""
    gemma._graphs = None
    encode_canvases_both_ways(gemma, "cpu")
    assert [graph.function.__name__ for graph in rerun_graphs] == ["encoder_layers"]
    assert gemma._graphs.replays == {"encoder_layers": 2}
    gemma._graphs = None


def test_generate_with_the_encoder_pass_through_the_runner(gemma, rerun_graphs):
    """generate() over the static cache with the encoder's canvas pass through the runner decodes the eager
    run's tokens; the decoder stays eager here (`capture_decoder` off)."""
    gemma.static_cache, gemma._generate_cache, gemma._graphs, gemma.capture_decoder = True, None, None, False
    try:
        generate_both_ways(gemma, "cpu")
        assert gemma._graphs.replays == {"encoder_layers": 1}
    finally:
        gemma.static_cache, gemma._generate_cache, gemma._graphs, gemma.capture_decoder = None, None, None, True


@pytest.mark.gpu
def test_cuda_encoder_canvas_graph_is_the_eager_pass_bit_for_bit(gemma_cuda_bf16):
    """On CUDA the canvas pass captured once and replayed twice writes the eager pass's K/V, columns and valid
    exactly (same kernels), the ring of the sliding layers (7 slots) overwritten at every canvas."""
    model = gemma_cuda_bf16
    model._graphs = None
    encode_canvases_both_ways(model, "cuda")
    assert [key[0] for key in model._graphs.entries] == ["encoder_layers"]
    assert model._graphs.replays == {"encoder_layers": 2}


@pytest.mark.gpu
def test_cuda_generate_with_encoder_graph_equals_eager(gemma_cuda_bf16, monkeypatch):
    """generate() of 3 canvases on CUDA with the encoder's canvas pass replayed from its graph decodes the eager
    run's tokens (decoder graphs on in both); a second call reuses the cache and replays the captured graphs, and
    captures the prompt's pass, which the third replays. (The canvas passes apart: `fuse_canvas_passes` off; the
    pair pass' own test is in test_diffusion_gemma_fused_canvas_pass.py.)"""
    model = gemma_cuda_bf16
    monkeypatch.setattr(type(model), "fuse_canvas_passes", False)
    model._graphs, model._generate_cache = None, None
    generate_both_ways(model, "cuda")
    replays = dict(model._graphs.replays)
    assert replays.get("encoder_layers") == 1 and replays.get("decoder_layers", 0) > 0
    generate_both_ways(model, "cuda")
    assert model._graphs.replays["encoder_layers"] == 3  # the same graph: captured once for both calls
    # The prompt's pass: eager at the first call, captured at the second, replayed at the third (same tokens).
    # A key ends with its inputs' (shape, dtype, device); the first input is x (B, C, hidden).
    widths = sorted(key[-1][0][0][1] for key in model._graphs.entries if key[0] == "encoder_layers")
    assert widths == sorted([21, model.config.canvas_length])
    generate_both_ways(model, "cuda")
    assert model._graphs.replays["encoder_layers"] == 6


def test_a_shapes_first_pass_is_only_counted_and_at_most_limit_shapes_are_admitted():
    """`seen_before`: a shape's first sight is counted (False: the caller runs it eagerly), its second admits it
    (True: `run` captures it) while fewer than `limit` shapes were admitted; a captured shape stays admitted; new
    cache buffers forget both."""
    runner, cache = CacheGraphs(), Versioned()
    first, second = torch.zeros(2, 3), torch.zeros(2, 5)
    assert not runner.seen_before(scaled, cache, (first,), 1)
    assert runner.seen_before(scaled, cache, (first,), 1)
    runner.entries[runner._key(scaled, (first,))] = "captured"
    assert runner.seen_before(scaled, cache, (first,), 1)
    assert not runner.seen_before(scaled, cache, (second,), 1)
    assert not runner.seen_before(scaled, cache, (second,), 1)  # over the limit: stays eager
    cache.version = 1
    assert not runner.seen_before(scaled, cache, (second,), 1) and runner.seen_before(scaled, cache, (second,), 1)


def test_prompt_passes_are_captured_from_their_shapes_second_call(gemma, rerun_graphs):
    """generate() three times on one prompt: its encoder pass runs eagerly at the first call, is captured at the
    second and replayed at the third (the canvas pass captured at the first call, replayed after); every call
    decodes the eager run's tokens."""
    gemma.static_cache, gemma._generate_cache, gemma._graphs, gemma.capture_decoder = True, None, None, False
    prompt = torch.randint(3, 300, (2, 21), generator=torch.Generator().manual_seed(1))

    def generate(captured):
        gemma.capture_encoder = captured
        torch.manual_seed(5)
        return gemma.generate(prompt, max_new_tokens=32, max_denoising_steps=3).sequences

    try:
        eager = generate(False)
        for call in range(3):
            assert torch.equal(generate(True), eager), call
            widths = [graph.static[0].shape[1] for graph in rerun_graphs]
            assert widths == [[16], [16, 21], [16, 21]][call]  # the canvas', then the prompt's capture
        assert gemma._graphs.replays == {"encoder_layers": 3}  # canvas: 2 calls; prompt: the third
    finally:
        gemma.static_cache, gemma._generate_cache, gemma._graphs = None, None, None
        gemma.capture_decoder = gemma.capture_encoder = True
