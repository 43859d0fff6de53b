"""The wan family's causal form: teacher forcing and the KV-cache rollout (a mixin of
trainer.models.wan.module.WanTransformer).

With `causal_chunk_size` set, the video is cut into chunks of that many latent frames and a
chunk's self-attention sees only itself and earlier chunks (within `attn_window_chunks`), as
the DiT's (docs/algorithms.md, "Causal teacher forcing"); cross-attention to the caption is
per token and needs no rule.

- `forward_teacher_forcing` runs [clean | noisy] video in one pass: the clean half at t = 0
  (r = 0), the noisy half at the sample's times, both halves at the same RoPE positions, the
  chunk rule of trainer.models.attention (`ChunkLayout("teacher_forcing")`).
- The KV cache (`new_kv_cache`, `forward_chunk`, `commit_chunk`) holds per layer the caption's
  cross-attention K/V, computed once, and each committed chunk's self-attention K/V (RoPE at
  its absolute frames, detached; under context parallel in head space: this rank's heads of
  every token). A chunk attends to itself and the kept committed chunks with no mask.
- The packed forms run a pack of samples of different shapes at once (Stage2 on packs), each
  sample attending to its own keys only, each result equal to that sample's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.models.attention import ChunkLayout, teacher_forcing_mask
from trainer.models.dit.module import grid_positions

__all__ = ["WanCausal", "WanKVCache", "WanPackedKVCache"]


@dataclass
class WanKVCache:
    """What a causal rollout reuses. cross_kv[layer] = the caption's cross-attention (k, v)
    [B, L, heads, head_dim]; chunks[i][layer] = the i-th kept committed chunk's self-attention
    (k, v) (oldest first, detached, RoPE at absolute positions; under context parallel every
    token for this rank's heads); next_frame: the latent frame where the next chunk starts."""

    cross_kv: list[tuple[torch.Tensor, torch.Tensor]]
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]]
    next_frame: int = 0

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The committed chunks' (k, v) a new chunk sees besides itself, or None."""
        if not self.chunks:
            return None
        return (torch.cat([c[layer][0] for c in self.chunks], dim=1),
                torch.cat([c[layer][1] for c in self.chunks], dim=1))


@dataclass
class WanPackedKVCache:
    """A rollout cache over a pack: per sample i, cross_kv[i][layer] = (k, v) [1, L_i, heads,
    head_dim] of its caption, chunks[i] its kept committed chunks ([layer] = (k, v) [1, n,
    heads, head_dim]) and next_frame[i] where its next chunk starts."""

    cross_kv: list[list[tuple[torch.Tensor, torch.Tensor]]]
    chunks: list[list[list[tuple[torch.Tensor, torch.Tensor]]]]
    next_frame: list[int]


