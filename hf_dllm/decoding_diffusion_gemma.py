"""DiffusionGemma's sampler as policies of hf_dllm's block loop: the canvas starts as random tokens, each step
samples every position at a linearly scheduled temperature, accepts the lowest-entropy samples under an entropy
bound, renoises the rest, feeds its processed logits back as self-conditioning, and a canvas stops once it is stable
and confident (transformers' `DiffusionGemmaGenerationMixin`: `EntropyBoundSampler`,
`LinearTemperatureScheduleLogitsProcessor`, `StableAndConfidentStoppingCriteria`; the entropy bound is from
arXiv:2505.24857). `EncoderPrefixCache` is the cache policy: the columns before a canvas are encoded once, by a
separate encoder pass, at the canvas' first step (or in one pass with that step where the model fuses them:
`DiffusionGemmaForBlockDiffusion.fuse_canvas_passes`).

Random draws follow transformers' order exactly (global generator): per canvas one `randint((B, C))`, then per step
one `multinomial` over `(B * C, vocab)` and one `randint((B, C))`, every row of the batch included (rows that
ended still draw: `keeps_ended_rows`), so that a seeded call reproduces transformers' tokens on the CPU.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

import os

import torch

from .cache import CachePolicy
from .decoding import UnmaskingPolicy
from .family_diffusion_gemma import SAMPLER_DEFAULTS
from .kernels import kernel_mode
from .triton_diffusion_gemma import TRITON_AVAILABLE, fused_sample

# Elements of a `(rows, vocab)` float32 slice the sampler and the decoder's head process at once: past it the rows go
# in chunks, so that a batch-32 canvas of the 262,144-token vocabulary (8.6 GB per float32 copy) never has its
# temporaries (softmax, entropy terms, the head's output before the soft cap) materialised whole. One chunk (the
# CPU fixtures, a batch-1 canvas) runs the very ops of the unchunked code, in transformers' order.
ROW_CHUNK_ELEMENTS = 1 << 27


def row_chunks(rows: int, vocab: int) -> list[slice]:
    """Slices of `rows` rows with at most `ROW_CHUNK_ELEMENTS` elements of `vocab` columns each (one at least)."""
    step = max(1, ROW_CHUNK_ELEMENTS // vocab)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """`(..., vocab)` -> `(...)`: the entropy of softmax(logits), as `torch.distributions.Categorical` computes it
    (the reference's reductions, in its order). Without its argument check, which reads a device bool on the host
    (a synchronisation per step on a GPU) and computes nothing the entropy uses."""
    return torch.distributions.Categorical(logits=logits, validate_args=False).entropy()


class EntropyBoundSampler(UnmaskingPolicy):
    """DiffusionGemma's denoising step as an unmasking policy (the block is the canvas of `canvas_length` tokens).

    Per canvas (`initial_block`): a random canvas, no self-conditioning, the stopping history cleared. Per step n =
    N, ..., 1 (`denoise`), on the decoder's logits `(B, C, vocab)`: z = logits / T(n), T(n) = t_min + (t_max - t_min)
    * n / N; a sample per position from softmax(z) and its argmax; per row the positions sorted by entropy H of
    softmax(z), accepted while the sum of the lower entropies is <= `entropy_bound`; the next canvas keeps the
    accepted samples and draws the rest anew; z is the next step's self-conditioning. A row whose argmax equals its
    argmax of the last `stability_threshold` steps and whose mean entropy is < `confidence_threshold` is finished for
    this canvas: its canvas, argmax and self-conditioning freeze (its forwards still run and still draw). The canvas
    committed (`final_block`) is the last argmax.

    The fused path (`fused`; None: where hf_dllm's Triton kernels run, `kernels.kernel_mode()`: CUDA with Triton, or
    `HF_DLLM_KERNELS=triton`) asks the model for the LM head's raw output `(B, C, vocab)` in its dtype
    (`forward_inputs`: `capped_logits=False`) and computes the soft cap (`softcap`, the model's
    `final_logit_softcapping`), the temperature, the entropy, the argmax, a sample (inverse CDF from one uniform per
    position: not `torch.multinomial`'s draws) and the next step's self-conditioning input softmax(z) in the model's
    dtype (`self_conditioning_probabilities`) in two Triton launches over vocabulary chunks
    (`triton_diffusion_gemma.fused_sample`), with no float32 `(B, C, vocab)` tensor. The CPU keeps the PyTorch
    path, which reproduces transformers' draws.
    """

    keeps_ended_rows = True

    def __init__(
        self,
        vocab_size: int,
        max_denoising_steps: int,
        entropy_bound: float,
        t_min: float | None,
        t_max: float | None,
        stability_threshold: int | None,
        confidence_threshold: float | None,
        softcap: float | None = None,
        fused: bool | None = None,
    ):
        if fused not in (None, True, False):
            raise ValueError(f"`fused` must be None, True or False, got {fused!r}.")
        if fused and not TRITON_AVAILABLE:
            raise ValueError("`fused=True` needs the `triton` package (pip install hf-dllm[triton]).")
        self.vocab_size = vocab_size
        self.softcap = softcap
        self.fused = fused
        self.fused_active = False
        self.probabilities = None  # the fused path's self-conditioning input, kept across canvases of one shape
        self.max_denoising_steps = max_denoising_steps
        self.entropy_bound = entropy_bound
        self.t_min, self.t_max = t_min, t_max
        self.stability_threshold = stability_threshold
        self.confidence_threshold = confidence_threshold
        self.stops = stability_threshold is not None and confidence_threshold is not None

    # -- per canvas -------------------------------------------------------------------------------------------
    def initial_block(self, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """The canvas' first tokens `(rows, length)`, uniform over the vocabulary (the canvas' one draw)."""
        self.step_index = 0
        self.self_conditioning = None
        self.argmax = None
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.history = None
        self.fused_active = self.uses_fused(torch.device(device))
        return torch.randint(0, self.vocab_size, (rows, length), device=device)

    def uses_fused(self, device: torch.device) -> bool:
        """Whether the steps on `device` take the fused path (see the class docstring)."""
        runs_here = TRITON_AVAILABLE and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
        if self.fused and not runs_here:
            raise ValueError(
                f"`fused=True`: the fused sampler's Triton kernels run on CUDA (or in Triton's interpreter, "
                f"TRITON_INTERPRET=1), not on {device.type}; use fused=None or False."
            )
        if self.fused is not None:
            return self.fused
        mode = kernel_mode()
        return runs_here and mode != "torch" and (device.type == "cuda" or mode == "triton")

    def final_block(self) -> torch.Tensor:
        """The canvas committed: the last argmax `(rows, C)`."""
        return self.argmax

    def forward_inputs(self) -> dict:
        if self.fused_active:
            probabilities = self.probabilities if self.step_index > 0 else None
            return {"self_conditioning_probabilities": probabilities, "capped_logits": False}
        return {"self_conditioning_logits": self.self_conditioning}

    def steps_for_block(self) -> None:
        return None  # the stopping rule decides

    def stop_check_lag(self, device: torch.device) -> int:
        """1 on CUDA: the next step is queued before the host reads whether a row is left (finished rows are
        frozen, so a step past the last needed one changes no output; it draws and counts a forward), so the GPU
        never waits for the host's per-step work. 0 elsewhere: the CPU reproduces transformers' forwards and
        draws."""
        return 1 if torch.device(device).type == "cuda" else 0

    def step_limit(self) -> int:
        return self.max_denoising_steps

    # -- per step ---------------------------------------------------------------------------------------------
    def temperature(self, steps_left: int) -> torch.Tensor:
        """T(n) as transformers computes it: an int32 step count divided in float32."""
        fraction = torch.tensor(steps_left, dtype=torch.int32) / self.max_denoising_steps
        return self.t_min + ((self.t_max - self.t_min) * fraction)

    def sample_argmax_entropy(self, processed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the processed logits `(rows, C, vocab)`: a sample of softmax per position (one `multinomial` per
        chunk of rows, `row_chunks`), the argmax and the entropy, each `(rows, C)`."""
        rows, length, vocab = processed.shape
        flat = processed.reshape(-1, vocab)
        sample = torch.empty(rows * length, dtype=torch.long, device=processed.device)
        entropy = torch.empty(rows * length, dtype=torch.float32, device=processed.device)
        for part in row_chunks(rows * length, vocab):
            probabilities = torch.softmax(flat[part], dim=-1, dtype=torch.float32)
            sample[part] = torch.multinomial(probabilities, num_samples=1).view(-1)
            del probabilities
            entropy[part] = token_entropy(flat[part])
        argmax = torch.argmax(processed, dim=-1)
        return sample.view(rows, length), argmax, entropy.view(rows, length).to(processed.dtype)

    def _stable_and_confident(self, argmax: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """`(rows,)` bool: transformers' `StableAndConfidentStoppingCriteria` (history of the last
        `stability_threshold` argmax canvases, kept here) from the argmax and the entropy `(rows, C)`."""
        rows = argmax.shape[0]
        if self.stability_threshold == 0:
            stable = torch.ones(rows, dtype=torch.bool, device=argmax.device)
        else:
            if self.history is None:
                self.history = torch.full(
                    (self.stability_threshold, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device
                )
            stable = (self.history == argmax[None]).all(dim=-1).all(dim=0)
            self.history = torch.roll(self.history, shifts=-1, dims=0)
            self.history[-1] = argmax
        confident = entropy.mean(dim=-1) < self.confidence_threshold
        return stable & confident

    def accept(self, entropy: torch.Tensor) -> torch.Tensor:
        """`(rows, C)` bool from the entropies `(rows, C)`: per row, lowest entropy first, a position is accepted
        while the sum of the entropies below it is <= `entropy_bound` (the lowest is always accepted)."""
        sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
        accepted_sorted = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= self.entropy_bound
        return torch.scatter(torch.zeros_like(accepted_sorted), -1, order, accepted_sorted)

    def denoise(self, block, logits, rules, scheduled, generated=None, active=None, candidates=None):
        """One step on the canvas `block` `(B, C)` from the decoder's `logits` `(B, C, vocab)` (soft-capped float32;
        on the fused path the LM head's raw output); returns the next canvas, the draft (the argmax) and no edit."""
        steps_left = self.max_denoising_steps - self.step_index
        self.step_index += 1
        rows, length = block.shape
        frozen = self.finished[:, None] if self.stops and self.argmax is not None else None
        if self.fused_active:
            sample, argmax, entropy = self._fused_sample(logits, steps_left, frozen)
            processed = None
        else:
            processed = logits
            if self.t_min is not None and self.t_max is not None:  # no schedule: the logits as they are
                # In place: the decoder's logits are this step's alone (the same quotient as `logits / T`).
                processed = logits.div_(self.temperature(steps_left).to(logits.device))
            sample, argmax, entropy = self.sample_argmax_entropy(processed)
        accepted = self.accept(entropy)
        noise = torch.randint(0, self.vocab_size, (rows, length), device=block.device)
        canvas = torch.where(accepted, sample, noise)
        if self.stops:
            if frozen is not None:  # rows finished earlier keep their canvas (no host synchronisation)
                argmax = torch.where(frozen, self.argmax, argmax)
                canvas = torch.where(frozen, block, canvas)
                if processed is not None:  # (the fused kernel left the frozen rows' probabilities as they were)
                    processed = torch.where(frozen[..., None], self.self_conditioning, processed, out=processed)
            # The entropy of the step's own logits: a frozen row's (its old logits') would only be OR-ed into
            # `finished`, which it already is.
            self.finished = self.finished | self._stable_and_confident(argmax, entropy)
        self.argmax = argmax
        self.self_conditioning = processed
        return canvas, argmax, torch.zeros(rows, dtype=torch.bool, device=block.device)

    def _fused_sample(self, raw_logits: torch.Tensor, steps_left: int, frozen: torch.Tensor | None):
        """`sample_argmax_entropy` on the fused path from the LM head's raw output `(B, C, vocab)`; writes the next
        step's self-conditioning probabilities (frozen rows `(B, 1)` keep theirs)."""
        device = raw_logits.device
        if (
            self.probabilities is None
            or self.probabilities.shape != raw_logits.shape
            or self.probabilities.dtype != raw_logits.dtype
            or self.probabilities.device != device
        ):
            self.probabilities = torch.empty_like(raw_logits, memory_format=torch.contiguous_format)
        scheduled = self.t_min is not None and self.t_max is not None
        # A host-side value (the schedule's float32 quotient, as `temperature` computes it) filled on the device.
        value = float(self.temperature(steps_left)) if scheduled else 1.0
        temperature = torch.full((1,), value, dtype=torch.float32, device=device)
        seed = torch.randint(0, 1 << 62, (1,), device=device)
        return fused_sample(
            raw_logits,
            temperature,
            seed,
            self.softcap,
            self.probabilities,
            frozen.view(-1) if frozen is not None else None,
        )

    def still_active(self, active, masked_before, masked_after, edited, step):
        """Rows that need another step: not finished, and steps left."""
        if step >= self.max_denoising_steps:
            return torch.zeros_like(active)
        return ~self.finished


class EncoderPrefixCache(CachePolicy):
    """The cache of encoder-decoder block diffusion (DiffusionGemma): the columns before a canvas are encoded once
    by a separate encoder pass at the canvas' first step, which is fed the whole prefix (views of the canvas; the
    model encodes only the columns its cache does not hold yet, so a cache emptied between blocks, as the serving
    engine's layouts do, is filled again); later steps feed the canvas alone, which the decoder reads without
    writing the cache."""

    name = "encoder"
    uses_cache = True

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        return (0, block_end) if first_step else (block_start, block_end)

    def keep_rows(self, cache, index: torch.Tensor) -> None:
        if cache is not None:
            cache.keep_rows(index)


__all__ = [
    "ROW_CHUNK_ELEMENTS",
    "SAMPLER_DEFAULTS",
    "EncoderPrefixCache",
    "EntropyBoundSampler",
    "row_chunks",
    "token_entropy",
]
