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
cache for chunk-by-chunk rollout (`new_kv_cache`, `forward_chunk`, `commit_chunk`); the last
two are trainer.models.common.causal's, over this module's hooks. See docs/model.md.

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
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.models.attention import AttentionPlan, ChunkLayout, attend, plan_attention, plan_packed
from trainer.models.common.causal import CausalForms, KVCache, PackedKVCache
from trainer.models.common.compiling import apply_compile_settings
from trainer.models.common.inputs import check_text, check_video
from trainer.models.common.norms import HeadRMSNorm
from trainer.models.common.rope import apply_rope, grid_positions, rope_tables
from trainer.models.common.time import conditioning, mix_two_times, timestep_features
from trainer.models.dit.config import TIME_FREQ_DIM, DiTConfig, dit_geometry
from trainer.models.sparse_attention import active_settings, sparse_video_plan, tile_order, \
    to_tiles

__all__ = ["VideoDiT", "compile_transformer_blocks"]


# --------------------------------------------------------------------------------------------
# building blocks


class TimestepEmbedder(nn.Module):
    """MLP from sinusoidal timestep features to the conditioning vector: [..., D]."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear_1 = nn.Linear(TIME_FREQ_DIM, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = timestep_features(t, TIME_FREQ_DIM).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(feats)))


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


class VideoDiT(CausalForms, nn.Module):
    """Video DiT; keyword arguments are the fields of DiTConfig (see its defaults). Teacher
    forcing and the KV-cache rollout come from trainer.models.common.causal.CausalForms.

    Raises ValueError for an unknown argument (naming the closest valid one) or an invalid value.
    """

    # sparse video attention (trainer.models.sparse_attention): set by the training loop
    # (set_video_attention_sparsity); None or sparsity 0 is the dense path
    supports_sparse_video_attention = True
    sparse_video = None

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

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return self.cfg.patch_size

    def _chunking(self) -> tuple[int | None, int | None]:
        return self.cfg.causal_chunk_size, self.cfg.attn_window_chunks

    def _has_second_time(self) -> bool:
        return self.r_embedder is not None

    def _check_video(self, x: torch.Tensor, name: str) -> tuple[int, int, int, int]:
        return check_video(x, self.cfg.in_channels, self.cfg.patch_size, name)

    def _check_text(self, text: torch.Tensor, text_mask: torch.Tensor | None, batch: int) -> None:
        check_text(text, text_mask, batch, self.cfg.text_dim)

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

    def _embed_time(self, t: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        e = self.time_embedder(t)
        if self.r_embedder is None:
            return e
        return mix_two_times(e, self.r_embedder(t if r is None else r), self.time_gate)

    def _conditioning(self, t: Any, r: Any, batch: int, frames: int, device) -> torch.Tensor:
        """Conditioning per patch-frame slot: [B, 1, D] or [B, T / pt, D]."""
        return conditioning(self._embed_time, self.r_embedder is not None, t, r, batch, frames,
                            self.cfg.patch_size[0], device)

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
        grid = self._grid(frames, h, w)
        if causal is None:
            causal = self.cfg.causal_chunk_size is not None
        cond = self._conditioning(t, r, b, frames, x.device)
        out = self._run_captioned(self._patchify(x), cond, None, grid_positions(*grid, 0, x.device),
                                  text, text_mask, "block_causal" if causal else None, grid)
        return self._unpatchify(out, frames, h, w)

    def _run_captioned(self, vid, cond, slots, positions, text, text_mask, kind, grid):
        """The blocks and the head over video tokens [B, N, D] with their caption run alongside
        (CausalForms' hook): video attention over [video | caption] under the chunk rule `kind`
        (None: bidirectional)."""
        caption = self._with_text(text, text_mask)
        layout = self._chunk_layout(kind, grid, caption.length)
        n = vid.shape[1]
        sparse = active_settings(self, kind)
        if sparse is None:
            plan = self._video_plan(n, n + caption.length, caption.length, caption.lengths,
                                    vid.device, layout)
        else:  # tile-major order for the blocks, the head output put back (docs/model.md)
            order = tile_order(grid, sparse.tile, vid.device)
            vid, positions, slots = to_tiles(order, vid, positions, slots, cond.shape[1]
                                             if slots is None else slots.shape[0])
            used = None if caption.lengths is None else caption.lengths + n
            plan = sparse_video_plan(sparse, self.cfg.attention_backend, num_video=n,
                                     head_dim=self.cfg.head_dim,
                                     dtype=self._compute_dtype(vid.device), device=vid.device,
                                     key_lengths=used)
        out, _ = self._run(vid, cond, slots, positions, plan, caption)
        return out if sparse is None else out[:, order.from_tiles]

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
        within = self._within("block_causal", layout.grids) if causal else None
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

    # ---- the rollout cache (CausalForms' hooks) -------------------------------------------

    def _caption_kv(self, text: torch.Tensor, text_mask: torch.Tensor | None):
        """The caption's per-layer text (k, v) a rollout's chunks attend to, and its real
        tokens per sample (None: none padded)."""
        caption = self._with_text(text, text_mask)
        txt, text_kv = caption.tokens, []
        for i, block in enumerate(self.blocks):
            out = block(txt, None, text_plan=caption.plan,
                        need_text_output=i + 1 < len(self.blocks))
            txt = out.txt
            # Under context parallel these are this rank's heads only (forward_text).
            text_kv.append(out.text_kv)
        return text_kv, caption.lengths

    def _run_cached(self, vid, cond, positions, cache: KVCache, collect_kv: bool):
        """The blocks and the head over a chunk's video tokens, attending to themselves and the
        cache's prefix (committed chunks, then the caption)."""
        prefix = [cache.prefix(i) for i in range(len(self.blocks))]
        n, length = vid.shape[1], cache.text_kv[0][0].shape[1]
        plan = self._video_plan(n, n + prefix[0][0].shape[1], length, cache.text_lengths, vid.device)
        return self._run(vid, cond, None, positions, plan, past=prefix, collect_kv=collect_kv)

    def _packed_caption_kv(self, texts: list[torch.Tensor], text_masks: list[torch.Tensor]):
        """A pack's captions run once through the blocks' text stream, every caption seeing
        only itself: (per-sample per-layer (k, v), per-sample real tokens).

        Under context parallel the captions split as forward_packed's do (the last one padded
        with masked tokens to a multiple of cp_size, token j on cp rank j % cp_size), and the
        cache keeps this rank's heads of every caption's keys and values."""
        from trainer.data.packing import PackLayout

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
        return per_sample, list(text_masks)

    def _run_cached_pack(self, vid, cond, slots, positions, query_ids, padding: int,
                         cache: PackedKVCache, samples: list[int], collect_kv: bool):
        """The blocks and the head over the next chunks of a pack's samples, each attending to
        itself and its own sample's prefix in the cache (query_ids: each token's sample, the
        padding one past the pack's)."""
        prefix = [cache.prefix(samples, layer) for layer in range(len(self.blocks))]
        _, _, key_ids, used = prefix[0]
        key_ids = torch.cat([query_ids, key_ids])
        used = torch.cat([torch.ones_like(query_ids, dtype=torch.bool), used])
        plan = plan_packed(self.cfg.attention_backend, query_ids, key_ids, used,
                           head_dim=self.cfg.head_dim, dtype=self._compute_dtype(vid.device))
        if plan is None:  # SDPA: each query sees its own sample's used keys
            mask = (query_ids[:, None] == key_ids[None, :]) & used[None, :]
            plan = AttentionPlan("sdpa", None, mask[None, None])
        return self._run(vid, cond, slots, positions, plan,
                         past=[(k, v) for k, v, _, _ in prefix], collect_kv=collect_kv)


def compile_transformer_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile each transformer block's two streams in place; returns the same model.

    Training must compile through this same function when compile_transformer is set: the
    Inductor/Triton cache keys include the traced graphs and the Inductor config
    (trainer.models.common.compiling), so a warm-up that compiled differently would warm
    nothing. Blocks share their compiled graphs (the module is an input, not a constant), so a
    deep model compiles three graphs, not three per layer.
    """
    apply_compile_settings()
    for block in model.blocks:
        block.forward_text = torch.compile(block.forward_text)
        block.forward_video = torch.compile(block.forward_video)
    return model
