"""`hf-dllm export` of Dream (`model_type="Dream"`) checkpoints (the files and config.json every family exports alike:
test_dream_family.py): the generation_config.json the family table gives (Dream's own sampler by default, Fast-dLLM's
with `--generation-defaults fast`, a source's own settings kept, the original Dream code's generation_config.json
recognised and not read), the Dream model cards, the errors, and the exported repo loaded in a fresh process where
hf_dllm cannot be imported, generating exactly hf_dllm's tokens (Dream's algs, Fast-dLLM's caches and threshold,
sampling, padded batches, `diffusion_generate()`, recorded cases of Dream's reference code, the pipeline and the
card's own usage code). LLaDA's and LLaDA2.x's exports: `tests/hub/test_export.py`,
`tests/models/llada2/test_llada2_export.py`.
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_dllm
from hf_dllm.hub import cards, export
from hf_dllm.hub.cards import CARD_PRESETS
from hf_dllm.hub.export import export_checkpoint
from hf_dllm.hub.families import (
    MODEL_FAMILIES,
    ExportError,
)
from tests.conftest import FIXTURES, ROOT, export_to, save_checkpoint
from tests.hub.export_helpers import (
    assert_export_refused,
    assert_kept_settings_generate_alike,
    assert_padded_rows_alone,
    assert_pipeline_matches,
    assert_remote_loads,
    remote_tokens_are_hf_dllms,
    run_export_child,
    with_generation_config,
    written_fields,
)
from tests.models.dream.test_dream_generation import char_dream
from tests.models.dream.test_dream_reference import CASES as DREAM_REFERENCE_CASES
from tests.models.dream.test_dream_reference import generate_kwargs as reference_kwargs

DREAM_REF = FIXTURES / "dream-tiny-ref"
FAMILY = MODEL_FAMILIES["dream"]
DREAM_GENERATION_DEFAULTS = FAMILY.generation_defaults
DREAM_FAST_GENERATION_DEFAULTS = FAMILY.fast_generation_defaults
MASK, EOS, BOS = 3, 0, 1  # the character tokenizer's (EOS is also its pad)
# generation_config.json as the Hub's Dream checkpoints ship it: written by Dream's own `DreamGenerationConfig`
# (its class defaults, for its `diffusion_generate()`), with `output_history`, which hf_dllm does not have.
DREAM_HUB_GENERATION = {
    "_from_model_config": True,
    "alg": "origin",
    "alg_temp": None,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "eps": 0.001,
    "mask_token_id": None,
    "output_history": False,
    "pad_token_id": EOS,
    "steps": 512,
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
    "transformers_version": "4.46.2",
}
# A source's own hf_dllm settings: Dream's top-k margin on 8 steps in blocks of 8, no cache. Each differs from
# the family's defaults.
SOURCE_GENERATION = dict(
    max_new_tokens=16, block_length=8, steps=8, alg="topk_margin", use_cache=False, eos_early_stop=False
)
SOURCE_IDS = dict(mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=BOS)
PROMPT = [[BOS, 40, 41, 42, 43, 44, 45]]


def save_dream(path: Path, seed: int = 1, generation: dict | None = None, **fields) -> Path:
    """A tiny random Dream (vocabulary 103) with the character tokenizer. `generation`: the generation_config.json
    written as it is (None: none at all); `fields`: an hf_dllm generation config saved instead."""
    model = char_dream(seed)
    if fields:
        model.generation_config = hf_dllm.DiffusionGenerationConfig(**fields)
    save_checkpoint(model, path)
    if not fields:
        (path / "generation_config.json").unlink()
        if generation is not None:
            (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


@pytest.fixture(scope="module")
def dream_checkpoint(tmp_path_factory) -> Path:
    """As the Hub's Dream checkpoints are: config.json, weights, tokenizer, Dream's own generation_config.json."""
    return save_dream(tmp_path_factory.mktemp("dream-src") / "dream-chat", generation=DREAM_HUB_GENERATION)


@pytest.fixture(scope="module")
def exported_dream(tmp_path_factory, dream_checkpoint) -> Path:
    """Exported with the Dream-v0-Instruct-7B card and the default options."""
    return export_to(tmp_path_factory, "exported_dream", dream_checkpoint, card="dream-v0-instruct-7b")


@pytest.fixture(scope="module")
def exported_ref(tmp_path_factory) -> Path:
    """The Dream reference fixture (the Hub's config.json and weights, no tokenizer, no generation config)."""
    return export_to(tmp_path_factory, "exported_ref", DREAM_REF, tokenizer=False)


@pytest.fixture(scope="module")
def kept_source(tmp_path_factory) -> Path:
    return save_dream(tmp_path_factory.mktemp("dream-kept") / "dream-kept", seed=2, **SOURCE_GENERATION, **SOURCE_IDS)


@pytest.fixture(scope="module")
def exported_kept(tmp_path_factory, kept_source) -> Path:
    dst = tmp_path_factory.mktemp("dream-kept-export") / "exported_kept"
    export_checkpoint(kept_source, dst)
    return dst


# --- what the export holds ----------------------------------------------------------------------------------------


# --- generation_config.json ---------------------------------------------------------------------------------------


def test_dream_family_defaults_are_dreams_own_sampler_and_fast_is_fast_dllms():
    assert FAMILY.generation_defaults is DREAM_GENERATION_DEFAULTS
    assert FAMILY.fast_defaults is DREAM_FAST_GENERATION_DEFAULTS is MODEL_FAMILIES["llada"].fast_defaults
    own = DREAM_GENERATION_DEFAULTS
    assert (own["use_cache"], own["threshold"], own["steps"], own["eos_early_stop"]) == (False, None, None, False)
    assert own["block_length"] == own["max_new_tokens"] == 256 and "alg" not in own  # one block; alg None: entropy
    fast = DREAM_FAST_GENERATION_DEFAULTS
    assert (fast["use_cache"], fast["dual_cache"], fast["threshold"], fast["block_length"]) == (True, True, 0.9, 32)
    # The families without fast defaults of their own write the same with either choice.
    for name in ("llada", "llada2"):
        assert MODEL_FAMILIES[name].fast_defaults is MODEL_FAMILIES[name].generation_defaults


def test_dreams_own_generation_config_is_not_read_but_reported(exported_dream, dream_checkpoint, tmp_path, capsys):
    """The Hub's Dream checkpoints carry Dream's own generation_config.json (`output_history`, its class defaults:
    `alg="origin"`, `steps=512`): the family's defaults are written instead, with the special tokens of config.json,
    and the export says so."""
    written = written_fields(exported_dream)
    assert {key: written[key] for key in DREAM_GENERATION_DEFAULTS} == DREAM_GENERATION_DEFAULTS
    assert (written["alg"], written["steps"], written["eps"]) == (None, None, 1e-3)  # not the file's origin / 512
    assert (written["mask_token_id"], written["eos_token_id"], written["pad_token_id"]) == (MASK, EOS, EOS)
    assert written["bos_token_id"] == BOS and written["eot_token_id"] is None
    dst = tmp_path / "again"
    assert export.main([str(dream_checkpoint), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "generation_config.json (Dream):" in out
    assert re.search(r"^  block_length = 256 +<- the family's default$", out, re.M), out
    assert re.search(r"^  use_cache = False +<- the family's default$", out, re.M), out
    assert re.search(r"^  mask_token_id = 3 +<- SRC's config.json / tokenizer$", out, re.M), out
    assert "the original Dream code's generation config (it has ['output_history'])" in out
    assert written_fields(dst) == written


def test_no_source_generation_config_gives_the_family_defaults(exported_ref):
    written = written_fields(exported_ref)
    assert {key: written[key] for key in DREAM_GENERATION_DEFAULTS} == DREAM_GENERATION_DEFAULTS
    # special token ids from the Hub's config.json
    assert (written["mask_token_id"], written["eos_token_id"], written["bos_token_id"]) == (310, 301, 301)


def test_source_generation_config_is_kept(exported_kept, kept_source):
    assert written_fields(exported_kept) == written_fields(kept_source)
    written = written_fields(exported_kept)
    assert (written["alg"], written["steps"], written["block_length"], written["use_cache"]) == (
        "topk_margin",
        8,
        8,
        False,
    )
    card = (exported_kept / "README.md").read_text()
    assert '| `alg` | "topk_margin" |' in card and "| `steps` | 8 |" in card
    assert (
        'Dream\'s timestep schedule (`alg="topk_margin"`, `steps=8` in all) with no KV cache, greedy, in blocks of 8'
        in card
    )


def test_source_generation_config_is_read_once(kept_source, monkeypatch):
    """SRC's generation_config.json is read as JSON once: for whether it is Dream's own file and for the fields it
    sets (the origins `summary` reports), which come from that one read."""
    from hf_dllm.hub import generation_settings

    reads = []
    read = generation_settings.read_json_object
    monkeypatch.setattr(
        generation_settings, "read_json_object", lambda path, hint="": reads.append(path) or read(path, hint)
    )
    settings = generation_settings.resolve_generation_settings("dream", kept_source)
    assert reads == [kept_source / "generation_config.json"]
    set_by_source = set(json.loads((kept_source / "generation_config.json").read_text()))
    assert {name for name, origin in settings.origins.items() if origin == "source"} == set_by_source & set(
        settings.origins
    )


def test_fast_generation_defaults(exported_kept, kept_source, dream_checkpoint, tmp_path, capsys):
    dst = tmp_path / "fast"
    assert export.main([str(kept_source), str(dst), "--generation-defaults", "fast", "--max-new-tokens", "64"]) == 0
    written = written_fields(dst)
    assert {key: written[key] for key in DREAM_FAST_GENERATION_DEFAULTS} == {
        **DREAM_FAST_GENERATION_DEFAULTS,
        "max_new_tokens": 64,
    }
    assert written["alg"] is None and written["mask_token_id"] == MASK  # not the source's topk_margin
    out = capsys.readouterr().out
    assert re.search(r"^  threshold = 0\.9 +<- the family's default$", out, re.M), out
    assert re.search(r"^  max_new_tokens = 64 +<- option --max-new-tokens$", out, re.M), out
    card = (dst / "README.md").read_text()
    assert (
        "Fast-dLLM's threshold rule (`threshold=0.9`) with the dual cache, greedy, in blocks of 32: the fast " in card
    )
    # Dream's own generation_config.json is ignored by `fast` as well.
    export_checkpoint(dream_checkpoint, tmp_path / "fast_hub", generation_defaults="fast")
    assert written_fields(tmp_path / "fast_hub") == {**written, "max_new_tokens": 256}


def test_options_override_single_fields(kept_source, exported_ref, tmp_path):
    source = written_fields(kept_source)
    result = export_checkpoint(kept_source, tmp_path / "block4", block_length=4)
    assert written_fields(tmp_path / "block4") == {**source, "block_length": 4}
    assert result.generation.origins["alg"] == "source" and result.generation.origins["block_length"] == (
        "option --block-length"
    )
    # On the family's defaults (alg None) a threshold is Fast-dLLM's rule.
    export_checkpoint(DREAM_REF, tmp_path / "threshold", threshold=0.8, tokenizer=False)
    written = written_fields(tmp_path / "threshold")
    assert (written["threshold"], written["steps"], written["alg"]) == (0.8, None, None)
    model = hf_dllm.DreamModel.from_pretrained(tmp_path / "threshold").eval()
    assert type(model.diffusion_family.unmasking_policy(model.generation_config)).__name__ == "DreamThreshold"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # the source's alg="topk_margin" is a scheduled rule: a threshold contradicts it
        (dict(threshold=0.8), r"--threshold 0.8 on top of .*it contradicts `alg='topk_margin'`"),
        (dict(threshold=1.5), r"--threshold \(threshold=1.5\)"),
        (dict(block_length=0), r"--block-length \(block_length=0\)"),
        (
            dict(generation_defaults="slow"),
            r"--generation-defaults \(generation_defaults\) must be one of source, fast",
        ),
    ],
    ids=["threshold-vs-alg", "threshold-range", "block-length", "generation-defaults"],
)
def test_bad_options_are_refused(kept_source, tmp_path, kwargs, message):
    assert_export_refused(kept_source, tmp_path / "out", message, **kwargs)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"alg": "greedy"}, r"`alg` must be None or one of \('origin', 'maskgit_plus'"),
        ({"top_k": 0}, "`top_k` must be None or a positive integer"),
        ({"alg": "entropy", "threshold": 0.9}, "contradicts `alg='entropy'`"),
        ({"editing_threshold": 0.5}, "only supported by block-causal models"),
        ({"minimal_topk": 2}, "`minimal_topk` only applies to block-causal models"),
        ({"output_history": False, "alg": "greedy"}, None),  # Dream's own file: not read, so not refused
        ("{", "is not readable JSON"),
    ],
    ids=["alg", "top_k", "contradiction", "editing", "minimal_topk", "dream-file", "json"],
)
def test_invalid_source_generation_config_is_refused(kept_source, tmp_path, fields, message):
    src, dst = tmp_path / "src", tmp_path / "out"
    path = with_generation_config(kept_source, src, fields)
    if message is None:
        export_checkpoint(src, dst)
        assert written_fields(dst)["alg"] is None
        return
    error = assert_export_refused(src, dst, message)
    assert str(path) in str(error.value) and "--generation-defaults fast" in str(error.value)
    export_checkpoint(src, dst, generation_defaults="fast")  # the way out the message names
    assert written_fields(dst)["threshold"] == DREAM_FAST_GENERATION_DEFAULTS["threshold"]


