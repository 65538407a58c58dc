"""Dream's decoding rules as unmasking policies of the one block loop.

Dream (arXiv:2508.15487) decodes with a timestep schedule instead of LLaDA's linear one: with `t =
linspace(1, eps, s + 1)`, step i of s commits `k_i = int(M_i * (1 - t[i+1] / t[i]))` of the `M_i` masked positions
left (all of them at the last step), chosen by a confidence that depends on `alg`:

- `maskgit_plus`: the probability of the candidate token (top-1 probability when greedy);
- `topk_margin`: top-1 minus top-2 probability;
- `entropy`: negative entropy `sum p log p` of the token distribution;
- `origin`: no confidence: each masked position is committed independently with probability `1 - t[i+1] / t[i]`.

`alg_temp > 0` samples the committed positions from `softmax(confidence / alg_temp)` (without replacement) instead
of taking the most confident ones; `temperature`, `top_p`, `top_k` shape the token distribution (Dream's
`sample_tokens`).

Fast-dLLM (arXiv:2505.22618) runs Dream's sampler block by block with a KV cache: each block's first forward (the
full one that refreshes the cache) commits the block's first position unconditionally (its prediction comes from
the committed token before it, as in an autoregressive step), then the block runs Dream's schedule over steps
1..s-1 with `t = linspace(1, eps, s + 1)` (`alg` other than `confidence_threshold`), or Fast-dLLM's threshold
rule until no mask is left (`confidence_threshold`: the most confident position and every other with confidence
>= `threshold`). `make_dream_policy` applies that block start whenever `use_cache` is on, so cached decoding is
Fast-dLLM's algorithm and uncached decoding is Dream's own.

Every schedule is computed on the host before the block (all rows of a block start with the same number of masks
and commit the same number per step), so steps that would commit nothing are skipped: they change no token, and
the reference's forward count is an upper bound of ours.

On CUDA the greedy rules (`temperature` 0, `alg_temp` 0, any `alg` but `origin`, with or without `top_p` / `top_k`)
are pure tensor functions of the step's inputs, so the loop captures their steps in CUDA graphs (`graphs.py`);
`origin` and `alg_temp` > 0 draw random numbers (and `origin` reads its step's probability on the host), so they
run eagerly.

This file is exported verbatim as Hub remote code: relative imports only.
"""

from __future__ import annotations

import torch

from .decoding import NOT_MASKED, BlockProposal, ConfidenceThreshold, UnmaskingPolicy, rank_by_confidence
from .family_dream import DEFAULT_DREAM_ALG, DREAM_ALGS
from .generation_config import DiffusionGenerationConfig

# `scheduled` count meaning "commit the first masked position of each row" (a block's first step in Fast-dLLM).
FIRST_POSITION = -1

__all__ = [
    "DEFAULT_DREAM_ALG",
    "DREAM_ALGS",
    "DreamSchedule",
    "DreamThreshold",
    "dream_sample_tokens",
    "dream_transfer_counts",
    "make_dream_policy",
]


