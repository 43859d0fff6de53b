"""The VAE between pixels and latents: a diffusers AutoencoderKLWan loaded from a local directory.

The embedded default has none: its "VAE" is the identity (pixels are the latents, read by
latents_to_frames). `relay data encode` encodes through `WanVAE`, and
validation decodes its samples through it when `vae_path` is set, so both sides use one
normalisation: a latent is (z - latents_mean) / latents_std of the checkpoint's own config, as
Wan's pipelines expect. Needs the `encode` extra (diffusers); no hub access at run time.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


class WanVAE:
    """An AutoencoderKLWan from `directory` on `device`, frozen.

    temporal / spatial: its compression factors; channels: the latent channels (z_dim).
    Raises ImportError naming the extra when diffusers is missing, OSError when the directory
    holds no loadable checkpoint, ValueError when latents_mean/std do not have z_dim values.
    """

    def __init__(self, directory, device="cpu"):
        try:
            from diffusers import AutoencoderKLWan
        except ImportError as error:
            raise ImportError("a VAE directory needs diffusers: pip install 'relay[encode]'") from error
        vae = AutoencoderKLWan.from_pretrained(str(directory), local_files_only=True)
        cfg = vae.config
        if len(cfg.latents_mean) != cfg.z_dim or len(cfg.latents_std) != cfg.z_dim:
            raise ValueError(f"{directory}: latents_mean/std hold {len(cfg.latents_mean)} values "
                             f"for z_dim {cfg.z_dim}")
        self.device = torch.device(device)
        self.vae = vae.to(self.device).eval().requires_grad_(False)
        self.temporal, self.spatial = int(cfg.scale_factor_temporal), int(cfg.scale_factor_spatial)
        self.channels = int(cfg.z_dim)
        shape = (1, self.channels, 1, 1, 1)
        self.mean = torch.tensor(cfg.latents_mean).reshape(shape)
        self.std = torch.tensor(cfg.latents_std).reshape(shape)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised latents float32 [B, C, T', H', W'] (CPU) of pixels [B, 3, T, H, W] in
        [-1, 1]: the posterior mean, so encoding is deterministic."""
        z = self.vae.encode(pixels.to(self.device)).latent_dist.mean.float().cpu()
        return (z - self.mean) / self.std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels float32 [B, 3, T', H', W'] in [-1, 1] (CPU) of normalised latents [B, C, T, H, W]
        (T' = 1 + (T - 1) x temporal, sides x spatial)."""
        z = latents.detach().float().cpu() * self.std + self.mean
        dtype = next(self.vae.parameters()).dtype
        pixels = self.vae.decode(z.to(self.device, dtype)).sample
        return pixels.float().clamp(-1.0, 1.0).cpu()

    def frames(self, latent: torch.Tensor) -> np.ndarray:
        """uint8 frames [T', H', W', 3] of one normalised latent [C, T, H, W]."""
        pixels = self.decode(latent[None])[0]
        return np.rint((pixels.numpy() + 1.0) * 127.5).astype(np.uint8).transpose(1, 2, 3, 0)


def latents_to_frames(latent) -> np.ndarray:
    """Identity-VAE decode: latents [C=3, T, H, W] in [-1, 1] (tensor or array) -> uint8
    frames [T, H, W, 3]. Values outside [-1, 1] are clipped. Raises ValueError on other shapes."""
    if isinstance(latent, torch.Tensor):
        latent = latent.detach().to("cpu", torch.float32).numpy()
    latent = np.asarray(latent, dtype=np.float32)
    if latent.ndim != 4 or latent.shape[0] != 3:
        raise ValueError(f"expected latents [3, T, H, W], got shape {tuple(latent.shape)}")
    pixels = (np.clip(latent, -1.0, 1.0) + 1.0) * 127.5
    return np.rint(pixels).astype(np.uint8).transpose(1, 2, 3, 0)


def latents_to_clips(latents: torch.Tensor, vae_path: str | None) -> list[np.ndarray]:
    """uint8 clips [T, H, W, 3] of sampled latents [B, C, T, H, W]: decoded by the VAE at
    vae_path (loaded once per process, on the latents' device), or read as pixels by the
    identity VAE when vae_path is None."""
    if vae_path is None:
        return [latents_to_frames(x) for x in latents]
    vae = _cached_vae(str(vae_path), str(latents.device))
    return [vae.frames(x) for x in latents]


@functools.lru_cache(maxsize=1)
def _cached_vae(directory: str, device: str) -> WanVAE:
    # Validation decodes every validation_interval steps: one load per run, not per call.
    return WanVAE(directory, device=device)
