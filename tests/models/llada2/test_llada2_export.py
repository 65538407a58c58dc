"""`hf-dllm export` of LLaDA2.x (`model_type="llada2_moe"`) checkpoints (the files and config.json every family exports
alike: test_llada2_family.py): the generation_config.json the family table gives, the verification of tied and untied
weights, and the exported repo loaded in a fresh process where hf_dllm cannot be imported, generating exactly
hf_dllm's tokens (LLaDA2.0's `steps` with `threshold`, LLaDA2.1's token editing on the reference fixture, padded
batches, the pipeline, a streamer). LLaDA's export is unchanged: `tests/hub/test_export.py`.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_dllm
from hf_dllm.hub import export
from hf_dllm.hub.export import export_checkpoint
from hf_dllm.hub.families import MODEL_FAMILIES, ExportError
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer
from tests.conftest import FIXTURES, export_to, with_mask_id
from tests.hub.export_helpers import (
    assert_export_refused,
    assert_generation_config_file,
    assert_padded_rows_alone,
    assert_pipeline_matches,
    assert_remote_loads,
    remote_tokens_are_hf_dllms,
    run_export_child,
)
from tests.models.llada2.test_llada2_integration import tiny_llada2

LLADA21_REF = FIXTURES / "llada21-tiny-ref"
FAMILY = MODEL_FAMILIES["llada2"]
LLADA2_GENERATION_DEFAULTS = FAMILY.generation_defaults
MASK, EOS = 3, 0  # the character tokenizer's


def save_llada2(path: Path, seed: int = 1, tokenizer: bool = True, **overrides) -> Path:
    """A tiny random LLaDA2 (vocabulary 103) saved as a Hub checkpoint would be, with the character tokenizer."""
    tiny_llada2(seed=seed, **overrides).save_pretrained(path)
    if tokenizer:
        build_char_tokenizer().save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def llada2_checkpoint(tmp_path_factory) -> Path:
    return save_llada2(tmp_path_factory.mktemp("llada2-src") / "llada2-chat")


@pytest.fixture(scope="module")
def exported_llada2(tmp_path_factory, llada2_checkpoint) -> Path:
    """Exported with the LLaDA2.1-mini card and the family's default generation settings."""
    return export_to(tmp_path_factory, "exported_llada2", llada2_checkpoint, card="llada2.1-mini")


@pytest.fixture(scope="module")
def llada21_source(tmp_path_factory) -> Path:
    return with_mask_id(LLADA21_REF, tmp_path_factory.mktemp("llada21-src") / "llada21")


@pytest.fixture(scope="module")
def exported_llada21_ref(tmp_path_factory, llada21_source) -> Path:
    """`llada21_source` (the LLaDA2.1 fixture with its mask id) exported without a tokenizer."""
    source = llada21_source
    dst = tmp_path_factory.mktemp("llada21-export") / "exported_llada21"
    export_checkpoint(source, dst, tokenizer=False)
    return dst


# --- what the export holds ----------------------------------------------------------------------------------------


def test_llada2_generation_config_defaults(exported_llada2, exported_llada21_ref):
    assert LLADA2_GENERATION_DEFAULTS["threshold"] == 0.95 and LLADA2_GENERATION_DEFAULTS["steps"] is None
    defaults = hf_dllm.DiffusionGenerationConfig().to_dict()
    common = {key: defaults[key] for key in hf_dllm.DiffusionGenerationConfig.field_names() if key in defaults}
    expected = {
        **common,
        "max_new_tokens": 256,
        "block_length": 32,
        "threshold": 0.95,
        "steps": None,
        "eos_early_stop": True,
        "do_sample": False,
        "temperature": 0.0,
        "mask_token_id": MASK,
        "eos_token_id": EOS,
        "pad_token_id": 0,
        "bos_token_id": 1,
    }
    assert_generation_config_file(exported_llada2, expected)
    written = json.loads((exported_llada21_ref / "generation_config.json").read_text())
    assert (written["mask_token_id"], written["eos_token_id"], written["threshold"]) == (310, 301, 0.95)
    assert "eot_token_id" not in written  # LLaDA's <|eot_id|> lookup is LLaDA's


def test_llada2_export_options(tmp_path, llada2_checkpoint, capsys):
    """The options override the family's defaults; `--threshold none` writes no threshold."""
    dst = tmp_path / "options"
    argv = [str(llada2_checkpoint), str(dst), "--threshold", "none", "--block-length", "8", "--max-new-tokens", "24"]
    assert export.main(argv) == 0
    written = json.loads((dst / "generation_config.json").read_text())
    assert (written["max_new_tokens"], written["block_length"], written.get("threshold")) == (24, 8, None)
    card = (dst / "README.md").read_text()  # the generic LLaDA2 card, named after DST
    assert card.startswith("---\nlicense: other\n") and "# options" in card and "tags:\n- llada2" in card
    assert "one token per step (`threshold=None`" in card and "| `block_length` | 8 |" in card
    assert export.main([str(llada2_checkpoint), str(tmp_path / "t"), "--threshold", "0.8"]) == 0
    assert json.loads((tmp_path / "t" / "generation_config.json").read_text())["threshold"] == 0.8


