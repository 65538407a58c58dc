"""DiffusionGemma configuration (`model_type = "diffusion_gemma"`) that reads the Hub's `config.json` unchanged.

Google's DiffusionGemma (`google/diffusiongemma-26B-A4B-it`) is a block-diffusion Gemma 4 MoE: a causal encoder
writes the prompt and each accepted canvas into a K/V cache, and a bidirectional decoder (the same text transformer,
weights shared) denoises the next canvas of `canvas_length` tokens. Its `config.json` nests the text transformer's
fields under `text_config` (`model_type` "diffusion_gemma_text") and a Gemma 4 vision tower's under
`vision_config`; both are kept under their original names so that a config saved by these classes is the Hub's
format again. The vision tower is not run by hf_dllm (image inputs are refused): its config is kept as a dict.

This file is exported verbatim as Hub remote code: it imports only transformers and the standard library.
"""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_ROPE_PARAMETERS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


class DiffusionGemmaTextConfig(PretrainedConfig):
    r"""
    The text transformer shared by DiffusionGemma's encoder and decoder (defaults: transformers'
    `DiffusionGemmaTextConfig`).

    Args:
        vocab_size, hidden_size (`int`): embedding rows and model width (the LM head is the embedding).
        intermediate_size (`int`): width of the dense gated-GELU MLP every layer runs beside its experts (and of
            the decoder's self-conditioning MLP).
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (`int`): layers and heads of the
            sliding-window layers; `per_layer_config` overrides `head_dim` / `num_key_value_heads` per layer
            (`{"5": {"head_dim": 512, "num_key_value_heads": 2}}`: the full-attention layers').
        layer_types (`list[str]`): `"sliding_attention"` or `"full_attention"` per layer (the last must be full).
        sliding_window (`int`): keys a sliding layer's encoder query sees (itself included).
        rope_parameters (`dict`): per layer type, `rope_type` ("default" or "proportional"), `rope_theta`,
            `partial_rotary_factor`.
        num_experts, top_k_experts, moe_intermediate_size (`int`): the MoE of every layer.
        hidden_activation (`str`): `gelu_pytorch_tanh`.
        rms_norm_eps (`float`), max_position_embeddings (`int`), use_bidirectional_attention (`str`, "vision" or
            None; "all" is refused: the encoder is causal over text), attention_bias (must be False).
        pad_token_id, eos_token_id, bos_token_id (`int`): special tokens (generation does not read the EOS here).
    """

    model_type = "diffusion_gemma_text"
    # Logits are soft-capped at 30 (`30 * tanh(l / 30)`), a class attribute as in transformers (not in config.json).
    final_logit_softcapping = 30.0
    # Tensor / expert parallelism (`from_pretrained(..., tp_plan="auto")`), transformers' plans for this model.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.experts.gate_up_proj": "packed_colwise",
        "layers.*.experts.down_proj": "rowwise",
        "layers.*.experts": "moe_tp_experts",
    }
    base_model_ep_plan = {
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.experts.gate_up_proj": "grouped_gemm",
        "layers.*.experts.down_proj": "grouped_gemm",
        "layers.*.experts": "ep_dispatch_experts",
    }

    def __init__(
        self,
        vocab_size: int = 262_144,
        hidden_size: int = 2304,
        intermediate_size: int = 9216,
        num_hidden_layers: int = 30,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 4,
        head_dim: int = 256,
        hidden_activation: str = "gelu_pytorch_tanh",
        max_position_embeddings: int = 131_072,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        pad_token_id: int | None = 0,
        eos_token_id=1,
        bos_token_id: int | None = 2,
        tie_word_embeddings: bool = True,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        sliding_window: int = 512,
        layer_types: list | None = None,
        use_bidirectional_attention: str | None = None,
        num_experts: int | None = None,
        top_k_experts: int | None = None,
        moe_intermediate_size: int | None = None,
        per_layer_config: dict | None = None,
        global_head_dim: int = 512,
        num_global_key_value_heads: int | None = None,
        **kwargs,
    ):
        if use_bidirectional_attention not in (None, "vision"):
            raise ValueError(
                f"`use_bidirectional_attention` must be None or 'vision' (the encoder is causal over text), got "
                f"{use_bidirectional_attention!r}."
            )
        if attention_bias:
            raise ValueError("`attention_bias` must be False: DiffusionGemma's projections have no bias.")
        if layer_types is None:
            layer_types = [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_hidden_layers)
            ]
        layer_types = list(layer_types)
        bad = sorted(set(layer_types) - set(LAYER_TYPES))
        if bad or len(layer_types) != num_hidden_layers:
            raise ValueError(
                f"`layer_types` must hold {num_hidden_layers} entries among {LAYER_TYPES}, got {layer_types}."
            )
        if layer_types[-1] != "full_attention":
            logger.warning("The last layer must use full attention: forcing layer_types[-1] = 'full_attention'.")
            layer_types[-1] = "full_attention"
        if per_layer_config is None:
            overrides = {"head_dim": global_head_dim}
            if num_global_key_value_heads is not None:
                overrides["num_key_value_heads"] = num_global_key_value_heads
            per_layer_config = {
                str(i): dict(overrides) for i, kind in enumerate(layer_types) if kind == "full_attention"
            }
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_activation = hidden_activation
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = rope_parameters if rope_parameters is not None else dict(DEFAULT_ROPE_PARAMETERS)
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.sliding_window = sliding_window
        self.layer_types = layer_types
        self.use_bidirectional_attention = use_bidirectional_attention
        self.num_experts = num_experts
        self.top_k_experts = top_k_experts
        self.moe_intermediate_size = moe_intermediate_size
        # Not stored as `per_layer_config`: newer transformers give that attribute a meaning of their own
        # (heterogeneous layers); `to_dict` writes it back under the Hub's name.
        self.layer_overrides = {str(key): dict(value) for key, value in per_layer_config.items()}
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def convert_rope_params_to_dict(self, **kwargs):
        """`rope_parameters` is already per layer type: legacy `rope_scaling` / `rope_theta` entries are dropped, not
        merged into it (some transformers 5 releases add a top-level `rope_theta` to any dict, which their own
        validation then reads as a layer type)."""
        kwargs.pop("rope_scaling", None)
        kwargs.pop("rope_theta", None)
        return kwargs

    def layer_attention(self, layer: int) -> tuple[int, int]:
        """`(head_dim, num_key_value_heads)` of layer `layer` (`per_layer_config` over the global fields)."""
        override = self.layer_overrides.get(str(layer), {})
        return override.get("head_dim", self.head_dim), override.get("num_key_value_heads", self.num_key_value_heads)

    def to_dict(self) -> dict:
        output = super().to_dict()
        output["per_layer_config"] = output.pop("layer_overrides")
        return output


