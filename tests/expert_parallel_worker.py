"""Worker of tests/generation/test_expert_parallel.py, started by `torchrun --nproc-per-node N` (gloo on CPU, NCCL on
GPUs): loads the tiny MoE fixtures of `CASES` with transformers' expert parallelism
(`distributed_config=DistributedConfig(tp_size=N, ep_size=N)`: each rank keeps E / N routed experts whole; LLaDA2's
attention, dense and shared layers tensor-parallel as `tp_plan="auto"` shards them) and records on every rank what
`record` returns, plus the experts each MoE layer kept and this rank's parameter bytes; rank 0 saves all ranks'
records to `OUT` (torch.save). tensor_parallel_worker.py runs these cases too (`run`), after its own, for 2 ranks.

Usage: torchrun --nproc-per-node N tests/expert_parallel_worker.py OUT DEVICE DTYPE [CASE ...]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "tensor_parallel_worker", Path(__file__).parent / "tensor_parallel_worker.py"
)
tp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tp_worker)

FIXTURES = tp_worker.FIXTURES
# case -> (checkpoint, config overrides, generate() settings: (name, kwargs) as tensor_parallel_worker's SETTINGS).
# LLaDA2.2's block routing (config `block_size` / `expert_capacity`, here on the LLaDA2.0 fixture: LLaDA2.2's own
# decodes with Levenshtein editing): per block of 4 positions at most 4 of the 8 experts; routing is replicated, so
# expert parallelism must give the same tokens with it.
CASES = {
    "llada2": (FIXTURES / "llada2-tiny-ref", {}, tp_worker.SETTINGS["llada2"][:1]),
    "llada22_block_routing": (
        FIXTURES / "llada2-tiny-ref",
        dict(block_size=4, expert_capacity=4),
        tp_worker.SETTINGS["llada2"][:1],
    ),
    "llada_moe": (
        FIXTURES / "lladamoe-tiny-ref",
        {},
        [("dual_cache", dict(steps=8, use_cache=True, dual_cache=True))],
    ),
}
# LLaDA-MoE under tensor parallelism (`tp_plan="auto"`: its plan splits only the experts' widths, for the loop over
# the sharded experts), the same checks but each rank holding a slice of every expert.
CASES["llada_moe_tensor"] = CASES["llada_moe"]
TENSOR_PARALLEL = ("llada_moe_tensor",)


def load(case: str, device: str, dtype: torch.dtype, ranks: int | None = None):
    """The fixture of `case`, with expert parallelism over `ranks` ranks (tensor parallelism for `TENSOR_PARALLEL`;
    None: one process, on `device`)."""
    from transformers import AutoModel

    import hf_dllm  # noqa: F401  (registers the model types)

    path, overrides, _ = CASES[case]
    kwargs = dict(overrides, dtype=dtype)
    if ranks is not None and case in TENSOR_PARALLEL:
        kwargs["tp_plan"] = "auto"
    elif ranks is not None and case == "llada_moe":  # transformers' own sum of the experts' outputs (`AutoEP`)
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=ranks, ep_size=ranks)
    elif ranks is not None:  # hf_dllm's (`tensor_parallel.EP_IMPLEMENTATION`, `parallel_load_kwargs`)
        from hf_dllm.tensor_parallel import parallel_load_kwargs

        kwargs.update(parallel_load_kwargs("expert", ranks))
    model = AutoModel.from_pretrained(path, **kwargs).eval()
    return model if ranks is not None else model.to(device)


@torch.no_grad()
def record(model, case: str, device: str) -> dict:
    """`tensor_parallel_worker.record` for the case's settings, the same first setting with the experts as a loop
    (`experts_implementation="eager"`), each MoE layer's kept experts `(first, count)` and the parameter bytes
    this rank holds (`experts`: the routed experts', `total`)."""
    from hf_dllm.grouped_gemm import ExpertList
    from hf_dllm.tensor_parallel import local_tensor

    settings = CASES[case][2]
    result = tp_worker.record(model, "llada2", device, settings)
    model.set_experts_implementation("eager")
    ids, mask = tp_worker.inputs(device)
    result["experts_loop"] = model.generate(ids, attention_mask=mask, **tp_worker.COMMON, **settings[0][1]).sequences
    result["experts_loop"] = result["experts_loop"].cpu()
    model.set_experts_implementation("grouped_mm")
    lists = [module for module in model.modules() if isinstance(module, ExpertList)]
    result["kept"] = [(experts.first, experts.num_experts) for experts in lists]
    nbytes = {"experts": 0, "total": 0}
    for name, parameter in model.named_parameters():
        size = local_tensor(parameter).numel() * parameter.element_size()
        nbytes["total"] += size
        nbytes["experts"] += size if ".experts." in name else 0
    result["bytes"] = nbytes
    if device == "cuda":
        result["graphs_captured"] = bool(
            getattr(model, "_hf_dllm_step_graphs", None) and model._hf_dllm_step_graphs.steps
        )
    return result


def run(device: str, dtype: torch.dtype, cases: list[str] | None = None) -> dict:
    """`ep:<case>` -> every rank's `record`, for `cases` (default: all), in the running process group."""
    import os

    import torch.distributed as dist

    results = {}
    for case in cases or list(CASES):
        model = load(case, device, dtype, ranks=int(os.environ["WORLD_SIZE"]))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, record(model, case, device))
        results[f"ep:{case}"] = gathered
        del model
    return results


def main() -> None:
    import torch.distributed as dist

    out_path, device, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
    torch.set_num_threads(1)
    results = run(device, dtype, sys.argv[4:])
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
