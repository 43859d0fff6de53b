"""The Triton kernels behind trainer/models/fused_ops.py, forward and backward: q/k RMSNorm +
RoPE, and LayerNorm + modulation (scale and shift).

Inductor folds the column sums of a backward pass (the norm weight's gradient, the modulation's
scale and shift gradients: sums over all tokens) into the row-wise backward kernel, and that
fused reduction runs far below memory bandwidth: 0.81 ms a layer for q and k together at the
Wan2.1-1.3B shape on an H200, where their memory traffic needs about 0.15 ms, and 0.85 ms for a
block's three LayerNorms, where it needs about 0.2. Here each backward program takes a fixed run
of rows and keeps its share of the column sums in registers, writing one partial row the caller
adds up. Each forward is one pass over whole rows, in float32, rounded once.

Importing this module imports triton; fused_ops imports it at the first call. The launchers
take any tensors triton can address, so under TRITON_INTERPRET=1 they run on CPU tensors (the
tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Each program takes this many row tiles and writes one partial sum of the weight gradient: a
# fixed count (not a loop to a runtime bound), so a new row count, as packed batches bring every
# step, compiles nothing new.
ROW_BLOCKS = 16


@triton.jit
def _norm_rope_forward(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, rows, seq, eps, D: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    p = tl.arange(0, BLOCK_D // 2)
    mask = (r[:, None] < rows) & (d[None, :] < D)
    pmask = (r[:, None] < rows) & (p[None, :] < D // 2)
    offsets = r.to(tl.int64)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    angle = (r[:, None] % seq) * HALF + p[None, :] % HALF
    c = tl.load(cos_ptr + angle, mask=pmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + angle, mask=pmask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    z = x * rstd[:, None] * w[None, :]
    ze, zo = tl.split(tl.reshape(z, (BLOCK_M, BLOCK_D // 2, 2)))
    y = tl.reshape(tl.join(ze * c - zo * s, ze * s + zo * c), (BLOCK_M, BLOCK_D))
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_backward(dy_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, dx_ptr, dw_ptr, rows, seq, eps,
                        D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, ROW_BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    p = tl.arange(0, BLOCK_D // 2)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(ROW_BLOCKS):
        r = (pid * ROW_BLOCKS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (r[:, None] < rows) & (d[None, :] < D)
        pmask = (r[:, None] < rows) & (p[None, :] < D // 2)
        offsets = r.to(tl.int64)[:, None] * D + d[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        angle = (r[:, None] % seq) * HALF + p[None, :] % HALF
        c = tl.load(cos_ptr + angle, mask=pmask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + angle, mask=pmask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        n = x * rstd[:, None]
        # the rotation's transpose takes dy back to the gradient of the normalised, scaled z
        de, do = tl.split(tl.reshape(dy, (BLOCK_M, BLOCK_D // 2, 2)))
        dz = tl.reshape(tl.join(de * c + do * s, do * c - de * s), (BLOCK_M, BLOCK_D))
        dw += tl.sum(dz * n, axis=0)
        dn = dz * w[None, :]
        dot = tl.sum(dn * n, axis=1) / D
        dx = rstd[:, None] * (dn - n * dot[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * D + d, dw, mask=d < D)


@triton.jit
def _layer_norm_modulate_forward(x_ptr, scale_ptr, shift_ptr, y_ptr, run_len, eps,
                                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    run = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mask = (r[:, None] < run_len) & (d[None, :] < D)
    offsets = (run.to(tl.int64) * run_len + r)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    xc = tl.where(mask, x - (tl.sum(x, axis=1) / D)[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)
    scale = tl.load(scale_ptr + run * D + d, mask=d < D, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + run * D + d, mask=d < D, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * (1 + scale[None, :]) + shift[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_modulate_backward(dy_ptr, x_ptr, scale_ptr, dx_ptr, dscale_ptr, dshift_ptr,
                                  run_len, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                  BLOCK_M: tl.constexpr, ROW_BLOCKS: tl.constexpr):
    run = tl.program_id(0)
    part = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    scale = tl.load(scale_ptr + run * D + d, mask=d < D, other=0.0).to(tl.float32)
    dscale = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dshift = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(ROW_BLOCKS):
        r = (part * ROW_BLOCKS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (r[:, None] < run_len) & (d[None, :] < D)
        offsets = (run.to(tl.int64) * run_len + r)[:, None] * D + d[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - (tl.sum(x, axis=1) / D)[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)
        n = xc * rstd[:, None]
        dscale += tl.sum(dy * n, axis=0)
        dshift += tl.sum(dy, axis=0)
        dn = dy * (1 + scale[None, :])
        dx = rstd[:, None] * (dn - (tl.sum(dn, axis=1) / D)[:, None]
                              - n * (tl.sum(dn * n, axis=1) / D)[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    partial = (run * tl.num_programs(1) + part) * D + d
    tl.store(dscale_ptr + partial, dscale, mask=d < D)
    tl.store(dshift_ptr + partial, dshift, mask=d < D)


def _row_tile(d: int, elements: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_M, num_warps): whole rows, about `elements` to a tile and 1,024 to a
    warp. Measured at D = 1536 on an H200: the forward is fastest at 8K elements, the backward,
    which holds more in registers, at 4K (0.11 ms a tensor against 0.17 at 8K)."""
    block_d = triton.next_power_of_2(d)
    block_m = max(1, elements // block_d)
    return block_d, block_m, max(1, min(16, block_m * block_d // 1024))


def _row_layout(x: torch.Tensor, cos: torch.Tensor) -> tuple[int, int, int, int]:
    d = x.shape[-1]
    return d, cos.shape[-1], x.numel() // d, cos.shape[0]


def norm_rope_forward(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """y = RoPE(RMSNorm(x) * weight), x's shape and dtype: x [..., seq, D] contiguous (the norm
    over all D channels), cos/sin [seq, head_dim / 2] float32 (each head's consecutive channel
    pairs rotated by its token's angles)."""
    d, half, rows, seq = _row_layout(x, cos)
    y = torch.empty_like(x)
    block_d, block_m, warps = _row_tile(d, 8192)
    _norm_rope_forward[(triton.cdiv(rows, block_m),)](
        x, weight, cos, sin, y, rows, seq, eps, D=d, HALF=half, BLOCK_D=block_d, BLOCK_M=block_m,
        num_warps=warps)
    return y


def norm_rope_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight in float32) of norm_rope_forward for the output gradient dy (x's shape)."""
    d, half, rows, seq = _row_layout(x, cos)
    dx = torch.empty_like(x)
    block_d, block_m, warps = _row_tile(d, 4096)
    programs = triton.cdiv(rows, block_m * ROW_BLOCKS)
    partial = torch.empty((programs, d), dtype=torch.float32, device=x.device)
    _norm_rope_backward[(programs,)](
        dy, x, weight, cos, sin, dx, partial, rows, seq, eps, D=d, HALF=half, BLOCK_D=block_d,
        BLOCK_M=block_m, ROW_BLOCKS=ROW_BLOCKS, num_warps=warps)
    return dx, partial.sum(0)


def layer_norm_modulate_forward(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                                eps: float) -> torch.Tensor:
    """y = LayerNorm(x) * (1 + scale) + shift, x's shape and dtype: x [..., D] contiguous, its
    rows in `runs` equal runs (runs = scale.numel() // D), run i modulated by row i of scale
    and shift [runs, D] (float32); the norm without affine weights, in float32."""
    d, runs = x.shape[-1], scale.numel() // x.shape[-1]
    run_len = x.numel() // d // runs
    y = torch.empty_like(x)
    block_d, block_m, warps = _row_tile(d, 8192)
    _layer_norm_modulate_forward[(runs, triton.cdiv(run_len, block_m))](
        x, scale, shift, y, run_len, eps, D=d, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=warps)
    return y


def layer_norm_modulate_backward(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dscale, dshift) of layer_norm_modulate_forward for the output gradient dy; dscale
    and dshift [runs, D] float32, summed over each run's rows."""
    d, runs = x.shape[-1], scale.numel() // x.shape[-1]
    run_len = x.numel() // d // runs
    dx = torch.empty_like(x)
    block_d, block_m, warps = _row_tile(d, 4096)
    # runs shorter than a program's rows (a time per token) take fewer row tiles a program
    row_blocks = min(ROW_BLOCKS, triton.cdiv(run_len, block_m))
    parts = triton.cdiv(run_len, block_m * row_blocks)
    dscale = torch.empty((runs, parts, d), dtype=torch.float32, device=x.device)
    dshift = torch.empty_like(dscale)
    _layer_norm_modulate_backward[(runs, parts)](
        dy, x, scale, dx, dscale, dshift, run_len, eps, D=d, BLOCK_D=block_d, BLOCK_M=block_m,
        ROW_BLOCKS=row_blocks, num_warps=warps)
    return dx, dscale.sum(1), dshift.sum(1)
