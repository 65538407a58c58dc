"""Each running row's exact K/V between blocks, for block-causal models in a continuous batch (issue #14).

A block-causal model (LLaDA2.x: a block attends to itself and to earlier blocks) never changes the K/V of a
committed block, so `generate()` writes them once (`cache.ExactBlockCache`). The continuous-batching engine
(`engine.py`, `layout.py`) lays its rows out anew before every block (each row shifted right by whole blocks, so that its current
block starts at the layout's shared column) in one K/V cache that every layout of a boundary uses in turn, so that
cache cannot keep them from one block to the next. `RowKVStore` does: one slot per running row, holding the row's
K/V at its own columns (column c = position c of the row's canvas, its first prompt token at 0).

- `save`: after a block's first step, the columns that became exact (a joining row's prompt; a continuing row's
  previous block, committed now) go from the layout's cache rows into the rows' slots.
- `load`: before a block's first step, every row's slot goes into the layout's cache at the row's shifted columns.

Both are plain copies (one gather or scatter per layer and K/V) outside the model's step: captured CUDA graphs read
the layout cache by address, and it keeps its address.

Memory: per layer, keys and values `(slots, max_width, kv_heads, head_dim)` in the cache's dtype, as much as the
layout cache itself: 2 x layers x kv_heads x head_dim x bytes per position and slot. LLaDA2.0-mini (20 layers,
4 K/V heads of 128, bfloat16): 40 KiB per position, so 16 slots x 2560 columns = 1.6 GiB (x 4096: 2.5 GiB).
"""

from __future__ import annotations

import torch

from ..cache import DiffusionKVCache


class RowKVStore:
    """K/V of up to `slots` rows at their own columns `[0, max_width)` (see the module doc). Buffers are allocated
    at the first `save`, like the layout cache's buffers of each layer (dtype, device, heads), so a model split
    over devices keeps each layer's store next to its weights. What a slot holds at or after the columns its row
    last saved is unspecified (the engine tracks what is exact)."""

    def __init__(self, slots: int, max_width: int):
        self.slots = slots
        self.max_width = max_width
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    def _layers(self, cache: DiffusionKVCache):
        """`(cache keys, cache values, store keys, store values)` of every layer the cache holds."""
        if not self.keys:
            self.keys = [None] * cache.num_layers
            self.values = [None] * cache.num_layers
        for layer in range(cache.num_layers):
            if cache.keys[layer] is None and self.keys[layer] is not None:
                # A cache no forward wrote yet (another layout's): its buffers, like the store's.
                stored = self.keys[layer]
                cache.layer(layer, 1, stored.shape[2], stored.shape[3], stored)
            if cache.keys[layer] is None:
                continue
            keys, values = cache.layer_rows(layer)  # the layout's rows at its width
            if self.keys[layer] is None:
                shape = (self.slots, self.max_width, keys.shape[1], keys.shape[3])
                self.keys[layer] = keys.new_zeros(shape)
                self.values[layer] = values.new_zeros(shape)
            yield keys, values, self.keys[layer], self.values[layer]

    def save(
        self, cache: DiffusionKVCache, slots: torch.Tensor, columns: torch.Tensor, own_columns: torch.Tensor
    ) -> None:
        """Copy the cache's row i (i < len(slots)), columns `columns[i]`, into slot `slots[i]` at `own_columns[i]`.

        slots `(n,)` long; columns, own_columns `(n, m)` long (the same columns shifted by each row's shift)."""
        index = {}
        for keys, values, stored_keys, stored_values in self._layers(cache):
            device = keys.device
            if device not in index:
                index[device] = (
                    torch.arange(slots.numel(), device=device).unsqueeze(-1),
                    columns.to(device),
                    slots.to(device).unsqueeze(-1),
                    own_columns.to(device),
                )
            rows, source, slot, own = index[device]
            # `keys[rows, :, source]` is `(n, m, kv_heads, head_dim)`: the store's order.
            stored_keys[slot, own] = keys[rows, :, source]
            stored_values[slot, own] = values[rows, :, source]

    def load(self, cache: DiffusionKVCache, slots: torch.Tensor, shifts: torch.Tensor, width: int) -> None:
        """Fill the cache's first `len(slots)` rows, columns `[0, width)`, from their slots: column j of row i is
        own column `j - shifts[i]` of slot `slots[i]` (columns before the shift, the row's padding, get its column
        0: they are masked as keys).

        slots, shifts `(n,)` long."""
        if width == 0:
            return
        index = {}
        for keys, values, stored_keys, stored_values in self._layers(cache):
            device = keys.device
            if device not in index:
                own = torch.arange(width, device=device) - shifts.to(device).unsqueeze(-1)
                index[device] = (slots.to(device).unsqueeze(-1), own.clamp(0, self.max_width - 1))
            slot, own = index[device]
            rows = slots.numel()
            keys[:rows, :, :width].copy_(stored_keys[slot, own].transpose(1, 2))
            values[:rows, :, :width].copy_(stored_values[slot, own].transpose(1, 2))
