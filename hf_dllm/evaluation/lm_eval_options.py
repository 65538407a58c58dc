"""`hf-dllm lm-eval`'s options: lm-evaluation-harness's own command line, read without torch or the `hf_dllm`
model (`hf-dllm lm-eval --help` prints lm-eval's help without loading either; docs/decisions/cli-startup.md)."""

from __future__ import annotations

import sys


class HarnessParser:
    """lm-eval's command line (`lm_eval._cli.HarnessCLI`, which reads `sys.argv`) behind argparse's
    `parse_args(argv)`."""

    def parse_args(self, argv: list[str]):
        from lm_eval._cli import HarnessCLI

        saved = sys.argv
        sys.argv = ["lm-eval", *argv]
        try:
            return HarnessCLI().parse_args()
        finally:
            sys.argv = saved


def build_parser() -> HarnessParser:
    return HarnessParser()
