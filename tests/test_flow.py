"""Flow matching: samplers, shift, path identities, loss weights and the FM loss.

docs/algorithms.md, "Noise levels" and "The FM loss", property by property.
"""

import math

import pytest
import torch

from trainer.diffusion import flow

torch.set_num_threads(1)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- shift -----------------------------------------------------------------------------------

@pytest.mark.parametrize("u, expected", [(0.25, 0.625), (0.5, 5 / 6), (0.75, 0.9375)])
def test_shift_five_matches_worked_examples(u, expected):
    assert flow.shift_sigma(u, 5.0) == pytest.approx(expected, abs=1e-12)


def test_shift_fixes_endpoints():
    for s in (0.3, 1.0, 3.0, 5.0, 12.0):
        assert flow.shift_sigma(0.0, s) == 0.0
        assert flow.shift_sigma(1.0, s) == pytest.approx(1.0, abs=1e-15)


def test_shift_of_one_is_identity():
    u = torch.rand(1000, generator=_gen(), dtype=torch.float64)
    assert torch.equal(flow.shift_sigma(u, 1.0), u)


def test_shift_is_strictly_monotone():
    u = torch.linspace(0, 1, 1001, dtype=torch.float64)
    for s in (0.5, 1.0, 5.0):
        assert (flow.shift_sigma(u, s).diff() > 0).all()


def test_shift_rejects_non_positive():
    with pytest.raises(ValueError, match="shift"):
        flow.shift_sigma(0.5, 0.0)


