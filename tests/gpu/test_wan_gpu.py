"""The wan family on the GPU: relay's kernels (bf16, auto backend) against diffusers' own
WanTransformer3DModel on the same weights, and compiled blocks against eager gradients."""

import copy

import pytest
import torch

from trainer.models.wan.family import WanFamily

# a model built at random, as a trained one looks (zero_init_modulation would zero its output)
RANDOM = {"zero_init_modulation": False}

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
# head_dim 128 as every Wan checkpoint (the FA4/flash kernels' shape), small otherwise
CONFIG = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 128,
          "in_channels": 16, "out_channels": 16, "text_dim": 64, "freq_dim": 256,
          "ffn_dim": 512, "num_layers": 2, "cross_attn_norm": True,
          "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}


def _pair():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    reference = WanTransformer3DModel(**CONFIG).to(DEVICE).eval()
    family = WanFamily()
    model = family.build(family.config(CONFIG)).to(DEVICE).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    return reference, model


def _inputs():
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(2, 16, 5, 32, 32, device=DEVICE, generator=g)
    t = torch.tensor([900.0, 250.0], device=DEVICE)
    text = torch.randn(2, 24, 64, device=DEVICE, generator=g)
    return x, t, text


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_relay_kernels_in_bf16_match_diffusers_wan():
    reference, model = _pair()
    x, t, text = _inputs()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ours = model(x, t, text)
        theirs = reference(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
    with torch.no_grad():
        exact = reference(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
    assert _rel(ours, exact) < 3e-2, _rel(ours, exact)
    # bf16 error of the same order as diffusers' own bf16 forward
    assert _rel(ours, exact) < 3 * _rel(theirs, exact) + 1e-3


def test_compiled_wan_blocks_give_the_eager_gradients():
    _, eager = _pair()
    compiled = copy.deepcopy(eager)
    compiled.compile_blocks()
    x, t, text = _inputs()
    grads = []
    for model in (eager, compiled):
        model.train().zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, text)
        out.float().square().mean().backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    worst = max(grads[0], key=lambda n: _rel(grads[1][n], grads[0][n]))
    assert _rel(grads[1][worst], grads[0][worst]) < 5e-2, worst


def _causal(**extra):
    """The same small Wan, causal (chunks of 2 latent frames) and two-time, on the GPU."""
    family = WanFamily()
    torch.manual_seed(0)
    config = family.config({**CONFIG, "causal_chunk_size": 2, "two_time": True, **extra},
                           RANDOM)
    return family.build(config).to(DEVICE).eval()


def test_teacher_forcing_through_flex_matches_the_cached_chunks_and_fp32_sdpa():
    # bf16: teacher forcing's chunk mask runs as FlexAttention, the cached chunks as full
    # attention; both against the float32 SDPA reference of the same weights.
    model, reference = _causal(), _causal(attention_backend="sdpa")
    x, _, text = _inputs()
    clean = x.flip(2)
    t = torch.tensor([[0.0, 700.0, 700.0, 300.0, 300.0], [900.0] * 5], device=DEVICE)
    r = t * 0.5
    with torch.no_grad():
        exact = reference.forward_teacher_forcing(x, clean, t, text, r=r)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            tf = model.forward_teacher_forcing(x, clean, t, text, r=r)
            cache, chunks = model.new_kv_cache(text), []
            for start in range(0, 5, 2):
                sl = slice(start, start + 2)
                chunks.append(model.forward_chunk(x[:, :, sl], t[:, sl], cache, start,
                                                  r_chunk=r[:, sl]))
                model.commit_chunk(clean[:, :, sl], cache, start)
    assert _rel(tf, exact) < 3e-2, _rel(tf, exact)
    assert _rel(torch.cat(chunks, dim=2), exact) < 3e-2


def test_a_pack_on_the_gpu_matches_each_sample_alone():
    model = _causal()
    g = torch.Generator(device=DEVICE).manual_seed(2)
    xs = [torch.randn(16, *s, device=DEVICE, generator=g) for s in ((5, 32, 32), (1, 16, 48))]
    texts = [torch.randn(n, 64, device=DEVICE, generator=g) for n in (24, 7)]
    masks = [torch.ones(n, dtype=torch.bool, device=DEVICE) for n in (24, 7)]
    ts = [torch.tensor(600.0, device=DEVICE), torch.tensor([0.0], device=DEVICE)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model.forward_packed(xs, ts, texts, masks, causal=False)
        for x, t, text, got in zip(xs, ts, texts, packed):
            want = model(x[None], t[None], text[None], causal=False)[0]
            assert _rel(got, want) < 2e-2, _rel(got, want)


def test_compiled_causal_wan_blocks_give_the_eager_teacher_forcing_gradients():
    eager = _causal()
    compiled = copy.deepcopy(eager)
    compiled.compile_blocks()
    x, _, text = _inputs()
    t = torch.tensor([[0.0, 700.0, 700.0, 300.0, 300.0], [900.0] * 5], device=DEVICE)
    grads = []
    for model in (eager, compiled):
        model.train().zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.forward_teacher_forcing(x, x.flip(2), t, text, r=t * 0.5)
        out.float().square().mean().backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters()
                      if p.grad is not None})
    worst = max(grads[0], key=lambda n: _rel(grads[1][n], grads[0][n]))
    assert _rel(grads[1][worst], grads[0][worst]) < 5e-2, worst


