"""A pack of samples of different shapes computes what each sample computes alone."""

import pytest
import torch

from trainer.data.packing import pack_layout
from trainer.models.dit.module import VideoDiT

torch.set_num_threads(1)
C, D = 2, 6


def _model(**overrides):
    torch.manual_seed(0)
    cfg = dict(in_channels=C, hidden_size=16, num_attention_heads=2, num_layers=2,
               patch_size=(1, 2, 2), rope_axes_dim=(2, 2, 4), text_dim=D, zero_init_modulation=False)
    return VideoDiT(**{**cfg, **overrides}).double().eval()


def _samples():
    """Three samples: two video shapes and an image (T = 1), captions of 3, 7 and 5 tokens,
    the last with two padded tokens."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(C, 3, 4, 6, generator=g, dtype=torch.float64),
          torch.randn(C, 2, 6, 4, generator=g, dtype=torch.float64),
          torch.randn(C, 1, 4, 4, generator=g, dtype=torch.float64)]
    texts = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in (3, 7, 5)]
    masks = [torch.ones(3, dtype=torch.bool), torch.ones(7, dtype=torch.bool),
             torch.tensor([True, True, True, False, False])]
    ts = [torch.tensor(700.0), torch.tensor([100.0, 900.0]), torch.tensor(0.0)]  # per-frame for #2
    return xs, ts, texts, masks


def test_packed_forward_equals_each_sample_alone():
    model = _model()
    xs, ts, texts, masks = _samples()
    packed = model.forward_packed(xs, ts, texts, masks)
    for x, t, text, mask, out in zip(xs, ts, texts, masks, packed):
        alone = model(x[None], t[None], text[None], mask[None])[0]
        assert out.shape == alone.shape
        torch.testing.assert_close(out, alone, rtol=1e-10, atol=1e-10)


def test_packed_gradients_equal_the_sum_of_per_sample_gradients():
    model = _model()
    xs, ts, texts, masks = _samples()
    sum(p.square().mean() for p in model.forward_packed(xs, ts, texts, masks)).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for x, t, text, mask in zip(xs, ts, texts, masks):
        model(x[None], t[None], text[None], mask[None])[0].square().mean().backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_samples_in_a_pack_do_not_see_each_other():
    model = _model()
    xs, ts, texts, masks = _samples()
    before = model.forward_packed(xs, ts, texts, masks)
    xs[1] = xs[1] + 5.0           # change only the middle sample and its caption
    texts[1] = texts[1] * -2.0
    after = model.forward_packed(xs, ts, texts, masks)
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert not torch.allclose(before[1], after[1])


def test_varlen_runs_of_a_pack_attend_like_its_block_diagonal_mask():
    # The GPU path of a pack: each sample's used keys gathered into one run for a varlen
    # kernel. Checked here through SDPA per run against the dense mask CPU packs use.
    from trainer.models.attention import AttentionPlan, attend, packed_keys

    xs, _, texts, masks = _samples()
    layout = pack_layout(xs, texts, (1, 2, 2))
    vid, txt, real = layout.video_ids(), layout.text_ids(), torch.cat(masks)
    keys = packed_keys(vid, torch.cat([vid, txt]), torch.cat([torch.ones_like(vid, dtype=torch.bool), real]))
    assert keys.cu_seqlens_q.tolist() == [0, 18, 30, 34]
    assert keys.cu_seqlens_k.tolist() == [0, 21, 40, 47]   # the last caption's 2 pads left out
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, len(vid), 2, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, len(vid) + len(txt), 2, 4, generator=g, dtype=torch.float64) for _ in "kv")
    joint = layout.video_mask(masks)   # keys [captions | video]; the blocks' are [video | captions]
    dense = torch.cat([joint[..., len(txt):], joint[..., :len(txt)]], dim=-1)
    torch.testing.assert_close(attend(AttentionPlan("sdpa", None, keys), q, k, v),
                               attend(AttentionPlan("sdpa", None, dense), q, k, v))
    assert layout.positions()[18].tolist() == [0, 0, 0]   # the second sample's grid starts at 0


def test_a_latent_off_the_patch_grid_is_refused():
    with pytest.raises(ValueError, match="multiple of the patch size"):
        pack_layout([torch.zeros(C, 1, 3, 4)], [torch.zeros(2, D)], (1, 2, 2))


def _fm_args(tmp_path, **keys):
    from trainer.resolve import resolve_config

    # The stage's arguments only: its batches are built here, so neither the data directory
    # nor validation is read.
    argv = ["--data_path", str(tmp_path), "--output_dir", str(tmp_path / "out"), "--cfg_drop_prob", "0",
            "--validation_interval", "-1"]
    for key, value in keys.items():
        argv += [f"--{key}", str(value)]
    return resolve_config(None, argv, check_paths=False)


@pytest.mark.parametrize("keys", [{}, {"flow_snr_type": "lognorm", "train_timestep_shift_mode": "dynamic"}])
def test_packed_fm_loss_and_gradients_equal_the_per_sample_mean(tmp_path, keys):
    from trainer.diffusion.sample_draws import SampleDraws
    from trainer.stages.fm import PackedForward, fm_loss, fm_loss_packed

    args = _fm_args(tmp_path, **keys)
    model = _model().float()
    xs, _, texts, masks = _samples()
    xs, texts = [x.float() for x in xs], [t.float() for t in texts]
    null_text, null_mask = torch.zeros(4, D), torch.ones(4, dtype=torch.bool)
    torch.manual_seed(11)
    pack = {"packed": True, "latents": xs, "text": texts, "text_mask": masks}
    # fm_loss without draws keys its one sample 0 at step 0: the pack's samples likewise.
    draws = SampleDraws(args.seed, 0, [0] * len(xs))
    packed, _ = fm_loss_packed(PackedForward(model), pack, args, null_text, null_mask, (1, 2, 2),
                               draws)
    packed.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(11)
    alone = []
    for x, text, mask in zip(xs, texts, masks):
        batch = {"latents": x[None], "text": text[None], "text_mask": mask[None]}
        tokens = (x.shape[1]) * (x.shape[2] // 2) * (x.shape[3] // 2)
        alone.append(fm_loss(model, batch, args, null_text, null_mask, tokens)[0])
    (sum(alone) / len(alone)).backward()
    torch.testing.assert_close(packed, sum(alone) / len(alone), rtol=1e-5, atol=1e-6)
    for got, p in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)


# ---- block-causal stages: the chunk rule holds within each sample of a pack --------------------

def _causal_samples():
    """Three samples of 4, 3 and 1 latent frames (chunks of 2: the second ends in a short chunk),
    per-frame times for the first, per-sample for the others."""
    xs, _, texts, masks = _samples()
    g = torch.Generator().manual_seed(5)
    xs[0] = torch.randn(C, 4, 4, 6, generator=g, dtype=torch.float64)
    xs[1] = torch.randn(C, 3, 6, 4, generator=g, dtype=torch.float64)
    ts = [torch.tensor([50.0, 300.0, 600.0, 950.0]), torch.tensor(400.0), torch.tensor(800.0)]
    return xs, ts, texts, masks


@pytest.mark.parametrize("window", [None, 1])
def test_block_causal_pack_equals_each_sample_alone(window):
    model = _model(causal_chunk_size=2, attn_window_chunks=window)
    xs, ts, texts, masks = _causal_samples()
    packed = model.forward_packed(xs, ts, texts, masks)
    for x, t, text, mask, out in zip(xs, ts, texts, masks, packed):
        alone = model(x[None], t[None], text[None], mask[None])[0]
        torch.testing.assert_close(out, alone, rtol=1e-10, atol=1e-10)
    # and the rule is really causal: a later frame of sample 0 does not move its first chunk
    later = [x.clone() for x in xs]
    later[0][:, 2:] += 3.0
    moved = model.forward_packed(later, ts, texts, masks)
    assert torch.equal(moved[0][:, :2], packed[0][:, :2]) and not torch.equal(moved[0], packed[0])


def test_teacher_forcing_pack_equals_each_sample_alone_and_its_gradients_sum():
    model = _model(causal_chunk_size=2, two_time=True, time_gate=0.25)
    xs, ts, texts, masks = _causal_samples()
    g = torch.Generator().manual_seed(9)
    cleans = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in xs]
    rs = [t * 0.5 for t in ts]
    packed = model.forward_teacher_forcing_packed(xs, cleans, ts, texts, masks, rs)
    sum(p.square().mean() for p in packed).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for x, clean, t, r, text, mask, out in zip(xs, cleans, ts, rs, texts, masks, packed):
        alone = model.forward_teacher_forcing(x[None], clean[None], t[None], text[None],
                                              mask[None], r=r[None])[0]
        torch.testing.assert_close(out, alone, rtol=1e-10, atol=1e-10)
        alone.square().mean().backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def _stage1_args(tmp_path, **keys):
    model = (f"{{in_channels: {C}, hidden_size: 16, num_attention_heads: 2, num_layers: 2, "
             f"patch_size: [1, 2, 2], rope_axes_dim: [2, 2, 4], text_dim: {D}, "
             "causal_chunk_size: 2, two_time: true, time_gate: 0.25}")
    keys = {"stage": "tf_anyflow", "use_ema": "true", "anyflow_fuse_guidance_scale": 3.0,
            "transformer_config_overrides": model, "anyflow_time_gate": 0.25,
            "cfg_drop_prob": 0.3, "image_cond_prob": 0.3, **keys}
    return _fm_args(tmp_path, **keys)


def _stage1_model():
    return _model(causal_chunk_size=2, two_time=True, time_gate=0.25).float().train()


def _anyflow_losses(tmp_path, pack_xs, texts, masks, keys, null_len=5, teacher=None,
                    **arg_keys):
    """(packed loss, its gradients, stacked-or-alone reference loss, its gradients)."""
    from trainer.diffusion.sample_draws import SampleDraws
    from trainer.stages.tf_anyflow import (TeacherForcingForward, TeacherForcingPackedForward,
                                           AnyFlowSettings, anyflow_batch_loss, anyflow_pack_loss)

    args = _stage1_args(tmp_path, **arg_keys)
    model = _stage1_model()
    # the stacked batch swaps a dropped caption for the null one in place: the same length
    null_text, null_mask = torch.zeros(null_len, D), torch.arange(null_len) < 1
    positions, total = torch.arange(len(pack_xs)), len(pack_xs)
    pack = {"packed": True, "latents": pack_xs, "text": texts, "text_mask": masks}
    loss, _ = anyflow_pack_loss(TeacherForcingPackedForward(model), pack, AnyFlowSettings.of(args), null_text,
                                null_mask, patch_size=(1, 2, 2),
                                draws=SampleDraws(args.seed, 3, keys), positions=positions,
                                global_batch=total, teacher=teacher)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return args, model, loss, grads, (TeacherForcingForward(model), anyflow_batch_loss,
                                      AnyFlowSettings.of(args), null_text, null_mask,
                                      positions, total)


@pytest.mark.parametrize("context", [None, "clip", "causal"])  # None: no guidance teacher
def test_packed_stage1_loss_and_gradients_equal_the_stacked_batch(tmp_path, context):
    """Samples of one shape: the pack's loss is the batch's, over every pair kind, caption drop,
    clean first frames and the fused guidance target (its direction from the student's null
    branch, or from a frozen teacher on the whole clip or per causal chunk)."""
    from trainer.diffusion.sample_draws import SampleDraws

    teacher, extra = None, {}
    if context is not None:
        torch.manual_seed(7)
        teacher = _model().float().eval().requires_grad_(False)  # bidirectional, single-time
        extra = {"anyflow_guidance_reference": "teacher", "anyflow_teacher_context": context,
                 "load_transformer_weights": "true", "pretrained_transformer_path": tmp_path}

    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(C, 4, 4, 6, generator=g) for _ in range(4)]
    texts = [torch.randn(5, D, generator=g) for _ in range(4)]
    masks = [torch.tensor([True] * n + [False] * (5 - n)) for n in (5, 3, 4, 1)]
    keys = [10, 11, 12, 13]
    args, model, packed, grads, (u_model, batch_loss, settings, null_text, null_mask, positions,
                                 total) = \
        _anyflow_losses(tmp_path, xs, texts, masks, keys, teacher=teacher, **extra)
    assert settings.teacher_chunk_frames == (2 if context == "causal" else None)
    batch = {"latents": torch.stack(xs), "text": torch.stack(texts), "text_mask": torch.stack(masks)}
    stacked, stats = batch_loss(u_model, batch, settings, null_text, null_mask,
                                num_tokens=4 * 2 * 3,
                                draws=SampleDraws(args.seed, 3, keys), positions=positions,
                                global_batch=total, teacher=teacher)
    stacked.backward()
    assert stats["count_diffusion"] == 2 and stats["count_consistency"] == 1
    torch.testing.assert_close(packed, stacked, rtol=1e-5, atol=1e-6)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)


def test_packed_stage1_loss_of_mixed_shapes_is_the_mean_of_each_sample_alone(tmp_path):
    from trainer.diffusion.sample_draws import SampleDraws

    xs, _, texts, masks = _causal_samples()
    # captions padded to one length (7), as the stacked reference needs for its caption drop
    masks = [torch.cat([m, torch.zeros(7 - len(m), dtype=torch.bool)]) for m in masks]
    texts = [torch.cat([t, torch.zeros(7 - len(t), D, dtype=t.dtype)]).float() for t in texts]
    xs = [x.float() for x in xs]
    keys = [5, 6, 7]
    # every sample diffusion: no rescale, so the pack's loss is the plain mean over samples
    args, model, packed, grads, (u_model, batch_loss, settings, null_text, null_mask, _, _) = \
        _anyflow_losses(tmp_path, xs, texts, masks, keys, anyflow_diffusion_ratio=1.0,
                        anyflow_consistency_ratio=0.0, null_len=7)
    alone = []
    for x, text, mask, key in zip(xs, texts, masks, keys):
        batch = {"latents": x[None], "text": text[None], "text_mask": mask[None]}
        tokens = x.shape[1] * (x.shape[2] // 2) * (x.shape[3] // 2)
        alone.append(batch_loss(u_model, batch, settings, null_text, null_mask, num_tokens=tokens,
                                draws=SampleDraws(args.seed, 3, [key]))[0])
    (sum(alone) / len(alone)).backward()
    torch.testing.assert_close(packed, sum(alone) / len(alone), rtol=1e-5, atol=1e-6)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)
