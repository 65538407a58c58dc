"""Diffusion `generate()` for masked-diffusion language models: one semi-autoregressive block-denoising loop.

The loop (LLaDA arXiv:2502.09992, Sec. 2.4 "semi-autoregressive remasking"; Fast-dLLM arXiv:2505.22618) fills
`max_new_tokens` masked positions after the prompt, `block_length` at a time, left to right. Within a block, each
step runs the model, proposes a token for every masked position and commits some of them. Two independent,
pluggable pieces decide the rest:

- a cache policy (`cache.py`): which positions a step recomputes (no cache / prefix cache / dual cache);
- an unmasking policy (`decoding.py`): how many positions a step commits (fixed schedule / threshold / factor).

The loop itself is `block_loop.py` (`BlockDiffusionRun`), its steps `step_machine.py` (`StepMachine`), where it
decodes is `block_plan.py`; this file holds the model interface and `generate()`, and re-exports their names. The
generation parameters are `DiffusionGenerationConfig` (`generation_config.py`, re-exported here). The model is
reached through a small interface (`DiffusionGenerationMixin`): `generation_config.mask_token_id`, its family
object (`family.py`: every rule in which families differ), `_diffusion_forward` and `_diffusion_new_cache`.

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.utils import ModelOutput, logging

from .block_loop import BlockDiffusionRun, BlockEvent, apply_stopping_criteria
from .block_plan import BlockPlan, plan_bidirectional, plan_block_causal, plan_blocks
from .cache import CachePolicy, DiffusionKVCache, new_kv_cache
from .decoding import UnmaskingPolicy
from .family import family_for_config
from .generation_config import DiffusionGenerationConfig, is_number
from .step_machine import decoding_policies

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


class DiffusionGenerationMixin:
    """`generate()` for masked-diffusion LMs. A model using it provides:

    - `generation_config` (a `DiffusionGenerationConfig`) with `mask_token_id`;
    - `diffusion_families`: the family objects (`family.DiffusionFamily`) its class serves, of which
      `diffusion_family` is the one its config describes (LLaDA2.2 over LLaDA2.x, say). Everything that differs
      between families (topology and block planning, legal fields and their rules, default policies, logits
      shift) is asked of that object;
    - `diffusion_packed_rows`: whether the forward takes a `packed.PackedRows` as its `attention_mask` and
      `past_key_values` (rows of different lengths end to end in one row; default False): the continuous-batching
      engine then computes a block's full forward without padding;
    - `_diffusion_forward(input_ids, attention_mask, position_ids, cache, cache_position, logits_slice, **kw)`
      returning logits `(batch, L, vocab)` for the kept positions; the default calls `self(...)` with
      transformers' arguments (`past_key_values`, `cache_position`, `logits_to_keep`) and the family's
      `forward_kwargs` (block-causal models: `block_length`);
    - `_diffusion_step_capturable()`: whether a step can be captured in a CUDA graph (default True);
    - `_diffusion_new_cache(batch_size, max_length, kv_cache_dtype=None, max_positions=None)` returning a
      `DiffusionKVCache` (default: one per layer of `config.num_hidden_layers`, `cache.new_kv_cache`), and
      `diffusion_kv_cache_dtypes`, the `kv_cache_dtype` values its attention layers read;
    - `_diffusion_attention_mask(key_mask, q_len)` turning the `(rows, seq_len)` padding mask into what the
      forward's attention backend takes, once per query length (default: transformers'
      `create_bidirectional_mask`), so that no step builds masks (or synchronises with the host).
    """

    # The families this model class serves, most specific first (`family_for_config` picks by the config).
    diffusion_families: tuple = ()
    # True where the attention layers run `packed.PackedRows` (padding-free forwards of several rows).
    diffusion_packed_rows = False
    # `kv_cache_dtype` values the model's layers can read (None: the model's dtype; "fp8": `FP8DiffusionKVCache`).
    diffusion_kv_cache_dtypes: tuple = (None,)

    @property
    def diffusion_family(self):
        """The model's family object (`family.DiffusionFamily`): the one of `diffusion_families` its config
        describes."""
        found = family_for_config(self.config, self.diffusion_families)
        if found is None:
            names = [family.display_name for family in self.diffusion_families]
            raise ValueError(f"{type(self).__name__}'s config describes none of its families {names}.")
        return found

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

    def _diffusion_step_capturable(self) -> bool:
        """Whether a denoising step can be captured in a CUDA graph (no host synchronisation in the forward)."""
        return True

    def _diffusion_new_cache(
        self, batch_size: int, max_length: int, kv_cache_dtype: str | None = None, max_positions: int | None = None
    ):
        return new_kv_cache(self.config.num_hidden_layers, batch_size, max_length, kv_cache_dtype, max_positions)

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
            if not self.diffusion_family.original_generation_fields:
                raise
            loaded = self._original_generation_config(pretrained_model_name_or_path, loading)
        # Special token ids a foreign generation_config.json leaves unset still come from the model config.
        loaded.inherit_special_tokens(self.generation_config)
        self.diffusion_family.validate(loaded)
        self.generation_config = loaded

    def _original_generation_config(self, pretrained_model_name_or_path, loading: dict) -> DiffusionGenerationConfig:
        """A generation_config.json written by the family's original implementation (e.g. Dream's
        `DreamGenerationConfig`, as on the Hub): its fields that hf_dllm does not provide
        (`DiffusionFamily.original_generation_fields`) are accepted at their no-op values and refused otherwise, the rest
        are read as usual."""
        fields = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **loading).to_diff_dict()
        for name, no_op in self.diffusion_family.original_generation_fields.items():
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
        self.diffusion_family.validate(config)
        if config.kv_cache_dtype not in self.diffusion_kv_cache_dtypes:
            raise ValueError(
                f"`kv_cache_dtype={config.kv_cache_dtype!r}` is not supported by {type(self).__name__}: its attention "
                f"reads the K/V cache as {self.diffusion_kv_cache_dtypes}."
            )
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
        # A family whose sampler starts blocks from tokens of its own has no mask token (`masked_canvas`): its
        # `mask_token_id` only marks undecoded columns and is never fed to the model.
        masked = self.diffusion_family.masked_canvas
        if config.mask_token_id is None:
            raise ValueError(
                "`mask_token_id` is not set: pass it to generate() or set it in the generation config "
                f"(an integer in [0, {vocab_size}))."
            )
        special = {"mask_token_id": config.mask_token_id} if masked else {}
        special["eot_token_id"] = config.eot_token_id
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

        if input_ids is None:
            input_ids = torch.tensor([self.diffusion_family.empty_prompt(config)], dtype=torch.long, device=device)
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
        if input_ids.shape[1] == 0:  # empty prompts: the family's start (its BOS) or a ValueError
            start = torch.tensor(self.diffusion_family.empty_prompt(config), dtype=torch.long, device=device)
            input_ids, attention_mask = start.expand(input_ids.shape[0], -1), None
        if input_ids.numel() and not bool(((input_ids >= 0) & (input_ids < vocab_size)).all()):
            raise ValueError(f"`input_ids` must hold token ids in [0, {vocab_size}).")
        if masked and bool((input_ids == config.mask_token_id).any()):
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
        shift = self.diffusion_family.logits_shift
        if shift and input_ids.shape[1] < shift:
            raise ValueError(
                f"This model predicts token i from position i - {shift}: the prompt needs {shift} token(s)."
            )
        limit = self.diffusion_family.context_length(self.config)
        if limit is not None and input_ids.shape[1] + config.max_new_tokens > limit:
            raise ValueError(
                f"The prompt ({input_ids.shape[1]} tokens) and `max_new_tokens` ({config.max_new_tokens}) take "
                f"{input_ids.shape[1] + config.max_new_tokens} positions, more than the model's context of {limit} "
                "positions: shorten the prompt or lower max_new_tokens."
            )
        if limit is not None and config.block_length > limit:
            raise ValueError(
                f"`block_length` ({config.block_length}) is longer than the model's context of {limit} positions: "
                "a block must fit the context (a block_length above max_new_tokens is clamped to it on "
                "bidirectional models only)."
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


# The generation API, with the loop's, its steps' and the plan's names (`block_loop.py`, `step_machine.py`,
# `block_plan.py`) for importers of this module.
__all__ = [
    "DECODING_RULE_FIELDS",
    "BlockDiffusionRun",
    "BlockEvent",
    "BlockPlan",
    "DiffusionGenerateOutput",
    "DiffusionGenerationConfig",
    "DiffusionGenerationMixin",
    "apply_stopping_criteria",
    "decoding_policies",
    "left_pad",
    "plan_bidirectional",
    "plan_block_causal",
    "plan_blocks",
    "select_positions",
]
