"""The wan blocks' fused Triton kernels (trainer/models/triton_kernels.py) as registered operators.

`norm_rope(x, weight, eps, cos, sin, heads)`: RMSNorm of x across all heads, then RoPE on each
head's channel pairs. The forward is `relay::norm_rope_forward`, one pass over the rows; the
backward `relay::norm_rope_backward`, one kernel that also sums the weight gradient, where
Inductor's fused reduction ran several times below memory bandwidth (docs/performance.md). As
registered operators they are single nodes of a compiled block; the partitioner saves the
forward's input for the backward, which measured no higher peak than Inductor's own fusion at
the Wan2.1-1.3B step.

`layer_norm_modulate(x, scale, shift, eps)`: LayerNorm(x) * (1 + scale) + shift, a row of
scale and shift for each of S equal runs of tokens. The forward is
`relay::layer_norm_modulate_forward`, inside a checkpoint so that the backward pass runs it
again instead of keeping its output; the backward `relay::layer_norm_modulate_backward` also
sums the scale's and shift's gradients over each run.

The kernels compute in float32 and round once, where the composite code rounds between steps,
so the two agree to the input dtype's rounding (tests/test_fused_ops.py holds them equal
in float32 under Triton's interpreter; tests/gpu/test_wan_gpu.py in bf16 on a GPU).
`fused_kernels_apply(x)` says whether a tensor takes this path: on CUDA with triton present.
The kernels' module is imported at the first call, so this one imports without triton.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from trainer.models.common.rope import apply_rope


def _kernels():
    from trainer.models import triton_kernels

    return triton_kernels


# Looked up once here: inside a compiled block the lookup would break the graph in two.
TRITON_PRESENT = importlib.util.find_spec("triton") is not None


def fused_kernels_apply(x: Tensor) -> bool:
    """Whether x takes the fused kernels: a CUDA tensor with triton installed (it ships with
    torch's CUDA builds). Elsewhere (CPU runs, float64 tests) the composite torch code runs."""
    return TRITON_PRESENT and x.is_cuda and x.dtype != torch.float64


def composite_norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                        heads: int) -> Tensor:
    """RoPE(RMSNorm(x) * weight) in torch ops, [B, N, heads * head_dim] -> [B, N, heads,
    head_dim]."""
    return apply_rope(F.rms_norm(x, (x.shape[-1],), weight, eps).unflatten(2, (heads, -1)), cos, sin)


@torch.library.custom_op("relay::norm_rope_forward", mutates_args=())
def _norm_rope_forward(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    return _kernels().norm_rope_forward(x.contiguous(), weight.contiguous(), cos.contiguous(),
                                        sin.contiguous(), eps)


@_norm_rope_forward.register_fake
def _(x, weight, cos, sin, eps):
    return torch.empty_like(x)


@torch.library.custom_op("relay::norm_rope_backward", mutates_args=())
def _norm_rope_backward(dy: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    dx, dweight = _kernels().norm_rope_backward(dy.contiguous(), x.contiguous(),
                                                weight.contiguous(), cos.contiguous(),
                                                sin.contiguous(), eps)
    return dx, dweight.to(weight.dtype)


@_norm_rope_backward.register_fake
def _(dy, x, weight, cos, sin, eps):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, cos, sin, eps = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.eps = eps


def _backward(ctx, dy: Tensor):
    x, weight, cos, sin = ctx.saved_tensors
    dx, dweight = _norm_rope_backward(dy, x, weight, cos, sin, ctx.eps)
    return dx, dweight, None, None, None


_norm_rope_forward.register_autograd(_backward, setup_context=_setup_context)


def norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
              heads: int) -> Tensor:
    """RoPE(RMSNorm(x) * weight) of x [B, N, heads * head_dim] as [B, N, heads, head_dim]: the
    norm over all channels, then each head's consecutive channel pairs rotated by token n's
    angles cos/sin [N, head_dim / 2] (float32); weight in x's dtype."""
    return _norm_rope_forward(x, weight, cos, sin, eps).unflatten(2, (heads, -1))


def composite_layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    """LayerNorm(x) * (1 + scale) + shift in float32 torch ops (float64 stays), returned in x's
    dtype: x [B, N, D], scale/shift [B, S, D] (the N tokens in S equal runs, run s modulated by
    row s)."""
    wide = x if x.dtype == torch.float64 else x.float()
    h = F.layer_norm(wide, (x.shape[-1],), eps=eps).unflatten(1, (scale.shape[1], -1))
    return (h * (1 + scale[:, :, None]) + shift[:, :, None]).flatten(1, 2).type_as(x)


@torch.library.custom_op("relay::layer_norm_modulate_backward", mutates_args=())
def _layer_norm_modulate_backward(dy: Tensor, x: Tensor, scale: Tensor,
                                  eps: float) -> tuple[Tensor, Tensor, Tensor]:
    dx, dscale, dshift = _kernels().layer_norm_modulate_backward(dy.contiguous(), x.contiguous(),
                                                                 scale.contiguous(), eps)
    return dx, dscale.view(scale.shape).to(scale.dtype), dshift.view(scale.shape).to(scale.dtype)


@_layer_norm_modulate_backward.register_fake
def _(dy, x, scale, eps):
    return torch.empty_like(x), torch.empty_like(scale), torch.empty_like(scale)


@torch.library.custom_op("relay::layer_norm_modulate_forward", mutates_args=())
def _layer_norm_modulate_forward(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    return _kernels().layer_norm_modulate_forward(x.contiguous(), scale.contiguous(),
                                                  shift.contiguous(), eps)


@_layer_norm_modulate_forward.register_fake
def _(x, scale, shift, eps):
    return torch.empty_like(x)


def _setup_modulate_context(ctx, inputs, output):
    x, scale, shift, eps = inputs
    ctx.save_for_backward(x, scale)
    ctx.eps = eps


def _modulate_backward(ctx, dy: Tensor):
    x, scale = ctx.saved_tensors
    dx, dscale, dshift = _layer_norm_modulate_backward(dy, x, scale, ctx.eps)
    return dx, dscale, dshift, None


_layer_norm_modulate_forward.register_autograd(_modulate_backward,
                                               setup_context=_setup_modulate_context)


def layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    """composite_layer_norm_modulate as one Triton kernel forward and one backward; scale and
    shift float32. The forward runs again in the backward pass rather than have its output
    saved: an operator's output is otherwise kept for the backward (a token-sized tensor per
    norm, 8.4 GiB at the Wan2.1-1.3B step), where the partitioner recomputes Inductor's own
    LayerNorm from the block's input."""
    return checkpoint(_layer_norm_modulate_forward, x, scale, shift, eps, use_reentrant=False)
