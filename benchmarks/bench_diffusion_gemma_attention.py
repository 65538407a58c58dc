"""DiffusionGemma's decoder attention at the 26B-A4B shapes, every backend: what `DECODER_ATTENTION`
(`hf_dllm/modeling_diffusion_gemma.py`, the decoder's backend and Triton tiles per head width and batch class) is
picked from (issue #67: the batch-1 step within 1.3x its floor; cuDNN SDPA with the additive mask took 74 us of
each sliding layer's step on an H200).

Shapes (one layer, a 256-token canvas's queries against the cache's keys plus its own, bidirectional):

- sliding: 16 query / 8 key-value heads of 256, a ring of 1,023 slots + 256 canvas keys;
- full: 16 query / 2 key-value heads of 512, `--full-cache` columns (default 1,024: a 512-token prompt and 512 new
  tokens) + 256 canvas keys;

at batch 1 / 8 / 32, with the cache partly valid (`--valid`: the fractions of its slots written, default 0.5, a
short prompt whose ring has empty slots, and 1.0); at batch > 1 each row left-padded by its own amount (row r: (37 r) mod
128 leading keys invalid). Per case, every backend, each producing what the o-projection reads (`(B, T, H * D)`):

- `sdpa_<kernel>_additive`: torch's SDPA with the decoder's additive mask (`decoder_key_mask`: 0 / -inf, rows
  16-aligned) under the cuDNN / memory-efficient kernel, and torch's own choice (`default`: what the model runs),
  then the transpose copy; `sdpa_<kernel>_unmasked`: the same without a mask (a bound: it attends to the empty
  slots too; its error is against an unmasked reference). Kernels that refuse the shape (heads of 512) are listed
  with their error;
- `gemm`: `gemm_attention` (two bfloat16 tensor-core products, the float32 masked softmax kernel), then the copy;
- `triton`: `triton_attention.block_attention` (writes `(B, T, H, D)`: no copy) over the tile configs
  `--block-m` (default 32 / 64 / 128 rows for heads of 256, 16 / 32 / 64 for 512) x `--block-n` x `--warps` x
  `--stages` (splits planned from the SM count, `skip_masked` on; configs that do not fit are listed so), then
  for the best two configs of each head width the key splits `--splits` (power-of-two or even chunks of tiles)
  with `skip_masked` off and on; it skips the cache's unwritten slots (`key_gap`), as the model's decoder pass
  does, and merges its splits in the kernel (`fold_merge`, the default).

Timing: `--sets` input sets (default enough to spill the L2, at most 16) rotated through, `--calls` calls (default
max(4, 32 / batch)) captured in one CUDA graph (no launch gaps, as the decoder's captured step), replayed
`--replays` times; microseconds per call. Error: max |out - reference| over the first set, the reference float32 math on the same bfloat16 inputs.

Proposed table: per (head width, batch), among what the model can run (SDPA as it calls it, `gemm`, a Triton
config) within 2x the error of the best SDPA/GEMM baseline, the one with the least time summed over the validity
cases (`proposed` in the JSON line; printed as `DECODER_ATTENTION` entries to paste).

`--cpu`: tiny float32 shapes on the CPU (the Triton kernel through its interpreter), batch 2 (a left-padded row),
half the cache valid, two Triton configs per kind, a few seconds.

    python benchmarks/bench_diffusion_gemma_attention.py --kinds sliding   # one H200, a few minutes (compiles)
    python benchmarks/bench_diffusion_gemma_attention.py --kinds full
    python benchmarks/bench_diffusion_gemma_attention.py --batch-sizes 1 --block-m 64 --block-n 32
    python benchmarks/bench_diffusion_gemma_attention.py --cpu

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

if "--cpu" in sys.argv:  # before Triton is imported: the kernel runs in its interpreter on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dllm.modeling_diffusion_gemma import decoder_key_mask, gemm_attention, unwritten_slots  # noqa: E402
from hf_dllm.triton_attention import AttentionTiles, block_attention  # noqa: E402

# (query heads, key/value heads, head_dim, cached slots) of the 26B-A4B's layers (the full layers' slots: --full-cache).
SHAPES = {"sliding": (16, 8, 256, 1023), "full": (16, 2, 512, None)}
CANVAS = 256
TINY_SHAPES = {"sliding": (4, 2, 16, 24), "full": (4, 1, 32, None)}
TINY_CANVAS = 8
L2_BYTES = 50 << 20  # an H100/H200's L2 (50 / 60 MiB): inputs rotated over more than it holds
SDPA_KERNELS = ("cudnn", "efficient", "default")


class _MaskCache:
    """The one method of a cache `decoder_key_mask` calls: the bool key mask `(B, 1, 1, S)` given."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def decoder_mask(self, layer, canvas, padded):
        return self.mask


