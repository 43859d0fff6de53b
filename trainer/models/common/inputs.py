"""The shape checks of a family's inputs: latents [B, C, T, H, W] and captions [B, L, text_dim]."""

from __future__ import annotations

import torch

__all__ = ["check_text", "check_video"]


def check_video(x: torch.Tensor, in_channels: int, patch_size, name: str
                ) -> tuple[int, int, int, int]:
    """(B, T, H, W) of latents x; raises ValueError unless x is [B, in_channels, T, H, W] with
    T, H, W multiples of the patch size."""
    if x.ndim != 5 or x.shape[1] != in_channels:
        raise ValueError(f"{name} must be [B, {in_channels}, T, H, W], got {list(x.shape)}")
    b, _, t, h, w = x.shape
    for size, patch, axis in zip((t, h, w), patch_size, "THW"):
        if size % patch:
            raise ValueError(f"{name}: {axis}={size} is not a multiple of the patch size {patch}")
    return b, t, h, w


def check_text(text: torch.Tensor, text_mask: torch.Tensor | None, batch: int,
               text_dim: int) -> None:
    """Raises ValueError unless text is [batch, L, text_dim] and text_mask None or bool [B, L]."""
    if text.ndim != 3 or text.shape[0] != batch or text.shape[2] != text_dim:
        raise ValueError(f"text must be [B={batch}, L, {text_dim}], got {list(text.shape)}")
    if text_mask is not None and (text_mask.dtype != torch.bool or text_mask.shape != text.shape[:2]):
        raise ValueError(f"text_mask must be bool [B, L]={list(text.shape[:2])}, "
                         f"got {text_mask.dtype} {list(text_mask.shape)}")
