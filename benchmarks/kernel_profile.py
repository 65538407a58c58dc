"""Kernel tables of a step under `torch.profiler`, for the benchmarks' `--profile` modes and the profile scripts:
the kernels (on a GPU; CPU ops elsewhere) of `steps` calls of a function grouped by name and by kind, with the
union of their intervals (busy time) and the span from the first start to the last end, per call."""

from __future__ import annotations

from collections import defaultdict

import torch

# Kernel-name fragments per kind, first match wins.
KINDS = (
    ("experts (grouped products)", ("_grouped_kernel",)),
    ("norms (and layer-end kernels)", ("norm", "rope", "_post_attention", "_post_feedforward")),
    ("attention", ("attention", "attn", "flash", "softmax_kernel")),
    ("sampler, decision", ("sample", "entropy", "_partials_kernel", "_finish_kernel", "commit")),
    ("routing, alignment, combine", ("route", "align", "chunk_", "combine", "router")),
    ("dense products", ("gemm", "nvjet", "sm90", "cutlass", "xmma", "gemv", "splitk", "_dense_rows")),
)


def kind_of(name: str) -> str:
    """The `KINDS` entry a kernel's name falls under ("other" where none does)."""
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


def profile_calls(function, steps: int, device: torch.device, top: int = 25) -> dict:
    """`function()` called `steps` times under the profiler (after the caller's warm-up): per call, ms by kind,
    the kernels' sum, busy and span ms, and the `top` kernels by time (name, calls, us per call, ms per call).
    On a CPU the outermost CPU ops stand in for kernels (the script runs; the figures mean little)."""
    gpu = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            function()
        if gpu:
            torch.cuda.synchronize(device)
    wanted = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU
    events = [e for e in profiler.events() if e.device_type == wanted and e.time_range.elapsed_us() > 0]
    if not gpu:
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
    per_call = 1e-3 / steps  # us over every call -> ms per call
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return dict(
        steps=steps,
        ms_by_kind={kind: round(us * per_call, 4) for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        kernels_ms=round(sum(by_kind.values()) * per_call, 4),
        busy_ms=round(busy_us(intervals) * per_call, 4),
        span_ms=round(span * per_call, 4),
        top=[
            dict(name=name, calls=calls / steps, us_per_call=round(us / calls, 2), ms=round(us * per_call, 4))
            for name, (us, calls) in ranked
        ],
    )


def print_profile(profile: dict) -> None:
    """The table of a `profile_calls` result."""
    total = profile["kernels_ms"] or 1.0
    print(f"\n{'kind':<32}{'ms / step':>10}{'share':>8}")
    for kind, ms in profile["ms_by_kind"].items():
        print(f"{kind:<32}{ms:>10.3f}{ms / total:>8.1%}")
    for label, key in (("kernels (sum)", "kernels_ms"), ("busy (union)", "busy_ms"), ("span", "span_ms")):
        print(f"{label:<32}{profile[key]:>10.3f}")
    print(f"{'idle in span':<32}{profile['span_ms'] - profile['busy_ms']:>10.3f}")
    print(f"\n{'kernel':<70}{'calls / step':>13}{'us / call':>10}{'ms / step':>10}")
    for row in profile["top"]:
        print(f"{row['name'][:69]:<70}{row['calls']:>13.1f}{row['us_per_call']:>10.1f}{row['ms']:>10.3f}")
