"""What the models need to run on the shards of transformers' tensor parallelism (`tp_plan="auto"`).

transformers shards a model by its config's `base_model_tp_plan` (Megatron-LM's scheme, arXiv:1909.08053): the
planned parameters become `DTensor`s holding one slice per rank, and the planned `nn.Linear`s get forward hooks
(a column-wise layer computes its slice of the outputs, a row-wise layer all-reduces its partial sums). This module
holds the few things the models add on top, because they multiply weights without calling the hooked modules
(concatenated q/k/v and gate/up weights, grouped expert GEMMs) or need to know which slice a rank holds:

- `local_tensor` / `local_shape`: a parameter's local slice (the tensor itself when not sharded), for products that
  multiply local weights directly; shapes read from it give per-rank head counts and widths.
- `shard_range`: which rows/columns of the full tensor the local slice holds.
- `all_reduce_partial`: sum partial results across the ranks of a sharded weight (no-op when not sharded), through
  `all_reduce`: PyTorch's symmetric-memory one-shot / two-shot kernels where they beat NCCL, NCCL / gloo elsewhere.
- `row_parallel_linear`: a row-wise sharded linear layer's product and its all-reduce, through `all_reduce`.
- `vocab_shard`, `local_head_logits`: a step's logits kept as this rank's vocabulary slice, reduced to the proposal
  before a small gather (`decoding.propose_tokens_sharded`) instead of gathering the whole vocabulary's logits.
- `agree_across_ranks`: every rank takes the first rank's copy of a denoising step's outputs, so ranks cannot
  diverge (sampling with per-rank random states, or collectives that are not bitwise identical on every rank).
- `tensor_parallel_group`: the model's tensor-parallel process group (None when it is not sharded).
- `LocalHeadCounts`: an attention layer's head counts read from its q/k weights (this rank's heads when sharded).
- `EXPERTS_STYLE` / `LocalExperts`: the expert-parallel style that keeps each rank's whole experts (see
  "expert parallelism" below), registered with transformers' parallel styles.
- `moe_parallelism`, `parallel_load_kwargs`: tensor or expert parallelism for an MoE model by batch size (a rule,
  overridable), and the `from_pretrained` arguments of each.

Every function is a no-op on models that are not sharded. This file is exported as Hub remote code.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch build without distributed support runs unsharded only
    dist = None
    DTensor = None
    Shard = None
try:  # transformers' expert parallelism (`DistributedConfig(ep_size=...)`, transformers >= 5.24)
    from transformers.distributed.expert_parallel import AllReduceEP, EPImplementationInterface, ExpertParallelLayer
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
except ImportError:
    AllReduceEP = EPImplementationInterface = ALL_PARALLEL_STYLES = None
    ExpertParallelLayer = object


def is_sharded(tensor) -> bool:
    """Whether `tensor` is a `DTensor` split across ranks (not merely replicated)."""
    return DTensor is not None and isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a `DTensor` parameter (the storage itself, no copy and no autograd), else `tensor`."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor._local_tensor
    return tensor


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of `tensor`: a replicated `DTensor`'s local copy, a sharded one gathered from its ranks, else
    `tensor` itself."""
    if DTensor is None or not isinstance(tensor, DTensor):
        return tensor
    return tensor.full_tensor() if is_sharded(tensor) else tensor._local_tensor


def local_shape(tensor: torch.Tensor) -> torch.Size:
    """Shape of this rank's slice (the full shape when not sharded)."""
    return local_tensor(tensor).shape


