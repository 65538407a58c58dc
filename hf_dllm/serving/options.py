"""`hf-dllm serve MODEL`: an OpenAI-compatible HTTP server for masked-diffusion LMs, batched and streaming.

This module holds the command's options (`build_parser`) and the defaults they print, shared with the engine
(`engine.py`), the request checks (`protocol.py`) and the app (`server.py`). It imports neither torch nor
transformers, so that `hf-dllm serve --help` answers without them (docs/decisions/cli-startup.md).
"""

from __future__ import annotations

import argparse

from ..cli.loading import add_model_arguments
from .deadlines import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT

# Joining rows decode their first block apart once this many others of their cohort run: a shorter time to first
# block for them at a small cost to the others (`benchmarks/bench_load.py`).
JOIN_LAYOUT_MIN_ROWS = 8

# Rows decoded at once by default (`ContinuousBatcher`, `hf-dllm serve --max-batch-size`) off CUDA.
DEFAULT_MAX_BATCH_SIZE = 16

# On CUDA the default batch is what K/V fits in this share of the free memory (at most `MAX_AUTO_BATCH_SIZE`
# rows): the rest is for activations and CUDA graphs, and a batch that fills makes arrivals wait whole boundaries.
AUTO_BATCH_MEMORY_SHARE = 0.6
MAX_AUTO_BATCH_SIZE = 128

# Prompts one /v1/completions request may hold (400 past it).
MAX_PROMPTS = 64

API_KEY_ENV = "HF_DLLM_API_KEY"
# Default request-body limit: 64 bytes per token of the model's context (a full-context prompt as JSON text or token
# ids), at least 4 MiB. Larger bodies get 413 before they are read.
BODY_BYTES_PER_CONTEXT_TOKEN = 64
MIN_MAX_BODY_BYTES = 4 << 20
# torch's CPU threads of `hf-dllm serve` unless `--threads` says otherwise. One per core (torch's default) collapses
# when other processes share the cores: OpenMP threads wait on each other at every op while the scheduler runs
# someone else (benchmarks/bench_load.py --cpu --cpu-hogs 2 on a shared 2-core machine: p50 latency 70.3 s with two
# threads against 3.3 s with one, 21.1 s against 1.1 s per block boundary). A quiet many-core CPU server may pass more.
SERVE_THREADS = 1


def integer_or_off(value: str) -> int | None:
    """`--join-layout-min-rows`, `--max-refresh-positions`: an integer >= 1, or `off` (None)."""
    if value == "off":
        return None
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'off', got {value!r}")
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dllm serve", description=__doc__.split("\n")[0])
    parser.add_argument("model", metavar="MODEL", help="checkpoint folder or Hub id (model + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help=f"rows decoding at once (default: on CUDA {MAX_AUTO_BATCH_SIZE} within the K/V budget of "
        "--max-batch-positions for a bidirectional model, and for a block-causal one as many as fit their K/V of "
        f"max-batch-width columns each in {AUTO_BATCH_MEMORY_SHARE * 100:.0f} %% of the GPU's free memory, at most "
        f"{MAX_AUTO_BATCH_SIZE}; elsewhere {DEFAULT_MAX_BATCH_SIZE}). Given alone, the K/V cache holds "
        "max-batch-size x max-batch-width positions",
    )
    parser.add_argument(
        "--max-batch-width",
        type=int,
        default=None,
        help="columns of the widest layout (each row's prompt and output, aligned at its current block; default: "
        "the model's context)",
    )
    parser.add_argument(
        "--max-batch-positions",
        type=int,
        default=None,
        help="K/V positions of the layout cache, a budget for a layout's rows x columns: many rows of short "
        "requests or few long ones (default, with no --max-batch-size: on CUDA, for a bidirectional model, what "
        f"fits in {AUTO_BATCH_MEMORY_SHARE * 100:.0f} %% of the GPU's free memory; otherwise max-batch-size x "
        "max-batch-width); at least max-batch-width",
    )
    parser.add_argument(
        "--join-layout-min-rows",
        type=integer_or_off,
        default=JOIN_LAYOUT_MIN_ROWS,
        metavar="{N,off}",
        help="a joining request decodes its first block in a layout of its own, before the running rows, when at "
        "least N others run and none waits (a shorter time to first block, for a little more latency of the "
        f"others); off: always in the running rows' layout (default: {JOIN_LAYOUT_MIN_ROWS})",
    )
    parser.add_argument(
        "--max-refresh-positions",
        type=integer_or_off,
        default=None,
        metavar="{N,off}",
        help="bidirectional models (LLaDA, Dream) recompute every row's whole canvas at each block start: a layout "
        "holding more positions is decoded in slices of at most N, and requests that arrive meanwhile join the "
        "slices still to decode (a wait of one slice, not the whole batch's refresh, at the cost of more, smaller "
        "layouts: on an H100 at the LLaDA-8B shape, N=16384 did not shorten the p99 time to first block and added "
        "13-41 %% to p50 latency; benchmarks/bench_load.py); off (default): one layout per settings group",
    )
    parser.add_argument("--served-model-name", default=None, help="model id of the API (default: folder name)")
    parser.add_argument(
        "--api-key",
        default=None,  # not the environment's key: the key stays out of --help and the process list
        help=f"require `Authorization: Bearer KEY` on every route but /health (default: ${API_KEY_ENV}, which keeps "
        "the key out of the process list; unset: no key)",
    )
    parser.add_argument(
        "--allowed-origins",
        default=None,
        help="comma-separated browser origins CORS lets call the API, e.g. https://app.example.com, or '*' "
        "(default: none, CORS off)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help=f"larger request bodies get 413 unread (default: {BODY_BYTES_PER_CONTEXT_TOKEN} bytes per token of the "
        f"model's context, at least {MIN_MAX_BODY_BYTES >> 20} MiB)",
    )
    add_model_arguments(
        parser,
        threads=SERVE_THREADS,
        threads_help=f"CPU threads of torch (default {SERVE_THREADS}: more collapse when other processes share the "
        "cores, e.g. p50 latency 70.3 s with 2 threads against 3.3 s with 1 beside two busy processes on 2 cores, "
        "benchmarks/bench_load.py --cpu --cpu-hogs 2; a quiet many-core CPU server may pass more; matters only on "
        "the CPU)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="seconds a request's head (request line and headers) may take to arrive, from the connection's opening "
        "or the request's first byte: past it, 408 and the connection is closed (default: %(default)s)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="seconds a request's body may take to arrive after its head (a total, not an idle time): past it, 408 "
        "and the connection is closed (default: %(default)s)",
    )
    parser.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=MAX_PROMPTS,
        help="prompts one /v1/completions request may hold (400 past it); each is a row admitted in turns with "
        "other requests' rows (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's and the server's log level (default: info)",
    )
    return parser
