"""Worker of test_diffusion_gemma_tensor_parallel.py, started by `torchrun --nproc-per-node N` (2 or 4):
DiffusionGemma under transformers' tensor parallelism through its config's own `base_model_tp_plan`
(`tp_plan="auto"`).

Rank 0 writes a tiny DiffusionGemma checkpoint (the fixture's shape, but as many key/value heads as ranks and at
least 2 in every layer, so that every attention layer splits; random float32 weights, seeded) to OUT's folder and
records what one process gives (no plan): the logits of one forward and the tokens of seeded `generate()` calls.
Then every rank loads it with `tp_plan="auto"` and records the same, under the same seeds (the draws are identical
on every rank); rank 0 saves {"single": ..., "ranks": [...], "reference_logits": ...} to OUT (torch.save), the
last one (a float32 forward on the CPU, one process) where DTYPE is not float32.

With a fifth argument `ep`, its `base_model_ep_plan` too (`DistributedConfig(tp_size=N, ep_size=N)`: each rank
holds its share of the experts, the attention and dense MLP split as under `tp`; transformers' `all_reduce`
dispatch masks the routes to the other ranks' experts). `tp,ep`: one launch loads and records both in turn (one
process's record shared). Each is saved to OUT with `{mode}` replaced by the plan's name.

With a sixth argument `logits`, only the forward's logits (no `generate()` calls): the fused path in Triton's
interpreter (`HF_DLLM_KERNELS=triton`) pays per operation, and its layers are what a plan wraps.

Usage: torchrun --nproc-per-node N gemma_tp_worker.py OUT DEVICE DTYPE [tp|ep|tp,ep [logits]]
(DEVICE cpu -> gloo, cuda -> nccl)
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "diffusion-gemma-tiny-ref"
PROMPTS = [[11, 40, 72, 9, 150, 33, 201, 17], [0, 0, 0, 64, 12, 99, 5, 180]]  # the second row left-padded
# (name, seed, generate kwargs): the fixture's `eb05` profile over two canvases with an EOS that row 0 samples in its
# first canvas (it ends, the batch goes on); a cold schedule whose rows stop after different numbers of steps (9, 7).
SETTINGS = [
    (
        "eos",
        2,
        dict(
            max_new_tokens=32,
            max_denoising_steps=8,
            sampler_config={"entropy_bound": 0.5},
            confidence_threshold=0.5,
            eos_token_id=281,
            pad_token_id=0,
        ),
    ),
    (
        "cold",
        3,
        dict(
            max_new_tokens=16,
            max_denoising_steps=12,
            t_min=0.1,
            t_max=0.5,
            stability_threshold=0,
            confidence_threshold=1.0,
        ),
    ),
]

# On CUDA, a rank still running after this long is taken as hung (stacks dumped, exit).
HANG_AFTER_S = int(os.environ.get("GEMMA_TP_HANG_AFTER_S", 420))
# NCCL's communicator shutdown (`destroy_process_group`) waited forever on two GPUs while the model (its captured
# collectives) was alive; it is dropped first (docs/multi-gpu.md), so a rank still shutting down after this long
# fails at once (exit status 3) rather than at the test's limit.
SHUTDOWN_S = 30
# Settings also run over the static cache on the CPU (on CUDA every run uses it): it holds this rank's heads only.
STATIC_SETTINGS = ("eos",)


def say(what: str) -> None:
    """A progress line on stderr (the test prints it when the ranks fail or do not finish)."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def write_checkpoint(path: Path, ranks: int) -> None:
    """The fixture's config with at least 2 key/value heads in every layer and as many as there are `ranks`
    (every attention layer splits; the fixture's 4 query heads and 4 experts split up to 4 ways), random weights
    (seed 0)."""
    import hf_dllm

    config = json.loads((FIXTURE / "config.json").read_text())
    text = config["text_config"]
    text["num_key_value_heads"] = max(text["num_key_value_heads"], ranks)
    text["per_layer_config"]["2"]["num_key_value_heads"] = max(2, ranks)
    config = hf_dllm.DiffusionGemmaConfig.from_dict(config)
    torch.manual_seed(0)
    model = hf_dllm.DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():  # the fixture's recipe, roughly: sharpened logits so that decoding is non-trivial
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)