def shard_range(tensor: torch.Tensor, dim: int) -> tuple[int, int]:
    """`[start, stop)` of the full tensor's indices along `dim` held by this rank (`(0, size)` when not split
    along `dim`). Follows `torch.chunk`, as DTensor's `Shard` placement does."""
    size = tensor.shape[dim]
    if not is_sharded(tensor):
        return 0, size
    dim = dim % tensor.dim()
    (placement,) = tensor.placements
    if placement.dim % tensor.dim() != dim:
        return 0, size
    mesh = tensor.device_mesh
    chunk = -(-size // mesh.size())
    start = min(size, chunk * mesh.get_local_rank())
    return start, min(size, start + chunk)


def tensor_parallel_group(model: torch.nn.Module):
    """The process group of the model's tensor-parallel mesh, or None when the model is not sharded."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or dist is None or not dist.is_initialized() or (getattr(model, "_tp_size", None) or 1) <= 1:
        return None
    if mesh.ndim > 1:
        mesh = mesh["tp"]
    return mesh.get_group()


def all_reduce_partial(partial: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum `partial` (each rank's share of a result computed from its slice of `like`, a weight) over the ranks
    `like` is split across (`all_reduce`); unchanged when `like` is not sharded."""
    if not is_sharded(like):
        return partial
    return all_reduce(partial, like.device_mesh.get_group())


# -- all-reduce: PyTorch's symmetric-memory kernels where they beat NCCL --------------------------------------------
# A tensor-parallel step all-reduces small activations (a block of 32 tokens x 4096 in bf16 is 256 KiB) twice per
# layer, where NCCL's ~30 us per call dominates. PyTorch's symmetric-memory all-reduces (`torch.ops.symm_mem`) read
# the peers' buffers directly over NVLink: one-shot (every rank reads every peer's whole buffer; the lowest latency)
# for the smallest tensors, two-shot (reduce-scatter then all-gather through peer loads) up to a few MiB, NCCL
# beyond. Both work without NVLink multicast (NVLS), which stays off (`TORCH_SYMM_MEM_DISABLE_MULTICAST=1`,
# `NCCL_NVLS_ENABLE=0`): `multimem_all_reduce_`, which needs it, is never used. They capture in CUDA graphs.
ALL_REDUCE_ENV = "HF_DLLM_ALL_REDUCE"  # auto (the rule of `all_reduce_algorithm`), nccl, one_shot, two_shot
ALL_REDUCE_CHOICES = ("auto", "nccl", "one_shot", "two_shot")
ONE_SHOT_MAX_BYTES = 512 * 1024  # at most this: one-shot; benchmarks/bench_allreduce.py measures the crossovers
TWO_SHOT_MAX_BYTES = 16 * 1024 * 1024  # at most this: two-shot; larger: NCCL (also the symmetric buffer's size)
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes both kernels reduce
_symmetric_buffers: dict[str, torch.Tensor | None] = {}  # group name -> its rendezvoused buffer (None: refused)


def all_reduce_choice() -> str:
    """`HF_DLLM_ALL_REDUCE` (default `auto`), validated."""
    import os

    choice = os.environ.get(ALL_REDUCE_ENV, "auto")
    if choice not in ALL_REDUCE_CHOICES:
        raise ValueError(f"{ALL_REDUCE_ENV} must be one of {ALL_REDUCE_CHOICES}, got {choice!r}.")
    return choice


def symmetric_memory_available(device: torch.device) -> bool:
    """Whether PyTorch's symmetric-memory all-reduces can run on `device`: a CUDA device and a torch build with the
    one-shot and two-shot operators."""
    if device.type != "cuda" or dist is None:
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
    except ImportError:
        return False
    ops = getattr(torch.ops, "symm_mem", None)
    return all(hasattr(ops, name) for name in ("one_shot_all_reduce_copy", "two_shot_all_reduce_out"))


def all_reduce_algorithm(nbytes: int, dtype: torch.dtype, world_size: int, choice: str, symmetric: bool) -> str:
    """Which all-reduce sums a tensor of `nbytes` bytes of `dtype` over `world_size` ranks: `one_shot`,
    `two_shot` (the symmetric-memory kernels) or `collective` (the process group's own: NCCL, gloo).

    `choice`: `HF_DLLM_ALL_REDUCE`; `symmetric`: whether the group has a symmetric buffer (a CUDA group whose
    rendezvous succeeded). The symmetric kernels take bf16 / float32 tensors of whole 16-byte words that fit the
    buffer (two-shot: split in 16-byte words per rank); elsewhere, or with `choice="nccl"`, the collective. `auto`
    picks by size (`ONE_SHOT_MAX_BYTES`, `TWO_SHOT_MAX_BYTES`); `one_shot` / `two_shot` force that kernel wherever
    it can run."""
    if choice not in ALL_REDUCE_CHOICES:
        raise ValueError(f"choice must be one of {ALL_REDUCE_CHOICES}, got {choice!r}.")
    fits = symmetric and world_size > 1 and dtype in SYMMETRIC_DTYPES and 0 < nbytes <= TWO_SHOT_MAX_BYTES
    if choice == "nccl" or not fits or nbytes % 16:
        return "collective"
    two_shot_fits = nbytes % (16 * world_size) == 0
    if choice == "one_shot" or (choice == "auto" and nbytes <= ONE_SHOT_MAX_BYTES):
        return "one_shot"
    return "two_shot" if two_shot_fits else "collective"


def symmetric_buffer(group, device: torch.device) -> torch.Tensor | None:
    """The group's symmetric-memory buffer (`TWO_SHOT_MAX_BYTES` bytes), allocated and rendezvoused on first use:
    a collective call, so every rank makes it at the same all-reduce (they run the same forwards). None where the
    kernels are not available, while a CUDA graph is being captured (no rendezvous inside a capture: the eager
    warm-up step makes the buffer first), or where the rendezvous fails (the collective serves that group)."""
    name = group.group_name
    if name in _symmetric_buffers:
        return _symmetric_buffers[name]
    if not symmetric_memory_available(device) or torch.cuda.is_current_stream_capturing():
        return None
    import os
    import warnings

    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # only the P2P kernels are used
    try:
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a deprecated no-op since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        # Never an inference tensor (the first all-reduce may run under `torch.inference_mode()`): later steps
        # write it in place outside that mode.
        with torch.inference_mode(False):
            buffer = symm_mem.empty(TWO_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, name)
    except RuntimeError:  # e.g. no P2P access between the GPUs
        buffer = None
    _symmetric_buffers[name] = buffer
    return buffer


def all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum of `tensor` over the ranks of `group`: through the symmetric-memory kernel that
    `all_reduce_algorithm` picks (one-shot returns a new tensor), else the group's collective (NCCL, gloo; in
    place). Use the returned tensor."""
    choice = all_reduce_choice()
    buffer = None if choice == "nccl" else symmetric_buffer(group, tensor.device)
    nbytes = tensor.numel() * tensor.element_size()
    algorithm = all_reduce_algorithm(nbytes, tensor.dtype, group.size(), choice, buffer is not None)
    if algorithm == "collective" or not tensor.is_contiguous():
        dist.all_reduce(tensor, group=group)
        return tensor
    flat = tensor.view(-1)
    staging = buffer[:nbytes].view(tensor.dtype)
    if algorithm == "one_shot":  # the kernel copies `flat` into the buffer itself
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, flat, "sum", group.group_name).view_as(tensor)
    else:
        staging.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", group.group_name, flat)
    return tensor


def row_parallel_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`layer(x)` for a row-wise sharded `nn.Linear` (weight split by input columns, as transformers' `rowwise`
    plan style): this rank's partial product, summed by `all_reduce` (so every tensor-parallel all-reduce of the
    models takes the same path), then the bias once. None when `layer`'s weight is not split by columns. x `(...,
    in_features / ranks)` -> `(..., out_features)`. Inference only (the all-reduce has no backward): None while
    autograd records, where the plan's hook (DTensor) keeps the gradients right."""
    weight = _weight(layer)
    if not is_sharded(weight) or weight.placements[0].dim % weight.dim() != weight.dim() - 1:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    out = torch.nn.functional.linear(x, local_tensor(weight))
    out = all_reduce(out, weight.device_mesh.get_group())
    bias = layer._parameters.get("bias")
    return out if bias is None else out + local_tensor(bias)


