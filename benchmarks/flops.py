"""Counted FLOPs of one training step, for MFU: any relay model family, and diffusers' Wan transformer.

Only matrix products count (linear layers, the patch embedding, the two products of each
attention); norms, activations and the optimizer are left out, as is usual for MFU. A
training step is counted as 3x the forward (the backward computes two products per forward
product), whatever activation checkpointing recomputes: MFU measures useful work.
Both functions count one sample; multiply by the batch.
"""

from __future__ import annotations

import math
from typing import Any



def _linear(tokens: int, fan_in: int, fan_out: int) -> int:
    return 2 * tokens * fan_in * fan_out


def _attention(queries: int, keys: int, width: int) -> int:
    # scores (q k^T) and the weighted sum of values: 2 * queries * keys * head_dim per head each
    return 2 * 2 * queries * keys * width


def model_forward_flops(family: str, config: dict[str, Any], video_tokens: int,
                        text_tokens: int) -> int:
    """Forward FLOPs of one sample of relay's model family `family` with model config `config`,
    as the family counts them (trainer.models.family.ModelFamily.forward_flops)."""
    from trainer.models.registry import get_family

    return int(get_family(family).forward_flops(config, video_tokens, text_tokens))


def wan_forward_flops(config: dict[str, Any], video_tokens: int, text_tokens: int) -> int:
    """Forward FLOPs of diffusers' WanTransformer3DModel (its config dict) on one sample.

    Per block: self-attention over the video, cross-attention from video to the caption,
    the feed-forward network.
    """
    d = config["num_attention_heads"] * config["attention_head_dim"]
    patch = math.prod(config["patch_size"])
    n, length = video_tokens, text_tokens
    self_attention = 4 * _linear(n, d, d) + _attention(n, n, d)
    cross_attention = 2 * _linear(n, d, d) + 2 * _linear(length, d, d) + _attention(n, length, d)
    ffn = _linear(n, d, config["ffn_dim"]) + _linear(n, config["ffn_dim"], d)
    embed = (_linear(n, config["in_channels"] * patch, d)
             + _linear(length, config["text_dim"], d) + _linear(length, d, d)
             + _linear(1, config["freq_dim"], d) + _linear(1, d, d) + _linear(1, d, 6 * d)
             + _linear(n, d, config["out_channels"] * patch))
    return config["num_layers"] * (self_attention + cross_attention + ffn) + embed


def train_flops(forward_flops: int) -> int:
    """Model FLOPs of one training step from its forward FLOPs (see the module docstring)."""
    return 3 * forward_flops
