"""`hf-dllm export`: the exported Hub repo, its remote code, and loading it where hf_dllm is not installed.

No drift: nothing generated is committed except the model cards. Instead the tests check that (1) every exported
`.py` file is byte-identical to the package's file and the set of them is exactly `REMOTE_CODE_FILES`,
(2) `config.json` and `generation_config.json` are exactly what the exporter's documented rules give, recomputed
here independently, (3) exporting twice gives identical folders, (4) `model_cards/<card>.md` equals the template
rendered with its preset, and (5) in a fresh process where `import hf_dllm` fails, the export loads through
transformers' remote-code loader (local folder and Hub cache), generates the same tokens as hf_dllm, and each
exported module imports on its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hf_dllm
from hf_dllm.hub import cards, export
from hf_dllm.hub.cards import CARD_PRESETS
from hf_dllm.hub.export import check_remote_code, export_checkpoint
from hf_dllm.hub.families import FAST_GENERATION_DEFAULTS, MODEL_FAMILIES, ExportError
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer
from tests import conftest
from tests.conftest import (
    FIXTURES,
    REFERENCE_DIR,
    ROOT,
    export_to,
    generate_cases,
    run_without_hf_dllm,
    save_checkpoint,
    tiny_model,
)
from tests.hub.export_helpers import (
    assert_generation_config_file,
    assert_kept_settings_generate_alike,
    assert_pipeline_matches,
    assert_remote_model,
    with_generation_config,
    written_fields,
)

REMOTE_CODE_FILES = MODEL_FAMILIES["llada"].remote_code_files
AUTO_MAP = MODEL_FAMILIES["llada"].auto_map

PACKAGE_DIR = Path(hf_dllm.__file__).parent
MODEL_CARDS_DIR = ROOT / "model_cards"
TOKENIZER_SAVED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
HUB_REPO = "hf-dllm-test/llada-tiny"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


# --- the export ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The reference fixture (Hub format, no tokenizer) exported with the default options."""
    return export_to(tmp_path_factory, "exported", REFERENCE_DIR, tokenizer=False)


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> Path:
    """A tiny random LLaDA (vocabulary 103) saved with the character tokenizer, as a Hub checkpoint would be."""
    src = tmp_path_factory.mktemp("chat-src") / "llada-chat"
    tiny_model(seed=1).save_pretrained(src)
    build_char_tokenizer().save_pretrained(src)
    (src / "generation_config.json").unlink(missing_ok=True)  # not part of the LLaDA Hub format
    return src


@pytest.fixture(scope="module")
def exported_chat(tmp_path_factory, chat_checkpoint) -> Path:
    dst = tmp_path_factory.mktemp("export-chat") / "exported_chat"
    export_checkpoint(chat_checkpoint, dst, card="llada-8b-instruct", max_new_tokens=24, block_length=8)
    return dst


# The source's own generation_config.json: blocks of 8, 16 tokens, LLaDA's fixed schedule (8 steps) with the prefix
# cache, two EOS ids. Every one of these differs from the family's defaults.
SOURCE_GENERATION = dict(max_new_tokens=16, block_length=8, threshold=None, steps=8, dual_cache=False)
SOURCE_IDS = dict(mask_token_id=3, eos_token_id=[0, 2], pad_token_id=0, bos_token_id=1)


def save_with_generation_config(path: Path, model, **fields) -> Path:
    """`model` saved with the character tokenizer and a generation_config.json holding `fields`."""
    model.generation_config = hf_dllm.DiffusionGenerationConfig(**fields)
    return save_checkpoint(model, path)


@pytest.fixture(scope="module")
def kept_source(tmp_path_factory) -> Path:
    return save_with_generation_config(
        tmp_path_factory.mktemp("kept-src") / "llada-kept", tiny_model(seed=2), **SOURCE_GENERATION, **SOURCE_IDS
    )


@pytest.fixture(scope="module")
def exported_kept(tmp_path_factory, kept_source) -> Path:
    """`kept_source` exported with the default options: its generation_config.json is kept."""
    dst = tmp_path_factory.mktemp("export-kept") / "exported_kept"
    export_checkpoint(kept_source, dst)
    return dst


