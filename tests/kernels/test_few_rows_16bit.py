"""The few-rows kernel on bf16/fp16 weights (`fp8_triton.few_rows_matmul`, issue #63) and where `kernels.linear` runs
it (`kernels.few_rows_applies`, `kernels.dense_product`).

- Its error against the float32 product is within 2x of PyTorch's own product in the same dtype, over shapes, row
  counts, configs (split or not, several row tiles, k tiles that do not divide K) and bias: through Triton's
  interpreter on the CPU (tiny shapes), compiled at the 7B models' shapes on the GPU.
- `kernels.linear` and `ConcatenatedProjections.project` take it only where the rule says: never on the CPU, in
  float32, under autograd, past `FEW_ROWS_MAX_ROWS` rows or outside the weight range, nor for mixed dtypes, hooked or
  subclassed layers, or `HF_DLLM_KERNELS=torch`.
- On the GPU: bits equal run to run, in CUDA graphs as eager, and a LLaDA-MoE model with the 7B model's attention
  shape runs it in its block step within 2x of PyTorch's bf16 error.
"""

from __future__ import annotations

import copy
import importlib.util
import textwrap

import pytest
import torch
from torch import nn

from hf_dllm import fp8_triton, kernels
from hf_dllm.kernels import ConcatenatedProjections, set_kernel_mode
from tests.conftest import interpreter_job

# (rows, N, K, bias) at the 7B models' shapes (`benchmarks/bench_few_rows_gemm.py`'s table): LLaDA-MoE-7B's fused
# q/k/v and output projection at a batch-1 block step, Dream-7B's q/k/v (with its bias) at batch 2, LLaDA-8B's output
# projection at one row. Few cases: each row tile (and bias) compiles and times every config once.
CASES_7B = [(32, 6144, 2048, False), (32, 2048, 2048, False), (64, 4608, 3584, True), (1, 4096, 4096, False)]


def errors(x, weight, bias=None, **kwargs) -> tuple[float, float, torch.Tensor]:
    """(the kernel's relative error against the float32 product, PyTorch's in x's dtype, the kernel's output)."""
    exact = x.float() @ weight.float().t() + (0 if bias is None else bias.float())
    out = fp8_triton.few_rows_matmul(x, weight, bias, **kwargs)
    reference = nn.functional.linear(x, weight, bias)
    norm = exact.norm()
    return ((out.float() - exact).norm() / norm).item(), ((reference.float() - exact).norm() / norm).item(), out


