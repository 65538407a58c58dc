"""A replayed step copies only the inputs that changed (CPU: the copy rule itself and the loop's reused inputs;
the GPU tests compare graph and eager tokens end to end).

- `graphs._CapturedStep.load` skips a copy only for the tensor last copied into that buffer (or a view of the same
  memory, same shape and strides) unchanged since, by its version counter; inference tensors are always copied.
- The loop's column indices and the rules' scheduled counts are the same tensors at every step of a block, and
  new ones where a block starts; LLaDA2's schedule table gives `schedule_counts` at every step.
- RoPE tables (`cache.PositionTables`) give the computed rows, grow without freeing the tables graphs read, and
  are used only with the caches of the loop and the engine, whose positions the cache's length bounds (the GPU
  tests compare them with the computed ones in LLaDA and LLaDA2).
- `graphs.spans_devices` (whether a run may capture graphs: a graph is one device's) reads accelerate's
  `hf_device_map` and the embeddings' devices, without walking every parameter.
- A graph keeps the kernels it was captured with: the step machine's runner signature and DiffusionGemma's graph
  keys hold the kernel mode, so a call after `set_kernel_mode` captures its own graphs.
"""

from __future__ import annotations

import pytest
import torch

import hf_dllm
from hf_dllm.block_loop import BlockDiffusionRun
from hf_dllm.cache import DiffusionKVCache, PositionTables
from hf_dllm.decoding import FixedSchedule, ScheduledThreshold, TokenEditing, schedule_counts
from hf_dllm.graphs import _CapturedStep, spans_devices
from hf_dllm.modeling_llada2_moe import rotary_cos_sin
from hf_dllm.serving.engine import ContinuousBatcher
from tests.conftest import tiny_model

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
    first, _ = run.machine.step_inputs(run.canvas, start, end, 1, None, None)
    second, _ = run.machine.step_inputs(run.canvas, start, end, 2, None, None)
    fed = {name: value for name, value in first.items() if value is not None}
    replay = captured_step(**fed)
    unchanged = ("position_ids", "cache_position", "logits_index", "block_index", "scheduled")
    for name in unchanged:  # a replay of the second step copies none of these again
        assert not copied(replay, name, second[name]), name
    run.x[:, start] = 5  # the block's tokens changed: copied
    assert copied(replay, "tokens", run.machine.step_inputs(run.canvas, start, end, 3, None, None)[0]["tokens"])
    # The block start's full forward: its own columns.
    refresh, _ = run.machine.step_inputs(run.canvas, start, end, 0, None, None)
    assert refresh["cache_position"] is not first["cache_position"]
    assert torch.equal(refresh["cache_position"], torch.arange(run.seq_len))
    later, _ = run.machine.step_inputs(run.canvas, *next_block, 1, None, None)
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


def tiny_llada2_config() -> hf_dllm.LLaDA2MoeConfig:
    return hf_dllm.LLaDA2MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, num_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
        use_qk_norm=True, mask_token_id=511, eos_token_id=510, pad_token_id=510,
    )  # fmt: skip


