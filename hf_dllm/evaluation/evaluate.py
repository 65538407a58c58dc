"""`hf-dllm eval MODEL --dataset PATH_OR_NAME ...`: generate on a dataset, score, report speed and NFE.

    hf-dllm eval GSAI-ML/LLaDA-8B-Instruct --dataset openai/gsm8k --dataset-config main --scorer number \\
        --threshold 0.9 --block-length 32 --max-new-tokens 256 --batch-size 16 --output-dir gsm8k-run

Data parallel: the same command under `accelerate launch` runs one model replica per process (one GPU each, or CPU
processes with `--cpu`), shards the examples and gathers the results on the main process, which writes the same
files as a single process would:

    accelerate launch --num_processes 8 -m hf_dllm eval MODEL --dataset ... [options]

On a machine without a GPU, accelerate's plain launcher starts a single process whatever `--num_processes` says;
`accelerate launch --multi_gpu --num_processes N -m hf_dllm eval MODEL ... --device cpu` starts N (torchrun; they
form a CPU gloo group). `--device-map auto` instead splits one model over every visible GPU (one process).

Settings: the generation options given > the checkpoint's generation_config.json > the library's defaults
(`model.resolve_generation_config`). Stop tokens and `--stop` strings: the run's committed blocks feed each row's
`CompletionText` (`hf_dllm.cli.completion_text`, shared with the server); a row whose completion is over is
stopped (no more forwards), and its prediction is that completion's text.

Outputs (main process), in `--output-dir`:
- `predictions.jsonl`: one line per example, in dataset order: `index`, `prompt`, `prediction`, `answer`,
  `correct`, `nfe` (forwards the row took part in, from the run's `nfe_per_row`), `new_tokens` (the completion's
  tokens, and the EOS/EOT that ended it; a stop string's tokens are not counted).
- `summary.json`: `accuracy`, `n`, `correct`, `tokens_per_second` (generated tokens / wall time of the generation
  phase, the slowest process counting), `mean_nfe`, `tokens_per_forward` (generated tokens / per-row forwards),
  `forward_calls` (batched forwards), the resolved generation config, the evaluation settings, versions and
  per-process timings.

Sharding: prompts are sorted by length and cut into batches (left-padded) as one process would; the batches are
dealt round-robin to the processes. A batch holds the same rows whatever the number of processes, so predictions and
NFE (also with `--threshold`/`--factor`, where the rows of a batch move through a block in lockstep and a row's NFE
counts its batch's slowest row) equal the one-process run's, in bf16 on GPUs too, where kernels round differently
by shape.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from ..cli.completion_text import CompletionText, stop_token_ids
from ..cli.generation_options import add_generation_arguments, generation_arguments
from ..cli.loading import add_model_arguments, load_model, model_arguments
from .data import SCORERS, build_prompt, format_prompt, load_examples, process_state, score, shard_batches


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dllm eval",
        description="Evaluate a masked-diffusion LM on a dataset (run under `accelerate launch` for data parallelism).",
    )
    parser.add_argument("model", help="local checkpoint directory or Hub id")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", required=True, help="local .json/.jsonl/.parquet/.csv file, directory, or Hub name")
    data.add_argument("--dataset-config", default=None, help="Hub dataset configuration (e.g. `main` for gsm8k)")
    data.add_argument("--split", default=None, help="split (default: `train` for local files, `test` for the Hub)")
    data.add_argument("--prompt-field", default="question", help="field holding the prompt (default: question)")
    data.add_argument("--answer-field", default="answer", help="field holding the reference answer (default: answer)")
    data.add_argument(
        "--prompt-template", default=None, help="Python format string over the row's fields, e.g. '{question}\\nA:'"
    )
    data.add_argument("--system-prompt", default=None, help="system message (chat template) or preamble")
    data.add_argument(
        "--no-chat-template", action="store_true", help="do not apply the tokenizer's chat template to prompts"
    )
    data.add_argument("--limit", type=int, default=None, help="evaluate the first N examples only")
    data.add_argument(
        "--scorer",
        choices=SCORERS,
        default="exact",
        help="exact: stripped strings equal; number: last number equals the answer's (GSM8K style)",
    )
    data.add_argument("--stop", action="append", default=[], help="stop sequence cutting predictions (repeatable)")

    run = parser.add_argument_group("run")
    run.add_argument("--batch-size", type=int, default=8, help="prompts per generate() call and process")
    run.add_argument("--output-dir", default="eval_results", help="where predictions.jsonl and summary.json go")
    run.add_argument("--seed", type=int, default=0, help="torch seed (matters only when sampling)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_arguments(parser)

    gen = parser.add_argument_group(
        "generation (DiffusionGenerationConfig fields; unset = the checkpoint's generation_config.json, then the "
        "library's defaults)"
    )
    add_generation_arguments(gen)
    return parser


def generation_kwargs(args: argparse.Namespace) -> dict:
    """The generation fields given on the command line (`--threshold none` gives `threshold=None`)."""
    return generation_arguments(args)


def versions() -> dict:
    from importlib import metadata

    import hf_dllm

    found = {"hf_dllm": hf_dllm.__version__, "python": platform.python_version()}
    for name in ("transformers", "torch", "accelerate", "datasets"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def generate_completions(model, input_ids, attention_mask, config, completions: list[CompletionText]):
    """Run one batch block by block, feeding each row's committed tokens to its `CompletionText` and stopping the
    rows whose completion is over (a stop token or stop string: no more forwards for them). Returns the finished
    run (`sequences`, `nfe`, `nfe_per_row`)."""
    import torch

    run = model.generate_blocks(input_ids, attention_mask=attention_mask, generation_config=config)
    for event in run:
        rows = event.rows.tolist()
        over = [completions[row].extend(tokens) for row, tokens in zip(rows, event.new_tokens(), strict=True)]
        if any(over):
            event.stop(torch.tensor(over, dtype=torch.bool))
    return run


def evaluate_shard(model, tokenizer, config, batches, prompt_ids, prompts, answers, args, progress) -> tuple[list, int]:
    """Generate and score this process's batches. Returns the per-example records and the batched forwards."""
    from ..generation_utils import left_pad  # torch: imported when the command runs, not for its --help

    stop_ids = stop_token_ids(config, tokenizer)
    pad_id = config.prompt_pad_token_id
    device = model.get_input_embeddings().weight.device
    records, forward_calls, tokens = [], 0, 0
    started = time.perf_counter()
    for batch in batches:
        input_ids, attention_mask = left_pad([prompt_ids[i] for i in batch], pad_id)
        completions = [CompletionText(tokenizer, stop_ids, args.stop) for _ in batch]
        run = generate_completions(model, input_ids.to(device), attention_mask.to(device), config, completions)
        forward_calls += int(run.nfe)
        nfe = run.nfe_per_row.cpu().tolist()
        for row, index in enumerate(batch):
            completion = completions[row]
            # The completion's tokens, and the stop token that ended it (a stop string's tokens are cut off).
            new_tokens = completion.completion_tokens + int(
                completion.finish_reason == "stop" and not completion.stop_string_found
            )
            tokens += new_tokens
            records.append(
                {
                    "index": index,
                    "prompt": prompts[index],
                    "prediction": completion.text,
                    "answer": answers[index],
                    "correct": score(completion.text, answers[index], args.scorer),
                    "nfe": int(nfe[row]),
                    "new_tokens": new_tokens,
                }
            )
        if progress is not None:
            progress.update(len(batch))
            progress.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - started, 1e-9):.1f}")
    return records, forward_calls


