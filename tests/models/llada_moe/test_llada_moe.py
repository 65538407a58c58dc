"""LLaDA-MoE (`LLaDAMoEConfig`, `LLaDAMoEModelLM`): the Hub-format fixture loads with every key, its logits and every
recorded generation case of the reference implementations reproduce, an independent float32 forward written here
from the spec agrees on configs the fixture does not cover, the prefix / dual caches are checked against the
uncached run, and config values the model cannot honour are refused.

Fixture: `tests/fixtures/lladamoe-tiny-ref` (copied from the shared reference fixtures; its README section "Reference
fixtures for LLaDA-MoE" specifies the forward and the generation algorithms): the Hub's modeling code
(`modeling_lladamoe.py`) driven by Fast-dLLM's `generate()` (no cache; fixed steps or `threshold`) and by LLaDA's
`generate()` (`cfg_scale`), float32 on CPU. The reference recomputes the whole sequence at every step and decodes
every position (no EOS stop), hence `use_cache=False` and `eos_early_stop=False` here.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from hf_dllm.cache import CachePolicy, DiffusionKVCache, padding_aware_position_ids
from hf_dllm.configuration_llada_moe import LLaDAMoEConfig
from hf_dllm.generation_config import DiffusionGenerationConfig
from hf_dllm.modeling_llada_moe import LLaDAMoEModelLM, LLaDAMoESparseMoeBlock
from hf_dllm.packed import PackedRows
from tests.conftest import CACHE_MODES, FIXTURES, assert_cache_modes_agree, reference_fixtures
from tests.models.llada.test_reference_parity import reference_kwargs

FIXTURE = FIXTURES / "lladamoe-tiny-ref"
CASES = json.loads((FIXTURE / "cases.json").read_text())["cases"]
FIXTURE_CONFIG = json.loads((FIXTURE / "config.json").read_text())
MASK, EOS = 310, 301


model, expected = reference_fixtures(FIXTURE, LLaDAMoEModelLM)


# ----------------------------------------------------------------------------------------------------------------
# An independent float32 forward, written from the README's spec with direct loops over tokens, heads and experts.
# ----------------------------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean() + eps))


def _swiglu(weights: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = weights[f"{prefix}.gate_proj.weight"] @ x
    up = weights[f"{prefix}.up_proj.weight"] @ x
    return weights[f"{prefix}.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up)


def _rope(x: torch.Tensor, position: int, rotary: int, theta: float, factor: float) -> torch.Tensor:
    """Rotate-half RoPE of one head's vector `x` with the frequencies `theta ** (-arange(0, rotary, 2) / rotary)` (an
    odd `rotary` has `(rotary + 1) / 2` of them, each rotating two dims, as in the reference)."""
    half = -(-rotary // 2)
    out = x.clone()
    for i in range(half):
        angle = position * theta ** (-(2 * i) / rotary) / factor
        cos, sin = math.cos(angle), math.sin(angle)
        out[i] = x[i] * cos - x[i + half] * sin
        out[i + half] = x[i + half] * cos + x[i] * sin
    return out


def reference_logits(
    weights: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits `(len, vocab)` of one row `input_ids` `(len,)`; `key_mask` `(len,)` (1 = token, 0 = padding): padded
    keys are never attended, positions count from the first token (rows of padded positions are garbage)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim, group = hidden // heads, heads // kv_heads
    rotary = int(head_dim * config["partial_rotary_factor"])
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    factor = (config.get("rope_scaling") or {}).get("factor", 1.0)
    clip = config.get("clip_qkv")
    length = input_ids.shape[0]
    key_mask = torch.ones(length, dtype=torch.long) if key_mask is None else key_mask
    positions = [max(int(key_mask[: t + 1].sum()) - 1, 0) for t in range(length)]
    states = [weights["model.embed_tokens.weight"][int(token)].clone() for token in input_ids]

    def project(name: str, x: torch.Tensor) -> torch.Tensor:
        y = weights[f"{name}.weight"] @ x
        bias = weights.get(f"{name}.bias")
        return y if bias is None else y + bias

    for layer in range(config["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        q, k, v = [], [], []
        for t in range(length):
            x = _rms(states[t], weights[f"{pre}.input_layernorm.weight"], eps)
            qt = project(f"{pre}.self_attn.q_proj", x).view(heads, head_dim)
            kt = project(f"{pre}.self_attn.k_proj", x).view(kv_heads, head_dim)
            vt = project(f"{pre}.self_attn.v_proj", x).view(kv_heads, head_dim)
            if config.get("qk_layernorm"):
                qt = torch.stack([_rms(h, weights[f"{pre}.self_attn.q_norm.weight"], eps) for h in qt])
                kt = torch.stack([_rms(h, weights[f"{pre}.self_attn.k_norm.weight"], eps) for h in kt])
            if clip is not None:
                qt, kt, vt = qt.clamp(-clip, clip), kt.clamp(-clip, clip), vt.clamp(-clip, clip)
            q.append(torch.stack([_rope(h, positions[t], rotary, theta, factor) for h in qt]))
            k.append(torch.stack([_rope(h, positions[t], rotary, theta, factor) for h in kt]))
            v.append(vt)
        new_states = []
        for t in range(length):
            attended = []
            for h in range(heads):
                j = h // group  # key/value head j serves query heads j*g .. j*g+g-1
                keys = [s for s in range(length) if key_mask[s]]
                scores = torch.stack([q[t][h] @ k[s][j] for s in keys]) / math.sqrt(head_dim)
                probabilities = torch.softmax(scores, dim=0)
                attended.append(sum(p * v[s][j] for p, s in zip(probabilities, keys, strict=True)))
            h_t = states[t] + project(f"{pre}.self_attn.o_proj", torch.cat(attended))
            x = _rms(h_t, weights[f"{pre}.post_attention_layernorm.weight"], eps)
            if config["moe_layer_freq"][layer] == 0:
                mlp = _swiglu(weights, f"{pre}.mlp", x)
            else:
                probabilities = torch.softmax(weights[f"{pre}.mlp.gate.weight"] @ x, dim=0)
                if config.get("moe_router_enable_expert_bias"):
                    probabilities = probabilities + weights[f"{pre}.mlp.expert_bias"]
                order = sorted(range(len(probabilities)), key=lambda e: -float(probabilities[e]))
                mlp = torch.zeros_like(x)
                for expert in order[: config["num_experts_per_tok"]]:  # weights as they are, not renormalised
                    mlp = mlp + probabilities[expert] * _swiglu(weights, f"{pre}.mlp.experts.{expert}", x)
                if config.get("shared_expert_intermediate_size") is not None:
                    mlp = mlp + _swiglu(weights, f"{pre}.shared_expert", x)
            new_states.append(h_t + mlp)
        states = new_states
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return torch.stack([head @ _rms(s, weights["model.norm.weight"], eps) for s in states])


RANDOM_CONFIGS = {
    # A dense layer, a shared expert, tied embeddings, grouped-query attention, partial RoPE.
    "dense_shared_tied_gqa": dict(
        moe_layer_freq=[0, 1, 1],
        shared_expert_intermediate_size=20,
        tie_word_embeddings=True,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
    ),
    # The router's expert bias, q/k/v clamping, attention biases, no q/k norms, linear RoPE scaling, and
    # `norm_topk_prob` true (ignored, as by the Hub code).
    "bias_clip_linear_rope": dict(
        moe_layer_freq=[1, 0, 1],
        moe_router_enable_expert_bias=True,
        clip_qkv=1.5,
        attention_bias=True,
        qk_layernorm=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        norm_topk_prob=True,
        num_key_value_heads=1,
    ),
    # An odd RoPE `dim` (int(8 * 0.7) = 5: three frequencies rotate six dims, as the reference's tables do).
    "odd_rotary_dim": dict(hidden_size=32, num_attention_heads=4, partial_rotary_factor=0.7, moe_layer_freq=[1, 1, 0]),
}


def random_config(**overrides) -> LLaDAMoEConfig:
    fields = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=3,
        expert_intermediate_size=16,
        moe_layer_freq=[1, 1, 1],
        dense_intermediate_size=48,
        shared_expert_intermediate_size=None,
        qk_layernorm=True,
        partial_rotary_factor=1.0,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        mask_token_id=95,
        eos_token_id=90,
        pad_token_id=90,
    )
    fields.update(overrides)
    return LLaDAMoEConfig(**fields)


def random_model(config: LLaDAMoEConfig, attn_implementation: str = "sdpa", seed: int = 0) -> LLaDAMoEModelLM:
    """A model with weights large enough that routing and attention are far from uniform (no near-ties)."""
    model = LLaDAMoEModelLM._from_config(config, attn_implementation=attn_implementation).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return model


def config_fields(config: LLaDAMoEConfig) -> dict:
    return {**config.to_dict(), "num_key_value_heads": config.num_key_value_heads}


# ----------------------------------------------------------------------------------------------------------------
# (1) loading, (2) the reference logits, (3) the independent forward
# ----------------------------------------------------------------------------------------------------------------


def test_fixture_loads_with_every_key_and_no_other():
    model, info = LLaDAMoEModelLM.from_pretrained(FIXTURE, output_loading_info=True)
    assert isinstance(model.config, LLaDAMoEConfig)
    assert model.config.model_type == "llada"
    assert {key: sorted(value) for key, value in info.items() if key != "error_msgs"} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
    }
    assert not info["error_msgs"]
    stored = load_file(FIXTURE / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(stored)
    for key, tensor in stored.items():
        assert torch.equal(state[key], tensor), key
    assert model.dtype == torch.float32
    # Every Hub field is kept under its name (the base class only adds its own).
    saved = model.config.to_dict()
    for key, value in FIXTURE_CONFIG.items():
        if key not in ("torch_dtype", "transformers_version"):
            assert saved[key] == value, key


def test_independent_forward_matches_the_fixture(model, expected):
    ids = expected["logits.input_ids"]
    weights = load_file(FIXTURE / "model.safetensors")
    reference = reference_logits(weights, FIXTURE_CONFIG, ids[0])
    torch.testing.assert_close(reference, expected["logits.expected"][0], atol=1e-4, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[0], reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(RANDOM_CONFIGS))
def test_independent_forward_matches_the_model(name, attn_implementation):
    config = random_config(**RANDOM_CONFIGS[name])
    model = random_model(config, attn_implementation)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = {key: value.detach() for key, value in model.state_dict().items()}
    ids = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # row 1 left-padded
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    scale = float(logits.abs().max())
    for row in range(2):
        reference = reference_logits(weights, config_fields(config), ids[row], mask[row])
        real = mask[row].bool()
        torch.testing.assert_close(logits[row][real], reference[real], atol=1e-4 * scale, rtol=0)


def test_random_config_round_trips_through_the_hub_format(tmp_path):
    config = random_config(**RANDOM_CONFIGS["dense_shared_tied_gqa"], moe_router_enable_expert_bias=True)
    model = random_model(config)
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied
    assert "model.layers.1.shared_expert.gate_proj.weight" in stored
    assert "model.layers.0.mlp.gate_proj.weight" in stored and "model.layers.0.mlp.gate.weight" not in stored
    assert "model.layers.2.mlp.expert_bias" in stored
    loaded, info = LLaDAMoEModelLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    assert "head_dim" not in json.loads((tmp_path / "config.json").read_text())


def test_norm_topk_prob_is_ignored_as_by_the_hub_code():
    """The Hub's MoE block hard-codes `norm_topk_prob` off: true and false compute the same."""
    ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        off = random_model(random_config(norm_topk_prob=False))(ids).logits
        on = random_model(random_config(norm_topk_prob=True))(ids).logits
    assert torch.equal(on, off)


