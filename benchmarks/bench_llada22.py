"""LLaDA2.2 against LLaDA2.1 at one shape: what Levenshtein editing (and block routing) cost per forward, and a long
prompt's prefill.

GPU setting: the LLaDA2.0-mini shape of `bench_llada2.py` (random bf16 weights built on the GPU) as three models
sharing those weights: LLaDA2.1 (token editing), LLaDA2.2 without block routing (Levenshtein editing: the config's
`delete_token_id` / `split_token_id`, LLaDA2.2's ids), and LLaDA2.2 with block routing (`block_size` 32,
`expert_capacity` 48, as LLaDA2.2's config.json). Batch 1, prompt 512, 128 new tokens, block 32, `threshold` 0.7,
`editing_threshold` 0.5, `max_post_steps` 16, the exact block cache, CUDA graphs. Reported per model: the block
step (`bench_llada2.block_step`: a step of the first block after its first, forward plus the decoding rule, steps
queued back to back as the loop queues them, CUDA-graph replays): the per-forward cost the issue's goal compares
(LLaDA2.2 within 1.1x of LLaDA2.1); and a whole `generate()`: forwards, ms per forward (the call over its forwards:
it also holds the prompt's prefill and each block's first step, and the loop's host work between blocks), tokens/s.
The `generate()` figures compare like for like only when every variant made the same forwards over the same blocks
(`same_forwards` in the JSON; random weights decode different tokens under different rules, so their counts may
differ): the block step compares in any case.

`--long-prompt N` (off by default; the issue's run: 32768): one forward over an N-token prompt (the exact cache's
prefill of LLaDA2.2's 128K context, `max_position_embeddings` 131072) and a 32-token generation after it, each timed
once after one untimed call: time and peak memory.

Without a GPU (`--cpu`): a small float32 model (vocabulary 1024), prompt 16, 32 new tokens, long prompt 128.

Each timed call follows one untimed call of the same shapes (CUDA graphs captured); `--repeats` timed calls (default
1) give the median.

Prints a table and ends with one JSON line.

    python benchmarks/bench_llada22.py                       # block step and ms per forward, about 2 minutes on an H200
    python benchmarks/bench_llada22.py --long-prompt 32768   # and the 32K-token prompt
    python benchmarks/bench_llada22.py --cpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_llada2 import LLADA2_MINI, SMALL, block_step, sync, timed  # noqa: E402

import hf_dllm  # noqa: E402

# LLaDA2.2's config.json and tokenizer: <|mask|>, <|endoftext|>, DELETE, SPLIT. The CPU check's small vocabulary
# takes its last four ids.
HUB_IDS = dict(mask=156895, eos=156892, delete=156930, split=156931)


def variants(num_experts: int, ids: dict) -> dict[str, dict]:
    """The config fields of each compared model (block routing: LLaDA2.2's 48 of 256 experts per block of 32; at
    most three quarters of a smaller model's experts)."""
    llada22 = dict(delete_token_id=ids["delete"], split_token_id=ids["split"])
    capacity = min(48, num_experts * 3 // 4)
    return {
        "LLaDA2.1 (token editing)": {},
        "LLaDA2.2 (Levenshtein editing)": llada22,
        "LLaDA2.2 + block routing": dict(llada22, block_size=32, expert_capacity=capacity),
    }


def build_model(shape: dict, ids: dict, dtype, device) -> hf_dllm.LLaDA2MoeModelLM:
    """Random weights built on `device`."""
    config = hf_dllm.LLaDA2MoeConfig(
        **shape, mask_token_id=ids["mask"], eos_token_id=ids["eos"], pad_token_id=ids["eos"]
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_dllm.LLaDA2MoeModelLM._from_config(config, dtype=dtype)
    return model.eval()


def variant(base, fields: dict, dtype, device):
    """A model sharing `base`'s weights and buffers (no second copy in memory: the peak columns compare decoding,
    not two models held at once) with the config `fields` set (LLaDA2.2's ids, block routing)."""
    config = type(base.config).from_dict({**base.config.to_dict(), **fields})
    with torch.device("meta"):
        model = type(base)._from_config(config, dtype=dtype)
    for kind, tensors in (("_parameters", base.named_parameters()), ("_buffers", base.named_buffers())):
        for name, tensor in tensors:  # the same objects: non-persistent buffers (rotary tables) too
            module_name, _, attr = name.rpartition(".")
            getattr(model.get_submodule(module_name), kind)[attr] = tensor
    leftover = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    assert not leftover, leftover
    return model.eval()


@torch.no_grad()
def long_prompt(model, length: int, device) -> dict:
    """One forward over a `length`-token prompt (the exact cache's prefill) and a 32-token generation after it."""
    prompt = torch.randint(0, model.config.vocab_size - 4, (1, length), device=device)
    prefill_s, _, prefill_peak = timed(lambda: model(input_ids=prompt, block_length=32, logits_to_keep=1), device, 1)
    kwargs = dict(max_new_tokens=32, block_length=32, threshold=0.95, eos_early_stop=False)
    kwargs.update(mask_token_id=model.config.mask_token_id, eos_token_id=model.config.eos_token_id)
    generate_s, out, generate_peak = timed(
        lambda: model.generate(prompt, return_dict_in_generate=True, **kwargs), device, 1
    )
    return {
        "prompt_tokens": length,
        "prefill_ms": round(prefill_s * 1e3, 1),
        "prefill_peak_gib": round(prefill_peak / 2**30, 2),
        "generate_32_ms": round(generate_s * 1e3, 1),
        "generate_peak_gib": round(generate_peak / 2**30, 2),
        "nfe": int(out.nfe),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="a small float32 model on the CPU (CI's quick check)")
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=None,
        help="tokens of the long prompt (default: none on a GPU, 128 on the CPU)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per model after the untimed one")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    shape = dict(LLADA2_MINI, max_position_embeddings=131072) if gpu else dict(SMALL, vocab_size=1024)
    vocab = shape["vocab_size"]
    ids = HUB_IDS if gpu else dict(mask=vocab - 4, eos=vocab - 3, delete=vocab - 2, split=vocab - 1)
    prompt_len, new_tokens = (512, 128) if gpu else (16, 32)
    long_length = args.long_prompt if args.long_prompt is not None else (0 if gpu else 128)
    repeats = args.repeats
    base = build_model(shape, ids, dtype, device)
    torch.manual_seed(1)
    prompt = torch.randint(0, vocab - 4, (1, prompt_len), device=device)
    kwargs = dict(
        max_new_tokens=new_tokens,
        block_length=32,
        threshold=0.7,
        editing_threshold=0.5,
        max_post_steps=16,
        eos_early_stop=False,
        mask_token_id=ids["mask"],
        eos_token_id=ids["eos"],
        return_dict_in_generate=True,
    )
    device_name = torch.cuda.get_device_name(device) if gpu else "cpu"
    rows, summary = [], {"device": device_name, "dtype": str(dtype), "shape": "LLaDA2.0-mini" if gpu else "small"}
    compared = variants(shape["num_experts"], ids)
    for name, fields in compared.items():
        model = base if not fields else variant(base, fields, dtype, device)
        seconds, out, peak = timed(lambda m=model: m.generate(prompt, **kwargs), device, repeats)
        nfe = int(out.nfe)
        config = model.resolve_generation_config(**{k: v for k, v in kwargs.items() if k != "return_dict_in_generate"})
        step_ms, _, _ = block_step(model, prompt, config, device, repeats=10 if gpu else 1, in_a_row=10 if gpu else 1)
        rows.append(
            {
                "variant": name,
                "family": model.diffusion_family.name,
                "step_ms": round(step_ms, 3),
                "nfe": nfe,
                "ms_per_forward": round(seconds * 1e3 / nfe, 3),
                "tokens_per_s": round(new_tokens / seconds, 1),
                "peak_gib": round(peak / 2**30, 2),
            }
        )
        if model is not base:
            del model
        sync(device)
    first = rows[0]
    for row in rows:
        row["step_vs_llada21"] = round(row["step_ms"] / first["step_ms"], 3)
        row["vs_llada21"] = round(row["ms_per_forward"] / first["ms_per_forward"], 3)
    summary["rows"] = rows
    summary["same_forwards"] = len({row["nfe"] for row in rows}) == 1
    summary["goal_step_within_1_1x"] = rows[1]["step_vs_llada21"] <= 1.1
    if long_length:
        llada22 = variant(base, compared["LLaDA2.2 + block routing"], dtype, device)
        del base
        summary["long_prompt"] = long_prompt(llada22, long_length, device)
    print(f"{device_name}, {dtype}, {summary['shape']} shape, batch 1, prompt {prompt_len}, {new_tokens} new tokens")
    print(
        f"{'variant':34} {'family':10} {'step ms':>8} {'vs 2.1':>7} {'nfe':>5} {'ms/forward':>11} {'vs 2.1':>7} "
        f"{'tokens/s':>9} {'peak GiB':>9}"
    )
    for row in rows:
        print(
            f"{row['variant']:34} {row['family']:10} {row['step_ms']:>8.3f} {row['step_vs_llada21']:>7.3f} "
            f"{row['nfe']:>5} {row['ms_per_forward']:>11.3f} {row['vs_llada21']:>7.3f} {row['tokens_per_s']:>9.1f} "
            f"{row['peak_gib']:>9.2f}"
        )
    if not summary["same_forwards"]:
        print("the variants made different forwards: compare the block steps, not ms/forward")
    print(f"goal_step_within_1_1x: {'met' if summary['goal_step_within_1_1x'] else 'NOT met'}")
    if long_length:
        long = summary["long_prompt"]
        print(
            f"long prompt {long['prompt_tokens']} tokens: prefill {long['prefill_ms']} ms (peak {long['prefill_peak_gib']} "
            f"GiB), then 32 tokens in {long['generate_32_ms']} ms (peak {long['generate_peak_gib']} GiB, {long['nfe']} forwards)"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
