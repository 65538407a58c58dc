"""DiffusionGemma's settings and inputs: transformers' argument forms accepted, bad values and other families'
fields refused before any forward, its fields refused by other families; streamers get one canvas at a time."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import FIXTURES, reference_fixtures

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"
CASES = {case["name"]: case for case in json.loads((GEMMA_DIR / "cases.json").read_text())["cases"]}


gemma, expected = reference_fixtures(GEMMA_DIR)


def test_transformers_sampler_config_object_and_canvas_rounding(gemma, expected):
    """`sampler_config=EntropyBoundSamplerConfig(...)` (transformers' object) works as its dict, and
    `max_new_tokens=24` decodes two whole canvases (32 tokens), as transformers."""
    reference = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")  # >= 5.24
    EntropyBoundSamplerConfig = reference.EntropyBoundSamplerConfig
    case = CASES["p5.g24.eb05.s2"]
    kwargs = {**case["kwargs"], "sampler_config": EntropyBoundSamplerConfig(entropy_bound=0.5)}
    torch.manual_seed(case["seed"])
    out = gemma.generate(expected["prompt.p5"], **kwargs)
    assert out.sequences.shape[1] == 5 + 32
    assert torch.equal(out.sequences, expected[f"case.{case['name']}"])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"threshold": 0.9}, "LLaDA / Fast-dLLM"),
        ({"steps": 8}, "LLaDA / Fast-dLLM"),
        ({"temperature": 0.5}, "LLaDA / Fast-dLLM"),
        ({"alg": "entropy"}, "Dream"),
        ({"sampler_config": {"entropy_bound": -1.0}}, "entropy_bound"),
        ({"sampler_config": {"top_k": 3}}, "sampler_config"),
        ({"t_min": 0.9, "t_max": 0.5}, "t_max"),
        ({"max_denoising_steps": 0}, "max_denoising_steps"),
        ({"stability_threshold": -1}, "stability_threshold"),
        ({"confidence_threshold": 0.0}, "confidence_threshold"),
        ({"block_length": 8}, "canvas_length"),
        ({"pixel_values": torch.zeros(1, 3, 8, 8)}, "text only"),
    ],
)
def test_bad_settings_refused(gemma, expected, fields, message):
    with pytest.raises(ValueError, match=message):
        gemma.generate(expected["prompt.p5"], max_new_tokens=16, **fields)


def test_gemma_fields_refused_by_other_families(reference_model):
    with pytest.raises(ValueError, match="DiffusionGemma"):
        reference_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, block_length=8, max_denoising_steps=4)


def test_streamer_gets_each_canvas_when_accepted(gemma, expected):
    """A streamer receives the prompt, then each canvas (16 tokens) as it is committed, then `end()`; a draft
    streamer also sees every step's argmax canvas; the streamed tokens are the returned ones."""
    puts, drafts, ended = [], [], []

    class Streamer:
        def put(self, value):
            puts.append(value.clone())

        def put_draft(self, value):
            drafts.append(value.clone())

        def end(self):
            ended.append(True)

    case = CASES["p11.g32.eb05.s1"]
    torch.manual_seed(case["seed"])
    out = gemma.generate(expected["prompt.p11"], streamer=Streamer(), **case["kwargs"])
    assert [tuple(put.shape) for put in puts] == [(1, 11), (1, 16), (1, 16)]
    assert torch.equal(torch.cat(puts, dim=1), out.sequences)
    assert len(drafts) == case["nfe"] and all(draft.shape == (1, 16) for draft in drafts)
    assert ended == [True]


def test_pipeline_chat(gemma, char_tokenizer):
    """`pipeline("text-generation")` with chat messages: the pipeline's call is the model's `generate()` on the
    chat template's tokens (same seed, same text)."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=gemma, tokenizer=char_tokenizer)
    messages = [{"role": "user", "content": "Hi"}]
    settings = dict(max_new_tokens=16, max_denoising_steps=4)
    torch.manual_seed(0)
    result = pipe(messages, **settings)
    reply = result[0]["generated_text"][-1]
    assert reply["role"] == "assistant"
    encoded = char_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    torch.manual_seed(0)
    out = gemma.generate(**encoded, **settings)
    generated = out.sequences[0, encoded["input_ids"].shape[1] :]
    assert reply["content"] == char_tokenizer.decode(generated, skip_special_tokens=True)


def test_lm_eval_generate_until(gemma, char_tokenizer):
    """lm-eval's adapter: `generate_until` runs DiffusionGemma's sampler (its fields as model_args), cut at
    `until`; the LLaDA Monte-Carlo log-likelihood is refused with a clear error."""
    pytest.importorskip("lm_eval")
    from hf_dllm.evaluation.lm_eval_model import DiffusionEvalLM

    class Request:
        def __init__(self, *args):
            self.args = args

    lm = DiffusionEvalLM(
        pretrained=gemma, tokenizer=char_tokenizer, device="cpu", batch_size=2, threads=1, max_denoising_steps=4
    )
    assert lm.base_config.max_denoising_steps == 4
    outputs = lm.generate_until(
        [
            Request("add 1+2", {"until": ["b"], "max_gen_toks": 20}),
            Request("copy", {"max_gen_toks": 8, "do_sample": False}),
        ],
        disable_tqdm=True,
    )
    assert len(outputs) == 2 and all(isinstance(text, str) for text in outputs)
    assert "b" not in outputs[0]
    with pytest.raises(ValueError, match="LLaDA / Fast-dLLM"):
        lm.generate_until([Request("x", {"threshold": 0.9})], disable_tqdm=True)
    with pytest.raises(NotImplementedError, match="DiffusionGemma"):
        lm.loglikelihood([Request("a", "b")], disable_tqdm=True)


def test_block_events_per_canvas(gemma, expected):
    """`generate_blocks()` yields one `BlockEvent` per canvas (its 16 tokens per row), and a row that ends at an
    EOS is reported ended while it stays in the batch; the run's sequences are `generate()`'s."""
    case = CASES["b2.g32.eos.s3"]
    kwargs = {**case["kwargs"], "attention_mask": expected["attention_mask.b2"]}
    torch.manual_seed(case["seed"])
    run = gemma.generate_blocks(expected["prompt.b2"], **kwargs)
    events = [(event.block, [len(tokens) for tokens in event.new_tokens()], event.ended.tolist()) for event in run]
    reference = expected[f"case.{case['name']}"]
    canvases = (reference.shape[1] - 13) // 16
    assert [block for block, _, _ in events] == list(range(canvases))
    assert all(lengths == [16, 16] for _, lengths, _ in events)
    assert events[-1][2] == [True, True]
    assert torch.equal(run.sequences[:, : reference.shape[1]], reference)
