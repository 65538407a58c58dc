"""LLaDA-MoE-7B-A1B shape (issue #63, item 5): hf_dllm against the Hub's modeling code driven by LLaDA's reference
`generate()`, in one run, and the batch-1 block step against its weight-read floor.

GPU setting: the Hub config's shape (`LLADA_MOE_7B`: hidden 2048, 16 layers, every layer MoE, 16 heads and 16 K/V
heads of 128, 64 experts top-8 of width 1024, vocabulary 157184, q/k norms, RoPE theta 50000), random bf16 weights
built on the GPU; the Hub model class gets the same weights. Batch 1, prompt 256, 128 new tokens, block 32:

- reference: the Hub code (`modeling_lladamoe.py`, sdpa) and LLaDA's `generate()` (no cache: the Hub code refuses
  one), 128 steps (one token per forward);
- ours, dual cache, the same 128 steps; ours, dual cache, `threshold` 0.9 (random weights rarely reach it: about
  one token per forward too). CUDA graphs and the Triton MoE kernels as `generate()` picks them.

Reported: ms per forward, forwards, tokens/s and the speed-up over the reference (goal: dual cache >= 3x), and the
batch-1 block step (a step after the block's first, on the block's 32 positions, steps queued back to back as the
loop queues them; timed after the rows, as `generate()` runs it, and before them, while its graph is the first the
process captured: it replays faster then, see `first_step` below; also without the router's product in the routing
kernel, without the next norm in the MoE's combine kernel (`LLaDAMoESparseMoeBlock`'s switches), with cuBLAS for the
dense products of the step's few rows (`triton_linear.FEW_ROWS_PRODUCTS`), without programmatic dependent launch
(`triton_ops.DEPENDENT_LAUNCH`), without the
attention's key splits merged in its own kernel (a second kernel merges them: `AttentionTiles.fold_merge=False`),
without the step's decision in one launch (`UnmaskingPolicy.commit_in_one_launch`) and with the autotuner's
grouped-product configs where `grouped_gemm.PINNED_CONFIGS` pins them) against its weight-read floor: the bytes of
every weight a step reads (attention, norms, routers, output head; the embedding's gathered rows aside) plus the
distinct experts the step's 32 tokens chose in each layer, over the device's measured copy bandwidth (goal: step
within 2x of the floor).

Also the step's attention alone (`attention_merge_rows`), at the batch-1 shape over 384 (this run's cache), 1024
and 2048 keys: the split-KV kernel with the splits' merge folded into it (one launch, the default) against the
merge as a second kernel (`AttentionTiles.fold_merge=False`), and whether the two give the same bits.

The reference code is never committed: `--reference DIR` names a folder holding `modeling_lladamoe.py`,
`configuration_lladamoe.py` (ZHZisZZ/dllm) and LLaDA's `generate.py` (`benchmarks/lladamoe_reference.py` says how to
copy them). Without it only hf_dllm's rows and the floor are measured.

`--profile N`: also N block steps under `torch.profiler`, their kernels by name and kind (`kernel_profile.py`).

`--cpu`: a tiny shape in float32 (seconds; checks that the script runs, timings mean nothing).

    python benchmarks/bench_llada_moe.py --reference /tmp/lladamoe-ref
    python benchmarks/bench_llada_moe.py --repeats 1 --profile 5
    python benchmarks/bench_llada_moe.py --cpu --reference /tmp/lladamoe-ref
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fp8_gemm import timed_us  # noqa: E402
from bench_generate import copy_bandwidth, forget_graphs, switched  # noqa: E402
from bench_llada2 import sync, timed  # noqa: E402
from kernel_profile import print_profile, profile_calls  # noqa: E402

from hf_dllm import (  # noqa: E402
    LLaDAMoEConfig,
    LLaDAMoEModelLM,
    grouped_gemm,
    triton_attention,
    triton_linear,
    triton_ops,
)
from hf_dllm.block_loop import BlockDiffusionRun  # noqa: E402
from hf_dllm.decoding import UnmaskingPolicy  # noqa: E402
from hf_dllm.graphs import StepGraphs  # noqa: E402
from hf_dllm.modeling_llada_moe import LLaDAMoESparseMoeBlock  # noqa: E402

# inclusionAI/LLaDA-MoE-7B-A1B-Base's config.json (fields this model reads).
LLADA_MOE_7B = dict(
    vocab_size=157184,
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    expert_intermediate_size=1024,
    dense_intermediate_size=8192,
    moe_layer_freq=[1] * 16,
    qk_layernorm=True,
    rope_theta=50000.0,
    max_position_embeddings=8192,
    partial_rotary_factor=1.0,
    tie_word_embeddings=False,
)
TINY = dict(
    LLADA_MOE_7B,
    vocab_size=1024,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=16,
    num_experts_per_tok=4,
    expert_intermediate_size=64,
    dense_intermediate_size=256,
    moe_layer_freq=[1, 1],
)
# The Hub tokenizer's <|mask|> and <|endoftext|> ids (LLaDA-MoE shares LLaDA2's vocabulary); a tiny model: its last.
HUB_MASK, HUB_EOS = 156895, 156892


def build_model(shape: dict, mask: int, eos: int, dtype, device) -> LLaDAMoEModelLM:
    config = LLaDAMoEConfig(**shape, pad_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    with torch.device(device):
        model = LLaDAMoEModelLM._from_config(config, dtype=dtype)
    model.generation_config.mask_token_id = mask
    return model.eval()


def distinct_experts(model, ids: torch.Tensor, columns: slice) -> list[int]:
    """Distinct experts each MoE layer's router picks for the tokens at `columns` of one forward over `ids`."""
    counts = []

    def count(module, args, output):
        logits = output[1].view(ids.shape[0], ids.shape[1], -1)[:, columns]
        counts.append(int(logits.topk(module.top_k, dim=-1).indices.unique().numel()))

    handles = [layer.mlp.register_forward_hook(count) for layer in model.model.layers if layer.is_moe]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return counts


