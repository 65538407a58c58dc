"""`hf-dllm` command line (also `python -m hf_dllm`). Each subcommand lives in its own module with `main(argv)`."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Modules are imported only when their command runs, so optional
# dependencies (fastapi, datasets, lm-eval) are needed only by the command that uses them.
COMMANDS = {
    "export": (
        "hf_dllm.hub.export",
        "turn a local checkpoint of any family into a Hub repo that runs hf_dllm's remote code",
    ),
    "generate": (
        "hf_dllm.cli.generate",
        "decode prompts from the command line (one device, or sharded under torchrun)",
    ),
    "serve": ("hf_dllm.serving.server", "OpenAI-compatible HTTP server with dLLM generation parameters"),
    "eval": ("hf_dllm.evaluation.evaluate", "evaluate a model on a dataset (datasets + accelerate data parallelism)"),
    "lm-eval": ("hf_dllm.evaluation.lm_eval_model", "lm-evaluation-harness with the `hf_dllm` model registered"),
}


def _usage() -> str:
    lines = ["usage: hf-dllm COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "Run `hf-dllm COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"hf-dllm: unknown command {command!r}; choose one of {', '.join(COMMANDS)}.\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
