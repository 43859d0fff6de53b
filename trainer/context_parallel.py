"""Ulysses context parallelism: the video tokens of a sample split over a cp group.

Within a group of `size` ranks, video token j of every sample lives on cp rank j % size
(strided, so each rank holds a share of every frame; RoPE positions and per-frame modulation
slots are cut the same way and follow their tokens). The caption's text stream is small and
is computed whole on every rank. Around each block's video attention two all-to-alls trade
tokens for heads: a rank attends over the full sequence for num_heads / size heads, keys
[caption | all video], then gets its own tokens back with every head. The head's output is
all-gathered at the end of the model, so the stages compute their losses on whole samples,
unchanged. The gather's backward sums the group's identical gradients, which FSDP2's mean
over the dp x cp shard group turns back into the mean over data-parallel ranks.

The model calls in at two points: `split_tokens` / `gather_tokens` around its blocks
(VideoDiT._run) and `attention` in place of the plain attention call of the video stream.
The KV-cached rollout (Stage2) is not split: it is refused under cp (trainer.preflight).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from trainer.attention import attention as plain_attention


@dataclasses.dataclass(frozen=True)
class UlyssesGroup:
    group: dist.ProcessGroup
    size: int
    rank: int


def attach(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Make `model` (and its blocks) run context-parallel over `group`."""
    cp = UlyssesGroup(group, dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank()))
    heads = model.cfg.num_attention_heads
    if heads % cp.size:
        raise ValueError(f"num_attention_heads {heads} is not divisible by cp_size {cp.size}")
    for module in (model, *model.blocks):
        module.ulysses = cp


def group_of(module: torch.nn.Module) -> UlyssesGroup | None:
    return getattr(module, "ulysses", None)


def split_tokens(cp: UlyssesGroup, vid: torch.Tensor, slots: torch.Tensor | None,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This rank's strided share of video tokens [B, N, D], their frame slots [N] and
    positions [N, 3]. Raises ValueError when N is not a multiple of the group size."""
    n = vid.shape[1]
    if n % cp.size:
        raise ValueError(f"{n} video tokens do not split over cp_size {cp.size}")
    take = slice(cp.rank, None, cp.size)
    return vid[:, take], None if slots is None else slots[take], positions[take]


class _AllGather(torch.autograd.Function):
    """[size, ...] of every rank's tensor; backward sums each rank's gradient of this rank's
    part (a reduce-scatter, written as an all-to-all: torch's own autograd all_gather
    addresses gloo subgroups by group rank where it needs the global one)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        return out.view(size, *local.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # (empty_like keeps a permuted gradient's strides)
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=ctx.group)
        return received.sum(0), None


def gather_tokens(cp: UlyssesGroup, local: torch.Tensor) -> torch.Tensor:
    """All ranks' tokens [B, n, C] back in sequence order [B, n x size, C] (autograd-aware)."""
    parts = _AllGather.apply(local, cp.group)  # [size, B, n, C]
    b, n, c = local.shape
    return parts.permute(1, 2, 0, 3).reshape(b, n * cp.size, c)


def _tokens_to_heads(cp: UlyssesGroup, x: torch.Tensor) -> torch.Tensor:
    """[B, H, n, d] local tokens -> [B, H / size, n x size, d], gathered rank-major."""
    b, h, n, d = x.shape
    send = x.reshape(b, cp.size, h // cp.size, n, d).transpose(0, 1).contiguous()
    recv = dist_fn.all_to_all_single(torch.empty_like(send), send, group=cp.group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * n, d)


def _heads_to_tokens(cp: UlyssesGroup, x: torch.Tensor) -> torch.Tensor:
    """The inverse of _tokens_to_heads: [B, H / size, n x size, d] -> [B, H, n, d]."""
    b, hc, total, d = x.shape
    n = total // cp.size
    send = x.reshape(b, hc, cp.size, n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = dist_fn.all_to_all_single(torch.empty_like(send), send, group=cp.group)
    return recv.transpose(0, 1).reshape(b, cp.size * hc, n, d)


def _rank_major_order(cp: UlyssesGroup, n: int, device) -> torch.Tensor:
    """Sequence index of each gathered token: rank r's l-th token is token l x size + r."""
    ranks = torch.arange(cp.size, device=device)[:, None]
    return (ranks + torch.arange(n, device=device)[None, :] * cp.size).reshape(-1)


def attention(module: torch.nn.Module, q: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, mask: torch.Tensor | None, backend: str) -> torch.Tensor:
    """The video stream's attention of `module`: q [B, H, n, d] over keys/values [B, H, P + n,
    d] ([caption prefix | own video]); mask over the whole sequence ([P + N] keys) or None.
    Without a cp group, plain attention."""
    cp = group_of(module)
    if cp is None:
        return plain_attention(q, keys, values, mask, backend)
    n = q.shape[2]
    prefix = keys.shape[2] - n
    heads = slice(cp.rank * (q.shape[1] // cp.size), (cp.rank + 1) * (q.shape[1] // cp.size))
    order = _rank_major_order(cp, n, q.device)
    k = torch.cat([keys[:, heads, :prefix], _tokens_to_heads(cp, keys[:, :, prefix:])], dim=2)
    v = torch.cat([values[:, heads, :prefix], _tokens_to_heads(cp, values[:, :, prefix:])], dim=2)
    if mask is not None:
        columns = torch.cat([torch.arange(prefix, device=q.device), prefix + order])
        mask = mask.index_select(-1, columns)
        if mask.shape[-2] > 1:
            mask = mask.index_select(-2, order)
    out = plain_attention(_tokens_to_heads(cp, q), k, v, mask, backend)
    return _heads_to_tokens(cp, out)