def top_p_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering as Dream's `top_p_logits`: keep the most probable tokens whose cumulative probability
    reaches `top_p` (always the first), set the others to the dtype's minimum. `(..., vocab)` -> same."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_indices, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Dream's `top_k_logits`: tokens below the k-th largest logit get the dtype's minimum."""
    top_k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def dream_sample_tokens(
    logits: torch.Tensor,
    alg: str,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    mask_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's `sample_tokens`: candidate tokens and their confidence.

    Args:
        logits: `(..., vocab)`.
        alg: which confidence (`maskgit_plus` / `confidence_threshold` / `origin`: the candidate's probability;
            `topk_margin`: top-1 minus top-2 probability; `entropy`: `sum p log(p + 1e-10)`).
        temperature: 0 = greedy, else logits / temperature and a categorical draw.
        top_p, top_k: filtering before the softmax, as Dream's.
        mask_token_id: never proposed (a committed mask would stay masked); probabilities and confidences are
            still those of the full distribution, so decisions equal Dream's whenever its candidate is not the mask.

    Returns `x0` `(...)` long and `confidence` `(...)` float32.
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    candidates = probs
    if mask_token_id is not None:
        candidates = probs.clone()
        candidates[..., mask_token_id] = 0.0
    if temperature > 0:
        flat = candidates.reshape(-1, candidates.shape[-1])
        x0 = torch.multinomial(flat, 1, replacement=True).view(candidates.shape[:-1])
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        confidence, x0 = candidates.max(dim=-1)
    if alg == "topk_margin":
        top2 = torch.topk(probs, 2, dim=-1).values
        confidence = top2[..., 0] - top2[..., 1]
    elif alg == "entropy":
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return x0, confidence


def dream_transfer_counts(masks: int, steps: int, eps: float, first_position: bool = False) -> list[int]:
    """Tokens Dream's schedule commits at each step of a block that starts with `masks` masked positions.

    `t = linspace(1, eps, steps + 1)` (float32 on the CPU, as the reference builds it on a CPU run); step i commits
    `int(M_i * (1 - t[i+1] / t[i]))` (float32 arithmetic, as the reference's tensors), the last step all that is
    left. With `first_position` (Fast-dLLM's block start) step 0 commits the block's first position
    (`FIRST_POSITION`) and steps 1..s-1 follow the schedule; a one-step block then commits everything at once (the
    reference would leave it masked). Steps that commit nothing are dropped (they would change no token).
    """
    if first_position and steps >= 2 and masks >= 1:
        counts, left, first_step = [FIRST_POSITION], masks - 1, 1
    else:
        counts, left, first_step = [], masks, 0
    t = torch.linspace(1, eps, steps + 1)
    for i in range(first_step, steps):
        if i < steps - 1:
            k = int(torch.tensor(left, dtype=torch.float32) * (1 - t[i + 1] / t[i]))
        else:
            k = left
        k = min(k, left)
        if k > 0:
            counts.append(k)
            left -= k
    return counts


def first_masked_position(masked: torch.Tensor) -> torch.Tensor:
    """`(rows, L)` bool: each row's first masked position (none for a row without masks)."""
    return masked & (masked.long().cumsum(-1) == 1)


class DreamSchedule(UnmaskingPolicy):
    """Dream's scheduled rule (`alg` in `maskgit_plus`, `topk_margin`, `entropy`, `origin`), optionally with
    Fast-dLLM's block start (`first_position`). See the module docstring.

    Per block the schedule is a host list (`dream_transfer_counts`), one entry per forward; `scheduled` carries
    the step's count into the step (or `FIRST_POSITION`). The greedy path is a pure tensor function; `alg_temp` >
    0 samples positions with Gumbel top-k (the law of Dream's sampling without replacement), `origin` draws one
    uniform number per position."""

    reads_logits = True  # its confidences come from the whole vocabulary's logits

    # The greedy path (not `origin`, no `alg_temp`) is capturable; `graph_key` says None for the others.
    capturable = True

    def __init__(
        self,
        alg: str,
        alg_temp: float | None = None,
        temperature: float = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        eps: float = 1e-3,
        mask_token_id: int | None = None,
        first_position: bool = False,
    ):
        if alg not in DREAM_ALGS or alg == "confidence_threshold":
            raise ValueError(f"DreamSchedule: `alg` must be one of {DREAM_ALGS[:-1]}, got {alg!r}.")
        self.alg = alg
        self.alg_temp = alg_temp or 0.0
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.eps = eps
        self.mask_token_id = mask_token_id
        self.first_position = first_position

    def graph_key(self) -> tuple | None:
        """None (eager steps) for the random rules: `origin` (uniform draws, and the step's probability read on the
        host), `alg_temp` > 0 (Gumbel noise) and `temperature` > 0 (a categorical draw)."""
        if self.alg == "origin" or self.alg_temp > 0 or self.temperature > 0:
            return None
        return super().graph_key()

    def step_constants(self) -> tuple:
        # The step's counts (and the block start's `FIRST_POSITION`) arrive as the `scheduled` input, and `eps` only
        # shapes those host-side counts: what the step bakes in is the confidence and the token filtering.
        return (self.alg, self.top_p, self.top_k, self.mask_token_id)

    def start_block(self, block_length: int, num_steps) -> None:
        super().start_block(block_length, num_steps)
        if self.num_steps.dim() and bool((self.num_steps != self.num_steps.max()).any()):
            raise ValueError("DreamSchedule takes one step count for all rows of a block.")
        steps = int(self.num_steps.max())
        if self.alg == "origin":
            # Random commits: every step of the schedule runs (each commits a random share).
            self.counts = [FIRST_POSITION] if self.first_position and steps >= 2 else []
            t = torch.linspace(1, self.eps, steps + 1)
            first = len(self.counts)
            self.probabilities = [float(1 - t[i + 1] / t[i]) if i < steps - 1 else 1.0 for i in range(first, steps)]
            self.counts += [0] * len(self.probabilities)
        else:
            self.counts = dream_transfer_counts(block_length, steps, self.eps, self.first_position)
        self.step = 0

    def steps_for_block(self) -> int:
        return len(self.counts)

    def scheduled_count(self, step: int) -> int:
        self.step = step  # host-side, for `origin`'s probability of this step
        return self.counts[step]

    def still_active(self, active, masked_before, masked_after, edited, step):
        return active & (step < self.steps_for_block())

    def commit(self, proposal: BlockProposal, scheduled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        masked = proposal.masked
        x0, confidence = dream_sample_tokens(
            proposal.logits, self.alg, self.temperature, self.top_p, self.top_k, self.mask_token_id
        )
        if self.alg == "origin":
            first_count = 1 if self.counts and self.counts[0] == FIRST_POSITION else 0
            if self.step < first_count:
                commit = torch.zeros_like(masked)
            else:
                p = self.probabilities[self.step - first_count]
                commit = masked & (torch.rand(masked.shape, device=masked.device) < p)
        else:
            keys = torch.where(masked, confidence, NOT_MASKED)
            if self.alg_temp > 0:
                # Gumbel top-k: the k largest of log-softmax(confidence / alg_temp) + Gumbel noise are a draw of k
                # positions without replacement from softmax(confidence / alg_temp), Dream's multinomial.
                uniform = torch.rand(keys.shape, device=keys.device).clamp(min=torch.finfo(torch.float32).tiny)
                keys = torch.where(masked, keys / self.alg_temp - torch.log(-torch.log(uniform)), NOT_MASKED)
            _, ranks = rank_by_confidence(keys)
            commit = masked & (ranks < scheduled.clamp(min=0).unsqueeze(-1))
        commit = torch.where((scheduled == FIRST_POSITION).unsqueeze(-1), first_masked_position(masked), commit)
        new_block = torch.where(commit, x0, proposal.block)
        return new_block, torch.zeros(new_block.shape[0], dtype=torch.bool, device=new_block.device)


class DreamThreshold(ConfidenceThreshold):
    """Fast-dLLM's threshold rule on Dream (`alg="confidence_threshold"`): each step commits the most confident
    masked position and every other one with probability >= `threshold`, with Dream's token sampling; with
    `first_position`, a block's first step commits its first position (Fast-dLLM's cached block start)."""

    reads_logits = True  # its confidences come from the whole vocabulary's logits

    # Greedy steps are capturable (`graph_key` says None when sampling).
    capturable = True

    def __init__(
        self,
        threshold: float,
        temperature: float = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        mask_token_id: int | None = None,
        first_position: bool = False,
    ):
        super().__init__(threshold)
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.mask_token_id = mask_token_id
        self.first_position = first_position

    def graph_key(self) -> tuple | None:
        """None (eager steps) when `temperature` > 0: the tokens are a categorical draw."""
        if self.temperature > 0:
            return None
        return super().graph_key()

    def step_constants(self) -> tuple:
        # The block start arrives as the `scheduled` input (`FIRST_POSITION`); the threshold and the token filtering
        # are baked in.
        return (self.threshold, self.top_p, self.top_k, self.mask_token_id)

    def scheduled_count(self, step: int) -> int:
        return FIRST_POSITION if self.first_position and step == 0 else 0

    def commit(self, proposal: BlockProposal, scheduled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        masked = proposal.masked
        x0, confidence = dream_sample_tokens(
            proposal.logits, "maskgit_plus", self.temperature, self.top_p, self.top_k, self.mask_token_id
        )
        sorted_confidence, ranks = rank_by_confidence(torch.where(masked, confidence, NOT_MASKED))
        commit = masked & (ranks < self.num_to_commit(sorted_confidence, scheduled).unsqueeze(-1))
        commit = torch.where((scheduled == FIRST_POSITION).unsqueeze(-1), first_masked_position(masked), commit)
        new_block = torch.where(commit, x0, proposal.block)
        return new_block, torch.zeros(new_block.shape[0], dtype=torch.bool, device=new_block.device)


def make_dream_policy(config: DiffusionGenerationConfig) -> UnmaskingPolicy | None:
    """The policy for Dream's settings: `threshold` (with `alg` None or `confidence_threshold`) gives
    `DreamThreshold`; `factor` gives None (the loop's Fast-dLLM factor rule, on the candidate's probability);
    otherwise `DreamSchedule` with `alg` (default `DEFAULT_DREAM_ALG`). `use_cache` adds Fast-dLLM's block start.
    Raises `ValueError` for the settings of LLaDA's rules that Dream's do not implement."""
    for name in ("logits_eos_inf", "confidence_eos_eot_inf"):
        if getattr(config, name):
            raise ValueError(f"`{name}` is a LLaDA option that Dream's rules do not implement: set it to False.")
    if config.remasking != "low_confidence":
        raise ValueError(
            f"`remasking={config.remasking!r}` is LLaDA's; Dream chooses positions by `alg` (one of {DREAM_ALGS}): "
            "leave remasking at 'low_confidence'."
        )
    if config.factor is not None:
        return None
    sampling = dict(
        temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, mask_token_id=config.mask_token_id
    )
    if config.threshold is not None:
        return DreamThreshold(config.threshold, first_position=config.use_cache, **sampling)
    return DreamSchedule(
        config.alg or DEFAULT_DREAM_ALG,
        config.alg_temp,
        eps=config.eps,
        first_position=config.use_cache,
        **sampling,
    )