# Triton's interpreter multiplies bfloat16 operands as their raw 16-bit integers (its `create_dot` converts FP8
# operands only; bfloat16 is stored as uint16): the script widens them to float32 first, exactly, as a tensor
# core reads them.
INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch
    from torch import nn
    from triton.runtime import interpreter
    import triton.language as tl

    dot = interpreter.InterpreterBuilder.create_dot

    def bf16_dot(self, a, b, d, *args):
        def widened(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return dot(self, widened(a), widened(b), d, *args)

    interpreter.InterpreterBuilder.create_dot = bf16_dot

    from hf_dllm import fp8_triton, kernels
    from tests.kernels.test_few_rows_16bit import QKV, errors

    torch.manual_seed(0)
    cases = [
        (None, (5, 192, 320), False),  # the interpreter's config: split in 2, k tiles not dividing K
        ({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}, (20, 256, 256), True),
        ({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 4}, (33, 128, 96), True),  # 2 row tiles, empty splits
        ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 8}, (64, 64, 512), False),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for config, (rows, n_out, k_in), with_bias in cases:
            if config is not None:
                fp8_triton.INTERPRETER_CONFIGS["few_rows_16bit"] = config
            x = torch.randn(rows, k_in).to(dtype)
            weight = (torch.randn(n_out, k_in) * 0.05).to(dtype)
            bias = (torch.randn(n_out) * 0.1).to(dtype) if with_bias else None
            error, reference, out = errors(x, weight, bias)
            assert out.dtype == dtype and out.shape == (rows, n_out), (out.dtype, out.shape)
            assert error <= 2 * reference + 1e-4, (dtype, config, error, reference)
    # Through `kernels.linear` and a concatenated q/k/v product, the rule faked to take every product: leading
    # dimensions kept, the kernel's output (the same bits as calling it), close to PyTorch's.
    kernels.few_rows_applies = lambda *args: True
    fp8_triton.INTERPRETER_CONFIGS["few_rows_16bit"] = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}
    module = QKV(96, (64, 32, 32), bias=True).to(torch.bfloat16)
    x = torch.randn(2, 16, 96).to(torch.bfloat16)
    with torch.no_grad():
        for out, want, direct in [
            (kernels.linear(module.q, x), module.q(x), fp8_triton.few_rows_matmul(x, module.q.weight, module.q.bias)),
            (module.project(x, module.names), torch.cat([module.q(x), module.k(x), module.v(x)], -1), None),
        ]:
            assert out.shape == want.shape, (out.shape, want.shape)
            assert (out.float() - want.float()).abs().max() <= 2e-2, (out.float() - want.float()).abs().max()
            assert direct is None or torch.equal(out, direct)
    print("ok")
    """
)

INTERPRETER_RUN = interpreter_job(
    {"few_rows_16bit": INTERPRETER_SCRIPT},
    timeout=300,
    when=lambda: importlib.util.find_spec("triton") is not None and not torch.cuda.is_available(),
)


@INTERPRETER_RUN.used_by
def test_few_rows_16bit_kernel_in_triton_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU-only check: with a GPU the kernel is tested compiled (the gpu tests)")
    for name, result in INTERPRETER_RUN.results().items():
        assert result.returncode == 0 and "ok" in result.stdout, (name, result.stderr[-3000:])


class QKV(ConcatenatedProjections):
    """Three linear layers of one input, multiplied as one by `project(x, names)`."""

    names = ("q", "k", "v")

    def __init__(self, hidden: int, widths: tuple[int, int, int], bias: bool = False):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(hidden, width, bias=bias) for width in widths)


def test_rule_takes_a_block_steps_rows_of_the_measured_weights(monkeypatch):
    """`few_rows_applies` on a GPU with bf16 tensor cores (faked, so that it runs here): bf16/fp16, 1 to
    `FEW_ROWS_MAX_ROWS` rows, weights in the measured byte range; never float32, the CPU, or older GPUs."""
    monkeypatch.setattr(kernels, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(kernels, "_bf16_tensor_cores", lambda index: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    rows = kernels.FEW_ROWS_MAX_ROWS
    for n_out, k_in in [(6144, 2048), (2048, 2048), (4608, 3584), (4096, 4096)]:  # within 8-32 MiB in bf16
        for dtype in (torch.bfloat16, torch.float16):
            assert kernels.few_rows_applies(32, n_out, k_in, dtype, cuda)
            assert kernels.few_rows_applies(rows, n_out, k_in, dtype, cuda)
            assert kernels.few_rows_applies(1, n_out, k_in, dtype, cuda)
        assert not kernels.few_rows_applies(rows + 1, n_out, k_in, torch.bfloat16, cuda)
        assert not kernels.few_rows_applies(0, n_out, k_in, torch.bfloat16, cuda)
        assert not kernels.few_rows_applies(32, n_out, k_in, torch.float32, cuda)
        assert not kernels.few_rows_applies(32, n_out, k_in, torch.bfloat16, cpu)
    wide, small = (12288, 4096), (1024, 2048)  # 96 MiB, 4 MiB
    assert not kernels.few_rows_applies(32, *wide, torch.bfloat16, cuda)
    assert not kernels.few_rows_applies(32, *small, torch.bfloat16, cuda)
    monkeypatch.setattr(kernels, "FEW_ROWS_MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(kernels, "FEW_ROWS_MAX_WEIGHT_BYTES", 2**40)
    assert kernels.few_rows_applies(32, *wide, torch.bfloat16, cuda)
    assert kernels.few_rows_applies(32, *small, torch.bfloat16, cuda)
    monkeypatch.setattr(kernels, "_bf16_tensor_cores", lambda index: False)
    assert not kernels.few_rows_applies(32, 2048, 2048, torch.bfloat16, cuda)


@pytest.fixture
def taken(monkeypatch):
    """The products `dense_product` sends to the kernel, the rule faked to take every shape (its arguments kept):
    the kernel replaced by a recorder computing PyTorch's product, so that this runs on the CPU without Triton."""
    calls, rules = [], []

    def rule(*args):
        rules.append(args)
        return args[3] in fp8_triton.FEW_ROWS_16BIT_DTYPES

    def kernel(x, weight, bias=None):
        calls.append((tuple(x.shape), tuple(weight.shape), bias is not None))
        return nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(kernels, "few_rows_applies", rule)
    monkeypatch.setattr(kernels, "few_rows_matmul", kernel)
    set_kernel_mode("auto")
    yield calls, rules
    set_kernel_mode("auto")


