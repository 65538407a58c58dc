"""Hostile input against the real `hf-dllm serve` process: statuses, response times and the server's memory.

    python benchmarks/bench_hostile.py                 # tiny random LLaDA (context 512), 3 rounds of every case

Starts `python -m hf_dllm serve MODEL --api-key KEY` as a subprocess on a free loopback port (127.0.0.1 only) and
measures, from outside, the server process's resident memory (VmRSS of /proc/PID/status):

1. `HTTP_CASES` of `tests/serving/test_hostile.py` (malformed JSON, NaN / huge numbers, 1 MiB prompts, 100k-deep nesting,
   surrogates, wrong content types, oversized bodies, ...), `--rounds` times on one keep-alive connection, plus the
   same without the API key (401): every status, the slowest answer, memory before and after;
2. the largest bodies: a declared Content-Length of 1 GiB and 64 GiB whose body is never sent (time to the 413),
   and bodies of 64 MiB and 256 MiB actually uploaded, with Content-Length and chunked (time from the first byte
   sent to the 413, memory after);
3. bodies just under the limit (a 4 MiB prompt, a 4 MiB chat message): parsed, then refused by their length in
   characters without being tokenized;
4. a valid request after all that (the server still serves).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_serve import free_port, tiny_random_checkpoint  # noqa: E402

from tests.serving.test_hostile import API_KEY, HTTP_CASES, JSON, MODEL_NAME, Connection, completion, rss_bytes  # noqa: E402


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def wait_until_up(process, port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(process.stdout.read().decode())
        try:
            with Connection(port, timeout=2) as connection:
                if connection.request("GET", "/health").status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("the server did not come up")


def upload(port: int, size: int, chunked: bool, key: dict) -> dict:
    """Send a body of `size` bytes (a JSON prompt of 'a's) and time the 413."""
    body = b'{"prompt": "' + b"a" * (size - 14) + b'"}'
    headers = {**key, "Transfer-Encoding": "chunked"} if chunked else key
    with Connection(port) as connection:
        reply = connection.request("POST", "/v1/completions", body, headers)
        followup = connection.request("GET", "/v1/models", headers=key).status
    return {"status": reply.status, "seconds": round(reply.seconds, 3), "same_connection_next_status": followup}


def declared(port: int, size: int, key: dict) -> dict:
    """Declare `size` bytes in Content-Length, send none: time to the 413."""
    with Connection(port) as connection:
        start = time.monotonic()
        connection.send_head("POST", "/v1/completions", {**key, "Content-Length": str(size)})
        reply = connection.read_reply()
    return {"status": reply.status, "seconds": round(time.monotonic() - start, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="times every case is sent")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        model = tiny_random_checkpoint(folder)
        port = free_port()
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        command = [sys.executable, "-m", "hf_dllm", "serve", model, "--port", str(port), "--threads", "1"]
        command += ["--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--log-level", "warning"]
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            wait_until_up(process, port)
            key = {**JSON, "Authorization": f"Bearer {API_KEY}"}
            with Connection(port) as connection:  # warm-up: one valid request
                assert connection.request("POST", "/v1/completions", completion(max_tokens=8), key).status == 200
            rss_start = rss_bytes(process.pid)

            statuses: dict[int, int] = {}
            slowest = (0.0, "")
            sent = 0
            with Connection(port) as connection:
                for _ in range(args.rounds):
                    for case in HTTP_CASES:
                        headers = {**case.headers, "Authorization": key["Authorization"]}
                        for with_key in (True, False):
                            reply = connection.request(
                                case.method, case.path, case.body, headers if with_key else case.headers
                            )
                            expected = case.status if with_key else 401
                            assert reply.status == expected, (case.name, with_key, reply.status, reply.body[:300])
                            statuses[reply.status] = statuses.get(reply.status, 0) + 1
                            sent += 1
                            if reply.seconds > slowest[0]:
                                slowest = (reply.seconds, case.name)
            rss_cases = rss_bytes(process.pid)

            large = {
                "declared_1GiB": declared(port, 1 << 30, key),
                "declared_64GiB": declared(port, 64 << 30, key),
            }
            # Just under the 4 MiB limit: read and parsed (off the event loop), refused by its length in characters.
            for name, body in (
                ("prompt_4MiB_under_limit", completion(prompt="a" * ((4 << 20) - 200))),
                (
                    "chat_4MiB_under_limit",
                    json.dumps({"messages": [{"role": "user", "content": "a" * ((4 << 20) - 200)}]}).encode(),
                ),
            ):
                path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
                with Connection(port) as connection:
                    reply = connection.request("POST", path, body, key)
                large[name] = {
                    "status": reply.status,
                    "code": reply.json()["error"]["code"],
                    "seconds": round(reply.seconds, 3),
                }
            for size in (64 << 20, 256 << 20):
                for chunked in (False, True):
                    name = f"uploaded_{size >> 20}MiB{'_chunked' if chunked else ''}"
                    large[name] = upload(port, size, chunked, key)
            rss_end = rss_bytes(process.pid)
            with Connection(port) as connection:
                final = connection.request("POST", "/v1/completions", completion(max_tokens=8), key)
            health = json.loads(Connection(port).request("GET", "/health").body)
        finally:
            process.terminate()
            process.wait(30)

    result = {
        "cases": len(HTTP_CASES),
        "requests": sent,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "all_4xx": all(400 <= status < 500 for status in statuses),
        "slowest_s": round(slowest[0], 3),
        "slowest_case": slowest[1],
        "server_rss_mib": {"after_warmup": mib(rss_start), "after_cases": mib(rss_cases), "after_large": mib(rss_end)},
        "large_bodies": large,
        "valid_request_after": final.status,
        "batch_errors": health["batching"]["errors"],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
    }
    print(f"{sent} hostile requests ({len(HTTP_CASES)} cases x {args.rounds} rounds, with and without the key):")
    print(f"  statuses {result['statuses']}, slowest {slowest[0]:.3f} s ({slowest[1]})")
    print(
        f"  server RSS: {mib(rss_start)} MiB after warm-up, {mib(rss_cases)} after the cases, {mib(rss_end)} at the end"
    )
    for name, outcome in large.items():
        print(f"  {name}: {outcome}")
    print(f"  valid request afterwards: {final.status}; generate() errors: {result['batch_errors']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
