"""Stage2 (DMD via SGF): the properties of docs/algorithms.md, "Stage2: DMD via SGF", plus a short end-to-end
run through train.py (warm start from FM checkpoints, resume after a kill, relay sample)."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.diffusion import flow
from trainer.resolve import resolve_config
from trainer.config.schema import ConfigError
from trainer.optim.ema import EMA
from trainer.models.dit.family import DiTFamily
from trainer.models.dit.module import VideoDiT
from trainer.stages import dmd_sgf as D
from trainer.stages import rollout as R

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
B, C, T, H, W, L, TEXT_DIM = 2, 2, 6, 4, 4, 5, 6


def tiny(causal: bool = True, seed: int = 0, dtype=torch.float64) -> VideoDiT:
    """A small model with non-zero modulation, so every path carries signal."""
    torch.manual_seed(seed)
    model = VideoDiT(in_channels=C, hidden_size=16, num_attention_heads=2, num_layers=2,
                     patch_size=(1, 2, 2), rope_axes_dim=(2, 2, 4), text_dim=TEXT_DIM,
                     zero_init_modulation=False, causal_chunk_size=2 if causal else None)
    return model.to(dtype)


def captions(seed: int = 1, dtype=torch.float64) -> D.Captions:
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(B, L, TEXT_DIM, generator=g, dtype=dtype)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, -2:] = False
    null = torch.randn(L, TEXT_DIM, generator=g, dtype=dtype)
    null_mask = torch.zeros(L, dtype=torch.bool)
    null_mask[0] = True
    return D.Captions(text, mask, null, null_mask)


def latents(seed: int, dtype=torch.float64, frames: int = T) -> torch.Tensor:
    return torch.randn(B, C, frames, H, W, generator=torch.Generator().manual_seed(seed),
                       dtype=dtype)


def all_frames() -> torch.Tensor:
    return torch.ones(B, T, dtype=torch.bool)


# ---- the DMD gradient and the surrogate --------------------------------------------------------


@pytest.mark.parametrize("scale,same_caption", [(0.0, False), (3.0, True)])
def test_dmd_gradient_is_zero_when_critic_equals_teacher(scale, same_caption):
    teacher = tiny(causal=False, seed=3)
    critic = copy.deepcopy(teacher)
    cap = captions()
    if same_caption:  # cond == uncond: guidance changes nothing
        cap = D.Captions(cap.text, cap.mask, cap.text[0], cap.mask[0])
        cap.text[1], cap.mask[1] = cap.text[0], cap.mask[0]
    x_hat = latents(0).requires_grad_()
    s = R.frame_sigmas(torch.tensor([0.3, 0.8]), B, T, None, dtype=torch.float64)
    x_noisy = flow.interpolate(x_hat.detach(), latents(1), s)
    with torch.no_grad():
        real = D.teacher_x0(teacher, x_noisy, s, cap, scale)
        fake = D.critic_x0(critic, x_noisy, s, cap)
        g = D.dmd_gradient(x_hat.detach(), fake, real, all_frames())
    assert torch.allclose(g, torch.zeros_like(g), atol=1e-10)
    D.dmd_surrogate_loss(x_hat, g, all_frames()).backward()
    assert x_hat.grad.abs().max() <= 1e-12


def test_surrogate_gradient_is_g_over_numel_and_value_half_mean_square():
    x_hat = latents(0).requires_grad_()
    g = latents(1) * 0.3
    loss = D.dmd_surrogate_loss(x_hat, g, all_frames())
    assert loss.item() == pytest.approx(0.5 * g.square().mean().item(), rel=1e-12)
    loss.backward()
    assert torch.allclose(x_hat.grad, g / g.numel(), atol=1e-12)
    # finite differences of L(x) = 0.5 mean((x - c)^2) with c = sg(x_hat - g) held fixed
    target = (x_hat - g).detach()
    h = 1e-6
    for index in [(0, 0, 0, 0, 0), (1, 1, 3, 2, 1), (0, 1, 5, 3, 3)]:
        plus, minus = x_hat.detach().clone(), x_hat.detach().clone()
        plus[index] += h
        minus[index] -= h
        half_mse = [0.5 * (x - target).square().mean() for x in (plus, minus)]
        fd = (half_mse[0] - half_mse[1]) / (2 * h)
        assert fd.item() == pytest.approx((g[index] / g.numel()).item(), abs=1e-8)


def test_one_sgd_step_moves_the_sample_toward_the_teacher_and_away_from_the_critic():
    a = latents(5)  # the teacher's x0
    x_hat = latents(6).requires_grad_()
    g = D.dmd_gradient(x_hat.detach(), x_hat.detach(), a, all_frames())  # the critic says "x_hat"
    D.dmd_surrogate_loss(x_hat, g, all_frames()).backward()
    with torch.no_grad():
        stepped = x_hat - 10.0 * x_hat.grad
    assert (stepped - a).abs().sum() < (x_hat.detach() - a).abs().sum()
    assert ((stepped - a).abs() <= (x_hat.detach() - a).abs() + 1e-15).all()


def test_anchor_frame_is_left_out_of_normaliser_gradient_and_loss_and_nan_there_stays_there():
    mask = all_frames()
    mask[0, 0] = False  # sample 0 is image-conditioned: frame 0 is its clean anchor
    x_hat = latents(0).requires_grad_()
    real, fake = latents(1), latents(2)
    g = D.dmd_gradient(x_hat.detach(), fake, real, mask)
    poisoned = real.clone()
    poisoned[0, :, 0] = float("nan")
    fake_changed = fake.clone()
    fake_changed[0, :, 0] += 100.0
    g_poisoned = D.dmd_gradient(x_hat.detach(), fake_changed, poisoned, mask)
    assert torch.isfinite(g_poisoned).all()
    assert torch.equal(g_poisoned, g)  # the anchor frame moves neither g nor the normaliser
    assert (g[0, :, 0] == 0).all() and (g[1, :, 0] != 0).all()
    loss = D.dmd_surrogate_loss(x_hat, g_poisoned, mask)
    valid = mask[:, None, :, None, None].expand_as(g)
    assert loss.item() == pytest.approx(0.5 * g[valid].square().mean().item(), rel=1e-12)
    loss.backward()
    assert (x_hat.grad[0, :, 0] == 0).all()
    assert torch.allclose(x_hat.grad[valid], g[valid] / valid.sum(), atol=1e-14)
    # the normaliser is per sample and over valid elements only
    dist0 = (x_hat.detach() - real)[0, :, 1:].abs().mean()
    assert torch.allclose(g[0, :, 1:], (fake - real)[0, :, 1:] / dist0, atol=1e-12)


# ---- guidance conventions ---------------------------------------------------------------------


def test_reference_cfg_equals_standard_cfg_with_w_one_plus_s_on_velocities_or_x0():
    c, u, x = latents(0), latents(1), latents(2)
    sigma = 0.7
    for s in (0.0, 1.5, 3.0):
        standard = u + (1 + s) * (c - u)
        assert torch.allclose(D.reference_cfg(c, u, s), standard, atol=1e-12)
        guided_then_x0 = x - sigma * D.reference_cfg(c, u, s)
        x0_then_guided = D.reference_cfg(x - sigma * c, x - sigma * u, s)
        assert torch.allclose(guided_then_x0, x0_then_guided, atol=1e-12)


def test_teacher_x0_applies_reference_guidance_with_the_null_caption():
    teacher = tiny(causal=False, seed=3)
    cap = captions()
    x = latents(0)
    s = R.frame_sigmas(torch.tensor([0.4, 0.9]), B, T, None, dtype=torch.float64)
    with torch.no_grad():
        cond = teacher(x, s * 1000, cap.text, cap.mask)
        null = cap.null_text.expand(B, -1, -1)
        uncond = teacher(x, s * 1000, null, cap.null_mask.expand(B, -1))
        got = D.teacher_x0(teacher, x, s, cap, 3.0)
    want = flow.x0_from_velocity(x, s, D.reference_cfg(cond, uncond, 3.0))
    assert torch.allclose(got, want, atol=1e-10)


# ---- the step list ------------------------------------------------------------------------------


def test_warp_moves_the_four_step_list_onto_the_shift_5_table():
    got = R.warp_denoising_steps([1000, 750, 500, 250], 5.0)
    assert got == pytest.approx([1000.0, 937.5, 833.3333333333, 625.0], abs=1e-9)
    table = torch.cat([flow.shifted_timestep_grid(5.0), torch.zeros(1, dtype=torch.float64)])
    assert got == pytest.approx([float(table[1000 - a]) for a in (1000, 750, 500, 250)], abs=1e-9)
    assert R.warp_denoising_steps([1000, 500], 1.0) == [1000.0, 500.0]  # shift 1: identity


def test_sampler_steps_equal_the_warped_training_list_and_the_fm_grid():
    assert [s * 1000 for s in R.inference_sigmas(4, 5.0)] == pytest.approx(
        R.warp_denoising_steps([1000, 750, 500, 250], 5.0), abs=1e-9)
    assert R.inference_sigmas(3, 2.0) == pytest.approx(flow.sampling_sigmas(3, 2.0).tolist()[:-1])
    assert R.rollout_sigmas([1000, 750], 5.0, warp=False) == [1.0, 0.75]
    with pytest.raises(ValueError):
        R.warp_denoising_steps([1200], 5.0)


# ---- cadence and EMA ---------------------------------------------------------------------------


def test_student_updates_every_fifth_outer_step_after_warming_the_critic():
    student_ks = [k for k in range(30) if D.is_student_step(k, 5)]
    assert student_ks == [5, 10, 15, 20, 25]
    assert [D.outer_index(step) for step in (1, 6)] == [0, 5]
    assert D.student_updates_through(30, 5) == 5 and D.student_updates_through(6, 5) == 1
    assert D.student_updates_through(5, 5) == 0 and D.student_updates_through(0, 5) == 0


@pytest.mark.parametrize("start,first_k", [(1, 5), (3, 15), (39, 195)])
def test_ema_starting_at_student_update_s_first_updates_at_outer_step_5s(start, first_k):
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, 0.9, start=start)
    updates, first = 0, None
    for k in range(300):
        if D.is_student_step(k, 5):
            updates += 1
            if ema.update(model, updates) and first is None:
                first = k
    assert first == first_k
    assert ema.num_updates == 1 + (updates - start)


# ---- rollout, replay, cache -------------------------------------------------------------------


def run_reference(model, noise, cap, sigmas, j, seed, anchor=None, anchored=None):
    """Self-Forcing semantics: each chunk's exit forward with grad, detached cache."""
    with torch.no_grad():
        student = R.CachedStudent(model, cap.text, cap.mask)
    return R.simulate_rollout(student, noise, sigmas, j, anchor=anchor, anchored=anchored,
                              generator=torch.Generator().manual_seed(seed), grad_at_exit=True)