def test_dynamic_shift_equals_exponential_time_shift():
    g = _gen(1)
    u = torch.rand(2000, generator=g, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    mu = torch.randn(2000, generator=g, dtype=torch.float64)
    flux_form = torch.exp(mu) / (torch.exp(mu) + (1 / u - 1))
    shifted = torch.stack([flow.shift_sigma(ui, math.exp(mi)) for ui, mi in zip(u, mu)])
    assert torch.allclose(flux_form, shifted, atol=1e-12, rtol=0)


def test_dynamic_shift_hits_configured_mu_at_both_token_counts():
    assert flow.dynamic_shift(256) == pytest.approx(math.exp(0.5))
    assert flow.dynamic_shift(4096) == pytest.approx(math.exp(1.15))
    assert flow.dynamic_shift(2176) == pytest.approx(math.exp((0.5 + 1.15) / 2))
    assert flow.dynamic_shift(128, base_tokens=128, max_tokens=512,
                              base_shift=1.0, max_shift=2.0) == pytest.approx(math.e)


# --- base samplers ---------------------------------------------------------------------------

def test_mode_transform_without_scale_is_one_minus_u():
    u = torch.rand(10000, generator=_gen())
    assert torch.equal(flow.mode_transform(u, 0.0), 1.0 - u)


def test_mode_sampler_without_scale_is_clipped_one_minus_uniform():
    got = flow.sample_base_sigma(64, "mode", mode_scale=0.0, generator=_gen(3))
    u = torch.rand(64, generator=_gen(3))
    assert torch.allclose(got, (1 - u) * (flow.SIGMA_MAX - flow.SIGMA_MIN) + flow.SIGMA_MIN,
                          atol=1e-7, rtol=0)


@pytest.mark.parametrize("snr_type", ["mode", "lognorm"])
def test_symmetric_samplers_have_mean_one_half(snr_type):
    sigma = flow.sample_base_sigma(200_000, snr_type, generator=_gen(4))
    assert sigma.double().mean().item() == pytest.approx(0.5, abs=0.005)


def test_mix_takes_uniform_draws_at_the_configured_ratio():
    # A lognorm location of 30 puts every lognorm draw at the top clip bound; uniform draws
    # land below 0.999 except one in a thousand, so the fraction below counts uniform draws.
    n = 100_000
    for ratio in (0.3, 0.6):
        sigma = flow.sample_base_sigma(n, "mix", lognorm_loc=30.0, mix_uniform_ratio=ratio,
                                       generator=_gen(5))
        frac_uniform = (sigma < 0.999).double().mean().item() / 0.999
        assert frac_uniform == pytest.approx(ratio, abs=0.01)


@pytest.mark.parametrize("snr_type", flow.SNR_TYPES)
@pytest.mark.parametrize("loc", [-40.0, 0.0, 40.0])
def test_base_samples_stay_inside_clip_interval(snr_type, loc):
    sigma = flow.sample_base_sigma(20_000, snr_type, lognorm_loc=loc, generator=_gen(6))
    assert sigma.dtype == torch.float32 and sigma.shape == (20_000,)
    assert sigma.min().item() >= flow.SIGMA_MIN * (1 - 1e-6)
    assert sigma.max().item() <= flow.SIGMA_MAX


def test_extreme_lognorm_reaches_both_clip_bounds():
    low = flow.sample_base_sigma(100, "lognorm", lognorm_loc=-40.0, generator=_gen())
    high = flow.sample_base_sigma(100, "lognorm", lognorm_loc=40.0, generator=_gen())
    assert torch.allclose(low, torch.full_like(low, flow.SIGMA_MIN))
    assert torch.allclose(high, torch.full_like(high, flow.SIGMA_MAX))


def test_unknown_snr_type_lists_valid_ones():
    with pytest.raises(ValueError, match="uniform, lognorm, mix, mode"):
        flow.sample_base_sigma(4, "logit")


def test_sampler_is_reproducible_from_generator():
    a = flow.sample_base_sigma(32, "mix", generator=_gen(9))
    b = flow.sample_base_sigma(32, "mix", generator=_gen(9))
    assert torch.equal(a, b)


# --- training sigma --------------------------------------------------------------------------

def test_training_sigma_fixed_shift_is_shifted_base_draw():
    base = flow.sample_base_sigma(128, "lognorm", generator=_gen(2))
    got = flow.sample_training_sigma(128, snr_type="lognorm", shift=3.0, generator=_gen(2))
    assert torch.allclose(got, flow.shift_sigma(base, 3.0))


def test_training_sigma_dynamic_shift_uses_token_count_not_fixed_shift():
    base = flow.sample_base_sigma(128, "uniform", generator=_gen(2))
    got = flow.sample_training_sigma(128, snr_type="uniform", shift=7.0, shift_mode="dynamic",
                                     num_tokens=4096, generator=_gen(2))
    assert torch.allclose(got, flow.shift_sigma(base, math.exp(1.15)))


def test_training_sigma_dynamic_without_tokens_raises():
    with pytest.raises(ValueError, match="num_tokens"):
        flow.sample_training_sigma(4, snr_type="uniform", shift_mode="dynamic")


def test_training_sigma_unknown_shift_mode_raises():
    with pytest.raises(ValueError, match="fixed, dynamic"):
        flow.sample_training_sigma(4, snr_type="uniform", shift_mode="static")


def test_unshift_inverts_the_shift():
    u = torch.linspace(0.0, 1.0, 101, dtype=torch.float64)
    for s in (0.5, 1.0, 3.0, 12.0):
        assert torch.allclose(flow.unshift_sigma(flow.shift_sigma(u, s), s), u, atol=1e-12)


@pytest.mark.parametrize("snr_type, shift_mode", [("uniform", "fixed"), ("lognorm", "fixed"),
                                                  ("mix", "dynamic")])
@pytest.mark.parametrize("span", [(0.875, 1.0), (0.0, 0.875), (0.2, 0.3)])
def test_a_sigma_range_keeps_every_draw_inside_and_draws_as_many_numbers(snr_type, shift_mode,
                                                                         span):
    kw = dict(snr_type=snr_type, shift=3.0, shift_mode=shift_mode, num_tokens=1024)
    g_full, g_range = _gen(4), _gen(4)
    full = flow.sample_training_sigma(4096, generator=g_full, **kw)
    kept = flow.sample_training_sigma(4096, sigma_range=span, generator=g_range, **kw)
    assert kept.dtype == torch.float32
    assert span[0] <= kept.min().item() and kept.max().item() <= span[1]
    assert kept.max() - kept.min() > 0.5 * (span[1] - span[0])  # spread over the range
    # the same numbers consumed: what a sample draws next (its noise) is what it was
    assert torch.equal(torch.rand(8, generator=g_full), torch.rand(8, generator=g_range))
    # each draw keeps its rank: the map is monotone in the unrestricted draw
    assert (kept[full.argsort()].diff() >= -1e-6).all()  # (float32 ties aside)


def test_a_sigma_range_of_uniform_draws_is_their_density_restricted_to_it():
    span = (0.875, 1.0)
    kept = flow.sample_training_sigma(50_000, snr_type="uniform", shift=3.0, sigma_range=span,
                                      generator=_gen(5))
    full = flow.sample_training_sigma(400_000, snr_type="uniform", shift=3.0, generator=_gen(6))
    inside = full[(full >= span[0]) & (full <= span[1])]
    q = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    assert torch.allclose(kept.quantile(q), inside.quantile(q), atol=3e-3)


def test_a_sigma_range_outside_zero_one_or_reversed_raises():
    for span in ((0.5, 0.5), (0.9, 0.1), (-0.1, 0.5), (0.0, 1.1)):
        with pytest.raises(ValueError, match="0 <= lo < hi <= 1"):
            flow.sample_training_sigma(4, snr_type="uniform", sigma_range=span)


def test_larger_shift_trains_noisier():
    lo = flow.sample_training_sigma(50_000, snr_type="uniform", shift=1.0, generator=_gen())
    hi = flow.sample_training_sigma(50_000, snr_type="uniform", shift=5.0, generator=_gen())
    assert hi.mean() > lo.mean() + 0.2


# --- sampler grid ----------------------------------------------------------------------------

def test_sampling_sigmas_descend_from_one_to_zero():
    sig = flow.sampling_sigmas(8, shift=5.0)
    assert sig.shape == (9,)
    assert sig[0].item() == pytest.approx(1.0) and sig[-1].item() == 0.0
    assert (sig.diff() < 0).all()
    assert sig[6].item() == pytest.approx(0.625)  # S(1 - 6/8; 5) = S(0.25; 5)


# --- path identities and broadcasting --------------------------------------------------------

def _latents(b=3, c=4, t=5, h=2, w=3, seed=0):
    g = _gen(seed)
    return torch.randn(b, c, t, h, w, generator=g), torch.randn(b, c, t, h, w, generator=g)


@pytest.mark.parametrize("per_frame", [False, True])
def test_velocity_recovers_data(per_frame):
    x0, noise = _latents()
    shape = (3, 5) if per_frame else (3,)
    sigma = torch.rand(shape, generator=_gen(1))
    x_t = flow.interpolate(x0, noise, sigma)
    v = flow.velocity_target(x0, noise)
    assert torch.allclose(flow.x0_from_velocity(x_t, sigma, v), x0, atol=1e-6)


def test_per_sample_sigma_equals_constant_per_frame_sigma():
    x0, noise = _latents()
    sigma = torch.tensor([0.1, 0.5, 0.9])
    per_frame = sigma[:, None].expand(3, 5)
    assert torch.equal(flow.interpolate(x0, noise, sigma),
                       flow.interpolate(x0, noise, per_frame))


def test_per_frame_sigma_broadcasts_along_frame_axis():
    x0, noise = _latents()
    sigma = torch.rand(3, 5, generator=_gen(2))
    got = flow.interpolate(x0, noise, sigma)
    for b in range(3):
        for t in range(5):
            s = sigma[b, t]
            assert torch.allclose(got[b, :, t], (1 - s) * x0[b, :, t] + s * noise[b, :, t])


def test_anchored_frame_with_zero_sigma_stays_data():
    x0, noise = _latents()
    sigma = torch.full((3, 5), 0.7)
    sigma[:, 0] = 0.0
    x_t = flow.interpolate(x0, noise, sigma)
    assert torch.equal(x_t[:, :, 0], x0[:, :, 0])
    assert not torch.allclose(x_t[:, :, 1], x0[:, :, 1])


def test_interpolate_endpoints_are_data_and_noise():
    x0, noise = _latents()
    assert torch.equal(flow.interpolate(x0, noise, 0.0), x0)
    assert torch.equal(flow.interpolate(x0, noise, torch.ones(3)), noise)


def test_interpolate_rejects_mismatched_sigma():
    x0, noise = _latents()
    with pytest.raises(ValueError):
        flow.interpolate(x0, noise, torch.rand(4))
    with pytest.raises(ValueError):
        flow.interpolate(x0, noise, torch.rand(3, 4))


def test_interpolate_keeps_latent_dtype():
    x0, noise = _latents()
    out = flow.interpolate(x0.bfloat16(), noise.bfloat16(), torch.rand(3))
    assert out.dtype == torch.bfloat16


# --- loss weights ----------------------------------------------------------------------------

@pytest.mark.parametrize("shift", [1.0, 5.0])
def test_gaussian_weights_have_unit_mean_zero_min_and_peak_at_500(shift):
    w = flow.timestep_weights("gaussian", shift)
    grid = flow.shifted_timestep_grid(shift)
    assert w.shape == grid.shape == (1000,)
    assert w.mean().item() == pytest.approx(1.0, abs=1e-9)
    assert w.min().item() == 0.0
    assert grid[w.argmax()].item() == pytest.approx(500.0, abs=2.0)


def test_beta08_and_none_weights_have_unit_mean():
    for kind in ("beta08", "none"):
        assert flow.timestep_weights(kind, 3.0).mean().item() == pytest.approx(1.0, abs=1e-9)


def test_grid_is_shifted_descending_table():
    grid = flow.shifted_timestep_grid(5.0)
    assert grid[0].item() == pytest.approx(1000.0)
    assert grid[750].item() == pytest.approx(625.0)  # 1000 * S(0.25; 5)
    assert (grid.diff() < 0).all()


def test_loss_weight_reads_nearest_grid_point():
    w = flow.timestep_weights("gaussian", 1.0)
    grid = flow.shifted_timestep_grid(1.0)
    sigma = torch.tensor([0.5, 0.5004, 0.1234, 0.999])
    got = flow.loss_weight(sigma, "gaussian", 1.0)
    expected = [w[(grid - 1000 * s).abs().argmin()] for s in sigma.double()]
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float32))
    assert got[0] == got.max() == pytest.approx(w.max().item())
    assert got.dtype == torch.float32 and got.shape == sigma.shape