# --- the model cards ----------------------------------------------------------------------------------------------


def test_dream_presets_have_committed_cards():
    """`test_export.test_committed_model_cards_are_the_rendered_template` covers every preset with a file: the Dream
    ones are among them."""
    dream = {name: preset for name, preset in CARD_PRESETS.items() if preset["family"] == "dream"}
    assert {name: preset["file"] for name, preset in dream.items()} == {
        "dream-v0-instruct-7b": "Dream-v0-Instruct-7B.md",
        "dream-coder-v0-instruct-7b": "Dream-Coder-v0-Instruct-7B.md",
        "generic-dream": "",
    }
    for name in ("dream-v0-instruct-7b", "dream-coder-v0-instruct-7b"):
        path = ROOT / "model_cards" / dream[name]["file"]
        assert path.read_text() == cards.render_preset_card(name)


def test_dream_card(exported_dream):
    card = (exported_dream / "README.md").read_text()
    assert card.startswith("---\nlicense: apache-2.0\nbase_model: Dream-org/Dream-v0-Instruct-7B\n")
    assert "{{" not in card and 'repo = "your-org/Dream-v0-Instruct-7B-hf-dllm"' in card
    # the usage through transformers: generate() with this repo's defaults and Fast-dLLM's, diffusion_generate()
    assert "AutoModel.from_pretrained(repo, trust_remote_code=True" in card
    assert "model.generate(input_ids, max_new_tokens=256)" in card
    assert 'alg="confidence_threshold",\n    threshold=0.9,\n    use_cache=True,' in card
    assert "model.diffusion_generate(" in card and 'alg="entropy", alg_temp=0.0, temperature=0.2, top_p=0.95' in card
    # the table and the sentence render what generation_config.json holds
    for row in ("| `alg` | None |", "| `block_length` | 256 |", "| `use_cache` | False |", "| `eps` | 0.001 |"):
        assert row in card, row
    assert "Dream's own sampler, as its `diffusion_generate()`" in card
    assert "Dream 7B: Diffusion Large Language Models" in card and "Fast-dLLM" in card
    assert not re.search(r"\d%", card)  # no benchmark figures
    coder = cards.render_preset_card("dream-coder-v0-instruct-7b")
    assert "base_model: Dream-org/Dream-Coder-v0-Instruct-7B" in coder and "license: other" in coder
    assert "Dream-Coder 7B: An Open Diffusion Language Model for Code" in coder and "temperature=0.1" in coder
    assert not re.search(r"\d%", coder)


