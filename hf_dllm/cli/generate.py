"""`hf-dllm generate MODEL --prompt TEXT`: decode prompts from the command line, on one device or sharded.

    hf-dllm generate GSAI-ML/LLaDA-8B-Instruct --chat --prompt "What is diffusion?" --threshold 0.9
    torchrun --nproc-per-node 2 -m hf_dllm generate GSAI-ML/LLaDA-8B-Instruct --tp-plan auto --chat --prompt "Hi"

Each `--prompt` is one row of a batch (left-padded). Settings not given come from the checkpoint's
`generation_config.json`, exactly as `model.generate()` without the keyword. With `--stream`, each row's text is
printed block by block as the blocks are committed. Under `torchrun` with `--tp-plan auto` every process holds
its shard of the weights and decodes the same tokens (hf_dllm/tensor_parallel.py); only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys

from .completion_text import CompletionText, stop_token_ids
from .generation_options import add_generation_arguments, generation_arguments
from .loading import add_model_arguments, load_model, model_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dllm generate",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help="checkpoint folder or Hub id (model + tokenizer)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    settings = parser.add_argument_group(
        "generation (DiffusionGenerationConfig fields; unset = the checkpoint's generation_config.json)"
    )
    add_generation_arguments(settings)
    # The flag's first name (before every field had its option): --no-use-cache.
    settings.add_argument(
        "--no-cache", dest="use_cache", action="store_false", default=argparse.SUPPRESS, help="--no-use-cache"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed torch's random draws (sampling)")
    parser.add_argument("--stream", action="store_true", help="print each row's text block by block")
    add_model_arguments(parser)
    return parser


def encode(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat needs a tokenizer with a chat template; this one has none.")
        return [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for prompt in prompts
        ]
    return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from ..generation_utils import left_pad

    if args.stream and len(args.prompt) > 1:
        print("hf-dllm generate: --stream prints one row's text as it comes: give one --prompt.", file=sys.stderr)
        return 2
    settings = generation_arguments(args)
    try:
        model, tokenizer = load_model(args.model, **model_arguments(args))
        prompts = encode(tokenizer, args.prompt, args.chat)
        config = model.resolve_generation_config(**settings)
    except (FileNotFoundError, OSError, ValueError) as error:
        print(f"hf-dllm generate: {error}", file=sys.stderr)
        return 2
    leader = int(os.environ.get("RANK", "0")) == 0
    if args.seed is not None:
        torch.manual_seed(args.seed)
    device = model.get_input_embeddings().weight.device
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_ids[0]
    input_ids, attention_mask = left_pad(prompts, pad)
    stops = stop_token_ids(config, tokenizer)
    texts = [CompletionText(tokenizer, stops, (), None) for _ in prompts]
    printed = [0] * len(prompts)
    run = model.generate_blocks(
        input_ids.to(device), config, attention_mask=attention_mask.to(device), return_dict_in_generate=True
    )
    with torch.no_grad():
        for event in run:  # every rank runs every block; rank 0 prints
            for row, tokens in zip(event.rows.tolist(), event.new_tokens(), strict=True):
                texts[row].extend(tokens)
                if args.stream and leader:
                    end = texts[row].streamable()
                    print(texts[row].text[printed[row] : end], end="", flush=True)
                    printed[row] = end
    if leader:
        if args.stream:
            print(texts[0].text[printed[0] :])
        else:
            for prompt, text in zip(args.prompt, texts, strict=True):
                print(text.text if len(args.prompt) == 1 else f"[{prompt}] {text.text}")
        print(f"(NFE {run.nfe})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