def test_exported_generation_config_follows_the_rules(exported, exported_chat, char_tokenizer):
    assert FAST_GENERATION_DEFAULTS["use_cache"] and FAST_GENERATION_DEFAULTS["dual_cache"]
    assert FAST_GENERATION_DEFAULTS["do_sample"] is False and FAST_GENERATION_DEFAULTS["threshold"] == 0.9
    defaults = hf_dllm.DiffusionGenerationConfig().to_dict()
    # Another family's sampler fields (Dream's) at their defaults are not written: LLaDA's remote code lacks them.
    assert not {"alg", "eps"} & defaults.keys()
    common = {key: defaults[key] for key in hf_dllm.DiffusionGenerationConfig.field_names() if key in defaults}
    expected = {
        **common,
        "max_new_tokens": 256,
        "block_length": 32,
        "threshold": 0.9,
        "use_cache": True,
        "dual_cache": True,
        "do_sample": False,
        "mask_token_id": 310,  # special tokens from the source config.json
        "eos_token_id": 301,
        "pad_token_id": 301,
    }
    assert_generation_config_file(exported, expected)
    # bos from the config, eot = the tokenizer's <|eot_id|>; exporter options override the fast defaults.
    written = json.loads((exported_chat / "generation_config.json").read_text())
    assert written["eot_token_id"] == char_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert (written["bos_token_id"], written["mask_token_id"], written["eos_token_id"]) == (1, 3, 0)
    assert (written["max_new_tokens"], written["block_length"], written["threshold"]) == (24, 8, 0.9)
    loaded = hf_dllm.DiffusionGenerationConfig.from_pretrained(exported_chat)
    assert isinstance(loaded, hf_dllm.DiffusionGenerationConfig) and loaded.dual_cache and not loaded.do_sample


def test_exported_tokenizer_and_card(exported_chat, chat_checkpoint):
    for name in TOKENIZER_SAVED:
        assert (exported_chat / name).read_bytes() == (chat_checkpoint / name).read_bytes()
    card = (exported_chat / "README.md").read_text()
    assert card.startswith("---\n") and "base_model: GSAI-ML/LLaDA-8B-Instruct" in card
    assert "your-org/LLaDA-8B-Instruct-hf-dllm" in card and "{{" not in card
    assert "max_new_tokens` | 24" in card  # the card documents the defaults this export wrote


def test_export_is_deterministic_and_link_shares_weights(exported, tmp_path):
    again = tmp_path / "again" / exported.name  # the generic card is named after DST's folder
    linked = tmp_path / "linked" / exported.name
    export_checkpoint(REFERENCE_DIR, again, tokenizer=False)
    assert tree_bytes(again) == tree_bytes(exported)
    src = copy_source(tmp_path)  # hard links need SRC and DST on one file system
    export_checkpoint(src, linked, link=True, tokenizer=False)
    assert tree_bytes(linked) == tree_bytes(exported)
    assert (linked / "model.safetensors").stat().st_ino == (src / "model.safetensors").stat().st_ino


def test_sharded_weights_are_exported_with_their_index(tmp_path):
    src = tmp_path / "sharded"
    tiny_model().save_pretrained(src, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    export_checkpoint(src, tmp_path / "out", tokenizer=False)
    shards = set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values())
    weights = {p.name for p in (tmp_path / "out").iterdir() if "safetensors" in p.name}
    assert weights == shards | {"model.safetensors.index.json"} and len(shards) > 1


@pytest.mark.parametrize("card", [name for name, preset in CARD_PRESETS.items() if preset["file"]])
def test_committed_model_cards_are_the_rendered_template(card):
    path = MODEL_CARDS_DIR / CARD_PRESETS[card]["file"]
    assert path.read_text() == cards.render_preset_card(card), (
        f"{path} is out of date: regenerate the cards with "
        '`python -c "from hf_dllm.hub.cards import write_preset_cards; write_preset_cards()"`'
    )


def test_cli_export_and_console_dispatch(tmp_path, exported, capsys):
    from hf_dllm.cli import main as cli_main

    assert cli_main(["export", str(REFERENCE_DIR), str(tmp_path / exported.name), "--no-tokenizer"]) == 0
    assert tree_bytes(tmp_path / exported.name) == tree_bytes(exported)
    assert "Exported" in capsys.readouterr().out
    assert export.main(["--help"]) == 0
    usage = " ".join(capsys.readouterr().out.split())
    assert "--link" in usage and "--generation-defaults {source,fast}" in usage
    assert "'source' (default) keeps SRC's generation_config.json" in usage and "'fast' writes the family's" in usage


# --- generation_config.json: option > SRC's generation_config.json > the family's defaults --------------------------