@pytest.mark.parametrize(
    "card, message",
    [
        (
            "llada-8b-instruct",
            "describes a LLaDA model .* SRC is a Dream checkpoint .*choose one of generic, "
            "dream-coder-v0-instruct-7b, dream-v0-instruct-7b",
        ),
        ("dream-v0", "unknown model card 'dream-v0'"),
    ],
)
def test_card_of_another_family_is_refused(tmp_path, dream_checkpoint, card, message):
    """The message names the Dream cards to choose from (any other family's card: test_dream_family.py)."""
    assert_export_refused(dream_checkpoint, tmp_path / "out", message, card=card)


# --- SRC's config and weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sliding_window": True}, "not a Dream config hf_dllm can run.*use_sliding_window"),
        ({"num_key_value_heads": 3}, "not a Dream config hf_dllm can run.*num_key_value_heads"),
        ({"model_type": "dream"}, r"model_type 'dream'.*Dream \(Dream-org/Dream-v0-Instruct-7B"),
        ({"intermediate_size": 96}, r"mlp.gate_proj.weight is \[128, 64\], the config gives \[96, 64\]"),
    ],
    ids=["sliding-window", "kv-heads", "model-type", "shapes"],
)
def test_bad_dream_config_is_refused(tmp_path, change, message):
    src = tmp_path / "src"
    shutil.copytree(DREAM_REF, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    assert_export_refused(src, tmp_path / "out", message, tokenizer=False)


def test_dream_weights_are_verified_tied_or_not(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DREAM_REF, src)
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, src / "model.safetensors")
    with pytest.raises(ExportError, match="missing from the weights: lm_head.weight"):
        export_checkpoint(src, tmp_path / "out", tokenizer=False)
    # With tie_word_embeddings the head is the embedding: save_pretrained leaves it out.
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    export_checkpoint(src, tmp_path / "tied", tokenizer=False)
    tied = hf_dllm.DreamModel.from_pretrained(tmp_path / "tied")
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()


