"""`hf-dllm generate` and `hf-dllm serve` under `torchrun --nproc-per-node 2 ... --tp-plan auto` (gloo, CPU): the
sharded commands answer what one process answers (the tiny trained LLaDA, float32). The server's other rank
follows rank 0's scheduling (serving/tensor_parallel.py): concurrent requests, a stop string, streaming."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers.distributed.tensor_parallel import TensorParallelLayer

from hf_dllm.tiny_model import tasks
from tests.conftest import FIXTURES, ROOT, run_side_by_side

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

# The tiny trained LLaDA's head has 103 rows: transformers shards a gathered column-wise layer unevenly only from
# the versions whose TP layers have `_from_local_last_dim_shard` (5.23 here; 5.17 refuses 103 rows over 2 ranks).
_uneven = pytest.mark.skipif(
    not hasattr(TensorParallelLayer, "_from_local_last_dim_shard"),
    reason="this transformers shards a gathered output only when the ranks divide its width (103 rows here)",
)

TRAINED = FIXTURES / "llada-tiny-trained"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
PROMPTS = ["reverse decoding", "sort language", "copy parallel", "reverse tensor"]


def environment() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def free_port(taken: tuple[int, ...] = ()) -> int:
    """A port free now, not one of `taken` (a server already started may not have bound its port yet)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


@_uneven
def test_generate_command_sharded_equals_one_process(capsys):
    from hf_dllm.cli import main

    args = ["generate", str(TRAINED), "--chat", "--max-new-tokens", "32", "--block-length", "8"]
    args += ["--steps", "16", "--threads", "1"]
    for prompt in PROMPTS[:2]:
        args += ["--prompt", prompt]
    # The sharded command starts while the one-process command runs here, in the test process (a process of its
    # own only paid another `import hf_dllm`: the sharded run is the command-line one).
    with ThreadPoolExecutor(1) as pool:
        launched = pool.submit(
            run_side_by_side,
            {"sharded": [*TORCHRUN, "-m", "hf_dllm", *args, "--tp-plan", "auto"]},
            180,
            env=environment(),
        )
        assert main(args) == 0
        one = capsys.readouterr().out
        sharded = launched.result()["sharded"]
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    expected = [f"[{p}] {tasks.solve(*p.split(' ', 1))}" for p in PROMPTS[:2]]
    assert one.splitlines() == expected
    assert sharded.stdout.splitlines() == one.splitlines()  # only rank 0 prints


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tp_plan="auto"), "torchrun --nproc-per-node N"),
        (dict(tp_plan="colwise"), "--tp-plan must be `auto`"),
        (dict(tp_plan="auto", device_map="auto"), "excludes --device-map"),
    ],
)
def test_bad_tp_plan_flags_are_refused_before_loading(monkeypatch, kwargs, message):
    from hf_dllm.cli.loading import load_model

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(TRAINED, **kwargs)


def test_fp8_with_tp_plan_is_refused_before_loading(monkeypatch):
    from hf_dllm.cli.loading import load_model

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=re.escape("--quantization fp8 and --tp-plan cannot be combined")):
        load_model(TRAINED, tp_plan="auto", quantization="fp8")


def post(port: int, body: dict) -> dict | str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        text = response.read().decode()
    return text if body.get("stream") else json.loads(text)


def launch_server(
    sharded: bool, log: Path, taken: tuple[int, ...] = (), options: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, int]:
    """The server started, not yet answering (see `wait_for_server`), on a free port not in `taken`, with `options`
    (more `hf-dllm serve` flags)."""
    port = free_port(taken)
    args = ["-m", "hf_dllm", "serve", str(TRAINED), "--port", str(port), "--threads", "1", "--log-level", "warning"]
    args += list(options)
    command = [*TORCHRUN, *args, "--tp-plan", "auto"] if sharded else [sys.executable, *args]
    with open(log, "w") as output:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(command, env=environment(), stdout=output, stderr=subprocess.STDOUT)
    return process, port


def wait_for_server(process: subprocess.Popen, port: int, log: Path) -> tuple[subprocess.Popen, int]:
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return process, port
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError("the server did not start")


def start_server(sharded: bool, log: Path, taken: tuple[int, ...] = ()) -> tuple[subprocess.Popen, int]:
    return wait_for_server(*launch_server(sharded, log, taken), log)


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def requests() -> list[dict]:
    bodies = [
        dict(messages=tasks.chat_messages(p), max_tokens=24, block_length=8, steps=12, temperature=0) for p in PROMPTS
    ]
    bodies[1]["stop"] = ["gg"]  # "sort language" -> "aaegglnu": cut before "gg"
    bodies[2]["threshold"], bodies[2]["steps"] = 0.7, None
    return bodies


@_uneven
def test_serve_sharded_answers_what_one_process_answers(tmp_path):
    expected = []
    # Both servers start at once (their start-ups overlap); the sharded one is first asked once the other has
    # answered and stopped. The sharded one decodes in slices of one row (canvases of ~60 positions), so its ranks
    # also agree on what joins between two layouts of a boundary; each row's answer is still the one-process one.
    sharded_server = launch_server(
        sharded=True, log=tmp_path / "sharded.log", options=("--max-refresh-positions", "64")
    )
    try:
        process, port = start_server(sharded=False, log=tmp_path / "one.log", taken=(sharded_server[1],))
        try:
            for body in requests():
                expected.append(post(port, {k: v for k, v in body.items() if v is not None}))
        finally:
            stop_server(process)
        process, port = wait_for_server(*sharded_server, tmp_path / "sharded.log")
    except BaseException:
        stop_server(sharded_server[0])
        raise
    try:
        bodies = [{k: v for k, v in body.items() if v is not None} for body in requests()]
        sequential = [post(port, body) for body in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:  # rows decoding together on both ranks
            concurrent = list(pool.map(lambda body: post(port, body), bodies))
        streamed = post(port, dict(bodies[0], stream=True))
    finally:
        stop_server(process)

    def answer(response):
        choice = response["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], response["usage"]["nfe"]

    assert expected[1]["choices"][0]["message"]["content"] == "aae"  # the stop string cut it
    assert [answer(r) for r in sequential] == [answer(r) for r in expected]
    assert [answer(r)[:2] for r in concurrent] == [answer(r)[:2] for r in expected]
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == answer(expected[0])[0]
    )
