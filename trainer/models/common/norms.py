"""The per-head q/k RMSNorm both families' attention uses."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["HeadRMSNorm"]


class HeadRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight is cast to the input's dtype (q/k norm under bf16 autocast).

    With a float32 weight and bf16 input torch falls back from the fused kernel to a composite
    one ("Mismatch dtype between input and weight"). Same parameter, so checkpoints load.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
