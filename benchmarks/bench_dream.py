"""Speed of Dream's `generate()` on the GPU fast path against Fast-dLLM's Dream code, in one run (issue #18, item 4:
">= 5x its tokens/s at batch 1").

GPU setting: a Dream-7B-shaped model (the config of `Dream-org/Dream-v0-Instruct-7B`, a Qwen2.5-7B body: hidden 3584,
28 layers, 28 query / 4 key-value heads of 128, SiLU MLP 18944, vocab 152064, q/k/v biases, rope_theta 1e6, untied
head; 7.6 B parameters) with random bf16 weights built on the GPU (the mask token's output row zeroed, so that
neither implementation proposes it: hf_dllm never does, Fast-dLLM could); prompt 512, 256 new tokens, block 32, `eos_early_stop=False`. Two decoding settings:

- `dual-threshold` (the headline rows): Fast-dLLM's Dream setting "dual cache + parallel" (`dream/eval_gsm8k.sh`:
  `alg=confidence_threshold, threshold=0.9, use_cache, dual_cache`): each block's full forward commits its first
  position, then every block-only forward commits the most confident masked position and every other one with
  confidence >= 0.9. Random weights give no confidence near 0.9, so both implementations commit one token per
  forward: 32 forwards per block, NFE 256 each (measured and printed). Fast-dLLM's dual cache runs at batch 1 only
  (it writes the block's K/V at the positions of every row's block, a shape mismatch for more than one row; its
  threshold rule also selects in row 0 only), so its batch-32 row reports the error it raises.
- `prefix-schedule` (`--prefix-schedule-batch-sizes`, default batch 32): the prefix cache with Dream's entropy
  schedule, `steps` = new tokens (about one token per forward): the one Fast-dLLM Dream setting that runs at batch
  > 1. Fast-dLLM makes every step's forward, also those whose quota rounds to 0 tokens; hf_dllm skips the forwards
  that commit nothing, so NFEs differ: compare ms/forward as well as tokens/s.

Implementations, same weights:
- hf_dllm: `model.generate()` with CUDA graphs (the default), `attn_implementation` = `--attn` (default Dream's
  default `llada_triton`; at this shape its split-KV kernel does not apply (7 query heads per key-value head x 33
  query rows > 64) and it runs `sdpa`); batch 1 also without graphs (`disable_compile=True`, tokens compared).
- Fast-dLLM: their `DreamModel` (`modeling_dream.py`) with their block sampler (`generation_utils_block.py`'s
  `diffusion_generate` and `_sample`, bound as their `dream/eval.py` binds them for cached runs), loaded from
  `--reference-code DIR` (copy it with `benchmarks/fetch_fast_dllm.sh dream`; never shipped with hf_dllm) and
  sharing hf_dllm's weights in place (`load_state_dict(assign=True)`: the same tensors, no second copy). It is
  transformers-4 code: `patch_reference` gives transformers 5 the two things it misses (the "default" RoPE
  initialiser and a generation-config `validate()` of the old signature), without touching their files. Forwards are
  counted with a forward pre-hook. Tokens at batch 1 are compared with hf_dllm's (reported, not asserted: bf16
  kernels differ and random weights leave near-ties everywhere).

hf_dllm rows: one warm-up call (graph capture), then the median of `--repeats` calls (prefix-schedule rows: one
call: at batch 32 each call recomputes the block and its suffix for 32 rows at every forward); Fast-dLLM rows: a one-block warm-up call, then `--reference-repeats` calls.
"step ms": median of 30 dual-cache block steps (CUDA events).

`--cpu`: a tiny float32 Dream on the CPU (sharpened head so that thresholds commit several tokens per forward),
both implementations, batch 1 and 4; in float32 the two must give the same tokens. Prints a table and ends with one
JSON line.

    benchmarks/fetch_fast_dllm.sh dream                                  # once: .ref/fast_dllm_dream (git-ignored)
    python benchmarks/bench_dream.py --reference-code .ref/fast_dllm_dream
    python benchmarks/bench_dream.py --cpu --reference-code .ref/fast_dllm_dream
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import dual_step_ms, forget_graphs  # noqa: E402

import hf_dllm  # noqa: E402

# Dream-org/Dream-v0-Instruct-7B's config.json (Qwen2.5-7B's body); its tokenizer's <|mask|> and <|endoftext|>.
DREAM_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    mask_token_id=151666,
    eos_token_id=151643,
    bos_token_id=151643,
    pad_token_id=151643,
)
TINY = dict(
    DREAM_7B,
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    mask_token_id=2000,
    eos_token_id=1999,
    bos_token_id=1999,
    pad_token_id=1999,
)
REFERENCE_FILES = ("configuration_dream.py", "modeling_dream.py", "generation_utils.py", "generation_utils_block.py")


def build_model(shape: dict, dtype: torch.dtype, device: torch.device, attn: str, head_scale: float):
    """hf_dllm's DreamModel with random weights built on `device`; the mask token's output row is zero (it is never
    a good candidate), and the head is multiplied by `head_scale` (> 1 spreads confidences over (0, 1))."""
    config = hf_dllm.DreamConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_dllm.DreamModel._from_config(config, dtype=dtype, attn_implementation=attn)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        model.lm_head.weight[shape["mask_token_id"]] = 0
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warm_up: bool = True):
    """(median seconds, last result, peak bytes of the last call) of `fn()`, after one untimed call if `warm_up`."""
    if warm_up:
        fn()
    times, peak, result = [], 0, None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
    return statistics.median(times), result, peak


def default_rope(config, device=None, seq_len=None, **kwargs):
    """transformers 4's default RoPE initialiser (`inv_freq`, attention scaling 1), which transformers 5 dropped from
    `ROPE_INIT_FUNCTIONS` and Fast-dLLM's `DreamRotaryEmbedding` looks up."""
    head_dim = config.hidden_size // config.num_attention_heads
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    return 1.0 / (config.rope_theta**exponents), 1.0