def floor_bytes(model, distinct: list[int]) -> int:
    """Bytes a batch-1 block step reads at the least: every weight but the routed experts and the input embedding
    (a step gathers a few of its rows), plus each layer's distinct experts' three matrices."""
    every = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if ".mlp.experts." not in name and "embed_tokens" not in name
    )
    expert = model.model.layers[0].mlp.experts[0]
    one = sum(p.numel() * p.element_size() for p in expert.parameters())
    return every + one * sum(distinct)


@contextlib.contextmanager
def block_steps(model, prompt, config):
    """A step of the first block after its first step (the block's 32 positions against the dual cache), warmed up
    and captured afresh (the model's runner is dropped first: it keeps each shape's graph as captured, so a step timed
    after a switch would replay the graph of before it): yields the call that runs one more, replayed from its CUDA
    graph; the graphs released after."""
    forget_graphs(model)
    run = BlockDiffusionRun(model, config, prompt, None, None)
    try:
        with torch.no_grad():
            start, end = run.plan.blocks[0]
            run.unmasking.start_block(end - start, run.plan.block_steps[:, 0])
            run.cache_policy.start_block(start)
            run.run_step(start, end, 0)
            for _ in range(3):  # warm-up and capture
                run.run_step(start, end, 1)
            yield lambda: run.run_step(start, end, 1)
    finally:
        StepGraphs.release_to(model)


def block_step_ms(model, prompt, config, device, repeats: int = 20, in_a_row: int = 10) -> float:
    """ms of one of `block_steps`, the median over `repeats` runs of `in_a_row` steps queued back to back."""
    with block_steps(model, prompt, config) as step:

        def steps_ms(count: int) -> float:
            sync(device)
            begin = time.perf_counter()
            for _ in range(count):
                step()
            sync(device)
            return 1000 * (time.perf_counter() - begin) / count

        return statistics.median(steps_ms(in_a_row) for _ in range(repeats))


def block_step_profile(model, prompt, config, device, steps: int) -> dict:
    """`kernel_profile.profile_calls` over `steps` of `block_steps`."""
    with block_steps(model, prompt, config) as step:
        return profile_calls(step, steps, device)


