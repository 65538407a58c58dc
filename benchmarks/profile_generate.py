"""Where a whole `generate()` call's time goes beyond its block steps (issue #13): host work, syncs, eager launches.

`bench_generate.py` reports a call's time per forward and, separately, one block step's replay time; at the LLaDA-8B
shape the call takes longer than its steps and block-start forwards add up to (FP8 more so than bf16). This script
runs one warmed-up `generate()` call (batch 1, prompt 512, 256 new tokens, block 32, dual cache, one token per
forward) under torch.profiler with CPU and CUDA activities and prints:

- the call's wall time, and the GPU's busy time (kernels, copies; kernels replayed inside CUDA graphs included);
- the CUDA runtime calls the host made (graph launches, kernel launches, synchronisations, copies), with counts and
  host time;
- the operators with the most host time (self CPU), and the gaps where the GPU sat idle, longest first.

    python benchmarks/profile_generate.py [--quantization none,fp8] [--attn llada_triton] [--batch 1]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_generate import LLADA_8B, QUANTIZATIONS, build_model, parse_quantizations, quantize_fp8  # noqa: E402

RUNTIME_CALLS = (
    "cudaGraphLaunch",
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaMalloc",
    "cudaFree",
    "cudaStreamIsCapturing",
)


def profile_call(model, prompts, kwargs) -> dict:
    model.generate(prompts, **kwargs)  # warm-up: autotuning, compilation, graph capture
    model.generate(prompts, **kwargs)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        out = model.generate(prompts, **kwargs)
        torch.cuda.synchronize()
        wall_ms = 1000 * (time.perf_counter() - start)
    device_intervals, runtime, operators = [], defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            device_intervals.append((event.time_range.start, event.time_range.end))
        elif event.name in RUNTIME_CALLS:
            entry = runtime[event.name]
            entry[0] += 1
            entry[1] += event.cpu_time_total / 1000
        elif not event.name.startswith("cuda"):
            entry = operators[event.name[:80]]
            entry[0] += 1
            entry[1] += event.self_cpu_time_total / 1000
    device_intervals.sort()
    busy, gaps, current_start, current_end = 0.0, [], None, None
    for begin, end in device_intervals:
        if current_end is None or begin > current_end:
            if current_end is not None:
                busy += current_end - current_start
                gaps.append(((begin - current_end) / 1000, current_end))
            current_start, current_end = begin, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    gaps.sort(reverse=True)
    first = device_intervals[0][0] if device_intervals else 0
    return dict(
        wall_ms=wall_ms,
        nfe=int(out.nfe),
        gpu_busy_ms=busy / 1000,
        gpu_span_ms=(device_intervals[-1][1] - first) / 1000 if device_intervals else 0.0,
        idle_gaps_over_0_2_ms=sum(1 for g, _ in gaps if g > 0.2),
        idle_ms_in_gaps_over_0_2_ms=sum(g for g, _ in gaps if g > 0.2),
        longest_gaps_ms=[(round(g, 3), round((at - first) / 1000, 2)) for g, at in gaps[:12]],
        runtime={name: dict(calls=c, host_ms=round(ms, 2)) for name, (c, ms) in sorted(runtime.items())},
        top_host_operators=[
            (name, c, round(ms, 2)) for name, (c, ms) in sorted(operators.items(), key=lambda kv: -kv[1][1])[:25]
        ],
    )


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="none,fp8", help=f"comma list of {', '.join(QUANTIZATIONS)}")
    parser.add_argument("--attn", default="llada_triton")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=256, help="total steps (256: one token per forward)")
    args = parser.parse_args(argv)
    quantizations = parse_quantizations(parser, args.quantization)
    device = torch.device("cuda")
    model = build_model(LLADA_8B, torch.bfloat16, device, args.attn)
    torch.manual_seed(1)
    prompts = torch.randint(0, LLADA_8B["vocab_size"] - 512, (args.batch, 512), device=device)
    kwargs = dict(
        max_new_tokens=256,
        block_length=32,
        steps=args.steps,
        use_cache=True,
        dual_cache=True,
        eos_early_stop=False,
        return_dict_in_generate=True,
    )
    results = {}
    for quant in quantizations:
        # Each FP8 scheme (`bench_generate.py`'s names, `+head` included) quantized from the bf16 model.
        run = model if quant == "none" else quantize_fp8(model, device, args.attn, quant)
        result = profile_call(run, prompts, kwargs)
        del run
        torch.cuda.empty_cache()
        results[quant] = result
        print(
            f"\n== {quant}: wall {result['wall_ms']:.1f} ms for {result['nfe']} forwards "
            f"({result['wall_ms'] / result['nfe']:.2f} ms each); GPU busy {result['gpu_busy_ms']:.1f} ms, "
            f"span {result['gpu_span_ms']:.1f} ms; idle gaps > 0.2 ms: {result['idle_gaps_over_0_2_ms']} "
            f"({result['idle_ms_in_gaps_over_0_2_ms']:.1f} ms)"
        )
        print("longest idle gaps (ms, at ms):", result["longest_gaps_ms"])
        print("CUDA runtime calls:", json.dumps(result["runtime"]))
        print("host time by operator (self CPU ms):")
        for name, calls, ms in result["top_host_operators"]:
            print(f"  {ms:9.2f} {calls:7d}  {name}")
    print(json.dumps(dict(device=torch.cuda.get_device_name(device), batch=args.batch, results=results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
