"""One DiffusionGemma denoising step run twice on the same inputs and the same injected random draws: by hf_dllm
(`DiffusionGemmaForBlockDiffusion.encode` / `decode` and `EntropyBoundSampler.denoise`, what the block loop calls)
and by transformers (its own `DiffusionGemmaGenerationMixin._denoising_step`, driven with its own encoder, decoder
mask, `EntropyBoundSampler`, temperature processor and `StableAndConfidentStoppingCriteria`). Used by the per-step
parity tests (CPU float32: exact; CUDA bfloat16: within transformers' own bf16 error, decisions exact away from
their boundaries).

A step's draws are one `multinomial` over `(B * C, vocab)` and one `randint((B, C))` (the renoise): `InjectedDraws`
replaces both for the duration of a step, the multinomial by inverse-CDF sampling at given uniforms, the renoise by
tokens at or above the vocabulary size (so that the next canvas itself tells which positions were accepted).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import pytest
import torch


def inverse_cdf(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`(rows, vocab)` probabilities, `(rows,)` uniforms in [0, 1) -> `(rows,)` the first index whose cumulative
    probability (float64, normalised) exceeds the uniform."""
    cdf = probabilities.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    return (cdf <= uniforms.double()[:, None]).sum(-1).clamp(max=probabilities.shape[-1] - 1)


class InjectedDraws:
    """Within `with`, `torch.multinomial(p, 1)` samples by `inverse_cdf` at the next rows of `uniforms` `(B * C,)`
    and `torch.randint(0, vocab, (B, C))` returns `noise` `(B, C)`; leaving checks that exactly one renoise and all
    uniforms were consumed (a step that draws another way fails here, not silently)."""

    def __init__(self, uniforms: torch.Tensor, noise: torch.Tensor, vocab_size: int):
        self.uniforms, self.noise, self.vocab_size = uniforms, noise, vocab_size

    def _multinomial(self, probabilities, num_samples, replacement=False, *, generator=None, out=None):
        if num_samples != 1 or probabilities.dim() != 2 or probabilities.shape[-1] != self.vocab_size:
            raise AssertionError(f"unexpected multinomial draw: {tuple(probabilities.shape)}, {num_samples}")
        rows = probabilities.shape[0]
        uniforms = self.uniforms[self.used : self.used + rows].to(probabilities.device)
        self.used += rows
        return inverse_cdf(probabilities, uniforms)[:, None]

    def _randint(self, *args, device=None, **kwargs):
        named = [name for name in ("low", "high", "size") if name in kwargs]
        three = len(args) + len(named) == 3
        params = dict(zip(("low", "high", "size") if three else ("high", "size"), args, strict=False))
        params.update({name: kwargs[name] for name in named})
        low, high, size = params.get("low", 0), params["high"], params["size"]
        if (low, high) != (0, self.vocab_size) or tuple(size) != tuple(self.noise.shape):
            raise AssertionError(f"unexpected randint draw: [{low}, {high}) {tuple(size)}")
        self.renoises += 1
        return self.noise.to(device if device is not None else self.noise.device)

    def __enter__(self):
        self.used, self.renoises = 0, 0
        self._saved = torch.multinomial, torch.randint
        torch.multinomial, torch.randint = self._multinomial, self._randint
        return self

    def __exit__(self, *exc):
        torch.multinomial, torch.randint = self._saved
        if exc[0] is None and (self.used != self.uniforms.numel() or self.renoises != 1):
            raise AssertionError(
                f"the step drew {self.used} of {self.uniforms.numel()} injected uniforms and {self.renoises} renoise "
                "canvases (expected all and one): it samples another way than torch.multinomial / torch.randint."
            )
        return False


@dataclass
class StepInputs:
    """What a denoising step depends on. prompt `(B, T)` left-padded per `attention_mask` `(B, T)` (None: no
    padding); canvas `(B, C)`; self_conditioning `(B, C, V)` float32 (None: a canvas' first step); steps_left n of
    `max_denoising_steps` N; finished `(B,)` rows already stable and confident (frozen); previous_argmax `(B, C)`;
    history `(stability_threshold, B, C)` the stopping rule's argmax history (None: empty); uniforms `(B * C,)` and
    noise `(B, C)` the step's injected draws; `settings` the sampler's generation fields."""

    prompt: torch.Tensor
    attention_mask: torch.Tensor | None
    canvas: torch.Tensor
    self_conditioning: torch.Tensor | None
    steps_left: int
    finished: torch.Tensor
    previous_argmax: torch.Tensor
    history: torch.Tensor | None
    uniforms: torch.Tensor
    noise: torch.Tensor
    settings: dict

    def to(self, device) -> StepInputs:
        return replace(self, **{k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)})