def key_validity(batch: int, slots: int, canvas: int, valid_fraction: float, device) -> torch.Tensor:
    """`(B, slots + canvas)` bool: the first `valid_fraction` of the cache's slots written (the rest empty), row r's
    first (37 r) mod 128 of them padding (scaled down for tiny caches), the canvas' keys all valid."""
    valid = torch.zeros(batch, slots + canvas, dtype=torch.bool, device=device)
    written = max(1, round(slots * valid_fraction))
    for row in range(batch):
        pad = (37 * row) % min(128, max(1, written // 2))
        valid[row, pad:written] = True
    valid[:, slots:] = True
    return valid


def reference(q, k, v, valid) -> torch.Tensor:
    """float32 math attention `(B, T, H, D)` of bfloat16 inputs, grouped-query heads, scale 1 (DiffusionGemma's)."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ keys.transpose(-1, -2)
    if valid is not None:
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2)


def sdpa_context(kernel: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel == "default":
        return None
    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[kernel])


def backends(q, valid, tile_configs: list[AttentionTiles], on_cuda: bool, key_gap=None) -> dict:
    """name -> (config dict, function(q, k, v) -> `(B, T, H * D)`) of every backend for this case; `key_gap` the
    Triton kernel's (`unwritten_slots`: the model passes it)."""
    batch, heads, length, dim = q.shape
    additive = decoder_key_mask(_MaskCache(valid[:, None, None, :]), 0, q.new_empty(batch, length, 1), True, True)
    bool_mask = valid[:, None, None, :]
    enable_gqa = True
    entries = {}

    def flat(output):  # (B, H, T, D) -> (B, T, H * D), the o-projection's input (the model's reshape)
        return output.transpose(1, 2).reshape(batch, length, heads * dim)

    for kernel in SDPA_KERNELS if on_cuda else ("default",):
        for masked in (True, False):

            def run(q, k, v, kernel=kernel, masked=masked):
                context = sdpa_context(kernel)
                mask = additive if masked else None
                if context is None:
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, scale=1.0, enable_gqa=enable_gqa
                    )
                else:
                    with context:
                        out = torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, attn_mask=mask, scale=1.0, enable_gqa=enable_gqa
                        )
                return flat(out)

            entries[f"sdpa_{kernel}_{'additive' if masked else 'unmasked'}"] = ({}, run)
    entries["gemm"] = ({}, lambda q, k, v: flat(gemm_attention(q, k, v, bool_mask)))
    for tiles in tile_configs:
        config = {name: getattr(tiles, name) for name in ("block_m", "block_n", "num_warps", "num_stages", "splits",
                                                           "skip_masked", "even_splits")}  # fmt: skip
        entries[f"triton {config_label(tiles)}"] = (
            config,
            lambda q, k, v, tiles=tiles: block_attention(q, k, v, valid, scale=1.0, tiles=tiles, key_gap=key_gap).view(
                batch, length, heads * dim
            ),
        )
    return entries


