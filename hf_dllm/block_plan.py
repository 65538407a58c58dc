"""Where a `generate()` call decodes: the blocks of the generated region and each row's columns on the canvas.

`plan_blocks` splits `max_new_tokens` into blocks of `block_length` with their share of `steps` (LLaDA
arXiv:2502.09992, Sec. 2.4: semi-autoregressive blocks, the steps spread evenly). `plan_bidirectional` lays a batch of
left-padded prompts out for bidirectional models (LLaDA, Dream: the blocks start after the prompt);
`plan_block_causal` for block-causal ones (LLaDA2.x, arXiv:2512.15745: blocks aligned to absolute positions, the
prompt's last partial block decoded with the first generated positions). Both give a `BlockPlan`, built once per call
before any forward; the loop (`block_loop.py`) and the serving engine read it.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .generation_config import DiffusionGenerationConfig


def plan_blocks(max_new_tokens: int, block_length: int, steps: int | None) -> list[tuple[int, int, int]]:
    """Split the generated region into blocks: `[(offset, length, steps), ...]`.

    Blocks have `block_length` positions except a shorter last one. `steps` (total) is spread in proportion to
    block lengths: block b gets `floor(steps * end_b / N) - floor(steps * start_b / N)` (N = `max_new_tokens`),
    which is `steps / num_blocks` for equal blocks as in LLaDA; any block left with 0 borrows one from the
    block with the most. `None` gives each block one step per position.
    """
    # Offsets are arithmetic (block b starts at b * block_length): summing the lengths before each block was
    # quadratic in the number of blocks (100k blocks took a minute).
    lengths = [block_length] * (max_new_tokens // block_length)
    if max_new_tokens % block_length:
        lengths.append(max_new_tokens % block_length)
    offsets = [b * block_length for b in range(len(lengths))]
    if steps is None:
        block_steps = list(lengths)
    else:
        if steps < len(lengths):
            raise ValueError(
                f"`steps` ({steps}) must be >= the number of blocks ({len(lengths)} = "
                f"ceil(max_new_tokens={max_new_tokens} / block_length={block_length})): each block needs a step."
            )
        block_steps = [
            steps * (off + length) // max_new_tokens - steps * off // max_new_tokens
            for off, length in zip(offsets, lengths, strict=True)
        ]
        # Only the short last block can get 0 (a full block's share, steps * block_length / N, is >= 1 once
        # steps >= the number of blocks), so at most one donor search runs: linear in the number of blocks.
        for b, count in enumerate(block_steps):
            if count == 0:
                donor = max(range(len(block_steps)), key=block_steps.__getitem__)
                block_steps[donor] -= 1
                block_steps[b] = 1
    return list(zip(offsets, lengths, block_steps, strict=True))


@dataclass
class BlockPlan:
    """Where one `generate()` call puts everything on its canvas (the `(batch, canvas_width)` token matrix the
    loop denoises), and which blocks it decodes. Built once per call, before any forward.

    Args:
        canvas_width: columns of the canvas.
        prompt_start, prompt_end: `(batch,)` long, each row's prompt occupies columns `[prompt_start, prompt_end)`
            and its generated positions start at `prompt_end`; columns before `prompt_start` are padding.
        blocks: `[(start, end), ...]` columns of the blocks, shared by all rows, decoded left to right.
        block_steps: `(batch, num_blocks)` long (host), each row's share of `steps` per block.
        last_block: `(batch,)` long (host), the last block each row decodes (rows may need fewer blocks).
        prompt_width: the width of the caller's (left-padded) prompts; output rows are the caller's prompt
            followed by the generated positions `[prompt_end, prompt_end + max_new_tokens)`.
    """

    canvas_width: int
    prompt_start: torch.Tensor
    prompt_end: torch.Tensor
    blocks: list[tuple[int, int]]
    block_steps: torch.Tensor
    last_block: torch.Tensor
    prompt_width: int


def plan_bidirectional(
    prompt_width: int, batch: int, config: DiffusionGenerationConfig, device: torch.device
) -> BlockPlan:
    """LLaDA-style plan: the canvas is the caller's prompts followed by `max_new_tokens` masks, blocks start right
    after the prompts (`plan_blocks`), every row decodes every block with the same steps."""
    blocks = plan_blocks(config.max_new_tokens, config.block_length, config.steps)
    return BlockPlan(
        canvas_width=prompt_width + config.max_new_tokens,
        prompt_start=torch.zeros(batch, dtype=torch.long, device=device),
        prompt_end=torch.full((batch,), prompt_width, dtype=torch.long, device=device),
        blocks=[(prompt_width + offset, prompt_width + offset + length) for offset, length, _ in blocks],
        block_steps=torch.tensor([[steps for _, _, steps in blocks]] * batch, dtype=torch.long),
        last_block=torch.full((batch,), len(blocks) - 1, dtype=torch.long),
        prompt_width=prompt_width,
    )


def plan_block_causal(
    prompt_lengths: list[int], prompt_width: int, config: DiffusionGenerationConfig, device: torch.device
) -> BlockPlan:
    """LLaDA2-style plan (block-causal models, LLaDA2.0 tech report; its reference `generate()`): blocks are
    aligned to each row's absolute positions (position p is in block p // block_length), the first decoded block
    is the one holding position `len(prompt)` (so it can hold the prompt's tail), and the last block is decoded
    whole (positions past `max_new_tokens` are decoded and dropped).

    Rows of different prompt lengths are left-padded by whole blocks so that every row's first decoded block
    starts at the same column: block boundaries then coincide for all rows, and a row's block-causal attention
    is the one it has alone. Row r decodes `ceil((P_r + N) / B) - P_r // B` blocks, N = `max_new_tokens`; a row
    with one block fewer ends one block earlier. `steps` (total, per row) is split over a row's blocks in
    proportion (`steps / blocks` each when it divides), each capped at `max_new_tokens // minimal_topk`; `None`
    means `block_length` steps per block (one token per step)."""
    block, new = config.block_length, config.max_new_tokens
    first_blocks = [length // block for length in prompt_lengths]
    num_blocks = [-(-(length + new) // block) - length // block for length in prompt_lengths]
    start_block = max(first_blocks)
    cap = new // config.minimal_topk
    if cap < 1:
        raise ValueError(
            f"`minimal_topk` ({config.minimal_topk}) must be <= max_new_tokens ({new}): it caps a block's steps at "
            "max_new_tokens // minimal_topk."
        )
    steps = torch.zeros(len(prompt_lengths), max(num_blocks), dtype=torch.long)
    for row, count in enumerate(num_blocks):
        if config.steps is None:
            steps[row, :count] = min(block, cap)
            continue
        if config.steps < count:
            raise ValueError(
                f"`steps` ({config.steps}) must be >= the number of blocks a prompt of {prompt_lengths[row]} tokens "
                f"decodes ({count} = ceil((prompt + max_new_tokens) / block_length) - prompt // block_length)."
            )
        shares = torch.arange(count + 1) * config.steps // count
        steps[row, :count] = (shares[1:] - shares[:-1]).clamp(max=cap)
    shift = torch.tensor([(start_block - first) * block for first in first_blocks], dtype=torch.long)
    lengths = torch.tensor(prompt_lengths, dtype=torch.long)
    return BlockPlan(
        canvas_width=(start_block + max(num_blocks)) * block,
        prompt_start=shift.to(device),
        prompt_end=(shift + lengths).to(device),
        blocks=[((start_block + k) * block, (start_block + k + 1) * block) for k in range(max(num_blocks))],
        block_steps=steps,
        last_block=torch.tensor(num_blocks, dtype=torch.long) - 1,
        prompt_width=prompt_width,
    )
