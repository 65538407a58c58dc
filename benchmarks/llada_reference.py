"""hf_dllm's CPU `generate()` against Fast-dLLM's LLaDA reference functions, in one process, interleaved.

Used by `benchmarks/bench_generate.py --cpu --reference PATH`. PATH is a copy of Fast-dLLM's public `llada/`
folder (`generate.py` with `generate` / `generate_with_prefix_cache` / `generate_with_dual_cache`, and
`model/modeling_llada.py`), made with `benchmarks/fetch_fast_dllm.sh llada`; it is Apache-2.0 code that is never
committed here. The reference functions run the reference's own model code on the same checkpoint (the tiny
trained LLaDA, `tests/fixtures/llada-tiny-trained`, float32, loaded by both from its safetensors file).

Settings (issue 13 item 6; batch 1, 32 new tokens, block 8 unless named, greedy, `eos_early_stop=False` since the
reference decodes every position): no cache with 32 and 16 steps, prefix cache, dual cache (32 steps), no cache /
prefix / dual with threshold 0.9, dual with threshold 0.7, dual with threshold 0.9 and block 32.

For every thread count and setting, one warm-up pass over the prompts (the reference wraps sdpa in
`torch.compile`, which compiles again for new shapes), then for each repeat each prompt is decoded by hf_dllm then
by the reference, one after the other (so machine load hits both alike); a repeat's time is the sum over prompts,
its ratio reference/hf_dllm, and a setting's ratio the median over repeats. The tokens of every prompt (first
repeat) are compared with the reference's.
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "tests" / "fixtures" / "llada-tiny-trained"
REFERENCE_FILES = ("generate.py", "model/__init__.py", "model/configuration_llada.py", "model/modeling_llada.py")
NEW_TOKENS = 32


@dataclass(frozen=True)
class Setting:
    name: str
    cache: str  # "none", "prefix" or "dual"
    block_length: int = 8
    steps: int = NEW_TOKENS
    threshold: float | None = None


SETTINGS = (
    Setting("no cache, 32 steps", "none"),
    Setting("no cache, 16 steps", "none", steps=16),
    Setting("prefix, 32 steps", "prefix"),
    Setting("dual, 32 steps", "dual"),
    Setting("no cache, threshold 0.9", "none", threshold=0.9),
    Setting("prefix, threshold 0.9", "prefix", threshold=0.9),
    Setting("dual, threshold 0.9", "dual", threshold=0.9),
    Setting("dual, threshold 0.7", "dual", threshold=0.7),
    Setting("dual, threshold 0.9, block 32", "dual", block_length=32, threshold=0.9),
)


def load_reference(code_dir: Path, checkpoint: Path):
    """(Fast-dLLM's `LLaDAModelLM` with `checkpoint`'s weights, their `generate` module).

    Shims, none changing what runs: `config.use_cache` restored from the checkpoint; their files import `model.modeling_llada` as a top-level package (aliased to
    the copy in `code_dir`), and `einops` (imported at the top of their modeling file, used only by a flex-attention
    path these settings never take) gets a stub when it is not installed.
    """
    code_dir = Path(code_dir)
    missing = [name for name in REFERENCE_FILES if not (code_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"--reference {code_dir} lacks {missing}: copy Fast-dLLM's llada/ folder there with "
            "benchmarks/fetch_fast_dllm.sh llada."
        )
    try:
        import einops  # noqa: F401
    except ImportError:
        stub = types.ModuleType("einops")

        def rearrange(*args, **kwargs):
            raise NotImplementedError("einops is not installed (stub from benchmarks/llada_reference.py)")

        stub.rearrange = rearrange
        sys.modules["einops"] = stub
    package = types.ModuleType("fast_dllm_llada")
    package.__path__ = [str(code_dir)]
    sys.modules[package.__name__] = package
    model_package = importlib.import_module("fast_dllm_llada.model")
    configuration = importlib.import_module("fast_dllm_llada.model.configuration_llada")
    saved = {name: sys.modules.get(name) for name in ("model", "model.modeling_llada")}
    sys.modules["model"] = model_package
    sys.modules["model.modeling_llada"] = importlib.import_module("fast_dllm_llada.model.modeling_llada")
    try:
        generate_module = importlib.import_module("fast_dllm_llada.generate")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

    from safetensors.torch import load_file

    fields = json.loads((Path(checkpoint) / "config.json").read_text())
    config = configuration.LLaDAConfig(**fields)
    # transformers 5 no longer keeps `use_cache` on every config; their forward reads it when not passed.
    config.use_cache = fields.get("use_cache", False)
    reference = model_package.LLaDAModelLM(config, init_params=False)
    missing_keys, unexpected = reference.load_state_dict(
        load_file(Path(checkpoint) / "model.safetensors"), strict=False
    )
    if missing_keys or unexpected:
        raise RuntimeError(f"reference weights do not line up: missing {missing_keys[:5]}, unexpected {unexpected[:5]}")
    return reference.eval(), generate_module


def reference_call(generate_module, reference, prompt: torch.Tensor, setting: Setting, mask_id: int):
    """Fast-dLLM's function for `setting`; returns (sequences `(1, prompt + 32)`, NFE)."""
    function = {
        "none": generate_module.generate,
        "prefix": generate_module.generate_with_prefix_cache,
        "dual": generate_module.generate_with_dual_cache,
    }[setting.cache]
    return function(
        reference,
        prompt,
        steps=setting.steps,
        gen_length=NEW_TOKENS,
        block_length=setting.block_length,
        temperature=0.0,
        mask_id=mask_id,
        threshold=setting.threshold,
    )