def test_llada2_source_generation_config_is_kept(tmp_path):
    """LLaDA2's own rules hold for SRC's generation_config.json: `steps` with `threshold` and token editing, which
    LLaDA refuses, are kept; the export generates the source's tokens with no arguments."""
    src = save_llada2(tmp_path / "src")
    fields = dict(max_new_tokens=16, block_length=8, threshold=0.6, steps=4, mask_token_id=MASK, eos_token_id=EOS)
    hf_dllm.DiffusionGenerationConfig(**fields).save_pretrained(src)
    result = export_checkpoint(src, tmp_path / "kept")
    written = hf_dllm.DiffusionGenerationConfig.from_pretrained(tmp_path / "kept")
    assert (written.max_new_tokens, written.block_length, written.threshold, written.steps) == (16, 8, 0.6, 4)
    assert result.generation.origins["steps"] == "source" and "generation_config.json (LLaDA2.x):" in (
        result.generation.summary()
    )
    prompt = torch.tensor([[1, 40, 41, 42, 43]])
    source = hf_dllm.LLaDA2MoeModelLM.from_pretrained(src).eval().generate(prompt)
    exported = hf_dllm.LLaDA2MoeModelLM.from_pretrained(tmp_path / "kept").eval().generate(prompt)
    assert source.shape[1] == prompt.shape[1] + 16 and exported.tolist() == source.tolist()
    editing = dict(max_new_tokens=16, threshold=0.7, editing_threshold=0.5, mask_token_id=MASK, eos_token_id=EOS)
    hf_dllm.DiffusionGenerationConfig(**editing).save_pretrained(src)
    export_checkpoint(src, tmp_path / "editing")
    assert json.loads((tmp_path / "editing" / "generation_config.json").read_text())["editing_threshold"] == 0.5
    card = (tmp_path / "editing" / "README.md").read_text()
    assert "LLaDA2.1 token editing (`editing_threshold=0.5`, `threshold=0.7`" in card
    assert "| `editing_threshold` | 0.5 |" in card


def test_llada2_threshold_none_and_fast_defaults_over_a_source_config(tmp_path, capsys):
    src = save_llada2(tmp_path / "src", tokenizer=False)
    hf_dllm.DiffusionGenerationConfig(max_new_tokens=16, block_length=8, threshold=0.6, steps=4).save_pretrained(src)
    assert export.main([str(src), str(tmp_path / "none"), "--threshold", "none", "--no-tokenizer"]) == 0
    written = json.loads((tmp_path / "none" / "generation_config.json").read_text())
    assert (written["max_new_tokens"], written["block_length"], written.get("threshold"), written.get("steps")) == (
        16,
        8,
        None,
        None,
    )
    assert "one token per step (`threshold=None`" in (tmp_path / "none" / "README.md").read_text()
    assert "threshold = None" in capsys.readouterr().out
    export_checkpoint(src, tmp_path / "fast", generation_defaults="fast", tokenizer=False)
    written = json.loads((tmp_path / "fast" / "generation_config.json").read_text())
    assert {key: written.get(key) for key in LLADA2_GENERATION_DEFAULTS} == LLADA2_GENERATION_DEFAULTS


def test_llada2_card(exported_llada2):
    card = (exported_llada2 / "README.md").read_text()
    assert card.startswith("---\nlicense: apache-2.0\nbase_model: inclusionAI/LLaDA2.1-mini\n")
    assert "{{" not in card and "your-org/LLaDA2.1-mini-hf-dllm" in card
    assert "editing_threshold=0.5" in card and "max_post_steps=16" in card and "steps=128" in card
    assert "LLaDA2.0: Scaling Up Diffusion Language Models to 100B" in card and "@techreport" in card
    assert "arXiv" not in card and "| `threshold` | 0.95 |" in card


@pytest.mark.parametrize(
    "card, message",
    [
        ("nonsense", "unknown model card 'nonsense'"),
    ],
)
def test_llada2_card_of_another_family_is_refused(tmp_path, llada2_checkpoint, card, message):
    assert_export_refused(llada2_checkpoint, tmp_path / "out", message, card=card)
    assert_export_refused(
        FIXTURES / "llada-tiny-ref", tmp_path / "out", "describes a LLaDA2.x model", card="llada2.0-mini"
    )