def test_source_generation_config_is_kept(exported_kept, kept_source, tmp_path):
    # Every field kept; a special token id the source leaves unset comes from the checkpoint as without one (here
    # the tokenizer's <|eot_id|>).
    eot = build_char_tokenizer().convert_tokens_to_ids("<|eot_id|>")
    assert written_fields(kept_source)["eot_token_id"] is None
    assert written_fields(exported_kept) == {**written_fields(kept_source), "eot_token_id": eot}
    written = written_fields(exported_kept)
    assert (written["max_new_tokens"], written["block_length"], written["steps"]) == (16, 8, 8)
    assert (written["threshold"], written["dual_cache"], written["eos_token_id"]) == (None, False, [0, 2])
    card = (exported_kept / "README.md").read_text()  # the card documents what was written
    assert "| `max_new_tokens` | 16 |" in card and "| `block_length` | 8 |" in card and "| `steps` | 8 |" in card
    assert "| `dual_cache` | False |" in card and "| `threshold` | None |" in card
    assert (
        "LLaDA's fixed schedule (`steps=8` in all; `threshold=None`) with the prefix cache, greedy, in blocks of 8"
        in card
    )
    # The project's tiny trained model (256 positions) keeps its 32 tokens in blocks of 8.
    trained = FIXTURES / "llada-tiny-trained"
    result = export_checkpoint(trained, tmp_path / "trained")
    assert written_fields(tmp_path / "trained") == written_fields(trained)
    assert result.generation.origins["max_new_tokens"] == "source"
    assert "generation_config.json" in result.files


def test_option_overrides_one_field_and_keeps_the_rest(kept_source, tmp_path):
    source = written_fields(kept_source)
    result = export_checkpoint(kept_source, tmp_path / "block4", block_length=4)
    assert written_fields(tmp_path / "block4") == {**source, "block_length": 4, "eot_token_id": 2}
    origins = result.generation.origins
    assert origins["block_length"] == "option --block-length"
    assert origins["max_new_tokens"] == origins["steps"] == origins["eos_token_id"] == "source"
    assert origins["eot_token_id"] == "checkpoint" and origins["factor"] == "default"
    # --threshold replaces the source's decoding rule (steps), as generate(threshold=...) does.
    result = export_checkpoint(kept_source, tmp_path / "threshold", threshold=0.8, max_new_tokens=24)
    written = written_fields(tmp_path / "threshold")
    assert written == {**source, "threshold": 0.8, "steps": None, "max_new_tokens": 24, "eot_token_id": 2}
    assert result.generation.origins["steps"] == result.generation.origins["threshold"] == "option --threshold"


def test_fast_defaults_option_writes_the_family_defaults(kept_source, tmp_path, capsys):
    dst = tmp_path / "fast"
    assert export.main([str(kept_source), str(dst), "--generation-defaults", "fast", "--block-length", "16"]) == 0
    written = written_fields(dst)
    assert {key: written[key] for key in FAST_GENERATION_DEFAULTS} == {**FAST_GENERATION_DEFAULTS, "block_length": 16}
    # special token ids as without a source generation_config.json: config.json's, the tokenizer's <|eot_id|>
    eot = build_char_tokenizer().convert_tokens_to_ids("<|eot_id|>")
    assert (written["eos_token_id"], written["eot_token_id"], written["mask_token_id"]) == (0, eot, 3)
    out = capsys.readouterr().out
    assert re.search(r"^  threshold = 0\.9 +<- the family's default$", out, re.M), out
    assert re.search(r"^  block_length = 16 +<- option --block-length$", out, re.M), out
    assert re.search(r"^  eos_token_id = 0 +<- SRC's config.json / tokenizer$", out, re.M), out


def test_no_source_generation_config_gives_the_family_defaults(exported_chat, chat_checkpoint, tmp_path):
    assert not (chat_checkpoint / "generation_config.json").exists()
    result = export_checkpoint(chat_checkpoint, tmp_path / "out", max_new_tokens=24)
    written = written_fields(tmp_path / "out")
    assert {key: written[key] for key in FAST_GENERATION_DEFAULTS} == {**FAST_GENERATION_DEFAULTS, "max_new_tokens": 24}
    origins = result.generation.origins
    assert origins["threshold"] == origins["block_length"] == "family default"
    assert origins["max_new_tokens"] == "option --max-new-tokens" and origins["mask_token_id"] == "checkpoint"


