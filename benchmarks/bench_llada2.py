"""Speed of `generate()` for LLaDA2.x MoE models (issue "The LLaDA 2.x family"), against the reference `generate()`.

GPU setting: a LLaDA2.0-mini-shaped model (the Hub config's fields: 20 layers, hidden 2048, 16 heads / 4 KV heads of
128, dense first layer of 5120, 256 experts of 512 top-8 in 8 groups (top 4 groups), 1 shared expert, vocab 157184)
with random bf16 weights built on the GPU; prompt 512, 256 new tokens, block 32, batch 1 / 8 / 32, one token per
step (`steps=256`) and 4 tokens per step (`steps=64`), `eos_early_stop=False`, the exact block cache, CUDA graphs.

Also measured:
- one block step (CUDA events around steps replayed back to back after warm-up, as the loop queues them; also
  each step timed alone from an idle GPU, `step_alone_ms`, which adds the host's preparation of the step) and its
  **weight-read floor**:
  the bytes of every weight the step reads (attention, dense layer, shared experts, final norm, LM head, and the
  distinct routed experts the step actually selected, counted by hooks on the routers during one eager step of the
  same block) over the measured copy bandwidth (read + write of a 4 GiB buffer);
- the whole generation's floor (GPU): each forward's weight bytes as above, its routed experts counted in one eager
  run of the same call (`generation_routing`; `tokens_equal_eager` says whether it decoded the timed run's tokens),
  summed over the forwards, and the timed generation over it (`forward_over_floor`: ms per forward over the mean
  floor per forward). A block's first steps select the fewest experts (its positions are nearly all masks); as its
  positions are committed, its steps select more (random weights: ~28 -> ~80 of 256 per layer in a CPU check of
  the shape), so the one timed step above is the least favourable to the floor;
- the reference `generate()` (the Hub's `modeling_llada2_moe.py`, batch 1, same weights shared in place), when
  `--reference-code DIR` names a folder holding the Hub's `modeling_llada2_moe.py` and `configuration_llada2_moe.py`
  (not shipped with hf_dllm). It is transformers-4 code: `patch_transformers_for_reference` adds the two names it
  needs from transformers 4. It recomputes the whole sequence every step, so it runs `--reference-new-tokens`
  (default 64: two blocks, shorter sequences than ours, which favours the reference).

`--quantization none,fp8` (issue #13) runs the same settings with the bf16 model and with its FP8 copy, quantized on
the GPU through transformers' API (`from_pretrained(..., quantization_config=fp8_quantization_config("llada2"))`:
128x128 weight blocks for attention, the dense layer and every expert's layers; the head stays bf16), and prints the
FP8 copy's logit error and top-1 agreement against bf16 over one prompt (`bench_generate.logit_agreement`).

Without a GPU: a small float32 model on the CPU (no reference unless asked).

Prints a table and ends with one JSON line.

    python benchmarks/bench_llada2.py --reference-code path/to/LLaDA2.0-mini-code
    python benchmarks/bench_llada2.py --quantization none,fp8 --batch-sizes 1,32 --tokens-per-step 1
    python benchmarks/bench_llada2.py --cpu
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_generate import copy_bandwidth, logit_agreement, quantize_fp8  # noqa: E402  (this folder: the script's own)

import hf_dllm  # noqa: E402
from hf_dllm.generation_utils import BlockDiffusionRun  # noqa: E402
from hf_dllm.graphs import StepGraphs  # noqa: E402

MASK_ID, EOS_ID = 156895, 156892  # the Hub tokenizer's <|mask|> and <|endoftext|>
LLADA2_MINI = dict(
    vocab_size=157184,
    hidden_size=2048,
    intermediate_size=5120,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=256,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    moe_intermediate_size=512,
    num_shared_experts=1,
    first_k_dense_replace=1,
    partial_rotary_factor=0.5,
    rope_theta=600000.0,
    routed_scaling_factor=2.5,
    score_function="sigmoid",
    use_qk_norm=True,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)
SMALL = dict(
    LLADA2_MINI,
    vocab_size=157184,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=64,
)


def build_model(
    shape: dict, dtype: torch.dtype, device: torch.device, attn_implementation: str | None = None
) -> hf_dllm.LLaDA2MoeModelLM:
    """Random weights; `attn_implementation` None = the model's default (`llada_triton`)."""
    config = hf_dllm.LLaDA2MoeConfig(**shape, mask_token_id=MASK_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_dllm.LLaDA2MoeModelLM._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int):
    """(median seconds, last result, peak bytes of the last call) of `fn()` after one untimed call (warm-up)."""
    fn()
    times, peak, result = [], 0, None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
    return statistics.median(times), result, peak


