"""Times as both families take them: sinusoidal features, a time per sample or per patch-frame,
and the two-time mix e(t, r) (docs/algorithms.md, "Two-time model").

Timesteps are raw (N * sigma, 0..1000), per sample [B] or per latent frame [B, T]; per-frame
times are read per patch-frame (the first latent frame of each), and per-frame times that are
all equal come back per sample, so the blocks take the per-sample modulation path.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["conditioning", "frame_times", "mix_two_times", "timestep_features"]


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features [..., dim] (cos half, then sin half) of raw timesteps t [...].

    Computed in float64 for float64 input and float32 otherwise: raw times up to 1000 lose
    their low bits in bf16.
    """
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=work) / half)
    args = t.to(work)[..., None] * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def mix_two_times(e: torch.Tensor, e_r: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """e(t, r) from e = E_t(t) and e_r = E_r(r)."""
    # e + g (e_r - e) rather than (1 - g) e + g e_r: identical in exact arithmetic, and exactly
    # E_t(t) in floating point when E_r = E_t and r = t (or when g = 0)
    return e + gate.to(e.dtype) * (e_r - e)


def frame_times(value: Any, batch: int, frames: int, patch_t: int, name: str,
                device) -> torch.Tensor:
    """Times per patch-frame: [B, 1] for per-sample input, [B, T / pt] for per-frame input.

    Per-frame times equal across a sample's frames (flow matching without clean frames)
    come back as [B, 1], so the blocks take the per-sample modulation path.
    Raises ValueError for any other shape (naming the input as `name`).
    """
    t = torch.as_tensor(value, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.ndim == 1 and t.shape[0] == batch:
        return t[:, None]
    if t.ndim == 2 and tuple(t.shape) == (batch, frames):
        t = t[:, ::patch_t]
        return t[:, :1] if bool((t == t[:, :1]).all()) else t
    raise ValueError(f"{name} must be a scalar, [B]={[batch]} or [B, T]={[batch, frames]}, "
                     f"got {list(t.shape)}")


def conditioning(embed_time: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                 two_time: bool, t: Any, r: Any, batch: int, frames: int, patch_t: int,
                 device) -> torch.Tensor:
    """The time embedding per patch-frame slot, [B, 1, D] or [B, T / pt, D]: embed_time (the
    family's, of times [B, S] and r [B, S] or None) of t and r read per patch-frame. Raises
    ValueError for r on a single-time model or a malformed time."""
    if r is not None and not two_time:
        raise ValueError("r was given but the model is single-time: build it with "
                         "two_time: true for a second time input")
    t_f = frame_times(t, batch, frames, patch_t, "t", device)
    r_f = None if r is None else frame_times(r, batch, frames, patch_t, "r", device)
    if r_f is not None and r_f.shape[1] != t_f.shape[1]:
        width = max(t_f.shape[1], r_f.shape[1])
        t_f, r_f = t_f.expand(batch, width), r_f.expand(batch, width)
    return embed_time(t_f, r_f)
