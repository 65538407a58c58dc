"""`hf-dllm` command line (also `python -m hf_dllm`). Each subcommand lives in its own module with `main(argv)`.

A command's options come from a `build_parser()` that imports neither torch nor transformers (the command's own
module, or its `parser` module): `hf-dllm COMMAND --help` prints them without loading either, and the console
script (`hf_dllm_launcher`) initialises the `hf_dllm` package, which registers the families with transformers'
Auto classes, only when a command runs (docs/decisions/cli-startup.md).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # its `main(argv)` runs the command
    help: str  # one line, for `hf-dllm --help`
    parser: str | None = None  # the module of its torch-free `build_parser()`, when not `module`


# Modules are imported only when their command runs, so optional dependencies (fastapi, datasets, lm-eval) are
# needed only by the command that uses them.
COMMANDS = {
    "export": Command(
        "hf_dllm.hub.export", "turn a local checkpoint of any family into a Hub repo that runs hf_dllm's remote code"
    ),
    "generate": Command(
        "hf_dllm.cli.generate", "decode prompts from the command line (one device, or sharded under torchrun)"
    ),
    "serve": Command(
        "hf_dllm.serving.server",
        "OpenAI-compatible HTTP server with dLLM generation parameters",
        parser="hf_dllm.serving.options",
    ),
    "eval": Command(
        "hf_dllm.evaluation.evaluate", "evaluate a model on a dataset (datasets + accelerate data parallelism)"
    ),
    "lm-eval": Command(
        "hf_dllm.evaluation.lm_eval_model",
        "lm-evaluation-harness with the `hf_dllm` model registered",
        parser="hf_dllm.evaluation.lm_eval_options",
    ),
}


def _usage() -> str:
    lines = ["usage: hf-dllm COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {command.help}" for name, command in COMMANDS.items()]
    lines += ["", "Run `hf-dllm COMMAND --help` for a command's options."]
    return "\n".join(lines)


def asks_for_help(args: list[str]) -> bool:
    """Whether a command's arguments hold `-h` / `--help` (before a `--`, after which arguments are positional)."""
    options = args[: args.index("--")] if "--" in args else args
    return "-h" in options or "--help" in options


def main(argv: list[str] | None = None, load_package: Callable[[], None] | None = None) -> int:
    """Run `hf-dllm COMMAND ARGS...`. `load_package`: initialises the `hf_dllm` package before a command runs (the
    console script's launcher defers it); a command's `--help` is answered by its torch-free parser before that."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hf-dllm: unknown command {name!r}; choose one of {', '.join(COMMANDS)}.\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    command = COMMANDS[name]
    if asks_for_help(rest):
        # argparse prints the help (or a usage error) and exits; were it to return, the command runs as usual.
        try:
            importlib.import_module(command.parser or command.module).build_parser().parse_args(rest)
        except SystemExit as exit_:
            return int(exit_.code or 0)
    if load_package is not None:
        load_package()
    return int(importlib.import_module(command.module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
