"""Where DiffusionGemma's denoising step spends its time: a per-kernel breakdown of the captured step.

At the 26B-A4B shape in bf16 on a GPU (`bench_diffusion_gemma.GEMMA_26B_A4B`, random weights, a 512-token prompt
encoded first), one decoder step plus the fused sampler, as `generate()` runs it (the layers replayed from a CUDA
graph), is run `--steps` times under `torch.profiler`. Kernels are grouped by name and by kind (the experts'
grouped products, cuBLAS products, attention, the sampler, norms and routing, the rest); the table gives each
group's time per step, its share, and the GPU's idle time between kernels (the step's span minus the union of its
kernels). Ends with one JSON line.

    python benchmarks/profile_diffusion_gemma_step.py [--batch 1] [--steps 5] [--layers 30]

`--cpu`: a tiny float32 shape on the CPU (checks that the script runs; CPU ops instead of kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_diffusion_gemma import GEMMA_26B_A4B, TINY, build_models, sync, text_fields  # noqa: E402
from kernel_profile import print_profile, profile_calls  # noqa: E402

from hf_dllm.decoding_diffusion_gemma import SAMPLER_DEFAULTS, EntropyBoundSampler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny float32 shape on the CPU (default without a GPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="steps profiled")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the shape's)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed by name")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        parser.error("--batch and --steps must be positive")
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    shape = text_fields(GEMMA_26B_A4B if gpu else TINY, args.layers)
    canvas, dtype, prompt_len = (256, torch.bfloat16, 512) if gpu else (16, torch.float32, 16)
    torch.manual_seed(0)
    model, _, _ = build_models(shape, canvas, dtype, device, with_reference=False)
    text = model.config.text_config
    defaults = {k: v for k, v in SAMPLER_DEFAULTS.items() if k not in ("sampler_config", "max_denoising_steps")}
    sampler = EntropyBoundSampler(
        text.vocab_size,
        max_denoising_steps=1 << 20,
        entropy_bound=0.1,
        softcap=text.final_logit_softcapping,
        **defaults,
    )  # as bench_diffusion_gemma's isolated step
    positions = torch.arange(prompt_len, prompt_len + canvas, device=device)
    with torch.no_grad():
        prompt = torch.randint(3, shape["vocab_size"], (args.batch, prompt_len), device=device)
        cache = model._diffusion_new_cache(args.batch, prompt_len + canvas)
        valid = torch.ones(args.batch, prompt_len, dtype=torch.bool, device=device)
        model.encode(prompt, torch.arange(prompt_len, device=device), valid, cache)
        block = sampler.initial_block(args.batch, canvas, device)

        def step(block):
            logits = model.decode(block, positions, cache, padded=False, **sampler.forward_inputs())
            return sampler.denoise(block, logits, None, None)[0]

        for _ in range(3):  # self-conditioned, captured, replayed once
            block = step(block)
        sync(device)
        state = {"block": block}

        def one_step():
            state["block"] = step(state["block"])

        profile = profile_calls(one_step, args.steps, device, args.top)
    print_profile(profile)
    summary = dict(
        benchmark="profile_diffusion_gemma_step",
        device=torch.cuda.get_device_name(device) if gpu else "CPU",
        batch=args.batch,
        layers=shape["num_hidden_layers"],
        graphs_used=model._graphs is not None and bool(model._graphs.entries),
        **profile,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