@pytest.mark.parametrize("checkpointing", ["off", "selective"])
def test_fused_kernels_give_the_composite_gradients_in_bf16(monkeypatch, checkpointing):
    """The fused kernels (q/k RMSNorm + RoPE, LayerNorm + modulation), in compiled blocks,
    also under selective activation checkpointing, against the composite torch code of the
    same model (trainer/models/fused_ops.py), and that the GPU does take them."""
    from trainer.models import fused_ops
    from trainer.models.wan import module as wan_module

    assert fused_ops.fused_kernels_apply(torch.zeros(1, device=DEVICE, dtype=torch.bfloat16))
    _, fused = _pair()
    composite = copy.deepcopy(fused)
    if checkpointing == "selective":  # as prepare_for_training: checkpoint, then compile
        from torch.distributed._composable import checkpoint

        from trainer.build import _keep_attention_outputs

        for block in (*composite.blocks, *fused.blocks):
            checkpoint(block, context_fn=_keep_attention_outputs)
    x, t, text = _inputs()
    grads, outs = [], []
    for model, on in ((composite, False), (fused, True)):
        monkeypatch.setattr(wan_module, "fused_kernels_apply", lambda tensor, on=on: on)
        torch._dynamo.reset()
        model.compile_blocks()
        model.train().zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, text)
        out.float().square().mean().backward()
        outs.append(out.detach().float())
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    assert _rel(outs[1], outs[0]) < 1e-2, _rel(outs[1], outs[0])
    worst = max(grads[0], key=lambda n: _rel(grads[1][n], grads[0][n]))
    assert _rel(grads[1][worst], grads[0][worst]) < 3e-2, (worst, _rel(grads[1][worst], grads[0][worst]))


def test_the_matmul_bias_gradient_equals_nn_linear_compiled_in_bf16():
    """MatmulBiasLinear (the block's linear layers) against nn.Linear under autocast, compiled:
    the same output and input and weight gradients, the bias gradient to bf16 rounding."""
    from trainer.models.matmul_bias import MatmulBiasLinear

    torch.manual_seed(0)
    plain = torch.nn.Linear(256, 384).to(DEVICE)
    ours = MatmulBiasLinear(256, 384).to(DEVICE)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(2, 1000, 256, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(2, 1000, 384, device=DEVICE, dtype=torch.bfloat16)
    results = []
    for layer in (plain, ours):
        torch._dynamo.reset()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(layer)(torch.nn.functional.gelu(xi))
        out.backward(dy)
        results.append((out.float(), xi.grad.float(), layer.weight.grad, layer.bias.grad))
    for got, want in zip(results[1], results[0]):
        assert _rel(got, want) < 1e-2, _rel(got, want)