def test_linear_and_concatenated_projections_take_the_kernel_where_the_rule_says(taken):
    """`linear` and `project` hand the rule the product's rows (leading dimensions flattened), shape, dtype and
    device, and run the kernel where it says so, with no gradient to record; else PyTorch's product."""
    calls, rules = taken
    layer = nn.Linear(64, 48).to(torch.bfloat16)
    module = QKV(64, (32, 16, 16)).to(torch.bfloat16)
    x = torch.randn(2, 16, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(kernels.linear(layer, x), layer(x))
        assert rules[-1] == (32, 48, 64, torch.bfloat16, x.device)
        module.project(x, module.names)
        assert rules[-1] == (32, 64, 64, torch.bfloat16, x.device)
    assert calls == [((2, 16, 64), (48, 64), True), ((2, 16, 64), (64, 64), False)]
    kernels.linear(layer, x)  # autograd records (the weight wants a gradient): no kernel
    module.project(x.clone().requires_grad_(), module.names)  # (the concatenation is a buffer: x's gradient)
    with torch.inference_mode():
        kernels.linear(layer, x)
    assert len(calls) == 3


def test_products_the_kernel_cannot_take_stay_with_pytorch(taken):
    """No kernel for float32, mixed dtypes, subclassed or hooked layers, a weight without contiguous rows, or the
    `torch` kernel mode; the result is PyTorch's product."""
    calls, _ = taken
    x = torch.randn(32, 64).to(torch.bfloat16)

    class Subclass(nn.Linear):
        pass

    hooked = nn.Linear(64, 48).to(torch.bfloat16)
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    replaced = nn.Linear(64, 48).to(torch.bfloat16)
    replaced.forward = lambda t: nn.functional.linear(t, replaced.weight) * 3  # as accelerate's hooks replace it
    with torch.no_grad():
        plain = nn.Linear(64, 48)
        assert torch.equal(kernels.linear(plain, x.float()), plain(x.float()))
        assert not kernels._takes_few_rows(x, plain.weight.half(), None)
        assert not kernels._takes_few_rows(x, plain.weight.bfloat16(), plain.bias.half())
        for layer in (Subclass(64, 48).to(torch.bfloat16), hooked, replaced):
            assert torch.equal(kernels.linear(layer, x), layer(x))
        transposed = torch.randn(64, 48).to(torch.bfloat16).t()
        assert torch.equal(kernels.dense_product(x, transposed), nn.functional.linear(x, transposed))
        set_kernel_mode("torch")
        kernels.linear(plain.to(torch.bfloat16), x)
    assert calls == []


@pytest.mark.parametrize(
    "arguments,error",
    [
        (dict(x=(4, 64, torch.float32), weight=(48, 64, torch.float32)), TypeError),
        (dict(x=(4, 64, torch.bfloat16), weight=(48, 64, torch.float16)), TypeError),
        (dict(x=(4, 64, torch.bfloat16), weight=(48, 32, torch.bfloat16)), ValueError),
        (dict(x=(4, 64, torch.bfloat16), weight=(48, 64, torch.bfloat16), bias=(32, torch.bfloat16)), ValueError),
    ],
)
def test_bad_operands_are_refused_before_any_launch(arguments, error):
    """`few_rows_matmul` names the operand and what it takes (no Triton launch happens: this runs on the CPU)."""
    x = torch.zeros(arguments["x"][:2], dtype=arguments["x"][2])
    weight = torch.zeros(arguments["weight"][:2], dtype=arguments["weight"][2])
    bias = torch.zeros(arguments["bias"][0], dtype=arguments["bias"][1]) if "bias" in arguments else None
    with pytest.raises(error, match="few_rows_matmul"):
        fp8_triton.few_rows_matmul(x, weight, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n_out,k_in,with_bias", CASES_7B)
def test_gpu_error_within_twice_pytorch_at_the_7b_shapes(rows, n_out, k_in, with_bias):
    """The autotuned kernel at the 7B models' shapes: within 2x of cuBLAS's bf16 error against float32, the same
    bits when run again (split sums added in a fixed order)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(n_out, k_in, device="cuda") * 0.02).to(torch.bfloat16)
    bias = (torch.randn(n_out, device="cuda") * 0.1).to(torch.bfloat16) if with_bias else None
    error, reference, out = errors(x, weight, bias)
    assert error <= 2 * reference + 1e-4, (error, reference)
    assert torch.equal(fp8_triton.few_rows_matmul(x, weight, bias), out)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1},
        {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 8},
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4},  # 33 rows: 3 row tiles
    ],
)
def test_gpu_fixed_configs_with_bias(config):
    """Configs of `few_rows_16bit_configs()` forced (no split with the bias in the kernel, the largest split, several
    row tiles) on LLaDA-MoE-7B's q/k/v, fp16 and bf16."""
    import triton

    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        x = torch.randn(33 if config["BLOCK_M"] == 16 else 32, 2048, device="cuda", dtype=dtype)
        weight = (torch.randn(6144, 2048, device="cuda") * 0.02).to(dtype)
        bias = (torch.randn(6144, device="cuda") * 0.1).to(dtype)
        error, reference, _ = errors(x, weight, bias, config=triton.Config(config, num_warps=4, num_stages=3))
        assert error <= 2 * reference + 1e-4, (dtype, error, reference)


@pytest.mark.gpu
def test_gpu_linear_runs_the_kernel_where_the_rule_says_and_graphs_replay_it(monkeypatch):
    """On the GPU with the real rule (its weight range set to take the shape, whatever the measured range is):
    LLaDA-MoE-7B's output projection at 32 rows is the kernel's product (its bits), at `FEW_ROWS_MAX_ROWS` + 1 rows
    and under autograd cuBLAS's; captured in a CUDA graph it gives the eager bits."""
    monkeypatch.setattr(kernels, "FEW_ROWS_MIN_WEIGHT_BYTES", 4 * 2**20)
    monkeypatch.setattr(kernels, "FEW_ROWS_MAX_WEIGHT_BYTES", 32 * 2**20)
    layer = nn.Linear(2048, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 32, 2048, device="cuda", dtype=torch.bfloat16)
    many = torch.randn(1, kernels.FEW_ROWS_MAX_ROWS + 1, 2048, device="cuda", dtype=torch.bfloat16)
    set_kernel_mode("auto")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 tensor cores needed")
    with torch.no_grad():
        eager = kernels.linear(layer, x)
        assert torch.equal(eager, fp8_triton.few_rows_matmul(x, layer.weight))
        assert torch.equal(kernels.linear(layer, many), layer(many))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kernels.linear(layer, x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured = kernels.linear(layer, x)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    assert torch.equal(kernels.linear(layer, x), layer(x))  # autograd records: cuBLAS


@pytest.mark.gpu
def test_gpu_llada_moe_7b_attention_block_step_within_twice_pytorch_bf16(monkeypatch):
    """A LLaDA-MoE with the 7B model's attention (hidden 2048, 16 heads: q/k/v 24 MiB, output 8 MiB, both in the
    rule's range, set here to 4-32 MiB whatever the measured one is) and small experts: a cached prefill and block step
    in bf16 on the fused path, the few-rows kernel running (counted), within 2x of the same model's error with the
    kernel ruled out (cuBLAS), against float32."""
    from hf_dllm.cache import DiffusionKVCache
    from hf_dllm.modeling_llada_moe import LLaDAMoEModelLM
    from tests.models.llada_moe.test_llada_moe_fast_path import random_config, random_model

    config = random_config(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, vocab_size=320)
    reference = random_model(config, torch.float32, "cuda")
    model = LLaDAMoEModelLM._from_config(copy.deepcopy(config), dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict({name: tensor.to(torch.bfloat16) for name, tensor in reference.state_dict().items()})
    # A 96-token prefill (past `FEW_ROWS_MAX_ROWS`: cuBLAS), then the block's 32.
    ids, block = torch.randint(0, 300, (1, 96), device="cuda"), torch.randint(0, 300, (1, 32), device="cuda")
    launches = []
    kernel = kernels.few_rows_matmul
    monkeypatch.setattr(kernels, "few_rows_matmul", lambda *args: launches.append(1) or kernel(*args))

    def step_logits(net) -> torch.Tensor:
        cache = DiffusionKVCache(2, 1, 128)
        with torch.no_grad():
            net(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(96, device="cuda"))
            at = torch.arange(96, 128, device="cuda")
            step = net(block, past_key_values=cache, use_cache=True, cache_position=at)
        return step.logits.float()

    monkeypatch.setattr(kernels, "FEW_ROWS_MIN_WEIGHT_BYTES", 4 * 2**20)  # every other weight is under 2 MiB
    monkeypatch.setattr(kernels, "FEW_ROWS_MAX_WEIGHT_BYTES", 32 * 2**20)
    set_kernel_mode("auto")
    want = step_logits(reference)
    fused = step_logits(model)
    assert len(launches) == 4  # q/k/v and output projection of both layers, in the block step only (32 rows)
    monkeypatch.setattr(kernels, "FEW_ROWS_MAX_WEIGHT_BYTES", 0)
    plain = step_logits(model)
    assert len(launches) == 4
    assert (fused - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-3