@dataclass
class StepResult:
    """A step's outputs: raw decoder logits and processed (tempered) logits `(B, C, V)` float32; the sample's
    argmax `(B, C)`; the next canvas `(B, C)`; accepted `(B, C)` (next canvas below the vocabulary: not renoised,
    frozen rows count as accepted); finished `(B,)`."""

    logits: torch.Tensor
    processed: torch.Tensor
    argmax: torch.Tensor
    canvas: torch.Tensor
    accepted: torch.Tensor
    finished: torch.Tensor


def make_inputs(prompt, attention_mask, vocab_size, canvas_length, settings, steps_left, seed, finished=None):
    """Random step inputs (seeded): a canvas, self-conditioning logits (bfloat16-representable, so that both
    implementations read the same values whatever their dtype; none at the first step), the previous argmax as the
    history (so stability can fire), uniforms and renoise tokens `vocab_size + position`."""
    generator = torch.Generator().manual_seed(seed)
    batch = prompt.shape[0]
    first = steps_left == settings["max_denoising_steps"]
    canvas = torch.randint(0, vocab_size, (batch, canvas_length), generator=generator)
    self_conditioning = None
    if not first:
        self_conditioning = (3 * torch.randn(batch, canvas_length, vocab_size, generator=generator)).bfloat16().float()
    argmax = torch.randint(0, vocab_size, (batch, canvas_length), generator=generator)
    stability = settings.get("stability_threshold") or 0
    history = None if first or not stability else argmax[None].repeat(stability, 1, 1)
    return StepInputs(
        prompt=prompt,
        attention_mask=attention_mask,
        canvas=canvas,
        self_conditioning=self_conditioning,
        steps_left=steps_left,
        finished=finished if finished is not None else torch.zeros(batch, dtype=torch.bool),
        previous_argmax=argmax,
        history=history,
        uniforms=torch.rand(batch * canvas_length, generator=generator),
        noise=vocab_size + torch.arange(canvas_length).expand(batch, -1).contiguous(),
        settings=settings,
    )


def next_step_inputs(inputs: StepInputs, result: StepResult, seed: int) -> StepInputs:
    """The inputs of the step after `inputs`, from its outcome `result`: the next canvas (renoised positions, above
    the vocabulary, mapped into it), the processed logits as self-conditioning, the argmax as previous argmax and
    history, the finished rows, one step fewer left, fresh draws."""
    vocab = result.logits.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    canvas = torch.where(result.canvas >= vocab, (result.canvas * 7) % vocab, result.canvas)
    stability = inputs.settings.get("stability_threshold") or 0
    return replace(
        inputs,
        canvas=canvas,
        self_conditioning=result.processed.bfloat16().float(),
        steps_left=inputs.steps_left - 1,
        finished=result.finished.clone(),
        previous_argmax=result.argmax,
        history=result.argmax[None].repeat(stability, 1, 1) if stability else None,
        uniforms=torch.rand(inputs.uniforms.shape, generator=generator).to(inputs.uniforms.device),
    )


def _result(logits, processed, argmax, canvas, finished, vocab_size) -> StepResult:
    return StepResult(logits.float(), processed.float(), argmax, canvas, canvas < vocab_size, finished)


