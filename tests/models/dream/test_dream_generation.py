"""Dream generation beyond the recorded cases: left-padded batches give each row its tokens alone, streamers and
`pipeline("text-generation")` work, `diffusion_generate()` maps Dream's arguments onto `generate()`, bad settings
raise before any forward, Dream's schedule equals the reference's arithmetic, and sampling behaves.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import pipeline
from transformers.generation.streamers import BaseStreamer

from hf_dllm import ConfidenceFactor, DreamConfig, DreamModel, FixedSchedule, left_pad
from hf_dllm.decoding_dream import (
    FIRST_POSITION,
    DreamSchedule,
    DreamThreshold,
    dream_sample_tokens,
    dream_transfer_counts,
)
from tests.conftest import FIXTURES, tiny_model
from tests.generation.test_streamers import ForwardCounter

DREAM = FIXTURES / "dream-tiny-ref"
MASK, EOS = 310, 301


@pytest.fixture(scope="module")
def dream():
    return DreamModel.from_pretrained(DREAM).eval()


@pytest.fixture(scope="module")
def prompts():
    expected = load_file(DREAM / "expected.safetensors")
    return [expected[f"prompt.{name}"][0].tolist() for name in ("p5", "p12", "p19")]


SETTINGS = {
    "dream-entropy": dict(max_new_tokens=16, block_length=16, steps=8, alg="entropy", use_cache=False),
    "dream-margin-blocks": dict(max_new_tokens=16, block_length=8, steps=8, alg="topk_margin", use_cache=False),
    "prefix-threshold": dict(max_new_tokens=16, block_length=8, threshold=0.7, use_cache=True, dual_cache=False),
    "dual-threshold": dict(max_new_tokens=16, block_length=8, alg="confidence_threshold", threshold=0.9),
    "prefix-maskgit": dict(max_new_tokens=24, block_length=8, steps=12, alg="maskgit_plus", dual_cache=False),
    "dual-entropy-short-block": dict(max_new_tokens=20, block_length=8, steps=10, alg="entropy"),
    "defaults-eos-stop": dict(max_new_tokens=16, block_length=8),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_left_padded_batch_rows_equal_each_row_alone(dream, prompts, name):
    settings = dict(SETTINGS[name], eos_early_stop=name == "defaults-eos-stop", return_dict_in_generate=True)
    input_ids, attention_mask = left_pad(prompts, EOS)
    batch = dream.generate(input_ids, attention_mask=attention_mask, **settings)
    width = input_ids.shape[1]
    for row, prompt in enumerate(prompts):
        alone = dream.generate(torch.tensor([prompt]), **settings)
        assert torch.equal(batch.sequences[row, width:], alone.sequences[0, len(prompt) :]), row
        assert int(batch.nfe_per_row[row]) == alone.nfe
        assert not bool((alone.sequences == MASK).any())


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.drafts = 0
        self.ended = False

    def put(self, value):
        self.puts.append(value.clone())

    def put_draft(self, value, **kwargs):
        self.drafts += 1

    def end(self):
        self.ended = True


@pytest.mark.parametrize("use_cache", [False, True])
def test_streamer_gets_the_prompt_then_every_block(dream, prompts, use_cache):
    prompt = torch.tensor([prompts[1]])
    settings = dict(max_new_tokens=24, block_length=8, steps=12, alg="entropy", use_cache=use_cache)
    streamer = Recorder()
    out = dream.generate(prompt, streamer=streamer, eos_early_stop=False, return_dict_in_generate=True, **settings)
    assert streamer.ended and len(streamer.puts) == 1 + 3
    assert torch.equal(torch.cat(streamer.puts, dim=-1), out.sequences)
    assert streamer.drafts == out.nfe  # one draft per forward


def char_dream(seed: int = 0) -> DreamModel:
    """A random Dream sized for the character tokenizer (vocabulary 103, mask 3, EOS/pad 0, BOS 1)."""
    torch.manual_seed(seed)
    config = DreamConfig(
        vocab_size=103,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mask_token_id=3,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=1,
    )
    model = DreamModel(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)  # spread the confidences
    return model


def test_pipeline_text_generation(char_tokenizer):
    model = char_dream()
    pipe = pipeline("text-generation", model=model, tokenizer=char_tokenizer)
    settings = dict(max_new_tokens=8, block_length=4, alg="maskgit_plus", steps=4)
    encoded = char_tokenizer("Hello", return_tensors="pt")  # batches: test_dream_family.py
    out = model.generate(**encoded, **settings)
    text = char_tokenizer.decode(out[0, encoded.input_ids.shape[1] :], skip_special_tokens=True)
    assert pipe("Hello", **settings)[0]["generated_text"] == "Hello" + text
    with pytest.raises(ValueError, match="alg"):
        pipe("Hello", max_new_tokens=8, alg="greedy")


def test_diffusion_generate_maps_dreams_arguments(dream, prompts):
    prompt = torch.tensor([prompts[0]])
    dream_args = dict(steps=8, alg="topk_margin", alg_temp=0.0, temperature=0.0, return_dict_in_generate=True)
    via_alias = dream.diffusion_generate(prompt, max_new_tokens=16, **dream_args)
    via_generate = dream.generate(
        prompt, max_new_tokens=16, block_length=16, use_cache=False, eos_early_stop=False, **dream_args
    )
    assert torch.equal(via_alias.sequences, via_generate.sequences) and via_alias.nfe == via_generate.nfe
    # Dream's max_length counts the prompt; return_dict is Dream's name for return_dict_in_generate.
    by_length = dream.diffusion_generate(prompt, max_length=5 + 16, steps=8, alg="topk_margin", return_dict=True)
    assert torch.equal(by_length.sequences, via_alias.sequences)
    repeated = dream.diffusion_generate(prompt, max_new_tokens=16, num_return_sequences=2, **dream_args)
    assert torch.equal(repeated.sequences, via_alias.sequences.expand(2, -1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=8, output_history=True), "output_history"),
        (dict(max_new_tokens=8, generation_logits_hook_func=lambda i, x, logits: logits), "generation_logits_hook"),
        (dict(max_new_tokens=8, alg="greedy"), r"alg.*maskgit_plus"),
        (dict(max_length=3), "max_length"),
        (dict(max_length=30, max_new_tokens=8), "max_length"),
        (dict(max_new_tokens=8, num_return_sequences=0), "num_return_sequences"),
        (dict(max_new_tokens=8, beams=2), "beams"),
    ],
)
def test_diffusion_generate_rejects_what_it_does_not_support(dream, prompts, kwargs, match):
    counter = ForwardCounter(dream)
    try:
        with pytest.raises(ValueError, match=match):
            dream.diffusion_generate(torch.tensor([prompts[0]]), **kwargs)
    finally:
        counter.remove()
    assert counter.count == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alg="greedy"), r"\balg\b.*entropy"),
        (dict(alg_temp=-1.0), r"\balg_temp\b"),
        (dict(alg_temp=float("nan")), r"\balg_temp\b"),
        (dict(top_p=0.0), r"\btop_p\b.*\(0, 1\]"),
        (dict(top_p=1.5), r"\btop_p\b"),
        (dict(top_k=0), r"\btop_k\b.*positive"),
        (dict(top_k=2.5), r"\btop_k\b"),
        (dict(eps=0.0), r"\beps\b.*\(0, 1\)"),
        (dict(eps=1.0), r"\beps\b"),
        (dict(alg="confidence_threshold"), r"confidence_threshold.*threshold"),
        (dict(alg="entropy", threshold=0.9), r"threshold.*alg"),
        (dict(alg="entropy", factor=1.0), r"factor.*alg"),
        (dict(alg_temp=0.5, threshold=0.9), r"alg_temp"),
        (dict(remasking="random"), r"remasking.*alg"),
        (dict(logits_eos_inf=True), r"logits_eos_inf"),
        (dict(confidence_eos_eot_inf=True), r"confidence_eos_eot_inf"),
        (dict(cfg_scale=1.0), r"cfg_scale"),
        (dict(steps=1, block_length=4), r"steps.*blocks"),
    ],
)
def test_bad_settings_raise_before_any_forward(dream, prompts, kwargs, match):
    counter = ForwardCounter(dream)
    try:
        with pytest.raises(ValueError, match=match):
            dream.generate(torch.tensor([prompts[0]]), max_new_tokens=16, **kwargs)
    finally:
        counter.remove()
    assert counter.count == 0


@pytest.mark.parametrize("field, value", [("alg", "entropy"), ("alg_temp", 0.5), ("top_p", 0.9), ("top_k", 5)])
def test_models_without_dreams_rules_reject_its_settings(field, value):
    llada = tiny_model()
    counter = ForwardCounter(llada)
    try:
        with pytest.raises(ValueError, match=rf"\b{field}\b.*Dream"):
            llada.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, block_length=4, **{field: value})
    finally:
        counter.remove()
    assert counter.count == 0


def reference_counts(masks: int, steps: int, eps: float, first_position: bool) -> list[int]:
    """Transfer counts as the reference loops compute them (Dream's `_sample`, Fast-dLLM's cached block), zeros
    included: a batch-mean mask count as a float32 tensor times `1 - s / t` of float32 linspace entries."""
    t = torch.linspace(1, eps, steps + 1)
    left, counts = masks, []
    start = 1 if first_position else 0
    if first_position:
        counts.append(1)
        left -= 1
    for i in range(start, steps):
        mask_index = torch.ones(1, left, dtype=torch.bool)
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        k = int(num_mask_token * (1 - t[i + 1] / t[i])) if i < steps - 1 else int(num_mask_token)
        counts.append(k)
        left -= k
    return counts


@pytest.mark.parametrize("first_position", [False, True])
@pytest.mark.parametrize("eps", [1e-3, 0.05])
def test_transfer_counts_follow_the_reference_arithmetic(first_position, eps):
    for masks in range(1, 41):
        for steps in range(2, 41):
            reference = reference_counts(masks, steps, eps, first_position)
            ours = dream_transfer_counts(masks, steps, eps, first_position)
            expected = [k for k in reference if k > 0]  # steps that commit nothing are skipped
            if first_position:
                expected[0] = FIRST_POSITION
            assert ours == expected, (masks, steps)
            assert sum(reference) == masks
    # One step per block with Fast-dLLM's start: everything at once (the reference would leave masks behind).
    assert dream_transfer_counts(8, 1, 1e-3, first_position=True) == [8]


def test_policies_follow_the_settings(dream):
    config = dream.resolve_generation_config(alg="topk_margin", steps=8, use_cache=False)
    policy = dream.diffusion_family.unmasking_policy(config)
    assert isinstance(policy, DreamSchedule) and policy.alg == "topk_margin" and not policy.first_position
    config = dream.resolve_generation_config(threshold=0.8)
    policy = dream.diffusion_family.unmasking_policy(config)
    assert isinstance(policy, DreamThreshold) and policy.threshold == 0.8 and policy.first_position
    default = dream.diffusion_family.unmasking_policy(dream.resolve_generation_config())
    assert isinstance(default, DreamSchedule) and default.alg == "entropy"
    assert isinstance(
        dream.diffusion_family.unmasking_policy(dream.resolve_generation_config(factor=1.0)), ConfidenceFactor
    )


def test_greedy_rules_are_capturable_and_random_ones_are_not(dream):
    """The loop captures a step in a CUDA graph only when the policy's `graph_key` is not None: Dream's greedy rules
    say so, with the constants their step bakes in (never the host-side schedule: `eps`, `first_position`); the
    rules that draw random numbers (`origin`, `alg_temp` > 0, `temperature` > 0) and subclasses run eagerly."""

    def key(**settings):
        return dream.diffusion_family.unmasking_policy(dream.resolve_generation_config(**settings)).graph_key()

    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        assert key(alg=alg, steps=8) == ("DreamSchedule", alg, None, None, MASK)
        assert key(alg=alg, steps=8, alg_temp=0.0) == key(alg=alg, steps=8)
    assert key(threshold=0.9) == ("DreamThreshold", 0.9, None, None, MASK)
    assert key(alg="confidence_threshold", threshold=0.9, use_cache=False) == key(threshold=0.9)
    assert key(alg="entropy", steps=8, eps=0.05, use_cache=False) == key(alg="entropy", steps=8)
    # Filtering changes the confidences a greedy step computes: another graph.
    assert key(alg="maskgit_plus", steps=8, top_p=0.9) == ("DreamSchedule", "maskgit_plus", 0.9, None, MASK)
    assert key(threshold=0.9, top_k=5) == ("DreamThreshold", 0.9, None, 5, MASK)
    assert key(threshold=0.9) != key(threshold=0.8)
    assert key(alg="origin", steps=8) is None
    assert key(alg="entropy", steps=8, alg_temp=0.5) is None
    assert key(alg="entropy", steps=8, temperature=0.7) is None
    assert key(threshold=0.9, temperature=0.7) is None

    class Subclass(DreamThreshold):
        pass

    assert Subclass(0.9).graph_key() is None  # a subclass may change the step: eager until it says otherwise


def test_factor_and_custom_policies_run_on_dream(dream, prompts):
    prompt = torch.tensor([prompts[1]])
    out = dream.generate(prompt, max_new_tokens=16, block_length=8, factor=1.0, eos_early_stop=False)
    assert not bool((out == MASK).any())
    # A policy object replaces the model's rule: LLaDA's fixed schedule, one token per step.
    fixed = dream.generate(
        prompt,
        max_new_tokens=16,
        block_length=8,
        unmasking_policy=FixedSchedule(),
        use_cache=False,
        eos_early_stop=False,
        return_dict_in_generate=True,
    )
    assert fixed.nfe == 16 and not bool((fixed.sequences == MASK).any())


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.8, alg="entropy", steps=8),
        dict(temperature=0.8, top_p=0.9, alg="maskgit_plus", steps=8),
        dict(alg_temp=0.5, alg="topk_margin", steps=8),
        dict(alg="origin", steps=8),
        dict(temperature=0.5, threshold=0.7),
    ],
)
@pytest.mark.parametrize("use_cache", [False, True])
def test_sampling_is_seeded_and_fills_every_position(dream, prompts, settings, use_cache):
    prompt = torch.tensor([prompts[0]])
    kwargs = dict(settings, max_new_tokens=16, block_length=8, use_cache=use_cache, eos_early_stop=False)
    torch.manual_seed(1)
    first = dream.generate(prompt, return_dict_in_generate=True, **kwargs)
    torch.manual_seed(1)
    again = dream.generate(prompt, return_dict_in_generate=True, **kwargs)
    assert torch.equal(first.sequences, again.sequences)
    assert not bool((first.sequences == MASK).any())
    if settings.get("alg") == "origin":
        assert first.nfe == kwargs["steps"]  # random commits: no step can be skipped
    elif "steps" in settings:
        assert first.nfe <= kwargs["steps"]


def test_dream_sample_tokens():
    """Dream's `sample_tokens`: greedy candidates and the three confidences; top-k 1 or a tiny top-p leave only the
    greedy token to sample; the mask token is never proposed, yet confidences stay those of the full softmax."""
    torch.manual_seed(0)
    logits = torch.randn(40, 97) * 3
    probs = logits.softmax(-1)
    x0, confidence = dream_sample_tokens(logits, "maskgit_plus")
    assert torch.equal(x0, logits.argmax(-1))
    torch.testing.assert_close(confidence, probs.max(-1).values)
    top2 = probs.topk(2, dim=-1).values
    torch.testing.assert_close(dream_sample_tokens(logits, "topk_margin")[1], top2[:, 0] - top2[:, 1])
    entropy = dream_sample_tokens(logits, "entropy")[1]
    torch.testing.assert_close(entropy, (probs * probs.clamp(min=1e-10).log()).sum(-1), atol=1e-6, rtol=0)
    assert bool((entropy <= 0).all())
    for filtering in (dict(top_k=1), dict(top_p=1e-6)):
        sampled, _ = dream_sample_tokens(logits, "entropy", temperature=1.5, **filtering)
        assert torch.equal(sampled, logits.argmax(-1))
    mask = int(logits[0].argmax())
    x0, confidence = dream_sample_tokens(logits, "maskgit_plus", mask_token_id=mask)
    assert not bool((x0 == mask).any())
    torch.testing.assert_close(confidence, probs.gather(-1, x0[:, None]).squeeze(-1))


def test_generate_blocks_yields_one_event_per_block(dream, prompts):
    run = dream.generate_blocks(torch.tensor([prompts[0]]), max_new_tokens=24, block_length=8, eos_early_stop=False)
    events = list(run)
    assert [event.block for event in events] == [0, 1, 2]
    assert [len(event.new_tokens()[0]) for event in events] == [8, 8, 8]


def test_hub_generation_config_of_dreams_own_code_loads(tmp_path):
    """The Hub's Dream checkpoints carry a generation_config.json written by Dream's `DreamGenerationConfig`
    (`output_history`, `num_return_sequences`): it loads, its sampler settings are read, and a value hf_dllm cannot
    honour is refused naming the field."""
    import json
    import shutil

    for name in ("config.json", "model.safetensors"):
        shutil.copy(DREAM / name, tmp_path / name)
    original = {
        "alg": "entropy",
        "alg_temp": 0.0,
        "eps": 0.001,
        "steps": 16,
        "max_new_tokens": 16,
        "output_history": False,
        "num_return_sequences": 1,
        "return_dict_in_generate": False,
        "temperature": 0.0,
        "transformers_version": "4.46.2",
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(original))
    model = DreamModel.from_pretrained(tmp_path).eval()
    config = model.generation_config
    assert (config.alg, config.steps, config.max_new_tokens, config.eps) == ("entropy", 16, 16, 0.001)
    (tmp_path / "generation_config.json").write_text(json.dumps({**original, "output_history": True}))
    with pytest.raises(ValueError, match="output_history"):
        DreamModel.from_pretrained(tmp_path)