def agree_across_ranks(model: torch.nn.Module, outputs: tuple) -> tuple:
    """`outputs` (tensors of one denoising step) as the tensor-parallel group's first rank computed them, on every
    rank (one broadcast; inside a CUDA graph when the step is captured). Unchanged when `model` is not sharded.

    Greedy decoding computes identical logits on every rank (the sharded layers' collectives return the same sum to
    all ranks), but sampling draws from each rank's own random state: taking one rank's tokens keeps the ranks'
    sequences, and with them every later forward, identical whatever the seeds."""
    group = tensor_parallel_group(model)
    if group is None:
        return outputs
    tensors = [output for output in outputs if output is not None]
    packed = torch.cat([tensor.reshape(-1).to(torch.long) for tensor in tensors])
    dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group)
    synced, offset = [], 0
    for output in outputs:
        if output is None:
            synced.append(None)
            continue
        synced.append(packed[offset : offset + output.numel()].view(output.shape).to(output.dtype))
        offset += output.numel()
    return tuple(synced)


# -- the output head's logits reduced to the step's proposal before any gather ---------------------------------------
# The head is split by vocabulary rows (`colwise_gather_output`): its hook gathers `(rows, L, vocab)` logits on every
# rank, 8 MiB per step for a batch-1 block of 32 over LLaDA's 126464-token vocabulary. A greedy low-confidence step
# needs only each position's best token and its probability, which each rank can reduce from its own vocabulary
# slice: (best logit, its id, log-sum-exp) per position, gathered (12 bytes per position) and combined
# (`decoding.propose_tokens_sharded`).
_LOCAL_HEAD = contextvars.ContextVar("hf_dllm_local_head", default=None)


