"""Sparse video self-attention: tiles of the latent grid, each query tile over its top-k key tiles.

The video tokens of a (frames, rows, cols) patch grid are put in tile-major order (`TileOrder`):
tiles of `tile` = [t, h, w] tokens, edge tiles smaller where the tile does not divide the grid,
no padding. Blocks are `block` = t * h * w consecutive tokens of that order (an edge block may
hold parts of two neighbouring edge tiles; the last one may be short). For each query block and
head, a coarse score against every key block, the dot product of the two blocks' mean q and mean
k, picks the `keep` = max(1, round((1 - sparsity) * video key blocks)) best key blocks (as
FastVideo's VSA does), or with `own_tile` the query block's own key block and the `keep` - 1
best of the others; attention then runs over exactly the chosen blocks. Key blocks that are not
wholly video (a short last block, and in the DiT the blocks holding caption keys, which come after
the video's) are always attended.

The order is applied once per forward pass (the model permutes its tokens, their RoPE positions
and modulation before the blocks, and the head output back after), not per layer. The selection
runs in every layer (it depends on that layer's q and k) and is not differentiated.

Kernels (`SparseVideo.kernel`): FlashAttention 4's block sparsity on CUDA (Hopper/Blackwell,
bf16/fp16, 128-token blocks, no caption padding: `relay::fa4_sparse_forward`,
trainer/models/fa4_ops.py); else FlexAttention with a BlockMask of the chosen blocks on CUDA
(128-token blocks); else SDPA with the token-level mask of the selection (CPU, the reference).
`sparsity: 0` never gets here: the model runs its dense path, exactly as without the option.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple

import torch

from trainer.models.attention import _flex, _runs_here, _sdpa
from trainer.models.fa4_ops import fa4_sparse_attention

log = logging.getLogger("relay")

__all__ = ["active_settings", "SparseVideoSettings", "SparseVideo", "TileOrder", "tile_order", "keep_for",
           "select_key_blocks", "sparse_video_plan", "set_video_attention_sparsity",
           "current_sparsity", "to_tiles"]

FA4_BLOCK = 128  # FA4's SM90 tile: its block sparsity works in 128 x 128 blocks


class SparseVideoSettings(NamedTuple):
    """What a module with sparse video attention runs with now: the fraction of video key
    blocks each query block skips (0: the dense path), the tile [t, h, w] in tokens, and
    whether each query block always keeps its own key block (within the same count)."""

    sparsity: float
    tile: tuple[int, int, int]
    own_tile: bool = False


def current_sparsity(target: float, warmup_steps: int, step: int) -> float:
    """The ramp: target x min(1, step / warmup_steps) at optimizer step `step` (1-based), the
    target from the first step when warmup_steps is 0. A function of the step alone, so a
    resumed run uses what the uninterrupted one used."""
    if target <= 0:
        return 0.0
    if warmup_steps <= 0:
        return float(target)
    return float(target) * min(1.0, max(step, 0) / warmup_steps)


def set_video_attention_sparsity(model: torch.nn.Module, sparsity: float,
                                 tile: tuple[int, int, int] | list[int],
                                 own_tile: bool = False) -> int:
    """Set every module of `model` (a family's module, or one wrapped by peft) that has sparse
    video attention (`supports_sparse_video_attention`) to run at `sparsity` with `tile`
    (and `own_tile`). Returns how many were set."""
    settings = SparseVideoSettings(float(sparsity), tuple(int(x) for x in tile), bool(own_tile))
    count = 0
    for module in model.modules():
        if getattr(type(module), "supports_sparse_video_attention", False):
            module.sparse_video = settings
            count += 1
    return count


def active_settings(module: torch.nn.Module, kind: str | None) -> SparseVideoSettings | None:
    """The sparse video attention settings a family's module runs a captioned forward with
    (None: the dense path, sparsity 0 or never set). kind: the forward's chunk rule (None:
    bidirectional). Raises ValueError where it cannot run: a causal rule (block-causal,
    teacher forcing) or context parallel (preflight refuses both first:
    trainer/checks/sparse_attention.py)."""
    settings = getattr(module, "sparse_video", None)
    if settings is None or settings.sparsity <= 0:
        return None
    if kind is not None:
        raise ValueError(f"sparse video attention (video_attention_sparsity "
                         f"{settings.sparsity:g}) runs bidirectional video attention only, not "
                         f"the {kind.replace('_', '-')} form; set video_attention_sparsity: 0")
    if getattr(module, "ulysses", None) is not None:
        raise ValueError("sparse video attention does not run under context parallel (cp_size "
                         "> 1); set video_attention_sparsity: 0 or cp_size: 1")
    return settings


def keep_for(sparsity: float, blocks: int) -> int:
    """Key blocks each query block keeps of `blocks` candidates at `sparsity`: at least one."""
    return max(1, min(blocks, round((1.0 - sparsity) * blocks)))


# --------------------------------------------------------------------------------------------
# the tile-major order


class TileOrder(NamedTuple):
    """A grid's tile-major order: tokens_tiled = tokens[:, to_tiles];
    tokens = tokens_tiled[:, from_tiles]."""

    to_tiles: torch.Tensor  # long [N]: the frame-major index of the token at tiled position i
    from_tiles: torch.Tensor  # long [N]: the tiled position of frame-major token j


@functools.lru_cache(maxsize=32)
def _order_cpu(grid: tuple[int, int, int], tile: tuple[int, int, int]):
    T, H, W = grid
    tt, th, tw = tile
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    nh, nw = math.ceil(H / th), math.ceil(W / tw)
    tile_id = ((t // tt) * nh + h // th) * nw + w // tw
    inner = ((t % tt) * th + h % th) * tw + w % tw
    key = (tile_id * (tt * th * tw) + inner).flatten()
    to_tiles = key.argsort()  # keys are distinct: the sort is exact
    from_tiles = torch.empty_like(to_tiles)
    from_tiles[to_tiles] = torch.arange(to_tiles.numel())
    return to_tiles, from_tiles


_ORDERS: dict = {}


def tile_order(grid: tuple[int, int, int], tile: tuple[int, int, int], device) -> TileOrder:
    """The tile-major order of a frame-major (frames, rows, cols) grid (cached per device)."""
    key = (tuple(grid), tuple(tile), str(torch.device(device)))
    if key not in _ORDERS:
        to_tiles, from_tiles = _order_cpu(tuple(grid), tuple(tile))
        _ORDERS[key] = TileOrder(to_tiles.to(device), from_tiles.to(device))
    return _ORDERS[key]


def to_tiles(order: TileOrder, tokens: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor | None, groups: int):
    """Tokens [B, N, D], their grid positions [N, 3] and modulation runs in tile-major order:
    (tokens, positions, slots). The N tokens form `groups` equal runs, run g taking slot
    slots[g] (None: slot g); one run stays one run (slots as given), more become one run per
    token (its slot, in the new order)."""
    n = tokens.shape[1]
    if groups > 1:
        per_group = slots if slots is not None else torch.arange(groups, device=tokens.device)
        slots = per_group.repeat_interleave(n // groups)[order.to_tiles]
    return tokens[:, order.to_tiles], positions[order.to_tiles], slots


# --------------------------------------------------------------------------------------------
# the selection


def _block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """[B, N, H, D] -> float32 [B, H, ceil(N / block), D], each block's mean (a short last
    block over its own tokens)."""
    B, N, H, D = x.shape
    nb = math.ceil(N / block)
    pad = nb * block - N
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, H, D)], dim=1)
    sums = x.view(B, nb, block, H, D).sum(2, dtype=torch.float32)
    counts = torch.full((nb,), float(block), device=x.device)
    counts[-1] = block - pad
    return (sums / counts[None, :, None, None]).transpose(1, 2)


@torch.no_grad()
def select_key_blocks(q: torch.Tensor, k: torch.Tensor, block: int, num_video: int,
                      keep: torch.Tensor | int, own_tile: bool = False) -> torch.Tensor:
    """bool [B, H, query blocks, key blocks]: the key blocks each query block attends to.

    q [B, Nq, H, D] (video queries, tile-major), k [B, Nk, H, D] (the first num_video keys the
    video's, tile-major, then any others). Of the num_video // block key blocks wholly of video,
    each query block and head takes the `keep` (an int or a 0-d tensor, so a compiled graph
    does not specialise on it) with the highest coarse score mean(q) . mean(k); every other key
    block is always taken. Ties go to the lower block index. own_tile: query block i ranks its
    own key block i first (a local window of one tile inside the same `keep`)."""
    full = num_video // block
    nk = math.ceil(k.shape[1] / block)
    qm = _block_means(q, block)
    km = _block_means(k[:, :full * block], block) if full else qm[:, :, :0]
    scores = qm @ km.transpose(-1, -2)  # [B, H, nq, full]
    if own_tile:  # tile-major on both sides: query block i and key block i are one tile
        own = torch.eye(scores.shape[-2], full, dtype=torch.bool, device=q.device)
        scores = scores.masked_fill(own, math.inf)
    order = scores.argsort(dim=-1, descending=True, stable=True)
    keep = torch.as_tensor(keep, device=q.device)
    ranked = (torch.arange(full, device=q.device) < keep).expand_as(order)
    chosen = torch.zeros_like(ranked).scatter_(-1, order, ranked)
    rest = chosen.new_ones((*chosen.shape[:-1], nk - full))
    return torch.cat([chosen, rest], dim=-1)


def _ordered(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 count [..., rows], int32 indices [..., rows, cols]): each row's chosen columns,
    ascending and packed left (the rest: the unchosen ones)."""
    count = chosen.sum(-1, dtype=torch.int32)
    index = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, index


def token_mask(chosen: torch.Tensor, block: int, num_queries: int, num_keys: int,
               key_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, H, Nq, Nk]: query token -> key token allowed by the chosen blocks (and by the
    keys used per sample, key_lengths int [B])."""
    qb = torch.arange(num_queries, device=chosen.device) // block
    kb = torch.arange(num_keys, device=chosen.device) // block
    mask = chosen[:, :, qb][:, :, :, kb]
    if key_lengths is not None:
        used = torch.arange(num_keys, device=chosen.device)[None, :] < key_lengths[:, None]
        mask = mask & used[:, None, None, :]
    return mask


# --------------------------------------------------------------------------------------------
# the plan and the kernels


class SparseVideo(NamedTuple):
    """A forward pass's sparse video attention, carried as an AttentionPlan's mask (attend()
    calls `.attend`); plain data for torch.compile (keep is a tensor: no recompile as the ramp
    changes it)."""

    kernel: str  # fa4 | flex | sdpa
    block: int
    num_video: int  # the video's tokens: the queries, and the first keys
    keep: torch.Tensor  # long 0-d: video key blocks each query block keeps
    key_lengths: torch.Tensor | None  # int32 [B]: keys used per sample (caption padding)
    own_tile: bool = False  # each query block keeps its own key block

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of video queries q [B, N, H, D] (tile-major) over k, v [B, Nk, H, D]."""
        chosen = select_key_blocks(q, k, self.block, self.num_video, self.keep, self.own_tile)
        if self.kernel == "fa4":
            fwd_count, fwd_index = _ordered(chosen)
            bwd_count, bwd_index = _ordered(chosen.transpose(-1, -2))
            return fa4_sparse_attention(q, k, v, fwd_count, fwd_index.contiguous(), bwd_count,
                                        bwd_index.contiguous(), self.block)
        if self.kernel == "flex":
            return _flex(q, k, v, _flex_block_mask(chosen, self.block, q.shape[1], k.shape[1],
                                                   self.key_lengths))
        mask = token_mask(chosen, self.block, q.shape[1], k.shape[1], self.key_lengths)
        return _sdpa(q, k, v, mask)


def _flex_block_mask(chosen, block, num_queries, num_keys, key_lengths):
    from torch.nn.attention.flex_attention import BlockMask

    count, index = _ordered(chosen)
    zeros = torch.zeros_like(count)
    if key_lengths is None:  # every chosen block whole; the short tails masked by length
        return BlockMask.from_kv_blocks(zeros, index, count, index, BLOCK_SIZE=block,
                                        seq_lengths=(num_queries, num_keys))

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < key_lengths[b]

    return BlockMask.from_kv_blocks(count, index, None, None, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(num_queries, num_keys))


def sparse_kernel(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                  block: int, padded_keys: bool) -> str:
    """The kernel sparse video attention runs on here (module docstring)."""
    if device.type != "cuda" or backend == "sdpa" or block != FA4_BLOCK:
        return "sdpa"
    if backend in ("auto", "fa4") and not padded_keys and _runs_here("fa4", device, dtype, head_dim):
        return "fa4"
    return "flex"


@functools.lru_cache(maxsize=None)
def _log_route(kernel: str, where: str, tile: tuple, block: int) -> None:
    log.info("attention: sparse video attention -> %s (tile %s, %d-token blocks, %s)", kernel,
             "x".join(map(str, tile)), block, where)


def sparse_video_plan(settings: SparseVideoSettings, backend: str, *, num_video: int,
                      head_dim: int, dtype: torch.dtype, device,
                      key_lengths: torch.Tensor | None = None):
    """The AttentionPlan of video queries over [video | any other keys] at settings.sparsity
    (> 0) with settings.tile, in tile-major order. key_lengths: int [B] keys used per sample, or
    None."""
    from trainer.models.attention import AttentionPlan

    device = torch.device(device)
    block = math.prod(settings.tile)
    kernel = sparse_kernel(backend, device, dtype, head_dim, block, key_lengths is not None)
    _log_route(kernel, f"{device.type}, {str(dtype).removeprefix('torch.')}", settings.tile, block)
    candidates = num_video // block
    keep = torch.tensor(keep_for(settings.sparsity, max(candidates, 1)), device=device)
    if key_lengths is not None:
        key_lengths = key_lengths.to(device=device, dtype=torch.int32)
    return AttentionPlan("sparse", None, SparseVideo(kernel, block, num_video, keep, key_lengths,
                                                     settings.own_tile))
