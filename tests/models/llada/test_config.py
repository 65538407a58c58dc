"""Packaging/registration and `LLaDAConfig`: Hub config fields kept, standard names, validation, family variants."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

import hf_dllm
from hf_dllm import LLaDAConfig, LLaDAModelLM
from tests.conftest import REFERENCE_DIR, tiny_config, tiny_model

REFERENCE_CONFIG = json.loads((REFERENCE_DIR / "config.json").read_text())
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
NORM_NAMES = ("attn_norm", "ff_norm")


# ----------------------------------------------------------------------------------------------------------------
# Packaging / registration
# ----------------------------------------------------------------------------------------------------------------


def test_import_registers_llada_with_the_auto_classes():
    # "llada" is dense LLaDA's and LLaDA-MoE's model_type: AutoConfig's entry builds the class of the family a
    # config describes (by architectures / auto_map / fields), LLaDA's by default.
    assert issubclass(CONFIG_MAPPING["llada"], LLaDAConfig)
    assert type(AutoConfig.for_model("llada")) is LLaDAConfig
    assert type(CONFIG_MAPPING["llada"].from_dict(REFERENCE_CONFIG)) is LLaDAConfig
    moe = json.loads((REFERENCE_DIR.parent / "lladamoe-tiny-ref" / "config.json").read_text())
    assert type(CONFIG_MAPPING["llada"].from_dict(moe)) is hf_dllm.LLaDAMoEConfig
    assert MODEL_MAPPING[hf_dllm.LLaDAMoEConfig] is hf_dllm.LLaDAMoEModelLM
    assert MODEL_MAPPING[LLaDAConfig] is LLaDAModelLM
    assert MODEL_FOR_CAUSAL_LM_MAPPING[LLaDAConfig] is LLaDAModelLM
    assert hf_dllm.LLaDAConfig is LLaDAConfig


@pytest.mark.parametrize("auto_class", [AutoModel, AutoModelForCausalLM])
def test_auto_from_pretrained_without_remote_code(auto_class):
    # config.json carries an auto_map to configuration_llada.py / modeling_llada.py, which do not exist locally.
    assert "auto_map" in REFERENCE_CONFIG
    assert not (REFERENCE_DIR / "modeling_llada.py").exists()
    config = AutoConfig.from_pretrained(REFERENCE_DIR, trust_remote_code=False)
    assert isinstance(config, LLaDAConfig)
    model = auto_class.from_pretrained(REFERENCE_DIR, trust_remote_code=False)
    assert type(model) is LLaDAModelLM
    weights = load_file(REFERENCE_DIR / "model.safetensors")
    state = model.state_dict()
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)


def test_importing_the_package_registers_the_auto_classes():
    """Executing `hf_dllm/__init__.py` is what registers LLaDA: unregister, re-import, and the mappings are back."""
    extra = (CONFIG_MAPPING._extra_content, MODEL_MAPPING._extra_content, MODEL_FOR_CAUSAL_LM_MAPPING._extra_content)
    saved = [dict(mapping) for mapping in extra]
    try:
        CONFIG_MAPPING._extra_content.pop("llada")
        MODEL_MAPPING._extra_content.pop(LLaDAConfig)
        MODEL_FOR_CAUSAL_LM_MAPPING._extra_content.pop(LLaDAConfig)
        assert "llada" not in CONFIG_MAPPING
        importlib.reload(hf_dllm)
        assert type(CONFIG_MAPPING["llada"].from_dict(REFERENCE_CONFIG)) is LLaDAConfig
        assert MODEL_MAPPING[LLaDAConfig] is LLaDAModelLM
        assert MODEL_FOR_CAUSAL_LM_MAPPING[LLaDAConfig] is LLaDAModelLM
    finally:
        for mapping, content in zip(extra, saved, strict=True):
            mapping.update(content)


@pytest.mark.slow
def test_registration_happens_on_import_in_a_fresh_interpreter():
    """Before `import hf_dllm` transformers does not know LLaDA; after it, the Auto classes load the fixture
    offline and without trust_remote_code."""
    script = textwrap.dedent(
        f"""
        from transformers import AutoModel
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        assert "llada" not in CONFIG_MAPPING
        import hf_dllm
        model = AutoModel.from_pretrained({str(REFERENCE_DIR)!r})
        assert type(model).__name__ == "LLaDAModelLM", type(model)
        print("OK", type(model.generation_config).__name__)
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK DiffusionGenerationConfig" in result.stdout


# ----------------------------------------------------------------------------------------------------------------
# Reading / writing the Hub config
# ----------------------------------------------------------------------------------------------------------------


def test_reference_config_fields_are_read_unchanged():
    config = LLaDAConfig.from_pretrained(REFERENCE_DIR)
    for key, value in REFERENCE_CONFIG.items():
        if key in ("transformers_version", "auto_map", "architectures", "model_type"):
            continue
        assert getattr(config, key) == value, key


