"""Stage1 TF-AnyFlow (docs/algorithms.md, "Stage1: TF-AnyFlow"): its properties, the flow-map sampler, and a run end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.diffusion import flow
from trainer.resolve import resolve_config
from trainer.config.schema import ConfigError
from trainer.optim.ema import EMA
from trainer.models.dit.module import VideoDiT
from trainer.diffusion.sample_draws import SampleDraws
from trainer.stages.tf_anyflow import (
    CONSISTENCY,
    DIFFUSION,
    FLOW_MAP,
    N,
    TeacherForcingForward,
    TFAnyFlowStage,
    TimePairs,
    adaptive_rescale,
    AnyFlowSettings,
    anyflow_batch_loss,
    anyflow_residual,
    bounded_window,
    flowmap_step,
    kind_counts,
    kinds_at,
    masked_mean_square,
    pair_kinds,
    raw_time_pairs,
    reduce_anyflow_losses,
    sample_flowmap,
    sample_time_pairs,
)
from trainer.encoders.text import build_text_encoder

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
B, C, T, H, W, L, D_TEXT = 2, 2, 6, 4, 4, 5, 6
CHUNK = 2
TINY = dict(in_channels=C, hidden_size=32, num_attention_heads=2, num_layers=2, patch_size=(1, 2, 2),
            rope_axes_dim=(4, 4, 8), text_dim=D_TEXT, zero_init_modulation=False)


def tiny(**overrides) -> VideoDiT:
    """A small fp64 causal two-time model with non-zero modulation (every path carries signal)."""
    torch.manual_seed(0)
    cfg = dict(TINY, causal_chunk_size=CHUNK, two_time=True)
    cfg.update(overrides)
    return VideoDiT(**cfg).double().eval()


def data(seed=1, frames=T):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, C, frames, H, W, generator=g, dtype=torch.float64)
    noise = torch.randn(B, C, frames, H, W, generator=g, dtype=torch.float64)
    text = torch.randn(B, L, D_TEXT, generator=g, dtype=torch.float64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, -2:] = False
    return x0, noise, text, mask


def per_frame(values, frames=T):
    return torch.as_tensor(values, dtype=torch.float64)[:, None].expand(-1, frames).clone()


def tf_u(model, x0, text, mask):
    """u(z, t, r) as Stage1 evaluates it: the teacher-forcing forward with clean context x0."""
    return lambda z, t, r: model.forward_teacher_forcing(z, x0, t, text, mask, r=r)


class Recorder:
    """Wraps a u function; records each call's inputs, grad mode and output."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, z, t, r):
        out = self.fn(z, t, r)
        self.calls.append(SimpleNamespace(z=z.detach().clone(), t=t.clone(), r=r.clone(),
                                          grad_enabled=torch.is_grad_enabled(),
                                          requires_grad=out.requires_grad, out=out))
        return out


# ---- 1. r = t equals FM --------------------------------------------------------------------


@pytest.mark.parametrize("anchored", [False, True])
def test_diagonal_pairs_give_exactly_the_flow_matching_loss(anchored):
    model = tiny().float()  # flow_matching_loss works in float32
    x0, noise, text, mask = (v.float() if v.is_floating_point() else v for v in data())
    t = per_frame([730.0, 180.0]).float()
    frame_mask = torch.ones(B, T, dtype=torch.bool)
    if anchored:
        frame_mask[:, 0] = False
        t[:, 0] = 0.0
    u = tf_u(model, x0, text, mask)
    residual, _ = anyflow_residual(u, x0, noise, t, t.clone(), epsilon=5.0, frame_mask=frame_mask)
    anyflow = masked_mean_square(residual, frame_mask)
    pred = u(flow.interpolate(x0, noise, t / N), t, t)
    _, fm = flow.flow_matching_loss(pred, x0, noise, frame_mask=frame_mask)
    assert torch.equal(anyflow, fm)


# ---- 2. init identity after cloning E_r ------------------------------------------------------


def fm_checkpoint(tmp_path) -> tuple[Path, VideoDiT]:
    """A single-time FM model's state dict on disk, with E_t moved away from its init."""
    torch.manual_seed(3)
    fm = VideoDiT(**dict(TINY, causal_chunk_size=CHUNK)).double().eval()
    with torch.no_grad():
        for p in fm.time_embedder.parameters():
            p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / "fm.pt"
    torch.save(fm.state_dict(), path)
    return path, fm


def stage_for(model, ema=None, args=None):
    encoder = build_text_encoder("standin", text_dim=D_TEXT, max_tokens=L)
    return TFAnyFlowStage(model, TeacherForcingForward(model), None, None, ema, None,
                          args or SimpleNamespace(), encoder, torch.device("cpu"))


def warm_args(path):
    return SimpleNamespace(pretrained_transformer_path=str(path), pretrained_weights="live",
                           load_transformer_weights=True, warm_start_allow_missing=[],
                           warm_start_allow_unexpected=[])


def warm_start(model, path, ema=None) -> dict:
    """The warm start a Stage1 run makes (trainer.run_state), from the FM weights at `path`."""
    from trainer import run_state

    return run_state.warm_start(stage_for(model, ema, warm_args(path)))


