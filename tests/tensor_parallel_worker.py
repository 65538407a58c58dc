"""Worker of tests/generation/test_tensor_parallel.py, started by `torchrun --nproc-per-node 2`: loads the tiny LLaDA, LLaDA2
and Dream fixtures with `tp_plan="auto"` and records, on every rank, the logits of one forward and the tokens of
`generate()` for each of `SETTINGS`; rank 0 saves all ranks' records to `OUT` (torch.save).

With the arguments `fused EXTRA`, only LLaDA2, through `record_fused` (its fused MoE and attention paths on the
shards; tests/kernels/test_tensor_parallel_fused.py runs it on the CPU with the kernels in Triton's interpreter), and
`cached_step` with the counts of the fused calls of the LLaDA2 checkpoint at the path EXTRA (`two_shared_experts`)
and of the fixture with sdpa attention (`sdpa`; the default is `llada_triton`). Without them, on CPU, also the
expert-parallel cases of `expert_parallel_worker.py` (`ep:<case>`), in the same processes (one torchrun for both
tests; on GPUs test_expert_parallel.py starts its own, which needs transformers >= 5.24).

Usage: torchrun --nproc-per-node 2 tests/tensor_parallel_worker.py OUT DEVICE DTYPE [fused EXTRA]
       (DEVICE cpu -> gloo, cuda -> nccl)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = {
    "llada": FIXTURES / "llada-tiny-ref",
    "llada2": FIXTURES / "llada2-tiny-ref",
    "dream": FIXTURES / "dream-tiny-ref",
}
PROMPTS = [[11, 40, 72, 9, 150, 33, 201, 17], [0, 0, 0, 64, 12, 99, 5, 180]]  # the second row left-padded
PAD = 301
# EOS is suppressed (`logits_eos_inf`): the tiny random models would otherwise end every row after a few tokens.
COMMON = dict(
    max_new_tokens=16,
    block_length=8,
    mask_token_id=310,
    eos_token_id=301,
    logits_eos_inf=True,
    return_dict_in_generate=True,
)
DREAM = dict(logits_eos_inf=False, eos_early_stop=False)
# Per model: (name, generate kwargs). LLaDA: no cache, dual cache, the confidence threshold with and without the dual
# cache; LLaDA2 (block-causal): its exact block cache, recomputation, the threshold; the per-expert loop instead of
# the grouped expert GEMMs. Dream (logit-shifted, grouped-query heads): its own rules with and without the dual cache,
# and the confidence threshold with it.
SETTINGS = {
    "llada": [
        ("no_cache", dict(steps=8, use_cache=False)),
        ("dual_cache", dict(steps=8, use_cache=True, dual_cache=True)),
        ("threshold", dict(threshold=0.3, use_cache=False)),
        ("threshold_dual_cache", dict(threshold=0.3, use_cache=True, dual_cache=True)),
    ],
    "llada2": [
        ("exact_cache", dict(steps=8, use_cache=True)),
        ("no_cache", dict(steps=8, use_cache=False)),
        ("threshold_exact_cache", dict(threshold=0.3, use_cache=True)),
    ],
    # Dream's rules have no `logits_eos_inf`: rows run to their end instead (no EOS stop).
    "dream": [
        ("entropy_dual_cache", dict(DREAM, steps=8, alg="entropy", use_cache=True, dual_cache=True)),
        ("maskgit_no_cache", dict(DREAM, steps=8, alg="maskgit_plus", use_cache=False)),
        (
            "threshold_dual_cache",
            dict(DREAM, alg="confidence_threshold", threshold=0.3, use_cache=True, dual_cache=True),
        ),
    ],
}
# Sampling with a different seed on each rank: the ranks must still agree (rank 0's tokens are kept).
SAMPLED = dict(steps=8, use_cache=False, temperature=1.0)


def inputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(PROMPTS, device=device)
    return ids, (ids != 0).long()


def load(name: str | Path, device: str, dtype: torch.dtype, **kwargs):
    """The fixture `name` of `MODELS`, or the checkpoint at the path `name`."""
    from transformers import AutoModel

    import hf_dllm  # noqa: F401  (registers the model types)

    path = name if isinstance(name, Path) else MODELS[name]
    model = AutoModel.from_pretrained(path, dtype=dtype, **kwargs).eval()
    return model if "tp_plan" in kwargs else model.to(device)


@torch.no_grad()
def record(model, name: str, device: str, settings: list | None = None) -> dict:
    """The logits of one forward of the prompts and the output of `generate()` for each of `settings` (default:
    the model's `SETTINGS`)."""
    ids, mask = inputs(device)
    logits = model(input_ids=ids, attention_mask=mask).logits.float().cpu()
    generated = {}
    for setting, kwargs in SETTINGS[name] if settings is None else settings:
        out = model.generate(ids, attention_mask=mask, **{**COMMON, **kwargs})
        generated[setting] = (out.sequences.cpu(), int(out.nfe))
    return {"logits": logits, "generated": generated}


# `record_fused`: a prefill of the prompts (two blocks of 4) into a `DiffusionKVCache`, then one cached block step.
FUSED_BLOCK = 4
# The exact block cache over the same blocks as SETTINGS["llada2"]'s, in 4 steps rather than 8: 6 forwards instead
# of 11, each slow in Triton's interpreter.
FUSED_SETTINGS = [("exact_cache", dict(steps=4, use_cache=True))]
FUSED_STEP_IDS = [[310, 310, 44, 310], [7, 310, 310, 310]]


def count_fused_calls(model) -> dict:
    """Counts of the calls of LLaDA2's fused MoE (`fused_forward`) and fused attention (`_fused_forward`) paths,
    through wrappers set on each layer's modules (a dict that the wrappers keep counting into)."""
    calls = {"moe": 0, "attention": 0}

    def counting(key, method):
        def counted(*args, **kwargs):
            calls[key] += 1
            return method(*args, **kwargs)

        return counted

    for layer in model.model.layers:
        layer.attention._fused_forward = counting("attention", layer.attention._fused_forward)
        if hasattr(layer.mlp, "fused_forward"):
            layer.mlp.fused_forward = counting("moe", layer.mlp.fused_forward)
    return calls


@torch.no_grad()
def cached_step(model, device: str) -> dict:
    """A prefill and one block step through a `DiffusionKVCache` (block-causal, blocks of `FUSED_BLOCK`): both
    forwards' logits, and the keys and values layer 1 (an MoE layer) cached, with the key/value heads they are."""
    from hf_dllm.cache import DiffusionKVCache

    ids, mask = inputs(device)
    step_ids = torch.tensor(FUSED_STEP_IDS, device=device)
    length = ids.shape[1] + step_ids.shape[1]
    key_mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)  # over the cache's whole buffer
    cache = DiffusionKVCache(model.config.num_hidden_layers, ids.shape[0], length)
    common = dict(attention_mask=key_mask, past_key_values=cache, use_cache=True, block_length=FUSED_BLOCK)
    prefill = model(ids, cache_position=torch.arange(ids.shape[1], device=device), **common).logits
    step = model(step_ids, cache_position=torch.arange(ids.shape[1], length, device=device), **common).logits
    return {
        "prefill": prefill.float().cpu(),
        "step": step.float().cpu(),
        "keys": cache.keys[1].float().cpu(),
        "values": cache.values[1].float().cpu(),
        "kv_heads": model.model.layers[1].attention.local_heads()[1],
    }


