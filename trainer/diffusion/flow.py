"""Flow matching: noise levels, the straight noise path, velocity targets and the FM loss.

Convention (docs/algorithms.md, "Notation and conventions"; Wan/LTX): sigma in [0, 1], sigma = 1 is pure noise,
x_sigma = (1 - sigma) * x0 + sigma * noise, velocity target v = noise - x0 (noise-ward), and the
timestep embedder receives the raw timestep N * sigma with N = NUM_TRAIN_TIMESTEPS.

Latents are laid out [B, C, T, H, W] (channels before frames), so a per-frame sigma [B, T]
broadcasts along dim 2. A per-sample sigma [B] broadcasts over any latent rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import functools
import math

import torch

from trainer.diffusion.timesteps import NUM_TRAIN_TIMESTEPS  # noqa: F401  (flow.NUM_TRAIN_TIMESTEPS)

# Every base sample is squeezed into this interval so that neither end of the path (where the
# model input is exactly data or exactly noise) is drawn. docs/algorithms.md, "Base draws".
SIGMA_MIN = 1e-5
SIGMA_MAX = 1.0 - 1e-5

SNR_TYPES = ("uniform", "lognorm", "mix", "mode")
SHIFT_MODES = ("fixed", "dynamic")
LOSS_WEIGHTINGS = ("none", "gaussian", "beta08")


# ---------------------------------------------------------------------------------------------
# Base samplers (docs/algorithms.md, "Base draws")
# ---------------------------------------------------------------------------------------------

def mode_transform(u_prime: torch.Tensor, mode_scale: float) -> torch.Tensor:
    """Map uniform draws through SD3's 'mode' density: u = 1 - u' - c*(cos^2(pi u'/2) - 1 + u').

    Returns a tensor like `u_prime`. With mode_scale = 0 the result is exactly 1 - u'.
    Kept public so the transform can be checked without the clip interval.
    """
    return 1.0 - u_prime - mode_scale * (torch.cos(math.pi * u_prime / 2.0) ** 2 - 1.0 + u_prime)


def sample_base_sigma(
    batch_size: int,
    snr_type: str,
    *,
    lognorm_loc: float = 0.0,
    lognorm_scale: float = 1.0,
    mode_scale: float = 1.29,
    mix_uniform_ratio: float = 0.3,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Draw `batch_size` unshifted noise levels from the base density `snr_type`.

    Returns a float32 tensor [batch_size] on `device`, every value in [SIGMA_MIN, SIGMA_MAX]
    (each draw is affinely mapped into that interval, "Base draws"). `mix` takes a lognorm draw with
    probability 1 - mix_uniform_ratio and a uniform draw otherwise, per sample; the lognorm
    location/scale apply inside `mix` too (an assumption).
    Raises ValueError for an unknown `snr_type` (the message lists the valid ones) or a
    `mix_uniform_ratio` outside [0, 1].
    """
    if snr_type not in SNR_TYPES:
        raise ValueError(f"unknown snr_type {snr_type!r}; valid: {', '.join(SNR_TYPES)}")
    if not 0.0 <= mix_uniform_ratio <= 1.0:
        raise ValueError(f"mix_uniform_ratio must lie in [0, 1], got {mix_uniform_ratio}")
    kwargs = dict(generator=generator, device=device, dtype=torch.float32)

    def lognorm() -> torch.Tensor:
        return torch.sigmoid(lognorm_loc + lognorm_scale * torch.randn(batch_size, **kwargs))

    if snr_type == "uniform":
        u = torch.rand(batch_size, **kwargs)
    elif snr_type == "lognorm":
        u = lognorm()
    elif snr_type == "mode":
        u = mode_transform(torch.rand(batch_size, **kwargs), mode_scale)
    else:  # mix
        # Both candidates are drawn for every sample so the number of generator draws does not
        # depend on the mask (reproducible streams whatever the outcome).
        take_lognorm = torch.rand(batch_size, **kwargs) > mix_uniform_ratio
        u = torch.where(take_lognorm, lognorm(), torch.rand(batch_size, **kwargs))
    return u * (SIGMA_MAX - SIGMA_MIN) + SIGMA_MIN


# ---------------------------------------------------------------------------------------------
# Shift (docs/algorithms.md, "Shift")
# ---------------------------------------------------------------------------------------------

def _check_shift(shift: float) -> None:
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")


def shift_sigma(u, shift: float):
    """Apply the fixed shift S(u; s) = s*u / (1 + (s - 1)*u).

    `u` is a tensor or a float in [0, 1]; the result has the same type and shape. s > 1 moves
    mass toward noise; s = 1 is the identity; S(0) = 0 and S(1) = 1 for every s.
    Raises ValueError when shift <= 0.
    """
    _check_shift(shift)
    return shift * u / (1.0 + (shift - 1.0) * u)


def unshift_sigma(sigma, shift: float):
    """The inverse of `shift_sigma`: u = sigma / (s - (s - 1)*sigma), same type and shape.

    Raises ValueError when shift <= 0.
    """
    _check_shift(shift)
    return sigma / (shift - (shift - 1.0) * sigma)


def dynamic_shift(
    num_tokens: int,
    base_tokens: int = 256,
    max_tokens: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """Resolution-dependent shift s = exp(mu(L)) with mu linear in the token count L ("Shift").

    `base_shift` and `max_shift` are the values of mu (the log of the shift) at `base_tokens`
    and `max_tokens` video tokens (Flux's constants by default; unconfirmed for
    video). Outside [base_tokens, max_tokens] mu is extrapolated linearly, as Flux does.
    Returns the shift as a float, usable with `shift_sigma`.
    Raises ValueError when num_tokens < 1 or base_tokens == max_tokens.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if base_tokens == max_tokens:
        raise ValueError("dynamic shift needs base_tokens != max_tokens")
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    mu = base_shift + slope * (num_tokens - base_tokens)
    return math.exp(mu)


def sample_training_sigma(
    batch_size: int,
    *,
    snr_type: str,
    shift: float = 1.0,
    shift_mode: str = "fixed",
    num_tokens: int | None = None,
    lognorm_loc: float = 0.0,
    lognorm_scale: float = 1.0,
    mode_scale: float = 1.29,
    mix_uniform_ratio: float = 0.3,
    dynamic_base_tokens: int = 256,
    dynamic_max_tokens: int = 4096,
    dynamic_base_shift: float = 0.5,
    dynamic_max_shift: float = 1.15,
    sigma_range: tuple[float, float] = (0.0, 1.0),
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Draw the training noise levels of one batch: a base draw, then the shift ("Base draws", "Shift").

    shift_mode "fixed" uses `shift`; "dynamic" ignores it and uses
    `dynamic_shift(num_tokens, ...)`, where num_tokens counts the video tokens of one sample.
    `sigma_range` (lo, hi), 0 <= lo < hi <= 1: the shifted levels are kept inside it ("An
    expert's range"): the base draw is mapped affinely onto [S^-1(lo), S^-1(hi)] before the
    shift, so every sigma lies in [lo, hi], as many random numbers are drawn as without it,
    and with a uniform base the levels are the unrestricted ones' density on that interval.
    Returns a float32 tensor [batch_size] in (0, 1), one sigma per sample ("Noise levels").
    Raises ValueError for an unknown snr_type or shift_mode, dynamic mode without num_tokens,
    or a sigma_range outside 0 <= lo < hi <= 1.
    """
    if shift_mode not in SHIFT_MODES:
        raise ValueError(f"unknown shift_mode {shift_mode!r}; valid: {', '.join(SHIFT_MODES)}")
    if shift_mode == "dynamic":
        if num_tokens is None:
            raise ValueError("shift_mode 'dynamic' needs num_tokens (video tokens per sample)")
        shift = dynamic_shift(num_tokens, dynamic_base_tokens, dynamic_max_tokens,
                              dynamic_base_shift, dynamic_max_shift)
    u = sample_base_sigma(batch_size, snr_type, lognorm_loc=lognorm_loc,
                          lognorm_scale=lognorm_scale, mode_scale=mode_scale,
                          mix_uniform_ratio=mix_uniform_ratio, generator=generator,
                          device=device)
    lo, hi = (float(v) for v in sigma_range)
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"sigma_range must be (lo, hi) with 0 <= lo < hi <= 1, got {sigma_range}")
    if (lo, hi) != (0.0, 1.0):
        u_lo, u_hi = unshift_sigma(lo, shift), unshift_sigma(hi, shift)
        u = u_lo + (u_hi - u_lo) * u
        # (float32 rounding of the shift never carries a level across the boundary)
        return shift_sigma(u, shift).clamp(lo, hi)
    return shift_sigma(u, shift)


@dataclass(frozen=True)
class SigmaSampling:
    """How a run draws its training noise levels ("Noise levels"), typed from its keys: the
    base draw (flow_*), the shift (train_timestep_shift, or the dynamic one) and the range an
    expert trains on (train_timestep_range)."""

    snr_type: str
    lognorm_loc: float
    lognorm_scale: float
    mode_scale: float
    mix_uniform_ratio: float
    shift: float
    shift_mode: str
    dynamic_base_tokens: int
    dynamic_max_tokens: int
    dynamic_base_shift: float
    dynamic_max_shift: float
    sigma_range: tuple[float, float]

    @classmethod
    def of(cls, args) -> "SigmaSampling":
        return cls(snr_type=args.flow_snr_type, lognorm_loc=args.flow_lognorm_loc,
                   lognorm_scale=args.flow_lognorm_scale, mode_scale=args.flow_mode_scale,
                   mix_uniform_ratio=args.flow_mix_uniform_ratio,
                   shift=args.train_timestep_shift, shift_mode=args.train_timestep_shift_mode,
                   dynamic_base_tokens=args.dynamic_shift_base_tokens,
                   dynamic_max_tokens=args.dynamic_shift_max_tokens,
                   dynamic_base_shift=args.dynamic_shift_base,
                   dynamic_max_shift=args.dynamic_shift_max,
                   sigma_range=tuple(args.train_timestep_range))

    def shift_for(self, num_tokens: int) -> float:
        """The shift of a sample of `num_tokens` video tokens: fixed, or the dynamic one."""
        if self.shift_mode == "dynamic":
            return dynamic_shift(num_tokens, self.dynamic_base_tokens, self.dynamic_max_tokens,
                                 self.dynamic_base_shift, self.dynamic_max_shift)
        return self.shift

    def draw(self, batch_size: int, num_tokens: int | None, generator: torch.Generator | None,
             device=None) -> torch.Tensor:
        """sample_training_sigma with this run's settings: [batch_size] levels."""
        return sample_training_sigma(
            batch_size, snr_type=self.snr_type, lognorm_loc=self.lognorm_loc,
            lognorm_scale=self.lognorm_scale, mode_scale=self.mode_scale,
            mix_uniform_ratio=self.mix_uniform_ratio, shift=self.shift,
            shift_mode=self.shift_mode, num_tokens=num_tokens,
            dynamic_base_tokens=self.dynamic_base_tokens,
            dynamic_max_tokens=self.dynamic_max_tokens,
            dynamic_base_shift=self.dynamic_base_shift,
            dynamic_max_shift=self.dynamic_max_shift, sigma_range=self.sigma_range,
            generator=generator, device=device)


def sampling_sigmas(num_steps: int, shift: float = 1.0, *,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Noise levels of a `num_steps`-step sampler: S(1 - k/n; shift) for k = 0..n.

    Returns a tensor [num_steps + 1], strictly descending from 1 to exactly 0 (computed in
    float64, then cast to `dtype`). Raises ValueError when num_steps < 1 or shift <= 0.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigma(u, shift).to(dtype)


# ---------------------------------------------------------------------------------------------
# The straight path (docs/algorithms.md, "Notation and conventions")
# ---------------------------------------------------------------------------------------------

def _expand_sigma(sigma, like: torch.Tensor) -> torch.Tensor:
    """Shape sigma to broadcast against latents `like` ([B, ...] or [B, C, T, H, W])."""
    if not torch.is_tensor(sigma):
        return torch.tensor(sigma, dtype=like.dtype, device=like.device)
    sigma = sigma.to(dtype=like.dtype, device=like.device)
    if sigma.ndim == 0:
        return sigma
    batch = like.shape[0]
    if sigma.ndim == 1:
        if sigma.shape[0] != batch:
            raise ValueError(f"sigma has {sigma.shape[0]} entries for a batch of {batch}")
        return sigma.view(batch, *([1] * (like.ndim - 1)))
    if sigma.ndim == 2:
        if like.ndim != 5 or tuple(sigma.shape) != (batch, like.shape[2]):
            raise ValueError(
                f"per-frame sigma {tuple(sigma.shape)} needs latents [B, C, T, H, W] with "
                f"B, T = {tuple(sigma.shape)}; got latents {tuple(like.shape)}")
        return sigma.view(batch, 1, like.shape[2], 1, 1)
    raise ValueError(f"sigma must be a scalar, [B] or [B, T]; got shape {tuple(sigma.shape)}")


def interpolate(x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
    """Return x_sigma = (1 - sigma) * x0 + sigma * noise, in x0's dtype.

    `sigma` is a float, a 0-d tensor, a per-sample tensor [B] (any latent rank) or a per-frame
    tensor [B, T] (latents [B, C, T, H, W]; a frame with sigma 0 stays exactly x0).
    Raises ValueError when the shapes do not fit.
    """
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} differ in shape")
    s = _expand_sigma(sigma, x0)
    return (1.0 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Return the flow-matching target v = noise - x0 = d x_sigma / d sigma."""
    return noise - x0


def x0_from_velocity(x_sigma: torch.Tensor, sigma, velocity: torch.Tensor) -> torch.Tensor:
    """Return the data estimate x0 = x_sigma - sigma * v (exact on the straight path).

    `sigma` broadcasts as in `interpolate`; raises ValueError when it does not fit.
    """
    return x_sigma - _expand_sigma(sigma, x_sigma) * velocity


# ---------------------------------------------------------------------------------------------
# Loss weights and the FM loss (docs/algorithms.md, "Loss weights", "The FM loss")
# ---------------------------------------------------------------------------------------------

def shifted_timestep_grid(shift: float,
                          num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """Return the discrete raw-timestep table N * S(1 - i/N; shift) for i = 0..N-1.

    A float64 tensor [N], descending from N to N * S(1/N). Raises ValueError when shift <= 0.
    """
    u = torch.linspace(1.0, 0.0, num_train_timesteps + 1, dtype=torch.float64)[:-1]
    return num_train_timesteps * shift_sigma(u, shift)


@functools.lru_cache(maxsize=16)
def _timestep_weights_cached(kind: str, shift: float, num_train_timesteps: int) -> torch.Tensor:
    n = num_train_timesteps
    grid = shifted_timestep_grid(shift, n)
    if kind == "none":
        return torch.ones(n, dtype=torch.float64)
    if kind == "gaussian":
        raw = torch.exp(-2.0 * ((grid - n / 2) / n) ** 2)
        raw = raw - raw.min()
    else:  # beta08
        tau = grid / n
        raw = tau ** 1.0 * (1.0 - tau) ** 0.5
    # Normalised to sum N so the mean weight over the grid is 1 and the loss scale is unchanged.
    return raw * n / raw.sum()


def timestep_weights(kind: str, shift: float = 1.0,
                     num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """Loss weight of every point of `shifted_timestep_grid(shift)` ("Loss weights").

    Returns a float64 tensor [N] aligned with the grid, with mean 1: "none" is all ones,
    "gaussian" peaks at raw t = N/2 and has minimum 0, "beta08" is tau * sqrt(1 - tau) on
    tau = grid / N. Raises ValueError for an unknown kind or shift <= 0.
    """
    if kind not in LOSS_WEIGHTINGS:
        raise ValueError(f"unknown loss weighting {kind!r}; valid: {', '.join(LOSS_WEIGHTINGS)}")
    _check_shift(shift)
    return _timestep_weights_cached(kind, float(shift), int(num_train_timesteps)).clone()


def loss_weight(sigma: torch.Tensor, kind: str, shift: float = 1.0,
                num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """Per-sample loss weight w(sigma): the weight of the grid point nearest to N * sigma.

    Returns a float32 tensor shaped like `sigma`, on its device ("none" gives ones without
    touching the grid). Raises ValueError for an unknown kind or shift <= 0.
    """
    if kind not in LOSS_WEIGHTINGS:
        raise ValueError(f"unknown loss weighting {kind!r}; valid: {', '.join(LOSS_WEIGHTINGS)}")
    if kind == "none":
        return torch.ones_like(sigma, dtype=torch.float32)
    grid = shifted_timestep_grid(shift, num_train_timesteps).to(sigma.device)
    weights = timestep_weights(kind, shift, num_train_timesteps).to(sigma.device)
    raw = sigma.detach().reshape(-1, 1).to(torch.float64) * num_train_timesteps
    nearest = (grid.unsqueeze(0) - raw).abs().argmin(dim=1)
    return weights[nearest].to(torch.float32).reshape(sigma.shape)


def flow_matching_loss(
    pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    frame_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-matching loss of a velocity prediction against noise - x0 ("The FM loss"), in float32.

    Each sample's loss is the mean squared error over its elements; with `frame_mask` [B, T]
    (latents [B, C, T, H, W]) frames marked False contribute nothing, neither value nor
    gradient, and the mean runs over the valid elements only (a sample with no valid frame
    scores 0). The batch loss is the mean over samples of weight * per-sample loss
    (`weight` [B], default 1).
    Returns (loss, per_sample_losses): a 0-d tensor and the unweighted per-sample losses [B],
    both attached to the graph. Raises ValueError when shapes do not fit.
    """
    if not (pred.shape == x0.shape == noise.shape):
        raise ValueError(f"pred {tuple(pred.shape)}, x0 {tuple(x0.shape)} and noise "
                         f"{tuple(noise.shape)} must have the same shape")
    batch = pred.shape[0]
    diff = pred.float() - velocity_target(x0.float(), noise.float())
    if frame_mask is None:
        per_sample = diff.square().reshape(batch, -1).mean(dim=1)
    else:
        if pred.ndim != 5 or tuple(frame_mask.shape) != (batch, pred.shape[2]):
            raise ValueError(f"frame_mask {tuple(frame_mask.shape)} needs latents "
                             f"[B, C, T, H, W] with B, T matching; got {tuple(pred.shape)}")
        mask = frame_mask.to(device=pred.device, dtype=torch.bool)[:, None, :, None, None]
        mask = mask.expand_as(diff)
        # where() before squaring: a masked element gets exactly zero gradient even if the
        # prediction there is inf or NaN (multiplying by 0 would give NaN).
        diff = torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))
        valid = mask.reshape(batch, -1).sum(dim=1).clamp_min(1)
        per_sample = diff.square().reshape(batch, -1).sum(dim=1) / valid
    if weight is None:
        loss = per_sample.mean()
    else:
        if weight.shape != (batch,):
            raise ValueError(f"weight must have shape ({batch},), got {tuple(weight.shape)}")
        loss = (weight.to(per_sample) * per_sample).mean()
    return loss, per_sample


# ---- classifier-free guidance ----------------------------------------------------------

def guided(model_fn, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, mask: torch.Tensor,
           null_text: torch.Tensor, null_mask: torch.Tensor, guidance: float, **kw) -> torch.Tensor:
    """The guided prediction u + w (c - u), with both branches in one batched forward."""
    if guidance == 1.0:
        return model_fn(x, t, text, mask, **kw)
    cond, uncond = both_branches(model_fn, x, t, text, mask, null_text, null_mask, **kw)
    return uncond + guidance * (cond - uncond)


def both_branches(model_fn, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor,
                  mask: torch.Tensor, null_text: torch.Tensor, null_mask: torch.Tensor,
                  **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, u): the conditional and the null-caption predictions, in one batched forward."""
    b = x.shape[0]
    null_text = null_text.to(text).expand(b, -1, -1)
    null_mask = null_mask.to(mask.device).expand(b, -1)
    length = max(text.shape[1], null_text.shape[1])
    texts = torch.cat([_pad(text, length), _pad(null_text, length)])
    masks = torch.cat([_pad(mask, length), _pad(null_mask, length)])
    kw2 = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    cond, uncond = model_fn(torch.cat([x, x]), torch.cat([t, t]), texts, masks, **kw2).chunk(2)
    return cond, uncond


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    pad = x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)