def test_bfloat16_model_follows_the_float32_one(expected):
    """In bfloat16 (router softmax in float32, weights and combine in bfloat16, as the Hub code) the logits stay close
    to float32's and generation with each cache decodes every position."""
    model = LLaDAMoEModelLM.from_pretrained(FIXTURE, dtype=torch.bfloat16).eval()
    assert model.dtype == torch.bfloat16
    ids = expected["logits.input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16
    reference = expected["logits.expected"]
    assert (logits.float().argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
    assert float((logits.float() - reference).abs().max()) < 0.1 * float(reference.abs().max())
    for settings in CACHE_MODES.values():
        out = model.generate(
            ids[:, :12], max_new_tokens=16, block_length=8, threshold=0.9, mask_token_id=MASK, **settings
        )
        assert out.shape == (1, 28) and not (out == MASK).any()


@pytest.fixture
def grouped_float32(monkeypatch):
    """Run the experts grouped in float32 too (torch's grouped GEMM runs on the CPU), to compare with the loop."""
    monkeypatch.setattr(LLaDAMoESparseMoeBlock, "grouped_mm_dtypes", (torch.float32, torch.bfloat16))


def test_grouped_experts_equal_the_loop(expected, grouped_float32, tmp_path):
    """The grouped experts (two grouped GEMMs over stacked views of the Hub-named weights) give the loop's logits and
    the reference tokens; the model still saves one tensor per Hub name, with the same values."""
    grouped = LLaDAMoEModelLM.from_pretrained(FIXTURE).eval()
    loop = LLaDAMoEModelLM.from_pretrained(FIXTURE, experts_implementation="eager").eval()
    ids = expected["logits.input_ids"]
    block = grouped.model.layers[0].mlp
    with torch.no_grad():
        assert block.uses_grouped_mm(ids.new_empty(0, 64, dtype=torch.float32))
        assert not loop.model.layers[0].mlp.uses_grouped_mm(ids.new_empty(0, 64, dtype=torch.float32))
        torch.testing.assert_close(grouped(ids).logits, loop(ids).logits, atol=1e-5, rtol=0)
    gate_up, down = block.stacks()[:2]
    assert block.experts[3].up_proj.weight.data_ptr() == gate_up[3, 24:].data_ptr()  # views, not copies
    for case in CASES[::9]:
        prompt = expected[f"prompt.{case['prompt']}"]
        out = grouped.generate(prompt, **generate_kwargs(case))
        assert torch.equal(out.sequences, expected[f"case.{case['name']}"]), case["name"]
    grouped.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    for key, tensor in load_file(FIXTURE / "model.safetensors").items():
        assert torch.equal(stored[key], tensor), key


@pytest.mark.parametrize("name", list(RANDOM_CONFIGS))
def test_grouped_experts_equal_the_loop_on_random_configs(name, grouped_float32):
    config = random_config(**RANDOM_CONFIGS[name])
    model = random_model(config)
    ids = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        grouped = model(ids, attention_mask=mask).logits
        model.config._experts_implementation = "eager"
        loop = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(grouped, loop, atol=1e-5 * float(loop.abs().max()), rtol=0)
    # `.to()` gives the weights new storage: the stacks follow.
    model.config._experts_implementation = None
    model.to(torch.float64).to(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).logits, loop, atol=1e-5 * float(loop.abs().max()), rtol=0
        )


def test_router_logits_are_returned_per_moe_layer():
    model = random_model(random_config(moe_layer_freq=[1, 0, 1]))
    ids = torch.randint(0, 90, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    assert len(out.router_logits) == 2
    assert all(logits.shape == (10, 8) for logits in out.router_logits)


# ----------------------------------------------------------------------------------------------------------------
# (4) every reference generation case
# ----------------------------------------------------------------------------------------------------------------


def generate_kwargs(case: dict) -> dict:
    """The reference's kwargs in `DiffusionGenerationConfig` terms (`steps` is the call's total, as the
    reference's)."""
    return {**reference_kwargs(case["kwargs"]), "remasking": case["kwargs"]["remasking"], "use_cache": False}


def test_every_case_is_tested():
    assert len(CASES) == 63
    assert sum(case["prompt"] == "b2" for case in CASES) == 15


def selected_cases() -> list[dict]:
    """Every case with HF_DLLM_ALL_CASES=1; by default the classifier-free guidance cases and half of the others
    (prompt x block length x schedule, the parity of the sum of their indices): every prompt, block length and
    schedule, and every pair of them, is run (the suite's time budget)."""
    if os.environ.get("HF_DLLM_ALL_CASES") == "1":
        return CASES
    grid = {case["name"]: case["name"].split(".", 3) for case in CASES if ".nocache." in case["name"]}
    axes = [sorted({parts[axis] for parts in grid.values()}) for axis in (0, 2, 3)]
    return [
        case
        for case in CASES
        if case["name"] not in grid
        or sum(axis.index(value) for axis, value in zip(axes, [grid[case["name"]][i] for i in (0, 2, 3)], strict=True))
        % 2
        == 0
    ]


SELECTED = selected_cases()


@pytest.mark.parametrize("case", SELECTED, ids=[case["name"] for case in SELECTED])
def test_reference_case(case, model, expected):
    """Each row of a case (both rows of a `b2` case in one batched call) gets the reference's tokens, in no more
    forwards than the reference made."""
    prompt = expected[f"prompt.{case['prompt']}"]
    reference = expected[f"case.{case['name']}"]
    out = model.generate(prompt, **generate_kwargs(case))
    assert out.sequences.shape == reference.shape
    mismatches = int((out.sequences != reference).sum())
    assert mismatches == 0, f"{mismatches} tokens differ from the reference"
    if case["nfe"] is not None:
        assert out.nfe <= case["nfe"]


# ----------------------------------------------------------------------------------------------------------------
# (5) prefix / dual cache, padding
# ----------------------------------------------------------------------------------------------------------------


def padded_batch(expected) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    prompts = [expected["prompt.p5"], expected["prompt.p19"], expected["prompt.p12"]]
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return ids, mask, prompts


def test_cached_forwards_equal_the_full_forward(model, expected):
    """A full forward writes every position's K/V into a `DiffusionKVCache`; forwards of the prefix cache's range
    (block and suffix) and the dual cache's (block) with the same tokens, reading the rest from the cache, give the
    full forward's logits there (left-padded rows: the cache's padding mask and padding-aware positions)."""
    ids, mask, _ = padded_batch(expected)
    ids = torch.cat([ids, torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(5))], dim=1)
    ids[:, -16:-8] = MASK
    mask = torch.cat([mask, torch.ones(3, 16, dtype=torch.long)], dim=1)
    length = ids.shape[1]
    with torch.no_grad():
        uncached = model(ids, attention_mask=mask).logits
        cache = DiffusionKVCache(model.config.num_hidden_layers, 3, length)
        full = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(full, uncached, atol=1e-5, rtol=0)
        for start, end in ((length - 16, length - 8), (length - 16, length), (length - 8, length)):
            columns = torch.arange(start, end)
            part = model(
                ids[:, start:end], attention_mask=mask, past_key_values=cache, use_cache=True, cache_position=columns
            ).logits
            torch.testing.assert_close(part, full[:, start:end], atol=1e-5, rtol=0)
        # Explicit positions agree with the default (counted from each row's first token).
        positions = padding_aware_position_ids(mask)[:, length - 8 :]
        explicit = model(
            ids[:, -8:],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(length - 8, length),
        ).logits
        torch.testing.assert_close(explicit, full[:, -8:], atol=1e-5, rtol=0)


def test_default_attention_is_lladas_backend(model, expected):
    """As LLaDA's, the default backend is `llada_triton` (the split-KV kernel on CUDA block steps, sdpa elsewhere)."""
    assert model.config._attn_implementation == "llada_triton"
    sdpa = LLaDAMoEModelLM.from_pretrained(FIXTURE, attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(expected["logits.input_ids"]).logits, sdpa(expected["logits.input_ids"]).logits
        )


def test_packed_rows_compute_what_each_row_computes_alone(model, expected):
    """Rows packed end to end (`PackedRows`, the serving engine's padding-free forwards) each attend to themselves
    only and write their K/V at their own row and columns of the cache."""
    rows = [torch.cat([expected[f"prompt.{name}"][0], torch.full((8,), MASK)]) for name in ("p5", "p19", "p12")]
    lengths = [len(row) for row in rows]
    width = max(lengths)
    cache = DiffusionKVCache(model.config.num_hidden_layers, len(rows), width)
    columns = torch.cat([torch.arange(length) for length in lengths])
    packed = PackedRows(lengths, cache=cache, columns=columns)
    with torch.no_grad():
        logits = model(
            torch.cat(rows)[None], attention_mask=packed, past_key_values=packed, position_ids=columns[None]
        ).logits[0]
        start = 0
        for index, row in enumerate(rows):
            alone_cache = DiffusionKVCache(model.config.num_hidden_layers, 1, len(row))
            alone = model(row[None], past_key_values=alone_cache, use_cache=True).logits[0]
            torch.testing.assert_close(logits[start : start + len(row)], alone, atol=1e-5, rtol=0)
            for layer in range(model.config.num_hidden_layers):
                keys = cache.keys[layer][index, :, : len(row)]
                torch.testing.assert_close(keys, alone_cache.keys[layer][0], atol=1e-5, rtol=0)
            start += len(row)


class RefreshEveryStep(CachePolicy):
    """A cache whose K/V are all recomputed at every step: each forward is a full forward through the cache."""

    name = "refresh"
    uses_cache = True

    def query_range(self, block_start: int, block_end: int, seq_len: int, first_step: bool) -> tuple[int, int]:
        return 0, seq_len


REFRESH_SETTINGS = {
    "steps": dict(steps=16, block_length=8),
    "threshold": dict(threshold=0.7, block_length=16),
    "factor": dict(factor=1.0, block_length=8),
    "cfg": dict(steps=16, block_length=8, cfg_scale=1.5),
}


@pytest.mark.parametrize("setting", list(REFRESH_SETTINGS))
def test_refreshed_cache_gives_the_uncached_tokens(model, expected, setting):
    """The cached forward path (K/V written into and attended from a `DiffusionKVCache`) gives exactly the uncached
    run's tokens when the cache is refreshed at every step, on a left-padded batch."""
    ids, mask, _ = padded_batch(expected)
    kwargs = dict(
        max_new_tokens=32,
        mask_token_id=MASK,
        eos_early_stop=False,
        return_dict_in_generate=True,
        **REFRESH_SETTINGS[setting],
    )
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **kwargs)
    refreshed = model.generate(ids, attention_mask=mask, cache_policy=RefreshEveryStep(), **kwargs)
    assert torch.equal(refreshed.sequences, uncached.sequences)
    assert refreshed.nfe == uncached.nfe


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
@pytest.mark.parametrize("rule", ["one_step_per_block", "threshold_commits_the_block"])
def test_cache_modes_agree_where_each_block_is_one_full_forward(model, expected, rule, cfg_scale):
    """Where every block is committed by its first step (a full forward in every cache mode), prefix and dual cache
    give exactly the uncached tokens, in one forward per block."""
    ids, mask, _ = padded_batch(expected)
    decoding = dict(steps=4) if rule == "one_step_per_block" else dict(threshold=1e-9)
    settings = dict(attention_mask=mask, max_new_tokens=32, block_length=8, mask_token_id=MASK, cfg_scale=cfg_scale)
    assert_cache_modes_agree(model, ids, 4, **settings, **decoding)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_generation_feeds_only_the_policys_positions(model, expected, cache):
    """Prefix / dual cache: a block's first step is a full forward, later steps feed the block and the suffix
    (prefix) or the block alone (dual); every position is decoded, in exactly `steps` forwards; most tokens agree
    with the uncached run (the caches are Fast-dLLM's approximation, so not all need to)."""
    prompt = expected["prompt.p12"]
    widths = []
    handle = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    kwargs = dict(max_new_tokens=32, block_length=8, steps=16, mask_token_id=MASK, eos_early_stop=False)
    try:
        out = model.generate(prompt, return_dict_in_generate=True, **kwargs, **CACHE_MODES[cache])
    finally:
        handle.remove()
    length = 12 + 32
    block_starts = [12, 20, 28, 36]
    later = [length - start if cache == "prefix" else 8 for start in block_starts]
    assert widths == [width for rest in later for width in (length, rest, rest, rest)]  # 4 steps per block
    assert out.nfe == 16
    assert not (out.sequences == MASK).any()
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(out.sequences[:, :12], prompt)
    assert (out.sequences == uncached).float().mean() > 0.5


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fp8_kv_cache(model, expected, cache):
    """`kv_cache_dtype="fp8"`: where each block is one full forward (which attends to its own K/V as computed), the
    tokens are the uncached run's; with later steps reading the float8 K/V, every position is still decoded and most
    generated tokens agree with the float32 cache's."""
    ids, mask, _ = padded_batch(expected)
    kwargs = dict(max_new_tokens=32, block_length=8, mask_token_id=MASK, eos_early_stop=False, **CACHE_MODES[cache])
    one_forward = dict(kwargs, threshold=1e-9)
    uncached = model.generate(ids, attention_mask=mask, **{**one_forward, "use_cache": False})
    assert torch.equal(model.generate(ids, attention_mask=mask, kv_cache_dtype="fp8", **one_forward), uncached)
    fp8 = model.generate(ids, attention_mask=mask, kv_cache_dtype="fp8", steps=16, **kwargs)
    full = model.generate(ids, attention_mask=mask, steps=16, **kwargs)
    assert not (fp8 == MASK).any()
    generated = slice(ids.shape[1], None)
    assert (fp8[:, generated] == full[:, generated]).float().mean() > 0.5  # 0.96 (prefix), 0.80 (dual) here