def config_label(tiles: AttentionTiles) -> str:
    splits = "plan" if tiles.splits is None else tiles.splits
    skip = "skip" if tiles.skip_masked else "noskip"
    even = " even" if tiles.even_splits else ""
    return f"m{tiles.block_m} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages} x{splits}{even} {skip}"


def time_us(function, sets: list, calls: int, replays: int, device) -> tuple[float, str]:
    """(microseconds per call, how): `calls` calls rotating over `sets` captured in a CUDA graph and replayed (eager
    calls where the capture fails, or on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for call in range(calls):
                    function(*sets[call % len(sets)])
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            return 1000 * start.elapsed_time(end) / (replays * calls), "graph"
        except Exception:  # noqa: BLE001  (some kernels do not capture: timed eagerly, said so)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for call in range(replays * calls):
                function(*sets[call % len(sets)])
            end.record()
            end.synchronize()
            return 1000 * start.elapsed_time(end) / (replays * calls), "eager"
    began = time.perf_counter()
    for call in range(calls):
        function(*sets[call % len(sets)])
    return 1e6 * (time.perf_counter() - began) / calls, "eager"


def run_case(kind, batch, valid_fraction, shape, canvas, full_cache, tile_configs, args, device, dtype) -> list:
    heads, kv_heads, dim, slots = shape
    slots = full_cache if slots is None else slots
    valid = key_validity(batch, slots, canvas, valid_fraction, device)
    set_bytes = batch * (heads * canvas + 2 * kv_heads * (slots + canvas)) * dim * torch.finfo(dtype).bits // 8
    n_sets = args.sets or max(2, min(16, math.ceil(3 * L2_BYTES / set_bytes)))
    generator = torch.Generator(device="cpu").manual_seed(batch * 1000 + dim)
    sets = []
    for _ in range(n_sets if device.type == "cuda" else 1):
        # Unit-RMS keys and values (the k/v norms'), queries scaled by dim^-0.5 so the scores (DiffusionGemma's
        # scale is 1) have unit spread: a softmax neither flat nor one-hot.
        q = (torch.randn(batch, heads, canvas, dim, generator=generator) * dim**-0.5).to(device, dtype)
        k = torch.randn(batch, kv_heads, slots + canvas, dim, generator=generator).to(device, dtype)
        v = torch.randn(batch, kv_heads, slots + canvas, dim, generator=generator).to(device, dtype)
        sets.append((q, k, v))
    q, k, v = sets[0]
    want = {True: reference(q, k, v, valid), False: reference(q, k, v, None)}
    rows = []
    key_gap = unwritten_slots(valid[:, :slots])  # what the model's decoder pass skips (keys `slots` on: the canvas')
    for name, (config, function) in backends(q, valid, tile_configs, device.type == "cuda", key_gap).items():
        row = dict(kind=kind, batch=batch, valid=valid_fraction, backend=name.split(" ")[0], config=config, name=name)
        try:
            out = function(q, k, v)
            masked = not name.endswith("_unmasked")
            row["max_error"] = (out.float().view_as(want[masked]) - want[masked]).abs().max().item()
            calls = args.calls or (1 if device.type == "cpu" else max(4, 32 // batch))
            row["us"], row["timing"] = time_us(function, sets, calls, args.replays, device)
        except Exception as error:  # noqa: BLE001  (a kernel that refuses the shape or does not fit: reported)
            row["error"] = f"{type(error).__name__}: {error}"[:200]
        rows.append(row)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the graphs' pools, before the next case's inputs
    return rows


def tile_grid(args, head_dim: int) -> list[AttentionTiles]:
    """The tile configs swept (skip_masked on, splits planned); the row tiles shrink as the heads widen (the float32
    accumulator is block_m x head_dim)."""
    block_m = args.block_m or ([32, 64, 128] if head_dim <= 256 else [16, 32, 64])
    return [
        AttentionTiles(block_m=m, block_n=n, num_warps=w, num_stages=s, skip_masked=True)
        for m, n, w, s in itertools.product(block_m, args.block_n, args.warps, args.stages)
    ]


def baselines_error(rows: list) -> float:
    """The least error of the masked SDPA / GEMM rows (the bar a Triton config's error is held to)."""
    errors = [r["max_error"] for r in rows if "max_error" in r and not r["name"].endswith("_unmasked")
              and r["backend"] != "triton"]  # fmt: skip
    return min(errors) if errors else float("inf")


# The rows the model can run (`DiffusionGemmaAttention.backends`): SDPA as the model calls it (torch's kernel choice,
# the additive mask), the GEMM attention, the Triton kernel with its tiles; the forced SDPA kernels are for reading.
RUNNABLE = {"sdpa_default_additive": "sdpa", "gemm": "gemm", "triton": "triton"}


def table_entry(backend: str, config: dict, default_tiles: dict) -> str:
    """A `DECODER_ATTENTION` value as Python source (non-Triton backends keep the table's tiles)."""
    tiles = config or default_tiles
    fields = ", ".join(f"{k}={v!r}" for k, v in tiles.items() if v != AttentionTiles.__dataclass_fields__[k].default
                       or k == "block_m")  # fmt: skip
    return f'("{backend}", AttentionTiles({fields}))'


def propose(rows: list, head_dims: dict) -> dict:
    """Per (head width, batch): the runnable backend/config of least summed time over the validity cases, among
    those timed in every case with an error within 2x the best baseline's (plus float32 round-off)."""
    from hf_dllm.modeling_diffusion_gemma import decoder_tiles

    proposed = {}
    for kind, batch in sorted({(r["kind"], r["batch"]) for r in rows}):
        case_rows = [r for r in rows if r["kind"] == kind and r["batch"] == batch]
        validities = sorted({r["valid"] for r in case_rows})
        bars = {f: 2 * baselines_error([r for r in case_rows if r["valid"] == f]) + 1e-6 for f in validities}
        totals = {}
        for name in {r["name"] for r in case_rows if r["backend"] in RUNNABLE or r["name"] in RUNNABLE}:
            mine = [r for r in case_rows if r["name"] == name and "us" in r and r["max_error"] <= bars[r["valid"]]]
            if len(mine) == len(validities):
                totals[name] = (sum(r["us"] for r in mine), mine[0])
        if totals:
            name, (total, row) = min(totals.items(), key=lambda item: item[1][0])
            backend = RUNNABLE.get(row["name"], RUNNABLE.get(row["backend"]))
            tiles = decoder_tiles(head_dims[kind], batch).__dict__
            key = f"({head_dims[kind]}, {batch})"
            proposed[key] = dict(name=name, entry=table_entry(backend, row["config"], tiles),
                                 us_summed=round(total, 2), cases=len(validities))  # fmt: skip
    return proposed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny float32 shapes on the CPU (Triton's interpreter)")
    parser.add_argument("--batch-sizes", default=None, help="comma list (GPU 1,8,32; CPU 2)")
    parser.add_argument("--kinds", default="sliding,full", help="layer kinds: sliding,full")
    parser.add_argument("--valid", default="0.5,1.0", help="fractions of the cache's slots written")
    parser.add_argument("--full-cache", type=int, default=None, help="full layers' cache columns (GPU 1024, CPU 24)")
    parser.add_argument(
        "--block-m", default=None, help="row tiles (default: 32,64,128 for heads of 256; 16,32,64 wider)"
    )
    parser.add_argument("--block-n", default="32,64")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--splits", default="1,2,4,8", help="key splits tried on each head width's best 2 configs")
    parser.add_argument("--sets", type=int, default=None, help="input sets rotated (default: 3x the L2, 2..16)")
    parser.add_argument("--calls", type=int, default=None, help="calls per graph (GPU max(4, 32 / batch), CPU 1)")
    parser.add_argument("--replays", type=int, default=None, help="graph replays timed (GPU 5, CPU 1)")
    args = parser.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    shapes, canvas = (TINY_SHAPES, TINY_CANVAS) if cpu else (SHAPES, CANVAS)
    full_cache = args.full_cache or (24 if cpu else 1024)
    batches = [int(b) for b in (args.batch_sizes or ("2" if cpu else "1,8,32")).split(",")]
    args.replays = args.replays or (1 if cpu else 5)
    if cpu:  # one case per kind, two configs (the interpreter runs a program in milliseconds)
        args.block_m, args.block_n, args.warps, args.stages, args.splits = [16], [8], [4], [2], []
        args.valid = "0.5"
    else:
        args.block_m, args.block_n, args.warps, args.stages, args.splits = (
            None if getattr(args, name) is None else [int(x) for x in getattr(args, name).split(",")]
            for name in ("block_m", "block_n", "warps", "stages", "splits")
        )
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(SHAPES):
        parser.error(f"--kinds: each of {sorted(SHAPES)}, got {args.kinds!r}")
    fractions = [float(f) for f in args.valid.split(",")]
    began = time.time()
    rows = []
    for kind in kinds:
        grid = tile_grid(args, shapes[kind][2])
        kind_rows = []
        for batch, fraction in itertools.product(batches, fractions):
            kind_rows += run_case(kind, batch, fraction, shapes[kind], canvas, full_cache, grid, args, device, dtype)
            print(f"# {kind} batch {batch} valid {fraction}: {time.time() - began:.0f} s", file=sys.stderr)
        # The key splits (planned, or each of --splits in power-of-two or even chunks of tiles), skip_masked off and
        # on, on the two best tile configs.
        timed = {}
        for r in kind_rows:
            if r["backend"] == "triton" and "us" in r:
                timed[r["name"]] = timed.get(r["name"], 0.0) + r["us"]
        best = sorted(timed, key=timed.get)[:2]
        splits_grid = []
        for name in best:
            base = next(r["config"] for r in kind_rows if r["name"] == name)
            for splits, skip, even in itertools.product([None, *args.splits], (False, True), (False, True)):
                if even and splits is None:
                    continue
                tiles = AttentionTiles(**dict(base, splits=splits, skip_masked=skip, even_splits=even))
                if tiles not in grid and tiles not in splits_grid:
                    splits_grid.append(tiles)
        for batch, fraction in itertools.product(batches, fractions):
            if splits_grid:
                extra = run_case(kind, batch, fraction, shapes[kind], canvas, full_cache, splits_grid, args, device,
                                 dtype)  # fmt: skip
                kind_rows += [r for r in extra if r["backend"] == "triton"]
        rows += kind_rows
    proposed = propose(rows, {kind: shapes[kind][2] for kind in kinds})

    print(f"{'kind':8} {'batch':>5} {'valid':>5}  {'backend / config':52} {'us':>9} {'max err':>9}")
    for r in sorted(rows, key=lambda r: (r["kind"], r["batch"], r["valid"], r.get("us", float("inf")))):
        value = f"{r['us']:9.1f} {r['max_error']:9.2e}" if "us" in r else f"  {r.get('error', '')[:60]}"
        print(f"{r['kind']:8} {r['batch']:5d} {r['valid']:5.2f}  {r['name']:52} {value}")
    print("\nProposed DECODER_ATTENTION entries (least time summed over the validity cases, error within 2x):")
    for key, choice in proposed.items():
        print(
            f"    {key}: {choice['entry']},  # {choice['name']}: {choice['us_summed']} us over {choice['cases']} cases"
        )
    summary = dict(
        benchmark="bench_diffusion_gemma_attention",
        device=torch.cuda.get_device_name() if not cpu else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        canvas=canvas,
        full_cache=full_cache,
        seconds=round(time.time() - began, 1),
        proposed=proposed,
        rows=[{k: (round(v, 3) if isinstance(v, float) and k == "us" else v) for k, v in r.items()} for r in rows],
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