@pytest.mark.parametrize("gate", [0.25, 0.0])
def test_warm_start_copies_e_t_into_e_r_so_the_diagonal_is_the_fm_model(tmp_path, gate):
    path, fm = fm_checkpoint(tmp_path)
    model = tiny(time_gate=gate)
    config_before = model.config
    ema = EMA(model, 0.99)
    report = warm_start(model, path, ema)
    assert report["second_time"] == "copied from the first"
    assert sorted(report["missing"]) == sorted(k for k in model.state_dict() if k.startswith("r_embedder."))
    assert model.config == config_before and model.config["two_time"] is True
    for key, value in model.state_dict().items():
        assert torch.equal(ema.shadow[key], value.float()), key  # the EMA restarts from the load
    x0, noise, text, mask = data()
    t = per_frame([640.0, 90.0])
    z = flow.interpolate(x0, noise, t / N)
    two = model.forward_teacher_forcing(z, x0, t, text, mask, r=t)
    assert torch.equal(two, fm.forward_teacher_forcing(z, x0, t, text, mask))
    off_diagonal = model.forward_teacher_forcing(z, x0, t, text, mask, r=t * 0.3)
    if gate == 0.0:  # r enters only through g E_r(r)
        assert torch.equal(off_diagonal, two)
    else:
        assert not torch.allclose(off_diagonal, two)


def test_warm_start_keeps_a_trained_e_r_and_refuses_a_partial_one(tmp_path):
    from trainer.checkpoint.store import CheckpointError

    source = tiny()
    with torch.no_grad():
        source.r_embedder.linear_1.weight.add_(1.0)
    torch.save(source.state_dict(), tmp_path / "stage1.pt")
    model = tiny()
    assert warm_start(model, tmp_path / "stage1.pt")["second_time"] == "loaded"
    assert torch.equal(model.r_embedder.linear_1.weight, source.r_embedder.linear_1.weight)
    partial = {k: v for k, v in source.state_dict().items() if k != "r_embedder.linear_2.bias"}
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match="only some of the second time"):
        warm_start(tiny(), tmp_path / "partial.pt")


# ---- 3. Gaussian oracle fixed point ----------------------------------------------------------

SD = 0.5  # data standard deviation


def sigma_of(t):
    return torch.sqrt((1 - t) ** 2 * SD ** 2 + t ** 2)


def oracle_u(x, t_raw, r_raw):
    """Exact average velocity of 1-D Gaussian data N(0, SD^2) on the straight path, per element."""
    t, r = per_el(t_raw / N, x), per_el(r_raw / N, x)
    s_t, s_r = sigma_of(t), sigma_of(r)
    v = (t - (1 - t) * SD ** 2) / s_t ** 2 * x
    gap = torch.where(t > r, t - r, torch.ones_like(t))
    return torch.where(t > r, (1 - s_r / s_t) / gap * x, v)


def per_el(values, like):
    return values[:, None, :, None, None].expand_as(like)


@pytest.mark.parametrize("t,r", [(700.0, 200.0), (900.0, 0.0), (500.0, 450.0), (300.0, 298.0)])
def test_gaussian_oracle_is_a_fixed_point_of_the_v15_residual(t, r):
    g = torch.Generator().manual_seed(0)
    x_t = 2 * torch.rand(B, C, T, H, W, generator=g, dtype=torch.float64) - 1
    t_f, r_f = per_frame([t, t]), per_frame([r, r])
    v = oracle_u(x_t, t_f, t_f)
    # choose (x0, noise) on the straight path through x_t whose velocity is the marginal one
    s = t / N
    x0, noise = x_t - s * v, x_t + (1 - s) * v
    residual, _ = anyflow_residual(oracle_u, x0, noise, t_f, r_f, epsilon=5.0)
    assert residual.abs().max() < 1e-4


# ---- 4. flow-map step exactness ------------------------------------------------------------


def test_flowmap_step_is_exact_on_a_straight_path():
    x0, noise, _, _ = data()
    t = torch.tensor([0.9, 0.35], dtype=torch.float64)
    r = torch.tensor([0.2, 0.0], dtype=torch.float64)
    x_t = flow.interpolate(x0, noise, t)
    out = flowmap_step(x_t, t, r, noise - x0)
    assert torch.allclose(out, flow.interpolate(x0, noise, r), atol=1e-12)


# ---- 5. pair sampler -----------------------------------------------------------------------


@pytest.mark.parametrize("global_batch", [8, 12, 30])
def test_pair_kinds_counts_and_order_do_not_depend_on_world_size(global_batch):
    n_d, n_c = kind_counts(global_batch, 0.5, 0.25)
    expected = [DIFFUSION] * n_d + [CONSISTENCY] * n_c + [FLOW_MAP] * (global_batch - n_d - n_c)
    assert n_d == round(0.5 * global_batch) and n_c == round(0.25 * global_batch)
    for world in (1, 2, 3, 6):
        if global_batch % world:
            continue
        b = global_batch // world
        kinds = torch.cat([pair_kinds(b, rank, world, 0.5, 0.25) for rank in range(world)])
        assert kinds.tolist() == expected, world


def test_kinds_follow_the_place_in_the_global_batch_not_the_split():
    # dp 2 x accum 2, micro-batch 3, strided keys: any split of keys 0..11 gives each key the
    # kind it has in one batch of 12
    whole = pair_kinds(12, 0, 1, 0.5, 0.25)
    for keys in (torch.arange(0, 12, 2), torch.arange(1, 12, 2), torch.tensor([11, 3, 7])):
        assert kinds_at(keys, 12, 0.5, 0.25).tolist() == whole[keys].tolist()


