"""Model families: one object per family of diffusion LMs, holding everything that differs between families.

The generation loop, the serving engine, evaluation, the exporter and the CLI are generic: where families differ
(attention topology and block planning, the generation fields a family accepts and their rules, its default cache
and unmasking policies, the logits shift, its mask / EOS / edit tokens, what an export writes, the FP8 skip list)
they ask the model's family object (`model.diffusion_family`) and never test a `model_type`. A family is one
subclass of `DiffusionFamily`, registered by name (`register_family`); `family_for_config` resolves a checkpoint's
family from its `architectures` first, then its `auto_map`, then its `model_type` and fields (model types collide:
LLaDA-MoE's Hub config says `llada`, as dense LLaDA's does). The shape follows SGLang's `srt/dllm/algorithm/`: one
small class per variant, each validating its own settings, registered by name.

Two attention topologies underlie the families, as mixins with the block facts that follow from them:
`Bidirectional` (LLaDA, LLaDA-MoE, Dream: every position sees every other; blocks start after the prompt) and
`BlockCausal` (LLaDA2.x, arXiv:2512.15745: a block sees itself and earlier blocks; blocks aligned to absolute
positions; committed K/V are exact).

This file is exported verbatim as Hub remote code.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import TYPE_CHECKING

from .generation_fields import EDITING_FIELDS, GENERATION_FIELDS

if TYPE_CHECKING:
    import torch

    from .block_plan import BlockPlan
    from .cache import CachePolicy
    from .decoding import UnmaskingPolicy
    from .generation_config import DiffusionGenerationConfig

# The family objects are imported without torch or transformers (the command line's `--help` lists the families'
# fields and defaults without loading either, docs/decisions/cli-startup.md): the modules that decode (policies,
# caches, block plans) are imported by the methods that use them.

# Remote code every family shares: the generation loop, its config, the family objects, policies, caches, attention
# backends and kernels, reached from the model files through relative imports.
SHARED_REMOTE_CODE_FILES = (
    "generation_utils.py",
    "block_loop.py",
    "block_plan.py",
    "step_machine.py",
    "generation_config.py",
    "generation_fields.py",
    "family.py",
    "decoding.py",
    "cache.py",
    "packed.py",
    "attention.py",
    "triton_attention.py",
    "kernels.py",
    "fp8.py",
    "fp8_schemes.py",
    "fp8_triton.py",
    "triton_ops.py",
    "triton_linear.py",
    "graphs.py",
    "tensor_parallel.py",
)
# The generation defaults an export writes when SRC has none: Fast-dLLM's parallel decoding (threshold 0.9) with the
# dual cache, greedy, in blocks of 32 (families adjust them).
FAST_GENERATION_DEFAULTS = {
    "max_new_tokens": 256,
    "block_length": 32,
    "threshold": 0.9,
    "steps": None,
    "use_cache": True,
    "dual_cache": True,
    "do_sample": False,
    "temperature": 0.0,
    "remasking": "low_confidence",
    "eos_early_stop": True,
}


class DiffusionFamily:
    """What one family of diffusion LMs is, and every rule in which it differs from the others.

    Identity (how a checkpoint is recognised, `family_for_config`): `name` (the registry key), `display_name` (in
    messages and model cards), `architectures`, `auto_map_configs` (`auto_map["AutoConfig"]` values) and
    `model_types` of its Hub checkpoints, and `describes(config)` for the fields that tell it apart from a family
    sharing those.

    Export facts (`hf-dllm export`): the modules and classes `auto_map` points at, the `remote_code_files` (the
    model's files first; the shared ones are added by the exporter), `generation_defaults` written when SRC has no
    generation_config.json (and `fast_generation_defaults` for `--generation-defaults fast`), the model-card
    template and generic preset, the end-of-turn token looked up in the tokenizer, the FP8 modules left
    unquantized.
    """

    name = ""
    display_name = ""
    checkpoints = ""
    architectures: tuple[str, ...] = ()
    auto_map_configs: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()

    config_module = ""
    config_class = ""
    model_module = ""
    model_class = ""
    # The family's own remote-code files: the two `auto_map` points at first, then the rest its model reaches.
    own_remote_code_files: tuple[str, ...] = ()
    generation_defaults: dict = {}
    fast_generation_defaults: dict | None = None
    card_template = "template.md"
    generic_card = "generic"
    eot_token: str | None = None
    fp8_modules_to_not_convert: tuple[str, ...] | None = None

    # Logits at position i predict token i + logits_shift (0: a mask predictor, LLaDA; 1: Dream).
    logits_shift = 0
    # Classifier-free guidance with a masked prompt (LLaDA App. B.3).
    supports_cfg = True
    # Whether undecoded positions are the mask token, which prompts must not hold (False: the sampler starts a block
    # from tokens of its own, `UnmaskingPolicy.initial_block`, and `mask_token_id` only marks undecoded columns).
    masked_canvas = True
    # Fields of the family's original generation config (on the Hub) that hf_dllm does not provide, each with the
    # value at which it changes nothing (Dream: `output_history=False`): such a generation_config.json still loads.
    original_generation_fields: dict = {}
    # Fields whose default in the family's original implementation differs from hf_dllm's, applied where a
    # checkpoint's generation_config.json leaves them unset (DiffusionGemma: transformers' `max_new_tokens=256`).
    original_defaults: dict = {}
    # Generation fields of the family's own sampler (`generation_config.register_generation_fields`, which describes
    # them for every application): the family accepts them; every other family refuses them away from their defaults.
    own_generation_fields: tuple[str, ...] = ()
    # Whether the family's rule edits committed tokens whatever the settings (LLaDA2.2: an unset
    # `editing_threshold` is 0.0); elsewhere the editing fields (`max_post_steps`, `num_to_transfer`) away from
    # their defaults need `editing_threshold`.
    always_edits = False

    @property
    def remote_code_files(self) -> tuple[str, ...]:
        """Every package file an export of this family ships as remote code."""
        return (*self.own_remote_code_files, *SHARED_REMOTE_CODE_FILES)

    @property
    def fast_defaults(self) -> dict:
        """What `--generation-defaults fast` writes."""
        return self.fast_generation_defaults if self.fast_generation_defaults is not None else self.generation_defaults

    @property
    def auto_map(self) -> dict[str, str]:
        """`config.json`'s `auto_map` of an export: AutoModel and AutoModelForCausalLM both give the model with the
        LM head and the diffusion `generate()`, as `import hf_dllm` registers them."""
        model = f"{self.model_module}.{self.model_class}"
        return {
            "AutoConfig": f"{self.config_module}.{self.config_class}",
            "AutoModel": model,
            "AutoModelForCausalLM": model,
        }

    def classes(self) -> tuple[type, type]:
        """hf_dllm's config and model classes of this family."""
        config = getattr(importlib.import_module(f".{self.config_module}", __package__), self.config_class)
        model = getattr(importlib.import_module(f".{self.model_module}", __package__), self.model_class)
        return config, model

    def context_length(self, model_config) -> int | None:
        """Positions a model of this family runs on (prompt + generated), from its config: `max_position_embeddings`
        (None: no limit known), times a RoPE scaling `factor` where the config declares one (it extrapolates)."""
        limit = getattr(model_config, self.context_length_field, None)
        scaling = getattr(model_config, "rope_scaling", None)
        if limit is not None and isinstance(scaling, dict) and isinstance(scaling.get("factor"), (int, float)):
            limit = int(limit * max(1.0, scaling["factor"]))
        return limit

    def empty_prompt(self, config: DiffusionGenerationConfig) -> list[int]:
        """The prompt a call with an empty one (or none) decodes from: the BOS token (`bos_token_id`), as the
        family's tokenizer starts every text with it; a `ValueError` when the settings name no BOS (a model never
        trained to start from nothing would decode noise, silently)."""
        if config.bos_token_id is None:
            raise ValueError(
                f"The prompt is empty and `bos_token_id` is not set: {self.display_name} models need at least one "
                "prompt token (pass a prompt, or set bos_token_id to start from the BOS token)."
            )
        return [config.bos_token_id]

    # Fields of a model config holding token ids; each must be in the vocabulary (`check_token_ids`).
    token_id_fields: tuple[str, ...] = ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")

    def vocabulary_size(self, model_config) -> int:
        """Rows of the model's embedding: the token ids it can read (`vocab_size`)."""
        return model_config.vocab_size

    def check_token_ids(self, model_config, others: dict | None = None) -> None:
        """`ValueError` naming the field, for a token id of `model_config` (`token_id_fields`) or of `others` (a
        label naming the field, to an id or a list of ids: a generation config's) outside the vocabulary: a default id of the full-size
        model (LLaDA2's mask 156895) in a config with a small vocabulary would only fail at generate() time."""
        vocabulary = self.vocabulary_size(model_config)
        fields = {f"`{name}`": getattr(model_config, name, None) for name in self.token_id_fields}
        for name, value in {**fields, **(others or {})}.items():
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if token is not None and not (isinstance(token, int) and 0 <= token < vocabulary):
                    raise ValueError(
                        f"{name} is {value!r}, outside the vocabulary of {vocabulary} tokens (ids 0 to "
                        f"{vocabulary - 1}): set it to the id of that token in this model's vocabulary."
                    )

    # The config field naming the trained context.
    context_length_field = "max_position_embeddings"

    def describes(self, config: dict) -> bool:
        """Whether a checkpoint config (as a dict) that matches this family's identity is this family's (e.g.
        LLaDA2.2: LLaDA2's architecture with `delete_token_id` / `split_token_id`)."""
        return True

    # -- settings ---------------------------------------------------------------------------------------------
    def validate(self, config: DiffusionGenerationConfig) -> None:
        """`ValueError` naming the field for any setting of `config` a model of this family cannot honour: the
        model-agnostic checks (`config.validate()`), then the family's own rules."""
        config.validate()
        if config.editing_threshold is None and not self.always_edits:
            for name in EDITING_FIELDS[1:]:
                if getattr(config, name) != GENERATION_FIELDS[name].default:
                    raise ValueError(f"`{name}` only applies to token editing: set `editing_threshold` too.")
        foreign = [
            field
            for field in GENERATION_FIELDS.values()
            if field.owner is not None
            and field.name not in self.own_generation_fields
            and getattr(config, field.name) != field.default
        ]
        if foreign:
            owners = " and ".join(sorted({field.owner for field in foreign}))
            foreign = [field.name for field in foreign]
            raise ValueError(
                f"{foreign} are settings of {owners}'s sampler, which {self.display_name} models do not use: leave "
                "them unset (this model's rules are `steps`, `threshold` and `factor`)."
            )
        if config.cfg_scale > 0 and (not self.supports_cfg or self.logits_shift):
            # The unconditional branch masks the prompt's columns: that is LLaDA's guidance of an unshifted model.
            raise ValueError(f"`cfg_scale` > 0 is not supported by {self.display_name} models: set it to 0.")
        self.validate_topology(config)

    def validate_topology(self, config: DiffusionGenerationConfig) -> None:
        """The rules of the family's attention topology (`Bidirectional`, `BlockCausal`)."""

    # -- decoding ---------------------------------------------------------------------------------------------
    def unmasking_policy(self, config: DiffusionGenerationConfig, model_config=None) -> UnmaskingPolicy:
        """The rule the settings name for this family (`model_config`: the model's, for families whose rules read
        it, e.g. LLaDA2.2's edit tokens)."""
        raise NotImplementedError

    def cache_policy(self, config: DiffusionGenerationConfig) -> CachePolicy:
        raise NotImplementedError

    def fill_token_id(self, config: DiffusionGenerationConfig) -> int:
        """What an ended row shows after its end: its first EOS id, else `pad_token_id`, else the mask id."""
        eos = config.eos_token_ids
        return eos[0] if eos else config.pad_token_id if config.pad_token_id is not None else config.mask_token_id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class Bidirectional:
    """Topology of families whose positions all attend to each other (LLaDA arXiv:2502.09992, Dream): blocks start
    right after each prompt (`plan_bidirectional`), and a K/V cache outside the block is an approximation refreshed
    at each block start (Fast-dLLM arXiv:2505.22618: prefix / dual cache)."""

    topology = "bidirectional"
    # Committed blocks' K/V change as later blocks are decoded (the engine recomputes them at each block start).
    committed_kv_exact = False
    # LLaDA's Monte-Carlo log-likelihood bound (`evaluation/likelihood.py`) needs every masked position to see the
    # whole continuation.
    scores_likelihood = True
    # Later blocks can still change the meaning of an EOS: it ends a row only with `eos_early_stop`.
    cut_after_first_eos = False

    def validate_topology(self, config: DiffusionGenerationConfig) -> None:
        rule = "threshold" if config.threshold is not None else None
        if rule and config.steps is not None:
            raise ValueError(f"`steps` must be None with `{rule}`: confidence decides how many steps a block takes.")
        if config.minimal_topk != GENERATION_FIELDS["minimal_topk"].default:
            raise ValueError("`minimal_topk` only applies to block-causal models (LLaDA2).")
        if config.editing_threshold is not None:
            raise ValueError(
                "`editing_threshold` (token editing, LLaDA2.1) is only supported by block-causal models (LLaDA2); "
                "this model attends bidirectionally."
            )

    def plan(self, prompt_lengths: list[int], prompt_width: int, config, device) -> BlockPlan:
        """Where a batch of left-padded prompts (of `prompt_lengths` real tokens) decodes (`BlockPlan`)."""
        from .block_plan import plan_bidirectional

        return plan_bidirectional(prompt_width, len(prompt_lengths), config, device)

    def lay_out(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, plan: BlockPlan, config):
        """The canvas of a batch: `x` `(batch, canvas_width)` (the caller's prompts, as padded, then masks), the key
        padding mask (None without padding) and the position ids (counted from each row's first real token)."""
        import torch

        from .cache import padding_aware_position_ids

        batch, width = input_ids.shape
        x = torch.full((batch, plan.canvas_width), config.mask_token_id, dtype=torch.long, device=input_ids.device)
        x[:, :width] = input_ids
        if attention_mask is None:
            return x, None, torch.arange(plan.canvas_width, device=input_ids.device).expand(batch, -1)
        generated = torch.ones(batch, config.max_new_tokens, dtype=attention_mask.dtype, device=input_ids.device)
        key_mask = torch.cat([attention_mask, generated], dim=1)
        return x, key_mask, padding_aware_position_ids(key_mask)

    def decoded_length(self, max_tokens: int, config: DiffusionGenerationConfig) -> int:
        """Positions decoded for `max_tokens` asked (the server's `max_tokens`): whole blocks."""
        return -(-max_tokens // config.block_length) * config.block_length

    def forward_kwargs(self, config: DiffusionGenerationConfig) -> dict:
        return {}

    def cache_policy(self, config: DiffusionGenerationConfig) -> CachePolicy:
        from .cache import DualCache, NoCache, PrefixCache

        if not config.use_cache:
            return NoCache()
        return DualCache() if config.dual_cache else PrefixCache()

    def eos_ends_row(self, config: DiffusionGenerationConfig) -> bool:
        """Whether an EOS in a row's committed blocks ends the row."""
        return config.eos_early_stop

    def stops_inside_block(self, config: DiffusionGenerationConfig, unmasking: UnmaskingPolicy) -> bool:
        """Whether a row may stop inside a block, at a committed EOS (the step then takes an `active` mask)."""
        return False


class BlockCausal:
    """Topology of block-diffusion families (LLaDA2.x, arXiv:2512.15745): a block attends to itself and earlier
    blocks, so blocks are aligned to absolute positions (`plan_block_causal`), committed K/V are exact (written
    once, `ExactBlockCache`), the forward takes the block length, and nothing after an EOS can change it."""

    topology = "block-causal"
    committed_kv_exact = True
    cut_after_first_eos = True
    scores_likelihood = False

    def validate_topology(self, config: DiffusionGenerationConfig) -> None:
        return None  # `steps` combines with `threshold`; editing and `minimal_topk` are the family's to judge

    def plan(self, prompt_lengths: list[int], prompt_width: int, config, device) -> BlockPlan:
        from .block_plan import plan_block_causal

        return plan_block_causal(prompt_lengths, prompt_width, config, device)

    def lay_out(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, plan: BlockPlan, config):
        """As `Bidirectional.lay_out`, with each row's real tokens moved to its `plan.prompt_start` (whole blocks of
        padding before them, so that every row's block boundaries fall on the same columns)."""
        import torch

        device = input_ids.device
        prompts = (
            list(input_ids)
            if attention_mask is None
            else [row[keep.bool()] for row, keep in zip(input_ids, attention_mask, strict=True)]
        )
        x = torch.full((len(prompts), plan.canvas_width), config.mask_token_id, dtype=torch.long, device=device)
        columns = torch.arange(plan.canvas_width, device=device)
        x[columns < plan.prompt_start.unsqueeze(-1)] = config.prompt_pad_token_id
        for row, prompt in enumerate(prompts):
            start = int(plan.prompt_start[row])
            x[row, start : start + len(prompt)] = prompt
        padded = bool((plan.prompt_start > 0).any())
        key_mask = (columns >= plan.prompt_start.unsqueeze(-1)).long() if padded else None
        return x, key_mask, (columns - plan.prompt_start.unsqueeze(-1)).clamp(min=0)

    def decoded_length(self, max_tokens: int, config: DiffusionGenerationConfig) -> int:
        """Blocks are aligned to absolute positions and the last one is decoded whole anyway: no rounding."""
        return max_tokens

    def forward_kwargs(self, config: DiffusionGenerationConfig) -> dict:
        return {"block_length": config.block_length}

    def cache_policy(self, config: DiffusionGenerationConfig) -> CachePolicy:
        # The suffix is never attended: the prefix and dual caches are the same exact cache (`dual_cache` is moot).
        from .cache import BlockCausalNoCache, ExactBlockCache

        return ExactBlockCache() if config.use_cache else BlockCausalNoCache()

    def eos_ends_row(self, config: DiffusionGenerationConfig) -> bool:
        return True

    def stops_inside_block(self, config: DiffusionGenerationConfig, unmasking: UnmaskingPolicy) -> bool:
        # LLaDA2.0's in-block EOS stop (its `eos_early_stop`): without editing, a committed token is final.
        return config.eos_early_stop and not unmasking.edits and bool(config.eos_token_ids)


def fast_dllm_policy(config: DiffusionGenerationConfig) -> UnmaskingPolicy:
    """LLaDA's fixed schedule or Fast-dLLM's threshold / factor rule, as the settings name."""
    from .decoding import ConfidenceFactor, ConfidenceThreshold, FixedSchedule

    if config.factor is not None:
        return ConfidenceFactor(config.factor)
    if config.threshold is not None:
        return ConfidenceThreshold(config.threshold)
    return FixedSchedule()


# -- the registry ---------------------------------------------------------------------------------------------
FAMILIES: dict[str, DiffusionFamily] = {}


def register_family(family: DiffusionFamily) -> DiffusionFamily:
    """Register `family` under `family.name` (the last registration of a name wins); returns it."""
    if not isinstance(family, DiffusionFamily) or not family.name:
        raise TypeError(f"register_family() takes a named DiffusionFamily, got {family!r}.")
    FAMILIES[family.name] = family
    return family


def _specificity(family: DiffusionFamily) -> int:
    # A subclass refines its parent (LLaDA2.2 over LLaDA2): the deeper class is asked first.
    return len(type(family).__mro__)


def family_for_config(config, families=None) -> DiffusionFamily | None:
    """The family of a checkpoint config (a `PretrainedConfig` or its dict), or None: among `families` (default:
    every registered one) those naming one of its `architectures`, else its `auto_map["AutoConfig"]`, else its
    `model_type`; of those, the most specific one that `describes` it. A config's `model_type`, when it has one,
    must be one of the family's (an architecture name alone does not make a `llama` config a LLaDA one)."""
    if not isinstance(config, dict):
        # The instance's own fields (no deep copy, unlike `to_dict()`: a model asks at every call) and its class's
        # `model_type`.
        config = {**vars(config), "model_type": getattr(config, "model_type", None)}
    model_type = config.get("model_type")
    candidates = [
        family
        for family in (FAMILIES.values() if families is None else families)
        if not model_type or model_type in family.model_types
    ]
    architectures = set(config.get("architectures") or ())
    auto_config = (config.get("auto_map") or {}).get("AutoConfig")
    if isinstance(auto_config, str):
        auto_config = auto_config.split("--")[-1]  # "repo--module.Class" in configs of remote code
    for matches in (
        lambda family: architectures & set(family.architectures),
        lambda family: auto_config in family.auto_map_configs,
        lambda family: model_type in family.model_types,
    ):
        found = [family for family in candidates if matches(family) and family.describes(config)]
        if found:
            return max(found, key=_specificity)
    return None


def import_families() -> None:
    """Import every `family_*` module of this package: each registers its family (and its sampler's generation
    fields), so the registry is complete without importing the models (torch), e.g. for the command line's
    `--help`."""
    package = sys.modules[__package__]
    for module in pkgutil.iter_modules(package.__path__):
        if module.name.startswith("family_"):
            importlib.import_module(f".{module.name}", __package__)


def registered_family(name: str) -> DiffusionFamily:
    """The family registered as `name`; a `ValueError` naming the registered ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; the families are {sorted(FAMILIES)}.")
    return FAMILIES[name]


def plan_for(family, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config) -> BlockPlan:
    """`family.plan` for a `(batch, width)` batch of left-padded prompts (`attention_mask` None: no padding)."""
    width = input_ids.shape[1]
    lengths = [width] * input_ids.shape[0] if attention_mask is None else attention_mask.sum(-1).tolist()
    return family.plan(lengths, width, config, input_ids.device)


__all__ = [
    "FAMILIES",
    "FAST_GENERATION_DEFAULTS",
    "SHARED_REMOTE_CODE_FILES",
    "BlockCausal",
    "Bidirectional",
    "DiffusionFamily",
    "family_for_config",
    "fast_dllm_policy",
    "import_families",
    "plan_for",
    "register_family",
    "registered_family",
]
