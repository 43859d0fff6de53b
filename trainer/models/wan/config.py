"""The Wan transformer's config facts shared by its family and its module (no torch): the
defaults, Wan's RoPE split of a head, and the geometry of a config."""

from __future__ import annotations

from typing import Any

from trainer.models.family import Geometry

DIFFUSERS_CLASS = "WanTransformer3DModel"
QK_NORM = "rms_norm_across_heads"

# Wan2.1-T2V-1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json)
WAN_DEFAULTS: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": QK_NORM,
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
    "attention_backend": "auto",
}


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Channels of a head that rotate with the (frame, row, col) position, as Wan splits them:
    rows and columns 2 * (head_dim // 6) each, frames the rest (128 -> 44, 42, 42)."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def wan_geometry(config: dict[str, Any]) -> Geometry:
    """The geometry (trainer.models.family.Geometry) of a complete wan config dict."""
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    return Geometry(patch_size=tuple(config["patch_size"]), num_heads=heads, head_dim=head_dim,
                    hidden_size=heads * head_dim, num_layers=config["num_layers"],
                    latent_channels=config["in_channels"],
                    out_channels=config["out_channels"] or config["in_channels"],
                    text_dim=config["text_dim"], causal_chunk_frames=None, two_time=False)
