"""Multi-GPU benchmark: one LLaDA-8B-shaped model split over 2 GPUs, and data-parallel `hf-dllm eval`.

Part 1 (model parallel): a random bf16 model with LLaDA-8B's shapes (d_model 4096, 32 layers, 32 heads, MLP 12288,
vocabulary 126464) is built directly on GPU 0 (no 16 GB download or checkpoint), then `generate()` runs at batch 1
with no / prefix / dual cache on that GPU alone, then with the model split over both GPUs by accelerate's
`dispatch_model` (embedding and first half of the blocks on GPU 0, the rest and the head on GPU 1: the machinery and
layout of `from_pretrained(..., device_map="auto")` when one GPU cannot hold the model). Tokens must be identical;
tokens/s on 1 and 2 GPUs are reported. `--from-pretrained` also saves the random checkpoint to `--checkpoint-dir`
and loads it back with `from_pretrained(dir, device_map="auto", max_memory=...)` (the cap makes "auto" split it
about in half), the path users take. If the default `generate()` path (CUDA graphs) fails or changes tokens on a
split model, that is reported and the eager path (`disable_compile=True`) is measured.

Part 2 (`--eval-dp`, data parallel): `hf-dllm eval` on a synthetic dataset through `accelerate launch` with 1 and
then 2 processes (one GPU each), from the checkpoint in `--checkpoint-dir` (saved there if missing), after an
untimed 1-process run that compiles the Triton kernels. Reports tokens/s and wall time of both runs, the speed-up,
and whether the predictions are identical.

    # the 2-GPU machine (about 16 GB of GPU memory per copy of the model, ~16 GB of disk for the checkpoint):
    python benchmarks/bench_multigpu.py --from-pretrained --eval-dp --checkpoint-dir /tmp/llada8b-random
    # reduced mode on CPU (tiny shapes, CPU "devices"; checks every code path, timings meaningless):
    python benchmarks/bench_multigpu.py --cpu --from-pretrained --eval-dp

Prints a table per part and, last, one JSON line with every number.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hf_dllm  # noqa: E402
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer  # noqa: E402

MODES = {"none": dict(use_cache=False), "prefix": dict(use_cache=True, dual_cache=False),
         "dual": dict(use_cache=True, dual_cache=True)}  # fmt: skip


def model_config(cpu: bool, small: bool = False) -> hf_dllm.LLaDAConfig:
    tokenizer = build_char_tokenizer()
    special = dict(
        mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if cpu:
        shapes = dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden_size=192, vocab_size=320,
                      embedding_size=320)  # fmt: skip
    elif small:  # a quick check of the GPU paths (~0.4B parameters)
        shapes = dict(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=16, mlp_hidden_size=2816,
                      vocab_size=126464, embedding_size=126464)  # fmt: skip
    else:  # LLaDA-8B
        shapes = dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
                      vocab_size=126464, embedding_size=126464)  # fmt: skip
    return hf_dllm.LLaDAConfig(**shapes, max_sequence_length=4096, **special)


def build_model(config, device: str, seed: int, attn_implementation: str | None):
    """Random bf16 (GPU) / float32 (CPU) model, initialised directly on `device`. `attn_implementation`: None = the
    model's default; the reloaded model of `--from-pretrained` gets the same one, so both runs use the same kernels."""
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def sync() -> None:
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def run_modes(model, prompt: torch.Tensor, args) -> dict:
    """Per cache mode: generated tokens (CPU), seconds of the timed runs (best), NFE."""
    device = model.get_input_embeddings().weight.device
    prompt = prompt.to(device)
    settings = dict(max_new_tokens=args.gen_length, block_length=args.block_length, eos_early_stop=False,
                    return_dict_in_generate=True, disable_compile=args.disable_compile)  # fmt: skip
    if args.threshold is not None:
        settings["threshold"] = args.threshold
    else:
        settings["steps"] = args.steps or args.gen_length
    results = {}
    for mode in args.modes:
        kwargs = {**settings, **MODES[mode]}
        # Warm-up: one full run, so every block's shapes (prefix mode: the query shrinks block by block) have their
        # CUDA graphs captured and Triton kernels compiled before the timed runs.
        model.generate(prompt, **kwargs)
        best, out = float("inf"), None
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            out = model.generate(prompt, **kwargs)
            sync()
            best = min(best, time.perf_counter() - start)
        results[mode] = {"tokens": out.sequences.cpu(), "seconds": best, "nfe": int(out.nfe),
                         "tokens_per_second": args.gen_length * prompt.shape[0] / best}  # fmt: skip
    return results