@torch.no_grad()
def hf_dllm_step(model, inputs: StepInputs, sampler_class=None) -> StepResult:
    """The step as hf_dllm's loop runs it: the family's sampler (or the subclass `sampler_class` of it, same
    settings; its state set to the inputs'), the prompt encoded
    into the model's own cache for generation (`_diffusion_new_cache`: static on CUDA), the decoder pass
    (`decode`, CUDA graphs where they apply), `EntropyBoundSampler.denoise` under the injected draws."""
    config = model.resolve_generation_config(max_new_tokens=model.config.canvas_length, **inputs.settings)
    sampler = model.diffusion_family.unmasking_policy(config, model.config)
    if sampler_class is not None:
        sampler.__class__ = sampler_class
    sampler.fused = False  # the injected draws replace torch's; the fused sampler draws from its own uniforms
    batch, width = inputs.prompt.shape
    canvas_length = inputs.canvas.shape[1]
    device = inputs.prompt.device
    sampler.initial_block(batch, canvas_length, device)  # the per-canvas reset (its draw is discarded)
    sampler.step_index = config.max_denoising_steps - inputs.steps_left
    first = inputs.steps_left == config.max_denoising_steps
    sampler.self_conditioning = inputs.self_conditioning
    sampler.argmax = None if first else inputs.previous_argmax
    sampler.finished = inputs.finished.clone()
    sampler.history = None if inputs.history is None else inputs.history.clone()
    cache = model._diffusion_new_cache(batch, width + canvas_length)
    valid = (
        inputs.attention_mask.bool()
        if inputs.attention_mask is not None
        else torch.ones(batch, width, dtype=torch.bool, device=device)
    )
    model.encode(inputs.prompt, torch.arange(width, device=device), valid, cache)
    positions = torch.arange(width, width + canvas_length, device=device)
    logits = model.decode(
        inputs.canvas,
        positions,
        cache,
        sampler.forward_inputs()["self_conditioning_logits"],
        padded=inputs.attention_mask is not None,
    )
    vocab = model.config.text_config.vocab_size
    with InjectedDraws(inputs.uniforms, inputs.noise, vocab):
        canvas, argmax, _ = sampler.denoise(inputs.canvas, logits.clone(), None, None)
    processed = logits
    if config.t_min is not None and config.t_max is not None:
        processed = logits / sampler.temperature(inputs.steps_left).to(device)
    return _result(logits, processed, argmax, canvas, sampler.finished, vocab)


@torch.no_grad()
def skip_unless_reference_step_runs() -> None:
    """Skip (saying why) where transformers' private generation helpers are not the ones `transformers_step` drives:
    5.24's (5.17 named the cache `past_key_values` and stopped by other criteria; its public `generate()` is the
    same algorithm, which the fixture tests check)."""
    generation = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    mixin = generation.DiffusionGemmaGenerationMixin
    if "cache" not in inspect.signature(mixin._prepare_encoder_inputs).parameters:
        import transformers

        pytest.skip(
            f"the reference step drives transformers 5.24's private step helpers, not {transformers.__version__}'s"
        )


