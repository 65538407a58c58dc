"""Diffusion `generate()` for masked-diffusion language models: one semi-autoregressive block-denoising loop.

The loop (LLaDA arXiv:2502.09992, Sec. 2.4 "semi-autoregressive remasking"; Fast-dLLM arXiv:2505.22618) fills
`max_new_tokens` masked positions after the prompt, `block_length` at a time, left to right. Within a block, each
step runs the model, proposes a token for every masked position and commits some of them. Two independent,
pluggable pieces decide the rest:

- a cache policy (`cache.py`): which positions a step recomputes (no cache / prefix cache / dual cache);
- an unmasking policy (`decoding.py`): how many positions a step commits (fixed schedule / threshold / factor).

The generation parameters are `DiffusionGenerationConfig` (`generation_config.py`, re-exported here). The model is
reached through a small interface (`DiffusionGenerationMixin`): `generation_config.mask_token_id`,
`diffusion_logits_shift`, `_diffusion_forward` and `_diffusion_new_cache`. LLaDA implements it in
`modeling_llada.py`; a Dream-style model (logits shifted by one) only sets `diffusion_logits_shift = 1`.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.utils import ModelOutput, logging

from .cache import CachePolicy, DiffusionKVCache, make_cache_policy, padding_aware_position_ids
from .decoding import ScheduledThreshold, StepRules, UnmaskingPolicy, denoise_step, make_unmasking_policy
from .generation_config import DiffusionGenerationConfig, is_number
from .graphs import StepGraphs
from .tensor_parallel import agree_across_ranks

logger = logging.get_logger(__name__)

DECODING_RULE_FIELDS = frozenset({"steps", "threshold", "factor"})


@dataclass
class DiffusionGenerateOutput(ModelOutput):
    """Output of `generate(..., return_dict_in_generate=True)`.

    Args:
        sequences (`torch.LongTensor` of shape `(batch, prompt_len + max_new_tokens)`): prompts and generated
            tokens (rows stopped at EOS are filled with EOS).
        nfe (`int`): number of model forwards the call made (one batched forward counts once).
        nfe_per_row (`torch.LongTensor` of shape `(batch,)`): forwards each row took part in (a row stopped at
            EOS takes part in no more forwards).
    """

    sequences: torch.LongTensor | None = None
    nfe: int | None = None
    nfe_per_row: torch.LongTensor | None = None


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
        self._nfe_per_row = run.nfe_per_row[device_rows].clone()
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


def select_positions(hidden_states: torch.Tensor, logits_to_keep: int | slice | torch.Tensor) -> torch.Tensor:
    """transformers' `logits_to_keep` on `(batch, L, hidden)` states: an `int` keeps the last n positions (0 keeps
    all), a `slice` or a 1D index tensor selects positions, a `(batch, L)` index tensor each row's own positions, so
    an LM head runs only where logits are needed."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, slice(-logits_to_keep, None) if logits_to_keep > 0 else slice(None)]
    if isinstance(logits_to_keep, torch.Tensor):
        # With the model split over devices (device_map), the last layer's output is not on the input's device.
        index = logits_to_keep.to(hidden_states.device)
        if index.dim() == 2:  # `(batch, L)`: positions of each row (rows laid out at different columns)
            return hidden_states.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden_states.shape[-1]))
        return hidden_states[:, index]
    return hidden_states[:, logits_to_keep]


