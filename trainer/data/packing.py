"""A pack's samples laid out as one sequence: boundaries for attention, RoPE, modulation, loss.

A pack (trainer.data.loader.collate_pack) holds samples of different shapes. The model runs
them as one batch row: the captions one after another in the text stream, the video tokens one
after another in the video stream. `PackLayout` says where each sample's tokens sit; from it
come the block-diagonal masks (a sample attends only to its own caption and video), each
sample's RoPE grid (starting at frame 0, as if alone), the conditioning slot of every token
(its own sample's time). Every family's packed forms (forward_packed, the packed teacher forcing
and rollout) use it (and give varlen kernels the sequence ids: trainer.models.attention.
plan_packed); a block-causal or
teacher-forcing sample brings its own chunk mask over its own video tokens, and the pack
places it on the diagonal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackLayout:
    """grids: each sample's patch grid (frames, rows, cols); text_lens: its caption tokens;
    copies: video streams per sample (2 for teacher forcing's [clean | noisy], which share the
    grid's positions)."""

    grids: tuple[tuple[int, int, int], ...]
    text_lens: tuple[int, ...]
    copies: int = 1

    @property
    def video_lens(self) -> list[int]:
        return [self.copies * f * r * c for f, r, c in self.grids]

    def _ids(self, lengths: list[int], device) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                       torch.tensor(lengths, device=device))

    def video_ids(self, device=None) -> torch.Tensor:
        """Which sample each video token belongs to: long [sum of video tokens]."""
        return self._ids(self.video_lens, device)

    def text_ids(self, device=None) -> torch.Tensor:
        """Which sample each caption token belongs to: long [sum of caption tokens]."""
        return self._ids(list(self.text_lens), device)

    def positions(self, device=None) -> torch.Tensor:
        """(frame, row, col) of every video token, each sample's grid from 0: long [N, 3]."""
        grids = [torch.stack(torch.meshgrid(*(torch.arange(n, device=device) for n in g),
                                            indexing="ij"), dim=-1).reshape(-1, 3).repeat(self.copies, 1)
                 for g in self.grids]
        return torch.cat(grids)

    def text_mask(self, text_masks: list[torch.Tensor]) -> torch.Tensor:
        """Text-to-text attention, bool [1, 1, L, L]: own sample's real tokens (and itself, so
        a padded query never has an empty row)."""
        ids = self.text_ids(text_masks[0].device)
        real = torch.cat(text_masks)
        eye = torch.eye(len(ids), dtype=torch.bool, device=ids.device)
        return ((ids[:, None] == ids[None, :]) & real[None, :] | eye)[None, None]

    def video_mask(self, text_masks: list[torch.Tensor],
                   within: list[torch.Tensor] | None = None, padding: int = 0) -> torch.Tensor:
        """Video queries over keys [all captions | all video], bool [1, 1, N, L + N]: a token
        sees its own sample's real caption tokens and its own sample's video; within[i] (bool
        [n_i, n_i], None: all of it) says which of sample i's video keys each of its tokens sees.
        `padding` tokens after the last sample (context parallel splits the pack evenly) see
        only each other."""
        device = text_masks[0].device
        vid, txt = self.video_ids(device), self.text_ids(device)
        vid = torch.cat([vid, vid.new_full((padding,), -1)])
        to_text = (vid[:, None] == txt[None, :]) & torch.cat(text_masks)[None, :]
        if within is None:
            to_video = vid[:, None] == vid[None, :]
        else:
            pad = torch.ones(padding, padding, dtype=torch.bool, device=device)
            to_video = torch.block_diag(*(w.to(device) for w in within), pad)
        return torch.cat([to_text, to_video], dim=1)[None, None]


def pack_layout(latents: list[torch.Tensor], texts: list[torch.Tensor], patch_size,
                copies: int = 1) -> PackLayout:
    """The layout of samples latents [C, T, H, W] (each) with captions [L, D] (each), each
    sample's video `copies` times (see PackLayout).

    Raises ValueError when a side is not a multiple of the patch size.
    """
    grids = []
    for latent in latents:
        sizes = latent.shape[1:]
        if any(s % p for s, p in zip(sizes, patch_size)):
            raise ValueError(f"latent {list(latent.shape)} is not a multiple of the patch size {list(patch_size)}")
        grids.append(tuple(s // p for s, p in zip(sizes, patch_size)))
    return PackLayout(tuple(grids), tuple(int(t.shape[0]) for t in texts), int(copies))
