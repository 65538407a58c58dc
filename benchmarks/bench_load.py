"""Open-loop load benchmark of `hf-dllm serve` (issue #14): continuous batching against the old window batching.

    # GPU (the issue's setting): LLaDA-8B shape, random bf16 weights; the window-batching server from an older
    # checkout of the package (e.g. `git archive 42f8188 hf_dllm | tar -x -C .old`)
    python benchmarks/bench_load.py --shape llada-8b --rates 0.5,1,2 --requests 48 --window-code .old
    python benchmarks/bench_load.py --cpu                # small CPU smoke run of the same path
    python benchmarks/bench_load.py --cpu --shape llada2-small --servers continuous --check 12   # block-causal
    # several GPUs (issue #64): `torchrun --nproc-per-node 4 -m hf_dllm serve CHECKPOINT --tp-plan auto`
    python benchmarks/bench_load.py --tp 4 --rates 1,4 --requests 32
    python benchmarks/bench_load.py --cpu --tp 2 --rates 4 --requests 6 --warmup 2    # the same on gloo

For each server (`continuous`: this checkout; `window`: `--window-code`, the package before continuous batching,
run with `--batch-window-ms`), a server process is started on 127.0.0.1 (`--role server`: a model with random
weights built in the process, a word-level tokenizer over its vocabulary, `create_app` + uvicorn). For each rate
R (requests/s), `--requests` requests arrive open-loop (exponential gaps of mean 1/R, fixed seed), sent through
the official `openai` async client as streaming completions of token-id prompts. Prompt lengths are uniform in
[128, 1024] tokens and `max_tokens` uniform in [64, 512] rounded to whole blocks (both fixed by the seed, the same
for every server and rate); decoding: block 32, dual cache, 8 steps per block (4 tokens per forward, the
parallelism Fast-dLLM's threshold reaches on real models; random weights never reach a confidence threshold).

With `--tp N` the server is `hf-dllm serve` itself on a saved copy of the random model, sharded over N processes
(`torchrun ... --tp-plan auto`: rank 0 serves HTTP, the others follow its schedule); it has no bench routes (no
boundary trace, no memory figure).

Reported per server and rate: throughput (completion tokens / time from the first arrival to the last answer),
requests/s (completed requests over the same time), p50/p99 request latency, p50/p99 time to the first streamed block, requests lost or failed, peak GPU memory of the
server process (`torch.cuda.max_memory_allocated`, from its /bench-memory route), and the engine's mean seconds
per block boundary and positions (rows x columns) its blocks' first steps computed per boundary (the prefix rows
recompute, and joining rows' prefill). A table, then one JSON line.
`--check N` also compares N answers of the continuous server with `model.generate()` alone (float32 CPU runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The load's distributions (the issue's): prompt tokens and `max_tokens`, uniform; the CPU smoke run's are smaller.
PROMPT_RANGE, OUTPUT_RANGE = (128, 1024), (64, 512)
CPU_PROMPT_RANGE, CPU_OUTPUT_RANGE = (16, 96), (32, 96)
SHAPES = {
    "llada-8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288, vocab_size=126464),
    "small": dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=256, vocab_size=2048),
}
BLOCK = 32
STEPS_PER_BLOCK = 8


# -- the server process ------------------------------------------------------------------------------------------


LLADA2_SHAPES = ("llada2-mini", "llada2-small")  # bench_llada2.py's LLADA2_MINI and SMALL


def llada2_fields(shape: str) -> dict:
    """LLaDA2.0-mini's shape (or bench_llada2.py's small one), imported once the server's hf_dllm is (bench_llada2
    puts this checkout first on sys.path)."""
    import bench_llada2

    return dict(bench_llada2.LLADA2_MINI if shape == "llada2-mini" else bench_llada2.SMALL)


def build_model(shape: str, device: str, dtype: str, seed: int = 0):
    import torch

    import hf_dllm

    if shape in LLADA2_SHAPES:
        import bench_llada2

        config = hf_dllm.LLaDA2MoeConfig(
            **llada2_fields(shape),
            mask_token_id=bench_llada2.MASK_ID,
            eos_token_id=bench_llada2.EOS_ID,
            pad_token_id=bench_llada2.EOS_ID,
            bos_token_id=bench_llada2.EOS_ID,
        )
        torch.manual_seed(seed)
        with torch.device(device):
            model = hf_dllm.LLaDA2MoeModelLM._from_config(
                config, dtype=getattr(torch, dtype), attn_implementation="sdpa"
            )
        return model.eval()
    fields = SHAPES[shape]
    vocab = fields["vocab_size"]
    config = hf_dllm.LLaDAConfig(
        **fields,
        embedding_size=vocab,
        mask_token_id=vocab - 128,
        eos_token_id=vocab - 383,
        pad_token_id=vocab - 383,
        bos_token_id=vocab - 384,
        max_sequence_length=4096,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = hf_dllm.LLaDAModelLM._from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def word_tokenizer(vocab: int, eos: int, bos: int, pad: int):
    """A tokenizer whose tokens are `t0 ... t{vocab-1}` (random weights need no real text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token=f"t{pad}"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=f"t{eos}", bos_token=f"t{bos}", pad_token=f"t{pad}", unk_token=f"t{pad}"
    )


