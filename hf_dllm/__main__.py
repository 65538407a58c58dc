"""`python -m hf_dllm COMMAND ...`: the `hf-dllm` command line, run after `import hf_dllm` (which imports torch and
transformers); `hf-dllm` and `python -m hf_dllm_launcher` answer `--help` without them (docs/decisions/cli-startup.md)."""

import sys

from .cli import main

sys.exit(main())