@pytest.mark.parametrize("sampler", ["v15", "nvlabs"])
def test_sampled_pairs_are_ordered_and_flow_map_pairs_strict(sampler):
    g = torch.Generator().manual_seed(0)
    pairs = sample_time_pairs(4000, diffusion_ratio=0.5, consistency_ratio=0.25, sampler=sampler,
                              generator=g)
    t, r = raw_time_pairs(pairs, shift=3.0)
    assert torch.all(r <= t) and torch.all(t < N) and torch.all(r >= 0)
    assert torch.equal(r[pairs.kind == DIFFUSION], t[pairs.kind == DIFFUSION])
    assert torch.all(r[pairs.kind == CONSISTENCY] == 0)
    fm = pairs.kind == FLOW_MAP
    assert torch.all(r[fm] > 0) and torch.all(r[fm] < t[fm])
    assert [(pairs.kind == k).sum().item() for k in (DIFFUSION, CONSISTENCY, FLOW_MAP)] == [2000, 1000, 1000]
    if sampler == "v15":  # t uniform: mean 1/2 before the shift; nvlabs: t = max, mean 2/3
        assert abs(pairs.t.mean().item() - 0.5) < 0.02
    else:
        assert abs(pairs.t.mean().item() - 2 / 3) < 0.02


def test_degenerate_flow_map_pairs_are_made_strict_in_the_model_dtype():
    # t = r = 0, r = 0, and t == r: draws the strict rule must repair without new randomness
    pairs = TimePairs(t=torch.tensor([0.0, 0.4, 0.7, 0.7]), r=torch.tensor([0.0, 0.0, 0.7, 0.7]),
                      kind=torch.tensor([FLOW_MAP, FLOW_MAP, FLOW_MAP, DIFFUSION]))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t, r = raw_time_pairs(pairs, shift=5.0, dtype=dtype)
        assert torch.all(r[:3] > 0) and torch.all(r[:3] < t[:3]), dtype
        assert r[3] == t[3]


# ---- 6. bounded window ---------------------------------------------------------------------


def test_bounded_window_stays_in_r_to_n_and_the_derivative_uses_its_width():
    t = per_frame([998.0, 302.0, 600.0])
    r = per_frame([100.0, 300.0, 600.0])
    t_plus, t_minus = bounded_window(t, r, 5.0)
    assert torch.all(t_plus <= N) and torch.all(t_minus >= r)
    assert t_plus[0, 0] == N and t_minus[1, 0] == 300.0
    slope = 0.37
    u_linear = lambda z, tt, rr: slope * tt[:, None, :, None, None] + 0 * z  # du/dt = slope
    x0 = torch.zeros(3, C, T, H, W, dtype=torch.float64)
    residual, extra = anyflow_residual(u_linear, x0, x0.clone(), t, r, epsilon=5.0)
    assert torch.allclose(extra["window"], t_plus - t_minus)
    # residual = u + (t - r) D - 0 with u = slope t: D == slope only with the actual width
    derivative = (residual - slope * per_el(t, residual)) / per_el((t - r).clamp_min(1e-9), residual)
    assert torch.allclose(derivative[:2], torch.full_like(derivative[:2], slope), atol=1e-9)


# ---- 7. adaptive rescale and the weight order -------------------------------------------------


def test_rescale_gives_each_non_diffusion_loss_the_diffusion_mean_and_scales_its_gradient():
    losses = torch.tensor([0.8, 1.2, 3.0, 0.05, 7.0], dtype=torch.float64, requires_grad=True)
    is_diff = torch.tensor([True, True, False, False, False])
    out, mean_d = adaptive_rescale(losses, is_diff)
    assert mean_d.item() == pytest.approx(1.0)
    assert torch.equal(out[:2], losses[:2].detach())
    assert torch.allclose(out[2:], torch.full((3,), 1.0, dtype=torch.float64), rtol=1e-3)
    grads = torch.autograd.grad(out.sum(), losses)[0]
    expected = torch.tensor([1.0, 1.0, *(1.0 / (v + 1e-5) for v in (3.0, 0.05, 7.0))], dtype=torch.float64)
    assert torch.allclose(grads, expected, rtol=1e-12)
    assert abs(out[2].item() - 1.0) / 1.0 < 1e-4


def test_rescale_is_the_identity_without_a_finite_diffusion_reference():
    losses = torch.tensor([2.0, 3.0], requires_grad=True)
    out, mean_d = adaptive_rescale(losses, torch.tensor([False, False]))
    assert torch.equal(out, losses) and mean_d.isnan()
    assert torch.equal(torch.autograd.grad(out.sum(), losses)[0], torch.ones(2))
    inf_ref = torch.tensor([float("inf"), 3.0])
    out, mean_d = adaptive_rescale(inf_ref, torch.tensor([True, False]))
    assert mean_d.isnan() and torch.equal(out, inf_ref)