def record_fused(device: str, dtype: torch.dtype, extra: Path, **load_kwargs) -> tuple:
    """LLaDA2's `record` (generating with the exact block cache only: Triton's interpreter is slow) and
    `cached_step`, then the `cached_step` of the model at `extra` (two shared experts) and of LLaDA2 on sdpa, each
    with the counts of the fused paths' calls it made; returns (the LLaDA2 model, the record). `load_kwargs`:
    `tp_plan="auto"` in the worker, nothing in the tests' one-process reference."""
    model = load("llada2", device, dtype, **load_kwargs)
    calls = count_fused_calls(model)
    result = record(model, "llada2", device, FUSED_SETTINGS)
    result["cached_step"] = cached_step(model, device)
    result["fused_calls"] = dict(calls)
    for key, path, kwargs in (("two_shared_experts", extra, {}), ("sdpa", "llada2", {"attn_implementation": "sdpa"})):
        other = load(path, device, dtype, **load_kwargs, **kwargs)
        calls = count_fused_calls(other)
        result[key] = cached_step(other, device)
        result[f"{key}_fused_calls"] = dict(calls)
        del other
    return model, result


def main() -> None:
    import torch.distributed as dist

    out_path, device, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
    fused = sys.argv[4:5] == ["fused"]
    torch.set_num_threads(1)
    results = {}
    for name in ["llada2"] if fused else MODELS:
        if fused:
            model, result = record_fused(device, dtype, Path(sys.argv[5]), tp_plan="auto")
        else:
            model = load(name, device, dtype, tp_plan="auto")  # (sets up the process group)
            result = record(model, name, device)
        rank = dist.get_rank()
        if name == "llada":
            block = model.model.transformer.blocks[0]
            result["local_heads"] = (block.num_heads, block.num_kv_heads, tuple(block.q_proj.weight.to_local().shape))
            ids, mask = inputs(device)
            torch.manual_seed(1234 + rank)  # different random draws on each rank
            with torch.no_grad():
                sampled = model.generate(ids, attention_mask=mask, **COMMON, **SAMPLED)
            result["sampled"] = sampled.sequences.cpu()
        elif name == "dream":
            attention = model.model.layers[0].self_attn
            result["local_heads"] = (
                attention.num_heads,
                attention.num_kv_heads,
                tuple(attention.q_proj.weight.to_local().shape),
            )
        elif not fused:
            attention = model.model.layers[0].attention
            result["local_heads"] = (attention.num_heads, attention.num_kv_heads, attention.local_heads())
            # The per-expert loop (the sharded modules and their hooks) instead of the grouped GEMMs.
            model.set_experts_implementation("eager")
            ids, mask = inputs(device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, **COMMON, **SETTINGS[name][0][1])
            result["experts_loop"] = out.sequences.cpu()
        if device == "cuda":
            result["graphs_captured"] = bool(
                getattr(model, "_hf_dllm_step_graphs", None) and model._hf_dllm_step_graphs.steps
            )
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        results[name] = gathered
        del model
    if not fused and device == "cpu":  # expert parallelism in the same processes (test_expert_parallel.py's CPU tests)
        results.update(expert_parallel_worker().run(device, dtype))
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def expert_parallel_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "expert_parallel_worker", Path(__file__).parent / "expert_parallel_worker.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