# --- a fresh process without hf_dllm ------------------------------------------------------------------------------

# Run after conftest's CHILD_PRELUDE (spec, out, record, expect_error, describe, no_hf_dllm, generate_cases).
CHILD = textwrap.dedent(
    r"""
    import re

    from transformers import AutoModel

    out["no_hf_dllm"] = no_hf_dllm()
    chat = spec["chat"]
    model = load_with_remote_code(chat, spec["cases"], spec["cases"][:2])

    def dream_entry_point():
        torch.manual_seed(0)
        result = model.diffusion_generate(torch.tensor(spec["prompt"]), **spec["dream_kwargs"])
        return {"sequences": result.sequences.tolist(), "nfe": result.nfe}

    record("diffusion_generate", dream_entry_point)
    prompt = torch.tensor(spec["prompt"])
    out["errors_validation"] = {
        name: expect_error(lambda kwargs=kwargs: model.generate(prompt, max_new_tokens=8, **kwargs))
        for name, kwargs in spec["bad"].items()
    }
    out["errors_validation"]["output_history"] = expect_error(
        lambda: model.diffusion_generate(prompt, max_new_tokens=8, output_history=True)
    )

    reference = AutoModel.from_pretrained(spec["reference"], trust_remote_code=True).eval()
    out["reference_model"] = describe(reference)
    record("tokens_reference", lambda: generate_cases(reference, spec["reference_cases"]))
    kept = AutoModel.from_pretrained(spec["kept"], trust_remote_code=True).eval()  # no kwargs: its generation_config.json
    record("tokens_kept", lambda: kept.generate(prompt).tolist())

    record("pipeline", lambda: run_pipeline(chat, spec["pipeline_settings"]))

    def run_card_usage():
        # The model card's usage code as a user would paste it, with this folder as the repo.
        card = (Path(chat) / "README.md").read_text()
        code = card.split("## Usage")[1].split("```python\n")[1].split("```")[0]
        code = re.sub(r'^repo = ".*"$', f"repo = {chat!r}", code, count=1, flags=re.M)
        printed = []
        exec(compile(code, "README.md", "exec"), {"print": lambda *args: printed.append(" ".join(map(str, args)))})
        return printed

    record("card_usage", run_card_usage)
    """
)