def test_export_says_what_it_wrote(kept_source, tmp_path, capsys, caplog):
    dst = tmp_path / "said"
    assert export.main([str(kept_source), str(dst), "--threshold", "none", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "generation_config.json (LLaDA):" in out
    for line in (
        r"max_new_tokens = 24 +<- option --max-new-tokens",
        r"block_length = 8 +<- SRC's generation_config.json",
        r"threshold = None +<- option --threshold",
        r"steps = None +<- option --threshold",  # --threshold replaced the source's rule
        r"dual_cache = False +<- SRC's generation_config.json",
        r"eos_token_id = \[0, 2\] +<- SRC's generation_config.json",
    ):
        assert re.search(rf"^  {line}$", out, re.M), f"{line!r} not in:\n{out}"
    assert written_fields(dst)["max_new_tokens"] == 24 and written_fields(dst)["threshold"] is None
    with caplog.at_level("INFO", logger="hf_dllm.hub.export"):
        result = export_checkpoint(kept_source, dst, overwrite=True)
    assert result.generation.summary() in caplog.text
    assert re.search(r"block_length = 8 +<- SRC's generation_config.json", caplog.text)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"threshold": 1.5}, r"`threshold` must be None or a number in \(0, 1\]"),
        ({"threshold": 0.9, "steps": 8}, "`steps` must be None with `threshold`"),  # LLaDA: no steps with threshold
        ({"editing_threshold": 0.5}, "only supported by block-causal models"),  # LLaDA2.1 token editing
        ({"num_beams": 4}, "unknown fields.*num_beams"),
        ("{", "is not readable JSON"),
    ],
    ids=["range", "contradiction", "editing", "unknown", "json"],
)
def test_invalid_source_generation_config_is_refused(kept_source, tmp_path, fields, message):
    src, dst = tmp_path / "src", tmp_path / "out"
    path = with_generation_config(kept_source, src, fields)
    with pytest.raises(ExportError, match=message) as error:
        export_checkpoint(src, dst)
    assert str(path) in str(error.value) and "--generation-defaults fast" in str(error.value)
    assert not dst.exists() and no_staging_left(tmp_path)
    export_checkpoint(src, dst, generation_defaults="fast")  # the way out the message names
    assert written_fields(dst)["threshold"] == FAST_GENERATION_DEFAULTS["threshold"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"generation_defaults": "slow"}, "--generation-defaults .*must be one of source, fast, got 'slow'"),
        ({"block_length": 0}, r"--block-length \(block_length=0\).*positive integer"),
        ({"max_new_tokens": 2**21}, r"--max-new-tokens \(max_new_tokens=2097152\).*at most"),
        ({"threshold": 0.0}, r"--threshold \(threshold=0.0\).*\(0, 1\]"),
    ],
)
def test_bad_generation_options_are_refused(kept_source, tmp_path, options, message):
    with pytest.raises(ExportError, match=message):
        export_checkpoint(kept_source, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists() and no_staging_left(tmp_path)


# --- bad input: a clear error, DST untouched ----------------------------------------------------------------------


def no_staging_left(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".export-" in p.name or ".old-" in p.name]


def copy_source(tmp_path: Path, name: str = "src") -> Path:
    src = tmp_path / name
    shutil.copytree(REFERENCE_DIR, src)
    return src


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no-config", "has no config.json"),
        ("no-weights", "has no weights"),
        ("not-llada", "model_type 'llama' and architectures .* is not of a model family hf-dllm export supports"),
        ("unsupported", "alibi"),
        ("bad-json", "not readable JSON"),
        ("missing-shard", "names shard(s) missing"),
    ],
)
def test_bad_source_is_rejected(tmp_path, breakage, message):
    src = copy_source(tmp_path)
    config = json.loads((src / "config.json").read_text())
    if breakage == "no-config":
        (src / "config.json").unlink()
    elif breakage == "no-weights":
        (src / "model.safetensors").unlink()
    elif breakage == "not-llada":
        (src / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    elif breakage == "unsupported":
        (src / "config.json").write_text(json.dumps({**config, "alibi": True}))
    elif breakage == "bad-json":
        (src / "config.json").write_text("{")
    elif breakage == "missing-shard":
        index = {"metadata": {}, "weight_map": {"model.transformer.wte.weight": "model-00001-of-00002.safetensors"}}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = tmp_path / "out"
    with pytest.raises(ExportError, match=message.replace("(", r"\(").replace(")", r"\)")):
        export_checkpoint(src, dst)
    assert not dst.exists() and no_staging_left(tmp_path)


def test_non_empty_destination_needs_overwrite(tmp_path, exported):
    dst = tmp_path / exported.name
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_checkpoint(REFERENCE_DIR, dst, tokenizer=False)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    export_checkpoint(REFERENCE_DIR, dst, overwrite=True, tokenizer=False)
    assert tree_bytes(dst) == tree_bytes(exported) and no_staging_left(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(REFERENCE_DIR, empty, tokenizer=False)  # an existing empty folder is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="not a folder"):
        export_checkpoint(REFERENCE_DIR, tmp_path / "file", overwrite=True, tokenizer=False)
    src = copy_source(tmp_path, "self")
    with pytest.raises(ExportError, match="is SRC"):
        export_checkpoint(src, src, overwrite=True, tokenizer=False)
    with pytest.raises(ExportError, match="contains SRC"):
        export_checkpoint(src, tmp_path, overwrite=True, tokenizer=False)


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    def fail(source, target, link):
        raise OSError("disk full")

    monkeypatch.setattr(export, "_place", fail)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    # One line naming the destination (an ExportError, printed without a traceback), the old DST kept.
    with pytest.raises(ExportError, match=r"cannot write .*out: disk full \(.*out is left as it was\)"):
        export_checkpoint(REFERENCE_DIR, dst, overwrite=True, tokenizer=False)
    assert [p.name for p in dst.iterdir()] == ["old.txt"] and no_staging_left(tmp_path)


# --- verification of what is written, leftovers of killed runs ----------------------------------------------------


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("truncated-weights", "model.safetensors is not a readable safetensors file.*not fully covered"),
        ("garbage-weights", "model.safetensors is not a readable safetensors file"),
        ("empty-weights", "model.safetensors is not a readable safetensors file"),
        (
            "wider-mlp",
            r"shapes differ from config.json: model.transformer.blocks.0.ff_proj.weight is \[192, 64\], "
            r"the config gives \[256, 64\]",
        ),
        ("more-layers", r"missing from the weights: model.transformer.blocks.2"),
        ("tied-weights", r"in the weights but not in a model of this config: model.transformer.ff_out.weight"),
        ("bad-tokenizer", r"tokenizer files \(tokenizer.json\) do not load"),
        ("index-lies", r"model.safetensors.index.json does not match its shards"),
    ],
)
def test_export_verifies_what_it_writes(tmp_path, breakage, message, capsys):
    """Weights and config that disagree, unreadable files: exit 1 with the reason, DST untouched, no staging left."""
    src = copy_source(tmp_path)
    weights = src / "model.safetensors"
    config = json.loads((src / "config.json").read_text())
    if breakage == "truncated-weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif breakage == "garbage-weights":
        weights.write_bytes(os.urandom(4096))
    elif breakage == "empty-weights":
        weights.write_bytes(b"")
    elif breakage == "wider-mlp":
        (src / "config.json").write_text(json.dumps({**config, "mlp_hidden_size": 256}))
    elif breakage == "more-layers":
        (src / "config.json").write_text(json.dumps({**config, "n_layers": 3}))
    elif breakage == "tied-weights":
        (src / "config.json").write_text(json.dumps({**config, "weight_tying": True}))
    elif breakage == "bad-tokenizer":
        (src / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    elif breakage == "index-lies":
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        names = sorted(tensors)
        save_file({n: tensors[n] for n in names[:10]}, src / "model-00001-of-00002.safetensors")
        save_file({n: tensors[n] for n in names[10:]}, src / "model-00002-of-00002.safetensors")
        weight_map = {n: "model-00001-of-00002.safetensors" for n in names}  # every tensor in shard 1: wrong
        (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        weights.unlink()
    dst = tmp_path / "out"
    tokenizer = breakage == "bad-tokenizer"  # the reference fixture has no tokenizer of its own
    with pytest.raises(ExportError, match=message):
        export_checkpoint(src, dst, tokenizer=tokenizer)
    assert not dst.exists() and no_staging_left(tmp_path)
    assert export.main([str(src), str(dst), *([] if tokenizer else ["--no-tokenizer"])]) == 1
    assert "hf-dllm export: error:" in capsys.readouterr().err
    assert not dst.exists() and no_staging_left(tmp_path)


def test_pytorch_bin_weights_are_verified(tmp_path):
    """`pytorch_model.bin` (no safetensors): shapes read from the mapped file; a truncated file is refused."""
    from safetensors.torch import load_file

    src = copy_source(tmp_path)
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    export_checkpoint(src, tmp_path / "out", tokenizer=False)
    assert (tmp_path / "out" / "pytorch_model.bin").read_bytes() == (src / "pytorch_model.bin").read_bytes()
    data = (src / "pytorch_model.bin").read_bytes()
    (src / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match="pytorch_model.bin is not a readable PyTorch weights file"):
        export_checkpoint(src, tmp_path / "out2", tokenizer=False)
    assert not (tmp_path / "out2").exists() and no_staging_left(tmp_path)


def dead_pid() -> int:
    """The id of a process that has exited (ids are reused only after the counter wraps)."""
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)


def test_killed_export_leaves_nothing_a_later_export_does_not_remove(tmp_path, exported, caplog):
    """An export killed (SIGKILL) while assembling leaves `.DST.export-PID-*`; the next export into DST removes
    it, and says so."""
    child = textwrap.dedent(
        """
        import os, signal, sys
        from hf_dllm.hub import export
        export.verify_export = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # die with the repo half-made
        export.export_checkpoint(sys.argv[1], sys.argv[2], tokenizer=False)
        """
    )
    dst = tmp_path / exported.name
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_DIR.parent))
    killed = subprocess.run([sys.executable, "-c", child, str(REFERENCE_DIR), str(dst)], env=env, timeout=120)
    assert killed.returncode == -9
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.export-")]
    assert len(leftovers) == 1 and not dst.exists()
    # A running export's folder (this process) and a pre-PID folder name are left alone and reported.
    live = tmp_path / f".{dst.name}.export-{os.getpid()}-live"
    unnamed = tmp_path / f".{dst.name}.export-abcd1234"
    live.mkdir()
    unnamed.mkdir()
    with caplog.at_level("WARNING", logger="hf_dllm.hub.export"):
        export_checkpoint(REFERENCE_DIR, dst, tokenizer=False)
    assert tree_bytes(dst) == tree_bytes(exported)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted([live.name, unnamed.name])
    notes = caplog.text
    assert f"removed {tmp_path / leftovers[0]}" in notes and "was killed" in notes
    assert f"left {live}" in notes and f"left {unnamed}" in notes


