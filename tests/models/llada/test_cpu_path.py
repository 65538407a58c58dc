"""The CPU path of LLaDA (`llada_lean.lean_block`, `positions_to_keep`, the CPU RoPE table, and the run's
inference mode on the CPU) computes what the regular path computes, and leaves the model trainable.

The regular path is what runs with autograd on (the lean path is inference only), so each comparison is one model
called under `torch.no_grad()` and under `torch.enable_grad()`.
"""

from __future__ import annotations

import pytest
import torch

import hf_dllm
from hf_dllm.cache import DiffusionKVCache
from hf_dllm.llada_lean import lean_rotary
from hf_dllm.modeling_llada import rotary_cos_sin
from tests.conftest import tiny_model

MHA = dict(n_kv_heads=4)  # the lean path covers multi-head attention (LLaDA 8B); conftest's default is GQA


def forward_logits(model, grad: bool, **kwargs) -> torch.Tensor:
    with torch.enable_grad() if grad else torch.no_grad():
        return model(**kwargs).logits.detach()


def count_lean_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = hf_dllm.modeling_llada.lean_block

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(hf_dllm.modeling_llada, "lean_block", counted)
    return calls


@pytest.mark.parametrize(
    "overrides",
    [MHA, dict(MHA, include_qkv_bias=True, include_bias=True), dict(MHA, activation_type="gelu")],
    ids=["plain", "biases", "gelu"],
)
def test_lean_forward_matches_regular_path(overrides, monkeypatch):
    model = tiny_model(seed=1, **overrides)
    for parameter in model.parameters():  # non-zero biases, so that a dropped bias would show
        torch.nn.init.normal_(parameter, std=0.3)
    calls = count_lean_calls(monkeypatch)
    input_ids = torch.randint(4, 100, (2, 21))
    keep = torch.tensor([3, 4, 17])
    for kwargs in (dict(), dict(logits_to_keep=keep), dict(logits_to_keep=slice(5, 13)), dict(logits_to_keep=4)):
        calls[0] = 0
        lean = forward_logits(model, grad=False, input_ids=input_ids, **kwargs)
        assert calls[0] == model.config.n_layers
        calls[0] = 0
        regular = forward_logits(model, grad=True, input_ids=input_ids, **kwargs)
        assert calls[0] == 0
        torch.testing.assert_close(lean, regular, rtol=1e-5, atol=1e-5)