def test_config_round_trip_keeps_every_original_key_and_value(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    original = dict(REFERENCE_CONFIG, some_future_field=[1, 2])  # unknown fields survive too
    (source / "config.json").write_text(json.dumps(original))
    config = AutoConfig.from_pretrained(source)
    assert isinstance(config, LLaDAConfig)
    config.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    for key, value in original.items():
        if key == "transformers_version":
            continue
        assert key in saved, f"{key} was dropped on save"
        assert saved[key] == value, f"{key}: saved {saved[key]!r}, original {value!r}"
    # Loading the saved config again gives the same config.
    again = LLaDAConfig.from_pretrained(tmp_path / "saved").to_dict()
    first = config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        again.pop(key, None)
        first.pop(key, None)
    assert again == first


def test_standard_transformers_names():
    config = LLaDAConfig.from_pretrained(REFERENCE_DIR)
    assert config.hidden_size == config.d_model == 64
    assert config.num_attention_heads == config.n_heads == 4
    assert config.num_key_value_heads == config.n_kv_heads == 4
    assert config.num_hidden_layers == config.n_layers == 2
    assert config.intermediate_size == config.mlp_hidden_size == 192
    assert config.head_dim == 64 // 4

    gqa = tiny_config(n_kv_heads=1)
    assert gqa.num_key_value_heads == 1
    assert tiny_config(n_kv_heads=None).num_key_value_heads == 4  # None = n_heads
    assert tiny_config(multi_query_attention=True, n_kv_heads=None).num_key_value_heads == 1
    assert tiny_config(mlp_hidden_size=None, mlp_ratio=3).intermediate_size == 3 * 64
    # The standard names can be used to build a config too (attribute_map).
    config = LLaDAConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_hidden_layers=3,
        vocab_size=50,
        embedding_size=64,
        mask_token_id=7,
        eos_token_id=0,
        pad_token_id=0,
    )
    assert (config.d_model, config.n_heads, config.n_layers) == (32, 2, 3)


# ----------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------

INVALID_CONFIGS = [
    ("d_model", dict(d_model=66, n_heads=4)),
    ("n_kv_heads", dict(n_heads=4, n_kv_heads=3)),
    ("n_kv_heads", dict(n_heads=4, n_kv_heads=0)),
    ("n_kv_heads", dict(n_heads=4, n_kv_heads=-2)),
    ("embedding_size", dict(vocab_size=103, embedding_size=100)),
    ("block_type", dict(block_type="sequential")),
    ("layer_norm_type", dict(layer_norm_type="default")),
    ("activation_type", dict(activation_type="tanh")),
    ("alibi", dict(alibi=True)),
    ("mask_token_id", dict(mask_token_id=103)),
    ("mask_token_id", dict(mask_token_id=-1)),
    ("d_model", dict(d_model=0)),
    ("n_heads", dict(n_heads=0)),
    ("n_layers", dict(n_layers=0)),
    ("n_layers", dict(n_layers=-1)),
    ("vocab_size", dict(vocab_size=0)),
    ("max_sequence_length", dict(max_sequence_length=0)),
    ("mlp_hidden_size", dict(mlp_hidden_size=0)),
    ("mlp_hidden_size", dict(mlp_hidden_size=-8)),
]


@pytest.mark.parametrize(
    "field, overrides", INVALID_CONFIGS, ids=[f"{f}={list(o.values())}" for f, o in INVALID_CONFIGS]
)
def test_invalid_config_raises_naming_the_field(field, overrides):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        tiny_config(**overrides)


def test_mask_token_id_may_use_the_padded_embedding_rows():
    config = tiny_config(vocab_size=100, embedding_size=128, mask_token_id=120)
    assert config.padded_vocab_size == 128


# ----------------------------------------------------------------------------------------------------------------
# Family variants
# ----------------------------------------------------------------------------------------------------------------

VARIANTS = {
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mha": dict(n_heads=4, n_kv_heads=4),
    "mqa": dict(n_heads=4, n_kv_heads=None, multi_query_attention=True),
    "tied": dict(weight_tying=True),
    "illada": dict(mask_token_id=5, max_sequence_length=8192),
    "bias": dict(include_bias=True),
    "qkv_bias": dict(include_qkv_bias=True),
    "padded_vocab": dict(vocab_size=100, embedding_size=128),
    "scaled": dict(input_emb_norm=True, scale_logits=True, activation_type="gelu"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_builds_and_runs_a_forward(name):
    model = tiny_model(**VARIANTS[name])
    config = model.config
    ids = torch.randint(4, 100, (2, 10))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 10, config.padded_vocab_size)
    assert torch.isfinite(logits).all()
    block = model.model.transformer.blocks[0]
    kv_dim = config.num_key_value_heads * config.head_dim
    assert block.k_proj.weight.shape == (kv_dim, config.d_model)
    assert block.v_proj.weight.shape == (kv_dim, config.d_model)
    assert model.generation_config.mask_token_id == config.mask_token_id


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_query_attention_equals_repeated_kv_heads(kv_heads):
    """A GQA model computes what a full multi-head model computes with each K/V head repeated for its group."""
    gqa = tiny_model(n_heads=4, n_kv_heads=kv_heads)
    mha = tiny_model(seed=1, n_heads=4, n_kv_heads=4)
    group = 4 // kv_heads
    head_dim = gqa.config.head_dim
    state = {}
    for name, tensor in gqa.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensor = tensor.view(kv_heads, head_dim, -1).repeat_interleave(group, dim=0).reshape(4 * head_dim, -1)
        state[name] = tensor
    mha.load_state_dict(state)
    ids = torch.randint(4, 100, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids).logits, mha(ids).logits, atol=1e-5, rtol=1e-5)


