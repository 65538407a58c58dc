"""tests/gpu_suite.py, the runner of the GPU tests over a host's GPUs: its jobs, its collection, its report."""

from __future__ import annotations

import pytest

from tests import gpu_suite

WIDE = """
import pytest, torch

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two(x):
    pass

def test_inside(ranks):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA devices")

def test_plain():
    pass

def helper():
    return torch.cuda.device_count()
"""


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_wide.py").write_text(WIDE)
    (tmp_path / "tests/test_big.py").write_text("def test_a(i):\n    pass\n")
    (tmp_path / "tests/test_all.py").write_text(
        "import torch, pytest\npytestmark = pytest.mark.skipif(torch.cuda.device_count() < 4, reason='4')\n"
        "def test_x():\n    pass\n"
    )
    return tmp_path


def test_plan_puts_multi_gpu_tests_first_and_splits_large_files(tree):
    nodes = [
        *[f"tests/test_big.py::test_a[{i}]" for i in range(20)],
        "tests/test_wide.py::test_two[1]",
        "tests/test_wide.py::test_two[2]",
        "tests/test_wide.py::test_inside[4]",
        "tests/test_wide.py::test_plain",
        "tests/test_all.py::test_x",
    ]
    jobs = gpu_suite.plan(nodes, chunk=8, root=tree)
    assert [(job.name, job.count, job.all_gpus) for job in jobs] == [
        ("test_wide_gpus", 3, True),
        ("test_all_gpus", 1, True),
        ("test_big_0", 8, False),
        ("test_big_1", 8, False),
        ("test_big_2", 4, False),
        ("test_wide", 1, False),
    ]
    assert jobs[0].tests == nodes[20:23]
    assert jobs[5].tests == ["tests/test_wide.py::test_plain"]  # not the whole file: its wide tests ran apart
    assert jobs[2].tests == nodes[:8]
    # A file small enough for one job runs whole (one path: its module fixtures built once).
    assert gpu_suite.plan(nodes[:12], chunk=8, root=tree)[0].tests == ["tests/test_big.py"]


def test_report_lists_each_job_the_failures_tracebacks_and_what_did_not_run():
    passed = gpu_suite.Job("ok", ["t.py"], 2)
    passed.result = {"code": 0, "seconds": 3, "summary": ["2 passed in 1.0s"], "log": ""}
    failed = gpu_suite.Job("bad", ["u.py"], 1)
    log = "F\n=== FAILURES ===\n___ test_u ___\nE   assert 1 == 2\n=== 1 failed in 2.0s ==="
    failed.result = {"code": 1, "seconds": 4, "summary": ["=== 1 failed in 2.0s ==="], "log": log}
    late = gpu_suite.Job("late", ["v.py"], 5)
    text = gpu_suite.report([passed, failed], [late])
    assert "2 passed in 1.0s" in text and "1 of 2 jobs passed" in text
    assert "not run (deadline): ['late']" in text
    assert "######## bad (1)" in text and "E   assert 1 == 2" in text


def test_refuses_a_host_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_suite.main(["--out", "unused"])


def test_a_collection_error_stops_the_run_instead_of_dropping_tests(tmp_path):
    broken = tmp_path / "test_broken.py"
    broken.write_text("import a_module_that_does_not_exist\n")
    with pytest.raises(SystemExit, match="collection failed"):
        gpu_suite.collect([str(broken)])
