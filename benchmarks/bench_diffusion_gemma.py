"""Speed of DiffusionGemma's `generate()` (issue #67 item 5) against transformers' own `generate()`, same weights.

GPU setting: the `google/diffusiongemma-26B-A4B-it` text shape (`GEMMA_26B_A4B`: hidden 2816, 30 layers, 16 query /
8 key-value heads of 256 with a sliding window of 1024, every 6th layer full attention with 2 key-value heads of
512, 128 experts top-8 of width 704 beside a dense MLP of 2112, vocabulary 262,144, canvas 256) with random bf16
weights built on the GPU once (transformers' model when it is importable, hf_dllm's model reading the same tensors
in place; else hf_dllm's alone); batch 1 / 8 / 32, a 512-token random prompt, 512 new tokens (two canvases), the
model's default sampler settings (entropy bound 0.1, temperature 0.8 -> 0.4, stable-and-confident stop) and a fixed
`max_denoising_steps` of 16 and 48. Random weights never get confident, so every canvas takes all its steps.

Per row: tokens/s, denoising steps per canvas (decoder forwards per canvas), ms per step (the call's time over its
steps, encoder passes included), peak memory allocated during the call, the CUDA graph replays per pass
(`graph_replays`: the graphs were captured by the two warm-up calls: a prompt shape's encoder pass is captured at
its second call, `prompt_graphs`); the same for transformers' `generate()`
(only at `--reference-batch-sizes`, default 1 and 8: its batch-32 rows would take most of the time budget).

Also measured, per batch size: one **encoder pass over the prompt** (on an emptied cache, as generate() runs it)
and one **encoder pass over an accepted canvas** (after the prompt, in generate()'s cache), each eager (host-bound
at batch 1, so its ms are the host's) and replayed from its CUDA graph (`capture_encoder`), on CUDA also with the
sliding layers' attention on Triton (`ENCODER_ATTENTION`), the **host syncs of one generate() call** (torch's
sync debug mode; the stop decision's event read is not one), and one
**isolated denoising step** (decoder forward + `EntropyBoundSampler.denoise`,
after the encoder wrote the prompt, with self-conditioning; CUDA events around `--step-repeats` steps back to back)
and its **weight-read floor**: the bytes of the attention, dense-MLP, norm and router weights of every layer, the
self-conditioning MLP, the embedding twice (the self-conditioning matmul and the tied LM head each read it) and the
distinct experts the step's routers selected (counted by hooks), over the measured device copy bandwidth.

The step's parts, each timed alone at each batch size (`steps[*]` in the JSON line): the sampler on the fused path
(`triton_diffusion_gemma.fused_sample`, where it runs) and the PyTorch one on the same logits, and one layer's
experts on the canvas' routing under torch's grouped GEMM and hf_dllm's Triton kernels (`experts_default`: the one
the model runs; the measurement that picks it); on CUDA the captured step with every layer's attention on each
backend, with the experts' weighted sum launched apart against inside the layer's end kernel (the default), with
each layer's input norm launched apart (not by the previous layer's end kernel), with the dense MLP inline instead
of on a side stream beside the experts (`dense_mlp_beside_experts`), with that MLP forked before the router's
product and routing instead of after them (`dense_mlp_after_routing`), with the side stream at normal priority
(`SIDE_STREAM_PRIORITY`), with the router's product on cuBLAS (`product_in_routing_kernel`), and with the sliding
attention reading the ring's unwritten slots, splitting its keys in power-of-two chunks, or merging its splits in a
second kernel.

On CUDA, `hf_dllm apart` rows: `generate()` again with an accepted canvas' encoder pass and the next canvas' first
decoder pass run apart (`fuse_canvas_passes` off; on by default: one pass), and their batch-1 speed-ups over
transformers (`canvas_passes_apart` in the JSON line).

Goals (in the JSON line, each with its value and `met`): batch 1 >= 5x transformers' tokens/s (at each step
count); the batch-1 step within 1.3x its floor; batch 32 under 80 GB peak.

`--cpu`: a tiny float32 shape on the CPU, both ours and transformers' (tokens compared: on the CPU hf_dllm
reproduces transformers' draws under the same seed), a few seconds; no floor (no device bandwidth).

    python benchmarks/bench_diffusion_gemma.py                       # one H200, < 6 minutes
    python benchmarks/bench_diffusion_gemma.py --layers 6 --batch-sizes 1 --steps 16
    python benchmarks/bench_diffusion_gemma.py --cpu

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_generate import switched  # noqa: E402

import hf_dllm  # noqa: E402
from hf_dllm import modeling_diffusion_gemma  # noqa: E402
from hf_dllm.decoding_diffusion_gemma import SAMPLER_DEFAULTS, EntropyBoundSampler  # noqa: E402

# The 26B-A4B text transformer (the shape issue #67 gives; transformers' config defaults are a smaller Gemma).
GEMMA_26B_A4B = dict(
    vocab_size=262_144,
    hidden_size=2816,
    intermediate_size=2112,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=2,
    sliding_window=1024,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    max_position_embeddings=131_072,
    use_bidirectional_attention="vision",
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    sliding_window=8,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    max_position_embeddings=512,
    use_bidirectional_attention="vision",
)
# A minimal vision tower: transformers' model always builds one; neither model runs it here.
TINY_VISION = dict(
    model_type="gemma4_vision",
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=16,
)


def transformers_class():
    """transformers' `DiffusionGemmaForBlockDiffusion`, or the reason it cannot be used (str)."""
    try:
        from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
    except ImportError as error:
        import transformers

        return f"transformers {transformers.__version__} has no DiffusionGemma ({error})"
    return DiffusionGemmaForBlockDiffusion