def serve(args) -> None:
    """`--role server`: build the model and serve it (this checkout's package, or `--window-code`'s via
    PYTHONPATH: the launcher sets it)."""
    import inspect

    import torch
    import uvicorn

    from hf_dllm.serving.server import create_app

    if (
        args.server_kind == "continuous-cudnn"
    ):  # the engine before its planless attention: sdpa may pick cuDNN (a plan per new shape)
        import contextlib

        import hf_dllm.serving.engine

        hf_dllm.serving.engine.attention_without_shape_plans = lambda device: contextlib.nullcontext()
    try:
        from hf_dllm.serving.options import SERVE_THREADS
    except ImportError:  # an older package (--window-code): torch's default
        SERVE_THREADS = None
    threads = SERVE_THREADS if args.threads is None else args.threads
    if threads:  # 0: torch's default, one per core
        torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    model = build_model(args.shape, device, "bfloat16" if device == "cuda" else "float32")
    config = model.config
    tokenizer = word_tokenizer(config.vocab_size, config.eos_token_id, config.bos_token_id, config.pad_token_id)
    accepted = inspect.signature(create_app).parameters
    kwargs = dict(model_name="bench", max_batch_size=args.max_batch_size or None)
    if "max_batch_width" in accepted:
        kwargs["max_batch_width"] = args.max_batch_width
    if "batch_window_ms" in accepted:
        kwargs["batch_window_ms"] = args.batch_window_ms
    app = create_app(model, tokenizer, **kwargs)
    engine = getattr(app.state.server.batcher, "engine", None)
    if engine is not None and args.width_granularity:
        engine.scheduler.width_granularity = args.width_granularity
    if engine is not None and args.max_batch_positions:
        engine.set_max_batch_positions(args.max_batch_positions)
    if engine is not None and args.max_refresh_positions is not None and not engine.keeps_row_kv:
        engine.scheduler.max_refresh_positions = (
            args.max_refresh_positions or None
        )  # block-causal layouts are never cut
    if args.server_kind == "continuous-join-apart":
        engine.scheduler.join_layout_min_rows = args.join_layout_min_rows
    if args.server_kind == "continuous-join-in":  # the engine's rule before joining rows decoded apart
        engine.scheduler.join_layout_min_rows = None
    trace = trace_boundaries(app.state.server.batcher) if engine is not None else []

    @app.get("/bench-trace")
    async def boundary_trace(since: int = 0):
        return {"length": len(trace), "boundaries": trace[since:]}

    @app.get("/bench-memory")
    async def memory():
        if device != "cuda":
            return {"peak_bytes": None}
        return {"peak_bytes": torch.cuda.max_memory_allocated()}

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


# -- the load ------------------------------------------------------------------------------------------------------


SERVER_KINDS = ("continuous", "continuous-cudnn", "continuous-join-in", "continuous-join-apart", "window")


def request_key(prompt: list[int]) -> str:
    """A request's key in the server's boundary trace: its prompt's last tokens (random ids)."""
    return ",".join(str(token) for token in prompt[-4:])


def _autotuned_kernels() -> list:
    """The package's Triton autotuners (none without Triton: the modules then define no kernels)."""
    from hf_dllm import fp8, grouped_gemm

    kernels = [(grouped_gemm, "_grouped_kernel"), (fp8, "_weight_only_kernel"), (fp8, "_w8a8_kernel")]
    return [getattr(module, name) for module, name in kernels if hasattr(getattr(module, name, None), "cache")]


