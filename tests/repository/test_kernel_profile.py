"""`benchmarks/kernel_profile.py`, the kernel tables of the benchmarks' `--profile` modes: the busy time is the
union of the kernels' intervals, names fall under their kinds, and a profiled CPU function gives per-call figures
(span >= busy, the top ops by time)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "tests").parent


def load():
    spec = importlib.util.spec_from_file_location("kernel_profile", ROOT / "benchmarks" / "kernel_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_busy_time_is_the_union_of_the_intervals():
    profile = load()
    assert profile.busy_us([]) == 0.0
    assert profile.busy_us([(0, 10), (5, 15), (20, 30)]) == 25.0  # overlap counted once, the gap not at all
    assert profile.busy_us([(20, 30), (0, 40), (41, 42)]) == 41.0  # one interval inside another, any order


def test_kernel_names_fall_under_their_kinds():
    profile = load()
    kinds = {
        "_grouped_kernel": "experts (grouped products)",
        "_block_attention_kernel": "attention",
        "nvjet_sm90_tst_96x64_64x10_2x4_h_bz_TNN": "dense products",
        "void cublasLt::splitKreduce_kernel<32, 16>": "dense products",
        "_dense_rows_kernel": "dense products",
        "_route_kernel": "routing, alignment, combine",
        "_post_attention_kernel": "norms (and layer-end kernels)",
        "_qkv_norm_rope_kernel": "norms (and layer-end kernels)",
        "_partials_kernel": "sampler, decision",
        "Memcpy DtoD (Device -> Device)": "other",
    }
    assert {name: profile.kind_of(name) for name in kinds} == kinds


def test_profiled_cpu_calls_give_figures_per_call():
    profile = load()
    x = torch.randn(64, 64)
    result = profile.profile_calls(lambda: torch.mm(x, x).relu(), 3, torch.device("cpu"), top=2)
    assert result["steps"] == 3 and len(result["top"]) == 2
    assert result["span_ms"] >= result["busy_ms"] > 0
    assert abs(sum(result["ms_by_kind"].values()) - result["kernels_ms"]) < 1e-3
    assert {row["name"] for row in result["top"]} <= {"aten::mm", "aten::relu"}
    assert all(row["calls"] == 1.0 for row in result["top"])
