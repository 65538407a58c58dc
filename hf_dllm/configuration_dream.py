"""Dream configuration (`model_type = "Dream"`) that reads the Hub's `config.json` unchanged.

HKUNLP's Dream 7B (arXiv:2508.15487) is a masked-diffusion LM initialised from Qwen2.5: a Qwen2 body (q/k/v
projections with biases, rotate-half RoPE, SiLU-gated MLP, RMS norms) with bidirectional attention and logits
shifted by one position (the logits at position i predict token i + 1). Its checkpoints (`Dream-org/Dream-v0-*`)
ship Qwen2's config fields plus `mask_token_id`; this class keeps every one of them under its original name, so a
config saved by it is the Hub's format again, and rejects the switches the model cannot honour (sliding windows,
RoPE scalings other than none / linear) with an error naming the field.

This file is exported verbatim as Hub remote code: it imports only transformers and the standard library.
"""

from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.utils import logging

logger = logging.get_logger(__name__)

ROPE_TYPES = ("default", "linear")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class DreamConfig(PretrainedConfig):
    r"""
    Configuration of a Dream masked-diffusion language model. Defaults are the Hub class's (`configuration_dream.py`
    of `Dream-org/Dream-v0-Instruct-7B`); the 7B checkpoints set their own sizes in `config.json`.

    Args:
        vocab_size (`int`): rows of the embedding and of the output head.
        hidden_size (`int`): model width; the head width is `hidden_size // num_attention_heads`.
        intermediate_size (`int`): width of the SiLU-gated MLP.
        num_hidden_layers (`int`): number of decoder layers.
        num_attention_heads (`int`): query heads.
        num_key_value_heads (`int`, *optional*): key/value heads (grouped-query attention); `None` = query heads.
        hidden_act (`str`): activation of the gated MLP (a key of transformers' `ACT2FN`).
        max_position_embeddings (`int`): longest trained context (RoPE itself is not limited by it).
        initializer_range (`float`): std of the normal init of new weights.
        rms_norm_eps (`float`): epsilon of every RMS norm.
        use_cache (`bool`): kept for round-tripping (the Hub stores False); generation's `use_cache` decides.
        tie_word_embeddings (`bool`): the output head is the input embedding matrix (no `lm_head.weight`).
        rope_theta (`float`): RoPE base.
        rope_scaling (`dict`, *optional*): `None`, `{"rope_type": "default"}` or `{"rope_type": "linear", "factor": f}`.
        use_sliding_window (`bool`): must be False (Dream attends to the whole sequence); `sliding_window` and
            `max_window_layers` are kept for round-tripping.
        attention_dropout (`float`): dropout on attention weights, in training only.
        mask_token_id (`int`): id of the mask token (151666, `<|mask|>` of the Dream tokenizer).
        pad_token_id, bos_token_id, eos_token_id (`int`): special token ids.
    """

    model_type = "Dream"
    # The outputs' cache, which `Trainer` leaves out of evaluation logits: `cache` since transformers 5.2x,
    # `past_key_values` before.
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # Tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun), Megatron-style as transformers'
    # Qwen2: q/k/v (and their biases) and gate/up split by output rows (whole heads per rank: num_attention_heads
    # and num_key_value_heads must divide by the number of ranks), o_proj and down_proj by input columns (each
    # rank's partial sum is all-reduced), the output head by vocabulary rows (`DreamModel._tp_plan`). The embedding
    # is replicated. The attention layers read their per-rank head counts from the weights' shapes.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    # Pipeline stages (transformers' `base_model_pp_plan`): the embedding, the decoder layers, the final norm.
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    # transformers 5 turns `rope_scaling` into a deprecated alias of `rope_parameters`; Dream's configs store the
    # field itself, so this plain class attribute shadows the alias and `rope_scaling` is an ordinary field again.
    rope_scaling = None

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 22016,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = 32,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = False,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        use_sliding_window: bool = False,
        sliding_window: int | None = 4096,
        max_window_layers: int = 28,
        attention_dropout: float = 0.0,
        mask_token_id: int | None = 151666,
        pad_token_id: int | None = 151643,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        # transformers 5 dropped `use_cache` from the base config; the Hub's config.json carries it, keep it.
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.use_sliding_window = use_sliding_window
        # As the Hub class: the window only exists when it is used.
        self.sliding_window = sliding_window if use_sliding_window else None
        self.max_window_layers = max_window_layers
        self.attention_dropout = attention_dropout
        self.mask_token_id = mask_token_id
        # Before the base class's own checks, which read sizes such as `head_dim`.
        self.validate_dream()
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def head_dim(self) -> int:
        """Per-head width, `hidden_size // num_attention_heads` (Qwen2; Dream's config has no `head_dim`)."""
        return self.hidden_size // self.num_attention_heads

    def validate_dream(self) -> None:
        """Raise a `ValueError` naming the field and the allowed values for any config this code cannot run."""
        name = type(self).__name__
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            value = getattr(self, field)
            if not _is_positive_int(value):
                raise ValueError(f"{name}.{field} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{name}.hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}): the head width is hidden_size // num_attention_heads."
            )
        if self.head_dim % 2:
            raise ValueError(f"{name}: the head width ({self.head_dim}) must be even for rotate-half RoPE.")
        kv = self.num_key_value_heads
        if not _is_positive_int(kv) or self.num_attention_heads % kv != 0:
            raise ValueError(
                f"{name}.num_key_value_heads must be a positive divisor of num_attention_heads "
                f"({self.num_attention_heads}), got {kv!r}."
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"{name}.hidden_act must be one of {sorted(ACT2FN)}, got {self.hidden_act!r}.")
        if not _is_number(self.rms_norm_eps) or self.rms_norm_eps < 0:
            raise ValueError(f"{name}.rms_norm_eps must be a number >= 0, got {self.rms_norm_eps!r}.")
        if not _is_number(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(f"{name}.rope_theta must be a number > 0, got {self.rope_theta!r}.")
        scaling = self.rope_scaling
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise ValueError(f"{name}.rope_scaling must be None or a dict, got {scaling!r}.")
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"{name}.rope_scaling type must be one of {ROPE_TYPES}, got {rope_type!r}.")
            factor = scaling.get("factor")
            if rope_type == "linear" and (not _is_number(factor) or factor <= 0):
                raise ValueError(f"{name}.rope_scaling['factor'] must be a number > 0 for linear RoPE, got {factor!r}.")
        if self.use_sliding_window:
            raise ValueError(
                f"{name}.use_sliding_window=True is not supported: Dream attends to the whole sequence (set False)."
            )
        if not _is_number(self.attention_dropout) or not 0 <= self.attention_dropout < 1:
            raise ValueError(f"{name}.attention_dropout must be in [0, 1), got {self.attention_dropout!r}.")
        if self.mask_token_id is not None and (
            not isinstance(self.mask_token_id, int) or isinstance(self.mask_token_id, bool) or self.mask_token_id < 0
        ):
            raise ValueError(f"{name}.mask_token_id must be None or an integer >= 0, got {self.mask_token_id!r}.")

    def rope_position_scale(self) -> float:
        """Linear RoPE scaling divides positions by `factor` (1.0 without scaling)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type", "default")) == "linear":
            return float(scaling["factor"])
        return 1.0


__all__ = ["DreamConfig"]