@pytest.mark.parametrize("cache", list(CACHE_MODES))
def test_left_padded_batch_rows_equal_rows_alone(model, expected, cache):
    ids, mask, prompts = padded_batch(expected)
    kwargs = dict(max_new_tokens=32, block_length=8, steps=16, mask_token_id=MASK, eos_early_stop=False)
    batched = model.generate(ids, attention_mask=mask, **kwargs, **CACHE_MODES[cache])
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt, **kwargs, **CACHE_MODES[cache])
        assert torch.equal(batched[row, ids.shape[1] - prompt.shape[1] :], alone[0]), row


def test_generation_config_takes_the_mask_token_from_the_config():
    assert LLaDAMoEConfig().mask_token_id == 156895
    assert DiffusionGenerationConfig.from_model_config(LLaDAMoEConfig()).mask_token_id == 156895
    # The fixture's vocabulary (320) does not hold the Hub's id: none, pass it to generate().
    assert LLaDAMoEConfig.from_pretrained(FIXTURE).mask_token_id is None
    model = random_model(random_config())
    assert model.generation_config.mask_token_id == 95
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, block_length=8, steps=4)
    assert out.shape == (1, 11) and not (out == 95).any()


# ----------------------------------------------------------------------------------------------------------------
# (6) config values the model cannot honour
# ----------------------------------------------------------------------------------------------------------------

