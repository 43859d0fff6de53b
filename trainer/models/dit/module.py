"""The video diffusion transformer (DiT) that every stage trains.

Input latents x [B, C, T, H, W] are cut into (pt, ph, pw) patches, one token per patch, frame
major. Each block is pre-norm self-attention + MLP with adaLN-Zero modulation (shift, scale,
gate for each half) from the timestep embedding; queries and keys get RMSNorm (qk-norm) and
3-D RoPE by the patch's (frame, row, col). A final adaLN + linear head maps tokens back to
patches: the output is [B, C_out, T, H, W] (the velocity, docs/algorithms.md, "Notation and conventions").

Text conditioning is joint attention: the caption's hidden states are projected to the hidden
size and their keys/values sit in front of the video's in every block. Text tokens go through
the same block weights with a plain (unmodulated) norm and attend only to text. So the text
stream is a function of the caption alone, never of the video or of the timestep: its K/V can
be computed once per caption and reused for every chunk and every denoising step of a causal
rollout, and the same code path serves full forwards and cached ones. (Modulating text by the
timestep would tie its K/V to t, and per-frame times in causal stages would leave no single t
to use.) Text tokens get no RoPE; RoPE at position 0 is the identity, so this is the same as
giving them position 0.

Attention runs in two calls per block, text over text and video over [video | text], instead of
one call with a joint mask. The video call then needs no mask at all in the bidirectional case,
and under context parallelism each call trades tokens for heads on its own stream: the caption's
and the video's tokens are both split over the ranks, and the text K/V in head space is the
prefix of the video's keys.
The caption's keys come last, so its padding is a number of used keys per sample (a sequence
length for FlashAttention), never a dense mask; a mask that hides nothing is dropped before
attention. trainer/models/attention.py routes each call to its kernel.

Modes: bidirectional (`causal_chunk_size=None`, or `forward(..., causal=False)`), block-causal
over chunks of `causal_chunk_size` latent frames (optionally a sliding window of
`attn_window_chunks` earlier chunks), teacher forcing (`forward_teacher_forcing`), and a KV
cache for chunk-by-chunk rollout (`new_kv_cache`, `forward_chunk`, `commit_chunk`). See
docs/model.md.

Timesteps are raw (N * sigma, 0..1000). A timestep is per sample [B] or per latent frame
[B, T]; per-frame times are embedded per patch-frame (the first latent frame of each). The
modulation is one vector per run of tokens that share a time (a sample, or a frame) and is
broadcast over the run, never copied per token; per-frame times that are all equal take the
per-sample path. A split of the token sequence across ranks must cut at run boundaries:
under context parallel (`ulysses`, set by trainer.parallel.context_parallel.attach) each rank holds a
strided share of the video tokens, which keeps a run's boundaries when cp_size divides its
length, and a strided share of the caption's (padded with masked tokens to a multiple of
cp_size); attention then runs over the whole sequence for the rank's heads.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.models.attention import (AttentionPlan, ChunkLayout, attend, block_causal_mask,
                               plan_attention, plan_packed, teacher_forcing_mask)
from trainer.models.dit.config import TIME_FREQ_DIM, DiTConfig, dit_geometry

__all__ = ["KVCache", "PackedKVCache", "VideoDiT", "timestep_features"]



# --------------------------------------------------------------------------------------------
# building blocks


def timestep_features(t: torch.Tensor, dim: int = TIME_FREQ_DIM) -> torch.Tensor:
    """Sinusoidal features [..., dim] (cos half, then sin half) of raw timesteps t [...].

    Computed in float64 for float64 input and float32 otherwise: raw times up to 1000 lose
    their low bits in bf16.
    """
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=work) / half)
    args = t.to(work)[..., None] * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """MLP from sinusoidal timestep features to the conditioning vector: [..., D]."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear_1 = nn.Linear(TIME_FREQ_DIM, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = timestep_features(t).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(feats)))


