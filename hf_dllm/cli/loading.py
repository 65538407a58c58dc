"""One way to load a model for every command (`hf-dllm serve`, `hf-dllm eval`, `hf-dllm lm-eval`): the same flags,
the same defaults and the same errors.

`add_model_arguments(parser)` adds the flags; `load_model(...)` takes their values (the lm-eval model passes its
`model_args` under the same names) and returns the model in eval mode with its tokenizer.
"""

from __future__ import annotations

import argparse
import os

from ..fp8_schemes import FP8_QUANTIZATIONS

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
# torch's CPU threads unless a command is told otherwise (`--threads`, lm-eval's `threads`): None keeps torch's
# default, one per core, which was the fastest on the quiet 2-core development machine (benchmarks/bench_threads.py);
# one thread is faster only while other processes hold the cores.
DEFAULT_THREADS = None
# `--quantization`: "none" loads the checkpoint's weights as they are; an `fp8_schemes.FP8_QUANTIZATIONS` name quantizes them
# at load time through transformers' `FineGrainedFP8Config` ("fp8": one scale per 128x128 block, "fp8-tensor": one per
# matrix; "+head": the output head too; CUDA GPUs of compute capability >= 8.9), run by hf_dllm's FP8 kernels
# (`hf_dllm/fp8.py`). A checkpoint saved already quantized loads as such without the flag.
QUANTIZATION_CHOICES = ("none", *FP8_QUANTIZATIONS)


def parse_dtype(value, flag: str = "--dtype"):
    """`"auto"` or a `torch.dtype` from a name (`bfloat16`, `bf16`, `torch.float32`, ...); ValueError otherwise."""
    import torch

    if value is None or value == "auto":
        return "auto"
    if isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    dtype = getattr(torch, DTYPE_ALIASES.get(name, name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{flag} must be one of {', '.join(DTYPE_CHOICES)} (or bf16, fp16, fp32), got {value!r}.")
    return dtype


def resolve_device(device=None):
    """`None` / `"auto"`: the GPU when there is one, else the CPU; otherwise the named device (ValueError when it
    does not exist here)."""
    import torch

    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}.") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for, but CUDA is not available on this machine.")
    return device


def add_model_arguments(
    parser: argparse.ArgumentParser, threads: int | None = DEFAULT_THREADS, threads_help: str | None = None
) -> argparse._ArgumentGroup:
    """The loading flags every command takes (the positional MODEL is the command's own); `threads` and
    `threads_help`: a command's own default for `--threads` and why (`hf-dllm serve`'s is 1)."""
    group = parser.add_argument_group("model loading")
    group.add_argument("--tokenizer", default=None, help="tokenizer path or Hub id (default: the model's)")
    group.add_argument("--dtype", default="auto", help=f"{', '.join(DTYPE_CHOICES)} (default: the checkpoint's)")
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU when there is one)")
    group.add_argument("--device-map", default=None, help="split one model over GPUs, e.g. `auto`")
    group.add_argument(
        "--tp-plan",
        default=None,
        help="`auto`: tensor parallelism over the processes of a torchrun launch (`torchrun --nproc-per-node N "
        "-m hf_dllm COMMAND ...`; every GPU holds 1/N of the weights, all ranks decode the same tokens)",
    )
    group.add_argument("--attn-implementation", default=None, help="sdpa, eager, flex_attention, llada_triton, ...")
    group.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    group.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own code")
    group.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATION_CHOICES,
        help="fp8: quantize the weights to FP8 with 128x128 block scales at load time (transformers' "
        "FineGrainedFP8Config; needs a CUDA GPU of compute capability >= 8.9, e.g. H100); default none",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=threads,
        help=threads_help
        or "CPU threads of torch per process (default: torch's, one per core; matters only on the CPU). On the "
        "quiet 2-core development machine the default was fastest for `hf-dllm eval` on the tiny LLaDA (batch 8: "
        "0.188 s against 0.235 s with 1 thread, medians of 7; benchmarks/bench_threads.py); pass 1 when other "
        "processes share the cores, or cores / N to each of N processes",
    )
    return group


def model_arguments(args: argparse.Namespace) -> dict:
    """The keyword arguments of `load_model` from parsed `add_model_arguments` flags."""
    names = (
        "tokenizer",
        "dtype",
        "device",
        "device_map",
        "tp_plan",
        "attn_implementation",
        "revision",
        "trust_remote_code",
        "quantization",
    )
    return {name: getattr(args, name) for name in names} | {"threads": args.threads}


def set_threads(threads: int | None) -> None:
    """torch's CPU thread count (`None`: leave torch's default)."""
    import torch

    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {threads!r}.")
    torch.set_num_threads(threads)


