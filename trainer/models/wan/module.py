"""The Wan2.1/2.2 text-to-video transformer in relay's code, with diffusers' state-dict keys.

Same computation as diffusers' `WanTransformer3DModel` (a test holds the two equal in float32),
written so that relay's attention kernels, compiled blocks and activation checkpointing apply:

- the latents [B, C, T, H, W] go through a Conv3d patch embedding, one token per
  (pt, ph, pw) patch, frame major;
- the time: sinusoidal features (cos half, then sin half) of the raw timestep, an MLP
  (`condition_embedder.time_embedder`) to temb [D], and one projection shared by all blocks
  (`condition_embedder.time_proj`, of silu(temb)) to 6 vectors; each block adds its own
  `scale_shift_table` [1, 6, D] to them: shift, scale and gate of the self-attention and of the
  FFN, in float32;
- the caption [B, L, text_dim] through an MLP (linear, gelu-tanh, linear);
- a block: norm1 (LayerNorm, no affine) + modulation -> self-attention `attn1` (RMSNorm of q
  and of k across all heads, then 3-D RoPE: each head's channels split into frame, row and
  column pairs as `rope_axes` says) -> gated residual; norm2 (affine when cross_attn_norm) ->
  cross-attention `attn2` to the caption (RMSNorm of q and k, no RoPE) -> residual; norm3 +
  modulation -> FFN (gelu-tanh) -> gated residual;
- the output: LayerNorm + shift/scale from temb and the top-level `scale_shift_table`
  [1, 2, D], `proj_out`, unpatchify to [B, C_out, T, H, W].

A time is one per sample [B] or one per latent frame [B, T] (per-frame times are embedded per
patch-frame, as Wan2.2 TI2V embeds a time per token, and broadcast over the frame's tokens).
Caption padding: Wan was trained on captions padded with zero vectors, attending to them, so a
`text_mask` zeroes the padding positions and every position is attended (the output then equals
diffusers' on the zero-padded caption); the caption length is part of the input, as it is for
Wan (whose pipeline pads to 512 tokens).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.models.attention import AttentionPlan, attend, plan_attention
from trainer.models.dit.module import (HeadRMSNorm, apply_rope, grid_positions, rope_tables,
                                       timestep_features)
from trainer.models.wan.config import rope_axes, wan_geometry

__all__ = ["WanTransformer", "WanBlock"]

ROPE_THETA = 10000.0


def _layer_norm(norm: nn.LayerNorm | nn.Identity, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm in float32 (diffusers' FP32LayerNorm), returning float32."""
    if isinstance(norm, nn.Identity):
        return x.float()
    weight = None if norm.weight is None else norm.weight.float()
    bias = None if norm.bias is None else norm.bias.float()
    return F.layer_norm(x.float(), norm.normalized_shape, weight, bias, norm.eps)


