"""The step machine: what a block's denoising steps decode with, shared by `generate()`'s run
(`block_loop.BlockDiffusionRun`) and the serving engine's layouts (`serving/layout.LayoutRun`).

`StepMachine` owns everything a step needs that is not the rows themselves: the model's family object's policies
(`cache.py`'s cache policy, `decoding.py`'s unmasking policy and `StepRules`), the special-token rules, the K/V
cache and the model's CUDA-graph runner (`graphs.py`), the step's inputs and the step itself (a pure tensor
function, captured per shape as a CUDA graph where it can be). The rows are a `Canvas` (with the loop over a
block's steps and which rows end with it), which the run (one canvas for the whole call, rows dropped as they end)
and each engine layout (a canvas laid out anew before each block) own; what differs between the two (how the cache
is made, the shape their graphs share, the cache policy) is given to the machine when it is made, and each passes
its own step runner to `Canvas.denoise_block` (the engine's runs some steps on packed rows).

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .cache import CachePolicy
from .decoding import ScheduledThreshold, StepRules, UnmaskingPolicy
from .generation_config import DiffusionGenerationConfig
from .graphs import StepGraphs, spans_devices
from .kernels import kernel_mode, upload
from .tensor_parallel import agree_across_ranks, local_head_logits, vocab_shard

# Steps of at least this many block positions (rows x block length) compute logits only where masks can be left
# (`UnmaskingPolicy.masked_bound`), rounded up to `CANDIDATE_GRANULARITY` positions per row so that few step shapes
# are captured. Below it the LM head reads its weight once whatever its rows: on an H100 at LLaDA2.0-mini's shape
# the head was 0.92 ms of a 17.7 ms batch-32 block step (1,024 positions, compute-bound) and ~0.23 ms at batch 1.
MIN_CANDIDATE_POSITIONS = 256
CANDIDATE_GRANULARITY = 8

# A block step's runner: `run_step(block_start, block_end, step, active, generated)` runs the step on the canvas
# and returns the new block `(rows, L)` and whether each row edited a committed token `(rows,)`.
RunStep = Callable[[int, int, int, "torch.Tensor | None", "torch.Tensor | None"], tuple]


def decoding_policies(
    model,
    config: DiffusionGenerationConfig,
    unmasking_policy: UnmaskingPolicy | None = None,
    cache_policy: CachePolicy | None = None,
) -> tuple[CachePolicy, UnmaskingPolicy]:
    """The cache and unmasking policies a run of `config` on `model` decodes with: the objects given (a new rule or
    cache is one `UnmaskingPolicy` / `CachePolicy` subclass), else those the model's family chooses for the
    settings (`DiffusionFamily.cache_policy`, `unmasking_policy`). Raises ValueError for settings the family's
    rules refuse (and a `kv_cache_dtype` with a cache policy that keeps no cache), TypeError for a policy object
    of the wrong kind."""
    family = model.diffusion_family
    if cache_policy is not None and not isinstance(cache_policy, CachePolicy):
        raise TypeError(f"`cache_policy` must be a CachePolicy, got {type(cache_policy).__name__}.")
    if unmasking_policy is not None and not isinstance(unmasking_policy, UnmaskingPolicy):
        raise TypeError(f"`unmasking_policy` must be an UnmaskingPolicy, got {type(unmasking_policy).__name__}.")
    cache = cache_policy if cache_policy is not None else family.cache_policy(config)
    unmasking = unmasking_policy if unmasking_policy is not None else family.unmasking_policy(config, model.config)
    if config.kv_cache_dtype is not None and not cache.uses_cache:
        raise ValueError(
            f"`kv_cache_dtype={config.kv_cache_dtype!r}` needs a cache, and the cache policy "
            f"{type(cache).__name__} keeps none."
        )
    return cache, unmasking


class Canvas:
    """The rows a block's steps decode, as the model sees them.

    Attributes:
        x (`torch.LongTensor` `(rows, width)`): each row's canvas (prompt, committed tokens, masks).
        position_ids (`torch.LongTensor` `(rows, width)`): each column's RoPE position.
        key_mask (`torch.LongTensor` `(rows, width)` or None): 1 where a column is a key (None: every column).
        prompt_end (`torch.LongTensor` `(rows,)`, device): each row's first generated column.
        rows (`torch.LongTensor` `(rows,)`, device), host_rows (host): each row's index among the rows the canvas
            started with, which index `host_prompt_end`, `stopped` and `nfe_per_row` (rows are dropped, `keep`).
        host_prompt_end (`torch.LongTensor` `(batch,)`, host): `prompt_end` of every row the canvas started with.
        stopped (`torch.BoolTensor` `(batch,)`): rows that stopped inside their block (in-block EOS stop).
        ended (`torch.BoolTensor` `(rows,)`): rows that ended but stay in the batch (`keeps_ended_rows`): still
            decoded, counted in no forward, their blocks shown as the fill token.
        nfe_per_row (`torch.LongTensor` `(batch,)`): forwards each row took part in.
        attention_masks: the key mask in the model's format, per `(rows, q_len, kv_len)` (`StepMachine`).
    """

    def __init__(self, x, position_ids, key_mask, prompt_end: torch.Tensor, host_prompt_end: torch.Tensor):
        batch, device = x.shape[0], x.device
        self.x, self.position_ids, self.key_mask = x, position_ids, key_mask
        self.prompt_end, self.host_prompt_end = prompt_end, host_prompt_end
        self.width = x.shape[1]
        self.rows = torch.arange(batch, device=device)
        self.host_rows = torch.arange(batch)
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)
        self.nfe_per_row = torch.zeros(batch, dtype=torch.long, device=device)
        self.attention_masks: dict[tuple[int, int, int], object] = {}

    def generated(self, block_start: int, block_end: int) -> torch.Tensor:
        """`(rows, L)` bool: the block's columns at or after each row's first generated position."""
        columns = torch.arange(block_start, block_end, device=self.x.device)
        return columns.unsqueeze(0) >= self.prompt_end.unsqueeze(-1)

    def generated_part(self, block_end: int) -> torch.Tensor:
        """`(rows, width)` bool: generated columns decoded so far."""
        columns = torch.arange(self.width, device=self.x.device).unsqueeze(0)
        return (columns >= self.prompt_end.unsqueeze(-1)) & (columns < block_end)

    def keep(self, keep: torch.Tensor) -> None:
        """Keep only the rows marked in `keep` (`(rows,)` bool, device)."""
        self.x, self.rows, self.position_ids = self.x[keep], self.rows[keep], self.position_ids[keep]
        self.host_rows = self.host_rows[keep.cpu()]
        self.prompt_end = self.prompt_end[keep]
        self.ended = self.ended[keep]
        if self.key_mask is not None:
            self.key_mask = self.key_mask[keep]

    def denoise_block(
        self, machine: StepMachine, steps: torch.Tensor, block_start: int, block_end: int, run_step: RunStep
    ) -> None:
        """Denoise the block at columns `[block_start, block_end)` until every row's rule says done; `steps` `(rows,)`
        long (host) is each row's share of `steps` for it (`BlockPlan.block_steps`). `run_step` runs one step on
        this canvas (the owner's: `machine.step_rows`, the new block written into `x`)."""
        rows, unmasking, device = self.x.shape[0], machine.unmasking, machine.device
        if isinstance(unmasking, ScheduledThreshold):
            generated_columns = (block_end - self.host_prompt_end[self.host_rows]).clamp(0, block_end - block_start)
            unmasking.start_block(block_end - block_start, steps, generated_columns)
        else:
            unmasking.start_block(block_end - block_start, steps)
        if hasattr(unmasking, "prepare_block"):  # a rule with per-block device state resets it here
            unmasking.prepare_block(rows, device)
        initial = unmasking.initial_block(rows, block_end - block_start, device)
        if initial is not None:  # a rule that starts from tokens of its own (DiffusionGemma: random ones)
            self.x[:, block_start:block_end] = initial
        machine.cache_policy.start_block(block_start)
        # Rows that stop while their block still holds masks (in-block EOS stop) or that may edit committed tokens
        # are frozen by an `active` mask inside the step; otherwise a row that is done has nothing left to commit,
        # and the step needs neither mask (two fewer inputs to copy per replay).
        freeze = unmasking.edits or machine.eos_stop_in_block
        generated = self.generated(block_start, block_end) if freeze else None
        active = torch.ones(rows, dtype=torch.bool, device=device)
        # LLaDA2.0's in-block EOS stop can end a block early: then ask after every step whether rows are left.
        known_steps = None if machine.eos_stop_in_block else unmasking.steps_for_block()
        if known_steps is not None and not freeze:
            # Every row makes every step: no per-step bookkeeping, and no host synchronisation.
            for step in range(known_steps):
                run_step(block_start, block_end, step, None, None)
            # A row that needed fewer steps (LLaDA2's first block, partly prompt) had no mask left: unchanged.
            self.nfe_per_row[self.rows] += upload(unmasking.steps_per_row(), device)
            self._finish_block(machine, block_start, block_end)
            return
        step, mask_id = 0, machine.mask_id
        counted = ~self.ended  # rows that ended but stay in the batch cost no forward of their own
        lag = 0 if known_steps is not None or machine.eos_stop_in_block else unmasking.stop_check_lag(device)
        limit = unmasking.step_limit() if lag else None
        pending = []  # "rows left" of steps not read yet (`stop_check_lag`)
        while True:
            before = self.x[:, block_start:block_end].clone() if freeze else None
            masked_before = (before == mask_id).any(-1) if freeze else None
            block, edited = run_step(block_start, block_end, step, active if freeze else None, generated)
            self.nfe_per_row.index_add_(0, self.rows, (active & counted).long())
            step += 1
            active = unmasking.still_active(active, masked_before, (block == mask_id).any(-1), edited, step)
            if machine.eos_stop_in_block:
                stop = self._eos_committed_after_all_masks(machine, before, block, generated)
                self.stopped[self.rows] |= stop
                active = active & ~stop
            if known_steps is not None:
                if step >= known_steps:
                    break
            elif lag == 0:
                if not bool(active.any()):
                    break
            else:
                if limit is not None and step >= limit:
                    break
                pending.append(HostFlag(active.any()))
                if len(pending) > lag and not pending.pop(0).read():
                    break
        self._finish_block(machine, block_start, block_end)

    def _finish_block(self, machine: StepMachine, block_start: int, block_end: int) -> None:
        """The rule's committed block (`final_block`, where it has one), and the fill token in the blocks of rows
        that ended but stay in the batch."""
        final = machine.unmasking.final_block()
        if final is not None:
            self.x[:, block_start:block_end] = final
        if machine.unmasking.keeps_ended_rows:
            self.x[:, block_start:block_end] = torch.where(
                self.ended.unsqueeze(-1), machine.fill_id, self.x[:, block_start:block_end]
            )

    @staticmethod
    def _eos_committed_after_all_masks(
        machine: StepMachine, before: torch.Tensor, block: torch.Tensor, generated: torch.Tensor
    ) -> torch.Tensor:
        """`(rows,)` bool, LLaDA2.0's in-block EOS stop: the step committed an EOS, and no mask lies between the
        prompt and the row's first EOS (earlier blocks hold neither: a row stops after a block with an EOS)."""
        mask_id = machine.mask_id
        committed = (before == mask_id) & (block != mask_id)
        is_eos = torch.isin(block, machine.eos_ids) & generated
        committed_eos = (committed & is_eos).any(-1)
        length = block.shape[-1]
        first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), length)
        before_eos = torch.arange(length, device=block.device) < first_eos.unsqueeze(-1)
        return committed_eos & ~((block == mask_id) & before_eos).any(-1)

    def finished_rows(self, machine: StepMachine, last_block: torch.Tensor, block_end: int) -> torch.Tensor | None:
        """`(rows,)` bool: rows that hold an EOS (with `eos_early_stop`; always for block-causal models, whose later
        blocks cannot change what comes before), that stopped inside the block, or that decoded their last block
        (`last_block`, `(rows,)` bool, host). None when host-side facts say no row can finish: checking on the GPU
        costs a host synchronisation, which stalls the next block's first step."""
        eos_stop = machine.eos_ids is not None and machine.family.eos_ends_row(machine.config)
        if not (eos_stop or machine.eos_stop_in_block or bool(last_block.any())):
            return None
        finished = self.stopped[self.rows].clone()
        if eos_stop:
            finished |= (torch.isin(self.x, machine.eos_ids) & self.generated_part(block_end)).any(dim=-1)
        finished |= upload(last_block, finished.device)
        return finished

    def fill_ended(self, machine: StepMachine, ended: torch.Tensor, block_end: int) -> None:
        """Show the rows marked in `ended` (`(rows,)` bool, device) as the output shows ended rows: the fill token
        (`machine.fill_id`, EOS) from column `block_end` on and, for block-causal models, after the first generated
        EOS (where the reference cuts its output)."""
        rows = self.x[ended]
        rows[:, block_end:] = machine.fill_id
        if machine.family.cut_after_first_eos and machine.eos_ids is not None:
            is_eos = torch.isin(rows, machine.eos_ids) & self.generated_part(block_end)[ended]
            after_first = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
            rows[after_first] = machine.fill_id
        self.x[ended] = rows


