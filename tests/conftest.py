"""Shared fixtures: the reference-format checkpoint, tiny random LLaDA models, the character tokenizer."""

from __future__ import annotations

import inspect
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_dllm
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]  # the repository
TESTS = ROOT / "tests"
FIXTURES = TESTS / "fixtures"
DATA = TESTS / "data"
REFERENCE_DIR = FIXTURES / "llada-tiny-ref"
# generate()'s cache modes: none, Fast-dLLM's prefix cache, its dual cache.
CACHE_MODES = {
    "none": dict(use_cache=False),
    "prefix": dict(use_cache=True, dual_cache=False),
    "dual": dict(use_cache=True, dual_cache=True),
}


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The tests run tiny models: one intra-op thread is faster than two, which wait on each other on a busy
    2-core machine (a tiny forward measured 100x slower). Subprocesses the tests start set OMP_NUM_THREADS=1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _remote_code_checked_once_per_input():
    """`hf-dllm export`'s remote-code check (`hub.remote_code.check_remote_code`: ~0.6 s of CPU, nearly all of an
    export of a tiny model, parsing the same package files at each of the suite's ~150 exports) made once per input:
    the package folder, the family, its file list and auto_map and the bytes of those files. A check that fails is
    never remembered (it raises each time). Tests of the check itself call the function they imported, unwrapped."""
    from hf_dllm.hub import export
    from hf_dllm.hub.families import DEFAULT_FAMILY, model_family
    from hf_dllm.hub.remote_code import PACKAGE_DIR

    check, passed = export.check_remote_code, {}

    def checked_once(package_dir=PACKAGE_DIR, family=DEFAULT_FAMILY):
        try:
            files, auto_map = model_family(family).remote_code_files, model_family(family).auto_map
            contents = tuple((Path(package_dir) / name).read_bytes() for name in files)
        except Exception:  # an unknown family or a missing file: the check itself says so
            return check(package_dir, family)
        key = (str(package_dir), family, files, tuple(sorted(auto_map.items())), contents)
        if key not in passed:
            passed[key] = check(package_dir, family)
        return list(passed[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "check_remote_code", checked_once)
        yield


@pytest.fixture(autouse=True)
def _fresh_compile_for_flex(request):
    """Each flex_attention test compiles from scratch: once dynamo has compiled flex attention for one shape, it
    recompiles the next with dynamic shapes, and torch 2.13's CPU inductor emits C++ that does not compile for
    that (`cur_kvSplitSize0` undeclared)."""
    if "flex" in request.node.nodeid:
        torch._dynamo.reset()
    yield


def pytest_collection_modifyitems(config, items):
    """Modules with a test that waits for a `BackgroundJob` run after all the others (each kept whole and in its
    order, so module fixtures are built once): the jobs, started at collection, then run beside every other test
    instead of keeping the test process waiting early in the session. Tests needing a GPU are skipped without one."""
    waiting = {
        item.nodeid.split("::")[0] for item in items if getattr(getattr(item, "function", None), "background_jobs", ())
    }
    items[:] = [item for item in items if item.nodeid.split("::")[0] not in waiting] + [
        item for item in items if item.nodeid.split("::")[0] in waiting
    ]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return REFERENCE_DIR


@pytest.fixture(scope="session")
def reference_model():
    """The reference-format tiny checkpoint (float32, sdpa), loaded through the Auto classes."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(REFERENCE_DIR).eval()


@pytest.fixture(scope="session")
def reference_expected() -> dict[str, torch.Tensor]:
    return load_file(REFERENCE_DIR / "expected.safetensors")


@pytest.fixture(scope="session")
def reference_cases() -> list[dict]:
    return json.loads((REFERENCE_DIR / "cases.json").read_text())["cases"]


def reference_fixtures(folder: Path, model_class=None):
    """The module fixtures of a reference fixture `folder`: its model (`model_class.from_pretrained`, AutoModel by
    default, in eval mode) and its recorded `expected.safetensors`. Name them as the module assigns them:
    `dream, expected = reference_fixtures(DREAM, DreamModel)`."""

    @pytest.fixture(scope="module")
    def model():
        from transformers import AutoModel

        return (model_class or AutoModel).from_pretrained(folder).eval()

    @pytest.fixture(scope="module")
    def expected() -> dict[str, torch.Tensor]:
        return load_file(folder / "expected.safetensors")

    return model, expected


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


def with_remote_code_files(monkeypatch, name: str, files: tuple[str, ...]) -> None:
    """Make the registered family `name` export exactly `files` as remote code (for the duration of a test)."""
    from hf_dllm.family import FAMILIES

    family = FAMILIES[name]
    patched = type(family).__new__(type(type(family).__name__, (type(family),), {"remote_code_files": files}))
    patched.__dict__.update(family.__dict__)
    monkeypatch.setitem(FAMILIES, name, patched)


def tiny_config(vocab_size: int = 103, **overrides) -> hf_dllm.LLaDAConfig:
    """A small LLaDA config (GQA 4 query / 2 kv heads) sized for the character tokenizer's vocabulary."""
    fields = dict(
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        mlp_hidden_size=128,
        vocab_size=vocab_size,
        embedding_size=vocab_size,
        max_sequence_length=512,
        mask_token_id=3,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=1,
    )
    fields.update(overrides)
    return hf_dllm.LLaDAConfig(**fields)


def assert_cache_modes_agree(model, input_ids: torch.Tensor, nfe: int, **kwargs) -> None:
    """`model.generate(input_ids, **kwargs)` (no early stop) in every cache mode of `CACHE_MODES` gives the uncached
    tokens, in `nfe` forwards."""
    outs = {
        cache: model.generate(input_ids, eos_early_stop=False, return_dict_in_generate=True, **kwargs, **settings)
        for cache, settings in CACHE_MODES.items()
    }
    for out in outs.values():
        assert out.nfe == nfe
        assert torch.equal(out.sequences, outs["none"].sequences)


def random_weights_model(
    model_class, config, *, dtype=torch.float32, device="cpu", noise=0.0, head_scale=1.0, **kwargs
):
    """`model_class._from_config(config, dtype=dtype, **kwargs)` built on `device` after `torch.manual_seed(0)`, in
    eval mode; then every parameter moved by Gaussian noise of std `noise` (routing and attention far from uniform,
    no near-ties) and the output head scaled by `head_scale` (confidences spread over (0, 1), so thresholds commit
    in parallel)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype, **kwargs).eval()
    with torch.no_grad():
        for param in model.parameters() if noise else ():
            param.add_(torch.randn_like(param) * noise)
        model.get_output_embeddings().weight.mul_(head_scale)
    return model


def assert_quantized_from(source: dict[str, torch.Tensor], quantized: dict[str, torch.Tensor], block) -> None:
    """Every FP8 weight of the `quantized` state dict, and its `weight_scale_inv`, is `fp8.quantize_blocks` of the
    `source` state dict's weight of that name bit for bit (transformers' load-time arithmetic on the checkpoint's
    values: what `hf-dllm export --quantization fp8` writes); `block` None: one scale per matrix."""
    names = [name for name, tensor in quantized.items() if tensor.dtype == hf_dllm.fp8.FP8_DTYPE]
    assert names, "no FP8 weight"
    for name in names:
        weight, scale = hf_dllm.fp8.quantize_blocks(source[name], block or tuple(source[name].shape[-2:]))
        assert torch.equal(quantized[name].view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(quantized[name + "_scale_inv"].flatten(), scale.flatten()), name


def save_checkpoint(model, path: Path) -> Path:
    """A checkpoint folder: `model` (with its generation_config.json) and the character tokenizer."""
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def tiny_model(seed: int = 0, **overrides) -> hf_dllm.LLaDAModelLM:
    torch.manual_seed(seed)
    return hf_dllm.LLaDAModelLM(tiny_config(**overrides)).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random LLaDA (`tiny_model(seed=0)`) with the character tokenizer, saved as a checkpoint folder."""
    return save_checkpoint(tiny_model(seed=0), tmp_path_factory.mktemp("llada-tiny-random"))


