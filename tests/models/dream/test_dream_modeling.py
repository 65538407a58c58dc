"""Dream's model: the Hub checkpoint format loads unchanged, float32 logits equal the reference's, every attention
backend and an independent from-scratch forward agree on other shapes (odd sizes, grouped-query attention, tied
embeddings), padding and the diffusion KV cache behave, bad configs are refused, and the files load as Hub remote
code without hf_dllm.

Fixture: `tests/fixtures/dream-tiny-ref` (see README-reference.md, "Reference fixtures for Dream").
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel

import hf_dllm
from hf_dllm import DiffusionKVCache, DreamConfig, DreamModel
from tests.conftest import FIXTURES, reference_fixtures

DREAM = FIXTURES / "dream-tiny-ref"
PACKAGE = Path(hf_dllm.__file__).parent


dream, expected = reference_fixtures(DREAM)


def tiny_config(**overrides) -> DreamConfig:
    fields = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        rope_theta=1000.0,
        mask_token_id=96,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    fields.update(overrides)
    return DreamConfig(**fields)


def random_model(config: DreamConfig, attn: str = "eager", seed: int = 0) -> DreamModel:
    torch.manual_seed(seed)
    model = DreamModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.2)
    model.set_attn_implementation(attn)
    return model


def test_hub_format_loads_through_the_auto_classes(dream, tmp_path):
    config = AutoConfig.from_pretrained(DREAM)
    assert type(config) is DreamConfig and config.model_type == "Dream" and config.head_dim == 16
    assert type(dream) is DreamModel  # the Auto classes: test_dream_family.py
    assert dream.diffusion_family.name == "dream" and dream.diffusion_family.logits_shift == 1
    assert dream.generation_config.mask_token_id == 310 and dream.generation_config.eos_token_id == 301
    # Saving gives the Hub's format back: the same tensor names and config fields.
    dream.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(DREAM / "model.safetensors"))
    saved, original = (json.loads((p / "config.json").read_text()) for p in (tmp_path, DREAM))
    for field in ("model_type", "hidden_size", "num_key_value_heads", "rope_theta", "mask_token_id", "auto_map"):
        assert saved[field] == original[field], field


def reference_forward(model: DreamModel, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None):
    """An independent float64 forward of the Qwen2 body with bidirectional attention, written from the equations
    (not from the model's code): RMSNorm, rotate-half RoPE at positions counted from each row's first real token,
    q/k/v biases, grouped-query attention over the non-padded keys, SiLU-gated MLP, untied or tied head."""
    config = model.config
    state = {name: tensor.double() for name, tensor in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    batch, length = input_ids.shape
    key_mask = torch.ones(batch, length, dtype=torch.bool) if key_mask is None else key_mask.bool()
    positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0).double()

    def norm(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps)

    def rope(x):  # x (batch, heads, length, dim)
        half = dim // 2
        freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)
        angle = positions[:, None, :, None] * freq
        cos, sin = torch.cos(angle), torch.sin(angle)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    x = state["model.embed_tokens.weight"][input_ids]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, state[p + "input_layernorm.weight"])

        q, k, v = (
            (h @ state[p + f"self_attn.{name}.weight"].T + state[p + f"self_attn.{name}.bias"])
            .view(batch, length, n, dim)
            .transpose(1, 2)
            for name, n in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads))
        )
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dim)
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, heads * dim)
        x = x + attn @ state[p + "self_attn.o_proj.weight"].T
        h = norm(x, state[p + "post_attention_layernorm.weight"])
        gate = h @ state[p + "mlp.gate_proj.weight"].T
        x = (
            x
            + (torch.nn.functional.silu(gate) * (h @ state[p + "mlp.up_proj.weight"].T))
            @ state[p + "mlp.down_proj.weight"].T
        )
    x = norm(x, state["model.norm.weight"])
    head = state["model.embed_tokens.weight"] if config.tie_word_embeddings else state["lm_head.weight"]
    return x @ head.T


SHAPES = {
    "odd-mqa": dict(),  # hidden 48, 3 heads of 16, one K/V head, vocab 97
    "gqa-tied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "mha-head-24": dict(hidden_size=72, num_attention_heads=3, num_key_value_heads=3, intermediate_size=40),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("attn", ["eager", "sdpa", "llada_triton"])
def test_forward_matches_an_independent_implementation(shape, attn):
    model = random_model(tiny_config(**SHAPES[shape]), attn)
    input_ids = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        logits = model(input_ids).logits
    torch.testing.assert_close(logits.double(), reference_forward(model, input_ids), atol=1e-4, rtol=0)


def test_tied_embeddings_share_the_matrix_and_round_trip(tmp_path):
    model = random_model(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    input_ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_rows_compute_what_they_compute_alone(attn):
    model = random_model(tiny_config(), attn)
    short, long = torch.randint(2, 96, (1, 6)), torch.randint(2, 96, (1, 10))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone = model(short).logits
    torch.testing.assert_close(padded[0, 4:], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded.double(), reference_forward(model, batch, mask), atol=1e-4, rtol=0)


def test_cache_read_only_query_keeps_its_cached_keys():
    """`cache_read_only=1`: the first query position attends and gets logits, but its K/V in the cache stay those
    of the earlier full forward (what Fast-dLLM's caches keep for the column before the block)."""
    model = random_model(tiny_config())
    tokens = torch.randint(2, 96, (1, 12))
    cache = DiffusionKVCache(model.config.num_hidden_layers, 1, 12)
    with torch.no_grad():
        model(tokens, past_key_values=cache, use_cache=True)
        before = [keys.clone() for keys in cache.keys]
        changed = tokens.clone()
        changed[0, 4:8] = torch.randint(2, 96, (4,))
        columns = torch.arange(3, 12)
        model(changed[:, 3:], past_key_values=cache, use_cache=True, cache_position=columns, cache_read_only=1)
    for layer, (old, new) in enumerate(zip(before, cache.keys, strict=True)):
        torch.testing.assert_close(new[:, :, :4], old[:, :, :4], atol=0, rtol=0)  # column 3 was read-only
        if layer > 0:  # layer 0's keys depend on the tokens only; later layers see the changed block
            assert not torch.allclose(new[:, :, 8:], old[:, :, 8:])
    with pytest.raises(TypeError, match="cache_read_only"):
        model(tokens, past_key_values=None, cache_read_only=1, use_cache=True)


@pytest.mark.parametrize(
    "field, fields",
    [
        ("hidden_size", dict(hidden_size=50)),
        ("num_key_value_heads", dict(num_key_value_heads=2)),
        ("hidden_act", dict(hidden_act="swish2")),
        ("rope_theta", dict(rope_theta=0)),
        ("rope_scaling", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0})),
        ("factor", dict(rope_scaling={"rope_type": "linear"})),
        ("use_sliding_window", dict(use_sliding_window=True)),
        ("mask_token_id", dict(mask_token_id=-1)),
        ("attention_dropout", dict(attention_dropout=1.0)),
    ],
)
def test_config_rejects_what_the_model_cannot_run(field, fields):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        tiny_config(**fields)


