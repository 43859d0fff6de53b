"""Sparse video attention's CUDA kernels (FlexAttention with a BlockMask, FA4's block sparsity)
against float32 softmax attention over the same chosen blocks, forward and backward, with and
without own-tile selection and caption padding."""

import math

import pytest
import torch

from trainer.models.attention import _runs_here
from trainer.models.sparse_attention import (FA4_BLOCK, SparseVideoSettings, keep_for,
                                             select_key_blocks, sparse_video_plan)

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
TILE = (2, 8, 8)  # 128 tokens: the block both CUDA kernels take


def _inputs(num_video, text, heads=4, head_dim=128, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(2, num_video, heads, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, num_video + text, heads, head_dim, device=DEVICE, dtype=torch.bfloat16,
                        generator=g) for _ in range(2))
    return q, k, v


def _reference(q, k, v, allowed):
    q, k, v = (t.float() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("kernel,padded", [("flex", False), ("flex", True), ("fa4", False)])
@pytest.mark.parametrize("own_tile", [False, True])
def test_sparse_kernels_match_float32_attention_over_the_chosen_blocks(kernel, padded, own_tile):
    if kernel == "fa4" and not _runs_here("fa4", DEVICE, torch.bfloat16, 128):
        pytest.skip("FA4 (flash-attn-4 on an SM90+ GPU) is not installed or does not run here")
    blocks, text = 12, 40
    num_video = blocks * FA4_BLOCK
    q, k, v = _inputs(num_video, text)
    lengths = torch.tensor([num_video + text, num_video + 17], device=DEVICE) if padded else None
    plan = sparse_video_plan(SparseVideoSettings(0.8, TILE, own_tile), kernel,
                             num_video=num_video, head_dim=128, dtype=torch.bfloat16,
                             device=DEVICE, key_lengths=lengths)
    assert plan.mask.kernel == kernel
    keep = keep_for(0.8, blocks)
    chosen = select_key_blocks(q, k, FA4_BLOCK, num_video, keep, own_tile)
    video = chosen[..., :blocks]
    assert bool((video.sum(-1) == keep).all())
    if own_tile:
        assert bool(video[..., torch.eye(blocks, dtype=torch.bool, device=DEVICE)].all())
    qb = torch.arange(num_video, device=DEVICE) // FA4_BLOCK
    kb = torch.arange(num_video + text, device=DEVICE) // FA4_BLOCK
    allowed = chosen[:, :, qb][:, :, :, kb]
    if padded:
        allowed = allowed & (torch.arange(num_video + text, device=DEVICE)[None, :]
                             < lengths[:, None])[:, None, None]

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    refs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out, ref = plan.mask.attend(*leaves), _reference(*refs, allowed)
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    assert _rel(out, ref) < 1e-2, _rel(out, ref)
    for name, a, b in zip("qkv", leaves, refs):
        assert _rel(a.grad, b.grad) < 2e-2, (name, _rel(a.grad, b.grad))
    dense = _reference(q, k, v, torch.ones_like(allowed))
    assert _rel(out, dense) > 5e-2  # the sparse output is not the dense one


def test_own_tile_changes_the_choice_on_the_gpu_only_where_the_own_tile_was_dropped():
    blocks = 16
    q, k, _ = _inputs(blocks * FA4_BLOCK, 0, seed=3)
    keep = keep_for(0.8, blocks)
    top = select_key_blocks(q, k, FA4_BLOCK, blocks * FA4_BLOCK, keep)
    own = select_key_blocks(q, k, FA4_BLOCK, blocks * FA4_BLOCK, keep, own_tile=True)
    diagonal = torch.eye(blocks, dtype=torch.bool, device=DEVICE)
    assert bool(own[..., diagonal].all()) and bool((own.sum(-1) == keep).all())
    kept_anyway = top[..., diagonal]
    assert torch.equal(own[kept_anyway], top[kept_anyway])
    assert not bool(kept_anyway.all())  # random q, k: the coarse top-k drops some own tiles
