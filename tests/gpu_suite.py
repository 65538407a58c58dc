"""Every GPU test (`-m gpu`) on all of this host's GPUs at once, under a deadline.

A device command gets 10 minutes, far less than the GPU tests take in one pytest process (most of it Triton
compiling and graph capture on the host). So: one collection, then the tests split into jobs (a file, or chunks of
`--chunk` tests of a large file), run by `--workers` pytest processes, each job on the least busy GPU
(`CUDA_VISIBLE_DEVICES`), except the tests that read `device_count()`: they start first, with every GPU visible.
(A test that skips for want of GPUs through a helper shows as skipped in its job's line.) Logs, one per job, go
to `--out` in one archive; the summary is printed and written as `summary.txt`, with the failures' tracebacks.

    python -m tests.gpu_suite --workers 8 --deadline 540 --out "$OUT"

The multi-GPU tests' NCCL settings are set here (no NVLink multicast: docs/multi-gpu.md).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SUMMARY_LINE = re.compile(r"^=* ?\d+ (passed|failed|skipped|error|deselected).*$|^=* ?no tests ran.*$")


@dataclass
class Job:
    name: str
    tests: list[str]  # node ids, or a whole file
    count: int  # tests
    all_gpus: bool = False
    result: dict = field(default_factory=dict)


def needs_more_gpus(path: Path) -> set[str]:
    """The test functions of the file at `path` that may skip unless several CUDA devices are visible: those that
    read `device_count()` (in a skip decorator or their body; the module's `pytestmark`: "*", every test).
    Running a one-GPU test with every GPU visible costs nothing: it takes the first."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if "device_count()" in ast.unparse(node.value):
                return {"*"}
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test")
        and "device_count()" in ast.unparse(node)
    }


def plan(node_ids: list[str], chunk: int, root: Path = ROOT) -> list[Job]:
    """Jobs for `node_ids` (collection order): first a job per file of the tests needing several GPUs
    (`needs_more_gpus`, run with every GPU visible); then a job per file, or chunks of `chunk` tests for a file of
    more than `chunk * 3 // 2`, the jobs with the most tests first (long ones should not start last)."""
    files: dict[str, list[str]] = {}
    for node in node_ids:
        files.setdefault(node.split("::")[0], []).append(node)
    several, single = [], []
    for path, nodes in files.items():
        stem, names = Path(path).stem, needs_more_gpus(root / path)
        wide = [node for node in nodes if "*" in names or node.split("::")[-1].split("[")[0] in names]
        rest = [node for node in nodes if node not in wide]
        if wide:
            several.append(Job(f"{stem}_gpus", wide, len(wide), all_gpus=True))
        if len(rest) <= chunk * 3 // 2:
            single += [Job(stem, [path] if not wide else rest, len(rest))] if rest else []
            continue
        for k in range(0, len(rest), chunk):
            single.append(Job(f"{stem}_{k // chunk}", rest[k : k + chunk], len(rest[k : k + chunk])))
    return several + sorted(single, key=lambda job: -job.count)


def collect(paths: list[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu", *paths],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode not in (0, 5):  # 5: none selected. A module failing to import must not drop its tests unseen
        raise SystemExit(
            f"gpu_suite: collection failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


class Runner:
    """`--workers` threads taking jobs in order; each job a pytest process on the least busy GPU (or all)."""

    def __init__(self, gpus: int, deadline: float, out: Path):
        self.deadline, self.out = deadline, out
        self.busy = [0] * max(gpus, 1)  # single-GPU jobs running on each GPU
        self.lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run_all(self, jobs: list[Job], workers: int) -> list[Job]:
        queue, started = list(jobs), []

        def work():
            while True:
                with self.lock:
                    if not queue or self.left() < 30:
                        return
                    job = queue.pop(0)
                    started.append(job)
                self.run(job)

        threads = [threading.Thread(target=work) for _ in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return started

    def run(self, job: Job) -> None:
        env = dict(os.environ, **NCCL_ENV, PYTHONUNBUFFERED="1")
        with self.lock:
            gpu = min(range(len(self.busy)), key=self.busy.__getitem__)
            if not job.all_gpus:
                self.busy[gpu] += 1
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the GPUs this run was given, if narrowed
                env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
        start = time.monotonic()
        log = self.out / f"{job.name}.log"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--tb=short", "-m", "gpu"]
        with open(log, "w") as handle:
            try:
                code = subprocess.run(
                    [*command, *job.tests], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                    timeout=max(self.left(), 1),
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                code = "timeout"
        if not job.all_gpus:
            with self.lock:
                self.busy[gpu] -= 1
        text = log.read_text()
        summary = [line for line in text.splitlines() if SUMMARY_LINE.match(line)]
        job.result = {"code": code, "seconds": round(time.monotonic() - start), "summary": summary[-1:], "log": text}


def report(jobs: list[Job], not_run: list[Job]) -> str:
    lines = [f"{job.name:48s} {job.result['code']!s:>7} {job.result['seconds']:5d}s  {' '.join(job.result['summary'])}"
             for job in jobs]  # fmt: skip
    failed = [job for job in jobs if job.result["code"] != 0]
    lines.append(f"not run (deadline): {[job.name for job in not_run]}")
    lines.append(f"{len(jobs) - len(failed)} of {len(jobs)} jobs passed")
    for job in failed:
        text = job.result["log"]
        start = text.find("= FAILURES =")
        lines += [
            f"\n######## {job.name} ({job.result['code']})",
            text[start : start + 6000] if start >= 0 else text[-3000:],
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["tests"])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--deadline", type=float, default=540, help="seconds from start for the whole run")
    parser.add_argument("--chunk", type=int, default=8, help="tests per job of a large file")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_suite_logs")))
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("gpu_suite: no CUDA device here")
    args.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(gpus, time.monotonic() + args.deadline, args.out)
    jobs = plan(collect(args.paths), args.chunk)
    started = runner.run_all(jobs, args.workers)
    not_run = [job for job in jobs if job not in started]
    text = report(started, not_run)
    (args.out / "summary.txt").write_text(text)
    with tarfile.open(args.out / "logs.tgz", "w:gz") as tar:  # one file back from a device machine, not dozens
        for job in started:
            tar.add(args.out / f"{job.name}.log", arcname=f"{job.name}.log")
            (args.out / f"{job.name}.log").unlink()
    print(text)
    return 0 if all(job.result["code"] == 0 for job in started) and not not_run else 1


if __name__ == "__main__":
    sys.exit(main())