def run_two_pass(model, noise, cap, sigmas, j, seed, anchor=None, anchored=None):
    with torch.no_grad():
        student = R.CachedStudent(model, cap.text, cap.mask)
        first = R.simulate_rollout(student, noise, sigmas, j, anchor=anchor, anchored=anchored,
                                   generator=torch.Generator().manual_seed(seed))
    x_hat = R.replay_exit(model, first.noisy_at_exit, first.output, sigmas[j], cap.text,
                          cap.mask, anchor=anchor, anchored=anchored)
    return first, x_hat


@pytest.mark.parametrize("j,anchor_first", [(0, False), (2, True), (3, False)])
def test_two_pass_replay_equals_the_reference_chunk_by_chunk_rollout(j, anchor_first):
    model = tiny()
    cap = captions()
    sigmas = R.rollout_sigmas([1000, 750, 500, 250], 5.0, warp=True)
    noise = latents(7)
    anchored = torch.tensor([True, False]) if anchor_first else None
    anchor = latents(8)[:, :, :1] if anchor_first else None
    ref = run_reference(model, noise, cap, sigmas, j, seed=11, anchor=anchor, anchored=anchored)
    first, x_hat = run_two_pass(model, noise, cap, sigmas, j, seed=11, anchor=anchor,
                                anchored=anchored)
    assert torch.allclose(x_hat, ref.output, atol=1e-5)
    if anchor_first:
        assert torch.equal(x_hat[0, :, 0], anchor[0, :, 0])


