"""Speed of `generate()`: ms per model forward, tokens/s, NFE and peak memory per cache mode and batch size.

GPU setting (issue "GPU speed"): an LLaDA-8B-shaped model (d_model 4096, 32 layers, 32 heads, MLP 12288, vocab
126464) with random bf16 weights built on the GPU, prompt 512, 256 new tokens, block 32, 256 steps (one token per
step, so every setting makes the same number of forwards and only the cost of a step is compared),
`eos_early_stop=False`. Without a GPU, a small float32 model on the CPU.

Also measured: the median latency of one dual-cache block step (CUDA events around single steps after warm-up),
and, with `--check-eager`, that the CUDA-graph fast path gives the same tokens as `disable_compile=True`.

`--quantization none,fp8` (issue #13) runs the same settings with the bf16 model and with its FP8 copy, quantized
on the GPU through transformers' API (`from_pretrained(..., quantization_config=FineGrainedFP8Config())`, 128x128
weight blocks; `fp8-tensor`: `FineGrainedFP8Config(weight_block_size=None)`, one scale per matrix; the LM head stays
bf16, as transformers leaves output embeddings, unless the scheme ends in `+head`, e.g. `fp8+head`:
`modules_to_not_convert=[]`) and prints per quantization the
weights one step reads, their read floor at the device's copy bandwidth (measured: a 4 GiB device-to-device copy,
each byte read and written; `--bandwidth` TB/s instead if given) and the bandwidth the batch-1 dual step achieves;
then the FP8 logits' error against bf16 over one full-sequence forward (per position: top-1 agreement).
`--tokens-per-forward 1,4` also runs 4 tokens per forward (steps = new tokens / 4). `--kv-cache-dtypes auto,fp8`
runs each cached setting with K/V in the model's dtype and in FP8 (`kv_cache_dtype="fp8"`: float8 e4m3 with a scale
per position and head), and reports the FP8 rows' generated tokens equal to the model-dtype rows' (`same_tokens`).

Prints a table and ends with one JSON line.

    python benchmarks/bench_generate.py                      # GPU: the issue's settings
    python benchmarks/bench_generate.py --cpu                # small CPU setting
    python benchmarks/bench_generate.py --modes dual --quantization none,fp8 --tokens-per-forward 1,4
    python benchmarks/bench_generate.py --cpu --reference .ref/fast_dllm_llada   # CPU vs Fast-dLLM, same run

`--reference PATH` (CPU only) instead times the tiny trained LLaDA against Fast-dLLM's LLaDA reference functions
(PATH: their `llada/` folder, copied by `benchmarks/fetch_fast_dllm.sh llada`), interleaved in one process, at
every `--reference-threads` count, checking that every prompt's tokens are identical
(`benchmarks/llada_reference.py` says how).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # llada_reference.py

import hf_dllm  # noqa: E402
from hf_dllm.fp8 import FP8_QUANTIZATIONS  # noqa: E402
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


def quantize_fp8(model, device: torch.device, attn: str | None, scheme: str = "fp8"):
    """An FP8 copy of `model` (LLaDA, LLaDA2.x) made by transformers' quantizer with the config `--quantization
    SCHEME` loads with (`fp8_config_for`: "fp8" 128 x 128 block scales, "fp8-tensor" one per matrix; with
    the suffix `+head` the output head too), the way `from_pretrained` quantizes a checkpoint."""
    from hf_dllm.fp8 import fp8_config_for

    quantized = type(model).from_pretrained(
        None,
        config=model.config,
        state_dict=model.state_dict(),
        quantization_config=fp8_config_for(model.config, scheme),
        dtype=torch.bfloat16,
        device_map=str(device),
        attn_implementation=attn,
    )
    return quantized.eval()


# `--quantization` values: the model's dtype, every FP8 scheme, and each with its output head in FP8 too.
QUANTIZATIONS = ("none", *FP8_QUANTIZATIONS)


def parse_quantizations(parser: argparse.ArgumentParser, value: str) -> list[str]:
    """`--quantization`'s comma list, each a `QUANTIZATIONS` name (else the parser's error, before any model is
    built)."""
    quantizations = value.split(",")
    if any(q not in QUANTIZATIONS for q in quantizations):
        parser.error(f"--quantization takes a comma list of {', '.join(QUANTIZATIONS)}, got {value!r}")
    return quantizations


@torch.no_grad()
def load_dequantized_(model, quantized) -> None:
    """Overwrite `model`'s weights, in place, with the FP8 weights of `quantized` dequantized to bf16."""
    from hf_dllm.fp8 import dequantize, fp8_block_size, fp8_scales, is_fp8_linear

    for name, module in quantized.named_modules():
        if is_fp8_linear(module):
            target = model.get_submodule(name).weight
            target.copy_(dequantize(module.weight, fp8_scales(module), fp8_block_size(module), target.dtype))


def step_weight_bytes(model) -> int:
    """Bytes of the weights a block step reads: every parameter but the input embedding (only its rows are read)."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)


@torch.no_grad()
def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


def logit_agreement(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """FP8 logits `(1, L, V)` against bf16: error relative to the reference's scale and top-1 agreement."""
    reference, logits = reference.float()[0], logits.float()[0]
    error = (logits - reference).abs()
    scale = reference.abs().mean()
    agree = (reference.argmax(-1) == logits.argmax(-1)).float()
    return dict(
        positions=int(agree.numel()),
        max_abs_error=error.max().item(),
        mean_abs_error=error.mean().item(),
        mean_abs_reference=scale.item(),
        relative_rms_error=((logits - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item(),
        top1_agreement=agree.mean().item(),
        top1_agreement_first_last_block=[agree[:32].mean().item(), agree[-32:].mean().item()],
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, prompts, kwargs, device, repeats):
    """Returns (median seconds, output of the last call, peak bytes of the last call, every call's seconds)."""
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
    return statistics.median(times), out, peak, times


@contextlib.contextmanager
def switched(owner, name: str, value):
    """`owner.name` (a class's or module's switch) set to `value` inside, restored after. A step timed inside must
    be captured inside (`forget_graphs`): a graph keeps the kernels it was captured with."""
    default = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, default)


def forget_graphs(model) -> None:
    """Free the model's CUDA-graph runner (its K/V cache and graph memory): before another implementation runs, or
    before a step is timed after a switch (the runner keeps each shape's graph, captured with the kernels of then)."""
    runner = getattr(model, "_hf_dllm_step_graphs", None)
    if runner is not None:
        runner.release()
    model._hf_dllm_step_graphs = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def copy_bandwidth(device: torch.device, gib: float = 4.0, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once), the median of `repeats` timed
    copies after one untimed: the rate a weight-read floor divides by."""
    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    bytes_moved = 2 * source.numel()
    del source, target
    torch.cuda.empty_cache()  # the allocator would keep the 8 GiB reserved beside the model
    return bytes_moved / statistics.median(times)


def measure(model, attn: str, quant: str, settings: dict) -> list[dict]:
    """The settings' rows (batch x cache mode x tokens per forward) for one model."""
    args, device, gpu, new_tokens = settings["args"], settings["device"], settings["gpu"], settings["new_tokens"]
    weight_bytes = step_weight_bytes(model)
    model_dtype_tokens = {}  # (batch, mode, tokens per forward) -> generated tokens with K/V in the model's dtype
    floor = dict(gb=weight_bytes / 1e9)
    if args.bandwidth is not None:  # measured on a GPU or given
        floor["floor_ms"] = weight_bytes / (args.bandwidth * 1e12) * 1000
    WEIGHT_READ[quant] = floor
    rows = []
    for batch in settings["batch_sizes"]:
        torch.manual_seed(batch)
        prompts = torch.randint(
            0, settings["shape"]["vocab_size"] - 512, (batch, settings["prompt_len"]), device=device
        )
        for mode in settings["modes"]:
            if batch > 1 and mode not in settings["big_modes"]:
                continue
            for per_forward, kv in ((p, kv) for p in settings["tokens_per_forward"] for kv in settings["kv_dtypes"]):
                if kv != "auto" and mode == "none":
                    continue
                kwargs = dict(
                    max_new_tokens=new_tokens,
                    block_length=settings["block_length"],
                    steps=new_tokens // per_forward,
                    use_cache=mode != "none",
                    dual_cache=mode == "dual",
                    kv_cache_dtype=None if kv == "auto" else kv,
                    eos_early_stop=False,
                    return_dict_in_generate=True,
                )
                base = dict(attn=attn, quant=quant, batch=batch, mode=mode, tokens_per_forward=per_forward, kv=kv)
                try:
                    seconds, out, peak, each = timed_generate(model, prompts, kwargs, device, args.repeats)
                except torch.OutOfMemoryError as error:
                    rows.append(dict(base, error=f"OOM: {error}"[:120]))
                    torch.cuda.empty_cache()
                    continue
                row = dict(
                    base,
                    nfe=out.nfe,
                    ms_per_forward=1000 * seconds / out.nfe,
                    tokens_per_s=batch * new_tokens / seconds,
                    seconds=seconds,
                    seconds_each=[round(t, 4) for t in each],
                    peak_gb=peak / 1e9,
                )
                generated = out.sequences[:, settings["prompt_len"] :]
                if kv == "auto":
                    model_dtype_tokens[(batch, mode, per_forward)] = generated
                elif (batch, mode, per_forward) in model_dtype_tokens:
                    row["same_tokens"] = (generated == model_dtype_tokens[(batch, mode, per_forward)]).float().mean()
                    row["same_tokens"] = round(row["same_tokens"].item(), 4)
                if mode == "dual" and per_forward == settings["tokens_per_forward"][0]:
                    row["dual_step_ms"] = dual_step_ms(model, prompts, kwargs, device, args.step_repeats)
                    if gpu and batch == 1:
                        # Weight bytes read once per step over the step time (the bandwidth floor's view).
                        row["weight_read_tb_s"] = weight_bytes / (row["dual_step_ms"] / 1000) / 1e12
                        floor["achieved_tb_s"] = row["weight_read_tb_s"]
                if args.check_eager and batch <= args.check_eager_max_batch:
                    eager = model.generate(prompts, **dict(kwargs, disable_compile=True))
                    row["tokens_equal_eager"] = bool(torch.equal(eager.sequences, out.sequences))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


WEIGHT_READ: dict[str, dict] = {}


def reference_main(args) -> int:
    """`--reference PATH`: hf_dllm vs Fast-dLLM's LLaDA functions on the CPU (table, then one JSON line)."""
    import llada_reference

    if not args.cpu:
        raise ValueError("--reference compares on the CPU: pass --cpu with it")
    if not args.reference.is_dir():
        raise ValueError(f"--reference {args.reference} is not a folder (benchmarks/fetch_fast_dllm.sh llada)")
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
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 2; --cpu: 1)")
    parser.add_argument("--check-eager", action="store_true", help="also compare tokens with disable_compile=True")
    parser.add_argument("--check-eager-max-batch", type=int, default=8)
    parser.add_argument(
        "--quantization",
        default="none",
        help="comma list of none (the dtype's weights), fp8 (128 x 128 block scales) and fp8-tensor (one scale per "
        "matrix; both GPU only), each FP8 one optionally with the suffix +head (the output head in FP8 too)",
    )
    parser.add_argument("--tokens-per-forward", default="1", help="comma list; steps = new tokens / this")
    parser.add_argument(
        "--kv-cache-dtypes", default="auto", help="comma list of auto (the model's dtype) and fp8 (cached modes)"
    )
    parser.add_argument(
        "--bandwidth", type=float, default=None, help="TB/s for the weight-read floor (default: the measured copy's)"
    )
    parser.add_argument("--reference", type=Path, default=None, help="Fast-dLLM's llada/ folder (CPU comparison)")
    parser.add_argument("--reference-threads", default="1,2", help="comma list of torch thread counts")
    parser.add_argument("--reference-prompts", type=int, default=6, help="held-out tiny-task prompts per setting")
    parser.add_argument("--reference-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.reference is not None:
        return reference_main(args)

    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    # --cpu checks the script (the test suite runs it): one timed call per row and fewer timed block steps
    args.repeats = args.repeats or (1 if args.cpu else 2)
    args.step_repeats = 5 if args.cpu else 30
    shape, dtype = (LLADA_8B, torch.bfloat16) if gpu else (SMALL, torch.float32)
    prompt_len = args.prompt_len or (512 if gpu else 64)
    new_tokens = args.new_tokens or (256 if gpu else 64)
    block_length = args.block_length or (32 if gpu else 16)
    batch_sizes = [int(b) for b in (args.batch_sizes or ("1,8,32" if gpu else "1,4")).split(",")]
    modes = args.modes.split(",")
    big_modes = set(args.big_batch_modes.split(","))
    device_name = torch.cuda.get_device_name(device) if gpu else "CPU"

    rows, summary = [], {"device": device_name, "torch": torch.__version__, "dtype": str(dtype)}
    if gpu and args.bandwidth is None:
        args.bandwidth = copy_bandwidth(device) / 1e12
        summary["copy_bandwidth_tb_s"] = args.bandwidth
    summary.update(prompt_len=prompt_len, new_tokens=new_tokens, block_length=block_length, weight_read=WEIGHT_READ)
    quantizations = parse_quantizations(parser, args.quantization)
    schemes = [q for q in quantizations if q != "none"]
    if schemes and not gpu:
        parser.error("--quantization fp8 needs a GPU (transformers quantizes FP8 on CUDA or XPU only)")
    tokens_per_forward = [int(t) for t in args.tokens_per_forward.split(",")]
    if any(t < 1 or new_tokens % t for t in tokens_per_forward):
        parser.error(f"--tokens-per-forward values must divide {new_tokens}, got {args.tokens_per_forward!r}")
    kv_dtypes = args.kv_cache_dtypes.split(",")
    if any(kv not in ("auto", "fp8") for kv in kv_dtypes):
        parser.error(f"--kv-cache-dtypes takes a comma list of auto and fp8, got {args.kv_cache_dtypes!r}")
    settings = dict(
        batch_sizes=batch_sizes, modes=modes, big_modes=big_modes, tokens_per_forward=tokens_per_forward, args=args
    )
    settings.update(kv_dtypes=kv_dtypes)
    settings.update(shape=shape, device=device, gpu=gpu, prompt_len=prompt_len, new_tokens=new_tokens)
    settings.update(block_length=block_length)
    for attn in args.attn.split(","):
        if "none" in quantizations:
            model = build_model(shape, dtype, device, attn)
            rows += measure(model, attn, "none", settings)
            del model
        for scheme in schemes:  # each from the same random bf16 weights (the seed), built again
            model = build_model(shape, dtype, device, attn)
            torch.manual_seed(1)
            probe = torch.randint(0, shape["vocab_size"] - 512, (1, prompt_len + new_tokens), device=device)
            reference = full_logits(model, probe)
            quantized = quantize_fp8(model, device, attn, scheme)
            logits = full_logits(quantized, probe)
            agreement = logit_agreement(reference, logits)
            # Against bf16 running the FP8 weights dequantized: the same weights, so what differs is the kernels'
            # arithmetic and, above WEIGHT_ONLY_MAX_ROWS rows (this 768-row forward), the activations' FP8 rounding.
            load_dequantized_(model, quantized)
            agreement["vs_dequantized_weights"] = logit_agreement(full_logits(model, probe), logits)
            summary[f"{scheme}_vs_bf16_logits"] = agreement
            print(json.dumps({scheme: agreement}), flush=True)
            del reference, logits, model  # the bf16 model is freed: peak memory is the FP8 model's
            gc.collect()  # without it, some runs' peak still counted the bf16 weights (24 GB against 9 at batch 1)
            torch.cuda.empty_cache()
            rows += measure(quantized, attn, scheme, settings)
            del quantized
        if gpu:
            torch.cuda.empty_cache()

    print()
    header = (
        f"{'attn':<13}{'quant':>16}{'kv':>5}{'batch':>6}{'mode':>8}{'tok/fwd':>8}{'NFE':>6}{'ms/fwd':>9}{'tok/s':>9}"
        f"{'step ms':>9}{'peak GB':>9}{'=eager':>8}{'=kv auto':>9}"
    )
    print(f"{device_name}, {dtype}, prompt {prompt_len}, {new_tokens} new tokens, block {block_length}")
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['attn']:<13}{r['quant']:>16}{r['kv']:>5}{r['batch']:>6}{r['mode']:>8}  {r['error']}")
            continue
        step = f"{r['dual_step_ms']:.2f}" if "dual_step_ms" in r else "-"
        same = str(r.get("tokens_equal_eager", "-"))
        print(
            f"{r['attn']:<13}{r['quant']:>16}{r['kv']:>5}{r['batch']:>6}{r['mode']:>8}{r['tokens_per_forward']:>8}"
            f"{r['nfe']:>6}{r['ms_per_forward']:>9.2f}{r['tokens_per_s']:>9.1f}{step:>9}{r['peak_gb']:>9.2f}{same:>8}"
            f"{str(r.get('same_tokens', '-')):>9}"
        )
    for quant, floor in summary.get("weight_read", {}).items():
        if "floor_ms" not in floor:  # CPU without --bandwidth: no floor
            continue
        achieved = floor.get("achieved_tb_s")  # only with a batch-1 dual row
        print(
            f"{quant}: a step reads {floor['gb']:.2f} GB of weights, floor {floor['floor_ms']:.2f} ms at "
            f"{args.bandwidth:.2f} TB/s"
            + ("" if achieved is None else f"; batch-1 dual step achieved {achieved:.2f} TB/s")
        )
    summary["rows"] = rows
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
