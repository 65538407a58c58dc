"""LLaDA configuration that reads the Hub's `config.json` of the LLaDA family unchanged.

LLaDA (arXiv:2502.09992) checkpoints (`GSAI-ML/LLaDA-8B-Base`, `-Instruct`, `LLaDA-1.5`, iLLaDA) ship an
OLMo-style config (`d_model`, `n_heads`, `n_kv_heads`, `mlp_hidden_size`, ...). This class keeps every one of
those fields under its original name, so a config saved by it is the Hub's format again, and exposes the
standard transformers names (`hidden_size`, `num_attention_heads`, `num_key_value_heads`,
`num_hidden_layers`, `intermediate_size`, `head_dim`) on top.

This file is exported verbatim as Hub remote code: it imports only transformers and the standard library.
"""

from transformers import PretrainedConfig

# Architecture switches of the OLMo-style config that LLaDA checkpoints never turn on. Each is rejected with a
# clear error rather than silently computing something else than the checkpoint was trained with.
_SUPPORTED_CHOICES = {
    "block_type": ("llama",),
    "layer_norm_type": ("rms",),
    "activation_type": ("silu", "gelu", "relu"),
}
_MUST_BE_FALSE = ("alibi", "attention_layer_norm")


class LLaDAConfig(PretrainedConfig):
    r"""
    Configuration of a LLaDA masked-diffusion language model.

    Field names and defaults follow the Hub's `configuration_llada.py` (an OLMo `ModelConfig`); the defaults are
    those of LLaDA-8B. Only the fields that change the computation are validated; bookkeeping fields of the
    original training code (`init_device`, `precision`, `flash_attention`, ...) are kept for round-tripping.

    Args:
        d_model (`int`): hidden size.
        n_heads (`int`): number of query heads.
        n_kv_heads (`int`, *optional*): number of key/value heads (grouped-query attention); `None` = `n_heads`.
        n_layers (`int`): number of transformer blocks.
        mlp_hidden_size (`int`, *optional*): width of the gated MLP; `None` = `mlp_ratio * d_model`.
        mlp_ratio (`int`): used when `mlp_hidden_size` is `None`.
        vocab_size (`int`): number of real tokens.
        embedding_size (`int`, *optional*): rows of the embedding / columns of the logits (>= `vocab_size`).
        max_sequence_length (`int`): longest sequence the model was trained on (RoPE is not limited by it).
        rope_theta (`float`): RoPE base.
        rms_norm_eps (`float`): epsilon of the RMS norms.
        include_bias (`bool`): bias in every linear layer.
        include_qkv_bias (`bool`): bias in the q/k/v projections only.
        bias_for_layer_norm (`bool`, *optional*): bias in the norms; `None` = `include_bias`.
        layer_norm_with_affine (`bool`): whether the norms have a weight.
        weight_tying (`bool`): logits use the input embedding matrix (no `ff_out` head).
        input_emb_norm (`bool`): scale embeddings by `sqrt(d_model)`.
        scale_logits (`bool`): scale logits by `1 / sqrt(d_model)`.
        mask_token_id (`int`): id of the `[MASK]` token (126336 for LLaDA-8B).
        eos_token_id, pad_token_id (`int`): special token ids.
    """

    model_type = "llada"
    # The outputs' cache, which `Trainer` leaves out of evaluation logits: `cache` since transformers 5.2x,
    # `past_key_values` before.
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # Tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun), Megatron-style as transformers'
    # Llama: q/k/v and the gate/up projections split by output rows (whole heads per rank; n_heads and n_kv_heads
    # must divide by the number of ranks), attention output and ff_out by input columns (each rank's partial sum is
    # all-reduced), the output head by vocabulary rows with the logits gathered so every rank unmasks from the same
    # logits. The embedding is replicated. The blocks read their per-rank head counts from the weights' shapes.
    base_model_tp_plan = {
        "transformer.blocks.*.q_proj": "colwise",
        "transformer.blocks.*.k_proj": "colwise",
        "transformer.blocks.*.v_proj": "colwise",
        "transformer.blocks.*.attn_out": "rowwise",
        "transformer.blocks.*.ff_proj": "colwise",
        "transformer.blocks.*.up_proj": "colwise",
        "transformer.blocks.*.ff_out": "rowwise",
        "transformer.ff_out": "colwise_gather_output",
    }
    # No `base_model_pp_plan`: pipeline stages are children of the base model, and LLaDA's only child is
    # `transformer`, the ModuleDict that holds the embedding, blocks, final norm and output head under the Hub
    # checkpoints' parameter names (`model.transformer.blocks.0...`), which the model must keep to load them.
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
    }

    def __init__(
        self,
        d_model: int = 4096,
        n_heads: int = 32,
        n_kv_heads: int | None = None,
        n_layers: int = 32,
        mlp_ratio: int = 4,
        mlp_hidden_size: int | None = 12288,
        activation_type: str = "silu",
        block_type: str = "llama",
        block_group_size: int = 1,
        alibi: bool = False,
        alibi_bias_max: float = 8.0,
        rope: bool = True,
        rope_full_precision: bool = True,
        rope_theta: float = 500000.0,
        flash_attention: bool = False,
        attention_dropout: float = 0.0,
        multi_query_attention: bool | None = None,
        attention_layer_norm: bool = False,
        attention_layer_norm_with_affine: bool = True,
        residual_dropout: float = 0.0,
        embedding_dropout: float = 0.0,
        input_emb_norm: bool = False,
        layer_norm_type: str = "rms",
        layer_norm_with_affine: bool = True,
        bias_for_layer_norm: bool | None = False,
        rms_norm_eps: float = 1e-5,
        max_sequence_length: int = 4096,
        include_qkv_bias: bool | None = False,
        include_bias: bool = False,
        scale_logits: bool = False,
        vocab_size: int = 126464,
        embedding_size: int | None = 126464,
        weight_tying: bool = False,
        init_device: str | None = None,
        init_fn: str = "mitchell",
        init_std: float = 0.02,
        init_cutoff_factor: float | None = None,
        precision: str | None = None,
        mask_token_id: int | None = 126336,
        eos_token_id: int | list[int] | None = 126081,
        pad_token_id: int | None = 126081,
        use_cache: bool = False,
        **kwargs,
    ):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_layers = n_layers
        self.mlp_ratio = mlp_ratio
        self.mlp_hidden_size = mlp_hidden_size
        self.activation_type = activation_type
        self.block_type = block_type
        self.block_group_size = block_group_size
        self.alibi = alibi
        self.alibi_bias_max = alibi_bias_max
        self.rope = rope
        self.rope_full_precision = rope_full_precision
        self.rope_theta = rope_theta
        self.flash_attention = flash_attention
        self.attention_dropout = attention_dropout
        self.multi_query_attention = multi_query_attention
        self.attention_layer_norm = attention_layer_norm
        self.attention_layer_norm_with_affine = attention_layer_norm_with_affine
        self.residual_dropout = residual_dropout
        self.embedding_dropout = embedding_dropout
        self.input_emb_norm = input_emb_norm
        self.layer_norm_type = layer_norm_type
        self.layer_norm_with_affine = layer_norm_with_affine
        self.bias_for_layer_norm = bias_for_layer_norm
        self.rms_norm_eps = rms_norm_eps
        self.max_sequence_length = max_sequence_length
        self.include_qkv_bias = include_qkv_bias
        self.include_bias = include_bias
        self.scale_logits = scale_logits
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.weight_tying = weight_tying
        self.init_device = init_device
        self.init_fn = init_fn
        self.init_std = init_std
        self.init_cutoff_factor = init_cutoff_factor
        self.precision = precision
        self.mask_token_id = mask_token_id
        # transformers 5 dropped `use_cache` from the base config; LLaDA's config.json carries it, keep it.
        self.use_cache = use_cache
        # LLaDA ties through `weight_tying` and has no `ff_out` when tied: transformers' own tying must stay off.
        kwargs["tie_word_embeddings"] = False
        # Before the base class's own checks, which read derived sizes such as `head_dim`.
        self.validate_llada()
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)

    # Standard transformers names for the OLMo-style fields.
    @property
    def num_key_value_heads(self) -> int:
        if self.multi_query_attention:
            return 1
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def intermediate_size(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and width of the logits (`embedding_size`, or `vocab_size` when unset)."""
        return self.embedding_size if self.embedding_size is not None else self.vocab_size

    @property
    def qkv_bias(self) -> bool:
        return bool(self.include_bias or self.include_qkv_bias)

    @property
    def layer_norm_bias(self) -> bool:
        return bool(self.include_bias if self.bias_for_layer_norm is None else self.bias_for_layer_norm)

    def validate_llada(self) -> None:
        """Raise a `ValueError` naming the field and the allowed values for any config this code cannot run."""
        for name in ("d_model", "n_heads", "n_layers", "vocab_size", "max_sequence_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LLaDAConfig.{name} must be a positive integer, got {value!r}.")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"LLaDAConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}).")
        if self.head_dim % 2 != 0:
            raise ValueError(f"LLaDAConfig head dimension d_model / n_heads = {self.head_dim} must be even for RoPE.")
        kv = self.num_key_value_heads
        if not isinstance(kv, int) or kv <= 0 or self.n_heads % kv != 0:
            raise ValueError(
                f"LLaDAConfig.n_kv_heads must be a positive divisor of n_heads ({self.n_heads}), got {self.n_kv_heads!r}."
            )
        if not isinstance(self.intermediate_size, int) or self.intermediate_size <= 0:
            raise ValueError(
                f"LLaDAConfig.mlp_hidden_size (or mlp_ratio * d_model) must be a positive integer, "
                f"got {self.intermediate_size!r}."
            )
        if self.embedding_size is not None and self.embedding_size < self.vocab_size:
            raise ValueError(
                f"LLaDAConfig.embedding_size ({self.embedding_size}) must be >= vocab_size ({self.vocab_size})."
            )
        for name, allowed in _SUPPORTED_CHOICES.items():
            value = getattr(self, name)
            value = getattr(value, "value", value)
            if value not in allowed:
                raise ValueError(f"LLaDAConfig.{name} must be one of {allowed}, got {value!r}.")
        for name in _MUST_BE_FALSE:
            if getattr(self, name):
                raise ValueError(f"LLaDAConfig.{name}=True is not supported by LLaDA models; it must be false.")
        if not self.rope:
            raise ValueError("LLaDAConfig.rope must be true: LLaDA uses rotary position embeddings.")
        if self.block_group_size != 1:
            raise ValueError(f"LLaDAConfig.block_group_size must be 1, got {self.block_group_size!r}.")
        if not self.rope_theta or self.rope_theta <= 0:
            raise ValueError(f"LLaDAConfig.rope_theta must be > 0, got {self.rope_theta!r}.")
        if self.rms_norm_eps is None or self.rms_norm_eps < 0:
            raise ValueError(f"LLaDAConfig.rms_norm_eps must be >= 0, got {self.rms_norm_eps!r}.")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.padded_vocab_size:
            raise ValueError(
                f"LLaDAConfig.mask_token_id must be in [0, {self.padded_vocab_size}), got {self.mask_token_id!r}."
            )


__all__ = ["LLaDAConfig"]
