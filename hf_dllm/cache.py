"""KV caching for block diffusion: a static K/V store and the three cache policies of Fast-dLLM.

Masked-diffusion models attend bidirectionally, so no K/V is ever exact once any token changes. Fast-dLLM
(arXiv:2505.22618, Sec. 3.2) observes that K/V of positions outside the block being denoised barely change within
a block, and reuses them:

- `NoCache`: every step is a full forward over the whole sequence (LLaDA's original sampler).
- `PrefixCache`: the block's first step is a full forward that also stores every position's K/V; later steps
  recompute the block and everything after it, and reuse the stored K/V before the block.
- `DualCache`: as prefix, but later steps recompute only the block and reuse stored K/V on both sides.

Block-causal models (LLaDA2: each block attends to itself and earlier blocks) need no approximation:
- `ExactBlockCache`: committed blocks' K/V never change, so each is written once. The first step of a block also
  recomputes the previous block with its committed tokens (writing its exact K/V; the first block's first step
  prefills the prompt), later steps compute the block alone. Same forwards as recomputing everything, exact.
- `StoredBlockCache`: the same queries for a continuous batch, whose engine keeps each row's exact K/V between
  blocks itself (rows are laid out anew before every block).
- `BlockCausalNoCache`: every step recomputes everything up to the end of the block (the reference `generate()`).

All of them only differ in which positions a step feeds to the model (`query_range`), so the denoising loop is
written once. The store itself, `DiffusionKVCache`, is pre-allocated for the whole call (gpt-fast style) and
written in place at explicit positions, so a step never concatenates tensors or changes shapes.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from .generation_fields import KV_CACHE_DTYPES

# transformers renamed the model outputs' cache field from `past_key_values` to `cache` (5.2x; the old name still
# works, with a deprecation warning when an output is built or read with it): hf_dllm's models build and read their
# outputs under the installed version's name (`cache_output`, `output_cache`).
OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_output(cache) -> dict:
    """`{OUTPUT_CACHE_FIELD: cache}`: the keyword a model output (`BaseModelOutputWithPast`, ...) takes its cache by."""
    return {OUTPUT_CACHE_FIELD: cache}


def output_cache(output):
    """The cache a model output holds (None if none), by the installed transformers' field name."""
    return getattr(output, OUTPUT_CACHE_FIELD)


