"""relay's DiT as a model family: its config, geometry, counts and what the stages may ask of it.

Torch-free: the login node validates a DiT run with this module alone. The module half is
trainer.models.dit.module.VideoDiT, built lazily by `DiTFamily.build`.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.models.dit.config import MODEL_CONFIG_DEFAULTS, TIME_FREQ_DIM, DiTConfig, dit_geometry
from trainer.models.family import Geometry, ParamCounts, RelayCausalFamily


class DiTFamily(RelayCausalFamily):
    """`model_family: dit` (the default): the joint text/video DiT with per-block adaLN."""

    name = "dit"
    capabilities = frozenset({"per_frame_times", "packed", "teacher_forcing", "kv_cache",
                              "two_time", "context_parallel", "sparse_video_attention"})
    second_time_keys = ("r_embedder.*",)
    run_config_keys = ("causal_chunk_size", "attn_window_chunks", "two_time", "time_gate",
                       "attention_backend")
    # Attention in and out of every block; the MLP (mlp.0, mlp.2) on request.
    lora_target_modules = ("qkv", "proj")
    # Each block's adaLN `modulation` linear, its norms and the embedders stay with AdamW.
    muon_excluded_name_parts = ("norm", "modulation", "embed")
    toy_size = {"hidden_size": 32, "num_attention_heads": 2, "num_layers": 2,
                "rope_axes_dim": [4, 4, 8]}
    block_video_arg = 1  # block(text, video, ...): the joint block carries both streams

    def defaults(self) -> dict[str, Any]:
        return {k: v for k, v in MODEL_CONFIG_DEFAULTS.items() if k != "zero_init_modulation"}

    def settings_config(self, settings) -> dict[str, Any]:
        return {"zero_init_modulation": settings.get("zero_init_modulation", True)}

    def validate(self, config: dict[str, Any]) -> None:
        DiTConfig(**config)

    def geometry(self, config: dict[str, Any]) -> Geometry:
        return dit_geometry(config)

    def param_counts(self, config: dict[str, Any]) -> ParamCounts:
        h = config["hidden_size"]
        m = int(h * config["mlp_ratio"])
        head_dim = h // config["num_attention_heads"]
        qk_norm = 2 * head_dim if config.get("qk_norm", True) else 0
        # attention qkv + out, MLP, the block's adaLN table (6 modulation vectors), q/k norms
        per_block = (3 * h * h + 3 * h) + (h * h + h) + (2 * h * m + m + h) + (6 * h * h + 6 * h) \
            + qk_norm
        pt, ph, pw = config["patch_size"]
        patch_in = config["in_channels"] * pt * ph * pw
        patch_out = (config.get("out_channels") or config["in_channels"]) * pt * ph * pw
        time_mlp = TIME_FREQ_DIM * h + h + h * h + h
        root = ((patch_in * h + h) + (config["text_dim"] * h + h + h * h + h) + time_mlp
                + (2 * h * h + 2 * h) + (h * patch_out + patch_out))
        second = time_mlp if config.get("two_time") else 0
        muon = config["num_layers"] * (3 * h * h + h * h + 2 * h * m)
        return ParamCounts(total=root + second + config["num_layers"] * per_block,
                           per_block=per_block, muon=muon, second_time=second)

    def linear_shapes(self, config: dict[str, Any]) -> dict[str, tuple[int, int]]:
        h = config["hidden_size"]
        m = int(h * config["mlp_ratio"])
        patch = math.prod(config["patch_size"])
        out = (config.get("out_channels") or config["in_channels"]) * patch
        shapes = {"patch_embed": (config["in_channels"] * patch, h),
                  "text_embedder.0": (config["text_dim"], h), "text_embedder.2": (h, h),
                  "time_embedder.linear_1": (TIME_FREQ_DIM, h), "time_embedder.linear_2": (h, h)}
        for i in range(config["num_layers"]):
            shapes.update({f"blocks.{i}.qkv": (h, 3 * h), f"blocks.{i}.proj": (h, h),
                           f"blocks.{i}.mlp.0": (h, m), f"blocks.{i}.mlp.2": (m, h),
                           f"blocks.{i}.modulation": (h, 6 * h)})
        shapes.update({"final_modulation": (h, 2 * h), "head": (h, out)})
        if config.get("two_time"):
            shapes.update({"r_embedder.linear_1": (TIME_FREQ_DIM, h),
                           "r_embedder.linear_2": (h, h)})
        return shapes

    def forward_flops(self, config: dict[str, Any], video_tokens: int, text_tokens: int) -> float:
        """Every block runs the caption stream (text over text) and the video stream (video
        over [video | text]); the last block computes only the caption's K/V, all the video
        needs from it."""
        d = config["hidden_size"]
        hidden = int(d * config["mlp_ratio"])
        patch = math.prod(config["patch_size"])
        out_channels = config.get("out_channels") or config["in_channels"]
        n, length = video_tokens, text_tokens

        def stream(tokens: int, keys: int) -> int:
            return (_linear(tokens, d, 3 * d) + _attention(tokens, keys, d)
                    + _linear(tokens, d, d) + _linear(tokens, d, hidden)
                    + _linear(tokens, hidden, d))

        per_block = stream(n, n + length) + _linear(1, d, 6 * d) + stream(length, length)
        last_block_text_saving = stream(length, length) - _linear(length, d, 3 * d)
        embed = (_linear(n, config["in_channels"] * patch, d)
                 + _linear(length, config["text_dim"], d) + _linear(length, d, d)
                 + _linear(1, TIME_FREQ_DIM, d) + _linear(1, d, d) + _linear(1, d, 2 * d)
                 + _linear(n, d, out_channels * patch))
        return config["num_layers"] * per_block - last_block_text_saving + embed

    def build(self, config: dict[str, Any]):
        from trainer.models.dit.module import VideoDiT

        return VideoDiT(**config)


def _linear(tokens: int, fan_in: int, fan_out: int) -> int:
    return 2 * tokens * fan_in * fan_out


def _attention(queries: int, keys: int, width: int) -> int:
    # scores (q k^T) and the weighted sum of values: 2 * queries * keys * head_dim per head each
    return 2 * 2 * queries * keys * width