def affine_rows(positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    values = positions.to(dtype).unsqueeze(-1) * torch.tensor([0.5, 2.0], dtype=dtype)
    return values, -values


def test_position_tables_look_up_the_computed_rows():
    tables = PositionTables(affine_rows)
    positions = torch.tensor([[0, 3, 7], [5, 5, 1]])
    for got, expected in zip(
        tables.lookup(positions, 8, torch.float32), affine_rows(positions, torch.float32), strict=True
    ):
        assert torch.equal(got, expected)
    first = tables.tables[(positions.device, torch.float32)][-1]
    tables.lookup(positions, 6, torch.float32)  # a smaller bound: the same table
    assert tables.tables[(positions.device, torch.float32)][-1] is first
    wide = torch.tensor([[20]])
    assert torch.equal(tables.lookup(wide, 21, torch.float32)[0], affine_rows(wide, torch.float32)[0])
    made = tables.tables[(positions.device, torch.float32)]
    assert len(made) == 2 and made[0] is first and made[1][0].shape[0] == 21  # the old table is kept (graphs)
    assert tables.lookup(positions, 8, torch.float64)[0].dtype == torch.float64  # one table per dtype


def test_only_caches_of_the_loop_and_the_engine_bound_positions():
    plain = DiffusionKVCache(2, 1, 16)
    assert PositionTables.bound_of(plain) is None and PositionTables.bound_of(None) is None
    model = tiny_model()
    config = model.resolve_generation_config(max_new_tokens=16, block_length=8, use_cache=True, dual_cache=True)
    run = BlockDiffusionRun(model, config, torch.randint(4, 100, (2, 6)), None)
    assert PositionTables.bound_of(run.cache) == run.seq_len
    engine = ContinuousBatcher(model, max_batch_size=2, max_batch_width=64)
    assert PositionTables.bound_of(engine.runner.shared_cache(2)) == 64


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rope_tables_equal_the_computed_rope(dtype):
    """LLaDA's and LLaDA2's tables give the per-call RoPE bit for bit on a GPU (the CPU keeps its own paths), and
    a forward through a cache that bounds the positions gives the same logits as through one that does not."""
    positions = torch.randint(0, 900, (3, 40), device="cuda")
    llada = tiny_model().to("cuda", dtype)
    for got, expected in zip(
        llada.model._rotary_cos_sin(positions, bound=900), llada.model._rotary_cos_sin(positions), strict=True
    ):
        assert torch.equal(got, expected)
    torch.manual_seed(0)
    llada2 = hf_dllm.LLaDA2MoeModelLM(tiny_llada2_config()).to("cuda", dtype).eval()
    expected = rotary_cos_sin(positions, llada2.config, dtype)
    for got, want in zip(llada2.model._rope_tables.lookup(positions, 900, dtype), expected, strict=True):
        assert torch.equal(got, want)
    ids = torch.randint(0, 500, (2, 48), device="cuda")
    logits = []
    for bounded in (False, True):
        cache = llada2._diffusion_new_cache(2, 48)
        cache.positions_below_length = bounded
        with torch.no_grad():
            out = llada2(
                ids,
                past_key_values=cache,
                use_cache=True,
                block_length=16,
                cache_position=torch.arange(48, device="cuda"),
            )
        logits.append(out.logits)
    assert torch.equal(logits[0], logits[1])


def test_spans_devices_reads_the_device_map_and_the_embeddings(monkeypatch):
    """A split recorded in `hf_device_map` (accelerate's dispatch) or embeddings on two devices span devices; a
    model on one device, a one-device map and a module that is not a transformers model do not. The parameters are
    not walked (LLaDA2.0-mini has ~15,000: ~45 ms per `generate()`)."""
    model = tiny_model()

    def walked(self, *args, **kwargs):
        raise AssertionError("spans_devices walked the parameters")

    # `parameters()` walks through `named_parameters()`: either walk fails the test.
    monkeypatch.setattr(type(model), "named_parameters", walked)
    assert not spans_devices(model)
    model.hf_device_map = {"": 0}
    assert not spans_devices(model)
    model.hf_device_map = {"model.transformer.wte": 0, "model.transformer.blocks.0": 0, "model.transformer.blocks.1": 1}
    assert spans_devices(model)
    del model.hf_device_map
    model.get_output_embeddings().to("meta")  # the head alone moved (its forward would need hooks of its own)
    assert spans_devices(model)
    assert not spans_devices(torch.nn.Linear(2, 2))


def test_graph_signatures_hold_the_kernel_mode():
    from hf_dllm.modeling_diffusion_gemma import CacheGraphs

    model = tiny_model()
    config = model.resolve_generation_config(max_new_tokens=16, block_length=8, use_cache=True, dual_cache=True)
    run = BlockDiffusionRun(model, config, torch.randint(4, 100, (2, 6)), None)
    signatures, keys = {}, {}
    try:
        for mode in ("auto", "torch"):
            hf_dllm.kernels.set_kernel_mode(mode)
            signatures[mode] = run.machine._graph_signature()
            keys[mode] = CacheGraphs._key(test_graph_signatures_hold_the_kernel_mode, (torch.zeros(2, 3),))
    finally:
        hf_dllm.kernels.set_kernel_mode("auto")
    assert signatures["auto"] != signatures["torch"] and keys["auto"] != keys["torch"]
