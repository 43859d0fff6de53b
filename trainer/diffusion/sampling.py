"""Samplers: turn noise into latents with a trained model.

`sample_fm` is the Euler flow-matching sampler with classifier-free guidance in the standard
convention G_w(c, u) = u + w (c - u) (w = 1: conditional only). With `first_frame`, the first
latent frame is given clean (kept at t = 0 throughout), as in image-conditioned training.

Every stage's sampler has the same signature; the stage's declaration names it, with its
steps, guidance and shift (trainer.stages.declaration.SamplingPlan):
    fn(model, text, text_mask, null_text, null_mask, *, shape, steps, guidance, shift,
       generator, first_frame=None) -> latents [B, C, T, H, W]
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.diffusion import flow


@torch.no_grad()
def sample_fm(model: nn.Module, text: torch.Tensor, text_mask: torch.Tensor,
              null_text: torch.Tensor, null_mask: torch.Tensor, *, shape: tuple[int, ...],
              steps: int, guidance: float, shift: float = 1.0,
              generator: torch.Generator | None = None,
              first_frame: torch.Tensor | None = None) -> torch.Tensor:
    """Euler steps from noise (sigma = 1) to data (sigma = 0). Returns latents of `shape`.

    shape: [B, C, T, H, W]; text [B, L, D] with text_mask [B, L]; first_frame [B, C, 1, H, W]
    or None. The noise comes from `generator` (CPU) so results do not depend on the device.
    """
    device = text.device
    x = torch.randn(shape, generator=generator).to(device)
    sigmas = flow.sampling_sigmas(steps, shift).tolist()
    b, _, frames = shape[:3]
    clean = 0
    if first_frame is not None:
        clean = first_frame.shape[2]
        x[:, :, :clean] = first_frame.to(x)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((b, frames), s * flow.NUM_TRAIN_TIMESTEPS, device=device)
        t[:, :clean] = 0.0
        v = flow.guided(model, x, t, text, text_mask, null_text, null_mask, guidance)
        x = x + (s_next - s) * v.float()
        if clean:
            x[:, :, :clean] = first_frame.to(x)
    return x