def ours_kwargs(setting: Setting) -> dict:
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        block_length=setting.block_length,
        use_cache=setting.cache != "none",
        dual_cache=setting.cache == "dual",
        eos_early_stop=False,
        return_dict_in_generate=True,
    )
    if setting.threshold is None:
        kwargs["steps"] = setting.steps
    else:
        kwargs["threshold"] = setting.threshold  # the reference ignores `steps` under a threshold
    return kwargs


def prompts_of(tokenizer, n: int) -> list[torch.Tensor]:
    """The first `n` held-out prompts of the tiny tasks (copy / reverse / sort in turn), chat-formatted, `(1, P)`."""
    from hf_dllm.tiny_model import tasks

    return [tasks.encode_prompts(tokenizer, [example.prompt]).input_ids for example in tasks.heldout_examples(n)]


@torch.no_grad()
def compare(
    code_dir: Path,
    checkpoint: Path = TRAINED,
    threads: tuple[int, ...] = (1, 2),
    n_prompts: int = 6,
    repeats: int = 3,
    settings: tuple[Setting, ...] = SETTINGS,
    log=print,
) -> dict:
    """Times every setting at every thread count; returns the summary (rows per threads x setting)."""
    from transformers import AutoModel, AutoTokenizer

    import hf_dllm  # noqa: F401  (registers LLaDA with the Auto classes)

    ours = AutoModel.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reference, generate_module = load_reference(code_dir, checkpoint)
    mask_id = ours.config.mask_token_id
    prompts = prompts_of(tokenizer, n_prompts)
    parameters = sum(p.numel() for p in ours.parameters())
    rows = []
    for thread_count in threads:
        torch.set_num_threads(thread_count)
        for setting in settings:
            kwargs = ours_kwargs(setting)
            for prompt in prompts:  # warm-up on every prompt length (the reference's compiled sdpa recompiles)
                ours.generate(prompt, **kwargs)
                reference_call(generate_module, reference, prompt, setting, mask_id)
            ours_times, reference_times, identical, ours_nfe, reference_nfe = [], [], 0, 0, 0
            for repeat in range(repeats):
                ours_total = reference_total = 0.0
                for prompt in prompts:
                    start = time.perf_counter()
                    out = ours.generate(prompt, **kwargs)
                    middle = time.perf_counter()
                    expected, nfe = reference_call(generate_module, reference, prompt, setting, mask_id)
                    end = time.perf_counter()
                    ours_total += middle - start
                    reference_total += end - middle
                    if repeat == 0:
                        identical += int(torch.equal(out.sequences, expected))
                        ours_nfe += int(out.nfe)
                        reference_nfe += int(nfe)
                ours_times.append(ours_total)
                reference_times.append(reference_total)
            ratios = [r / o for r, o in zip(reference_times, ours_times, strict=True)]
            row = dict(
                threads=thread_count,
                setting=setting.name,
                ours_ms_per_call=1000 * statistics.median(ours_times) / len(prompts),
                reference_ms_per_call=1000 * statistics.median(reference_times) / len(prompts),
                ratio=statistics.median(ratios),
                ratios=[round(r, 3) for r in ratios],
                ours_nfe=ours_nfe / len(prompts),
                reference_nfe=reference_nfe / len(prompts),
                identical=identical,
                prompts=len(prompts),
            )
            rows.append(row)
            log(json.dumps(row))
    return dict(
        benchmark="cpu_vs_fast_dllm_reference",
        model=str(checkpoint),
        parameters=parameters,
        new_tokens=NEW_TOKENS,
        repeats=repeats,
        torch=torch.__version__,
        rows=rows,
        all_identical=all(r["identical"] == r["prompts"] for r in rows),
        min_ratio=min(r["ratio"] for r in rows),
    )


def print_table(summary: dict) -> None:
    print(
        f"\n{summary['model']} ({summary['parameters'] / 1e6:.2f}M parameters), CPU float32, batch 1, "
        f"{summary['new_tokens']} new tokens, median of {summary['repeats']} interleaved repeats"
    )
    header = (
        f"{'threads':>7}  {'setting':<30}{'ours ms':>9}{'ref ms':>9}{'ratio':>7}{'NFE':>6}{'ref NFE':>8}{'same':>7}"
    )
    print(header)
    for r in summary["rows"]:
        print(
            f"{r['threads']:>7}  {r['setting']:<30}{r['ours_ms_per_call']:>9.1f}{r['reference_ms_per_call']:>9.1f}"
            f"{r['ratio']:>6.2f}x{r['ours_nfe']:>6.1f}{r['reference_nfe']:>8.1f}{r['identical']:>4}/{r['prompts']}"
        )