def text_fields(shape: dict, layers: int | None) -> dict:
    fields = dict(shape)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    # Every 6th layer full attention, and the last (the model requires it).
    count = fields["num_hidden_layers"]
    fields["layer_types"] = [
        "full_attention" if (i + 1) % 6 == 0 or i == count - 1 else "sliding_attention" for i in range(count)
    ]
    return fields


def build_models(shape: dict, canvas: int, dtype, device, with_reference: bool):
    """(ours, reference or None, reason the reference is missing or None): random weights built once on `device`
    (transformers' initialisation when the reference exists); ours reads the reference's tensors in place."""
    reference_class = transformers_class() if with_reference else "not asked (--no-reference)"
    config = hf_dllm.DiffusionGemmaConfig(text_config=dict(shape), vision_config=None, canvas_length=canvas)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if isinstance(reference_class, str):
            with torch.device(device):
                return hf_dllm.DiffusionGemmaForBlockDiffusion(config).eval(), None, reference_class
        from transformers.models.diffusion_gemma import DiffusionGemmaConfig

        try:  # another transformers version may build it differently: then ours alone, saying why
            reference_config = DiffusionGemmaConfig(
                text_config=dict(shape), vision_config=dict(TINY_VISION), canvas_length=canvas
            )
            with torch.device(device):
                reference = reference_class._from_config(reference_config, dtype=dtype).eval()
        except Exception as error:  # noqa: BLE001  (reported in the JSON line)
            with torch.device(device):
                ours = hf_dllm.DiffusionGemmaForBlockDiffusion(config).eval()
            return ours, None, f"transformers' model could not be built: {type(error).__name__}: {error}"
        with torch.device("meta"):
            ours = hf_dllm.DiffusionGemmaForBlockDiffusion(config)
    finally:
        torch.set_default_dtype(default_dtype)
    missing, _ = ours.load_state_dict(reference.state_dict(), strict=False, assign=True)
    if missing:
        raise RuntimeError(f"hf_dllm's model lacks the reference's tensors: {missing[:5]}")
    decoder = ours.model.decoder
    for kind, frequencies in decoder.rope_frequencies().items():
        setattr(decoder, f"{kind}_inv_freq", frequencies.to(device))
    ours.lm_head.weight = decoder.embed_tokens.weight
    left = [name for name, tensor in [*ours.named_parameters(), *ours.named_buffers()] if tensor.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")
    share_concatenations(ours, reference)
    return ours.eval(), reference, None


def share_concatenations(ours, reference) -> None:
    """Concatenate ours' q/k/v and gate/up now (the fused path's first forward would: `ConcatenatedProjections`)
    and point every reference parameter that held one of the replaced tensors at its view, so that the two models
    still share every weight (otherwise the reference keeps the old tensors, under its decoder's names and its
    encoder's tied ones: ~2.1 GB more at the 26B-A4B shape, in every peak-memory figure)."""
    before = {name: parameter.data_ptr() for name, parameter in ours.named_parameters()}
    for layer in ours.model.decoder.layers:
        attention = layer.self_attn
        attention.concatenated(("q_proj", "k_proj", "v_proj") if attention.v_proj is not None else ("q_proj", "k_proj"))
        layer.mlp.concatenated(("gate_proj", "up_proj"))
    replaced = {
        before[name]: parameter for name, parameter in ours.named_parameters() if parameter.data_ptr() != before[name]
    }
    for module in reference.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            view = replaced.get(parameter.data_ptr())
            if view is not None and view.shape == parameter.shape:
                setattr(module, name, torch.nn.Parameter(view, requires_grad=False))
    shared = {parameter.untyped_storage().data_ptr() for parameter in ours.parameters()}
    apart = [
        name
        for name, parameter in reference.named_parameters(remove_duplicate=False)
        if "vision" not in name and parameter.untyped_storage().data_ptr() not in shared
    ]
    if apart:  # the text weights are built once, shared in place (the vision tower is the reference's alone)
        raise RuntimeError(f"the reference's text weights are not all ours: {apart[:5]}")


def canvas_passes_fused(model, on: bool | None):
    """`model`'s class with `fuse_canvas_passes` set to `on` inside (None: as it is; another model's class)."""
    return contextlib.nullcontext() if on is None else switched(type(model), "fuse_canvas_passes", on)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, prompt, new_tokens: int, steps: int, seed: int, reference: bool) -> dict:
    """One `generate()` call: seconds, decoder forwards per canvas, peak GB and the tokens."""
    device = prompt.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    replays_before = graph_replays(model)
    torch.manual_seed(seed)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, max_denoising_steps=steps, return_dict_in_generate=True)
    sync(device)
    seconds = time.perf_counter() - start
    replayed = graph_replays(model)
    canvases = new_tokens // model.config.canvas_length
    if reference:  # tokens_per_forward (B,): a row's new tokens over its decoder forwards
        forwards = float((new_tokens / out.tokens_per_forward.float()).max())
    else:
        forwards = float(out.nfe)
    batch = prompt.shape[0]
    return dict(
        seconds=seconds,
        tokens_per_s=batch * new_tokens / seconds,
        steps_per_canvas=forwards / canvases,
        ms_per_step=1000 * seconds / forwards,
        peak_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        graph_replays={name: count - replays_before.get(name, 0) for name, count in replayed.items()},
        sequences=out.sequences,
    )


