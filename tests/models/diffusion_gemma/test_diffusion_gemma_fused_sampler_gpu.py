"""DiffusionGemma's fused path on CUDA: the fused sampler (`triton_diffusion_gemma.fused_sample`) against the PyTorch
sampler on a bfloat16 LM head of the real vocabulary (entropy within 2x of PyTorch's own bfloat16 error against a
float32 head, the argmax PyTorch's but for near ties, every sample the inverse CDF at its row's Philox uniform within
rounding), replayed from a CUDA graph with the seed rewritten on the device, its draws' distribution (chi-square,
chunked and not), the Triton experts against torch's grouped GEMM, the dense MLP's GELU gate kernel against
PyTorch's ops, and generate() on the fused path (seeded, well formed, graphs or not)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

import hf_dllm  # noqa: F401  (registers the family)
from hf_dllm.decoding_diffusion_gemma import EntropyBoundSampler, token_entropy
from hf_dllm.triton_diffusion_gemma import fused_sample
from tests.conftest import FIXTURES
from tests.models.diffusion_gemma.sampler_reference import inverse_cdf, philox_uniforms, within_its_interval
from tests.models.diffusion_gemma.sampler_reference import processed as kernel_z

pytestmark = pytest.mark.gpu
pytest.importorskip("triton", reason="the `triton` extra is not installed")

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"
CAP, TEMPERATURE = 30.0, 0.6


def processed(raw: torch.Tensor) -> torch.Tensor:
    """The PyTorch path's z from a head output: float32, soft cap, temperature (in place, as the model and sampler)."""
    return raw.float().div_(CAP).tanh_().mul_(CAP).div_(TEMPERATURE)


def test_fused_sample_against_pytorch_on_the_real_vocabulary():
    """A canvas of 256 positions over 262,144 tokens from a bfloat16 head: the fused entropy's error against the
    float32 head's is within 2x of PyTorch's (same bfloat16 head output, float32 sampler); the argmax is PyTorch's
    wherever PyTorch's top two differ by more than float32 rounding; the probabilities are softmax(z) in bf16."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(256, 512, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(262_144, 512, device="cuda", generator=generator) * 0.08).bfloat16()
    # Sharper positions (a larger scale) beside flat ones, as a denoising canvas has.
    hidden[:64] *= 8
    raw = (hidden @ weight.T)[None]  # (1, 256, V) bf16: what the model's head gives
    exact = processed((hidden.float() @ weight.float().T)[None])
    z = processed(raw)
    reference_entropy = token_entropy(exact)
    torch_error = (token_entropy(z) - reference_entropy).abs()
    probabilities = torch.empty_like(raw)
    sample, argmax, entropy = fused_sample(
        raw, torch.tensor([TEMPERATURE], device="cuda"), torch.tensor([11], device="cuda"), CAP, probabilities
    )
    fused_error = (entropy - reference_entropy).abs()
    assert fused_error.max() <= 2 * torch_error.max() + 1e-6, (fused_error.max(), torch_error.max())
    assert fused_error.mean() <= 2 * torch_error.mean() + 1e-7, (fused_error.mean(), torch_error.mean())
    top2 = z.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4
    assert torch.equal(argmax[clear], z.argmax(-1)[clear])
    torch.testing.assert_close(probabilities.float(), z.softmax(-1).bfloat16().float(), rtol=0.02, atol=1e-6)
    # The draw: the inverse CDF of softmax(z) at the row's Philox uniform, up to 5e-5 of cumulative probability
    # (float32 sums of 8,192-column chunks, the GPU's exp; a flat row's columns are 4e-6 wide, so there it places
    # the sample within a few columns, a peaked row's exactly), and never a column of probability 0.
    z_kernel, u = kernel_z(raw, CAP, TEMPERATURE), philox_uniforms(11, 256)
    assert within_its_interval(z_kernel, u, sample.view(-1), 5e-5).all()
    draw, near = inverse_cdf(z_kernel, u, 5e-5)
    assert torch.equal(sample.view(-1)[~near], draw[~near]), int(near.sum())


def test_fused_sample_replays_from_a_cuda_graph():
    """fused_sample captured in a CUDA graph reads its seed and temperature on the device: a replay after both are
    rewritten in place draws what an eager call with the new values draws, and its argmax, entropy and
    probabilities are the eager call's too."""
    raw = (torch.randn(2, 256, 32_768, device="cuda") * 3).bfloat16()
    seed, temperature = torch.tensor([5], device="cuda"), torch.tensor([0.9], device="cuda")
    probabilities = torch.empty_like(raw)
    fused_sample(raw, temperature, seed, CAP, probabilities)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_sample(raw, temperature, seed, CAP, probabilities)
    seed.fill_(123)
    temperature.fill_(0.5)
    graph.replay()
    eager_probabilities = torch.empty_like(raw)
    eager = fused_sample(raw, torch.tensor([0.5], device="cuda"), torch.tensor([123], device="cuda"), CAP,
                         eager_probabilities)  # fmt: skip
    for replayed, wanted in zip(captured, eager, strict=True):
        assert torch.equal(replayed, wanted)
    assert torch.equal(probabilities, eager_probabilities)
    first = fused_sample(raw, torch.tensor([0.5], device="cuda"), torch.tensor([5], device="cuda"), CAP)[0]
    assert not torch.equal(first, eager[0])  # the rewritten seed was read