def test_loss_weight_none_is_ones_and_unknown_kind_raises():
    assert torch.equal(flow.loss_weight(torch.rand(4), "none"), torch.ones(4))
    with pytest.raises(ValueError, match="none, gaussian, beta08"):
        flow.loss_weight(torch.rand(4), "snr")


# --- FM loss ---------------------------------------------------------------------------------

def test_oracle_prediction_has_zero_loss():
    x0, noise = _latents()
    loss, per_sample = flow.flow_matching_loss(noise - x0, x0, noise)
    assert loss.item() == 0.0 and torch.equal(per_sample, torch.zeros(3))


def test_loss_is_weighted_mean_of_per_sample_mse():
    x0, noise = _latents()
    pred = torch.randn_like(x0)
    weight = torch.tensor([0.0, 1.0, 2.0])
    loss, per_sample = flow.flow_matching_loss(pred, x0, noise, weight=weight)
    mse = ((pred - (noise - x0)) ** 2).flatten(1).mean(1)
    assert torch.allclose(per_sample, mse)
    assert loss.item() == pytest.approx((weight * mse).mean().item(), rel=1e-6)


def test_constant_prediction_moves_toward_mean_velocity():
    x0, noise = _latents(b=16)
    a = torch.zeros(4, 5, 2, 3, requires_grad=True)
    with torch.no_grad():
        a += 0.3 * torch.randn(a.shape, generator=_gen(7))
    before = a.detach().clone()
    opt = torch.optim.SGD([a], lr=0.1)
    loss, _ = flow.flow_matching_loss(a.expand_as(x0), x0, noise)
    loss.backward()
    opt.step()
    target = (noise - x0).mean(0)
    step = a.detach() - before
    assert (torch.sign(step) == torch.sign(target - before)).all()
    assert ((a.detach() - target).abs() < (before - target).abs()).all()