def with_mask_id(src: Path, folder: Path, mask_token_id: int = 310) -> Path:
    """A copy of the reference fixture `src` (the Hub's config.json and weights, no tokenizer) with the mask id of
    its 320-token vocabulary in config.json: the Hub's LLaDA2 / LLaDA-MoE configs name none, and the config class's
    default (the full model's) is outside that vocabulary, which the export refuses."""
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mask_token_id": mask_token_id}))
    return folder


def export_to(tmp_path_factory, name: str, src: Path, **options) -> Path:
    """`hf-dllm export` of `src` into a fresh folder `name` (the generic card is named after it)."""
    from hf_dllm.hub.export import export_checkpoint

    dst = tmp_path_factory.mktemp(name) / name
    export_checkpoint(src, dst, **options)
    return dst


@pytest.fixture
def make_tiny_model():
    return tiny_model


# --- exported repos run where hf_dllm cannot be imported (tests/hub/test_export.py, tests/models/llada2/test_llada2_export.py) --------


def generate_cases(model, cases: list[dict]) -> dict:
    """`model.generate()` on each case (`name`, `input_ids`, `kwargs`, optional `attention_mask`), seeded alike:
    name -> {"sequences"[, "nfe"]}. The same function runs in the child process of `run_without_hf_dllm` (its
    source is sent there), so both sides generate the same way."""
    results = {}
    for case in cases:
        torch.manual_seed(0)
        kwargs = dict(case["kwargs"])
        if case.get("attention_mask") is not None:
            kwargs["attention_mask"] = torch.tensor(case["attention_mask"])
        out = model.generate(torch.tensor(case["input_ids"]), **kwargs)
        if isinstance(out, torch.Tensor):
            results[case["name"]] = {"sequences": out.tolist()}
        else:
            results[case["name"]] = {"sequences": out.sequences.tolist(), "nfe": out.nfe}
    return results


