"""The Wan transformer's config facts shared by its family and its module (no torch): the
defaults, Wan's RoPE split of a head, and the geometry of a config.

The keys are diffusers' `WanTransformer3DModel` arguments plus relay's own (`RELAY_KEYS`):
`attention_backend`, and the causal and two-time settings with the DiT's names and meanings
(`causal_chunk_size` latent frames per chunk, `attn_window_chunks`, `two_time`, `time_gate`).
A diffusers config.json has none of relay's keys and an export leaves them out."""

from __future__ import annotations

from typing import Any

from trainer.models.family import Geometry

DIFFUSERS_CLASS = "WanTransformer3DModel"
WAN_TEXT_LEN = 512  # WanPipeline's max_sequence_length: captions are padded to it
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
    # relay's own (not diffusers'): the causal form and the second time input
    "causal_chunk_size": None,  # latent frames per causal chunk; None = bidirectional
    "attn_window_chunks": None,  # earlier chunks a chunk may see; None = all
    "two_time": False,  # a second time input r (the flow map's), condition_embedder.time_embedder_r
    "time_gate": 0.25,  # e(t, r) = e_t + time_gate (e_r - e_t)
}

# Keys of relay's, not of diffusers' WanTransformer3DModel: a run may set them whatever
# directory the architecture comes from, and a diffusers config.json leaves them out.
RELAY_KEYS = ("attention_backend", "causal_chunk_size", "attn_window_chunks", "two_time",
              "time_gate")
# The state-dict keys of the second time input (absent from diffusers' and the Wan release's
# weights): fnmatch patterns, the family's second_time_keys.
SECOND_TIME_PREFIX = "condition_embedder.time_embedder_r."


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
                    text_dim=config["text_dim"],
                    causal_chunk_frames=config.get("causal_chunk_size"),
                    two_time=bool(config.get("two_time")),
                    time_gate=float(config.get("time_gate", 0.25)) if config.get("two_time") else None)
