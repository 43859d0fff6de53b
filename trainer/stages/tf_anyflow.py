"""Stage1 TF-AnyFlow: causal teacher forcing + the AnyFlow v1.5 flow-map loss (docs/algorithms.md, "Stage1: TF-AnyFlow").

The model u(x_t, t, r) predicts the average noise-ward velocity over [r, t] (two-time
embedding, "Two-time model"). Every sample of the logical data-parallel batch gets a pair (t, r) whose kind
is fixed by its global flat index ("Time pairs"): the first half trains the diagonal r = t (plain FM),
the next quarter r = 0 (the x0 map), the rest 0 < r < t. The target of the v1.5 form ("Flow-map loss")
holds the model's own finite difference along its own tangent:

    residual = (u(z, t, r) + (t - r) D - [w v_c + (1 - w) u(z, t, t | null)]) / w

Every u call is a teacher-forcing forward over [clean x0 | noisy z] with the same clean context
("Stage1: TF-AnyFlow"); only the first has gradients. Per-sample losses are rescaled toward the mean diffusion
loss, then time-weighted ("Batch reduction", SolarWM order). Choices where the references leave one are
listed in docs/stages.md ("Stage1") and pinned by tests/test_tf_anyflow.py.

`sample_flowmap` is the matching sampler ("Flow-map sampler"): any number of flow-map steps, chunk by chunk
with the KV cache for a causal model, committing each finished chunk clean.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from trainer.diffusion import flow
from trainer.models.registry import family_of, model_config
from trainer.parallel.distributed import gather_across_ranks, sum_across_ranks
from trainer.checkpoint.layout import CheckpointError
from trainer.stages.base import WarmStartSource
from trainer.stages.declarations import teacher_guided
from trainer.diffusion.sample_draws import SampleDraws
from trainer.stages.fm import FlowMatchingStage, sample_condition_frames

N = flow.NUM_TRAIN_TIMESTEPS

# Sample kinds by global flat index ("Time pairs").
DIFFUSION, CONSISTENCY, FLOW_MAP = 0, 1, 2
KIND_NAMES = {DIFFUSION: "diffusion", CONSISTENCY: "consistency", FLOW_MAP: "flowmap"}
PAIR_SAMPLERS = ("v15", "nvlabs")

# Floor of the finite-difference width (raw units) and of the rescale denominator ("Flow-map loss", "Batch reduction").
MIN_WINDOW = 1e-6
RESCALE_EPS = 1e-5

# u(z, t, r) -> prediction [B, C, T, H, W]; t and r raw per frame [B, T].
VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# (t, r) pairs ("Time pairs")
# ---------------------------------------------------------------------------------------------

class TimePairs(NamedTuple):
    """Per-sample normalized times (float32 [B], before the shift) and kinds (long [B])."""

    t: torch.Tensor
    r: torch.Tensor
    kind: torch.Tensor


def kind_counts(global_batch: int, diffusion_ratio: float,
                consistency_ratio: float) -> tuple[int, int]:
    """(n_d, n_c): how many samples of the global batch are diffusion, then consistency.

    Python's round (half to even), as the SolarWM reference does.
    """
    n_d = round(diffusion_ratio * global_batch)
    n_c = min(round(consistency_ratio * global_batch), global_batch - n_d)
    return n_d, n_c


def pair_kinds(batch_size: int, rank: int, world: int, diffusion_ratio: float,
               consistency_ratio: float) -> torch.Tensor:
    """Kinds (long [batch_size]) of a rank's samples, by their global flat index.

    Global index g = rank * batch_size + i over G = world * batch_size: g < n_d is diffusion,
    then n_c consistency, the rest flow map. The concatenation over ranks depends only on G.
    Raises ValueError for a rank outside [0, world).
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, {world}), got {rank}")
    return kinds_at(torch.arange(batch_size) + rank * batch_size, world * batch_size,
                    diffusion_ratio, consistency_ratio)


def kinds_at(positions: torch.Tensor, global_batch: int, diffusion_ratio: float,
             consistency_ratio: float) -> torch.Tensor:
    """Kinds (long) of the samples at `positions` (0 <= p < global_batch) of the global batch:
    p < n_d diffusion, then n_c consistency, the rest flow map."""
    n_d, n_c = kind_counts(global_batch, diffusion_ratio, consistency_ratio)
    kind = torch.full(positions.shape, FLOW_MAP, dtype=torch.long)
    kind[positions < n_d + n_c] = CONSISTENCY
    kind[positions < n_d] = DIFFUSION
    return kind


def sample_time_pairs(batch_size: int, *, rank: int = 0, world: int = 1,
                      diffusion_ratio: float = 0.5, consistency_ratio: float = 0.25,
                      sampler: str = "v15",
                      generator: torch.Generator | None = None) -> TimePairs:
    """Normalized (t, r) per sample, r <= t, plus the kinds of `pair_kinds` ("Time pairs").

    Two uniform draws per sample (all u1, then all u2): v15 takes t = u1, r = u2 t; nvlabs
    t = max, r = min. Diffusion samples get r = t, consistency r = 0. Strictness 0 < r < t of
    flow-map samples is enforced after the shift, in the dtype the model sees
    (`raw_time_pairs`). Raises ValueError for an unknown sampler.
    """
    if sampler not in PAIR_SAMPLERS:
        raise ValueError(f"unknown pair sampler {sampler!r}; valid: {', '.join(PAIR_SAMPLERS)}")
    u1 = torch.rand(batch_size, generator=generator)
    u2 = torch.rand(batch_size, generator=generator)
    kind = pair_kinds(batch_size, rank, world, diffusion_ratio, consistency_ratio)
    return time_pairs_from(u1, u2, kind, sampler)