def summarize(records: list[dict], stats: list[dict], config, args, state, total_seconds: float) -> dict:
    import torch

    n = len(records)
    correct = sum(int(r["correct"]) for r in records)
    new_tokens = sum(r["new_tokens"] for r in records)
    row_forwards = sum(r["nfe"] for r in records)
    wall = max((s["seconds"] for s in stats), default=0.0)
    fields = type(config).field_names()
    return {
        "model": args.model,
        "dataset": args.dataset,
        "n": n,
        "correct": correct,
        "accuracy": correct / n if n else None,
        "scorer": args.scorer,
        "generated_tokens": new_tokens,
        "generation_seconds": wall,
        "tokens_per_second": new_tokens / wall if wall > 0 else None,
        "mean_nfe": row_forwards / n if n else None,
        "tokens_per_forward": new_tokens / row_forwards if row_forwards else None,
        "forward_calls": sum(s["forward_calls"] for s in stats),
        "num_processes": state.num_processes,
        "total_seconds": total_seconds,
        "generation_config": {name: getattr(config, name) for name in fields},
        "settings": {
            "dataset": args.dataset,
            "dataset_config": args.dataset_config,
            "split": args.split,
            "prompt_field": args.prompt_field,
            "answer_field": args.answer_field,
            "prompt_template": args.prompt_template,
            "system_prompt": args.system_prompt,
            "chat_template": not args.no_chat_template,
            "limit": args.limit,
            "stop": args.stop,
            "batch_size": args.batch_size,
            "dtype": args.dtype,
            "device_map": args.device_map,
            "attn_implementation": args.attn_implementation,
            "revision": args.revision,
            "threads": torch.get_num_threads(),
            "seed": args.seed,
        },
        "versions": versions(),
        "per_process": sorted(stats, key=lambda s: s["rank"]),
    }


