"""LLaDA2.2 (Levenshtein editing, `levenshtein_editing.py`) through the applications: `pipeline("text-generation")`
(chat messages, batches equal single calls), `hf-dllm eval` and the lm-eval model, and FP8 weights on the CPU
(the family's skip list). Never a DELETE or SPLIT token in what they return. The HTTP server:
test_llada22_serve.py.

`tiny_llada22` is a tiny random LLaDA2.2 sized for the character tokenizer, its DELETE / SPLIT ids two characters
the tests never prompt with; their output rows are scaled so that the model proposes them often: each test also
checks that DELETE and SPLIT were written (the rule consumed them), else "none in the output" would prove nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import pipeline

from hf_dllm import left_pad
from hf_dllm.evaluation import evaluate
from hf_dllm.levenshtein_editing import LevenshteinEditing
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer
from tests.conftest import random_weights_model, save_checkpoint
from tests.evaluation.eval_helpers import (
    QUESTIONS,
    assert_eval_equals_generate,
    assert_responses_are,
    chat_prompt_ids,
    eval_direct,
    load_checkpoint,
    run_lm_eval,
)
from tests.models.llada2.test_llada2_integration import tiny_llada2, tiny_llada2_config

DELETE_TEXT, SPLIT_TEXT = "{", "}"  # characters whose ids are the edit tokens (never in a prompt here)
_TOKENIZER = build_char_tokenizer()
DELETE, SPLIT = _TOKENIZER.convert_tokens_to_ids(DELETE_TEXT), _TOKENIZER.convert_tokens_to_ids(SPLIT_TEXT)
# LLaDA2.2's own fields: Levenshtein editing at SGLang's default editing threshold 0 (edit wherever the prediction
# differs) with two post-edit steps.
SETTINGS = dict(max_new_tokens=8, block_length=4, threshold=0.6, editing_threshold=0.0, max_post_steps=2)


def tiny_llada22(seed: int = 4) -> torch.nn.Module:
    """`tiny_llada2(seed)` with `delete_token_id` / `split_token_id` (a LLaDA2.2 checkpoint's config fields): the
    `llada2.2` family. The DELETE / SPLIT rows of the output head are doubled so that edits happen often."""
    model = tiny_llada2(seed=seed, delete_token_id=DELETE, split_token_id=SPLIT)
    with torch.no_grad():
        model.lm_head.weight[[DELETE, SPLIT]] *= 2.0
    assert model.diffusion_family.name == "llada2.2"
    return model


def edit_totals(model, prompts: list[list[int]], **settings) -> dict[str, int]:
    """DELETE / SPLIT tokens the rule consumed decoding `prompts` (one left-padded batch) with `settings`; asserts
    that none is left in the output."""
    ids, mask = left_pad(prompts, model.config.pad_token_id)
    run = model.generate_blocks(ids, attention_mask=mask, **settings)
    for _ in run:
        pass
    assert isinstance(run.unmasking, LevenshteinEditing)
    assert not torch.isin(run.sequences[:, ids.shape[1] :], torch.tensor([DELETE, SPLIT])).any()
    return run.unmasking.totals()


def assert_edits_made(totals: dict[str, int]) -> None:
    assert totals["deletes"] > 0 and totals["splits"] > 0, totals


def assert_no_edit_text(*texts: str) -> None:
    for text in texts:
        assert DELETE_TEXT not in text and SPLIT_TEXT not in text, text


@pytest.fixture(scope="module")
def model():
    return tiny_llada22()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model) -> Path:
    return save_checkpoint(model, tmp_path_factory.mktemp("llada22-apps") / "model")


# ----- pipeline("text-generation") -----


def test_pipeline_chat_and_text_batches_equal_single_calls(model, char_tokenizer):
    """Chat messages and plain prompts of different lengths, batched and one by one: the same texts, each the
    direct generate()'s, with no DELETE / SPLIT text although both were written while decoding them."""
    pipe = pipeline("text-generation", model=model, tokenizer=char_tokenizer)
    settings = dict(max_new_tokens=12, block_length=4, threshold=0.6)
    chats = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Good morning, world"}]]
    texts = ["The cat sat", "abc"]
    batched = pipe(chats, batch_size=2, **settings) + pipe(texts, batch_size=2, **settings)
    singles = [pipe(prompt, **settings) for prompt in [*chats, *texts]]
    assert [b[0]["generated_text"] for b in batched] == [s[0]["generated_text"] for s in singles]
    replies = [s[0]["generated_text"][-1] for s in singles[:2]]
    assert [reply["role"] for reply in replies] == ["assistant", "assistant"]
    prompts = [chat_prompt_ids(char_tokenizer, chat[0]["content"]) for chat in chats]
    prompts += [char_tokenizer(text)["input_ids"] for text in texts]
    directs = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), **settings)
        directs.append(char_tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    assert [reply["content"] for reply in replies] == directs[:2]
    assert [s[0]["generated_text"] for s in singles[2:]] == [t + d for t, d in zip(texts, directs[2:], strict=True)]
    assert_no_edit_text(*directs)
    assert_edits_made(edit_totals(model, prompts, **settings))


# ----- hf-dllm eval and lm-eval -----


def test_hf_dllm_eval_runs_llada22(checkpoint, tmp_path):
    """`hf-dllm eval` with LLaDA2.2's fields: each prediction and NFE is a direct generate()'s, the fields reach the
    summary, and a setting the rule cannot honour (`steps`) is refused before any work (exit 2)."""
    model, tokenizer = load_checkpoint(checkpoint)
    options = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    args, summary = assert_eval_equals_generate(checkpoint, model, tokenizer, tmp_path, SETTINGS, options)
    config = summary["generation_config"]
    assert (config["editing_threshold"], config["max_post_steps"]) == (0.0, 2)
    predictions = (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()
    assert_no_edit_text(*(json.loads(line)["prediction"] for line in predictions))
    assert_edits_made(edit_totals(model, [chat_prompt_ids(tokenizer, q) for q in QUESTIONS], **SETTINGS))
    refused = [*args, "--output-dir", str(tmp_path / "refused"), *options, "--steps", "8"]
    assert evaluate.main(refused) == 2 and not (tmp_path / "refused" / "summary.json").exists()


def test_lm_eval_runs_llada22(checkpoint):
    pytest.importorskip("lm_eval")
    from hf_dllm.evaluation.lm_eval_model import DiffusionEvalLM

    model, tokenizer = load_checkpoint(checkpoint)
    model_args = ",".join(f"{'gen_length' if k == 'max_new_tokens' else k}={v}" for k, v in SETTINGS.items())
    results = run_lm_eval(checkpoint, f"dtype=float32,{model_args}", ["hf_dllm_tiny_gen"], batch_size=3, limit=3)
    samples = results["samples"]["hf_dllm_tiny_gen"]
    assert len(samples) == 3
    assert_responses_are(
        samples,
        tokenizer,
        lambda ids, gen_kwargs: eval_direct(model, tokenizer, ids, gen_kwargs["until"], **SETTINGS)[0],
    )
    assert_no_edit_text(*(sample["resps"][0][0] for sample in samples))
    contexts = [tokenizer(s["arguments"][0][0], add_special_tokens=False)["input_ids"] for s in samples]
    assert_edits_made(edit_totals(model, contexts, **SETTINGS))

    lm = DiffusionEvalLM(pretrained=model, tokenizer=tokenizer, device="cpu", editing_threshold=0.0, max_post_steps=0)
    assert (lm.base_config.editing_threshold, lm.base_config.max_post_steps) == (0.0, 0)
    with pytest.raises(ValueError, match="num_to_transfer"):  # LLaDA2.1's pace, which LLaDA2.2's rule has not
        DiffusionEvalLM(pretrained=model, tokenizer=tokenizer, device="cpu", num_to_transfer=2)


# ----- the serving engine: rows of one setting sharing layouts -----


@pytest.mark.parametrize("use_cache", [True, False], ids=["exact_cache", "no_cache"])
def test_engine_rows_joining_running_ones_equal_generate_alone(model, use_cache):
    """Rows of different prompt lengths with the same settings share the engine's layouts, joining at different
    block boundaries: a block's first step then decides the joining rows apart from the continuing ones (and packs
    rows without their padding rows); each row's per-row editing state follows it, so each gets the tokens and
    forwards of `generate()` alone, edits included."""
    from hf_dllm.serving.engine import ContinuousBatcher
    from tests.serving.test_engine import assert_alone, drive, request

    settings = dict(max_new_tokens=12, block_length=4, threshold=0.6, max_post_steps=2, use_cache=use_cache)
    prompts = [[1, 30, 31], [1, 50, 51, 52, 53, 54], [1, 40], [1, 60, 61, 62, 63, 64, 65, 66, 67]]
    requests = [request(model, prompt, eos_token_id=0, **settings) for prompt in prompts]
    drive(ContinuousBatcher(model, max_batch_size=4), requests, [0, 0, 1, 2])
    assert_alone(model, requests)
    assert_edits_made(edit_totals(model, prompts, **settings))


# ----- settings: LLaDA2.2 always edits -----


def test_max_post_steps_needs_editing_threshold_only_where_editing_is_optional(model):
    """LLaDA2.2 edits whatever the settings (`editing_threshold` unset: 0.0), so `max_post_steps` alone is its
    post-edit budget (same run as with `editing_threshold=0.0`); LLaDA2.0 / 2.1 refuse it without editing."""
    prompt = torch.tensor([[1, 40, 41, 42, 43]])
    settings = dict(max_new_tokens=8, block_length=4, threshold=0.6, return_dict_in_generate=True)
    alone = model.generate(prompt, max_post_steps=0, **settings)
    explicit = model.generate(prompt, max_post_steps=0, editing_threshold=0.0, **settings)
    assert torch.equal(alone.sequences, explicit.sequences) and alone.nfe == explicit.nfe
    assert model.generate(prompt, max_post_steps=16, **settings).nfe > alone.nfe  # the budget is used
    with pytest.raises(ValueError, match="max_post_steps"):
        tiny_llada2(seed=1).generate(prompt, max_post_steps=0, **settings)


# ----- FP8 weights on the CPU -----


@pytest.fixture
def cpu_quantization(monkeypatch):
    # transformers quantizes on CUDA/XPU only; its quantization math is plain torch, so the CPU tests lift the check.
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)


FP8_MASK, FP8_EOS, FP8_DELETE, FP8_SPLIT = 310, 301, 314, 315  # the reference fixture's ids


def fp8_llada22(device: str):
    """A LLaDA2.2 whose projections are whole 128 x 128 FP8 blocks (random bf16 weights), loaded on `device` with
    `fp8_quantization_config` of its family; its DELETE / SPLIT head rows doubled (edits happen often)."""
    import hf_dllm
    from hf_dllm import fp8

    config = tiny_llada2_config(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        moe_intermediate_size=128,
        mask_token_id=FP8_MASK,
        eos_token_id=FP8_EOS,
        pad_token_id=FP8_EOS,
        bos_token_id=None,
        delete_token_id=FP8_DELETE,
        split_token_id=FP8_SPLIT,
    )
    source = random_weights_model(hf_dllm.LLaDA2MoeModelLM, config, dtype=torch.bfloat16, noise=0.05)
    family = source.diffusion_family
    assert family.name == "llada2.2" and family.fp8_modules_to_not_convert == ("lm_head", r".*\.experts$")
    quantized = hf_dllm.LLaDA2MoeModelLM.from_pretrained(
        None,
        config=source.config,
        state_dict=source.state_dict(),
        quantization_config=fp8.fp8_quantization_config(family),
        dtype=torch.bfloat16,
        device_map=device,
    ).eval()
    with torch.no_grad():
        quantized.lm_head.weight[[FP8_DELETE, FP8_SPLIT]] *= 2.0
    return quantized


FP8_PROMPTS = [[7, 8, 9, 17, 42], [50, 51, 52, 53, 54, 55, 56, 57, 58]]
FP8_SETTINGS = dict(max_new_tokens=12, block_length=4, threshold=0.7, mask_token_id=FP8_MASK, eos_token_id=FP8_EOS)


def fp8_batch(quantized, **settings) -> torch.Tensor:
    """`FP8_PROMPTS` decoded in one left-padded batch: the generated part `(2, 12)`, after checking that DELETE and
    SPLIT were written and that no MASK, DELETE or SPLIT is left."""
    ids, attention = left_pad(FP8_PROMPTS, FP8_EOS)
    device = quantized.device
    run = quantized.generate_blocks(ids.to(device), attention_mask=attention.to(device), **FP8_SETTINGS, **settings)
    for _ in run:
        pass
    assert_edits_made(run.unmasking.totals())
    generated = run.sequences[:, ids.shape[1] :].cpu()
    assert not torch.isin(generated, torch.tensor([FP8_MASK, FP8_DELETE, FP8_SPLIT])).any()
    return generated


def test_fp8_weights_generate_without_edit_tokens(cpu_quantization):
    """Attention, dense MLP and every expert in FP8; the family's skips (output head, the `experts` list kept as
    the Hub's per-expert layers) and the router in bf16; a batch of two prompt lengths decodes with edits, no
    MASK / DELETE / SPLIT id in the output, each row what it gets alone."""
    from hf_dllm import fp8

    quantized = fp8_llada22("cpu")
    moe = quantized.model.layers[1].mlp
    assert isinstance(moe.experts, torch.nn.ModuleList) and fp8.is_fp8_linear(moe.experts[5].down_proj)
    for layer in (quantized.model.layers[0].attention.query_key_value, quantized.model.layers[0].mlp.up_proj):
        assert fp8.is_fp8_linear(layer), layer
    assert moe.gate.weight.dtype == quantized.lm_head.weight.dtype == torch.bfloat16
    generated = fp8_batch(quantized)
    for row, prompt in enumerate(FP8_PROMPTS):
        alone = quantized.generate(torch.tensor([prompt]), **FP8_SETTINGS)
        assert torch.equal(generated[row], alone[0, len(prompt) :]), row


# ----- on CUDA (run by hand on a GPU machine: `-m gpu`) -----


@pytest.mark.gpu
def test_gpu_fp8_weights_generate_without_edit_tokens():
    """FP8 weights on CUDA (the grouped FP8 expert kernels, the fused Levenshtein step): edits, no MASK / DELETE /
    SPLIT in the output, and the CUDA-graph run's tokens those of the eager run."""
    quantized = fp8_llada22("cuda")
    assert torch.equal(fp8_batch(quantized), fp8_batch(quantized, disable_compile=True))


@pytest.mark.gpu
def test_gpu_engine_graphs_equal_eager_engine_and_generate():
    """The serving engine on CUDA with LLaDA2.2 rows of one setting joining running ones (the partial first steps
    whose editing state `rows_only` keeps apart), twice (the second run replays the captured graphs): the tokens and
    forwards of the eager engine and, in float32, of `generate()` alone."""
    from tests.serving.test_engine_gpu import assert_equals_eager_engine_and_generate, decode

    model = tiny_llada22().cuda()
    prompts = [[1, 30, 31], [1, 50, 51, 52, 53, 54], [1, 40], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 70, 71, 72]]
    arrivals = [0, 0, 1, 2, 2]
    settings = dict(max_new_tokens=16, block_length=4, threshold=0.6, max_post_steps=2, eos_token_id=0)
    for _ in range(2):
        graphs, graph_nfe, _ = decode(model, prompts, arrivals, settings)
    assert_equals_eager_engine_and_generate(model, prompts, arrivals, settings, graphs, graph_nfe, torch.float32)
    assert_no_edit_text(*(_TOKENIZER.decode(tokens) for tokens in graphs))