def chat_cases() -> list[dict]:
    """generate() calls on the tiny chat export (its generation_config.json: Dream's own sampler in one block):
    Dream's algs on its schedule, Fast-dLLM's caches with the threshold and the schedule, the factor rule, sampling
    (tokens and positions), `origin`, and a left-padded batch."""
    prompt = PROMPT
    padded = [[EOS, EOS, EOS, EOS, EOS, 30, 31, 32], [BOS, 50, 51, 52, 53, 54, 55, 56]]
    blocks = {"max_new_tokens": 16, "block_length": 8}
    return [
        {"name": "own_sampler", "input_ids": prompt, "kwargs": {"max_new_tokens": 24, "return_dict_in_generate": True}},
        {
            "name": "fast_dual_threshold",
            "input_ids": prompt,
            "kwargs": {"threshold": 0.7, "use_cache": True, "return_dict_in_generate": True, **blocks},
        },
        {
            "name": "prefix_maskgit",
            "input_ids": prompt,
            "kwargs": {"steps": 8, "alg": "maskgit_plus", "use_cache": True, "dual_cache": False, **blocks},
        },
        {"name": "factor", "input_ids": prompt, "kwargs": {"factor": 1.0, "use_cache": True, **blocks}},
        {
            "name": "sampling",
            "input_ids": prompt,
            "kwargs": {
                "max_new_tokens": 12,
                "steps": 6,
                "alg": "topk_margin",
                "alg_temp": 0.5,
                "temperature": 0.8,
                "top_p": 0.9,
                "top_k": 20,
            },
        },
        {"name": "origin", "input_ids": prompt, "kwargs": {"max_new_tokens": 12, "steps": 6, "alg": "origin"}},
        {
            "name": "padded",
            "input_ids": padded,
            "attention_mask": [[0] * 5 + [1] * 3, [1] * 8],
            "kwargs": {"steps": 8, "alg": "entropy", "return_dict_in_generate": True, **blocks},
        },
    ]


