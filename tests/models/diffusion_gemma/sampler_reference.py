"""References of the fused sampler's draw (`triton_diffusion_gemma.fused_sample`) shared by its
interpreter test (`test_diffusion_gemma_fused_sampler.py`) and its CUDA test (`..._gpu.py`): the uniform each row
draws (numpy) and the inverse-CDF sample of softmax(z) at it (torch float64, on the logits' device)."""

from __future__ import annotations

import math

import numpy as np
import torch

MASK = np.uint64(0xFFFFFFFF)


def philox_uniforms(seed: int, rows: int) -> torch.Tensor:
    """`(rows,)` float64: the kernel's u of each row, from the first word of Philox4x32-10 at (seed, row) (Triton's
    `tl.randint`: counter (row low, row high, 0, 0), key (seed low, seed high), ten rounds), its 31 bits of magnitude
    (a negative word w as ~w) times 2^-31."""
    offset = np.arange(rows, dtype=np.uint64)
    c0, c1, c2, c3 = offset & MASK, offset >> np.uint64(32), np.zeros_like(offset), np.zeros_like(offset)
    k0, k1 = np.uint64(seed) & MASK, (np.uint64(seed) >> np.uint64(32)) & MASK
    for _ in range(10):
        product_b, product_a = np.uint64(0xCD9E8D57) * c2, np.uint64(0xD2511F53) * c0
        c0, c2 = (product_b >> np.uint64(32)) ^ c1 ^ k0, (product_a >> np.uint64(32)) ^ c3 ^ k1
        c1, c3 = product_b & MASK, product_a & MASK
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & MASK, (k1 + np.uint64(0xBB67AE85)) & MASK
    word = c0.astype(np.uint32).view(np.int32)
    return torch.from_numpy(np.where(word < 0, ~word, word).astype(np.float64) * 2.0**-31)


def processed(x: torch.Tensor, cap: float | None, temperature: float) -> torch.Tensor:
    """z `(rows, vocab)` float32 from head outputs `(..., vocab)` as the kernels compute it: the soft cap as
    cap (1 - 2 / (e^(2x / cap) + 1)), then the temperature's quotient."""
    x = x.float().reshape(-1, x.shape[-1])
    if cap:
        x = cap * (1 - 2 / ((2 * (x * (1.0 / cap))).exp() + 1))
    return x / temperature


def cumulative(z: torch.Tensor) -> torch.Tensor:
    """`(rows, vocab)` float64: the cumulative probabilities of softmax(z), each row ending at 1."""
    total = (z.double() - z.double().amax(-1, keepdim=True)).exp().cumsum(-1)
    return total / total[:, -1:]


def inverse_cdf(z: torch.Tensor, u: torch.Tensor, tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw of softmax(z) `(rows, vocab)` at `u` `(rows,)` float64, in float64, and per row whether u lies within
    `tolerance` of a cumulative probability (a boundary: float32 rounding may put the kernel on either side). The
    draw is the first column whose cumulative probability exceeds u (never a column of probability 0)."""
    cdf = cumulative(z)
    u = u.to(cdf.device)[:, None]
    draw = (cdf <= u).sum(-1).clamp(max=z.shape[-1] - 1)
    return draw, ((cdf - u).abs() < tolerance).any(-1)


def within_its_interval(z: torch.Tensor, u: torch.Tensor, sample: torch.Tensor, tolerance: float) -> torch.Tensor:
    """`(rows,)` bool: u lies in the sample's interval of cumulative probability, [F(s - 1), F(s)), widened by
    `tolerance` on both sides, and the sample has a probability the kernel can draw (e^(z_s - max z) of at least
    2^-126: the kernel flushes smaller terms to 0). `sample` `(rows,)` inside the vocabulary."""
    cdf = cumulative(z)
    u, sample = u.to(cdf.device), sample.reshape(-1, 1).to(cdf.device)
    high = cdf.gather(-1, sample)[:, 0]
    low = torch.where(sample[:, 0] > 0, cdf.gather(-1, (sample - 1).clamp(min=0))[:, 0], 0.0)
    drawable = z.gather(-1, sample)[:, 0].double() - z.double().amax(-1) >= -126 * math.log(2)
    return (low - tolerance <= u) & (u < high + tolerance) & drawable