def patch_reference(generation_modules) -> None:
    """What Fast-dLLM's transformers-4 Dream code needs from transformers 5: the default RoPE initialiser, and a
    `validate()` on its generation configs that takes transformers 5's arguments (their override takes only
    `is_init`, and `GenerationConfig.update()` now calls it with `user_set_attributes`; theirs checks nothing)."""
    import transformers.modeling_rope_utils as rope_utils

    rope_utils.ROPE_INIT_FUNCTIONS.setdefault("default", default_rope)
    for module in generation_modules:
        module.DreamGenerationConfig.validate = lambda self, *args, **kwargs: None


def load_reference(code_dir: Path, model) -> tuple[torch.nn.Module, type]:
    """Fast-dLLM's Dream model from `code_dir`, sharing `model`'s weights (no copy), with their block sampler bound;
    and their generation-config class."""
    code_dir = Path(code_dir)
    missing = [name for name in REFERENCE_FILES if not (code_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"--reference-code {code_dir} lacks {missing}: copy Fast-dLLM's dream/model/ there with "
            "benchmarks/fetch_fast_dllm.sh dream."
        )
    package = types.ModuleType("fast_dllm_dream")  # their files import each other relatively
    package.__path__ = [str(code_dir)]
    sys.modules[package.__name__] = package
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 on their rope_scaling / rope validation
        configuration = importlib.import_module(f"{package.__name__}.configuration_dream")
        generation = importlib.import_module(f"{package.__name__}.generation_utils")
        block_sampler = importlib.import_module(f"{package.__name__}.generation_utils_block")
        modeling = importlib.import_module(f"{package.__name__}.modeling_dream")
        patch_reference([generation, block_sampler])
        fields = {key: model.config.to_dict()[key] for key in DREAM_7B}
        config = configuration.DreamConfig(**fields)
    config._attn_implementation = "sdpa"  # their layers are DreamSdpaAttention whatever this says
    with torch.device("meta"):
        reference = modeling.DreamModel(config)
    missing_keys, unexpected = reference.load_state_dict(model.state_dict(), strict=False, assign=True)
    if missing_keys or unexpected:
        raise RuntimeError(f"reference weights do not line up: missing {missing_keys[:5]}, unexpected {unexpected[:5]}")
    device = next(model.parameters()).device
    # The rotary tables are non-persistent buffers (in no state dict): rebuild those modules on the device.
    rotary = type(reference.model.rotary_emb)
    reference.model.rotary_emb = rotary(config=config, device=device)
    for layer in reference.model.layers:
        layer.self_attn.rotary_emb = rotary(config=config, device=device)
    meta = [name for name, tensor in [*reference.named_parameters(), *reference.named_buffers()] if tensor.is_meta]
    if meta:
        raise RuntimeError(f"reference tensors left on the meta device: {meta[:5]}")
    # As Fast-dLLM's dream/eval.py does for cached runs: the block sampler's entry point and loop.
    reference.diffusion_generate = types.MethodType(block_sampler.DreamGenerationMixin.diffusion_generate, reference)
    reference._sample = types.MethodType(block_sampler.DreamGenerationMixin._sample, reference)
    return reference.eval(), generation.DreamGenerationConfig


class ForwardCounter:
    """Counts a module's forward calls (Fast-dLLM's sampler calls `self(...)` once per forward)."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1


def ours_kwargs(setting: str, new_tokens: int, block: int, threshold: float) -> dict:
    """hf_dllm's `generate()` settings for `setting` (`dual-threshold` or `prefix-schedule`)."""
    kwargs = dict(
        max_new_tokens=new_tokens,
        block_length=block,
        use_cache=True,
        dual_cache=setting == "dual-threshold",
        eos_early_stop=False,
        return_dict_in_generate=True,
    )
    if setting == "dual-threshold":
        return dict(kwargs, alg="confidence_threshold", threshold=threshold)
    return dict(kwargs, alg="entropy", steps=new_tokens)


def reference_generate(reference, config_class, prompts, setting: str, new_tokens: int, block: int, threshold, ids):
    """Fast-dLLM's `diffusion_generate` for `setting` (their eval's arguments); returns `sequences`."""
    blocks = new_tokens // block
    generation_config = config_class(
        max_new_tokens=new_tokens,
        # Their eval passes steps = new_tokens / block_length with the threshold (unused there beyond divisibility).
        steps=blocks if setting == "dual-threshold" else new_tokens,
        alg="confidence_threshold" if setting == "dual-threshold" else "entropy",
        alg_temp=0.0,
        temperature=0.0,
        return_dict_in_generate=True,
        **ids,
    )
    out = reference.diffusion_generate(
        prompts,
        generation_config=generation_config,
        threshold=threshold,
        block_length=block,
        dual_cache=setting == "dual-threshold",
    )
    return out.sequences


def error_text(error: BaseException) -> str:
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}"[:160]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny float32 setting on the CPU (default without a GPU)")
    parser.add_argument("--reference-code", type=Path, default=None, help="Fast-dLLM's dream/model/ files")
    parser.add_argument("--batch-sizes", default=None, help="dual-threshold rows, comma list (GPU: 1,32; CPU: 1,4)")
    parser.add_argument(
        "--prefix-schedule-batch-sizes", default=None, help="prefix-schedule rows (GPU: 32; CPU: 4; '' = none)"
    )
    parser.add_argument("--reference-batch-sizes", default=None, help="Fast-dLLM rows (default: every batch size)")
    parser.add_argument("--attn", default="llada_triton", help="hf_dllm's attn_implementation")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--block-length", type=int, default=None)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--head-scale", type=float, default=None, help="LM head multiplier (GPU 1, CPU 40)")
    parser.add_argument("--repeats", type=int, default=None, help="timed hf_dllm calls (GPU 2, CPU 1)")
    parser.add_argument("--reference-repeats", type=int, default=1)
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    shape, dtype = (DREAM_7B, torch.bfloat16) if gpu else (TINY, torch.float32)

    def chosen(value, gpu_default, cpu_default):
        return value if value is not None else gpu_default if gpu else cpu_default

    prompt_len = chosen(args.prompt_len, 512, 24)
    new_tokens = chosen(args.new_tokens, 256, 32)
    block = chosen(args.block_length, 32, 8)
    head_scale = chosen(args.head_scale, 1.0, 40.0)
    repeats = chosen(args.repeats, 2, 1)

    def sizes(text: str | None, default: str) -> list[int]:
        text = default if text is None else text
        try:
            values = [int(b) for b in text.split(",") if b.strip()]
        except ValueError:
            raise ValueError(f"batch sizes must be a comma list of integers, got {text!r}.") from None
        if any(b < 1 for b in values):
            raise ValueError(f"batch sizes must be >= 1, got {text!r}.")
        return values

    threshold_batches = sizes(args.batch_sizes, "1,32" if gpu else "1,4")
    schedule_batches = sizes(args.prefix_schedule_batch_sizes, "32" if gpu else "4")
    all_batches = sorted(set(threshold_batches) | set(schedule_batches))
    reference_batches = set(sizes(args.reference_batch_sizes, ",".join(map(str, all_batches))))
    for name, value in (("--prompt-len", prompt_len), ("--new-tokens", new_tokens), ("--block-length", block),
                        ("--repeats", repeats), ("--reference-repeats", args.reference_repeats)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if new_tokens % block:
        raise ValueError(f"--new-tokens ({new_tokens}) must be a multiple of --block-length ({block}) (Fast-dLLM's).")
    if not 0 < args.threshold <= 1:
        raise ValueError(f"--threshold must be in (0, 1], got {args.threshold}.")
    if args.reference_code is not None and not Path(args.reference_code).is_dir():
        raise ValueError(
            f"--reference-code {args.reference_code} is not a folder (benchmarks/fetch_fast_dllm.sh dream)"
        )
    device_name = torch.cuda.get_device_name(device) if gpu else "CPU"
    ids = {key: shape[key] for key in ("mask_token_id", "eos_token_id", "bos_token_id", "pad_token_id")}

    started = time.perf_counter()
    model = build_model(shape, dtype, device, args.attn, head_scale)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    summary = {
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype),
        "shape": "Dream-7B" if gpu else "tiny",
        "config": {key: value for key, value in shape.items()},
        "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "attn": args.attn,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "block_length": block,
        "threshold": args.threshold,
        "head_scale": head_scale,
        "build_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)

    prompts = {}
    for batch in all_batches:
        torch.manual_seed(batch)
        prompts[batch] = torch.randint(0, shape["vocab_size"] - 512, (batch, prompt_len), device=device)

    rows, outputs = [], {}

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    def run_ours(setting: str, batch: int, eager: bool = False) -> None:
        kwargs = ours_kwargs(setting, new_tokens, block, args.threshold)
        if eager:
            kwargs["disable_compile"] = True
        name = "hf_dllm eager" if eager else "hf_dllm"
        try:
            calls = 1 if eager or setting == "prefix-schedule" else repeats
            seconds, out, peak = timed(lambda: model.generate(prompts[batch], **kwargs), device, calls)
            step_ms = None
            if not eager and setting == "dual-threshold":
                step_ms = dual_step_ms(model, prompts[batch], kwargs, device)
        except torch.OutOfMemoryError as error:
            forget_graphs(model)
            record(dict(impl=name, setting=setting, batch=batch, error=error_text(error)))
            return
        row = dict(
            impl=name,
            setting=setting,
            batch=batch,
            nfe=out.nfe,
            ms_per_forward=1000 * seconds / out.nfe,
            tokens_per_s=batch * new_tokens / seconds,
            seconds=seconds,
            peak_gb=peak / 1e9,
        )
        if step_ms is not None:
            row["step_ms"] = step_ms
            if gpu and batch == 1:
                # Weight bytes read once per step over the step time (the bandwidth floor's view).
                row["weight_read_tb_s"] = weight_bytes / (row["step_ms"] / 1000) / 1e12
        outputs[(name, setting, batch)] = out.sequences
        if eager:
            graphs = outputs.get(("hf_dllm", setting, batch))
            if graphs is not None:
                row["tokens_equal_graphs"] = bool(torch.equal(graphs, out.sequences))
        record(row)

    reference = None

    def run_reference(setting: str, batch: int) -> None:
        def call(tokens: int) -> torch.Tensor:
            return reference_generate(
                reference, config_class, prompts[batch], setting, tokens, block, args.threshold, ids
            )

        try:
            with torch.no_grad():
                call(block)  # warm-up on one block: the first launches, without paying for a whole extra run
                counter = ForwardCounter(reference)
                try:
                    seconds, sequences, peak = timed(
                        lambda: call(new_tokens), device, args.reference_repeats, warm_up=False
                    )
                finally:
                    counter.handle.remove()
        except Exception as error:  # their code's failures (out of memory, unsupported batch) are results here
            record(dict(impl="Fast-dLLM", setting=setting, batch=batch, error=error_text(error)))
            if gpu:
                torch.cuda.empty_cache()
            return
        nfe = counter.count // args.reference_repeats
        row = dict(
            impl="Fast-dLLM",
            setting=setting,
            batch=batch,
            nfe=nfe,
            ms_per_forward=1000 * seconds / nfe,
            tokens_per_s=batch * new_tokens / seconds,
            seconds=seconds,
            peak_gb=peak / 1e9,
        )
        ours = outputs.get(("hf_dllm", setting, batch))
        if ours is not None and ours.shape == sequences.shape:
            generated = (ours[:, prompt_len:] == sequences[:, prompt_len:]).float()
            row["tokens_equal_hf_dllm"] = bool(generated.all())
            row["tokens_equal_fraction"] = round(float(generated.mean()), 4)
        record(row)

    config_class = None
    if args.reference_code is not None:
        reference, config_class = load_reference(args.reference_code, model)

    for setting, batches in (("dual-threshold", threshold_batches), ("prefix-schedule", schedule_batches)):
        for batch in batches:
            run_ours(setting, batch)
            if setting == "dual-threshold" and batch == 1:
                run_ours(setting, batch, eager=True)
            forget_graphs(model)
            if reference is not None and batch in reference_batches:
                run_reference(setting, batch)

    def find(impl: str, setting: str, batch: int) -> dict | None:
        return next(
            (r for r in rows if (r["impl"], r["setting"], r["batch"]) == (impl, setting, batch) and "error" not in r),
            None,
        )

    ours_1, theirs_1 = find("hf_dllm", "dual-threshold", 1), find("Fast-dLLM", "dual-threshold", 1)
    if ours_1 is not None and theirs_1 is not None:
        summary["batch1_ratio"] = ours_1["tokens_per_s"] / theirs_1["tokens_per_s"]
        summary["batch1_goal_5x_met"] = summary["batch1_ratio"] >= 5
        summary["batch1_tokens_equal_fraction"] = theirs_1.get("tokens_equal_fraction")

    print()
    print(
        f"{device_name}, {dtype}, {summary['shape']} shape ({summary['parameters_b']} B parameters), attn {args.attn}, "
        f"prompt {prompt_len}, {new_tokens} new tokens, block {block}; dual-threshold = dual cache, alg "
        f"confidence_threshold, threshold {args.threshold}; prefix-schedule = prefix cache, alg entropy, steps "
        f"{new_tokens}"
    )
    print(
        f"{'impl':<15}{'setting':<16}{'batch':>6}{'NFE':>6}{'ms/fwd':>9}{'tok/s':>10}{'step ms':>9}{'peak GB':>9}  note"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<15}{r['setting']:<16}{r['batch']:>6}  {r['error']}")
            continue
        step = f"{r['step_ms']:.2f}" if "step_ms" in r else "-"
        note = ""
        if "tokens_equal_graphs" in r:
            note = f"tokens = graphs: {r['tokens_equal_graphs']}"
        if "tokens_equal_fraction" in r:
            note = f"tokens = hf_dllm: {100 * r['tokens_equal_fraction']:.1f}%"
        print(
            f"{r['impl']:<15}{r['setting']:<16}{r['batch']:>6}{r['nfe']:>6}{r['ms_per_forward']:>9.2f}"
            f"{r['tokens_per_s']:>10.1f}{step:>9}{r['peak_gb']:>9.2f}  {note}"
        )
    if "batch1_ratio" in summary:
        print(
            f"batch 1, dual-threshold: hf_dllm {ours_1['tokens_per_s']:.1f} tok/s vs Fast-dLLM {theirs_1['tokens_per_s']:.1f} "
            f"tok/s = {summary['batch1_ratio']:.2f}x (goal >= 5x: {'met' if summary['batch1_goal_5x_met'] else 'not met'})"
        )
    summary["rows"] = rows
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