def test_linear_rope_scaling_divides_the_positions():
    scaled = random_model(tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    plain = random_model(tiny_config())
    input_ids = torch.randint(2, 96, (1, 8))
    with torch.no_grad():
        positions = torch.arange(8).unsqueeze(0)
        torch.testing.assert_close(
            scaled(input_ids, position_ids=positions * 2).logits, plain(input_ids, position_ids=positions).logits
        )


REMOTE_CHILD = textwrap.dedent(
    r"""
    import sys
    for blocked in ("hf_dllm", "triton", "flash_attn"):  # not installed, as far as this process can tell
        sys.modules[blocked] = None
    import json
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModel

    torch.set_num_threads(1)
    repo = sys.argv[1]
    model = AutoModel.from_pretrained(repo, trust_remote_code=True).eval()
    expected = load_file(f"{repo}/expected.safetensors")
    with torch.no_grad():
        logits = model(expected["logits.input_ids"]).logits
    case = next(c for c in json.load(open(f"{repo}/cases.json"))["cases"] if c["name"] == "p12.blk.g16.dual.t0.9")
    out = model.generate(
        expected["prompt.p12"], max_new_tokens=16, block_length=8, alg="confidence_threshold", threshold=0.9,
        use_cache=True, dual_cache=True, temperature=0.0, eos_early_stop=False,
    )
    print(json.dumps({
        "module": type(model).__module__,
        "class": type(model).__name__,
        "max_error": float((logits - expected["logits.expected"]).abs().max()),
        "tokens_equal": bool(torch.equal(out, expected["case." + case["name"]])),
    }))
    """
)


def test_loads_as_remote_code_without_hf_dllm(tmp_path):
    """The Hub's auto_map (`configuration_dream.DreamConfig`, `modeling_dream.DreamModel`) resolves to these files
    in a process where hf_dllm cannot be imported: transformers' dynamic-module loader follows their relative
    imports to the shared files."""
    from hf_dllm.hub.families import MODEL_FAMILIES

    repo = tmp_path / "dream-remote"
    shutil.copytree(DREAM, repo)
    for name in MODEL_FAMILIES["dream"].remote_code_files:
        shutil.copy(PACKAGE / name, repo / name)
    (tmp_path / "child.py").write_text(REMOTE_CHILD)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "PYTHON", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "child.py"), str(repo)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["class"] == "DreamModel" and result["module"].startswith("transformers_modules.")
    assert result["max_error"] < 1e-4
    assert result["tokens_equal"]