def rope_tables(positions: torch.Tensor, axes_dim: tuple[int, int, int], theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [N, head_dim / 2] of the rotation angles for grid positions [N, 3].

    Each axis (frame, row, col) owns axes_dim[a] channels of the head, i.e. axes_dim[a] / 2
    rotation pairs. Angles are computed in float64 (frame indices times small frequencies),
    then the tables are cast to `dtype`.
    """
    angles = []
    for axis, dim in enumerate(axes_dim):
        if dim == 0:
            continue
        inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)
        angles.append(positions[:, axis, None].to(torch.float64) * inv_freq)
    angle = torch.cat(angles, dim=-1)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates consecutive channel pairs of x [B, N, heads, head_dim] by per-token angles.

    In float32, or float64 for float64 input; returns x's dtype. cos, sin: [N, head_dim / 2].
    Real arithmetic on GPUs and under torch.compile (Inductor generates no code for complex
    tensors); one complex multiply in eager CPU code, where the strided real form is several
    times slower (the embedded default trains on CPUs).
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos[:, None].to(work), sin[:, None].to(work)
    pairs = x.to(work).unflatten(-1, (-1, 2))
    if x.is_cuda or torch.compiler.is_compiling():
        even, odd = pairs.unbind(-1)
        rotated = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1)
    else:
        rotated = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.complex(c, s))
    return rotated.flatten(-2).to(x.dtype)


def grid_positions(num_frames: int, rows: int, cols: int, frame_start: int,
                   device: torch.device | None = None) -> torch.Tensor:
    """(frame, row, col) of each token of a frame-major patch grid: long [F * rows * cols, 3]."""
    f = torch.arange(frame_start, frame_start + num_frames, device=device)
    r = torch.arange(rows, device=device)
    c = torch.arange(cols, device=device)
    grid = torch.stack(torch.meshgrid(f, r, c, indexing="ij"), dim=-1)
    return grid.reshape(-1, 3)


class InputDtypeLayerNorm(nn.LayerNorm):
    """LayerNorm that returns its input's dtype, also under autocast.

    Autocast runs layer_norm in float32 and returns float32: a bf16 residual would then leave a
    float32 copy of every normalised activation for the backward. The kernel accumulates in
    float32 either way; only its output is rounded, and the next linear rounds it anyway. A
    cast, not an autocast-disabled region: that region in a compiled block makes AOTAutograd
    bypass its cache, so the kernel warm-up could not fill it for training.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


class HeadRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight is cast to the input's dtype (q/k norm under bf16 autocast).

    With a float32 weight and bf16 input torch falls back from the fused kernel to a composite
    one ("Mismatch dtype between input and weight"). Same parameter, so checkpoints load.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def _by_group(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Tokens [B, N, D] as [B, groups, N / groups, D] (a view: groups are contiguous runs)."""
    return x.unflatten(1, (groups, -1))


class BlockOutput(NamedTuple):
    """What a block returns: updated streams and the K/V it attended with: the text's whenever
    the text stream ran, the video's (RoPE'd) only when asked for (`keep_kv`)."""

    txt: torch.Tensor | None
    vid: torch.Tensor | None
    text_kv: tuple[torch.Tensor, torch.Tensor] | None
    video_kv: tuple[torch.Tensor, torch.Tensor] | None


class DiTBlock(nn.Module):
    """Pre-norm attention + MLP block; video tokens modulated (adaLN-Zero), text tokens not.

    Streams are [B, N, D]; queries, keys and values [B, N, heads, head_dim].
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.norm1 = InputDtypeLayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.q_norm = HeadRMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.k_norm = HeadRMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.proj = nn.Linear(d, d)
        self.norm2 = InputDtypeLayerNorm(d, elementwise_affine=False, eps=1e-6)
        hidden = int(d * cfg.mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d))
        # SiLU(conditioning) -> shift, scale, gate for attention, then for the MLP
        self.modulation = nn.Linear(d, 6 * d)
        # trainer.parallel.context_parallel.Ulysses when the video tokens are split over a cp group
        self.ulysses = None

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(h).unflatten(-1, (3, self.num_heads, -1)).unbind(dim=-3)
        return self.q_norm(q), self.k_norm(k), v

    def forward_text(self, txt: torch.Tensor, plan: AttentionPlan, need_output: bool = True):
        """Text stream, attending to text only: (updated text or None, k, v).

        plan: the text-over-text attention plan; k, v: [B, L, heads, head_dim]. need_output=False
        skips the residual updates (the last block's text output is never read).

        Under context parallel (self.ulysses) txt holds this rank's share of the caption's
        tokens and attention runs in head space, as the video's does; the returned k, v are
        then the whole caption for this rank's heads: the prefix of its video attention.
        """
        q, k, v = self._qkv(self.norm1(txt))
        if self.ulysses is not None:
            k, v = self.ulysses.to_heads(k), self.ulysses.to_heads(v)
        if not need_output:
            return None, k, v
        if self.ulysses is not None:
            q = self.ulysses.to_heads(q)
        out = attend(plan, q, k, v)
        if self.ulysses is not None:
            out = self.ulysses.to_tokens(out)
        txt = txt + self.proj(out.flatten(-2))
        txt = txt + self.mlp(self.norm2(txt))
        return txt, k, v

    def forward_video(self, vid: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      prefix_k: torch.Tensor, prefix_v: torch.Tensor, plan: AttentionPlan,
                      keep_kv: bool = False):
        """Video stream over keys [own video | prefix]: (updated video, k, v), k with RoPE; k
        and v are None unless keep_kv. Off, the compiled method has no such outputs, whose
        unused gradients autograd would otherwise fill with zeros in every backward pass.

        mod: [B, G, 6D], one modulation per group of N / G consecutive tokens (G = 1: per
        sample; G = frames: per frame), broadcast over the group rather than copied per token.
        rope: (cos, sin) of its tokens; prefix_k/v: [B, P, heads, head_dim]; plan: the video
        attention plan for N queries over N + P keys.

        Under context parallel (self.ulysses) vid holds this rank's share of the tokens and
        attention runs in head space: every token, this rank's heads (the prefix, text K/V
        from forward_text or a cache, is in head space already); the returned k, v are then in
        head space too (a rollout caches them).
        """
        groups = mod.shape[1]
        shift1, scale1, gate1, shift2, scale2, gate2 = mod[:, :, None].chunk(6, dim=-1)
        x = _by_group(vid, groups)
        q, k, v = self._qkv((self.norm1(x) * (1 + scale1) + shift1).flatten(1, 2))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.ulysses is not None:
            q, k, v = (self.ulysses.to_heads(t) for t in (q, k, v))
        out = attend(plan, q, torch.cat([k, prefix_k], dim=1), torch.cat([v, prefix_v], dim=1))
        if self.ulysses is not None:
            out = self.ulysses.to_tokens(out)
        x = x + gate1 * _by_group(self.proj(out.flatten(-2)), groups)
        x = x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)
        return (x.flatten(1, 2), k, v) if keep_kv else (x.flatten(1, 2), None, None)

    def forward(self, txt: torch.Tensor | None, vid: torch.Tensor | None, *,
                text_plan: AttentionPlan | None = None, video_plan: AttentionPlan | None = None,
                need_text_output: bool = True, mod: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                keep_kv: bool = False) -> BlockOutput:
        """One block over the text stream, the video stream, or both.

        The video's key prefix is past_kv (cached [committed chunks | text]) when given, else
        this call's text K/V. The model calls blocks only through here, so FSDP2 and activation
        checkpointing, which hook `forward`, see every call; the two stream methods stay
        separately compilable (trainer/warmup.py). Returns BlockOutput; streams not given (and
        the text output when need_text_output is False) come back as None, and so does the
        video's K/V unless keep_kv (a rollout's cache).
        Raises ValueError when video is given without any prefix.
        """
        text_kv = None
        if txt is not None:
            txt, k, v = self.forward_text(txt, text_plan, need_text_output)
            text_kv = (k, v)
        video_kv = None
        if vid is not None:
            prefix = past_kv if past_kv is not None else text_kv
            if prefix is None:
                raise ValueError("the video stream needs a key prefix: text tokens or a cache")
            vid, k, v = self.forward_video(vid, mod, rope, prefix[0], prefix[1], video_plan,
                                           keep_kv)
            video_kv = (k, v) if keep_kv else None
        return BlockOutput(txt, vid, text_kv, video_kv)


class Caption(NamedTuple):
    """A caption as the blocks take it (VideoDiT._with_text, VideoDiT._run_pack)."""

    tokens: torch.Tensor  # embedded [B, L, D]; under context parallel this rank's share
    plan: AttentionPlan  # text over text, over all `length` tokens
    lengths: torch.Tensor | None  # real tokens per sample, long [B]; None: none padded, or a
    # pack (its captions' padding is in its plans)
    length: int  # caption keys the video attends to (under cp: padded to a multiple of cp_size)


def _pad_last_caption(texts: list[torch.Tensor], text_masks: list[torch.Tensor], pad: int):
    """A pack's captions [L_i, text_dim] and masks [L_i] with `pad` masked zero tokens after the
    last caption: (texts, text_masks). Masked tokens are never keys, so every sample's result
    stays the same."""
    last, last_mask = texts[-1], text_masks[-1]
    return ([*texts[:-1], torch.cat([last, last.new_zeros(pad, last.shape[1])])],
            [*text_masks[:-1], torch.cat([last_mask, last_mask.new_zeros(pad)])])


# --------------------------------------------------------------------------------------------
# KV cache


