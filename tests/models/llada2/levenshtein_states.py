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

from hf_dllm.kernels import kernel_mode, set_kernel_mode
from hf_dllm.levenshtein_editing import LevenshteinEditing

# A vocabulary of three of the anti-loop argmax's chunks (`triton_levenshtein.LEVENSHTEIN_VOCAB_BLOCK`).
MASK, DELETE, SPLIT, VOCAB = 8200, 7, 4100, 9000
# The tokens the logits favour: MASK, DELETE, SPLIT and ordinary tokens in each chunk of the vocabulary.
FAVOURED = torch.tensor([MASK, DELETE, SPLIT, 3, 4, 4500, 8999, 100])


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


def two_rules(threshold: float, editing_threshold: float, max_post_steps: int, length: int) -> list:
    """The PyTorch step's rule and the fused step's, each with its own buffers and totals."""
    rules = [LevenshteinEditing(threshold, editing_threshold, max_post_steps, MASK, DELETE, SPLIT) for _ in range(2)]
    for rule in rules:
        rule.start_block(length, 1)
    return rules


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
    those of them whose block changed in it: the final cleanup, row-steps of rows finished before it)."""
    generator = torch.Generator().manual_seed(seed)
    rules = two_rules(threshold, editing_threshold, max_post_steps, length)
    block, generated, logits, _ = random_state(rules[0], rows, length, generator, device, vocab)
    return compare_from(rules, block, generated, logits.to(dtype), steps, seed)[0]


def compare_from(rules: list, block, generated, logits, steps: int, label) -> tuple[dict[str, int], torch.Tensor]:
    """`compare_steps` from `rules[0]`'s state (copied to `rules[1]`): what it counted, and the last new block."""
    rows = block.shape[0]
    rules[1].prepare_block(rows, block.device)
    for name, value in rules[0]._state.items():
        rules[1]._state[name].copy_(value)
    mode = kernel_mode()
    seen = {"delete": 0, "split": 0, "anti_loop": 0, "newly_finished": 0, "final_cleanup": 0, "finished": 0}
    blocks = [block, block.clone()]
    try:
        for _ in range(steps):
            set_kernel_mode("torch")
            candidates = rules[0].candidates(logits)
            before = {name: value.clone() for name, value in rules[0]._state.items()}
            totals_before = rules[0]._totals.clone()
            results = []
            for rule, current, step_mode in zip(rules, blocks, ("torch", "triton"), strict=True):
                set_kernel_mode(step_mode)
                results.append(rule.step(current, logits, generated, rule._state, candidates=candidates))
            for name, ours, ref in zip(("block", "orig flags", "edited"), results[1], results[0], strict=True):
                assert ours.dtype == ref.dtype and torch.equal(ours, ref), (name, label, ours, ref)
            for name in rules[0]._state:
                assert torch.equal(rules[1]._state[name], rules[0]._state[name]), (name, label)
            assert torch.equal(rules[1]._totals, rules[0]._totals), ("totals", label)
            added = (rules[0]._totals - totals_before).tolist()
            seen["delete"] += added[0]
            seen["split"] += added[1]
            seen["anti_loop"] += added[2]
            newly_finished = ~before["finished"] & rules[0]._state["finished"]
            seen["newly_finished"] += int(newly_finished.sum())
            seen["final_cleanup"] += int((newly_finished & results[0][2]).sum())  # finished by a step that wrote
            seen["finished"] += int(before["finished"].sum())
            blocks = [results[0][0], results[1][0]]
            logits = logits.roll(1, dims=1)
    finally:
        set_kernel_mode(mode)
    return seen, blocks[0]


def compare_anti_loop_choices(device="cpu") -> None:
    """Two hand-made rows whose anti-loop fires at a generated, non-original position (a token-to-token edit, the
    least confident change) whose greedy token is in its history: the re-sample is MASK (allowed there: it is not
    an original mask), and in the second row, where MASK is unlikely, the first of two tied tokens in different
    chunks of the vocabulary. Both paths must agree, and the PyTorch step must make those choices."""
    length = 8
    rules = two_rules(0.9, 0.0, 16, length)
    block = torch.tensor([[3, 4, 3, 4, 3, 4, MASK, MASK]] * 2, device=device)
    generated = torch.arange(length, device=device).expand(2, -1) >= 2
    state = rules[0].init_state(block, generated)
    state["seen"][:, 0] = block  # seen before
    state["seen_count"].fill_(1)
    state["updates"].fill_(1)
    state["hist"][:, 2, 0] = 100  # the greedy token of position 2, written there before
    logits = torch.full((2, length, VOCAB), -10.0, device=device)
    logits[:, :, 3] = 10.0  # positions 0-5 keep their tokens (3, 4, 3, 4, 3, 4)
    logits[:, 1::2, 4] = 12.0
    logits[:, 6:, 5] = 12.0  # the original masks: committed with probability ~1
    logits[:, 2, 3] = -10.0
    logits[:, 2, [100, MASK, FAVOURED[5], FAVOURED[6]]] = torch.tensor(
        [[5.0, 4.0, 3.0, 3.0], [5.0, 1.0, 3.0, 3.0]], device=device
    )
    seen, new = compare_from(rules, block, generated, logits, 1, "anti-loop")
    assert seen["anti_loop"] == 2, seen
    assert new[:, 2].tolist() == [MASK, int(FAVOURED[5])], new
