"""How the running rows of a continuous batch are grouped into layouts at a block boundary (`LayoutScheduler`), for
the engine (`engine.ContinuousBatcher`): cohorts of rows that can step together, split where they would exceed
the K/V cache, cut into slices (`Slice`) where a refresh would hold too many positions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..generation_config import is_int
from .layout import kv_positions
from .rows import EngineRequest


def cohort_key(row: EngineRequest) -> tuple:
    """Rows of equal keys share a layout: the same settings (but `max_new_tokens` and `steps`), and current blocks
    of the same length and number of steps."""
    start, end = row.plan.blocks[row.block]
    return (row.settings, end - start, int(row.plan.block_steps[0, row.block]))


class Slice(list):
    """The rows of a layout cut from a larger one (`LayoutScheduler.slices`): waiting requests may join it while
    its boundary runs. (Other layouts take no one mid-boundary: a joining row would wait out a whole cohort's
    layout, and a block-causal layout, never cut, would take its joining rows' prefill into the continuing rows'
    block; both measured slower.)"""


@dataclass
class LayoutScheduler:
    """The engine's layout limits and the grouping of rows into layouts (the engine's arguments of the same names
    are documented on `ContinuousBatcher`).

    Attributes:
        max_batch_width (`int`): the widest layout (columns).
        width_granularity (`int`): layouts are rounded up to a multiple of this many columns.
        keeps_row_kv (`bool`): the family keeps its rows' exact K/V between blocks (block-causal).
        max_batch_positions (`int | None`): the K/V budget of a layout (rows x columns), None for none.
        max_refresh_positions (`int | None`): slice a layout whose canvases hold more positions.
        join_layout_min_rows (`int | None`): joining rows decode apart once this many others of their cohort run.
    """

    max_batch_width: int
    width_granularity: int
    keeps_row_kv: bool
    max_batch_positions: int | None = None
    max_refresh_positions: int | None = None
    join_layout_min_rows: int | None = None

    @classmethod
    def validated(cls, max_batch_width, width_granularity, keeps_row_kv, **limits) -> LayoutScheduler:
        """The scheduler of the engine's arguments, each checked (ValueError naming it)."""
        scheduler = cls(max_batch_width, width_granularity, keeps_row_kv, **limits)
        if not is_int(max_batch_width) or max_batch_width < 1:
            raise ValueError(f"`max_batch_width` must be an integer >= 1, got {max_batch_width!r}.")
        for name in ("width_granularity", "join_layout_min_rows", "max_refresh_positions"):
            value = getattr(scheduler, name)
            if not (value is None and name != "width_granularity") and not (is_int(value) and value >= 1):
                raise ValueError(f"`{name}` must be None or an integer >= 1, got {value!r}.")
        return scheduler

    def layout_width(self, rows: list[EngineRequest]) -> int:
        """Columns of the layout of `rows`: their current blocks aligned at the latest block start, plus the
        longest rest of a canvas after it, rounded up to `width_granularity` (at most `max_batch_width`).

        Block-causal rows with `width_granularity > 1` (CUDA graphs): only the columns up to the block's end, as a
        power-of-two multiple of `width_granularity`: their steps never see a later column (the block-causal mask;
        the split-KV kernel reads no key past the last one visible), and whole canvases would multiply the step
        shapes. With granularity 1 (off CUDA) a row alone is laid out as `generate()` lays it out, so its float32
        arithmetic is exactly `generate()`'s."""
        return self.width_of([(*row.plan.blocks[row.block], row.plan.canvas_width) for row in rows])

    def width_of(self, spans: list[tuple[int, int, int]]) -> int:
        """`layout_width` of rows given as `(block start, block end, canvas width)`, one per row."""
        starts = [start for start, _, _ in spans]
        granularity = self.width_granularity
        if self.keeps_row_kv and granularity > 1:
            width = max(starts) + max(end - start for start, end, _ in spans)
            rounded = granularity << (-(-width // granularity) - 1).bit_length()
        else:
            width = max(starts) + max(canvas - start for start, _, canvas in spans)
            rounded = -(-width // granularity) * granularity
        return max(width, min(rounded, self.max_batch_width))

    def fits_one_layout(self, rows: list[EngineRequest]) -> bool:
        """Whether `rows` (one cohort) fit one layout: at most `max_batch_width` columns and, with a budget,
        `max_batch_positions` K/V positions (rows x columns, padding rows aside; twice the rows with classifier-free
        guidance). One row always fits: the engine refuses a request that would not, alone."""
        width = self.layout_width(rows)
        if width > self.max_batch_width:
            return False
        return (
            self.max_batch_positions is None
            or kv_positions(len(rows), width, rows[0].config) <= self.max_batch_positions
        )

    def fits_with_cohort(self, head: EngineRequest, running: list[EngineRequest]) -> bool:
        """Whether `head` and the running rows of its cohort fit one layout (`fits_one_layout`)."""
        partners = [row for row in running if cohort_key(row) == cohort_key(head)]
        return not partners or self.fits_one_layout([*partners, head])

    def into_a_slice(self, head: EngineRequest, queue: list[list[EngineRequest]]) -> bool:
        """Put `head` into the first slice of its cohort in `queue` (layouts still to decode) that its width still
        fits; whether one took it."""
        key = cohort_key(head)
        for rows in queue:
            if isinstance(rows, Slice) and cohort_key(rows[0]) == key and self.fits_one_layout([*rows, head]):
                rows.append(head)
                return True
        return False

    def layouts(
        self, running: list[EngineRequest], opening: Callable[[EngineRequest], bool], unopened: bool
    ) -> list[list[EngineRequest]]:
        """The running rows grouped into layouts (cohorts), each split further where it would exceed the cache's
        width; in order of their oldest row, except that the rows of requests opening at this boundary
        (`opening(row)`: their request's first rows, at their first block) decode apart and first when at least
        `join_layout_min_rows` others of their cohort run and no request waits unopened (`unopened`: a full batch,
        where an extra layout would only lengthen every wait). The later rows of a request already decoding (a
        many-prompt request's) share their cohort's layout: a request, not a row, gets its first block sooner."""
        groups: dict[tuple, list[EngineRequest]] = {}
        for row in running:
            groups.setdefault(cohort_key(row), []).append(row)
        apart = self.join_layout_min_rows is not None and not unopened
        first, layouts = [], []
        for rows in groups.values():
            joining = [row for row in rows if row.block == 0 and opening(row)] if apart else []
            if joining and len(rows) - len(joining) >= self.join_layout_min_rows:
                first += self.split(joining)
                rows = [row for row in rows if not (row.block == 0 and opening(row))]
            layouts += self.split(rows)
        return first + layouts

    def split(self, rows: list[EngineRequest]) -> list[list[EngineRequest]]:
        """`rows` in order, split into layouts that fit (`fits_one_layout`), each cut further into slices of about
        equal refresh positions (`max_refresh_positions`)."""
        layouts, current = [], []
        for row in rows:
            if current and not self.fits_one_layout([*current, row]):
                layouts.append(current)
                current = []
            current.append(row)
        layouts.append(current)
        return [piece for layout in layouts for piece in self.slices(layout)]

    def slices(self, rows: list[EngineRequest]) -> list[list[EngineRequest]]:
        """`rows` (one layout) in order, cut into slices whose canvases hold at most `max_refresh_positions`
        positions (a row alone may hold more), of about equal positions: the k-th slice ends where the running
        total reaches k shares, a share being the total over the fewest slices the budget allows."""
        budget = self.max_refresh_positions
        positions = [row.plan.canvas_width for row in rows]
        total = sum(positions)
        if budget is None or total <= budget:
            return [rows]
        share = total / -(-total // budget)
        slices, current, held, done = [], [], 0, 0
        for row, size in zip(rows, positions, strict=True):
            if current and held + size > budget:
                slices.append(current)
                current, held = [], 0
            current.append(row)
            held += size
            done += size
            if done >= share * (len(slices) + 1):  # cut at the running total's shares, so slices stay even
                slices.append(current)
                current, held = [], 0
        if current:
            slices.append(current)
        return [Slice(rows) for rows in slices] if len(slices) > 1 else slices
