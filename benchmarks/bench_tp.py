"""Tensor parallelism (`tp_plan="auto"` under torchrun) against one GPU, in the same run (issue "Tensor parallel").

For each model shape (random bf16 weights, saved once as a checkpoint so that the sharded run loads it through
`from_pretrained(..., tp_plan="auto")` exactly as users do):

- LLaDA-8B (bench_generate.py's shape: d_model 4096, 32 layers, 32 heads, MLP 12288, vocab 126464), dual cache;
- LLaDA2.0-mini (bench_llada2.py's shape: 20 layers, 256 experts of 512, top-8), its exact block cache;

prompt 512, 256 new tokens, block 32, one token per step (`steps=256`, so both runs make the same forwards),
`eos_early_stop=False`, CUDA graphs, batch 1 and 8: tokens/s of `generate()` and the median latency of one block
step (CUDA events around single steps after warm-up), first on one GPU (this process), then with `--tp` GPUs (a
`torchrun` child that loads the same checkpoint with `tp_plan="auto"`). Also reported: weight memory per GPU, whether
the ranks produced identical tokens (they must), the share of generated tokens equal to one GPU's (bf16: the shards
sum in another order, so greedy choices between near-tied tokens may differ), which of LLaDA2's fused paths the
step takes (`fused`; on the shards too), and issue #64's goals for `--tp 2` / `--tp 4` (`GOALS`, met or not).

Also: the collectives per forward of each run (`CollectiveCounter`, over one eager `generate()`; the token
agreement's broadcast included).

LLaDA2 (an MoE) is sharded twice (`--parallel`): tensor parallelism (every expert split over the GPUs) and expert
parallelism (`distributed_config=DistributedConfig(tp_size=N, ep_size=N)`: each GPU holds E / N experts whole, the
attention and shared expert still split). Per batch size the table says which layout
`hf_dllm.tensor_parallel.moe_parallelism`'s rule picks and which was faster; the goals are judged on the rule's pick.

Prints a table and ends with one JSON line. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`,
`TORCH_SYMM_MEM_DISABLE_MULTICAST=1`); `HF_DLLM_ALL_REDUCE=nccl` measures the sharded run without the
symmetric-memory all-reduces (hf_dllm/tensor_parallel.py).

    python benchmarks/bench_tp.py                           # both shapes, TP=2, batch 1 and 8
    python benchmarks/bench_tp.py --models llada --tp 2
    python benchmarks/bench_tp.py --models llada2 --tp 4 --parallel expert
    python benchmarks/bench_tp.py --cpu                     # tiny float32 shapes, 2 gloo processes: seconds
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
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_generate  # noqa: E402
import bench_llada2  # noqa: E402

import hf_dllm  # noqa: E402,F401

# Issue #64's goals: (model, batch, GPUs) -> (figure, bound, whether the figure must stay at most / at least it).
# `step_ratio`: the sharded block step over one GPU's; `speedup`: the sharded run's tokens/s over one GPU's.
GOALS = {
    ("llada", 1, 2): ("step_ratio", 0.60, "max"),
    ("llada", 1, 4): ("step_ratio", 0.40, "max"),
    ("llada2", 1, 4): ("step_ratio", 0.75, "max"),
    ("llada2", 8, 4): ("speedup", 1.8, "min"),
}
MODELS = ("llada", "llada2")
PARALLEL = ("tensor", "expert")
MOE_MODELS = ("llada2",)  # the models `--parallel expert` applies to
ATTENTION = {"llada": "llada_triton", "llada2": "sdpa"}  # each family's default backend
CACHE_NAME = {"llada": "dual", "llada2": "exact"}
# (GPU default, `--cpu` default) of the options whose default depends on the mode: the CPU run takes seconds.
DEFAULTS = dict(
    batch_sizes=("1,8", "1"), prompt_len=(512, 16), new_tokens=(256, 8), block_length=(32, 4), repeats=(2, 1)
)


def generate_kwargs(
    name: str, new_tokens: int, block: int, disable_compile: bool = False, mask_id: int = 0, eos_id: int = 0
) -> dict:
    kwargs = dict(
        disable_compile=disable_compile,
        max_new_tokens=new_tokens,
        block_length=block,
        steps=new_tokens,
        use_cache=True,
        eos_early_stop=False,
        return_dict_in_generate=True,
    )
    if name == "llada":
        kwargs["dual_cache"] = True
    else:
        kwargs.update(threshold=None, mask_token_id=mask_id, eos_token_id=eos_id)
    return kwargs


def prompts_for(batch: int, prompt_len: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The same prompts on every rank and in the single-GPU run (a CPU generator, seeded by the batch size)."""
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab - 512, (batch, prompt_len), generator=generator).to(device)


