"""Few-row dense products split over the reduction (`triton_linear.few_rows_linear`) and where they run
(`kernels.dense_linear`).

- Through Triton's interpreter (CPU, float16): every split (1 to 8), column and reduction tails, a bias, 3-D inputs:
  the error against a float64 product within twice PyTorch's own (float32 product rounded to float16); a row gives
  the same bits alone as among 32; a second call the same bits; the counters back at zero.
- The split rule picks the splits an H200's sweep picked for LLaDA-MoE-7B's, LLaDA2.0-mini's and LLaDA-8B's shapes.
- `few_rows_applies` refuses what the kernel does not compute (33 rows, float32, mixed dtypes, a transposed or an
  output-head-sized weight), and `few_rows_linear` says so with a ValueError; `dense_linear` stays PyTorch's on CPU.
- GPU (bfloat16, the step shapes): the same error bound against cuBLAS's, rows alone equal rows together, counters
  at zero, CUDA graph replays equal, and `kernels.linear` takes the kernel for few rows, cuBLAS beyond them and the
  module itself where a hook must run.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import interpreter_job

pytest.importorskip("triton", reason="the `triton` extra is not installed")

# (rows, n, k, split, bias): tails in both n (100: two tiles of 64, the second partial) and k (300: split chunks of
# 128-column steps, the last short), a chunk past k (k 300 over 4 splits), 3-D rows.
CPU_CASES = [
    ((32, 128, 256), 1, False),
    ((7, 100, 300), 2, True),
    ((1, 64, 300), 4, False),
    ((2, 5, 192, 1024), 8, True),
    ((32, 96, 512), 4, True),
]

INTERPRETER_SCRIPT = f"""
import torch
from torch.nn import functional as F
from hf_dllm import triton_linear as T
from hf_dllm.triton_attention import _MERGE_COUNTERS

torch.manual_seed(0)
for shape, split, with_bias in {CPU_CASES!r}:
    *lead, n, k = shape
    x = torch.randn(*lead, k).half()
    w = (torch.randn(n, k) / k**0.5).half()
    b = torch.randn(n).half() if with_bias else None
    out = T.few_rows_linear(x, w, b, config=(split, 2))
    assert out.shape == (*lead, n) and out.dtype == torch.float16, (out.shape, out.dtype)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch_err = (F.linear(x.float(), w.float(), None if b is None else b.float()).half().double() - exact).abs().max()
    err = (out.double() - exact).abs().max()
    assert err <= 2 * torch_err + 1e-6, (shape, split, float(err), float(torch_err))
    assert torch.equal(T.few_rows_linear(x, w, b, config=(split, 2)), out), "a second call changed the bits"
    rows, last = x.reshape(-1, k), x.numel() // k - 1
    alone = T.few_rows_linear(rows[last:], w, b, config=(split, 2))
    assert torch.equal(alone, out.reshape(-1, n)[last:]), "a row alone differs from the row among others"
    counters = [c for key, cs in _MERGE_COUNTERS.items() if key[1] == w.data_ptr() for c in cs]
    assert (split == 1) == (not counters) and all(int(c.abs().sum()) == 0 for c in counters), counters
print("few rows checks passed")
"""
INTERPRETER_RUN = interpreter_job({"few_rows": INTERPRETER_SCRIPT}, timeout=300)


@INTERPRETER_RUN.used_by
def test_few_rows_product_in_the_interpreter():
    for result in INTERPRETER_RUN.results().values():
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "few rows checks passed" in result.stdout


@pytest.mark.parametrize(
    "n, k, split",
    [(6144, 2048, 1), (2048, 2048, 4), (3072, 2048, 2), (12288, 4096, 1), (4096, 4096, 4), (24576, 4096, 1),
     (4096, 12288, 4), (64, 512, 1)],
)  # fmt: skip
def test_split_rule_picks_the_swept_splits(n, k, split):
    from hf_dllm.triton_linear import few_rows_config

    assert few_rows_config(n, k, torch.device("cpu")) == (split, 3)


def test_applies_only_to_what_the_kernel_computes():
    from hf_dllm.triton_linear import FEW_ROWS, few_rows_applies, few_rows_linear

    w = torch.randn(64, 128, dtype=torch.bfloat16)
    x = torch.randn(FEW_ROWS, 128, dtype=torch.bfloat16)
    assert few_rows_applies(x, w, None) and few_rows_applies(x[:1], w, torch.zeros(64, dtype=torch.bfloat16))
    refused = {
        "33 rows": (torch.randn(FEW_ROWS + 1, 128, dtype=torch.bfloat16), w, None),
        "float32": (x.float(), w.float(), None),
        "mixed dtypes": (x.half(), w, None),
        "transposed weight": (x, torch.randn(128, 64, dtype=torch.bfloat16).t(), None),
        "wrong k": (x[:, :64], w, None),
        "float32 bias": (x, w, torch.zeros(64)),
        "head-sized weight": (x, torch.empty(1, 128, dtype=torch.bfloat16).expand((1 << 27) // 128 + 1, 128), None),
    }
    for name, args in refused.items():
        assert not few_rows_applies(*args), name
        with pytest.raises(ValueError, match="few_rows_linear takes"):
            few_rows_linear(*args)


def test_dense_linear_stays_pytorch_on_cpu(monkeypatch):
    from hf_dllm import kernels

    monkeypatch.setattr(kernels, "few_rows_linear", lambda *args: pytest.fail("few_rows_linear ran on CPU"))
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    assert torch.equal(kernels.dense_linear(x, w), torch.nn.functional.linear(x, w))


STEP_SHAPES = [(32, 6144, 2048), (32, 2048, 2048), (7, 3072, 2048), (32, 4096, 12288), (1, 100, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n, k", STEP_SHAPES)
def test_few_rows_product_on_gpu(rows, n, k):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hf_dllm import triton_linear as T
    from hf_dllm.triton_attention import _MERGE_COUNTERS

    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if n == 100 else None
    out = T.few_rows_linear(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    cublas_err = (torch.nn.functional.linear(x, w, b).double() - exact).abs().max()
    err = (out.double() - exact).abs().max()
    assert err <= 2 * cublas_err + 1e-6, (float(err), float(cublas_err))
    assert torch.equal(T.few_rows_linear(x[:1], w, b), out[:1])
    torch.cuda.synchronize()
    owned = [c for key, cs in _MERGE_COUNTERS.items() if key[1] == w.data_ptr() for c in cs]
    assert all(int(c.abs().sum()) == 0 for c in owned)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = T.few_rows_linear(x, w, b)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)


@pytest.mark.gpu
def test_linear_and_project_take_the_kernel_for_few_rows_only(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hf_dllm import kernels

    calls = []
    real = kernels.few_rows_linear
    monkeypatch.setattr(kernels, "few_rows_linear", lambda *args: calls.append(args[0].shape) or real(*args))
    layer = torch.nn.Linear(256, 192, bias=True, device="cuda", dtype=torch.bfloat16)
    few, many = (torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16) for rows in (32, 64))
    with torch.no_grad():
        assert torch.allclose(kernels.linear(layer, few), layer(few), atol=2e-2, rtol=2e-2)
        assert torch.equal(kernels.linear(layer, many), layer(many))
        assert calls == [few.shape]
        seen = []  # a pre-hook must still run: the layer is called, with cuBLAS's product
        hook = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
        kernels.linear(layer, few)
        hook.remove()
    assert calls == [few.shape] and seen == [few.shape]