def test_replay_gradient_adds_the_context_path_to_the_reference_gradient():
    """The choice (docs/stages.md): the replay recomputes the context's K/V with grad.

    Parameters that only act after the last attention (head, final modulation, the last
    block's attention output and MLP) cannot reach any K/V: their gradients equal the
    reference's. Parameters that make K/V (caption embedder, first block's qkv) get the
    reference's gradient plus the context path, so they differ.
    """
    model = tiny()
    cap = captions()
    sigmas = R.rollout_sigmas([1000, 750, 500, 250], 5.0, warp=True)
    noise, weight = latents(7), latents(9)

    def grads(x_out):
        model.zero_grad(set_to_none=True)
        (x_out * weight).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    ref = grads(run_reference(model, noise, cap, sigmas, 1, seed=3).output)
    tf = grads(run_two_pass(model, noise, cap, sigmas, 1, seed=3)[1])
    after_attention = [k for k in ref if k.startswith(("head.", "final_modulation.",
                                                        "blocks.1.mlp.", "blocks.1.proj."))]
    assert len(after_attention) == 10
    for k in after_attention:
        assert torch.allclose(tf[k], ref[k], atol=1e-9), k
    for k in ("text_embedder.0.weight", "blocks.0.qkv.weight"):
        assert k not in ref or not torch.allclose(tf[k], ref[k], atol=1e-6), k
        assert tf[k].abs().sum() > 0


