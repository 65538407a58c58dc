"""Hostile input against the library and the real `hf-dllm serve` process (issues #15, #66): what is refused, how fast,
and what the server's memory and latency do.

    python benchmarks/bench_hostile.py          # tiny random LLaDA (context 512), 3 rounds, large uploads, 5/10 s deadlines
    python benchmarks/bench_hostile.py --cpu    # CI: 1 round, no large uploads, 1 s deadlines (well under a minute)

In this process:

1. bad `generate()` inputs (`tests/generation/test_inputs.py`'s and the issue's):
   refused with a ValueError / TypeError before any forward, N of N (forwards counted by hooks);
2. export faults (`tests/hub/test_export_limits.py`'s: NaN / inf weights, no tokenizer, a chat template that does not
   parse, a token id outside the vocabulary, a read-only or full destination): refused with nothing left at the
   destination or beside it, N of N.

Against `python -m hf_dllm serve MODEL --api-key KEY` started as a subprocess on a free loopback port (127.0.0.1
only), measuring from outside the server process's resident memory (VmRSS of /proc/PID/status):

3. `HTTP_CASES` of `tests/serving/test_hostile.py` (malformed JSON, NaN / huge numbers, 1 MiB prompts, 100k-deep nesting,
   forged chat roles, unbounded stop strings, wrong content types, oversized bodies, ...), `--rounds` times on one
   keep-alive connection, plus the same without the API key (401), then each case once more on a fresh connection
   followed by a health check (/health and a valid completion): every status 4xx, the server healthy after each;
4. slow connections (silent, a head or a body trickled a byte at a time, a Content-Length promising more than is
   sent): each answered 408 and closed within the server's deadline (`--header-timeout` / `--body-timeout`), N of N;
5. fairness: a one-prompt request's latency alone, and next to a 64-prompt request (48 tokens each) sent 0.3 s before
   it, measured in turns `--fair-repeats` times (default 5): the ratio of the medians (the goal: at most 3), and the
   64-prompt request's own time;
6. (without `--cpu`) the largest bodies: a declared Content-Length of 1 GiB and 64 GiB whose body is never sent
   (time to the 413), bodies of 64 MiB and 256 MiB actually uploaded, with Content-Length and chunked, and bodies
   just under the limit (parsed, then refused by their length in characters without being tokenized);
7. a valid request after all that (the server still serves).

Prints a summary, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
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


def generate_refusals() -> dict:
    """Every bad `generate()` input of the tests, on the tiny model: refused before any forward?"""
    import torch

    from tests.conftest import tiny_model
    from tests.generation.test_inputs import BAD_INPUTS, BAD_PROMPTS, GEN, PROMPT

    model = tiny_model()
    forwards = {"n": 0}
    for module in (model, model.model):
        module.register_forward_pre_hook(lambda *args: forwards.__setitem__("n", forwards["n"] + 1))
    cases = [(name, {**GEN, **kwargs}) for name, kwargs, _, _ in BAD_INPUTS]
    cases += [(f"prompt:{name}", {**GEN, "inputs": prompt}) for name, prompt, _, _ in BAD_PROMPTS]
    # Issue #66's: past the context, a block past 2**20, guidance past 100, an empty prompt without a BOS.
    cases += [
        ("max_new_tokens=10**6", {**GEN, "max_new_tokens": 10**6}),
        ("block_length=10**20", {**GEN, "block_length": 10**20}),
        ("cfg_scale=1e30", {**GEN, "cfg_scale": 1e30}),
        ("empty_prompt_without_bos", {**GEN, "inputs": torch.zeros(1, 0, dtype=torch.long), "bos_token_id": None}),
    ]
    refused, failures = 0, []
    for name, kwargs in cases:
        kwargs = dict(kwargs)
        prompt = kwargs.pop("inputs", PROMPT)
        before = forwards["n"]
        try:
            model.generate(prompt, **kwargs)
        except (ValueError, TypeError):
            if forwards["n"] == before:
                refused += 1
                continue
        failures.append(name)
    return {"cases": len(cases), "refused_before_a_forward": refused, "not_refused": failures}


def export_refusals() -> dict:
    """Every export fault of the tests: refused, with nothing left at the destination or beside it?"""
    import errno
    import shutil
    from unittest import mock

    from hf_dllm.hub import export
    from tests.conftest import save_checkpoint, tiny_model
    from tests.hub.test_export_limits import FAULTS

    refused, failures = 0, []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        source = save_checkpoint(tiny_model(seed=0), root / "source")
        faults = [(name, fault, None) for name, fault, _ in FAULTS]
        faults += [
            ("read_only_destination", None, ("tempfile.mkdtemp", OSError(errno.EROFS, "Read-only file system"))),
            ("full_destination", None, ("shutil.copyfile", OSError(errno.ENOSPC, "No space left on device"))),
        ]
        for name, fault, failure in faults:
            src = Path(shutil.copytree(source, root / name / "src"))
            if fault is not None:
                fault(src)
            dst = root / name / "out"
            patch = mock.patch(failure[0], side_effect=failure[1]) if failure else contextlib.nullcontext()
            try:
                with patch:
                    export.export_checkpoint(src, dst)
                ok = False
            except export.ExportError:
                left = [p.name for p in dst.parent.iterdir() if p.name.startswith((".out.", "out"))]
                ok = not left
            if ok:
                refused += 1
            else:
                failures.append(name)
    return {"cases": len(faults), "refused_nothing_left": refused, "not_refused": failures}


SLOW_CASES = [
    # (name, bytes sent at once, bytes then trickled one every 0.1 s, "head" or "body")
    ("silent_connection", b"", b"", "head"),
    ("slow_head", b"POST /v1/comp", b"letions HTTP/1.1\r\nHost: x\r\n" * 20, "head"),
    ("short_body_14_of_50", b"Content-Length: 50\r\n\r\n" + b'{"prompt": "a', b"", "body"),
    ("slow_body", b"Content-Length: 4000\r\n\r\n", b'{"prompt": "' + b"a" * 3900, "body"),
    ("slow_chunked_body", b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\na\r\n" * 1000, "body"),
]


def slow_connection(port: int, case, deadlines: dict, authorization: str) -> dict:
    """One slow client: its status, whether the server closed the connection, and when."""
    import socket

    name, sent, trickled, what = case
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: {authorization}\r\n"
    ).encode()
    if what == "body":
        sent = head + sent
    deadline = deadlines[what]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        start = time.monotonic()
        try:
            sock.sendall(sent)
            for byte in trickled:
                if time.monotonic() - start > deadline + 5:
                    break
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass  # closed while trickling: the answer is in the receive buffer
        sock.settimeout(deadline + 10)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
            closed = True
        except (TimeoutError, ConnectionResetError):
            closed = False
        seconds = time.monotonic() - start
    status = int(data.split()[1]) if data.startswith(b"HTTP/1.1") else None
    return {"status": status, "closed": closed, "seconds": round(seconds, 2), "deadline_s": deadline}


def fairness(port: int, key: dict, repeats: int) -> dict:
    """A one-prompt request's latency alone and sent 0.3 s after a 64-prompt request (48 tokens each), measured in
    turns (alone, then beside, `repeats` times: both under the same load of the shared machine), as medians; and
    the 64-prompt request's own time (what fairness costs it)."""
    import statistics
    import threading

    victim = completion(prompt="v" * 48, max_tokens=32, block_length=32)
    big = completion(prompt=["b" * 48] * 64, max_tokens=32, block_length=32)

    def timed(body: bytes, into: list | None = None) -> float:
        with Connection(port) as connection:
            reply = connection.request("POST", "/v1/completions", body, key)
        assert reply.status == 200, reply.body[:300]
        if into is not None:
            into.append(reply.seconds)
        return reply.seconds

    alone, beside, big_seconds = [], [], []
    for _ in range(repeats):
        alone.append(timed(victim))
        thread = threading.Thread(target=timed, args=(big, big_seconds))
        thread.start()
        time.sleep(0.3)  # the 64 rows are queued (and the first of them running) when the victim arrives
        beside.append(timed(victim))
        thread.join()
    ratio = statistics.median(beside) / statistics.median(alone)
    return {
        "repeats": repeats,
        "victim_alone_s": round(statistics.median(alone), 3),
        "victim_beside_64_prompts_s": round(statistics.median(beside), 3),
        "ratio": round(ratio, 2),
        "goal_met": ratio <= 3,
        "big_request_s": round(statistics.median(big_seconds), 3),
        "victim_alone_each_s": [round(x, 3) for x in alone],
        "victim_beside_each_s": [round(x, 3) for x in beside],
    }


