"""Unmasking policies: which masked positions of the current block are committed after a forward.

A denoising step (LLaDA arXiv:2502.09992, Alg. "low-confidence remasking") has two halves:

1. `propose_tokens`: from the block's logits, a candidate token `x0` and a confidence per position
   (softmax probability of `x0`, or a uniform draw for `remasking="random"`).
2. An `UnmaskingPolicy` decides how many of the masked positions to commit (`num_to_commit`), and
   `commit_most_confident` commits that many, most confident first (`rank_by_confidence`).

Policies:
- `FixedSchedule`: LLaDA's schedule, the block's masks spread evenly over its steps
  (`L // s` per step, one more for the first `L % s` steps).
- `ConfidenceThreshold`: Fast-dLLM's threshold rule (arXiv:2505.22618, Sec. 3.3): every masked position with
  confidence >= tau, and always at least the most confident one.
- `ConfidenceFactor`: Fast-dLLM's factor rule: the n most confident positions for the largest n with
  `(n + 1) * (1 - c_n) < factor`, at least one (c_n = n-th largest confidence).

Everything here is a tensor function of fixed shapes with no host synchronisation, so a step can be captured in a
CUDA graph.
"""

from __future__ import annotations

import torch

# Confidence of positions that are not masked: they can never be chosen.
NOT_MASKED = float("-inf")
# Confidence given to positions whose candidate is EOS/EOT under `confidence_eos_eot_inf` (LLaDA App. B.4): below
# every real probability, so they are committed last, yet above NOT_MASKED, so a scheduled commit still lands on a
# masked position.
DEFERRED = -1.0


