"""nn.Linear whose bias gradient is a matrix product, for the large linear layers of a block.

The bias gradient is the sum of the output gradient over all tokens. Compiled, Inductor fuses
that column sum into the element-wise kernel that produces the output gradient (the GELU's
backward, a gate's product), and such fused column reductions run well below memory
bandwidth: at the Wan2.1-1.3B step on an H200 the FFN's alone took 1.2 ms a layer where the
tensors' traffic needs about 0.4. Computed as ones[1, tokens] @ dy, the sum is a cuBLAS
matrix-vector product at bandwidth, and the element-wise kernel stays a plain one
(docs/performance.md has the measured step).

The layer is an nn.Linear (same parameters, state-dict keys, LoRA wrapping); its own path
takes half-precision inputs (autocast's activations) and computes what F.linear under
autocast computes, with the weight and bias cast to the input's dtype. Other inputs (float32
on a CPU, float64 in the exact tests) take nn.Linear's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


class _LinearMatmulBiasGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        rows = dy.reshape(-1, dy.shape[-1])
        dx = (rows @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dweight = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        dbias = (rows.new_ones(1, rows.shape[0]) @ rows).view(-1) if ctx.needs_input_grad[2] \
            else None
        return dx, dweight, dbias


class MatmulBiasLinear(nn.Linear):
    """nn.Linear; for half-precision inputs its bias gradient is a matrix product."""

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None or x.dtype not in (torch.bfloat16, torch.float16):
            return super().forward(x)
        # the casts autocast would make, done here so that the backward sees one dtype
        with torch.autocast(x.device.type, enabled=False):
            return _LinearMatmulBiasGrad.apply(x, self.weight.to(x.dtype), self.bias.to(x.dtype))
