"""A LLaDA2.x-flash-shaped model (~100B parameters, MoE) across N GPUs with tensor or expert parallelism (issue #64,
"the flash shape").

LLaDA2.0-flash does not fit one H200 in bf16 (~200 GB), so there is no one-GPU reference: each rank of a `torchrun`
child builds its shard directly on its GPU, through the path users take (`from_pretrained(dir, tp_plan="auto")`),
from a checkpoint directory holding the config and a single tensor: transformers initialises every missing
parameter randomly (the model's `initializer_range`), each rank only its own slices, with the same seed on every
rank (the replicated router and q/k/v projection are then equal across ranks, as a real checkpoint's).

Measured per (batch, tokens per step): prompt 512, 256 new tokens, block 32, `eos_early_stop=False`, the exact
block cache, CUDA graphs: tokens/s of `generate()`, ms per forward, the median block step, per-GPU peak memory, the
collectives per forward, and the step's per-GPU weight-read floor: the bytes of the attention, dense and shared
weights this GPU reads (its slices; its q/k/v rows; the output head's vocabulary rows), plus what it holds of the
distinct routed experts the step touched (counted on an eager step: under tensor parallelism its slice of each;
under expert parallelism those of its own experts, whole), over the measured device copy bandwidth; the largest
rank's (the step waits for it).

Layouts (`--parallel`): `tensor` (`tp_plan="auto"`: every expert split over the GPUs), `expert`
(`DistributedConfig(tp_size=N, ep_size=N)`: E / N experts whole per GPU, attention and shared expert still split),
or `auto` (the default): each row under the layout `hf_dllm.tensor_parallel.moe_parallelism` picks for its batch
size. The goals are judged on the rule's pick.

`--cpu` loads a whole tiny random checkpoint (every layout reads the same weights) and also decodes each row in one
process: every layout's tokens must equal it (`tokens_equal_one_process`).

Goals (issue #64, 4x H200): batch-1 step (1 token per step) within 1.6x of its floor; batch 32 x 4 tokens per
step >= 5,000 tokens/s.

Prints a table and ends with one JSON line. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`,
`TORCH_SYMM_MEM_DISABLE_MULTICAST=1`).

    python benchmarks/bench_flash.py --gpus 4                 # batch 1/8/32 x 1 and 4 tokens per step
    python benchmarks/bench_flash.py --gpus 4 --parallel tensor,expert   # every row under both layouts
    python benchmarks/bench_flash.py --cpu                    # a tiny flash-like shape, 2 gloo processes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_generate  # noqa: E402
import bench_llada2  # noqa: E402
import bench_tp  # noqa: E402

import hf_dllm  # noqa: E402

# LLaDA2.0-flash's fields as quoted in public code: inclusionAI/dFactory, configs/model_configs/llada2_flash/
# config.json (commit c29d72c): 32 layers, hidden 4096, dense MLP 9216 (first layer), 32 query / 4 key-value heads
# of 128, 256 routed experts of 1024 (top-8 of 8 groups, 4 groups kept), one shared expert, vocabulary 157184,
# partial RoPE 0.5 (theta 600000), sigmoid scores, routed scaling 2.5. The same as LLaDA2.0-mini's (bench_llada2.py)
# for the fields not listed here; that config leaves out `use_qk_norm`, which the LLaDA2.0 report gives both sizes
# (QK-Norm, arXiv:2512.15745, Table 4.1) and LLaDA2.0-mini's config sets.
LLADA2_FLASH = dict(
    bench_llada2.LLADA2_MINI,
    hidden_size=4096,
    intermediate_size=9216,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=256,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    moe_intermediate_size=1024,
    num_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=16384,
)
# `--cpu`: the same structure, tiny (every head and expert count divisible by 2 and 4 ranks).
CPU_FLASH = dict(
    LLADA2_FLASH,
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    num_experts=16,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=32,
    max_position_embeddings=512,
)
GOAL_FLOOR_RATIO = 1.6  # batch-1 step / its per-GPU weight-read floor
GOAL_TOKENS_PER_S = 5000.0  # batch 32, 4 tokens per step
# (GPU default, --cpu default)
DEFAULTS = dict(
    batch_sizes=("1,8,32", "1,2"),
    tokens_per_step=("1,4", "1,2"),
    prompt_len=(512, 16),
    new_tokens=(256, 8),
    block_length=(32, 4),
    gpus=(4, 2),
)


def write_checkpoint(directory: Path, cpu: bool, layers: int | None = None) -> None:
    """The config (`layers` decoder layers instead of the shape's when given) and one tensor (the final norm's
    weight): `from_pretrained` initialises the rest randomly."""
    from safetensors.torch import save_file

    shape = dict(CPU_FLASH if cpu else LLADA2_FLASH)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = hf_dllm.LLaDA2MoeConfig(
        **shape, mask_token_id=bench_llada2.MASK_ID, eos_token_id=bench_llada2.EOS_ID, pad_token_id=bench_llada2.EOS_ID
    )
    if cpu:  # the tiny vocabulary holds no Hub special ids; every weight saved, so that the layouts load the same
        config.mask_token_id, config.eos_token_id, config.pad_token_id = 1000, 999, 999
        torch.manual_seed(0)
        hf_dllm.LLaDA2MoeModelLM._from_config(config, dtype=torch.float32).save_pretrained(directory)
        return
    config.save_pretrained(directory)
    norm = torch.ones(config.hidden_size, dtype=torch.bfloat16)
    save_file({"model.norm.weight": norm}, str(directory / "model.safetensors"), metadata={"format": "pt"})


def local_bytes(tensor: torch.Tensor) -> int:
    from hf_dllm.tensor_parallel import local_tensor

    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def step_read_floor_bytes(model, routed: list[torch.Tensor], batch: int) -> int:
    """Bytes of weights one block step reads on this GPU: every parameter's local slice except the routed experts,
    the embedding (a lookup reads `batch x block` rows, counted as the whole batch's rows at most) and the replicated
    q/k/v projections (each rank reads its heads' rows, `LLaDA2MoeAttention.local_projection`); plus, per MoE layer,
    the experts of `routed` (the distinct expert ids the step chose there) that this GPU holds, at the bytes it holds
    of each (tensor parallelism: a slice of every expert; expert parallelism: its own experts, whole)."""
    total = 0
    for name, parameter in model.named_parameters():
        if ".experts." in name or "word_embeddings" in name or "query_key_value" in name:
            continue
        total += local_bytes(parameter)
    embedding = model.model.word_embeddings.weight
    total += min(batch * 32, embedding.shape[0]) * embedding.shape[1] * embedding.element_size()
    moe_layers = []
    for layer in model.model.layers:
        weight, bias = layer.attention.local_projection()
        total += weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
        if hasattr(layer.mlp, "experts"):
            moe_layers.append(layer.mlp.experts)
    for experts, ids in zip(moe_layers, routed, strict=True):
        held = int(((ids >= experts.first) & (ids < experts.first + experts.num_experts)).sum())
        total += held * sum(local_bytes(p) for p in experts[experts.first].parameters())
    return total


def block_step_with_routing(model, prompts, config, device, **timing) -> tuple[float, list[torch.Tensor]]:
    """`bench_llada2.block_step`'s step ms and the distinct expert ids of each MoE layer in that step (which of them
    a GPU holds depends on the layout)."""
    step_ms, _, routed = bench_llada2.block_step(model, prompts, config, device, expert_ids=True, **timing)
    return step_ms, routed


def row_layouts(args, config) -> dict[int, list[str]]:
    """Batch size -> the layouts its rows run under: `--parallel`'s, or with `auto` the rule's pick."""
    from hf_dllm.tensor_parallel import moe_parallelism

    if args.parallel == ["auto"]:
        return {batch: [moe_parallelism(config, batch, args.block_length)] for batch in args.batch_sizes}
    return {batch: list(args.parallel) for batch in args.batch_sizes}


@torch.no_grad()
def worker(args) -> int:
    import torch.distributed as dist
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.workdir)
    layouts = row_layouts(args, config)
    rows, loads, weights, bandwidth = [], {}, {}, None
    for layout in dict.fromkeys(layout for batch in args.batch_sizes for layout in layouts[batch]):
        model, loads[layout] = load(args, layout)
        device = next(model.parameters()).device
        if bandwidth is None and not args.cpu:
            bandwidth = bench_generate.copy_bandwidth(device)
        first = True  # the collectives are counted on each layout's first row
        for batch in [batch for batch in args.batch_sizes if layout in layouts[batch]]:
            for per_step in args.tokens_per_step:
                rows.append(measure_row(model, args, layout, batch, per_step, device, bandwidth, first))
                first = False
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sum(local_bytes(p) for p in model.parameters()) / 1e9)
        weights[layout] = max(gathered)
        del model
        if not args.cpu:
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        torch.save(dict(rows=rows, load_s=loads, weight_gb_per_gpu=weights, bandwidth=bandwidth), args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def load(args, layout: str):
    """(The model split by `layout` over the `torchrun` ranks, seconds to load it)."""
    from transformers import AutoModel

    from hf_dllm.tensor_parallel import parallel_load_kwargs

    dtype = torch.float32 if args.cpu else torch.bfloat16
    torch.manual_seed(0)  # every rank initialises the same replicated weights (router, q/k/v)
    started = time.perf_counter()
    split = parallel_load_kwargs(layout, args.gpus)
    model = AutoModel.from_pretrained(args.workdir, dtype=dtype, attn_implementation="sdpa", **split).eval()
    return model, time.perf_counter() - started


def measure_row(model, args, layout: str, batch: int, per_step: int, device, bandwidth, first: bool) -> dict:
    """One row: `generate()` timed, the block step and its routing, the floor (the largest rank's), the collectives
    per forward (`first` row of a layout only: the same per forward at every batch), whether the ranks agree."""
    import torch.distributed as dist

    prompts = bench_tp.prompts_for(batch, args.prompt_len, model.config.vocab_size, device)
    kwargs = bench_tp.generate_kwargs(
        "llada2", args.new_tokens, args.block_length, False, model.config.mask_token_id, model.config.eos_token_id
    )
    kwargs["steps"] = args.new_tokens // per_step
    if not args.cpu:
        torch.cuda.reset_peak_memory_stats(device)
    seconds, out, _, _ = bench_generate.timed_generate(model, prompts, kwargs, device, args.repeats)
    config = model.resolve_generation_config(**kwargs)
    timing = dict(repeats=3, in_a_row=2) if args.cpu else {}
    step_ms, routed = block_step_with_routing(model, prompts, config, device, **timing)
    per_forward, by_op = None, None
    if first:
        one_block = dict(kwargs, max_new_tokens=args.block_length, steps=args.block_length // per_step)
        per_forward, by_op = bench_tp.collectives_per_forward(model, prompts, one_block)
    floors = [None] * dist.get_world_size()
    dist.all_gather_object(floors, step_read_floor_bytes(model, routed, batch))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out.sequences.cpu())
    row = dict(
        parallel=layout,
        batch=batch,
        tokens_per_step=per_step,
        nfe=out.nfe,
        tokens_per_s=batch * args.new_tokens / seconds,
        ms_per_forward=1000 * seconds / out.nfe,
        step_ms=step_ms,
        peak_gb=None if args.cpu else torch.cuda.max_memory_allocated(device) / 1e9,
        floor_gb=max(floors) / 1e9,
        floor_ms=None if bandwidth is None else 1000 * max(floors) / bandwidth,
        distinct_experts_per_layer=sum(ids.numel() for ids in routed) / max(1, len(routed)),
        collectives_per_forward=per_forward,
        collectives=by_op,
        ranks_agree=all(torch.equal(other, gathered[0]) for other in gathered),
        sequences=gathered[0] if args.cpu else None,
    )
    if dist.get_rank() == 0:
        print(
            f"[{layout}, batch {batch}, {per_step}/step] {step_ms:.2f} ms/step, {row['tokens_per_s']:.0f} tok/s, "
            f"floor {row['floor_gb']:.2f} GB",
            flush=True,
        )
    return row


def one_process_tokens(args, rows: list[dict]) -> None:
    """`--cpu`: each row decoded in this process from the same checkpoint; sets `tokens_equal_one_process`."""
    model = hf_dllm.LLaDA2MoeModelLM.from_pretrained(args.workdir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    device = torch.device("cpu")
    for row in rows:
        prompts = bench_tp.prompts_for(row["batch"], args.prompt_len, model.config.vocab_size, device)
        kwargs = bench_tp.generate_kwargs(
            "llada2", args.new_tokens, args.block_length, False, model.config.mask_token_id, model.config.eos_token_id
        )
        kwargs["steps"] = args.new_tokens // row["tokens_per_step"]
        with torch.no_grad():
            expected = model.generate(prompts, **kwargs).sequences
        row["tokens_equal_one_process"] = bool(torch.equal(expected, row.pop("sequences")))


def launch(args) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1")
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = args.workdir / "results.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
        __file__, "--worker", "--out", str(out), "--workdir", str(args.workdir),
        "--batch-sizes", ",".join(map(str, args.batch_sizes)),
        "--tokens-per-step", ",".join(map(str, args.tokens_per_step)), "--prompt-len", str(args.prompt_len),
        "--new-tokens", str(args.new_tokens), "--block-length", str(args.block_length), "--repeats", str(args.repeats),
        "--parallel", ",".join(args.parallel), *(["--cpu"] if args.cpu else []),
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True)
    return torch.load(out, weights_only=False)


def dict_args(args, parallel: list[str]):
    """`args` with `--parallel` replaced."""
    return argparse.Namespace(**dict(vars(args), parallel=parallel))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default 4; --cpu: 2)")
    parser.add_argument("--batch-sizes", default=None, help="comma list (default 1,8,32; --cpu: 1,2)")
    parser.add_argument("--tokens-per-step", default=None, help="comma list (default 1,4; --cpu: 1,2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 512 (--cpu: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (--cpu: 8)")
    parser.add_argument("--block-length", type=int, default=None, help="default 32 (--cpu: 4)")
    parser.add_argument("--repeats", type=int, default=1, help="timed generate() calls per row")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the shape's 32); fewer shorten the load, and the floor counts those layers",
    )
    parser.add_argument(
        "--parallel",
        default="auto",
        help="auto (each batch size under the layout moe_parallelism's rule picks), or a comma list of: tensor, expert",
    )
    parser.add_argument("--cpu", action="store_true", help="a tiny flash-like shape on the CPU (gloo)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for field, (gpu, cpu) in DEFAULTS.items():
        if getattr(args, field) is None:
            setattr(args, field, cpu if args.cpu else gpu)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.tokens_per_step = [int(t) for t in str(args.tokens_per_step).split(",")]
    for per_step in args.tokens_per_step:
        if per_step < 1 or args.block_length % per_step:
            raise ValueError(f"--tokens-per-step must divide --block-length ({args.block_length}), got {per_step}.")
    args.parallel = args.parallel.split(",")
    if args.parallel != ["auto"] and (not args.parallel or set(args.parallel) - {"tensor", "expert"}):
        raise ValueError(f"--parallel must be auto or a comma list of tensor, expert; got {args.parallel}.")
    if args.worker:
        return worker(args)
    from hf_dllm.tensor_parallel import parallel_load_kwargs

    if "tensor" not in args.parallel or len(args.parallel) > 1:  # auto or expert: refused here if unsupported
        parallel_load_kwargs("expert", args.gpus)
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"bench_flash.py needs {args.gpus} CUDA devices (--gpus), found {torch.cuda.device_count()}.")
    started = time.perf_counter()
    args.workdir = Path(tempfile.mkdtemp(prefix="bench_flash_"))
    try:
        write_checkpoint(args.workdir, args.cpu, args.layers)
        results = launch(args)
        if args.cpu:
            one_process_tokens(args, results["rows"])
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    import transformers

    device = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    print(f"\n{device} x{args.gpus}, LLaDA2.0-flash shape{' (tiny, --cpu)' if args.cpu else ''}")
    print(f"{'split':>7}{'batch':>6}{'tok/step':>9}{'tok/s':>9}{'ms/fwd':>8}{'step ms':>9}{'floor ms':>9}{'x floor':>8}"
          f"{'GB/GPU':>8}{'experts':>8}{'coll/fwd':>9}{'ranks=':>7}")  # fmt: skip
    config = hf_dllm.LLaDA2MoeConfig(**(CPU_FLASH if args.cpu else LLADA2_FLASH))
    picks = {batch: layouts[0] for batch, layouts in row_layouts(dict_args(args, ["auto"]), config).items()}
    for row in results["rows"]:
        row["rule_pick"] = picks[row["batch"]] == row["parallel"]
        row["step_over_floor"] = None if row["floor_ms"] is None else row["step_ms"] / row["floor_ms"]
        floor = "-" if row["floor_ms"] is None else f"{row['floor_ms']:.2f}"
        ratio = "-" if row["step_over_floor"] is None else f"{row['step_over_floor']:.2f}"
        peak = "-" if row["peak_gb"] is None else f"{row['peak_gb']:.1f}"
        collectives = "-" if row["collectives_per_forward"] is None else f"{row['collectives_per_forward']:.1f}"
        print(
            f"{row['parallel']:>7}{row['batch']:>6}{row['tokens_per_step']:>9}{row['tokens_per_s']:>9.0f}"
            f"{row['ms_per_forward']:>8.2f}{row['step_ms']:>9.2f}{floor:>9}{ratio:>8}{peak:>8}"
            f"{row['distinct_experts_per_layer']:>8.1f}{collectives:>9}{str(row['ranks_agree']):>7}"
        )
    for batch, pick in picks.items():
        step = {
            r["parallel"]: r["step_ms"] for r in results["rows"] if r["batch"] == batch and r["tokens_per_step"] == 1
        }
        faster = min(step, key=step.get) if len(step) > 1 else None
        print(f"batch {batch}: the rule picks {pick} parallelism" + (f"; {faster} was faster" if faster else ""))
    goals = {}
    picked = [r for r in results["rows"] if r["rule_pick"]]  # the goals are judged on the rule's layout
    batch1 = [r for r in picked if r["batch"] == 1 and r["tokens_per_step"] == 1]
    if batch1 and batch1[0]["step_over_floor"] is not None:
        value = batch1[0]["step_over_floor"]
        goals["batch1_step_over_floor"] = dict(
            value=value, goal=GOAL_FLOOR_RATIO, met=value <= GOAL_FLOOR_RATIO, parallel=batch1[0]["parallel"]
        )
    batch32 = [r for r in picked if r["batch"] == 32 and r["tokens_per_step"] == 4]
    if batch32 and args.layers in (None, LLADA2_FLASH["num_hidden_layers"]):  # tokens/s of the whole model only
        value = batch32[0]["tokens_per_s"]
        goals["batch32_x4_tokens_per_s"] = dict(
            value=value, goal=GOAL_TOKENS_PER_S, met=value >= GOAL_TOKENS_PER_S, parallel=batch32[0]["parallel"]
        )
    for name, goal in goals.items():
        print(
            f"goal {name} ({goal['parallel']}): {goal['value']:.2f} (goal {goal['goal']}) "
            f"{'met' if goal['met'] else 'NOT met'}"
        )
    summary = dict(
        device=device,
        gpus=args.gpus,
        parallelism=",".join(args.parallel),
        rule_picks=picks,
        layers=args.layers or (CPU_FLASH if args.cpu else LLADA2_FLASH)["num_hidden_layers"],
        torch=torch.__version__,
        transformers=transformers.__version__,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        block_length=args.block_length,
        weight_gb_per_gpu=results["weight_gb_per_gpu"],
        load_s=results["load_s"],
        copy_bandwidth_gb_s=None if results["bandwidth"] is None else results["bandwidth"] / 1e9,
        goals=goals,
        total_s=round(time.perf_counter() - started, 1),
        rows=results["rows"],
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