def test_lean_forward_with_padding_and_a_cache(monkeypatch):
    """A padded batch (4D key mask) and a `DiffusionKVCache` written at `cache_position`, as a dual-cache step."""
    model = tiny_model(seed=2, **MHA)
    calls = count_lean_calls(monkeypatch)
    input_ids = torch.randint(4, 100, (2, 24))
    attention_mask = torch.ones(2, 24, dtype=torch.long)
    attention_mask[1, :5] = 0
    results = {}
    for grad in (False, True):
        cache = DiffusionKVCache(model.config.n_layers, 2, 24)
        full = forward_logits(model, grad, input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
        block = torch.arange(8, 16)
        step = forward_logits(
            model,
            grad,
            input_ids=input_ids[:, 8:16],
            attention_mask=attention_mask,
            past_key_values=cache,
            cache_position=block,
            logits_to_keep=torch.arange(2, 6),
        )
        results[grad] = (full, step, cache.keys[0].clone())
    assert calls[0] == 2 * model.config.n_layers  # the no_grad forwards only
    for lean, regular in zip(results[False], results[True], strict=True):
        torch.testing.assert_close(lean, regular, rtol=1e-5, atol=1e-5)


def test_lean_path_steps_aside(monkeypatch):
    """GQA, bfloat16 and autograd take the regular path; where a block refuses the lean path, it is asked once."""
    from hf_dllm.modeling_llada import LLaDALlamaBlock

    calls = count_lean_calls(monkeypatch)
    asked = []
    lean_weights = LLaDALlamaBlock.lean_weights
    monkeypatch.setattr(LLaDALlamaBlock, "lean_weights", lambda self: asked.append(self) or lean_weights(self))
    input_ids = torch.randint(4, 100, (1, 9))
    with torch.no_grad():
        gqa = tiny_model(seed=3)
        gqa(input_ids)  # GQA (4 query, 2 key/value heads)
    assert len(asked) == gqa.config.n_layers
    with torch.no_grad():
        tiny_model(seed=3, **MHA).to(torch.bfloat16)(input_ids)
    tiny_model(seed=3, **MHA)(input_ids)
    assert calls[0] == 0


@pytest.mark.parametrize("hooked", ["block", "ff_out", "ff_norm"])
def test_hooked_modules_still_run_their_hooks(hooked, monkeypatch):
    """The lean path reads weights instead of calling modules: a block with a hook on one of its layers runs the
    regular path, so the hook fires, and the other blocks stay lean; a hook on a block itself makes the model call
    the block as a module (the hook fires), which then computes leanly inside its forward."""
    calls = count_lean_calls(monkeypatch)
    model = tiny_model(seed=3, **MHA)
    block = model.model.transformer.blocks[0]
    seen = []
    (block if hooked == "block" else getattr(block, hooked)).register_forward_hook(lambda *args: seen.append(1))
    with torch.no_grad():
        model(torch.randint(4, 100, (1, 9)))
    assert seen == [1]
    assert calls[0] == model.config.n_layers - (hooked != "block")


def test_hooks_added_after_a_lean_forward_still_run(monkeypatch):
    """The lean weights are gathered once; a hook registered later on one of a block's layers still fires."""
    calls = count_lean_calls(monkeypatch)
    model = tiny_model(seed=3, **MHA)
    input_ids = torch.randint(4, 100, (1, 9))
    with torch.no_grad():
        model(input_ids)
    seen = []
    model.model.transformer.blocks[1].up_proj.register_forward_hook(lambda *args: seen.append(1))
    calls[0] = 0
    with torch.no_grad():
        model(input_ids)
    assert seen == [1] and calls[0] == model.config.n_layers - 1


def test_hooks_on_every_module_still_run(monkeypatch):
    """A hook registered for every module (`register_module_forward_hook`, as profilers do) sees the model, its
    blocks and their layers called as `generate()` calls them: no module is skipped by the lean path."""
    from torch.nn.modules.module import register_module_forward_hook

    model = tiny_model(seed=3, **MHA)
    seen = []
    handle = register_module_forward_hook(lambda module, *args: seen.append(module))
    try:
        model.generate(torch.randint(4, 100, (1, 5)), max_new_tokens=8, block_length=8, steps=2)
    finally:
        handle.remove()
    blocks = model.model.transformer.blocks
    assert seen.count(model.model) == 2 and seen.count(blocks[-1]) == 2 and seen.count(blocks[0].ff_out) == 2


@pytest.mark.parametrize("change", ["in_place", "replaced", "data", "layer", "to"])
def test_lean_path_follows_weight_changes(change, monkeypatch):
    """After a lean forward gathered the weights, every way of changing them reaches the next lean forward: in
    place (the views see it), a new parameter, `param.data = ...`, a new layer, `.to()` (new storage)."""
    calls = count_lean_calls(monkeypatch)
    model = tiny_model(seed=7, **MHA)
    input_ids = torch.randint(4, 100, (1, 11))
    with torch.no_grad():
        before = model(input_ids).logits
    block = model.model.transformer.blocks[-1]
    new_weight = torch.randn_like(block.k_proj.weight) * 0.3
    with torch.no_grad():
        if change == "in_place":
            block.k_proj.weight.copy_(new_weight)
        elif change == "replaced":
            block.k_proj.weight = torch.nn.Parameter(new_weight)
        elif change == "data":
            block.k_proj.weight.data = new_weight
        elif change == "layer":
            layer = torch.nn.Linear(*reversed(block.k_proj.weight.shape), bias=False)
            layer.weight.copy_(new_weight)
            block.k_proj = layer
        else:  # new storage, then an in-place change that views of the old storage would miss
            model.to(torch.float64).to(torch.float32)
            block.k_proj.weight.copy_(new_weight)
    calls[0] = 0
    lean = forward_logits(model, grad=False, input_ids=input_ids)
    assert calls[0] == model.config.n_layers
    regular = forward_logits(model, grad=True, input_ids=input_ids)
    torch.testing.assert_close(lean, regular, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lean, before, atol=1e-3)  # the change mattered


def test_positions_to_keep_refuses_hidden_states():
    model = tiny_model(seed=4, **MHA)
    with pytest.raises(ValueError, match="positions_to_keep"):
        model.model(torch.randint(4, 100, (1, 9)), positions_to_keep=slice(2, 4), output_hidden_states=True)


def test_cpu_rope_table_is_the_computed_rope():
    model = tiny_model(seed=5, **MHA)
    model.model._rotary_cos_sin(torch.tensor([[0, 5, 300]]))  # a first table, of 301 positions
    positions = torch.tensor([[0, 5, 300, 7], [1, 2, 3, 700]])  # 700 grows the table past its first size
    table = model.model._rotary_cos_sin(positions)
    assert [t[0].shape[0] for t in model.model._rope_tables.tables[(positions.device, torch.float32)]] == [301, 701]
    computed = rotary_cos_sin(positions, model.config.head_dim, model.config.rope_theta)
    for a, b in zip(table, computed, strict=True):
        assert torch.equal(a, b)
    q = torch.randn(2, 4, 4, model.config.head_dim)  # (batch, q_len, heads, head_dim)
    cos, signed_sin = lean_rotary(*computed)
    half = model.config.head_dim // 2
    rotated = q * cos + torch.roll(q, half, -1) * signed_sin
    expected, _ = hf_dllm.modeling_llada.apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), *computed)
    assert torch.equal(rotated, expected.transpose(1, 2))


def test_generate_on_cpu_leaves_the_model_trainable():
    """The run's inference mode on the CPU must not turn parameters (the concatenated q/k/v and gate/up weights the
    lean path makes) or the RoPE table into inference tensors: training after generation still works."""
    model = tiny_model(seed=6, **MHA)
    prompt = torch.randint(4, 100, (1, 6))
    out = model.generate(prompt, max_new_tokens=8, block_length=4, steps=8, use_cache=True, dual_cache=True)
    assert not out.is_inference()
    assert not any(parameter.is_inference() for parameter in model.parameters())
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randint(4, 100, (1, 10))).logits.square().mean()
    loss.backward()
    optimizer.step()  # in place on the parameters: raises for inference tensors
    model.eval()
    again = model.generate(prompt, max_new_tokens=8, block_length=4, steps=8)
    assert again.shape == out.shape
