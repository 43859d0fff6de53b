"""MatmulBiasLinear (trainer/models/matmul_bias.py), the wan blocks' linear layers: its
autograd function against finite differences, the layer against nn.Linear under bf16 autocast
(the path a GPU run takes, here on the CPU), and under a peft LoRA adapter, which must still
train the adapter and leave the base frozen. On a GPU, tests/gpu/test_wan_gpu.py compares it
compiled."""

from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model

from trainer.models.matmul_bias import MatmulBiasLinear, _LinearMatmulBiasGrad


def test_the_function_has_linear_gradients():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((2, 5, 6), (4, 6), (4,)))
    assert torch.autograd.gradcheck(_LinearMatmulBiasGrad.apply, (x, w, b))


def _pair():
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 40)
    ours = MatmulBiasLinear(48, 40)
    ours.load_state_dict(plain.state_dict())
    return plain, ours


def test_under_bf16_autocast_it_computes_what_nn_linear_computes():
    plain, ours = _pair()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 70, 48, generator=g)
    dy = torch.randn(3, 70, 40, generator=g, dtype=torch.bfloat16)
    results = []
    for layer in (plain, ours):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(xi.bfloat16())
        out.backward(dy)
        results.append((out, xi.grad, layer.weight.grad, layer.bias.grad))
    for name, got, want in zip(("out", "dx", "dweight", "dbias"), results[1], results[0]):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(results[1][0], results[0][0])  # the same matrix product forward


def test_float32_inputs_take_nn_linear():
    plain, ours = _pair()
    x = torch.randn(4, 48)
    assert torch.equal(ours(x), plain(x))


def test_a_lora_adapter_on_it_trains_the_adapter_and_leaves_the_base_frozen():
    _, ours = _pair()
    model = torch.nn.Sequential(ours)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0"], init_lora_weights=False), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    x = torch.randn(2, 9, 48, dtype=torch.bfloat16)
    base = ours(x)  # the wrapped layer's own output: the base alone
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert not torch.allclose(out.float(), base.float())  # the adapter's delta is there
    out.float().square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[n] is not None for n in grads if "lora_" in n)
    assert all(grads[n] is None for n in grads if "lora_" not in n)