def load_model(
    model: str | os.PathLike,
    *,
    tokenizer=None,
    dtype="auto",
    device=None,
    device_map=None,
    tp_plan: str | None = None,
    attn_implementation: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    threads: int | None = None,
    num_processes: int = 1,
    quantization: str = "none",
):
    """Load `model` (a local checkpoint folder or a Hub id) and its tokenizer with transformers' Auto classes.

    Args:
        tokenizer: a tokenizer object, its path or Hub id, or `None` for the model's own.
        dtype: `"auto"` (the checkpoint's) or a dtype name / `torch.dtype`.
        device: where the model goes (`resolve_device`); ignored with `device_map`.
        device_map: transformers' `device_map` (e.g. `"auto"`) to split one model over GPUs.
        tp_plan: `"auto"` shards the model over the processes of a `torchrun` launch (transformers' tensor
            parallelism, the model config's `base_model_tp_plan`); each process gets its GPU (`LOCAL_RANK`).
        num_processes: processes of a data-parallel launch (`accelerate launch`); each holds a replica, so
            `device_map` is refused there.
        quantization: `"none"`, `"fp8"` or `"fp8-tensor"`, the latter two with `"+head"` to quantize the output
            head too (see `QUANTIZATION_CHOICES`): FP8 quantizes on the target GPU while loading.

    Returns `(model, tokenizer)`, the model in eval mode. Raises `ValueError` for a bad flag value and
    `FileNotFoundError` for a local path that does not exist, before anything is loaded.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_dllm  # noqa: F401  (registers hf_dllm's model families with the Auto classes)

    set_threads(threads)
    dtype = parse_dtype(dtype)
    path = os.path.expanduser(os.fspath(model))
    # A Hub id is `name` or `namespace/name`; anything else names a local folder, which must exist.
    looks_local = path.startswith((".", "/")) or path.count("/") > 1 or os.path.exists(path)
    if looks_local and not os.path.isdir(path):
        raise FileNotFoundError(f"MODEL {os.fspath(model)!r}: no such checkpoint folder.")
    if device_map is not None and num_processes > 1:
        raise ValueError(
            "--device-map splits one model over several GPUs, but a data-parallel launch gives every process its "
            "own replica: use one or the other."
        )
    if tp_plan is not None:
        if tp_plan != "auto":
            raise ValueError(f"--tp-plan must be `auto` (the model config's plan), got {tp_plan!r}.")
        if device_map is not None or num_processes > 1:
            raise ValueError(
                "--tp-plan shards one model over the launch's processes: it excludes --device-map and data-parallel "
                "launches (accelerate), where every process holds its own replica."
            )
        if int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise ValueError(
                "--tp-plan auto shards the model over the processes of a torchrun launch; start the command with "
                "`torchrun --nproc-per-node N -m hf_dllm ...` (N >= 2)."
            )
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}.")
    if quantization != "none" and tp_plan is not None:
        raise ValueError(
            f"--quantization {quantization} and --tp-plan cannot be combined yet: the FP8 products multiply whole "
            "weights, not tensor-parallel shards. Use one of them."
        )
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if quantization != "none":
        if device_map is None and resolve_device(device).type != "cuda":
            raise ValueError(
                f"--quantization {quantization} needs a CUDA GPU (transformers quantizes FP8 weights on CUDA or XPU "
                f"devices only), but the model would load on {resolve_device(device)}."
            )
        from transformers import AutoConfig

        from hf_dllm.fp8 import fp8_config_for

        model_config = AutoConfig.from_pretrained(
            path, trust_remote_code=trust_remote_code, **({"revision": revision} if revision else {})
        )
        kwargs["quantization_config"] = fp8_config_for(model_config, quantization)
    if revision is not None:
        kwargs["revision"] = revision
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
        loaded = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    elif tp_plan is not None:  # transformers places each rank's shard on its device (LOCAL_RANK)
        from ..tensor_parallel import tensor_parallel_load_kwargs

        loaded = AutoModelForCausalLM.from_pretrained(path, **tensor_parallel_load_kwargs(), **kwargs).eval()
    else:
        target = resolve_device(device)
        if target.type == "cuda" and target.index is not None:
            torch.cuda.set_device(target)  # kernels launch on the current device
        if quantization != "none":
            # Quantized where it loads: on the GPU, without a full-precision copy on the host first.
            loaded = AutoModelForCausalLM.from_pretrained(path, device_map={"": target}, **kwargs).eval()
        else:
            loaded = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(target).eval()
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        source = os.path.expanduser(os.fspath(tokenizer)) if tokenizer is not None else path
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
    return loaded, tokenizer
