"""Offline demo: a small LLaDA trained here answers real prompts with diffusion decoding (a few seconds on CPU).

    python examples/demo.py
    python examples/demo.py --prompt "reverse masked" --threshold 0.7

The checkpoint (`tests/fixtures/llada-tiny-trained`, 0.74M parameters, made by `examples/train_tiny.py`) knows
three tasks: `copy <letters>`, `reverse <letters>` and `sort <letters>` (lowercase letters, 3 to 8 of them). Each
answer is checked exactly. The demo decodes through `model.generate()` (showing the number of forwards, NFE,
and tokens/s) and through a transformers `pipeline` with the chat template.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hf_dllm  # noqa: E402,F401  (registers LLaDA with the Auto classes)
from hf_dllm.tiny_model import tasks as st  # noqa: E402

DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "llada-tiny-trained"
DEFAULT_PROMPTS = ["reverse decoding", "sort language", "copy parallel"]


def example_for(prompt: str) -> st.Example | None:
    """The expected answer when the prompt is one of the known tasks, else None."""
    task, _, argument = prompt.partition(" ")
    if task in st.ALL_TASKS and argument:
        try:
            return st.Example(task, prompt, st.solve(task, argument))
        except ValueError:
            return None
    return None


def verdict(prompt: str, answer: str) -> str:
    example = example_for(prompt)
    if example is None:
        return "(unknown task: not checked)"
    if answer == example.answer:
        return "correct"
    argument = prompt.partition(" ")[2]
    hint = (
        ""
        if st.MIN_STRING <= len(argument) <= st.MAX_STRING and argument.isalpha() and argument.islower()
        else (f"; trained on {st.MIN_STRING}-{st.MAX_STRING} lowercase letters")
    )
    return f"WRONG (expected {example.answer!r}{hint})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompt", action="append", help="user message (repeatable); default: three examples")
    p.add_argument("--threshold", type=float, default=0.9, help="Fast-dLLM threshold (the model's default)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--block-length", type=int, default=8)
    args = p.parse_args(argv)
    prompts = args.prompt or DEFAULT_PROMPTS
    torch.set_num_threads(1)

    from transformers import AutoModel, AutoTokenizer, pipeline

    model = AutoModel.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{Path(args.model).name}: LLaDA, {n_params / 1e6:.2f}M parameters, {model.config.n_layers} layers, CPU")

    settings = {
        "one token per step, no cache": dict(threshold=None, use_cache=False),
        f"threshold {args.threshold}, dual cache": dict(threshold=args.threshold, use_cache=True, dual_cache=True),
    }
    print("\n== model.generate() ==")
    for prompt in prompts:
        batch = st.encode_prompts(tokenizer, [prompt])
        print(f"user: {prompt}")
        for name, kwargs in settings.items():
            model.generate(**batch, max_new_tokens=args.max_new_tokens, block_length=args.block_length, **kwargs)
            start = time.perf_counter()
            out = model.generate(
                **batch,
                max_new_tokens=args.max_new_tokens,
                block_length=args.block_length,
                return_dict_in_generate=True,
                **kwargs,
            )
            seconds = time.perf_counter() - start
            response = st.decode_responses(tokenizer, out.sequences, batch["input_ids"].shape[1])[0]
            answer = st.extract_answer(response)
            # tokens/s counts every generated position (answer, <|eot_id|>, EOS padding) over the call's time.
            print(
                f"  [{name}] assistant: {answer!r} -> {verdict(prompt, answer)}; NFE {out.nfe}, "
                f"{args.max_new_tokens / seconds:.0f} tokens/s ({seconds * 1000:.0f} ms)"
            )

    print("\n== transformers pipeline (chat template, the model's generation_config) ==")
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    for prompt in prompts:
        start = time.perf_counter()
        result = generator(st.chat_messages(prompt), max_new_tokens=args.max_new_tokens)
        seconds = time.perf_counter() - start
        answer = result[0]["generated_text"][-1]["content"].strip()
        print(f"user: {prompt}\n  assistant: {answer!r} -> {verdict(prompt, answer)} ({seconds * 1000:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