def test_rescale_reference_is_gathered_over_all_ranks():
    # another rank holds losses [4, 9] with flags [diffusion, not]: adaptive_rescale gathers the
    # losses first, then the diffusion flags
    other = iter([torch.tensor([4.0, 9.0]), torch.tensor([1.0, 0.0])])
    gather = lambda v: torch.cat([v, next(other).to(v)])
    out, mean_d = adaptive_rescale(torch.tensor([2.0, 5.0]), torch.tensor([True, False]), gather=gather)
    assert mean_d.item() == pytest.approx(3.0)
    assert out[1].item() == pytest.approx(3.0, rel=1e-4)


def _rescale_on_rank(rank, world, store):
    import torch.distributed as dist

    from trainer.parallel.distributed import destroy, sum_across_ranks

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        # rank 0 holds the diffusion samples, rank 1 only flow-map ones (the global index order)
        losses = torch.tensor([1.0, 3.0]) if rank == 0 else torch.tensor([8.0, 0.5])
        out, mean_d = adaptive_rescale(losses, torch.tensor([rank == 0, rank == 0]))
        assert mean_d.item() == pytest.approx(2.0)
        if rank == 1:
            assert torch.allclose(out, torch.full((2,), 2.0), rtol=1e-4)
        assert sum_across_ranks([1.0, float(rank)]) == [2.0, 1.0]
    finally:
        destroy()  # with the pause a spawned rank needs before its interpreter exits


def test_rescale_reference_reaches_a_rank_without_diffusion_samples(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rescale_on_rank, args=(2, f"file://{tmp_path / 'store'}"), nprocs=2, join=True)


def _rescale_with_unequal_packs(rank, world, store):
    import torch.distributed as dist

    from trainer.parallel.distributed import destroy

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        # packs: rank 0 holds one diffusion sample, rank 1 three samples, one of them diffusion
        losses = torch.tensor([1.0]) if rank == 0 else torch.tensor([8.0, 3.0, 0.5])
        flags = torch.tensor([True]) if rank == 0 else torch.tensor([False, True, False])
        out, mean_d = adaptive_rescale(losses, flags)
        assert mean_d.item() == pytest.approx(2.0)
        assert out.shape == losses.shape
    finally:
        destroy()  # with the pause a spawned rank needs before its interpreter exits


def test_rescale_reference_gathers_ranks_holding_different_numbers_of_samples(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rescale_with_unequal_packs, args=(2, f"file://{tmp_path / 'store'}"), nprocs=2,
             join=True)


def test_time_weight_is_applied_after_the_rescale():
    losses = torch.tensor([1.0, 4.0, 0.5])
    is_diff = torch.tensor([True, False, False])
    weight = torch.tensor([0.5, 2.0, 0.0])
    loss, _ = reduce_anyflow_losses(losses, is_diff, weight)
    mean_d = 1.0
    solar = (1.0 * 0.5 + 4.0 * mean_d / (4.0 + 1e-5) * 2.0 + 0.0) / 3
    assert loss.item() == pytest.approx(solar, rel=1e-6)
    nvlabs = (1.0 * 0.5 + mean_d * 0.5 + mean_d * 0.5) / 3  # weight first: cancelled by the rescale
    assert abs(loss.item() - nvlabs) > 0.1


# ---- 8, 9, 10. no-grad discipline, anchor, causality (through the stage's micro-batch loss) ----


def stage_args(**overrides):
    """The run's keys at their defaults, with Stage1's loss keys set for these tests."""
    from trainer.config.schema import ARGS, ResolvedArgs

    args = {name: arg.default for name, arg in ARGS.items()}
    args.update(cfg_drop_prob=0.0, anyflow_diffusion_ratio=0.5, anyflow_consistency_ratio=0.25,
                anyflow_pair_sampler="v15", anyflow_epsilon=5.0, anyflow_fuse_guidance_scale=3.0,
                image_cond_prob=0.0, video_cond_prob=0.0, video_cond_frames=2,
                train_timestep_shift=1.0, train_timestep_shift_mode="fixed", loss_weighting="none")
    args.update(overrides)
    return ResolvedArgs(args)


class RecordingTF(torch.nn.Module):
    """The stage's u_model with every call recorded."""

    def __init__(self, model):
        super().__init__()
        self.inner = TeacherForcingForward(model)
        self.calls = []

    def forward(self, noisy, clean, t, text, text_mask=None, r=None):
        out = self.inner(noisy, clean, t, text, text_mask, r)
        self.calls.append(SimpleNamespace(noisy=noisy.detach().clone(), clean=clean, t=t.clone(),
                                          r=r.clone(), text=text, text_mask=text_mask,
                                          grad_enabled=torch.is_grad_enabled(),
                                          requires_grad=out.requires_grad))
        return out


def run_batch_loss(model, *, seed=0, batch_size=4, **overrides):
    torch.manual_seed(seed)
    x0, _, text, mask = data(seed + 1)
    x0 = torch.cat([x0, x0])[:batch_size]
    batch = {"latents": x0, "text": torch.cat([text, text])[:batch_size],
             "text_mask": torch.cat([mask, mask])[:batch_size]}
    null_text, null_mask = torch.zeros(L, D_TEXT, dtype=torch.float64), torch.zeros(L, dtype=torch.bool)
    null_mask[0] = True
    recorder = RecordingTF(model)
    loss, stats = anyflow_batch_loss(recorder, batch, AnyFlowSettings.of(stage_args(**overrides)),
                                     null_text, null_mask,
                                     num_tokens=T * 4, draws=SampleDraws(seed, 0, range(batch_size)))
    return loss, stats, recorder.calls, batch, null_text


