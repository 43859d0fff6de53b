"""The causal forms of a video model, written once for every family: teacher forcing over
[clean | noisy] chunks and the chunked KV-cache rollout, each also over a pack of samples of
different shapes (docs/algorithms.md, "Causal teacher forcing"; docs/model.md).

With `causal_chunk_size` set, the video is cut into chunks of that many latent frames and a
chunk's video attention sees only itself and earlier chunks (within `attn_window_chunks`): the
chunk rule of trainer.models.attention (`ChunkLayout`, `block_causal_mask`,
`teacher_forcing_mask`). A caption is per sample and needs no rule.

- Teacher forcing runs [clean | noisy] video in one pass: the clean half at t = 0 (r = 0), the
  noisy half at the sample's times, both halves at the same RoPE positions; noisy chunk i sees
  its own noisy chunk and the clean chunks before i.
- The KV cache (`KVCache`) holds per layer the caption's K/V, computed once per rollout (the
  DiT's text keys, which sit after the video's in its joint attention; Wan's cross-attention
  keys), and each committed chunk's video K/V (RoPE at its absolute frames, detached; under
  context parallel in head space: this rank's heads of every token). A chunk attends to
  itself, the kept committed chunks and the caption; reading the cache never changes it.
- The packed forms (`PackedKVCache`, `*_packed`) run a pack of samples at once (Stage2 on
  packs), each sample attending to its own keys only, each result equal to that sample's own.

What differs between the families is how their blocks run over the tokens and where the caption
enters; `CausalForms` takes that from the hooks its docstring lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.models.attention import ChunkLayout, block_causal_mask, teacher_forcing_mask
from trainer.models.common.rope import grid_positions

__all__ = ["CausalForms", "KVCache", "PackedKVCache"]

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class KVCache:
    """Keys/values a causal rollout reuses: the caption's, and those of committed chunks.

    text_kv[layer] = (k, v) [B, L, heads, head_dim] of the caption as that layer attends to it
    (under context parallel: the DiT's are this rank's head group over the whole caption, padded
    to a multiple of cp_size); text_lengths: int [B] real caption tokens, or None when no
    caption is padded or its padding is attended (Wan); chunks[i][layer] = (k, v) of the i-th
    kept committed chunk (oldest first, detached, RoPE applied at absolute positions; under
    context parallel every token for this rank's heads); next_frame is the latent frame where
    the next chunk starts. Built by the model's new_kv_cache.
    """

    text_kv: list[KV]
    text_lengths: torch.Tensor | None
    chunks: list[list[KV]]
    next_frame: int = 0

    def past(self, layer: int) -> KV | None:
        """The committed chunks' (k, v) a new chunk sees besides itself, or None."""
        if not self.chunks:
            return None
        return (torch.cat([c[layer][0] for c in self.chunks], dim=1),
                torch.cat([c[layer][1] for c in self.chunks], dim=1))

    def prefix(self, layer: int) -> KV:
        """Keys and values [B, committed tokens + L, heads, head_dim] a new chunk attends to
        besides itself: committed chunks, then the caption (last, so its padding is a length)."""
        ks = [c[layer][0] for c in self.chunks] + [self.text_kv[layer][0]]
        vs = [c[layer][1] for c in self.chunks] + [self.text_kv[layer][1]]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


@dataclass
class PackedKVCache:
    """A rollout cache over a pack of samples of different shapes (trainer.data.packing):
    per sample i, text_kv[i][layer] = (k, v) [1, L_i, heads, head_dim] of its caption,
    text_used[i] bool [L_i] its real caption tokens (None where every caption token is a key:
    Wan attends its zeroed padding; `prefix` needs them),
    chunks[i] its kept committed chunks ([layer] = (k, v) [1, n, heads, head_dim], detached,
    RoPE at absolute positions) and next_frame[i] where its next chunk starts. A sample's
    chunks attend only to their own sample's keys. Under context parallel the DiT's `heads` is
    this rank's head group, and its last caption holds its masked padding (the captions split
    evenly over the group). Built by the model's new_packed_kv_cache.
    """

    text_kv: list[list[KV]]
    text_used: list[torch.Tensor] | None
    chunks: list[list[list[KV]]]
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


class CausalForms:
    """Teacher forcing and the KV-cache rollout of a family's module (a mixin).

    The module provides:
    - `patch_size` (pt, ph, pw); `_chunking()`: (causal_chunk_size, attn_window_chunks) of its
      config; `_has_second_time()`: whether it has the second time input; `ulysses`: the
      context-parallel group's Ulysses, or None;
    - `_check_video(x, name)` -> (B, T, H, W), `_check_text(text, text_mask, batch)`,
      `_conditioning(t, r, batch, frames, device)` -> [B, S, D] slots, `_embed_time(t, r)`,
      `_patchify(x)` -> [B, N, D], `_unpatchify(tokens, frames, height, width)`;
    - how its blocks run: `_run_captioned(tokens, cond, slots, positions, text, text_mask,
      kind, grid)` over video tokens with their caption (kind: the ChunkLayout kind, or None
      for bidirectional) -> head output [B, N, patch values]; `_run_pack(tokens, conds, slots,
      layout, texts, text_masks, within)` -> per-sample head outputs; `_caption_kv(text,
      text_mask)` -> (per-layer caption (k, v), text_lengths); `_packed_caption_kv(texts,
      text_masks)` -> (per-sample per-layer (k, v), text_used); `_run_cached(tokens, cond,
      positions, cache, collect_kv)` and `_run_cached_pack(tokens, cond, slots, positions,
      query_ids, padding, cache, samples, collect_kv)` -> (head output, per-layer detached
      video (k, v) when collect_kv).
    """

    # ---- the chunk rule --------------------------------------------------------------------

    def _chunk_frames(self) -> int:
        """Chunk size in patch-frames; raises ValueError when the model has no chunks."""
        chunk, _ = self._chunking()
        if chunk is None:
            raise ValueError("this needs a causal model: set causal_chunk_size in the model config")
        return chunk // self.patch_size[0]

    def _grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        pt, ph, pw = self.patch_size
        return frames // pt, height // ph, width // pw

    def _chunk_layout(self, kind: str | None, grid: tuple[int, int, int],
                      text_keys: int) -> ChunkLayout | None:
        """The chunk rule over a grid's video tokens (kind "block_causal" or "teacher_forcing",
        None: bidirectional), with text_keys caption keys after the video's."""
        if kind is None:
            return None
        return ChunkLayout(kind, grid[0], grid[1] * grid[2], self._chunk_frames(),
                           self._chunking()[1], text_keys)

    def _within(self, kind: str, grids) -> list[torch.Tensor]:
        """Each sample's own video mask (bool [V_i, V_i], or [2V_i, 2V_i] for teacher forcing)
        over a pack's (patch-frames, rows, cols) grids."""
        chunk, window = self._chunk_frames(), self._chunking()[1]
        mask = block_causal_mask if kind == "block_causal" else teacher_forcing_mask
        return [mask(f, rows * cols, chunk, window) for f, rows, cols in grids]

    def _pad_to_split(self, tokens, positions, slots):
        """A pack's video tokens [1, N, D], their RoPE positions [N, 3] and per-token slots [N],
        padded under context parallel with zero tokens to a multiple of cp_size, so that they
        split evenly: (tokens, positions, slots, padding). The caller makes the padding a
        sequence of its own, attending only to itself, and drops its outputs."""
        pad = 0 if self.ulysses is None else self.ulysses.padding(tokens.shape[1])
        if not pad:
            return tokens, positions, slots, 0
        return (torch.cat([tokens, tokens.new_zeros(1, pad, tokens.shape[2])], dim=1),
                torch.cat([positions, positions.new_zeros(pad, 3)]),
                torch.cat([slots, slots.new_zeros(pad)]), pad)

    def _clean_time(self, batch: int, device) -> torch.Tensor:
        """The conditioning [B, 1, D] of a clean copy: t = 0 (and r = 0)."""
        zero = torch.zeros(batch, 1, device=device)
        return self._embed_time(zero, zero if self._has_second_time() else None)

    # ---- teacher forcing -------------------------------------------------------------------

    def forward_teacher_forcing(self, noisy: torch.Tensor, clean: torch.Tensor, t: Any,
                                text: torch.Tensor, text_mask: torch.Tensor | None = None,
                                r: Any = None, return_clean: bool = False):
        """Teacher-forcing forward over [clean | noisy] video and the caption (docs/algorithms.md, "Causal teacher forcing").

        Noisy chunk i sees its own noisy chunk and clean chunks before i (within the window);
        the clean half runs at t = 0 (and r = 0) with the same RoPE positions as the noisy half.
        Returns the noisy-half prediction [B, C_out, T, H, W], or (noisy, clean) predictions when
        return_clean. Raises ValueError for a non-causal model or mismatched shapes.
        """
        self._chunk_frames()
        b, frames, height, width = self._check_video(noisy, "noisy")
        if clean.shape != noisy.shape:
            raise ValueError(f"clean {list(clean.shape)} and noisy {list(noisy.shape)} must match")
        self._check_text(text, text_mask, b)
        grid = self._grid(frames, height, width)
        cond_noisy = self._conditioning(t, r, b, frames, noisy.device)
        cond = torch.cat([self._clean_time(b, noisy.device), cond_noisy], dim=1)
        slots = None  # per-sample noisy time: two runs, clean (slot 0) and noisy (slot 1)
        if cond_noisy.shape[1] > 1:  # per frame: every clean frame slot 0, noisy frame f slot 1 + f
            slots = torch.cat([torch.zeros(grid[0], dtype=torch.long),
                               torch.arange(1, grid[0] + 1)]).to(noisy.device)
        positions = grid_positions(*grid, 0, noisy.device)
        tokens = torch.cat([self._patchify(clean), self._patchify(noisy)], dim=1)
        out = self._run_captioned(tokens, cond, slots, torch.cat([positions, positions]), text,
                                  text_mask, "teacher_forcing", grid)
        n_video = tokens.shape[1] // 2
        noisy_pred = self._unpatchify(out[:, n_video:], frames, height, width)
        if return_clean:
            return noisy_pred, self._unpatchify(out[:, :n_video], frames, height, width)
        return noisy_pred

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

        self._chunk_frames()
        for noisy, clean in zip(noisys, cleans):
            if clean.shape != noisy.shape:
                raise ValueError(f"clean {list(clean.shape)} and noisy {list(noisy.shape)} must match")
        layout = pack_layout(noisys, texts, self.patch_size, copies=2)
        within = self._within("teacher_forcing", layout.grids)
        rs = [None] * len(noisys) if rs is None else rs
        cond_clean = self._clean_time(1, noisys[0].device)
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
        tokens = torch.cat([torch.cat([self._patchify(c[None]), self._patchify(n[None])], dim=1)
                            for c, n in zip(cleans, noisys)], dim=1)
        pieces = self._run_pack(tokens, conds, slots, layout, texts, text_masks, within)
        return [self._unpatchify(p[:, p.shape[1] // 2:], *x.shape[1:])[0]
                for p, x in zip(pieces, noisys)]

    # ---- the KV cache ----------------------------------------------------------------------

    def new_kv_cache(self, text: torch.Tensor, text_mask: torch.Tensor | None = None) -> KVCache:
        """An empty rollout cache holding the caption's per-layer K/V.

        Computed in the caller's grad mode (wrap in torch.no_grad() for a detached cache).
        Raises ValueError for a non-causal model or a malformed text / text_mask.
        """
        self._chunk_frames()
        self._check_text(text, text_mask, text.shape[0])
        text_kv, lengths = self._caption_kv(text, text_mask)
        return KVCache(text_kv=text_kv, text_lengths=lengths, chunks=[])

    def _check_chunk(self, x: torch.Tensor, cache: KVCache, frame_start: int, name: str):
        chunk_latent = self._chunking()[0]
        self._chunk_frames()
        b, frames, height, width = self._check_video(x, name)
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
        return b, frames, height, width

    def _run_chunk(self, x, t, r, cache: KVCache, frame_start: int, collect_kv: bool):
        b, frames, height, width = self._check_chunk(x, cache, frame_start, "x_chunk")
        grid = self._grid(frames, height, width)
        cond = self._conditioning(t, r, b, frames, x.device)
        tokens = self._patchify(x)
        positions = grid_positions(*grid, frame_start // self.patch_size[0], x.device)
        out, kv = self._run_cached(tokens, cond, positions, cache, collect_kv)
        return self._unpatchify(out, frames, height, width), kv

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
        zero = torch.zeros(x_chunk_clean.shape[0], device=x_chunk_clean.device)
        r = zero if self._has_second_time() else None
        _, kv = self._run_chunk(x_chunk_clean, zero, r, cache, frame_start, collect_kv=True)
        cache.chunks.append(kv)
        window = self._chunking()[1]
        if window is not None:
            del cache.chunks[: max(0, len(cache.chunks) - window)]
        cache.next_frame = frame_start + x_chunk_clean.shape[2]

    # ---- the rollout cache over a pack (Stage2 on packs) -----------------------------------

    def new_packed_kv_cache(self, texts: list[torch.Tensor],
                            text_masks: list[torch.Tensor]) -> PackedKVCache:
        """An empty rollout cache over a pack: each caption [L_i, text_dim] (bool mask [L_i])
        run through the blocks once, every caption seeing only itself, in one call per block
        (so every rank of a sharded model runs the same forwards whatever its pack), its
        per-layer K/V kept per sample. Computed in the caller's grad mode. Raises ValueError
        for a non-causal model."""
        self._chunk_frames()
        per_sample, text_used = self._packed_caption_kv(texts, text_masks)
        return PackedKVCache(per_sample, text_used, [[] for _ in texts], [0] * len(texts))

    def _run_chunk_packed(self, xs, ts, rs, cache: PackedKVCache, samples: list[int],
                          collect_kv: bool):
        """The next chunk [C, Tc_i, H_i, W_i] of each sample in `samples` (each at its own
        cache.next_frame), as one pack: (predictions, per-sample per-layer (k, v) or None)."""
        if len(xs) != len(samples) or len(ts) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(xs)} chunks and {len(ts)} times")
        chunk_latent = self._chunking()[0]
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
            # One slot per token, after the slots of the samples before (as forward_packed).
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
        # Padding (context parallel) is a sequence of its own: one past the pack's samples.
        query_ids = torch.repeat_interleave(
            torch.tensor([*samples, len(cache.next_frame)], device=tokens.device),
            torch.tensor([*lens, pad], device=tokens.device))
        out, kv = self._run_cached_pack(tokens, torch.cat(conds, dim=1), slots, positions,
                                        query_ids, pad, cache, samples, collect_kv)
        real = sum(lens)  # the tokens before the padding
        preds = [self._unpatchify(o, *s)[0] for o, s in zip(out[:, :real].split(lens, dim=1), shapes)]
        if not collect_kv:
            return preds, None
        # Under context parallel these are this rank's heads of every token (head space).
        split = [list(zip(*(a[:, :real].split(lens, dim=1) for a in layer_kv)))
                 for layer_kv in kv]  # [layer][sample] = (k, v)
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
        rs = [z if self._has_second_time() else None for z in zeros]
        _, kv = self._run_chunk_packed(xs, zeros, rs, cache, samples, collect_kv=True)
        window = self._chunking()[1]
        for i, x, sample_kv in zip(samples, xs, kv):
            cache.chunks[i].append(sample_kv)
            if window is not None:
                del cache.chunks[i][: max(0, len(cache.chunks[i]) - window)]
            cache.next_frame[i] += x.shape[1]
