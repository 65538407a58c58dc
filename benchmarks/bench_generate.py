"""Speed of `generate()`: ms per model forward, tokens/s, NFE and peak memory per cache mode and batch size.

GPU setting (issue "GPU speed"): an LLaDA-8B-shaped model (d_model 4096, 32 layers, 32 heads, MLP 12288, vocab
126464) with random bf16 weights built on the GPU, prompt 512, 256 new tokens, block 32, 256 steps (one token per
step, so every setting makes the same number of forwards and only the cost of a step is compared),
`eos_early_stop=False`. Without a GPU, a small float32 model on the CPU.

Also measured: the median latency of one dual-cache block step (CUDA events around single steps after warm-up),
and, with `--check-eager`, that the CUDA-graph fast path gives the same tokens as `disable_compile=True`.

Prints a table and ends with one JSON line.

    python benchmarks/bench_generate.py                      # GPU: the issue's settings
    python benchmarks/bench_generate.py --cpu                # small CPU setting
    python benchmarks/bench_generate.py --cpu --reference .ref/fast_dllm_llada   # CPU vs Fast-dLLM, same run

`--reference PATH` (CPU only) instead times the tiny trained LLaDA against Fast-dLLM's LLaDA reference functions
(PATH: their `llada/` folder, copied by `benchmarks/fetch_fast_dllm_llada.sh`), interleaved in one process, at
every `--reference-threads` count, checking that every prompt's tokens are identical
(`benchmarks/llada_reference.py` says how).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # llada_reference.py

import hf_dllm  # noqa: E402
from hf_dllm.generation_utils import BlockDiffusionRun  # noqa: E402
from hf_dllm.graphs import StepGraphs  # noqa: E402

LLADA_8B = dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288, vocab_size=126464)
SMALL = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden_size=768, vocab_size=1024)


def build_model(shape: dict, dtype: torch.dtype, device: torch.device, attn: str) -> hf_dllm.LLaDAModelLM:
    config = hf_dllm.LLaDAConfig(
        **shape,
        embedding_size=shape["vocab_size"],
        mask_token_id=shape["vocab_size"] - 128,
        eos_token_id=shape["vocab_size"] - 383,
        pad_token_id=shape["vocab_size"] - 383,
        max_sequence_length=4096,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_dllm.LLaDAModelLM._from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, prompts, kwargs, device, repeats):
    """Returns (median seconds, output of the last call, peak bytes of the last call)."""
    model.generate(prompts, **kwargs)  # warm-up: Triton compilation, graph capture
    times, peak = [], 0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        out = model.generate(prompts, **kwargs)
        sync(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
    return statistics.median(times), out, peak


@torch.no_grad()
def dual_step_ms(model, prompts, kwargs, device, repeats: int = 30) -> float:
    """Median time of one dual-cache block step (a replay on CUDA), after the block's full forward."""
    config = model.resolve_generation_config(**dict(kwargs, use_cache=True, dual_cache=True))
    run = BlockDiffusionRun(model, config, prompts, None, None)
    try:
        return _time_block_steps(run, config, device, repeats)
    finally:
        StepGraphs.release_to(model)