def vocab_of(model) -> int:
    return model.config.vocab_size


def fused_paths(model, name: str, device: torch.device) -> str:
    """Which of LLaDA2's fused paths (`moe`: router/combine kernels around the grouped GEMMs; `attention`: q/k norm,
    RoPE and cache write in one kernel) a cached block step takes on this rank: `moe+attention`, ..., `none`; `-`
    for LLaDA."""
    if name != "llada2":
        return "-"
    from hf_dllm.cache import DiffusionKVCache
    from hf_dllm.llada2_moe_layer import LLaDA2MoeSparseMoeBlock

    layer = next(layer for layer in model.model.layers if isinstance(layer.mlp, LLaDA2MoeSparseMoeBlock))
    probe = torch.zeros(1, 1, model.config.hidden_size, dtype=model.dtype, device=device)
    taken = {
        "moe": layer.mlp.use_fused(probe),
        "attention": layer.attention.uses_fused_path(probe, DiffusionKVCache(1, 1, 1)),
    }
    return "+".join(path for path, on in taken.items() if on) or "none"


# Communication ops, by operator namespace, that `CollectiveCounter` counts (waits and autograd wrappers are not
# collectives of their own). `symm_mem`: the symmetric-memory all-reduces of `hf_dllm.tensor_parallel`.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "symm_mem")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives (`c10d` ops: `torch.distributed`'s calls, DTensor's functional collectives, the
    symmetric-memory all-reduces) that run while it is active, by op name: a counting wrapper around every
    `torch.distributed` entry point at the dispatcher, which each of them goes through. Eager only (a CUDA graph
    replay dispatches nothing)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = str(func).partition(".")
        if namespace in COLLECTIVE_NAMESPACES and not name.startswith(NOT_COLLECTIVES):
            op = f"{namespace}.{name.split('.')[0]}"
            self.calls[op] = self.calls.get(op, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def collectives_per_forward(model, prompts, kwargs) -> tuple[float, dict]:
    """(collectives per forward of an eager `generate()` with `kwargs`, the counts by op over the whole call). Each
    forward is one denoising step here (`steps=new_tokens`, cached), so this is the collectives per step, the token
    agreement's broadcast included."""
    with CollectiveCounter() as counter:
        out = model.generate(prompts, **dict(kwargs, disable_compile=True))
    return counter.total / out.nfe, dict(sorted(counter.calls.items()))


@torch.no_grad()
def measure(model, name: str, args, device: torch.device) -> list[dict]:
    """Rows (one per batch size): tokens/s, ms per forward, block-step ms, collectives per forward, the generated
    tokens."""
    rows = []
    config = model.config
    timing = dict(repeats=3) if args.cpu else {}  # step medians: a few steps check the script on the CPU
    for batch in args.batch_sizes:
        prompts = prompts_for(batch, args.prompt_len, vocab_of(model), device)
        kwargs = generate_kwargs(
            name, args.new_tokens, args.block_length, args.disable_compile, config.mask_token_id, config.eos_token_id
        )
        seconds, out, peak, _ = bench_generate.timed_generate(model, prompts, kwargs, device, args.repeats)
        if name == "llada":
            step_ms = bench_generate.dual_step_ms(model, prompts, kwargs, device, **timing)
        else:
            resolved = model.resolve_generation_config(**kwargs)
            step_ms, _, _ = bench_llada2.block_step(
                model, prompts, resolved, device, **timing, in_a_row=2 if args.cpu else 10
            )
        per_forward, by_op = collectives_per_forward(model, prompts, kwargs)
        rows.append(
            dict(
                batch=batch,
                nfe=out.nfe,
                tokens_per_s=batch * args.new_tokens / seconds,
                ms_per_forward=1000 * seconds / out.nfe,
                step_ms=step_ms,
                peak_gb=peak / 1e9,
                graphs=bool(getattr(model, "_hf_dllm_step_graphs", None) and model._hf_dllm_step_graphs.steps),
                fused=fused_paths(model, name, device),
                collectives_per_forward=per_forward,
                collectives=by_op,
                sequences=out.sequences[:, args.prompt_len :].cpu(),
            )
        )
        print(
            f"[{name} batch {batch}] {rows[-1]['step_ms']:.2f} ms/step, {rows[-1]['tokens_per_s']:.1f} tok/s, "
            f"{per_forward:.1f} collectives/forward {by_op}",
            flush=True,
        )
    return rows


# `--cpu`: float32 shapes that run in seconds (a small vocabulary: the head is most of a tiny model's work).
CPU_SHAPES = {
    "llada": bench_generate.SMALL,
    "llada2": dict(bench_llada2.SMALL, vocab_size=1024, mask_token_id=1000, eos_token_id=999, pad_token_id=999),
}


def build_and_save(name: str, directory: Path, device: torch.device, cpu: bool):
    """The model with random weights (bf16; float32 and `CPU_SHAPES` with `--cpu`) on `device`, also saved
    (safetensors) to `directory`."""
    dtype = torch.float32 if cpu else torch.bfloat16
    if name == "llada":
        shape = CPU_SHAPES[name] if cpu else bench_generate.LLADA_8B
        model = bench_generate.build_model(shape, dtype, device, ATTENTION[name])
    elif cpu:
        torch.manual_seed(0)
        config = hf_dllm.LLaDA2MoeConfig(**CPU_SHAPES[name])
        model = hf_dllm.LLaDA2MoeModelLM._from_config(config, dtype=dtype, attn_implementation=ATTENTION[name]).eval()
    else:
        model = bench_llada2.build_model(bench_llada2.LLADA2_MINI, dtype, device)
    model.save_pretrained(directory)  # before any forward: the fused/stacked weight views do not exist yet
    return model


def weight_gb(model) -> float:
    from hf_dllm.tensor_parallel import local_tensor

    return sum(local_tensor(p).numel() * p.element_size() for p in model.parameters()) / 1e9


def worker(args) -> int:
    """One rank of the tensor-parallel run (started by torchrun)."""
    import torch.distributed as dist
    from transformers import AutoModel

    from hf_dllm.tensor_parallel import parallel_load_kwargs

    results = {}
    for name in args.models:
        for parallel in layouts(name, args.parallel):
            started = time.perf_counter()
            dtype = torch.float32 if args.cpu else torch.bfloat16
            split = parallel_load_kwargs(parallel, args.tp)
            model = AutoModel.from_pretrained(
                args.workdir / name, dtype=dtype, attn_implementation=ATTENTION[name], **split
            ).eval()
            device = next(model.parameters()).device
            load_s = time.perf_counter() - started
            rows = measure(model, name, args, device)
            for row in rows:  # every rank must hold rank 0's tokens
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, row["sequences"])
                row["ranks_agree"] = all(torch.equal(other, gathered[0]) for other in gathered)
            weights = [None] * dist.get_world_size()
            dist.all_gather_object(weights, weight_gb(model))
            results[name, parallel] = dict(
                rows=rows, weight_gb_per_gpu=max(weights), load_s=load_s, layers=model.config.num_hidden_layers
            )
            del model
            if not args.cpu:
                torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def layouts(name: str, parallel: list[str]) -> list[str]:
    """The layouts `name` is sharded with: `parallel`'s, expert parallelism for the MoE models only."""
    return [layout for layout in parallel if layout == "tensor" or name in MOE_MODELS]


