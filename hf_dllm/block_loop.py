"""The block-denoising loop of `generate()`: `BlockDiffusionRun`, and the block events it reports.

One loop for every model family (LLaDA arXiv:2502.09992, Sec. 2.4; Fast-dLLM arXiv:2505.22618): blocks left to
right, and within a block steps that run the model on the positions the cache policy asks for (`cache.py`) and commit
what the unmasking policy decides (`decoding.py`), each step a pure tensor function captured as a CUDA graph where it
can be (`graphs.py`). The steps are a `StepMachine` (`step_machine.py`, which the serving engine's layouts share);
the run owns the call's canvas and block-level facts (which rows, which columns, forwards made) and reports them as
`BlockEvent`s to streamers and stopping criteria. `DiffusionGenerationMixin.generate` (`generation_utils.py`)
builds a run from the resolved settings and a `BlockPlan` (`block_plan.py`).

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

import torch

from .cache import CachePolicy
from .decoding import UnmaskingPolicy
from .family import plan_for
from .generation_config import DiffusionGenerationConfig
from .graphs import MAX_GRAPHS
from .step_machine import Canvas, StepMachine, decoding_policies


class BlockEvent:
    """One committed block of a run: what `BlockDiffusionRun` yields (iterate `model.generate_blocks(...)`) once
    a block is committed and the rows that ended with it are dropped from later forwards.

    The host-side facts are plain attributes (no device synchronisation); what lives on the device is read on
    demand (`ended`, `nfe_per_row`, `new_tokens`, `prefix`), so a consumer that does not ask costs nothing.

    Attributes:
        block (`int`): index of the block in the run (0-based).
        rows (`torch.LongTensor` `(n,)`, host): the batch rows decoded in this block.
        previously_committed, committed (`torch.LongTensor` `(n,)`, host): how many generated positions of each
            row were final before / are final after this block; `[previously_committed, committed)` of
            `sequences[row, prompt_width:]` is what the block added (`new_tokens`).
        forwards (`int`): model forwards the run made so far (one batched forward counts once).
    """

    def __init__(self, run: "BlockDiffusionRun", block: int, rows, device_rows, previously_committed, committed, ended):
        self._run = run
        self.block = block
        self.rows = rows
        self._device_rows = device_rows
        self.previously_committed = previously_committed
        self.committed = committed
        self.forwards = run.nfe
        self._ended = ended  # `(n,)` bool on the device, or None when no row could end with this block
        self._host_ended: torch.Tensor | None = None
        self._nfe_per_row = run.nfe_per_row[device_rows]  # a copy (an index tensor selects)
        self._stopped = torch.zeros(len(rows), dtype=torch.bool)

    @property
    def ended(self) -> torch.Tensor:
        """`(n,)` bool (host): rows that left the run with this block, by the run's own rules (EOS with
        `eos_early_stop`, in-block EOS stop, their last block) or by `stop()`."""
        if self._host_ended is None:
            ended = torch.zeros(len(self.rows), dtype=torch.bool)
            self._host_ended = ended if self._ended is None else self._ended.cpu()
        return self._host_ended | self._stopped

    @property
    def nfe_per_row(self) -> torch.Tensor:
        """`(n,)` long (host): forwards each row took part in so far (final for rows that ended)."""
        return self._nfe_per_row.cpu()

    @property
    def sequences(self) -> torch.Tensor:
        """The run's output `(batch, prompt_width + max_new_tokens)` as it stands (undecoded positions masked)."""
        return self._run.sequences

    def new_tokens(self) -> list[list[int]]:
        """For each row, the generated tokens this block committed (`[previously_committed, committed)`)."""
        start = self._run.prompt_len
        generated = self._run.sequences[self._device_rows, start:].cpu()
        return [
            row[begin:end].tolist()
            for row, begin, end in zip(
                generated, self.previously_committed.tolist(), self.committed.tolist(), strict=True
            )
        ]

    def prefix(self, rows: torch.Tensor | None = None, length: int | None = None) -> torch.Tensor:
        """`(k, prompt_width + length)`: the prompts and first `length` generated tokens of the event rows selected
        by `rows` (a `(n,)` bool mask; all by default). `length` defaults to their `committed` count, which must
        then be equal; it may not exceed any selected row's `committed` (never a mask token)."""
        selected = torch.ones(len(self.rows), dtype=torch.bool) if rows is None else rows
        if length is None:
            lengths = self.committed[selected].unique()
            if len(lengths) > 1:
                raise ValueError("prefix(): the selected rows committed different numbers of positions: pass length.")
            length = int(lengths[0]) if len(lengths) else 0
        elif bool((self.committed[selected] < length).any()):
            raise ValueError(f"prefix(): length {length} exceeds what a selected row committed.")
        width = self._run.prompt_len + length
        return self._run.sequences[self._device_rows[selected.to(self._device_rows.device)], :width]

    def stop(self, rows: torch.Tensor) -> None:
        """Stop the event rows marked in `rows` (`(n,)` bool): they take part in no more forwards and their
        positions after this block are filled with EOS, as for an EOS stop. Rows that already ended are left as
        they are."""
        rows = torch.as_tensor(rows, dtype=torch.bool).cpu().reshape(-1)
        if rows.shape != (len(self.rows),):
            raise ValueError(
                f"stop(): expected a ({len(self.rows)},) bool mask over the event's rows, got {tuple(rows.shape)}."
            )
        new = rows & ~self.ended
        if bool(new.any()):
            self._run.stop_rows(self.rows[new])
            self._stopped |= new


