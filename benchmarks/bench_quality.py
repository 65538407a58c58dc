"""Accuracy vs. number of forwards (NFE) of every decoding setting, on the tiny trained LLaDA.

    python benchmarks/bench_quality.py                      # all settings, 192 held-out prompts, CPU
    python benchmarks/bench_quality.py --n 48 --no-plot     # quicker

Model: `tests/fixtures/llada-tiny-trained` (trained by `examples/train_tiny.py`). Prompts: the first `--n`
prompts of the fixed held-out set of `hf_dllm.tiny_model.tasks` (copy / reverse / sort in turn; never seen in
training), chat-formatted. An answer is correct when the text before the first `<|eot_id|>`/EOS equals the
expected answer exactly.

Settings, each at block length 8 and 32 and with `eos_early_stop` off and on:
- one token per step (`steps = max_new_tokens`, LLaDA's low-confidence remasking) with no cache, prefix cache
  and dual cache;
- threshold 0.5 / 0.7 / 0.9 and factor 0.5 / 1 / 2 (Fast-dLLM) with the dual cache;
- threshold 0.9 with no cache (separates the cost of the cache from that of parallel unmasking).

Reported per setting: accuracy (and per task), mean NFE per prompt, tokens per forward and wall time.
Prompts are decoded one at a time (batch size 1) by default, so NFE is each prompt's own count (in a batch, rows
stay in lockstep and every row pays for the slowest one). Tokens per forward = `max_new_tokens` / mean NFE: every
generated position counts (answer, `<|eot_id|>` and EOS padding, also the EOS filled in by `eos_early_stop`),
so it is the speed-up over one token per forward. Wall time: seconds for all prompts, after one warm-up call.

Output: a table, a PNG of accuracy against mean NFE (one point per setting, `--plot`), and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hf_dllm  # noqa: E402,F401  (registers the LLaDA classes with the Auto classes)
from hf_dllm.fp8 import FP8_QUANTIZATIONS  # noqa: E402
from hf_dllm.tiny_model import tasks as st  # noqa: E402

DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "llada-tiny-trained"


def decoding_settings() -> list[tuple[str, dict]]:
    """(name, generate kwargs) of every unmasking/cache combination, without block length and early stop."""
    one = dict(threshold=None, factor=None, steps=None)
    settings = [
        ("one/step no-cache", dict(one, use_cache=False)),
        ("one/step prefix", dict(one, use_cache=True, dual_cache=False)),
        ("one/step dual", dict(one, use_cache=True, dual_cache=True)),
    ]
    for tau in (0.5, 0.7, 0.9):
        settings.append((f"threshold {tau} dual", dict(threshold=tau, factor=None, use_cache=True, dual_cache=True)))
    settings.append(("threshold 0.9 no-cache", dict(threshold=0.9, factor=None, use_cache=False)))
    for factor in (0.5, 1.0, 2.0):
        settings.append(
            (f"factor {factor:g} dual", dict(threshold=None, factor=factor, use_cache=True, dual_cache=True))
        )
    return settings


def all_settings(block_lengths) -> list[dict]:
    out = []
    for block_length in block_lengths:
        for eos_early_stop in (False, True):
            for name, kwargs in decoding_settings():
                out.append(
                    {
                        "name": name,
                        "block_length": block_length,
                        "eos_early_stop": eos_early_stop,
                        "kwargs": dict(kwargs, block_length=block_length, eos_early_stop=eos_early_stop),
                    }
                )
    return out


@torch.no_grad()
def run_setting(model, tokenizer, examples, encoded, max_new_tokens: int, kwargs: dict, batch_size: int) -> dict:
    """Decode every prompt with one setting. `encoded`: list of (input_ids, attention_mask) batches."""
    correct = {}
    nfe = []
    answers = []
    model.generate(**encoded[0], max_new_tokens=max_new_tokens, **kwargs)  # warm-up
    start = time.perf_counter()
    index = 0
    for batch in encoded:
        out = model.generate(**batch, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **kwargs)
        responses = st.decode_responses(tokenizer, out.sequences, batch["input_ids"].shape[1])
        for row, response in enumerate(responses):
            example = examples[index]
            index += 1
            answers.append(st.extract_answer(response))
            correct.setdefault(example.task, []).append(st.is_correct(example, response))
            nfe.append(int(out.nfe_per_row[row]))
    wall = time.perf_counter() - start
    n = len(examples)
    mean_nfe = sum(nfe) / n
    return {
        "accuracy": sum(sum(v) for v in correct.values()) / n,
        "accuracy_per_task": {task: sum(v) / len(v) for task, v in correct.items()},
        "mean_nfe": mean_nfe,
        "tokens_per_forward": max_new_tokens / mean_nfe,
        "wall_s": wall,
        "answers": answers,
    }


def encode(tokenizer, examples, batch_size: int, device) -> list:
    batches = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batches.append(st.encode_prompts(tokenizer, [e.prompt for e in chunk]).to(device))
    return batches


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"one/step": "tab:gray", "threshold": "tab:blue", "factor": "tab:orange"}
    markers = {8: "o", 32: "s"}
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)
    for r in results:
        family = r["name"].split()[0]
        color = colors.get(family, "black")
        if "no-cache" in r["name"] and family == "threshold":
            color = "tab:green"
        face = color if r["eos_early_stop"] else "none"
        ax.scatter(
            r["mean_nfe"],
            100 * r["accuracy"],
            marker=markers.get(r["block_length"], "^"),
            s=48,
            facecolors=face,
            edgecolors=color,
            linewidths=1.4,
        )
    handles = [
        plt.Line2D([], [], color=c, marker="o", linestyle="", label=label)
        for label, c in (
            ("one token/step", "tab:gray"),
            ("threshold (dual cache)", "tab:blue"),
            ("threshold 0.9 (no cache)", "tab:green"),
            ("factor (dual cache)", "tab:orange"),
        )
    ]
    handles += [
        plt.Line2D([], [], color="black", marker="o", linestyle="", label="block 8"),
        plt.Line2D([], [], color="black", marker="s", linestyle="", label="block 32"),
        plt.Line2D([], [], color="black", marker="o", markerfacecolor="none", linestyle="", label="eos_early_stop off"),
    ]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("mean forwards per prompt (NFE, log scale)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="accuracy vs NFE of every decoding setting on the tiny trained LLaDA")
    p.add_argument(
        "--model", default=str(DEFAULT_MODEL.relative_to(ROOT)) if Path.cwd() == ROOT else str(DEFAULT_MODEL)
    )
    p.add_argument("--n", type=int, default=192, help="held-out prompts (tasks in turn)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--block-lengths", default="8,32")
    p.add_argument("--batch-size", type=int, default=1, help="1 = per-prompt NFE and latency")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", default=str(ROOT / "benchmarks" / "quality_vs_nfe.png"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--dtype", default=None, help="load the weights in this dtype (default: the checkpoint's)")
    p.add_argument(
        "--quantization",
        default="none",
        choices=("none", *FP8_QUANTIZATIONS),
        help="fp8: FP8 weights with 128x128 block scales (transformers' FineGrainedFP8Config; CUDA only); "
        "fp8-tensor: one scale per matrix (FineGrainedFP8Config(weight_block_size=None)); with +head the output "
        "head too (its rows must be a multiple of 128, resp. 16)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=("fp8",),
        help="fp8: the cached settings keep K/V as float8 e4m3 with a scale per position and head (kv_cache_dtype)",
    )
    p.add_argument("--cpu", action="store_true", help="quick check (CI): 3 prompts, block length 8, no plot")
    args = p.parse_args(argv)
    if args.cpu:
        args.n, args.block_lengths, args.no_plot = min(args.n, 3), "8", True
    if args.quantization != "none" and not args.device.startswith("cuda"):
        p.error(
            f"--quantization {args.quantization} needs --device cuda (transformers quantizes FP8 on CUDA or XPU only)"
        )

    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
    if args.quantization != "none":
        from hf_dllm.fp8 import fp8_config_for

        load.update(quantization_config=fp8_config_for(AutoConfig.from_pretrained(args.model), args.quantization))
        load.update(device_map=args.device)
        model = AutoModel.from_pretrained(args.model, **load).eval()
    else:
        model = AutoModel.from_pretrained(args.model, **load).to(args.device).eval()
    examples = st.heldout_examples(args.n)
    encoded = encode(tokenizer, examples, args.batch_size, args.device)
    block_lengths = [int(x) for x in args.block_lengths.split(",")]
    config = model.config
    print(
        f"model {args.model}: d_model {config.d_model}, {config.n_layers} layers, {config.n_heads} heads, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; device {args.device} "
        f"({platform.processor() or platform.machine()}, {args.threads} thread(s)), torch {torch.__version__}, "
        f"quantization {args.quantization}, K/V cache {args.kv_cache_dtype or 'model dtype'}"
    )
    print(
        f"{args.n} held-out prompts ({', '.join(st.TASKS)}), max_new_tokens {args.max_new_tokens}, "
        f"batch size {args.batch_size}, greedy"
    )
    header = (
        f"{'setting':<24} {'block':>5} {'eos_stop':>8} {'acc %':>6} "
        + " ".join(f"{t[:7]:>7}" for t in st.TASKS)
        + f" {'NFE':>6} {'tok/fwd':>7} {'wall s':>7}"
    )
    print(header)
    print("-" * len(header))
    results = []
    for setting in all_settings(block_lengths):
        kwargs = dict(setting["kwargs"])
        if args.kv_cache_dtype and kwargs.get("use_cache", True):  # settings without a cache keep no K/V
            kwargs["kv_cache_dtype"] = args.kv_cache_dtype
        r = run_setting(model, tokenizer, examples, encoded, args.max_new_tokens, kwargs, args.batch_size)
        row = {k: setting[k] for k in ("name", "block_length", "eos_early_stop")}
        row.update({k: v for k, v in r.items() if k != "answers"})
        row["_answers"] = r["answers"]
        results.append(row)
        print(
            f"{row['name']:<24} {row['block_length']:>5} {str(row['eos_early_stop']):>8} "
            f"{100 * row['accuracy']:>6.1f} "
            + " ".join(f"{100 * row['accuracy_per_task'].get(t, float('nan')):>7.1f}" for t in st.TASKS)
            + f" {row['mean_nfe']:>6.2f} {row['tokens_per_forward']:>7.2f} {row['wall_s']:>7.2f}",
            flush=True,
        )

    # eos_early_stop must never change an answer: compare each setting with its twin without early stop.
    changed = 0
    for r in results:
        if r["eos_early_stop"]:
            twin = next(
                o
                for o in results
                if o["name"] == r["name"] and o["block_length"] == r["block_length"] and not o["eos_early_stop"]
            )
            changed += sum(a != b for a, b in zip(r["_answers"], twin["_answers"], strict=True))
    print(f"answers changed by eos_early_stop (all settings): {changed}")

    if not args.no_plot:
        plot(
            results,
            Path(args.plot),
            f"tiny trained LLaDA ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M), {args.n} held-out "
            f"prompts, max_new_tokens {args.max_new_tokens}",
        )
        print(f"plot written to {args.plot}")
    summary = {
        "benchmark": "quality_vs_nfe",
        "model": str(args.model),
        "n_prompts": args.n,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "device": args.device,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "answers_changed_by_eos_early_stop": changed,
        "settings": [
            {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in r.items()
                if not k.startswith("_") and k != "accuracy_per_task"
            }
            | {"accuracy_per_task": {t: round(a, 4) for t, a in r["accuracy_per_task"].items()}}
            for r in results
        ],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