def softmax_case(kind: str) -> tuple[torch.Tensor, int | None, int | None]:
    """(logits `(64,)`, splits, block) of a draw-distribution case: `spread` (one chunk, the default blocks), `one
    chunk` (chunks of 16 columns, 94% of the mass in the third), `last column` (chunks of 16, the vocabulary's last
    column the likeliest)."""
    logits = torch.linspace(-2.0, 2.0, 64)[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    if kind == "spread":
        return logits, None, None
    if kind == "one chunk":
        logits[32:48] += 3.0
    else:
        logits[63] = 3.5
    return logits, 4, 16


@pytest.mark.parametrize("kind", ["spread", "one chunk", "last column"])
def test_fused_draws_follow_softmax(kind):
    """200,000 draws of a 64-token distribution (cap and temperature applied), chunked or not: chi-square with 63
    degrees of freedom below 113.5 (p = 0.0001: the six tests here fail falsely with probability 0.0006); the same
    seed draws alike, another otherwise."""
    logits, splits, block = softmax_case(kind)
    rows = 200_000
    raw = logits.cuda().expand(1, rows, 64).contiguous()
    temperature = torch.tensor([0.8], device="cuda")
    draws = [
        fused_sample(raw, temperature, torch.tensor([seed], device="cuda"), CAP, splits=splits, block=block)[0]
        for seed in (1, 2, 1)
    ]
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])
    expected = ((logits.double() / CAP).tanh() * CAP / 0.8).softmax(-1) * rows
    if kind == "one chunk":
        assert expected[32:48].sum() > 0.9 * rows
    for sample in draws[:2]:
        counts = torch.bincount(sample.view(-1).cpu(), minlength=64).double()
        assert counts.numel() == 64, "a sample past the vocabulary"
        chi_square = float(((counts - expected) ** 2 / expected).sum())
        assert chi_square < 113.5, (chi_square, counts, expected)


def test_triton_experts_against_torch_grouped_gemm():
    """The experts' Triton kernels (GELU-gated grouped products) and torch's grouped GEMM on bfloat16 rows of a
    canvas (2,048 tokens x top-8 of 128 experts at a small width), both against the float32 loop."""
    config = hf_dllm.DiffusionGemmaConfig(
        text_config=dict(
            vocab_size=64, hidden_size=256, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, global_head_dim=64, num_global_key_value_heads=1, sliding_window=8,
            num_experts=128, top_k_experts=8, moe_intermediate_size=128, layer_types=["full_attention"],
        ),
        vision_config=None,
        canvas_length=16,
    ).text_config  # fmt: skip
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaExperts

    experts = DiffusionGemmaExperts(config).cuda()
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    x = torch.randn(2048, 256, device="cuda")
    index = torch.rand(2048, 128, device="cuda").topk(8, dim=-1).indices
    weights = torch.rand(2048, 8, device="cuda").softmax(-1)
    with torch.no_grad():
        experts.implementation = "loop"
        exact = experts(x, index, weights)
        experts.bfloat16()
        outputs = {}
        for implementation in ("grouped", "triton"):
            experts.implementation = implementation
            outputs[implementation] = experts(x.bfloat16(), index, weights).float()
    torch_error = (outputs["grouped"] - exact).abs().max()
    assert (outputs["triton"] - exact).abs().max() <= 2 * torch_error + 1e-4, torch_error