def test_unknown_model_type_names_the_supported_ones(tmp_path):
    src = save_llada2(tmp_path / "src", tokenizer=False)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "bailing_moe"}))
    with pytest.raises(ExportError, match="model_type 'bailing_moe'") as error:
        export_checkpoint(src, tmp_path / "out")
    assert "LLaDA (GSAI-ML" in str(error.value) and "LLaDA2.x (inclusionAI" in str(error.value)
    (src / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(ExportError, match="not a LLaDA2.x config hf_dllm can run.*use_sliding_window"):
        export_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- verification of the weights: tied and untied -----------------------------------------------------------------


def test_tied_llada2_exports_with_or_without_the_head(tmp_path):
    """With `tie_word_embeddings`, `lm_head.weight` is the embedding: save_pretrained leaves it out, and a
    checkpoint that stores it anyway is accepted too (shape checked)."""
    src = save_llada2(tmp_path / "tied", tie_word_embeddings=True, tokenizer=False)
    assert "lm_head.weight" not in load_file(src / "model.safetensors")
    export_checkpoint(src, tmp_path / "out", tokenizer=False)
    loaded = hf_dllm.LLaDA2MoeModelLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.word_embeddings.weight.data_ptr()
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, "lm_head.weight": tensors["model.word_embeddings.weight"].clone()}, src / "model.safetensors")
    export_checkpoint(src, tmp_path / "out_with_head", tokenizer=False)
    save_file({**tensors, "lm_head.weight": torch.zeros(7, 48)}, src / "model.safetensors")
    with pytest.raises(ExportError, match=r"lm_head.weight is \[7, 48\], the config gives \[103, 48\]"):
        export_checkpoint(src, tmp_path / "out_bad_head", tokenizer=False)


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no-head", "missing from the weights: lm_head.weight"),
        ("wider-experts", r"experts.0.gate_proj.weight is \[24, 48\], the config gives \[32, 48\]"),
        ("fewer-experts", r"in the weights but not in a model of this config: model.layers.1.mlp.experts.4"),
    ],
)
def test_untied_llada2_weights_are_verified(tmp_path, breakage, message):
    src = save_llada2(tmp_path / "src", tokenizer=False)
    config = json.loads((src / "config.json").read_text())
    if breakage == "no-head":
        tensors = load_file(src / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, src / "model.safetensors")
    elif breakage == "wider-experts":
        (src / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 32}))
    elif breakage == "fewer-experts":
        (src / "config.json").write_text(json.dumps({**config, "num_experts": 4, "n_group": 2, "topk_group": 1}))
    assert_export_refused(src, tmp_path / "out", message, tokenizer=False)


# --- a fresh process without hf_dllm ------------------------------------------------------------------------------

# Run after conftest's CHILD_PRELUDE (spec, out, record, expect_error, describe, no_hf_dllm, generate_cases).
CHILD = textwrap.dedent(
    r"""
    from transformers import AutoModel, AutoTokenizer, TextIteratorStreamer

    out["no_hf_dllm"] = no_hf_dllm()
    chat, reference = spec["chat"], spec["reference"]
    model = load_with_remote_code(chat, spec["cases"], spec["cases"][:2])
    edited = AutoModel.from_pretrained(reference, trust_remote_code=True).eval()
    out["reference_model"] = describe(edited)
    record("tokens_reference", lambda: generate_cases(edited, spec["reference_cases"]))
    prompt = torch.tensor([[5, 6, 7]])
    out["errors_validation"] = {
        "steps_with_editing": expect_error(lambda: model.generate(prompt, editing_threshold=0.5, steps=8)),
        "factor_with_steps": expect_error(lambda: model.generate(prompt, factor=1.0, steps=8)),
    }

    record("pipeline", lambda: run_pipeline(chat, spec["pipeline_settings"]))

    def run_streamer():
        tokenizer = AutoTokenizer.from_pretrained(chat)
        encoded = tokenizer("Hello", return_tensors="pt")
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        result = model.generate(**encoded, streamer=streamer, max_new_tokens=12, block_length=4, threshold=0.6)
        text = tokenizer.decode(result[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
        return {"streamed": "".join(streamer), "decoded": text}

    record("streamer", run_streamer)
    """
)


PIPELINE_SETTINGS = dict(max_new_tokens=12, block_length=4, threshold=0.6)