def transformers_step(model, inputs: StepInputs) -> StepResult:
    """The step as transformers' `generate()` runs it, on transformers' `DiffusionGemmaForBlockDiffusion` `model`:
    its cache, encoder pass and decoder mask for the prompt, then its `_denoising_step` with its own sampler,
    temperature processor and stopping rule (history set to the inputs') under the injected draws."""
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as reference

    settings = dict(inputs.settings)
    if "sampler_config" in settings:
        settings["sampler_config"] = reference.EntropyBoundSamplerConfig(
            entropy_bound=float(settings["sampler_config"]["entropy_bound"])
        )
    config, _ = model._prepare_generation_config(None, **settings)
    batch, width = inputs.prompt.shape
    canvas_length = inputs.canvas.shape[1]
    device = inputs.prompt.device
    attention_mask = (
        inputs.attention_mask.bool()
        if inputs.attention_mask is not None
        else torch.ones(batch, width, dtype=torch.bool, device=device)
    )
    cache = model._prepare_cache_for_generation(config, batch, width + canvas_length)
    encoder_positions = torch.arange(width, dtype=torch.int32, device=device)[None]
    encoder_ids, encoder_masks = model._prepare_encoder_inputs(
        input_ids=inputs.prompt,
        attention_mask=attention_mask,
        encoder_position_ids=encoder_positions,
        cache=cache,
        is_prefill=True,
        canvas_length=canvas_length,
        batch_size=batch,
    )
    cache = model.model.encoder(
        input_ids=encoder_ids, attention_mask=encoder_masks, cache=cache, position_ids=encoder_positions
    ).cache
    decoder_attention_mask = torch.nn.functional.pad(attention_mask, (0, canvas_length), value=True)
    mask_mapping = model.model.decoder.create_diffusion_decoder_attention_mask(
        config=model.config,
        inputs_embeds=inputs.canvas.unsqueeze(-1),
        cache=cache,
        decoder_attention_mask=decoder_attention_mask,
    )
    sampler = model._prepare_sampler(config)
    stopping = model._prepare_diffusion_stopping_criteria(config)
    if stopping is not None and inputs.history is not None:
        stopping.argmax_canvas_history = inputs.history.clone()
    processors = model._prepare_logits_processor(config)
    seen = {}

    def decoder_forward(**kwargs):
        output = model.forward(**kwargs)
        seen["logits"] = output.logits.clone()
        return output

    def logits_processor(input_ids, scores, **kwargs):
        seen["processed"] = processors(input_ids, scores, **kwargs)
        return seen["processed"]

    first = inputs.steps_left == config.max_denoising_steps
    self_conditioning = inputs.self_conditioning
    if self_conditioning is not None:  # its loop hands the step its logits in the embeddings' dtype
        self_conditioning = self_conditioning.to(model.model.decoder.embed_tokens.weight.dtype)
    with InjectedDraws(inputs.uniforms, inputs.noise, model.config.text_config.vocab_size):
        canvas, argmax, _, finished = model._denoising_step(
            decoder_forward=decoder_forward,
            current_canvas=inputs.canvas,
            argmax_canvas=inputs.canvas if first else inputs.previous_argmax,
            input_ids=inputs.prompt,
            decoder_position_ids=torch.arange(width, width + canvas_length, dtype=torch.int32, device=device)[None],
            self_conditioning_logits=self_conditioning,
            mask_mapping=mask_mapping,
            cache=cache,
            finished_denoising=inputs.finished.clone(),
            cur_step=inputs.steps_left,
            sampler=sampler,
            logits_processor=logits_processor,
            diffusion_stopping_criteria=stopping,
        )
    vocab = model.config.text_config.vocab_size
    return _result(seen["logits"], seen["processed"], argmax, canvas, finished, vocab)


def token_entropy(processed: torch.Tensor) -> torch.Tensor:
    return torch.distributions.Categorical(logits=processed.double()).entropy()


