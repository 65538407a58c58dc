"""LLaDA-MoE's routing in one launch (`triton_moe.gate_route_and_align`: the router product's programs, the last of
which routes and aligns every token) against the three launches it replaces (`router_partials`, `route`,
`align_by_expert`), bit for bit: on the CPU through Triton's interpreter (float16: the interpreter has no exact
bfloat16), over 1, 7, 32 and 64 tokens, a count of experts that is not a power of two, tied experts; the arrival
counter back to 0 after every launch; bad arguments; a tiny LLaDA-MoE's logits with the switch on and off. On a GPU
(bfloat16, LLaDA-MoE-7B's router shape) the same equalities, where the order of the softmax's sum matters."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from tests.conftest import interpreter_job

COMPARE = """
import torch
from hf_dllm import triton_moe


def three_launches(x, gate, top_k, splits=None):
    partials = triton_moe.router_partials(x, gate, splits)
    logits = x.new_empty(x.shape[0], gate.shape[0])
    index, weight = triton_moe.route(partials, None, 1, 1, top_k, "softmax", False, 1.0, x.dtype, summed_logits=logits)
    return (logits, index, weight, *triton_moe.align_by_expert(index, gate.shape[0], False))


def check_equal(x, gate, top_k, splits=None, name=""):
    want, got = three_launches(x, gate, top_k, splits), triton_moe.gate_route_and_align(x, gate, top_k, splits)
    for what, a, b in zip(("logits", "index", "weight", "sorted_token", "offsets", "row"), want, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, what)
    counter = triton_moe._ROUTE_COUNTERS[x.device]
    assert counter.tolist() == [0], (name, "counter", counter)
    return got
