"""Where a dual-cache block step's time goes: a per-kernel breakdown (torch.profiler) and GEMM bandwidth.

For the LLaDA-8B or Dream-7B shape in bf16 on a GPU: runs a few eager block steps under the profiler (kernel
durations are the same as in a CUDA-graph replay; only launch gaps differ), groups CUDA kernels by name, and prints
the top ones with their share; the same for the block-start full forward (the dual cache's refresh), with both
steps' CUDA-graph replay times and one replay of each kernel by kernel (durations and the time between kernels, and
a layer's kernels in order). Then times the block's matrix products alone (separate q/k/v and gate/up products
vs. concatenated weights) to show how close cuBLAS gets to the memory-bandwidth floor at small M. Ends with one
JSON line.

    python benchmarks/profile_step.py [--batch 1] [--shape llada-8b|dream-7b] [--quantization fp8|fp8-tensor[+head]]

`--quantization fp8` (128 x 128 block scales) or `fp8-tensor` (one scale per matrix): the LLaDA-8B model quantized
by transformers' `FineGrainedFP8Config` (as bench_generate.py does), so the breakdown is the FP8 step's and
refresh's (the GEMM bandwidth table stays bf16's).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_generate import LLADA_8B, QUANTIZATIONS, build_model, quantize_fp8  # noqa: E402

from hf_dllm.generation_utils import BlockDiffusionRun  # noqa: E402
from hf_dllm.graphs import StepGraphs  # noqa: E402


def gemm_bandwidth(m: int, k: int, n: int, dtype=torch.bfloat16, repeats: int = 50) -> tuple[float, float]:
    """(ms, TB/s of weight bytes) of x (m, k) @ W^T (n, k), rotating over weight copies to defeat L2."""
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(4)]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    for w in weights:
        torch.nn.functional.linear(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(repeats):
        torch.nn.functional.linear(x, weights[i % 4])
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / repeats
    return ms, n * k * weights[0].element_size() / (ms / 1000) / 1e12


def attention_ms(
    batch: int, padded: bool, impl: str, repeats: int = 96, n_splits: int | None = None, kv_copies: int = 1
) -> float:
    """One block-step attention at the 8B shape: 32 queries x 32 heads x 128 dims against 768 cached keys (Triton's
    with `n_splits` key chunks, default its plan). `kv_copies` > 1: the calls take that many K/V copies in turn, so
    that (with enough of them) each call reads its keys and values from memory, as a layer's step does."""
    from hf_dllm.triton_attention import block_attention

    q = torch.randn(batch, 32, 32, 128, device="cuda", dtype=torch.bfloat16)
    kv = [
        (
            torch.randn(batch, 32, 768, 128, device="cuda", dtype=torch.bfloat16),
            torch.randn(batch, 32, 768, 128, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(kv_copies)
    ]
    mask = torch.ones(batch, 768, dtype=torch.bool, device="cuda")
    if padded:
        mask[:, :100] = False

    def call(i):
        k, v = kv[i % kv_copies]
        if impl == "triton":
            return block_attention(q, k, v, mask if padded else None, n_splits=n_splits)
        attn_mask = mask[:, None, None, :] if padded else None
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    for i in range(3):
        call(i)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(repeats):
            call(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats * 1000


def cuda_kernels(fn, calls: int = 1) -> list:
    """The CUDA kernel events (`torch.profiler`) of `calls` calls of `fn()`, in order of start."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda event: event.time_range.start)


def kernel_table(step_fn, steps: int = 5) -> tuple[float, int, list]:
    """(GPU kernel ms per call, kernels per call, top 25 [(name, (ms, count))]) of `step_fn()` under the profiler."""
    per_kernel = defaultdict(lambda: [0.0, 0])
    for event in cuda_kernels(step_fn, steps):
        entry = per_kernel[event.name[:90]]
        entry[0] += event.device_time_total / 1000 / steps
        entry[1] += 1
    total = sum(ms for ms, _ in per_kernel.values())
    kernels = sum(c for _, c in per_kernel.values()) // steps
    return total, kernels, sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]


def print_table(title: str, total: float, kernels: int, top: list, steps: int = 5, rows: int = 25) -> None:
    print(f"{title}: GPU kernel time {total:.2f} ms over {kernels} kernels")
    print(f"{'ms':>8} {'share':>6} {'count':>6}  kernel")
    for name, (ms, count) in top[:rows]:
        print(f"{ms:8.3f} {100 * ms / total:5.1f}% {count // steps:6d}  {name}")


def replay_timeline(fn) -> list[tuple[str, float, float]]:
    """`(kernel name, start us, end us)` of the GPU work of one call of `fn` (a CUDA-graph replay: the kernels as
    they run back to back, with the time between them), in order of start."""
    for _ in range(2):
        fn()
    return [(event.name, event.time_range.start, event.time_range.end) for event in cuda_kernels(fn)]


HOST_WAIT_US = 50.0  # inside a graph kernels follow each other within ~0.1-1 us (H100)


def print_timeline(title: str, events: list[tuple[str, float, float]], in_order: int = 40) -> dict:
    """Per kernel name: total duration, total time since the previous kernel ended, count; then the first
    `in_order` kernels after the first layer's norm one by one (a layer's sequence). A gap of more than
    `HOST_WAIT_US` is the host preparing the replay (the inputs are copied before it), counted apart. Returns
    `{"busy_us", "gaps_us", "host_wait_us", "kernels"}`."""
    per_name = defaultdict(lambda: [0.0, 0.0, 0])
    rows, previous_end = [], None
    for name, start, end in events:
        gap = 0.0 if previous_end is None else start - previous_end
        previous_end = end
        entry = per_name[name[:80]]
        entry[0] += end - start
        entry[1] += gap
        entry[2] += 1
        rows.append((name[:80], end - start, gap))
    busy = sum(duration for _, duration, _ in rows)
    gaps = sum(max(gap, 0.0) for _, _, gap in rows if gap <= HOST_WAIT_US)
    host_wait = sum(gap for _, _, gap in rows if gap > HOST_WAIT_US)
    print(f"{title}: {len(rows)} kernels, {busy:.1f} us busy, {gaps:.1f} us between them ({host_wait:.0f} host)")
    print(f"{'us':>9} {'gap us':>8} {'count':>5}  kernel")
    for name, (duration, gap, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"{duration:9.1f} {gap:8.1f} {count:5d}  {name}")
    first_norm = next((i for i, row in enumerate(rows) if "norm" in row[0]), 0)
    print(f"kernels {first_norm}-{first_norm + in_order - 1} in order (us, gap before):")
    for name, duration, gap in rows[first_norm : first_norm + in_order]:
        print(f"{duration:8.2f} {gap:7.2f}  {name}")
    return {"busy_us": busy, "gaps_us": gaps, "host_wait_us": host_wait, "kernels": len(rows)}


def replay_ms(fn, repeats: int = 20) -> float:
    """Median CUDA-event time of `fn()` (a step through the run's CUDA graphs)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--shape", choices=("llada-8b", "dream-7b"), default="llada-8b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="an FP8 scheme: the LLaDA-8B model quantized (issue #13); with the suffix +head the output head too",
    )
    args = parser.parse_args(argv)
    if args.quantization != "none" and args.shape != "llada-8b":
        parser.error(f"--quantization {args.quantization} is measured at the llada-8b shape")
    device = torch.device("cuda")
    if args.shape == "dream-7b":
        from bench_dream import DREAM_7B
        from bench_dream import build_model as build_dream

        model = build_dream(DREAM_7B, torch.bfloat16, device, args.attn, head_scale=1.0)
        vocab, hidden, mlp, kv_width = DREAM_7B["vocab_size"], 3584, 18944, 2 * 4 * 128
    else:
        model = build_model(LLADA_8B, torch.bfloat16, device, args.attn)
        if args.quantization != "none":
            model = quantize_fp8(model, device, args.attn, args.quantization)
            torch.cuda.empty_cache()
        vocab, hidden, mlp, kv_width = LLADA_8B["vocab_size"], 4096, 12288, 2 * 4096
    prompts = torch.randint(0, 120000, (args.batch, args.prompt_len), device=device)
    config = model.resolve_generation_config(
        max_new_tokens=args.new_tokens, block_length=32, eos_early_stop=False, disable_compile=True
    )
    # Kernels per step counted without graphs: the eager step runs exactly the kernels a replay runs.
    run = BlockDiffusionRun(model, config, prompts, None, None)
    start, end = run.prompt_len, run.prompt_len + 32
    run.unmasking.start_block(32, 32)
    run.run_step(start, end, 0)
    for _ in range(3):
        run.run_step(start, end, 1)
    total, kernels, top = kernel_table(lambda: run.run_step(start, end, 1))
    print_table("block step", total, kernels, top)
    refresh_total, refresh_kernels, refresh_top = kernel_table(lambda: run.run_step(start, end, 0), steps=2)
    print_table("\nblock-start full forward", refresh_total, refresh_kernels, refresh_top, steps=2, rows=12)

    # The same two steps through CUDA graphs (what generate() replays).
    graph_config = model.resolve_generation_config(
        max_new_tokens=args.new_tokens, block_length=32, eos_early_stop=False
    )
    graph_run = BlockDiffusionRun(model, graph_config, prompts, None, None)
    try:
        graph_run.unmasking.start_block(32, 32)
        for _ in range(3):
            graph_run.run_step(start, end, 0)
            graph_run.run_step(start, end, 1)
        step_replay = replay_ms(lambda: graph_run.run_step(start, end, 1))
        refresh_replay = replay_ms(lambda: graph_run.run_step(start, end, 0), repeats=5)
        # The replays' kernels one by one: the cost of each small kernel of a layer as it runs in the graph.
        print()
        step_timeline = print_timeline(
            "block step, one CUDA-graph replay", replay_timeline(lambda: graph_run.run_step(start, end, 1))
        )
        print()
        refresh_timeline = print_timeline(
            "block-start full forward, one CUDA-graph replay",
            replay_timeline(lambda: graph_run.run_step(start, end, 0)),
            in_order=0,
        )
    finally:
        StepGraphs.release_to(model)
    tokens = args.batch * (args.prompt_len + args.new_tokens)
    flops = 2 * (sum(p.numel() for p in model.parameters()) - 2 * vocab * hidden) * tokens
    print(
        f"\nCUDA-graph replay: block step {step_replay:.2f} ms, block-start full forward {refresh_replay:.2f} ms "
        f"({tokens} positions, {flops / refresh_replay / 1e9:.0f} TFLOP/s in the layers' products)"
    )

    m = args.batch * 32
    gemms = {
        f"q ({hidden}x{hidden})": (hidden, hidden),
        f"qkv fused ({hidden + kv_width}x{hidden})": (hidden, hidden + kv_width),
        f"gate ({mlp}x{hidden})": (hidden, mlp),
        f"gate+up fused ({2 * mlp}x{hidden})": (hidden, 2 * mlp),
        f"down ({hidden}x{mlp})": (mlp, hidden),
        f"lm head ({vocab}x{hidden})": (hidden, vocab),
    }
    print(f"\nGEMM, M = {m} rows, bf16 (weight bytes / time)")
    results = {}
    for name, (k, n) in gemms.items():
        ms, tbs = gemm_bandwidth(m, k, n)
        results[name] = {"ms": ms, "tb_s": tbs}
        print(f"  {name:<28} {ms:7.3f} ms  {tbs:5.2f} TB/s")
    attention = {}
    if args.shape == "llada-8b":
        print("\nBlock-step attention (one layer), microseconds, CUDA-graph replays")
    for batch in (1, 8, 32) if args.shape == "llada-8b" else ():
        for padded in (False, True):
            row = {impl: attention_ms(batch, padded, impl) for impl in ("triton", "sdpa")}
            attention[f"b{batch}{'-padded' if padded else ''}"] = row
            print(
                f"  batch {batch:>2} {'padded' if padded else 'no pad':<7} triton {row['triton']:7.1f}  sdpa {row['sdpa']:7.1f}"
            )
    if args.shape == "llada-8b":
        # Batch 1: Triton's key chunks (the plan takes 6 at 768 keys) against fewer and more, K/V from memory (8
        # copies: 100 MB), each with the merge kernel that a split adds.
        chunks = {n: attention_ms(1, False, "triton", n_splits=n, kv_copies=8) for n in (1, 2, 3, 6, 12)}
        attention["b1-key-chunks"] = chunks
        print("  batch  1, K/V from memory, key chunks: " + ", ".join(f"{n}: {us:.1f}" for n, us in chunks.items()))
    print(
        json.dumps(
            {
                "shape": args.shape,
                "quantization": args.quantization,
                "batch": args.batch,
                "kernel_ms_per_step": total,
                "refresh_kernel_ms": refresh_total,
                "step_replay_ms": step_replay,
                "refresh_replay_ms": refresh_replay,
                "step_replay_timeline": step_timeline,
                "refresh_replay_timeline": refresh_timeline,
                "top": top[:10],
                "gemm": results,
                "attention_us": attention,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