def test_weight_tying_uses_the_embedding_as_head():
    model = tiny_model(weight_tying=True)
    assert "ff_out" not in model.model.transformer
    assert not any(name == "model.transformer.ff_out.weight" for name, _ in model.named_parameters())
    assert model.get_output_embeddings() is None
    ids = torch.randint(4, 100, (1, 7))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    expected = torch.nn.functional.linear(out.hidden_states[-1], model.model.transformer.wte.weight)
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=1e-5)


def test_scale_logits_and_input_emb_norm():
    plain = tiny_model()
    scaled = tiny_model(scale_logits=True)
    ids = torch.randint(4, 100, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(scaled(ids).logits, plain(ids).logits * 64**-0.5, atol=1e-6, rtol=1e-5)
        normed = tiny_model(input_emb_norm=True)
        embeds = plain.get_input_embeddings()(ids) * 64**0.5
        torch.testing.assert_close(normed(ids).logits, plain(inputs_embeds=embeds).logits, atol=1e-5, rtol=1e-5)


def _bias_names(model) -> set[str]:
    return {name for name, _ in model.named_parameters() if name.endswith(".bias")}


def test_include_qkv_bias_creates_only_qkv_biases():
    model = tiny_model(include_qkv_bias=True)
    expected = {f"model.transformer.blocks.{i}.{p}.bias" for i in range(2) for p in ("q_proj", "k_proj", "v_proj")}
    assert _bias_names(model) == expected


def test_include_bias_creates_biases_on_every_linear_layer():
    model = tiny_model(include_bias=True)
    expected = {f"model.transformer.blocks.{i}.{p}.bias" for i in range(2) for p in LINEAR_NAMES}
    expected.add("model.transformer.ff_out.bias")
    assert _bias_names(model) == expected
    assert not _bias_names(tiny_model())


def _hub_names(n_layers: int, bias: bool, tied: bool) -> set[str]:
    names = {"model.transformer.wte.weight", "model.transformer.ln_f.weight"}
    for i in range(n_layers):
        prefix = f"model.transformer.blocks.{i}"
        names |= {f"{prefix}.{p}.weight" for p in LINEAR_NAMES + NORM_NAMES}
        if bias:
            names |= {f"{prefix}.{p}.bias" for p in LINEAR_NAMES}
    if not tied:
        names.add("model.transformer.ff_out.weight")
        if bias:
            names.add("model.transformer.ff_out.bias")
    return names


@pytest.mark.parametrize("tied, bias", [(True, True), (False, True), (True, False)])
def test_saved_checkpoint_uses_hub_names_and_reloads_exactly(tmp_path, tied, bias):
    model = tiny_model(weight_tying=tied, include_bias=bias)
    for name, param in model.named_parameters():  # biases start at zero: make them informative
        if name.endswith(".bias"):
            param.data.normal_()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == _hub_names(2, bias=bias, tied=tied)
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert reloaded.config.weight_tying is tied and reloaded.config.include_bias is bias
    original = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0)
    ids = torch.randint(4, 100, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_missing_biases_are_initialized(tmp_path):
    """The Hub checkpoints have no biases: loading them into a biased config must not leave garbage."""
    model = AutoModel.from_pretrained(REFERENCE_DIR, include_qkv_bias=True)
    biases = {name: p for name, p in model.named_parameters() if name.endswith(".bias")}
    assert len(biases) == 6
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.isfinite(param).all(), name
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 300, (1, 9))).logits).all()


def test_missing_norm_weight_and_bias_are_initialized(tmp_path):
    model = tiny_model(include_bias=True)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.transformer.ln_f.weight"]
    del weights["model.transformer.blocks.1.attn_out.bias"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded = AutoModel.from_pretrained(tmp_path)
    for name, param in reloaded.named_parameters():
        assert torch.isfinite(param).all(), name
    with torch.no_grad():
        assert torch.isfinite(reloaded(torch.randint(4, 100, (1, 9))).logits).all()
