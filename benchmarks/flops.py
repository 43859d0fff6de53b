"""Counted FLOPs of one training step, for MFU, as each relay model family counts them (the `wan`
family's count is also diffusers' WanTransformer3DModel's: same config keys, same products).

Only matrix products count (linear layers, the patch embedding, the two products of each
attention); norms, activations and the optimizer are left out, as is usual for MFU. A
training step is counted as 3x the forward (the backward computes two products per forward
product), whatever activation checkpointing recomputes: MFU measures useful work.
`model_forward_flops` counts one sample; multiply by the batch.
"""

from __future__ import annotations

from typing import Any


def model_forward_flops(family: str, config: dict[str, Any], video_tokens: int,
                        text_tokens: int) -> int:
    """Forward FLOPs of one sample of relay's model family `family` with model config `config`,
    as the family counts them (trainer.models.family.ModelFamily.forward_flops)."""
    from trainer.models.registry import get_family

    return int(get_family(family).forward_flops(config, video_tokens, text_tokens))


def train_flops(forward_flops: int) -> int:
    """Model FLOPs of one training step from its forward FLOPs (see the module docstring)."""
    return 3 * forward_flops