def test_kv_cache_rollout_prediction_equals_teacher_forcing_on_committed_chunks():
    model = tiny()
    cap = captions()
    clean, noisy = latents(1), latents(2)
    t = torch.full((B, T), 600.0, dtype=torch.float64)
    tf = model.forward_teacher_forcing(noisy, clean, t, cap.text, cap.mask)
    with torch.no_grad():
        student = R.CachedStudent(model, cap.text, cap.mask)
        for start in range(0, T, 2):
            out = student.velocity(noisy[:, :, start:start + 2], t[:, start:start + 2])
            assert torch.allclose(out, tf[:, :, start:start + 2], atol=1e-5)
            student.commit(clean[:, :, start:start + 2])


class ForwardLog:
    """Records every forward_chunk / forward_teacher_forcing call: (kind, grad on, times)."""

    def __init__(self, model):
        self.calls = []
        self.commits = []
        for name in ("forward_chunk", "forward_teacher_forcing", "commit_chunk"):
            original = getattr(model, name)
            setattr(model, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def call(*args, **kwargs):
            if name == "commit_chunk":
                self.commits.append(args[0].clone())
            else:
                times = args[1] if name == "forward_chunk" else args[2]
                self.calls.append((name, torch.is_grad_enabled(), torch.as_tensor(times).clone()))
            return original(*args, **kwargs)
        return call


def test_only_the_exit_forward_runs_with_grad_and_commits_equal_the_output():
    sigmas = R.rollout_sigmas([1000, 750, 500, 250], 5.0, warp=True)
    cap, noise = captions(), latents(7)
    model = tiny()
    log = ForwardLog(model)
    ref = run_reference(model, noise, cap, sigmas, 2, seed=5)
    grad_calls = [c for c in log.calls if c[1]]
    assert len(grad_calls) == T // 2  # one exit forward per chunk
    assert len(log.calls) == (T // 2) * 3  # steps 0..j* per chunk; nothing past the exit
    assert all(torch.allclose(c[2], torch.tensor(sigmas[2] * 1000, dtype=c[2].dtype))
               for c in grad_calls)  # every chunk exits at the same j*
    assert torch.equal(torch.cat(log.commits, dim=2), ref.output.detach())

    model = tiny()
    log = ForwardLog(model)
    first, x_hat = run_two_pass(model, noise, cap, sigmas, 2, seed=5)
    assert [c[0] for c in log.calls if c[1]] == ["forward_teacher_forcing"]
    assert x_hat.requires_grad and not first.output.requires_grad
    assert torch.equal(torch.cat(log.commits, dim=2), first.output)


def test_exit_index_is_uniform_over_the_list():
    g = torch.Generator().manual_seed(0)
    draws = [R.sample_exit_index(4, g) for _ in range(400)]
    assert set(draws) == {0, 1, 2, 3}
    assert all(60 < draws.count(i) < 140 for i in range(4))


def test_sample_student_is_deterministic_and_keeps_the_first_frame():
    model = tiny(dtype=torch.float32).eval()
    cap = captions(dtype=torch.float32)
    first = torch.randn(B, C, 1, H, W)
    outs = [R.sample_student(model, cap.text, cap.mask, cap.null_text[None], cap.null_mask[None],
                             shape=(B, C, T, H, W), steps=4, guidance=w, shift=5.0,
                             generator=torch.Generator().manual_seed(0), first_frame=first)
            for w in (1.0, 1.0, 3.0)]
    assert torch.equal(outs[0], outs[1])
    assert not torch.allclose(outs[0], outs[2])
    assert torch.equal(outs[0][:, :, :1], first)
    log = ForwardLog(model)
    R.sample_student(model, cap.text, cap.mask, cap.null_text[None], cap.null_mask[None],
                     shape=(B, C, T, H, W), steps=4, guidance=1.0, shift=5.0,
                     generator=torch.Generator().manual_seed(0))
    assert len(log.calls) == 4 * (T // 2) and len(log.commits) == T // 2  # 4 NFE per chunk


# ---- a stage on tiny models ------------------------------------------------------------------


class FakeData:
    """Endless random batches in the data iterator's format."""

    def __init__(self, batch: int = B, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.batch = batch
        self.served = 0

    def next_batch(self):
        keys = list(range(self.served * self.batch, (self.served + 1) * self.batch))
        self.served += 1
        text = torch.randn(self.batch, 8, 32, generator=self.g)
        return {"latents": torch.randn(self.batch, 3, 4, 8, 8, generator=self.g),
                "text": text, "text_mask": torch.ones(self.batch, 8, dtype=torch.bool),
                "first_frame": None, "sample_keys": keys}


def stage_args(**overrides):
    argv = ["--output_dir", "/tmp/unused", "--data_path", "/tmp/unused",
            "--synthetic_data", "true", "--stage", "dmd_sgf",
            "--student_init_path", "/x", "--teacher_init_path", "/x", "--critic_init_path", "/x",
            "--transformer_config_overrides",
            "{hidden_size: 16, num_attention_heads: 2, num_layers: 2, rope_axes_dim: [2, 2, 4], "
            "causal_chunk_size: 2}",
            "--zero_init_modulation", "false", "--cfg_drop_prob", "0",
            "--train_timestep_shift", "5", "--learning_rate", "1e-3",
            "--critic_learning_rate", "1e-3", "--max_steps", "20"]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    # The init paths are placeholders: these tests build the stage, never warm start it.
    return resolve_config(None, argv, check_paths=False)


def make_stage(**overrides):
    from trainer.models.registry import model_config
    from trainer.optim.optimizers import build_lr_scheduler, build_optimizer
    from trainer.encoders.text import build_text_encoder

    args = stage_args(**overrides)
    torch.manual_seed(0)
    student = VideoDiT(**model_config(args))
    teacher = VideoDiT(**DiTFamily().bidirectional_config(model_config(args))).eval().requires_grad_(False)
    critic = copy.deepcopy(teacher).requires_grad_(True).train()
    opts = {"student": build_optimizer(student, learning_rate=1e-3),
            "critic": build_optimizer(critic, learning_rate=1e-3, betas=(0.0, 0.999))}
    scheds = {k: build_lr_scheduler(o, lr_scheduler_type="constant", warmup_steps=0,
                                    max_steps=10) for k, o in opts.items()}
    ema = EMA(student, 0.9) if args.use_ema else None
    return D.DMDSGFStage(student, teacher, critic, opts, scheds, ema, FakeData(), args,
                         build_text_encoder("standin", text_dim=32, max_tokens=8),
                         torch.device("cpu"))


def test_score_sigmas_lie_in_the_clamp_range_constant_over_frames_zero_on_anchor():
    sigma = D.sample_score_sigmas(20000, shift=5.0, min_ratio=0.02, max_ratio=0.98,
                                  generator=torch.Generator().manual_seed(0))
    raw = sigma * 1000
    assert raw.min() >= 20 - 1e-4 and raw.max() <= 980 + 1e-4
    assert (raw - 20).abs().min() < 1e-4 and (raw - 980).abs().min() < 1e-4  # both clamps hit
    assert (sigma > 0.5).float().mean() > 0.7  # shift 5 favours noise
    stage = make_stage(image_cond_prob=0.5)
    x_hat = torch.randn(4, 3, 4, 8, 8)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1, 0] = False
    s_sample, s_frames, noise, x_noisy = stage._score_point(x_hat, mask)
    assert torch.equal(s_frames[:, 1:], s_sample[:, None].expand(4, 3))
    assert s_frames[1, 0] == 0 and torch.equal(x_noisy[1, :, 0], x_hat[1, :, 0])
    assert torch.equal(s_frames[[0, 2, 3], 0], s_sample[[0, 2, 3]])


def test_critic_loss_is_zero_for_the_exact_velocity_and_never_reaches_the_student():
    x_hat = latents(0).requires_grad_()
    noise = latents(1)
    loss = D.critic_flow_loss(noise - x_hat.detach(), x_hat, noise, all_frames())
    assert loss.item() == 0.0
    stage = make_stage()
    batch = stage._next_batch()
    x_grad, mask, _ = stage.student_sample(batch, with_grad=True)
    loss = stage.critic_loss(x_grad, mask, stage._captions(batch))
    loss.backward()
    assert all(p.grad is None for p in stage.student.parameters())
    assert any(p.grad is not None for p in stage.critic.parameters())


def test_roles_change_only_on_their_own_steps_and_the_teacher_never():
    stage = make_stage(generator_update_interval=3, use_ema=True)

    def snapshot():
        return {role: [p.detach().clone() for p in m.parameters()]
                for role, m in stage.roles.items()}

    def changed(before, role):
        now = stage.roles[role].parameters()
        return any(not torch.equal(a, b) for a, b in zip(before[role], now))

    student_steps = []
    for step in range(1, 8):
        before = snapshot()
        numbers = stage.train_step(step)
        assert changed(before, "critic"), step
        assert not changed(before, "teacher"), step
        if changed(before, "student"):
            student_steps.append(step)
        assert numbers["student_updates"] == D.student_updates_through(step, 3)
        assert all(isinstance(v, (int, float)) for v in numbers.values())
    assert student_steps == [4, 7]  # k = 3, 6
    assert stage.emas["student"].num_updates == 2
    assert stage.data.served == 7 + 2  # a fresh batch for every update
    state = stage.extra_state()
    assert state["student_updates"] == 2 and "generator_loss" in state["last_generator"]


def test_data_latent_mode_replays_noised_data_without_simulation():
    stage = make_stage(rollout_mode="data_latent")
    log = ForwardLog(stage.student)
    batch = stage._next_batch()
    x_hat, mask, j = stage.student_sample(batch, with_grad=True)
    assert [c[0] for c in log.calls] == ["forward_teacher_forcing"] and not log.commits
    assert x_hat.requires_grad and x_hat.shape == batch["latents"].shape


# ---- configuration -----------------------------------------------------------------------------


def test_config_errors_name_the_keys_to_fix():
    with pytest.raises(ConfigError, match="critic_init_path"):
        stage_args(critic_init_path="null")
    with pytest.raises(ConfigError, match="student_init_path, teacher_init_path and critic"):
        stage_args(pretrained_transformer_path="/y", load_transformer_weights="true")
    with pytest.raises(ConfigError, match="causal_chunk_size"):
        stage_args(transformer_config_overrides="{hidden_size: 16, num_attention_heads: 2, "
                                               "rope_axes_dim: [2, 2, 4]}")
    with pytest.raises(ConfigError, match="two_time: false"):
        stage_args(transformer_config_overrides="{causal_chunk_size: 2, two_time: true}")
    with pytest.raises(ConfigError, match="dmd_denoising_steps"):
        stage_args(dmd_denoising_steps="[250, 500]")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        stage_args(gradient_accumulation_steps=2)


def test_teacher_config_is_the_student_config_made_bidirectional():
    config = DiTFamily().bidirectional_config({"hidden_size": 8, "causal_chunk_size": 2,
                                               "attn_window_chunks": 1, "two_time": True})
    assert config == {"hidden_size": 8, "causal_chunk_size": None, "attn_window_chunks": None,
                      "two_time": False}


# ---- end to end through train.py ------------------------------------------------------------

SMALL_MODEL = ("{in_channels: 3, hidden_size: 32, num_attention_heads: 2, num_layers: 2, "
               "patch_size: [1, 4, 4], rope_axes_dim: [4, 4, 8], text_dim: 32, qk_norm: true%s}")


def train(config: str, *extra: str, env=None, wait=True):
    cmd = [PYTHON, "trainer/train.py", "--config", config, *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def fm_checkpoint(tmp: Path, name: str, causal: bool) -> Path:
    """A 2-step FM run with EMA (SFT-like) in tmp/name."""
    out = tmp / name
    model = SMALL_MODEL % (", causal_chunk_size: 2" if causal else "")
    train("config/tiny/pretrain.yaml", "--max_steps", "2", "--train_batch_size", "4",
          "--synthetic_num_samples", "32", "--data_path", str(tmp / "data"),
          "--output_dir", str(out), "--use_ema", "true", "--warmup_steps", "0",
          "--transformer_config_overrides", model, "--validation_interval", "-1")
    return out


def stage2_argv(tmp: Path, out: Path, sft: Path, student: Path) -> list[str]:
    return ["--student_init_path", str(student), "--teacher_init_path", str(sft),
            "--critic_init_path", str(sft), "--data_path", str(tmp / "data"),
            "--synthetic_num_samples", "32", "--train_batch_size", "4", "--max_steps", "10",
            "--generator_update_interval", "3", "--save_interval", "2", "--log_interval", "1",
            "--ema_start_step", "1", "--output_dir", str(out), "--validation_interval", "-1",
            "--transformer_config_overrides", SMALL_MODEL % ", causal_chunk_size: 2"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_stage2_trains_from_fm_checkpoints_resumes_exactly_after_a_kill_and_samples(tmp_path):
    # One FM run serves all three roles: causality adds no parameters, and a Stage1 source's
    # r_embedder.* is allowed to be dropped, not required.
    sft = student = fm_checkpoint(tmp_path, "sft", causal=False)

    straight = tmp_path / "straight"
    train("config/tiny/stage2.yaml", *stage2_argv(tmp_path, straight, sft, student))
    report = json.loads((straight / "warm-start.json").read_text())
    assert set(report["roles"]) == {"student", "teacher", "critic"}
    assert report["roles"]["student"]["member"] == "ema"
    checkpoint = straight / "checkpoint-10"
    complete = json.loads((checkpoint / "COMPLETE").read_text())
    # The frozen teacher is recorded by reference, not saved (save_frozen_teacher: false)
    assert {"student", "critic", "optimizer", "ema"} <= set(complete["members"])
    assert "teacher" not in complete["members"] and not (checkpoint / "teacher").exists()
    frozen = json.loads((checkpoint / "frozen-roles.json").read_text())
    assert list(frozen) == ["teacher"] and frozen["teacher"]["path"] == str(sft)

    killed = tmp_path / "killed"
    proc = train("config/tiny/stage2.yaml", *stage2_argv(tmp_path, killed, sft, student),
                 wait=False)
    # Killed as soon as checkpoint-2 is published (1 ms polls, no pause after): eight outer
    # steps remain, far more than a poll.
    deadline = time.time() + 300
    while not (killed / "checkpoint-2" / "COMPLETE").exists() and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    done = [int(p.name.split("-")[1]) for p in killed.glob("checkpoint-*")
            if (p / "COMPLETE").exists()]
    assert done and max(done) < 10, "the run finished before the kill; nothing was resumed"
    log = train("config/tiny/stage2.yaml", *stage2_argv(tmp_path, killed, sft, student))
    assert "resumed from" in log and "the frozen teacher is not in it; loaded again" in log

    want, got = records(straight), records(killed)
    assert [r["step"] for r in got] == list(range(1, 11))
    for a, b in zip(want, got):
        for key in ("critic_loss", "generator_loss", "student_updates", "critic_grad_norm"):
            assert a.get(key) == b.get(key), (a["step"], key)
    assert want[-1]["student_updates"] == 3 and "generator_loss" in want[-1]

    sample_dir = tmp_path / "sample"
    relay = [PYTHON, "-m", "launcher.cli"]
    proc = subprocess.run([*relay, "sample", "--checkpoint", str(straight), "--steps", "4",
                           "--guidance", "1", "--prompt", "a red square moving left",
                           "--out", str(sample_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (sample_dir / "frames.npy").is_file() and (sample_dir / "frames.png").is_file()


def test_stage2_refuses_to_resume_against_a_changed_teacher_and_can_save_it_instead(tmp_path):
    import shutil

    sft = fm_checkpoint(tmp_path, "sft", causal=False)
    teacher = tmp_path / "teacher"
    shutil.copytree(sft, teacher)
    out = tmp_path / "stage2"
    argv = [*stage2_argv(tmp_path, out, sft, sft), "--teacher_init_path", str(teacher)]
    train("config/tiny/stage2.yaml", *argv, "--max_steps", "2")
    # Other bytes of the same size in the teacher's weights (a retrained SFT written in place)
    shard = next((teacher / "checkpoint-2" / "ema").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    for dry_run in (["--dry-run"], []):  # refused at --dry-run (and relay submit), and by the job
        proc = subprocess.run([PYTHON, "trainer/train.py", "--config", "config/tiny/stage2.yaml",
                               *argv, "--max_steps", "4", *dry_run], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0, dry_run
        assert "the frozen teacher changed since checkpoint-2 was saved" in proc.stderr, dry_run
        assert "Traceback" not in proc.stderr
    assert not (out / "checkpoint-4").exists()

    # save_frozen_teacher: true keeps checkpoints self-contained
    whole = tmp_path / "whole"
    train("config/tiny/stage2.yaml", *stage2_argv(tmp_path, whole, sft, sft), "--max_steps", "2",
          "--save_frozen_teacher", "true")
    complete = json.loads((whole / "checkpoint-2" / "COMPLETE").read_text())
    assert "teacher" in complete["members"]
    assert not (whole / "checkpoint-2" / "frozen-roles.json").exists()
