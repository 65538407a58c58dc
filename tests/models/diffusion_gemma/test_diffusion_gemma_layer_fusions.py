"""DiffusionGemma's decoder layer in fewer kernels:

- the key masks built once per decoder pass and layer kind (equal to every layer's own, whose cache validity is the
  same across a kind), additive for SDPA;
- on the fused path (Triton's interpreter, `HF_DLLM_KERNELS=triton`, a subprocess beside the in-process tests),
  float32: q/k/v and gate/up as one product each (the parameters views of the concatenation, `state_dict`
  unchanged), the router's norm with its scales folded in and the per-expert scale inside `triton_moe.route`, the
  four norms after the attention in one kernel and the three at the end with the layer scalar (and the experts'
  weighted sum: no combine launched apart, bit for bit `triton_moe.combine`'s) in another: a tiny model's logits
  equal the PyTorch path's within float32 rounding, the same experts chosen;
- the dense MLP on a side stream beside the router and experts (`dense_mlp_beside_experts`): only on CUDA for an
  unwrapped MLP, and (GPU) the same logits as inline, eager and replayed.
"""

from __future__ import annotations

import functools
import textwrap

import pytest
import torch

import hf_dllm
from hf_dllm import kernels
from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaStaticCache, decoder_key_mask
from hf_dllm.triton_ops import TRITON_AVAILABLE
from tests.conftest import interpreter_job


