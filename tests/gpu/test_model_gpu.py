"""The DiT on the GPU: kernels against SDPA, compiled against eager, fused AdamW."""

import copy

import pytest
import torch

from trainer.models.dit.module import VideoDiT
from trainer.optim.optimizers import build_optimizer

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def _model(**overrides):
    torch.manual_seed(0)
    cfg = dict(in_channels=4, hidden_size=256, num_attention_heads=2, num_layers=2, patch_size=(1, 2, 2),
               rope_axes_dim=(44, 42, 42), text_dim=32, zero_init_modulation=False)
    cfg.update(overrides)
    return VideoDiT(**cfg).to(DEVICE)


def _batch(frames=4, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(2, 4, frames, 16, 16, device=DEVICE, generator=g)
    text = torch.randn(2, 12, 32, device=DEVICE, generator=g)
    mask = torch.ones(2, 12, dtype=torch.bool, device=DEVICE)
    mask[1, 7:] = False
    t = torch.tensor([[700.0] * frames, [float(100 + 50 * f) for f in range(frames)]], device=DEVICE)
    return x, t, text, mask


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fn(model)
    out.float().square().mean().backward()
    return out.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _compare(a, b, tol):
    out_a, grads_a = a
    out_b, grads_b = b
    assert _rel(out_a, out_b) < tol, _rel(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    worst = max(grads_a, key=lambda n: _rel(grads_a[n], grads_b[n]))
    assert _rel(grads_a[worst], grads_b[worst]) < 4 * tol, (worst, _rel(grads_a[worst], grads_b[worst]))


FORWARDS = {
    "full": lambda m, x, t, text, mask: m(x, t, text),
    "padded": lambda m, x, t, text, mask: m(x, t, text, mask),
    "teacher_forcing": lambda m, x, t, text, mask: m.forward_teacher_forcing(x, x.flip(0), t, text, mask),
}


@pytest.mark.parametrize("form", list(FORWARDS))
def test_auto_kernels_match_sdpa_through_the_model(form):
    causal = dict(causal_chunk_size=2) if form == "teacher_forcing" else {}
    fast = _model(attention_backend="auto", **causal)
    ref = copy.deepcopy(fast)
    ref.cfg.attention_backend = "sdpa"
    batch = _batch()
    run = FORWARDS[form]
    _compare(_loss_and_grads(fast, lambda m: run(m, *batch)),
             _loss_and_grads(ref, lambda m: run(m, *batch)), tol=1e-2)


@pytest.mark.parametrize("form", ["full", "teacher_forcing"])
def test_compiled_blocks_give_the_eager_gradients(form):
    from trainer.models.dit.module import compile_transformer_blocks

    causal = dict(causal_chunk_size=2) if form == "teacher_forcing" else {}
    eager = _model(**causal)
    compiled = compile_transformer_blocks(copy.deepcopy(eager))
    batch = _batch()
    run = FORWARDS[form]
    _compare(_loss_and_grads(compiled, lambda m: run(m, *batch)),
             _loss_and_grads(eager, lambda m: run(m, *batch)), tol=1e-2)


def test_adamw_is_fused_on_the_gpu_and_steps_like_the_reference():
    model = _model()
    optimizer = build_optimizer(model, learning_rate=1e-3, weight_decay=0.1)
    assert optimizer.defaults["fused"] is True
    ref_model = copy.deepcopy(model)
    reference = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95),
                                  foreach=False)
    for seed in range(3):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            p.grad = torch.randn(p.shape, device=DEVICE, generator=g)
            q.grad = p.grad.clone()
        optimizer.step()
        reference.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _pack(frames=(4, 2, 1), seed=2):
    """Three samples of `frames` latent frames at three sizes (the last an image when 1), with
    captions of 12, 7 and 9 tokens, the last with padding: (latents, captions, masks)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    xs = [torch.randn(4, f, h, w, device=DEVICE, generator=g) for f, (h, w) in zip(frames, ((16, 16), (8, 24), (16, 8)))]
    texts = [torch.randn(n, 32, device=DEVICE, generator=g) for n in (12, 7, 9)]
    masks = [torch.ones(n, dtype=torch.bool, device=DEVICE) for n in (12, 7, 9)]
    masks[2][5:] = False
    return xs, texts, masks


def _packed_inputs():
    xs, texts, masks = _pack()
    ts = [torch.tensor(700.0, device=DEVICE), torch.tensor([100.0, 800.0], device=DEVICE),
          torch.tensor(300.0, device=DEVICE)]
    return xs, ts, texts, masks


def test_packed_batches_through_varlen_kernels_match_sdpa():
    fast = _model(attention_backend="auto")
    ref = copy.deepcopy(fast)
    ref.cfg.attention_backend = "sdpa"
    batch = _packed_inputs()

    def run(m):
        return torch.cat([p.flatten() for p in m.forward_packed(*batch)])

    _compare(_loss_and_grads(fast, run), _loss_and_grads(ref, run), tol=1e-2)


@pytest.mark.parametrize("selective", [True, False])
def test_selective_checkpointing_does_not_recompute_fa4(monkeypatch, selective):
    from torch.distributed._composable import checkpoint

    from trainer import build
    from trainer.models import attention, fa4_ops

    if not attention._runs_here("fa4", DEVICE, torch.bfloat16, 128):
        pytest.skip("FA4 does not run here")
    interface = fa4_ops._fa4()
    calls = []

    class Counting:
        _flash_attn_bwd = staticmethod(interface._flash_attn_bwd)

        @staticmethod
        def _flash_attn_fwd(*args, **kwargs):
            calls.append(1)
            return interface._flash_attn_fwd(*args, **kwargs)

    monkeypatch.setattr(fa4_ops, "_fa4", lambda: Counting)
    model = _model(attention_backend="fa4")
    for block in model.blocks:
        checkpoint(block, **({"context_fn": build._keep_attention_outputs} if selective else {}))
    x, t, text, _ = _batch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x, t, text)
    forward_calls = len(calls)
    out.float().square().mean().backward()
    assert forward_calls > 0
    assert len(calls) == (forward_calls if selective else 2 * forward_calls)


def test_packed_teacher_forcing_through_varlen_kernels_matches_sdpa():
    fast = _model(attention_backend="auto", causal_chunk_size=2)
    ref = copy.deepcopy(fast)
    ref.cfg.attention_backend = "sdpa"
    xs, texts, masks = _pack(frames=(4, 3, 1), seed=3)  # chunks of 2; one ends short
    cleans = [x.flip(1) for x in xs]
    ts = [torch.tensor(700.0, device=DEVICE), torch.tensor([100.0, 500.0, 800.0], device=DEVICE),
          torch.tensor(300.0, device=DEVICE)]

    def run(m):
        return torch.cat([p.flatten() for p in m.forward_teacher_forcing_packed(xs, cleans, ts, texts, masks)])

    _compare(_loss_and_grads(fast, run), _loss_and_grads(ref, run), tol=1e-2)


@pytest.mark.parametrize("window", [None, 1])
def test_the_packed_rollout_cache_through_varlen_kernels_matches_sdpa(window):
    """Stage2's rollout on a pack: the KV-cached chunks with the auto kernels against SDPA."""
    fast = _model(attention_backend="auto", causal_chunk_size=2, attn_window_chunks=window)
    ref = copy.deepcopy(fast)
    ref.cfg.attention_backend = "sdpa"
    xs, texts, masks = _pack(frames=(4, 3, 1), seed=3)  # chunks of 2; one ends short
    outputs = {}
    for name, model in (("fast", fast), ("ref", ref)):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            cache = model.new_packed_kv_cache(texts, masks)
            outs = []
            for start in (0, 2):
                active = [i for i, x in enumerate(xs) if x.shape[1] > start]
                chunks = [xs[i][:, start:start + 2] for i in active]
                outs += model.forward_chunk_packed(chunks, [500.0] * len(active), cache, active)
                model.commit_chunk_packed(chunks, cache, active)
        assert cache.next_frame == [4, 3, 1]
        outputs[name] = torch.cat([o.float().flatten() for o in outs])
    assert _rel(outputs["fast"], outputs["ref"]) < 1e-2, _rel(outputs["fast"], outputs["ref"])
