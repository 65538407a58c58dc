"""Padding-free forwards: the sequences of several rows packed end to end into one row.

A batch of rows of different lengths, padded to the longest, computes every padding position in every linear
layer. Serving bidirectional models (LLaDA, Dream) with the dual/prefix cache, the block-start forward over each
row's whole canvas is most of the work (Fast-dLLM, arXiv:2505.22618, recomputes the whole sequence there), and
rows of a continuous batch differ in length by up to the context: padding is a third of that forward at typical
request mixes. Packed, the linear layers see exactly the positions that exist, and attention runs once per row
(its own sequence only), so each position computes what it computes in its row alone.

`PackedRows` describes the packing and is handed to the model's forward twice, as transformers hands a cache and
a mask: as `past_key_values` it writes each position's keys/values into a `DiffusionKVCache` at its row and column
there (the layout the following block steps read) and gives the packed keys/values back; as `attention_mask` it
tells the attention layer to attend within each row (`attend`). A model family supports it by dispatching to
`attend` in its attention layer (`DiffusionGenerationMixin.diffusion_packed_rows`).

This file is exported as Hub remote code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch


class PackedRows:
    """Rows of `lengths` positions laid end to end in one sequence of `sum(lengths)` positions `(1, T)`.

    Args:
        lengths: each row's positions (host ints, all >= 1).
        cache: where the rows' keys/values go (`DiffusionKVCache`), or None for a forward without a cache.
        columns: `(T,)` long, each position's column in `cache` (its row is its packed row's index).
        kept_per_row: positions per row whose outputs the forward keeps (`logits_to_keep` as a `(rows * kept,)`
            index, rows in order): the attention of a model that computes only the kept queries in its last layer
            then attends each row's kept queries to that row's keys.
    """

    def __init__(
        self,
        lengths: list[int],
        cache=None,
        columns: torch.Tensor | None = None,
        kept_per_row: int | None = None,
    ):
        if not lengths or any(length < 1 for length in lengths):
            raise ValueError(f"PackedRows: every row needs at least one position, got lengths {lengths}.")
        if (cache is None) != (columns is None):
            raise ValueError("PackedRows: `cache` and `columns` go together.")
        self.lengths = list(lengths)
        ends = torch.tensor(self.lengths).cumsum(0).tolist()
        self.spans = list(zip([0, *ends[:-1]], ends, strict=True))
        self.length = ends[-1]  # positions of the packed sequence (as `DiffusionKVCache.length` for a full forward)
        self.kept_spans = (
            [(i * kept_per_row, (i + 1) * kept_per_row) for i in range(len(lengths))] if kept_per_row else None
        )
        self.row_masks = None  # each row's own attention mask (`with_row_masks`), None: unmasked
        self.cache = cache
        if cache is not None:
            if columns.shape != (self.length,):
                raise ValueError(f"PackedRows: `columns` must be ({self.length},), got {tuple(columns.shape)}.")
            self.columns = columns
            # Built on the host: repeats on a GPU would make repeat_interleave wait for the device to size its output.
            self.rows = torch.repeat_interleave(torch.tensor(self.lengths)).to(columns.device)

    # -- as `past_key_values` (what `resolve_forward_positions` and the attention layers call) ------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # nothing is read from earlier forwards: every key is computed by this one

    def get_mask_sizes(self, q_len: int, layer_idx: int = 0) -> tuple[int, int]:
        return q_len, 0

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs: dict | None = None):
        """Write `key_states`/`value_states` `(1, kv_heads, T, head_dim)` into the cache (position p at row
        `rows[p]`, column `columns[p]`) and return them unchanged: each row attends to its own packed keys."""
        if self.cache is not None:
            _, kv_heads, _, head_dim = key_states.shape
            views = self.cache.layer(layer_idx, len(self.lengths), kv_heads, head_dim, key_states)
            for view, states in zip(views, (key_states, value_states), strict=True):
                view[self.rows, :, self.columns] = states[0].transpose(0, 1).to(view.dtype)
        return key_states, value_states

    # -- as `attention_mask` -----------------------------------------------------------------------------------
    def with_row_masks(self, mask_for_length: Callable[[int], object]) -> PackedRows:
        """This packing with each row's own attention mask, `mask_for_length(length)` (made once per distinct
        length): the mask of a row alone at columns `[0, length)` (a block-causal model's block-causal mask; a
        bidirectional row alone needs none)."""
        masks = {length: mask_for_length(length) for length in set(self.lengths)}
        packing = copy.copy(self)
        packing.row_masks = [masks[length] for length in self.lengths]
        return packing

    def attend(
        self,
        attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """Each row's queries attend to its own keys: `attention(q, k, v, mask)` (q `(1, Hq, t, D)`, k/v
        `(1, Hkv, s, D)`, the row's mask (`with_row_masks`) or None -> `(1, t, Hq, D)`) once per row. query
        `(1, Hq, T or kept, D)`, key/value `(1, Hkv, T, D)` -> `(1, T or kept, Hq, D)`."""
        query_spans = self.spans
        if query.shape[2] != self.length:
            if self.kept_spans is None or query.shape[2] != self.kept_spans[-1][1]:
                raise ValueError(
                    f"PackedRows.attend: {query.shape[2]} queries for {self.length} packed positions "
                    f"(kept spans {self.kept_spans})."
                )
            query_spans = self.kept_spans
        masks = self.row_masks or [None] * len(self.spans)
        outputs = [
            attention(query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], mask)
            for (q0, q1), (k0, k1), mask in zip(query_spans, self.spans, masks, strict=True)
        ]
        return torch.cat(outputs, dim=1)


def attend_rows(
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
) -> torch.Tensor:
    """`attention(query, key, value, attention_mask)` -> `(batch, q, Hq, D)`; a `PackedRows` mask runs it once per
    packed row, with the row's own mask (`PackedRows.attend`)."""
    if isinstance(attention_mask, PackedRows):
        return attention_mask.attend(attention, query, key, value)
    return attention(query, key, value, attention_mask)


def run_attention(interface: Callable, module, query, key, value, attention_mask, **kwargs) -> torch.Tensor:
    """The output `(batch, q, Hq, D)` of an `AttentionInterface` function, `interface(module, query, key, value,
    attention_mask, **kwargs)[0]`, through `attend_rows`."""
    return attend_rows(
        lambda q, k, v, mask: interface(module, q, k, v, mask, **kwargs)[0], query, key, value, attention_mask
    )
