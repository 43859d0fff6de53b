"""The fused Triton kernels of trainer/models/fused_ops.py (q/k RMSNorm + RoPE; LayerNorm +
modulation) against the torch code they replace, run on the CPU through Triton's interpreter
(tests/conftest.py turns it on where there is no GPU): outputs and gradients in float32, the
registered operators through torch.library.opcheck, a whole Wan model whose blocks take the
fused path against the same model on the composite path (also under activation
checkpointing), and a block compiled whole (no graph break) on that path. On a
GPU, tests/gpu/test_wan_gpu.py compares compiled bf16 blocks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("a GPU machine: tests/gpu/test_wan_gpu.py runs the kernels", allow_module_level=True)

from trainer.models import fused_ops  # noqa: E402
from trainer.models.wan import module as wan_module  # noqa: E402
from trainer.models.wan.family import WanFamily  # noqa: E402

TIGHT = dict(rtol=1e-5, atol=1e-5)
# a model built at random, as a trained one looks (zero_init_modulation would zero its output)
RANDOM = {"zero_init_modulation": False}


def _angles(n, half, seed):
    angle = torch.randn(n, half, generator=torch.Generator().manual_seed(seed)) * 3
    return angle.cos(), angle.sin()


# 3 heads of 64: 192 channels, not a power of two (the kernels mask the tile's rest), and 600
# rows, which three backward programs share (256 rows each at this width), the last in part
@pytest.mark.parametrize("batch, tokens, heads, head_dim", [(2, 300, 3, 64), (1, 5, 2, 16)])
def test_the_fused_kernels_give_the_composite_output_and_gradients(batch, tokens, heads, head_dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, tokens, heads * head_dim, generator=g).requires_grad_()
    weight = (1 + 0.3 * torch.randn(heads * head_dim, generator=g)).requires_grad_()
    cos, sin = _angles(tokens, head_dim // 2, 1)
    fused = fused_ops.norm_rope(x, weight, 1e-6, cos, sin, heads)
    composite = fused_ops.composite_norm_rope(x, weight, 1e-6, cos, sin, heads)
    torch.testing.assert_close(fused, composite, **TIGHT)
    dy = torch.randn(fused.shape, generator=g)
    got = torch.autograd.grad(fused, (x, weight), dy)
    want = torch.autograd.grad(composite, (x, weight), dy)
    torch.testing.assert_close(got[0], want[0], **TIGHT)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)  # a sum over 600 rows


# one run of 300 rows over two backward programs (256 rows each at 192 channels), runs of a
# few rows each (a time per frame) and of one row (a time per token), at widths that are not
# powers of two
@pytest.mark.parametrize("batch, runs, tokens, dim", [(2, 1, 300, 192), (2, 5, 10, 24),
                                                      (1, 3, 6, 16), (2, 7, 7, 40)])
def test_the_layer_norm_modulate_kernels_give_the_composite_output_and_gradients(batch, runs,
                                                                                 tokens, dim):
    g = torch.Generator().manual_seed(0)
    x = (3 + 2 * torch.randn(batch, tokens, dim, generator=g)).requires_grad_()
    scale = (0.3 * torch.randn(batch, runs, dim, generator=g)).requires_grad_()
    shift = torch.randn(batch, runs, dim, generator=g).requires_grad_()
    fused = fused_ops.layer_norm_modulate(x, scale, shift, 1e-6)
    composite = fused_ops.composite_layer_norm_modulate(x, scale, shift, 1e-6)
    torch.testing.assert_close(fused, composite, **TIGHT)
    dy = torch.randn(fused.shape, generator=g)
    got = torch.autograd.grad(fused, (x, scale, shift), dy)
    want = torch.autograd.grad(composite, (x, scale, shift), dy)
    for name, a, b in zip(("x", "scale", "shift"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_the_operators_pass_opcheck():
    """Schema, fake (meta) kernels, autograd registration as torch.compile relies on them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g).requires_grad_()
    weight = torch.randn(16, generator=g).requires_grad_()
    cos, sin = _angles(6, 4, 1)
    torch.library.opcheck(torch.ops.relay.norm_rope_forward, (x, weight, cos, sin, 1e-6))
    torch.library.opcheck(torch.ops.relay.norm_rope_backward,
                          (torch.randn(2, 6, 16, generator=g), x.detach(), weight.detach(), cos,
                           sin, 1e-6))
    scale, shift = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    torch.library.opcheck(torch.ops.relay.layer_norm_modulate_forward,
                          (x, scale.requires_grad_(), shift.requires_grad_(), 1e-6))
    torch.library.opcheck(torch.ops.relay.layer_norm_modulate_backward,
                          (torch.randn(2, 6, 16, generator=g), x.detach(), scale.detach(), 1e-6))