def run(args: argparse.Namespace) -> dict | None:
    """Evaluate; returns the summary on the main process (None elsewhere)."""
    import torch
    from accelerate.utils import gather_object
    from tqdm import tqdm

    started = time.perf_counter()
    state = process_state(args.device)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}.")
    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}.")
    torch.manual_seed(args.seed)

    examples = load_examples(args.dataset, args.split, args.dataset_config, args.limit)
    prompts = [format_prompt(example, args.prompt_field, args.prompt_template) for example in examples]
    missing = [i for i, example in enumerate(examples) if args.answer_field not in example]
    if missing:
        raise ValueError(
            f"example {missing[0]} has no field {args.answer_field!r} (fields: "
            f"{sorted(examples[missing[0]])}); choose one with --answer-field."
        )
    answers = [example[args.answer_field] for example in examples]

    loading = model_arguments(args)
    if state.num_processes > 1:
        loading["device"] = str(state.device)  # one replica per process, on the device accelerate assigned
    model, tokenizer = load_model(args.model, **loading, num_processes=state.num_processes)
    # One resolver: the command line's fields > the checkpoint's generation_config.json > the library's defaults.
    config = model.resolve_generation_config(**generation_kwargs(args))
    prompt_ids = [build_prompt(tokenizer, text, not args.no_chat_template, args.system_prompt) for text in prompts]
    lengths = [len(ids) for ids in prompt_ids]
    batches = shard_batches(lengths, args.batch_size, state.process_index, state.num_processes)
    local = [index for batch in batches for index in batch]

    progress = tqdm(
        total=len(local),
        desc=f"hf-dllm eval (process 1 of {state.num_processes})" if state.num_processes > 1 else "hf-dllm eval",
        disable=args.quiet or not state.is_main_process,
        file=sys.stderr,
    )
    state.wait_for_everyone()
    generation_started = time.perf_counter()
    records, forward_calls = evaluate_shard(
        model, tokenizer, config, batches, prompt_ids, prompts, answers, args, progress
    )
    seconds = time.perf_counter() - generation_started
    progress.close()
    stats = {
        "rank": state.process_index,
        "device": str(model.get_input_embeddings().weight.device),
        "examples": len(records),
        "generated_tokens": sum(r["new_tokens"] for r in records),
        "forward_calls": forward_calls,
        "seconds": seconds,
    }
    all_records = gather_object(records)
    all_stats = gather_object([stats])
    summary = None
    if state.is_main_process:
        all_records = sorted(all_records, key=lambda r: r["index"])
        summary = summarize(all_records, all_stats, config, args, state, time.perf_counter() - started)
        output = Path(args.output_dir)
        output.mkdir(parents=True, exist_ok=True)
        with open(output / "predictions.jsonl", "w") as f:
            for record in all_records:
                f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        (output / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        accuracy = summary["accuracy"]
        print(
            f"accuracy {accuracy if accuracy is None else round(accuracy, 4)} on {summary['n']} examples | "
            f"{(summary['tokens_per_second'] or 0):.1f} tokens/s | mean NFE {(summary['mean_nfe'] or 0):.1f} | "
            f"{(summary['tokens_per_forward'] or 0):.2f} tokens/forward | {state.num_processes} process(es) | "
            f"{output / 'summary.json'}"
        )
    state.wait_for_everyone()
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-dllm eval: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