def test_only_the_first_u_call_has_gradients():
    loss, stats, calls, batch, null_text = run_batch_loss(tiny())
    assert len(calls) == 5  # u, v_hat, u+, u-, u_null (guidance fused)
    assert [c.requires_grad for c in calls] == [True, False, False, False, False]
    assert [c.grad_enabled for c in calls] == [True, False, False, False, False]
    assert all(c.clean is batch["latents"] for c in calls)  # one clean context for all
    assert torch.equal(calls[4].text[0], null_text) and torch.equal(calls[0].text, batch["text"])
    assert torch.equal(calls[1].r, calls[1].t)  # v_hat on the diagonal
    assert stats["count_diffusion"] == 2 and stats["count_consistency"] == 1
    loss.backward()


def test_without_fusion_there_are_four_calls():
    _, _, calls, _, _ = run_batch_loss(tiny(), anyflow_fuse_guidance_scale=1.0)
    assert len(calls) == 4


def test_caption_dropped_samples_train_on_the_plain_target():
    # every caption dropped: no sample is fused (w = 1), so no null-branch call is made
    _, _, calls, _, _ = run_batch_loss(tiny(), cfg_drop_prob=1.0, anyflow_fuse_guidance_scale=3.0)
    assert len(calls) == 4


def test_fused_residual_matches_the_guided_target_divided_by_w():
    x0, noise, _, _ = data()
    t, r = per_frame([700.0, 400.0]), per_frame([300.0, 400.0])
    c, n = torch.full_like(x0, 0.3), torch.full_like(x0, -0.2)  # u(. | text), u(. | null)
    u_fn = lambda z, tt, rr: c + 0 * z
    null_fn = lambda z, tt, rr: n + 0 * z
    w = torch.tensor([3.0, 1.0], dtype=torch.float64)
    residual, _ = anyflow_residual(u_fn, x0, noise, t, r, epsilon=5.0, guidance=w, u_null_fn=null_fn)
    v = noise - x0  # D = 0 for a constant u
    assert torch.allclose(residual[0], (c[0] - (3.0 * v[0] - 2.0 * n[0])) / 3.0, atol=1e-12)
    assert torch.allclose(residual[1], c[1] - v[1], atol=1e-12)


def test_teacher_guided_residual_is_the_data_target_plus_the_teacher_direction():
    # anyflow_guidance_reference: teacher: target v + (w - 1) D, where D = T(. | c) - T(. | null)
    # at the sample's (z, t); not divided by w, and the student's null branch is not asked
    x0, noise, _, _ = data()
    t, r = per_frame([700.0, 400.0]), per_frame([300.0, 400.0])
    c, d = torch.full_like(x0, 0.3), torch.full_like(x0, 0.05)
    seen = []

    def delta_fn(z, tt):
        seen.append((z.clone(), tt.clone()))
        return d + 0 * z

    u_fn = lambda z, tt, rr: c + 0 * z
    w = torch.tensor([3.0, 1.0], dtype=torch.float64)
    residual, _ = anyflow_residual(u_fn, x0, noise, t, r, epsilon=5.0, guidance=w,
                                   delta_fn=delta_fn)
    v = noise - x0
    assert torch.allclose(residual[0], c[0] - (v[0] + 2.0 * d[0]), atol=1e-12)
    assert torch.allclose(residual[1], c[1] - v[1], atol=1e-12)
    (z, tt), = seen
    assert torch.equal(tt, t)  # the teacher sees the noisy clip at the sample's own times
    assert torch.allclose(z, x0 + (noise - x0) * (t / 1000.0)[:, None, :, None, None])


def test_a_guidance_teacher_replaces_the_students_null_branch_in_the_batch_loss():
    torch.manual_seed(3)
    teacher = VideoDiT(**TINY).double().eval().requires_grad_(False)  # bidirectional, single-time
    calls = []
    teacher.register_forward_hook(lambda m, a, kw, out: calls.append(a), with_kwargs=True)
    torch.manual_seed(0)
    x0, _, text, mask = data(1)
    batch = {"latents": torch.cat([x0, x0]), "text": torch.cat([text, text]),
             "text_mask": torch.cat([mask, mask])}
    null_text, null_mask = torch.zeros(L, D_TEXT, dtype=torch.float64), torch.zeros(L, dtype=torch.bool)
    null_mask[0] = True
    recorder = RecordingTF(tiny())
    loss, _ = anyflow_batch_loss(recorder, batch, AnyFlowSettings.of(stage_args()), null_text,
                                 null_mask, num_tokens=T * 4, draws=SampleDraws(0, 0, range(4)),
                                 teacher=teacher)
    assert len(recorder.calls) == 4  # u, v_hat, u+, u-: no null branch of the student
    (x, t, txt, msk), = calls  # one batched forward: [cond; null]
    assert x.shape[0] == 8 and torch.equal(txt[4], null_text) and torch.equal(txt[0], batch["text"][0])
    assert torch.equal(t[:4], recorder.calls[0].t)  # the student's per-frame times
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())