def trace_boundaries(batcher) -> list[dict]:
    """Record every block boundary of the server's engine (benchmark only): its start and end, and for each layout its
    end, rows, the rows that decoded their first block in it (`request_key`) and the steps the CUDA-graph runner
    ran eagerly for a new shape meanwhile; and the boundary's new entries in Triton's kernel cache (kernels
    compiled). Times are `time.monotonic()`, which the load process shares."""
    import gc
    import time

    import torch

    from hf_dllm.serving.layout import LayoutRun

    trace, engine = [], batcher.engine
    # Triton's kernel cache: an entry more means a kernel was compiled during the boundary.
    triton_cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")

    def compiled() -> set[str]:
        return set(os.listdir(triton_cache)) if triton_cache.is_dir() else set()

    def kernel_names(entries: set[str]) -> list[str]:
        """The kernels of new cache entries (each entry's folder holds `<kernel>.json` beside its binaries)."""
        names = []
        for entry in sorted(entries):
            folder = triton_cache / entry
            names += [f[: -len(".json")] for f in os.listdir(folder) if f.endswith(".json") and not f.startswith("__")]
        return names

    # What else can stall a boundary: an autotuner timing its configs for a new key (it runs every config, each
    # for ~0.1 s), the CUDA caching allocator calling cudaMalloc (or freeing its cache and retrying: a device
    # sync), and Python's garbage collector (it holds the GIL).
    autotuned = _autotuned_kernels()
    gc_state = dict(started=None, seconds=0.0)

    def on_gc(phase, info):
        if phase == "start":
            gc_state["started"] = time.perf_counter()
        elif gc_state["started"] is not None:
            gc_state["seconds"] += time.perf_counter() - gc_state["started"]
            gc_state["started"] = None

    gc.callbacks.append(on_gc)

    def stalls() -> dict:
        memory = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        return dict(
            tuned=sum(len(kernel.cache) for kernel in autotuned),
            device_allocs=memory.get("num_device_alloc", 0),
            alloc_retries=memory.get("num_alloc_retries", 0),
            gc_s=gc_state["seconds"],
        )

    original_block, original_boundary = LayoutRun.decode_block, batcher.decode_boundary

    def decode_block(run, rows, width):
        joined = [request_key(row.prompt_ids) for row in rows if row.block == 0]
        joined_tokens = sum(len(row.prompt_ids) for row in rows if row.block == 0)
        eager, started = engine.graph_counts()["eager"], time.monotonic()
        try:
            return original_block(run, rows, width)
        finally:
            ended = time.monotonic()
            trace[-1]["layouts"].append(
                dict(
                    start=started,
                    end=ended,
                    s=ended - started,
                    rows=len(rows),
                    width=width,
                    joined=joined,
                    joined_tokens=joined_tokens,
                    new_shapes=engine.graph_counts()["eager"] - eager,
                )
            )

    def decode_boundary():
        trace.append(dict(start=time.monotonic(), waiting=engine.pending() + len(batcher._submitted), layouts=[]))
        kernels, before = compiled(), stalls()
        original_boundary()
        after, new = stalls(), compiled() - kernels
        trace[-1].update(
            end=time.monotonic(),
            compiled=len(new),
            compiled_kernels=kernel_names(new) if new else [],
            **{k: after[k] - before[k] for k in after},
        )

    LayoutRun.decode_block = decode_block
    batcher.decode_boundary = decode_boundary
    return trace