class VocabShard(NamedTuple):
    """This rank's slice `[start, start + size)` of the vocabulary (the output head's rows) and the group the head is
    split across."""

    start: int
    size: int
    group: object


def vocab_shard(model: torch.nn.Module) -> VocabShard | None:
    """The vocabulary slice of `model`'s output head on this rank when tensor parallelism splits the head by rows,
    else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = None if head is None else head._parameters.get("weight")
    if weight is None or not is_sharded(weight) or weight.placements[0].dim % weight.dim() != 0:
        return None
    start, stop = shard_range(weight, 0)
    return VocabShard(start, stop - start, weight.device_mesh.get_group())


@contextlib.contextmanager
def local_head_logits(head: torch.nn.Module):
    """While active, `kernels.linear(head, x)` returns this rank's vocabulary slice of the logits `(..., size)`
    (`VocabShard`) instead of the gathered logits `(..., vocab)`."""
    token = _LOCAL_HEAD.set(head)
    try:
        yield
    finally:
        _LOCAL_HEAD.reset(token)


def local_head_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`layer`'s product with its local rows when `layer` is the head `local_head_logits` names, else None."""
    if _LOCAL_HEAD.get() is not layer:
        return None
    bias = layer._parameters.get("bias")
    return torch.nn.functional.linear(x, local_tensor(_weight(layer)), None if bias is None else local_tensor(bias))


def all_gather_stacked(tensor: torch.Tensor, group) -> torch.Tensor:
    """`(ranks, *tensor.shape)`: every rank's `tensor`, stacked in rank order."""
    gathered = tensor.new_empty((group.size() * tensor.shape[0], *tensor.shape[1:]))  # gloo: concatenated on dim 0
    dist.all_gather_into_tensor(gathered, tensor.contiguous(), group=group)
    return gathered.view(group.size(), *tensor.shape)


def _weight(module: torch.nn.Module) -> torch.Tensor:
    # `_parameters` first: nn.Module.__getattr__ costs about a microsecond per name, and the layers ask per forward.
    weight = module._parameters.get("weight")
    return weight if weight is not None else module.weight


