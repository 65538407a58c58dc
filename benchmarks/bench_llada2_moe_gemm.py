"""Does another grouped GEMM pay for LLaDA2.0-mini's experts at batch 32? (issue "The LLaDA 2.x family", item 7)

The two grouped GEMMs of a MoE layer (`torch._grouped_mm`, CUTLASS) take ~64% of a batch-32 block step. This
benchmark times, at LLaDA2.0-mini's shapes (257 groups: 256 routed experts of 512 plus the shared expert; gate/up
`(257, 1024, 2048)`, down `(257, 2048, 512)`; the rows of `tokens` tokens routed top-8 at random plus every token's
shared-expert row, in expert order as `triton_moe.align_by_expert` gives them):

- `torch._grouped_mm` as the fused path calls it;
- the same with each group's rows padded to a multiple of 16 or 64 (zero rows), so no tile straddles two groups;
- an experimental Triton grouped GEMM (not used by hf_dllm): one program per (row tile of one expert, column
  tile), the tiles of all experts listed on the host beforehand (a real kernel would list them on the device), with
  a few tile choices;

against the weight-read floor (bytes of the groups that received rows over the measured copy bandwidth). Each
candidate is replayed from a CUDA graph. Prints a table and ends with one JSON line.

    python benchmarks/bench_llada2_moe_gemm.py
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton
import triton.language as tl
from bench_llada2_kernels import graph_us  # the same timing as the kernel benchmark

TILES = [(64, 128, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (32, 128, 128, 4, 4), (64, 256, 64, 8, 3)]


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, group_end_ptr, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # c[rows of expert e] = a[rows of expert e] @ w[e].T; w (E, N, K) contiguous, a (P, K), c (P, N).
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    first = tl.load(tile_row_ptr + tile)
    end = tl.load(group_end_ptr + expert)
    rm = first + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rows = (rm < end)[:, None]
    a_tile = a_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    w_tile = w_ptr + expert * N * K + rn.to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_tile, mask=rows, other=0.0)
        w = tl.load(w_tile)
        acc = tl.dot(a, tl.trans(w), acc)
        a_tile += BLOCK_K
        w_tile += BLOCK_K
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=rows)


def triton_grouped_gemm(a, w, tile_expert, tile_row, group_end, tiles):
    block_m, block_n, block_k, warps, stages = tiles
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    grid = (tile_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, tile_expert, tile_row, group_end, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def copy_bandwidth(gib: int = 1) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    source = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * gib * 2**30 / (graph_us(lambda: target.copy_(source), calls=5) / 1e6)


def tile_list(counts: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first row) of every row tile of every expert (host-side listing)."""
    starts = torch.cumsum(counts, 0) - counts
    experts, rows = [], []
    for e, (start, count) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        for first in range(start, start + count, block_m):
            experts.append(e)
            rows.append(first)
    device = counts.device
    return torch.tensor(experts, device=device, dtype=torch.int32), torch.tensor(rows, device=device, dtype=torch.int32)


def padded(a: torch.Tensor, counts: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`a`'s groups each padded with zero rows to a multiple of `multiple`, and the padded end offsets."""
    padded_counts = (counts + multiple - 1) // multiple * multiple
    out = a.new_zeros(int(padded_counts.sum()), a.shape[1])
    source, target = 0, 0
    for count, size in zip(counts.tolist(), padded_counts.tolist(), strict=True):
        out[target : target + count] = a[source : source + count]
        source, target = source + count, target + size
    return out, torch.cumsum(padded_counts, 0).to(torch.int32)


def shape_rows(tokens: int, bandwidth: float) -> list[dict]:
    experts, hidden, inter = 256, 2048, 512
    groups = experts + 1
    topk = torch.stack([torch.randperm(experts, device="cuda")[:8] for _ in range(tokens)])
    flat = torch.cat([topk, torch.full((tokens, 1), experts, device="cuda")], 1).reshape(-1)
    counts = torch.bincount(flat, minlength=groups)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows = []
    for name, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        w = (torch.randn(groups, n, k, device="cuda") * 0.02).to(torch.bfloat16)
        a = torch.randn(flat.shape[0], k, device="cuda", dtype=torch.bfloat16)
        reference = torch._grouped_mm(a, w.transpose(1, 2), offs=offsets)
        floor_us = 1e6 * int((counts > 0).sum()) * n * k * 2 / bandwidth
        row = dict(tokens=tokens, gemm=name, rows=flat.shape[0], floor_us=floor_us)
        row["grouped_mm_us"] = graph_us(
            lambda a=a, w=w: torch._grouped_mm(a, w.transpose(1, 2), offs=offsets), calls=10
        )
        for multiple in (16, 64):
            a_pad, offsets_pad = padded(a, counts, multiple)
            row[f"grouped_mm_padded{multiple}_us"] = graph_us(
                lambda a=a_pad, w=w, o=offsets_pad: torch._grouped_mm(a, w.transpose(1, 2), offs=o), calls=10
            )
        for tiles in TILES:
            name_t = "triton_" + "x".join(map(str, tiles)) + "_us"
            tile_expert, tile_row = tile_list(counts, tiles[0])
            fn = functools.partial(triton_grouped_gemm, a, w, tile_expert, tile_row, offsets, tiles)
            try:
                error = (fn().float() - reference.float()).abs().max().item()
                row[name_t] = graph_us(fn, calls=10)
                row[name_t.replace("_us", "_max_diff")] = error
            except Exception as failure:  # a tile choice that does not fit (shared memory): recorded, skipped
                row[name_t] = f"failed: {type(failure).__name__}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024", help="comma list of tokens per step (1024 = batch 32 x block 32)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    summary["copy_bandwidth_tb_s"] = bandwidth / 1e12
    print(json.dumps(summary), flush=True)
    summary["rows"] = [row for tokens in args.tokens.split(",") for row in shape_rows(int(tokens), bandwidth)]
    print("\ntokens gemm     floor  grouped_mm  pad16  pad64  best Triton (us)")
    for r in summary["rows"]:
        timed = {k: v for k, v in r.items() if k.startswith("triton_") and k.endswith("_us") and isinstance(v, float)}
        best = min(timed, key=timed.get) if timed else None
        best_text = f"{timed[best]:.1f} {best}" if best else "-"
        print(
            f"{r['tokens']:>6} {r['gemm']:<8}{r['floor_us']:>6.1f}{r['grouped_mm_us']:>12.1f}"
            f"{r['grouped_mm_padded16_us']:>7.1f}{r['grouped_mm_padded64_us']:>7.1f}  {best_text}"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