# What every child script starts with: hf_dllm (and the optional kernels) made unimportable, `spec` (its JSON
# argument), `out` (written to spec["result"] at the end), `record`, `expect_error`, `describe` (a loaded model),
# `no_hf_dllm`, `load_with_remote_code`, `run_pipeline`, `generate_cases`.
CHILD_PRELUDE = textwrap.dedent(
    r"""
        import sys

        for blocked in ("hf_dllm", "triton", "flash_attn"):  # not installed, as far as this process can tell
            sys.modules[blocked] = None

        import json
        import traceback
        from pathlib import Path

        import torch

        spec = json.loads(Path(sys.argv[1]).read_text())
        torch.set_num_threads(spec["threads"])  # as in the parent process, so float reductions round alike
        out = {"errors": []}


        def record(name, fn):
            try:
                out[name] = fn()
            except Exception:
                out["errors"].append(f"{name}: {traceback.format_exc()}")


        def expect_error(fn):
            try:
                fn()
            except (ValueError, TypeError) as error:
                return f"{type(error).__name__}: {error}"
            return None


        def describe(model):
            config = model.generation_config
            return {
                "class": type(model).__name__,
                "class_module": type(model).__module__,
                "config_module": type(model.config).__module__,
                "has_generate": hasattr(model, "generate"),
                "family": model.diffusion_family.name,
                "generation_config_class": type(config).__name__,
                "generation_config_module": type(config).__module__,
                "generation_config": {name: getattr(config, name) for name in type(config).field_names()},
            }


        def no_hf_dllm():
            try:
                import hf_dllm  # noqa: F401
            except ImportError:
                return True
            return False


        # `path` through AutoConfig, AutoModel and AutoModelForCausalLM with remote code: records auto_config_module,
        # auto_model / auto_causal (`describe`), tokens / tokens_causal (`generate_cases` of `cases` / `causal_cases`);
        # returns the AutoModel's model.
        def load_with_remote_code(path, cases, causal_cases):
            from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

            config = lambda: type(AutoConfig.from_pretrained(path, trust_remote_code=True)).__module__  # noqa: E731
            record("auto_config_module", config)
            model = AutoModel.from_pretrained(path, trust_remote_code=True).eval()
            out["auto_model"] = describe(model)
            record("tokens", lambda: generate_cases(model, cases))
            causal = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
            out["auto_causal"] = describe(causal)
            record("tokens_causal", lambda: generate_cases(causal, causal_cases))
            return model


        # `pipeline("text-generation")` of `path` with remote code: "Hello" with `settings`, and a chat turn.
        def run_pipeline(path, settings):
            from transformers import pipeline

            generator = pipeline("text-generation", model=path, trust_remote_code=True)
            return {
                "text": generator("Hello", **settings)[0]["generated_text"],
                "chat": generator([{"role": "user", "content": "Hi"}], max_new_tokens=8)[0]["generated_text"][-1],
                "class": type(generator.model).__name__,
                "generation_config_class": type(generator.model.generation_config).__name__,
            }


        """
) + inspect.getsource(generate_cases)