def test_export_killed_while_swapping_folders_is_repaired(tmp_path, exported, caplog):
    """Killed between moving the old DST aside and moving the new one in: DST is missing and `.DST.old-PID-*`
    holds it. The next export puts it back first (then refuses to overwrite it without --overwrite)."""
    dst = tmp_path / exported.name
    pid = dead_pid()
    old = tmp_path / f".{dst.name}.old-{pid}-x1y2"
    shutil.copytree(exported, old)
    staging = tmp_path / f".{dst.name}.export-{pid}-z3w4"
    staging.mkdir()
    with caplog.at_level("WARNING", logger="hf_dllm.hub.export"), pytest.raises(ExportError, match="not empty"):
        export_checkpoint(REFERENCE_DIR, dst, tokenizer=False)
    assert tree_bytes(dst) == tree_bytes(exported) and no_staging_left(tmp_path)
    assert f"restored {dst} from {old}" in caplog.text
    # With DST present, a stale `.old-` copy is simply removed.
    shutil.copytree(exported, old)
    export_checkpoint(REFERENCE_DIR, dst, overwrite=True, tokenizer=False)
    assert no_staging_left(tmp_path) and tree_bytes(dst) == tree_bytes(exported)


def test_cli_errors(tmp_path, capsys):
    dst = tmp_path / "out"
    assert export.main([str(REFERENCE_DIR), str(dst), "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert export.main([str(tmp_path / "nowhere"), str(dst)]) == 1
    assert "is not a folder" in capsys.readouterr().err
    assert export.main([str(REFERENCE_DIR), str(dst), "--no-tokenizer", "--threshold", "2"]) == 1
    assert "--threshold (threshold=2.0)" in capsys.readouterr().err
    assert export.main([str(REFERENCE_DIR), str(dst), "--no-tokenizer", "--generation-defaults", "slow"]) == 2
    assert "invalid choice: 'slow'" in capsys.readouterr().err
    assert not dst.exists() and no_staging_left(tmp_path)


# --- the remote-code checks ---------------------------------------------------------------------------------------


def patched_package(tmp_path: Path, name: str, old: str, new: str) -> Path:
    package = tmp_path / "package"
    package.mkdir(exist_ok=True)
    for file_name in REMOTE_CODE_FILES:
        shutil.copyfile(PACKAGE_DIR / file_name, package / file_name)
    text = (package / name).read_text()
    assert old in text
    (package / name).write_text(text.replace(old, new, 1))
    return package


ANCHOR = "from .configuration_llada import LLaDAConfig\n"


@pytest.mark.parametrize(
    "new, message",
    [
        (ANCHOR + "import triton\n", r"imports \['triton'\] outside a `try:` block"),
        (ANCHOR + "from hf_dllm.cache import DiffusionKVCache\n", "imports `hf_dllm.cache`"),
        (ANCHOR + "from .char_tokenizer import build_char_tokenizer\n", r"`from \.char_tokenizer import"),
        (ANCHOR + "from ..cache import DiffusionKVCache\n", r"`from \.\.cache import"),
        (ANCHOR + '"""Example:\n    from .serve import app\n"""\n', r"relative imports of \['serve'\]"),
        (ANCHOR + "try:\n    import triton\nexcept ImportError:\n    triton = None\n", None),
    ],
)
def test_remote_code_violations_are_reported(tmp_path, new, message):
    package = patched_package(tmp_path, "modeling_llada.py", ANCHOR, new)
    if message is None:
        check_remote_code(package)  # a guarded optional import is fine
    else:
        with pytest.raises(ExportError, match=message):
            check_remote_code(package)


def with_remote_code_files(monkeypatch, files: tuple[str, ...], family: str = "llada") -> None:
    conftest.with_remote_code_files(monkeypatch, family, files)


def test_missing_or_unreachable_remote_code_file(tmp_path, monkeypatch):
    package = patched_package(tmp_path, "configuration_llada.py", "", "")
    (package / "attention.py").unlink()
    with pytest.raises(ExportError, match="missing from the package.*attention.py"):
        check_remote_code(package)
    with_remote_code_files(monkeypatch, (*REMOTE_CODE_FILES, "orphan.py"))
    shutil.copyfile(PACKAGE_DIR / "attention.py", package / "attention.py")
    (package / "orphan.py").write_text("X = 1\n")
    with pytest.raises(ExportError, match="orphan.py not reached by relative imports"):
        check_remote_code(package)
    dst = tmp_path / "out"
    with_remote_code_files(monkeypatch, (*REMOTE_CODE_FILES, "not_written_yet.py"))
    with pytest.raises(ExportError, match="not_written_yet.py"):
        export_checkpoint(REFERENCE_DIR, dst, tokenizer=False)
    assert not dst.exists()


# --- a fresh process without hf_dllm ------------------------------------------------------------------------------

# Run after conftest's CHILD_PRELUDE (spec, out, record, expect_error, describe, no_hf_dllm, generate_cases).
CHILD = textwrap.dedent(
    r"""
    import importlib
    import shutil

    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.dynamic_module_utils import check_imports

    subset = [case for case in spec["cases"] if case["name"] in spec["subset"]]
    local, hub, chat = spec["local"], spec["hub_repo"], spec["chat"]
    out["no_hf_dllm"] = no_hf_dllm()
    model = load_with_remote_code(local, spec["cases"], subset)
    out["errors_validation"] = {
        "threshold": expect_error(lambda: model.generate(torch.tensor([[5, 6]]), threshold=1.5)),
        "unknown": expect_error(lambda: model.generate(torch.tensor([[5, 6]]), num_beams=2)),
        "contradiction": expect_error(lambda: model.generate(torch.tensor([[5, 6]]), threshold=0.9, steps=8)),
        "unknown_field": expect_error(lambda: type(model.generation_config)(min_p=0.1)),
    }
    again = AutoModel.from_pretrained(local, trust_remote_code=True).eval()  # loading twice in one process
    out["again"] = describe(again)
    record("tokens_again", lambda: generate_cases(again, subset))
    from_hub = AutoModelForCausalLM.from_pretrained(hub, trust_remote_code=True).eval()  # the Hub code path
    out["hub"] = describe(from_hub)
    record("tokens_hub", lambda: generate_cases(from_hub, subset))
    record("roundtrip", lambda: type(model.generation_config).from_pretrained(local).to_dict() == model.generation_config.to_dict())
    kept = AutoModel.from_pretrained(spec["kept"], trust_remote_code=True).eval()  # no kwargs: its generation_config.json
    record("tokens_kept", lambda: kept.generate(torch.tensor(spec["kept_prompt"])).tolist())

    bad = Path(spec["scratch"]) / "bad_generation_config"
    shutil.copytree(local, bad)
    config = json.loads((bad / "generation_config.json").read_text())
    (bad / "generation_config.json").write_text(json.dumps({**config, "steps": 8}))
    out["errors_validation"]["bad_file"] = expect_error(
        lambda: AutoModel.from_pretrained(bad, trust_remote_code=True)
    )

    record("pipeline", lambda: run_pipeline(chat, spec["pipeline_settings"]))

    def import_each_module():
        for name in spec["modules"]:
            check_imports(str(Path(local) / f"{name}.py"))
        sys.path.insert(0, str(Path(local).parent))
        package = Path(local).name
        return [importlib.import_module(f"{package}.{name}").__name__ for name in spec["modules"]]

    record("imported", import_each_module)
    out["no_hf_dllm_after"] = no_hf_dllm()
    """
)


KEPT_PROMPT = [[1, 40, 41, 42, 43, 44]]
PIPELINE_SETTINGS = dict(max_new_tokens=16, threshold=0.9)
# Cases the models loaded after the first one run (the first runs them all): enough to show they are the same model.
SUBSET = ["threshold", "factor_prefix", "padded"]


def generation_cases(reference_expected) -> list[dict]:
    p7, p12, b2 = (reference_expected[f"prompt.{name}"] for name in ("p7", "p12", "b2"))
    pad = torch.full((1, 5), 301, dtype=torch.long)
    padded = torch.cat([torch.cat([pad, p7], dim=1), p12])
    mask = torch.cat([torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], dim=1), torch.ones(1, 12)]).long()
    short = {"max_new_tokens": 32, "block_length": 8}
    return [
        # generation_config.json decides everything else: threshold 0.9, dual cache, blocks of 32.
        {"name": "defaults", "input_ids": p12.tolist(), "kwargs": {"max_new_tokens": 64}},
        {"name": "threshold", "input_ids": p12.tolist(), "kwargs": {"threshold": 0.9, **short}},
        {
            "name": "fixed_nocache",
            "input_ids": p7.tolist(),
            "kwargs": {"threshold": None, "steps": 16, "use_cache": False, "eos_early_stop": False, **short},
        },
        {
            "name": "factor_prefix",
            "input_ids": b2.tolist(),
            "kwargs": {"threshold": None, "factor": 1.0, "dual_cache": False, "return_dict_in_generate": True, **short},
        },
        {
            "name": "cfg",
            "input_ids": p7.tolist(),
            "kwargs": {"threshold": None, "steps": 32, "cfg_scale": 1.5, "use_cache": False, **short},
        },
        {"name": "sampling", "input_ids": p12.tolist(), "kwargs": {"temperature": 0.7, **short}},
        {
            "name": "padded",
            "input_ids": padded.tolist(),
            "attention_mask": mask.tolist(),
            "kwargs": {"threshold": 0.7, "return_dict_in_generate": True, "confidence_eos_eot_inf": True, **short},
        },
    ]