def chat_cases() -> list[dict]:
    """generate() calls on the tiny chat model: its generation_config.json (threshold 0.95, blocks of 32), LLaDA2's
    `steps` with `threshold`, the schedule alone without a cache, token editing, a padded batch, sampling."""
    prompt = [1, 40, 41, 42, 43, 44, 45]
    short = {"max_new_tokens": 12, "block_length": 4}
    padded = [[0, 0, 0, 0, 0, 30, 31, 32], [1, 50, 51, 52, 53, 54, 55, 56]]
    return [
        {"name": "defaults", "input_ids": [prompt], "kwargs": {"max_new_tokens": 40, "return_dict_in_generate": True}},
        {
            "name": "steps_threshold",
            "input_ids": [prompt],
            "kwargs": {"threshold": 0.6, "steps": 6, "return_dict_in_generate": True, **short},
        },
        {
            "name": "schedule_no_cache",
            "input_ids": [prompt],
            "kwargs": {"threshold": None, "use_cache": False, "eos_early_stop": False, "minimal_topk": 2, **short},
        },
        {
            "name": "editing",
            "input_ids": [prompt],
            "kwargs": {
                "threshold": 0.5,
                "editing_threshold": 0.3,
                "max_post_steps": 2,
                "num_to_transfer": 2,
                "return_dict_in_generate": True,
                **short,
            },
        },
        {
            "name": "padded",
            "input_ids": padded,
            "attention_mask": [[0] * 5 + [1] * 3, [1] * 8],
            "kwargs": {"threshold": 0.7, "return_dict_in_generate": True, **short},
        },
        {"name": "sampling", "input_ids": [prompt], "kwargs": {"temperature": 0.8, **short}},
    ]


def reference_cases() -> list[dict]:
    """Three recorded LLaDA2.1 token-editing cases of the reference `generate()` (tests/fixtures/llada21-tiny-ref)."""
    from tests.models.llada2.test_llada2_generation import CASES21, generate_kwargs

    expected = load_file(LLADA21_REF / "expected.safetensors")
    cases = []
    for case in CASES21[:3]:
        prompt = expected[f"prompt.{case['prompt']}"]
        kwargs = generate_kwargs(case, prompt.shape[1])
        cases.append(
            {
                "name": case["name"],
                "input_ids": prompt.tolist(),
                "kwargs": kwargs,
                "expected": expected[f"case.{case['name']}"].tolist(),
            }
        )
    return cases


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory, exported_llada2, exported_llada21_ref) -> dict:
    """Run CHILD once in a process where hf_dllm cannot be imported; return what it recorded."""
    root = tmp_path_factory.mktemp("llada2-fresh")
    spec = {
        "chat": str(exported_llada2),
        "reference": str(exported_llada21_ref),
        "cases": chat_cases(),
        "pipeline_settings": PIPELINE_SETTINGS,
        "reference_cases": [{k: v for k, v in case.items() if k != "expected"} for case in reference_cases()],
    }
    return run_export_child(root, CHILD, spec)


@pytest.mark.slow
def test_remote_llada2_loads_as_the_lm_with_diffusion_generate(fresh_process):
    assert_remote_loads(fresh_process, "llada2", LLADA2_GENERATION_DEFAULTS)
    errors = fresh_process["errors_validation"]
    assert "`steps` must be None with `editing_threshold`" in errors["steps_with_editing"]
    assert "`steps` must be None with `factor`" in errors["factor_with_steps"]


@pytest.mark.slow
def test_remote_llada2_generates_generate_cases(fresh_process, exported_llada2, exported_llada21_ref):
    cases = chat_cases()
    model, expected = remote_tokens_are_hf_dllms(
        fresh_process["tokens"], hf_dllm.LLaDA2MoeModelLM, exported_llada2, cases
    )
    assert fresh_process["tokens_causal"] == {case["name"]: expected[case["name"]] for case in cases[:2]}
    assert expected["editing"]["nfe"] > 0 and expected["steps_threshold"]["nfe"] <= 6
    assert_padded_rows_alone(model, cases[4], expected["padded"]["sequences"])


@pytest.mark.slow
def test_remote_llada21_editing_matches_hf_dllm_and_the_reference(fresh_process, exported_llada21_ref):
    cases = reference_cases()
    reference_tokens = fresh_process["tokens_reference"]
    _, expected = remote_tokens_are_hf_dllms(reference_tokens, hf_dllm.LLaDA2MoeModelLM, exported_llada21_ref, cases)
    for case in cases:
        assert case["kwargs"]["editing_threshold"] is not None
        generated = expected[case["name"]]["sequences"][0][len(case["input_ids"][0]) :]
        reference = case["expected"][0]
        assert generated[: len(reference)] == reference, case["name"]


@pytest.mark.slow
def test_remote_llada2_pipeline_and_streamer(fresh_process, exported_llada2):
    remote = fresh_process["pipeline"]
    local = assert_pipeline_matches(remote, exported_llada2, hf_dllm.LLaDA2MoeModelLM, **PIPELINE_SETTINGS)
    streamed = fresh_process["streamer"]
    assert streamed["streamed"] == streamed["decoded"] == local[len("Hello") :]