def propose_tokens(
    logits: torch.Tensor,
    masked: torch.Tensor,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    suppressed_token_ids: torch.Tensor | None = None,
    deferred_token_ids: torch.Tensor | None = None,
    mask_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate tokens and confidences for one block.

    Args:
        logits: `(batch, L, vocab)` logits of the block positions.
        masked: `(batch, L)` bool, positions still masked.
        temperature: 0 = greedy argmax; > 0 = Gumbel-max sampling in float64 as LLaDA does
            (`exp(logits) / (-log u) ** temperature`; low precision Gumbel noise hurts quality, arXiv:2409.02908).
        remasking: `"low_confidence"` (confidence = softmax probability of the candidate) or `"random"`
            (confidence = uniform draw), LLaDA Sec. 2.4.
        suppressed_token_ids: ids whose logits are set to -inf before anything else (`logits_eos_inf`).
        deferred_token_ids: candidates with these ids get confidence `DEFERRED` (`confidence_eos_eot_inf`).
        mask_token_id: never proposed: a committed [MASK] would stay masked and, staying the most confident
            position, stall the block forever. The confidence is still the probability under the full softmax,
            as in LLaDA's sampler, so decisions match the reference whenever its candidate is not [MASK].

    Returns:
        `x0` `(batch, L)` long and `confidence` `(batch, L)` float32, `NOT_MASKED` where `masked` is False.
    """
    logits = logits.float()
    if suppressed_token_ids is not None:
        logits = logits.index_fill(-1, suppressed_token_ids, float("-inf"))
    candidates = logits
    if mask_token_id is not None:
        candidates = logits.clone()
        candidates[..., mask_token_id] = float("-inf")  # an int index: no host-to-device copy, graph-safe
    if temperature > 0:
        logits64 = candidates.double()
        gumbel = (-torch.log(torch.rand_like(logits64))) ** temperature
        x0 = torch.argmax(logits64.exp() / gumbel, dim=-1)
    else:
        x0 = torch.argmax(candidates, dim=-1)
    if remasking == "low_confidence":
        chosen = torch.gather(logits, -1, x0.unsqueeze(-1)).squeeze(-1)
        confidence = torch.exp(chosen - torch.logsumexp(logits, dim=-1))
    else:
        confidence = torch.rand(x0.shape, device=x0.device, dtype=torch.float32)
    if deferred_token_ids is not None:
        confidence = torch.where(torch.isin(x0, deferred_token_ids), DEFERRED, confidence)
    confidence = torch.where(masked, confidence, NOT_MASKED)
    return x0, confidence


def rank_by_confidence(confidence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort `(batch, L)` confidences descending. Returns the sorted values and each position's rank (0 = most
    confident). Ties go to the lower position (stable sort)."""
    sorted_confidence, order = torch.sort(confidence, dim=-1, descending=True, stable=True)
    positions = torch.arange(confidence.shape[-1], device=confidence.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, positions)
    return sorted_confidence, ranks


def commit_most_confident(ranks: torch.Tensor, masked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`(batch, L)` bool: the `counts[b]` best-ranked masked positions of each row."""
    return masked & (ranks < counts.unsqueeze(-1))


class UnmaskingPolicy:
    """Decides how many masked positions a step commits. Subclasses implement `num_to_commit`."""

    def start_block(self, block_length: int, num_steps: int) -> None:
        """Called before each block with its length and its share of `steps`."""

    def scheduled_count(self, step: int) -> int:
        """Tokens the fixed schedule assigns to `step` of the current block (0 for confidence-driven policies)."""
        return 0

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        """`sorted_confidence` `(batch, L)` descending (non-masked = -inf); `scheduled` `(batch,)` the step's
        `scheduled_count` as a tensor, so that one captured CUDA graph serves every step.

        Returns `(batch,)` long counts (>= 1; positions beyond the masked ones are never committed)."""
        raise NotImplementedError

    def steps_for_block(self) -> int | None:
        """Number of forwards the current block takes, when known in advance."""
        return None


class FixedSchedule(UnmaskingPolicy):
    """LLaDA's linear schedule: a block of L masks over s steps commits `L // s` tokens per step, plus one for
    the first `L % s` steps (LLaDA Sec. 2.4, `get_num_transfer_tokens`). Steps beyond L commit nothing and are
    skipped."""

    # Counts are computed per step, not listed: a list of `num_steps` entries cost memory and time in proportion
    # to `steps` (10**9 steps: 77 s and 4.4 GB) although at most `block_length` steps commit anything.

    def __init__(self) -> None:
        self.base, self.extra, self.num_steps = 0, 0, 0

    def start_block(self, block_length: int, num_steps: int) -> None:
        self.base, self.extra = divmod(block_length, num_steps)
        # With more steps than positions (base 0) only the first `extra` steps commit a token; the rest are skipped.
        self.num_steps = num_steps if self.base > 0 else self.extra

    def steps_for_block(self) -> int:
        return self.num_steps

    def scheduled_count(self, step: int) -> int:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} is outside this block's {self.num_steps} steps.")
        return self.base + (1 if step < self.extra else 0)

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        return scheduled


class ConfidenceThreshold(UnmaskingPolicy):
    """Fast-dLLM threshold decoding (arXiv:2505.22618, Sec. 3.3): commit every masked position with confidence
    >= `threshold`, and always the most confident one so that each step makes progress."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        return (sorted_confidence >= self.threshold).sum(-1).clamp(min=1)


class ConfidenceFactor(UnmaskingPolicy):
    """Fast-dLLM factor decoding (arXiv:2505.22618, Sec. 3.3): commit the n most confident masked positions for
    the largest n with `(n + 1) * (1 - c_n) < factor`, at least one. Unlike the reference loop, the last rank is
    judged by the same rule as the others."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        n = torch.arange(1, sorted_confidence.shape[-1] + 1, device=sorted_confidence.device)
        passes = (n + 1) * (1.0 - sorted_confidence.double()) < self.factor
        return (passes * n).amax(-1).clamp(min=1)


def make_unmasking_policy(threshold: float | None, factor: float | None) -> UnmaskingPolicy:
    if threshold is not None:
        return ConfidenceThreshold(threshold)
    if factor is not None:
        return ConfidenceFactor(factor)
    return FixedSchedule()


def denoise_block_step(
    block: torch.Tensor,
    logits: torch.Tensor,
    policy: UnmaskingPolicy,
    scheduled: torch.Tensor,
    mask_token_id: int,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    suppressed_token_ids: torch.Tensor | None = None,
    deferred_token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One denoising step on a block: `block` `(batch, L)` tokens, `logits` `(batch, L, vocab)`, `scheduled`
    `(batch,)` the fixed schedule's count for this step (see `UnmaskingPolicy.num_to_commit`).

    Returns the new block (committed positions filled in) and a draft `(batch, L)` in which still-masked
    positions show their current candidate (for streamers' `put_draft`).
    """
    masked = block == mask_token_id
    x0, confidence = propose_tokens(
        logits, masked, temperature, remasking, suppressed_token_ids, deferred_token_ids, mask_token_id
    )
    sorted_confidence, ranks = rank_by_confidence(confidence)
    counts = policy.num_to_commit(sorted_confidence, scheduled)
    commit = commit_most_confident(ranks, masked, counts)
    new_block = torch.where(commit, x0, block)
    draft = torch.where(new_block == mask_token_id, x0, new_block)
    return new_block, draft
