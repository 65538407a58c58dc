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
- `ScheduledThreshold`: LLaDA2.0's rule (block-causal models): the schedule's quota, or every position strictly
  above the threshold when there are more of them.
- `TokenEditing`: LLaDA2.1's rule: `ScheduledThreshold` with a fixed quota, plus re-decoding committed tokens whose
  new prediction is confident enough.

Everything here is a tensor function of fixed shapes with no host synchronisation, so a step can be captured in a
CUDA graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import triton_ops
from .kernels import upload, use_fused_kernels

# Confidence of positions that are not masked: they can never be chosen.
NOT_MASKED = float("-inf")
# Confidence given to positions whose candidate is EOS/EOT under `confidence_eos_eot_inf` (LLaDA App. B.4): below
# every real probability, so they are committed last, yet above NOT_MASKED, so a scheduled commit still lands on a
# masked position.
DEFERRED = -1.0


def propose_tokens(
    logits: torch.Tensor,
    masked: torch.Tensor | None,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    suppressed_token_ids: torch.Tensor | None = None,
    deferred_token_ids: torch.Tensor | None = None,
    mask_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate tokens and confidences for one block.

    Args:
        logits: `(batch, L, vocab)` logits of the block positions.
        masked: `(batch, L)` bool, positions still masked; None: all (no masking operation).
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
    if (
        temperature == 0
        and remasking == "low_confidence"
        and suppressed_token_ids is None
        and use_fused_kernels(logits)
    ):
        # The same greedy choice and probability in one pass over the vocabulary (`triton_ops.greedy_propose`; with
        # few rows the vocabulary is split among programs). On an H100 it took a batch-1 block step from 3.18 to
        # 3.06 ms (LLaDA2.0-mini shape) and the FP8 LLaDA-8B call from 4.95 to 4.83 ms per forward
        # (`benchmarks/bench_llada2.py`, `bench_generate.py`); with one program per row it was slower than PyTorch's
        # passes below 128 rows.
        x0, confidence = triton_ops.greedy_propose(logits, mask_token_id)
        if deferred_token_ids is not None:
            confidence = torch.where(torch.isin(x0, deferred_token_ids), DEFERRED, confidence)
        return x0, confidence if masked is None else torch.where(masked, confidence, NOT_MASKED)
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
    if masked is not None:
        confidence = torch.where(masked, confidence, NOT_MASKED)
    return x0, confidence


def propose_tokens_sharded(
    logits: torch.Tensor,
    shard,
    masked: torch.Tensor | None,
    suppressed_token_ids: torch.Tensor | None = None,
    deferred_token_ids: torch.Tensor | None = None,
    mask_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`propose_tokens` (greedy, `low_confidence`) from this rank's vocabulary slice of the logits, under tensor
    parallelism (Megatron-LM's vocabulary-parallel head, arXiv:1909.08053): each rank reduces its slice to (best
    logit, its token id, log-sum-exp) per position; one all-gather of those `(ranks, batch, L, 3)` values gives every
    rank the same candidate (the highest logit; between equal logits the lowest id, as `argmax`) and probability
    `exp(best - logsumexp(rank log-sum-exps))`.

    Args:
        logits: `(batch, L, size)` this rank's logits, of the tokens `[shard.start, shard.start + size)`.
        shard: `tensor_parallel.VocabShard`.
        masked, suppressed_token_ids, deferred_token_ids, mask_token_id: as in `propose_tokens` (global ids).

    Returns `x0` `(batch, L)` long and `confidence` `(batch, L)` float32, as `propose_tokens`.
    """
    from .tensor_parallel import all_gather_stacked

    logits = logits.float()
    start, size = shard.start, logits.shape[-1]
    if suppressed_token_ids is not None:
        local = suppressed_token_ids - start
        inside = (local >= 0) & (local < size)
        # Ids of other ranks' slices are sent to an extra column, dropped: fixed shapes, no host synchronisation.
        padded = torch.nn.functional.pad(logits, (0, 1))
        logits = padded.index_fill(-1, torch.where(inside, local, size), float("-inf"))[..., :size]
    candidates = logits
    if mask_token_id is not None and start <= mask_token_id < start + size:
        candidates = logits.clone()
        candidates[..., mask_token_id - start] = float("-inf")
    best, index = candidates.max(dim=-1)
    stats = torch.stack([best, (index + start).float(), torch.logsumexp(logits, dim=-1)], dim=-1)
    gathered = all_gather_stacked(stats, shard.group)  # (ranks, batch, L, 3); ids < 2**24 are exact in float32
    winner = gathered[..., 0].argmax(dim=0, keepdim=True)  # the first rank holding the highest logit
    chosen = gathered.gather(0, winner.unsqueeze(-1).expand(1, *gathered.shape[1:])).squeeze(0)
    x0 = chosen[..., 1].long()
    confidence = torch.exp(chosen[..., 0] - torch.logsumexp(gathered[..., 2], dim=0))
    if deferred_token_ids is not None:
        confidence = torch.where(torch.isin(x0, deferred_token_ids), DEFERRED, confidence)
    if masked is not None:
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
    """Decides how many masked positions a step commits. Subclasses implement `num_to_commit`.

    Per block, the loop calls `start_block` (host side), then for every step `scheduled_counts` (a `(rows,)`
    tensor, input of the captured step), runs `commit` inside the step, and after it `still_active` to know which
    rows need another forward (a row that stops is frozen: later steps of the block leave it unchanged).
    """

    # Whether `commit` may change committed tokens (token editing); the loop then tracks edits.
    edits = False
    # Whether `commit` reads `proposal.logits` (the whole vocabulary's): under tensor parallelism the step then
    # gathers the logits instead of reducing each rank's vocabulary slice to the proposal (`propose_tokens_sharded`).
    reads_logits = False
    # Whether this class's step can be captured in a CUDA graph. Read on the class itself, never inherited: a
    # subclass that changes the step (or a new policy) runs eagerly unless it says so.
    capturable = False
    # Whether rows that ended stay in the batch (decoded, their output the fill token) until every row has ended,
    # instead of leaving it: a rule whose random draws span the whole batch (DiffusionGemma's) needs them.
    keeps_ended_rows = False

    def initial_block(self, rows: int, length: int, device: torch.device) -> torch.Tensor | None:
        """The block's tokens before its first step `(rows, length)`, or None: its positions stay masked. Called
        at the start of every block (a rule with per-block state resets it here)."""
        return None

    def final_block(self) -> torch.Tensor | None:
        """What the block commits after its last step `(rows, L)`, or None: the block as the steps left it."""
        return None

    def forward_inputs(self) -> dict:
        """Extra inputs of the model's forward at the next step (state the rule carries between steps, e.g.
        DiffusionGemma's self-conditioning logits)."""
        return {}

    def denoise(
        self,
        block: torch.Tensor,
        logits: torch.Tensor,
        rules: "StepRules",
        scheduled: torch.Tensor,
        generated: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
        candidates: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's decision from the block's logits (`denoise_step`: propose, then `commit`); a rule that is not
        mask-based replaces it whole. Returns the new block, the draft and the edit flags."""
        return denoise_step(block, logits, rules, scheduled, generated, active, candidates)

    def rows_only(self, rows: slice | None):
        """A context in which the steps decide only `rows` of the block's rows (None: all of them; the serving
        layouts' partial steps: a block's first step of the rows joining it, apart from the rows continuing; the
        rows packed without their padding rows). A rule with per-row state across steps (LLaDA2.2's) steps that
        part of it; here nothing. `StepMachine.step_rows` and `decide` enter it."""
        return contextlib.nullcontext()

    def graph_key(self) -> tuple | None:
        """What identifies this policy's captured step (its class and the constants the step bakes in), or None
        when its steps must run eagerly."""
        if not type(self).__dict__.get("capturable", False):
            return None
        return (type(self).__name__, *self.step_constants())

    def step_constants(self) -> tuple:
        """The constants of `commit` (a captured graph bakes them in)."""
        return ()

    def start_block(self, block_length: int, num_steps: int | torch.Tensor) -> None:
        """Called before each block with its length and its share of `steps`: an int, or `(rows,)` long (rows
        may have different shares, e.g. block-causal rows with different numbers of blocks)."""
        self.block_length = block_length
        self.num_steps = torch.as_tensor(num_steps, dtype=torch.long)
        self._device_steps: torch.Tensor | None = None

    def steps_on(self, device: torch.device) -> torch.Tensor:
        """`num_steps` on `device`, copied once per block (not once per step)."""
        if self._device_steps is None or self._device_steps.device != device:
            self._device_steps = upload(self.num_steps, device)
        return self._device_steps

    def scheduled_count(self, step: int) -> int:
        """Tokens the fixed schedule assigns to `step` of the current block (0 for confidence-driven policies)."""
        return 0

    def scheduled_counts(self, step: int, rows: int, device: torch.device) -> torch.Tensor:
        """`(rows,)` long: the count of `scheduled_count` for every row."""
        return self.constant_counts(self.scheduled_count(step), rows, device)

    def constant_counts(self, count: int, rows: int, device: torch.device) -> torch.Tensor:
        """`(rows,)` long filled with `count`. One tensor per count and shape, kept: the same input at every step
        with that count, which a CUDA-graph replay need not copy again (`graphs.py`)."""
        # Made on first use, not in an __init__: a rule of a user's (the policies are pluggable) need not call one.
        made = self.__dict__.setdefault("_made_counts", {})
        counts = made.get((count, rows, device))
        if counts is None:
            counts = made[(count, rows, device)] = torch.full((rows,), count, dtype=torch.long, device=device)
        return counts

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        """`sorted_confidence` `(batch, L)` descending (non-masked = -inf); `scheduled` `(batch,)` the step's
        `scheduled_count` as a tensor, so that one captured CUDA graph serves every step.

        Returns `(batch,)` long counts (>= 1; positions beyond the masked ones are never committed)."""
        raise NotImplementedError

    def fused_count(self) -> tuple[int, float] | None:
        """How `num_to_commit` counts, for the step's decision in one launch (`triton_ops.commit_most_confident`):
        its rule (`triton_ops.COMMIT_*`) and threshold, or None (PyTorch's `commit`). Read only where the class
        itself defines it and keeps this class's `commit` (`fused_commit_rule`): a subclass may count otherwise."""
        return None

    # Whether the step's decision may run as one launch where `fused_commit_rule` allows (a benchmark's switch).
    commit_in_one_launch = True

    def fused_commit_rule(self) -> tuple[int, float] | None:
        """`fused_count()` where this class defines it and `commit` is `UnmaskingPolicy.commit` (and
        `commit_in_one_launch`), else None."""
        if "fused_count" not in type(self).__dict__ or type(self).commit is not UnmaskingPolicy.commit:
            return None
        return self.fused_count() if self.commit_in_one_launch else None

    def commit(self, proposal: "BlockProposal", scheduled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block after this step `(rows, L)` and `(rows,)` bool: whether a committed token was edited."""
        sorted_confidence, ranks = rank_by_confidence(proposal.confidence)
        counts = self.num_to_commit(sorted_confidence, scheduled)
        commit = commit_most_confident(ranks, proposal.masked, counts)
        new_block = torch.where(commit, proposal.x0, proposal.block)
        return new_block, torch.zeros(new_block.shape[0], dtype=torch.bool, device=new_block.device)

    def steps_for_block(self) -> int | None:
        """Number of forwards the current block takes, when known in advance (no host synchronisation)."""
        return None

    def stop_check_lag(self, device: torch.device) -> int:
        """Steps the loop may run before it reads whether rows are left after a step whose count it cannot know
        in advance (`steps_for_block` None): 0 reads it after every step (the host waits for that step, then
        queues the next); 1 queues the next step first, so the device never waits for the host, at the price of
        one forward after the last needed one (a no-op for the rule's frozen rows). A rule that freezes finished
        rows may allow 1 where the forwards need not match a reference's (the GPU)."""
        return 0

    def step_limit(self) -> int | None:
        """The most steps a block takes, known on the host (with `stop_check_lag`: the loop never runs past it)."""
        return None

    def max_masked(self, step: int) -> int | None:
        """The most masked positions a row still denoising can hold at `step` of the current block (0-based),
        known on the host from the rule alone, or None. The loop then computes logits only at that many positions
        of each row, its masked ones first (`masked_bound`). Read only where the class itself defines it (as
        `capturable`): a subclass may read the whole block's logits (Dream's rules) or edit committed tokens."""
        return None

    def masked_bound(self, step: int) -> int | None:
        """`max_masked(step)` where this class defines it, else None."""
        if "max_masked" not in type(self).__dict__:
            return None
        return self.max_masked(step)

    def steps_per_row(self) -> torch.Tensor | None:
        """`(rows,)` long (host): the forwards each row needs in this block, when known in advance."""
        steps = self.steps_for_block()
        return None if steps is None else torch.full(self.num_steps.shape or (1,), steps, dtype=torch.long)

    def still_active(
        self,
        active: torch.Tensor,
        masked_before: torch.Tensor,
        masked_after: torch.Tensor,
        edited: torch.Tensor,
        step: int,
    ) -> torch.Tensor:
        """`(rows,)` bool: rows that need another forward after `step` (1-based count of steps made) forwards.
        By default a row is done once its block holds no mask."""
        return active & masked_after & (step < self.steps_on(active.device))


def schedule_counts(block_length: int, num_steps: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """LLaDA's linear schedule for every row (`get_num_transfer_tokens`): `block_length // s` tokens per step, one
    more for the first `block_length % s` steps; `num_steps` `(rows,)` -> `(rows,)` long, or for a column of steps
    `(S, 1)` every one of them `(S, rows)`. Arithmetic, so no list of `steps` entries is ever built."""
    base, extra = block_length // num_steps, block_length % num_steps
    return base + (step < extra).long()


def scheduled_before(block_length: int, num_steps: torch.Tensor, step: int) -> int:
    """The fewest positions `schedule_counts` has committed in any row before `step` (host arithmetic over the
    distinct step counts of the `(rows,)` or scalar host tensor `num_steps`): `step * base + min(step, extra)`."""
    return min(step * (block_length // s) + min(step, block_length % s) for s in set(num_steps.flatten().tolist()))


class FixedSchedule(UnmaskingPolicy):
    """LLaDA's linear schedule: a block of L masks over s steps commits `L // s` tokens per step, plus one for
    the first `L % s` steps (LLaDA Sec. 2.4, `get_num_transfer_tokens`). Steps beyond L commit nothing and are
    skipped."""

    capturable = True

    def start_block(self, block_length: int, num_steps: int | torch.Tensor) -> None:
        super().start_block(block_length, num_steps)
        if self.num_steps.dim() and bool((self.num_steps != self.num_steps.max()).any()):
            raise ValueError("FixedSchedule takes one step count for all rows of a block.")
        self.steps = int(self.num_steps.max())

    def steps_for_block(self) -> int:
        return min(self.steps, self.block_length)

    def scheduled_count(self, step: int) -> int:
        base, extra = divmod(self.block_length, self.steps)  # host arithmetic: called before every step
        return base + (1 if step < extra else 0)

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        return scheduled

    def fused_count(self) -> tuple[int, float]:
        return triton_ops.COMMIT_SCHEDULED, 0.0

    def max_masked(self, step: int) -> int:
        # Each step commits at least its scheduled count (or every mask left).
        return max(0, self.block_length - scheduled_before(self.block_length, self.num_steps, step))

    def still_active(self, active, masked_before, masked_after, edited, step):
        return active & (step < self.steps_for_block())


class ConfidenceThreshold(UnmaskingPolicy):
    """Fast-dLLM threshold decoding (arXiv:2505.22618, Sec. 3.3): commit every masked position with confidence
    >= `threshold`, and always the most confident one so that each step makes progress."""

    capturable = True

    def step_constants(self) -> tuple:
        return (self.threshold,)

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        return (sorted_confidence >= self.threshold).sum(-1).clamp(min=1)

    def fused_count(self) -> tuple[int, float]:
        return triton_ops.COMMIT_AT_LEAST_THRESHOLD, self.threshold

    def max_masked(self, step: int) -> int:
        return max(0, self.block_length - step)  # at least one commit per step

    def still_active(self, active, masked_before, masked_after, edited, step):
        return active & masked_after


class ConfidenceFactor(UnmaskingPolicy):
    """Fast-dLLM factor decoding (arXiv:2505.22618, Sec. 3.3): commit the n most confident masked positions for
    the largest n with `(n + 1) * (1 - c_n) < factor`, at least one. Unlike the reference loop, the last rank is
    judged by the same rule as the others."""

    capturable = True

    def step_constants(self) -> tuple:
        return (self.factor,)

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        n = torch.arange(1, sorted_confidence.shape[-1] + 1, device=sorted_confidence.device)
        passes = (n + 1) * (1.0 - sorted_confidence.double()) < self.factor
        return (passes * n).amax(-1).clamp(min=1)

    max_masked = ConfidenceThreshold.max_masked  # at least one commit per step, too

    def still_active(self, active, masked_before, masked_after, edited, step):
        return active & masked_after


class ScheduledThreshold(UnmaskingPolicy):
    """LLaDA2.0's rule (its `generate()`): step s of a block has the linear schedule's quota over the whole
    `block_length` (also for a first block that starts inside the prompt); if more masked positions than the
    quota have confidence strictly above `threshold`, all of them are committed, otherwise the quota's most
    confident ones. `threshold=None` is the schedule alone (the reference's `threshold=1.0`). A row's block
    ends when it holds no mask, or after its `s` steps."""

    capturable = True

    def step_constants(self) -> tuple:
        return (self.threshold,)

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.masked_counts: torch.Tensor | None = None
        self._schedule_table: torch.Tensor | None = None  # `scheduled_counts`' table for the block under way

    def start_block(self, block_length: int, num_steps, masked_counts: torch.Tensor | None = None) -> None:
        """`masked_counts` `(rows,)` (host): masked positions of each row's block at its start, which fixes the
        number of forwards in advance when no threshold can end a block early."""
        super().start_block(block_length, num_steps)
        self.masked_counts = masked_counts
        self._schedule_table = None

    def steps_for_block(self) -> int | None:
        """Without a threshold, a row with M masks needs the fewest steps whose quotas add up to M (at most its
        `s`): known on the host, so the loop runs them without asking the GPU whether masks are left."""
        steps = self.steps_per_row()
        return None if steps is None else int(steps.max()) if steps.numel() else 0

    def steps_per_row(self) -> torch.Tensor | None:
        """`(rows,)` long (host): the forwards each row needs in this block, when known in advance."""
        if self.threshold is not None or self.masked_counts is None:
            return None
        steps = self.num_steps.broadcast_to(self.masked_counts.shape)
        base, extra = self.block_length // steps, self.block_length % steps
        masked = self.masked_counts
        # Steps 1..extra commit base + 1 each, later ones base.
        within_extra = -(-masked // (base + 1))
        after_extra = extra + -(-(masked - extra * (base + 1)) // base.clamp(min=1))
        needed = torch.where(masked <= extra * (base + 1), within_extra, after_extra)
        return torch.minimum(needed, steps)

    def scheduled_counts(self, step: int, rows: int, device: torch.device) -> torch.Tensor:
        """`schedule_counts` of `step`: a row of the block's table of every step's counts, made at its first step
        (one computation per block instead of one per step)."""
        table = self._schedule_table
        if table is None or table.device != device or table.shape[0] <= step:
            steps = self.steps_on(device)
            every_step = torch.arange(max(step + 1, int(self.num_steps.max())), device=device)
            table = schedule_counts(self.block_length, steps, every_step.view(-1, *[1] * steps.dim()))
            self._schedule_table = table
        return table[step]

    max_masked = FixedSchedule.max_masked  # each step commits at least its quota, too

    def num_to_commit(self, sorted_confidence: torch.Tensor, scheduled: torch.Tensor) -> torch.Tensor:
        if self.threshold is None:
            return scheduled
        above = (sorted_confidence > self.threshold).sum(-1)
        return torch.where(above >= scheduled, above, scheduled)

    def fused_count(self) -> tuple[int, float]:
        if self.threshold is None:
            return triton_ops.COMMIT_SCHEDULED, 0.0
        return triton_ops.COMMIT_ABOVE_THRESHOLD_OR_SCHEDULED, self.threshold


class TokenEditing(ScheduledThreshold):
    """LLaDA2.1's rule (its `generate()`): each forward commits masked positions as `ScheduledThreshold` with the
    quota fixed at `num_to_transfer`, and also re-decodes committed, non-prompt positions of the block whose
    greedy token differs from the current one with probability > `editing_threshold`. A row's block goes on
    while it has masks or its last forward edited, with at most `max_post_steps` forwards after its last mask
    was committed (the reference's loop, counted per row)."""

    edits = True

    capturable = True

    def step_constants(self) -> tuple:
        return (self.threshold, self.editing_threshold)

    def __init__(self, threshold: float | None, editing_threshold: float, num_to_transfer: int, max_post_steps: int):
        super().__init__(threshold)
        self.editing_threshold = editing_threshold
        self.num_to_transfer = num_to_transfer
        self.max_post_steps = max_post_steps

    def start_block(self, block_length: int, num_steps, masked_counts: torch.Tensor | None = None) -> None:
        super().start_block(block_length, num_steps, masked_counts)
        self.post_steps: torch.Tensor | None = None

    def steps_for_block(self) -> None:
        return None  # edits decide when a block ends

    def steps_per_row(self) -> None:
        return None

    def scheduled_counts(self, step: int, rows: int, device: torch.device) -> torch.Tensor:
        return self.constant_counts(self.num_to_transfer, rows, device)

    def commit(self, proposal: "BlockProposal", scheduled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_block, _ = super().commit(proposal, scheduled)
        editable = ~proposal.masked & proposal.generated
        edit = editable & (proposal.x0 != proposal.block) & (proposal.probability > self.editing_threshold)
        return torch.where(edit, proposal.x0, new_block), edit.any(-1)

    def still_active(self, active, masked_before, masked_after, edited, step):
        if self.post_steps is None:
            self.post_steps = torch.zeros_like(active, dtype=torch.long)
        # A forward that found no mask is a post step; another forward follows only if this one found masks or
        # edited, and (once no mask is left) while the post steps stay within `max_post_steps`.
        self.post_steps = self.post_steps + (active & ~masked_before).long()
        within = masked_after | (self.post_steps + 1 <= self.max_post_steps)
        return active & (masked_before | edited) & within


@dataclass
class BlockProposal:
    """What one forward proposes for the current block (all `(rows, L)`): the block's tokens before the step,
    which of them are masked, which are generated positions (not prompt), the candidate token and its
    probability everywhere, and the ranking confidence (`NOT_MASKED` outside masked positions); `logits`
    `(rows, L, vocab)` are the block's logits, for policies with confidences of their own (Dream's margin, entropy)."""

    block: torch.Tensor
    masked: torch.Tensor
    generated: torch.Tensor
    x0: torch.Tensor
    probability: torch.Tensor
    confidence: torch.Tensor
    logits: torch.Tensor | None = None


@dataclass
class StepRules:
    """The fixed, per-call parameters of a denoising step (one object instead of loose arguments)."""

    policy: UnmaskingPolicy
    mask_token_id: int
    temperature: float = 0.0
    remasking: str = "low_confidence"
    suppressed_token_ids: torch.Tensor | None = None
    deferred_token_ids: torch.Tensor | None = None
    # `tensor_parallel.VocabShard` when the step's logits are this rank's vocabulary slice (greedy low-confidence
    # steps of a tensor-parallel model whose policy does not read the logits): `propose_tokens_sharded`.
    vocab_shard: object | None = None


def denoise_step(
    block: torch.Tensor,
    logits: torch.Tensor,
    rules: StepRules,
    scheduled: torch.Tensor,
    generated: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One denoising step on a block, a pure tensor function (graph-capturable).

    Args:
        block: `(rows, L)` tokens of the block before the step.
        logits: `(rows, L, vocab)` logits of the block's positions, or `(rows, U, vocab)` of the positions
            `candidates`.
        scheduled: `(rows,)` the schedule's count for this step (see `UnmaskingPolicy.num_to_commit`).
        generated: `(rows, L)` bool, positions after the prompt (only they may be edited); default all.
        active: `(rows,)` bool, rows still denoising this block; the others are returned unchanged.
        candidates: `(rows, U)` distinct block positions holding every masked position of each active row (the
            policy's `masked_bound`), or None (logits at every position). Elsewhere the proposal is the block's
            own token with probability 0: no policy that reads it there (editing, the block's logits) gets them.

    Returns the new block, a draft `(rows, L)` in which still-masked positions show their current candidate (for
    streamers' `put_draft`), and `(rows,)` bool: whether the step edited a committed token.
    """
    masked = block == rules.mask_token_id
    if rules.vocab_shard is not None:  # every position's probability, as below
        x0, probability = propose_tokens_sharded(
            logits, rules.vocab_shard, None, rules.suppressed_token_ids, rules.deferred_token_ids, rules.mask_token_id
        )
        logits = None  # a slice: no policy that reads logits gets sharded ones
    else:
        x0, probability = propose_tokens(
            logits,
            None,  # every position's probability (the policies read it where it is not masked too)
            rules.temperature,
            rules.remasking,
            rules.suppressed_token_ids,
            rules.deferred_token_ids,
            rules.mask_token_id,
        )
    rule = rules.policy.fused_commit_rule()
    if rule is not None and triton_ops.commit_applies(block.shape[1]) and use_fused_kernels(probability):
        # The same decision in one launch instead of ~15 (scatters, sort, rank scatter, count, commit, freeze, draft).
        return triton_ops.commit_most_confident(
            block, x0, probability, candidates, scheduled, active, rules.mask_token_id, *rule
        )
    if candidates is not None:
        x0 = block.scatter(1, candidates, x0)
        probability = torch.zeros(block.shape, dtype=probability.dtype, device=block.device).scatter(
            1, candidates, probability
        )
        logits = None
    proposal = BlockProposal(
        block=block,
        masked=masked,
        generated=generated if generated is not None else torch.ones_like(masked),
        x0=x0,
        probability=probability,
        confidence=torch.where(masked, probability, NOT_MASKED),
        logits=logits,
    )
    new_block, edited = rules.policy.commit(proposal, scheduled)
    if active is not None:
        new_block = torch.where(active.unsqueeze(-1), new_block, block)
        edited = edited & active
    draft = torch.where(new_block == rules.mask_token_id, x0, new_block)
    return new_block, draft, edited

