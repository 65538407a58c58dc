"""What `hf-dllm export` checks in the assembled repo before it moves into place (`verify_export`): every weight
file's header readable, exactly the tensors the config implies with its shapes (`expected_tensor_shapes`, FP8 block
scales included), an index that matches its shards, finite weights (`check_finite`, streamed), and a tokenizer that
loads with a chat template that parses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .families import ExportError, checkpoint_family


def expected_tensor_shapes(config: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The checkpoint's tensor names and shapes that `config` implies, from the state dict of the family's model
    built on the meta device (no memory; the Hub's names are the model's): `(required, tied)`, where `tied` are the
    weights the model ties to another one (LLaDA2.x's `lm_head.weight` with `tie_word_embeddings`), which a
    checkpoint may store or leave out (`save_pretrained` leaves them out; transformers ties them on loading)."""
    import torch

    config_class, model_class = checkpoint_family(config).classes()
    with torch.device("meta"):
        model = model_class(config_class.from_dict(config))
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    tied_names = set(getattr(model, "all_tied_weights_keys", None) or {})
    required = {name: shape for name, shape in shapes.items() if name not in tied_names}
    tied = {name: shape for name, shape in shapes.items() if name in tied_names}
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "fp8":
        # An FP8 checkpoint (`hf-dllm export --quantization fp8`, or one saved quantized): a block-scale tensor beside
        # every weight transformers' FP8 quantizer converts.
        from transformers import FineGrainedFP8Config

        from .quantize import fp8_weight_names, scale_shapes

        quantization_config = FineGrainedFP8Config.from_dict(quantization)
        names = fp8_weight_names(model_class, config_class.from_dict(config), quantization_config)
        required.update(scale_shapes(shapes, names, quantization_config.weight_block_size))
    return required, tied


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors of one weight file, from its header (safetensors: nothing else is read;
    a truncated or garbage file fails here)."""
    if path.name.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as weights:
                return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
        except (SafetensorError, OSError, ValueError) as error:
            raise ExportError(f"{path.name} is not a readable safetensors file: {error}") from error
    import torch

    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # mapped: nothing read yet
    except Exception:  # torch.load raises many kinds on a corrupt file (pickle, zip, runtime)
        try:  # files of torch < 1.6 (not zip) cannot be mapped: read them
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ExportError(f"{path.name} is not a readable PyTorch weights file: {error}") from error
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ExportError(f"{path.name} must hold a state dict (tensor names to tensors).")
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


# Elements checked at once by `check_finite`: bounds the memory of the check (a float32 copy of this many), whatever
# the size of a tensor (LLaDA-8B's embedding has 0.5 G elements).
FINITE_CHUNK_ELEMENTS = 1 << 24


def _chunks(tensor_rows, rows: int, chunk_rows: int):
    for start in range(0, rows, chunk_rows):
        yield tensor_rows(start, min(rows, start + chunk_rows))


def check_finite(path: Path) -> None:
    """`ExportError` naming the first tensors of the weight file `path` holding NaN or an infinity. Streams: each
    tensor is read in slices of about `FINITE_CHUNK_ELEMENTS` elements (safetensors: from the mapped file; PyTorch
    files: mapped), so no more than one slice is in memory at a time. Integer tensors are skipped."""
    import torch

    bad = []

    def finite(read, shape, dtype) -> bool:
        if not (dtype.is_floating_point or dtype.is_complex):
            return True
        if not shape:
            return bool(torch.isfinite(read(0, 1).float()).all())
        per_row = max(1, int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
        step = max(1, FINITE_CHUNK_ELEMENTS // per_row)
        return all(bool(torch.isfinite(chunk.float()).all()) for chunk in _chunks(read, shape[0], step))

    if path.name.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as weights:
            for name in weights.keys():
                view = weights.get_slice(name)
                shape = tuple(view.get_shape())
                dtype = getattr(torch, _SAFETENSORS_DTYPES.get(view.get_dtype(), "float32"))
                read = (lambda a, b, v=view: v[a:b]) if shape else (lambda a, b, n=name: weights.get_tensor(n))
                if not finite(read, shape, dtype):
                    bad.append(name)
    else:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        for name, tensor in state.items():
            if not finite(lambda a, b, t=tensor: t[a:b] if t.dim() else t, tuple(tensor.shape), tensor.dtype):
                bad.append(name)
    if bad:
        raise ExportError(
            f"{path.name} holds NaN or infinite values in {listing(bad)}: such weights load, then generate garbage "
            "(e.g. all EOS). Export a checkpoint with finite weights."
        )


_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def check_chat_template(folder: Path, tokenizer) -> None:
    """`ExportError` when a chat template of the repo (the tokenizer's, and a `chat_template.jinja` file) is not
    valid Jinja as transformers compiles it: such a repo loads, then fails at the first chat request."""
    try:  # transformers' own compiler (its sandbox and extensions): what a chat request will run
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers that moved it: jinja2's sandbox parses the same syntax
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def _compile_jinja_template(text):
            return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string(text)

    templates = {}
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        templates.update({f"chat template {name!r}": text for name, text in template.items()})
    elif isinstance(template, str):
        templates["the tokenizer's chat template"] = template
    if (folder / "chat_template.jinja").is_file():
        templates["chat_template.jinja"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for where, text in templates.items():
        try:
            _compile_jinja_template(text)
        except Exception as error:  # jinja2's TemplateSyntaxError, or anything its compiler raises
            raise ExportError(f"{where} does not parse: {type(error).__name__}: {error}") from error


def listing(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def verify_export(folder: Path, config: dict, weights: list[str], tokenizer_files: list[str]) -> None:
    """Check the assembled repo `folder` before it is moved into place; raises `ExportError` naming the problem.

    Every weight file's header must be readable, the tensors together must be exactly those the config implies
    (`expected_tensor_shapes`: tied weights may be stored or not), each with the config's shape and, for an index,
    in the shard it names; every floating tensor finite (`check_finite`); and when tokenizer files were exported,
    `AutoTokenizer` must load them and their chat template must parse (`check_chat_template`).
    """
    found: dict[str, tuple[int, ...]] = {}
    shard_of: dict[str, str] = {}
    for name in weights:
        if name.endswith(".index.json"):
            continue
        for tensor, shape in _tensor_shapes(folder / name).items():
            if tensor in found:
                raise ExportError(f"tensor {tensor} is stored twice ({shard_of[tensor]} and {name}).")
            found[tensor], shard_of[tensor] = shape, name
    index = [name for name in weights if name.endswith(".index.json")]
    if index:
        weight_map = json.loads((folder / index[0]).read_text(encoding="utf-8"))["weight_map"]
        wrong = [tensor for tensor, shard in weight_map.items() if shard_of.get(tensor) != shard]
        unlisted = set(found) - set(weight_map)
        if wrong or unlisted:
            raise ExportError(
                f"{index[0]} does not match its shards: {listing(wrong)} not in the shard it names"
                + (f"; {listing(unlisted)} in no entry" if unlisted else "")
                + "."
            )
    required, tied = expected_tensor_shapes(config)
    expected = {**required, **tied}
    problems = []
    missing = set(required) - set(found)
    if missing:
        problems.append(f"missing from the weights: {listing(missing)}")
    # Tensors the model ignores on load by name (DiffusionGemma's vision tower, which hf_dllm does not run).
    ignored = getattr(checkpoint_family(config).classes()[1], "_keys_to_ignore_on_load_unexpected", None) or ()
    unexpected = {name for name in set(found) - set(expected) if not any(re.search(rule, name) for rule in ignored)}
    if unexpected:
        problems.append(f"in the weights but not in a model of this config: {listing(unexpected)}")
    mismatched = [
        f"{name} is {list(found[name])}, the config gives {list(shape)}"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    if mismatched:
        problems.append("shapes differ from config.json: " + "; ".join(mismatched[:5]))
    if problems:
        raise ExportError("the weights do not match config.json: " + "; ".join(problems) + ".")
    for name in weights:
        if not name.endswith(".index.json"):
            check_finite(folder / name)
    if tokenizer_files:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception as error:  # tokenizers, json, sentencepiece and transformers each raise their own kinds
            raise ExportError(
                f"the tokenizer files ({', '.join(tokenizer_files)}) do not load: {type(error).__name__}: {error}"
            ) from error
        check_chat_template(folder, tokenizer)
