"""LLaDA2.x configuration (`model_type = "llada2_moe"`) that reads the Hub's `config.json` unchanged.

inclusionAI's LLaDA2.0-mini / -flash and LLaDA2.1 (arXiv:2512.15745) are block-diffusion MoE models on the Ling 2.0
(Bailing MoE V2) body. Their checkpoints ship the fields of the original `LLaDA2MoeConfig` plus a few the original
code stores without reading (`score_function`, `norm_topk_prob`, `router_dtype`, `rotary_dim`, ...). This class
keeps every one of them under its original name, so a config saved by it is the Hub's format again; the switches
that change the computation are validated here, and the ones the model cannot honour are rejected with an error
naming the field rather than silently ignored.

The one addition is `mask_token_id` (the Hub's `config.json` has none; the original `generate()` takes `mask_id`,
default 156895, the tokenizer's `<|mask|>`), so that the diffusion generation config finds it.

This file is exported verbatim as Hub remote code: it imports only transformers and the standard library.
"""

from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.utils import logging

logger = logging.get_logger(__name__)

# `router_dtype` values -> the torch dtype name the router runs in. `None` is float32, what the original code always
# uses (it computes the router in float32 whatever the field says).
ROUTER_DTYPES = {
    None: "float32",
    "fp32": "float32",
    "float32": "float32",
    "fp64": "float64",
    "float64": "float64",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
SCORE_FUNCTIONS = ("sigmoid", "softmax")
ROPE_TYPES = ("default", "linear")

# Switches of the Ling / Bailing config family that no LLaDA2.x checkpoint turns on and that the original LLaDA2
# code does not implement. Each must keep the value given here.
_FIXED_SWITCHES = {
    "use_rmsnorm": True,
    "norm_head": False,
    "norm_softmax": False,
    "use_sliding_window": False,
}


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class LLaDA2MoeConfig(PretrainedConfig):
    r"""
    Configuration of a LLaDA2.x masked block-diffusion MoE language model. Defaults are LLaDA2.0-mini's.

    Layers `0 .. first_k_dense_replace - 1` have a dense SiLU-gated MLP of width `intermediate_size`; the others a
    mixture of `num_experts` routed experts (width `moe_intermediate_size`, `num_experts_per_tok` chosen per token)
    plus `num_shared_experts` always-on experts (one MLP of width `moe_intermediate_size * num_shared_experts`, as
    the original code builds it; `moe_shared_expert_intermediate_size` is kept for round-tripping only).

    Args:
        vocab_size (`int`): rows of the embedding and of the output head.
        hidden_size (`int`): model width.
        intermediate_size (`int`, *optional*): width of the dense MLP layers (needed when there are dense layers).
        num_hidden_layers (`int`): number of decoder layers.
        num_attention_heads (`int`): query heads.
        num_key_value_heads (`int`, *optional*): key/value heads (grouped-query attention); `None` = query heads.
        head_dim (`int`, *optional*): per-head width; `None` = `hidden_size // num_attention_heads`.
        hidden_act (`str`): activation of the gated MLPs (a key of transformers' `ACT2FN`).
        use_qkv_bias (`bool`): bias in the fused `query_key_value` projection.
        use_bias (`bool`): bias in the attention output projection (`dense`).
        use_qk_norm (`bool`): per-head RMS norm of queries and keys before RoPE.
        rms_norm_eps (`float`): epsilon of every RMS norm.
        tie_word_embeddings (`bool`): the output head is the input embedding matrix (no `lm_head.weight`).
        embedding_dropout, output_dropout (`float`): kept for round-tripping; the original code never applies them.
        attention_dropout (`float`): dropout on attention weights, in training only.
        initializer_range (`float`): std of the normal init of new weights.
        max_position_embeddings (`int`): longest trained context (RoPE itself is not limited by it).
        rope_theta (`float`): RoPE base.
        rope_scaling (`dict`, *optional*): `None`, `{"rope_type": "default"}` or `{"rope_type": "linear", "factor": f}`.
        partial_rotary_factor (`float`): RoPE rotates the first `int(head_dim * partial_rotary_factor)` dims of
            each head (rotate-half style); the rest pass through.
        rotary_dim (`int`, *optional*): stored by the Hub configs; the rotary width is always derived from
            `partial_rotary_factor` as the original code does (a differing value is logged).
        num_experts (`int`, *optional*): routed experts per MoE layer; `None` makes every layer dense.
        num_shared_experts (`int`, *optional*): always-on experts (`None` or 0: none).
        num_experts_per_tok (`int`): experts chosen per token (top-k).
        n_group, topk_group (`int`): group-limited routing: the experts form `n_group` groups, a token's top-k is
            chosen within its `topk_group` best groups (a group's score is the sum of its two best experts).
        moe_intermediate_size (`int`): width of one routed expert.
        moe_shared_expert_intermediate_size (`int`, *optional*): kept for round-tripping (see above).
        first_k_dense_replace (`int`): number of leading dense layers.
        routed_scaling_factor (`float`): factor on the routing weights.
        score_function (`str`): `"sigmoid"` (LLaDA2.x) or `"softmax"` router scores.
        norm_topk_prob (`bool`): normalise the chosen experts' scores to sum to one (with top-k > 1).
        moe_router_enable_expert_bias (`bool`): the router has an `expert_bias` (a load-balancing bias added to
            the scores for choosing experts only, not for weighting them).
        router_dtype (`str`, *optional*): dtype the router runs in (`"fp32"`; `None` = float32).
        output_router_logits (`bool`): return every MoE layer's router logits.
        block_size, expert_capacity (`int`, *optional*): LLaDA2.2's block routing (its config.json: 32 and 48): per
            block of `block_size` positions (absolute positions, in multiples of `block_size`), only the
            `expert_capacity` experts with the highest block-max choice score may be chosen, then each token takes
            its top-k among them (`llada2_moe_layer.block_limited_topk`). Both set or neither; None (LLaDA2.0 /
            2.1): plain group-limited routing.
        use_rmsnorm, norm_head, norm_softmax, use_sliding_window (`bool`): Ling switches LLaDA2.x keeps at
            `True`, `False`, `False`, `False`; other values are rejected. `sliding_window` and `max_window_layers`
            are kept for round-tripping.
        mask_token_id (`int`): id of the mask token (156895, `<|mask|>` of the LLaDA2 tokenizer).
        delete_token_id, split_token_id (`int`, *optional*): LLaDA2.2's edit tokens (156930 / 156931 on the Hub):
            a checkpoint that has them decodes with LLaDA2.2's Levenshtein editing (`levenshtein_editing.py`), where
            writing DELETE removes a block position and SPLIT inserts a mask before it. None (LLaDA2.0 / 2.1): none.
        pad_token_id, eos_token_id, bos_token_id (`int`): special token ids.
    """

    model_type = "llada2_moe"
    # The outputs' cache, which `Trainer` leaves out of evaluation logits: `cache` since transformers 5.2x,
    # `past_key_values` before.
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # Tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun). The fused `query_key_value`
    # (rows: all query heads, then keys, then values) is replicated and each rank multiplies only the rows of its
    # own query heads and of the key/value heads they read (grouped-query aware, also when there are fewer key/value
    # heads than ranks; `LLaDA2MoeAttention.local_projection`): an even row split would cut across the q/k/v
    # boundaries, and gathering its output would cost a collective per layer. `dense` takes those heads' columns
    # (partial sums all-reduced). Every MLP (the
    # dense layers', each routed expert, the shared experts) is split along its intermediate width: gate/up by rows,
    # down by columns; the routed experts' partial outputs (with the shared expert's where the fused path runs it
    # with them) are summed across ranks once per MoE layer. The router, norms and embedding are replicated; the
    # output head is split by vocabulary rows with the logits gathered (see `LLaDA2MoeModelLM._tp_plan`). The layers
    # read their per-rank head counts from the weights' shapes.
    base_model_tp_plan = {
        "layers.*.attention.dense": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.experts.*.gate_proj": "colwise",
        "layers.*.mlp.experts.*.up_proj": "colwise",
        "layers.*.mlp.experts.*.down_proj": "rowwise",
    }
    # Expert parallelism (`distributed_config=DistributedConfig(tp_size=N, ep_size=N)` under torchrun, transformers
    # >= 5.24): each rank keeps E / N routed experts whole (`tensor_parallel.EXPERTS_STYLE`, the name
    # hf_dllm/tensor_parallel.py registers) and transformers' `ep_dispatch_experts` sums their outputs over the ranks
    # (one all-reduce per MoE layer); these rules replace the experts' tensor-parallel ones, the rest of
    # `base_model_tp_plan` still applies.
    base_model_ep_plan = {
        "layers.*.mlp.experts": "hf_dllm_local_experts",
        "layers.*.mlp.expert_dispatch": "ep_dispatch_experts",
    }
    # No `base_model_pp_plan`: transformers' pipeline stages replace the layers a stage does not own by an identity
    # that returns the hidden states alone, and LLaDA2's decoder layers return `(hidden_states, router_logits)`.
    # transformers 5 turns `rope_scaling` into a deprecated alias of `rope_parameters`; LLaDA2's configs store the
    # field itself, so this plain class attribute shadows the alias and `rope_scaling` is an ordinary field again.
    rope_scaling = None

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        intermediate_size: int | None = 5120,
        num_hidden_layers: int = 20,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = 4,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        use_qkv_bias: bool = False,
        use_bias: bool = False,
        use_qk_norm: bool = True,
        rms_norm_eps: float = 1e-6,
        tie_word_embeddings: bool = False,
        embedding_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        output_dropout: float = 0.0,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 32768,
        rope_theta: float = 600000.0,
        rope_scaling: dict | None = None,
        partial_rotary_factor: float = 0.5,
        rotary_dim: int | None = None,
        num_experts: int | None = 256,
        num_shared_experts: int | None = 1,
        num_experts_per_tok: int = 8,
        n_group: int = 8,
        topk_group: int = 4,
        moe_intermediate_size: int | None = 512,
        moe_shared_expert_intermediate_size: int | None = None,
        first_k_dense_replace: int = 1,
        routed_scaling_factor: float = 2.5,
        score_function: str = "sigmoid",
        norm_topk_prob: bool = True,
        moe_router_enable_expert_bias: bool = True,
        router_dtype: str | None = "fp32",
        output_router_logits: bool = False,
        block_size: int | None = None,
        expert_capacity: int | None = None,
        use_rmsnorm: bool = True,
        norm_head: bool = False,
        norm_softmax: bool = False,
        use_sliding_window: bool = False,
        sliding_window: int | None = 4096,
        max_window_layers: int | None = 28,
        use_cache: bool = False,
        mask_token_id: int | None = 156895,
        delete_token_id: int | None = None,
        split_token_id: int | None = None,
        pad_token_id: int | None = 156892,
        eos_token_id: int | list[int] | None = 156892,
        bos_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        # As the original config: a missing head_dim is derived (and then saved).
        if head_dim is None and _is_positive_int(hidden_size) and _is_positive_int(num_attention_heads):
            head_dim = hidden_size // num_attention_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.use_qkv_bias = use_qkv_bias
        self.use_bias = use_bias
        self.use_qk_norm = use_qk_norm
        self.rms_norm_eps = rms_norm_eps
        self.embedding_dropout = embedding_dropout
        self.attention_dropout = attention_dropout
        self.output_dropout = output_dropout
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.partial_rotary_factor = partial_rotary_factor
        self.rotary_dim = rotary_dim
        self.num_experts = num_experts
        self.num_shared_experts = num_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_group = n_group
        self.topk_group = topk_group
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_shared_expert_intermediate_size = moe_shared_expert_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.routed_scaling_factor = routed_scaling_factor
        self.score_function = score_function
        self.norm_topk_prob = norm_topk_prob
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        self.router_dtype = router_dtype
        self.output_router_logits = output_router_logits
        self.block_size = block_size
        self.expert_capacity = expert_capacity
        self.use_rmsnorm = use_rmsnorm
        self.norm_head = norm_head
        self.norm_softmax = norm_softmax
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = max_window_layers
        # transformers 5 dropped `use_cache` from the base config; the Hub's config.json carries it, keep it.
        self.use_cache = use_cache
        self.mask_token_id = mask_token_id
        self.delete_token_id = delete_token_id
        self.split_token_id = split_token_id
        # Before the base class's own checks, which read sizes such as `head_dim`.
        self.validate_llada2()
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def rotary_embedding_dim(self) -> int:
        """Dims of each head that RoPE rotates: `int(head_dim * partial_rotary_factor)`, as the original code."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has routed experts (else a dense MLP)."""
        return self.num_experts is not None and layer_idx >= self.first_k_dense_replace

    def validate_llada2(self) -> None:
        """Raise a `ValueError` naming the field and the allowed values for any config this code cannot run."""
        name = type(self).__name__
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            value = getattr(self, field)
            if not _is_positive_int(value):
                raise ValueError(f"{name}.{field} must be a positive integer, got {value!r}.")
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
        if not _is_number(self.partial_rotary_factor) or not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"{name}.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}.")
        rotary = self.rotary_embedding_dim()
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"{name}.partial_rotary_factor: int(head_dim * partial_rotary_factor) = int({self.head_dim} * "
                f"{self.partial_rotary_factor}) = {rotary} must be an even number >= 2 (the dims RoPE rotates)."
            )
        if self.rotary_dim is not None and self.rotary_dim != rotary:
            logger.warning(
                f"{name}.rotary_dim ({self.rotary_dim}) differs from int(head_dim * partial_rotary_factor) = "
                f"{rotary}; RoPE rotates {rotary} dims per head, as the original LLaDA2 code does."
            )
        self._validate_rope_scaling(name)
        if self.attention_dropout is not None and (
            not _is_number(self.attention_dropout) or not 0 <= self.attention_dropout < 1
        ):
            raise ValueError(f"{name}.attention_dropout must be in [0, 1), got {self.attention_dropout!r}.")
        for field, required in _FIXED_SWITCHES.items():
            if bool(getattr(self, field)) != required:
                raise ValueError(
                    f"{name}.{field}={getattr(self, field)!r} is not supported by LLaDA2 models; it must be {required}."
                )
        if self.mask_token_id is not None and (
            not isinstance(self.mask_token_id, int) or isinstance(self.mask_token_id, bool) or self.mask_token_id < 0
        ):
            raise ValueError(f"{name}.mask_token_id must be None or an integer >= 0, got {self.mask_token_id!r}.")
        self._validate_edit_tokens(name)

        layers = self.num_hidden_layers
        first_dense = self.first_k_dense_replace
        if not isinstance(first_dense, int) or isinstance(first_dense, bool) or not 0 <= first_dense <= layers:
            raise ValueError(
                f"{name}.first_k_dense_replace must be an integer in [0, num_hidden_layers={layers}], "
                f"got {first_dense!r}."
            )
        if self.num_experts is None or first_dense > 0:
            if not _is_positive_int(self.intermediate_size):
                raise ValueError(
                    f"{name}.intermediate_size must be a positive integer (the width of the dense MLP layers), "
                    f"got {self.intermediate_size!r}."
                )
        if self.num_experts is not None:
            self._validate_moe(name)
        self._validate_block_routing(name)

    def _validate_edit_tokens(self, name: str) -> None:
        """LLaDA2.2's `delete_token_id` / `split_token_id`: None, or ids in [0, vocab_size) distinct from each other
        and from `mask_token_id`."""
        seen = {"mask_token_id": self.mask_token_id}
        for field in ("delete_token_id", "split_token_id"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"{name}.{field} must be None or an integer in [0, vocab_size={self.vocab_size}), got {value!r}."
                )
            for other, other_value in seen.items():
                if other_value == value:
                    raise ValueError(f"{name}.{field} ({value}) must differ from {other} ({other_value}).")
            seen[field] = value
        if (self.delete_token_id is None) != (self.split_token_id is None):
            missing = "split_token_id" if self.split_token_id is None else "delete_token_id"
            raise ValueError(f"{name}.{missing} must be set too: LLaDA2.2's editing needs both edit tokens.")

    def uses_block_routing(self) -> bool:
        """Whether the MoE layers route by blocks (LLaDA2.2: `block_size` and `expert_capacity` set)."""
        return self.block_size is not None and self.expert_capacity is not None

    def _validate_block_routing(self, name: str) -> None:
        """LLaDA2.2's `block_size` / `expert_capacity`: both None, or both positive integers with `expert_capacity`
        in [num_experts_per_tok, num_experts]."""
        size, capacity = self.block_size, self.expert_capacity
        for field, value in (("block_size", size), ("expert_capacity", capacity)):
            if value is not None and not _is_positive_int(value):
                raise ValueError(f"{name}.{field} must be None or a positive integer, got {value!r}.")
        if (size is None) != (capacity is None):
            missing = "expert_capacity" if capacity is None else "block_size"
            raise ValueError(
                f"{name}.{missing} must be set too: block routing needs both block_size and expert_capacity "
                f"(got block_size={size!r}, expert_capacity={capacity!r})."
            )
        if capacity is None:
            return
        if self.num_experts is None:
            raise ValueError(
                f"{name}.expert_capacity ({capacity}) needs routed experts, but num_experts is None (a dense model)."
            )
        if not self.num_experts_per_tok <= capacity <= self.num_experts:
            raise ValueError(
                f"{name}.expert_capacity must be an integer in [num_experts_per_tok={self.num_experts_per_tok}, "
                f"num_experts={self.num_experts}], got {capacity!r}."
            )

    def _validate_rope_scaling(self, name: str) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ValueError(f"{name}.rope_scaling must be None or a dict, got {scaling!r}.")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{name}.rope_scaling type must be one of {ROPE_TYPES}, got {rope_type!r}.")
        if rope_type == "linear":
            factor = scaling.get("factor")
            if not _is_number(factor) or factor <= 0:
                raise ValueError(f"{name}.rope_scaling['factor'] must be a number > 0 for linear RoPE, got {factor!r}.")

    def _validate_moe(self, name: str) -> None:
        experts = self.num_experts
        if not _is_positive_int(experts):
            raise ValueError(f"{name}.num_experts must be None or a positive integer, got {experts!r}.")
        top_k = self.num_experts_per_tok
        if not _is_positive_int(top_k) or top_k > experts:
            raise ValueError(
                f"{name}.num_experts_per_tok must be an integer in [1, num_experts={experts}], got {top_k!r}."
            )
        groups = self.n_group
        if not _is_positive_int(groups) or experts % groups != 0:
            raise ValueError(f"{name}.n_group must be a positive divisor of num_experts ({experts}), got {groups!r}.")
        if not _is_positive_int(self.topk_group) or self.topk_group > groups:
            raise ValueError(f"{name}.topk_group must be an integer in [1, n_group={groups}], got {self.topk_group!r}.")
        selectable = self.topk_group * (experts // groups)
        if top_k > selectable:
            raise ValueError(
                f"{name}.num_experts_per_tok ({top_k}) must be <= topk_group * num_experts / n_group = {selectable} "
                "(the experts of the groups a token may use)."
            )
        if not _is_positive_int(self.moe_intermediate_size):
            raise ValueError(
                f"{name}.moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size!r}."
            )
        shared = self.num_shared_experts
        if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool) or shared < 0):
            raise ValueError(f"{name}.num_shared_experts must be None or an integer >= 0, got {shared!r}.")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"{name}.score_function must be one of {SCORE_FUNCTIONS}, got {self.score_function!r}.")
        if not _is_number(self.routed_scaling_factor) or self.routed_scaling_factor <= 0:
            raise ValueError(f"{name}.routed_scaling_factor must be a number > 0, got {self.routed_scaling_factor!r}.")
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"{name}.router_dtype must be one of {sorted(k for k in ROUTER_DTYPES if k)} or None, "
                f"got {self.router_dtype!r}."
            )


__all__ = ["LLaDA2MoeConfig"]
