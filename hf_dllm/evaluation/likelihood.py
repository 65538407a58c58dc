"""Monte-Carlo log-likelihood of a continuation under a masked-diffusion LM (used by the lm-eval adapter).

A masked-diffusion model has no left-to-right factorisation, so `log p(continuation | prompt)` is estimated by the
variational bound of LLaDA (arXiv:2502.09992, Eq. (6) and App. B.5):

    log p(r | p)  >=  E_{l ~ U{1..L}, r_l}[ (L / l) * sum_{i masked in r_l} log p_theta(r_i | p, r_l) ]

where `L` is the continuation length and `r_l` is the continuation with `l` positions, chosen uniformly without
replacement, replaced by the mask token. Each sample costs one forward over `prompt + r_l`; the estimate averages
`num_samples` of them. As in LLaDA's evaluation, the `l` values are stratified (an evenly spaced grid over
`1..L` with a random offset) to lower the variance; the estimator stays unbiased.

Determinism: every request draws its masks from its own generator, seeded by `seed` and the request's tokens, so
an estimate does not depend on the other requests, on their order, on the batch size or on the process it runs in
(up to float rounding of padded batches).

Batching: the samples of all requests are packed into forwards of `batch_size` rows, left-padded (the model's
attention mask and padding-aware positions make a padded row compute what it computes alone), and only the last
`max continuation length` positions go through the output head.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..generation_utils import left_pad


@dataclass
class _Sample:
    request: int
    tokens: list[int]  # prompt + continuation, masked positions already replaced by the mask id
    prompt_len: int
    masked: list[int]  # positions (in the continuation) that are masked
    targets: list[int]  # original tokens at those positions
    weight: float  # L / l


def request_generator(seed: int, prompt: Sequence[int], continuation: Sequence[int]) -> torch.Generator:
    """CPU generator seeded by `seed` and the request's tokens (stable across processes and runs)."""
    digest = hashlib.sha256(f"{seed}|{','.join(map(str, prompt))}|{','.join(map(str, continuation))}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def stratified_mask_counts(length: int, num_samples: int, generator: torch.Generator) -> list[int]:
    """`num_samples` numbers of masked positions in `1..length`: a grid of step `length / num_samples` shifted by a
    uniform random start and wrapped around, so every count is equally likely and the counts cover the range."""
    start = int(torch.randint(1, length + 1, (), generator=generator))
    counts = []
    for i in range(num_samples):
        value = math.floor(start + i * length / num_samples + 0.5)
        counts.append((value - 1) % length + 1)
    return counts


def draw_samples(
    prompt: Sequence[int],
    continuation: Sequence[int],
    num_samples: int,
    mask_token_id: int,
    seed: int,
    request: int = 0,
) -> list[_Sample]:
    """The masked copies of `prompt + continuation` one request's estimate averages over."""
    length = len(continuation)
    generator = request_generator(seed, prompt, continuation)
    samples = []
    for count in stratified_mask_counts(length, num_samples, generator):
        positions = sorted(torch.randperm(length, generator=generator)[:count].tolist())
        tokens = list(prompt) + list(continuation)
        for position in positions:
            tokens[len(prompt) + position] = mask_token_id
        samples.append(
            _Sample(
                request=request,
                tokens=tokens,
                prompt_len=len(prompt),
                masked=positions,
                targets=[continuation[p] for p in positions],
                weight=length / count,
            )
        )
    return samples


def _forward_logits(model, rows: list[_Sample], keep: int, pad_token_id: int, mask_token_id: int, cfg_scale: float):
    """Logits `(rows, keep, vocab)` of the last `keep` positions of each left-padded row."""
    device = model.get_input_embeddings().weight.device
    input_ids, attention_mask = left_pad([row.tokens for row in rows], pad_token_id)
    width = input_ids.shape[1]
    if cfg_scale > 0:
        # LLaDA App. B.3: the unconditional branch sees the prompt masked.
        unconditional = input_ids.clone()
        for i, row in enumerate(rows):
            start = width - len(row.tokens)
            unconditional[i, start : start + row.prompt_len] = mask_token_id
        input_ids = torch.cat([input_ids, unconditional])
        attention_mask = torch.cat([attention_mask, attention_mask])
    mask = None if bool(attention_mask.all()) else attention_mask.to(device)
    logits = model(input_ids=input_ids.to(device), attention_mask=mask, logits_to_keep=keep).logits
    if cfg_scale > 0:
        conditional, unconditional = logits.float().chunk(2, dim=0)
        logits = unconditional + (cfg_scale + 1) * (conditional - unconditional)
    return logits


@torch.no_grad()
def mc_loglikelihood(
    model,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    num_samples: int = 128,
    batch_size: int = 32,
    mask_token_id: int | None = None,
    pad_token_id: int | None = None,
    cfg_scale: float = 0.0,
    seed: int = 1234,
    progress=None,
) -> list[float]:
    """Monte-Carlo estimates of `log p(continuation | prompt)` for `(prompt_ids, continuation_ids)` pairs.

    Args:
        model: a masked-diffusion LM whose forward takes `input_ids`, `attention_mask`, `logits_to_keep`.
        requests: token id lists; every continuation must be non-empty.
        num_samples: Monte-Carlo samples per request (LLaDA: 128; 1 is exact for a one-token continuation).
        batch_size: rows per forward (samples of several requests share forwards).
        mask_token_id / pad_token_id: default to the model's generation config.
        cfg_scale: unsupervised classifier-free guidance (LLaDA App. B.3), 0 = off.
        seed: base seed of the per-request generators.
        progress: optional callable `progress(n)` called with the number of rows after each forward.

    Returns:
        One float per request (the estimate of the log-likelihood, <= 0 in expectation).
    """
    family = model.diffusion_family
    if not family.scores_likelihood:
        # The bound needs every masked position to see the whole (partly masked) continuation; a block-causal
        # model (LLaDA2.x) attends only to its own and earlier blocks, so this estimate would be a different,
        # unvalidated quantity.
        raise NotImplementedError(
            f"{type(model).__name__} is a {family.topology} {family.display_name} model: LLaDA's Monte-Carlo "
            "log-likelihood assumes bidirectional attention and is not implemented for it. Evaluate it on generation tasks (lm-eval "
            "`generate_until`, `hf-dllm eval`)."
        )
    if num_samples < 1 or batch_size < 1:
        raise ValueError(f"num_samples and batch_size must be >= 1, got {num_samples} and {batch_size}.")
    generation_config = getattr(model, "generation_config", None)
    if mask_token_id is None:
        mask_token_id = getattr(generation_config, "mask_token_id", None)
    if mask_token_id is None:
        raise ValueError("mask_token_id is not set (pass it or set it in the model's generation config).")
    if pad_token_id is None:
        pad_token_id = generation_config.prompt_pad_token_id if generation_config is not None else 0
    shift = family.logits_shift

    samples: list[_Sample] = []
    for index, (prompt, continuation) in enumerate(requests):
        if len(continuation) == 0:
            raise ValueError(f"request {index} has an empty continuation: nothing to score.")
        if shift and len(prompt) < shift:
            raise ValueError(
                f"request {index}: this model predicts token i from position i - {shift}; "
                f"the prompt needs {shift} token(s)."
            )
        samples.extend(draw_samples(prompt, continuation, num_samples, mask_token_id, seed, index))

    # Longest first, so padding stays small and an out-of-memory error shows up on the first forward.
    samples.sort(key=lambda s: (-len(s.tokens), s.request))
    totals = [0.0] * len(requests)
    for start in range(0, len(samples), batch_size):
        rows = samples[start : start + batch_size]
        continuation_lengths = [len(row.tokens) - row.prompt_len for row in rows]
        keep = max(continuation_lengths) + shift
        logits = _forward_logits(model, rows, keep, pad_token_id, mask_token_id, cfg_scale)
        row_index, column, targets, weights = [], [], [], []
        for i, (row, length) in enumerate(zip(rows, continuation_lengths, strict=True)):
            offset = keep - length - shift  # column of the continuation's first position
            row_index += [i] * len(row.masked)
            column += [offset + p for p in row.masked]
            targets += row.targets
            weights += [row.weight] * len(row.masked)
        picked = logits[torch.tensor(row_index), torch.tensor(column)].float()
        device = picked.device
        losses = F.cross_entropy(picked, torch.tensor(targets, device=device), reduction="none")
        losses = (losses * torch.tensor(weights, device=device, dtype=losses.dtype)).cpu().tolist()
        for i, loss in zip(row_index, losses, strict=True):
            totals[rows[i].request] += loss
        if progress is not None:
            progress(len(rows))
    return [-total / num_samples for total in totals]


@torch.no_grad()
def greedy_matches(
    model,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    batch_size: int = 8,
    cfg_scale: float = 0.0,
) -> list[bool]:
    """Whether greedy low-confidence decoding of `len(continuation)` masks after the prompt, one token per step
    (LLaDA's `suffix_greedy_prediction`), reproduces the continuation. Runs through `generate()`."""
    pad_token_id = model.generation_config.prompt_pad_token_id
    device = model.get_input_embeddings().weight.device
    results = [False] * len(requests)
    by_length: dict[int, list[int]] = {}
    for index, (_, continuation) in enumerate(requests):
        by_length.setdefault(len(continuation), []).append(index)
    for length, indices in by_length.items():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            input_ids, attention_mask = left_pad([list(requests[i][0]) for i in chunk], pad_token_id)
            out = model.generate(
                input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=length,
                block_length=length,
                steps=length,
                threshold=None,
                factor=None,
                temperature=0.0,
                remasking="low_confidence",
                use_cache=False,
                cfg_scale=cfg_scale,
                eos_early_stop=False,
                logits_eos_inf=False,
                confidence_eos_eot_inf=False,
            )
            generated = out[:, input_ids.shape[1] :].cpu()
            for row, i in enumerate(chunk):
                results[i] = generated[row].tolist() == list(requests[i][1])
    return results