class HostFlag:
    """A device bool copied to the host without waiting for the work queued after it: read() waits for the copy
    only (an event recorded with it), not for the steps queued since (`UnmaskingPolicy.stop_check_lag`)."""

    def __init__(self, flag: torch.Tensor):
        self.event = None
        if flag.is_cuda:
            self.value = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.value.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.value = flag

    def read(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.value)


class StepColumns:
    """The index tensors of a device's steps, made once and reused: the same tensors at every step of a block, so a
    CUDA-graph replay need not copy them again (`graphs.py`)."""

    def __init__(self, device: torch.device, shift: int):
        self.device = device
        self.shift = shift  # the model's logits shift (`DiffusionFamily.logits_shift`)
        self._slots: dict[int, torch.Tensor] = {}  # `slots`' aranges, made once per size
        # `block`'s index tensors for the block under way, made once per block and query range.
        self._block: tuple[tuple[int, int], dict[tuple[int, int], tuple]] = ((-1, -1), {})

    def block(
        self, block_start: int, block_end: int, q_start: int, q_end: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`StepMachine.step`'s column indices for the block `[block_start, block_end)` fed from column `q_start` to
        `q_end`: cache_position `(q,)`, logits_index and block_index `(L,)`."""
        block, made = self._block
        if block != (block_start, block_end):
            made = {}
            self._block = ((block_start, block_end), made)
        columns = made.get((q_start, q_end))
        if columns is None:
            device = self.device
            columns = made[(q_start, q_end)] = (
                torch.arange(q_start, q_end, device=device),
                torch.arange(block_start - self.shift - q_start, block_end - self.shift - q_start, device=device),
                torch.arange(block_start - q_start, block_end - q_start, device=device),
            )
        return columns

    def slots(self, count: int) -> torch.Tensor:
        """`arange(count)` on the device (`StepMachine.step`'s `logit_slots`)."""
        cached = self._slots.get(count)
        if cached is None:
            cached = self._slots[count] = torch.arange(count, device=self.device)
        return cached


class StepMachine:
    """What a block's steps decode with, whatever the rows: the model's family rules, the cache and unmasking
    policies, the step's `StepRules`, the K/V cache and CUDA graphs, and the steps themselves on a `Canvas`.

    A step (`step`: the forward on the positions the cache policy asks for, then the unmasking rule) is one tensor
    function without host synchronisation: on CUDA captured once per shape and replayed (`graphs.py`), else eager.

    Args:
        policies: the cache and unmasking policies (`decoding_policies`).
        rows: the most rows a step runs (its forwards run twice as many with classifier-free guidance).
        new_cache: `new_cache(rows_per_forward)`, a `DiffusionKVCache` (asked only when the cache policy keeps one
            and the model's graph runner of this signature holds none).
        graph_shape: `graph_shape(rows_per_forward)`, the shapes every captured step of the owner shares.
        max_graphs: captured shapes kept.
        drafts: whether a consumer reads each step's draft at every position (logits at every position then).

    `nfe` and `first_step_positions` count the forwards the machine runs (and an owner's own, e.g. packed rows).
    """

    def __init__(
        self,
        model,
        config: DiffusionGenerationConfig,
        device: torch.device,
        policies: tuple[CachePolicy, UnmaskingPolicy],
        rows: int,
        new_cache: Callable[[int], object],
        graph_shape: Callable[[int], tuple],
        max_graphs: int,
        drafts: bool = False,
    ):
        self.model = model
        self.config = config
        self.device = device
        self.mask_id = config.mask_token_id
        self.family = model.diffusion_family
        self.shift = self.family.logits_shift
        self.cfg = config.cfg_scale > 0
        self.forward_kwargs = self.family.forward_kwargs(config)
        self.drafts = drafts
        self.columns = StepColumns(device, self.shift)
        self.nfe = 0  # model forwards made (one batched forward counts once)
        self.first_step_positions = 0  # positions (rows x columns) fed to the model by blocks' first steps

        eos = config.eos_token_ids
        self.eos_ids = torch.tensor(eos, device=device) if eos else None
        self.suppressed_ids = self.eos_ids if config.logits_eos_inf else None
        deferred = eos + ([config.eot_token_id] if config.eot_token_id is not None else [])
        self.deferred_ids = torch.tensor(deferred, device=device) if config.confidence_eos_eot_inf else None
        self.fill_id = self.family.fill_token_id(config)

        self.cache_policy, self.unmasking = policies
        # LLaDA2.0's in-block EOS stop (its `eos_early_stop`): without editing, a committed token is final.
        self.eos_stop_in_block = self.family.stops_inside_block(config, self.unmasking)
        self._setup_cache(rows, new_cache, graph_shape, max_graphs)
        self._setup_rules()

    def _setup_cache(self, rows: int, new_cache, graph_shape, max_graphs: int) -> None:
        """`rows_per_forward` (the model's batch for `rows` rows: twice with classifier-free guidance), `graphs`, the
        model's CUDA-graph runner for these shapes where the fast path applies (`_graphs_allowed`), and `cache`:
        the runner's (its graphs read it) or a new one."""
        self.rows_per_forward = rows * (2 if self.cfg else 1)

        def make_cache():
            return new_cache(self.rows_per_forward) if self.cache_policy.uses_cache else None

        self.graphs = None
        if self._graphs_allowed():
            signature = (*graph_shape(self.rows_per_forward), *self._graph_signature())
            self.graphs = StepGraphs.acquire(self.model, signature, make_cache, max_graphs)
        self.cache = self.graphs.cache if self.graphs is not None else make_cache()

    def _setup_rules(self) -> None:
        """The step's decoding rules, once `graphs` is known (captured graphs read the runner's token-id tensors)."""
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
            self.proposal_vocab_shard(),
        )

    def proposal_vocab_shard(self):
        """This rank's `tensor_parallel.VocabShard` when the proposal is reduced from it before any gather (a head
        split by vocabulary rows, greedy low-confidence without guidance, a policy that reads no logits), else None."""
        if not self._greedy_without_guidance() or self.unmasking.reads_logits:
            return None
        return vocab_shard(self.model)

    def release(self) -> None:
        """Give the model's CUDA-graph runner back (its graphs stay with the model), once the steps are done."""
        if self.graphs is not None:
            StepGraphs.release_to(self.model)
            self.graphs = None

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
            or not self.step_capturable()
            or self.unmasking.graph_key() is None  # a policy that does not say its step is capturable
        )

    def _greedy_without_guidance(self) -> bool:
        """Greedy low-confidence proposals without guidance: no random draw and no doubled rows in a step."""
        config = self.config
        return config.temperature == 0 and config.remasking == "low_confidence" and not self.cfg

    def step_capturable(self) -> bool:
        """The model's `_diffusion_step_capturable()` without autograd, as the steps run (a model may choose its
        kernels by it; the engine's scheduler thread may set a run up with autograd on)."""
        with torch.no_grad():
            return self.model._diffusion_step_capturable()

    def _graph_signature(self) -> tuple:
        """What every captured step shares but the owner's shapes (shapes that vary per step are in its key)."""
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
            kernel_mode(),  # a graph keeps the kernels it was captured with: `set_kernel_mode` must not replay it
            self.model.dtype,
            self.device,
            self.proposal_vocab_shard() is not None,  # the step reduces its logits to the proposal, then gathers
        )

    def _model_rows(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Duplicate per-row tensors for the unconditional branch of classifier-free guidance."""
        if tensor is None or not self.cfg:
            return tensor
        return torch.cat([tensor, tensor], dim=0)

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
        prompt_end: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One denoising step, a pure tensor function (graph-capturable). tokens, position_ids `(rows, q)` at columns
        `cache_position` `(q,)`; logits_index, block_index `(L,)` or `(rows, L)`: which fed positions carry the
        block's logits, and where its tokens are; scheduled `(rows,)`; active `(rows,)` (None: all); generated
        `(rows, L)`: positions after each prompt (editing only); logit_slots `arange(U)`: logits only at each row's
        first U positions in masked-first order (`_logit_slots`; None: all L); prompt_end `(rows,)` (guidance only).
        Returns the new block, the draft `(rows, L)` and whether each row edited a committed token `(rows,)`."""
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
            in_prompt = cache_position.unsqueeze(0) < prompt_end.unsqueeze(-1)
            unconditional = torch.where(in_prompt, self.mask_id, tokens)
            model_tokens = torch.cat([tokens, unconditional], dim=0)
            model_positions = self._model_rows(position_ids)
        logits = self.forward_logits(
            model_tokens, attention_mask, model_positions, self.cache, cache_position, logits_index,
            **self.unmasking.forward_inputs(),
        ).to(tokens.device)  # a model split over GPUs returns logits on its last device
        if self.cfg:
            conditional, unconditional = logits.float().chunk(2, dim=0)
            logits = unconditional + (self.config.cfg_scale + 1) * (conditional - unconditional)
        return self.decide(block, logits, scheduled, generated, active, candidates)

    def forward_logits(self, *args, **inputs) -> torch.Tensor:
        """The model's `_diffusion_forward(*args, **forward_kwargs, **inputs)` (`inputs`: the policy's): the logits
        `decide` takes (this rank's vocabulary slice under tensor parallelism with a `rules.vocab_shard`)."""
        head = self.model.get_output_embeddings() if self.rules.vocab_shard is not None else None
        with local_head_logits(head):
            return self.model._diffusion_forward(*args, **self.forward_kwargs, **inputs)

    def decide(
        self,
        block: torch.Tensor,
        logits: torch.Tensor,
        scheduled: torch.Tensor,
        generated: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
        candidates: torch.Tensor | None = None,
        rows: slice | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's decision: block `(rows, L)`, logits `(rows, L, vocab)` (or `(rows, U, vocab)` at `candidates`
        `(rows, U)`), the rest as in `step`; returns what `step` returns. `rows`: which of the block's rows these
        are, where they are not all of them (a policy with per-row state steps only theirs: `rows_only`)."""
        with self.unmasking.rows_only(rows):
            decided = self.unmasking.denoise(block, logits, self.rules, scheduled, generated, active, candidates)
        # Under tensor parallelism every rank keeps the first rank's tokens (a no-op for unsharded models).
        return agree_across_ranks(self.model, decided)

    def step_rows(
        self,
        canvas: Canvas,
        block_start: int,
        block_end: int,
        step: int,
        active: torch.Tensor | None = None,
        generated: torch.Tensor | None = None,
        rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step `step` of the block `[block_start, block_end)` of the canvas' first `rows` rows (default all;
        `active` and `generated` as in `step`, every row's), through the CUDA graph of its shape where there are
        graphs; counts the forward. Returns what `step` returns; the canvas is not changed. A policy with per-row
        state steps only those rows' (`rows_only`)."""
        inputs, key = self.step_inputs(canvas, block_start, block_end, step, active, generated, rows)
        with self.unmasking.rows_only(None if rows is None else slice(0, rows)):
            outputs = self.step(**inputs) if self.graphs is None else self.graphs.run(key, self.step, inputs)
        self.nfe += 1
        return outputs

    def step_inputs(
        self,
        canvas: Canvas,
        block_start: int,
        block_end: int,
        step: int,
        active: torch.Tensor | None,
        generated: torch.Tensor | None,
        rows: int | None = None,
    ) -> tuple[dict, tuple]:
        """The inputs of `step` for step `step` of the block (the positions the cache policy asks for) of the
        canvas' first `rows` rows (default all), and the key of its CUDA graph (what fixes every input's shape).
        Counts the positions a block's first step feeds (`first_step_positions`)."""
        width = canvas.width
        q_start, q_end = self.cache_policy.query_range(block_start, block_end, width, first_step=step == 0)
        q_start = min(q_start, block_start - self.shift)
        rows = canvas.x.shape[0] if rows is None else rows
        kv_len = width if self.cache is not None else q_end
        cache_position, logits_index, block_index = self.columns.block(block_start, block_end, q_start, q_end)
        inputs = dict(
            tokens=canvas.x[:rows, q_start:q_end],
            position_ids=canvas.position_ids[:rows, q_start:q_end],
            cache_position=cache_position,
            logits_index=logits_index,
            block_index=block_index,
            scheduled=self.unmasking.scheduled_counts(step, canvas.x.shape[0], self.device)[:rows],
            active=None if active is None else active[:rows],
            generated=None if generated is None else generated[:rows],
            attention_mask=self._attention_mask(canvas, q_end - q_start, kv_len, rows),
            logit_slots=self._logit_slots(step, rows, block_end - block_start),
            prompt_end=canvas.prompt_end[:rows] if self.cfg else None,
        )
        if step == 0:
            self.first_step_positions += inputs["tokens"].numel()
        # Whether a mask is fed is part of the shape (a key mask of all ones may be None); where the block lies is
        # not (column indices are input tensors), so one graph serves every block's step of one shape.
        mask_fed = inputs["attention_mask"] is not None
        slots = None if inputs["logit_slots"] is None else inputs["logit_slots"].shape[0]
        return inputs, (rows, q_end - q_start, block_end - block_start, kv_len, mask_fed, slots)

    def _attention_mask(self, canvas: Canvas, q_len: int, kv_len: int, rows: int):
        """The key padding mask of the canvas' first `rows` rows and `kv_len` columns, prepared once per shape in
        the model's format (kept with the canvas)."""
        if canvas.key_mask is None:
            return None
        masks = canvas.attention_masks
        if (rows, q_len, kv_len) not in masks:
            masks[(rows, q_len, kv_len)] = self.model._diffusion_attention_mask(
                self._model_rows(canvas.key_mask[:rows, :kv_len]), q_len
            )
        return masks[(rows, q_len, kv_len)]

    def _logit_slots(self, step: int, rows: int, length: int) -> torch.Tensor | None:
        """`arange(U)` when step `step` of a block of `length` needs logits at only U < L positions per row (the rule
        bounds an active row's masks, `masked_bound`; at least `MIN_CANDIDATE_POSITIONS`; greedy without guidance
        and no drafts read the others), else None."""
        if rows * length < MIN_CANDIDATE_POSITIONS or not self._greedy_without_guidance() or self.drafts:
            return None
        bound = self.unmasking.masked_bound(step)
        if bound is None:
            return None
        slots = min(length, max(1, -(-bound // CANDIDATE_GRANULARITY) * CANDIDATE_GRANULARITY))
        if slots >= length:
            return None
        return self.columns.slots(slots)
