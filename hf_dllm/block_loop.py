"""The block-denoising loop of `generate()`: `BlockDiffusionRun`, and the block events it reports.

One loop for every model family (LLaDA arXiv:2502.09992, Sec. 2.4; Fast-dLLM arXiv:2505.22618): blocks left to
right, and within a block steps that run the model on the positions the cache policy asks for (`cache.py`) and commit
what the unmasking policy decides (`decoding.py`), each step a pure tensor function captured as a CUDA graph where it
can be (`graphs.py`). The loop owns the block-level facts (which rows, which columns, forwards made) and reports them
as `BlockEvent`s to streamers, stopping criteria and the serving engine. `DiffusionGenerationMixin.generate`
(`generation_utils.py`) builds a run from the resolved settings and a `BlockPlan` (`block_plan.py`).

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

import torch

from .cache import CachePolicy
from .decoding import ScheduledThreshold, StepRules, UnmaskingPolicy, denoise_step
from .family import plan_for
from .generation_config import DiffusionGenerationConfig
from .graphs import MAX_GRAPHS, StepGraphs, spans_devices
from .kernels import upload
from .tensor_parallel import agree_across_ranks

# Steps of at least this many block positions (rows x block length) compute logits only where masks can be left
# (`UnmaskingPolicy.masked_bound`), rounded up to `CANDIDATE_GRANULARITY` positions per row so that few step shapes
# are captured. Below it the LM head reads its weight once whatever its rows: on an H100 at LLaDA2.0-mini's shape
# the head was 0.92 ms of a 17.7 ms batch-32 block step (1,024 positions, compute-bound) and ~0.23 ms at batch 1.
MIN_CANDIDATE_POSITIONS = 256
CANDIDATE_GRANULARITY = 8


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


def decoding_policies(
    model,
    config: DiffusionGenerationConfig,
    unmasking_policy: UnmaskingPolicy | None = None,
    cache_policy: CachePolicy | None = None,
) -> tuple[CachePolicy, UnmaskingPolicy]:
    """The cache and unmasking policies a run of `config` on `model` decodes with: the objects given (a new rule or
    cache is one `UnmaskingPolicy` / `CachePolicy` subclass), else those the model's family chooses for the
    settings (`DiffusionFamily.cache_policy`, `unmasking_policy`). Raises ValueError for settings the family's
    rules refuse, TypeError for a policy object of the wrong kind."""
    family = model.diffusion_family
    if cache_policy is not None and not isinstance(cache_policy, CachePolicy):
        raise TypeError(f"`cache_policy` must be a CachePolicy, got {type(cache_policy).__name__}.")
    if unmasking_policy is not None and not isinstance(unmasking_policy, UnmaskingPolicy):
        raise TypeError(f"`unmasking_policy` must be an UnmaskingPolicy, got {type(unmasking_policy).__name__}.")
    cache = cache_policy if cache_policy is not None else family.cache_policy(config)
    unmasking = unmasking_policy if unmasking_policy is not None else family.unmasking_policy(config, model.config)
    return cache, unmasking


class BlockDiffusionRun:
    """State of one `generate()` call: the canvas of the rows still decoding and the loop over blocks and steps.

    Rows (prompts) stay in lockstep: every block starts for all rows at the same step, so a row's tokens never
    depend on the other rows; within a block, a row whose rule says it is done is frozen (and counts no more
    forwards) while the others go on. Rows that finish (EOS with `eos_early_stop`, a stopping criterion, their
    last block) are dropped between blocks, so they cost no more forwards.

    A step is one tensor function (`step`: model forward on the positions the cache policy asks for, then the
    unmasking rule on the block) with no host synchronisation, so on CUDA it is captured once per shape as a CUDA
    graph and replayed (`graphs.py`); everywhere else, or with `disable_compile=True`, it runs eagerly.
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
        self._setup_decoding(model, config, device, unmasking_policy, cache_policy)
        self.streamer = streamer
        self.stopping_criteria = list(stopping_criteria or [])
        self.input_ids = input_ids

        self.plan = plan_for(self.family, input_ids, attention_mask, config)
        self.seq_len = self.plan.canvas_width
        self.x, self.key_mask, self.position_ids = self.family.lay_out(input_ids, attention_mask, self.plan, config)
        self.canvas = self.x.clone()
        self.sequences = torch.full(
            (batch, self.prompt_len + config.max_new_tokens), self.mask_id, dtype=torch.long, device=device
        )
        self.sequences[:, : self.prompt_len] = input_ids
        self.generated_columns = self.plan.prompt_end.unsqueeze(-1) + torch.arange(config.max_new_tokens, device=device)
        self.prompt_end = self.plan.prompt_end
        self.host_prompt_end = self.plan.prompt_end.cpu()
        self.rows = torch.arange(batch, device=device)
        self.host_rows = torch.arange(batch)
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)

        self._setup_cache(batch, MAX_GRAPHS)
        self._setup_rules()
        self.nfe_per_row = torch.zeros(batch, dtype=torch.long, device=device)
        self.block_end = self.plan.blocks[0][0] if self.plan.blocks else self.seq_len

    def _setup_decoding(
        self,
        model,
        config: DiffusionGenerationConfig,
        device: torch.device,
        unmasking_policy: UnmaskingPolicy | None,
        cache_policy: CachePolicy | None,
    ) -> None:
        """What a run decodes with, whatever its rows: the model's interface, the special-token rules, the cache
        and unmasking policies (shared with the continuous-batching engine, which lays rows out per block)."""
        self.model = model
        self.config = config
        self.device = device
        self.mask_id = config.mask_token_id
        self.family = model.diffusion_family
        self.shift = self.family.logits_shift
        self.cfg = config.cfg_scale > 0
        self.forward_kwargs = self.family.forward_kwargs(config)
        self.attention_masks: dict[tuple[int, int, int], object] = {}
        self._slot_tensors: dict[int, torch.Tensor] = {}  # `_logit_slots`' aranges, made once per size
        # `_step_columns`' index tensors for the block under way, made once per block and query range.
        self._block_columns: tuple[tuple[int, int], dict[tuple[int, int], tuple]] = ((-1, -1), {})

        eos = config.eos_token_ids
        self.eos_ids = torch.tensor(eos, device=device) if eos else None
        self.suppressed_ids = self.eos_ids if config.logits_eos_inf else None
        deferred = eos + ([config.eot_token_id] if config.eot_token_id is not None else [])
        self.deferred_ids = torch.tensor(deferred, device=device) if config.confidence_eos_eot_inf else None
        self.fill_id = eos[0] if eos else config.pad_token_id if config.pad_token_id is not None else self.mask_id

        self.cache_policy, self.unmasking = decoding_policies(model, config, unmasking_policy, cache_policy)
        if config.kv_cache_dtype is not None and not self.cache_policy.uses_cache:
            raise ValueError(
                f"`kv_cache_dtype={config.kv_cache_dtype!r}` needs a cache, and the cache policy "
                f"{type(self.cache_policy).__name__} keeps none."
            )
        # LLaDA2.0's in-block EOS stop (its `eos_early_stop`): without editing, a committed token is final.
        self.eos_stop_in_block = self.family.stops_inside_block(config, self.unmasking)
        self.nfe = 0

    def _setup_rules(self) -> None:
        """The step's decoding rules, once `graphs` is known (captured graphs read the runner's copies of the
        constant token-id tensors)."""
        if self.graphs is not None:
            if hasattr(self.unmasking, "keep_state_in"):  # a rule with device state its graphs read by address
                self.unmasking.keep_state_in(self.graphs)
            self.suppressed_ids = self.graphs.constant("suppressed_ids", self.suppressed_ids)
            self.deferred_ids = self.graphs.constant("deferred_ids", self.deferred_ids)
        self.rules = StepRules(
            self.unmasking,
            self.mask_id,
            self.config.temperature,
            self.config.remasking,
            self.suppressed_ids,
            self.deferred_ids,
        )

    def _graphs_allowed(self) -> bool:
        """Whether the CUDA-graph fast path applies: CUDA, greedy, no guidance (their random draws and doubled rows
        stay eager), a capturable model and policy, and not turned off with `disable_compile`."""
        config = self.config
        return not (
            self.device.type != "cuda"
            or config.disable_compile
            or not self._greedy_without_guidance()
            or self.model.config._attn_implementation == "flex_attention"  # BlockMask inputs are not tensors
            or spans_devices(self.model)  # a graph is one device's
            or not self._step_capturable()
            or self.unmasking.graph_key() is None  # a policy that does not say its step is capturable
        )

    def _greedy_without_guidance(self) -> bool:
        """Greedy low-confidence proposals without classifier-free guidance: no random draw shaped by the block
        and no doubled rows in a step."""
        config = self.config
        return config.temperature == 0 and config.remasking == "low_confidence" and not self.cfg

    def _step_capturable(self) -> bool:
        """The model's `_diffusion_step_capturable()`, asked in the mode the steps run in (without autograd): a model
        may choose its kernels by it (LLaDA2's grouped expert GEMMs are off while autograd records), and a run may be
        set up by a caller that has autograd on (the serving engine's scheduler thread)."""
        with torch.no_grad():
            return self.model._diffusion_step_capturable()

    def _graph_signature(self) -> tuple:
        """What every captured step of this run shares (shapes that vary per step are in `run_step`'s key)."""
        return (
            self.cache_policy.uses_cache,
            self.config.kv_cache_dtype,
            self.unmasking.graph_key(),
            self.eos_stop_in_block,  # whether steps take the `active` mask (a graph's inputs are fixed)
            tuple(sorted(self.forward_kwargs.items())),
            self.mask_id,
            None if self.suppressed_ids is None else tuple(self.suppressed_ids.tolist()),
            None if self.deferred_ids is None else tuple(self.deferred_ids.tolist()),
            self.model.config._attn_implementation,
            self.model.dtype,
            self.device,
        )

    def _new_cache(self):
        """A `DiffusionKVCache` for the run's forwards, or None when its cache policy keeps none."""
        if not self.cache_policy.uses_cache:
            return None
        cache = self.model._diffusion_new_cache(self.rows_per_forward, self.seq_len, self.config.kv_cache_dtype)
        cache.positions_below_length = True  # positions count the canvas' columns (`cache.PositionTables`)
        return cache

    def _graph_shape(self) -> tuple:
        """The shapes every captured step of the run shares (the start of its graphs' signature)."""
        return (self.rows_per_forward, self.seq_len, self.key_mask is None)

    def _setup_cache(self, rows: int, max_graphs: int) -> None:
        """`rows_per_forward` (the model's batch for `rows` rows: twice with classifier-free guidance), `graphs`, the
        model's CUDA-graph runner for this run's shapes where the fast path applies (`_graphs_allowed`; at most
        `max_graphs` captured shapes), and `cache`: the runner's (its graphs read it) or a new one."""
        self.rows_per_forward = rows * (2 if self.cfg else 1)
        self.graphs = None
        if self._graphs_allowed():
            signature = (*self._graph_shape(), *self._graph_signature())
            self.graphs = StepGraphs.acquire(self.model, signature, self._new_cache, max_graphs)
        self.cache = self.graphs.cache if self.graphs is not None else self._new_cache()

    def _model_rows(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Duplicate per-row tensors for the unconditional branch of classifier-free guidance."""
        if tensor is None or not self.cfg:
            return tensor
        return torch.cat([tensor, tensor], dim=0)

    def _attention_mask(self, q_len: int, kv_len: int, rows: int | None = None):
        """The key padding mask of the first `rows` rows (default all) and `kv_len` columns, prepared once per shape
        in the model's format."""
        rows = self.x.shape[0] if rows is None else rows
        if self.key_mask is None:
            return None
        if (rows, q_len, kv_len) not in self.attention_masks:
            self.attention_masks[(rows, q_len, kv_len)] = self.model._diffusion_attention_mask(
                self._model_rows(self.key_mask[:rows, :kv_len]), q_len
            )
        return self.attention_masks[(rows, q_len, kv_len)]

    def step(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        logits_index: torch.Tensor,
        block_index: torch.Tensor,
        scheduled: torch.Tensor,
        active: torch.Tensor | None = None,
        generated: torch.Tensor | None = None,
        attention_mask=None,
        logit_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One denoising step, a pure tensor function (graph-capturable).

        tokens, position_ids `(rows, q)`: the positions fed to the model (columns `cache_position` `(q,)`);
        logits_index `(L,)`: which of them carry the block's logits; block_index `(L,)`: where the block's tokens
        are among them (both `(rows, L)` when rows hold their blocks at different columns); scheduled `(rows,)`: the schedule's count; active `(rows,)`: rows still denoising (None: all);
        generated `(rows, L)`: the block's positions after each prompt (None: all; only editing reads it);
        logit_slots `(U,)` (`arange(U)`, U < L): logits only at each row's first U block positions in masked-first
        order (its masked positions in order, then the others), where the rule says no active row holds more
        than U masks (`_logit_slots`); None: at all L. Returns the new block, the draft `(rows, L)` and whether
        each row edited a committed token `(rows,)` (see `decoding.denoise_step`).
        """
        block = tokens.gather(1, block_index) if block_index.dim() == 2 else tokens.index_select(1, block_index)
        candidates = None
        if logit_slots is not None:
            # A stable sort of "not masked" puts each row's masked positions first, in position order.
            masked_first = torch.sort((block != self.mask_id).to(torch.uint8), dim=1, stable=True).indices
            candidates = masked_first.index_select(1, logit_slots)
            logits_index = logits_index.gather(1, candidates) if logits_index.dim() == 2 else logits_index[candidates]
        model_tokens, model_positions = tokens, position_ids
        if self.cfg:
            # LLaDA App. B.3: the unconditional branch sees the prompt masked (each row's own prompt columns).
            in_prompt = cache_position.unsqueeze(0) < self.prompt_end.unsqueeze(-1)
            unconditional = torch.where(in_prompt, self.mask_id, tokens)
            model_tokens = torch.cat([tokens, unconditional], dim=0)
            model_positions = self._model_rows(position_ids)
        logits = self.model._diffusion_forward(
            model_tokens,
            attention_mask,
            model_positions,
            self.cache,
            cache_position,
            logits_index,
            **self.forward_kwargs,
        ).to(tokens.device)  # a model split over GPUs returns logits on its last device
        if self.cfg:
            conditional, unconditional = logits.float().chunk(2, dim=0)
            logits = unconditional + (self.config.cfg_scale + 1) * (conditional - unconditional)
        return self.decide(block, logits, scheduled, generated, active, candidates)

    def decide(
        self,
        block: torch.Tensor,
        logits: torch.Tensor,
        scheduled: torch.Tensor,
        generated: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
        candidates: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's decision from the block's logits: block `(rows, L)`, logits `(rows, L, vocab)` (or `(rows, U,
        vocab)` at the positions `candidates` `(rows, U)`), the rest as in `step`; returns what `step` returns."""
        # Under tensor parallelism every rank keeps the first rank's tokens (a no-op for unsharded models).
        return agree_across_ranks(
            self.model, denoise_step(block, logits, self.rules, scheduled, generated, active, candidates)
        )

    def run_step(
        self,
        block_start: int,
        block_end: int,
        step: int,
        active: torch.Tensor | None = None,
        generated: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run step `step` of the block `[block_start, block_end)` for the rows `active` (default all; `generated`
        as in `step`); returns the new block `(rows, L)` and whether each row edited a committed token `(rows,)`."""
        new_block, draft, edited = self._step_of(*self._step_inputs(block_start, block_end, step, active, generated))
        self.nfe += 1
        self.x[:, block_start:block_end] = new_block
        if self.streamer is not None and hasattr(self.streamer, "put_draft"):
            full = self.canvas[:, block_start:block_end].clone()
            full[self.rows] = draft
            self.streamer.put_draft(full.cpu())
        return new_block, edited

    def _step_of(self, inputs: dict, key: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`step(**inputs)`, through the CUDA graph of `key` (`_step_inputs`) where the run has graphs."""
        if self.graphs is None:
            return self.step(**inputs)
        return self.graphs.run(key, self.step, inputs)

    def _step_inputs(
        self,
        block_start: int,
        block_end: int,
        step: int,
        active: torch.Tensor | None,
        generated: torch.Tensor | None,
        rows: int | None = None,
    ) -> tuple[dict, tuple]:
        """The inputs of `step` for step `step` of the block (the positions the cache policy asks for) of the first
        `rows` rows (default all; `active` and `generated` are every row's), and the key of its CUDA graph (what
        fixes every input's shape)."""
        q_start, q_end = self.cache_policy.query_range(block_start, block_end, self.seq_len, first_step=step == 0)
        q_start = min(q_start, block_start - self.shift)
        device = self.device
        rows = self.x.shape[0] if rows is None else rows
        kv_len = self.seq_len if self.cache is not None else q_end
        cache_position, logits_index, block_index = self._step_columns(block_start, block_end, q_start, q_end)
        inputs = dict(
            tokens=self.x[:rows, q_start:q_end],
            position_ids=self.position_ids[:rows, q_start:q_end],
            cache_position=cache_position,
            logits_index=logits_index,
            block_index=block_index,
            scheduled=self.unmasking.scheduled_counts(step, self.x.shape[0], device)[:rows],
            active=None if active is None else active[:rows],
            generated=None if generated is None else generated[:rows],
            attention_mask=self._attention_mask(q_end - q_start, kv_len, rows),
            logit_slots=self._logit_slots(step, rows, block_end - block_start),
        )
        # Whether a mask is fed is part of the shape: a key mask of all ones may be prepared as None. Where the
        # block lies is not: every column index is an input tensor, so one graph serves every block's step of one
        # shape (in particular the dual/prefix cache's full forward at each block start, captured at the second
        # block and replayed from the third instead of running eagerly once per block).
        mask_fed = inputs["attention_mask"] is not None
        slots = None if inputs["logit_slots"] is None else inputs["logit_slots"].shape[0]
        return inputs, (rows, q_end - q_start, block_end - block_start, kv_len, mask_fed, slots)

    def _step_columns(
        self, block_start: int, block_end: int, q_start: int, q_end: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`step`'s column indices for the block `[block_start, block_end)` fed from column `q_start` to `q_end`:
        cache_position `(q,)`, logits_index and block_index `(L,)`. Made once per block and query range (the same
        tensors at every step of a block, so a CUDA-graph replay need not copy them again: `graphs.py`)."""
        block, made = self._block_columns
        if block != (block_start, block_end):
            made = {}
            self._block_columns = ((block_start, block_end), made)
        columns = made.get((q_start, q_end))
        if columns is None:
            device = self.device
            columns = made[(q_start, q_end)] = (
                torch.arange(q_start, q_end, device=device),
                torch.arange(block_start - self.shift - q_start, block_end - self.shift - q_start, device=device),
                torch.arange(block_start - q_start, block_end - q_start, device=device),
            )
        return columns

    def _logit_slots(self, step: int, rows: int, length: int) -> torch.Tensor | None:
        """`arange(U)` on the device when step `step` of a block of `length` positions needs logits at only U < L
        positions of each row (see `step`), else None: the rule bounds the masks an active row can hold
        (`UnmaskingPolicy.masked_bound`), the step is large enough for the LM head's rows to cost
        (`MIN_CANDIDATE_POSITIONS`), and nothing else reads the other positions' logits (greedy low-confidence
        proposals without guidance; a streamer's drafts show every position's candidate)."""
        if (
            rows * length < MIN_CANDIDATE_POSITIONS
            or not self._greedy_without_guidance()
            or (self.streamer is not None and hasattr(self.streamer, "put_draft"))
        ):
            return None
        bound = self.unmasking.masked_bound(step)
        if bound is None:
            return None
        slots = min(length, max(1, -(-bound // CANDIDATE_GRANULARITY) * CANDIDATE_GRANULARITY))
        if slots >= length:
            return None
        cached = self._slot_tensors.get(slots)
        if cached is None:
            cached = self._slot_tensors[slots] = torch.arange(slots, device=self.device)
        return cached

    def _generated(self, block_start: int, block_end: int) -> torch.Tensor:
        """`(rows, L)` bool: the block's columns at or after each row's first generated position."""
        columns = torch.arange(block_start, block_end, device=self.device)
        return columns.unsqueeze(0) >= self.prompt_end.unsqueeze(-1)

    def denoise_block(self, steps: torch.Tensor, block_start: int, block_end: int) -> None:
        """Denoise the block at columns `[block_start, block_end)` until every row's rule says done; `steps` `(rows,)`
        long (host) is each row's share of `steps` for it (`BlockPlan.block_steps`)."""
        rows = self.x.shape[0]
        if isinstance(self.unmasking, ScheduledThreshold):
            generated_columns = (block_end - self.host_prompt_end[self.host_rows]).clamp(0, block_end - block_start)
            self.unmasking.start_block(block_end - block_start, steps, generated_columns)
        else:
            self.unmasking.start_block(block_end - block_start, steps)
        if hasattr(self.unmasking, "prepare_block"):  # a rule with per-block device state resets it here
            self.unmasking.prepare_block(rows, self.device)
        self.cache_policy.start_block(block_start)
        # Rows that stop while their block still holds masks (in-block EOS stop) or that may edit committed tokens
        # are frozen by an `active` mask inside the step; otherwise a row that is done has nothing left to commit,
        # and the step needs neither mask (two fewer inputs to copy per replay).
        freeze = self.unmasking.edits or self.eos_stop_in_block
        generated = self._generated(block_start, block_end) if freeze else None
        active = torch.ones(rows, dtype=torch.bool, device=self.device)
        # LLaDA2.0's in-block EOS stop can end a block early: then ask after every step whether rows are left.
        known_steps = None if self.eos_stop_in_block else self.unmasking.steps_for_block()
        if known_steps is not None and not freeze:
            # Every row makes every step: no per-step bookkeeping, and no host synchronisation.
            for step in range(known_steps):
                self.run_step(block_start, block_end, step)
            # A row that needed fewer steps (LLaDA2's first block, partly prompt) had no mask left: unchanged.
            self.nfe_per_row[self.rows] += upload(self.unmasking.steps_per_row(), self.device)
            return
        step = 0
        while True:
            before = self.x[:, block_start:block_end].clone() if freeze else None
            masked_before = (before == self.mask_id).any(-1) if freeze else None
            block, edited = self.run_step(block_start, block_end, step, active if freeze else None, generated)
            self.nfe_per_row.index_add_(0, self.rows, active.long())
            step += 1
            active = self.unmasking.still_active(active, masked_before, (block == self.mask_id).any(-1), edited, step)
            if self.eos_stop_in_block:
                stop = self._eos_committed_after_all_masks(before, block, generated)
                self.stopped[self.rows] |= stop
                active = active & ~stop
            if known_steps is not None:
                if step >= known_steps:
                    break
            elif not bool(active.any()):
                break

    def _eos_committed_after_all_masks(
        self, before: torch.Tensor, block: torch.Tensor, generated: torch.Tensor
    ) -> torch.Tensor:
        """`(rows,)` bool, LLaDA2.0's in-block EOS stop: the step committed an EOS, and no mask lies between the
        prompt and the row's first EOS (earlier blocks hold neither: a row stops after a block with an EOS)."""
        committed = (before == self.mask_id) & (block != self.mask_id)
        is_eos = torch.isin(block, self.eos_ids) & generated
        committed_eos = (committed & is_eos).any(-1)
        length = block.shape[-1]
        first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), length)
        before_eos = torch.arange(length, device=block.device) < first_eos.unsqueeze(-1)
        return committed_eos & ~((block == self.mask_id) & before_eos).any(-1)

    def finished_rows(self, last_block: torch.Tensor, block_end: int) -> torch.Tensor:
        """`(active_rows,)` bool: rows that hold an EOS (with `eos_early_stop`; always for block-causal models,
        whose later blocks cannot change what comes before), that stopped inside the block, or that decoded their
        last block (`last_block`, `(active_rows,)` bool, host)."""
        finished = self.stopped[self.rows].clone()
        if self.eos_ids is not None and self.family.eos_ends_row(self.config):
            finished |= (torch.isin(self.x, self.eos_ids) & self._generated_part(block_end)).any(dim=-1)
        finished |= upload(last_block, finished.device)
        return finished

    def _rows_can_finish(self, last_block: torch.Tensor) -> bool:
        """Whether any row may finish after this block (host-side facts only: `last_block` `(active_rows,)` bool):
        checking on the GPU costs a host synchronisation, which stalls the next block's first step."""
        eos_stop = self.eos_ids is not None and self.family.eos_ends_row(self.config)
        return eos_stop or self.eos_stop_in_block or bool(last_block.any())

    def _generated_part(self, block_end: int) -> torch.Tensor:
        """`(rows, canvas)` bool: generated columns decoded so far."""
        columns = torch.arange(self.seq_len, device=self.device).unsqueeze(0)
        return (columns >= self.prompt_end.unsqueeze(-1)) & (columns < block_end)

    def committed_positions(self, host_rows: torch.Tensor, block_end: int) -> torch.Tensor:
        """`(n,)` long (host): generated positions of the batch rows `host_rows` that are final once the block
        ending at column `block_end` is committed."""
        committed = block_end - self.host_prompt_end[host_rows]
        return committed.clamp(0, self.config.max_new_tokens)

    def finish_rows(self, finished: torch.Tensor, block_end: int) -> None:
        """Drop the active rows marked in `finished` (`(active_rows,)` bool): fill their positions after
        `block_end` (and, for block-causal models, everything after the first generated EOS, where the reference
        cuts its output) with EOS, write them out, and remove them from later forwards."""
        self.x[finished] = self.filled(self.x[finished], self._generated_part(block_end)[finished], block_end)
        self._write_rows()
        keep = ~finished
        kept = keep.nonzero().squeeze(-1)
        self.cache_policy.keep_rows(self.cache, kept)
        self.x, self.rows, self.position_ids = self.x[keep], self.rows[keep], self.position_ids[keep]
        self.host_rows = self.host_rows[keep.cpu()]
        self.prompt_end = self.prompt_end[keep]
        if self.key_mask is not None:
            self.key_mask = self.key_mask[keep]

    def filled(self, rows: torch.Tensor, generated_part: torch.Tensor, block_end: int) -> torch.Tensor:
        """Ended rows `(k, canvas)` as the output shows them: EOS (`fill_id`) from column `block_end` on and, for
        block-causal models, after the first generated EOS (where the reference cuts its output);
        `generated_part` `(k, canvas)` bool marks the generated columns decoded so far."""
        rows = rows.clone()
        rows[:, block_end:] = self.fill_id
        if self.family.cut_after_first_eos and self.eos_ids is not None:
            is_eos = torch.isin(rows, self.eos_ids) & generated_part
            after_first = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
            rows[after_first] = self.fill_id
        return rows

    def stop_rows(self, rows: torch.Tensor) -> None:
        """Stop the batch rows `rows` (`(k,)` long, host) after the block just committed (`BlockEvent.stop`)."""
        finished = torch.isin(self.host_rows, rows)
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
        self.canvas[self.rows] = self.x
        self.sequences[self.rows, self.prompt_len :] = self.x.gather(1, self.generated_columns[self.rows])

    def committed_for_all_rows(self) -> int:
        """Generated positions final in every row of the batch (rows that ended are final everywhere)."""
        if len(self.host_rows) == 0:
            return self.config.max_new_tokens
        return int(self.committed_positions(self.host_rows, self.block_end).min())

    def __iter__(self):
        """Decode block by block; yield a `BlockEvent` after each committed block (see `BlockEvent`). The run's
        own work is done without autograd (a consumer iterating it needs no `torch.no_grad()`); the consumer's code
        between events keeps its own grad mode."""
        try:
            for block, (block_start, block_end) in enumerate(self.plan.blocks):
                host_rows, device_rows = self.host_rows, self.rows
                previously = self.committed_positions(host_rows, block_start)
                ended = None
                with self._without_autograd():
                    self.denoise_block(self.plan.block_steps[self.host_rows, block], block_start, block_end)
                    self._write_rows()
                    self.block_end = block_end
                    last_block = self.plan.last_block[self.host_rows] == block
                    if self._rows_can_finish(last_block):
                        ended = self.finished_rows(last_block, block_end)
                        if bool(ended.any()):
                            self.finish_rows(ended, block_end)
                committed = self.committed_positions(host_rows, block_end)
                yield BlockEvent(self, block, host_rows, device_rows, previously, committed, ended)
                if self.x.shape[0] == 0:
                    break
        finally:
            if self.graphs is not None:
                StepGraphs.release_to(self.model)

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