# per-frame times modulate each frame's tokens by their own row (three runs a sample); the
# kernels' forward runs inside a checkpoint of its own, nested in the block's when the run
# checkpoints blocks (trainer.build.prepare_for_training: whole, or selective)
@pytest.mark.parametrize("times, checkpointing", [("sample", "off"), ("frame", "off"),
                                                  ("sample", "full"), ("frame", "selective")])
def test_a_wan_model_on_the_fused_path_equals_the_composite_path(monkeypatch, times,
                                                                 checkpointing):
    """The whole module's wiring: which weights, eps, head split and bias the kernels get."""
    tiny = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 8,
            "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32,
            "num_layers": 2, "eps": 1e-5}
    family = WanFamily()
    torch.manual_seed(0)
    model = family.build(family.config(tiny, RANDOM))
    with torch.no_grad():  # weights away from their initial ones, so each one's use shows
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 4, 6, generator=g)
    text = torch.randn(2, 5, 16, generator=g)
    t = torch.tensor([700.0, 80.0]) if times == "sample" else torch.tensor([[700.0, 500, 20],
                                                                             [80, 900, 300]])
    if checkpointing != "off":
        from torch.distributed._composable import checkpoint

        from trainer.build import _keep_attention_outputs

        options = {"context_fn": _keep_attention_outputs} if checkpointing == "selective" else {}
        for block in model.blocks:
            checkpoint(block, **options)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(wan_module, "fused_kernels_apply", lambda tensor, on=fused: on)
        model.zero_grad(set_to_none=True)
        out = model(x, t, text)
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (out_c, grads_c), (out_f, grads_f) = results
    torch.testing.assert_close(out_f, out_c, **TIGHT)
    assert grads_f.keys() == grads_c.keys()
    for name in grads_c:
        torch.testing.assert_close(grads_f[name], grads_c[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_cpu_tensors_keep_the_composite_path():
    assert not fused_ops.fused_kernels_apply(torch.zeros(2))


@pytest.mark.parametrize("checkpointing", ["off", "selective"])
def test_a_compiled_wan_block_on_the_fused_path_is_one_graph(monkeypatch, checkpointing):
    """Every block compiles whole (fullgraph) with the fused backward inside, and its
    gradients stay the composite path's: a graph break would split each block's graph and let
    the partitioner save more (at Wan2.1-1.3B one such break cost 3.5 GiB of peak)."""
    tiny = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 8,
            "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32,
            "num_layers": 1}
    family = WanFamily()
    torch.manual_seed(0)
    model = family.build(family.config(tiny, RANDOM))
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(1, 4, 2, 4, 4, generator=g), torch.randn(1, 5, 16, generator=g)
    t = torch.tensor([500.0])
    model(x, t, text).square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(wan_module, "fused_kernels_apply", lambda tensor: True)
    block = model.blocks[0]
    if checkpointing == "selective":  # as prepare_for_training: checkpoint, then compile
        from torch.distributed._composable import checkpoint

        from trainer.build import _keep_attention_outputs

        checkpoint(block, context_fn=_keep_attention_outputs)
    monkeypatch.setattr(block, "forward", torch.compile(block.forward, fullgraph=True,
                                                        backend="aot_eager"))
    model.zero_grad(set_to_none=True)
    model(x, t, text).square().mean().backward()
    for name, grad in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4,
                                   atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
