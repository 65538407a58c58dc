"""What the models need to run on the shards of transformers' tensor parallelism (`tp_plan="auto"`).

transformers shards a model by its config's `base_model_tp_plan` (Megatron-LM's scheme, arXiv:1909.08053): the
planned parameters become `DTensor`s holding one slice per rank, and the planned `nn.Linear`s get forward hooks
(a column-wise layer computes its slice of the outputs, a row-wise layer all-reduces its partial sums). This module
holds the few things the models add on top, because they multiply weights without calling the hooked modules
(concatenated q/k/v and gate/up weights, grouped expert GEMMs) or need to know which slice a rank holds:

- `local_tensor` / `local_shape`: a parameter's local slice (the tensor itself when not sharded), for products that
  multiply local weights directly; shapes read from it give per-rank head counts and widths.
- `shard_range`: which rows/columns of the full tensor the local slice holds.
- `all_reduce_partial`: sum partial results across the ranks of a sharded weight (no-op when not sharded).
- `agree_across_ranks`: every rank takes the first rank's copy of a denoising step's outputs, so ranks cannot
  diverge (sampling with per-rank random states, or collectives that are not bitwise identical on every rank).
- `tensor_parallel_group`: the model's tensor-parallel process group (None when it is not sharded).
- `LocalHeadCounts`: an attention layer's head counts read from its q/k weights (this rank's heads when sharded).

Every function is a no-op on models that are not sharded. This file is exported as Hub remote code.
"""

from __future__ import annotations

import torch

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch build without distributed support runs unsharded only
    dist = None
    DTensor = None
    Shard = None


def is_sharded(tensor) -> bool:
    """Whether `tensor` is a `DTensor` split across ranks (not merely replicated)."""
    return DTensor is not None and isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a `DTensor` parameter (the storage itself, no copy and no autograd), else `tensor`."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor._local_tensor
    return tensor


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
    `like` is split across, in place; unchanged when `like` is not sharded."""
    if not is_sharded(like):
        return partial
    dist.all_reduce(partial, group=like.device_mesh.get_group())
    return partial


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


__all__ = [
    "LocalHeadCounts",
    "agree_across_ranks",
    "all_reduce_partial",
    "is_sharded",
    "local_shape",
    "local_tensor",
    "shard_range",
    "tensor_parallel_group",
]
