"""A replayed step copies only the inputs that changed (CPU: the copy rule itself and the loop's reused inputs;
the GPU tests compare graph and eager tokens end to end).

- `graphs._CapturedStep.load` skips a copy only for the tensor last copied into that buffer (or a view of the same
  memory, same shape and strides) unchanged since, by its version counter; inference tensors are always copied.
- The loop's column indices and the rules' scheduled counts are the same tensors at every step of a block, and
  new ones where a block starts; LLaDA2's schedule table gives `schedule_counts` at every step.
"""

from __future__ import annotations

import torch
from conftest import tiny_model

from hf_dllm.block_loop import BlockDiffusionRun
from hf_dllm.decoding import FixedSchedule, ScheduledThreshold, TokenEditing, schedule_counts
from hf_dllm.graphs import _CapturedStep

SENTINEL = -7


def captured_step(**sources: torch.Tensor) -> _CapturedStep:
    """A captured step without a graph whose buffers hold `sources` (as after capture)."""
    inputs = {name: value.clone() for name, value in sources.items()}
    return _CapturedStep(None, inputs, (), {name: (value, value._version) for name, value in sources.items()})


def copied(step: _CapturedStep, name: str, value: torch.Tensor) -> bool:
    """Whether `load` copies `value` (the buffer is first overwritten with a sentinel that a copy replaces)."""
    step.inputs[name].fill_(SENTINEL)
    step.load(name, value)
    return not bool((step.inputs[name] == SENTINEL).all())


def test_the_tensor_last_copied_is_not_copied_again():
    source = torch.arange(6)
    step = captured_step(index=source)
    assert not copied(step, "index", source)
    assert not copied(step, "index", source[:])  # another view of the same memory, same shape and strides


def test_a_changed_or_different_tensor_is_copied():
    source = torch.arange(6)
    step = captured_step(index=source)
    source.add_(1)  # in place: the version counter moves
    assert copied(step, "index", source)
    assert torch.equal(step.inputs["index"], torch.arange(1, 7))
    assert not copied(step, "index", source)
    other = torch.arange(1, 7)  # the same values elsewhere
    assert copied(step, "index", other)
    assert copied(step, "index", source)


def test_a_view_with_other_strides_or_offset_is_copied():
    base = torch.arange(12).view(2, 6)
    step = captured_step(x=base[:, :3])
    assert not copied(step, "x", base[:, :3])
    assert copied(step, "x", base[:, 3:])  # same shape, other memory
    assert copied(step, "x", base.t()[:3].t())  # transposed: same first address, other strides


def test_a_write_through_another_view_is_seen():
    base = torch.zeros(2, 6, dtype=torch.long)
    step = captured_step(x=base[:, :3])
    base[0, 0] = 5  # through the base: the views share its version counter
    assert copied(step, "x", base[:, :3])
    assert int(step.inputs["x"][0, 0]) == 5


def test_the_last_source_is_kept_alive():
    step = captured_step(index=torch.arange(4))
    fresh = torch.arange(4) * 10
    step.load("index", fresh)
    pointer = fresh.data_ptr()
    del fresh
    held, _ = step.sources["index"]
    assert held.data_ptr() == pointer and held.tolist() == [0, 10, 20, 30]


def test_inference_tensors_are_always_copied():
    with torch.inference_mode():
        source = torch.arange(6)
    step = captured_step(index=torch.arange(6))
    assert copied(step, "index", source)
    assert copied(step, "index", source)


def test_step_inputs_reuse_a_blocks_columns_and_counts():
    model = tiny_model()
    prompts = torch.randint(4, 100, (2, 6))
    generation = model.resolve_generation_config(max_new_tokens=16, block_length=8, use_cache=True, dual_cache=True)
    run = BlockDiffusionRun(model, generation, prompts, None)
    (start, end), next_block = run.plan.blocks[0], run.plan.blocks[1]
    run.unmasking.start_block(end - start, 8)
    first, _ = run._step_inputs(start, end, 1, None, None)
    second, _ = run._step_inputs(start, end, 2, None, None)
    fed = {name: value for name, value in first.items() if value is not None}
    replay = captured_step(**fed)
    unchanged = ("position_ids", "cache_position", "logits_index", "block_index", "scheduled")
    for name in unchanged:  # a replay of the second step copies none of these again
        assert not copied(replay, name, second[name]), name
    run.x[:, start] = 5  # the block's tokens changed: copied
    assert copied(replay, "tokens", run._step_inputs(start, end, 3, None, None)[0]["tokens"])
    refresh, _ = run._step_inputs(start, end, 0, None, None)  # the block start's full forward: its own columns
    assert refresh["cache_position"] is not first["cache_position"]
    assert torch.equal(refresh["cache_position"], torch.arange(run.seq_len))
    later, _ = run._step_inputs(*next_block, 1, None, None)
    assert torch.equal(later["cache_position"], torch.arange(*next_block))
    assert torch.equal(first["cache_position"], torch.arange(start, end))  # the earlier block's are unchanged
    assert torch.equal(later["block_index"], torch.arange(8))


def test_scheduled_counts_are_one_tensor_per_count():
    rule = FixedSchedule()
    rule.start_block(8, 3)  # 3, 3, 2
    counts = [rule.scheduled_counts(step, 4, torch.device("cpu")) for step in range(3)]
    assert [c.tolist() for c in counts] == [[3] * 4, [3] * 4, [2] * 4]
    assert counts[0] is counts[1] and counts[1] is not counts[2]
    editing = TokenEditing(0.9, editing_threshold=0.8, num_to_transfer=2, max_post_steps=2)
    editing.start_block(8, 4)
    assert editing.scheduled_counts(0, 3, torch.device("cpu")) is editing.scheduled_counts(5, 3, torch.device("cpu"))


def test_llada2_schedule_table_gives_schedule_counts():
    rule = ScheduledThreshold(threshold=0.9)
    steps = torch.tensor([3, 5, 8, 32])
    rule.start_block(32, steps)
    for step in (0, 1, 2, 4, 7, 31, 40):  # 40: past every row's steps (the table grows)
        assert torch.equal(rule.scheduled_counts(step, 4, torch.device("cpu")), schedule_counts(32, steps, step))
    rule.start_block(16, torch.tensor(3))  # one share for every row (a 0-d tensor)
    assert torch.equal(rule.scheduled_counts(1, 1, torch.device("cpu")), schedule_counts(16, torch.tensor(3), 1))
    rule.start_block(32, torch.tensor([4, 4, 4, 4]))  # a new block: a new table
    assert rule.scheduled_counts(0, 4, torch.device("cpu")).tolist() == [8] * 4