class WanCausal:
    """Teacher forcing and the KV cache of WanTransformer (which provides the helpers used here:
    _run, _conditioning, _embed_time, _patchify, _plan, ...)."""

    # ---- teacher forcing ---------------------------------------------------------------------

    def _clean_time(self, batch: int, device) -> torch.Tensor:
        """temb [B, 1, D] of the clean copy: t = 0 (and r = 0)."""
        zero = torch.zeros(batch, 1, device=device)
        return self._embed_time(zero, zero if self.condition_embedder.time_embedder_r is not None
                                else None)

    def forward_teacher_forcing(self, noisy: torch.Tensor, clean: torch.Tensor, t: Any,
                                text: torch.Tensor, text_mask: torch.Tensor | None = None,
                                r: Any = None, return_clean: bool = False):
        """One pass over [clean | noisy] video and the caption: noisy chunk i sees its own
        noisy chunk and the clean chunks before i (within the window); the clean half runs at
        t = 0 (r = 0) with the noisy half's RoPE positions. Returns the noisy-half prediction
        [B, C_out, T, H, W] (and the clean half's when return_clean). Raises ValueError for a
        non-causal model or mismatched shapes."""
        chunk = self._chunk_frames()
        b, frames, height, width = self._check_video(noisy, "noisy")
        if clean.shape != noisy.shape:
            raise ValueError(f"clean {list(clean.shape)} and noisy {list(noisy.shape)} must match")
        self._check_text(text, text_mask, b)
        grid = self._grid(frames, height, width)
        cond = self._conditioning(t, r, b, frames, noisy.device)
        temb = torch.cat([self._clean_time(b, noisy.device), cond], dim=1)
        slots = None  # a time per sample: two runs, clean (slot 0) and noisy (slot 1)
        if cond.shape[1] > 1:  # per frame: every clean frame slot 0, noisy frame f slot 1 + f
            slots = torch.cat([torch.zeros(grid[0], dtype=torch.long),
                               torch.arange(1, grid[0] + 1)]).to(noisy.device)
        positions = grid_positions(*grid, 0, noisy.device)
        tokens = torch.cat([self._patchify(clean), self._patchify(noisy)], dim=1)
        context = self._context(text, text_mask)
        layout = ChunkLayout("teacher_forcing", grid[0], grid[1] * grid[2], chunk,
                             self._config["attn_window_chunks"], 0)
        n = tokens.shape[1]
        out, _ = self._run(tokens, temb, slots, torch.cat([positions, positions]),
                           self._plan(n, n, noisy.device, layout),
                           self._plan(self._local(n), context.shape[1], noisy.device),
                           context=context)
        noisy_pred = self._unpatchify(out[:, n // 2:], frames, height, width)
        if return_clean:
            return noisy_pred, self._unpatchify(out[:, :n // 2], frames, height, width)
        return noisy_pred

    def forward_teacher_forcing_packed(self, noisys: list[torch.Tensor],
                                       cleans: list[torch.Tensor], ts: list[Any],
                                       texts: list[torch.Tensor], text_masks: list[torch.Tensor],
                                       rs: list[Any] | None = None) -> list[torch.Tensor]:
        """forward_teacher_forcing over a pack (noisys, cleans [C, T_i, H_i, W_i]; ts, rs raw
        times per sample, scalar or [T_i]; texts, text_masks as forward_packed): the noisy-half
        predictions, each equal to that sample's own."""
        from trainer.data.packing import pack_layout

        chunk = self._chunk_frames()
        for noisy, clean in zip(noisys, cleans):
            if clean.shape != noisy.shape:
                raise ValueError(f"clean {list(clean.shape)} and noisy {list(noisy.shape)} must match")
        layout = pack_layout(noisys, texts, self.patch_size, copies=2)
        window = self._config["attn_window_chunks"]
        within = [teacher_forcing_mask(f, rows * cols, chunk, window)
                  for f, rows, cols in layout.grids]
        rs = [None] * len(noisys) if rs is None else rs
        clean_time = self._clean_time(1, noisys[0].device)
        conds, slots = [], []
        for x, t, r, (frames, rows, cols) in zip(noisys, ts, rs, layout.grids):
            r = None if r is None else torch.as_tensor(r, device=x.device)[None]
            cond = self._conditioning(torch.as_tensor(t, device=x.device)[None], r, 1,
                                      x.shape[1], x.device)
            per_frame = torch.arange(frames, device=x.device).repeat_interleave(rows * cols)
            noisy_slot = 1 + (per_frame if cond.shape[1] > 1 else per_frame * 0)
            slots.append(torch.cat([torch.zeros_like(per_frame), noisy_slot]))
            conds.append(torch.cat([clean_time, cond], dim=1))
        tokens = torch.cat([torch.cat([self._patchify(c[None]), self._patchify(n[None])], dim=1)
                            for c, n in zip(cleans, noisys)], dim=1)
        pieces = self._run_pack(tokens, conds, slots, layout, texts, text_masks, within)
        return [self._unpatchify(p[:, p.shape[1] // 2:], *x.shape[1:])[0]
                for p, x in zip(pieces, noisys)]

    # ---- the KV cache ------------------------------------------------------------------------

    def _caption_kv(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each block's cross-attention (k, v) of an embedded caption [B, L, D] (through the
        block's forward, so FSDP2 gathers its weights)."""
        return [block(None, context=context).cross_kv for block in self.blocks]

    def new_kv_cache(self, text: torch.Tensor, text_mask: torch.Tensor | None = None) -> WanKVCache:
        """An empty rollout cache holding the caption's per-layer cross-attention K/V, in the
        caller's grad mode. Raises ValueError for a non-causal model or a malformed text."""
        self._chunk_frames()
        self._check_text(text, text_mask, text.shape[0])
        return WanKVCache(self._caption_kv(self._context(text, text_mask)), [])

    def _check_chunk(self, x: torch.Tensor, cache: WanKVCache, frame_start: int, name: str):
        chunk_latent = self._config["causal_chunk_size"]
        self._chunk_frames()
        b, frames, height, width = self._check_video(x, name)
        if b != cache.cross_kv[0][0].shape[0]:
            raise ValueError(f"{name} has batch {b} but the cache was built for "
                             f"{cache.cross_kv[0][0].shape[0]}")
        if frames > chunk_latent:
            raise ValueError(f"{name} has {frames} latent frames; a chunk has at most {chunk_latent}")
        if frame_start != cache.next_frame or frame_start % chunk_latent:
            raise ValueError(
                f"frame_start={frame_start}, but the cache's next chunk starts at latent frame "
                f"{cache.next_frame} (chunks start at multiples of {chunk_latent}; after a short "
                "last chunk the rollout is complete)")
        return b, frames, height, width

    def _run_chunk(self, x, t, r, cache: WanKVCache, frame_start: int, collect_kv: bool):
        b, frames, height, width = self._check_chunk(x, cache, frame_start, "x_chunk")
        grid = self._grid(frames, height, width)
        temb = self._conditioning(t, r, b, frames, x.device)
        past = [cache.past(i) for i in range(len(self.blocks))]
        tokens = self._patchify(x)
        n = tokens.shape[1]
        committed = 0 if past[0] is None else past[0][0].shape[1]
        positions = grid_positions(*grid, frame_start // self.patch_size[0], x.device)
        out, kv = self._run(tokens, temb, None, positions, self._plan(n, n + committed, x.device),
                            self._plan(self._local(n), cache.cross_kv[0][0].shape[1], x.device),
                            cross_kv=cache.cross_kv, past=past, collect_kv=collect_kv)
        return self._unpatchify(out, frames, height, width), kv

    def forward_chunk(self, x_chunk: torch.Tensor, t_chunk: Any, cache: WanKVCache,
                      frame_start: int, r_chunk: Any = None) -> torch.Tensor:
        """Prediction [B, C_out, Tc, H, W] for the next chunk, reading (never changing) the
        cache: the chunk attends to itself and the kept committed chunks, RoPE at absolute
        frame frame_start. t_chunk, r_chunk: scalar, [B] or [B, Tc]. Raises ValueError unless
        frame_start is where the cache's next chunk starts and the chunk fits."""
        return self._run_chunk(x_chunk, t_chunk, r_chunk, cache, frame_start, False)[0]

    @torch.no_grad()
    def commit_chunk(self, x_chunk_clean: torch.Tensor, cache: WanKVCache, frame_start: int) -> None:
        """Runs the clean chunk at t = 0 (and r = 0), appends its detached K/V to the cache,
        evicts chunks out of the window and advances cache.next_frame."""
        zero = torch.zeros(x_chunk_clean.shape[0], device=x_chunk_clean.device)
        r = zero if self.condition_embedder.time_embedder_r is not None else None
        _, kv = self._run_chunk(x_chunk_clean, zero, r, cache, frame_start, True)
        cache.chunks.append(kv)
        window = self._config["attn_window_chunks"]
        if window is not None:
            del cache.chunks[: max(0, len(cache.chunks) - window)]
        cache.next_frame = frame_start + x_chunk_clean.shape[2]

    # ---- the KV cache over a pack ------------------------------------------------------------

    def new_packed_kv_cache(self, texts: list[torch.Tensor],
                            text_masks: list[torch.Tensor]) -> WanPackedKVCache:
        """An empty rollout cache over a pack: each caption [L_i, text_dim] (bool mask [L_i])
        projected in one call per block (every rank of a sharded model runs the same forwards
        whatever its pack), its per-layer cross-attention K/V kept per sample."""
        self._chunk_frames()
        lengths = [int(t.shape[0]) for t in texts]
        context = self._context(torch.cat(texts)[None], torch.cat(text_masks)[None])
        per_layer = [[(k, v) for k, v in zip(k_all.split(lengths, dim=1), v_all.split(lengths, dim=1))]
                     for k_all, v_all in self._caption_kv(context)]
        return WanPackedKVCache([[layer[i] for layer in per_layer] for i in range(len(texts))],
                                [[] for _ in texts], [0] * len(texts))

    def _run_chunk_packed(self, xs, ts, rs, cache: WanPackedKVCache, samples: list[int],
                          collect_kv: bool):
        """The next chunk [C, Tc_i, H_i, W_i] of each sample in `samples` (each at its own
        cache.next_frame) as one pack: (predictions, per-sample per-layer (k, v) or None)."""
        if len(xs) != len(samples) or len(ts) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(xs)} chunks and {len(ts)} times")
        chunk_latent = self._config["causal_chunk_size"]
        self._chunk_frames()
        conds, slots, positions, tokens, lens, shapes = [], [], [], [], [], []
        for x, t, r, i in zip(xs, ts, rs, samples):
            _, frames, height, width = self._check_video(x[None], "x_chunk")
            start = cache.next_frame[i]
            if frames > chunk_latent or start % chunk_latent:
                raise ValueError(f"sample {i}: a chunk of {frames} latent frames at frame {start}; "
                                 f"chunks hold at most {chunk_latent} and start at its multiples")
            grid = self._grid(frames, height, width)
            r = None if r is None else torch.as_tensor(r, device=x.device)[None]
            cond = self._conditioning(torch.as_tensor(t, device=x.device)[None], r, 1, frames,
                                      x.device)
            per_frame = torch.arange(grid[0], device=x.device).repeat_interleave(grid[1] * grid[2])
            offset = sum(c.shape[1] for c in conds)
            slots.append(offset + (per_frame if cond.shape[1] > 1 else 0 * per_frame))
            conds.append(cond)
            positions.append(grid_positions(*grid, start // self.patch_size[0], x.device))
            tokens.append(self._patchify(x[None]))
            lens.append(grid[0] * grid[1] * grid[2])
            shapes.append((frames, height, width))
        tokens, positions, slots, pad = self._pad_to_split(torch.cat(tokens, dim=1),
                                                           torch.cat(positions), torch.cat(slots))
        device = tokens.device
        # Padding (context parallel) is a sequence of its own: one past the pack's samples.
        query_ids = torch.repeat_interleave(torch.tensor([*samples, len(cache.next_frame)],
                                                         device=device),
                                            torch.tensor([*lens, pad], device=device))
        past, past_ids = [], []
        for layer in range(len(self.blocks)):
            pieces = [c[layer] for i in samples for c in cache.chunks[i]]
            past.append(None if not pieces else (torch.cat([k for k, _ in pieces], dim=1),
                                                 torch.cat([v for _, v in pieces], dim=1)))
        for i in samples:
            committed = sum(c[0][0].shape[1] for c in cache.chunks[i])
            past_ids.append(torch.full((committed,), i, device=device))
        self_plan = self._packed_plan(query_ids, torch.cat([query_ids, *past_ids]))
        cross_ids = torch.cat([torch.full((cache.cross_kv[i][0][0].shape[1],), i, device=device)
                               for i in samples])
        real_ids = query_ids[:sum(lens)]
        cross_plan = self._packed_plan(self._cross_queries(real_ids, pad, samples[-1]), cross_ids)
        cross_kv = [(torch.cat([cache.cross_kv[i][layer][0] for i in samples], dim=1),
                     torch.cat([cache.cross_kv[i][layer][1] for i in samples], dim=1))
                    for layer in range(len(self.blocks))]
        out, kv = self._run(tokens, torch.cat(conds, dim=1), slots, positions, self_plan,
                            cross_plan, cross_kv=cross_kv, past=past, collect_kv=collect_kv)
        real = sum(lens)
        preds = [self._unpatchify(o, *s)[0] for o, s in zip(out[:, :real].split(lens, dim=1), shapes)]
        if not collect_kv:
            return preds, None
        split = [list(zip(*(a[:, :real].split(lens, dim=1) for a in layer_kv)))
                 for layer_kv in kv]  # [layer][sample] = (k, v)
        return preds, [[layer[j] for layer in split] for j in range(len(samples))]

    def forward_chunk_packed(self, xs: list[torch.Tensor], ts: list[Any],
                             cache: WanPackedKVCache, samples: list[int],
                             rs: list[Any] | None = None) -> list[torch.Tensor]:
        """Predictions [C_out, Tc_i, H_i, W_i] for the next chunk of each sample in `samples`
        (indices into the cache's pack, ascending), reading the cache: each equals
        forward_chunk on that sample alone with its own cache."""
        rs = [None] * len(xs) if rs is None else rs
        return self._run_chunk_packed(xs, ts, rs, cache, samples, False)[0]

    @torch.no_grad()
    def commit_chunk_packed(self, xs: list[torch.Tensor], cache: WanPackedKVCache,
                            samples: list[int]) -> None:
        """commit_chunk for each sample in `samples`, as one pack."""
        zeros = [torch.zeros((), device=x.device) for x in xs]
        two_time = self.condition_embedder.time_embedder_r is not None
        rs = [z if two_time else None for z in zeros]
        _, kv = self._run_chunk_packed(xs, zeros, rs, cache, samples, True)
        window = self._config["attn_window_chunks"]
        for i, x, sample_kv in zip(samples, xs, kv):
            cache.chunks[i].append(sample_kv)
            if window is not None:
                del cache.chunks[i][: max(0, len(cache.chunks[i]) - window)]
            cache.next_frame[i] += x.shape[1]