def first_block_parts(records: list[dict], trace: list[dict]) -> list[dict]:
    """Each answered request's time to first block, split at the server's boundaries: `before` (from sending to
    its admission: the start of the boundary it joined, having waited out the boundary under way when it arrived
    and any others, `passed`; or, joining a boundary under way, the start of its first layout after the request
    was sent), `own` (from its admission to the end of the layout that decoded its first block), `mid_boundary`
    (whether it joined a boundary under way) and `after` (from there to the first streamed text: the scheduler's
    hand-off, HTTP, the client)."""
    joined = {}
    for boundary in trace:
        for layout in boundary["layouts"]:
            for key in layout["joined"]:
                joined.setdefault(key, []).append((boundary, layout))
    parts = []
    for record in records:
        if "first_at" not in record:
            continue
        sent = record["sent_at"]
        # The same prompts recur at every rate: the first layout that started after this request was sent.
        found = next(((b, lay) for b, lay in joined.get(record["key"], []) if lay["start"] >= sent), None)
        if found is None:
            continue
        boundary, layout = found
        mid_boundary = boundary["start"] < sent
        admitted = (
            min(lay["start"] for lay in boundary["layouts"] if lay["start"] >= sent)
            if mid_boundary
            else boundary["start"]
        )
        passed = [b for b in trace if sent <= b["start"] < boundary["start"]]
        under_way = [b for b in trace if b["start"] < sent <= b["end"]]
        parts.append(
            dict(
                first_block=record["first_at"] - sent,
                before=admitted - sent,
                passed=len(passed),
                mid_boundary=mid_boundary,
                own=layout["end"] - admitted,
                after=record["first_at"] - layout["end"],
                rows=sum(lay["rows"] for lay in boundary["layouts"]),
                layout_rows=layout["rows"],
                new_shapes=sum(
                    lay["new_shapes"]
                    for b in {id(b): b for b in [*under_way, *passed, boundary]}.values()
                    for lay in b["layouts"]
                ),
                compiled=sum(b["compiled"] for b in {id(b): b for b in [*under_way, *passed, boundary]}.values()),
                waiting=boundary["waiting"],
            )
        )
    return parts


# What `trace_boundaries` counts per boundary besides compiles: new autotuner keys, cudaMalloc calls, allocator
# retries (cache freed: a device sync), seconds in Python's garbage collector.
STALLS = ("tuned", "device_allocs", "alloc_retries", "gc_s")