def _failure(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def run_split(model, prompt, single: dict, args, report: dict, name: str) -> dict | None:
    """`run_modes` on a split model. If the default path (CUDA graphs on CUDA) fails or changes tokens, that is
    recorded in the report and the eager path (`disable_compile=True`) is measured instead; if that fails too, the
    error is recorded and None returned (the benchmark goes on with its other parts)."""
    problem, runs = None, None
    try:
        runs = run_modes(model, prompt, args)
        wrong = [mode for mode in runs if not torch.equal(runs[mode]["tokens"], single[mode]["tokens"])]
        if wrong:
            problem = f"tokens differ from the single-device run for cache modes {wrong}"
    except Exception as error:  # noqa: BLE001 - reported, then the eager path is measured
        problem = _failure(error)
    if problem is None:
        return runs
    report[f"{name}_problem"] = problem
    print(f"{name}: generate() (disable_compile={args.disable_compile}): {problem}")
    if args.disable_compile:
        return runs
    try:
        eager = argparse.Namespace(**{**vars(args), "disable_compile": True})
        runs = run_modes(model, prompt, eager)
        report[f"{name}_measured_with"] = "disable_compile=True"
        print(f"{name}: measured with disable_compile=True instead")
        return runs
    except Exception as error:  # noqa: BLE001 - reported; the other parts still run
        report[f"{name}_eager_problem"] = _failure(error)
        print(f"{name}: generate() with disable_compile=True: {report[f'{name}_eager_problem']}")
        return None


def split_device_map(model, devices: list) -> dict:
    """Half of the blocks on each device: the embedding and the first half on `devices[0]`, the rest, the final
    norm and the output head on `devices[1]` (the layout `device_map="auto"` gives when one GPU cannot hold it)."""
    blocks = model.config.n_layers
    device_map = {"model.transformer.wte": devices[0], "model.transformer.emb_drop": devices[0]}
    device_map.update({f"model.transformer.blocks.{i}": devices[0 if i < blocks // 2 else 1] for i in range(blocks)})
    device_map.update({"model.transformer.ln_f": devices[1], "model.transformer.ff_out": devices[1]})
    return device_map


def auto_max_memory(model) -> dict:
    """`max_memory` for `from_pretrained(device_map="auto")` that makes it split the model about in half: GPU 0 gets
    room for the embedding, half of the blocks and the largest layer (which accelerate keeps free), GPU 1 the rest."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    blocks = model.config.n_layers
    block = sizes["model.transformer.blocks.0"]
    largest = max(block, sizes.get("model.transformer.ff_out", 0), sizes["model.transformer.wte"])
    first = sizes["model.transformer.wte"] + (blocks // 2) * block + largest + block // 2
    return {0: int(first), 1: int(sizes[""] * 2)}


def placement(model) -> dict:
    """Number of parameters' bytes per device."""
    sizes: dict[str, int] = {}
    for parameter in model.parameters():
        key = str(parameter.device)
        sizes[key] = sizes.get(key, 0) + parameter.numel() * parameter.element_size()
    return sizes


def table(title: str, single: dict, split: dict | None, labels=("1 GPU", "2 GPUs")) -> list[dict]:
    print(f"\n{title}")
    if split is None:
        print("(no result: see the error above)")
        return [{"mode": mode, "identical": False, "error": True} for mode in single]
    print(f"| cache | NFE | {labels[0]} tokens/s | {labels[1]} tokens/s | ratio | tokens identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for mode in single:
        a, b = single[mode], split[mode]
        identical = bool(torch.equal(a["tokens"], b["tokens"]))
        ratio = b["tokens_per_second"] / a["tokens_per_second"]
        print(f"| {mode} | {a['nfe']} | {a['tokens_per_second']:.1f} | {b['tokens_per_second']:.1f} | "
              f"{ratio:.2f} | {identical} |")  # fmt: skip
        rows.append({"mode": mode, "nfe": a["nfe"], "nfe_split": b["nfe"], "tps_single": a["tokens_per_second"],
                     "tps_split": b["tokens_per_second"], "ratio": ratio, "identical": identical})  # fmt: skip
    return rows


def save_checkpoint(model, directory: Path) -> None:
    if (directory / "config.json").exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_char_tokenizer().save_pretrained(directory)


def write_dataset(path: Path, n: int) -> None:
    from hf_dllm.tiny_model.tasks import heldout_examples

    with open(path, "w") as f:
        for example in heldout_examples(n):
            f.write(json.dumps({"question": example.prompt, "answer": example.answer}) + "\n")


def eval_dp(args, checkpoint: Path, workdir: Path) -> dict:
    """`hf-dllm eval` under `accelerate launch` with 1 then 2 processes; returns both summaries' numbers."""
    dataset = workdir / "dp_eval.jsonl"
    write_dataset(dataset, args.eval_examples)
    common = [str(checkpoint), "--dataset", str(dataset), "--batch-size", str(args.eval_batch_size),
              "--max-new-tokens", str(args.eval_gen_length), "--block-length", str(args.block_length),
              "--no-eos-early-stop", "--quiet", "--dtype", "float32" if args.cpu else "bfloat16"]  # fmt: skip
    if args.threshold is not None:
        common += ["--threshold", str(args.threshold)]
    if args.cpu:
        common += ["--device", "cpu"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.cpu:
        env["OMP_NUM_THREADS"] = "1"
    runs = {}
    # Warm-up (untimed): the first process on a machine JIT-compiles the Triton kernels and fills Triton's on-disk
    # cache; without this run the 1-process figure would include that one-time compilation and the 2-process one not.
    for timed, processes in ((False, 1), (True, 1), (True, 2)):
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
        if processes > 1:
            launch.append("--multi_gpu")  # torchrun launcher; with --device cpu the processes form a gloo group
        output = workdir / (f"dp_{processes}" if timed else "dp_warmup")
        command = [*launch, "-m", "hf_dllm.cli", "eval", *common, "--output-dir", str(output)]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"eval with {processes} process(es) failed:\n{done.stderr[-4000:]}")
        if not timed:
            continue
        summary = json.loads((output / "summary.json").read_text())
        runs[processes] = {
            "tokens_per_second": summary["tokens_per_second"],
            "generation_seconds": summary["generation_seconds"],
            "wall_seconds": wall,
            "mean_nfe": summary["mean_nfe"],
            "accuracy": summary["accuracy"],
            "per_process": summary["per_process"],
            "predictions": (output / "predictions.jsonl").read_text(),
        }
    identical = runs[1].pop("predictions") == runs[2].pop("predictions")
    result = {
        "examples": args.eval_examples,
        "batch_size": args.eval_batch_size,
        "gen_length": args.eval_gen_length,
        "one_process": runs[1],
        "two_processes": runs[2],
        "speedup_tokens_per_second": runs[2]["tokens_per_second"] / runs[1]["tokens_per_second"],
        "speedup_wall": runs[1]["wall_seconds"] / runs[2]["wall_seconds"],
        "predictions_identical": identical,
    }
    print("\nData-parallel `hf-dllm eval` (accelerate launch)")
    print("| processes | generation s | tokens/s | wall s (with start and load) | mean NFE |")
    print("| --- | --- | --- | --- | --- |")
    for processes, run in runs.items():
        print(f"| {processes} | {run['generation_seconds']:.2f} | {run['tokens_per_second']:.1f} | "
              f"{run['wall_seconds']:.1f} | {run['mean_nfe']:.1f} |")  # fmt: skip
    print(f"speed-up (tokens/s): {result['speedup_tokens_per_second']:.2f}x, "
          f"(wall): {result['speedup_wall']:.2f}x, predictions identical: {identical}")  # fmt: skip
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="reduced mode: tiny shapes on the CPU")
    parser.add_argument("--small", action="store_true", help="GPU mode with a ~0.4B model (a quick check)")
    parser.add_argument("--gen-length", type=int, default=None, help="new tokens (default 256 GPU, 16 CPU)")
    parser.add_argument("--block-length", type=int, default=None, help="block length (default 32 GPU, 8 CPU)")
    parser.add_argument("--threshold", type=float, default=0.9, help="Fast-dLLM threshold (0 = fixed steps)")
    parser.add_argument("--steps", type=int, default=None, help="total steps when --threshold 0 (default gen length)")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per mode, best kept (2 GPU, 1 CPU)")
    parser.add_argument("--modes", default="none,prefix,dual")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disable-compile", action="store_true", help="eager steps (no CUDA graphs) everywhere")
    parser.add_argument(
        "--attn-implementation", default=None, help="attention backend of every model here (default: the model's)"
    )
    parser.add_argument("--checkpoint-dir", default=None, help="where the random checkpoint is saved / read")
    parser.add_argument(
        "--from-pretrained",
        action="store_true",
        help="also load the saved checkpoint with from_pretrained(device_map='auto')",
    )
    parser.add_argument("--eval-dp", action="store_true", help="data-parallel eval speed-up, 1 vs 2 processes")
    parser.add_argument("--eval-examples", type=int, default=None, help="default 64 GPU, 8 CPU")
    parser.add_argument("--eval-batch-size", type=int, default=None, help="default 8 GPU, 2 CPU")
    parser.add_argument("--eval-gen-length", type=int, default=None, help="default 128 GPU, 16 CPU")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.repeats = args.repeats or (1 if args.cpu else 2)
    args.gen_length = args.gen_length or (16 if args.cpu else 256)
    args.block_length = args.block_length or (8 if args.cpu else 32)
    args.threshold = args.threshold or None
    args.eval_examples = args.eval_examples or (8 if args.cpu else 64)
    args.eval_batch_size = args.eval_batch_size or (2 if args.cpu else 8)
    args.eval_gen_length = args.eval_gen_length or (16 if args.cpu else 128)

    if args.cpu:
        devices = ["cpu", "cpu"]
        torch.set_num_threads(1)  # as each eval process below: tiny shapes, fair 1- vs 2-process comparison
    else:
        if torch.cuda.device_count() < 2:
            print("bench_multigpu: needs 2 GPUs (or --cpu for the reduced mode).", file=sys.stderr)
            return 2
        devices = [0, 1]
    workdir = Path(tempfile.mkdtemp(prefix="bench_multigpu_"))
    checkpoint = Path(args.checkpoint_dir) if args.checkpoint_dir else workdir / "checkpoint"
    report: dict = {"bench": "multigpu", "cpu_mode": args.cpu, "torch": torch.__version__,
                    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    "gen_length": args.gen_length, "block_length": args.block_length, "threshold": args.threshold,
                    "prompt_length": args.prompt_length, "batch": 1,
                    "shapes": "tiny" if args.cpu else "small" if args.small else "LLaDA-8B"}  # fmt: skip

    config = model_config(args.cpu, args.small)
    start = time.perf_counter()
    model = build_model(config, "cpu" if args.cpu else "cuda:0", args.seed, args.attn_implementation)
    report["parameters"] = sum(p.numel() for p in model.parameters())
    print(f"model: {report['parameters'] / 1e9:.2f}B parameters, built in {time.perf_counter() - start:.1f}s")
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(7, 103, (1, args.prompt_length), generator=generator)  # character-tokenizer ids

    single = run_modes(model, prompt, args)
    if args.from_pretrained or args.eval_dp:
        save_checkpoint(model, checkpoint)

    from accelerate import dispatch_model

    device_map = split_device_map(model, devices)
    max_memory = auto_max_memory(model)
    model = dispatch_model(model, device_map, main_device=devices[0], skip_keys=model._skip_keys_device_placement,
                           force_hooks=True)  # fmt: skip
    report["split_placement_bytes"] = placement(model)
    print(f"split placement (bytes per device): {report['split_placement_bytes']}")
    split = run_split(model, prompt, single, args, report, "model_parallel")
    labels = ("CPU", "CPU split (hooks)") if args.cpu else ("1 GPU", "2 GPUs")
    report["model_parallel"] = table("Model parallel: batch 1, generate()", single, split, labels)

    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    if args.from_pretrained:
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": torch.float32 if args.cpu else torch.bfloat16, "device_map": "auto",
                  "attn_implementation": args.attn_implementation}  # fmt: skip
        if not args.cpu:
            kwargs["max_memory"] = max_memory
        loaded = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).eval()
        device_map = getattr(loaded, "hf_device_map", None) or {"": loaded.get_input_embeddings().weight.device}
        report["from_pretrained_device_map"] = sorted({str(v) for v in device_map.values()})
        print(f"from_pretrained(device_map='auto') placed modules on {report['from_pretrained_device_map']}")
        loaded_runs = run_split(loaded, prompt, single, args, report, "from_pretrained")
        report["from_pretrained"] = table("from_pretrained(device_map='auto')", single, loaded_runs,
                                          (labels[0], "auto"))  # fmt: skip
        del loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    if args.eval_dp:
        report["data_parallel_eval"] = eval_dp(args, checkpoint, workdir)

    ok = all(row["identical"] for row in report["model_parallel"] + report.get("from_pretrained", []))
    if "data_parallel_eval" in report:
        ok = ok and report["data_parallel_eval"]["predictions_identical"]
    report["all_identical"] = ok
    print(json.dumps(report, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
