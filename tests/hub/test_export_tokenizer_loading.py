"""An exported repo's tokenizer loads with the model card's own line, in a process without hf_dllm and with stdin
closed: no "Do you wish to run the custom code?" prompt (transformers' AutoTokenizer reads config.json, whose
config class is the repo's remote code, so the card passes `trust_remote_code=True` to it too), and no fallback to a
config "of type ``"."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from hf_dllm.hub.export import export_checkpoint
from tests.conftest import FIXTURES


def card_lines_up_to_the_tokenizer(card: str) -> str:
    code = re.search(r"## Usage\n\n```python\n(.*?)```", card, re.S).group(1)
    lines = code.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("tokenizer = "))
    return "\n".join(lines[: end + 1])


def test_the_cards_tokenizer_line_loads_without_a_prompt(tmp_path):
    dst = tmp_path / "repo"
    export_checkpoint(FIXTURES / "llada-tiny-trained", dst, repo_id=str(dst))
    code = card_lines_up_to_the_tokenizer((dst / "README.md").read_text())
    assert "AutoTokenizer.from_pretrained(repo" in code
    child = "import sys\nsys.modules['hf_dllm'] = None\n" + code + "\nprint('encoded', tokenizer('12+7=')['input_ids'])"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON", "TRANSFORMERS_"))}
    environment.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "mod"))
    proc = subprocess.run(
        [sys.executable, "-c", child],
        cwd=tmp_path,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "Do you wish to run the custom code" not in output
    assert "model of type ``" not in output
    assert "encoded [" in proc.stdout