def time_pairs_from(u1: torch.Tensor, u2: torch.Tensor, kind: torch.Tensor,
                    sampler: str) -> TimePairs:
    """The (t, r) pairs of sample_time_pairs from its two uniform draws per sample and kinds."""
    if sampler == "v15":
        t, r = u1, u2 * u1
    else:
        t, r = torch.maximum(u1, u2), torch.minimum(u1, u2)
    r = torch.where(kind == DIFFUSION, t, r)
    r = torch.where(kind == CONSISTENCY, torch.zeros_like(r), r)
    return TimePairs(t, r, kind)


def raw_time_pairs(pairs: TimePairs, shift: float,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_raw, r_raw) = N * S(t; s), N * S(r; s) in `dtype`, [B] each.

    The shift runs in float64. Flow-map samples are then made strict in `dtype` without new
    random draws: r_raw >= the smallest positive value and t_raw > r_raw (nextafter), so the
    shift or the cast cannot collapse them onto the diagonal or onto r = 0.
    """
    t = (N * flow.shift_sigma(pairs.t.double(), shift)).to(dtype)
    r = (N * flow.shift_sigma(pairs.r.double(), shift)).to(dtype)
    is_map = pairs.kind == FLOW_MAP
    tiny = torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype))
    strict_r = torch.where(r > 0, r, tiny)
    strict_t = torch.where(t > strict_r, t, torch.nextafter(strict_r, torch.full_like(r, 2 * N)))
    return torch.where(is_map, strict_t, t), torch.where(is_map, strict_r, r)


@dataclasses.dataclass(frozen=True)
class AnyFlowSettings:
    """The keys Stage1's loss reads, typed once per run: caption dropout, the shares of pair
    kinds and their sampler, the fused guidance, the finite-difference step, the loss weight,
    the clean-frame conditioning and the noise levels' shift (docs/algorithms.md, "Stage1")."""

    seed: int
    cfg_drop_prob: float
    diffusion_ratio: float
    consistency_ratio: float
    pair_sampler: str
    fuse_guidance_scale: float
    epsilon: float
    loss_weighting: str
    image_cond_prob: float
    video_cond_prob: float
    video_cond_frames: Any
    sigma: flow.SigmaSampling
    # The guidance teacher's view of a chunk (anyflow_teacher_context): the whole noisy clip
    # (None) or, every `teacher_chunk_frames` latent frames, the chunks before it clean.
    teacher_chunk_frames: int | None = None

    @classmethod
    def of(cls, args) -> "AnyFlowSettings":
        causal = args.get("anyflow_teacher_context", "clip") == "causal"
        chunk = (family_of(args).geometry(model_config(args)).causal_chunk_frames
                 if causal else None)
        return cls(seed=args.seed, cfg_drop_prob=args.cfg_drop_prob,
                   diffusion_ratio=args.anyflow_diffusion_ratio,
                   consistency_ratio=args.anyflow_consistency_ratio,
                   pair_sampler=args.anyflow_pair_sampler,
                   fuse_guidance_scale=float(args.anyflow_fuse_guidance_scale),
                   epsilon=args.anyflow_epsilon, loss_weighting=args.loss_weighting,
                   image_cond_prob=args.image_cond_prob, video_cond_prob=args.video_cond_prob,
                   video_cond_frames=args.video_cond_frames, sigma=flow.SigmaSampling.of(args),
                   teacher_chunk_frames=chunk)


# ---------------------------------------------------------------------------------------------
# the v1.5 residual ("Flow-map loss") and the batch reduction ("Batch reduction")
# ---------------------------------------------------------------------------------------------

def _per_frame(values: torch.Tensor) -> torch.Tensor:
    """[B, T] per-frame values shaped to broadcast over latents [B, C, T, H, W]."""
    return values[:, None, :, None, None]


def _per_sample(values: torch.Tensor) -> torch.Tensor:
    return values[:, None, None, None, None]