def left_pad(token_ids: list[list[int]], pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Batch prompts of different lengths for `generate()`: `input_ids` and `attention_mask` `(batch, longest)`,
    each prompt right-aligned after `pad_token_id`s (left padding), 1 in the mask for its real tokens."""
    width = max((len(ids) for ids in token_ids), default=0)
    input_ids = torch.full((len(token_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(token_ids), width), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        if len(ids):
            input_ids[row, width - len(ids) :] = torch.as_tensor(list(ids), dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


def plan_blocks(max_new_tokens: int, block_length: int, steps: int | None) -> list[tuple[int, int, int]]:
    """Split the generated region into blocks: `[(offset, length, steps), ...]`.

    Blocks have `block_length` positions except a shorter last one. `steps` (total) is spread in proportion to
    block lengths: block b gets `floor(steps * end_b / N) - floor(steps * start_b / N)` (N = `max_new_tokens`),
    which is `steps / num_blocks` for equal blocks as in LLaDA; any block left with 0 borrows one from the
    block with the most. `None` gives each block one step per position.
    """
    # Offsets are arithmetic (block b starts at b * block_length): summing the lengths before each block was
    # quadratic in the number of blocks (100k blocks took a minute).
    lengths = [block_length] * (max_new_tokens // block_length)
    if max_new_tokens % block_length:
        lengths.append(max_new_tokens % block_length)
    offsets = [b * block_length for b in range(len(lengths))]
    if steps is None:
        block_steps = list(lengths)
    else:
        if steps < len(lengths):
            raise ValueError(
                f"`steps` ({steps}) must be >= the number of blocks ({len(lengths)} = "
                f"ceil(max_new_tokens={max_new_tokens} / block_length={block_length})): each block needs a step."
            )
        block_steps = [
            steps * (off + length) // max_new_tokens - steps * off // max_new_tokens
            for off, length in zip(offsets, lengths, strict=True)
        ]
        # Only the short last block can get 0 (a full block's share, steps * block_length / N, is >= 1 once
        # steps >= the number of blocks), so at most one donor search runs: linear in the number of blocks.
        for b, count in enumerate(block_steps):
            if count == 0:
                donor = max(range(len(block_steps)), key=block_steps.__getitem__)
                block_steps[donor] -= 1
                block_steps[b] = 1
    return list(zip(offsets, lengths, block_steps, strict=True))


class DiffusionGenerationMixin:
    """`generate()` for masked-diffusion LMs. A model using it provides:

    - `generation_config` (a `DiffusionGenerationConfig`) with `mask_token_id`;
    - `diffusion_logits_shift`: 0 if logits at position i predict token i (LLaDA), 1 if they predict i + 1 (Dream);
    - `diffusion_block_causal`: False if every position attends to every other (LLaDA), True if each block
      attends to itself and earlier blocks (LLaDA2): blocks are then aligned to absolute positions, the KV cache
      is exact, and `steps` combines with `threshold` (see `plan_block_causal`, `ExactBlockCache`,
      `ScheduledThreshold`);
    - `diffusion_sampler_fields`: the generation fields of the family's own sampler the model uses (Dream's `alg`,
      `alg_temp`, `top_p`, `top_k`, `eps`; default none), with `_diffusion_unmasking_policy(config)` returning
      the family's rule;
    - `_diffusion_forward(input_ids, attention_mask, position_ids, cache, cache_position, logits_slice, **kw)`
      returning logits `(batch, L, vocab)` for the kept positions; the default calls `self(...)` with
      transformers' arguments (`past_key_values`, `cache_position`, `logits_to_keep`) and, for block-causal
      models, `block_length`;
    - `_diffusion_step_capturable()`: whether a step can be captured in a CUDA graph (default True);
    - `_diffusion_new_cache(batch_size, max_length)` returning a `DiffusionKVCache` (default: one per layer of
      `config.num_hidden_layers`);
    - `_diffusion_attention_mask(key_mask, q_len)` turning the `(rows, seq_len)` padding mask into what the
      forward's attention backend takes, once per query length (default: transformers'
      `create_bidirectional_mask`), so that no step builds masks (or synchronises with the host).
    """

    diffusion_logits_shift = 0
    # True for block-causal models (LLaDA2): blocks aligned to absolute positions, an exact KV cache, and the
    # forward takes `block_length` (see `BlockDiffusionRun`).
    diffusion_block_causal = False
    # Generation fields of a family's own sampler that the model uses (Dream: `alg`, `top_k`, ...); the others'
    # are refused by `validate()`, where the config's rules would silently ignore them.
    diffusion_sampler_fields: tuple[str, ...] = ()
    # Fields of the family's original generation config (on the Hub) that hf_dllm does not provide, each with the
    # value at which it changes nothing (Dream: `output_history=False`): such a generation_config.json still loads.
    diffusion_original_generation_fields: dict = {}

    def _diffusion_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache: DiffusionKVCache | None,
        cache_position: torch.Tensor,
        logits_slice: slice,
        **forward_kwargs,
    ) -> torch.Tensor:
        return self(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            cache_position=cache_position,
            logits_to_keep=logits_slice,
            **forward_kwargs,
        ).logits

    def _diffusion_unmasking_policy(self, config: DiffusionGenerationConfig) -> UnmaskingPolicy | None:
        """The model family's own unmasking rule for `config`, or None for the rule the config names
        (`make_unmasking_policy`). A family with rules of its own (e.g. Dream's `alg`) overrides this."""
        return None

    def _diffusion_step_capturable(self) -> bool:
        """Whether a denoising step can be captured in a CUDA graph (no host synchronisation in the forward)."""
        return True

    def _diffusion_new_cache(self, batch_size: int, max_length: int) -> DiffusionKVCache:
        return DiffusionKVCache(self.config.num_hidden_layers, batch_size, max_length)

    def _diffusion_attention_mask(self, key_mask: torch.Tensor, q_len: int):
        shape_probe = torch.empty(key_mask.shape[0], q_len, 1, dtype=self.dtype, device=key_mask.device)
        return create_bidirectional_mask(config=self.config, inputs_embeds=shape_probe, attention_mask=key_mask)

    def adjust_generation_fn(
        self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, *args, **kwargs
    ):
        """Called by `from_pretrained`: read `generation_config.json` as a `DiffusionGenerationConfig`."""
        if generation_config is not None:
            self.generation_config = DiffusionGenerationConfig.from_generation_config(generation_config)
            return
        if pretrained_model_name_or_path is None:
            return
        loading = {
            key: kwargs[key]
            for key in ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
            if key in kwargs
        }
        try:
            loaded = DiffusionGenerationConfig.from_pretrained(pretrained_model_name_or_path, **loading)
        except OSError:
            logger.info("No generation_config.json found: using the defaults derived from the model config.")
            return
        except ValueError:
            if not self.diffusion_original_generation_fields:
                raise
            loaded = self._original_generation_config(pretrained_model_name_or_path, loading)
        # Special token ids a foreign generation_config.json leaves unset still come from the model config.
        loaded.inherit_special_tokens(self.generation_config)
        loaded.validate(block_causal=self.diffusion_block_causal, sampler_fields=self.diffusion_sampler_fields)
        self.generation_config = loaded

    def _original_generation_config(self, pretrained_model_name_or_path, loading: dict) -> DiffusionGenerationConfig:
        """A generation_config.json written by the family's original implementation (e.g. Dream's
        `DreamGenerationConfig`, as on the Hub): its fields that hf_dllm does not provide
        (`diffusion_original_generation_fields`) are accepted at their no-op values and refused otherwise, the rest
        are read as usual."""
        fields = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **loading).to_diff_dict()
        for name, no_op in self.diffusion_original_generation_fields.items():
            if name in fields and fields.pop(name) != no_op:
                raise ValueError(
                    f"{pretrained_model_name_or_path}: generation_config.json sets `{name}`, a setting of the original "
                    f"implementation's sampler that hf_dllm does not provide; only `{name}={no_op!r}` can be loaded."
                )
        fields = {
            key: value for key, value in fields.items() if key not in ("transformers_version", "_from_model_config")
        }
        return DiffusionGenerationConfig(**fields)

    def resolve_generation_config(
        self, generation_config: GenerationConfig | None = None, **fields
    ) -> DiffusionGenerationConfig:
        """The settings of one call, validated for this model: `fields` (what the call, request or command line
        named) > `generation_config` (default: the model's, i.e. the checkpoint's `generation_config.json`) > the
        defaults of `DiffusionGenerationConfig`. Every entry point (generate(), the server, eval, lm-eval, export)
        resolves its settings here, so the same fields give the same run everywhere.

        Rules: naming one decoding rule (`steps`, `threshold` or `factor`) replaces the base config's rule (naming
        two in one call is the contradiction `validate()` reports); `temperature` without `do_sample` sets
        `do_sample = temperature > 0`. Raises `ValueError` for an unknown field or a bad value.
        """
        base = generation_config if generation_config is not None else self.generation_config
        if not isinstance(base, GenerationConfig):
            raise TypeError(f"`generation_config` must be a GenerationConfig, got {type(base).__name__}.")
        config = DiffusionGenerationConfig.from_generation_config(base)
        if base is not self.generation_config:
            config.inherit_special_tokens(self.generation_config)
        unknown = sorted(set(fields) - set(DiffusionGenerationConfig.field_names()))
        if unknown:
            raise ValueError(
                f"unknown generation settings {unknown}: the settings are the fields of DiffusionGenerationConfig: "
                f"{sorted(DiffusionGenerationConfig.field_names())} (generate() also takes `input_ids`, "
                "`attention_mask`, `generation_config`, `streamer`, `stopping_criteria`, `unmasking_policy` and "
                "`cache_policy`)."
            )
        if DECODING_RULE_FIELDS & fields.keys():
            for name in DECODING_RULE_FIELDS - fields.keys():
                setattr(config, name, None)
        if "temperature" in fields and "do_sample" not in fields:
            fields["do_sample"] = fields["temperature"] > 0 if is_number(fields["temperature"]) else False
        for key, value in fields.items():
            setattr(config, key, value)
        config.validate(block_causal=self.diffusion_block_causal, sampler_fields=self.diffusion_sampler_fields)
        return config

    def generate_blocks(
        self,
        inputs: torch.LongTensor | None = None,
        generation_config: GenerationConfig | None = None,
        streamer=None,
        stopping_criteria=None,
        unmasking_policy: UnmaskingPolicy | None = None,
        cache_policy: CachePolicy | None = None,
        **kwargs,
    ) -> BlockDiffusionRun:
        r"""The run `generate()` would make, not started: iterate it for one `BlockEvent` per committed block
        (which rows, which positions, their tokens, forwards per row so far), stop rows with `event.stop(mask)`,
        and read `sequences`, `nfe` and `nfe_per_row` from it afterwards. Arguments as for `generate()`; every
        check runs here, before any forward.

        ```python
        run = model.generate_blocks(input_ids, max_new_tokens=64, threshold=0.9)
        for event in run:
            for row, tokens in zip(event.rows.tolist(), event.new_tokens()):
                ...
        print(run.sequences, run.nfe_per_row)
        ```
        """
        input_ids, attention_mask = kwargs.pop("input_ids", None), kwargs.pop("attention_mask", None)
        config = self.resolve_generation_config(generation_config, **kwargs)
        if inputs is not None and input_ids is not None:
            raise ValueError("Pass the prompts once: as `inputs` or as `input_ids`, not both.")
        input_ids = inputs if inputs is not None else input_ids
        input_ids, attention_mask = self._validate_diffusion_inputs(input_ids, attention_mask, config)
        if stopping_criteria is not None and not all(callable(criterion) for criterion in stopping_criteria):
            raise TypeError("`stopping_criteria` must be a list of callables (input_ids, scores) -> (batch,) bool.")
        if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
            raise TypeError(f"`streamer` must have put() and end() (a BaseStreamer), got {type(streamer).__name__}.")
        return BlockDiffusionRun(
            self,
            config,
            input_ids,
            attention_mask,
            streamer,
            stopping_criteria,
            unmasking_policy=unmasking_policy,
            cache_policy=cache_policy,
        )

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.LongTensor | None = None,
        generation_config: GenerationConfig | None = None,
        streamer=None,
        stopping_criteria=None,
        unmasking_policy: UnmaskingPolicy | None = None,
        cache_policy: CachePolicy | None = None,
        **kwargs,
    ) -> torch.LongTensor | DiffusionGenerateOutput:
        r"""
        Fill `max_new_tokens` masked positions after each prompt by block diffusion.

        Args:
            inputs / input_ids (`torch.LongTensor` `(batch, prompt_len)`): prompts, left-padded when their lengths
                differ (any padding works: the attention mask decides).
            attention_mask (`torch.Tensor` `(batch, prompt_len)`, *optional*): 1 for real tokens, 0 for padding.
            generation_config (`GenerationConfig`, *optional*): base parameters (default: the model's).
            streamer (`BaseStreamer`, *optional*): gets the prompt, then each block's tokens `(batch, block_len)`
                as soon as the block is committed (rows already stopped show EOS), then `end()`; a streamer with
                `put_draft` also gets the block being denoised (committed tokens and current candidates) after
                every step.
            stopping_criteria (`StoppingCriteriaList` or list of callables, *optional*): transformers' stopping
                criteria, called after every block with each row's committed prefix `(rows, prompt_len +
                committed)` (prompt and committed blocks, never a mask token) and `scores=None`; rows marked True
                stop like an EOS stop (later positions filled with EOS, no more forwards). Stock
                `MaxLengthCriteria`, `StopStringCriteria`, `EosTokenCriteria` work unchanged.
            unmasking_policy (`UnmaskingPolicy`, *optional*): a decoding rule object that replaces the one the
                settings name (`steps` / `threshold` / `factor`); its steps run eagerly (no CUDA graph).
            cache_policy (`CachePolicy`, *optional*): a cache object that replaces the one the settings name.
            kwargs: any `DiffusionGenerationConfig` field (`threshold=0.9`, `block_length=32`, ...).

        Returns:
            `torch.LongTensor` `(batch, prompt_len + max_new_tokens)`, or a `DiffusionGenerateOutput` with
            `sequences` and `nfe` when `return_dict_in_generate=True`. `generate_blocks()` gives the same run
            block by block.
        """
        run = self.generate_blocks(
            inputs,
            generation_config,
            streamer,
            stopping_criteria,
            unmasking_policy=unmasking_policy,
            cache_policy=cache_policy,
            **kwargs,
        )
        sequences = run.run()
        if run.config.return_dict_in_generate:
            return DiffusionGenerateOutput(sequences=sequences, nfe=run.nfe, nfe_per_row=run.nfe_per_row)
        return sequences

    def _validate_diffusion_inputs(
        self, input_ids, attention_mask, config: DiffusionGenerationConfig
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Check prompts and special tokens before any forward; raises `ValueError`/`TypeError`."""
        vocab_size = self.get_input_embeddings().weight.shape[0]
        device = self.get_input_embeddings().weight.device
        if device.type == "meta":
            raise ValueError("The model's weights are on the meta device (shapes without data): load real weights.")
        if config.mask_token_id is None:
            raise ValueError(
                "`mask_token_id` is not set: pass it to generate() or set it in the generation config "
                f"(an integer in [0, {vocab_size}))."
            )
        special = {"mask_token_id": config.mask_token_id, "eot_token_id": config.eot_token_id}
        special.update({f"eos_token_id[{i}]": token for i, token in enumerate(config.eos_token_ids)})
        for name, token in special.items():
            if token is not None and not 0 <= token < vocab_size:
                raise ValueError(f"`{name}` must be in [0, {vocab_size}) (the model's vocabulary), got {token}.")
        needs_eos = [
            name for name in ("eos_early_stop", "logits_eos_inf", "confidence_eos_eot_inf") if getattr(config, name)
        ]
        if needs_eos and not config.eos_token_ids:
            raise ValueError(f"{needs_eos} need `eos_token_id` to be set (or set them to False).")
        for name, token in special.items():
            if name != "mask_token_id" and token == config.mask_token_id:
                raise ValueError(
                    f"`{name}` ({token}) must differ from `mask_token_id`: every undecoded position would read as "
                    "the end of the text."
                )
        if config.cfg_scale > 0 and self.diffusion_logits_shift:
            raise ValueError("`cfg_scale` > 0 is only supported for models with unshifted logits.")
        if config.cfg_scale > 0 and self.diffusion_block_causal:
            raise ValueError("`cfg_scale` > 0 is not supported for block-causal models (LLaDA2): set it to 0.")

        if input_ids is None:
            start = [] if config.bos_token_id is None else [config.bos_token_id]
            input_ids = torch.tensor([start], dtype=torch.long, device=device)
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"`input_ids` must be a torch.LongTensor, got {type(input_ids).__name__}.")
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int, torch.int16, torch.int8):
            raise ValueError(
                f"`input_ids` must be an integer tensor of shape (batch, prompt_len), got {tuple(input_ids.shape)} "
                f"{input_ids.dtype}."
            )
        if input_ids.shape[0] == 0:
            raise ValueError("`input_ids` is an empty batch: it must hold at least one prompt (batch >= 1).")
        for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask)):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                raise ValueError(f"`{name}` is on the meta device (a shape without data): pass real token ids.")
        input_ids = input_ids.to(device=device, dtype=torch.long)
        if input_ids.numel() and not bool(((input_ids >= 0) & (input_ids < vocab_size)).all()):
            raise ValueError(f"`input_ids` must hold token ids in [0, {vocab_size}).")
        if bool((input_ids == config.mask_token_id).any()):
            row, column = (input_ids == config.mask_token_id).nonzero()[0].tolist()
            raise ValueError(
                f"`input_ids` holds the mask token ({config.mask_token_id}) at row {row}, position {column}: a prompt "
                "must not contain it (only the positions after the prompt are denoised; pad with another id)."
            )
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"`attention_mask` must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got "
                    f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}."
                )
            attention_mask = attention_mask.to(device)
            if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (real token).")
            empty_rows = (attention_mask.shape[1] > 0) & (attention_mask == 0).all(dim=1)
            if bool(empty_rows.any()):
                raise ValueError(
                    f"`attention_mask` row {int(empty_rows.nonzero()[0])} is all padding: every prompt needs at "
                    "least one real token (1 in the mask)."
                )
            if bool(attention_mask.all()):
                attention_mask = None
        shift = self.diffusion_logits_shift
        if shift and input_ids.shape[1] < shift:
            raise ValueError(
                f"This model predicts token i from position i - {shift}: the prompt needs {shift} token(s)."
            )
        max_len = getattr(self.config, "max_sequence_length", None)
        if max_len is not None and input_ids.shape[1] + config.max_new_tokens > max_len:
            logger.warning_once(
                f"Prompt + max_new_tokens exceeds the model's max_sequence_length ({max_len}); quality may degrade."
            )
        # A call whose token canvas and K/V cache alone exceed the device's total memory is refused here, instead
        # of failing in an allocation deep inside the loop (or swapping the machine to a halt).
        total_memory = None
        if device.type == "cuda":
            total_memory = torch.cuda.get_device_properties(device).total_memory
        elif device.type == "cpu":
            import os

            if hasattr(os, "sysconf"):
                try:
                    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                except (ValueError, OSError):
                    pass
        positions = input_ids.shape[0] * (input_ids.shape[1] + config.max_new_tokens)
        needed = positions * 8 * 3  # int64 canvas: the sequences, their working copy, the position ids
        layers, kv_heads, head_dim = (
            getattr(self.config, name, None) for name in ("num_hidden_layers", "num_key_value_heads", "head_dim")
        )
        if config.use_cache and layers and kv_heads and head_dim:
            rows = 2 if config.cfg_scale > 0 else 1
            needed += rows * positions * layers * 2 * kv_heads * head_dim * self.dtype.itemsize
        if total_memory is not None and needed > total_memory:
            raise ValueError(
                f"`max_new_tokens`={config.max_new_tokens} with {input_ids.shape[0]} prompt(s) of "
                f"{input_ids.shape[1]} tokens needs at least {needed / 2**30:.1f} GiB (token canvas and K/V cache), "
                f"more than the {total_memory / 2**30:.1f} GiB of the model's device ({device}): lower "
                "max_new_tokens or the batch size."
            )
        return input_ids, attention_mask


def decoding_policies(
    model,
    config: DiffusionGenerationConfig,
    unmasking_policy: UnmaskingPolicy | None = None,
    cache_policy: CachePolicy | None = None,
) -> tuple[CachePolicy, UnmaskingPolicy]:
    """The cache and unmasking policies a run of `config` on `model` decodes with: the objects given, else those the
    settings name. A policy object (the call's, or the model family's own `_diffusion_unmasking_policy`) replaces
    the config's rule. Raises ValueError for settings the family's rules refuse."""
    block_causal = bool(getattr(model, "diffusion_block_causal", False))
    cache = make_cache_policy(config.use_cache, config.dual_cache, block_causal, policy=cache_policy)
    model_policy = model._diffusion_unmasking_policy(config) if unmasking_policy is None else None
    unmasking = make_unmasking_policy(
        config.threshold,
        config.factor,
        block_causal,
        config.editing_threshold,
        config.num_to_transfer,
        config.max_post_steps,
        policy=unmasking_policy if unmasking_policy is not None else model_policy,
    )
    return cache, unmasking


@dataclass
class BlockPlan:
    """Where one `generate()` call puts everything on its canvas (the `(batch, canvas_width)` token matrix the
    loop denoises), and which blocks it decodes. Built once per call, before any forward.

    Args:
        canvas_width: columns of the canvas.
        prompt_start, prompt_end: `(batch,)` long, each row's prompt occupies columns `[prompt_start, prompt_end)`
            and its generated positions start at `prompt_end`; columns before `prompt_start` are padding.
        blocks: `[(start, end), ...]` columns of the blocks, shared by all rows, decoded left to right.
        block_steps: `(batch, num_blocks)` long (host), each row's share of `steps` per block.
        last_block: `(batch,)` long (host), the last block each row decodes (rows may need fewer blocks).
        prompt_width: the width of the caller's (left-padded) prompts; output rows are the caller's prompt
            followed by the generated positions `[prompt_end, prompt_end + max_new_tokens)`.
    """

    canvas_width: int
    prompt_start: torch.Tensor
    prompt_end: torch.Tensor
    blocks: list[tuple[int, int]]
    block_steps: torch.Tensor
    last_block: torch.Tensor
    prompt_width: int


def plan_bidirectional(
    prompt_width: int, batch: int, config: DiffusionGenerationConfig, device: torch.device
) -> BlockPlan:
    """LLaDA-style plan: the canvas is the caller's prompts followed by `max_new_tokens` masks, blocks start right
    after the prompts (`plan_blocks`), every row decodes every block with the same steps."""
    blocks = plan_blocks(config.max_new_tokens, config.block_length, config.steps)
    return BlockPlan(
        canvas_width=prompt_width + config.max_new_tokens,
        prompt_start=torch.zeros(batch, dtype=torch.long, device=device),
        prompt_end=torch.full((batch,), prompt_width, dtype=torch.long, device=device),
        blocks=[(prompt_width + offset, prompt_width + offset + length) for offset, length, _ in blocks],
        block_steps=torch.tensor([[steps for _, _, steps in blocks]] * batch, dtype=torch.long),
        last_block=torch.full((batch,), len(blocks) - 1, dtype=torch.long),
        prompt_width=prompt_width,
    )


def plan_block_causal(
    prompt_lengths: list[int], prompt_width: int, config: DiffusionGenerationConfig, device: torch.device
) -> BlockPlan:
    """LLaDA2-style plan (block-causal models, LLaDA2.0 tech report; its reference `generate()`): blocks are
    aligned to each row's absolute positions (position p is in block p // block_length), the first decoded block
    is the one holding position `len(prompt)` (so it can hold the prompt's tail), and the last block is decoded
    whole (positions past `max_new_tokens` are decoded and dropped).

    Rows of different prompt lengths are left-padded by whole blocks so that every row's first decoded block
    starts at the same column: block boundaries then coincide for all rows, and a row's block-causal attention
    is the one it has alone. Row r decodes `ceil((P_r + N) / B) - P_r // B` blocks, N = `max_new_tokens`; a row
    with one block fewer ends one block earlier. `steps` (total, per row) is split over a row's blocks in
    proportion (`steps / blocks` each when it divides), each capped at `max_new_tokens // minimal_topk`; `None`
    means `block_length` steps per block (one token per step)."""
    block, new = config.block_length, config.max_new_tokens
    first_blocks = [length // block for length in prompt_lengths]
    num_blocks = [-(-(length + new) // block) - length // block for length in prompt_lengths]
    start_block = max(first_blocks)
    cap = new // config.minimal_topk
    if cap < 1:
        raise ValueError(
            f"`minimal_topk` ({config.minimal_topk}) must be <= max_new_tokens ({new}): it caps a block's steps at "
            "max_new_tokens // minimal_topk."
        )
    steps = torch.zeros(len(prompt_lengths), max(num_blocks), dtype=torch.long)
    for row, count in enumerate(num_blocks):
        if config.steps is None:
            steps[row, :count] = min(block, cap)
            continue
        if config.steps < count:
            raise ValueError(
                f"`steps` ({config.steps}) must be >= the number of blocks a prompt of {prompt_lengths[row]} tokens "
                f"decodes ({count} = ceil((prompt + max_new_tokens) / block_length) - prompt // block_length)."
            )
        shares = torch.arange(count + 1) * config.steps // count
        steps[row, :count] = (shares[1:] - shares[:-1]).clamp(max=cap)
    shift = torch.tensor([(start_block - first) * block for first in first_blocks], dtype=torch.long)
    lengths = torch.tensor(prompt_lengths, dtype=torch.long)
    return BlockPlan(
        canvas_width=(start_block + max(num_blocks)) * block,
        prompt_start=shift.to(device),
        prompt_end=(shift + lengths).to(device),
        blocks=[((start_block + k) * block, (start_block + k + 1) * block) for k in range(max(num_blocks))],
        block_steps=steps,
        last_block=torch.tensor(num_blocks, dtype=torch.long) - 1,
        prompt_width=prompt_width,
    )


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
        self.device = device = input_ids.device
        self._setup_decoding(model, config, device, unmasking_policy, cache_policy)
        self.streamer = streamer
        self.stopping_criteria = list(stopping_criteria or [])
        self.input_ids = input_ids

        pad_id = config.prompt_pad_token_id
        if self.block_causal:
            if attention_mask is None:
                prompts = list(input_ids)
            else:
                prompts = [row[keep.bool()] for row, keep in zip(input_ids, attention_mask, strict=True)]
            self.plan = plan_block_causal([len(p) for p in prompts], self.prompt_len, config, device)
            self.seq_len = self.plan.canvas_width
            self.x = torch.full((batch, self.seq_len), self.mask_id, dtype=torch.long, device=device)
            columns = torch.arange(self.seq_len, device=device)
            self.x[columns < self.plan.prompt_start.unsqueeze(-1)] = pad_id
            for row, prompt in enumerate(prompts):
                start = int(self.plan.prompt_start[row])
                self.x[row, start : start + len(prompt)] = prompt
            padded = bool((self.plan.prompt_start > 0).any())
            self.key_mask = (columns >= self.plan.prompt_start.unsqueeze(-1)).long() if padded else None
            self.position_ids = (columns - self.plan.prompt_start.unsqueeze(-1)).clamp(min=0)
        else:
            self.plan = plan_bidirectional(self.prompt_len, batch, config, device)
            self.seq_len = self.plan.canvas_width
            self.x = torch.full((batch, self.seq_len), self.mask_id, dtype=torch.long, device=device)
            self.x[:, : self.prompt_len] = input_ids
            if attention_mask is None:
                self.key_mask = None
                self.position_ids = torch.arange(self.seq_len, device=device).expand(batch, -1)
            else:
                generated = torch.ones(batch, config.max_new_tokens, dtype=attention_mask.dtype, device=device)
                self.key_mask = torch.cat([attention_mask, generated], dim=1)
                self.position_ids = padding_aware_position_ids(self.key_mask)
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

        self.rows_per_forward = batch * (2 if self.cfg else 1)
        self.graphs = self._step_graphs()
        if self.graphs is not None:
            self.cache = self.graphs.cache
        elif self.cache_policy.uses_cache:
            self.cache = model._diffusion_new_cache(self.rows_per_forward, self.seq_len)
        else:
            self.cache = None
        self._setup_rules()
        self.nfe = 0
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
        self.shift = model.diffusion_logits_shift
        self.block_causal = bool(getattr(model, "diffusion_block_causal", False))
        self.cfg = config.cfg_scale > 0
        self.forward_kwargs = {"block_length": config.block_length} if self.block_causal else {}
        self.attention_masks: dict[tuple[int, int, int], object] = {}

        eos = config.eos_token_ids
        self.eos_ids = torch.tensor(eos, device=device) if eos else None
        self.suppressed_ids = self.eos_ids if config.logits_eos_inf else None
        deferred = eos + ([config.eot_token_id] if config.eot_token_id is not None else [])
        self.deferred_ids = torch.tensor(deferred, device=device) if config.confidence_eos_eot_inf else None
        self.fill_id = eos[0] if eos else config.pad_token_id if config.pad_token_id is not None else self.mask_id

        self.cache_policy, self.unmasking = decoding_policies(model, config, unmasking_policy, cache_policy)
        # LLaDA2.0's in-block EOS stop (its `eos_early_stop`): without editing, a committed token is final.
        self.eos_stop_in_block = (
            self.block_causal and config.eos_early_stop and not self.unmasking.edits and self.eos_ids is not None
        )
        self.nfe = 0

    def _setup_rules(self) -> None:
        """The step's decoding rules, once `graphs` is known (captured graphs read the runner's copies of the
        constant token-id tensors)."""
        if self.graphs is not None:
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
            or config.temperature > 0
            or config.remasking != "low_confidence"
            or self.cfg
            or self.model.config._attn_implementation == "flex_attention"  # BlockMask inputs are not tensors
            or len({parameter.device for parameter in self.model.parameters()}) > 1  # a graph is one device's
            or not self.model._diffusion_step_capturable()
            or self.unmasking.graph_key() is None  # a policy that does not say its step is capturable
        )

    def _graph_signature(self) -> tuple:
        """What every captured step of this run shares (shapes that vary per step are in `run_step`'s key)."""
        return (
            self.cache_policy.uses_cache,
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

    def _step_graphs(self) -> StepGraphs | None:
        """The model's CUDA-graph runner for this run's shapes when the fast path applies (`_graphs_allowed`)."""
        if not self._graphs_allowed():
            return None
        signature = (self.rows_per_forward, self.seq_len, self.key_mask is None, *self._graph_signature())

        def make_cache():
            return (
                self.model._diffusion_new_cache(self.rows_per_forward, self.seq_len)
                if self.cache_policy.uses_cache
                else None
            )

        return StepGraphs.acquire(self.model, signature, make_cache)

    def _model_rows(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Duplicate per-row tensors for the unconditional branch of classifier-free guidance."""
        if tensor is None or not self.cfg:
            return tensor
        return torch.cat([tensor, tensor], dim=0)

    def _attention_mask(self, q_len: int, kv_len: int):
        """The key padding mask of the first `kv_len` columns, prepared once per shape in the model's format."""
        rows = self.x.shape[0]
        if self.key_mask is None:
            return None
        if (rows, q_len, kv_len) not in self.attention_masks:
            self.attention_masks[(rows, q_len, kv_len)] = self.model._diffusion_attention_mask(
                self._model_rows(self.key_mask[:, :kv_len]), q_len
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One denoising step, a pure tensor function (graph-capturable).

        tokens, position_ids `(rows, q)`: the positions fed to the model (columns `cache_position` `(q,)`);
        logits_index `(L,)`: which of them carry the block's logits; block_index `(L,)`: where the block's tokens
        are among them (both `(rows, L)` when rows hold their blocks at different columns); scheduled `(rows,)`: the schedule's count; active `(rows,)`: rows still denoising (None: all);
        generated `(rows, L)`: the block's positions after each prompt (None: all; only editing reads it). Returns the new block, the draft `(rows, L)`
        and whether each row edited a committed token `(rows,)` (see `decoding.denoise_step`).
        """
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
        block = tokens.gather(1, block_index) if block_index.dim() == 2 else tokens.index_select(1, block_index)
        # Under tensor parallelism every rank keeps the first rank's tokens (a no-op for unsharded models).
        return agree_across_ranks(self.model, denoise_step(block, logits, self.rules, scheduled, generated, active))

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
        inputs, key = self._step_inputs(block_start, block_end, step, active, generated)
        if self.graphs is None:
            new_block, draft, edited = self.step(**inputs)
        else:
            new_block, draft, edited = self.graphs.run(key, self.step, inputs)
        self.nfe += 1
        self.x[:, block_start:block_end] = new_block
        if self.streamer is not None and hasattr(self.streamer, "put_draft"):
            full = self.canvas[:, block_start:block_end].clone()
            full[self.rows] = draft
            self.streamer.put_draft(full.cpu())
        return new_block, edited

    def _step_inputs(
        self, block_start: int, block_end: int, step: int, active: torch.Tensor | None, generated: torch.Tensor | None
    ) -> tuple[dict, tuple]:
        """The inputs of `step` for step `step` of the block (the positions the cache policy asks for), and the key
        of its CUDA graph (what fixes every input's shape)."""
        q_start, q_end = self.cache_policy.query_range(block_start, block_end, self.seq_len, first_step=step == 0)
        q_start = min(q_start, block_start - self.shift)
        rows, device = self.x.shape[0], self.device
        kv_len = self.seq_len if self.cache is not None else q_end
        inputs = dict(
            tokens=self.x[:, q_start:q_end],
            position_ids=self.position_ids[:, q_start:q_end],
            cache_position=torch.arange(q_start, q_end, device=device),
            logits_index=torch.arange(block_start - self.shift, block_end - self.shift, device=device) - q_start,
            block_index=torch.arange(block_start, block_end, device=device) - q_start,
            scheduled=self.unmasking.scheduled_counts(step, rows, device),
            active=active,
            generated=generated,
            attention_mask=self._attention_mask(q_end - q_start, kv_len),
        )
        # Whether a mask is fed is part of the shape: a key mask of all ones may be prepared as None. Where the
        # block lies is not: every column index is an input tensor, so one graph serves every block's step of one
        # shape (in particular the dual/prefix cache's full forward at each block start, captured at the second
        # block and replayed from the third instead of running eagerly once per block).
        mask_fed = inputs["attention_mask"] is not None
        return inputs, (rows, q_end - q_start, block_end - block_start, kv_len, mask_fed)

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
            self.nfe_per_row[self.rows] += self.unmasking.steps_per_row().to(self.device)
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
        if self.eos_ids is not None and (self.config.eos_early_stop or self.block_causal):
            finished |= (torch.isin(self.x, self.eos_ids) & self._generated_part(block_end)).any(dim=-1)
        finished |= last_block.to(finished.device)
        return finished

    def _rows_can_finish(self, last_block: torch.Tensor) -> bool:
        """Whether any row may finish after this block (host-side facts only: `last_block` `(active_rows,)` bool):
        checking on the GPU costs a host synchronisation, which stalls the next block's first step."""
        eos_stop = self.eos_ids is not None and (self.config.eos_early_stop or self.block_causal)
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
        if self.block_causal and self.eos_ids is not None:
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