def generate_host_syncs(model, prompt, new_tokens: int, steps: int) -> int | None:
    """Times one `generate()` call made the host wait for the GPU (torch's sync debug mode warns at each; an event
    read, the stop decision's, is not counted); None off CUDA."""
    if prompt.device.type != "cuda":
        return None
    torch.cuda.synchronize(prompt.device)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.generate(prompt, max_new_tokens=new_tokens, max_denoising_steps=steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("called a synchronizing" in str(warning.message) for warning in caught)


def graph_replays(model) -> dict:
    """hf_dllm's CUDA graph replays so far per captured pass (`CacheGraphs.replays`; {} for transformers')."""
    graphs = getattr(model, "_graphs", None)
    return dict(graphs.replays) if graphs is not None else {}


def step_floor_bytes(model, routed: list[int]) -> int:
    """Bytes a decoder step must read: every weight but the experts, the embedding twice (self-conditioning and
    the tied LM head), and `routed[layer]` experts of each layer."""
    decoder = model.model.decoder
    total = 0
    for name, tensor in decoder.named_parameters():
        if ".experts." not in name:
            total += tensor.numel() * tensor.element_size()
    embedding = decoder.embed_tokens.weight
    total += embedding.numel() * embedding.element_size()  # its second read (the LM head)
    for layer, count in zip(decoder.layers, routed, strict=True):
        experts = layer.experts
        per_expert = sum(p[0].numel() * p.element_size() for p in (experts.gate_up_proj, experts.down_proj))
        total += count * per_expert
    return total


def timed_ms(function, repeats: int, device) -> float:
    """Milliseconds per call of `function()` over `repeats` calls back to back (CUDA events on a GPU)."""
    function()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            function()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        function()
    return 1000 * (time.perf_counter() - began) / repeats


def pytorch_sampler_ms(sampler, block, raw, cap: float, repeats: int, device) -> float | None:
    """ms per step of the PyTorch sampler on the capped float32 logits of `raw` (it divides its input in place: a
    fresh copy per call, timed apart and subtracted); None where its float32 copies do not fit (batch 32)."""
    sampler.initial_block(block.shape[0], block.shape[1], device)
    capped = None
    try:
        capped = raw.float().div_(cap).tanh_().mul_(cap)  # what decode() gives it
        step_ms = timed_ms(lambda: sampler.denoise(block, capped.clone(), None, None), repeats, device)
        return step_ms - timed_ms(capped.clone, repeats, device)
    except torch.OutOfMemoryError:
        return None
    finally:
        capped = None  # (the float32 copy freed before the cache is emptied)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def encoder_canvas_pass(model, batch: int, prompt_len: int, repeats: int, device) -> dict:
    """ms per encoder pass over the `prompt_len` prompt of `batch` rows (on an emptied cache with the end column
    given, as generate() runs it: `encoder_prompt_*_ms`) and over an accepted canvas after it, in generate()'s cache
    (static on CUDA), with positions `(B, T)` as generate() gives them: each eager and with its layers replayed from a
    CUDA graph (where `CacheGraphs` applies: captured by the warm-up calls), and on CUDA replayed with the sliding
    layers' attention on Triton (`*_graph_triton_sliding_ms`; `ENCODER_ATTENTION`'s default may differ). Every timed
    pass writes the same columns again (the kernels and their shapes do not depend on what the cache holds)."""
    text, canvas = model.config.text_config, model.config.canvas_length
    generator = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(3, text.vocab_size, (batch, prompt_len + canvas), device=device, generator=generator)
    valid = torch.ones(batch, prompt_len + canvas, dtype=torch.bool, device=device)
    columns = torch.arange(prompt_len, prompt_len + canvas, device=device)
    captured, timings = model.capture_encoder, {}
    with torch.no_grad():
        cache = model._diffusion_new_cache(batch, prompt_len + canvas)
        prompt_columns = torch.arange(prompt_len, device=device)

        def encode_prompt():
            # On an emptied cache, as generate() begins (a pass on a cache holding columns reads them too).
            cache.set_length(0)
            model.encode(tokens[:, :prompt_len], prompt_columns, valid[:, :prompt_len], cache, end=prompt_len)

        def encode():
            model.encode(tokens[:, prompt_len:], columns, valid[:, prompt_len:], cache, columns.expand(batch, -1))

        table = dict(modeling_diffusion_gemma.ENCODER_ATTENTION)
        # Then (CUDA) the captured passes again with the sliding layers' attention on Triton (`ENCODER_ATTENTION`).
        triton_sliding = {
            key: ("triton", tiles) for key, (_, tiles) in table.items() if key[0] == GEMMA_26B_A4B["head_dim"]
        }
        variants = [("eager", False, {}), ("graph", True, {})]
        if device.type == "cuda" and modeling_diffusion_gemma.MOE_KERNELS_AVAILABLE:
            variants.append(("graph_triton_sliding", True, triton_sliding))
        try:
            for mode, capture, entries in variants:
                model.capture_encoder = capture
                modeling_diffusion_gemma.ENCODER_ATTENTION.update(entries)
                if entries:
                    model._graphs = None  # captured graphs keep the kernels they were captured with
                if capture:  # a prompt shape's first pass is only counted (`prompt_graphs`): the next is captured
                    encode_prompt()
                timings[f"encoder_prompt_{mode}_ms"] = timed_ms(encode_prompt, repeats, device)
                timings[f"encoder_canvas_{mode}_ms"] = timed_ms(encode, repeats, device)
                if mode == "graph":
                    timings["encoder_canvas_graph_replays"] = graph_replays(model).get("encoder_layers", 0)
        finally:
            model.capture_encoder = captured
            modeling_diffusion_gemma.ENCODER_ATTENTION.update(table)
            model._graphs = None
    return timings


def isolated_step(model, batch: int, prompt_len: int, repeats: int, device) -> dict:
    """The denoising step alone (decoder + sampler, self-conditioned, the prompt encoded into generate()'s cache:
    static on CUDA): ms per step with the decoder's layers captured (where `CacheGraphs` applies) and eager, and
    the experts its routers selected per layer (counted eagerly: hooks do not run in a graph's replay). Also the
    step's parts, each timed alone: the sampler (fused where it applies, and the PyTorch one) and one layer's
    experts on the canvas' routing under each implementation (torch's grouped GEMM, hf_dllm's Triton kernels)."""
    text, canvas = model.config.text_config, model.config.canvas_length
    generator = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(3, text.vocab_size, (batch, prompt_len), device=device, generator=generator)
    defaults = {k: v for k, v in SAMPLER_DEFAULTS.items() if k not in ("sampler_config", "max_denoising_steps")}

    def new_sampler(fused=None):
        return EntropyBoundSampler(
            text.vocab_size, max_denoising_steps=1 << 20, entropy_bound=0.1, softcap=text.final_logit_softcapping,
            fused=fused, **defaults,
        )  # fmt: skip

    sampler = new_sampler()
    positions = torch.arange(prompt_len, prompt_len + canvas, device=device)
    captured = model.capture_decoder
    with torch.no_grad():
        cache = model._diffusion_new_cache(batch, prompt_len + canvas)
        valid = torch.ones(batch, prompt_len, dtype=torch.bool, device=device)
        model.encode(prompt, torch.arange(prompt_len, device=device), valid, cache)
        block = sampler.initial_block(batch, canvas, device)

        def step(block):
            logits = model.decode(block, positions, cache, padded=False, **sampler.forward_inputs())
            return sampler.denoise(block, logits, None, None)[0]

        model.capture_decoder = False
        block = step(block)  # now self-conditioned
        routed = []

        def record(_module, inputs):  # the experts' (hidden, index, weights): both paths call them, not the router
            routed.append(int(inputs[1].unique().numel()))

        hooks = [layer.experts.register_forward_pre_hook(record) for layer in model.model.decoder.layers]
        experts_inputs = []
        hooks.append(
            model.model.decoder.layers[0].experts.register_forward_pre_hook(
                lambda _m, inputs: experts_inputs.append(inputs)
            )
        )
        block = step(block)
        for hook in hooks:
            hook.remove()
        timings = {}
        for mode, capture in (("eager", False), ("graph", True)):
            model.capture_decoder = capture
            block = step(block)  # a graph is captured here
            sync(device)
            timings[mode] = timed_ms(functools.partial(step, block), repeats, device)
        model.capture_decoder = captured
        parts = {}
        attention = model.model.decoder.layers[0].self_attn
        backend = attention.backend
        if device.type == "cuda":  # the step (graphs) with each attention backend set for every layer
            for other in attention.backends:
                try:
                    model.set_decoder_attention(other)
                    block = step(block)
                    parts[f"graph_step_{other}_attention_ms"] = timed_ms(
                        functools.partial(step, block), repeats, device
                    )
                except Exception as error:  # noqa: BLE001  (reported: a kernel that does not launch here)
                    parts[f"graph_step_{other}_attention_error"] = f"{type(error).__name__}: {error}"[:300]
            model.set_decoder_attention(backend)

            def recaptured_ms(block):
                """(ms of the step captured again with the switches as they are now, the canvas after it)."""
                model._graphs = None  # captured graphs keep the kernels they were captured with
                block = step(block)
                return timed_ms(functools.partial(step, block), repeats, device), block

            # The step (graphs) with one switch turned: the experts' weighted sum launched apart
            # (`triton_moe.combine`), not inside the layer's end kernel; each layer's input norm launched apart; the
            # dense MLP inline, not on a side stream beside the experts, or forked before the routing; the router's
            # product on cuBLAS; the side stream at the main stream's priority instead of high. Then the default's
            # step again, timed after them (the same state of the process).
            layer_class = type(model.model.decoder.layers[0])
            router_class = type(model.model.decoder.layers[0].router)
            for label, owner, switch, value in (
                ("combine_apart", layer_class, "combine_in_end_kernel", False),
                ("next_norm_apart", layer_class, "norm_in_end_kernel", False),
                ("dense_mlp_inline", layer_class, "dense_mlp_beside_experts", False),
                ("dense_mlp_forked_before_routing", layer_class, "dense_mlp_after_routing", False),
                ("router_product_cublas", router_class, "product_in_routing_kernel", False),
                ("side_stream_normal_priority", modeling_diffusion_gemma, "SIDE_STREAM_PRIORITY", 0),
            ):
                with switched(owner, switch, value):
                    parts[f"graph_step_{label}_ms"], block = recaptured_ms(block)
            parts["graph_step_combine_in_end_kernel_ms"], block = recaptured_ms(block)
            # The Triton attention reading the ring's unwritten slots (masked) instead of skipping them, its key
            # chunks a power of two of tiles instead of even ones, its splits merged by a second kernel; each alone,
            # then the default again.
            table = dict(modeling_diffusion_gemma.DECODER_ATTENTION)
            power_of_two = {
                key: (name, dataclasses.replace(tiles, even_splits=False)) for key, (name, tiles) in table.items()
            }
            apart = {key: (name, dataclasses.replace(tiles, fold_merge=False)) for key, (name, tiles) in table.items()}
            for label, skip, tiles in (
                ("ring_gap_read", False, table),
                ("power_of_two_chunks", True, power_of_two),
                ("merge_apart", True, apart),
                ("default", True, table),
            ):
                modeling_diffusion_gemma.SKIP_UNWRITTEN_SLOTS = skip
                modeling_diffusion_gemma.DECODER_ATTENTION.update(tiles)
                parts[f"graph_step_attention_{label}_ms"], block = recaptured_ms(block)
        parts["attention"] = backend or "auto"
        parts["attention_by_layer_kind"] = {
            kind: next(
                layer.self_attn.chosen_backend(block.new_empty(0, dtype=model.dtype))
                for layer, layer_kind in zip(model.model.decoder.layers, text.layer_types, strict=True)
                if layer_kind == kind
            )
            for kind in sorted(set(text.layer_types))
        }
        raw = model.decode(block, positions, cache, padded=False, **sampler.forward_inputs())
        if sampler.uses_fused(device):
            fused_sampler = new_sampler(True)
            fused_sampler.initial_block(batch, canvas, device)
            parts["sampler_fused_ms"] = timed_ms(
                functools.partial(fused_sampler.denoise, block, raw, None, None), repeats, device
            )
        parts["sampler_pytorch_ms"] = pytorch_sampler_ms(
            new_sampler(False), block, raw, text.final_logit_softcapping, repeats, device
        )
        del raw
        experts = model.model.decoder.layers[0].experts
        chosen = experts.implementation
        x, index, weights = experts_inputs[0]
        for implementation in ("grouped", "triton"):
            try:
                experts.implementation = implementation
                parts[f"experts_{implementation}_ms"] = timed_ms(lambda: experts(x, index, weights), repeats, device)
            except (RuntimeError, ValueError) as error:  # not available here (CPU, no Triton, no grouped_mm)
                parts[f"experts_{implementation}_ms"] = None
                parts[f"experts_{implementation}_error"] = str(error).splitlines()[0]
        experts.implementation = chosen
        parts["experts_default"] = experts.chosen_implementation(x)
    graphs = model._graphs is not None and bool(model._graphs.entries)
    return dict(
        step_ms=min(timings.values()),
        eager_step_ms=timings["eager"],
        graph_step_ms=timings["graph"],
        graphs_used=graphs,
        fused_sampler=sampler.fused_active,
        routed=routed,
        **parts,
    )


def goal(value, target: float, better: str) -> dict:
    met = None if value is None else (value >= target if better == "higher" else value <= target)
    return dict(value=None if value is None else round(value, 3), target=target, met=met)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny float32 shape on the CPU (default without a GPU)")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the shape's)")
    parser.add_argument("--batch-sizes", default=None, help="comma list (GPU default 1,8,32; CPU 1,2)")
    parser.add_argument("--steps", default=None, help="comma list of max_denoising_steps (GPU 16,48; CPU 4)")
    parser.add_argument("--reference-batch-sizes", default=None, help="batches transformers runs (GPU 1,8; CPU all)")
    parser.add_argument("--no-reference", action="store_true", help="hf_dllm only")
    parser.add_argument("--prompt-len", type=int, default=None, help="GPU 512, CPU 16")
    parser.add_argument("--new-tokens", type=int, default=None, help="GPU 512, CPU 32 (whole canvases)")
    parser.add_argument("--step-repeats", type=int, default=None, help="isolated steps timed (GPU 10, CPU 2)")
    parser.add_argument(
        "--attention",
        choices=("auto", "sdpa", "gemm", "triton"),
        default="auto",
        help="every layer's attention backend (auto: the model's choice per layer)",
    )
    parser.add_argument(
        "--experts", choices=("auto", "triton", "grouped", "loop"), default="auto", help="the experts' kernels"
    )
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    shape = text_fields(GEMMA_26B_A4B if gpu else TINY, args.layers)
    canvas, dtype = (256, torch.bfloat16) if gpu else (16, torch.float32)
    prompt_len = args.prompt_len or (512 if gpu else 16)
    new_tokens = args.new_tokens or (512 if gpu else 32)
    if new_tokens % canvas:
        parser.error(f"--new-tokens must be a multiple of the canvas ({canvas}), got {new_tokens}")
    batch_sizes = [int(b) for b in (args.batch_sizes or ("1,8,32" if gpu else "1,2")).split(",")]
    step_counts = [int(s) for s in (args.steps or ("16,48" if gpu else "4")).split(",")]
    reference_batches = [
        int(b) for b in (args.reference_batch_sizes or ("1,8" if gpu else ",".join(map(str, batch_sizes)))).split(",")
    ]
    repeats = args.step_repeats or (10 if gpu else 2)

    started = time.perf_counter()
    torch.manual_seed(0)
    ours, reference, missing_reason = build_models(shape, canvas, dtype, device, not args.no_reference)
    ours.set_decoder_attention(None if args.attention == "auto" else args.attention)
    for layer in ours.model.decoder.layers:
        layer.experts.implementation = None if args.experts == "auto" else args.experts
    summary = dict(
        benchmark="bench_diffusion_gemma",
        device=torch.cuda.get_device_name(device) if gpu else "CPU",
        torch=torch.__version__,
        dtype=str(dtype),
        shape=dict(shape, canvas_length=canvas),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        build_s=round(time.perf_counter() - started, 1),
        weights_gb=round(sum(p.numel() * p.element_size() for p in ours.parameters()) / 1e9, 2),
        reference=None if reference is None else "transformers DiffusionGemmaForBlockDiffusion.generate()",
        reference_skipped=missing_reason,
        attention=args.attention,
        experts=args.experts,
    )
    if gpu:
        from bench_generate import copy_bandwidth  # this folder's (needs CUDA)

        summary["copy_gb_per_s"] = round(copy_bandwidth(device) / 1e9, 1)
    print(f"# {json.dumps({k: v for k, v in summary.items() if k != 'shape'})}", flush=True)

    vocab = shape["vocab_size"]
    rows, steps_rows = [], []
    for batch in batch_sizes:
        prompt = torch.randint(3, vocab, (batch, prompt_len), device=device)
        # Warm-up (kernels, allocator, our passes' graphs over generate()'s static cache of this shape): every
        # canvas, two steps each.
        run_reference = reference is not None and batch in reference_batches
        # (name, model, canvases' passes fused): on CUDA hf_dllm also with `fuse_canvas_passes` off.
        runs = [("hf_dllm", ours, None), ("transformers", reference if run_reference else None, None)]
        runs += [("hf_dllm apart", ours, False)] if gpu else []
        for name, model, fused in runs:
            try:
                if model is not None:
                    # twice for ours: a prompt shape's pass is captured at its second call (`prompt_graphs`)
                    with canvas_passes_fused(model, fused):
                        for _ in range(1 if name == "transformers" else 2):
                            timed_generate(model, prompt, new_tokens, 2, 0, reference=name == "transformers")
            except torch.OutOfMemoryError:  # the timed rows record it
                torch.cuda.empty_cache()
        for steps in step_counts:
            for name, model, fused in runs:
                if model is None:
                    continue
                try:
                    with canvas_passes_fused(model, fused):
                        result = timed_generate(
                            model, prompt, new_tokens, steps, 1234, reference=name == "transformers"
                        )
                except torch.OutOfMemoryError as error:  # recorded; the other rows still run
                    result = dict(oom=str(error).splitlines()[0], sequences=None, tokens_per_s=None)
                    torch.cuda.empty_cache()
                result.update(model=name, batch=batch, max_denoising_steps=steps)
                rows.append(result)
            if run_reference and not gpu and rows[-1]["sequences"] is not None:  # on the CPU both draw alike
                rows[-2]["tokens_equal_reference"] = bool(torch.equal(rows[-2]["sequences"], rows[-1]["sequences"]))
        try:
            step = isolated_step(ours, batch, prompt_len, repeats, device)
            step.update(encoder_canvas_pass(ours, batch, prompt_len, repeats, device))
            step["generate_host_syncs"] = generate_host_syncs(ours, prompt, new_tokens, step_counts[0])
        except torch.OutOfMemoryError as error:
            torch.cuda.empty_cache()
            steps_rows.append(dict(batch=batch, oom=str(error).splitlines()[0]))
            continue
        if gpu:
            floor_bytes = step_floor_bytes(ours, step["routed"])
            step["floor_ms"] = 1000 * floor_bytes / (summary["copy_gb_per_s"] * 1e9)
            step["over_floor"] = step["step_ms"] / step["floor_ms"]
            step["floor_gb"] = floor_bytes / 1e9
        step["experts_per_layer"] = sum(step.pop("routed")) / shape["num_hidden_layers"]
        step["batch"] = batch
        steps_rows.append(step)

    print(f"\n{'model':>12} {'batch':>5} {'steps':>5} {'tok/s':>9} {'steps/canvas':>12} {'ms/step':>8} {'peak GB':>8}")
    for row in rows:
        if "oom" in row:
            print(f"{row['model']:>12} {row['batch']:5d} {row['max_denoising_steps']:5d} out of memory")
            continue
        peak = f"{row['peak_gb']:8.1f}" if row["peak_gb"] is not None else f"{'-':>8}"
        print(
            f"{row['model']:>12} {row['batch']:5d} {row['max_denoising_steps']:5d} {row['tokens_per_s']:9.1f} "
            f"{row['steps_per_canvas']:12.1f} {row['ms_per_step']:8.2f} {peak}"
        )
    print(f"\n{'batch':>5} {'eager ms':>8} {'graph ms':>8} {'floor ms':>8} {'x floor':>7} {'experts/layer':>13}")
    for step in steps_rows:
        if "oom" in step:
            print(f"{step['batch']:5d} out of memory")
            continue
        floor = f"{step['floor_ms']:8.2f} {step['over_floor']:7.2f}" if "floor_ms" in step else f"{'-':>8} {'-':>7}"
        print(
            f"{step['batch']:5d} {step['eager_step_ms']:8.2f} {step['graph_step_ms']:8.2f} {floor} "
            f"{step['experts_per_layer']:13.1f}"
        )

    def ms(value) -> str:
        return f"{value:9.3f}" if isinstance(value, float) else f"{'-':>9}"

    print(
        f"\n{'batch':>5} {'sampler ms: fused':>17} {'pytorch':>9} {'1 layer experts ms: grouped':>27} {'triton':>9} default"
    )
    for step in steps_rows:
        if "oom" not in step:
            print(
                f"{step['batch']:5d} {ms(step.get('sampler_fused_ms')):>17} {ms(step.get('sampler_pytorch_ms'))} "
                f"{ms(step.get('experts_grouped_ms')):>27} {ms(step.get('experts_triton_ms'))} {step['experts_default']}"
            )
            print(
                f"      encoder pass over the prompt: eager {step['encoder_prompt_eager_ms']:.2f} ms, graph "
                f"{step['encoder_prompt_graph_ms']:.2f} ms; over a canvas: eager "
                f"{step['encoder_canvas_eager_ms']:.2f} ms, graph {step['encoder_canvas_graph_ms']:.2f} ms "
                f"({step['encoder_canvas_graph_replays']} replays); host syncs in a generate() call "
                f"({step_counts[0]} steps): {step['generate_host_syncs']}"
            )
            if "encoder_canvas_graph_triton_sliding_ms" in step:
                print(
                    f"      encoder passes with the sliding layers' attention on Triton (graph): prompt "
                    f"{step['encoder_prompt_graph_triton_sliding_ms']:.2f} ms, canvas "
                    f"{step['encoder_canvas_graph_triton_sliding_ms']:.2f} ms"
                )
            if "graph_step_combine_apart_ms" in step:
                print(
                    f"      graph step with the experts' combine launched apart: {step['graph_step_combine_apart_ms']:.2f}"
                    f" ms, inside the layer's end kernel (default) {step['graph_step_combine_in_end_kernel_ms']:.2f} ms;"
                    f" each layer's input norm launched apart: {step['graph_step_next_norm_apart_ms']:.2f} ms;"
                    f" the dense MLP inline (not on a side stream beside the experts): "
                    f"{step['graph_step_dense_mlp_inline_ms']:.2f} ms; forked before the routing: "
                    f"{step['graph_step_dense_mlp_forked_before_routing_ms']:.2f} ms; its stream at normal priority: "
                    f"{step['graph_step_side_stream_normal_priority_ms']:.2f} ms; the router's product on cuBLAS: "
                    f"{step['graph_step_router_product_cublas_ms']:.2f} ms"
                )
            if "graph_step_attention_default_ms" in step:
                print(
                    f"      graph step with the ring's empty slots read: {step['graph_step_attention_ring_gap_read_ms']:.2f}"
                    f" ms, with power-of-two key chunks: {step['graph_step_attention_power_of_two_chunks_ms']:.2f} ms,"
                    f" with the splits merged by a second kernel: {step['graph_step_attention_merge_apart_ms']:.2f} ms,"
                    f" default: {step['graph_step_attention_default_ms']:.2f} ms"
                )
            for name in ("sdpa", "gemm", "triton"):
                if f"graph_step_{name}_attention_ms" in step:
                    print(
                        f"      graph step with every layer's attention on {name}: "
                        f"{step[f'graph_step_{name}_attention_ms']:.2f} ms"
                    )

    def row_of(model, batch, steps):
        return next(
            (r for r in rows if (r["model"], r["batch"], r["max_denoising_steps"]) == (model, batch, steps)), None
        )

    goals, apart_speedups = {}, {}
    for steps in step_counts:
        theirs = row_of("transformers", 1, steps)
        for name, mine in (
            ("hf_dllm", row_of("hf_dllm", 1, steps)),
            ("hf_dllm apart", row_of("hf_dllm apart", 1, steps)),
        ):
            ok = mine and theirs and mine.get("tokens_per_s") and theirs["tokens_per_s"]
            speedup = mine["tokens_per_s"] / theirs["tokens_per_s"] if ok else None
            if name == "hf_dllm":
                goals[f"batch1_speedup_steps{steps}"] = goal(speedup, 5.0, "higher")
            elif speedup is not None:  # the default's goal; the passes apart beside it
                apart_speedups[f"batch1_speedup_steps{steps}"] = round(speedup, 3)
    one = next((s for s in steps_rows if s["batch"] == 1), None)
    goals["batch1_step_over_floor"] = goal(one.get("over_floor") if one else None, 1.3, "lower")
    rows32 = [r for r in rows if r["model"] == "hf_dllm" and r["batch"] == 32]
    peak32 = [r["peak_gb"] for r in rows32 if r.get("peak_gb") is not None]
    goals["batch32_peak_gb"] = goal(max(peak32) if peak32 else None, 80.0, "lower")
    if any("oom" in r for r in rows32):
        goals["batch32_peak_gb"].update(value="out of memory", met=False)
    for row in rows:
        row.pop("sequences")
        for key, value in list(row.items()):
            if isinstance(value, float):
                row[key] = round(value, 3)
    for step in steps_rows:
        for key, value in list(step.items()):
            if isinstance(value, float):
                step[key] = round(value, 3)
    summary.update(rows=rows, steps=steps_rows, goals=goals, canvas_passes_apart=apart_speedups)
    summary["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