def bounded_window(t: torch.Tensor, r: torch.Tensor, epsilon: float,
                   frame_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_plus, t_minus) = (min(t + eps, N), max(t - eps, r)), raw, shaped like t.

    Frames outside frame_mask (clean, t = r = 0) keep t_plus = t_minus = t, so their inputs
    are never moved.
    """
    t_plus = torch.clamp(t + epsilon, max=float(N))
    t_minus = torch.maximum(t - epsilon, r)
    if frame_mask is not None:
        t_plus = torch.where(frame_mask, t_plus, t)
        t_minus = torch.where(frame_mask, t_minus, t)
    return t_plus, t_minus


def anyflow_residual(u_fn: VelocityFn, x0: torch.Tensor, noise: torch.Tensor,
                     t: torch.Tensor, r: torch.Tensor, *, epsilon: float,
                     frame_mask: torch.Tensor | None = None,
                     guidance: torch.Tensor | float = 1.0,
                     u_null_fn: VelocityFn | None = None,
                     delta_fn: GuidanceDeltaFn | None = None) -> tuple[torch.Tensor, dict]:
    """The v1.5 residual ("Flow-map loss"): [B, C, T, H, W] in float32 (float64 for float64 latents).

    x0, noise: [B, C, T, H, W]; t, r: raw times per frame [B, T] (clean frames 0, r <= t);
    z = (1 - t/N) x0 + (t/N) noise. Calls, in order: u(z, t, r) with gradients, then without:
    v = u(z, t, t), u(z + v (t+ - t)/N, t+, r), u(z - v (t - t-)/N, t-, r), and u_null(z, t, t)
    when any guidance weight differs from 1. guidance: w per sample [B] or one number.
    delta_fn(z, t) -> D: with it, the guidance's direction comes from D (a frozen teacher's
    T(z | c) - T(z | null)) instead of u_null: target v + (w - 1) D, undivided.
    Returns (residual, {"u": the prediction with gradients, "window": t+ - t-}); the residual
    is exactly u - (noise - x0) where t = r and w = 1. Raises ValueError without u_null_fn
    or delta_fn when guidance needs one.
    """
    def one_group(fn):
        return None if fn is None else (lambda zs, ts, rs: [fn(zs[0], ts[0], rs[0])])

    def one_delta(fn):
        return None if fn is None else (lambda zs, ts: [fn(zs[0], ts[0])])

    residuals, extra = anyflow_residual_groups(
        one_group(u_fn), [x0], [noise], [t], [r], epsilon=epsilon, frame_masks=[frame_mask],
        guidance=[guidance], u_null_fn=one_group(u_null_fn), delta_fn=one_delta(delta_fn))
    return residuals[0], {"u": extra["u"][0], "window": extra["window"][0]}


# u over groups of samples: (zs, ts, rs) lists -> predictions, one per group (a pack's samples).
GroupVelocityFn = Callable[[list, list, list], list]
# The guidance direction T(z | c) - T(z | null) of a frozen teacher at (z, t): one sample set,
# or (zs, ts) lists -> one per group.
GuidanceDeltaFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GroupDeltaFn = Callable[[list, list], list]


def anyflow_residual_groups(u_fn: GroupVelocityFn, x0s: list, noises: list, ts: list, rs: list,
                            *, epsilon: float, frame_masks: list, guidance: list,
                            u_null_fn: GroupVelocityFn | None = None,
                            delta_fn: GroupDeltaFn | None = None) -> tuple[list, dict]:
    """anyflow_residual over groups of samples whose shapes differ (a pack: one group a
    sample, [1, C, T_i, H_i, W_i]), with one u call per group list, so a pack runs the model
    five times, as a batch does. Every argument is a list with one entry per group, shaped as
    anyflow_residual's; guidance[i] is that group's w ([B_i] or one number). Returns
    (residuals, {"u", "window"}), lists with one entry per group.
    """
    work = torch.float64 if x0s[0].dtype == torch.float64 else torch.float32
    ws = [torch.as_tensor(w, dtype=work, device=x0.device).expand(x0.shape[0])
          for w, x0 in zip(guidance, x0s)]
    fused = any(bool((w != 1).any()) for w in ws)
    if fused and u_null_fn is None and delta_fn is None:
        raise ValueError("guidance fusion (w != 1) needs u_null_fn (the null-caption "
                         "prediction) or delta_fn (a teacher's guidance direction)")
    by_teacher = fused and delta_fn is not None
    zs = [flow.interpolate(x0, noise, t / N) for x0, noise, t in zip(x0s, noises, ts)]
    us = u_fn(zs, ts, rs)
    with torch.no_grad():
        v_hats = [v.to(work) for v in u_fn(zs, ts, ts)]
        windows = [bounded_window(t, r, epsilon, m) for t, r, m in zip(ts, rs, frame_masks)]
        z_plus = [z + (v * _per_frame((tp - t).to(work)) / N).to(z.dtype)
                  for z, v, t, (tp, _) in zip(zs, v_hats, ts, windows)]
        z_minus = [z - (v * _per_frame((t - tm).to(work)) / N).to(z.dtype)
                   for z, v, t, (_, tm) in zip(zs, v_hats, ts, windows)]
        u_plus = u_fn(z_plus, [tp for tp, _ in windows], rs)
        u_minus = u_fn(z_minus, [tm for _, tm in windows], rs)
        u_null = u_null_fn(zs, ts, ts) if fused and not by_teacher else [None] * len(zs)
        deltas = delta_fn(zs, ts) if by_teacher else [None] * len(zs)
    residuals, widths = [], []
    for i, (t_plus, t_minus) in enumerate(windows):
        with torch.no_grad():
            width = (t_plus - t_minus).to(work)
            derivative = ((u_plus[i].to(work) - u_minus[i].to(work))
                          / _per_frame(width.clamp_min(MIN_WINDOW)))
            if frame_masks[i] is not None:  # clean frames: a zero-width window, no derivative
                derivative = torch.where(_per_frame(frame_masks[i]), derivative,
                                         torch.zeros_like(derivative))
            correction = _per_frame((ts[i] - rs[i]).to(work)) * derivative
            target = flow.velocity_target(x0s[i].to(work), noises[i].to(work))
            if by_teacher:  # the data's noise is not scaled by w: no division either
                target = target + _per_sample(ws[i] - 1) * deltas[i].to(work)
            elif fused:
                target = _per_sample(ws[i]) * target + _per_sample(1 - ws[i]) * u_null[i].to(work)
        residual = us[i].to(work) + correction - target
        residuals.append(residual / _per_sample(ws[i]) if fused and not by_teacher else residual)
        widths.append(width)
    return residuals, {"u": us, "window": widths}


def masked_mean_square(residual: torch.Tensor, frame_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample mean of residual**2 over the frames in frame_mask [B, T]: [B].

    Masked elements contribute neither value nor gradient (where() before squaring, so even a
    non-finite residual there is harmless); a sample with no valid frame scores 0.
    """
    b = residual.shape[0]
    if frame_mask is None:
        return residual.square().reshape(b, -1).mean(dim=1)
    mask = _per_frame(frame_mask.to(device=residual.device, dtype=torch.bool)).expand_as(residual)
    residual = torch.where(mask, residual, torch.zeros((), dtype=residual.dtype, device=residual.device))
    valid = mask.reshape(b, -1).sum(dim=1).clamp_min(1)
    return residual.square().reshape(b, -1).sum(dim=1) / valid