class BlockDiffusionRun:
    """State of one `generate()` call: the canvas of the rows still decoding and the loop over its blocks.

    Rows (prompts) stay in lockstep: every block starts for all rows at the same step, so a row's tokens never
    depend on the other rows; within a block, a row whose rule says it is done is frozen (and counts no more
    forwards) while the others go on. Rows that finish (EOS with `eos_early_stop`, a stopping criterion, their
    last block) are dropped between blocks, so they cost no more forwards.

    The steps are the run's `StepMachine` (`step_machine.py`: policies, rules, K/V cache, CUDA graphs, the step
    itself) on the run's `Canvas` of active rows; the run owns the rest: the plan, the output `sequences`, the
    batch's canvas, finished rows, the streamer and the stopping criteria.
    """

    def __init__(
        self,
        model,
        config: DiffusionGenerationConfig,
        input_ids,
        attention_mask,
        streamer=None,
        stopping_criteria=None,
        *,
        unmasking_policy: UnmaskingPolicy | None = None,
        cache_policy: CachePolicy | None = None,
    ):
        batch, self.prompt_len = input_ids.shape
        device = input_ids.device
        policies = decoding_policies(model, config, unmasking_policy, cache_policy)
        self.model, self.config, self.device = model, config, device
        self.streamer = streamer
        self.stopping_criteria = list(stopping_criteria or [])
        self.input_ids = input_ids

        family = model.diffusion_family
        self.plan = plan_for(family, input_ids, attention_mask, config)
        self.seq_len = self.plan.canvas_width
        x, key_mask, position_ids = family.lay_out(input_ids, attention_mask, self.plan, config)
        self.batch_canvas = x.clone()  # every row's canvas: the active rows' copied in after each block
        self.sequences = torch.full(
            (batch, self.prompt_len + config.max_new_tokens), config.mask_token_id, dtype=torch.long, device=device
        )
        self.sequences[:, : self.prompt_len] = input_ids
        self.generated_columns = self.plan.prompt_end.unsqueeze(-1) + torch.arange(config.max_new_tokens, device=device)
        self.canvas = Canvas(x, position_ids, key_mask, self.plan.prompt_end, self.plan.prompt_end.cpu())
        drafts = streamer is not None and hasattr(streamer, "put_draft")
        self.machine = StepMachine(
            model, config, device, policies, batch, self._new_cache, self._graph_shape, MAX_GRAPHS, drafts
        )
        # The machine's objects that callers read of the run (fixed for the run).
        self.unmasking, self.cache_policy = self.machine.unmasking, self.machine.cache_policy
        self.rules, self.cache = self.machine.rules, self.machine.cache
        self.block_end = self.plan.blocks[0][0] if self.plan.blocks else self.seq_len

    def _new_cache(self, rows: int):
        """A `DiffusionKVCache` of `rows` rows over the run's canvas (the machine asks when its policy keeps one)."""
        cache = self.model._diffusion_new_cache(rows, self.seq_len, self.config.kv_cache_dtype)
        cache.positions_below_length = True  # positions count the canvas' columns (`cache.PositionTables`)
        return cache

    def _graph_shape(self, rows: int) -> tuple:
        """The shapes every captured step of the run shares, for `rows` rows per forward (its graphs' signature
        starts with them)."""
        return (rows, self.seq_len, self.canvas.key_mask is None)

    # What callers read of the run that changes as it goes: the machine's and the canvas' state.
    @property
    def x(self) -> torch.Tensor:
        """`(active_rows, canvas)`: the active rows' canvas."""
        return self.canvas.x

    @property
    def nfe(self) -> int:
        """Model forwards the run made so far (one batched forward counts once)."""
        return self.machine.nfe

    @property
    def nfe_per_row(self) -> torch.Tensor:
        """`(batch,)` long: forwards each row took part in so far."""
        return self.canvas.nfe_per_row

    @property
    def graphs(self):
        """The model's CUDA-graph runner the steps run through, or None (eager steps); settable (benchmarks)."""
        return self.machine.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.machine.graphs = graphs

    def run_step(
        self,
        block_start: int,
        block_end: int,
        step: int,
        active: torch.Tensor | None = None,
        generated: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run step `step` of the block `[block_start, block_end)` for the rows `active` (default all; `generated`
        as in `StepMachine.step`) and write it into the canvas; returns the new block `(rows, L)` and whether each
        row edited a committed token `(rows,)`. A streamer with `put_draft` gets the batch's draft."""
        new_block, draft, edited = self.machine.step_rows(self.canvas, block_start, block_end, step, active, generated)
        self.canvas.x[:, block_start:block_end] = new_block
        if self.machine.drafts:
            full = self.batch_canvas[:, block_start:block_end].clone()
            full[self.canvas.rows] = draft
            self.streamer.put_draft(full.cpu())
        return new_block, edited

    def committed_positions(self, host_rows: torch.Tensor, block_end: int) -> torch.Tensor:
        """`(n,)` long (host): generated positions of the batch rows `host_rows` that are final once the block
        ending at column `block_end` is committed."""
        committed = block_end - self.canvas.host_prompt_end[host_rows]
        return committed.clamp(0, self.config.max_new_tokens)

    def finish_rows(self, finished: torch.Tensor, block_end: int) -> None:
        """Drop the active rows marked in `finished` (`(active_rows,)` bool): fill their positions after
        `block_end` (and, for block-causal models, everything after the first generated EOS, where the reference
        cuts its output) with EOS, write them out, and remove them from later forwards."""
        self.canvas.fill_ended(self.machine, finished, block_end)
        self._write_rows()
        if self.machine.unmasking.keeps_ended_rows:
            self.canvas.ended |= finished
            return
        keep = ~finished
        self.machine.cache_policy.keep_rows(self.machine.cache, keep.nonzero().squeeze(-1))
        self.canvas.keep(keep)

    def stop_rows(self, rows: torch.Tensor) -> None:
        """Stop the batch rows `rows` (`(k,)` long, host) after the block just committed (`BlockEvent.stop`)."""
        finished = torch.isin(self.canvas.host_rows, rows)
        if bool(finished.any()):
            with self._without_autograd():
                self.finish_rows(finished.to(self.device), self.block_end)

    def _without_autograd(self):
        """The grad mode of the run's own work: `torch.inference_mode()` on the CPU, where skipping autograd's view
        and version bookkeeping saves about a fifth of a small model's step (its tensors, like the K/V cache, are
        then touched only in this mode); `torch.no_grad()` elsewhere (CUDA graphs and the serving engine keep plain
        tensors). The caller's `sequences` and `nfe_per_row` are allocated outside it either way."""
        return torch.inference_mode() if self.device.type == "cpu" else torch.no_grad()

    def _write_rows(self) -> None:
        """Copy the active rows' canvas into the batch canvas and their generated positions into `sequences`."""
        rows = self.canvas.rows
        self.batch_canvas[rows] = self.canvas.x
        self.sequences[rows, self.prompt_len :] = self.canvas.x.gather(1, self.generated_columns[rows])

    def committed_for_all_rows(self) -> int:
        """Generated positions final in every row of the batch (rows that ended are final everywhere)."""
        if len(self.canvas.host_rows) == 0:
            return self.config.max_new_tokens
        return int(self.committed_positions(self.canvas.host_rows, self.block_end).min())

    def __iter__(self):
        """Decode block by block; yield a `BlockEvent` after each committed block (see `BlockEvent`). The run's
        own work is done without autograd (a consumer iterating it needs no `torch.no_grad()`); the consumer's code
        between events keeps its own grad mode."""
        canvas = self.canvas
        try:
            for block, (block_start, block_end) in enumerate(self.plan.blocks):
                host_rows, device_rows = canvas.host_rows, canvas.rows
                previously = self.committed_positions(host_rows, block_start)
                with self._without_autograd():
                    steps = self.plan.block_steps[host_rows, block]
                    canvas.denoise_block(self.machine, steps, block_start, block_end, self.run_step)
                    self._write_rows()
                    self.block_end = block_end
                    ended = canvas.finished_rows(self.machine, self.plan.last_block[host_rows] == block, block_end)
                    if ended is not None and bool(ended.any()):
                        self.finish_rows(ended, block_end)
                committed = self.committed_positions(host_rows, block_end)
                yield BlockEvent(self, block, host_rows, device_rows, previously, committed, ended)
                if canvas.x.shape[0] == 0 or (self.machine.unmasking.keeps_ended_rows and bool(canvas.ended.all())):
                    break
        finally:
            self.machine.release()

    def run(self) -> torch.LongTensor:
        """Decode every block, feeding the run's streamer and stopping criteria (what `generate()` does); returns
        `sequences`.

        The streamer gets the prompts, then after every block the generated positions that became final in every
        row (rows that ended are final everywhere), then `end()`. Stopping criteria see each row's committed
        prefix, as in transformers (`apply_stopping_criteria`)."""
        streamer = self.streamer
        if streamer is not None:
            streamer.put(self.sequences[:, : self.prompt_len].cpu())
        streamed = 0  # generated positions already sent to the streamer (final in every row)
        for event in self:
            if self.stopping_criteria:
                event.stop(apply_stopping_criteria(self.stopping_criteria, event))
            if streamer is not None:
                final = self.committed_for_all_rows()
                if final > streamed:
                    streamer.put(self.sequences[:, self.prompt_len + streamed : self.prompt_len + final].cpu())
                    streamed = final
        if streamer is not None:
            streamer.end()
        return self.sequences


def apply_stopping_criteria(stopping_criteria, event: BlockEvent) -> torch.Tensor:
    """`(n,)` bool over the event's rows: transformers' stopping criteria (`StoppingCriteriaList`,
    `MaxLengthCriteria`, `StopStringCriteria`, `EosTokenCriteria`, or any `criterion(input_ids, scores)`) asked as an
    autoregressive `generate()` asks them: once per new token, on each row's committed prefix `(rows, prompt_width
    + k)` (the prompt and committed tokens, never a mask token), for every k the block committed. A block commits
    several tokens at once, so asking only at its end would miss what a criterion looks for at the end of the
    sequence (a stop string, an EOS) when it lies inside the block. `scores` is None: a diffusion step has no single
    next-token distribution."""
    stop = torch.zeros(len(event.rows), dtype=torch.bool)
    if not len(event.rows):
        return stop
    first, last = int(event.previously_committed.min()) + 1, int(event.committed.max())
    for length in range(first, last + 1):
        asked = (event.previously_committed < length) & (length <= event.committed) & ~stop
        if not bool(asked.any()):
            continue
        prefix = event.prefix(asked, length)
        count = int(asked.sum())
        for criterion in stopping_criteria:
            result = torch.as_tensor(criterion(prefix, None), dtype=torch.bool).cpu().reshape(-1)
            if result.numel() == 1:
                result = result.expand(count)
            if result.shape != (count,):
                raise ValueError(
                    f"a stopping criterion returned shape {tuple(result.shape)} for input_ids of shape "
                    f"{tuple(prefix.shape)}: it must return a (batch,) bool tensor (or one bool)."
                )
            stop[asked] |= result
    return stop