class WanAttention(nn.Module):
    """q/k/v/out projections with RMSNorm on q and k across heads (keys as diffusers')."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.norm_q = HeadRMSNorm(dim, eps=eps)
        self.norm_k = HeadRMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, plan: AttentionPlan,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q = self.norm_q(self.to_q(x)).unflatten(2, (self.heads, -1))
        k = self.norm_k(self.to_k(context)).unflatten(2, (self.heads, -1))
        v = self.to_v(context).unflatten(2, (self.heads, -1))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attend(plan, q, k, v).flatten(2).type_as(q)
        return self.to_out[0](out)


class GeluProjection(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, hidden), nn.Dropout(0.0), nn.Linear(hidden, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class WanBlock(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, heads: int, cross_attn_norm: bool, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, heads, eps)
        self.attn2 = WanAttention(dim, heads, eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps) if cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, ffn_dim)
        self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, text: torch.Tensor, time_proj: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], self_plan: AttentionPlan,
                cross_plan: AttentionPlan) -> torch.Tensor:
        """x [B, N, D]; text [B, L, D]; time_proj [B, S, 6, D]: the N tokens form S equal runs
        (S = 1: one time per sample; S = frames: one per patch-frame), run s modulated by slot s."""
        b, n, d = x.shape
        runs = time_proj.shape[1]
        mod = self.scale_shift_table[None].float() + time_proj.float()  # [B, S, 6, D]
        shift, scale, gate, c_shift, c_scale, c_gate = mod[:, :, :, None].unbind(2)  # [B, S, 1, D]

        def modulate(norm, h, sc, sh):
            return (_layer_norm(norm, h).unflatten(1, (runs, -1)) * (1 + sc) + sh).flatten(1, 2)

        def gated(h, out, g):
            return (h.float().unflatten(1, (runs, -1)) + out.float().unflatten(1, (runs, -1)) * g
                    ).flatten(1, 2).type_as(h)

        h = modulate(self.norm1, x, scale, shift).type_as(x)
        x = gated(x, self.attn1(h, h, self_plan, rope), gate)
        h = _layer_norm(self.norm2, x).type_as(x)
        x = x + self.attn2(h, text, cross_plan)
        h = modulate(self.norm3, x, c_scale, c_shift).type_as(x)
        return gated(x, self.ffn(h), c_gate)


class TimestepEmbedding(nn.Module):
    def __init__(self, freq_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(freq_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TextProjection(nn.Module):
    def __init__(self, text_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(text_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


class ConditionEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int, text_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = TimestepEmbedding(freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TextProjection(text_dim, dim)


class WanTransformer(nn.Module):
    """relay's Wan transformer for a complete `wan` config (trainer.models.wan.family)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self._config = dict(config)
        c = self._config
        heads, head_dim = c["num_attention_heads"], c["attention_head_dim"]
        d = heads * head_dim
        self.patch_size = tuple(c["patch_size"])
        self.out_channels = c["out_channels"] or c["in_channels"]
        self.patch_embedding = nn.Conv3d(c["in_channels"], d, kernel_size=self.patch_size,
                                         stride=self.patch_size)
        self.condition_embedder = ConditionEmbedder(d, c["freq_dim"], c["text_dim"])
        self.blocks = nn.ModuleList(WanBlock(d, c["ffn_dim"], heads, c["cross_attn_norm"], c["eps"])
                                    for _ in range(c["num_layers"]))
        self.norm_out = nn.LayerNorm(d, eps=c["eps"], elementwise_affine=False)
        self.proj_out = nn.Linear(d, self.out_channels * math.prod(self.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)

    # ---- the protocol's hooks (trainer.models.protocol) -------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._config)

    @property
    def geometry(self):
        return wan_geometry(self._config)

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def checkpoint_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def compile_blocks(self) -> None:
        """torch.compile each block in place, with the Inductor settings relay's DiT compiles
        with (trainer.models.dit.module.compile_transformer_blocks)."""
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        from trainer.models.dit.module import ACTIVATION_MEMORY_BUDGET

        if hasattr(inductor_config.triton, "mix_order_reduction"):
            inductor_config.triton.mix_order_reduction = False
        functorch_config.activation_memory_budget = ACTIVATION_MEMORY_BUDGET
        for block in self.blocks:
            block.forward = torch.compile(block.forward)

    def attach_context_parallel(self, ulysses) -> None:
        raise ValueError("model_family wan does not run context-parallel yet: set cp_size: 1")

    # ---- inputs ------------------------------------------------------------------------------

    def _frame_times(self, t: Any, batch: int, frames: int, device) -> torch.Tensor:
        """Times per patch-frame: [B, 1] per sample, [B, T / pt] per frame (all equal: [B, 1])."""
        t = torch.as_tensor(t, device=device)
        if t.ndim == 0:
            t = t.expand(batch)
        if t.ndim == 1 and t.shape[0] == batch:
            return t[:, None]
        if t.ndim == 2 and tuple(t.shape) == (batch, frames):
            t = t[:, :: self.patch_size[0]]
            return t[:, :1] if bool((t == t[:, :1]).all()) else t
        raise ValueError(f"t must be a scalar, [B]={[batch]} or [B, T]={[batch, frames]}, "
                         f"got {list(t.shape)}")

    def _check(self, x: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor | None) -> None:
        c = self._config
        if x.ndim != 5 or x.shape[1] != c["in_channels"]:
            raise ValueError(f"x must be [B, {c['in_channels']}, T, H, W], got {list(x.shape)}")
        for size, patch, axis in zip(x.shape[2:], self.patch_size, "THW"):
            if size % patch:
                raise ValueError(f"x: {axis}={size} is not a multiple of the patch size {patch}")
        if text.ndim != 3 or text.shape[0] != x.shape[0] or text.shape[2] != c["text_dim"]:
            raise ValueError(f"text must be [B={x.shape[0]}, L, {c['text_dim']}], got {list(text.shape)}")
        if text_mask is not None and (text_mask.dtype != torch.bool
                                      or text_mask.shape != text.shape[:2]):
            raise ValueError(f"text_mask must be bool [B, L]={list(text.shape[:2])}, "
                             f"got {text_mask.dtype} {list(text_mask.shape)}")

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.proj_out.weight.dtype

    def _plan(self, num_queries: int, num_keys: int, device) -> AttentionPlan:
        return plan_attention(self._config["attention_backend"], num_queries=num_queries,
                              num_keys=num_keys, head_dim=self._config["attention_head_dim"],
                              dtype=self._compute_dtype(device), device=device)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, t: Any, text: torch.Tensor,
                text_mask: torch.Tensor | None = None, r: Any = None) -> torch.Tensor:
        """Velocity [B, C_out, T, H, W] for latents x [B, C, T, H, W] at raw times t (scalar,
        [B] or [B, T]), caption text [B, L, text_dim] (text_mask bool [B, L]: its False
        positions are zeroed). Raises ValueError for mismatched shapes or an `r` (the wan family
        has no second time input)."""
        if r is not None:
            raise ValueError("r was given, but the wan family has no second time input")
        self._check(x, text, text_mask)
        b, _, frames, height, width = x.shape
        pt, ph, pw = self.patch_size
        grid = (frames // pt, height // ph, width // pw)
        embedder = self.condition_embedder

        times = self._frame_times(t, b, frames, x.device)  # [B, S]
        features = timestep_features(times.float(), embedder.freq_dim)
        temb = embedder.time_embedder(features.to(embedder.time_embedder.linear_1.weight.dtype))
        time_proj = embedder.time_proj(F.silu(temb)).unflatten(2, (6, -1))  # [B, S, 6, D]
        if text_mask is not None:
            text = text * text_mask[..., None].to(text.dtype)
        context = embedder.text_embedder(text)

        tokens = self.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()  # [B, N, D]
        n = tokens.shape[1]
        work = torch.float64 if self._compute_dtype(x.device) == torch.float64 else torch.float32
        rope = rope_tables(grid_positions(*grid, 0, x.device),
                           rope_axes(self._config["attention_head_dim"]), ROPE_THETA, dtype=work)
        self_plan = self._plan(n, n, x.device)
        cross_plan = self._plan(n, context.shape[1], x.device)
        for block in self.blocks:
            tokens = block(tokens, context, time_proj, rope, self_plan, cross_plan)

        runs = times.shape[1]
        shift, scale = (self.scale_shift_table[None].float() + temb[:, :, None].float()
                        )[:, :, :, None].unbind(2)  # [B, S, 1, D]
        h = (_layer_norm(self.norm_out, tokens).unflatten(1, (runs, -1)) * (1 + scale) + shift)
        out = self.proj_out(h.flatten(1, 2).type_as(tokens))
        out = out.reshape(b, *grid, pt, ph, pw, self.out_channels)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, self.out_channels, frames, height, width)
