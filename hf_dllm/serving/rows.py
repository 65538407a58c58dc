"""A request as a row of the continuous batch (`engine.py`): its prompt, settings and decoding state
(`EngineRequest`), and what each committed block gives it (`BlockUpdate`). The scheduler (`engine.py`) and the
decoding of a layout of rows (`layout.py`) share them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..block_plan import BlockPlan
from ..generation_config import DiffusionGenerationConfig


@dataclass(eq=False)
class BlockUpdate:
    """What one committed block gave a row: its new generated tokens, whether the row ended by the run's own rules
    (EOS with `eos_early_stop`, in-block EOS stop, last block) and its forwards so far."""

    new_tokens: list[int]
    ended: bool
    nfe: int


@dataclass(eq=False)
class EngineRequest:
    """One prompt to decode with `config` (resolved settings, as for `generate()`). `on_block(update)` is called
    (from the engine's thread) after every block the row decoded; returning True ends the row there (it takes
    part in no more forwards). `cancelled` ends it at the next boundary without another call."""

    prompt_ids: list[int]
    config: DiffusionGenerationConfig
    on_block: Callable[[BlockUpdate], bool | None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Called with the row's forwards when the engine drops it because `cancelled` was set (no `on_block` call).
    on_cancel: Callable[[int], None] | None = None
    # The request the row belongs to (rows of one group are admitted in turns with other groups': `admission.py`).
    group: object = None
    # Set by the engine.
    settings: str = ""  # `settings_key` of `config` without `max_new_tokens` and `steps`
    error: BaseException | None = None  # why the row ended without finishing, if a layout failed
    plan: BlockPlan | None = None
    tokens: torch.Tensor | None = None  # `(canvas_width,)` the row's own canvas: prompt, then generated positions
    block: int = 0  # the next block of `plan.blocks` to decode
    slot: int = -1  # the row's place while it runs (its `RowKVStore` slot for block-causal models)
    nfe: int = 0
    committed: int = 0  # generated positions final so far
    ended: bool = False

    @property
    def generated(self) -> torch.Tensor:
        """`(max_new_tokens,)` the row's generated positions (masks where not decoded; EOS after its end)."""
        start = int(self.plan.prompt_end[0])
        return self.tokens[start : start + self.config.max_new_tokens]
