"""Worker of tests/test_tensor_parallel.py, started by `torchrun --nproc-per-node 2`: loads the tiny LLaDA, LLaDA2
and Dream fixtures with `tp_plan="auto"` and records, on every rank, the logits of one forward and the tokens of
`generate()` for each of `SETTINGS`; rank 0 saves all ranks' records to `OUT` (torch.save).

Usage: torchrun --nproc-per-node 2 tests/tensor_parallel_worker.py OUT DEVICE DTYPE   (DEVICE cpu -> gloo, cuda -> nccl)
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


def load(name: str, device: str, dtype: torch.dtype, **kwargs):
    from transformers import AutoModel

    import hf_dllm  # noqa: F401  (registers the model types)

    model = AutoModel.from_pretrained(MODELS[name], dtype=dtype, **kwargs).eval()
    return model if "tp_plan" in kwargs else model.to(device)


@torch.no_grad()
def record(model, name: str, device: str) -> dict:
    ids, mask = inputs(device)
    logits = model(input_ids=ids, attention_mask=mask).logits.float().cpu()
    generated = {}
    for setting, kwargs in SETTINGS[name]:
        out = model.generate(ids, attention_mask=mask, **{**COMMON, **kwargs})
        generated[setting] = (out.sequences.cpu(), int(out.nfe))
    return {"logits": logits, "generated": generated}


def main() -> None:
    import torch.distributed as dist

    out_path, device, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
    torch.set_num_threads(1)
    results = {}
    for name in MODELS:
        model = load(name, device, dtype, tp_plan="auto")
        rank = dist.get_rank()
        result = record(model, name, device)
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
        else:
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
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