class LocalHeadCounts:
    """Head counts of an attention layer with `q_proj` / `k_proj` projections and `head_dim`, read from the weights'
    shapes: this rank's share under tensor parallelism (column-wise q/k/v), all heads otherwise. Read at every call,
    so replaced weights (sharded or quantized loading) are always seen."""

    def _head_counts(self) -> tuple[int, int]:
        modules = self._modules
        return (
            local_shape(_weight(modules["q_proj"]))[0] // self.head_dim,
            local_shape(_weight(modules["k_proj"]))[0] // self.head_dim,
        )

    @property
    def num_heads(self) -> int:
        return self._head_counts()[0]

    @property
    def num_kv_heads(self) -> int:
        return self._head_counts()[1]

    @property
    def num_key_value_groups(self) -> int:
        heads, kv_heads = self._head_counts()
        return heads // kv_heads


# -- expert parallelism: whole experts per rank, through transformers' `base_model_ep_plan` ---------------------------
# transformers' expert parallelism (`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N, ep_size=N))`)
# shards stacked expert tensors by their first dimension (`grouped_gemm` style) and hands an experts module's
# `forward(hidden_states, top_k_index, top_k_weights)` the routes to its own experts (`ep_dispatch_experts`: at
# inference `AllReduceEP`, every rank runs its experts on the whole batch and one all-reduce sums the outputs). The
# MoE families keep the Hub's one module per expert (`experts.{e}.gate_proj.weight`, ...), so their plans
# (`base_model_ep_plan` of `configuration_llada2_moe.py` / `configuration_llada_moe.py`) name two modules instead:
#
#   "layers.*.mlp.experts": EXPERTS_STYLE             # `grouped_gemm.ExpertList`: keeps this rank's experts whole
#   "layers.*.mlp.expert_dispatch": "ep_dispatch_experts"  # the list's forward, reached through transformers' EP
#
# The plans are applied in module order, after the model is built (on the meta device) and before the weights load:
# the other ranks' experts are gone before their weights are read or initialised, so each rank holds E / N experts.
EXPERTS_STYLE = "hf_dllm_local_experts"


class LocalExperts(ExpertParallelLayer):
    """transformers' expert-parallel style (`EXPERTS_STYLE`) for a list of expert modules (`grouped_gemm.ExpertList`):
    rank r of N keeps experts `[r * E / N, (r + 1) * E / N)` whole and drops the others (`keep_local_experts`)."""

    def install_forward(self, module, mesh):
        module.keep_local_experts(mesh.get_local_rank(), mesh.size())
        return module


# How the routed experts' outputs are summed (`DistributedConfig(ep_implementation=...)`): transformers' `AllReduceEP`
# with the sum through `all_reduce` (the symmetric-memory kernels where they beat NCCL, as the tensor-parallel layers'
# all-reduces) at inference; transformers' own with autograd.
EP_IMPLEMENTATION = "hf_dllm_all_reduce"
EP_IMPLEMENTATIONS = ("auto", "all_reduce", EP_IMPLEMENTATION)  # those that run the experts on every rank's batch