def launch_tp(args, out: Path) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.tp),
        __file__, "--worker", "--out", str(out), "--workdir", str(args.workdir),
        "--models", ",".join(args.models), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
        "--parallel", ",".join(args.parallel),
        "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
        "--block-length", str(args.block_length), "--repeats", str(args.repeats), *(["--cpu"] if args.cpu else []),
        *(["--disable-compile"] if args.disable_compile else []),
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True)
    return torch.load(out, weights_only=False)


def moe_choices(results: list[dict], args) -> dict:
    """Per MoE model and batch size: the layout `moe_parallelism`'s rule picks (`HF_DLLM_MOE_PARALLEL` overrides it),
    the one whose block step was faster here (when both ran), and whether they agree; printed."""
    from hf_dllm.tensor_parallel import moe_parallelism

    choices = {}
    for name in MOE_MODELS:
        rows = [row for row in results if row["model"] == name]
        if not rows:
            continue
        config = hf_dllm.LLaDA2MoeConfig(**(CPU_SHAPES[name] if args.cpu else bench_llada2.LLADA2_MINI))
        for batch in args.batch_sizes:
            step = {row["parallel"]: row["tp_step_ms"] for row in rows if row["batch"] == batch}
            rule = moe_parallelism(config, batch, args.block_length)
            faster = min(step, key=step.get) if len(step) > 1 else None
            choices[f"{name}_batch{batch}"] = dict(rule=rule, faster=faster, step_ms=step, agree=faster in (None, rule))
            print(
                f"{name} batch {batch}: the rule picks {rule} parallelism; "
                + (f"{faster} was faster ({step})" if faster else "one layout measured")
            )
    return choices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of: llada, llada2")
    parser.add_argument("--tp", type=int, default=2, help="GPUs of the sharded runs")
    parser.add_argument(
        "--parallel",
        default=None,
        help="comma list of the layouts of the sharded runs: tensor, expert (MoE models only; default both, tensor "
        "alone where transformers has no expert parallelism)",
    )
    parser.add_argument("--batch-sizes", default=None, help="comma list (default 1,8; --cpu: 1)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 512 (--cpu: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (--cpu: 8)")
    parser.add_argument("--block-length", type=int, default=None, help="default 32 (--cpu: 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timed generate() calls (default 2; --cpu: 1)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the random checkpoints go (default: a temp dir)"
    )
    parser.add_argument("--disable-compile", action="store_true", help="eager steps (no CUDA graphs), both runs")
    parser.add_argument("--cpu", action="store_true", help="small float32 shapes on the CPU (gloo): checks the script")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for field, (gpu, cpu) in DEFAULTS.items():
        if getattr(args, field) is None:
            setattr(args, field, cpu if args.cpu else gpu)
    args.models = args.models.split(",")
    unknown = set(args.models) - set(MODELS)
    if unknown:
        raise ValueError(f"--models must name some of {MODELS}, got {sorted(unknown)}.")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.parallel is None:
        from hf_dllm.tensor_parallel import ALL_PARALLEL_STYLES

        args.parallel = ",".join(PARALLEL) if ALL_PARALLEL_STYLES is not None else "tensor"
        if ALL_PARALLEL_STYLES is None and not args.worker:
            import transformers

            print(f"expert parallelism needs transformers >= 5.24 (found {transformers.__version__}): tensor only")
    args.parallel = args.parallel.split(",")
    if set(args.parallel) - set(PARALLEL) or not args.parallel:
        raise ValueError(f"--parallel must name some of {PARALLEL}, got {args.parallel}.")
    if args.worker:
        return worker(args)
    if not args.cpu and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"bench_tp.py needs {args.tp} CUDA devices (--tp), found {torch.cuda.device_count()}.")

    device = torch.device("cpu" if args.cpu else "cuda:0")
    if args.cpu:
        torch.set_num_threads(1)  # as each rank of the sharded run (OMP_NUM_THREADS=1): comparable CPU timings
    cleanup = args.workdir is None
    if cleanup:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 60e9 else None
        args.workdir = Path(tempfile.mkdtemp(prefix="bench_tp_", dir=base))
    started = time.perf_counter()
    summary = {"device": "CPU" if args.cpu else torch.cuda.get_device_name(device), "torch": torch.__version__}
    summary["tp"] = args.tp
    import transformers

    summary.update(transformers=transformers.__version__, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    summary.update(block_length=args.block_length, workdir=str(args.workdir), disable_compile=args.disable_compile)
    single = {}
    try:
        for name in args.models:
            t0 = time.perf_counter()
            model = build_and_save(name, args.workdir / name, device, args.cpu)
            print(f"[{name}] built and saved in {time.perf_counter() - t0:.0f} s", flush=True)
            single[name] = dict(rows=measure(model, name, args, device), weight_gb_per_gpu=weight_gb(model))
            del model
            if not args.cpu:
                torch.cuda.empty_cache()
        sharded = launch_tp(args, args.workdir / "tp_results.pt")
    finally:
        if cleanup:
            shutil.rmtree(args.workdir, ignore_errors=True)

    print()
    print(
        f"{summary['device']}, {'float32' if args.cpu else 'bf16'}, prompt {args.prompt_len}, {args.new_tokens} new tokens, block {args.block_length}"
    )
    header = (
        f"{'model':<8}{'cache':>7}{'split':>8}{'batch':>6}{'GPUs':>5}{'GB/GPU':>8}{'step ms':>9}{'ms/fwd':>8}"
        f"{'tok/s':>8}{'x step':>8}{'=1GPU':>7}{'ranks=':>7}{'coll/fwd':>9}  fused"
    )
    print(header)
    results = []
    for name in args.models:
        for parallel in layouts(name, args.parallel):
            source = sharded[name, parallel]
            for one, tp in zip(single[name]["rows"], source["rows"], strict=True):
                same = float((one["sequences"] == tp["sequences"]).float().mean())
                for gpus, row, weights, split in (
                    (1, one, single[name]["weight_gb_per_gpu"], "-"),
                    (args.tp, tp, source["weight_gb_per_gpu"], parallel),
                ):
                    ratio = row["step_ms"] / one["step_ms"]
                    print(
                        f"{name:<8}{CACHE_NAME[name]:>7}{split:>8}{row['batch']:>6}{gpus:>5}{weights:>8.2f}"
                        f"{row['step_ms']:>9.2f}{row['ms_per_forward']:>8.2f}{row['tokens_per_s']:>8.1f}{ratio:>8.2f}"
                        + (f"{same:>7.2f}{str(row['ranks_agree']):>7}" if gpus > 1 else f"{'-':>7}{'-':>7}")
                        + f"{row['collectives_per_forward']:>9.1f}"
                        + f"  {row['fused']}"
                    )
                results.append(
                    dict(
                        model=name,
                        cache=CACHE_NAME[name],
                        parallel=parallel,
                        batch=one["batch"],
                        single_step_ms=one["step_ms"],
                        tp_step_ms=tp["step_ms"],
                        step_ratio=tp["step_ms"] / one["step_ms"],
                        single_tokens_per_s=one["tokens_per_s"],
                        tp_tokens_per_s=tp["tokens_per_s"],
                        single_ms_per_forward=one["ms_per_forward"],
                        tp_ms_per_forward=tp["ms_per_forward"],
                        single_weight_gb=single[name]["weight_gb_per_gpu"],
                        tp_weight_gb_per_gpu=source["weight_gb_per_gpu"],
                        tp_graphs=tp["graphs"],
                        single_fused=one["fused"],
                        tp_fused=tp["fused"],
                        ranks_agree=tp["ranks_agree"],
                        layers=source["layers"],
                        tp_collectives_per_forward=tp["collectives_per_forward"],
                        tp_collectives=tp["collectives"],
                        tokens_equal_single_gpu=same,
                        nfe=(one["nfe"], tp["nfe"]),
                    )
                )
    summary["moe_parallelism"] = moe_choices(results, args)
    summary["goals"] = {}
    for row in results:
        goal = None if args.cpu else GOALS.get((row["model"], row["batch"], args.tp))
        picked = summary["moe_parallelism"].get(f"{row['model']}_batch{row['batch']}", {}).get("rule", "tensor")
        if goal is None or row["parallel"] != picked:  # judged on the layout the rule picks
            continue
        figure, bound, kind = goal
        value = row["step_ratio"] if figure == "step_ratio" else row["tp_tokens_per_s"] / row["single_tokens_per_s"]
        met = value <= bound if kind == "max" else value >= bound
        name = f"{row['model']}_batch{row['batch']}_tp{args.tp}_{figure}"
        summary["goals"][name] = dict(value=value, goal=bound, kind=kind, met=met, parallel=row["parallel"])
        sign = "<=" if kind == "max" else ">="
        print(f"goal {name} ({row['parallel']}): {value:.2f} (goal {sign} {bound}) {'met' if met else 'NOT met'}")
    summary["total_s"] = round(time.perf_counter() - started, 1)
    summary["rows"] = results
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