def fake_hub_cache(root: Path, repo: Path) -> Path:
    """An offline Hub cache holding `repo` as `HUB_REPO` at `HUB_COMMIT`, laid out as huggingface_hub does."""
    org, name = HUB_REPO.split("/")
    cache = root / f"models--{org}--{name}"
    shutil.copytree(repo, cache / "snapshots" / HUB_COMMIT)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(HUB_COMMIT)
    return root


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory, exported, exported_chat, exported_kept, reference_expected) -> dict:
    """Run CHILD once in a process where hf_dllm cannot be imported; return what it recorded."""
    root = tmp_path_factory.mktemp("fresh")
    cases = generation_cases(reference_expected)
    spec = {
        "local": str(exported),
        "hub_repo": HUB_REPO,
        "chat": str(exported_chat),
        "kept": str(exported_kept),
        "kept_prompt": KEPT_PROMPT,
        "pipeline_settings": PIPELINE_SETTINGS,
        "cases": cases,
        "subset": SUBSET,
        "modules": [name.removesuffix(".py") for name in REMOTE_CODE_FILES],
        "scratch": str(root),
    }
    result = run_without_hf_dllm(root, CHILD, spec, {"HF_HUB_CACHE": str(fake_hub_cache(root / "hub", exported))})
    result["cases"] = cases
    return result