def test_a_causal_teacher_context_shows_each_chunk_the_clean_chunks_before_it():
    from trainer.stages.tf_anyflow import guidance_by_chunk

    x0, noise, _, _ = data()
    t = per_frame([700.0, 300.0])
    z = flow.interpolate(x0, noise, t / 1000.0)
    views = []

    def direction(zv, tv):  # a different answer per call, so the chunk each one gave is known
        views.append((zv.clone(), tv.clone()))
        return torch.full_like(zv, float(len(views)))

    out = guidance_by_chunk(direction, x0, z, t, CHUNK)
    assert len(views) == T // CHUNK
    for k, (zv, tv) in enumerate(views):
        start = k * CHUNK
        assert torch.equal(zv[:, :, :start], x0[:, :, :start])  # earlier chunks clean, time 0
        assert torch.equal(tv[:, :start], torch.zeros_like(tv[:, :start]))
        assert torch.equal(zv[:, :, start:], z[:, :, start:]) and torch.equal(tv[:, start:], t[:, start:])
        assert (out[:, :, start:start + CHUNK] == k + 1).all()  # each chunk from its own view
    assert guidance_by_chunk(lambda zv, tv: zv * 2, x0, z, t, None).equal(z * 2)


def test_anchored_frame_gets_zero_time_zero_loss_and_zero_gradient():
    model = tiny()
    _, _, calls, batch, _ = run_batch_loss(model, image_cond_prob=1.0)
    x0 = batch["latents"]
    for call in calls:
        assert torch.all(call.t[:, 0] == 0) and torch.all(call.r[:, 0] == 0)  # t, r, t+, t- all 0
        assert torch.equal(call.noisy[:, :, 0], x0[:, :, 0])
        assert torch.all(call.t[:, 1:] > 0)
    # the residual's frame 0 carries neither loss nor gradient, whatever the prediction there
    x0, noise, text, mask = data()
    pred = torch.zeros(B, C, T, H, W, dtype=torch.float64, requires_grad=True)
    first = [True]

    def u_fn(z, t, r):
        if first[0]:
            first[0] = False
            frame0 = (torch.arange(T) == 0)[None, None, :, None, None]
            return torch.where(frame0, float("nan"), pred)
        return torch.zeros_like(z)

    t = per_frame([500.0, 800.0]); t[:, 0] = 0
    r = per_frame([100.0, 0.0]); r[:, 0] = 0
    frame_mask = torch.ones(B, T, dtype=torch.bool); frame_mask[:, 0] = False
    residual, _ = anyflow_residual(u_fn, x0, noise, t, r, epsilon=5.0, frame_mask=frame_mask)
    losses = masked_mean_square(residual, frame_mask)
    assert torch.isfinite(losses).all()
    losses.sum().backward()
    assert torch.all(pred.grad[:, :, 0] == 0) and torch.all(pred.grad[:, :, 1:] != 0)