def fragile_positions(reference: StepResult, inputs: StepInputs, logit_tol) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a change of the processed logits by at most `logit_tol` (a number, or `(B, C)` per position) could
    change a decision of the step, judged on
    `reference`: `(B, C)` positions whose argmax, sample (its uniform within the CDF's possible error of a bin
    edge) or acceptance (the entropy-bound sum within the entropies' possible error of the bound, or two entropies
    that could swap across it) is near a boundary, and `(B,)` rows whose stop (mean entropy vs
    `confidence_threshold`, or any fragile argmax) is. A logit error of at most d scales each probability by at
    most e^(2d) (so moves a normalised CDF by at most e^(2d) - 1) and an entropy by at most d * sum_i p_i |log p_i +
    H| (to first order; taken x 1.5)."""
    processed = reference.processed.double()
    batch, length, vocab = processed.shape
    logit_tol = torch.as_tensor(logit_tol, dtype=torch.float64, device=processed.device).expand(batch, length)
    top = processed.topk(2, dim=-1).values
    fragile = (top[..., 0] - top[..., 1]) <= 2 * logit_tol
    probabilities = processed.softmax(-1).view(-1, vocab)
    cdf = probabilities.cumsum(-1)
    cdf_error = torch.expm1(2 * logit_tol).reshape(-1, 1)
    uniforms = inputs.uniforms.to(cdf.device).double()[:, None]
    fragile |= ((cdf - uniforms).abs() <= cdf_error).any(-1).view(batch, length)
    entropy = token_entropy(processed)
    # First order (x 1.5): dH/dz_i = -p_i (log p_i + H), so |dH| <= max|dz| * sum_i p_i |log p_i + H|.
    log_p = processed.log_softmax(-1)
    entropy_error = 1.5 * logit_tol * (log_p.exp() * (log_p + entropy[..., None]).abs()).sum(-1)
    bound = inputs.settings["sampler_config"]["entropy_bound"]
    sorted_entropy, order = torch.sort(entropy, dim=-1)
    sorted_error = entropy_error.gather(1, order)
    below = sorted_entropy.cumsum(-1) - sorted_entropy
    near_bound = (below - bound).abs() <= sorted_error.cumsum(-1) - sorted_error
    accepted = below <= bound
    # Two neighbours on either side of the accepted set's edge that could swap order.
    edge = accepted[:, :-1] & ~accepted[:, 1:]
    swap = edge & ((sorted_entropy[:, 1:] - sorted_entropy[:, :-1]) <= sorted_error[:, 1:] + sorted_error[:, :-1])
    swap = torch.cat([swap, torch.zeros_like(swap[:, :1])], 1) | torch.cat([torch.zeros_like(swap[:, :1]), swap], 1)
    fragile |= torch.zeros_like(fragile).scatter(1, order, near_bound | swap)
    rows = fragile.any(-1)
    threshold = inputs.settings.get("confidence_threshold")
    if threshold is not None:
        rows |= (entropy.mean(-1) - threshold).abs() <= entropy_error.mean(-1)
    # Rows finished before the step are frozen: nothing of theirs is decided.
    fragile &= ~inputs.finished.to(fragile.device)[:, None]
    return fragile, rows & ~inputs.finished.to(rows.device)


def compare_decisions(ours: StepResult, reference: StepResult, fragile: torch.Tensor, fragile_rows: torch.Tensor):
    """Mismatches of argmax, next canvas and accepted set `(B, C)` and of the finished flags `(B,)` at positions /
    rows NOT marked fragile (must be none), and the number of fragile positions and rows."""
    mismatch = (ours.argmax != reference.argmax) | (ours.canvas != reference.canvas)
    mismatch |= ours.accepted != reference.accepted
    row_mismatch = ours.finished != reference.finished
    return {
        "position_mismatches": int((mismatch & ~fragile).sum()),
        "row_mismatches": int((row_mismatch & ~fragile_rows).sum()),
        "mismatches_at_fragile": int((mismatch & fragile).sum()),
        "fragile_positions": int(fragile.sum()),
        "fragile_rows": int(fragile_rows.sum()),
        "positions": int(fragile.numel()),
    }


def decision_mismatches(a: StepResult, b: StepResult) -> int:
    """Positions where two runs of a step decide differently (argmax, next canvas or accepted set)."""
    return int(((a.argmax != b.argmax) | (a.canvas != b.canvas) | (a.accepted != b.accepted)).sum())


def bf16_step_report(ours, transformers_bf16, transformers_fp32, cases) -> dict:
    """Per-step parity in low precision over `cases` (`StepInputs`, on the models' device): per position (the max
    over the vocabulary) the logit error of ours and of transformers' own low-precision step against transformers'
    float32 step; decisions of ours against transformers' low-precision step, at positions whose actual logit
    difference cannot reach a decision boundary (`fragile_positions`) and overall; and transformers' own decision
    changes from float32 to low precision (the noise floor ours is held to)."""
    ours_error, reference_error = [], []
    totals = {
        "position_mismatches": 0,
        "row_mismatches": 0,
        "mismatches_at_fragile": 0,
        "fragile_positions": 0,
        "fragile_rows": 0,
        "positions": 0,
        "ours_vs_bf16": 0,
        "bf16_vs_fp32": 0,
    }
    for inputs in cases:
        a = hf_dllm_step(ours, inputs)
        b = transformers_step(transformers_bf16, inputs)
        c = transformers_step(transformers_fp32, inputs)
        ours_error.append((a.logits - c.logits).abs().amax(-1).flatten().cpu())
        reference_error.append((b.logits - c.logits).abs().amax(-1).flatten().cpu())
        difference = (a.processed - b.processed).abs().amax(-1)
        fragile, rows = fragile_positions(b, inputs, difference)
        for key, value in compare_decisions(a, b, fragile, rows).items():
            totals[key] += value
        totals["ours_vs_bf16"] += decision_mismatches(a, b)
        totals["bf16_vs_fp32"] += decision_mismatches(b, c)
    ours_error, reference_error = torch.cat(ours_error), torch.cat(reference_error)
    quantiles = torch.tensor([0.5, 0.9])
    totals.update(
        ours_logit_error_mean=float(ours_error.mean()),
        transformers_logit_error_mean=float(reference_error.mean()),
        ours_logit_error_q50_q90=ours_error.quantile(quantiles).tolist(),
        transformers_logit_error_q50_q90=reference_error.quantile(quantiles).tolist(),
    )
    return totals