def test_masked_frame_adds_no_loss_and_no_gradient():
    x0, noise = _latents()
    pred = torch.randn_like(x0)
    pred[:, :, 0] = float("nan")  # garbage in the anchored frame must not leak
    pred.requires_grad_(True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[:, 0] = False
    loss, per_sample = flow.flow_matching_loss(pred, x0, noise, frame_mask=mask)
    loss.backward()
    expected = ((pred.detach()[:, :, 1:] - (noise - x0)[:, :, 1:]) ** 2).flatten(1).mean(1)
    assert torch.allclose(per_sample, expected)
    assert torch.equal(pred.grad[:, :, 0], torch.zeros_like(pred.grad[:, :, 0]))
    assert (pred.grad[:, :, 1:] != 0).all()


def test_masked_mean_runs_over_valid_elements_per_sample():
    x0, noise = _latents(b=2)
    pred = noise - x0
    pred[:, :, 3] += 2.0  # error 4 per element in frame 3 only
    mask = torch.tensor([[True, True, True, True, False],
                         [False, False, False, True, False]])
    _, per_sample = flow.flow_matching_loss(pred, x0, noise, frame_mask=mask)
    assert per_sample.tolist() == pytest.approx([4.0 / 4, 4.0])


def test_sample_without_valid_frames_scores_zero():
    x0, noise = _latents(b=2)
    mask = torch.tensor([[False] * 5, [True] * 5])
    loss, per_sample = flow.flow_matching_loss(torch.randn_like(x0), x0, noise, frame_mask=mask)
    assert per_sample[0].item() == 0.0 and torch.isfinite(loss)


def test_loss_rejects_mismatched_shapes():
    x0, noise = _latents()
    with pytest.raises(ValueError):
        flow.flow_matching_loss(x0[:, :2], x0, noise)
    with pytest.raises(ValueError):
        flow.flow_matching_loss(x0, x0, noise, frame_mask=torch.ones(3, 4, dtype=torch.bool))