BAD_CONFIGS = [
    ("rope_scaling", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
    ("rope_scaling", dict(rope_scaling={"type": "dynamic", "factor": 2.0})),
    ("rope_scaling", dict(rope_scaling={"rope_type": "linear"})),
    ("rope_scaling", dict(rope_scaling="linear")),
    ("clip_qkv", dict(clip_qkv=-1.0)),
    ("clip_qkv", dict(clip_qkv="8")),
    ("moe_layer_freq", dict(moe_layer_freq=[1])),
    ("moe_layer_freq", dict(moe_layer_freq=1)),
    ("moe_layer_freq", dict(moe_layer_freq=[1, 2])),
    ("dense_intermediate_size", dict(moe_layer_freq=[0, 1], dense_intermediate_size=None)),
    ("shared_expert_intermediate_size", dict(shared_expert_intermediate_size=0)),
    ("num_experts", dict(num_experts=0)),
    ("num_experts_per_tok", dict(num_experts_per_tok=17)),
    ("expert_intermediate_size", dict(expert_intermediate_size=None)),
    ("num_key_value_heads", dict(num_key_value_heads=3)),
    ("num_attention_heads", dict(num_attention_heads=5)),
    ("head_dim", dict(head_dim=32)),
    ("partial_rotary_factor", dict(partial_rotary_factor=0.0)),
    ("partial_rotary_factor", dict(partial_rotary_factor=1.5)),
    ("partial_rotary_factor", dict(hidden_size=60, partial_rotary_factor=1.0)),  # head size 15: 16 rotated dims
    ("rope_theta", dict(rope_theta=0)),
    ("hidden_act", dict(hidden_act="swish_typo")),
    ("rms_norm_eps", dict(rms_norm_eps=-1.0)),
    ("attention_dropout", dict(attention_dropout=1.0)),
    ("moe_router_enable_expert_bias", dict(moe_router_enable_expert_bias="yes")),
    ("moe_router_score_function", dict(moe_router_score_function="sigmoid")),
    ("routed_scaling_factor", dict(routed_scaling_factor=2.5)),
    ("router_num_group", dict(router_num_group=8)),
    ("router_topk_group", dict(router_topk_group=4)),
    ("qk_layernorm", dict(qk_layernorm="yes")),
    ("mask_token_id", dict(mask_token_id=-1)),
    ("tie_word_embeddings", dict(tie_word_embeddings="no")),
    ("vocab_size", dict(vocab_size=0)),
]


@pytest.mark.parametrize(("field", "overrides"), BAD_CONFIGS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_CONFIGS)])
def test_bad_config_values_are_refused(field, overrides):
    fields = {key: value for key, value in FIXTURE_CONFIG.items() if key not in ("torch_dtype", "transformers_version")}
    with pytest.raises(ValueError, match=field):
        LLaDAMoEConfig(**{**fields, **overrides})


def test_dense_llada_config_is_refused():
    """Dense LLaDA's config.json says `model_type` "llada" too; read as LLaDA-MoE's it would take default sizes."""
    dense = FIXTURES / "llada-tiny-ref"
    with pytest.raises(ValueError, match="d_model"):
        LLaDAMoEConfig.from_pretrained(dense)


def test_bad_config_file_is_refused_when_loading(tmp_path):
    config = dict(FIXTURE_CONFIG, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_scaling"):
        LLaDAMoEConfig.from_pretrained(tmp_path)