@torch.no_grad()
def record(model, device: str, logits_only: bool = False) -> dict:
    from hf_dllm.kernels import kernel_mode

    ids = torch.tensor(PROMPTS, device=device)
    mask = (ids != 0).long()
    canvas = torch.arange(16, device=device).expand(2, -1) * 19 % 320
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=canvas).logits.float().cpu()
    say(f"{device}: forward done")
    generated = {}
    for name, seed, kwargs in [] if logits_only else SETTINGS:
        # the static cache, CUDA's default, on the CPU too for STATIC_SETTINGS (as "<name>-static")
        for static in (None, True) if name in STATIC_SETTINGS and device == "cpu" else (None,):
            model.static_cache = static
            torch.manual_seed(seed)
            out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
            say(f"{device}: generate {name}{'-static' if static else ''} done")
            generated[name + ("-static" if static else "")] = (out.sequences.cpu(), out.nfe_per_row.cpu())
        model.static_cache = None
    # the static cache's key/value heads per layer (the last generate() call's; None without one)
    cache = getattr(model, "_generate_cache", None)
    cache_heads = None if cache is None else [keys.shape[1] for keys in cache.storage_keys]
    layers = model.model.decoder.layers
    return {
        "logits": logits,
        "generated": generated,
        "cache_heads": cache_heads,
        "q_rows": [local_rows(layer.self_attn.q_proj.weight) for layer in layers],
        "experts": [local_rows(layer.experts.gate_up_proj) for layer in layers],
        # whether the decoder's passes ran as CUDA graphs (the fast path; never on the CPU)
        "graphs": bool(model._graphs is not None and model._graphs.entries),
        "kernel_mode": kernel_mode(),  # "triton": the fused layers (HF_DLLM_KERNELS=triton on the CPU)
    }


def local_rows(tensor) -> int:
    """This rank's size of a parameter's first dimension (a DTensor's local slice)."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).shape[0]


def parallel_kwargs(mode: str, ranks: int) -> dict:
    """`from_pretrained`'s keywords for the plan `mode`: "tp" (the tensor plan, as the CLI loads it) or "ep" (the
    expert plan too: each rank holds its share of the experts)."""
    if mode == "ep":
        from transformers.distributed import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_size=ranks, ep_size=ranks)}
    if mode != "tp":
        raise ValueError(f"the plan must be 'tp' or 'ep', got {mode!r}")
    from hf_dllm.tensor_parallel import tensor_parallel_load_kwargs

    return tensor_parallel_load_kwargs()


def main() -> None:
    import torch.distributed as dist
    from transformers import AutoModel

    import hf_dllm  # noqa: F401  (registers the model type)

    out, device, dtype = Path(sys.argv[1]), sys.argv[2], getattr(torch, sys.argv[3])
    if device == "cuda":
        # A rank stuck in a collective: every thread's stack on stderr, then exit (the test shows them).
        faulthandler.dump_traceback_later(HANG_AFTER_S, exit=True)
        # One grouped-GEMM config for every product: the autotuner would time each config at every new shape and
        # row key (one process's shapes, then the shards', on each rank: ~2-4 s a key), most of a run here. Any
        # config computes the same products (the kernel tests cover the configs).
        from hf_dllm import grouped_gemm

        def first_config(gated, n, k, groups, bucket, weight_dtype, configs=None):
            return (configs or grouped_gemm.grouped_configs())[0]

        grouped_gemm.pinned_config = first_config
    # One checkpoint per launch: the test runs its tp and ep launches at once in the same folder, and a shared
    # folder let one launch rewrite the files the other's ranks were reading.
    checkpoint = out.parent / f"{out.stem}-checkpoint"
    logits_only = len(sys.argv) > 5 and sys.argv[5] == "logits"
    backend = "gloo" if device == "cpu" else "nccl"
    dist.init_process_group(backend)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    single = None
    reference = None
    if rank == 0:
        write_checkpoint(checkpoint, ranks)
        single = record(AutoModel.from_pretrained(checkpoint, dtype=dtype).eval().to(device), device, logits_only)
        if dtype != torch.float32:  # what both runs' rounding is measured against: one process in float32, the CPU
            reference = record(AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval(), "cpu", True)
    say(f"rank {rank}: at the barrier")
    dist.barrier()
    if device == "cuda":
        torch.cuda.set_device(rank)
    modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["tp"]
    for mode in modes:
        model = AutoModel.from_pretrained(checkpoint, dtype=dtype, **parallel_kwargs(mode, ranks)).eval()
        say(f"rank {rank}: {mode} model loaded")
        result = record(model, f"cuda:{rank}" if device == "cuda" else "cpu", logits_only)
        gathered = [None] * ranks
        dist.all_gather_object(gathered, result)
        if rank == 0:
            reference_logits = None if reference is None else reference["logits"]
            saved = Path(str(out).format(mode=mode))
            torch.save({"single": single, "ranks": gathered, "reference_logits": reference_logits}, saved)
        dist.barrier()
        del model
        gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        faulthandler.cancel_dump_traceback_later()
        watchdog = threading.Timer(
            SHUTDOWN_S, lambda: (say(f"rank {rank}: destroy_process_group did not return"), os._exit(3))
        )
        watchdog.daemon = True
        watchdog.start()
    dist.destroy_process_group()
    say(f"rank {rank}: done")


if __name__ == "__main__":
    main()
