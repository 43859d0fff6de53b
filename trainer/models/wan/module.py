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

Beyond diffusers' model (docs/model.md, "The wan family"):
- packed batches (`forward_packed`): samples of different shapes in one sequence, self-attention
  within each sample's video and cross-attention to its own caption, through the varlen kernels;
- a second time input (`two_time`): `condition_embedder.time_embedder_r`, mixed as the DiT's,
  e(t, r) = e_t + time_gate (e_r - e_t), feeding every place temb fed;
- the causal form (`causal_chunk_size`): block-causal self-attention, teacher forcing and the
  KV-cache rollout (trainer.models.common.causal, shared with the DiT);
- Ulysses context parallel: the video tokens split over the cp group, self-attention in head
  space; the caption is small and every rank projects it whole, so cross-attention needs no
  exchange (each rank's queries attend to the whole caption with every head);
- sparse video self-attention (`sparse_video`, trainer.models.sparse_attention): the
  bidirectional forward's self-attention over each query tile's top-k key tiles.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.models.attention import AttentionPlan, ChunkLayout, attend, plan_attention, plan_packed
from trainer.models.common.causal import CausalForms, KVCache, PackedKVCache
from trainer.models.common.compiling import apply_compile_settings
from trainer.models.common.inputs import check_text, check_video
from trainer.models.common.norms import HeadRMSNorm
from trainer.models.common.rope import grid_positions, rope_tables
from trainer.models.common.time import conditioning, mix_two_times, timestep_features
from trainer.models.fused_ops import composite_layer_norm_modulate, composite_norm_rope, \
    fused_kernels_apply, layer_norm_modulate, norm_rope
from trainer.models.matmul_bias import MatmulBiasLinear
from trainer.models.sparse_attention import active_settings, sparse_video_plan, tile_order, \
    to_tiles
from trainer.models.wan.config import WAN_DEFAULTS, rope_axes, wan_geometry

__all__ = ["WanTransformer", "WanBlock"]

ROPE_THETA = 10000.0


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32 where Wan computes in float32 (norms, modulation, gated residuals), or in
    float64 when it is float64 already (the exact tests)."""
    return x if x.dtype == torch.float64 else x.float()


def _layer_norm(norm: nn.LayerNorm | nn.Identity, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm in float32 (diffusers' FP32LayerNorm), returning float32 (float64 stays)."""
    if isinstance(norm, nn.Identity):
        return _wide(x)
    weight = None if norm.weight is None else _wide(norm.weight)
    bias = None if norm.bias is None else _wide(norm.bias)
    return F.layer_norm(_wide(x), norm.normalized_shape, weight, bias, norm.eps)


def _modulated_norm(norm: nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor,
                    shift: torch.Tensor) -> torch.Tensor:
    """norm(x) * (1 + scale) + shift in float32, in x's dtype: x [B, N, D] in scale's S equal
    runs, scale/shift [B, S, D]. On a GPU one kernel forward and one backward
    (trainer.models.fused_ops.layer_norm_modulate)."""
    if fused_kernels_apply(x) and scale.dtype == torch.float32:
        return layer_norm_modulate(x, scale, shift, norm.eps)
    return composite_layer_norm_modulate(x, scale, shift, norm.eps)


def _affine_norm(norm: nn.LayerNorm | nn.Identity, x: torch.Tensor) -> torch.Tensor:
    """The cross-attention's norm (affine LayerNorm, or none) in float32, in x's dtype; on a GPU
    the modulated norm's kernels with scale = weight - 1 and shift = bias."""
    if isinstance(norm, nn.LayerNorm) and fused_kernels_apply(x):
        expand = (x.shape[0], 1, x.shape[-1])
        return layer_norm_modulate(x, (norm.weight.float() - 1).expand(expand),
                                   norm.bias.float().expand(expand), norm.eps)
    return _layer_norm(norm, x).type_as(x)


class WanAttention(nn.Module):
    """q/k/v/out projections with RMSNorm on q and k across heads (keys as diffusers')."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q = MatmulBiasLinear(dim, dim)
        self.to_k = MatmulBiasLinear(dim, dim)
        self.to_v = MatmulBiasLinear(dim, dim)
        self.to_out = nn.ModuleList([MatmulBiasLinear(dim, dim), nn.Dropout(0.0)])
        self.norm_q = HeadRMSNorm(dim, eps=eps)
        self.norm_k = HeadRMSNorm(dim, eps=eps)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_q(self.to_q(x)).unflatten(2, (self.heads, -1))

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [B, N, heads, head_dim] of tokens x [B, N, D]."""
        return (self.norm_k(self.to_k(x)).unflatten(2, (self.heads, -1)),
                self.to_v(x).unflatten(2, (self.heads, -1)))

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention's q and k (RMSNorm'd, then RoPE'd by cos/sin [N, head_dim / 2]) and
        v [B, N, heads, head_dim] of tokens x [B, N, D]. On a GPU the norm and the rotation are
        one kernel forward and one backward (trainer.models.fused_ops.norm_rope)."""
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        rotate = norm_rope if fused_kernels_apply(q) and cos.dtype == torch.float32 \
            else composite_norm_rope
        q, k = (rotate(t, norm.weight.to(t.dtype), _eps(norm, t), cos, sin, self.heads)
                for t, norm in ((q, self.norm_q), (k, self.norm_k)))
        return q, k, v.unflatten(2, (self.heads, -1))

    def output(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self.to_out[0](out.flatten(2).type_as(like))


def _eps(norm: nn.RMSNorm, x: torch.Tensor) -> float:
    """The epsilon F.rms_norm uses for `norm` on x (its own, or x's dtype's when None)."""
    return norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps


class GeluProjection(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = MatmulBiasLinear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, hidden), nn.Dropout(0.0),
                                  MatmulBiasLinear(hidden, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class BlockOutput(NamedTuple):
    """A block's updated video tokens (None when only the caption's K/V were asked for), the
    self-attention (k, v) it attended with (RoPE'd; under context parallel in head space: every
    token, this rank's heads) and the caption's cross-attention (k, v); the two K/V pairs only
    when asked for (`keep_kv`) or when they are all that was asked for."""

    x: torch.Tensor | None
    self_kv: tuple[torch.Tensor, torch.Tensor] | None
    cross_kv: tuple[torch.Tensor, torch.Tensor] | None


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
        # trainer.parallel.context_parallel.Ulysses when the video tokens are split over a cp group
        self.ulysses = None

    def forward(self, x: torch.Tensor | None, time_proj: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                self_plan: AttentionPlan | None = None, cross_plan: AttentionPlan | None = None,
                *, context: torch.Tensor | None = None,
                cross_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                keep_kv: bool = False) -> BlockOutput:
        """x [B, N, D] video tokens (under context parallel this rank's share); time_proj
        [B, S, 6, D]: the N tokens form S equal runs (S = 1: one time per sample; S = frames:
        one per patch-frame; S = N: one per token), run s modulated by slot s. The caption is
        `context` [B, L, D] (its K/V computed here) or its `cross_kv` (a cache). `past_kv`:
        committed chunks' self-attention (k, v), seen after the tokens' own keys. With x None
        only the caption's K/V are computed (a rollout's cache). keep_kv: also return the K/V
        pairs; off, the compiled block has no such outputs, whose unused gradients autograd would
        otherwise fill with zeros (four activation-sized tensors a block in every backward pass).
        The model calls blocks only through here, so FSDP2 and activation checkpointing see
        every call."""
        if cross_kv is None:
            cross_kv = self.attn2.keys_values(context)
        if x is None:
            return BlockOutput(None, None, cross_kv)
        runs = time_proj.shape[1]
        mod = _wide(self.scale_shift_table[None]) + _wide(time_proj)  # [B, S, 6, D]
        shift, scale, gate, c_shift, c_scale, c_gate = mod.unbind(2)  # [B, S, D]

        def gated(h, out, g):
            return (_wide(h).unflatten(1, (runs, -1)) + _wide(out).unflatten(1, (runs, -1))
                    * g[:, :, None]).flatten(1, 2).type_as(h)

        h = _modulated_norm(self.norm1, x, scale, shift)
        q, k, v = self.attn1.rotated_qkv(h, *rope)
        if self.ulysses is not None:
            q, k, v = (self.ulysses.to_heads(a) for a in (q, k, v))
        keys, values = (k, v) if past_kv is None else (torch.cat([k, past_kv[0]], dim=1),
                                                       torch.cat([v, past_kv[1]], dim=1))
        out = attend(self_plan, q, keys, values)
        if self.ulysses is not None:
            out = self.ulysses.to_tokens(out)
        x = gated(x, self.attn1.output(out, q), gate)
        h = _affine_norm(self.norm2, x)
        q = self.attn2.query(h)
        x = x + self.attn2.output(attend(cross_plan, q, *cross_kv), q)
        h = _modulated_norm(self.norm3, x, c_scale, c_shift)
        x = gated(x, self.ffn(h), c_gate)
        return BlockOutput(x, (k, v), cross_kv) if keep_kv else BlockOutput(x, None, None)


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
        # the second time input (two_time), made by WanTransformer: E_r next to E_t
        self.time_embedder_r: TimestepEmbedding | None = None


class WanTransformer(CausalForms, nn.Module):
    """relay's Wan transformer for a complete `wan` config (trainer.models.wan.family). Teacher
    forcing and the KV-cache rollout come from trainer.models.common.causal.CausalForms."""

    # sparse video self-attention (trainer.models.sparse_attention): set by the training loop
    # (set_video_attention_sparsity); None or sparsity 0 is the dense path
    supports_sparse_video_attention = True
    sparse_video = None

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self._config = {**WAN_DEFAULTS, **config}
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
        if c["two_time"]:  # E_r starts as a copy of E_t: e(t, t) = e_t
            self.condition_embedder.time_embedder_r = copy.deepcopy(
                self.condition_embedder.time_embedder)
        # Non-persistent: follows .to(), stays out of the state dict (the keys stay diffusers').
        self.register_buffer("time_gate", torch.tensor(float(c["time_gate"])), persistent=False)
        # trainer.parallel.context_parallel.Ulysses when the video tokens are split over a cp group
        self.ulysses = None
        if c.get("zero_init_modulation"):
            self.zero_modulation()

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
        with (trainer.models.common.compiling)."""
        apply_compile_settings()
        for block in self.blocks:
            block.forward = torch.compile(block.forward)

    def attach_context_parallel(self, ulysses) -> None:
        """Run context-parallel through `ulysses` (trainer.parallel.context_parallel.Ulysses):
        the model splits and gathers the video tokens, every block's self-attention trades
        tokens for heads; cross-attention runs on the rank's tokens over the whole caption."""
        for module in (self, *self.blocks):
            module.ulysses = ulysses

    def init_weights(self) -> None:
        """The constructor's initialisation again, in place, for a module built on the meta
        device and materialised empty (trainer.parallel.distributed.materialise): each layer's
        own reset, the modulation tables' N(0, 1/dim), E_r as a copy of E_t, the time gate
        from the config (a non-persistent buffer, so no file holds it)."""
        with torch.no_grad():
            for module in self.modules():
                if module is not self and hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            for table in (self.scale_shift_table, *(b.scale_shift_table for b in self.blocks)):
                table.normal_(0.0, table.shape[-1] ** -0.5)
            if self.condition_embedder.time_embedder_r is not None:
                self.init_second_time_from_first()
            self.time_gate.fill_(float(self._config["time_gate"]))
        if self._config.get("zero_init_modulation"):
            self.zero_modulation()

    def zero_modulation(self) -> None:
        """adaLN-Zero for a model trained from scratch (the run's `zero_init_modulation`): the
        time projection, every scale/shift/gate table and the output projection start at zero,
        so the output is exactly zero and every gated branch (self-attention, FFN) adds nothing
        until training opens its gate. The caption's cross-attention, which Wan does not gate,
        runs from the start."""
        with torch.no_grad():
            for layer in (self.condition_embedder.time_proj, self.proj_out):
                layer.weight.zero_()
                layer.bias.zero_()
            for table in (self.scale_shift_table, *(b.scale_shift_table for b in self.blocks)):
                table.zero_()

    def init_second_time_from_first(self) -> None:
        """E_r := E_t (docs/algorithms.md, "Two-time model"), so e(t, t) = e_t right after: the
        model with single-time weights loaded is exactly that model at r = t. Raises
        RuntimeError on a single-time model."""
        embedder = self.condition_embedder
        if embedder.time_embedder_r is None:
            raise RuntimeError("the model is single-time (two_time: false): it has no second "
                               "time input to initialise")
        with torch.no_grad():
            embedder.time_embedder_r.load_state_dict(embedder.time_embedder.state_dict())

    # ---- inputs ------------------------------------------------------------------------------

    def _chunking(self) -> tuple[int | None, int | None]:
        return self._config["causal_chunk_size"], self._config["attn_window_chunks"]

    def _has_second_time(self) -> bool:
        return self.condition_embedder.time_embedder_r is not None

    def _embed_time(self, t: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        """temb [..., D] of raw times t [...] (and r, two-time: e_t + gate (e_r - e_t), exactly
        e_t when E_r = E_t and r = t; r None = t)."""
        embedder = self.condition_embedder

        def embed(mlp, times):
            features = timestep_features(times.float(), embedder.freq_dim)
            return mlp(features.to(mlp.linear_1.weight.dtype))

        e = embed(embedder.time_embedder, t)
        if embedder.time_embedder_r is None:
            return e
        return mix_two_times(e, embed(embedder.time_embedder_r, t if r is None else r),
                             self.time_gate)

    def _conditioning(self, t: Any, r: Any, batch: int, frames: int, device) -> torch.Tensor:
        """temb per patch-frame slot: [B, 1, D] or [B, T / pt, D]."""
        return conditioning(self._embed_time, self._has_second_time(), t, r, batch, frames,
                            self.patch_size[0], device)

    def _check_video(self, x: torch.Tensor, name: str = "x") -> tuple[int, int, int, int]:
        return check_video(x, self._config["in_channels"], self.patch_size, name)

    def _check_text(self, text: torch.Tensor, text_mask: torch.Tensor | None, batch: int) -> None:
        check_text(text, text_mask, batch, self._config["text_dim"])

    def _context(self, text: torch.Tensor, text_mask: torch.Tensor | None) -> torch.Tensor:
        """The embedded caption [..., L, D], its padding (text_mask False) zeroed first."""
        if text_mask is not None:
            text = text * text_mask[..., None].to(text.dtype)
        return self.condition_embedder.text_embedder(text)

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()  # [B, N, D]

    def _unpatchify(self, out: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        pt, ph, pw = self.patch_size
        b = out.shape[0]
        out = out.reshape(b, frames // pt, height // ph, width // pw, pt, ph, pw, self.out_channels)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, self.out_channels, frames, height,
                                                            width)

    # ---- attention plans ---------------------------------------------------------------------

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.proj_out.weight.dtype

    def _plan(self, num_queries: int, num_keys: int, device,
              layout: ChunkLayout | None = None) -> AttentionPlan:
        return plan_attention(self._config["attention_backend"], num_queries=num_queries,
                              num_keys=num_keys, head_dim=self._config["attention_head_dim"],
                              dtype=self._compute_dtype(device), device=device, layout=layout)

    def _local(self, num_tokens: int) -> int:
        """The tokens of num_tokens this rank holds (all of them without context parallel)."""
        return num_tokens if self.ulysses is None else num_tokens // self.ulysses.size

    def _packed_plan(self, query_ids: torch.Tensor, key_ids: torch.Tensor,
                     dense: torch.Tensor | None = None) -> AttentionPlan:
        """Queries of a pack over keys of the same sample (ids: long, queries non-decreasing):
        a varlen kernel where one runs, else SDPA with the dense mask (`dense`, bool
        [Nq, Nk], when given: a mask within samples, e.g. block-causal)."""
        plan = None
        if dense is None:
            plan = plan_packed(self._config["attention_backend"], query_ids, key_ids,
                               torch.ones_like(key_ids, dtype=torch.bool),
                               head_dim=self._config["attention_head_dim"],
                               dtype=self._compute_dtype(query_ids.device))
        if plan is None:
            mask = (query_ids[:, None] == key_ids[None, :]) if dense is None else dense
            plan = AttentionPlan("sdpa", None, mask[None, None])
        return plan

    # ---- the blocks --------------------------------------------------------------------------

    def _run(self, tokens, temb, slots, positions, self_plan, cross_plan, *, context=None,
             cross_kv=None, past=None, collect_kv=False):
        """The blocks and the head over video tokens [B, N, D]: (head output [B, N, patch
        values], per-layer detached self-attention (k, v) if collect_kv else []).

        temb [B, S, D]: conditioning slots; the tokens form G equal runs, run g taking slot
        slots[g] (None: G = S). The caption is `context` [B, L, D] or per-layer `cross_kv`;
        past[layer]: committed chunks' (k, v). Under context parallel the blocks run on this
        rank's strided share of the tokens (positions and runs follow them) and the output is
        gathered back into the whole sequence.
        """
        if self.ulysses is not None:
            groups = temb.shape[1] if slots is None else slots.shape[0]
            tokens, slots, positions = self.ulysses.split(tokens, slots, positions, groups)
        time_proj = self.condition_embedder.time_proj(F.silu(temb)).unflatten(2, (6, -1))
        if slots is not None:
            temb, time_proj = temb.index_select(1, slots), time_proj.index_select(1, slots)
        work = torch.float64 if self._compute_dtype(tokens.device) == torch.float64 else torch.float32
        rope = rope_tables(positions, rope_axes(self._config["attention_head_dim"]), ROPE_THETA,
                           dtype=work)
        collected = []
        for i, block in enumerate(self.blocks):
            out = block(tokens, time_proj, rope, self_plan, cross_plan, context=context,
                        cross_kv=None if cross_kv is None else cross_kv[i],
                        past_kv=None if past is None else past[i], keep_kv=collect_kv)
            tokens = out.x
            if collect_kv:
                collected.append((out.self_kv[0].detach(), out.self_kv[1].detach()))
        shift, scale = (_wide(self.scale_shift_table[None]) + _wide(temb[:, :, None])
                        ).unbind(2)  # [B, S, D]
        out = self.proj_out(_modulated_norm(self.norm_out, tokens, scale, shift))
        return (out if self.ulysses is None else self.ulysses.gather(out)), collected

    def _cross_queries(self, query_ids: torch.Tensor, padding: int, last: int) -> torch.Tensor:
        """The sample of each cross-attention query this rank runs: the pack's padding attends
        to sample `last`'s caption (its output is dropped)."""
        ids = torch.cat([query_ids, query_ids.new_full((padding,), last)])
        return ids if self.ulysses is None else self.ulysses.share(ids, dim=0)

    # ---- forwards ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, t: Any, text: torch.Tensor,
                text_mask: torch.Tensor | None = None, r: Any = None,
                causal: bool | None = None) -> torch.Tensor:
        """Velocity [B, C_out, T, H, W] for latents x [B, C, T, H, W] at raw times t (scalar,
        [B] or [B, T]; r likewise, two-time models only, None = t), caption text [B, L,
        text_dim] (text_mask bool [B, L]: its False positions are zeroed). causal: None follows
        the config (block-causal over chunks of causal_chunk_size frames when set), False
        forces bidirectional. Raises ValueError for mismatched shapes or r on a single-time
        model."""
        b, frames, height, width = self._check_video(x)
        self._check_text(text, text_mask, b)
        grid = self._grid(frames, height, width)
        if causal is None:
            causal = self._config["causal_chunk_size"] is not None
        temb = self._conditioning(t, r, b, frames, x.device)
        out = self._run_captioned(self._patchify(x), temb, None, grid_positions(*grid, 0, x.device),
                                  text, text_mask, "block_causal" if causal else None, grid)
        return self._unpatchify(out, frames, height, width)

    def _run_captioned(self, tokens, temb, slots, positions, text, text_mask, kind, grid):
        """The blocks and the head over video tokens [B, N, D] and their caption
        (CausalForms' hook): self-attention under the chunk rule `kind` (None: bidirectional),
        cross-attention to the caption."""
        layout = self._chunk_layout(kind, grid, 0)
        context = self._context(text, text_mask)
        n = tokens.shape[1]
        sparse = active_settings(self, kind)
        if sparse is None:
            self_plan = self._plan(n, n, tokens.device, layout)
        else:  # tile-major order for the blocks, the head output put back (docs/model.md)
            order = tile_order(grid, sparse.tile, tokens.device)
            tokens, positions, slots = to_tiles(order, tokens, positions, slots, temb.shape[1]
                                                if slots is None else slots.shape[0])
            self_plan = sparse_video_plan(sparse, self._config["attention_backend"], num_video=n,
                                          head_dim=self._config["attention_head_dim"],
                                          dtype=self._compute_dtype(tokens.device),
                                          device=tokens.device)
        out, _ = self._run(tokens, temb, slots, positions, self_plan,
                           self._plan(self._local(n), context.shape[1], tokens.device),
                           context=context)
        return out if sparse is None else out[:, order.from_tiles]

    def forward_packed(self, xs: list[torch.Tensor], ts: list[Any], texts: list[torch.Tensor],
                       text_masks: list[torch.Tensor], causal: bool | None = None
                       ) -> list[torch.Tensor]:
        """Predictions [C_out, T_i, H_i, W_i] for samples of different shapes run as one pack:
        xs [C, T_i, H_i, W_i], ts each sample's raw time (scalar or [T_i]), texts [L_i,
        text_dim], text_masks bool [L_i]. Each sample's tokens attend to its own video (its own
        RoPE grid from 0) and its own caption, so each prediction equals forward() on that
        sample alone; causal as in forward(), within each sample."""
        from trainer.data.packing import pack_layout

        layout = pack_layout(xs, texts, self.patch_size)
        if causal is None:
            causal = self._config["causal_chunk_size"] is not None
        within = self._within("block_causal", layout.grids) if causal else None
        conds, slots = [], []
        for x, t, (frames, rows, cols) in zip(xs, ts, layout.grids):
            conds.append(self._conditioning(torch.as_tensor(t, device=x.device)[None], None, 1,
                                            x.shape[1], x.device))
            per_frame = torch.arange(frames, device=x.device).repeat_interleave(rows * cols)
            slots.append(per_frame if conds[-1].shape[1] > 1 else per_frame * 0)
        tokens = torch.cat([self._patchify(x[None]) for x in xs], dim=1)
        pieces = self._run_pack(tokens, conds, slots, layout, texts, text_masks, within)
        return [self._unpatchify(p, *x.shape[1:])[0] for p, x in zip(pieces, xs)]

    def _run_pack(self, tokens, conds, slots, layout, texts, text_masks, within):
        """The blocks over a pack's tokens [1, N, D]: conds[i] [1, S_i, D] are sample i's
        conditioning slots and slots[i] (long, one per token) which of them each of its tokens
        takes; within[i] (None: all) sample i's own self-attention mask. Returns the head
        output split per sample ([1, n_i, patch values] each)."""
        offsets = [0]
        for cond in conds[:-1]:
            offsets.append(offsets[-1] + cond.shape[1])
        slots = torch.cat([o + s for o, s in zip(offsets, slots)])
        device = tokens.device
        tokens, positions, slots, pad = self._pad_to_split(tokens, layout.positions(device), slots)
        samples = len(layout.grids)
        video_ids = layout.video_ids(device)
        query_ids = torch.cat([video_ids, video_ids.new_full((pad,), samples)])
        dense = None
        if within is not None:  # a mask within each sample: dense, for SDPA
            dense = torch.block_diag(*(w.to(device) for w in within),
                                     torch.ones(pad, pad, dtype=torch.bool, device=device))
        self_plan = self._packed_plan(query_ids, query_ids, dense)
        cross_plan = self._packed_plan(self._cross_queries(video_ids, pad, samples - 1),
                                       layout.text_ids(device))
        context = self._context(torch.cat(texts)[None], torch.cat(text_masks)[None])
        out, _ = self._run(tokens, torch.cat(conds, dim=1), slots, positions, self_plan,
                           cross_plan, context=context)
        return out[:, :sum(layout.video_lens)].split(layout.video_lens, dim=1)

    # ---- the rollout cache (CausalForms' hooks) ---------------------------------------------

    def _block_caption_kv(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each block's cross-attention (k, v) of an embedded caption [B, L, D] (through the
        block's forward, so FSDP2 gathers its weights)."""
        return [block(None, context=context).cross_kv for block in self.blocks]

    def _caption_kv(self, text: torch.Tensor, text_mask: torch.Tensor | None):
        """The caption's per-layer cross-attention (k, v); every position is a key (padding is
        zeroed), so no lengths."""
        return self._block_caption_kv(self._context(text, text_mask)), None

    def _run_cached(self, tokens, temb, positions, cache: KVCache, collect_kv: bool):
        """The blocks and the head over a chunk's tokens: self-attention over [the chunk |
        committed chunks], cross-attention to the cached caption."""
        past = [cache.past(i) for i in range(len(self.blocks))]
        n = tokens.shape[1]
        committed = 0 if past[0] is None else past[0][0].shape[1]
        return self._run(tokens, temb, None, positions, self._plan(n, n + committed, tokens.device),
                         self._plan(self._local(n), cache.text_kv[0][0].shape[1], tokens.device),
                         cross_kv=cache.text_kv, past=past, collect_kv=collect_kv)

    def _packed_caption_kv(self, texts: list[torch.Tensor], text_masks: list[torch.Tensor]):
        """A pack's captions projected in one call per block (every rank of a sharded model runs
        the same forwards whatever its pack), their per-layer cross-attention K/V kept per
        sample; every caption position is a key."""
        lengths = [int(t.shape[0]) for t in texts]
        context = self._context(torch.cat(texts)[None], torch.cat(text_masks)[None])
        per_layer = [[(k, v) for k, v in zip(k_all.split(lengths, dim=1), v_all.split(lengths, dim=1))]
                     for k_all, v_all in self._block_caption_kv(context)]
        return [[layer[i] for layer in per_layer] for i in range(len(texts))], None

    def _run_cached_pack(self, tokens, temb, slots, positions, query_ids, padding: int,
                         cache: PackedKVCache, samples: list[int], collect_kv: bool):
        """The blocks and the head over the next chunks of a pack's samples: each sample's
        self-attention over its own chunk and committed chunks, its cross-attention to its own
        cached caption (query_ids: each token's sample, the padding one past the pack's)."""
        device = tokens.device
        past, past_ids = [], []
        for layer in range(len(self.blocks)):
            pieces = [c[layer] for i in samples for c in cache.chunks[i]]
            past.append(None if not pieces else (torch.cat([k for k, _ in pieces], dim=1),
                                                 torch.cat([v for _, v in pieces], dim=1)))
        for i in samples:
            committed = sum(c[0][0].shape[1] for c in cache.chunks[i])
            past_ids.append(torch.full((committed,), i, device=device))
        self_plan = self._packed_plan(query_ids, torch.cat([query_ids, *past_ids]))
        cross_ids = torch.cat([torch.full((cache.text_kv[i][0][0].shape[1],), i, device=device)
                               for i in samples])
        real_ids = query_ids[:query_ids.shape[0] - padding]
        cross_plan = self._packed_plan(self._cross_queries(real_ids, padding, samples[-1]),
                                       cross_ids)
        cross_kv = [(torch.cat([cache.text_kv[i][layer][0] for i in samples], dim=1),
                     torch.cat([cache.text_kv[i][layer][1] for i in samples], dim=1))
                    for layer in range(len(self.blocks))]
        return self._run(tokens, temb, slots, positions, self_plan, cross_plan,
                         cross_kv=cross_kv, past=past, collect_kv=collect_kv)