def test_gelu_gate_against_pytorch():
    """The dense MLP's GELU gate in one kernel (`triton_ops.gated_mul`, "gelu_tanh") on the halves of a bfloat16
    gate/up product at the 26B-A4B width: its error against float64 within 2x of PyTorch's bfloat16 ops' (same
    rounding points), and equal to them on most elements."""
    from hf_dllm import triton_ops

    # Unit-scale gates: far below -3, 1 + tanh cancels in float32 (PyTorch's tanh and this kernel's alike) and the
    # two roundings part more often.
    gate_up = torch.randn(256, 2 * 2112, device="cuda", dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    reference = torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()
    theirs = torch.nn.functional.gelu(gate, approximate="tanh") * up
    ours = triton_ops.gated_mul(gate, up, "gelu_tanh")
    assert ours.dtype == torch.bfloat16 and ours.shape == gate.shape
    assert (ours.double() - reference).abs().max() <= 2 * (theirs.double() - reference).abs().max() + 1e-6
    assert (ours == theirs).float().mean() > 0.99


@pytest.fixture(scope="module")
def gemma_cuda_bf16():
    return AutoModel.from_pretrained(GEMMA_DIR, dtype=torch.bfloat16).eval().cuda()


def test_generate_on_the_fused_path(gemma_cuda_bf16):
    """generate() on CUDA takes the fused sampler by default: seeded runs repeat, with and without the decoder's
    graphs, and the output is well formed; the PyTorch sampler (fused=False) runs the same number of forwards or
    fewer (rows stop when stable and confident)."""
    model = gemma_cuda_bf16
    text = model.config.text_config
    prompt = torch.randint(3, 300, (2, 21), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def sampler(fused):
        return EntropyBoundSampler(text.vocab_size, 6, 0.1, 0.4, 0.8, 1, 0.005, softcap=30.0, fused=fused)

    runs = []
    for captured in (False, True, True):
        model.capture_decoder = captured
        torch.manual_seed(5)
        policy = sampler(None)
        runs.append(model.generate(prompt, max_new_tokens=48, max_denoising_steps=6, unmasking_policy=policy,
                                   return_dict_in_generate=True))  # fmt: skip
        assert policy.fused_active
    model.capture_decoder = True
    for run in runs[1:]:
        assert torch.equal(run.sequences, runs[0].sequences) and run.nfe == runs[0].nfe
    sequences = runs[0].sequences
    assert torch.equal(sequences[:, :21], prompt) and (sequences[:, 21:] < text.vocab_size).all()
    assert runs[0].nfe <= 6 * 3


@pytest.mark.parametrize("backend", ["triton", "gemm"])
@pytest.mark.parametrize("layer", [0, 1])  # a sliding layer (heads of 256), a full one (heads of 512, 2 K/V heads)
def test_decoder_attention_backends_at_the_26b_head_widths(layer, backend):
    """The decoder's attention on the Triton and GEMM backends at the 26B-A4B head widths, a 256-token canvas over
    1,024 keys with padding: its error against a float32 SDPA within 2x of bfloat16 SDPA's."""
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaAttention

    text = hf_dllm.DiffusionGemmaConfig(
        text_config=dict(
            vocab_size=64, hidden_size=512, intermediate_size=64, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
            sliding_window=1024, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            layer_types=["sliding_attention", "full_attention"],
        ),
        vision_config=None,
        canvas_length=256,
    ).text_config  # fmt: skip
    torch.manual_seed(0)
    attention = DiffusionGemmaAttention(text, layer).cuda()
    for parameter in attention.parameters():
        parameter.data.normal_(1.0 if parameter.dim() == 1 else 0.0, 0.05)
    head_dim = attention.head_dim
    hidden = torch.randn(1, 256, 512, device="cuda")
    cached = torch.randn(1, attention.num_key_value_heads, 768, head_dim, device="cuda")

    class Cache:  # 768 cached keys (the first 100 padding) before the canvas' own
        def canvas_slots(self, layer, length):  # no slots to write into: keys_values concatenates
            return None

        def keys_values(self, layer, key, value, write):
            return torch.cat([cached.to(key.dtype), key], dim=-2), torch.cat([cached.to(value.dtype), value], dim=-2)

    mask = torch.ones(1, 1, 1, 1024, dtype=torch.bool, device="cuda")
    mask[..., :100] = False
    angles = torch.arange(768, 1024, device="cuda")[None, :, None] * 1e-3
    cos, sin = angles.cos().expand(1, 256, head_dim), angles.sin().expand(1, 256, head_dim)
    with torch.no_grad():
        exact = attention(hidden, cos, sin, Cache(), mask, False)
        attention.bfloat16()
        args = (hidden.bfloat16(), cos.bfloat16(), sin.bfloat16(), Cache(), mask, False)
        attention.backend = "sdpa"
        sdpa = attention(*args).float()
        attention.backend = backend
        out = attention(*args).float()
    sdpa_error = (sdpa - exact).abs().max()
    assert (out - exact).abs().max() <= 2 * sdpa_error + 1e-4, ((out - exact).abs().max(), sdpa_error)
