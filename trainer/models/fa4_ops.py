"""FlashAttention 4 (`flash_attn.cute`) as torch custom operators.

FA4's own entry points are autograd Functions around CuTe DSL kernels, which torch sees only
from the outside: a compiled block has to break its graph around them, and selective
activation checkpointing cannot tell the attention call apart from the cheap ops inside it,
so it recomputes attention in the backward pass. As registered operators (`relay::fa4_forward`
and its backward) they are single nodes in a compiled graph and a name the checkpointing
policy can keep (trainer/build.py).

The forms relay runs on FA4 go through here: batched q/k/v [B, N, heads, head_dim] with an
optional count of used keys per sample (caption padding, `key_lengths`), packed sequences
[total, heads, head_dim] with cu_seqlens, and block-sparse attention over chosen 128 x 128
blocks (`relay::fa4_sparse_forward`, sparse video attention: trainer/models/sparse_attention.py). The package is imported at the first call, so this
module imports everywhere (CPU machines, login nodes); the operators run only on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FA4_OPS", "fa4_attention", "fa4_varlen_attention", "fa4_sparse_attention"]


def _fa4():
    import flash_attn.cute.interface as interface

    return interface


def _zero_unused_keys(grad: Tensor, key_lengths: Tensor | None) -> Tensor:
    # FA4's backward with seqused_k never writes dK and dV for unused keys: they hold whatever
    # the allocator's memory held (seen on an H200 as gradients 10^5 times too large flowing
    # into the caption embedder). Zeroing them is what the masked reference computes.
    if key_lengths is None:
        return grad
    used = torch.arange(grad.shape[1], device=grad.device)[None, :] < key_lengths[:, None]
    return grad.masked_fill(~used[:, :, None, None], 0)


@torch.library.custom_op("relay::fa4_forward", mutates_args=(), device_types="cuda")
def _forward(q: Tensor, k: Tensor, v: Tensor, key_lengths: Tensor | None,
             cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int,
             max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    packed = cu_seqlens_q is not None
    out, lse, *_ = _fa4()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=key_lengths,
        max_seqlen_q=max_seqlen_q if packed else None,
        max_seqlen_k=max_seqlen_k if packed else None, return_lse=True)
    return out, lse


@_forward.register_fake
def _(q, k, v, key_lengths, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    if cu_seqlens_q is None:  # batched: lse [B, heads, Nq]
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:  # packed: lse [heads, total_q]
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("relay::fa4_backward", mutates_args=(), device_types="cuda")
def _backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 key_lengths: Tensor | None, cu_seqlens_q: Tensor | None,
                 cu_seqlens_k: Tensor | None, max_seqlen_q: int,
                 max_seqlen_k: int) -> tuple[Tensor, Tensor, Tensor]:
    packed = cu_seqlens_q is not None
    dq, dk, dv = _fa4()._flash_attn_bwd(
        q, k, v, out, dout, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_k=key_lengths, max_seqlen_q=max_seqlen_q if packed else None,
        max_seqlen_k=max_seqlen_k if packed else None)[:3]
    return dq, _zero_unused_keys(dk, key_lengths), _zero_unused_keys(dv, key_lengths)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, key_lengths, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, key_lengths, cu_q, cu_k, max_q, max_k = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], key_lengths, cu_q, cu_k)
    ctx.max_seqlens = (max_q, max_k)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, key_lengths, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout.contiguous(), q, k, v, out, lse, key_lengths, cu_q, cu_k,
                              *ctx.max_seqlens)
    return dq, dk, dv, None, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- block-sparse attention (FA4's block sparsity, every chosen block whole) -----------------


def _sparse_tensors(count: Tensor, index: Tensor, block: int):
    """FA4's block lists: no partially masked blocks, `count` whole blocks per row at `index`."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    none = torch.zeros_like(count)
    return BlockSparseTensorsTorch(mask_block_cnt=none, mask_block_idx=none[..., None],
                                   full_block_cnt=count, full_block_idx=index,
                                   block_size=(block, block))


@torch.library.custom_op("relay::fa4_sparse_forward", mutates_args=(), device_types="cuda")
def _sparse_forward(q: Tensor, k: Tensor, v: Tensor, fwd_count: Tensor, fwd_index: Tensor,
                    bwd_count: Tensor, bwd_index: Tensor, block: int) -> tuple[Tensor, Tensor]:
    out, lse, *_ = _fa4()._flash_attn_fwd(
        q, k, v, block_sparse_tensors=_sparse_tensors(fwd_count, fwd_index, block),
        return_lse=True)
    return out, lse


@_sparse_forward.register_fake
def _(q, k, v, fwd_count, fwd_index, bwd_count, bwd_index, block):
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("relay::fa4_sparse_backward", mutates_args=(), device_types="cuda")
def _sparse_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        bwd_count: Tensor, bwd_index: Tensor,
                        block: int) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _fa4()._flash_attn_bwd(
        q, k, v, out, dout, lse,
        block_sparse_tensors=_sparse_tensors(bwd_count, bwd_index, block))[:3]
    return dq, dk, dv


@_sparse_backward_op.register_fake
def _(dout, q, k, v, out, lse, bwd_count, bwd_index, block):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sparse_setup_context(ctx, inputs, output):
    q, k, v, _fc, _fi, bwd_count, bwd_index, block = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], bwd_count, bwd_index)
    ctx.block = block


def _sparse_backward(ctx, dout, _dlse):
    q, k, v, out, lse, bwd_count, bwd_index = ctx.saved_tensors
    dq, dk, dv = _sparse_backward_op(dout.contiguous(), q, k, v, out, lse, bwd_count, bwd_index,
                                     ctx.block)
    return dq, dk, dv, None, None, None, None, None


_sparse_forward.register_autograd(_sparse_backward, setup_context=_sparse_setup_context)


def fa4_sparse_attention(q: Tensor, k: Tensor, v: Tensor, fwd_count: Tensor, fwd_index: Tensor,
                         bwd_count: Tensor, bwd_index: Tensor, block: int) -> Tensor:
    """FA4 attention of q [B, Nq, heads, head_dim] over k, v [B, Nk, heads, head_dim] restricted
    to whole block x block blocks: query block i sees key blocks fwd_index[b, h, i, :fwd_count]
    (int32 [B, heads, q blocks(, k blocks)], ascending); bwd_count / bwd_index the same
    matrix by key block (the backward's lists). Short last blocks are masked by length."""
    return _sparse_forward(q, k, v, fwd_count, fwd_index, bwd_count, bwd_index, block)[0]


# What trainer/build.py's selective checkpointing keeps (the forward's out and lse).
FA4_OPS = (torch.ops.relay.fa4_forward, torch.ops.relay.fa4_sparse_forward)


def fa4_attention(q: Tensor, k: Tensor, v: Tensor, key_lengths: Tensor | None = None) -> Tensor:
    """FA4 attention of q [B, Nq, heads, head_dim] over k, v [B, Nk, heads, head_dim]; sample
    b sees its first key_lengths[b] keys (int32 [B]) or all of them when None."""
    return _forward(q, k, v, key_lengths, None, None, 0, 0)[0]


def fa4_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int) -> Tensor:
    """FA4 attention within packed sequences (q [total_q, heads, head_dim], int32 cu_seqlens)."""
    return _forward(q, k, v, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)[0]
