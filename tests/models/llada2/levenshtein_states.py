"""Random LLaDA2.2 block states for comparing the fused Levenshtein step (`triton_levenshtein.levenshtein_step`)
with the PyTorch step it replaces, on the CPU under Triton's interpreter (`test_llada22_fused_step.py`) and on CUDA
(`test_llada22_fused_step_gpu.py`).

Each trial builds a random state (original-mask flags, started / finished rows, counters at and past the final
cleanup's limits, past contents holding the current block so that the anti-loop fires, per-index histories
holding the chosen position's best tokens so that its re-sample must skip them, `seen_count` past the history's
depth) and logits concentrated on a few tokens (MASK, DELETE and SPLIT among them, tied probabilities across
positions, a vocabulary of several of the kernel's chunks), runs both steps from copies of it with the same
candidates, and then a few more steps from the results."""

from __future__ import annotations

import torch

from hf_dllm.kernels import set_kernel_mode
from hf_dllm.levenshtein_editing import LevenshteinEditing

MASK, DELETE, SPLIT, VOCAB = 2400, 7, 1030, 2600
# The tokens the logits favour: MASK, DELETE, SPLIT and ordinary tokens in each chunk of the vocabulary.
FAVOURED = torch.tensor([MASK, DELETE, SPLIT, 3, 4, 1500, 2100, 2599])


def random_state(
    rule: LevenshteinEditing, rows: int, length: int, generator: torch.Generator, device, vocab: int = VOCAB
) -> tuple:
    """`(block, generated, logits, state)` of a random block step (the rule's buffers hold the state)."""

    def randint(high, shape=()):
        return torch.randint(0, high, shape, generator=generator)

    def chance(probability, shape=()):
        return torch.rand(shape, generator=generator) < probability

    depth = rule.max_updates(length)
    prompt = randint(length // 2 + 1, (rows, 1))
    prompt[chance(0.5, (rows,))] = 0
    generated = torch.arange(length) >= prompt
    block = FAVOURED[randint(len(FAVOURED), (rows, length))]
    block[chance(0.4, (rows, length)) & generated] = MASK
    rule.prepare_block(rows, device)
    limit = length + rule.max_post_steps
    state = {
        "orig": chance(0.6, (rows, length)) & generated & (block == MASK),
        "started": chance(0.8, (rows,)),
        "updates": randint(limit + 3, (rows,)),
        "post": randint(rule.max_post_steps + 2, (rows,)),
        "finished": chance(0.2, (rows,)),
        "seen": FAVOURED[randint(len(FAVOURED), (rows, depth, length))],
        "seen_count": randint(depth + 3, (rows,)),
        "hist": FAVOURED[randint(len(FAVOURED), (rows, length, depth))],
    }
    # Sparse histories (some of the favoured tokens left for the anti-loop to choose), and full ones.
    filled = torch.rand(rows, 1, 1, generator=generator).square()
    state["hist"][torch.rand(rows, length, depth, generator=generator) > filled] = -1
    for row in range(rows):
        count = int(state["seen_count"][row])
        if chance(0.6) and count > 0:  # the current content seen before: the anti-loop fires if a position changes
            state["seen"][row, min(int(randint(count)), depth - 1)] = block[row]
        elif count < depth:  # ... or in a slot past the count, which must not count
            state["seen"][row, count] = block[row]
    logits = torch.randn(rows, length, vocab, generator=generator)
    boost = torch.rand(rows, length, generator=generator) * 14
    favoured = FAVOURED[randint(len(FAVOURED), (rows, length))]
    logits.scatter_add_(-1, favoured.unsqueeze(-1), boost.unsqueeze(-1))
    # The favoured token in its position's history: the anti-loop re-samples the runner-up (often MASK).
    known = chance(0.5, (rows, length))
    slot = randint(depth, (rows, length))
    state["hist"][known, slot[known]] = favoured[known]
    runner_up = torch.where(chance(0.4, (rows, length)), MASK, FAVOURED[randint(len(FAVOURED), (rows, length))])
    logits.scatter_add_(-1, runner_up.unsqueeze(-1), (boost - 1).clamp(min=0).unsqueeze(-1))
    # Tied confidences (ranks and the anti-loop's choice go to the lower position): two positions, or a whole row.
    logits[:, 1] = logits[:, 0]
    logits[:, -1] = logits[:, -3]
    same = chance(0.3, (rows,))
    logits[same] = logits[same, :1]
    logits[:, 2, FAVOURED[5]] = logits[:, 2, FAVOURED[6]] = 30.0  # a tie across chunks of the vocabulary
    state = {name: value.to(device) for name, value in state.items()}
    for name, value in state.items():
        rule._state[name].copy_(value)
    return block.to(device), generated.to(device), logits.to(device), rule._state


def compare_steps(
    rows: int,
    length: int,
    max_post_steps: int,
    threshold: float,
    editing_threshold: float,
    seed: int,
    device="cpu",
    steps: int = 3,
    vocab: int = VOCAB,
    dtype: torch.dtype = torch.float32,
) -> dict[str, int]:
    """Run the PyTorch step and the fused step from the same random state and candidates (of `dtype` logits),
    `steps` times in a row; raise AssertionError naming the first output or buffer that differs. Returns how often
    each branch of the rule was taken (tokens deleted and split, anti-loop re-samples, rows that finished in a step,
    row-steps of rows finished before it)."""
    generator = torch.Generator().manual_seed(seed)
    rules = [LevenshteinEditing(threshold, editing_threshold, max_post_steps, MASK, DELETE, SPLIT) for _ in range(2)]
    for rule in rules:
        rule.start_block(length, 1)
    block, generated, logits, state = random_state(rules[0], rows, length, generator, device, vocab)
    logits = logits.to(dtype)
    rules[1].prepare_block(rows, device)
    for name, value in state.items():
        rules[1]._state[name].copy_(value)
    seen = {"delete": 0, "split": 0, "anti_loop": 0, "newly_finished": 0, "finished": 0}
    blocks = [block, block.clone()]
    for _ in range(steps):
        set_kernel_mode("torch")
        candidates = rules[0].candidates(logits)
        before = {name: value.clone() for name, value in rules[0]._state.items()}
        totals_before = rules[0]._totals.clone()
        results = []
        for rule, current, mode in zip(rules, blocks, ("torch", "triton"), strict=True):
            set_kernel_mode(mode)
            results.append(rule.step(current, logits, generated, rule._state, candidates=candidates))
        set_kernel_mode("torch")
        for name, ours, ref in zip(("block", "orig flags", "edited"), results[1], results[0], strict=True):
            assert ours.dtype == ref.dtype and torch.equal(ours, ref), (name, seed, ours, ref)
        for name in rules[0]._state:
            assert torch.equal(rules[1]._state[name], rules[0]._state[name]), (name, seed)
        assert torch.equal(rules[1]._totals, rules[0]._totals), ("totals", seed)
        added = (rules[0]._totals - totals_before).tolist()
        seen["delete"] += added[0]
        seen["split"] += added[1]
        seen["anti_loop"] += added[2]
        seen["newly_finished"] += int((~before["finished"] & rules[0]._state["finished"]).sum())
        seen["finished"] += int(before["finished"].sum())
        blocks = [results[0][0], results[1][0]]
        logits = logits.roll(1, dims=1)
    return seen
