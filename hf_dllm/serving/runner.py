"""The decoding side of the continuous-batching engine (`engine.ContinuousBatcher`): one `layout.LayoutRun` per
settings group of the running rows, and the one K/V cache every layout of a boundary uses in turn."""

from __future__ import annotations

from collections.abc import Callable

from .layout import LayoutRun
from .row_cache import RowKVStore
from .rows import EngineRequest


class LayoutRunner:
    """The `LayoutRun` of each settings group (`run_for`) and their shared K/V cache (`shared_cache`).

    Args:
        model: a `DiffusionGenerationMixin` model.
        device (`torch.device`): where the rows' canvases live.
        max_batch_size (`int`): rows decoded at once.
        max_batch_width (`int`): the widest layout (columns).
        max_batch_positions (`int | None`): the K/V cache's positions (None: `max_batch_size x max_batch_width`).
        store (`RowKVStore | None`): block-causal rows' exact K/V between blocks.
        bucket_rows (`Callable[[int, int], int] | None`): the padded row count of a layout's forwards.
    """

    def __init__(
        self,
        model,
        device,
        max_batch_size: int,
        max_batch_width: int,
        max_batch_positions: int | None,
        store: RowKVStore | None,
        bucket_rows: Callable[[int, int], int] | None,
    ):
        self.model, self.device = model, device
        self.max_batch_size, self.max_batch_width = max_batch_size, max_batch_width
        self.max_batch_positions, self.store, self.bucket_rows = max_batch_positions, store, bucket_rows
        self.runs: dict[str, LayoutRun] = {}
        self.cache = None

    def run_for(self, row: EngineRequest) -> LayoutRun:
        """The decoding state of the row's settings group (made when the group appears; the first group holds the
        model's CUDA-graph runner, the others run eagerly until it leaves)."""
        run = self.runs.get(row.settings)
        if run is None:
            run = LayoutRun(
                self.model,
                row.config,
                self.max_batch_size,
                self.max_batch_width,
                self.device,
                self.shared_cache,
                self.store,
                self.bucket_rows,
                self.max_batch_positions,
            )
            self.runs[row.settings] = run
        return run

    def shared_cache(self, rows: int):
        """The K/V cache of every layout, for at least `rows` rows (made anew when a layout needs more)."""
        if self.cache is None or self.cache.max_batch_size < rows:
            self.cache = self.model._diffusion_new_cache(
                rows, self.max_batch_width, max_positions=self.max_batch_positions
            )
            # A row's positions count its own columns, narrower than the cache's (`cache.PositionTables`).
            self.cache.positions_below_length = True
        return self.cache

    def keep_only(self, groups: set[str]) -> None:
        """Release the runs of settings groups no longer running."""
        for settings in [settings for settings in self.runs if settings not in groups]:
            self.runs.pop(settings).release()

    def release(self) -> None:
        """Give the model's CUDA-graph runner back (the captured graphs stay with the model for the next run of
        the same signature)."""
        self.keep_only(set())

    def graph_counts(self) -> dict[str, int]:
        """Steps the model's CUDA-graph runner ran eagerly, captured and replayed (zeros without graphs)."""
        runner = getattr(self.model, "_hf_dllm_step_graphs", None)
        return dict(runner.counts) if runner is not None else {"eager": 0, "captured": 0, "replayed": 0}
