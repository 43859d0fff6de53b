"""Samplers: turn noise into latents with a trained model.

`sample_fm` is the Euler flow-matching sampler with classifier-free guidance in the standard
convention G_w(c, u) = u + w (c - u) (w = 1: conditional only). With `first_frame`, the first
latent frame is given clean (kept at t = 0 throughout), as in image-conditioned training.

Every stage has a sampler with the same signature (see `sampler_for`):
    fn(model, text, text_mask, null_text, null_mask, *, shape, steps, guidance, shift,
       generator, first_frame=None) -> latents [B, C, T, H, W]
"""

from __future__ import annotations

import torch
from torch import nn

from trainer import flow


def guided(model_fn, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, mask: torch.Tensor,
           null_text: torch.Tensor, null_mask: torch.Tensor, guidance: float, **kw) -> torch.Tensor:
    """The guided prediction u + w (c - u), with both branches in one batched forward."""
    if guidance == 1.0:
        return model_fn(x, t, text, mask, **kw)
    b = x.shape[0]
    null_text = null_text.to(text).expand(b, -1, -1)
    null_mask = null_mask.to(mask.device).expand(b, -1)
    length = max(text.shape[1], null_text.shape[1])
    texts = torch.cat([_pad(text, length), _pad(null_text, length)])
    masks = torch.cat([_pad(mask, length), _pad(null_mask, length)])
    kw2 = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    cond, uncond = model_fn(torch.cat([x, x]), torch.cat([t, t]), texts, masks, **kw2).chunk(2)
    return uncond + guidance * (cond - uncond)


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    pad = x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)


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
        v = guided(model, x, t, text, text_mask, null_text, null_mask, guidance)
        x = x + (s_next - s) * v.float()
        if clean:
            x[:, :, :clean] = first_frame.to(x)
    return x


def sampler_for(stage: str):
    """The sampler of a training stage: FM Euler, Stage1 flow map, Stage2 causal rollout."""
    if stage == "fm":
        return sample_fm
    if stage == "tf_anyflow":
        from trainer.stages.tf_anyflow import sample_flowmap

        return sample_flowmap
    if stage == "dmd_sgf":
        from trainer.stages.dmd_sgf import sample_student

        return sample_student
    raise ValueError(f"no sampler for stage {stage!r}")