PIPELINE_SETTINGS = dict(max_new_tokens=12, block_length=4, steps=6, alg="maskgit_plus")
# Dream's own `diffusion_generate()` arguments (sampling, so the seed matters).
DREAM_KWARGS = dict(
    max_new_tokens=12, steps=6, alg="entropy", temperature=0.5, top_p=0.95, return_dict_in_generate=True
)
# generate() settings of other families, each a ValueError for Dream.
BAD_SETTINGS = {
    "remasking": {"remasking": "random"},
    "cfg_scale": {"cfg_scale": 1.0},
    "logits_eos_inf": {"logits_eos_inf": True},
    "minimal_topk": {"minimal_topk": 2},
    "editing": {"editing_threshold": 0.5},
    "num_beams": {"num_beams": 2},
    "alg": {"alg": "greedy"},
}
REFERENCE_CASE_NAMES = (
    "p12.dg.g16.s8.entropy",
    "b2.dg.g32.s16.topk_margin",
    "p12.blk.g16.prefix.t0.9",
    "p5.blk.g16.dual.s4",
)


def reference_cases() -> list[dict]:
    """Recorded cases of Dream's reference code (its `diffusion_generate()` and Fast-dLLM's cached block sampler)."""
    expected = load_file(DREAM_REF / "expected.safetensors")
    cases = []
    for case in DREAM_REFERENCE_CASES:
        if case["name"] in REFERENCE_CASE_NAMES:
            cases.append(
                {
                    "name": case["name"],
                    "input_ids": expected[f"prompt.{case['prompt']}"].tolist(),
                    "kwargs": reference_kwargs(case),
                    "expected": expected[f"case.{case['name']}"].tolist(),
                }
            )
    assert len(cases) == len(REFERENCE_CASE_NAMES)
    return cases


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory, exported_dream, exported_ref, exported_kept) -> dict:
    """Run CHILD once in a process where hf_dllm cannot be imported; return what it recorded."""
    root = tmp_path_factory.mktemp("dream-fresh")
    spec = {
        "chat": str(exported_dream),
        "reference": str(exported_ref),
        "kept": str(exported_kept),
        "cases": chat_cases(),
        "prompt": PROMPT,
        "dream_kwargs": DREAM_KWARGS,
        "bad": BAD_SETTINGS,
        "pipeline_settings": PIPELINE_SETTINGS,
        "reference_cases": [{k: v for k, v in case.items() if k != "expected"} for case in reference_cases()],
    }
    return run_export_child(root, CHILD, spec)