@pytest.mark.parametrize("static", [False, True])
def test_key_masks_built_once_per_kind_equal_every_layers_mask(gemma, static):
    """Two encoder passes of a left-padded batch (21 then 2 columns: the sliding window of 8 wraps its ring) leave
    every sliding layer with the same cache validity, and the full layer(s) too; the mask of a kind's first layer
    is every layer's, and its additive form is 0 where a key is visible, -inf where not, its rows 16-aligned."""
    text = gemma.config.text_config
    cache = DiffusionGemmaStaticCache(text, 64, gemma.config.canvas_length) if static else gemma.new_encoder_cache()
    valid = torch.ones(2, 21, dtype=torch.bool)
    valid[0, :18] = False  # row 0 left-padded into the sliding layers' window
    tokens = torch.randint(3, text.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gemma.encode(tokens, torch.arange(21), valid, cache)
        gemma.encode(tokens[:, :2], torch.arange(21, 23), torch.ones(2, 2, dtype=torch.bool), cache)
    x = torch.zeros(2, gemma.config.canvas_length, text.hidden_size)
    kinds = sorted(set(text.layer_types))
    assert kinds == ["full_attention", "sliding_attention"]
    for kind in kinds:
        layers = [index for index, layer_kind in enumerate(text.layer_types) if layer_kind == kind]
        first = layers[0]
        shared = decoder_key_mask(cache, first, x, True, additive=False)
        additive = decoder_key_mask(cache, first, x, True, additive=True)
        assert shared.dtype == torch.bool and shared.shape == (2, 1, 1, cache.valid[first].shape[1] + x.shape[1])
        assert shared[0].sum() < shared[1].sum()  # row 0's padding is hidden
        assert bool(shared[..., -x.shape[1] :].all())  # the canvas' own keys are seen
        assert additive.dtype == x.dtype and torch.equal(additive == 0, shared)
        assert all(stride % 16 == 0 for stride in additive.stride()[:-1])  # SDPA takes it without a padded copy
        assert bool((additive[~shared] == float("-inf")).all())
        for index in layers:
            assert torch.equal(cache.valid[index], cache.valid[first]), (kind, index)
            assert torch.equal(cache.decoder_mask(index, x[..., 0], True), shared), (kind, index)
    if not static:  # the dynamic cache without padding: no mask at all
        assert decoder_key_mask(cache, 0, x, False, additive=True) is None


def test_experts_hand_pairs_back_only_unwrapped_on_the_triton_kernels(gemma):
    """`combine=False` hands back the pairs' outputs for the layer's end kernel to sum: refused, naming the
    implementation, where the experts run as a loop (nothing to hand back). The layer asks for it only where nothing
    else reads the module's summed output: not with a forward hook, nor with `forward` wrapped on the instance (as
    tensor and expert parallelism wrap it, to all-reduce the sum), nor under the PyTorch kernels."""
    experts = gemma.model.decoder.layers[0].experts
    hidden = torch.randn(3, gemma.config.text_config.hidden_size)
    index = torch.zeros(3, gemma.config.text_config.top_k_experts, dtype=torch.long)
    with pytest.raises(ValueError, match="combine=False.*'loop'"):
        experts(hidden, index, torch.ones(index.shape), combine=False)
    if not TRITON_AVAILABLE:
        return
    before = kernels.kernel_mode()
    try:
        kernels.set_kernel_mode("triton")
        with torch.no_grad():  # (with autograd recording, the experts never take the Triton kernels)
            assert experts.hands_pairs_back(hidden)
            handle = experts.register_forward_hook(lambda module, args, output: None)
            assert not experts.hands_pairs_back(hidden)
            handle.remove()
            experts.forward = functools.partial(type(experts).forward, experts)
            assert not experts.hands_pairs_back(hidden)
            del experts.forward
            assert experts.hands_pairs_back(hidden)
            kernels.set_kernel_mode("torch")
            assert not experts.hands_pairs_back(hidden)
    finally:
        kernels.set_kernel_mode(before)


def test_returns_its_forward_only_where_nothing_reads_or_replaces_the_output(monkeypatch):
    """`kernels.returns_its_forward`, which the experts' pair hand-back and the MLP's side stream ask: False with a
    forward hook (its own or every module's), accelerate's `_hf_hook`, `forward` replaced on the instance or a
    sharded parameter; a pre-hook (it sees only the inputs) leaves it True."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    layer = torch.nn.Linear(4, 4)
    assert kernels.returns_its_forward(layer)
    handle = layer.register_forward_pre_hook(lambda *args: None)
    assert kernels.returns_its_forward(layer)
    assert not kernels.returns_its_forward(layer, allow_pre_hooks=False)
    handle.remove()
    handle = register_module_forward_pre_hook(lambda *args: None)  # every module's pre-hook
    assert kernels.returns_its_forward(layer) and not kernels.returns_its_forward(layer, allow_pre_hooks=False)
    handle.remove()
    for register in (layer.register_forward_hook, register_module_forward_hook):
        handle = register(lambda *args: None)
        assert not kernels.returns_its_forward(layer)
        handle.remove()
    layer._hf_hook = object()
    assert not kernels.returns_its_forward(layer)
    del layer._hf_hook
    layer.forward = functools.partial(torch.nn.Linear.forward, layer)
    assert not kernels.returns_its_forward(layer)
    del layer.forward
    monkeypatch.setattr(kernels, "is_sharded", lambda tensor: tensor is layer.bias)
    assert not kernels.returns_its_forward(layer)
    monkeypatch.undo()
    assert kernels.returns_its_forward(layer)
    # A submodule's output read or replaced (a tensor-parallel hook on a projection whose weight is a plain tensor).
    block = torch.nn.Sequential(layer, torch.nn.ReLU())
    assert kernels.returns_its_forward(block)
    handle = layer.register_forward_hook(lambda *args: None)
    assert not kernels.returns_its_forward(block)
    handle.remove()
    layer.forward = functools.partial(torch.nn.Linear.forward, layer)
    assert not kernels.returns_its_forward(block)
    del layer.forward
    assert kernels.returns_its_forward(block)


FUSED_SCRIPT = textwrap.dedent(
    """
    import torch, hf_dllm
    from hf_dllm import kernels, triton_diffusion_gemma, triton_moe
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion, DiffusionGemmaRMSNorm

    layer_ends = []  # the fused layer's last kernel, once per layer that runs its feed-forward
    post_feedforward_norms = triton_diffusion_gemma.post_feedforward_norms
    triton_diffusion_gemma.post_feedforward_norms = lambda *a, **k: (layer_ends.append(1), post_feedforward_norms(*a, **k))[1]
    combines = []  # launches of the experts' combine apart from the layer's end kernel
    norm_calls = []  # launches of the plain norm kernel
    rms_norm = triton_diffusion_gemma.rms_norm
    triton_diffusion_gemma.rms_norm = lambda *a, **k: (norm_calls.append(1), rms_norm(*a, **k))[1]
    decoder_norms = {}
    combine = triton_moe.combine
    triton_moe.combine = lambda *a, **k: (combines.append(1), combine(*a, **k))[1]
    routed_now = []  # each experts call's choices (the fused layer's too call the module: its hooks see them)

    torch.manual_seed(0)
    config = hf_dllm.DiffusionGemmaConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            sliding_window=4, num_experts=6, top_k_experts=2, moe_intermediate_size=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        vision_config=None, canvas_length=8)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    for name, parameter in model.named_parameters():  # norms, router and layer scales that matter
        if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
            parameter.data.normal_(1.0, 0.3)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.normal_(1.0, 0.3)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    layers = model.model.decoder.layers
    prompt, block, signal = torch.randint(0, 64, (2, 7)), torch.randint(0, 64, (2, 8)), torch.randn(2, 8, 64)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[0, :3] = False  # a left-padded row: the decoder's key masks
    chosen, logits = {}, {}
    for mode in ("torch", "triton"):
        kernels.set_kernel_mode(mode)
        routed_now.clear()
        hooks = [layer.experts.register_forward_pre_hook(lambda m, args: routed_now.append(args[1])) for layer in layers]
        with torch.no_grad():
            cache = model.new_encoder_cache()
            model.encode(prompt, torch.arange(7), valid, cache)
            norms_before = len(norm_calls)
            logits[mode] = model.decode(block, torch.arange(7, 15), cache, signal, padded=True)
            decoder_norms[mode] = len(norm_calls) - norms_before
        for hook in hooks:
            hook.remove()
        chosen[mode] = list(routed_now)
        assert len(chosen[mode]) == 5, (mode, len(chosen[mode]))  # the encoder's first two layers, the decoder's three
        assert not combines, ("a combine launched apart", mode)
        concatenated = [len(layer.self_attn._concatenated) + len(layer.mlp._concatenated) for layer in layers]
        assert all(concatenated) == (mode == "triton"), (mode, concatenated)  # the fused path took them
        # The encoder's first two layers and the decoder's three on the two-launch norms.
        assert len(layer_ends) == (5 if mode == "triton" else 0), (mode, len(layer_ends))
    # The decoder's second and third layers' input norms came from their predecessors' end kernels; with the switch
    # off, each layer launches its own (the same logits, bit for bit).
    layer_class = type(layers[0])
    layer_class.norm_in_end_kernel = False
    with torch.no_grad():
        norms_before = len(norm_calls)
        apart = model.decode(block, torch.arange(7, 15), cache, signal, padded=True)
        assert len(norm_calls) - norms_before == decoder_norms["triton"] + 2, (len(norm_calls) - norms_before, decoder_norms)
    layer_class.norm_in_end_kernel = True
    assert torch.equal(apart, logits["triton"]), "the next layer's norm in the end kernel changed the logits"
    difference = (logits["torch"] - logits["triton"]).abs().max()
    assert 0 < difference < 1e-5, ("logits", difference)
    assert all(torch.equal(a, b) for a, b in zip(chosen["torch"], chosen["triton"], strict=True)), "experts"

    # The parameters are views of the concatenations (in order, one storage); state_dict keys and tensors unchanged.
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[name], state[name]) for name in state)
    for layer in layers:
        for module, names in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj") if layer.self_attn.v_proj is not None else ("q_proj", "k_proj")),
            (layer.mlp, ("gate_proj", "up_proj")),
        ):
            fused, _ = module.concatenated(names)
            at = fused.data_ptr()
            for name in names:
                weight = module._modules[name].weight
                assert weight.data_ptr() == at and weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                at += weight.numel() * weight.element_size()
            assert torch.equal(fused, torch.cat([module._modules[name].weight for name in names]))

    # route's per-expert scale: exactly route's weights times the chosen experts' scales; the router's folded norm
    # weight follows an in-place change of `scale`.
    scores, expert_scale = torch.randn(11, 6), torch.rand(6) + 0.5
    index, weights = triton_moe.route(scores, None, 1, 1, 2, "softmax", True, 1.0)
    scaled_index, scaled = triton_moe.route(scores, None, 1, 1, 2, "softmax", True, 1.0, expert_scale=expert_scale)
    assert torch.equal(scaled_index, index) and torch.equal(scaled, weights * expert_scale[index]), "expert_scale"
    router = layers[0].router
    before = router.fused_norm_weight()
    with torch.no_grad():
        router.scale.mul_(2.0)
    assert torch.equal(router.fused_norm_weight(), before * 2), "the folded norm weight follows `scale`"

    # In half precision the router's product goes through `router_partials`, summed in float32 and rounded in
    # `route`'s kernel: the choices and weights of the exact product rounded once; past `product_max_tokens` tokens
    # (or with a hook on the projection) the projection's own product.
    from hf_dllm.modeling_diffusion_gemma import DiffusionGemmaRouter
    calls = []
    partials = triton_moe.router_partials
    triton_moe.router_partials = lambda *a, **k: (calls.append(a[0].shape[0]), partials(*a, **k))[1]
    half = DiffusionGemmaRouter(config.text_config).half()  # (the interpreter has no bfloat16 product)
    torch.nn.init.normal_(half.proj.weight, std=0.5)
    half.per_expert_scale.data.uniform_(0.5, 1.5)
    normed = torch.randn(20, 32).half()
    with torch.no_grad():
        exact = (normed.double() @ half.proj.weight.double().T).half()
        want = triton_moe.route(exact, None, 1, 1, 2, "softmax", True, 1.0, expert_scale=half.per_expert_scale)
        got_weights, got_index = half.route_normed(normed)
        assert calls == [20] and torch.equal(got_index, want[0]), ("router_partials' choices", calls)
        assert (got_weights - want[1]).abs().max() <= 1e-6, "router_partials' weights"
        half.product_max_tokens = 16
        half.route_normed(normed)
        handle = half.proj.register_forward_hook(lambda *args: None)
        half.product_max_tokens = 256
        half.route_normed(normed)
        handle.remove()
        assert calls == [20], calls
    triton_moe.router_partials = partials

    # The norm with the layer scalar folded in, against the PyTorch ops; a scale of another dtype multiplies apart.
    norm = DiffusionGemmaRMSNorm(32)
    norm.weight.data.normal_()
    h, residual, scale = torch.randn(3, 5, 32), torch.randn(3, 5, 32), torch.tensor([0.7])
    with torch.no_grad():
        for s in (scale, scale.double()):
            fused = norm(h, residual=residual, scale=s)
            kernels.set_kernel_mode("torch")
            plain = norm(h, residual=residual, scale=s)
            kernels.set_kernel_mode("triton")
            assert fused.dtype == plain.dtype and (fused - plain).abs().max() < 2e-6, ("norm scale", s.dtype)

    # The experts' weighted sum inside the layer's end kernel: bit for bit `triton_moe.combine`, then the kernel on
    # its output (float32 and bfloat16 activations, 2 and 3 choices); a mis-shaped or mis-typed `experts` refused.
    generator = torch.Generator().manual_seed(3)
    for dtype, top_k in ((torch.float32, 2), (torch.bfloat16, 3)):
        dense, residual = (torch.randn(5, 32, generator=generator).to(dtype) for _ in range(2))
        expert_rows = torch.randn(5 * top_k, 32, generator=generator).to(dtype)
        rows = torch.randperm(5 * top_k, generator=generator).view(5, top_k)
        expert_weight = torch.rand(5, top_k, generator=generator)
        norm_weights = tuple(torch.randn(32, generator=generator).to(dtype) for _ in range(3))
        scale = torch.tensor([0.7]).to(dtype)
        moe = combine(expert_rows, rows, expert_weight, False)
        apart = post_feedforward_norms(dense, moe, residual, norm_weights, 1e-6, scale)
        together = post_feedforward_norms(dense, expert_rows, residual, norm_weights, 1e-6, scale, (rows, expert_weight))
        assert torch.equal(apart, together), ("combine in the end kernel", dtype)
        next_weight = torch.randn(32, generator=generator).to(dtype)
        out, normed = post_feedforward_norms(dense, moe, residual, norm_weights, 1e-6, scale, None, next_weight)
        assert torch.equal(out, apart) and torch.equal(normed, rms_norm(apart, next_weight, 1e-6)), ("next norm", dtype)
    for bad in ((rows[:4], expert_weight[:4]), (rows.float(), expert_weight), (rows, expert_weight.double())):
        try:
            post_feedforward_norms(dense, expert_rows, residual, norm_weights, 1e-6, scale, bad)
        except ValueError as error:
            assert "post_feedforward_norms" in str(error)
        else:
            raise AssertionError(("accepted", [t.dtype for t in bad]))
    print("ok")
    """
)

FUSED_RUN = interpreter_job(
    {"layer": FUSED_SCRIPT}, timeout=300, when=lambda: TRITON_AVAILABLE, HF_DLLM_KERNELS="triton"
)


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="the `triton` extra is not installed")
@FUSED_RUN.used_by
def test_fused_layer_equals_the_pytorch_path_in_the_interpreter():
    done = FUSED_RUN.results()["layer"]
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def _random_model(dtype: torch.dtype):
    """A small random DiffusionGemma (both layer kinds, grouped-query heads, 8 experts) on CUDA, seeded: norms,
    router scales and layer scalars away from 1 so that every fold is exercised, router logits of order 1 (the
    initialisation's are ~0.02: every expert nearly tied); q/k norms ~0.3, so that attention scores (scaling 1) are
    of order 1, not 8 (a softmax that sharp turns bfloat16's rounding into a different output)."""
    config = hf_dllm.DiffusionGemmaConfig(
        text_config=dict(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1, sliding_window=16,
            num_experts=8, top_k_experts=2, moe_intermediate_size=128,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        ),
        vision_config=None,
        canvas_length=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf_dllm.DiffusionGemmaForBlockDiffusion(config).eval()
    for name, parameter in model.named_parameters():
        if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
            parameter.data.normal_(1.0, 0.3)
        if name.endswith(("q_norm.weight", "k_norm.weight")):  # scores of order 1 (attention's scaling is 1)
            parameter.data.normal_(0.3, 0.05)
        if name.endswith("router.proj.weight"):
            parameter.data.normal_(0.0, 1.0)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.normal_(1.0, 0.3)
    return model.to(dtype).cuda()


@pytest.mark.gpu
def test_cuda_fused_captured_step_within_bf16_of_the_pytorch_path():
    """A decoder step in bfloat16 on the fused path replayed from its CUDA graph (concatenated projections, folded
    router and layer scalar, masks once per kind) against the unfused PyTorch path (`HF_DLLM_KERNELS` torch,
    eager): both against the float32 PyTorch step, the fused error per position (max over the vocabulary) within
    2x the PyTorch path's own bfloat16 error (mean and 90th percentile); and each router, fed the same bfloat16
    input, chooses the same experts as the unfused router wherever the float32 scores' gap between the last
    chosen and the first unchosen expert exceeds bfloat16's reach. (Not checkable in Triton's interpreter: it
    rounds float32 to bfloat16 by truncation, not to nearest, so its bfloat16 results err about twice as much.)"""
    from hf_dllm import kernels

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    previous_mode = kernels.kernel_mode()
    reference, model = _random_model(torch.float32), _random_model(torch.bfloat16)
    canvas, vocab = model.config.canvas_length, model.config.text_config.vocab_size
    generator = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(3, vocab, (2, 40), device="cuda", generator=generator)
    valid = torch.ones(2, 40, dtype=torch.bool, device="cuda")
    valid[0, :30] = False  # row 0 left-padded into the sliding window
    block = torch.randint(3, vocab, (2, canvas), device="cuda", generator=generator)
    signal = torch.randn(2, canvas, vocab, device="cuda", generator=generator)

    def step(network, mode, captured):
        kernels.set_kernel_mode(mode)
        network.capture_decoder, network._graphs = captured, None
        cache = network._diffusion_new_cache(2, 40 + canvas)
        with torch.no_grad():
            network.encode(prompt, torch.arange(40, device="cuda"), valid, cache)
            positions = torch.arange(40, 40 + canvas, device="cuda")
            runs = [network.decode(block, positions, cache, signal, padded=True) for _ in range(2 if captured else 1)]
        assert not captured or network._graphs.replays.get("decoder_layers"), "the fused step ran from a CUDA graph"
        return runs[-1].float()

    try:
        exact = step(reference, "torch", False)
        plain = step(model, "torch", False)
        fused = step(model, "auto", True)
        routers = []
        x = torch.randn(256, 256, device="cuda", generator=generator)
        for layer, exact_layer in zip(model.model.decoder.layers, reference.model.decoder.layers, strict=True):
            with torch.no_grad():
                kernels.set_kernel_mode("auto")
                weights, index = layer.router(x.bfloat16())
                kernels.set_kernel_mode("torch")
                plain_weights, plain_index = layer.router(x.bfloat16())
                router = exact_layer.router
                normed = router.norm(x.bfloat16().float()) * router.scale * router.scalar_root_size
                scores = router.proj(normed).softmax(-1)
            routers.append((weights, index, plain_weights, plain_index, scores))
    finally:
        kernels.set_kernel_mode(previous_mode)
    fused_error, plain_error = ((run - exact).abs().amax(-1).flatten() for run in (fused, plain))
    assert plain_error.max() > 0 and torch.isfinite(fused).all()
    assert fused_error.mean() <= 2 * plain_error.mean() + 1e-3, (fused_error.mean(), plain_error.mean())
    quantiles = torch.tensor([0.5, 0.9], device="cuda")
    for ours, theirs in zip(fused_error.quantile(quantiles), plain_error.quantile(quantiles), strict=True):
        assert ours <= 2 * theirs + 1e-3, (ours, theirs)
    for weights, index, plain_weights, plain_index, scores in routers:
        top = scores.topk(3, dim=-1).values
        clear = (top[:, 1] - top[:, 2]) > 0.02  # bfloat16 moves these probabilities by less
        assert clear.float().mean() > 0.5
        assert torch.equal(index.sort(-1).values[clear], plain_index.sort(-1).values[clear])
        same = (index == plain_index).all(-1)
        torch.testing.assert_close(weights[same], plain_weights[same], rtol=2e-2, atol=2e-3)


def test_dense_mlp_goes_beside_the_experts_only_on_cuda_switched_on_and_unwrapped(gemma, monkeypatch):
    """`mlp_on_side_stream`: the side stream only with `dense_mlp_beside_experts` on, on CUDA, and for an MLP that
    nothing wraps (a forward hook, a pre-hook, `forward` replaced on the instance: tensor parallelism's all-reduce
    must stay on the main stream); inline (None) on the CPU."""
    from types import SimpleNamespace

    from hf_dllm import modeling_diffusion_gemma

    layer = gemma.model.decoder.layers[0]
    cpu = torch.zeros(1)
    cuda = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # what the decision reads of the input
    monkeypatch.setattr(modeling_diffusion_gemma, "side_stream", lambda device: ("stream", device))
    monkeypatch.setattr(type(layer), "dense_mlp_beside_experts", False)
    assert layer.mlp_on_side_stream(cuda) is None
    monkeypatch.setattr(type(layer), "dense_mlp_beside_experts", True)
    assert layer.mlp_on_side_stream(cpu) is None
    assert layer.mlp_on_side_stream(cuda) == ("stream", cuda.device)
    for module in (layer.mlp, layer.mlp.down_proj):  # the MLP's own hooks or a projection's
        for register in (module.register_forward_hook, module.register_forward_pre_hook):
            handle = register(lambda *args: None)
            assert layer.mlp_on_side_stream(cuda) is None
            handle.remove()
    layer.mlp.forward = functools.partial(type(layer.mlp).forward, layer.mlp)
    assert layer.mlp_on_side_stream(cuda) is None
    del layer.mlp.forward
    assert layer.mlp_on_side_stream(cuda) == ("stream", cuda.device)


@pytest.mark.gpu
def test_cuda_dense_mlp_beside_the_experts_equals_inline():
    """The dense MLP on the side stream (forked after the attention's norms, joined before the end kernel: two
    branches of the captured step) gives the inline step's logits, eager and replayed from the CUDA graph."""
    from hf_dllm import modeling_diffusion_gemma

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _random_model(torch.bfloat16)
    canvas, vocab = model.config.canvas_length, model.config.text_config.vocab_size
    layer_class = type(model.model.decoder.layers[0])
    generator = torch.Generator(device="cuda").manual_seed(2)
    prompt = torch.randint(3, vocab, (2, 24), device="cuda", generator=generator)
    valid = torch.ones(2, 24, dtype=torch.bool, device="cuda")
    block = torch.randint(3, vocab, (2, canvas), device="cuda", generator=generator)
    signal = torch.randn(2, canvas, vocab, device="cuda", generator=generator)
    cache = model._diffusion_new_cache(2, 24 + canvas)
    positions = torch.arange(24, 24 + canvas, device="cuda")
    runs, default = {}, layer_class.dense_mlp_beside_experts
    try:
        with torch.no_grad():
            model.encode(prompt, torch.arange(24, device="cuda"), valid, cache)
            for beside in (False, True):
                layer_class.dense_mlp_beside_experts = beside
                model._graphs = None
                for captured in (False, True, True):  # eager, capture, replay
                    model.capture_decoder = captured
                    runs[beside, len(runs)] = model.decode(block, positions, cache, signal, padded=False).clone()
                if beside:
                    assert model.model.decoder.layers[0].mlp_on_side_stream(block.new_zeros(1).bfloat16()) is not None
        assert model._graphs.replays.get("decoder_layers"), "the step ran from a CUDA graph"
    finally:
        layer_class.dense_mlp_beside_experts = default
        model.capture_decoder = True
    inline = runs[False, 0]
    device = torch.device("cuda", torch.cuda.current_device())
    assert (device, modeling_diffusion_gemma.SIDE_STREAM_PRIORITY) in modeling_diffusion_gemma._SIDE_STREAMS
    for (beside, index), logits in runs.items():
        torch.testing.assert_close(logits, inline, rtol=0, atol=1e-5, msg=f"beside={beside}, run {index}")
