"""Where DiffusionGemma's denoising step spends its time: a per-kernel breakdown of the captured step.

At the 26B-A4B shape in bf16 on a GPU (`bench_diffusion_gemma.GEMMA_26B_A4B`, random weights, a 512-token prompt
encoded first), one decoder step plus the fused sampler, as `generate()` runs it (the layers replayed from a CUDA
graph), is run `--steps` times under `torch.profiler`. Kernels are grouped by name and by kind (the experts'
grouped products, cuBLAS products, attention, the sampler, norms and routing, the rest); the table gives each
group's time per step, its share, and the GPU's idle time between kernels (the step's span minus the union of its
kernels). Ends with one JSON line.

    python benchmarks/profile_diffusion_gemma_step.py [--batch 1] [--steps 5] [--layers 30]

`--cpu`: a tiny float32 shape on the CPU (checks that the script runs; CPU ops instead of kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_diffusion_gemma import GEMMA_26B_A4B, TINY, build_models, sync, text_fields  # noqa: E402

from hf_dllm.decoding_diffusion_gemma import SAMPLER_DEFAULTS, EntropyBoundSampler  # noqa: E402

# Kernel-name fragments per kind, first match wins.
KINDS = (
    ("experts (grouped products)", ("_grouped_kernel",)),
    ("attention", ("attention", "attn", "_block_attn", "flash", "softmax_kernel")),
    ("sampler", ("sample", "entropy")),
    ("routing, alignment, combine", ("route", "align", "chunk_", "combine", "router")),
    ("norms", ("norm", "rope")),
    ("products (cuBLAS)", ("gemm", "nvjet", "sm90", "cutlass", "xmma", "gemv")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny float32 shape on the CPU (default without a GPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="steps profiled")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the shape's)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed by name")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        parser.error("--batch and --steps must be positive")
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    shape = text_fields(GEMMA_26B_A4B if gpu else TINY, args.layers)
    canvas, dtype, prompt_len = (256, torch.bfloat16, 512) if gpu else (16, torch.float32, 16)
    torch.manual_seed(0)
    model, _, _ = build_models(shape, canvas, dtype, device, with_reference=False)
    text = model.config.text_config
    defaults = {k: v for k, v in SAMPLER_DEFAULTS.items() if k not in ("sampler_config", "max_denoising_steps")}
    sampler = EntropyBoundSampler(
        text.vocab_size,
        max_denoising_steps=1 << 20,
        entropy_bound=0.1,
        softcap=text.final_logit_softcapping,
        **defaults,
    )  # fmt: skip (as bench_diffusion_gemma's isolated step)
    positions = torch.arange(prompt_len, prompt_len + canvas, device=device)
    with torch.no_grad():
        prompt = torch.randint(3, shape["vocab_size"], (args.batch, prompt_len), device=device)
        cache = model._diffusion_new_cache(args.batch, prompt_len + canvas)
        valid = torch.ones(args.batch, prompt_len, dtype=torch.bool, device=device)
        model.encode(prompt, torch.arange(prompt_len, device=device), valid, cache)
        block = sampler.initial_block(args.batch, canvas, device)

        def step(block):
            logits = model.decode(block, positions, cache, padded=False, **sampler.forward_inputs())
            return sampler.denoise(block, logits, None, None)[0]

        for _ in range(3):  # self-conditioned, captured, replayed once
            block = step(block)
        sync(device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(args.steps):
                block = step(block)
            sync(device)
    wanted = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU
    events = [e for e in profiler.events() if e.device_type == wanted and e.time_range.elapsed_us() > 0]
    if not gpu:  # CPU ops nest: keep the outermost of each thread's (an approximation; timings mean nothing here)
        events = [e for e in events if e.cpu_parent is None]
    by_name: dict = defaultdict(lambda: [0.0, 0])
    by_kind: dict = defaultdict(float)
    intervals = []
    for event in events:
        elapsed = event.time_range.elapsed_us()
        by_name[event.name][0] += elapsed
        by_name[event.name][1] += 1
        by_kind[kind_of(event.name)] += elapsed
        intervals.append((event.time_range.start, event.time_range.end))
    span = max(end for _, end in intervals) - min(start for start, _ in intervals) if intervals else 0.0
    busy = busy_us(intervals)
    per_step = 1e-3 / args.steps  # us over all steps -> ms per step
    total = sum(by_kind.values())
    print(f"\n{'kind':<32}{'ms / step':>10}{'share':>8}")
    for kind, us in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"{kind:<32}{us * per_step:>10.3f}{us / total:>8.1%}")
    print(f"{'kernels (sum)':<32}{total * per_step:>10.3f}")
    print(f"{'busy (union)':<32}{busy * per_step:>10.3f}")
    print(f"{'span':<32}{span * per_step:>10.3f}")
    print(f"{'idle in span':<32}{(span - busy) * per_step:>10.3f}")
    print(f"\n{'kernel':<70}{'calls / step':>13}{'us / call':>10}{'ms / step':>10}")
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[: args.top]
    for name, (us, calls) in top:
        print(f"{name[:69]:<70}{calls / args.steps:>13.1f}{us / calls:>10.1f}{us * per_step:>10.3f}")
    summary = dict(
        benchmark="profile_diffusion_gemma_step",
        device=torch.cuda.get_device_name(device) if gpu else "CPU",
        batch=args.batch,
        steps=args.steps,
        layers=shape["num_hidden_layers"],
        graphs_used=model._graphs is not None and bool(model._graphs.entries),
        ms_per_step={kind: round(us * per_step, 4) for kind, us in by_kind.items()},
        kernels_ms=round(total * per_step, 4),
        busy_ms=round(busy * per_step, 4),
        span_ms=round(span * per_step, 4),
        top=[dict(name=name, calls=calls, us=round(us, 1)) for name, (us, calls) in top],
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