if ALL_PARALLEL_STYLES is not None:
    ALL_PARALLEL_STYLES.register(EXPERTS_STYLE, LocalExperts())

    class SymmetricAllReduceEP(AllReduceEP):
        """transformers' `AllReduceEP` (every rank runs its experts on the batch they share, the routes to other
        ranks' experts masked: local index `num_local_experts`, weight 0; the partial outputs summed), summed by
        `all_reduce` when no autograd graph is recorded."""

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
                return super().__call__(hidden_states, top_k_index, top_k_weights)
            off_rank = (top_k_index // self.num_local_experts) != self.ep_mesh.get_local_rank()
            local_index = torch.where(off_rank, self.num_local_experts, top_k_index % self.num_local_experts)
            out = self.experts_forward(hidden_states, local_index, top_k_weights.masked_fill(off_rank, 0.0))
            return all_reduce(out.contiguous(), self.ep_mesh.get_group())

    EPImplementationInterface.register(EP_IMPLEMENTATION, SymmetricAllReduceEP)


# Tensor or expert parallelism for an MoE model, by the (token, expert) pairs a denoising step routes. Tensor
# parallelism gives every rank 1/N of each expert a step touches, so the ranks read equal shares whatever the
# routing, through GEMMs 1/N as wide; expert parallelism gives each rank its experts whole (full-width GEMMs), but
# the step is as slow as the rank whose experts got the most tokens: balanced only once a step routes several
# pairs to every expert. Both reduce once per MoE layer. The rule takes expert parallelism from
# `EXPERT_PARALLEL_MIN_PAIRS` pairs per expert on average (LLaDA2.x, 256 experts, top-8, blocks of 32: batch 4 and
# up); `benchmarks/bench_tp.py` measures both layouts per batch size and says whether the rule picked the faster.
MOE_PARALLEL_ENV = "HF_DLLM_MOE_PARALLEL"  # auto (the rule), tensor, expert
MOE_PARALLEL_CHOICES = ("auto", "tensor", "expert")
EXPERT_PARALLEL_MIN_PAIRS = 4


def moe_parallelism(config, batch_size: int, tokens_per_row: int, choice: str | None = None) -> str:
    """`"tensor"` or `"expert"`: how to split an MoE model (`config` with `num_experts` and `num_experts_per_tok`)
    for steps of `batch_size` rows of `tokens_per_row` tokens (a denoising block). `choice`: `"tensor"` or
    `"expert"` as given; `"auto"` (the default: `HF_DLLM_MOE_PARALLEL`, else `"auto"`) the rule above."""
    import os

    choice = os.environ.get(MOE_PARALLEL_ENV, "auto") if choice is None else choice
    if choice not in MOE_PARALLEL_CHOICES:
        raise ValueError(f"choice ({MOE_PARALLEL_ENV}) must be one of {MOE_PARALLEL_CHOICES}, got {choice!r}.")
    for name, value in (("batch_size", batch_size), ("tokens_per_row", tokens_per_row)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    experts, top_k = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        raise ValueError(
            f"moe_parallelism needs an MoE config (num_experts, num_experts_per_tok), got {type(config).__name__}."
        )
    if choice != "auto":
        return choice
    return "expert" if batch_size * tokens_per_row * top_k >= EXPERT_PARALLEL_MIN_PAIRS * experts else "tensor"


def tensor_parallel_load_kwargs() -> dict:
    """`from_pretrained` keyword arguments of transformers' tensor parallelism over the processes of a `torchrun`
    launch with the config's own plan: `distributed_config=DistributedConfig(tp_plan="auto")` (its size is the
    launch's; transformers 5.x deprecates passing `tp_plan` itself), or `tp_plan="auto"` where transformers has no
    `DistributedConfig`."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def parallel_load_kwargs(parallelism: str, ranks: int) -> dict:
    """`from_pretrained` keyword arguments that split a model over the `ranks` processes of `torchrun`:
    `tensor_parallel_load_kwargs()` (`"tensor"`) or `distributed_config=DistributedConfig(tp_size=ranks,
    ep_size=ranks, ep_implementation=EP_IMPLEMENTATION)` (`"expert"`: the MoE families' `base_model_ep_plan`; the
    rest of the tensor-parallel plan still applies)."""
    if parallelism == "tensor":
        return tensor_parallel_load_kwargs()
    if parallelism != "expert":
        raise ValueError(f"parallelism must be 'tensor' or 'expert', got {parallelism!r}.")
    if ALL_PARALLEL_STYLES is None:
        import transformers

        raise ValueError(f"expert parallelism needs transformers >= 5.24, found {transformers.__version__}.")
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=ranks, ep_size=ranks, ep_implementation=EP_IMPLEMENTATION)}


__all__ = [
    "EP_IMPLEMENTATION",
    "EXPERTS_STYLE",
    "LocalExperts",
    "LocalHeadCounts",
    "moe_parallelism",
    "parallel_load_kwargs",
    "tensor_parallel_load_kwargs",
    "VocabShard",
    "agree_across_ranks",
    "all_reduce",
    "all_reduce_algorithm",
    "all_gather_stacked",
    "all_reduce_partial",
    "is_sharded",
    "local_head_linear",
    "local_head_logits",
    "local_shape",
    "local_tensor",
    "whole_tensor",
    "row_parallel_linear",
    "shard_range",
    "tensor_parallel_group",
    "vocab_shard",
]
