"""`hf-dllm export` of a DiffusionGemma checkpoint: remote-code files, config, generation_config.json and card; the
export loads and reproduces a reference case where hf_dllm cannot be imported."""

from __future__ import annotations

import json

from hf_dllm.hub.export import main as export_main
from tests.conftest import FIXTURES, run_without_hf_dllm

GEMMA_DIR = FIXTURES / "diffusion-gemma-tiny-ref"

CHILD = r"""
from safetensors.torch import load_file
from transformers import AutoModel

model = AutoModel.from_pretrained(spec["repo"], trust_remote_code=True).eval()
record("model", lambda: describe(model))
record("no_hf_dllm", no_hf_dllm)
expected = load_file(spec["expected"])
case = spec["case"]
torch.manual_seed(case["seed"])
result = model.generate(
    expected["prompt.b2"], attention_mask=expected["attention_mask.b2"], return_dict_in_generate=True, **case["kwargs"]
)
out["equal"] = bool(torch.equal(result.sequences, expected["case." + case["name"]]))
out["nfe"] = result.nfe
record("refused", lambda: expect_error(lambda: model.generate(expected["prompt.p5"], threshold=0.9)))
"""


def test_export_runs_without_hf_dllm(tmp_path):
    dst = tmp_path / "repo"
    assert export_main([str(GEMMA_DIR), str(dst), "--no-tokenizer"]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_diffusion_gemma.DiffusionGemmaForBlockDiffusion"
    assert config["text_config"]["per_layer_config"] == {"2": {"head_dim": 32, "num_key_value_heads": 1}}
    for name in ("modeling_diffusion_gemma.py", "decoding_diffusion_gemma.py", "family_diffusion_gemma.py"):
        assert (dst / name).is_file()
    card = (dst / "README.md").read_text()
    assert "DiffusionGemma" in card and "LLaDA" not in card.split("## Citation")[0]
    case = next(c for c in json.loads((GEMMA_DIR / "cases.json").read_text())["cases"] if c["name"] == "b2.g24.eos.s1")
    spec = {"repo": str(dst), "expected": str(GEMMA_DIR / "expected.safetensors"), "case": case}
    out = run_without_hf_dllm(tmp_path, CHILD, spec)
    assert not out["errors"], out["errors"]
    assert out["no_hf_dllm"] and out["model"]["family"] == "diffusion_gemma"
    assert out["model"]["class_module"].startswith("transformers_modules.")
    assert out["equal"] and out["nfe"] <= case["nfe"]
    assert "LLaDA / Fast-dLLM" in out["refused"]


def test_export_refuses_a_text_config_token_id_outside_the_vocabulary(tmp_path, capsys):
    """The ids live in the nested text config (its vocabulary): an EOS past it is refused, naming the field."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(GEMMA_DIR, src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["eos_token_id"] = config["text_config"]["vocab_size"] + 5
    (src / "config.json").write_text(json.dumps(config))
    assert export_main([str(src), str(tmp_path / "repo"), "--no-tokenizer"]) != 0
    assert "text_config's `eos_token_id`" in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()