def test_fresh_process_cannot_import_hf_dllm(fresh_process):
    assert fresh_process["no_hf_dllm"] and fresh_process["no_hf_dllm_after"]
    assert not fresh_process["errors"], "\n".join(fresh_process["errors"])


def test_every_exported_module_imports_without_hf_dllm(fresh_process):
    modules = [name.removesuffix(".py") for name in REMOTE_CODE_FILES]
    assert fresh_process["imported"] == [f"exported.{name}" for name in modules]


@pytest.mark.parametrize("loaded", ["auto_model", "auto_causal", "again", "hub"])
def test_remote_classes_have_diffusion_generate(fresh_process, loaded):
    info = fresh_process[loaded]
    assert_remote_model(info, "llada")
    expected = dict(FAST_GENERATION_DEFAULTS, mask_token_id=310, eos_token_id=301, pad_token_id=301)
    assert {key: info["generation_config"][key] for key in expected} == expected
    assert fresh_process["auto_config_module"].endswith(".configuration_llada")
    assert fresh_process["roundtrip"] is True


def test_remote_generate_matches_hf_dllm(fresh_process, exported):
    model = hf_dllm.LLaDAModelLM.from_pretrained(exported).eval()
    expected = generate_cases(model, fresh_process["cases"])
    assert expected["factor_prefix"]["nfe"] > 0
    assert fresh_process["tokens"] == expected
    for key in ("tokens_causal", "tokens_again", "tokens_hub"):
        assert fresh_process[key] == {name: expected[name] for name in SUBSET}, key


