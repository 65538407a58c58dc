"""LLaDA2.x (`llada2_moe`) forward: the reference logits, block-causal masks, caches, padding, the two experts paths,
Hub-format checkpoints and config validation."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers.cache_utils import DynamicCache

from hf_dllm.cache import DiffusionKVCache
from hf_dllm.configuration_llada2_moe import LLaDA2MoeConfig
from hf_dllm.generation_config import DiffusionGenerationConfig
from hf_dllm.llada2_moe_layer import LLaDA2MoeSparseMoeBlock
from hf_dllm.modeling_llada2_moe import LLaDA2MoeModelLM
from tests.conftest import FIXTURES

FIXTURE = FIXTURES / "llada2-tiny-ref"
ATOL = 1e-4  # float32, as the fixture's README asks
BLOCK = 8  # the fixture mask's block length


@pytest.fixture(scope="module")
def model() -> LLaDA2MoeModelLM:
    return LLaDA2MoeModelLM.from_pretrained(FIXTURE).eval()


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "expected.safetensors")


def logits_with(model, attn_implementation: str, *args, experts: str | None = None, **kwargs) -> torch.Tensor:
    previous = model.config._attn_implementation, model.config._experts_implementation
    model.set_attn_implementation(attn_implementation)
    if experts is not None:
        model.set_experts_implementation(experts)
    try:
        with torch.no_grad():
            return model(*args, **kwargs).logits
    finally:
        model.set_attn_implementation(previous[0])
        model.set_experts_implementation(previous[1])


def random_ids(batch: int, length: int, seed: int = 0, vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def block_causal(length: int, block: int) -> torch.Tensor:
    i = torch.arange(length)
    return (i[None, :] // block <= i[:, None] // block)[None, None]


# ----------------------------------------------------------------------------------------------------------------
# The reference logits (fixture: the original modeling code, float32, block-causal mask of block length 8)
# ----------------------------------------------------------------------------------------------------------------


FLEX = pytest.param("flex_attention", marks=pytest.mark.slow)  # compiles its kernel: seconds on a cold cache


@pytest.mark.parametrize("attn_implementation", [FLEX])  # the others: test_llada2_family.py
def test_reference_logits_with_the_fixture_4d_mask(model, expected, attn_implementation):
    mask = expected["logits.attention_mask"]
    assert mask.dtype == torch.bool and torch.equal(mask, block_causal(32, BLOCK))
    logits = logits_with(
        model,
        attn_implementation,
        expected["logits.input_ids"],
        attention_mask=mask,
        position_ids=torch.arange(32)[None],
    )
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected["logits.expected"], atol=ATOL, rtol=0)


def test_additive_4d_mask_is_used_as_given(model, expected):
    additive = torch.zeros(1, 1, 32, 32).masked_fill(~expected["logits.attention_mask"], torch.finfo(torch.float32).min)
    logits = logits_with(model, "sdpa", expected["logits.input_ids"], attention_mask=additive)
    torch.testing.assert_close(logits, expected["logits.expected"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", FLEX])
def test_padding_mask_with_block_length_equals_the_fixture_mask(model, expected, attn_implementation):
    ids = expected["logits.input_ids"]
    for mask in (torch.ones(1, 32, dtype=torch.long), None):
        logits = logits_with(model, attn_implementation, ids, attention_mask=mask, block_length=BLOCK)
        torch.testing.assert_close(logits, expected["logits.expected"], atol=ATOL, rtol=0)


def test_without_block_length_attention_is_causal(model):
    ids = random_ids(2, 20)
    causal = logits_with(model, "sdpa", ids)
    torch.testing.assert_close(
        causal, logits_with(model, "eager", ids, attention_mask=block_causal(20, 1)), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(causal, logits_with(model, "sdpa", ids, block_length=1), atol=0, rtol=0)


def test_a_token_changes_its_own_block_and_later_blocks_only(model):
    ids = random_ids(1, 32, seed=1)
    changed = ids.clone()
    changed[0, 13] = (changed[0, 13] + 1) % 300  # block 1 of [8, 16)
    before = logits_with(model, "sdpa", ids, block_length=BLOCK)[0]
    after = logits_with(model, "sdpa", changed, block_length=BLOCK)[0]
    moved = (before - after).abs().amax(-1) > 1e-6
    assert not moved[:8].any()
    assert moved[8:16].all() and moved[16:].all()


# ----------------------------------------------------------------------------------------------------------------
# Caches: a forward over the cached K/V of earlier blocks equals the full forward
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "llada_triton"])
@pytest.mark.parametrize("start, end", [(16, 24), (16, 32)])
def test_diffusion_cache_block_forward_equals_full_forward(model, attn_implementation, start, end):
    ids = random_ids(2, 40, seed=2)
    full = logits_with(model, attn_implementation, ids, block_length=BLOCK)

    def cached(first: int, last: int, cache: DiffusionKVCache) -> torch.Tensor:
        """Logits of positions [first, last) over `cache`, which the forward fills at those positions."""
        positions = torch.arange(first, last)
        return logits_with(
            model,
            attn_implementation,
            ids[:, first:last],
            past_key_values=cache,
            cache_position=positions,
            block_length=BLOCK,
        )

    cache = DiffusionKVCache(model.config.num_hidden_layers, 2, 40)
    # Prefill the blocks before `start` only: later columns of the buffer stay zero and must stay invisible.
    cached(0, start, cache)
    torch.testing.assert_close(cached(start, end, cache), full[:, start:end], atol=ATOL, rtol=0)
    # Dual-cache style: every column cached, a middle block recomputed (the blocks after it are masked out).
    cache = DiffusionKVCache(model.config.num_hidden_layers, 2, 40)
    logits_with(model, attn_implementation, ids, past_key_values=cache, block_length=BLOCK)
    torch.testing.assert_close(cached(start, end, cache), full[:, start:end], atol=ATOL, rtol=0)


def test_diffusion_cache_partial_forward_needs_cache_position(model):
    cache = DiffusionKVCache(model.config.num_hidden_layers, 1, 16)
    with pytest.raises(ValueError, match="cache_position"):
        model(random_ids(1, 8), past_key_values=cache, block_length=BLOCK)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_dynamic_cache_block_by_block_equals_full_forward(model, attn_implementation):
    ids = random_ids(2, 24, seed=3)
    full = logits_with(model, attn_implementation, ids, block_length=BLOCK)
    cache = DynamicCache()
    parts = [
        logits_with(
            model, attn_implementation, ids[:, s : s + BLOCK], past_key_values=cache, use_cache=True, block_length=BLOCK
        )
        for s in range(0, 24, BLOCK)
    ]
    assert cache.get_seq_length() == 24
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Padding: a left-padded row (padding a multiple of the block length) computes what it computes alone
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "llada_triton"])
def test_left_padded_row_computes_what_it_computes_alone(model, attn_implementation):
    long, short = random_ids(1, 24, seed=4)[0], random_ids(1, 8, seed=5)[0]
    pad = 24 - 8
    ids = torch.stack([long, torch.cat([torch.full((pad,), 301), short])])
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :pad] = 0
    batched = logits_with(model, attn_implementation, ids, attention_mask=mask, block_length=BLOCK)
    torch.testing.assert_close(
        batched[0], logits_with(model, attn_implementation, long[None], block_length=BLOCK)[0], atol=ATOL, rtol=0
    )
    alone = logits_with(model, attn_implementation, short[None], block_length=BLOCK)[0]
    torch.testing.assert_close(batched[1, pad:], alone, atol=ATOL, rtol=0)
    # The same row decoded block by block against a DiffusionKVCache of the padded sequence.
    cache = DiffusionKVCache(model.config.num_hidden_layers, 2, 24)
    logits_with(model, attn_implementation, ids, attention_mask=mask, past_key_values=cache, block_length=BLOCK)
    block = logits_with(
        model,
        attn_implementation,
        ids[:, 16:24],
        attention_mask=mask,
        past_key_values=cache,
        cache_position=torch.arange(16, 24),
        block_length=BLOCK,
    )
    torch.testing.assert_close(block[1], alone, atol=ATOL, rtol=0)


def test_2d_mask_must_cover_the_keys(model):
    with pytest.raises(ValueError, match="attention_mask"):
        model(random_ids(1, 8), attention_mask=torch.ones(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="block_length"):
        model(random_ids(1, 8), block_length=0)


# ----------------------------------------------------------------------------------------------------------------
# MoE: the grouped-GEMM and loop paths, training, the diffusion-generation hooks, outputs
# ----------------------------------------------------------------------------------------------------------------


def test_grouped_mm_and_loop_paths_agree(model, expected):
    moe = model.model.layers[1].mlp
    assert isinstance(moe, LLaDA2MoeSparseMoeBlock)
    ids = random_ids(3, 40, seed=6)
    loop = logits_with(model, "sdpa", ids, block_length=BLOCK, experts="eager")
    assert model.config._experts_implementation == "grouped_mm"  # the default
    with torch.no_grad():
        if not moe.use_grouped_mm(torch.zeros(1, 64)):
            pytest.skip("torch's grouped GEMM does not run here (torch < 2.9 on CPU)")
    grouped = logits_with(model, "sdpa", ids, block_length=BLOCK, experts="grouped_mm")
    torch.testing.assert_close(grouped, loop, atol=ATOL, rtol=0)
    # The stacks are the experts' own storage: no copy of the weights.
    gate_up, down = moe.stacked_weights()[:2]
    assert moe.experts[3].up_proj.weight.data_ptr() == gate_up[3, moe.intermediate_size :].data_ptr()
    assert moe.experts[5].down_proj.weight.data_ptr() == down[5].data_ptr()


def test_stacks_rebuild_when_the_shared_expert_leaves_them():
    """The shared expert is stacked with the routed ones only while `stack_shared` holds (it stops when its layers
    are replaced, e.g. by FP8 ones): the stacks then rebuild instead of failing on a stale check list."""
    config = LLaDA2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=8, num_shared_experts=1, first_k_dense_replace=1, mask_token_id=63,
    )  # fmt: skip
    moe = LLaDA2MoeModelLM(config).model.layers[1].mlp
    assert moe.stack_shared and moe.stacked_weights()[0].shape[0] == 7  # 6 routed + the shared expert
    replaced = torch.nn.Linear(32, 8, bias=False)  # a new layer object (as FP8 or tensor-parallel loading makes)
    moe.shared_experts.gate_proj = replaced
    assert torch.equal(moe.stacked_weights()[0][6, :8], replaced.weight.detach())
    moe.shared_experts = None
    assert not moe.stack_shared and moe.stacked_weights()[0].shape[0] == 6


def test_grouped_path_checkpoint_keeps_hub_names(tmp_path, expected):
    model = LLaDA2MoeModelLM.from_pretrained(FIXTURE, experts_implementation="grouped_mm").eval()
    with torch.no_grad():
        before = model(expected["logits.input_ids"], block_length=BLOCK).logits  # stacks the experts' weights
    model.save_pretrained(tmp_path)
    saved, original = load_file(tmp_path / "model.safetensors"), load_file(FIXTURE / "model.safetensors")
    assert set(saved) == set(original)
    for name, tensor in original.items():
        torch.testing.assert_close(saved[name], tensor, atol=0, rtol=0)
    reloaded = LLaDA2MoeModelLM.from_pretrained(tmp_path, experts_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(expected["logits.input_ids"], block_length=BLOCK).logits, before, atol=ATOL, rtol=0
        )


def test_experts_implementation_is_validated():
    with pytest.raises(ValueError, match="experts_implementation"):
        LLaDA2MoeModelLM.from_pretrained(FIXTURE, experts_implementation="batched_mm")


def test_training_backward_reaches_router_and_experts(model):
    model.train()
    try:
        out = model(random_ids(2, 16, seed=7), block_length=BLOCK)
        out.logits.logsumexp(-1).mean().backward()
        moe = model.model.layers[1].mlp
        assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
        assert any(expert.down_proj.weight.grad is not None for expert in moe.experts)
        assert model.model.word_embeddings.weight.grad is not None
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_diffusion_generation_hooks(model):
    assert model.diffusion_family.name == "llada2" and model.diffusion_family.committed_kv_exact
    assert model.diffusion_family.logits_shift == 0 and model.diffusion_family.forward_kwargs(
        model.resolve_generation_config(block_length=8)
    ) == {"block_length": 8}
    key_mask = torch.ones(2, 24, dtype=torch.long)
    key_mask[1, :8] = 0
    assert model._diffusion_attention_mask(key_mask, 8) is key_mask
    ids = random_ids(2, 24, seed=8)
    positions = (key_mask.cumsum(-1) - 1).clamp(min=0)
    full = logits_with(model, "sdpa", ids, attention_mask=key_mask, block_length=BLOCK)
    cache = model._diffusion_new_cache(2, 24)
    with torch.no_grad():
        model._diffusion_forward(ids, key_mask, positions, cache, torch.arange(24), slice(None), block_length=BLOCK)
        block = model._diffusion_forward(
            ids[:, 16:], key_mask, positions[:, 16:], cache, torch.arange(16, 24), torch.arange(8), block_length=BLOCK
        )
    torch.testing.assert_close(block, full[:, 16:], atol=ATOL, rtol=0)


def test_generation_config_gets_the_mask_token(model):
    assert LLaDA2MoeConfig().mask_token_id == 156895
    assert model.generation_config.mask_token_id == 156895  # not in the Hub's config.json: the default
    assert DiffusionGenerationConfig.from_model_config(LLaDA2MoeConfig(mask_token_id=310)).mask_token_id == 310


def test_logits_to_keep_outputs_and_tuples(model):
    ids = random_ids(1, 16, seed=9)
    with torch.no_grad():
        full = model(ids, block_length=BLOCK)
        torch.testing.assert_close(model(ids, block_length=BLOCK, logits_to_keep=3).logits, full.logits[:, -3:])
        torch.testing.assert_close(
            model(ids, block_length=BLOCK, logits_to_keep=slice(2, 5)).logits, full.logits[:, 2:5]
        )
        index = torch.tensor([0, 9])
        torch.testing.assert_close(model(ids, block_length=BLOCK, logits_to_keep=index).logits, full.logits[:, index])
        out = model(ids, block_length=BLOCK, output_hidden_states=True, output_router_logits=True)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        assert [r.shape for r in out.router_logits] == [(16, 8)] * 2  # layers 1, 2 are MoE
        embeds = model.get_input_embeddings()(ids)
        torch.testing.assert_close(model(inputs_embeds=embeds, block_length=BLOCK).logits, full.logits)
        assert isinstance(model(ids, return_dict=False), tuple)


# ----------------------------------------------------------------------------------------------------------------
# Hub format: names, round trips, odd configs
# ----------------------------------------------------------------------------------------------------------------


def hub_names(config: LLaDA2MoeConfig) -> set[str]:
    names = {"model.word_embeddings.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        names |= {f"{prefix}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        names |= {f"{prefix}.attention.{n}.weight" for n in ("query_key_value", "dense")}
        if config.use_qkv_bias:
            names.add(f"{prefix}.attention.query_key_value.bias")
        if config.use_bias:
            names.add(f"{prefix}.attention.dense.bias")
        if config.use_qk_norm:
            names |= {f"{prefix}.attention.{n}.weight" for n in ("query_layernorm", "key_layernorm")}
        projections = ("gate_proj", "up_proj", "down_proj")
        if config.is_moe_layer(i):
            names.add(f"{prefix}.mlp.gate.weight")
            if config.moe_router_enable_expert_bias:
                names.add(f"{prefix}.mlp.gate.expert_bias")
            names |= {f"{prefix}.mlp.experts.{e}.{p}.weight" for e in range(config.num_experts) for p in projections}
            if config.num_shared_experts:
                names |= {f"{prefix}.mlp.shared_experts.{p}.weight" for p in projections}
        else:
            names |= {f"{prefix}.mlp.{p}.weight" for p in projections}
    return names


def test_fixture_checkpoint_has_exactly_the_hub_names():
    config = LLaDA2MoeConfig.from_pretrained(FIXTURE)
    assert set(load_file(FIXTURE / "model.safetensors")) == hub_names(config)


def test_config_round_trip_keeps_every_original_key(tmp_path):
    original = json.loads((FIXTURE / "config.json").read_text())
    original["some_future_field"] = [1, 2]  # unknown fields survive too
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "config.json").write_text(json.dumps(original))
    config = LLaDA2MoeConfig.from_pretrained(tmp_path / "source")
    for key, value in original.items():
        if key not in ("transformers_version", "auto_map", "architectures", "model_type", "torch_dtype"):
            assert getattr(config, key) == value, key
    config.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    for key, value in original.items():
        if key in ("transformers_version", "torch_dtype"):  # transformers 5 writes `dtype`
            continue
        assert saved.get(key, "<missing>") == value, key
    assert saved["dtype"] == original["torch_dtype"] and saved["mask_token_id"] == 156895


TINY = dict(
    vocab_size=61,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=20,
    max_position_embeddings=128,
    mask_token_id=60,
    pad_token_id=0,
    eos_token_id=1,
)
TINY_VARIANTS = {
    "tied-mha-hd12-full-rope-softmax-no-bias-all-moe": dict(
        tie_word_embeddings=True,
        num_key_value_heads=4,
        head_dim=12,
        partial_rotary_factor=1.0,
        score_function="softmax",
        moe_router_enable_expert_bias=False,
        first_k_dense_replace=0,
        num_shared_experts=0,
    ),
    "untied-gqa4-hd24-partial-rope-2-dense": dict(
        num_key_value_heads=1, head_dim=24, partial_rotary_factor=0.5, first_k_dense_replace=2, num_shared_experts=2
    ),
    "tied-biases-no-qk-norm-unnormalised-odd-expert-width": dict(
        tie_word_embeddings=True,
        num_key_value_heads=2,
        head_dim=12,
        use_qkv_bias=True,
        use_bias=True,
        use_qk_norm=False,
        norm_topk_prob=False,
        moe_intermediate_size=13,  # rows not 16-byte aligned: the loop path
        first_k_dense_replace=1,
    ),
}


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_config_round_trip_keeps_names_and_logits(tmp_path, variant):
    config = LLaDA2MoeConfig(**dict(TINY, **TINY_VARIANTS[variant]))
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # informative weights: biases, norms and router non-trivial
            param.add_(torch.randn_like(param) * (0.2 if "norm" in name else 0.05))
        for layer in model.model.layers:
            if isinstance(layer.mlp, LLaDA2MoeSparseMoeBlock) and layer.mlp.gate.expert_bias is not None:
                layer.mlp.gate.expert_bias.normal_(0, 0.1)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.word_embeddings.weight
    ids = random_ids(2, 20, seed=10, vocab=60)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :8] = 0
    before = logits_with(model, "sdpa", ids, attention_mask=mask, block_length=4, experts="eager")
    assert torch.isfinite(before[mask.bool()]).all()
    grouped = logits_with(model, "sdpa", ids, attention_mask=mask, block_length=4, experts="grouped_mm")
    torch.testing.assert_close(grouped, before, atol=ATOL, rtol=0)
    model.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == hub_names(config)
    reloaded = LLaDA2MoeModelLM.from_pretrained(tmp_path).eval()
    for key in TINY_VARIANTS[variant]:
        assert getattr(reloaded.config, key) == getattr(config, key), key
    original = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], atol=0, rtol=0)
    after = logits_with(reloaded, "eager", ids, attention_mask=mask, block_length=4, experts="eager")
    real = mask.bool()  # fully masked pad rows differ between backends: only real positions are defined
    torch.testing.assert_close(after[real], before[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("num_experts_per_tok", dict(num_experts_per_tok=17)),
        ("num_experts_per_tok", dict(num_experts_per_tok=9, topk_group=2)),  # only 8 experts in 2 of 4 groups
        ("n_group", dict(n_group=5)),
        ("topk_group", dict(topk_group=5)),
        ("score_function", dict(score_function="relu")),
        ("router_dtype", dict(router_dtype="int8")),
        ("num_key_value_heads", dict(num_key_value_heads=3)),
        ("partial_rotary_factor", dict(partial_rotary_factor=0.0)),
        ("partial_rotary_factor", dict(head_dim=12, partial_rotary_factor=0.25)),  # 3 rotary dims
        ("first_k_dense_replace", dict(first_k_dense_replace=4)),
        ("intermediate_size", dict(intermediate_size=None, first_k_dense_replace=1)),
        ("moe_intermediate_size", dict(moe_intermediate_size=0)),
        ("num_shared_experts", dict(num_shared_experts=-1)),
        ("hidden_act", dict(hidden_act="swish-ish")),
        ("rope_scaling", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
        ("use_sliding_window", dict(use_sliding_window=True)),
        ("norm_head", dict(norm_head=True)),
        ("hidden_size", dict(hidden_size=0)),
    ],
)
def test_invalid_config_raises_naming_the_field(field, overrides):
    with pytest.raises(ValueError, match=re.escape(f"LLaDA2MoeConfig.{field}")):
        LLaDA2MoeConfig(**dict(TINY, **overrides))
