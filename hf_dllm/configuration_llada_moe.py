"""LLaDA-MoE configuration (`model_type = "llada"`, as on the Hub) that reads the Hub's `config.json` unchanged.

inclusionAI's LLaDA-MoE (`inclusionAI/LLaDA-MoE-7B-A1B-Base`, `-Instruct`, `-Instruct-TD`) is a bidirectional
masked-diffusion model (decoded like LLaDA) on an OLMoE-style MoE body. Its checkpoints ship the fields of the
original remote `configuration_lladamoe.LLaDAConfig`; this class keeps every one of them under its original name,
so a config saved by it is the Hub's format again. The switches that change the computation are validated here,
and the ones the model cannot honour are rejected with an error naming the field rather than silently ignored.

**`model_type` is `"llada"`, the same string as dense LLaDA's `LLaDAConfig`** (the Hub's value, kept so the file
round-trips). The two are told apart by `architectures` (`LLaDAMoEModelLM`), `auto_map`
(`configuration_lladamoe.LLaDAConfig` / `modeling_lladamoe.LLaDAMoEModelLM`) and their fields (`hidden_size`,
`num_experts`, `moe_layer_freq`, ... here; `d_model`, `n_layers`, ... there). This class registers nothing with the
Auto classes.

What the original modeling code (`modeling_lladamoe.py`) does, and so this one:

- `norm_topk_prob`: **ignored**. The original MoE block hard-codes it off (`self.norm_topk_prob = False`), so the
  chosen experts' softmax probabilities weight their outputs as they are, never renormalised, whatever the config
  says. A config with `norm_topk_prob: true` loads and computes what the Hub's code computes (a warning says so).
- `moe_router_enable_expert_bias`: a `mlp.expert_bias` buffer `(num_experts,)` (kept in the weights) is added to the
  softmax probabilities before the top-k, and the biased values are the weights (as the original code does).
- `moe_router_score_function`, `routed_scaling_factor`, `router_num_group`, `router_topk_group`: never read by the
  original code (softmax scores, no scaling, no group-limited routing). They are kept for round-tripping and must
  hold the values at which ignoring them changes nothing (`softmax` or None; 1; None or <= 1), else a `ValueError`.
- `clip_qkv`: queries and keys (after their per-head norms) and values are clamped to `[-clip_qkv, clip_qkv]`.
- `rope_scaling`: None, `{"rope_type": "default"}` or `{"rope_type": "linear", "factor": f}`; others are refused.

The one addition is `mask_token_id` (the Hub's `config.json` has none; the original `generate()` takes `mask_id`,
156895, the tokenizer's `<|mdm_mask|>`), so that the diffusion generation config finds it.

This file is exported verbatim as Hub remote code: it imports only transformers and the standard library.
"""

from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.utils import logging

logger = logging.get_logger(__name__)

