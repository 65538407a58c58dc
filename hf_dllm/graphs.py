"""CUDA-graph replay of denoising steps (the fast path of `generate()` on CUDA).

A denoising step of an 8B model at batch 1 is ~10 ms of GPU work spread over ~500 kernels; launched from Python
one by one, the launches alone take longer than the work. A step has fixed shapes within a call (the block, the
cached sequence, the batch), so it is captured once as a CUDA graph and replayed: inputs are copied into the
graph's static buffers (only those that changed since the last replay: most are the same tensors at every step of
a block), one replay runs every kernel, outputs land in static buffers (gpt-fast's recipe).

Replays run exactly the kernels of the eager step, so outputs are identical with and without graphs. The first
use of a shape runs the step eagerly (the warm-up: cuBLAS handles, Triton compilation and the K/V cache's
allocation happen there, outside any capture); the second use captures it and replays; later uses replay. Steps that read the K/V cache keep its
address, so a runner is tied to one `DiffusionKVCache`; `StepGraphs.acquire` reuses the runner (and its cache)
across `generate()` calls with the same shapes, so repeated calls neither re-capture nor grow memory. One call at
a time holds a model's runner; concurrent calls (e.g. from server threads) run eagerly with their own cache.

This file is exported as Hub remote code.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

_RUNNER_LOCK = threading.Lock()


class _CapturedStep:
    """A captured step: its graph, static input buffers and outputs, and for each input the tensor last copied into
    its buffer (`sources`)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict, outputs: tuple[torch.Tensor, ...], sources: dict):
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.sources = sources

    def load(self, name: str, value: torch.Tensor) -> None:
        """Copy `value` into the input buffer `name`, unless that buffer already holds it: the tensor last copied
        there, or a view of the same memory with the same shape and strides, unchanged since (autograd's version
        counter, which every in-place PyTorch op bumps). Most of a step's inputs (positions, column indices, masks,
        the schedule's count) are the same tensors at every step of a block: each skipped copy is a kernel less per
        replay. The last source is kept referenced, so its memory cannot hold another tensor meanwhile."""
        held = self.sources.get(name)
        version = tensor_version(value)
        if (
            held is not None
            and version is not None
            and held[1] == version
            and held[0].data_ptr() == value.data_ptr()
            and held[0].shape == value.shape
            and held[0].stride() == value.stride()
            and held[0].dtype == value.dtype
        ):
            return
        self.inputs[name].copy_(value)
        self.sources[name] = (value, version)


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (every in-place PyTorch op bumps it), or None where it has none (inference
    tensors): what tells a cached copy of a tensor (a replay's input buffer here, `fp8.fp8_scales`' per-row scales)
    from a stale one."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def spans_devices(model: torch.nn.Module) -> bool:
    """Whether the model's weights lie on more than one device (no CUDA graph then: a graph is one device's).

    A model split over devices runs through accelerate's hooks, which move the activations from layer to layer;
    its dispatch (`from_pretrained(..., device_map=...)`, `accelerate.dispatch_model`) records the split in
    `hf_device_map`, and that is read here, with the input and output embeddings' devices (a model moved by hand
    part by part, whose forward then needs hooks of its own). Walking every parameter instead took ~45 ms per
    `generate()` call for LLaDA2.0-mini's ~15,000 (each expert's three layers are parameters of their own;
    `benchmarks/bench_llada2.py`)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    if len(set(device_map.values())) > 1:
        return True
    devices = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):  # a model of the mixin that is not a transformers model
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            devices.add(weight.device)
    return len(devices) > 1


# Captured shapes a `generate()` runner keeps (the least recently used one is dropped beyond it).
MAX_GRAPHS = 32


class StepGraphs:
    """Captured steps of one model, keyed by shape, sharing one memory pool and one K/V cache.

    `run(key, step_fn, inputs)` calls `step_fn(**inputs)` (tensors, or None) through a graph captured for `key`;
    `key` must determine every input's shape and every Python value baked into `step_fn`.
    """

    def __init__(self, signature: tuple, cache, max_graphs: int):
        self.signature = signature
        self.cache = cache
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: OrderedDict[tuple, _CapturedStep] = OrderedDict()
        self.warmed_up: set[tuple] = set()
        self.constants: dict[str, torch.Tensor] = {}
        # Steps run by this runner: eagerly (a key's first use), captured (its second), replayed (later ones).
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    @classmethod
    def acquire(
        cls, model: torch.nn.Module, signature: tuple, make_cache: Callable[[], object], max_graphs: int
    ) -> "StepGraphs | None":
        """The model's runner for `signature` (shapes, dtype, device, decoding rule, kernel mode), replacing any
        other; or None while another `generate()` call on this model holds it (that call's graphs and cache are in
        use, so this one runs eagerly). Give it back with `release_to(model)`. `max_graphs`: captured shapes kept
        (the least recently used one is dropped beyond it)."""
        with _RUNNER_LOCK:
            if getattr(model, "_hf_dllm_step_graphs_busy", False):
                return None
            model._hf_dllm_step_graphs_busy = True
        try:
            runner = getattr(model, "_hf_dllm_step_graphs", None)
            if runner is None or runner.signature != signature:
                if runner is not None:
                    runner.release()
                    model._hf_dllm_step_graphs = None
                runner = cls(signature, make_cache(), max_graphs)
                model._hf_dllm_step_graphs = runner
        except BaseException:
            cls.release_to(model)
            raise
        return runner

    @staticmethod
    def release_to(model: torch.nn.Module) -> None:
        with _RUNNER_LOCK:
            model._hf_dllm_step_graphs_busy = False

    def release(self) -> None:
        self.steps.clear()
        self.warmed_up.clear()
        self.constants.clear()
        self.cache = None

    def constant(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The runner's copy of a constant tensor a step reads (e.g. token ids to suppress). Graphs read it by
        address in every later call that replays them, so it must live as long as the runner, not the call; the
        runner's signature fixes its value."""
        if tensor is None:
            return None
        return self.constants.setdefault(name, tensor)

    def run(self, key: tuple, step_fn: Callable[..., tuple], inputs: dict) -> tuple[torch.Tensor, ...]:
        """Outputs of `step_fn(**inputs)`; they live in static buffers that the next run of `key` overwrites."""
        captured = self.steps.get(key)
        if captured is None:
            if key not in self.warmed_up:
                self.warmed_up.add(key)
                self.counts["eager"] += 1
                return step_fn(**inputs)
            captured = self._capture(key, step_fn, inputs)
            self.counts["captured"] += 1
        else:
            self.counts["replayed"] += 1
        self.steps.move_to_end(key)
        for name, value in inputs.items():
            if value is not None:
                captured.load(name, value)
        captured.graph.replay()
        return captured.outputs

    def _capture(self, key: tuple, step_fn: Callable[..., tuple], inputs: dict) -> _CapturedStep:
        static = {name: (value.clone() if value is not None else None) for name, value in inputs.items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step_fn(**static)
        if len(self.steps) >= self.max_graphs:
            self.steps.popitem(last=False)
        # The buffers hold the capture's inputs (cloned above; the graph reads them, never writes them).
        sources = {name: (value, tensor_version(value)) for name, value in inputs.items() if value is not None}
        captured = _CapturedStep(graph, static, tuple(outputs), sources)
        self.steps[key] = captured
        return captured