def test_remote_dream_loads_as_the_model_with_generate(fresh_process):
    assert assert_remote_loads(fresh_process, "dream", DREAM_GENERATION_DEFAULTS)["mask_token_id"] == MASK


def test_remote_dream_generates_hf_dllms_tokens(fresh_process, exported_dream):
    cases = chat_cases()
    model, expected = remote_tokens_are_hf_dllms(fresh_process["tokens"], hf_dllm.DreamModel, exported_dream, cases)
    assert fresh_process["tokens_causal"] == {case["name"]: expected[case["name"]] for case in cases[:2]}
    assert expected["own_sampler"]["nfe"] > 0 and expected["fast_dual_threshold"]["nfe"] > 0
    assert_padded_rows_alone(model, cases[-1], expected["padded"]["sequences"])
    torch.manual_seed(0)
    local = model.diffusion_generate(torch.tensor(PROMPT), **DREAM_KWARGS)
    assert fresh_process["diffusion_generate"] == {"sequences": local.sequences.tolist(), "nfe": local.nfe}


def test_remote_dream_reproduces_dreams_reference_code(fresh_process, exported_ref):
    cases = reference_cases()
    _, expected = remote_tokens_are_hf_dllms(fresh_process["tokens_reference"], hf_dllm.DreamModel, exported_ref, cases)
    for case in cases:
        assert expected[case["name"]]["sequences"] == case["expected"], case["name"]


def test_remote_dream_keeps_the_source_settings(fresh_process, kept_source):
    """The export of a checkpoint with its own settings, loaded without hf_dllm, generates with no arguments what the
    source's generate() does with none: 16 tokens in blocks of 8, top-k margin on 8 steps, no cache."""
    new = SOURCE_GENERATION["max_new_tokens"]
    assert_kept_settings_generate_alike(fresh_process["tokens_kept"], hf_dllm.DreamModel, kept_source, PROMPT, new)


def test_remote_dream_validates(fresh_process):
    errors = fresh_process["errors_validation"]
    expected = {
        "remasking": "`remasking='random'` is LLaDA's",
        "cfg_scale": "`cfg_scale` > 0 is not supported by Dream models",
        "logits_eos_inf": "`logits_eos_inf` is a LLaDA option",
        "minimal_topk": "`minimal_topk` only applies to block-causal models",
        "editing": "only supported by block-causal models",
        "num_beams": "unknown generation settings ['num_beams']",
        "alg": "`alg` must be None or one of",
        "output_history": "`output_history` is not supported",
    }
    for name, message in expected.items():
        assert errors[name] is not None and errors[name].startswith("ValueError") and message in errors[name], name


def test_remote_dream_pipeline_and_card_usage(fresh_process, exported_dream):
    assert_pipeline_matches(fresh_process["pipeline"], exported_dream, hf_dllm.DreamModel, **PIPELINE_SETTINGS)
    # The card's usage code ran as written: three generations, each printed.
    printed = fresh_process["card_usage"]
    assert len(printed) == 3 and all(isinstance(text, str) for text in printed)
