"""The all-reduces of a tensor-parallel step, by size: NCCL against PyTorch's symmetric-memory one-shot and two-shot
kernels (`hf_dllm.tensor_parallel.all_reduce`, forced through `HF_DLLM_ALL_REDUCE`), each call captured in a CUDA
graph as the denoising steps are (issue #64). NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`,
`TORCH_SYMM_MEM_DISABLE_MULTICAST=1`).

For each size (bf16 elements of a `(tokens, hidden)` activation): microseconds per all-reduce of each algorithm (a
graph of `--calls` all-reduces, replayed `--repeats` times, median), the fastest, and the algorithm the `auto` rule
picks (`tensor_parallel.all_reduce_algorithm`: one-shot up to `ONE_SHOT_MAX_BYTES`, two-shot up to
`TWO_SHOT_MAX_BYTES`); `auto_within` is the rule's time over the fastest's. A table, then one JSON line.

    python benchmarks/bench_allreduce.py --gpus 2
    python benchmarks/bench_allreduce.py --gpus 4
    python benchmarks/bench_allreduce.py --cpu          # gloo, 2 processes, eager: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Elements: a block of 32 tokens x hidden 2048 / 4096 at batch 1, 8 and 32, and beyond (bf16: 2 bytes each).
SIZES = [32 * 2048, 32 * 4096, 2 * 32 * 4096, 4 * 32 * 4096, 8 * 32 * 4096, 16 * 32 * 4096, 32 * 32 * 4096]
CPU_SIZES = [32 * 64, 4 * 32 * 64]
ALGORITHMS = ("nccl", "one_shot", "two_shot")


def time_algorithm(tensor: torch.Tensor, group, choice: str, calls: int, repeats: int) -> float | None:
    """Microseconds per all-reduce of `tensor` with `HF_DLLM_ALL_REDUCE=choice` (None where that kernel cannot run
    this size: the rule falls back to the collective, which `nccl` measures)."""
    from hf_dllm import tensor_parallel

    os.environ[tensor_parallel.ALL_REDUCE_ENV] = choice
    cuda = tensor.is_cuda
    if choice != "nccl":
        buffer = tensor_parallel.symmetric_buffer(group, tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        picked = tensor_parallel.all_reduce_algorithm(nbytes, tensor.dtype, group.size(), choice, buffer is not None)
        if picked != choice:
            return None
    source = tensor.clone()
    for _ in range(3):  # warm-up (and the buffer's rendezvous, eagerly)
        tensor_parallel.all_reduce(source.clone(), group)
    if not cuda:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                tensor_parallel.all_reduce(source.clone(), group)
            times.append((time.perf_counter() - start) / calls)
        return 1e6 * statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = source
        for _ in range(calls):
            out = tensor_parallel.all_reduce(out, group) * 0.5  # a dependent chain, as the layers make
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def worker(args) -> int:
    import torch.distributed as dist

    from hf_dllm import tensor_parallel

    if args.cpu:
        dist.init_process_group("gloo")
        device, dtype, sizes = torch.device("cpu"), torch.float32, CPU_SIZES
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        device, dtype, sizes = torch.device("cuda"), torch.bfloat16, SIZES
    group = dist.group.WORLD
    rows = []
    for numel in sizes:
        tensor = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank())).to(device, dtype)
        row = dict(elements=numel, bytes=numel * tensor.element_size())
        for choice in ALGORITHMS:
            row[choice] = time_algorithm(tensor, group, choice, args.calls, args.repeats)
        buffer = tensor_parallel._symmetric_buffers.get(group.group_name)
        row["auto"] = tensor_parallel.all_reduce_algorithm(
            row["bytes"], dtype, group.size(), "auto", buffer is not None
        ).replace("collective", "nccl")
        timed = {name: row[name] for name in ALGORITHMS if row[name] is not None}
        row["fastest"] = min(timed, key=timed.get)
        row["auto_within"] = timed[row["auto"]] / timed[row["fastest"]]
        rows.append(row)
    if dist.get_rank() == 0:
        torch.save(rows, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--calls", type=int, default=None, help="all-reduces per graph (default 50; --cpu: 5)")
    parser.add_argument("--repeats", type=int, default=None, help="timed replays (default 20; --cpu: 3)")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, eager (checks the script)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.calls = args.calls or (5 if args.cpu else 50)
    args.repeats = args.repeats or (3 if args.cpu else 20)
    if args.gpus < 2:
        raise ValueError(f"--gpus must be >= 2, got {args.gpus}.")
    if args.worker:
        return worker(args)
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"bench_allreduce.py needs {args.gpus} CUDA devices, found {torch.cuda.device_count()}.")
    started = time.perf_counter()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "rows.pt"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus)]
        command += [__file__, "--worker", "--out", str(out), "--calls", str(args.calls), "--repeats", str(args.repeats)]
        subprocess.run([*command, *(["--cpu"] if args.cpu else [])], env=env, check=True)
        rows = torch.load(out, weights_only=False)
    device = "CPU (gloo)" if args.cpu else torch.cuda.get_device_name(0)
    print(f"\n{device} x{args.gpus}: microseconds per all-reduce (captured in a CUDA graph on GPUs)")
    print(f"{'bytes':>10}{'nccl':>9}{'one_shot':>10}{'two_shot':>10}{'fastest':>10}{'auto':>10}{'auto/best':>10}")
    for row in rows:
        cells = "".join(
            f"{'-' if row[name] is None else f'{row[name]:.1f}':>{w}}"
            for name, w in zip(ALGORITHMS, (9, 10, 10), strict=True)
        )
        print(f"{row['bytes']:>10}{cells}{row['fastest']:>10}{row['auto']:>10}{row['auto_within']:>10.2f}")
    from hf_dllm.tensor_parallel import ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES

    summary = dict(
        device=device,
        gpus=args.gpus,
        torch=torch.__version__,
        one_shot_max_bytes=ONE_SHOT_MAX_BYTES,
        two_shot_max_bytes=TWO_SHOT_MAX_BYTES,
        rule_within_10_percent=all(row["auto_within"] <= 1.1 for row in rows),
        total_s=round(time.perf_counter() - started, 1),
        rows=rows,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