def test_kept_generation_config_generates_the_source_tokens(fresh_process, kept_source):
    """The export of a checkpoint with its own generation_config.json, loaded where hf_dllm is not installed, generates
    with no arguments what the source model's generate() does with none: 16 tokens in blocks of 8, 8 fixed steps."""
    new = SOURCE_GENERATION["max_new_tokens"]
    assert_kept_settings_generate_alike(
        fresh_process["tokens_kept"], hf_dllm.LLaDAModelLM, kept_source, KEPT_PROMPT, new
    )


def test_remote_generation_config_validates(fresh_process):
    errors = fresh_process["errors_validation"]
    assert errors["threshold"].startswith("ValueError") and "`threshold`" in errors["threshold"]
    assert errors["unknown"].startswith("ValueError") and "num_beams" in errors["unknown"]
    assert errors["contradiction"].startswith("ValueError") and "`steps` must be None" in errors["contradiction"]
    assert errors["unknown_field"].startswith("ValueError") and "min_p" in errors["unknown_field"]
    assert errors["bad_file"] is not None and "`steps` must be None" in errors["bad_file"]


def test_remote_pipeline_matches_hf_dllm(fresh_process, exported_chat):
    assert_pipeline_matches(fresh_process["pipeline"], exported_chat, hf_dllm.LLaDAModelLM, **PIPELINE_SETTINGS)