def attention_merge_rows(shape: dict, kv_lengths=(384, 1024, 2048), copies: int = 8) -> list[dict]:
    """GPU time of the batch-1 block step's attention alone (`shape`'s heads, 32 queries, bidirectional over
    `kv_lengths` cached keys, no padding mask, bf16), the key splits merged in the attention kernel (one launch) and
    by a second kernel (two launches); `copies` K/V copies taken in turn (none stays in L2, as in a step)."""
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape["hidden_size"] // heads
    folded = triton_attention.default_tiles(heads // kv_heads * 32)
    two_launches = dataclasses.replace(folded, fold_merge=False)
    q = torch.randn(1, heads, 32, dim, device="cuda", dtype=torch.bfloat16)
    rows = []
    for kv_len in kv_lengths:
        kv = [
            torch.randn(2, 1, kv_heads, kv_len, dim, device="cuda", dtype=torch.bfloat16).unbind(0)
            for _ in range(copies)
        ]
        row = dict(kv_len=kv_len)
        for name, tiles in (("folded", folded), ("two_launches", two_launches)):
            calls = [functools.partial(triton_attention.block_attention, q, *kv_copy, tiles=tiles) for kv_copy in kv]
            row[f"{name}_us"] = round(timed_us(calls, 4 * copies), 2)
        outs = [triton_attention.block_attention(q, *kv[0], tiles=tiles) for tiles in (folded, two_launches)]
        row["equal"] = torch.equal(*outs)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="a tiny float32 model on the CPU (CI's quick check)")
    parser.add_argument("--reference", type=Path, default=None, help="folder of the Hub code and LLaDA's generate.py")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per row after one untimed call")
    parser.add_argument("--profile", type=int, default=0, help="also profile this many block steps by kernel")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.profile < 0:
        parser.error("--repeats must be positive and --profile at least 0")
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    shape = LLADA_MOE_7B if gpu else TINY
    mask, eos = (HUB_MASK, HUB_EOS) if gpu else (shape["vocab_size"] - 1, shape["vocab_size"] - 2)
    prompt_len, new_tokens, block = (256, 128, 32) if gpu else (16, 32, 8)
    model = build_model(shape, mask, eos, dtype, device)
    torch.manual_seed(1)
    prompt = torch.randint(0, mask - 2, (1, prompt_len), device=device)
    base = dict(max_new_tokens=new_tokens, block_length=block, mask_token_id=mask, eos_early_stop=False)
    device_name = torch.cuda.get_device_name(device) if gpu else "cpu"
    summary = {"device": device_name, "dtype": str(dtype), "shape": "LLaDA-MoE-7B-A1B" if gpu else "tiny"}
    rows = []
    config = model.resolve_generation_config(steps=new_tokens, **base, use_cache=True, dual_cache=True)
    # The step while its graph is the first CUDA graph this process captured, as a diagnostic of the gaps a process's
    # fourth graph exec widens (docs/decisions/gpu-step.md). generate() captures a graph per step shape, so the step
    # after the rows is the one it runs.
    first_step = block_step_ms(model, prompt, config, device) if gpu else None

    def add(name: str, call, nfe_of):
        seconds, out, peak = timed(call, device, args.repeats)
        nfe = nfe_of(out)
        rows.append(
            dict(
                row=name,
                nfe=nfe,
                ms_per_forward=round(1000 * seconds / nfe, 3),
                tokens_per_s=round(new_tokens / seconds, 1),
                peak_gib=round(peak / 2**30, 2),
            )
        )
        return out

    dual = dict(base, use_cache=True, dual_cache=True, return_dict_in_generate=True)
    ours_steps = add(
        "ours, dual cache, fixed steps", lambda: model.generate(prompt, steps=new_tokens, **dual), lambda o: int(o.nfe)
    )
    add("ours, dual cache, threshold 0.9", lambda: model.generate(prompt, threshold=0.9, **dual), lambda o: int(o.nfe))
    if args.reference is not None:
        from lladamoe_reference import load_reference, reference_model

        model_class, config_class, reference_generate = load_reference(args.reference)
        reference = reference_model(model_class, config_class, model)
        out = add(
            "Hub code + LLaDA generate(), fixed steps",
            lambda: reference_generate(
                reference, prompt, steps=new_tokens, gen_length=new_tokens, block_length=block, mask_id=mask
            ),
            lambda o: new_tokens,  # one forward per step, no cache
        )
        # Ours without a cache decodes as the reference does: the same tokens (bf16 on a GPU: up to near-ties).
        plain = model.generate(prompt, steps=new_tokens, use_cache=False, **base)
        summary["tokens_equal_reference_without_cache"] = bool(torch.equal(plain, out))
        del reference
        reference_seconds = new_tokens / rows[-1]["tokens_per_s"]
        for row in rows[:-1]:
            row["speedup_vs_reference"] = round(reference_seconds / (new_tokens / row["tokens_per_s"]), 2)
        summary["goal_dual_cache_3x_reference"] = rows[0]["speedup_vs_reference"] >= 3
    summary["rows"] = rows

    step = block_step_ms(model, prompt, config, device) if gpu else None
    variants = {}
    if gpu:  # the same step without one of its fusions (each a switch of a class)
        switches = [
            (LLaDAMoESparseMoeBlock, "router_product_in_routing_kernel"),
            (LLaDAMoESparseMoeBlock, "norm_in_combine"),
            (triton_linear, "FEW_ROWS_PRODUCTS"),
            (triton_ops, "DEPENDENT_LAUNCH"),
        ]
        for owner, switch in [*switches, (UnmaskingPolicy, "commit_in_one_launch")]:
            with switched(owner, switch, False):
                variants[f"ms_without_{switch}"] = round(block_step_ms(model, prompt, config, device), 3)
        # The grouped products with the autotuner's configs where `grouped_gemm.PINNED_CONFIGS` pins them (the
        # autotuner's picks cleared before and after: each run chooses again).
        pinned = dict(grouped_gemm.PINNED_CONFIGS)
        grouped_gemm.PINNED_CONFIGS.clear()
        grouped_gemm._grouped_kernel.cache.clear()
        try:
            variants["ms_without_pinned_grouped_configs"] = round(block_step_ms(model, prompt, config, device), 3)
        finally:
            grouped_gemm.PINNED_CONFIGS.update(pinned)
            grouped_gemm._grouped_kernel.cache.clear()
        # The attention's key splits merged by a second kernel (`AttentionTiles.fold_merge=False`) at every layer.
        folded_tiles = triton_attention.default_tiles
        unfolded = lambda rows: dataclasses.replace(folded_tiles(rows), fold_merge=False)  # noqa: E731
        with switched(triton_attention, "default_tiles", unfolded):
            variants["ms_without_fold_merge"] = round(block_step_ms(model, prompt, config, device), 3)
    canvas = ours_steps.sequences
    distinct = distinct_experts(model, canvas, slice(prompt_len, prompt_len + block))
    summary["step"] = {"distinct_experts_per_layer": round(statistics.mean(distinct), 1)}
    summary["step"]["weight_gb"] = round(floor_bytes(model, distinct) / 1e9, 3)
    if gpu:
        bandwidth = copy_bandwidth(device)
        floor_ms = floor_bytes(model, distinct) / bandwidth * 1000
        summary["step"].update(
            ms_as_first_graph=round(first_step, 3),
            over_floor_as_first_graph=round(first_step / floor_ms, 2),
            ms=round(step, 3),
            copy_bandwidth_tb_s=round(bandwidth / 1e12, 2),
            floor_ms=round(floor_ms, 3),
            over_floor=round(step / floor_ms, 2),
            **variants,
        )
        summary["goal_step_within_2x_floor"] = step <= 2 * floor_ms
        with torch.no_grad():
            x = torch.zeros(1, shape["hidden_size"], dtype=dtype, device=device)
            summary["fused_experts"] = model.model.layers[0].mlp.uses_fused_kernels(x)
            summary["cuda_graphs"] = model._diffusion_step_capturable()
        summary["attention_merge"] = attention_merge_rows(shape)
    if args.profile:
        summary["step_profile"] = block_step_profile(model, prompt, config, device, args.profile)

    print(f"{device_name}, {dtype}, {summary['shape']} shape, batch 1, prompt {prompt_len}, {new_tokens} new tokens")
    print(f"{'row':42} {'nfe':>5} {'ms/forward':>11} {'tokens/s':>9} {'speed-up':>9} {'peak GiB':>9}")
    for row in rows:
        speedup = row.get("speedup_vs_reference", "")
        print(
            f"{row['row']:42} {row['nfe']:>5} {row['ms_per_forward']:>11.3f} {row['tokens_per_s']:>9.1f} "
            f"{speedup!s:>9} {row['peak_gib']:>9.2f}"
        )
    step_line = summary["step"]
    if gpu:
        print(
            f"block step {step_line['ms']} ms, floor {step_line['floor_ms']} ms ({step_line['weight_gb']} GB at "
            f"{step_line['copy_bandwidth_tb_s']} TB/s, {step_line['distinct_experts_per_layer']} experts per layer): "
            f"{step_line['over_floor']}x; as the process's first captured graph {step_line['ms_as_first_graph']} ms: "
            f"{step_line['over_floor_as_first_graph']}x"
        )
        print("  without " + ", ".join(f"{name[11:]}: {ms} ms" for name, ms in variants.items()))
        print("attention alone (us): keys, splits merged in the kernel, merged by a second kernel, same bits")
        for r in summary["attention_merge"]:
            print(f"{r['kv_len']:>6}{r['folded_us']:>10.2f}{r['two_launches_us']:>10.2f}  {r['equal']}")
    if args.profile:
        print_profile(summary["step_profile"])
    for goal in ("goal_dual_cache_3x_reference", "goal_step_within_2x_floor"):
        if goal in summary:
            print(f"{goal}: {'met' if summary[goal] else 'NOT met'}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