def trace_summary(records: list[dict], trace: list[dict]) -> dict:
    """The parts of the time to first block (`first_block_parts`): their means, and the five slowest requests;
    boundary seconds (p50, p90, max) and how many boundaries ran a new step shape eagerly."""
    trace = [b for b in trace if "end" in b]  # boundaries that ended (the last may still be recording)
    parts = first_block_parts(records, trace)
    seconds = [b["end"] - b["start"] for b in trace]
    slowest = sorted(parts, key=lambda part: -part["first_block"])[:5]
    return dict(
        traced=len(parts),
        mean={name: sum(p[name] for p in parts) / len(parts) for name in ("before", "own", "after")} if parts else {},
        joined_mid_boundary=sum(p["mid_boundary"] for p in parts),
        slowest=[{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()} for p in slowest],
        boundaries=len(seconds),
        boundary_s={q: percentile(seconds, q) for q in (50, 90, 100)},
        boundaries_with_new_shapes=sum(any(lay["new_shapes"] for lay in b["layouts"]) for b in trace),
        kernels_compiled=sum(b["compiled"] for b in trace),
        compiled_kernels=sorted({name for b in trace for name in b.get("compiled_kernels", [])}),
        stalls={name: round(sum(b.get(name, 0) for b in trace), 3) for name in STALLS},
        slowest_boundaries=[
            dict(
                s=round(b["end"] - b["start"], 3),
                rows=[lay["rows"] for lay in b["layouts"]],
                width=[lay["width"] for lay in b["layouts"]],
                layout_s=[round(lay["s"], 3) for lay in b["layouts"] if "s" in lay],
                joined_tokens=[lay.get("joined_tokens") for lay in b["layouts"]],
                new_shapes=sum(lay["new_shapes"] for lay in b["layouts"]),
                compiled=b["compiled"],
                **{name: round(b[name], 3) for name in STALLS if name in b},
            )
            for b in sorted(trace, key=lambda b: b["start"] - b["end"])[:3]
        ],
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def workload(
    vocab: int,
    count: int,
    seed: int = 0,
    prompt_range: tuple[int, int] = PROMPT_RANGE,
    output_range: tuple[int, int] = OUTPUT_RANGE,
) -> list[dict]:
    """Prompts and lengths, fixed by the seed (the same for every server and rate)."""
    rng = random.Random(seed)
    items = []
    low_prompt, high_prompt = prompt_range
    low_out, high_out = output_range
    for _ in range(count):
        prompt = [rng.randrange(0, vocab - 400) for _ in range(rng.randint(low_prompt, high_prompt))]
        max_tokens = -(-rng.randint(low_out, high_out) // BLOCK) * BLOCK
        items.append(dict(prompt=prompt, max_tokens=max_tokens))
    return items


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Open-loop Poisson arrivals: seconds from the first request (exponential gaps of mean 1 / rate)."""
    rng, at, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(at)
        at += rng.expovariate(rate)
    return times


def engine_requests(model, items: list[dict]) -> list:
    """The workload's requests for `ContinuousBatcher` directly (no server), with `request_settings`."""
    from hf_dllm.serving.rows import EngineRequest

    return [
        EngineRequest(
            item["prompt"],
            model.resolve_generation_config(**request_settings(item, model.diffusion_family)),
            lambda u: None,
        )
        for item in items
    ]


def save_checkpoint(args, directory: Path) -> None:
    """The shape's random model (`build_model`, seed 0) and word tokenizer saved to `directory`, for a server that
    loads it (`--tp`: `torchrun -m hf_dllm serve DIR --tp-plan auto`)."""
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    model = build_model(args.shape, device, "bfloat16" if device == "cuda" else "float32")
    config = model.config
    model.save_pretrained(directory)
    word_tokenizer(config.vocab_size, config.eos_token_id, config.bos_token_id, config.pad_token_id).save_pretrained(
        directory
    )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def tensor_parallel_command(args, port: int) -> list[str]:
    """`hf-dllm serve` of `args.checkpoint` sharded over `args.tp` processes (one GPU each; gloo on the CPU), the
    command users run, with the engine options of the in-process server."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.tp)]
    command += ["-m", "hf_dllm", "serve", str(args.checkpoint), "--tp-plan", "auto", "--port", str(port)]
    command += ["--served-model-name", "bench", "--log-level", "warning"]
    if args.shape in LLADA2_SHAPES:  # as `build_model` builds them for the in-process server
        command += ["--attn-implementation", "sdpa"]
    if args.max_batch_size:
        command += ["--max-batch-size", str(args.max_batch_size)]
    if args.max_batch_width:
        command += ["--max-batch-width", str(args.max_batch_width)]
    if args.max_batch_positions:
        command += ["--max-batch-positions", str(args.max_batch_positions)]
    if args.cpu:
        command += ["--threads", "1"]
    return command


class ServerProcess:
    def __init__(self, args, kind: str):
        self.port = free_port()
        env = dict(os.environ)
        code = str(Path(args.window_code).resolve()) if kind == "window" else str(REPO)
        env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
        if args.tp > 1:  # NVLink multicast stays off (issue #64)
            env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1")
            if args.cpu:
                env["CUDA_VISIBLE_DEVICES"] = ""
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--role",
            "server",
            "--port",
            str(self.port),
            "--shape",
            args.shape,
            "--max-batch-size",
            str(args.max_batch_size),
            "--batch-window-ms",
            str(args.batch_window_ms),
            "--width-granularity",
            str(args.width_granularity or 0),
        ]
        if args.max_batch_width:
            command += ["--max-batch-width", str(args.max_batch_width)]
        if args.max_batch_positions and kind != "window":
            command += ["--max-batch-positions", str(args.max_batch_positions)]
        if args.cpu:
            command.append("--cpu")
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        command += ["--server-kind", kind, "--join-layout-min-rows", str(args.join_layout_min_rows)]
        if args.max_refresh_positions is not None:
            command += ["--max-refresh-positions", str(args.max_refresh_positions)]
        if args.tp > 1:
            command = tensor_parallel_command(args, self.port)
        self.process = subprocess.Popen(command, env=env, cwd=code)
        self.url = f"http://127.0.0.1:{self.port}"
        import httpx

        deadline = time.monotonic() + args.start_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {kind} server exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the {kind} server did not start in {args.start_timeout} s")
            time.sleep(1)

    def get(self, path: str) -> dict:
        import httpx

        return httpx.get(f"{self.url}{path}", timeout=10).json()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def one_request(client, item: dict, extra: dict, start: float, record: dict) -> None:
    sent = time.monotonic()
    record.update(arrival=sent - start, sent_at=sent, key=request_key(item["prompt"]))
    try:
        stream = await client.completions.create(
            model="bench",
            prompt=item["prompt"],
            max_tokens=item["max_tokens"],
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        text = []
        async for chunk in stream:
            now = time.monotonic()
            if chunk.choices and chunk.choices[0].text and "first_block" not in record:
                record.update(first_block=now - sent, first_at=now)
            if chunk.choices:
                text.append(chunk.choices[0].text)
            if chunk.usage is not None:
                record["completion_tokens"] = chunk.usage.completion_tokens
        record.update(latency=time.monotonic() - sent, done=time.monotonic() - start, text="".join(text))
    except Exception as error:  # counted as failed, never silently dropped
        record["error"] = f"{type(error).__name__}: {error}"


def decoded_blocks(item: dict, family) -> int:
    """Blocks a request decodes, as its model family plans it (`DiffusionFamily.plan`: LLaDA's blocks follow the
    prompt; LLaDA2's are aligned to positions, the first holding the prompt's end)."""
    import torch

    from hf_dllm.generation_config import DiffusionGenerationConfig

    prompt = len(item["prompt"])
    config = DiffusionGenerationConfig(max_new_tokens=item["max_tokens"], block_length=BLOCK, steps=None)
    plan = family.plan([prompt], prompt, config, torch.device("cpu"))
    return sum(1 for end in (end for _, end in plan.blocks[: int(plan.last_block[0]) + 1]) if end > prompt)


def request_settings(item: dict, family) -> dict:
    """`generate()` settings of a workload request (every server, the answer check and the engine scripts): block
    32, dual cache, `STEPS_PER_BLOCK` steps per decoded block, no early stop."""
    return dict(
        max_new_tokens=item["max_tokens"],
        block_length=BLOCK,
        steps=decoded_blocks(item, family) * STEPS_PER_BLOCK,
        use_cache=True,
        dual_cache=True,
        eos_early_stop=False,
    )


async def offered_load(url: str, items: list[dict], rate: float, seed: int, timeout: float, family) -> list[dict]:
    """Open loop: request i is sent at its Poisson arrival time, whatever the server's state."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    records = [dict() for _ in items]
    tasks = []
    start = time.monotonic()
    for item, record, at in zip(items, records, arrival_times(len(items), rate, seed), strict=True):
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        extra = request_settings(item, family)
        del extra["max_new_tokens"]  # sent as the request's `max_tokens`
        tasks.append(asyncio.create_task(one_request(client, item, extra, start, record)))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    await client.close()
    return records


def summarize(records: list[dict]) -> dict:
    done = [r for r in records if "latency" in r]
    tokens = sum(r.get("completion_tokens", 0) for r in done)
    span = max((r["done"] for r in done), default=0.0) - min((r["arrival"] for r in records), default=0.0)
    return dict(
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        tokens=tokens,
        throughput_tokens_per_s=tokens / span if span > 0 else 0.0,
        p50_latency_s=percentile([r["latency"] for r in done], 50),
        p99_latency_s=percentile([r["latency"] for r in done], 99),
        p50_first_block_s=percentile([r["first_block"] for r in done if "first_block" in r], 50),
        p99_first_block_s=percentile([r["first_block"] for r in done if "first_block" in r], 99),
    )


def requests_per_second(records: list[dict]) -> float:
    """Completed requests over the time from the first arrival to the last answer."""
    done = [r for r in records if "latency" in r]
    span = max((r["done"] for r in done), default=0.0) - min((r["arrival"] for r in records), default=0.0)
    return len(done) / span if span > 0 else 0.0


def check_answers(args, items: list[dict], records: list[dict], count: int) -> dict:
    """Answers of the continuous server against `generate()` alone (same weights, same settings); exact only in
    float32 (`--cpu`)."""
    import torch

    model = build_model(args.shape, "cpu", "float32")
    config = model.config
    tokenizer = word_tokenizer(config.vocab_size, config.eos_token_id, config.bos_token_id, config.pad_token_id)
    checked = equal = 0
    for item, record in list(zip(items, records, strict=True))[:count]:
        if "text" not in record:
            continue
        out = model.generate(torch.tensor([item["prompt"]]), **request_settings(item, model.diffusion_family))
        out = out[0, len(item["prompt"]) :].tolist()
        stops = {config.eos_token_id}
        end = next((i for i, token in enumerate(out) if token in stops), len(out))
        checked += 1
        equal += tokenizer.decode(out[:end], skip_special_tokens=True) == record["text"]
    return dict(checked=checked, equal=equal)


def measure(args) -> dict:
    vocab = llada2_fields(args.shape)["vocab_size"] if args.shape in LLADA2_SHAPES else SHAPES[args.shape]["vocab_size"]
    rates = [float(rate) for rate in args.rates.split(",")]
    items = workload(vocab, args.requests, args.seed, args.prompt_range, args.output_range)
    from hf_dllm.family import registered_family

    family = registered_family("llada2" if args.shape in LLADA2_SHAPES else "llada")  # how requests are planned
    results = {}
    for kind in args.servers.split(","):
        server = ServerProcess(args, kind)
        try:
            # Warm-up: kernels, CUDA graphs of the common shapes.
            asyncio.run(offered_load(server.url, items[: args.warmup], 100.0, args.seed, args.timeout, family))
            bench_routes = kind != "window" and args.tp == 1  # `hf-dllm serve` itself (`--tp`) has none
            for rate in rates:
                traced = server.get(f"/bench-trace?since={2**62}")["length"] if bench_routes else 0
                records = asyncio.run(offered_load(server.url, items, rate, args.seed + 1, args.timeout, family))
                summary = summarize(records)
                summary["requests_per_s"] = requests_per_second(records)
                if bench_routes:
                    summary["first_block_parts"] = trace_summary(
                        records, server.get(f"/bench-trace?since={traced}")["boundaries"]
                    )
                health = server.get("/health")
                summary["batching"] = health.get("batching")
                summary["max_batch_size"] = health.get("max_batch_size", args.max_batch_size)
                summary["max_batch_positions"] = health.get("max_batch_positions")
                summary["peak_gpu_bytes"] = server.get("/bench-memory")["peak_bytes"] if bench_routes else None
                if kind != "window" and args.check:
                    summary["check"] = check_answers(args, items, records, args.check)
                # A rate measured again (e.g. the cold start, then the warm peak) keeps both: "16.0", "16.0#2".
                repeat = sum(k == kind and str(r).split("#")[0] == str(rate) for k, r in results)
                results[(kind, rate if not repeat else f"{rate}#{repeat + 1}")] = summary
                print(
                    f"{kind} rate {rate}: {json.dumps({k: v for k, v in summary.items() if k != 'batching'})}",
                    flush=True,
                )
        finally:
            server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["load", "server"], default="load")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="small shape on the CPU (smoke run)")
    parser.add_argument("--shape", choices=sorted(SHAPES) + list(LLADA2_SHAPES), default=None)
    parser.add_argument("--rates", default=None, help="comma-separated request rates (requests/s)")
    parser.add_argument("--requests", type=int, default=None, help="requests per rate")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument(
        "--max-batch-size", type=int, default=16, help="0: the continuous server's default (from the GPU's memory)"
    )
    parser.add_argument("--max-batch-width", type=int, default=None)
    parser.add_argument(
        "--max-batch-positions",
        type=int,
        default=0,
        help="the continuous servers' K/V budget (`ContinuousBatcher.max_batch_positions`; 0: the engine's default, "
        "which with --max-batch-size 0 on CUDA is from the GPU's memory, else none)",
    )
    parser.add_argument("--width-granularity", type=int, default=0, help="0: the engine's default")
    parser.add_argument("--batch-window-ms", type=float, default=10.0, help="the window server's window")
    parser.add_argument("--window-code", default=None, help="folder holding the window-batching hf_dllm package")
    parser.add_argument(
        "--servers",
        default=None,
        help="which servers to measure (default: continuous,window with --window-code, else continuous), in order: continuous (hf-dllm serve's defaults), continuous-cudnn (the same "
        "engine with cuDNN's attention allowed, which plans per shape), continuous-join-in (joining rows always "
        "decode their first block in the running rows' layout), continuous-join-apart (joining rows decode their "
        "first block apart once --join-layout-min-rows others run: `ContinuousBatcher.join_layout_min_rows`), "
        "window (needs --window-code)",
    )
    parser.add_argument(
        "--join-layout-min-rows", type=int, default=4, help="the continuous-join-apart server's join_layout_min_rows"
    )
    parser.add_argument(
        "--max-refresh-positions",
        type=int,
        default=None,
        help="the continuous servers' `ContinuousBatcher.max_refresh_positions` (default: the engine's, no slices; "
        "0: no slices)",
    )
    parser.add_argument("--server-kind", choices=SERVER_KINDS, default="continuous", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=None)
    parser.add_argument("--output-range", type=int, nargs=2, default=None)
    parser.add_argument("--check", type=int, default=0, help="answers to compare with generate() alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="serve with `torchrun --nproc-per-node TP -m hf_dllm serve --tp-plan auto` (GPUs; gloo with --cpu)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of the server (default: hf-dllm serve's, 1; 0: torch's, one per core)",
    )
    parser.add_argument(
        "--cpu-hogs",
        type=int,
        default=0,
        help="busy-looping processes run beside the server while it is measured (other load on the cores)",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--start-timeout", type=float, default=600)
    args = parser.parse_args(argv)
    args.shape = args.shape or ("small" if args.cpu else "llada-8b")
    if args.role == "server":
        serve(args)  # the package comes from PYTHONPATH (this checkout, or --window-code's)
        return 0
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.tp > 1:  # `hf-dllm serve` itself, sharded: the continuous server only
        if args.servers is None:
            args.servers = "continuous"
        elif args.servers != "continuous":
            parser.error("--tp serves this checkout's `hf-dllm serve`: --servers continuous only")
    args.servers = args.servers or ("continuous,window" if args.window_code else "continuous")
    servers = args.servers.split(",")
    unknown = sorted(set(servers) - set(SERVER_KINDS))
    if unknown:
        parser.error(f"--servers: unknown {unknown}; choose from {', '.join(SERVER_KINDS)}")
    if "window" in servers and not args.window_code:
        parser.error("--servers window needs --window-code (the window-batching package's folder)")
    sys.path.insert(0, str(REPO))
    args.rates = args.rates or ("2,8" if args.cpu else "0.5,1,2")
    args.requests = args.requests or (16 if args.cpu else 48)
    args.prompt_range = args.prompt_range or (CPU_PROMPT_RANGE if args.cpu else PROMPT_RANGE)
    args.output_range = args.output_range or (CPU_OUTPUT_RANGE if args.cpu else OUTPUT_RANGE)
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(args.cpu_hogs)
    ]
    try:
        if args.tp > 1:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="bench_load_tp_") as directory:
                args.checkpoint = Path(directory)
                save_checkpoint(args, args.checkpoint)
                results = measure(args)
        else:
            results = measure(args)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print()
    header = [
        "server",
        "rate/s",
        "done",
        "failed",
        "tok/s",
        "req/s",
        "p50 lat s",
        "p99 lat s",
        "p50 TTFB s",
        "p99 TTFB s",
        "rows/layout or batch",
        "s/boundary",
        "1st-step positions/boundary",
        "peak GB",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for (kind, rate), s in results.items():
        batching = s.get("batching") or {}
        per = batching.get("mean_rows_per_layout", batching.get("mean_batch_size"))
        boundary_s = batching.get("mean_boundary_s")
        first_step = batching.get("mean_first_step_positions_per_boundary")
        peak = s["peak_gpu_bytes"]

        def fmt(value):
            return "-" if value is None else f"{value:.2f}"

        print(
            f"| {kind} | {rate} | {s['completed']} | {s['failed']} | {s['throughput_tokens_per_s']:.1f} | "
            f"{s['requests_per_s']:.2f} | "
            f"{fmt(s['p50_latency_s'])} | {fmt(s['p99_latency_s'])} | {fmt(s['p50_first_block_s'])} | "
            f"{fmt(s['p99_first_block_s'])} | {fmt(per)} | {'-' if boundary_s is None else f'{boundary_s:.3f}'} | "
            f"{'-' if first_step is None else f'{first_step:.0f}'} | {'-' if peak is None else f'{peak / 1e9:.1f}'} |"
        )
    import torch

    summary = dict(
        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.cpu else "cpu",
        shape=args.shape,
        tp=args.tp,
        max_batch_size=args.max_batch_size,
        threads=args.threads,
        cpu_hogs=args.cpu_hogs,
        prompt_range=args.prompt_range,
        output_range=args.output_range,
        block_length=BLOCK,
        steps_per_block=STEPS_PER_BLOCK,
        results={f"{kind}@{rate}": s for (kind, rate), s in results.items()},
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