def healthy(port: int, key: dict) -> bool:
    with Connection(port, timeout=30) as connection:
        if connection.request("GET", "/health").status != 200:
            return False
        return (
            connection.request("POST", "/v1/completions", completion(max_tokens=1, block_length=1), key).status == 200
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="quick run (CI): 1 round, no large uploads, 1 s deadlines")
    parser.add_argument("--rounds", type=int, default=None, help="times every case is sent (default 3; --cpu 1)")
    parser.add_argument(
        "--fair-repeats", type=int, default=5, help="alone / beside pairs of the fairness figure (median; default 5)"
    )
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.cpu else 3)
    deadlines = {"head": 1.0, "body": 1.0} if args.cpu else {"head": 5.0, "body": 10.0}
    started = time.monotonic()

    library = {"generate": generate_refusals(), "export": export_refusals()}

    with tempfile.TemporaryDirectory() as folder:
        model = tiny_random_checkpoint(folder)
        port = free_port()
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        command = [sys.executable, "-m", "hf_dllm", "serve", model, "--port", str(port), "--threads", "1"]
        command += ["--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--log-level", "warning"]
        command += ["--header-timeout", str(deadlines["head"]), "--body-timeout", str(deadlines["body"])]
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
                for _ in range(rounds):
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
            answered_4xx_healthy = 0
            for case in HTTP_CASES:  # each once more on a fresh connection, the server's health checked after it
                with Connection(port) as connection:
                    headers = {**case.headers, "Authorization": key["Authorization"]}
                    status = connection.request(case.method, case.path, case.body, headers).status
                answered_4xx_healthy += 400 <= status < 500 and healthy(port, key)
            rss_cases = rss_bytes(process.pid)

            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(SLOW_CASES)) as pool:
                slow = dict(
                    zip(
                        [case[0] for case in SLOW_CASES],
                        pool.map(lambda case: slow_connection(port, case, deadlines, key["Authorization"]), SLOW_CASES),
                        strict=True,
                    )
                )
            slow_ok = sum(
                outcome["status"] == 408 and outcome["closed"] and outcome["seconds"] <= outcome["deadline_s"] + 1.5
                for outcome in slow.values()
            )
            healthy_after_slow = healthy(port, key)
            fair = fairness(port, key, repeats=args.fair_repeats)

            large = {}
            if not args.cpu:
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

    generate, export = library["generate"], library["export"]
    result = {
        "generate_refused_before_forward": f"{generate['refused_before_a_forward']}/{generate['cases']}",
        "http_4xx_server_healthy_after_each": f"{answered_4xx_healthy}/{len(HTTP_CASES)}",
        "slow_connections_408_closed_within_deadline": f"{slow_ok}/{len(SLOW_CASES)}",
        "victim_latency_ratio_beside_64_prompts": fair["ratio"],
        "export_faults_refused_nothing_left": f"{export['refused_nothing_left']}/{export['cases']}",
        "generate": generate,
        "export": export,
        "fairness": fair,
        "slow_connections": slow,
        "healthy_after_slow_connections": healthy_after_slow,
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
        "mode": "cpu" if args.cpu else "full",
        "seconds": round(time.monotonic() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
    }
    print(f"bad generate() inputs refused before a forward: {result['generate_refused_before_forward']}")
    print(f"export faults refused, nothing left at the destination: {result['export_faults_refused_nothing_left']}")
    print(f"{sent} hostile requests ({len(HTTP_CASES)} cases x {rounds} rounds, with and without the key):")
    print(f"  statuses {result['statuses']}, slowest {slowest[0]:.3f} s ({slowest[1]})")
    print(
        f"  4xx with the server healthy after each (fresh connections): {result['http_4xx_server_healthy_after_each']}"
    )
    print(
        f"slow connections answered 408 and closed within the deadline: {result['slow_connections_408_closed_within_deadline']}"
    )
    for name, outcome in slow.items():
        print(f"  {name}: {outcome}")
    print(
        f"victim request, medians of {fair['repeats']} measured in turns: {fair['victim_alone_s']} s alone, "
        f"{fair['victim_beside_64_prompts_s']} s beside a 64-prompt request: x{fair['ratio']} "
        f"(goal <= 3: {'met' if fair['goal_met'] else 'NOT met'}); the 64-prompt request took {fair['big_request_s']} s"
    )
    print(f"  alone {fair['victim_alone_each_s']}, beside {fair['victim_beside_each_s']}")
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
