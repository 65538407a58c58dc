"""Bounded load test of `hf-dllm serve`: N concurrent OpenAI clients against a server on 127.0.0.1.

    python benchmarks/bench_serve.py                       # tiny random LLaDA, 32 clients x 4 requests
    python benchmarks/bench_serve.py --model tests/fixtures/llada-tiny-trained --compare-unbatched

Starts `python -m hf_dllm serve MODEL` as a subprocess on a free loopback port, runs `--clients` concurrent
clients (the official `openai` async client), each sending `--requests` requests one after the other (half of the
clients stream), then checks every answer against a direct `model.generate()` on the same prompt and parameters
(`--no-check` skips that). Traffic goes to 127.0.0.1 only; the run is bounded by `--timeout` seconds.

Prints a table, then one JSON line: requests/s, completion tokens/s, mean rows per layout (rows decoded together
per block, the batching factor of the continuous-batching engine), latency percentiles, and the same for the
unbatched server (`--max-batch-size 1`) with `--compare-unbatched`. The open-loop load benchmark of issue #14 is
`bench_load.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINED = REPO / "tests" / "fixtures" / "llada-tiny-trained"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_random_checkpoint(folder: str) -> str:
    """The tests' tiny LLaDA (d_model 64, 2 layers, random weights) with the character tokenizer."""
    import torch

    import hf_dllm
    from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    config = hf_dllm.LLaDAConfig(
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        mlp_hidden_size=128,
        vocab_size=103,
        embedding_size=103,
        max_sequence_length=512,
        mask_token_id=3,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=1,
    )
    hf_dllm.LLaDAModelLM(config).eval().save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return folder


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class ServerProcess:
    def __init__(self, model: str, max_batch_size: int, extra: list[str], timeout: float):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "hf_dllm",
            "serve",
            model,
            "--port",
            str(self.port),
            "--served-model-name",
            "bench",
            "--max-batch-size",
            str(max_batch_size),
            "--log-level",
            "warning",
            *extra,
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.process = subprocess.Popen(command, cwd=REPO, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"hf-dllm serve exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("hf-dllm serve did not come up")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def stats(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/health", timeout=10).json()["batching"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def make_workload(args) -> list[dict]:
    """One entry per request: prompt, parameters (two groups alternate per client), streaming or not."""
    groups = [{"block_length": args.block_length}, {"block_length": args.block_length, "threshold": 0.9}]
    groups = groups[: args.groups]
    workload = []
    for client in range(args.clients):
        for turn in range(args.requests):
            n = client * args.requests + turn
            workload.append(
                dict(
                    client=client,
                    prompt=f"Request {n}: " + "abcdefgh"[: n % 8 + 1] * (1 + n % 3),
                    extra=groups[(client + turn) % len(groups)],
                    stream=client % 2 == 1,
                )
            )
    return workload


async def run_clients(url: str, workload: list[dict], clients: int, max_tokens: int, timeout: float) -> tuple:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    results: dict[int, dict] = {}

    async def one(i: int, item: dict) -> None:
        start = time.perf_counter()
        kwargs = dict(model="bench", prompt=item["prompt"], max_tokens=max_tokens, extra_body=item["extra"])
        if item["stream"]:
            text, finish, usage, first = "", None, None, None
            stream = await client.completions.create(stream=True, **kwargs)
            async for chunk in stream:
                if chunk.choices:
                    if first is None:
                        first = time.perf_counter() - start
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
        else:
            out = await client.completions.create(**kwargs)
            text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
            first = None
        results[i] = dict(
            text=text,
            finish=finish,
            tokens=usage.completion_tokens,
            nfe=usage.model_extra["nfe"],
            latency=time.perf_counter() - start,
            first_chunk=first,
        )

    async def client_loop(c: int) -> None:
        for i, item in enumerate(workload):
            if item["client"] == c:
                await one(i, item)

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(client_loop(c) for c in range(clients))), timeout)
    elapsed = time.perf_counter() - start
    await client.close()
    return results, elapsed


