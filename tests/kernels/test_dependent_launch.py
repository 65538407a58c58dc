"""Programmatic dependent launch (`triton_ops.dependent_launch`, `wait_for_previous_kernel`).

- Every Triton kernel hf_dllm launches starts with `wait_for_previous_kernel()`, and every launch passes
  `**dependent_launch()` (directly or through `triton_ops.launch`): a kernel launched early that read or wrote memory
  before its wait would race the kernel before it, so the two must never come apart.
- `dependent_launch()` asks for PDL only on Hopper and later GPUs, outside Triton's interpreter, while
  `DEPENDENT_LAUNCH` is on.
- GPU: a captured chain of dependent kernels (norms with residuals, grouped products) gives the bits of the same chain
  launched plainly, replay after replay.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from hf_dllm import triton_ops

PACKAGE = pathlib.Path(triton_ops.__file__).parent
JIT_DECORATORS = ("triton.jit", "triton.autotune", "triton.heuristics")


def _jit_functions() -> dict[tuple[str, str], ast.FunctionDef]:
    """(file, name) -> definition of every Triton function of the package."""
    functions = {}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).startswith(JIT_DECORATORS) for d in node.decorator_list
            ):
                functions[(path.name, node.name)] = node
    return functions


def _kernels() -> dict[tuple[str, str], ast.FunctionDef]:
    """The Triton functions no other Triton function calls: the launched kernels (helpers are inlined into them)."""
    functions = _jit_functions()
    called = {
        call.func.id
        for function in functions.values()
        for call in ast.walk(function)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
    }
    return {key: function for key, function in functions.items() if key[1] not in called}


# Subscripted calls in the kernel files that launch no kernel: an expert module picked from a list, and the
# interpreter's launch in `triton_ops.launch` (Triton's interpreter has no dependent launch).
NOT_LAUNCHES = {("grouped_gemm.py", "self._experts[0]"), ("llada2_moe_layer.py", "self.experts[e]"),
                ("triton_ops.py", "kernel.fn[grid(meta)]")}  # fmt: skip


def test_every_kernel_waits_first_and_every_launch_asks_for_dependent_launch():
    kernels = _kernels()
    assert len(kernels) >= 35, f"the scan found only {len(kernels)} kernels: is it still looking at hf_dllm?"
    for (path, name), kernel in kernels.items():
        first = ast.unparse(kernel.body[0])
        assert first == "wait_for_previous_kernel()", (
            f"{path}: kernel {name} must start with `wait_for_previous_kernel()`, starts with {first!r}"
        )
    launches = 0
    for path in sorted({path for path, _ in kernels}):
        for call in ast.walk(ast.parse((PACKAGE / path).read_text())):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)):
                continue
            starred = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
            if "dependent_launch()" in starred:
                launches += 1
            else:
                assert (path, ast.unparse(call.func)) in NOT_LAUNCHES, (
                    f"{path}: the launch {ast.unparse(call.func)} at line {call.lineno} must pass **dependent_launch()"
                )
    assert launches >= 35


def test_the_launcher_of_autotuned_kernels_passes_the_options_on_gpu_paths():
    source = ast.parse(pathlib.Path(triton_ops.__file__).read_text())
    launcher = next(n for n in ast.walk(source) if isinstance(n, ast.FunctionDef) and n.name == "launch")
    calls = [n for n in ast.walk(launcher) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]
    with_options = [c for c in calls if any(ast.unparse(k.value) == "dependent_launch()" for k in c.keywords)]
    assert len(calls) == 3 and len(with_options) == 2  # the interpreter's launch takes none


@pytest.mark.parametrize(
    "interpreted, enabled, initialized, capability, expected",
    [
        (False, True, True, (9, 0), {"launch_pdl": True}),
        (False, True, True, (10, 0), {"launch_pdl": True}),
        (False, True, True, (8, 0), {}),
        (False, True, False, (9, 0), {}),
        (False, False, True, (9, 0), {}),
        (True, True, True, (9, 0), {}),
    ],
)
def test_dependent_launch_only_where_the_gpu_and_triton_have_it(
    monkeypatch, interpreted, enabled, initialized, capability, expected
):
    if not triton_ops.DEPENDENT_LAUNCH_AVAILABLE:
        pytest.skip("this Triton has no grid dependency control")
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_ops, "DEPENDENT_LAUNCH", enabled)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_ops, "capability", lambda device: capability)
    triton_ops._dependent_launch_options.cache_clear()
    try:
        assert triton_ops.dependent_launch() == expected
    finally:
        triton_ops._dependent_launch_options.cache_clear()


@pytest.mark.gpu
def test_captured_chain_of_dependent_kernels_equals_plain_launches(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hf_dllm.grouped_gemm import grouped_matmul

    torch.manual_seed(0)
    device = torch.device("cuda")
    rows, width, groups, links = 32, 256, 4, 24
    weights = [torch.randn(groups, width, width, device=device, dtype=torch.bfloat16) / 16 for _ in range(links)]
    norm = torch.rand(width, device=device, dtype=torch.bfloat16) + 0.5
    offsets = torch.tensor([5, 13, 13, rows], device=device, dtype=torch.int32)
    x0 = torch.randn(rows, width, device=device, dtype=torch.bfloat16)

    def chain(x):
        residual = x
        for weight in weights:
            x, residual = triton_ops.rms_norm(grouped_matmul(x, offsets, weight), norm, 1e-6, residual=residual)[:2]
        return x

    monkeypatch.setattr(triton_ops, "DEPENDENT_LAUNCH", False)
    plain = chain(x0.clone())
    monkeypatch.setattr(triton_ops, "DEPENDENT_LAUNCH", True)
    source = x0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(source)  # compile and autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(source)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)