def test_every_u_call_is_causal_teacher_forcing_with_the_same_clean_context():
    model = tiny()
    x0, noise, text, mask = data()
    t, r = per_frame([620.0, 410.0]), per_frame([200.0, 0.0])
    u = Recorder(tf_u(model, x0, text, mask))
    anyflow_residual(u, x0, noise, t, r, epsilon=5.0, guidance=2.0,
                     u_null_fn=u)  # null branch through the same recorder: 5 calls
    assert len(u.calls) == 5
    for i, call in enumerate(u.calls):
        base = model.forward_teacher_forcing(call.z, x0, call.t, text, mask, r=call.r)
        for j in range(0, T, CHUNK):
            clean = x0.clone()
            clean[:, :, j:j + CHUNK] += 1.0
            moved = model.forward_teacher_forcing(call.z, clean, call.t, text, mask, r=call.r)
            change = [(moved - base)[:, :, s:s + CHUNK].abs().max().item() for s in range(0, T, CHUNK)]
            assert all(c == 0 for c in change[: j // CHUNK + 1]), (i, j, change)
            assert all(c > 0 for c in change[j // CHUNK + 1:]), (i, j, change)
            noisy = call.z.clone()
            noisy[:, :, j:j + CHUNK] += 1.0
            moved = model.forward_teacher_forcing(noisy, x0, call.t, text, mask, r=call.r)
            change = [(moved - base)[:, :, s:s + CHUNK].abs().max().item() for s in range(0, T, CHUNK)]
            assert [c > 0 for c in change] == [s == j for s in range(0, T, CHUNK)], (i, j, change)


# ---- the sampler -------------------------------------------------------------------------------


class StraightPathOracle(torch.nn.Module):
    """Returns the exact average velocity of the straight path from the sampler's noise to x0."""

    def __init__(self, x0, chunk=None):
        super().__init__()
        self.x0 = x0
        self.weight = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.config = {"causal_chunk_size": chunk}
        self.geometry = SimpleNamespace(causal_chunk_frames=chunk)  # the protocol's geometry
        self.committed = []

    def _u(self, x, t, target):
        s = t[:, None, :, None, None] / N
        noise = (x - (1 - s) * target) / s.clamp_min(1e-300)
        return torch.where(s > 0, noise - target, torch.zeros_like(x))

    def forward(self, x, t, text, text_mask=None, r=None):
        return self._u(x, t, self.x0)

    def new_kv_cache(self, text, text_mask=None):
        return SimpleNamespace()

    def forward_chunk(self, x, t, cache, frame_start, r_chunk=None):
        return self._u(x, t, self.x0[:, :, frame_start:frame_start + x.shape[2]])

    def commit_chunk(self, x, cache, frame_start):
        self.committed.append((frame_start, x.clone()))


@pytest.mark.parametrize("chunk", [None, 2, 4])
@pytest.mark.parametrize("steps", [1, 2, 4])
def test_flowmap_sampler_with_the_exact_average_velocity_lands_on_x0(chunk, steps):
    x0, _, text, mask = data(frames=6)
    model = StraightPathOracle(x0, chunk)
    null_text, null_mask = text[:1], mask[:1]
    out = sample_flowmap(model, text, mask, null_text, null_mask, shape=tuple(x0.shape), steps=steps,
                         guidance=1.0, shift=3.0, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out, x0, atol=1e-12, rtol=0)
    if chunk is not None:  # every finished chunk is committed clean, in order
        assert [s for s, _ in model.committed] == list(range(0, 6, chunk))
        for start, committed in model.committed:
            assert torch.equal(committed, out[:, :, start:start + chunk])


def reference_tf_sampling(model, text, mask, null_text, null_mask, shape, steps, guidance, shift,
                          seed, first_frame=None):
    """Chunk-by-chunk flow-map sampling where every u is a full teacher-forcing forward whose clean
    context holds the chunks finished so far (no KV cache)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).double()
    clean_frames = 0 if first_frame is None else first_frame.shape[2]
    x[:, :, :clean_frames] = first_frame if clean_frames else x[:, :, :0]
    sigmas = flow.sampling_sigmas(steps, shift, dtype=torch.float64).tolist()
    b, frames = shape[0], shape[2]
    done = torch.zeros(shape, dtype=torch.float64)

    def u(noisy, t, r, txt, msk):
        return model.forward_teacher_forcing(noisy, done, t, txt, msk, r=r)

    for start in range(0, frames, CHUNK):
        sl = slice(start, start + CHUNK)
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            t = torch.full((b, frames), s * N, dtype=torch.float64)
            r = torch.full((b, frames), s_next * N, dtype=torch.float64)
            t[:, :clean_frames], r[:, :clean_frames] = 0.0, 0.0
            noisy = torch.zeros(shape, dtype=torch.float64)
            noisy[:, :, sl] = x[:, :, sl]
            cond = u(noisy, t, r, text, mask)[:, :, sl]
            if guidance != 1.0:
                uncond = u(noisy, t, r, null_text.expand(b, -1, -1), null_mask.expand(b, -1))[:, :, sl]
                cond = uncond + guidance * (cond - uncond)
            kept = x[:, :, :clean_frames].clone()
            x[:, :, sl] = x[:, :, sl] - (s - s_next) * cond
            x[:, :, :clean_frames] = kept
        done[:, :, sl] = x[:, :, sl]
    return x


@pytest.mark.parametrize("guidance,first", [(1.0, False), (2.5, False), (1.0, True)])
def test_kv_cache_flowmap_sampling_equals_teacher_forcing_sampling(guidance, first):
    model = tiny()
    _, _, text, mask = data()
    null_text, null_mask = torch.zeros(1, L, D_TEXT, dtype=torch.float64), torch.zeros(1, L, dtype=torch.bool)
    null_mask[0, 0] = True
    shape = (B, C, T, H, W)
    first_frame = torch.randn(B, C, 1, H, W, dtype=torch.float64) if first else None
    got = sample_flowmap(model, text, mask, null_text, null_mask, shape=shape, steps=3,
                         guidance=guidance, shift=2.0, generator=torch.Generator().manual_seed(5),
                         first_frame=first_frame)
    want = reference_tf_sampling(model, text, mask, null_text, null_mask, shape, 3, guidance, 2.0, 5,
                                 first_frame)
    assert torch.allclose(got, want, atol=1e-9)
    if first:
        assert torch.equal(got[:, :, :1], first_frame)


# ---- configuration ---------------------------------------------------------------------------


def stage1_overrides(**model):
    config = dict(in_channels=3, hidden_size=96, num_attention_heads=4, num_layers=4, mlp_ratio=4.0,
                  patch_size=[2, 4, 4], rope_axes_dim=[8, 8, 8], text_dim=32, qk_norm=True,
                  causal_chunk_size=4, two_time=True, time_gate=0.25)
    config.update(model)
    return {"transformer_config_overrides": {k: v for k, v in config.items() if v is not None}}


@pytest.mark.parametrize("model,message", [
    (dict(causal_chunk_size=None), "causal_chunk_size"),
    (dict(two_time=None), "two_time: true"),
    (dict(time_gate=0.5), "anyflow_time_gate is 0.25 but the model's time_gate is 0.5"),
])
def test_stage1_config_requires_a_causal_two_time_model(model, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(str(REPO / "config/tiny/stage1.yaml"), stage1_overrides(**model), cwd=REPO)


def test_stage1_config_checks_its_ratios_and_guidance():
    with pytest.raises(ConfigError, match="exceed 1"):
        resolve_config(str(REPO / "config/tiny/stage1.yaml"),
                       {"anyflow_diffusion_ratio": 0.8, "anyflow_consistency_ratio": 0.3}, cwd=REPO)
    with pytest.raises(ConfigError, match="anyflow_fuse_guidance_scale"):
        resolve_config(str(REPO / "config/tiny/stage1.yaml"), {"anyflow_fuse_guidance_scale": 0.0},
                       cwd=REPO)
    args = resolve_config(str(REPO / "config/tiny/stage1.yaml"), {}, cwd=REPO)
    assert args.stage == "tf_anyflow" and args.pretrained_weights == "ema"


def test_a_guidance_teacher_needs_fused_guidance_and_is_kept_out_of_checkpoints():
    from trainer.stages.registry import stage_of

    with pytest.raises(ConfigError, match="anyflow_teacher_context: causal"):
        resolve_config(str(REPO / "config/tiny/stage1.yaml"),
                       {"anyflow_teacher_context": "causal"}, cwd=REPO)
    with pytest.raises(ConfigError, match="would do nothing"):
        resolve_config(str(REPO / "config/tiny/stage1.yaml"),
                       {"anyflow_guidance_reference": "teacher",
                        "anyflow_fuse_guidance_scale": 1.0}, cwd=REPO)
    args = resolve_config(str(REPO / "config/tiny/stage1.yaml"),
                          {"anyflow_guidance_reference": "teacher"}, cwd=REPO)
    declaration = stage_of(args)
    assert declaration.frozen_roles(args) == {
        "teacher": (args.pretrained_transformer_path, args.pretrained_weights,
                    "pretrained_transformer_path")}
    assert [r.name for r in declaration.memory_roles(True, args)] == ["transformer", "teacher"]
    plain = resolve_config(str(REPO / "config/tiny/stage1.yaml"), {}, cwd=REPO)
    assert stage_of(plain).frozen_roles(plain) == {}
    assert [r.name for r in stage_of(plain).memory_roles(True, plain)] == ["transformer"]


# ---- end to end --------------------------------------------------------------------------------


def run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# the tiny configs' architecture, made smaller so the tests stay short on a busy CPU
SMALL = ("in_channels: 3, hidden_size: 32, num_attention_heads: 2, num_layers: 2, "
         "patch_size: [1, 4, 4], rope_axes_dim: [4, 4, 8], text_dim: 32")
CAUSAL = "{" + SMALL + ", causal_chunk_size: 2, two_time: true, time_gate: 0.25}"


@pytest.fixture(scope="module")
def fm_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A 3-step FM run with EMA on synthetic data: (its output_dir, the data flags)."""
    tmp = tmp_path_factory.mktemp("fm")
    common = ["--synthetic_num_samples", "64", "--data_path", str(tmp / "data"),
              "--log_interval", "1"]
    run([sys.executable, "trainer/train.py", "--config", "config/tiny/pretrain.yaml",
         "--max_steps", "3", "--train_batch_size", "4", "--use_ema", "true",
         "--validation_interval", "-1", "--transformer_config_overrides", "{" + SMALL + "}",
         "--output_dir", str(tmp / "fm"), *common], REPO)
    return tmp / "fm", common


def test_stage1_trains_from_an_fm_checkpoint_and_its_checkpoint_samples(tmp_path, fm_run):
    py = sys.executable
    fm, common = fm_run
    out = tmp_path / "stage1"
    run([py, "trainer/train.py", "--config", "config/tiny/stage1.yaml", "--max_steps", "2",
         "--train_batch_size", "4", "--warmup_steps", "0", "--pretrained_transformer_path",
         str(fm), "--validation_num_captions", "2", "--output_dir", str(out),
         "--transformer_config_overrides", CAUSAL, *common], REPO)
    warm = json.loads((out / "warm-start.json").read_text())
    assert warm["second_time"] == "copied from the first"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("loss", "loss_diffusion", "loss_consistency", "loss_flowmap", "grad_norm", "lr"):
        assert math.isfinite(records[-1][key]), key
    assert "val/ema/colour_accuracy" in records[-1]
    resolved = json.loads((out / "resolved-config.json").read_text())
    assert resolved["transformer_config_overrides"]["two_time"] is True
    proc = run([py, "-m", "launcher.cli", "sample", "--checkpoint", str(out), "--steps", "2",
                "--prompt", "a red square moving left", "--out", str(tmp_path / "clip")], REPO)
    assert (tmp_path / "clip" / "frames.npy").is_file(), proc.stdout


def test_a_teacher_guided_stage1_keeps_its_teacher_out_of_checkpoints_and_resumes(tmp_path, fm_run):
    fm, common = fm_run
    out = tmp_path / "stage1"
    argv = [sys.executable, "trainer/train.py", "--config", "config/tiny/stage1.yaml",
            "--train_batch_size", "4", "--warmup_steps", "0", "--pretrained_transformer_path",
            str(fm), "--validation_interval", "-1", "--output_dir", str(out),
            "--anyflow_guidance_reference", "teacher", "--save_interval", "2",
            "--transformer_config_overrides", CAUSAL, *common]
    run([*argv, "--max_steps", "2"], REPO)
    report = json.loads((out / "warm-start.json").read_text())
    assert set(report["roles"]) == {"transformer", "teacher"}
    checkpoint = out / "checkpoint-2"
    complete = json.loads((checkpoint / "COMPLETE").read_text())
    assert "transformer" in complete["members"] and "teacher" not in complete["members"]
    frozen = json.loads((checkpoint / "frozen-roles.json").read_text())
    assert list(frozen) == ["teacher"] and frozen["teacher"]["path"] == str(fm)
    proc = run([*argv, "--max_steps", "3"], REPO)
    log = proc.stdout + proc.stderr
    assert "resumed from" in log and "the frozen teacher is not in it; loaded again" in log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