def _time_block_steps(run, config, device, repeats: int) -> float:
    block_start, block_end = run.prompt_len, run.prompt_len + config.block_length
    run.unmasking.start_block(block_end - block_start, config.block_length)
    run.run_step(block_start, block_end, 0)
    for _ in range(3):  # warm-up and capture
        run.run_step(block_start, block_end, 1)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run.run_step(block_start, block_end, 1)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run.run_step(block_start, block_end, 1)
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def reference_main(args) -> int:
    """`--reference PATH`: hf_dllm vs Fast-dLLM's LLaDA functions on the CPU (table, then one JSON line)."""
    import llada_reference

    if not args.cpu:
        raise ValueError("--reference compares on the CPU: pass --cpu with it")
    if not args.reference.is_dir():
        raise ValueError(f"--reference {args.reference} is not a folder (benchmarks/fetch_fast_dllm_llada.sh)")
    threads = tuple(int(t) for t in args.reference_threads.split(","))
    if not threads or min(threads) < 1:
        raise ValueError(f"--reference-threads must be positive integers, got {args.reference_threads!r}")
    if args.reference_prompts < 1 or args.reference_repeats < 1:
        raise ValueError("--reference-prompts and --reference-repeats must be at least 1")
    summary = llada_reference.compare(
        args.reference, threads=threads, n_prompts=args.reference_prompts, repeats=args.reference_repeats
    )
    llada_reference.print_table(summary)
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="small CPU setting (default when no GPU)")
    parser.add_argument("--batch-sizes", default=None, help="comma list (default GPU: 1,8,32; CPU: 1,4)")
    parser.add_argument("--modes", default="dual,prefix,none", help="cache modes: dual,prefix,none")
    parser.add_argument("--big-batch-modes", default="dual", help="modes run at batch > 1 (others take minutes)")
    parser.add_argument("--attn", default="sdpa", help="comma list of attn_implementation values")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--block-length", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--check-eager", action="store_true", help="also compare tokens with disable_compile=True")
    parser.add_argument("--check-eager-max-batch", type=int, default=8)
    parser.add_argument("--reference", type=Path, default=None, help="Fast-dLLM's llada/ folder (CPU comparison)")
    parser.add_argument("--reference-threads", default="1,2", help="comma list of torch thread counts")
    parser.add_argument("--reference-prompts", type=int, default=6, help="held-out tiny-task prompts per setting")
    parser.add_argument("--reference-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.reference is not None:
        return reference_main(args)

    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    shape, dtype = (LLADA_8B, torch.bfloat16) if gpu else (SMALL, torch.float32)
    prompt_len = args.prompt_len or (512 if gpu else 64)
    new_tokens = args.new_tokens or (256 if gpu else 64)
    block_length = args.block_length or (32 if gpu else 16)
    batch_sizes = [int(b) for b in (args.batch_sizes or ("1,8,32" if gpu else "1,4")).split(",")]
    modes = args.modes.split(",")
    big_modes = set(args.big_batch_modes.split(","))
    device_name = torch.cuda.get_device_name(device) if gpu else "CPU"

    rows, summary = [], {"device": device_name, "torch": torch.__version__, "dtype": str(dtype)}
    summary.update(prompt_len=prompt_len, new_tokens=new_tokens, block_length=block_length, steps=new_tokens)
    for attn in args.attn.split(","):
        model = build_model(shape, dtype, device, attn)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for batch in batch_sizes:
            torch.manual_seed(batch)
            prompts = torch.randint(0, shape["vocab_size"] - 512, (batch, prompt_len), device=device)
            for mode in modes:
                if batch > 1 and mode not in big_modes:
                    continue
                kwargs = dict(
                    max_new_tokens=new_tokens,
                    block_length=block_length,
                    steps=new_tokens,
                    use_cache=mode != "none",
                    dual_cache=mode == "dual",
                    eos_early_stop=False,
                    return_dict_in_generate=True,
                )
                try:
                    seconds, out, peak = timed_generate(model, prompts, kwargs, device, args.repeats)
                except torch.OutOfMemoryError as error:
                    rows.append(dict(attn=attn, batch=batch, mode=mode, error=f"OOM: {error}"[:120]))
                    torch.cuda.empty_cache()
                    continue
                row = dict(
                    attn=attn,
                    batch=batch,
                    mode=mode,
                    nfe=out.nfe,
                    ms_per_forward=1000 * seconds / out.nfe,
                    tokens_per_s=batch * new_tokens / seconds,
                    seconds=seconds,
                    peak_gb=peak / 1e9,
                )
                if mode == "dual":
                    row["dual_step_ms"] = dual_step_ms(model, prompts, kwargs, device)
                    if gpu and batch == 1:
                        # Weight bytes read once per step over the step time (the bandwidth floor's view).
                        row["weight_read_tb_s"] = weight_bytes / (row["dual_step_ms"] / 1000) / 1e12
                if args.check_eager and batch <= args.check_eager_max_batch:
                    eager = model.generate(prompts, **dict(kwargs, disable_compile=True))
                    row["tokens_equal_eager"] = bool(torch.equal(eager.sequences, out.sequences))
                rows.append(row)
                print(json.dumps(row), flush=True)
        del model
        if gpu:
            torch.cuda.empty_cache()

    print()
    header = f"{'attn':<13}{'batch':>6}{'mode':>8}{'NFE':>6}{'ms/fwd':>9}{'tok/s':>9}{'step ms':>9}{'peak GB':>9}{'=eager':>8}"
    print(f"{device_name}, {dtype}, prompt {prompt_len}, {new_tokens} new tokens, block {block_length}")
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['attn']:<13}{r['batch']:>6}{r['mode']:>8}  {r['error']}")
            continue
        step = f"{r['dual_step_ms']:.2f}" if "dual_step_ms" in r else "-"
        same = str(r.get("tokens_equal_eager", "-"))
        print(
            f"{r['attn']:<13}{r['batch']:>6}{r['mode']:>8}{r['nfe']:>6}{r['ms_per_forward']:>9.2f}"
            f"{r['tokens_per_s']:>9.1f}{step:>9}{r['peak_gb']:>9.2f}{same:>8}"
        )
    summary["rows"] = rows
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