"""

INTERPRETER_SCRIPT = COMPARE + textwrap.dedent(
    """
    import hf_dllm

    torch.manual_seed(0)
    # Token counts within one tile, across tiles and at the limit; 64 experts (the real model), 40 and 24 (tiles cut
    # short, lanes past the experts); hidden sizes the chunks split evenly or not.
    for tokens, experts, hidden, splits in ((1, 64, 64, 2), (7, 40, 80, 3), (32, 24, 64, 2), (64, 64, 32, 1)):
        x = torch.randn(tokens, hidden).half()
        gate = (torch.randn(experts, hidden) * 0.1).half()
        logits, index, *_ = check_equal(x, gate, 8, splits, f"{tokens} tokens")
        assert torch.equal(logits.gather(1, index), logits.topk(8, dim=-1).values), tokens  # the 8 largest, in order
    # Ties: zero tokens (every logit 0: experts 0-7 in order), experts with the same weight row (tied logits: the
    # lower expert first), tokens that pick the same experts (one expert's rows in token order).
    x = torch.randn(6, 64).half()
    x[1] = 0
    gate = (torch.randn(16, 64) * 0.1).half()
    gate[9], gate[12] = gate[3], gate[3]
    _, index, weight, sorted_token, offsets, row = check_equal(x, gate, 8, 2, "ties")
    assert index[1].tolist() == list(range(8)) and bool((weight[1] == weight[1, 0]).all()), index[1]
    for picks in index.tolist():
        tied = [e for e in (3, 9, 12) if e in picks]
        assert [picks.index(e) for e in tied] == sorted(picks.index(e) for e in tied), picks
    assert torch.equal(sorted_token, torch.argsort(index.flatten(), stable=True) // 8)

    # Bad arguments: a clear ValueError naming the function before any launch.
    x, gate = torch.randn(4, 64).half(), torch.randn(16, 64).half()
    # (More cells than the last program takes: 64 tokens over 65 experts: 64 x 128 cells, powers of two.)
    assert triton_moe.routes_in_one_launch(64, 64) and not triton_moe.routes_in_one_launch(64, 65)
    for bad in ((x, gate, 0), (x, gate, 17), (x, gate, True), (x.float(), gate.float(), 2), (x, gate[:, :32], 2),
                (torch.zeros(65, 64).half(), gate, 2), (torch.zeros(64, 64).half(), torch.zeros(65, 64).half(), 2)):
        try:
            triton_moe.gate_route_and_align(*bad)
        except ValueError as error:
            assert "gate_route_and_align" in str(error), error
        else:
            raise AssertionError(f"bad gate_route_and_align input accepted: {bad[2]!r}")

    # A tiny LLaDA-MoE (float16, every kernel on): the same logits with the routing in one launch or three.
    from hf_dllm.modeling_llada_moe import LLaDAMoESparseMoeBlock

    config = hf_dllm.LLaDAMoEConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, expert_intermediate_size=32,
        dense_intermediate_size=64, moe_layer_freq=[1, 1], pad_token_id=62, eos_token_id=62)
    model = hf_dllm.LLaDAMoEModelLM._from_config(config, dtype=torch.float16).eval()
    ids, logits = torch.randint(0, 60, (1, 9)), []
    for one_launch in (True, False):
        LLaDAMoESparseMoeBlock.routing_in_one_launch = one_launch
        with torch.no_grad():
            assert model.model.layers[0].mlp.uses_fused_kernels(torch.zeros(1, 64, dtype=torch.float16))
            logits.append(model(ids).logits)
    LLaDAMoESparseMoeBlock.routing_in_one_launch = True
    assert torch.equal(*logits) and bool(logits[0].isfinite().all()), "model logits"
    print("ok")
    """
)

INTERPRETER_RUN = interpreter_job(
    {"one_launch": INTERPRETER_SCRIPT},
    timeout=600,
    when=lambda: importlib.util.find_spec("triton") is not None,
    HF_DLLM_KERNELS="triton",
)


@INTERPRETER_RUN.used_by
def test_routing_in_one_launch_equals_three_launches_in_the_interpreter():
    pytest.importorskip("triton", reason="the `triton` extra is not installed")
    done = INTERPRETER_RUN.results()["one_launch"]
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 32, 64])
def test_gpu_routing_in_one_launch_equals_three_launches(tokens):
    """At LLaDA-MoE-7B's router shape (hidden 2048, 64 experts top-8, bf16) with the default splits; the random
    inputs repeated 20 times (fresh partials each time: a stale read of another program's partials, or a counter
    left behind, would show), and tokens with tied logits."""
    namespace = {}
    exec(COMPARE, namespace)  # noqa: S102 - the same comparison as the interpreter's
    torch.manual_seed(tokens)
    gate = (torch.randn(64, 2048, device="cuda") * 0.02).bfloat16()
    gate[40] = gate[5]
    for _ in range(20):
        x = torch.randn(tokens, 2048, device="cuda").bfloat16()
        x[0] = 0
        namespace["check_equal"](x, gate, 8, None, f"{tokens} tokens")


@pytest.mark.gpu
def test_gpu_routing_in_one_launch_replays_in_a_cuda_graph():
    """Captured once, replayed on new inputs: the counter is reset by the kernel itself (no memset in the graph),
    so every replay equals the three launches run eagerly."""
    namespace = {}
    exec(COMPARE, namespace)  # noqa: S102
    from hf_dllm import triton_moe

    torch.manual_seed(0)
    gate = (torch.randn(64, 2048, device="cuda") * 0.02).bfloat16()
    x = torch.randn(32, 2048, device="cuda").bfloat16()
    triton_moe.gate_route_and_align(x, gate, 8)  # compiled and the counter allocated outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_moe.gate_route_and_align(x, gate, 8)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = namespace["three_launches"](x, gate, 8)
        assert all(torch.equal(a, b) for a, b in zip(want, captured, strict=True))
    assert triton_moe._ROUTE_COUNTERS[x.device].tolist() == [0]


@pytest.mark.gpu
def test_gpu_model_logits_equal_with_the_routing_in_one_launch_or_three():
    """A small bf16 LLaDA-MoE (64 experts top-8, as the 7B) on its fused path over a block's 32 tokens: the same logits
    with `routing_in_one_launch` on and off."""
    import hf_dllm
    from hf_dllm.modeling_llada_moe import LLaDAMoESparseMoeBlock
    from tests.conftest import random_weights_model

    config = hf_dllm.LLaDAMoEConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, num_experts=64,
        num_experts_per_tok=8, expert_intermediate_size=128, dense_intermediate_size=256, vocab_size=320,
        moe_layer_freq=[1, 1], pad_token_id=318, eos_token_id=318,
    )  # fmt: skip
    model = random_weights_model(hf_dllm.LLaDAMoEModelLM, config, dtype=torch.bfloat16, device="cuda", noise=0.05)
    ids, logits = torch.randint(0, 300, (1, 32), device="cuda"), []
    assert model.model.layers[0].mlp.uses_fused_kernels(torch.zeros(1, 256, dtype=torch.bfloat16, device="cuda"))
    try:
        for one_launch in (True, False):
            LLaDAMoESparseMoeBlock.routing_in_one_launch = one_launch
            with torch.no_grad():
                logits.append(model(ids).logits)
    finally:
        LLaDAMoESparseMoeBlock.routing_in_one_launch = True
    assert torch.equal(*logits)


@pytest.mark.gpu
def test_gpu_no_routing_counter_is_made_inside_a_capture(monkeypatch):
    """Inside a CUDA graph capture with no counter yet, the one launch does not apply (its counter's zeroing would
    only run at the graph's first replay) and the launch itself refuses; outside, it applies again."""
    from hf_dllm import triton_moe

    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(triton_moe, "_ROUTE_COUNTERS", {})
    x = torch.randn(32, 2048, device=device, dtype=torch.bfloat16)
    gate = torch.randn(64, 2048, device=device, dtype=torch.bfloat16)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            applies = triton_moe.routes_in_one_launch(32, 64, device)
            with pytest.raises(ValueError, match="capture"):
                triton_moe._route_counter(device)
        finally:
            graph.capture_end()
    assert not applies and triton_moe._ROUTE_COUNTERS == {}
    assert triton_moe.routes_in_one_launch(32, 64, device)
    triton_moe.gate_route_and_align(x, gate, 8)
    assert device in triton_moe._ROUTE_COUNTERS