@dataclass
class KVCache:
    """Keys/values a causal rollout reuses: the caption's, and those of committed chunks.

    text_kv[layer] = (k, v) [B, L, heads, head_dim] (under context parallel: this rank's head
    group over the whole caption, padded to a multiple of cp_size, and the chunks' K/V over the
    whole chunk); text_lengths: int [B] real caption tokens, or None when no caption is
    padded; chunks[i][layer] = (k, v) of the i-th kept committed chunk (oldest first,
    detached, RoPE applied at absolute positions); next_frame is the latent frame where the
    next chunk starts. Built by VideoDiT.new_kv_cache.
    """

    text_kv: list[tuple[torch.Tensor, torch.Tensor]]
    text_lengths: torch.Tensor | None
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]]
    next_frame: int = 0

    def prefix(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, committed tokens + L, heads, head_dim] a new chunk attends to
        besides itself: committed chunks, then the caption (last, so its padding is a length)."""
        ks = [c[layer][0] for c in self.chunks] + [self.text_kv[layer][0]]
        vs = [c[layer][1] for c in self.chunks] + [self.text_kv[layer][1]]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


@dataclass
class PackedKVCache:
    """A rollout cache over a pack of samples of different shapes (trainer.data.packing):
    per sample i, text_kv[i][layer] = (k, v) [1, L_i, heads, head_dim] of its caption,
    text_used[i] bool [L_i] its real caption tokens, chunks[i] its kept committed chunks
    ([layer] = (k, v) [1, n, heads, head_dim], detached, RoPE at absolute positions) and
    next_frame[i] where its next chunk starts. A sample's chunks attend only to their own
    sample's keys. Under context parallel `heads` is this rank's head group, and the last
    caption holds its masked padding (the captions split evenly over the group). Built by
    VideoDiT.new_packed_kv_cache.
    """

    text_kv: list[list[tuple[torch.Tensor, torch.Tensor]]]
    text_used: list[torch.Tensor]
    chunks: list[list[list[tuple[torch.Tensor, torch.Tensor]]]]
    next_frame: list[int]

    def prefix(self, samples: list[int], layer: int):
        """(k, v) [1, P, heads, head_dim] the chunks of `samples` attend to besides themselves
        (each sample's committed chunks, then its caption), with the sample of every key and
        whether it is used (caption padding is not): long [P], bool [P]."""
        ks, vs, ids, used = [], [], [], []
        for i in samples:
            pieces = [c[layer] for c in self.chunks[i]] + [self.text_kv[i][layer]]
            ks += [k for k, _ in pieces]
            vs += [v for _, v in pieces]
            committed = sum(k.shape[1] for k, _ in pieces[:-1])
            device = pieces[-1][0].device
            ids.append(torch.full((committed + len(self.text_used[i]),), i, device=device))
            used += [torch.ones(committed, dtype=torch.bool, device=device),
                     self.text_used[i].to(device)]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1), torch.cat(ids), torch.cat(used)


def text_lengths_of(text_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Real caption tokens per sample, long [B], from a bool [B, L] mask; None if none is padded.

    The mask must mark real tokens first and padding after (as every encoder and the data
    reader produce). One device sync: the answer decides which attention kernels run.
    Raises ValueError for a mask with a real token after padding.
    """
    if text_mask is None:
        return None
    lengths = text_mask.sum(dim=1)
    positions = torch.arange(text_mask.shape[1], device=text_mask.device)
    prefix_form = (text_mask == (positions[None, :] < lengths[:, None])).all()
    unpadded = lengths.min() == text_mask.shape[1]
    prefix_form, unpadded = torch.stack([prefix_form, unpadded]).tolist()
    if not prefix_form:
        raise ValueError("text_mask must mark each caption's real tokens first and its padding "
                         "after (True...True False...False); got a real token after padding")
    return None if unpadded else lengths


# --------------------------------------------------------------------------------------------
# the model


class VideoDiT(nn.Module):
    """Video DiT; keyword arguments are the fields of DiTConfig (see its defaults).

    Raises ValueError for an unknown argument (naming the closest valid one) or an invalid value.
    """

    def __init__(self, **kwargs: Any):
        super().__init__()
        cfg = DiTConfig.from_kwargs(kwargs)
        self.cfg = cfg
        d = cfg.hidden_size
        patch_volume = math.prod(cfg.patch_size)
        self.patch_embed = nn.Linear(cfg.in_channels * patch_volume, d)
        self.text_embedder = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"),
                                           nn.Linear(d, d))
        self.time_embedder = TimestepEmbedder(d)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = InputDtypeLayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Linear(d, 2 * d)
        self.head = nn.Linear(d, cfg.output_channels * patch_volume)
        # A non-persistent buffer: follows .to(), stays out of the state dict, so a two-time
        # model's keys are exactly the single-time keys plus `r_embedder.*`.
        self.register_buffer("time_gate", torch.tensor(float(cfg.time_gate)), persistent=False)
        # trainer.parallel.context_parallel.Ulysses when the video tokens are split over a cp group
        self.ulysses = None
        self._init_weights()
        self.r_embedder: TimestepEmbedder | None = None
        if cfg.two_time:
            self.r_embedder = copy.deepcopy(self.time_embedder)

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for layer in (self.time_embedder.linear_1, self.time_embedder.linear_2):
            nn.init.normal_(layer.weight, std=0.02)
        if self.cfg.zero_init_modulation:
            # adaLN-Zero: every block starts as the identity on video tokens and the output is 0
            zero = [b.modulation for b in self.blocks] + [self.final_modulation, self.head]
            for layer in zero:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)

    @property
    def config(self) -> dict[str, Any]:
        """The full constructor arguments as a JSON-serialisable dict (for checkpoints)."""
        return self.cfg.to_dict()

    @property
    def geometry(self):
        """Patch size, heads, widths and the causal / two-time settings (trainer.models.family)."""
        return dit_geometry(self.config)

    def init_weights(self) -> None:
        """The constructor's initialisation again, in place, for a module built on the meta
        device and materialised empty (trainer.parallel.distributed.materialise): each layer's
        own reset, then `_init_weights`, E_r as a copy of E_t, the time gate from the config
        (a non-persistent buffer, so no file holds it)."""
        with torch.no_grad():
            for module in self.modules():
                if module is not self and hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            self._init_weights()
            if self.r_embedder is not None:
                self.init_second_time_from_first()
            self.time_gate.fill_(float(self.cfg.time_gate))

    def init_second_time_from_first(self) -> None:
        """E_r := E_t (docs/algorithms.md, "Two-time model"), so e(t, t) = E_t(t) right after:
        the model with the flow-matching weights loaded is exactly that model at r = t.

        Raises RuntimeError on a single-time model (it has no E_r)."""
        if self.r_embedder is None:
            raise RuntimeError("the model is single-time (two_time: false): it has no second "
                               "time input to initialise")
        with torch.no_grad():
            self.r_embedder.load_state_dict(self.time_embedder.state_dict())

    # ---- how relay shards, checkpoints, compiles and splits it (trainer.models.protocol) ------

    def fsdp_units(self) -> list[nn.Module]:
        """Each block's adaLN table, then the block: the model computes a block's table before
        calling the block, outside its forward hooks, so the table is a unit of its own."""
        return [unit for block in self.blocks for unit in (block.modulation, block)]

    def checkpoint_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def compile_blocks(self) -> None:
        compile_transformer_blocks(self)

    def attach_context_parallel(self, ulysses) -> None:
        """Run context-parallel through `ulysses` (trainer.parallel.context_parallel.Ulysses):
        the model splits and gathers the video tokens, every block trades tokens for heads."""
        for module in (self, *self.blocks):
            module.ulysses = ulysses

    # ---- shapes and inputs -----------------------------------------------------------------

    def _check_video(self, x: torch.Tensor, name: str) -> tuple[int, int, int, int]:
        cfg = self.cfg
        if x.ndim != 5 or x.shape[1] != cfg.in_channels:
            raise ValueError(f"{name} must be [B, {cfg.in_channels}, T, H, W], got {list(x.shape)}")
        b, _, t, h, w = x.shape
        for size, patch, axis in zip((t, h, w), cfg.patch_size, "THW"):
            if size % patch:
                raise ValueError(f"{name}: {axis}={size} is not a multiple of the patch size {patch}")
        return b, t, h, w

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        pt, ph, pw = self.cfg.patch_size
        x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
        x = x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, c * pt * ph * pw)
        return self.patch_embed(x)

    def _unpatchify(self, tokens: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
        b = tokens.shape[0]
        pt, ph, pw = self.cfg.patch_size
        c = self.cfg.output_channels
        x = tokens.reshape(b, t // pt, h // ph, w // pw, c, pt, ph, pw)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, t, h, w)

    def _frame_times(self, value: Any, batch: int, frames: int, name: str, device) -> torch.Tensor:
        """Times per patch-frame: [B, 1] for per-sample input, [B, T / pt] for per-frame input.

        Per-frame times equal across a sample's frames (flow matching without clean frames)
        come back as [B, 1], so the blocks take the per-sample modulation path.
        """
        t = torch.as_tensor(value, device=device)
        if t.ndim == 0:
            t = t.expand(batch)
        if t.ndim == 1 and t.shape[0] == batch:
            return t[:, None]
        if t.ndim == 2 and tuple(t.shape) == (batch, frames):
            t = t[:, :: self.cfg.patch_size[0]]
            return t[:, :1] if bool((t == t[:, :1]).all()) else t
        raise ValueError(f"{name} must be a scalar, [B]={[batch]} or [B, T]={[batch, frames]}, "
                         f"got {list(t.shape)}")

    def _embed_time(self, t: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        e = self.time_embedder(t)
        if self.r_embedder is None:
            return e
        e_r = self.r_embedder(t if r is None else r)
        # e + g (e_r - e) rather than (1 - g) e + g e_r: identical in exact arithmetic, and exactly
        # E_t(t) in floating point when E_r = E_t and r = t (or when g = 0)
        return e + self.time_gate.to(e.dtype) * (e_r - e)

    def _conditioning(self, t: Any, r: Any, batch: int, frames: int, device) -> torch.Tensor:
        """Conditioning per patch-frame slot: [B, 1, D] or [B, T / pt, D]."""
        if r is not None and self.r_embedder is None:
            raise ValueError("r was given but the model is single-time: build it with "
                             "two_time: true for a second time input")
        t_f = self._frame_times(t, batch, frames, "t", device)
        r_f = None if r is None else self._frame_times(r, batch, frames, "r", device)
        if r_f is not None and r_f.shape[1] != t_f.shape[1]:
            width = max(t_f.shape[1], r_f.shape[1])
            t_f, r_f = t_f.expand(batch, width), r_f.expand(batch, width)
        return self._embed_time(t_f, r_f)

    def _check_text(self, text: torch.Tensor, text_mask: torch.Tensor | None, batch: int) -> None:
        if text.ndim != 3 or text.shape[0] != batch or text.shape[2] != self.cfg.text_dim:
            raise ValueError(f"text must be [B={batch}, L, {self.cfg.text_dim}], got {list(text.shape)}")
        if text_mask is not None and (text_mask.dtype != torch.bool or text_mask.shape != text.shape[:2]):
            raise ValueError(f"text_mask must be bool [B, L]={list(text.shape[:2])}, "
                             f"got {text_mask.dtype} {list(text_mask.shape)}")

    # ---- attention plans -------------------------------------------------------------------

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype queries and keys will have: autocast's when it is on, else the weights'."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.patch_embed.weight.dtype

    def _plan(self, num_queries: int, num_keys: int, device, key_lengths=None, layout=None):
        return plan_attention(self.cfg.attention_backend, num_queries=num_queries, num_keys=num_keys,
                              head_dim=self.cfg.head_dim, dtype=self._compute_dtype(device),
                              device=device, key_lengths=key_lengths, layout=layout)

    def _text_plan(self, text_lengths: torch.Tensor | None, length: int, device) -> AttentionPlan:
        # At least one key per sample: an all-padding caption's (unused) states stay finite.
        keys = None if text_lengths is None else text_lengths.clamp(min=1)
        return self._plan(length, length, device, keys)

    def _video_plan(self, num_video: int, num_keys: int, text_length: int,
                    text_lengths: torch.Tensor | None, device,
                    layout: ChunkLayout | None = None) -> AttentionPlan:
        """Video queries over [own video | prefix ending in the caption of text_length tokens]."""
        used = None if text_lengths is None else text_lengths + (num_keys - text_length)
        return self._plan(num_video, num_keys, device, used, layout)

    # ---- the two streams -------------------------------------------------------------------

    def _run(self, vid, cond, slot_of_group, positions, video_plan, caption=None, past=None,
             collect_kv=False):
        """Runs the blocks and the head over video tokens [B, N, D].

        cond: [B, S, D] conditioning slots; the tokens form G equal runs, run g modulated by slot
        slot_of_group[g] (None: G = S, run g by slot g). The prefix each block's video attends
        to is either the caption (a Caption), run alongside, or past[layer] = cached (k, v).
        Returns (head output tokens [B, N, patch values], per-layer detached video (k, v) if
        collect_kv else []).

        Under context parallel the blocks run on this rank's strided share of the tokens (their
        positions and modulation runs with them; trainer.parallel.context_parallel; the caption comes
        split already) and the output is gathered back into the whole sequence; collected
        (k, v) are this rank's heads of it.
        """
        if self.ulysses is not None:
            groups = cond.shape[1] if slot_of_group is None else slot_of_group.shape[0]
            vid, slot_of_group, positions = self.ulysses.split(vid, slot_of_group, positions,
                                                               groups)
        work = torch.float64 if self._compute_dtype(vid.device) == torch.float64 else torch.float32
        rope = rope_tables(positions, self.cfg.rope_axes_dim, self.cfg.rope_theta, dtype=work)
        cond = F.silu(cond)
        txt, text_plan = (caption.tokens, caption.plan) if caption is not None else (None, None)
        collected = []
        for i, block in enumerate(self.blocks):
            mod = block.modulation(cond)
            if slot_of_group is not None:
                mod = mod.index_select(1, slot_of_group)
            out = block(txt, vid, text_plan=text_plan, video_plan=video_plan,
                        need_text_output=i + 1 < len(self.blocks), mod=mod, rope=rope,
                        past_kv=None if past is None else past[i], keep_kv=collect_kv)
            txt, vid = out.txt, out.vid
            if collect_kv:
                collected.append((out.video_kv[0].detach(), out.video_kv[1].detach()))
        final = self.final_modulation(cond)
        if slot_of_group is not None:
            final = final.index_select(1, slot_of_group)
        shift, scale = final[:, :, None].chunk(2, dim=-1)
        x = _by_group(vid, final.shape[1])
        out = self.head(self.final_norm(x) * (1 + scale) + shift).flatten(1, 2)
        return (out if self.ulysses is None else self.ulysses.gather(out)), collected

    def _chunk_frames(self) -> int:
        """Chunk size in patch-frames; raises ValueError when the model has no chunks."""
        if self.cfg.causal_chunk_size is None:
            raise ValueError("this needs a causal model: set causal_chunk_size in the model config")
        return self.cfg.causal_chunk_size // self.cfg.patch_size[0]

    def _with_text(self, text: torch.Tensor, text_mask: torch.Tensor | None) -> Caption:
        """The caption [B, L, text_dim] ready for the blocks of a forward that runs it.

        Under context parallel it is padded with masked tokens to a multiple of cp_size and this
        rank embeds only its share (token j on cp rank j % cp_size), as its blocks run it.
        """
        if self.ulysses is not None:
            text, text_mask = self.ulysses.pad_caption(text, text_mask)
        lengths = text_lengths_of(text_mask)
        tokens = text if self.ulysses is None else self.ulysses.share(text)
        plan = self._text_plan(lengths, text.shape[1], text.device)
        return Caption(self.text_embedder(tokens), plan, lengths, text.shape[1])

    # ---- public forwards -------------------------------------------------------------------

    def forward(self, x: torch.Tensor, t: Any, text: torch.Tensor, text_mask: torch.Tensor | None = None,
                r: Any = None, causal: bool | None = None) -> torch.Tensor:
        """Prediction [B, C_out, T, H, W] for latents x [B, C, T, H, W].

        t, r: raw times, scalar, [B] or [B, T] (r only for two-time models; None = t). text:
        [B, L, text_dim], text_mask: bool [B, L] (True = real token, real tokens first).
        causal: None follows the config (block-causal when causal_chunk_size is set), False
        forces bidirectional.
        Raises ValueError for mismatched shapes, r on a single-time model, a text_mask with a
        real token after padding, or causal=True without causal_chunk_size.
        """
        b, frames, h, w = self._check_video(x, "x")
        self._check_text(text, text_mask, b)
        pt, ph, pw = self.cfg.patch_size
        grid = (frames // pt, h // ph, w // pw)
        tokens_per_frame = grid[1] * grid[2]
        if causal is None:
            causal = self.cfg.causal_chunk_size is not None
        caption = self._with_text(text, text_mask)
        layout = None
        if causal:
            layout = ChunkLayout("block_causal", grid[0], tokens_per_frame, self._chunk_frames(),
                                 self.cfg.attn_window_chunks, caption.length)
        cond = self._conditioning(t, r, b, frames, x.device)
        vid = self._patchify(x)
        n = vid.shape[1]
        plan = self._video_plan(n, n + caption.length, caption.length, caption.lengths, x.device,
                                layout)
        out, _ = self._run(vid, cond, None, grid_positions(*grid, 0, x.device), plan, caption)
        return self._unpatchify(out, frames, h, w)

    def forward_packed(self, xs: list[torch.Tensor], ts: list[Any], texts: list[torch.Tensor],
                       text_masks: list[torch.Tensor], causal: bool | None = None) -> list[torch.Tensor]:
        """Predictions [C_out, T_i, H_i, W_i] for samples of different shapes run as one pack.

        xs: latents [C, T_i, H_i, W_i]; ts: each sample's raw time (scalar or [T_i]); texts:
        [L_i, text_dim]; text_masks: bool [L_i]. Every sample sees only its own caption, video,
        RoPE grid and time (trainer.data.packing), so each prediction equals forward() on that
        sample alone; causal as in forward() (block-causal within each sample). Under context
        parallel the pack is split after packing (padded to a multiple of cp_size). Raises
        ValueError for mismatched shapes.
        """
        from trainer.data.packing import pack_layout

        layout = pack_layout(xs, texts, self.cfg.patch_size)
        if causal is None:
            causal = self.cfg.causal_chunk_size is not None
        within = None
        if causal:
            chunk = self._chunk_frames()
            within = [block_causal_mask(f, r * c, chunk, self.cfg.attn_window_chunks)
                      for f, r, c in layout.grids]
        conds, slots = [], []
        for x, t, (frames, rows, cols) in zip(xs, ts, layout.grids):
            cond = self._conditioning(torch.as_tensor(t, device=x.device)[None], None, 1,
                                      x.shape[1], x.device)
            per_frame = torch.arange(frames, device=x.device).repeat_interleave(rows * cols)
            slots.append(per_frame if cond.shape[1] > 1 else per_frame * 0)
            conds.append(cond)
        vid = torch.cat([self._patchify(x[None]) for x in xs], dim=1)
        pieces = self._run_pack(vid, conds, slots, layout, texts, text_masks, within)
        return [self._unpatchify(p, *x.shape[1:])[0] for p, x in zip(pieces, xs)]

    def forward_teacher_forcing_packed(self, noisys: list[torch.Tensor], cleans: list[torch.Tensor],
                                       ts: list[Any], texts: list[torch.Tensor],
                                       text_masks: list[torch.Tensor],
                                       rs: list[Any] | None = None) -> list[torch.Tensor]:
        """Teacher forcing (forward_teacher_forcing) over a pack of samples of different shapes:
        the noisy-half predictions [C_out, T_i, H_i, W_i], each equal to that sample run alone.

        noisys, cleans: latents [C, T_i, H_i, W_i] (pairwise equal shapes); ts, rs: each
        sample's raw times (scalar or [T_i]; rs None = ts); texts, text_masks as forward_packed.
        Raises ValueError for a non-causal model or mismatched shapes.
        """
        from trainer.data.packing import pack_layout

        chunk = self._chunk_frames()
        for noisy, clean in zip(noisys, cleans):
            if clean.shape != noisy.shape:
                raise ValueError(f"clean {list(clean.shape)} and noisy {list(noisy.shape)} must match")
        layout = pack_layout(noisys, texts, self.cfg.patch_size, copies=2)
        within = [teacher_forcing_mask(f, r * c, chunk, self.cfg.attn_window_chunks)
                  for f, r, c in layout.grids]
        rs = [None] * len(noisys) if rs is None else rs
        zero = torch.zeros(1, 1, device=noisys[0].device)
        cond_clean = self._embed_time(zero, None if self.r_embedder is None else zero)
        conds, slots = [], []
        for x, t, r, (frames, rows, cols) in zip(noisys, ts, rs, layout.grids):
            r = None if r is None else torch.as_tensor(r, device=x.device)[None]
            cond = self._conditioning(torch.as_tensor(t, device=x.device)[None], r, 1,
                                      x.shape[1], x.device)
            # slot 0: the clean copy at t = 0; noisy tokens slot 1 (per sample) or 1 + frame
            per_frame = torch.arange(frames, device=x.device).repeat_interleave(rows * cols)
            noisy_slot = 1 + (per_frame if cond.shape[1] > 1 else per_frame * 0)
            slots.append(torch.cat([torch.zeros_like(per_frame), noisy_slot]))
            conds.append(torch.cat([cond_clean, cond], dim=1))
        vid = torch.cat([torch.cat([self._patchify(c[None]), self._patchify(n[None])], dim=1)
                         for c, n in zip(cleans, noisys)], dim=1)
        pieces = self._run_pack(vid, conds, slots, layout, texts, text_masks, within)
        return [self._unpatchify(p[:, p.shape[1] // 2:], *x.shape[1:])[0]
                for p, x in zip(pieces, noisys)]

    def _run_pack(self, vid, conds, slots, layout, texts, text_masks, within):
        """The blocks over a pack's video tokens vid [1, N, D]: conds[i] [1, S_i, D] are sample
        i's conditioning slots and slots[i] (long, one per token) which of them each of its
        tokens takes. Returns the head output split per sample ([1, n_i, patch values] each)."""
        offsets = [0]
        for cond in conds[:-1]:
            offsets.append(offsets[-1] + cond.shape[1])
        slots = torch.cat([o + s for o, s in zip(offsets, slots)])
        vid, positions, slots, pad = self._pad_to_split(vid, layout.positions(vid.device), slots)
        text_pad = 0 if self.ulysses is None else self.ulysses.padding(sum(layout.text_lens))
        if text_pad:  # the captions split evenly too: the last one takes masked tokens
            texts, text_masks = _pad_last_caption(texts, text_masks, text_pad)
            layout = replace(layout, text_lens=(*layout.text_lens[:-1],
                                                layout.text_lens[-1] + text_pad))
        text = torch.cat(texts)[None]
        video_plan, text_plan = self._packed_plans(layout, text_masks, text.shape[1], pad, within)
        tokens = text if self.ulysses is None else self.ulysses.share(text)
        caption = Caption(self.text_embedder(tokens), text_plan, None, text.shape[1])
        # One modulation slot per token (runs of one token): samples' token counts differ.
        out, _ = self._run(vid, torch.cat(conds, dim=1), slots, positions, video_plan, caption)
        return out[:, :sum(layout.video_lens)].split(layout.video_lens, dim=1)

    def _pad_to_split(self, vid, positions, slots):
        """A pack's video tokens [1, N, D], their RoPE positions [N, 3] and per-token slots [N],
        padded under context parallel with zero tokens to a multiple of cp_size, so that they
        split evenly: (vid, positions, slots, padding). The caller makes the padding a sequence
        of its own, attending only to itself, and drops its outputs."""
        pad = 0 if self.ulysses is None else self.ulysses.padding(vid.shape[1])
        if not pad:
            return vid, positions, slots, 0
        return (torch.cat([vid, vid.new_zeros(1, pad, vid.shape[2])], dim=1),
                torch.cat([positions, positions.new_zeros(pad, 3)]),
                torch.cat([slots, slots.new_zeros(pad)]), pad)

    def _packed_plans(self, layout, text_masks: list[torch.Tensor], captions: int, padding: int,
                      within: list[torch.Tensor] | None):
        """(video, text) attention plans of a pack: varlen kernels where they run, else dense
        block-diagonal masks for SDPA. `padding` video tokens after the samples (context
        parallel) form one more sequence of their own. Samples with a mask of their own
        (`within`: block-causal, teacher forcing) take the dense mask: a varlen kernel sees
        whole sequences only."""
        device = text_masks[0].device
        vid, txt, real = layout.video_ids(device), layout.text_ids(device), torch.cat(text_masks)
        vid = torch.cat([vid, vid.new_full((padding,), len(layout.grids))])
        kernel = dict(head_dim=self.cfg.head_dim, dtype=self._compute_dtype(device))
        backend = self.cfg.attention_backend
        # The blocks' video keys are [all video | all captions].
        video_plan = None if within is not None else plan_packed(
            backend, vid, torch.cat([vid, txt]),
            torch.cat([torch.ones_like(vid, dtype=torch.bool), real]), **kernel)
        text_plan = plan_packed(backend, txt, txt, real, **kernel)
        if video_plan is None:  # SDPA: the layout's mask has the captions first; turn it around
            joint = layout.video_mask(text_masks, within, padding=padding)
            video_plan = AttentionPlan("sdpa", None, torch.cat([joint[..., captions:],
                                                                joint[..., :captions]], dim=-1))
        if text_plan is None:
            text_plan = AttentionPlan("sdpa", None, layout.text_mask(text_masks))
        return video_plan, text_plan

    def forward_teacher_forcing(self, noisy: torch.Tensor, clean: torch.Tensor, t: Any, text: torch.Tensor,
                                text_mask: torch.Tensor | None = None, r: Any = None,
                                return_clean: bool = False):
        """Teacher-forcing forward over [clean | noisy] video and the caption (docs/algorithms.md, "Causal teacher forcing").

        Noisy chunk i sees its own noisy chunk and clean chunks before i (within the window);
        the clean half runs at t = 0 (and r = 0) with the same RoPE positions as the noisy half.
        Returns the noisy-half prediction [B, C_out, T, H, W], or (noisy, clean) predictions when
        return_clean. Raises ValueError for a non-causal model or mismatched shapes.
        """
        chunk = self._chunk_frames()
        b, frames, h, w = self._check_video(noisy, "noisy")
        if clean.shape != noisy.shape:
            raise ValueError(f"clean {list(clean.shape)} and noisy {list(noisy.shape)} must match")
        self._check_text(text, text_mask, b)
        pt, ph, pw = self.cfg.patch_size
        grid = (frames // pt, h // ph, w // pw)
        tokens_per_frame = grid[1] * grid[2]
        cond_noisy = self._conditioning(t, r, b, frames, noisy.device)
        zero = torch.zeros(b, 1, device=noisy.device)
        cond_clean = self._embed_time(zero, None if self.r_embedder is None else zero)
        cond = torch.cat([cond_clean, cond_noisy], dim=1)
        slots = None  # per-sample noisy time: two runs, clean (slot 0) and noisy (slot 1)
        if cond_noisy.shape[1] > 1:  # per frame: every clean frame slot 0, noisy frame f slot 1 + f
            slots = torch.cat([torch.zeros(grid[0], dtype=torch.long),
                               torch.arange(1, grid[0] + 1)]).to(noisy.device)
        positions = grid_positions(*grid, 0, noisy.device)
        vid = torch.cat([self._patchify(clean), self._patchify(noisy)], dim=1)
        caption = self._with_text(text, text_mask)
        layout = ChunkLayout("teacher_forcing", grid[0], tokens_per_frame, chunk,
                             self.cfg.attn_window_chunks, caption.length)
        n = vid.shape[1]
        plan = self._video_plan(n, n + caption.length, caption.length, caption.lengths,
                                noisy.device, layout)
        out, _ = self._run(vid, cond, slots, torch.cat([positions, positions]), plan, caption)
        n_video = n // 2
        noisy_pred = self._unpatchify(out[:, n_video:], frames, h, w)
        if return_clean:
            return noisy_pred, self._unpatchify(out[:, :n_video], frames, h, w)
        return noisy_pred

    def new_kv_cache(self, text: torch.Tensor, text_mask: torch.Tensor | None = None) -> KVCache:
        """An empty rollout cache holding the caption's per-layer K/V.

        Computed in the caller's grad mode (wrap in torch.no_grad() for a detached cache).
        Raises ValueError for a non-causal model or a malformed text / text_mask.
        """
        self._chunk_frames()
        self._check_text(text, text_mask, text.shape[0])
        caption = self._with_text(text, text_mask)
        txt, text_kv = caption.tokens, []
        for i, block in enumerate(self.blocks):
            out = block(txt, None, text_plan=caption.plan,
                        need_text_output=i + 1 < len(self.blocks))
            txt = out.txt
            # Under context parallel these are this rank's heads only (forward_text).
            text_kv.append(out.text_kv)
        return KVCache(text_kv=text_kv, text_lengths=caption.lengths, chunks=[])

    def _check_chunk(self, x: torch.Tensor, cache: KVCache, frame_start: int, name: str):
        chunk_latent = self.cfg.causal_chunk_size
        self._chunk_frames()
        b, frames, h, w = self._check_video(x, name)
        if b != cache.text_kv[0][0].shape[0]:
            raise ValueError(f"{name} has batch {b} but the cache was built for "
                             f"{cache.text_kv[0][0].shape[0]}")
        if frames > chunk_latent:
            raise ValueError(f"{name} has {frames} latent frames; a chunk has at most {chunk_latent}")
        if frame_start != cache.next_frame or frame_start % chunk_latent:
            raise ValueError(
                f"frame_start={frame_start}, but the cache's next chunk starts at latent frame "
                f"{cache.next_frame} (chunks start at multiples of {chunk_latent}; after a short "
                "last chunk the rollout is complete)"
            )
        return b, frames, h, w

    def _run_chunk(self, x, t, r, cache: KVCache, frame_start: int, collect_kv: bool):
        b, frames, h, w = self._check_chunk(x, cache, frame_start, "x_chunk")
        pt, ph, pw = self.cfg.patch_size
        grid = (frames // pt, h // ph, w // pw)
        cond = self._conditioning(t, r, b, frames, x.device)
        prefix = [cache.prefix(i) for i in range(len(self.blocks))]
        vid = self._patchify(x)
        n, length = vid.shape[1], cache.text_kv[0][0].shape[1]
        plan = self._video_plan(n, n + prefix[0][0].shape[1], length, cache.text_lengths, x.device)
        positions = grid_positions(*grid, frame_start // pt, x.device)
        out, kv = self._run(vid, cond, None, positions, plan, past=prefix, collect_kv=collect_kv)
        return self._unpatchify(out, frames, h, w), kv

    def forward_chunk(self, x_chunk: torch.Tensor, t_chunk: Any, cache: KVCache, frame_start: int,
                      r_chunk: Any = None) -> torch.Tensor:
        """Prediction [B, C_out, Tc, H, W] for the next chunk, reading (never changing) the cache.

        The chunk attends to itself, the committed chunks in the window and the caption, with
        RoPE at absolute frame frame_start. t_chunk, r_chunk: scalar, [B] or [B, Tc].
        Raises ValueError unless frame_start is where the cache's next chunk starts and the
        chunk is at most causal_chunk_size frames.
        """
        out, _ = self._run_chunk(x_chunk, t_chunk, r_chunk, cache, frame_start, collect_kv=False)
        return out

    @torch.no_grad()
    def commit_chunk(self, x_chunk_clean: torch.Tensor, cache: KVCache, frame_start: int) -> None:
        """Runs the clean chunk at t = 0 (and r = 0) and appends its detached K/V to the cache.

        Evicts chunks that fell out of the attention window and advances cache.next_frame.
        Raises ValueError like forward_chunk.
        """
        b = x_chunk_clean.shape[0]
        zero = torch.zeros(b, device=x_chunk_clean.device)
        _, kv = self._run_chunk(x_chunk_clean, zero, None if self.r_embedder is None else zero, cache,
                                frame_start, collect_kv=True)
        cache.chunks.append(kv)
        window = self.cfg.attn_window_chunks
        if window is not None:
            del cache.chunks[: max(0, len(cache.chunks) - window)]
        cache.next_frame = frame_start + x_chunk_clean.shape[2]


    # ---- the rollout cache over a pack (Stage2 on packs) ---------------------------------

    def new_packed_kv_cache(self, texts: list[torch.Tensor],
                            text_masks: list[torch.Tensor]) -> PackedKVCache:
        """An empty rollout cache over a pack: each caption [L_i, text_dim] (bool mask [L_i])
        run once through the blocks' text stream, every caption seeing only itself, in one
        call (so every rank of a sharded model runs the same forwards whatever its pack).
        Computed in the caller's grad mode. Raises ValueError for a non-causal model.

        Under context parallel the captions split as forward_packed's do (the last one padded
        with masked tokens to a multiple of cp_size, token j on cp rank j % cp_size), and the
        cache keeps this rank's heads of every caption's keys and values."""
        from trainer.data.packing import PackLayout

        self._chunk_frames()
        text_pad = 0 if self.ulysses is None else self.ulysses.padding(
            sum(int(t.shape[0]) for t in texts))
        if text_pad:
            texts, text_masks = _pad_last_caption(texts, text_masks, text_pad)
        lengths = [int(t.shape[0]) for t in texts]
        text = torch.cat(texts)[None]
        txt = self.text_embedder(text if self.ulysses is None else self.ulysses.share(text))
        ids, real = PackLayout((), tuple(lengths)).text_ids(txt.device), torch.cat(text_masks)
        plan = plan_packed(self.cfg.attention_backend, ids, ids, real, head_dim=self.cfg.head_dim,
                           dtype=self._compute_dtype(txt.device))
        if plan is None:
            plan = AttentionPlan("sdpa", None, PackLayout((), tuple(lengths)).text_mask(text_masks))
        per_sample: list[list] = [[] for _ in texts]
        for i, block in enumerate(self.blocks):
            out = block(txt, None, text_plan=plan, need_text_output=i + 1 < len(self.blocks))
            txt = out.txt
            for sample, k, v in zip(per_sample, *(x.split(lengths, dim=1) for x in out.text_kv)):
                sample.append((k, v))
        return PackedKVCache(per_sample, list(text_masks), [[] for _ in texts], [0] * len(texts))

    def _run_chunk_packed(self, xs, ts, rs, cache: PackedKVCache, samples: list[int],
                          collect_kv: bool):
        """The next chunk [C, Tc_i, H_i, W_i] of each sample in `samples` (each at its own
        cache.next_frame), as one pack: (predictions, per-sample per-layer (k, v) or None)."""
        if len(xs) != len(samples) or len(ts) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(xs)} chunks and {len(ts)} times")
        chunk_latent = self.cfg.causal_chunk_size
        pt, ph, pw = self.cfg.patch_size
        conds, slots, positions, vids, lens, grids = [], [], [], [], [], []
        for x, t, r, i in zip(xs, ts, rs, samples):
            _, frames, h, w = self._check_video(x[None], "x_chunk")
            start = cache.next_frame[i]
            if frames > chunk_latent or start % chunk_latent:
                raise ValueError(f"sample {i}: a chunk of {frames} latent frames at frame {start}; "
                                 f"chunks hold at most {chunk_latent} and start at its multiples")
            grid = (frames // pt, h // ph, w // pw)
            r = None if r is None else torch.as_tensor(r, device=x.device)[None]
            cond = self._conditioning(torch.as_tensor(t, device=x.device)[None], r, 1, frames,
                                      x.device)
            # One slot per token, after the slots of the samples before (as forward_packed).
            per_frame = torch.arange(grid[0], device=x.device).repeat_interleave(grid[1] * grid[2])
            offset = sum(c.shape[1] for c in conds)
            slots.append(offset + (per_frame if cond.shape[1] > 1 else 0 * per_frame))
            conds.append(cond)
            positions.append(grid_positions(*grid, start // pt, x.device))
            vids.append(self._patchify(x[None]))
            lens.append(grid[0] * grid[1] * grid[2])
            grids.append((frames, h, w))
        vid, positions, slots, pad = self._pad_to_split(torch.cat(vids, dim=1),
                                                        torch.cat(positions), torch.cat(slots))
        # Padding (context parallel) is a sequence of its own: one past the pack's samples.
        query_ids = torch.repeat_interleave(
            torch.tensor([*samples, len(cache.next_frame)], device=vid.device),
            torch.tensor([*lens, pad], device=vid.device))
        prefix = [cache.prefix(samples, layer) for layer in range(len(self.blocks))]
        _, _, key_ids, used = prefix[0]
        key_ids = torch.cat([query_ids, key_ids])
        used = torch.cat([torch.ones_like(query_ids, dtype=torch.bool), used])
        plan = plan_packed(self.cfg.attention_backend, query_ids, key_ids, used,
                           head_dim=self.cfg.head_dim, dtype=self._compute_dtype(vid.device))
        if plan is None:  # SDPA: each query sees its own sample's used keys
            mask = (query_ids[:, None] == key_ids[None, :]) & used[None, :]
            plan = AttentionPlan("sdpa", None, mask[None, None])
        out, kv = self._run(vid, torch.cat(conds, dim=1), slots, positions, plan,
                            past=[(k, v) for k, v, _, _ in prefix], collect_kv=collect_kv)
        real = sum(lens)  # the tokens before the padding
        preds = [self._unpatchify(o, *g)[0]
                 for o, g in zip(out[:, :real].split(lens, dim=1), grids)]
        if not collect_kv:
            return preds, None
        # Under context parallel these are this rank's heads of every token (head space).
        split = [[(k, v) for k, v in zip(*(x[:, :real].split(lens, dim=1) for x in layer_kv))]
                 for layer_kv in kv]  # [layer][sample]
        return preds, [[layer[j] for layer in split] for j in range(len(samples))]

    def forward_chunk_packed(self, xs: list[torch.Tensor], ts: list[Any], cache: PackedKVCache,
                             samples: list[int], rs: list[Any] | None = None) -> list[torch.Tensor]:
        """Predictions [C_out, Tc_i, H_i, W_i] for the next chunk of each sample in `samples`
        (indices into the cache's pack), reading (never changing) the cache: each equals
        forward_chunk on that sample alone with its own cache. ts, rs: raw times per sample
        (scalar or [Tc_i]). Raises ValueError for mismatched lists or a chunk that is not the
        sample's next."""
        rs = [None] * len(xs) if rs is None else rs
        return self._run_chunk_packed(xs, ts, rs, cache, samples, collect_kv=False)[0]

    @torch.no_grad()
    def commit_chunk_packed(self, xs: list[torch.Tensor], cache: PackedKVCache,
                            samples: list[int]) -> None:
        """commit_chunk for each sample in `samples`, as one pack: its clean chunk run at t = 0
        (and r = 0), its detached K/V appended to its cache, the window applied per sample."""
        zeros = [torch.zeros((), device=x.device) for x in xs]
        rs = [None if self.r_embedder is None else z for z in zeros]
        _, kv = self._run_chunk_packed(xs, zeros, rs, cache, samples, collect_kv=True)
        window = self.cfg.attn_window_chunks
        for i, x, sample_kv in zip(samples, xs, kv):
            cache.chunks[i].append(sample_kv)
            if window is not None:
                del cache.chunks[i][: max(0, len(cache.chunks[i]) - window)]
            cache.next_frame[i] += x.shape[1]

ACTIVATION_MEMORY_BUDGET = 0.93  # of compiled blocks; see compile_transformer_blocks


def compile_transformer_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile each transformer block's two streams in place; returns the same model.

    Training must compile through this same function when compile_transformer is set: the
    Inductor/Triton cache keys include the traced graphs and the Inductor config, so a warm-up
    that compiled differently would warm nothing. Blocks share their compiled graphs (the
    module is an input, not a constant), so a deep model compiles three graphs, not three per
    layer.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # A known pitfall: torch 2.11's Inductor computed wrong gradients for
    # per-block adaLN tables with this reduction fusion on (pytorch#193061). Off for both the
    # warm-up and training, so their cache keys agree.
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        inductor_config.triton.mix_order_reduction = False
    # The partitioner keeps 93% of the activations it would save by default and recomputes the
    # cheapest rest in the backward pass: at the Wan-1.3B size on an H200 the step's peak fell
    # from 93.5 to 67.3 GiB at the same step time (docs/performance.md).
    functorch_config.activation_memory_budget = ACTIVATION_MEMORY_BUDGET
    for block in model.blocks:
        block.forward_text = torch.compile(block.forward_text)
        block.forward_video = torch.compile(block.forward_video)
    return model