def check(model_dir: str, workload: list[dict], results: dict, max_tokens: int) -> int:
    """Compare every answer with a direct model.generate(): returns the number of mismatches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_dllm  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = set(model.generation_config.eos_token_ids) | {tokenizer.eos_token_id}
    eot = tokenizer.get_vocab().get("<|eot_id|>")
    stops |= {eot} if eot is not None else set()
    cache, mismatches = {}, 0
    for i, item in enumerate(workload):
        key = (item["prompt"], json.dumps(item["extra"], sort_keys=True))
        if key not in cache:
            ids = tokenizer(item["prompt"])["input_ids"]
            block = item["extra"]["block_length"]
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=math.ceil(max_tokens / block) * block,
                eos_token_id=sorted(stops),
                return_dict_in_generate=True,
                **item["extra"],
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            end = min([max_tokens] + [j for j, t in enumerate(tokens) if t in stops][:1])
            cache[key] = (tokenizer.decode(tokens[:end], skip_special_tokens=True), end, int(out.nfe_per_row[0]))
        got = results.get(i)
        if got is None or (got["text"], got["tokens"], got["nfe"]) != cache[key]:
            mismatches += 1
    return mismatches


def measure(args, model: str, max_batch_size: int) -> dict:
    workload = make_workload(args)
    extra = ["--threads", str(args.num_threads)] if args.num_threads else []
    server = ServerProcess(model, max_batch_size, extra, args.timeout)
    try:
        # Warm-up (not measured): one request per parameter group.
        warm = [dict(client=0, prompt="warm up", extra=item["extra"], stream=False) for item in workload[:2]]
        asyncio.run(run_clients(server.url, warm, 1, args.max_tokens, args.timeout))
        before = server.stats()
        results, elapsed = asyncio.run(run_clients(server.url, workload, args.clients, args.max_tokens, args.timeout))
        after = server.stats()
    finally:
        server.stop()
    latencies = [r["latency"] for r in results.values()]
    firsts = [r["first_chunk"] for r in results.values() if r["first_chunk"] is not None]
    layouts = after["layouts"] - before["layouts"]
    layout_rows = {size: count - before["layout_sizes"].get(size, 0) for size, count in after["layout_sizes"].items()}
    decoded_rows = sum(int(size) * count for size, count in layout_rows.items())
    summary = dict(
        max_batch_size=max_batch_size,
        requests=len(workload),
        completed=len(results),
        lost=len(workload) - len(results),
        seconds=round(elapsed, 3),
        requests_per_s=round(len(results) / elapsed, 2),
        completion_tokens_per_s=round(sum(r["tokens"] for r in results.values()) / elapsed, 1),
        mean_rows_per_layout=round(decoded_rows / layouts, 2) if layouts else 0.0,
        layouts=layouts,
        latency_p50_s=round(percentile(latencies, 50), 3),
        latency_p90_s=round(percentile(latencies, 90), 3),
        latency_p99_s=round(percentile(latencies, 99), 3),
        first_chunk_p50_s=round(percentile(firsts, 50), 3) if firsts else None,
        server_errors=after["errors"] - before["errors"],
    )
    if not args.no_check:
        summary["mismatches"] = check(model, workload, results, args.max_tokens)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="checkpoint folder (default: tiny trained if present, else a tiny random model)"
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4, help="requests per client, sent one after the other")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-length", type=int, default=16)
    parser.add_argument("--groups", type=int, default=2, choices=[1, 2], help="parameter groups in the mix")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads of the server")
    parser.add_argument("--compare-unbatched", action="store_true", help="also run with --max-batch-size 1")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with model.generate()")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on each phase, seconds")
    parser.add_argument("--cpu", action="store_true", help="quick check (CI): 4 clients x 1 request, one thread")
    args = parser.parse_args(argv)
    if args.cpu:
        args.clients, args.requests, args.num_threads = min(args.clients, 4), 1, args.num_threads or 1
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)  # the correctness check in this process too

    with tempfile.TemporaryDirectory() as folder:
        if args.model:
            model, label = args.model, args.model
        elif (TRAINED / "config.json").exists():
            model, label = str(TRAINED), "tests/fixtures/llada-tiny-trained"
        else:
            model, label = tiny_random_checkpoint(folder), "tiny random LLaDA (d_model 64, 2 layers)"
        runs = [measure(args, model, args.max_batch_size)]
        if args.compare_unbatched:
            runs.append(measure(args, model, 1))

    import torch

    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    print(f"\nhf-dllm serve load test: {label}; {machine}")
    print(
        f"{args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, block_length "
        f"{args.block_length}, {args.groups} parameter group(s), continuous batching\n"
    )
    columns = [
        "max_batch_size",
        "requests",
        "lost",
        "requests_per_s",
        "completion_tokens_per_s",
        "mean_rows_per_layout",
        "latency_p50_s",
        "latency_p90_s",
        "latency_p99_s",
        "first_chunk_p50_s",
        "mismatches",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for run in runs:
        print("| " + " | ".join(str(run.get(c, "-")) for c in columns) + " |")
    result = dict(runs[0], model=label, clients=args.clients, machine=machine)
    if len(runs) > 1:
        result["unbatched"] = runs[1]
        result["speedup_vs_unbatched"] = round(runs[0]["requests_per_s"] / runs[1]["requests_per_s"], 2)
    print(json.dumps(result))
    ok = all(run["lost"] == 0 and run.get("mismatches", 0) == 0 and run["server_errors"] == 0 for run in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