ROPE_TYPES = ("default", "linear")
# The Hub tokenizer's mask token (`<|mdm_mask|>`) and EOS: not in the Hub's config.json.
HUB_MASK_TOKEN_ID = 156895
HUB_EOS_TOKEN_ID = 156892
SCORE_FUNCTIONS = (None, "softmax")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class LLaDAMoEConfig(PretrainedConfig):
    r"""
    Configuration of a LLaDA-MoE masked-diffusion language model. Defaults are at the scale of LLaDA-MoE-7B-A1B
    (hidden 2048, 16 layers, 64 experts of width 1024, 8 per token); a checkpoint's `config.json` sets them all.

    Layer `i` has routed experts if `moe_layer_freq[i]` is not 0 (`num_experts` SwiGLU experts of width
    `expert_intermediate_size`, `num_experts_per_tok` chosen per token by a softmax router, plus a shared SwiGLU
    expert of width `shared_expert_intermediate_size` when that is set), else a dense SwiGLU MLP of width
    `dense_intermediate_size`.

    Args:
        vocab_size (`int`): rows of the embedding and of the output head.
        hidden_size (`int`): model width.
        num_hidden_layers (`int`): number of layers.
        num_attention_heads (`int`): query heads; the head size is `hidden_size // num_attention_heads` (there is
            no `head_dim` field; `head_dim` is a read-only property).
        num_key_value_heads (`int`, *optional*): key/value heads (grouped-query attention); `None` = query heads.
        hidden_act (`str`): activation of the gated MLPs (a key of transformers' `ACT2FN`).
        attention_bias (`bool`): biases in the q/k/v/o projections.
        attention_dropout (`float`): dropout on attention weights, in training only.
        clip_qkv (`float`, *optional*): clamp queries, keys and values to `[-clip_qkv, clip_qkv]`.
        qk_layernorm (`bool`, *optional*): per-head RMS norm of queries and keys before RoPE (`None` = off).
        rms_norm_eps (`float`): epsilon of every RMS norm.
        rope_theta (`float`): RoPE base.
        rope_scaling (`dict`, *optional*): see the module docstring.
        partial_rotary_factor (`float`): RoPE's `dim = int(head_dim * partial_rotary_factor)`: frequencies
            `rope_theta ** (-arange(0, dim, 2) / dim)` rotate (rotate-half style) the first `rotary_width()` dims of
            each head (`dim` rounded up to even, as the original code does); the rest pass through.
        max_position_embeddings (`int`): longest trained context (RoPE itself is not limited by it).
        num_experts (`int`): routed experts per MoE layer.
        num_experts_per_tok (`int`): experts chosen per token (top-k).
        expert_intermediate_size (`int`): width of one routed expert.
        moe_layer_freq (`list[int]`): one entry per layer, 0 = dense MLP, 1 = MoE.
        dense_intermediate_size (`int`): width of the dense layers' MLP (read only where there are dense layers).
        shared_expert_intermediate_size (`int`, *optional*): width of the shared expert of MoE layers (None: none).
        norm_topk_prob (`bool`, *optional*): ignored, as by the original code (see the module docstring).
        moe_router_enable_expert_bias (`bool`, *optional*): the router's `expert_bias` buffer (see above).
        moe_router_score_function, routed_scaling_factor, router_num_group, router_topk_group: kept for
            round-tripping (see above).
        router_aux_loss_coef (`float`), output_router_logits (`bool`): router outputs for training; kept.
        initializer_range (`float`): std of the normal init of new weights.
        use_cache (`bool`): kept for round-tripping (the Hub stores `false`; `generate()`'s caches are its own).
        tie_word_embeddings (`bool`): the output head is the input embedding matrix (no `lm_head.weight`).
        mask_token_id (`int`): id of the mask token (not in the Hub's config.json): default 156895, the Hub
            tokenizer's, where the vocabulary holds it (else None: pass `mask_token_id` to `generate()`).
        pad_token_id, eos_token_id, bos_token_id (`int`): special token ids (EOS 156892 on the Hub).
    """

    model_type = "llada"
    # The outputs' cache, which `Trainer` leaves out of evaluation logits: `cache` since transformers 5.2x,
    # `past_key_values` before.
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # Several GPUs: expert parallelism only (`distributed_config=DistributedConfig(tp_size=N, ep_size=N)` under
    # torchrun, transformers >= 5.24): each rank keeps E / N routed experts whole (`hf_dllm_local_experts`, the style
    # hf_dllm/tensor_parallel.py registers) and transformers' `ep_dispatch_experts` sums their outputs over the ranks
    # (one all-reduce per MoE layer); attention, dense layers and the head stay whole on every rank. The
    # tensor-parallel plan splits only the experts' widths (the loop over the sharded experts); transformers needs one
    # to accept `tp_size`, and the expert-parallel rules replace it.
    base_model_tp_plan = {
        "layers.*.mlp.experts.*.gate_proj": "colwise",
        "layers.*.mlp.experts.*.up_proj": "colwise",
        "layers.*.mlp.experts.*.down_proj": "rowwise",
    }
    base_model_ep_plan = {
        "layers.*.mlp.experts": "hf_dllm_local_experts",
        "layers.*.mlp.expert_dispatch": "ep_dispatch_experts",
    }
    # transformers 5 turns `rope_scaling` into a deprecated alias of `rope_parameters`; the Hub's config stores the
    # field itself, so this plain class attribute shadows the alias and `rope_scaling` is an ordinary field again.
    rope_scaling = None

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        num_hidden_layers: int = 16,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        clip_qkv: float | None = None,
        qk_layernorm: bool | None = True,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 50000.0,
        rope_scaling: dict | None = None,
        partial_rotary_factor: float = 1.0,
        max_position_embeddings: int = 8192,
        num_experts: int = 64,
        num_experts_per_tok: int = 8,
        expert_intermediate_size: int = 1024,
        moe_layer_freq: list[int] | None = None,
        dense_intermediate_size: int | None = 8192,
        shared_expert_intermediate_size: int | None = None,
        norm_topk_prob: bool | None = False,
        moe_router_enable_expert_bias: bool | None = False,
        moe_router_score_function: str | None = "softmax",
        routed_scaling_factor: float | None = 1.0,
        router_num_group: int | None = None,
        router_topk_group: int | None = None,
        router_aux_loss_coef: float = 0.01,
        output_router_logits: bool = False,
        initializer_range: float = 0.02,
        use_cache: bool = False,
        tie_word_embeddings: bool = False,
        mask_token_id: int | None = HUB_MASK_TOKEN_ID,
        pad_token_id: int | None = HUB_EOS_TOKEN_ID,
        eos_token_id: int | list[int] | None = HUB_EOS_TOKEN_ID,
        bos_token_id: int | None = None,
        **kwargs,
    ):
        head_dim = kwargs.pop("head_dim", None)
        # Dense LLaDA's config.json says `model_type` "llada" too: read with this class it would silently take the
        # defaults for every size it names differently.
        dense_fields = sorted({"d_model", "n_layers", "n_heads", "mlp_hidden_size"} & kwargs.keys())
        if dense_fields:
            raise ValueError(
                f"{type(self).__name__}: {dense_fields} are fields of a dense LLaDA config (`LLaDAConfig`, also "
                "model_type 'llada'), not of LLaDA-MoE's: load that checkpoint with LLaDAConfig / LLaDAModelLM."
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.clip_qkv = clip_qkv
        self.qk_layernorm = qk_layernorm
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.partial_rotary_factor = partial_rotary_factor
        self.max_position_embeddings = max_position_embeddings
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.expert_intermediate_size = expert_intermediate_size
        if moe_layer_freq is None and _is_positive_int(num_hidden_layers):
            moe_layer_freq = [1] * num_hidden_layers
        self.moe_layer_freq = list(moe_layer_freq) if isinstance(moe_layer_freq, (list, tuple)) else moe_layer_freq
        self.dense_intermediate_size = dense_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        self.moe_router_score_function = moe_router_score_function
        self.routed_scaling_factor = routed_scaling_factor
        self.router_num_group = router_num_group
        self.router_topk_group = router_topk_group
        self.router_aux_loss_coef = router_aux_loss_coef
        self.output_router_logits = output_router_logits
        self.initializer_range = initializer_range
        # transformers 5 dropped `use_cache` from the base config; the Hub's config.json carries it, keep it.
        self.use_cache = use_cache
        if mask_token_id == HUB_MASK_TOKEN_ID and _is_positive_int(vocab_size) and vocab_size <= mask_token_id:
            mask_token_id = None  # the Hub's id, which a smaller vocabulary (a tiny test model) does not hold
        self.mask_token_id = mask_token_id
        if not isinstance(tie_word_embeddings, bool):
            raise ValueError(
                f"{type(self).__name__}.tie_word_embeddings must be a boolean, got {tie_word_embeddings!r}."
            )
        # Before the base class's own checks.
        self.validate_llada_moe(head_dim)
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def head_dim(self) -> int:
        """Per-head width: `hidden_size // num_attention_heads`, as the original code derives it (not saved)."""
        return self.hidden_size // self.num_attention_heads

    def rotary_embedding_dim(self) -> int:
        """RoPE's `dim`, `int(head_dim * partial_rotary_factor)`: the frequencies are `rope_theta ** (-arange(0, dim,
        2) / dim)`, as the original code (transformers' default RoPE) computes them."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rotary_width(self) -> int:
        """Dims of each head that RoPE rotates: two per frequency, `rotary_embedding_dim()` rounded up to even."""
        return 2 * -(-self.rotary_embedding_dim() // 2)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has routed experts (`moe_layer_freq[layer_idx] != 0`), else a dense MLP."""
        return self.moe_layer_freq[layer_idx] != 0

    def validate_llada_moe(self, head_dim: int | None = None) -> None:
        """Raise a `ValueError` naming the field and the allowed values for any config this code cannot run as the
        original code does. `head_dim`: a `head_dim` entry of the file, if any (not a Hub field)."""
        name = type(self).__name__
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            value = getattr(self, field)
            if not _is_positive_int(value):
                raise ValueError(f"{name}.{field} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{name}.num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                f"({self.hidden_size}): the head size is hidden_size // num_attention_heads."
            )
        if head_dim is not None and head_dim != self.head_dim:
            raise ValueError(
                f"{name}.head_dim ({head_dim!r}) must be hidden_size // num_attention_heads = {self.head_dim} (the "
                "original code derives it and has no head_dim field)."
            )
        kv = self.num_key_value_heads
        if not _is_positive_int(kv) or self.num_attention_heads % kv != 0:
            raise ValueError(
                f"{name}.num_key_value_heads must be a positive divisor of num_attention_heads "
                f"({self.num_attention_heads}), got {kv!r}."
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"{name}.hidden_act must be one of {sorted(ACT2FN)}, got {self.hidden_act!r}.")
        for field in ("attention_bias", "qk_layernorm", "norm_topk_prob"):
            value = getattr(self, field, None)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}.{field} must be a boolean, got {value!r}.")
        if not _is_number(self.rms_norm_eps) or self.rms_norm_eps < 0:
            raise ValueError(f"{name}.rms_norm_eps must be a number >= 0, got {self.rms_norm_eps!r}.")
        if self.attention_dropout is not None and (
            not _is_number(self.attention_dropout) or not 0 <= self.attention_dropout < 1
        ):
            raise ValueError(f"{name}.attention_dropout must be in [0, 1), got {self.attention_dropout!r}.")
        if self.clip_qkv is not None and (not _is_number(self.clip_qkv) or self.clip_qkv <= 0):
            raise ValueError(f"{name}.clip_qkv must be None or a number > 0, got {self.clip_qkv!r}.")
        self._validate_rope(name)
        if self.mask_token_id is not None and not (
            isinstance(self.mask_token_id, int) and not isinstance(self.mask_token_id, bool) and self.mask_token_id >= 0
        ):
            raise ValueError(f"{name}.mask_token_id must be None or an integer >= 0, got {self.mask_token_id!r}.")
        self._validate_layers(name)

    def _validate_rope(self, name: str) -> None:
        if not _is_number(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(f"{name}.rope_theta must be a number > 0, got {self.rope_theta!r}.")
        factor = self.partial_rotary_factor
        if not _is_number(factor) or not 0 < factor <= 1:
            raise ValueError(f"{name}.partial_rotary_factor must be in (0, 1], got {factor!r}.")
        if self.rotary_width() > self.head_dim:
            raise ValueError(
                f"{name}.partial_rotary_factor: int(head_dim * partial_rotary_factor) = int({self.head_dim} * "
                f"{factor}) = {self.rotary_embedding_dim()} frequencies' dims (rounded up to even: "
                f"{self.rotary_width()}) exceed the head size {self.head_dim}."
            )
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ValueError(f"{name}.rope_scaling must be None or a dict, got {scaling!r}.")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"{name}.rope_scaling type must be one of {ROPE_TYPES} (the RoPE variants implemented), got "
                f"{rope_type!r}."
            )
        if rope_type == "linear":
            scale = scaling.get("factor")
            if not _is_number(scale) or scale <= 0:
                raise ValueError(f"{name}.rope_scaling['factor'] must be a number > 0 for linear RoPE, got {scale!r}.")

    def _validate_layers(self, name: str) -> None:
        layers = self.num_hidden_layers
        freq = self.moe_layer_freq
        if (
            not isinstance(freq, list)
            or len(freq) != layers
            or not all(isinstance(v, int) and not isinstance(v, bool) and v in (0, 1) for v in freq)
        ):
            raise ValueError(
                f"{name}.moe_layer_freq must be a list of num_hidden_layers ({layers}) entries, each 0 (dense MLP) or "
                f"1 (MoE), got {freq!r}."
            )
        if 0 in freq and not _is_positive_int(self.dense_intermediate_size):
            raise ValueError(
                f"{name}.dense_intermediate_size must be a positive integer (the width of the dense layers, "
                f"moe_layer_freq has a 0), got {self.dense_intermediate_size!r}."
            )
        if 1 not in freq:
            return
        experts = self.num_experts
        if not _is_positive_int(experts):
            raise ValueError(f"{name}.num_experts must be a positive integer, got {experts!r}.")
        top_k = self.num_experts_per_tok
        if not _is_positive_int(top_k) or top_k > experts:
            raise ValueError(
                f"{name}.num_experts_per_tok must be an integer in [1, num_experts={experts}], got {top_k!r}."
            )
        if not _is_positive_int(self.expert_intermediate_size):
            raise ValueError(
                f"{name}.expert_intermediate_size must be a positive integer, got {self.expert_intermediate_size!r}."
            )
        shared = self.shared_expert_intermediate_size
        if shared is not None and not _is_positive_int(shared):
            raise ValueError(
                f"{name}.shared_expert_intermediate_size must be None (no shared expert) or a positive integer, "
                f"got {shared!r}."
            )
        bias = self.moe_router_enable_expert_bias
        if bias is not None and not isinstance(bias, bool):
            raise ValueError(f"{name}.moe_router_enable_expert_bias must be a boolean, got {bias!r}.")
        # Fields the original code never reads: only the values at which ignoring them changes nothing.
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"{name}.moe_router_score_function must be 'softmax' (or None): the original LLaDA-MoE code always "
                f"routes by softmax, got {self.moe_router_score_function!r}."
            )
        scaling = self.routed_scaling_factor
        if scaling is not None and (not _is_number(scaling) or scaling != 1):
            raise ValueError(
                f"{name}.routed_scaling_factor must be 1 (or None): the original LLaDA-MoE code never scales the "
                f"routing weights, got {scaling!r}."
            )
        for field in ("router_num_group", "router_topk_group"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value > 1):
                raise ValueError(
                    f"{name}.{field} must be None (or an integer <= 1): the original LLaDA-MoE code has no "
                    f"group-limited routing, got {value!r}."
                )
        if self.norm_topk_prob:
            logger.warning_once(
                f"{name}.norm_topk_prob is true, but LLaDA-MoE's original code hard-codes it off: the chosen experts' "
                "probabilities weight their outputs unnormalised, here as there."
            )


__all__ = ["LLaDAMoEConfig"]