def adaptive_rescale(losses: torch.Tensor, is_diffusion: torch.Tensor, *,
                     gather: Callable[[torch.Tensor], torch.Tensor] = gather_across_ranks,
                     eps: float = RESCALE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale non-diffusion per-sample losses toward the mean diffusion loss ("Batch reduction").

    mean_d = mean of the finite diffusion losses over all ranks (gathered, detached). Diffusion
    samples are returned unchanged; every other L_i becomes L_i * sg(mean_d / (L_i + eps)), so
    its value is ~mean_d and its gradient (mean_d / (L_i + eps)) grad L_i. Identity when no
    finite diffusion reference exists anywhere. Returns (losses [B], mean_d), mean_d NaN when
    there is no reference. Masked sums, not boolean indexing: nothing here makes the host wait
    for the GPU, which runs the backward pass right behind the forward.
    """
    all_losses = gather(losses.detach())
    usable = (gather(is_diffusion.to(torch.float32)) > 0.5) & torch.isfinite(all_losses)
    count = usable.sum()
    found = count > 0
    mean_d = (torch.where(usable, all_losses, 0.0).sum() / count.clamp(min=1)).to(losses)
    scale = mean_d / (losses.detach() + eps)
    scale = torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))
    rescaled = torch.where(is_diffusion | ~found, losses, losses * scale)
    return rescaled, torch.where(found, mean_d, torch.full_like(mean_d, float("nan")))


def reduce_anyflow_losses(losses: torch.Tensor, is_diffusion: torch.Tensor,
                          time_weight: torch.Tensor, *,
                          gather: Callable[[torch.Tensor], torch.Tensor] = gather_across_ranks
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch loss mean_i(rescaled L_i * w_time_i): rescale first, then the time weight
    (SolarWM order, "Batch reduction"; NVlabs weights first, which cancels the weight of rescaled samples).

    Returns (loss, mean_d) as adaptive_rescale.
    """
    rescaled, mean_d = adaptive_rescale(losses, is_diffusion, gather=gather)
    return (rescaled * time_weight.to(rescaled)).mean(), mean_d


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------

class TeacherForcingForward(nn.Module):
    """`forward` = model.forward_teacher_forcing: the stage's u calls go through one callable."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, noisy, clean, t, text, text_mask=None, r=None):
        return self.model.forward_teacher_forcing(noisy, clean, t, text, text_mask, r=r)


def with_null_captions(text: torch.Tensor, mask: torch.Tensor, drop: torch.Tensor,
                       null_text: torch.Tensor, null_mask: torch.Tensor):
    """(text, mask) with the dropped samples' captions replaced by the null caption [L, D]."""
    drop = drop.to(text.device)
    text = torch.where(drop[:, None, None], null_text.to(text)[None], text)
    mask = torch.where(drop[:, None], null_mask.to(mask.device)[None], mask)
    return text, mask


def context_view(x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor,
                 start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The clip as the causal student sees the chunk that begins at latent frame `start`: the
    frames before it clean (x0, time 0), the rest as they are (z, t). [B, C, T, H, W], [B, T]."""
    before = torch.arange(z.shape[2], device=z.device) < start
    return (torch.where(before[None, None, :, None, None], x0.to(z), z),
            torch.where(before[None, :], torch.zeros_like(t), t))


def guidance_by_chunk(direction: Callable, x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor,
                      chunk_frames: int | None) -> torch.Tensor:
    """A bidirectional teacher's guidance direction for every frame of the noisy clip z:
    direction(z, t) once on the whole clip (chunk_frames None), or per causal chunk on the view
    the student has of it (context_view: the chunks before it clean), each view's own chunk
    kept: one teacher call per chunk."""
    if chunk_frames is None:
        return direction(z, t)
    out = torch.empty_like(z)
    for start in range(0, z.shape[2], chunk_frames):
        view, view_t = context_view(x0, z, t, start)
        out[:, :, start:start + chunk_frames] = direction(view, view_t)[:, :, start:start + chunk_frames]
    return out


def anyflow_batch_loss(u_model: nn.Module, batch: dict, settings: AnyFlowSettings,
                       null_text: torch.Tensor,
                       null_mask: torch.Tensor, *, num_tokens: int,
                       draws: SampleDraws | None = None, positions: torch.Tensor | None = None,
                       global_batch: int | None = None,
                       teacher: nn.Module | None = None) -> tuple[torch.Tensor, dict]:
    """The Stage1 loss of one micro-batch ("Stage1: TF-AnyFlow") and its diagnostics.

    u_model: called as u_model(noisy, clean, t, text, text_mask, r) -> the noisy-half
    teacher-forcing prediction (TeacherForcingForward). draws: the per-sample generators
    (trainer.diffusion.sample_draws; default: samples keyed 0..B-1 at step 0). positions [B]: where the
    samples sit in the global batch of `global_batch` samples, which decides their kinds
    (default: 0..B-1 of B). teacher: the frozen bidirectional model whose guidance direction
    the fused target takes (anyflow_guidance_reference: teacher), run on the whole noisy clip
    with the sample's (possibly dropped) caption. Returns (loss, stats) where stats holds
    per-kind sums and counts of the unscaled losses and the diffusion reference.
    """
    x0 = batch["latents"]
    device, b, frames = x0.device, x0.shape[0], x0.shape[2]
    if draws is None:
        draws = SampleDraws(settings.seed, 0, range(b), device)
    if positions is None:
        positions, global_batch = torch.arange(b), b
    # One fixed order of draws per sample: caption drop, u1, u2, conditioning, noise.
    drop = (draws.uniform() < settings.cfg_drop_prob).cpu()
    text, mask = with_null_captions(batch["text"], batch["text_mask"], drop, null_text, null_mask)
    u1, u2 = draws.uniform().cpu(), draws.uniform().cpu()
    kind = kinds_at(positions, global_batch, settings.diffusion_ratio,
                    settings.consistency_ratio)
    pairs = time_pairs_from(u1, u2, kind, settings.pair_sampler)
    time_dtype = torch.float64 if x0.dtype == torch.float64 else torch.float32
    t_raw, r_raw = (v.to(device) for v in raw_time_pairs(pairs, settings.sigma.shift_for(num_tokens),
                                                         time_dtype))
    clean = sample_condition_frames(draws.uniform(), frames, image_prob=settings.image_cond_prob,
                                    video_prob=settings.video_cond_prob,
                                    video_frames=settings.video_cond_frames).to(device)
    frame_mask = torch.arange(frames, device=device)[None, :] >= clean[:, None]  # in the loss
    zero = torch.zeros((), dtype=time_dtype, device=device)
    t_frames = torch.where(frame_mask, t_raw[:, None], zero)  # clean frames: t = r = 0
    r_frames = torch.where(frame_mask, r_raw[:, None], zero)
    null_b = null_text.to(text)[None].expand(b, -1, -1)
    null_mask_b = null_mask.to(mask.device)[None].expand(b, -1)

    def u_fn(z, t, r):
        return u_model(z, x0, t, text, mask, r)

    def u_null_fn(z, t, r):
        return u_model(z, x0, t, null_b, null_mask_b, r)

    def delta_fn(z, t):
        def direction(zv, tv):
            cond, uncond = flow.both_branches(teacher, zv, tv, text, mask, null_text, null_mask)
            return cond - uncond

        return guidance_by_chunk(direction, x0, z, t, settings.teacher_chunk_frames)

    # Fusion applies to captioned samples; a dropped caption keeps the plain target (w = 1),
    # which trains u(. | null) on its own velocity.
    w = torch.where(drop, 1.0, settings.fuse_guidance_scale).to(device)
    residual, _ = anyflow_residual(u_fn, x0, draws.normal_like(x0), t_frames, r_frames,
                                   epsilon=settings.epsilon, frame_mask=frame_mask,
                                   guidance=w, u_null_fn=u_null_fn,
                                   delta_fn=None if teacher is None else delta_fn)
    losses = masked_mean_square(residual, frame_mask)
    kind = pairs.kind.to(device)
    weight = flow.loss_weight((t_raw / N).float(), settings.loss_weighting,
                              settings.sigma.shift_for(num_tokens))
    loss, mean_d = reduce_anyflow_losses(losses, kind == DIFFUSION, weight)
    return loss, _kind_stats(losses.detach(), pairs.kind, mean_d)


class TeacherForcingPackedForward(nn.Module):
    """`forward` = model.forward_teacher_forcing_packed, so FSDP2's hooks see every packed call."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, noisys, cleans, ts, texts, text_masks, rs=None):
        return self.model.forward_teacher_forcing_packed(noisys, cleans, ts, texts, text_masks, rs)


def anyflow_pack_loss(u_model: nn.Module, batch: dict, settings: AnyFlowSettings,
                      null_text: torch.Tensor,
                      null_mask: torch.Tensor, *, patch_size, draws: SampleDraws,
                      positions: torch.Tensor, global_batch: int,
                      teacher: nn.Module | None = None) -> tuple[torch.Tensor, dict]:
    """The Stage1 loss of one pack (trainer.data.loader.collate_pack), as anyflow_batch_loss
    computes it for a batch: each sample draws the same things in the same order, its pair
    shift follows its own token count, and each of the five u calls runs the pack once
    (u_model: TeacherForcingPackedForward; the teacher's two branches run it once more).
    For samples of one shape it equals anyflow_batch_loss on them stacked.
    """
    pt, ph, pw = patch_size
    x0s, texts, masks = batch["latents"], list(batch["text"]), list(batch["text_mask"])
    device = x0s[0].device
    time_dtype = torch.float64 if x0s[0].dtype == torch.float64 else torch.float32
    kinds = kinds_at(positions, global_batch, settings.diffusion_ratio,
                     settings.consistency_ratio)
    noises, ts, rs, frame_masks, ws, weights = [], [], [], [], [], []
    null_texts, null_masks = [], []
    for i, x0 in enumerate(x0s):
        one = draws.one(i)
        _, frames, h, w = x0.shape
        # The order of anyflow_batch_loss: caption drop, u1, u2, conditioning, noise.
        drop = bool(one.uniform()[0] < settings.cfg_drop_prob)
        if drop:
            texts[i], masks[i] = null_text.to(x0), null_mask.to(x0.device)
        u1, u2 = one.uniform().cpu(), one.uniform().cpu()
        pairs = time_pairs_from(u1, u2, kinds[i:i + 1], settings.pair_sampler)
        shift = settings.sigma.shift_for((frames // pt) * (h // ph) * (w // pw))
        t_raw, r_raw = (v.to(device) for v in raw_time_pairs(pairs, shift, time_dtype))
        clean = sample_condition_frames(one.uniform(), frames, image_prob=settings.image_cond_prob,
                                        video_prob=settings.video_cond_prob,
                                        video_frames=settings.video_cond_frames).to(device)
        frame_mask = torch.arange(frames, device=device)[None, :] >= clean[:, None]
        zero = torch.zeros((), dtype=time_dtype, device=device)
        ts.append(torch.where(frame_mask, t_raw[:, None], zero))
        rs.append(torch.where(frame_mask, r_raw[:, None], zero))
        noises.append(one.normal_like(x0[None]))
        frame_masks.append(frame_mask)
        ws.append(1.0 if drop else settings.fuse_guidance_scale)
        weights.append(flow.loss_weight((t_raw / N).float(), settings.loss_weighting, shift))
        null_texts.append(null_text.to(x0))
        null_masks.append(null_mask.to(device))

    def run(captions, caption_masks):
        def u_fn(zs, t, r):
            preds = u_model([z[0] for z in zs], x0s, [v[0] for v in t], captions, caption_masks,
                            [v[0] for v in r])
            return [p[None] for p in preds]
        return u_fn

    def delta_fn(zs, t):
        def direction(zv, tv, picked):
            n = len(picked)
            both = teacher.forward_packed(
                [v[0] for v in zv] * 2, [v[0] for v in tv] * 2,
                [texts[i] for i in picked] + [null_texts[i] for i in picked],
                [masks[i] for i in picked] + [null_masks[i] for i in picked])
            return [(c - u)[None] for c, u in zip(both[:n], both[n:])]

        chunk = settings.teacher_chunk_frames
        if chunk is None:
            return direction(zs, t, range(len(zs)))
        out = [torch.empty_like(z) for z in zs]
        for start in range(0, max(z.shape[2] for z in zs), chunk):
            picked = [i for i, z in enumerate(zs) if z.shape[2] > start]
            views = [context_view(x0s[i][None], zs[i], t[i], start) for i in picked]
            found = direction([v for v, _ in views], [tv for _, tv in views], picked)
            for i, delta in zip(picked, found):
                out[i][:, :, start:start + chunk] = delta[:, :, start:start + chunk]
        return out

    residuals, _ = anyflow_residual_groups(
        run(texts, masks), [x0[None] for x0 in x0s], noises, ts, rs,
        epsilon=settings.epsilon, frame_masks=frame_masks, guidance=ws,
        u_null_fn=run(null_texts, null_masks), delta_fn=None if teacher is None else delta_fn)
    losses = torch.cat([masked_mean_square(res, m) for res, m in zip(residuals, frame_masks)])
    kind = kinds.to(device)
    loss, mean_d = reduce_anyflow_losses(losses, kind == DIFFUSION, torch.cat(weights))
    return loss, _kind_stats(losses.detach(), kinds, mean_d)


def _kind_stats(losses: torch.Tensor, kinds: torch.Tensor, mean_d: torch.Tensor) -> dict:
    """Per-kind sums of the losses [B] as 0-d device tensors and counts as ints (kinds [B] lives
    on the host), and mean_d: nothing here makes the host wait for the GPU, which then runs the
    backward pass without a gap; the step reads them after the update (_merge_stats)."""
    stats = {}
    for code, name in KIND_NAMES.items():
        picked = kinds == code
        stats[f"sum_{name}"] = (losses * picked.to(losses.device, losses.dtype)).sum()
        stats[f"count_{name}"] = int(picked.sum())
    stats["mean_d"] = mean_d.detach()
    return stats


class TFAnyFlowStage(FlowMatchingStage):
    """Stage1: one causal two-time transformer, its optimizer, LR schedule and EMA."""

    name = "tf_anyflow"

    @functools.cached_property
    def settings(self) -> AnyFlowSettings:
        return AnyFlowSettings.of(self.args)

    def micro_batch_loss(self, batch: dict, micro: int,
                         draws: SampleDraws) -> tuple[torch.Tensor, dict]:
        # A step's sample keys are consecutive stream indices, so key mod the global batch is
        # the sample's place in it whatever the split (dp ranks, micro-batches).
        args = self.args
        global_batch = args.train_batch_size * args.gradient_accumulation_steps * self.dp_world
        positions = torch.tensor(batch["sample_keys"]) % global_batch
        if batch.get("packed"):
            # A pack's samples take their kinds by the same rule: every global_batch
            # consecutive samples of the stream hold the configured shares of each kind.
            return anyflow_pack_loss(self.train_model, batch, self.settings, self.null_text,
                                     self.null_mask, patch_size=self.model.geometry.patch_size,
                                     draws=draws, positions=positions, global_batch=global_batch,
                                     teacher=self.roles.get("teacher"))
        return anyflow_batch_loss(self.train_model, batch, self.settings, self.null_text,
                                  self.null_mask, num_tokens=self.tokens_per_sample,
                                  draws=draws, positions=positions, global_batch=global_batch,
                                  teacher=self.roles.get("teacher"))

    @staticmethod
    def merge_stats(stats: list[dict]) -> dict:
        return _merge_stats(stats)

    def warm_start_sources(self) -> list[WarmStartSource]:
        """The FM (SFT) weights; a source without the second time input E_r (the family's
        `second_time_keys`) gets E_t's copy (docs/algorithms.md, "Two-time model"). The
        guidance teacher, when there is one, loads the same weights as they are (a source
        that has E_r, a Stage1 checkpoint, leaves it out: the teacher is single-time)."""
        second = family_of(self.args).second_time_keys
        sources = [dataclasses.replace(source, allow_missing=(*source.allow_missing, *second))
                   for source in super().warm_start_sources()]
        if "teacher" in self.roles:
            sources += [dataclasses.replace(sources[0], role="teacher",
                                            allow_missing=tuple(self.args.warm_start_allow_missing),
                                            allow_unexpected=(*sources[0].allow_unexpected, *second))]
        return sources

    def after_warm_start(self, reports: dict[str, dict]) -> None:
        """E_r := E_t when the source had no second time input; a source that holds it (a
        Stage1 checkpoint) keeps its E_r, and one holding only some of its tensors is refused.
        Records which in the report ("second_time": "copied from the first" | "loaded")."""
        report = reports["transformer"]
        patterns = family_of(self.args).second_time_keys
        r_keys = {k for k in self.model.state_dict()
                  if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
        missing_r = r_keys & set(report["missing"] + report["skipped_shape_mismatch"])
        if missing_r and missing_r != r_keys:
            raise CheckpointError(
                f"warm start from {report['source']} holds only some of the second time "
                f"input's tensors (missing {sorted(missing_r)}); E_r must come whole from the "
                f"source or be copied whole from E_t.")
        if missing_r:
            self.model.init_second_time_from_first()
        report["second_time"] = "copied from the first" if missing_r else "loaded"
        super().after_warm_start(reports)


def _merge_stats(stats: list[dict]) -> dict:
    """Per-kind mean unscaled losses over the step's micro-batches on all ranks (a kind absent
    everywhere this step is left out), and the mean diffusion reference.

    Summed over ranks because kinds follow the global index: rank 0 alone may hold only
    diffusion samples.
    """
    names = list(KIND_NAMES.values())
    sums = torch.stack([sum(s[f"sum_{name}"] for s in stats) for name in names])
    counts = [sum(s[f"count_{name}"] for s in stats) for name in names]
    totals = sum_across_ranks([*sums.double().tolist(), *counts])
    out = {}
    for i, name in enumerate(names):
        total, count = totals[i], totals[len(names) + i]
        if count:
            out[f"loss_{name}"] = total / count
    refs = [float(s["mean_d"]) for s in stats if not s["mean_d"].isnan()]
    if refs:
        out["diffusion_reference"] = sum(refs) / len(refs)
    return out


# ---------------------------------------------------------------------------------------------
# sampling ("Flow-map sampler")
# ---------------------------------------------------------------------------------------------

def flowmap_step(x: torch.Tensor, t, r, u: torch.Tensor) -> torch.Tensor:
    """X_{t->r}(x) = x - (t - r) u for normalized times t >= r (floats or per-sample [B])."""
    dt = torch.as_tensor(t, dtype=x.dtype, device=x.device) - torch.as_tensor(r, dtype=x.dtype,
                                                                             device=x.device)
    if dt.ndim == 1:
        dt = dt.view(-1, *([1] * (x.ndim - 1)))
    return x - dt * u.to(x.dtype)


def _cfg_text(text, text_mask, null_text, null_mask):
    """[text; null] batched (2B), both padded to one length, for cond/uncond in one forward."""
    b = text.shape[0]
    null_text = null_text.to(text).expand(b, -1, -1)
    null_mask = null_mask.to(text_mask.device).expand(b, -1)
    length = max(text.shape[1], null_text.shape[1])

    def pad(x):
        extra = length - x.shape[1]
        return x if extra == 0 else torch.cat([x, x.new_zeros((b, extra, *x.shape[2:]))], dim=1)

    return (torch.cat([pad(text), pad(null_text)]), torch.cat([pad(text_mask), pad(null_mask)]))


def _guided(call, x, t, r, guidance: float) -> torch.Tensor:
    """call(x, t, r) with the batch as given (w = 1), or doubled [cond; uncond] and combined
    as u + w (c - u)."""
    if guidance == 1.0:
        return call(x, t, r)
    cond, uncond = call(torch.cat([x, x]), torch.cat([t, t]), torch.cat([r, r])).chunk(2)
    return uncond + guidance * (cond - uncond)


def _denoise(call, x: torch.Tensor, sigmas: list[float], clean: int, guidance: float):
    """Flow-map steps over the grid `sigmas` for latents x [B, C, F, H, W]; the first `clean`
    frames stay as given at t = r = 0."""
    b, frames = x.shape[0], x.shape[2]
    kept = x[:, :, :clean].clone()
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((b, frames), s * N, dtype=x.dtype, device=x.device)
        r = torch.full((b, frames), s_next * N, dtype=x.dtype, device=x.device)
        t[:, :clean] = 0.0
        r[:, :clean] = 0.0
        x = flowmap_step(x, s, s_next, _guided(call, x, t, r, guidance))
        x[:, :, :clean] = kept
    return x


@torch.no_grad()
def sample_flowmap(model: nn.Module, text: torch.Tensor, text_mask: torch.Tensor,
                   null_text: torch.Tensor, null_mask: torch.Tensor, *, shape: tuple[int, ...],
                   steps: int, guidance: float, shift: float = 1.0,
                   generator: torch.Generator | None = None,
                   first_frame: torch.Tensor | None = None) -> torch.Tensor:
    """Flow-map sampling ("Flow-map sampler"): latents of `shape` [B, C, T, H, W] after `steps` jumps.

    Grid sigma_k = S(1 - k/steps; shift); each step x <- x - (t - r) u(x, t, r). A causal
    model (one with causal chunks) goes chunk by chunk through its KV cache and commits each
    finished chunk clean (t = r = 0); a bidirectional one denoises the whole clip. guidance w
    != 1 applies u + w (c - u) with cond and uncond batched (a guidance-fused model samples
    with w = 1). first_frame [B, C, F0, H, W] stays clean. The noise comes from `generator`
    (CPU), so results do not depend on the device. Raises ValueError for steps < 1.
    """
    device = text.device
    param = next(model.parameters())
    work = torch.float64 if param.dtype == torch.float64 else torch.float32
    x = torch.randn(shape, generator=generator).to(device=device, dtype=work)
    sigmas = flow.sampling_sigmas(steps, shift, dtype=torch.float64).tolist()
    clean = 0 if first_frame is None else first_frame.shape[2]
    if clean:
        x[:, :, :clean] = first_frame.to(x)
    if guidance != 1.0:
        text, text_mask = _cfg_text(text, text_mask, null_text, null_mask)
    chunk = model.geometry.causal_chunk_frames
    to_model = param.dtype

    if chunk is None:
        def call(y, t, r):
            return model(y.to(to_model), t, text, text_mask, r=r).to(work)

        return _denoise(call, x, sigmas, clean, guidance)

    cache = model.new_kv_cache(text, text_mask)
    frames = shape[2]
    for start in range(0, frames, chunk):
        stop = min(start + chunk, frames)

        def call(y, t, r, start=start):
            return model.forward_chunk(y.to(to_model), t, cache, start, r_chunk=r).to(work)

        done = _denoise(call, x[:, :, start:stop], sigmas, max(0, min(clean - start, stop - start)),
                        guidance)
        x[:, :, start:stop] = done
        commit = done if guidance == 1.0 else torch.cat([done, done])
        model.commit_chunk(commit.to(to_model), cache, start)
    return x


# ---- the stage's construction and kernel warm-up (its declaration names these) ----------------

def build(args, topo) -> TFAnyFlowStage:
    """Stage1: the causal two-time transformer, trained through its teacher-forcing forward."""
    from trainer.build import (build_data, build_ema, build_optimization, build_text_encoder,
                               build_trained_model, distribute, packing_budget)

    model = build_trained_model(args, topo, warm_start=True)
    optimizer, scheduler = build_optimization(args, model, max_steps=args.max_steps)
    packed = packing_budget(args) is not None
    forward = TeacherForcingPackedForward if packed else TeacherForcingForward
    encoder = build_text_encoder(args, topo.device)
    stage = TFAnyFlowStage(model, forward(model), optimizer,
                           scheduler, build_ema(args, model),
                           build_data(args, topo, text_encoder=encoder), args,
                           encoder, topo.device, dp_rank=topo.dp_rank, dp_world=topo.dp_world)
    if teacher_guided(args):  # sharded like the student; no gradient, no optimizer state
        stage.roles["teacher"] = distribute(build_guidance_teacher(args, topo.device), topo)
    return stage


def build_guidance_teacher(args, device: torch.device) -> nn.Module:
    """The frozen bidirectional single-time copy of the student's config that gives the fused
    guidance its direction (anyflow_guidance_reference: teacher), prepared like the student."""
    from trainer.build import build_model, prepare_for_training

    config = family_of(args).bidirectional_config(model_config(args))
    teacher = build_model(args, device, config).eval().requires_grad_(False)
    return prepare_for_training(teacher, args)


def warmup_loss(model: nn.Module, batch: dict, args, shapes: dict) -> torch.Tensor:
    """The loss of one micro-batch for the kernel warm-up (trainer.warmup). Teacher forcing runs
    [clean | noisy] sequences under the block-causal mask: twice the video tokens of FM, so its
    kernels (and their autotuned configs) are its own."""
    from trainer.stages.fm import warmup_null_caption

    device = batch["latents"].device
    null_text, null_mask = warmup_null_caption(args, device)
    teacher = build_guidance_teacher(args, device) if teacher_guided(args) else None
    loss, _ = anyflow_batch_loss(TeacherForcingForward(model), batch, AnyFlowSettings.of(args),
                                 null_text, null_mask,
                                 num_tokens=shapes["video_tokens"], teacher=teacher)
    return loss