def run_without_hf_dllm(root: Path, child: str, spec: dict, env: dict[str, str] | None = None) -> dict:
    """Run `CHILD_PRELUDE + child` with `spec` in a fresh, offline process where hf_dllm cannot be imported (Hub and
    module caches under `root`, plus `env`); return its `out`, with its stderr under "stderr"."""
    spec = {**spec, "threads": torch.get_num_threads(), "result": str(root / "result.json")}
    (root / "spec.json").write_text(json.dumps(spec))
    (root / "child.py").write_text(CHILD_PRELUDE + child + '\nPath(spec["result"]).write_text(json.dumps(out))\n')
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON", "TRANSFORMERS_"))}
    environment.update(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(root / "hf_home"),
        HF_MODULES_CACHE=str(root / "modules"),
        HF_HUB_DISABLE_TELEMETRY="1",
        **(env or {}),
    )
    proc = subprocess.run(
        [sys.executable, str(root / "child.py"), str(root / "spec.json")],
        cwd=root,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads((root / "result.json").read_text())
    result["stderr"] = proc.stderr
    return result


_LIVE_PROCESSES: set[subprocess.Popen] = set()


def run_side_by_side(
    commands: dict[str, list[str]], timeout: float, **popen_kwargs
) -> dict[str, subprocess.CompletedProcess]:
    """Run each command (name -> argv) in its own process, all started at once, and wait for all of them: name ->
    CompletedProcess with stdout and stderr as text. For independent single-threaded subprocess checks (Triton's
    interpreter, command-line runs): the test process only waits on them, so on the 2-core test machine two of
    them take little more than one. As `subprocess.run`, a command still running after `timeout` seconds is killed
    and TimeoutExpired raised (the others are killed too)."""
    outputs, processes, done = {}, {}, {}
    try:
        for name, argv in commands.items():  # files, not pipes: a full pipe would stall a process nobody reads
            outputs[name] = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
            processes[name] = subprocess.Popen(argv, stdout=outputs[name][0], stderr=outputs[name][1], **popen_kwargs)
            _LIVE_PROCESSES.add(processes[name])
        deadline = time.monotonic() + timeout
        for name, process in processes.items():
            process.wait(timeout=max(deadline - time.monotonic(), 0))
            for stream in outputs[name]:
                stream.seek(0)
            stdout, stderr = (stream.read() for stream in outputs[name])
            done[name] = subprocess.CompletedProcess(commands[name], process.returncode, stdout, stderr)
        return done
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            _LIVE_PROCESSES.discard(process)
        for stream in (stream for pair in outputs.values() for stream in pair):
            stream.close()


class BackgroundJob:
    """Subprocess checks (Triton's interpreter, ...) started as soon as the session has collected a test that uses
    them, and run beside the in-process tests, which use one core of the 2-core test machine (one torch thread):
    the test only waits for the result. Jobs run one at a time, each job's commands side by side
    (`run_side_by_side`), in the order their tests were collected.

    `commands(workdir)` gives the job's commands (name -> argv), built when the job starts, with `workdir` a fresh
    folder of the job's own (`job.workdir`, removed when the session ends; the commands' working directory unless
    `cwd` is given); `when()`, whether the job is
    needed at all (say, the `triton` extra is installed): when false the job never runs and its test skips or
    fails as it would without the job. A test declares the job with the decorator `@JOB.used_by`; `results()` waits
    for the job (starting it if no collected test had) and returns `run_side_by_side`'s name -> CompletedProcess.

    `preload` (module names): the job's Python commands (`python -c SOURCE ...`, `python SCRIPT ...`) are forked from
    one process of the job's environment that imported these modules first, instead of each paying the imports
    (`import hf_dllm`: ~5.5 s of CPU, most of a short check) - see `ForkServer`; the names in `unforked` still run
    as processes of their own (a script that sets the environment the preloaded modules read at import).
    """

    def __init__(self, commands, timeout: float, when=lambda: True, preload=(), unforked=(), **popen_kwargs):
        self.commands, self.timeout, self.when, self.popen_kwargs = commands, timeout, when, popen_kwargs
        self.preload, self.unforked = tuple(preload), frozenset(unforked)
        self.future = self.workdir = None

    def used_by(self, test):
        test.background_jobs = (*getattr(test, "background_jobs", ()), self)
        return test

    def start(self) -> None:
        if self.future is None and self.when():
            if self.preload:
                ForkServer.expect(self.preload, self.popen_kwargs)
            self.workdir = Path(tempfile.mkdtemp(prefix="hf-dllm-test-job-"))
            _JOB_FOLDERS.append(self.workdir)
            self.future = _background_executor().submit(self._run)

    def _run(self) -> dict[str, subprocess.CompletedProcess]:
        popen_kwargs = {"cwd": self.workdir, **self.popen_kwargs}
        commands = self.commands(self.workdir)
        forked = {
            name: argv
            for name, argv in commands.items()
            if self.preload and name not in self.unforked and argv[0] == sys.executable and argv[1:2] != ["-m"]
        }
        if not forked:
            if self.preload:
                ForkServer.done(self.preload, self.popen_kwargs)
            return run_side_by_side(commands, self.timeout, **popen_kwargs)
        deadline = time.monotonic() + self.timeout
        try:
            server = ForkServer.of(self.preload, self.popen_kwargs)
            server.submit(forked, self.workdir, popen_kwargs["cwd"])  # at once; the job's others run meanwhile
            own = {name: argv for name, argv in commands.items() if name not in forked}
            done = run_side_by_side(own, self.timeout, **popen_kwargs) if own else {}
            return {**server.results(forked, self.workdir, deadline), **done}
        finally:
            ForkServer.done(self.preload, self.popen_kwargs)

    def results(self) -> dict[str, subprocess.CompletedProcess]:
        self.start()
        if self.future is None:
            raise RuntimeError("results() of a background job that when() rules out")
        return self.future.result()


# The process `ForkServer` starts: it imports the modules named in its argument, then for each request line on its
# stdin ({"commands": name -> argv, "folder": ..., "cwd": ...}) forks one child per command (all at once, as
# `run_side_by_side` starts processes), each in `cwd` with stdin from /dev/null, its stdout and stderr in files of
# the folder, `sys.argv` and `sys.path[0]` as `python -c` / `python SCRIPT` set them, and `__main__` run as there
# (an uncaught exception: traceback, exit status 1; `SystemExit` as the interpreter reads it); a child dies with
# the server (PDEATHSIG). When all have exited it writes their exit statuses to `<folder>/forked-rc.json` and
# answers one line.
FORK_SERVER = textwrap.dedent(
    r"""
    import ctypes, importlib, json, os, runpy, signal, sys, traceback

    for module in json.loads(sys.argv[1]):
        importlib.import_module(module)


    def child(argv, folder, name, cwd):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        os.chdir(cwd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, suffix in ((1, "out"), (2, "err")):
            os.dup2(os.open(os.path.join(folder, f"{name}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        code = 0
        try:
            if argv[1] == "-c":
                sys.argv = ["-c", *argv[3:]]
                exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.argv, sys.path[0] = argv[1:], os.path.dirname(os.path.abspath(argv[1]))
                runpy.run_path(argv[1], run_name="__main__")
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
            if not isinstance(exit.code, (int, type(None))):
                print(exit.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()
        children = {}
        for name, argv in request["commands"].items():
            pid = os.fork()
            if pid == 0:
                child(argv, request["folder"], name, request["cwd"])
            children[pid] = name
        codes = {}
        while children:
            pid, status = os.wait()
            if pid in children:
                codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
        with open(os.path.join(request["folder"], "forked-rc.json"), "w") as file:
            file.write(json.dumps(codes))
        print("done", flush=True)
    """
)


class ForkServer:
    """One `FORK_SERVER` process per preload list and environment (`env`) for the session: jobs of the same
    kind (the interpreter jobs of several test files) fork from the same imports. Jobs run one at a time, so a
    server has one request at a time. Closed when the last job of its kind that was started is done (what is left
    is killed at the session's end); killed, with its children, by a job's timeout."""

    _servers: dict = {}
    _pending: dict = {}  # key -> jobs started and not yet done: the last one done stops the server

    @staticmethod
    def key(preload: tuple[str, ...], popen_kwargs: dict) -> tuple:
        env = popen_kwargs.get("env")
        return preload, tuple(sorted(env.items())) if env is not None else None

    @classmethod
    def expect(cls, preload: tuple[str, ...], popen_kwargs: dict) -> None:
        key = cls.key(preload, popen_kwargs)
        cls._pending[key] = cls._pending.get(key, 0) + 1

    @classmethod
    def of(cls, preload: tuple[str, ...], popen_kwargs: dict) -> ForkServer:
        key = cls.key(preload, popen_kwargs)
        if key not in cls._servers or cls._servers[key].process.poll() is not None:
            cls._servers[key] = cls(preload, popen_kwargs)
        return cls._servers[key]

    @classmethod
    def done(cls, preload: tuple[str, ...], popen_kwargs: dict) -> None:
        key = cls.key(preload, popen_kwargs)
        cls._pending[key] -= 1
        if cls._pending[key] <= 0 and key in cls._servers:
            cls._servers.pop(key).close()

    def __init__(self, preload: tuple[str, ...], popen_kwargs: dict):
        self.stderr = tempfile.TemporaryFile("w+")
        command = [sys.executable, "-c", FORK_SERVER, json.dumps(preload)]
        kwargs = {**popen_kwargs, "cwd": tempfile.gettempdir()}  # each child runs in its own job's cwd
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, **kwargs
        )
        _LIVE_PROCESSES.add(self.process)

    def submit(self, commands: dict, folder: Path, cwd) -> None:
        (folder / "forked-rc.json").unlink(missing_ok=True)
        try:
            self.process.stdin.write(json.dumps({"commands": commands, "folder": str(folder), "cwd": str(cwd)}) + "\n")
            self.process.stdin.flush()
        except OSError:  # the server has exited (a preload that does not import): `results` reports it
            pass

    def results(self, commands: dict, folder: Path, deadline: float) -> dict:
        """name -> CompletedProcess of each command of the request: its exit status and output; when the server
        failed (a preload that does not import), its status and output for every command."""
        ready, _, _ = select.select([self.process.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            self.stop()
            raise subprocess.TimeoutExpired(list(commands), deadline)
        codes = folder / "forked-rc.json"
        if not self.process.stdout.readline() or not codes.exists():
            self.stop()
            self.stderr.seek(0)
            failed = self.process.returncode or 1
            stderr = self.stderr.read()
            return {name: subprocess.CompletedProcess(argv, failed, "", stderr) for name, argv in commands.items()}
        codes = json.loads(codes.read_text())
        return {
            name: subprocess.CompletedProcess(
                argv, codes[name], (folder / f"{name}.out").read_text(), (folder / f"{name}.err").read_text()
            )
            for name, argv in commands.items()
        }

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        _LIVE_PROCESSES.discard(self.process)

    def close(self) -> None:
        """No more requests: the server's loop ends at the end of its stdin."""
        try:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.stop()


def interpreter_job(scripts: dict[str, str], timeout: float, when=lambda: True, **env: str) -> BackgroundJob:
    """A `BackgroundJob` running each script (name -> Python source) as `python -c` under Triton's interpreter
    (TRITON_INTERPRET=1) from the repository root, one thread, with `env` added (HF_DLLM_KERNELS="triton": the
    kernels wherever they run); the scripts are forked from one process that imported hf_dllm in that environment
    (`preload`)."""
    return BackgroundJob(
        lambda _workdir: {name: [sys.executable, "-c", script] for name, script in scripts.items()},
        timeout=timeout,
        when=when,
        preload=("torch", "hf_dllm"),
        cwd=ROOT,
        env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env),
    )


# The environment and preload of the jobs that run `benchmarks/bench_*.py --cpu` (one thread, no GPU even on a GPU
# machine): one fork server imports hf_dllm for all of them.
BENCHMARK_ENV = dict(
    os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES=""
)
BENCHMARK_PRELOAD = ("torch", "transformers", "hf_dllm")

_EXECUTOR = None
_JOB_FOLDERS: list[Path] = []


def _background_executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-job")
    return _EXECUTOR


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    for item in session.items:
        for job in getattr(getattr(item, "function", None), "background_jobs", ()):
            job.start()


def pytest_sessionfinish(session):
    """Jobs whose tests did not run (a failure with -x, an interrupt) are not waited for."""
    if _EXECUTOR is not None:
        _EXECUTOR.shutdown(wait=False, cancel_futures=True)
    for process in list(_LIVE_PROCESSES):
        if process.poll() is None:
            process.kill()
            process.wait()
    for folder in _JOB_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def client(server):
    """An OpenAI client of the module's `server` (a `tests.serving.test_serve.RunningServer`)."""
    return server.client()