class DiffusionGemmaConfig(PretrainedConfig):
    r"""
    DiffusionGemma: `text_config` (a `DiffusionGemmaTextConfig`), `vision_config` (the Gemma 4 vision tower's
    fields, kept as a dict: hf_dllm does not run images), `canvas_length` (tokens per canvas, i.e. block), the image
    token ids (`boi_token_id`, `eoi_token_id`, `image_token_id`) and `tie_word_embeddings` (the LM head is the
    embedding; encoder and decoder share the text transformer).
    """

    model_type = "diffusion_gemma"
    sub_configs = {"text_config": DiffusionGemmaTextConfig}
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        text_config=None,
        vision_config=None,
        boi_token_id: int | None = 255_999,
        eoi_token_id: int | None = 258_882,
        image_token_id: int | None = 258_880,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        canvas_length: int = 256,
        **kwargs,
    ):
        if text_config is None:
            text_config = DiffusionGemmaTextConfig()
        elif isinstance(text_config, dict):
            text_config = DiffusionGemmaTextConfig(**{k: v for k, v in text_config.items() if k != "model_type"})
        elif not isinstance(text_config, DiffusionGemmaTextConfig):
            text_config = DiffusionGemmaTextConfig(**text_config.to_dict())
        if vision_config is not None and not isinstance(vision_config, dict):
            vision_config = vision_config.to_dict()
        if not isinstance(canvas_length, int) or isinstance(canvas_length, bool) or canvas_length <= 0:
            raise ValueError(f"`canvas_length` must be a positive integer, got {canvas_length!r}.")
        self.text_config = text_config
        self.vision_config = vision_config
        self.boi_token_id = boi_token_id
        self.eoi_token_id = eoi_token_id
        self.image_token_id = image_token_id
        self.initializer_range = initializer_range
        self.canvas_length = canvas_length
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def get_text_config(self, *args, **kwargs):
        return self.text_config

    @property
    def max_position_embeddings(self) -> int:
        """The text transformer's context (what `DiffusionFamily.context_length` reads)."""
        return self.text_config.max_position_embeddings


__all__ = ["DiffusionGemmaConfig", "DiffusionGemmaTextConfig"]