class DiffusionKVCache:
    """Per-layer K/V buffers `(buffer_rows, kv_heads, max_length, head_dim)`, written in place at `cache_position`.

    Attention of every forward covers the whole buffer (positions `[0, max_length)`), which is what the prefix
    and dual caches need: the full forward at a block start fills all positions, later steps overwrite the
    positions they recompute. A forward with fewer rows than the buffer uses its first rows (finished rows are
    dropped between blocks; the next full forward rewrites everything).

    Buffers are allocated at the first write of each layer, on that layer's device and dtype, so models split
    over several devices (`device_map="auto"`) keep each layer's cache next to its weights.

    `length` (default `max_length`) is the sequence the forwards see: a continuous batch whose canvases are
    narrower than the buffers (`set_length`) sees its rows of `length` columns laid end to end from the buffers'
    start (a contiguous view of their first `batch x length` positions), so the buffers keep their addresses and
    narrow rows take only the positions they use.

    `max_positions` (default `max_batch_size x max_length`): the positions (rows x columns) the buffers hold, when
    fewer than that: a continuous batch's K/V budget (`serving.engine.ContinuousBatcher(max_batch_positions=...)`),
    where many narrow rows or a few wide ones fit (`rows_at_length`). The buffers then hold
    `ceil(max_positions / max_length)` rows of `max_length` columns.
    """

    # Whether every position id fed with this cache is below `max_length`: true of the caches that hf_dllm's block
    # loop and serving engine make (their positions count the cache's columns), which lets a forward look its RoPE
    # tables up (`PositionTables`) instead of computing them at every step; off for caches made elsewhere.
    positions_below_length = False

    def __init__(self, num_layers: int, max_batch_size: int, max_length: int, max_positions: int | None = None):
        if max_positions is not None and not max_length <= max_positions:
            raise ValueError(
                f"DiffusionKVCache: max_positions ({max_positions}) must be at least max_length ({max_length}): a "
                "row of every column must fit."
            )
        self.num_layers = num_layers
        self.max_batch_size = max_batch_size
        self.max_length = max_length
        # Rows of `max_length` columns the buffers are allocated with.
        self.buffer_rows = max_batch_size
        if max_positions is not None:
            self.buffer_rows = min(max_batch_size, -(-max_positions // max_length))
        self.length = max_length
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def set_length(self, length: int) -> None:
        """Make forwards see rows of `length` columns (`<= max_length`; see the class doc)."""
        if not 0 < length <= self.max_length:
            raise ValueError(f"DiffusionKVCache.set_length: length must be in [1, {self.max_length}], got {length}.")
        self.length = length

    def layer(self, layer_idx: int, batch: int, kv_heads: int, head_dim: int, like: torch.Tensor):
        """This layer's K/V buffers for the first `batch` rows and `length` columns `(batch, kv_heads, length,
        head_dim)`, allocated (`max_length` columns) at first use with the dtype and device of `like`."""
        if self.keys[layer_idx] is None:
            shape = (self.buffer_rows, kv_heads, self.max_length, head_dim)
            self.keys[layer_idx] = like.new_zeros(shape)
            self.values[layer_idx] = like.new_zeros(shape)
        return self._visible(self.keys[layer_idx], batch), self._visible(self.values[layer_idx], batch)

    def rows_at_length(self) -> int:
        """The most rows of `length` columns the buffers hold (at most `max_batch_size`)."""
        return min(self.max_batch_size, self.buffer_rows * self.max_length // self.length)

    def layer_rows(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """Views of every buffer of an allocated layer (keys, values; an FP8 cache adds their scales) over all
        `rows_at_length()` rows of `length` columns: `(rows, kv_heads, length, ...)`."""
        return tuple(self._visible(buffers[layer_idx], self.rows_at_length()) for buffers in self._buffer_lists())

    def _visible(self, buffer: torch.Tensor, batch: int) -> torch.Tensor:
        """`batch` rows of `length` columns of a buffer `(buffer_rows, heads, max_length, ...)`, laid end to end from
        its start (contiguous; at the full length, its first `batch` rows)."""
        if batch > self.rows_at_length():
            raise ValueError(
                f"DiffusionKVCache holds {self.rows_at_length()} rows of {self.length} columns (max_batch_size "
                f"{self.max_batch_size}, {self.buffer_rows * self.max_length} positions), got a batch of {batch}."
            )
        if self.length == self.max_length:  # the same view in one op: every forward of `generate()` asks for it
            return buffer[:batch]
        shape = (batch, buffer.shape[1], self.length, *buffer.shape[3:])
        return buffer.view(-1)[: math.prod(shape)].view(shape)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states`/`value_states` `(batch, kv_heads, q_len, head_dim)` at `cache_kwargs["cache_position"]`
        `(q_len,)` and return this layer's K/V over the whole sequence `(batch, kv_heads, length, head_dim)`."""
        batch, kv_heads, q_len, head_dim = key_states.shape
        keys, values = self.layer(layer_idx, batch, kv_heads, head_dim, key_states)
        if q_len == self.length:
            keys.copy_(key_states)
            values.copy_(value_states)
        else:
            position = cache_kwargs["cache_position"]
            keys.index_copy_(2, position, key_states)
            values.index_copy_(2, position, value_states)
        return keys, values

    def keep_rows(self, index: torch.Tensor) -> None:
        """Compact the rows in place: row i becomes old row `index[i]` (`index` `(n,)` long), so the buffers keep
        their addresses (captured CUDA graphs read them) while finished rows leave the batch."""
        for layer in range(self.num_layers):
            if self.keys[layer] is not None:
                for view in self.layer_rows(layer):
                    data = _as_bytes(view)
                    data[: index.numel()].copy_(data.index_select(0, index.to(view.device)))

    def _buffer_lists(self) -> tuple[list, ...]:
        """The per-layer buffer lists a row owns a slice of (its keys and values; an FP8 cache adds their scales)."""
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """transformers' Cache interface: positions held (the whole sequence once the layer was written)."""
        return self.length if self.keys[layer_idx] is not None else 0

    def __len__(self) -> int:
        return self.num_layers


# Largest finite float8 e4m3 value: a position's largest |value| in a head maps to it.
FP8_E4M3_MAX = 448.0


def quantize_kv(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 K/V with one float32 scale per vector: `states` `(..., head_dim)` -> `(fp8 (..., head_dim),
    scale (...))`, `scale = max|x| * float32(1 / 448)` (1 for an all-zero vector) and `x / scale` rounded to nearest,
    ties to even. The reference of the fused kernel's write (`triton_ops.rotary_to_cache` with scales),
    bit for bit."""
    values = states.float()
    # Times the float32 reciprocal, not divided by 448: PyTorch's CUDA division by a scalar multiplies by the
    # reciprocal (its CPU one divides), and the fused kernel multiplies the same way: the same bits everywhere.
    scale = values.abs().amax(-1) * (1 / FP8_E4M3_MAX)  # a float32 tensor times a scalar: float32 arithmetic
    scale = torch.where(scale > 0, scale, 1.0)
    return (values / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize_kv(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`quantized` `(..., head_dim)` float8 times `scale` `(...)`, in float32, then cast to `dtype`."""
    return (quantized.float() * scale.unsqueeze(-1)).to(dtype)


class FP8DiffusionKVCache(DiffusionKVCache):
    """`DiffusionKVCache` holding K/V as float8 e4m3 with a float32 scale per (row, head, position): half the bytes
    of bfloat16 K/V plus 4 bytes per 128-value vector (`kv_cache_dtype="fp8"`). An approximation, as an FP8 K/V
    cache is in serving engines: each vector is rounded to 3 mantissa bits relative to its largest value.

    Buffers: `keys`/`values` `(buffer_rows, kv_heads, max_length, head_dim)` float8, `key_scales`/`value_scales`
    `(buffer_rows, kv_heads, max_length)` float32. `update` quantizes what it writes and returns the layer's K/V
    dequantized to the input's dtype (the reference path: any attention backend); the fused path writes through
    `quantized_layer` and hands the quantized K/V and their scales to the split-KV kernel, which reads them in place.
    A forward that computes every position's K/V (the prefix and dual caches' block-start refresh) attends to them
    as computed, on both paths: only later forwards read quantized K/V.
    """

    def __init__(self, num_layers: int, max_batch_size: int, max_length: int, max_positions: int | None = None):
        super().__init__(num_layers, max_batch_size, max_length, max_positions)
        self.key_scales: list[torch.Tensor | None] = [None] * num_layers
        self.value_scales: list[torch.Tensor | None] = [None] * num_layers

    def quantized_layer(self, layer_idx: int, batch: int, kv_heads: int, head_dim: int, like: torch.Tensor):
        """`(keys, values, key_scales, value_scales)` of this layer for the first `batch` rows and `length`
        columns: float8 `(batch, kv_heads, length, head_dim)` and float32 `(batch, kv_heads, length)`, allocated at
        first use on `like`'s device."""
        if self.keys[layer_idx] is None:
            shape = (self.buffer_rows, kv_heads, self.max_length, head_dim)
            self.keys[layer_idx] = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=like.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=like.device)
            self.key_scales[layer_idx] = torch.ones(shape[:3], dtype=torch.float32, device=like.device)
            self.value_scales[layer_idx] = torch.ones(shape[:3], dtype=torch.float32, device=like.device)
        return tuple(self._visible(buffers[layer_idx], batch) for buffers in self._buffer_lists())

    def _buffer_lists(self) -> tuple[list, ...]:
        return self.keys, self.values, self.key_scales, self.value_scales

    def layer(self, layer_idx: int, batch: int, kv_heads: int, head_dim: int, like: torch.Tensor):
        raise TypeError(
            "FP8DiffusionKVCache stores float8 K/V with scales: use `quantized_layer` (or `update`, which returns "
            "them dequantized)."
        )

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `DiffusionKVCache.update`, storing `quantize_kv` of the new K/V; returns the layer's K/V over the
        whole sequence: the given ones when they cover it (a forward over the whole cache attends to its own K/V as
        computed), else the cache's dequantized to `key_states.dtype`."""
        batch, kv_heads, q_len, head_dim = key_states.shape
        keys, values, key_scales, value_scales = self.quantized_layer(layer_idx, batch, kv_heads, head_dim, key_states)
        layer = (keys, key_scales, values, value_scales)
        new = (*quantize_kv(key_states), *quantize_kv(value_states))
        if q_len == self.length:
            for buffer, states in zip(layer, new, strict=True):
                buffer.copy_(states)
            return key_states, value_states
        for buffer, states in zip(layer, new, strict=True):  # float8 has no index kernels: its bytes are copied
            _as_bytes(buffer).index_copy_(2, cache_kwargs["cache_position"], _as_bytes(states))
        dtype = key_states.dtype
        return dequantize_kv(keys, key_scales, dtype), dequantize_kv(values, value_scales, dtype)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """float8 tensors viewed as uint8 (PyTorch has no index kernels for float8); others as they are."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


# The K/V store of each `kv_cache_dtype` (`generation_fields.KV_CACHE_DTYPES`, in order): None keeps K/V in the
# model's dtype.
KV_CACHE_CLASSES = dict(zip(KV_CACHE_DTYPES, (DiffusionKVCache, FP8DiffusionKVCache), strict=True))


def new_kv_cache(
    num_layers: int,
    max_batch_size: int,
    max_length: int,
    kv_cache_dtype: str | None = None,
    max_positions: int | None = None,
):
    """The K/V store `kv_cache_dtype` names (`KV_CACHE_CLASSES`), holding `max_positions` positions (default: every
    row at every column)."""
    if kv_cache_dtype not in KV_CACHE_CLASSES:
        raise ValueError(f"`kv_cache_dtype` must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}.")
    return KV_CACHE_CLASSES[kv_cache_dtype](num_layers, max_batch_size, max_length, max_positions)


def padding_aware_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions `(batch, len)` counted from each row's first real token (pads get 0), so a left-padded row
    sees the positions it has alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class PositionTables:
    """Per-position tables (RoPE's cos and sin), computed once for positions `[0, n)` per device and dtype and
    looked up by position ids, where a bound on the positions is known on the host without reading them
    (`bound_of`: a `DiffusionKVCache` with `positions_below_length`). A step then gathers its rows (one kernel per
    table) instead of computing them (~10 small kernels a forward, in every CUDA-graph replay too).

    `compute(positions (1, n), dtype)` returns the tables `(1, n, ...)`; it must compute each position's row on its
    own (elementwise), so that a looked-up row is the computed one bit for bit. Tables are only added, never
    freed: a captured CUDA graph keeps reading the one it was captured with."""

    def __init__(self, compute: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, ...]]):
        self.compute = compute
        self.tables: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}

    @staticmethod
    def bound_of(past_key_values) -> int | None:
        """The host-side bound on a forward's position ids that `past_key_values` guarantees, or None."""
        if isinstance(past_key_values, DiffusionKVCache) and past_key_values.positions_below_length:
            return past_key_values.max_length
        return None

    def covering(self, bound: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The tables `(n, ...)` on `device` in `dtype` for positions `[0, n)`, `n >= bound` (made, or made larger
        by at least doubling, when the last ones are shorter)."""
        made = self.tables.setdefault((device, dtype), [])
        if not made or made[-1][0].shape[0] < bound:
            size = max(bound, 2 * made[-1][0].shape[0] if made else bound)
            with torch.inference_mode(False), torch.no_grad():  # usable outside inference mode too
                positions = torch.arange(size, device=device).unsqueeze(0)
                made.append(tuple(table[0] for table in self.compute(positions, dtype)))
        return made[-1]

    def lookup(self, position_ids: torch.Tensor, bound: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The tables' rows at `position_ids` `(batch, q_len)` (every id below `bound`): `(batch, q_len, ...)`."""
        return tuple(table[position_ids] for table in self.covering(bound, position_ids.device, dtype))


def resolve_forward_positions(
    inputs_embeds: torch.Tensor,
    attention_mask,
    position_ids: torch.Tensor | None,
    past_key_values,
    use_cache: bool | None,
    cache_position: torch.Tensor | None,
):
    """What a model forward derives from its cache arguments, the same for every model family (transformers'
    conventions, plus the `DiffusionKVCache` written in place).

    Args:
        inputs_embeds: `(batch, q_len, hidden)` of the positions computed in this call.
        attention_mask: a 2D key padding mask `(batch, kv_len)` over the keys this call attends to (columns
            `[0, kv_len)` of the cache, or the call's own columns without one), or anything else (a prepared 4D
            mask, a flex `BlockMask`, None), passed through.
        position_ids, cache_position: as given, or derived: columns `past .. past + q_len` (a `DiffusionKVCache`
            needs them unless the inputs cover it whole), positions counted from each row's first real key.

    Returns `(past_key_values, cache_position (q_len,), position_ids (batch, q_len), mask_2d or None, kv_len)`; a
    `DynamicCache` is created when `use_cache` asks for one.
    """
    from transformers.cache_utils import DynamicCache

    batch, q_len = inputs_embeds.shape[:2]
    if use_cache is None:
        use_cache = past_key_values is not None
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache()
    if isinstance(past_key_values, DiffusionKVCache):
        kv_length, past_seen = past_key_values.length, 0
        if cache_position is None and q_len != kv_length:
            raise ValueError(
                "`cache_position` is required when `past_key_values` is a DiffusionKVCache and the input "
                f"({q_len} positions) does not cover the whole cache ({kv_length})."
            )
    elif past_key_values is not None:
        kv_length, _ = past_key_values.get_mask_sizes(q_len, 0)
        past_seen = past_key_values.get_seq_length()
    else:
        kv_length, past_seen = q_len, 0
    if cache_position is None:
        cache_position = torch.arange(past_seen, past_seen + q_len, device=inputs_embeds.device)
    mask_2d = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    if mask_2d is not None and mask_2d.shape != (batch, kv_length):
        raise ValueError(
            f"A 2D `attention_mask` must cover the keys of this call: shape ({batch}, {kv_length}), got "
            f"{tuple(mask_2d.shape)}."
        )
    if position_ids is None:
        if mask_2d is not None:
            positions = padding_aware_position_ids(mask_2d.to(inputs_embeds.device))
            position_ids = positions if past_key_values is None else positions[:, cache_position]
        else:
            position_ids = cache_position.unsqueeze(0).expand(batch, -1)
    return past_key_values, cache_position, position_ids, mask_2d, kv_length


class CachePolicy:
    """Which positions a denoising step recomputes. `uses_cache` says whether a `DiffusionKVCache` is needed."""

    name = "none"
    uses_cache = False

    def start_block(self, block_start: int) -> None:
        """Called before each block (with its first column)."""

    def keep_rows(self, cache: DiffusionKVCache | None, index: torch.Tensor) -> None:
        """Rows `index` stay in the batch after a block (finished rows leave). Policies that refresh every
        position at the next block's first step need do nothing."""

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        """Columns `[start, end)` of the sequence fed to the model at this step."""
        raise NotImplementedError


class NoCache(CachePolicy):
    """Every step recomputes the whole sequence (LLaDA's sampler)."""

    name = "none"
    uses_cache = False

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        return 0, seq_len


class PrefixCache(CachePolicy):
    """Fast-dLLM prefix cache: full forward at the block start, then the block and the suffix."""

    name = "prefix"
    uses_cache = True

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        return (0, seq_len) if first_step else (block_start, seq_len)


class DualCache(CachePolicy):
    """Fast-dLLM dual cache: full forward at the block start, then only the block."""

    name = "dual"
    uses_cache = True

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        return (0, seq_len) if first_step else (block_start, block_end)


class BlockCausalNoCache(CachePolicy):
    """Block-causal models without a cache: every step recomputes the sequence up to the end of the block (later
    positions cannot influence it), as the reference `generate()` does."""

    name = "none"
    uses_cache = False

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        return 0, block_end


class ExactBlockCache(CachePolicy):
    """Block-causal models: committed blocks' K/V are exact and written once (see the module docstring)."""

    name = "exact"
    uses_cache = True

    def __init__(self) -> None:
        self.exact_until = 0  # K/V of columns before this hold committed tokens
        self.refresh_from = 0

    def start_block(self, block_start: int) -> None:
        self.refresh_from, self.exact_until = self.exact_until, block_start

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        return (self.refresh_from, block_end) if first_step else (block_start, block_end)

    def keep_rows(self, cache: DiffusionKVCache | None, index: torch.Tensor) -> None:
        cache.keep_rows(index)


class StoredBlockCache(CachePolicy):
    """Block-causal models in a continuous batch (`hf_dllm.serving.engine`): rows are laid out anew before every
    block, and the engine keeps each row's exact K/V between blocks (`serving.row_cache.RowKVStore`) and puts them
    back at the row's columns before the block. So, as in `ExactBlockCache`, the first step of a block recomputes
    the previous block (committed now: its exact K/V are written once) and the block, later steps the block alone.
    (A row's first block, whose prompt has no K/V yet, is prefilled by the engine in a forward of its own rows.)
    Every block of a block-causal plan is `block_end - block_start` long, so the previous block is the columns
    just before this one."""

    name = "stored"
    uses_cache = True  # what is exact is tracked by the engine (per row), not by the policy

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        if not first_step:
            return block_start, block_end
        return max(0, 2 * block_start - block_end), block_end