@torch.no_grad()
def block_step(model, prompts, config, device, repeats: int = 30, in_a_row: int = 10, expert_ids: bool = False):
    """(ms of one block step after the block's first step, ms of one such step timed alone, distinct routed
    experts per MoE layer in one step of that block: their count, or their ids with `expert_ids`). The first step
    prefills the prompt; the timed steps run on the block only.

    The first figure is the median over `repeats` runs of `in_a_row` steps queued back to back (per step), as the
    loop queues a block's steps: the host prepares step n + 1 while the GPU runs step n. The second times each step
    from an idle GPU to its end, so it also holds the host's preparation of that step (inputs, graph launch: ~0.3
    ms at batch 1 on an H100), which the loop hides."""
    run = BlockDiffusionRun(model, config, prompts, None, None)
    try:
        start, end = run.plan.blocks[0]
        steps = run.plan.block_steps[:, 0]
        run.unmasking.start_block(end - start, steps)
        run.cache_policy.start_block(start)
        run.run_step(start, end, 0)
        graphs, run.graphs = run.graphs, None  # one eager step, so the hooks see the routing
        with routed_expert_counts(model, expert_ids) as forwards:
            run.run_step(start, end, 1)
        run.graphs = graphs
        distinct = forwards[-1]
        for _ in range(3):  # warm-up and capture
            run.run_step(start, end, 1)

        def timed_steps(count: int) -> float:
            if device.type != "cuda":
                t0 = time.perf_counter()
                for _ in range(count):
                    run.run_step(start, end, 1)
                return 1000 * (time.perf_counter() - t0) / count
            sync(device)
            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(count):
                run.run_step(start, end, 1)
            finish.record()
            finish.synchronize()
            return begin.elapsed_time(finish) / count

        alone = statistics.median(timed_steps(1) for _ in range(repeats))
        in_row = statistics.median(timed_steps(in_a_row) for _ in range(max(3, repeats // in_a_row)))
        return in_row, alone, distinct
    finally:
        StepGraphs.release_to(model)


@torch.no_grad()
def profile_block_step(model, prompts, config, top: int = 25) -> str:
    """torch.profiler table of one eager block step (the kernels a graph replay runs), by CUDA time."""
    run = BlockDiffusionRun(model, config, prompts, None, None)
    try:
        run.graphs = None
        start, end = run.plan.blocks[0]
        run.unmasking.start_block(end - start, run.plan.block_steps[:, 0])
        run.cache_policy.start_block(start)
        run.run_step(start, end, 0)
        run.run_step(start, end, 1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            run.run_step(start, end, 1)
            torch.cuda.synchronize()
        events = profiler.key_averages()
        kernels = sum(event.count for event in events if event.device_type == torch.autograd.DeviceType.CUDA)
        table = events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=90)
        return f"{kernels} kernel launches in one block step\n{table}"
    finally:
        StepGraphs.release_to(model)


@contextlib.contextmanager
def routed_expert_counts(model, ids: bool = False):
    """Yields a list that gets, for every forward run inside the block, the distinct routed experts of each MoE
    layer (a list per forward): a pre-hook on the decoder starts each forward's list, hooks on the routers add each
    layer's count (with `ids`, the distinct expert ids, a CPU tensor). Eager forwards only: CUDA graph replays run no
    hooks."""
    forwards: list[list] = []

    def record(module, args, out):
        distinct = out[0].unique()
        forwards[-1].append(distinct.cpu() if ids else int(distinct.numel()))

    handles = [model.model.register_forward_pre_hook(lambda module, args: forwards.append([]))]
    handles += [
        layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers if hasattr(layer.mlp, "gate")
    ]
    try:
        yield forwards
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def generation_routing(model, prompts, kwargs: dict) -> tuple[torch.Tensor, list[list[int]]]:
    """(sequences, the distinct routed experts of each MoE layer in every forward) of one eager `generate()` with
    `kwargs` (`routed_expert_counts`). Where the eager run's tokens equal the timed run's, its routing is the timed
    run's, forward by forward."""
    with routed_expert_counts(model) as forwards:
        out = model.generate(prompts, **dict(kwargs, disable_compile=True))
    return out.sequences, forwards


def weight_read_bytes(model) -> tuple[int, int]:
    """(bytes of the weights every forward reads, bytes of one routed expert): every weight but the routed experts
    and the input embedding (a forward gathers a few of its rows), and one expert's three matrices. A forward's
    floor is the first plus the second times the distinct routed experts it selected (`floor_bytes`). Walks every
    parameter (~15,000 in LLaDA2.0-mini), so it is read once per model, not per forward."""
    every_forward = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if ".mlp.experts." not in name and "word_embeddings" not in name
    )
    first_moe = model.config.first_k_dense_replace
    expert = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if name.startswith(f"model.layers.{first_moe}.mlp.experts.0.")
    )
    return every_forward, expert


def floor_bytes(read_bytes: tuple[int, int], distinct_experts: list[int]) -> int:
    """Bytes one forward reads at the least: `weight_read_bytes`'s pair and the distinct routed experts each MoE
    layer selected in it."""
    every_forward, expert = read_bytes
    return every_forward + expert * sum(distinct_experts)


def patch_transformers_for_reference() -> None:
    """Names the Hub's transformers-4 `modeling_llada2_moe.py` imports that transformers 5 dropped: the default
    RoPE initialiser (transformers 4's `_compute_default_rope_parameters`) and `is_torch_fx_available`."""
    import transformers.modeling_rope_utils as rope_utils
    import transformers.utils.import_utils as import_utils

    import_utils.is_torch_fx_available = lambda: False

    def default_rope(config, device=None, seq_len=None, **kwargs):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        return 1.0 / (config.rope_theta**exponents), 1.0

    rope_utils.ROPE_INIT_FUNCTIONS["default"] = default_rope


def load_reference(code_dir: Path, model) -> torch.nn.Module:
    """The reference model class from `code_dir`, sharing `model`'s weights (no copy)."""
    patch_transformers_for_reference()
    package = types.ModuleType("llada2_reference")  # the files import each other relatively
    package.__path__ = [str(code_dir)]
    sys.modules[package.__name__] = package
    configuration = importlib.import_module(f"{package.__name__}.configuration_llada2_moe")
    modeling = importlib.import_module(f"{package.__name__}.modeling_llada2_moe")
    fields = {k: v for k, v in model.config.to_dict().items() if k not in ("auto_map", "architectures", "model_type")}
    config = configuration.LLaDA2MoeConfig(**fields)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        reference = modeling.LLaDA2MoeModelLM(config)
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False, assign=True)
    if unexpected or missing:
        raise RuntimeError(f"reference weights do not line up: missing {missing[:5]}, unexpected {unexpected[:5]}")
    device = next(model.parameters()).device
    # The rotary table is a non-persistent buffer (not in any checkpoint): rebuild that module on the device.
    reference.model.rotary_emb = type(reference.model.rotary_emb)(config=config, device=device)
    meta = [name for name, tensor in [*reference.named_parameters(), *reference.named_buffers()] if tensor.is_meta]
    if meta:
        raise RuntimeError(f"reference tensors left on the meta device: {meta[:5]}")
    return reference.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="small CPU setting (default when no GPU)")
    parser.add_argument("--batch-sizes", default=None, help="comma list (default GPU: 1,8,32; CPU: 1,4)")
    parser.add_argument("--tokens-per-step", default="1,4", help="comma list of tokens committed per step")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-code", type=Path, default=None, help="folder with the Hub's modeling files")
    parser.add_argument("--reference-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    parser.add_argument("--profile", default=None, help="comma list of batch sizes: profile one block step each")
    parser.add_argument(
        "--check-eager",
        action="store_true",
        help="compare tokens with disable_compile=True on the CPU too (always on a GPU)",
    )
    parser.add_argument("--attn", default=None, help="attn_implementation (default: the model's, llada_triton)")
    parser.add_argument(
        "--quantization", default="none", help="comma list of none (the dtype's weights) and fp8 (GPU only)"
    )
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available() and not args.cpu
    quantizations = args.quantization.split(",")
    if any(q not in ("none", "fp8") for q in quantizations):
        parser.error(f"--quantization takes a comma list of none and fp8, got {args.quantization!r}")
    if "fp8" in quantizations and not gpu:
        parser.error("--quantization fp8 needs a GPU (transformers quantizes FP8 on CUDA or XPU only)")
    device = torch.device("cuda" if gpu else "cpu")
    shape, dtype = (LLADA2_MINI, torch.bfloat16) if gpu else (SMALL, torch.float32)
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype)  # the reference's generate() builds a bf16 mask: it needs bf16
    prompt_len = args.prompt_len or (512 if gpu else 64)
    new_tokens = args.new_tokens or (256 if gpu else 64)
    block = args.block_length
    batch_sizes = [int(b) for b in (args.batch_sizes or ("1,8,32" if gpu else "1,4")).split(",")]
    device_name = torch.cuda.get_device_name(device) if gpu else "CPU"

    started = time.perf_counter()
    model = build_model(shape, dtype, device, args.attn)
    summary = {"device": device_name, "torch": torch.__version__, "dtype": str(dtype), "shape": "LLaDA2.0-mini"}
    summary["attn_implementation"] = model.config._attn_implementation
    summary.update(prompt_len=prompt_len, new_tokens=new_tokens, block_length=block)
    summary["build_s"] = round(time.perf_counter() - started, 1)
    summary["weights_gb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(json.dumps(summary), flush=True)

    models = {"none": model}
    if "fp8" in quantizations:
        started = time.perf_counter()
        models["fp8"] = quantize_fp8(model, device, model.config._attn_implementation)
        summary["fp8_quantize_s"] = round(time.perf_counter() - started, 1)
        summary["fp8_weights_gb"] = sum(p.numel() * p.element_size() for p in models["fp8"].parameters()) / 1e9
        with torch.no_grad():  # over one random prompt, one forward (block-causal)
            probe = torch.randint(0, shape["vocab_size"] - 512, (1, prompt_len), device=device)
            summary["fp8_vs_bf16_logits"] = logit_agreement(
                model(probe, block_length=block).logits, models["fp8"](probe, block_length=block).logits
            )
        print(json.dumps({key: summary[key] for key in ("fp8_weights_gb", "fp8_vs_bf16_logits")}), flush=True)
        if "none" not in quantizations:
            models.pop("none")
    if args.profile:
        for (quantization, tested), batch in ((m, int(b)) for m in models.items() for b in args.profile.split(",")):
            prompts = torch.randint(0, shape["vocab_size"] - 512, (batch, prompt_len), device=device)
            kwargs = dict(max_new_tokens=new_tokens, block_length=block, steps=new_tokens, mask_token_id=MASK_ID)
            config = tested.resolve_generation_config(**kwargs)
            print(f"{quantization}, batch {batch}:\n{profile_block_step(tested, prompts, config)}", flush=True)
        return 0

    if gpu:  # the weight-read floors' rate and each model's weight bytes, measured once
        summary["copy_bandwidth_tb_s"] = copy_bandwidth(device) / 1e12
        read_bytes = {quantization: weight_read_bytes(tested) for quantization, tested in models.items()}
    rows = []
    for (quantization, tested), batch in ((item, batch) for item in models.items() for batch in batch_sizes):
        torch.manual_seed(batch)
        prompts = torch.randint(0, shape["vocab_size"] - 512, (batch, prompt_len), device=device)
        for per_step in [int(t) for t in args.tokens_per_step.split(",")]:
            kwargs = dict(
                max_new_tokens=new_tokens,
                block_length=block,
                steps=new_tokens // per_step,
                threshold=None,
                mask_token_id=MASK_ID,
                eos_token_id=EOS_ID,
                eos_early_stop=False,
                return_dict_in_generate=True,
            )
            try:
                seconds, out, peak = timed(
                    lambda m=tested, p=prompts, k=kwargs: m.generate(p, **k), device, args.repeats
                )
            except torch.OutOfMemoryError as error:
                rows.append(
                    dict(quantization=quantization, batch=batch, tokens_per_step=per_step, error=f"OOM: {error}"[:120])
                )
                torch.cuda.empty_cache()
                continue
            with torch.no_grad():
                graphs = gpu and tested._diffusion_step_capturable()
            row = dict(
                quantization=quantization,
                cuda_graphs=graphs,
                batch=batch,
                tokens_per_step=per_step,
                nfe=out.nfe,
                ms_per_forward=1000 * seconds / out.nfe,
                tokens_per_s=batch * new_tokens / seconds,
                seconds=seconds,
                peak_gb=peak / 1e9,
            )
            if gpu or args.check_eager:
                # One eager run, its routing counted in every forward: the floor of the whole generation (its steps
                # route more tokens to more experts as a block's positions are committed; `block_step` times one
                # step near the start of a block, where the fewest experts are selected).
                eager_sequences, routing = generation_routing(tested, prompts, kwargs)
                row["tokens_equal_eager"] = bool(torch.equal(eager_sequences, out.sequences))
                row["forwards_counted"] = len(routing)
                row["generation_distinct_experts_per_layer"] = round(
                    statistics.mean(count for forward in routing for count in forward), 1
                )
                if gpu:
                    floor_gb = sum(floor_bytes(read_bytes[quantization], forward) for forward in routing) / 1e9
                    row["generation_floor_ms_per_forward"] = floor_gb / summary["copy_bandwidth_tb_s"] / len(routing)
                    # Per forward, not the call's totals: the eager run may make other forwards where its tokens differ.
                    row["forward_over_floor"] = row["ms_per_forward"] / row["generation_floor_ms_per_forward"]
            if per_step == 1:
                config = tested.resolve_generation_config(**kwargs)
                row["step_ms"], row["step_alone_ms"], distinct = block_step(tested, prompts, config, device)
                row["distinct_experts_per_layer"] = round(statistics.mean(distinct), 1)
                if gpu:
                    row["step_weight_gb"] = floor_bytes(read_bytes[quantization], distinct) / 1e9
                    row["floor_ms"] = row["step_weight_gb"] / summary["copy_bandwidth_tb_s"]
                    row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
                    row["step_alone_over_floor"] = row["step_alone_ms"] / row["floor_ms"]
            if batch == 1 and per_step == 1 and quantization == "none":
                summary["ours_batch1_output"] = out.sequences[0, prompt_len:].tolist()
            rows.append(row)
            print(json.dumps(row), flush=True)

    if args.reference_code is not None:
        reference = load_reference(args.reference_code, model)
        prompt = torch.randint(0, shape["vocab_size"] - 512, (1, prompt_len), device=device)
        ref_kwargs = dict(
            gen_length=args.reference_new_tokens, block_length=block, steps=block, threshold=1.0,
            eos_early_stop=False, temperature=0.0, eos_id=EOS_ID, mask_id=MASK_ID,
        )  # fmt: skip
        forwards = [0]
        forward = reference.forward  # its generate() calls self.forward directly: count there

        def counted_forward(*a, **k):
            forwards[0] += 1
            return forward(*a, **k)

        reference.forward = counted_forward
        with torch.no_grad():
            reference.generate(prompt, **dict(ref_kwargs, gen_length=block))  # warm-up
            forwards[0] = 0
            sync(device)
            t0 = time.perf_counter()
            ref_out = reference.generate(prompt, **ref_kwargs)
            sync(device)
            ref_seconds = time.perf_counter() - t0
        ours_kwargs = dict(
            max_new_tokens=args.reference_new_tokens, block_length=block, steps=args.reference_new_tokens,
            threshold=None, mask_token_id=MASK_ID, eos_token_id=EOS_ID, eos_early_stop=False,
        )  # fmt: skip
        ours_seconds, ours_out, _ = timed(lambda: model.generate(prompt, **ours_kwargs), device, args.repeats)
        generated = ours_out[0, prompt_len:]
        compared = min(ref_out.shape[1], generated.shape[0])
        summary["reference"] = dict(
            new_tokens=args.reference_new_tokens,
            nfe=forwards[0],
            seconds=ref_seconds,
            tokens_per_s=args.reference_new_tokens / ref_seconds,
            ms_per_forward=1000 * ref_seconds / max(forwards[0], 1),
            ours_same_setting_tokens_per_s=args.reference_new_tokens / ours_seconds,
            same_setting_speedup=ref_seconds / ours_seconds,
            tokens_equal_fraction=float((ref_out[0, :compared] == generated[:compared]).float().mean()),
        )
        batch1 = next(
            (r for r in rows if (r["quantization"], r["batch"], r["tokens_per_step"]) == ("none", 1, 1)), None
        )
        if batch1 is not None:
            summary["reference"]["batch1_speedup_at_full_length"] = batch1["tokens_per_s"] / (
                args.reference_new_tokens / ref_seconds
            )
        print(json.dumps(summary["reference"]), flush=True)

    print()
    print(f"{device_name}, {dtype}, LLaDA2.0-mini shape, prompt {prompt_len}, {new_tokens} new tokens, block {block}")
    print(
        f"{'quant':>6}{'batch':>6}{'tok/step':>9}{'NFE':>6}{'ms/fwd':>9}{'tok/s':>10}"
        f"{'step ms':>9}{'alone ms':>9}{'floor ms':>9}{'gen floor':>10}{'fwd/floor':>10}{'peak GB':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['quantization']:>6}{r['batch']:>6}{r['tokens_per_step']:>9}  {r['error']}")
            continue
        step = f"{r['step_ms']:.2f}" if "step_ms" in r else "-"
        alone = f"{r['step_alone_ms']:.2f}" if "step_alone_ms" in r else "-"
        floor = f"{r['floor_ms']:.2f}" if "floor_ms" in r else "-"
        gen_floor = f"{r['generation_floor_ms_per_forward']:.2f}" if "generation_floor_ms_per_forward" in r else "-"
        over = f"{r['forward_over_floor']:.2f}x" if "forward_over_floor" in r else "-"
        print(
            f"{r['quantization']:>6}{r['batch']:>6}{r['tokens_per_step']:>9}{r['nfe']:>6}{r['ms_per_forward']:>9.2f}"
            f"{r['tokens_per_s']:>10.1f}{step:>9}{alone:>9}{floor:>9}{gen_floor:>10}{over:>10}{r['peak_gb']:>9.2f}"
        )
    if "reference" in summary:
        ref = summary["reference"]
        print(
            f"reference generate(), batch 1, {ref['new_tokens']} new tokens: {ref['tokens_per_s']:.2f} tok/s, "
            f"{ref['ms_per_forward']:.1f} ms/forward; hf_dllm same setting {ref['ours_same_setting_tokens_per_s']:.1f} "
            f"tok/s ({ref['same_setting_speedup']:.1f}x)"
        )
    summary.pop("ours_batch1_output", None)
    summary["rows"] = rows
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
