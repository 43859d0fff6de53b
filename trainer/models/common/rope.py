"""3-D rotary position embeddings by (frame, row, col): the tables, the rotation, the grid.

Positions come from grid ids, never from list order: the two halves of a teacher-forcing
sequence share them, and a chunk of a KV-cache rollout gets its absolute frame index.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "grid_positions", "rope_tables"]


def rope_tables(positions: torch.Tensor, axes_dim: tuple[int, int, int], theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [N, head_dim / 2] of the rotation angles for grid positions [N, 3].

    Each axis (frame, row, col) owns axes_dim[a] channels of the head, i.e. axes_dim[a] / 2
    rotation pairs. Angles are computed in float64 (frame indices times small frequencies),
    then the tables are cast to `dtype`.
    """
    angles = []
    for axis, dim in enumerate(axes_dim):
        if dim == 0:
            continue
        inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)
        angles.append(positions[:, axis, None].to(torch.float64) * inv_freq)
    angle = torch.cat(angles, dim=-1)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates consecutive channel pairs of x [B, N, heads, head_dim] by per-token angles.

    In float32, or float64 for float64 input; returns x's dtype. cos, sin: [N, head_dim / 2].
    Real arithmetic on GPUs and under torch.compile (Inductor generates no code for complex
    tensors); one complex multiply in eager CPU code, where the strided real form is several
    times slower (the embedded default trains on CPUs).
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos[:, None].to(work), sin[:, None].to(work)
    pairs = x.to(work).unflatten(-1, (-1, 2))
    if x.is_cuda or torch.compiler.is_compiling():
        even, odd = pairs.unbind(-1)
        rotated = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1)
    else:
        rotated = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.complex(c, s))
    return rotated.flatten(-2).to(x.dtype)


def grid_positions(num_frames: int, rows: int, cols: int, frame_start: int,
                   device: torch.device | None = None) -> torch.Tensor:
    """(frame, row, col) of each token of a frame-major patch grid: long [F * rows * cols, 3]."""
    f = torch.arange(frame_start, frame_start + num_frames, device=device)
    r = torch.arange(rows, device=device)
    c = torch.arange(cols, device=device)
    grid = torch.stack(torch.meshgrid(f, r, c, indexing="ij"), dim=-1)
    return grid.reshape(-1, 3)
