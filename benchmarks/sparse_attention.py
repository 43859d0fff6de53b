"""Tile-based block-sparse video self-attention (VSA-like) against dense FA4, forward + backward.

Video tokens [B, N, heads, head_dim] of a latent grid (T, H, W) (after patching) are put in
tile-major order, so that a spatio-temporal tile of the grid is contiguous, and cut into blocks
of `block` tokens (128 or 64). Each query block attends to its top-k key blocks, chosen from a
coarse attention over block means (softmax-free: top-k of mean(q) . mean(k)^T per head), as
FastVideo's VSA does. Sparsity s is the fraction of key blocks a query block skips
(keep = round((1 - s) * blocks), at least 1).

Two ways to lay the 21x30x52 grid of Wan2.1 at 81x480x832 over 128-token blocks (no power-of-two
tile divides 21, 30 and 52):
- "packed": tile-major order with uneven edge tiles and no padding; blocks are 128 consecutive
  tokens of that order, so edge blocks hold parts of two neighbouring tiles, and the last block
  is short (32760 = 255 * 128 + 120: kernels mask the tail by sequence length).
- "padded": the grid is padded to a multiple of the tile, every tile is exactly one block (as
  VSA pads each tile), and padding keys are masked (FlexAttention mask_mod on the blocks that
  hold padding); the padded queries are computed and dropped.

Kernels, each timed forward + backward at [1, N, heads, 128] bf16:
- fa4-dense: relay's FA4 operator (trainer/models/fa4_ops.py), the baseline;
- sdpa-dense: torch SDPA (cuDNN / flash backends), the fallback baseline;
- flex: torch FlexAttention, compiled, with a BlockMask of the selected blocks (all "full");
- fa4-sparse: FA4's own block sparsity (flash_attn.cute.flash_attn_func with
  block_sparse_tensors / block_sparse_tensors_bwd, full blocks only), packed layout only;
- selection: block means, coarse scores, top-k, sort, BlockMask (and FA4 index tensors),
  timed on its own; it runs once per attention layer per step.

Checks: the selection is the exact top-k of the coarse scores and the BlockMask holds exactly
the selected blocks; on sampled query rows every sparse kernel's output equals an fp32
reference restricted to the selected blocks (and differs from the unrestricted one at s > 0);
at s = 0 outputs and gradients equal the dense kernel's.

    python benchmarks/sparse_attention.py --toy          # CPU, tiny grid: the logic and checks
    python benchmarks/sparse_attention.py                # H100/H200: the measurements
    python benchmarks/sparse_attention.py --items fa4-dense,flex --budget-s 200

Prints one JSON line per measurement (also appended to --out when given).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: E402

GRID = (21, 30, 52)  # Wan2.1 latent 21x60x104 at 81x480x832, patched 1x2x2
HEAD_DIM = 128
HEADS = {"1.3B": 12, "14B": 40}
SPARSITIES = (0.0, 0.5, 0.8, 0.9)
TILE_FOR_BLOCK = {128: (2, 8, 8), 64: (4, 4, 4)}  # (4, 4, 4) is VSA's tile

_OUT = None
_T0 = time.perf_counter()


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if _OUT:
        with open(_OUT, "a") as f:
            f.write(line + "\n")


# --------------------------------------------------------------------------------------------
# layout: tile-major order, packed or padded


@dataclass
class Layout:
    grid: tuple[int, int, int]
    tile: tuple[int, int, int]
    block: int
    padded: bool
    n: int                 # tokens the kernel sees
    positions: torch.Tensor  # long [N]: kernel position of original (frame-major) token i
    valid: torch.Tensor    # bool [n]: a real token (False = padding)

    @property
    def blocks(self) -> int:
        return math.ceil(self.n / self.block)

    @property
    def name(self) -> str:
        return f"{'padded' if self.padded else 'packed'} {'x'.join(map(str, self.tile))}/{self.block}"

    def block_valid_counts(self) -> torch.Tensor:
        v = F.pad(self.valid, (0, self.blocks * self.block - self.n))
        return v.view(self.blocks, self.block).sum(1)

    def block_has_padding(self) -> torch.Tensor:
        """bool [blocks]: the block holds a padding key (or is the short tail block)."""
        return self.block_valid_counts() < self.block

    def to_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, ...] frame-major -> [B, n, ...] tile-major (zeros at padding)."""
        pos = self.positions.to(x.device)
        if not self.padded:
            inverse = torch.empty_like(pos)
            inverse[pos] = torch.arange(pos.numel(), device=x.device)
            return x[:, inverse]
        out = x.new_zeros((x.shape[0], self.n, *x.shape[2:]))
        out[:, pos] = x
        return out

    def from_kernel(self, y: torch.Tensor) -> torch.Tensor:
        return y[:, self.positions.to(y.device)]


def make_layout(grid, tile, block, padded) -> Layout:
    T, H, W = grid
    tt, th, tw = tile
    if padded and tt * th * tw != block:
        raise ValueError(f"a padded layout needs tile volume == block, got {tile} for {block}")
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    nh, nw = math.ceil(H / th), math.ceil(W / tw)
    tile_id = ((t // tt) * nh + h // th) * nw + w // tw
    inner = ((t % tt) * th + h % th) * tw + w % tw
    if padded:
        positions = (tile_id * block + inner).flatten()
        n = math.ceil(T / tt) * nh * nw * block
    else:
        positions = torch.empty(T * H * W, dtype=torch.long)
        positions[(tile_id * (tt * th * tw) + inner).flatten().argsort()] = torch.arange(T * H * W)
        n = T * H * W
    valid = torch.zeros(n, dtype=torch.bool)
    valid[positions] = True
    return Layout(tuple(grid), tuple(tile), block, padded, n, positions, valid)


# --------------------------------------------------------------------------------------------
# selection: block means, coarse scores, top-k


def keep_for(sparsity: float, blocks: int) -> int:
    return max(1, round((1.0 - sparsity) * blocks))


def block_means(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[B, n, H, D] -> fp32 [B, H, blocks, D], the mean over each block's real tokens."""
    B, n, H, D = x.shape
    nb = layout.blocks
    xs = F.pad(x, (0, 0, 0, 0, 0, nb * layout.block - n)).view(B, nb, layout.block, H, D)
    sums = xs.sum(2, dtype=torch.float32)  # padding tokens are zeros
    counts = layout.block_valid_counts().to(x.device, torch.float32)
    return (sums / counts[None, :, None, None]).transpose(1, 2)


def coarse_scores(q, k, layout) -> torch.Tensor:
    qm, km = block_means(q, layout), block_means(k, layout)
    return (qm @ km.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, nq, nk]


def select_blocks(q, k, layout, keep) -> torch.Tensor:
    """int32 [B, H, blocks, keep]: each query block's top-`keep` key blocks, ascending."""
    with torch.no_grad():
        scores = coarse_scores(q, k, layout)
        return scores.topk(keep, dim=-1).indices.sort(dim=-1).values.to(torch.int32)


def _packed_left(selected, flag, nb):
    """Indices of `selected` where flag, packed left (rest >= nb clamped), and their count."""
    key = torch.where(flag, selected, selected + nb)
    ordered = key.sort(dim=-1).values
    return ordered.clamp(max=nb - 1).to(torch.int32), flag.sum(-1, dtype=torch.int32)


@dataclass
class Sparse:
    selected: torch.Tensor     # int32 [B, H, nq, keep]
    block_mask: BlockMask
    fa4_fwd: object = None
    fa4_bwd: object = None


def selection_mask_mod(selected, layout: Layout):
    """The selection (and the padding) as a mask_mod. Compiled flex calls it only on partial
    blocks (those holding padding keys); eager flex (CPU) computes with it alone, ignoring the
    block structure, so the toy check needs it to see the sparsity."""
    B, H, nq, _ = selected.shape
    allowed = torch.zeros((B, H, nq, layout.blocks), dtype=torch.bool, device=selected.device)
    allowed.scatter_(-1, selected.long(), True)
    valid = layout.valid.to(selected.device)
    block = layout.block

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[b, h, q_idx // block, kv_idx // block] & valid[kv_idx]

    return mask_mod


_PAD_MASK_MODS: dict = {}


def padding_mask_mod(layout: Layout, device):
    """mask_mod hiding padding keys; one function object per layout, so that compiled flex
    (which guards on the function) compiles once for every sparsity."""
    key = (layout.name, layout.grid, str(device))
    if key not in _PAD_MASK_MODS:
        valid = layout.valid.to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            return valid[kv_idx]

        _PAD_MASK_MODS[key] = mask_mod
    return _PAD_MASK_MODS[key]


def build_sparse(q, k, layout, keep, fa4: bool = False, exact_mask_mod: bool = False) -> Sparse:
    """The selection and everything the kernels take (the timed 'selection overhead').

    Compiled flex reads the selection from the BlockMask's block lists and calls mask_mod only
    on partial blocks (padded layout: blocks holding padding keys), so mask_mod need only hide
    padding (packed layout: no mask_mod, every block full). exact_mask_mod puts the selection
    itself in mask_mod too, for eager flex (CPU), which ignores the block lists.
    """
    selected = select_blocks(q, k, layout, keep)
    B, H, nq, _ = selected.shape
    nb = layout.blocks
    width = torch.zeros((B, H, nq, nb), dtype=torch.int32, device=q.device)
    if exact_mask_mod:
        mask_mod = selection_mask_mod(selected, layout)
    else:
        mask_mod = padding_mask_mod(layout, q.device) if layout.padded else None
    if layout.padded:  # blocks holding padding keys are partial (mask_mod), the rest full
        has_pad = layout.block_has_padding().to(q.device)[selected.long()]
        part_idx, part_cnt = _packed_left(selected, has_pad, nb)
        full_idx, full_cnt = _packed_left(selected, ~has_pad, nb)
        kv_idx = width.clone()
        kv_idx[..., :selected.shape[-1]] = part_idx
        full = width.clone()
        full[..., :selected.shape[-1]] = full_idx
        block_mask = BlockMask.from_kv_blocks(part_cnt, kv_idx, full_cnt, full, BLOCK_SIZE=layout.block,
                                              mask_mod=mask_mod, seq_lengths=(layout.n, layout.n))
    else:  # every selected block is full; the short tail is masked by sequence length
        full = width.clone()
        full[..., :selected.shape[-1]] = selected
        full_cnt = torch.full((B, H, nq), selected.shape[-1], dtype=torch.int32, device=q.device)
        zeros = torch.zeros((B, H, nq), dtype=torch.int32, device=q.device)
        block_mask = BlockMask.from_kv_blocks(zeros, width, full_cnt, full, BLOCK_SIZE=layout.block,
                                              mask_mod=mask_mod, seq_lengths=(layout.n, layout.n))
    sparse = Sparse(selected, block_mask)
    if fa4:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        bm = block_mask
        size = (layout.block, layout.block)

        def i32(t):
            return None if t is None else t.to(torch.int32).contiguous()

        sparse.fa4_fwd = BlockSparseTensorsTorch(
            mask_block_cnt=i32(bm.kv_num_blocks), mask_block_idx=i32(bm.kv_indices),
            full_block_cnt=i32(bm.full_kv_num_blocks), full_block_idx=i32(bm.full_kv_indices),
            block_size=size)
        sparse.fa4_bwd = BlockSparseTensorsTorch(
            mask_block_cnt=i32(bm.q_num_blocks), mask_block_idx=i32(bm.q_indices),
            full_block_cnt=i32(bm.full_q_num_blocks), full_block_idx=i32(bm.full_q_indices),
            block_size=size)
    return sparse


def fa4_tensors_direct(selected, layout):
    """FA4's forward and backward block lists straight from the selection, without a flex
    BlockMask: forward = the sorted top-k lists (compact, [B, H, nq, keep]); backward = for each
    key block, the query blocks that selected it, ascending (a transpose of the block matrix)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    B, H, nq, keep = selected.shape
    dev = selected.device
    size = (layout.block, layout.block)
    chosen = torch.zeros((B, H, nq, nq), dtype=torch.bool, device=dev)
    chosen.scatter_(-1, selected.long(), True)
    by_key = chosen.transpose(-1, -2)  # [B, H, nk, nq]
    q_cnt = by_key.sum(-1, dtype=torch.int32)
    q_idx = torch.argsort((~by_key).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    fwd = BlockSparseTensorsTorch(
        mask_block_cnt=torch.zeros((B, H, nq), dtype=torch.int32, device=dev),
        mask_block_idx=torch.zeros((B, H, nq, 1), dtype=torch.int32, device=dev),
        full_block_cnt=torch.full((B, H, nq), keep, dtype=torch.int32, device=dev),
        full_block_idx=selected.contiguous(), block_size=size)
    bwd = BlockSparseTensorsTorch(
        mask_block_cnt=torch.zeros((B, H, nq), dtype=torch.int32, device=dev),
        mask_block_idx=torch.zeros((B, H, nq, 1), dtype=torch.int32, device=dev),
        full_block_cnt=q_cnt, full_block_idx=q_idx.contiguous(), block_size=size)
    return fwd, bwd


def dense_block_mask(block_mask: BlockMask) -> torch.Tensor:
    """bool [B, H, nq, nk]: blocks the BlockMask visits (partial or full)."""
    bm = block_mask
    B, H, nq, nk = bm.kv_indices.shape
    out = torch.zeros((B, H, nq, nk + 1), dtype=torch.bool, device=bm.kv_indices.device)
    for cnt, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        if cnt is None:
            continue
        used = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
        out.scatter_(-1, torch.where(used, idx, nk).long(), True)  # unused entries -> column nk
    return out[..., :nk]


def token_mask(selected, layout) -> torch.Tensor:
    """bool [B, H, n, n]: query token -> key token allowed by the selection and padding."""
    B, H, nq, _ = selected.shape
    blk = torch.zeros((B, H, nq, nq), dtype=torch.bool, device=selected.device)
    blk.scatter_(-1, selected.long(), True)
    ids = torch.arange(layout.n, device=selected.device) // layout.block
    return blk[:, :, ids][:, :, :, ids] & layout.valid.to(selected.device)


# --------------------------------------------------------------------------------------------
# kernels: q, k, v [B, n, H, D]


def flex_call(compiled, q, k, v, sparse, kernel_options=None):
    out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                   block_mask=sparse.block_mask, kernel_options=kernel_options)
    return out.transpose(1, 2)


def fa4_sparse_call(q, k, v, sparse):
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v, block_sparse_tensors=sparse.fa4_fwd,
                          block_sparse_tensors_bwd=sparse.fa4_bwd)
    return out[0] if isinstance(out, tuple) else out


def sdpa_call(q, k, v, mask=None):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask)
    return out.transpose(1, 2)


def reference_rows(q, k, v, rows, allowed=None):
    """fp32 attention of query rows [r] over all keys: [B, r, H, D]; allowed bool [B, H, r, n]."""
    s = torch.einsum("brhd,bnhd->bhrn", q[:, rows].float(), k.float()) * q.shape[-1] ** -0.5
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhrn,bnhd->brhd", s.softmax(-1), v.float())


def rows_allowed(sparse, layout, rows):
    """bool [B, H, r, n] for query rows: their block's selected key blocks, real keys only."""
    sel = sparse.selected[:, :, (rows // layout.block)].long()  # [B, H, r, keep]
    B, H, r, _ = sel.shape
    blk = torch.zeros((B, H, r, layout.blocks), dtype=torch.bool, device=sel.device)
    blk.scatter_(-1, sel, True)
    ids = torch.arange(layout.n, device=sel.device) // layout.block
    return blk[..., ids] & layout.valid.to(sel.device)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


# --------------------------------------------------------------------------------------------
# CPU toy check


def toy() -> None:
    torch.manual_seed(0)
    grid, heads, d = (5, 6, 10), 2, 16
    failures = []

    def check(name, ok, **info):
        emit({"check": name, "ok": bool(ok), **info})
        if not ok:
            failures.append(name)

    for tile, block, padded in (((2, 2, 4), 16, False), ((2, 2, 4), 16, True),
                                ((1, 4, 4), 16, True), ((2, 4, 4), 16, False)):
        lay = make_layout(grid, tile, block, padded)
        N = math.prod(grid)
        check(f"{lay.name}: positions are a permutation into the kernel order",
              lay.positions.unique().numel() == N and int(lay.valid.sum()) == N,
              n=lay.n, blocks=lay.blocks, padding=round(lay.n / N - 1, 3))
        x = torch.randn(1, N, heads, d)
        check(f"{lay.name}: to_kernel/from_kernel round trip",
              torch.equal(lay.from_kernel(lay.to_kernel(x)), x))
        if padded:  # each tile is one block, so a block's tokens share a tile
            t, h, w = torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij")
            tid = ((t // tile[0]) * 1000 + h // tile[1]) * 1000 + w // tile[2]
            tk = lay.to_kernel(tid.flatten()[None, :, None, None].float())[0, :, 0, 0]
            per_block = [tk[i * block:(i + 1) * block][lay.valid[i * block:(i + 1) * block]].unique().numel()
                         for i in range(lay.blocks)]
            check(f"{lay.name}: every block is one tile", max(per_block) == 1)

        # inputs with locality so the selection matters: a smooth field over the grid plus noise
        base = torch.randn(1, N, heads, d)
        q, k, v = (lay.to_kernel(base + 0.5 * torch.randn(1, N, heads, d)) for _ in range(3))
        q = q * 2
        dense_ref = lay.from_kernel(sdpa_call(q, k, v, mask=lay.valid[None, :]))
        for s in (0.0, 0.5, 0.8):
            keep = keep_for(s, lay.blocks)
            sp = build_sparse(q, k, lay, keep, exact_mask_mod=True)
            scores = coarse_scores(q, k, lay)
            sel = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, sp.selected.long(), True)
            exact_topk = bool((scores.masked_fill(~sel, float("inf")).amin(-1)
                               >= scores.masked_fill(sel, float("-inf")).amax(-1)).all())
            check(f"{lay.name} s={s}: {keep} of {lay.blocks} key blocks per query block, exact top-k, sorted",
                  exact_topk and bool((sel.sum(-1) == keep).all())
                  and bool((sp.selected.diff(dim=-1) > 0).all()) if keep > 1 else exact_topk)
            check(f"{lay.name} s={s}: BlockMask blocks == selection",
                  torch.equal(dense_block_mask(sp.block_mask), sel))
            out = flex_call(flex_attention, q, k, v, sp)  # CPU flex has no backward
            allowed = token_mask(sp.selected, lay)  # [B, H, n, n]
            ref = sdpa_call(q, k, v, mask=allowed)
            real = lay.valid
            err = rel_err(out[:, real], ref[:, real])
            check(f"{lay.name} s={s}: flex == SDPA with the token mask of the selection",
                  err < 1e-5, rel_err=err)
            rows = torch.nonzero(real).flatten()[::7]
            rerr = rel_err(reference_rows(q, k, v, rows, rows_allowed(sp, lay, rows)), out[:, rows])
            check(f"{lay.name} s={s}: sampled rows == fp32 reference over the selected blocks",
                  rerr < 1e-5, rel_err=rerr)
            if s == 0.0:
                e0 = rel_err(lay.from_kernel(out), dense_ref)
                check(f"{lay.name}: s=0 equals dense SDPA (original order)", e0 < 1e-5, rel_err=e0)
            else:
                diff = rel_err(lay.from_kernel(out), dense_ref)
                check(f"{lay.name} s={s}: sparse output differs from dense", diff > 1e-3, rel_err=diff)
    emit({"toy": "done", "failures": failures})
    if failures:
        raise SystemExit(1)


# --------------------------------------------------------------------------------------------
# GPU measurements


def timed(fn, repeats: int) -> tuple[float, float]:
    """(ms per call, peak GiB one call allocates on top of what was allocated before it: for a
    forward + backward, outputs, saved tensors, gradients and workspace, not q, k, v, dout)."""
    fn()
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, peak


class Bench:
    def __init__(self, args):
        self.args = args
        self.deadline = _T0 + args.budget_s
        self.dense_ms: dict[int, float] = {}
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.inputs = {}

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def qkvd(self, heads, layout):
        key = (heads, layout.name)
        if key not in self.inputs:
            self.inputs.clear()
            torch.cuda.empty_cache()
            g = torch.Generator(device="cuda").manual_seed(0)
            N = math.prod(layout.grid)
            shape = (1, N, heads, HEAD_DIM)
            # locality: a shared random field plus noise, so the coarse selection is meaningful
            base = torch.randn(shape, device="cuda", generator=g)
            q, k, v = ((base + 0.5 * torch.randn(shape, device="cuda", generator=g))
                       .to(torch.bfloat16) for _ in range(3))
            q = q * 2
            dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
            self.inputs[key] = tuple(layout.to_kernel(t).contiguous() for t in (q, k, v, dout))
        return self.inputs[key]

    def run(self, fn, q, k, v, dout):
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))

        def step():
            out = fn(qr, kr, vr)
            return torch.autograd.grad(out, (qr, kr, vr), dout)

        ms, peak = timed(step, self.args.repeats)
        out = fn(qr, kr, vr)
        grads = torch.autograd.grad(out, (qr, kr, vr), dout)
        return ms, peak, out.detach(), [g_.detach() for g_ in grads]

    def record(self, option, heads, layout, sparsity, ms, peak, **extra):
        width = next((w for w, h in HEADS.items() if h == heads), str(heads))
        dense = self.dense_ms.get(heads)
        emit({"option": option, "width": width, "heads": heads, "sparsity": sparsity,
              "tile": layout.name if layout else "-", "tokens": layout.n if layout else math.prod(GRID),
              "ms_fwd_bwd": round(ms, 3), "x_vs_dense_fa4": round(dense / ms, 2) if dense else None,
              "peak_gib": round(peak, 2), **extra})

    # ---- items

    def dense(self, heads):
        lay = make_layout(GRID, TILE_FOR_BLOCK[128], 128, False)
        q, k, v, dout = self.qkvd(heads, lay)
        rows = torch.arange(0, lay.n, 509, device="cuda")
        ref = reference_rows(q, k, v, rows)
        results = {}
        try:
            from trainer.models.fa4_ops import fa4_attention

            ms, peak, out, grads = self.run(fa4_attention, q, k, v, dout)
            self.dense_ms[heads] = ms
            results["fa4"] = (out, grads)
            self.record("fa4-dense", heads, None, 0.0, ms, peak, rows_rel_err=rel_err(out[:, rows], ref))
        except Exception as e:  # noqa: BLE001
            emit({"option": "fa4-dense", "heads": heads, "failed": repr(e)[:300]})
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, backends in (("sdpa-cudnn", [SDPBackend.CUDNN_ATTENTION]),
                               ("sdpa-flash", [SDPBackend.FLASH_ATTENTION])):
            try:
                def call(q_, k_, v_, backends=backends):
                    with sdpa_kernel(backends):
                        return sdpa_call(q_, k_, v_)

                ms, peak, out, grads = self.run(call, q, k, v, dout)
                if heads not in self.dense_ms:
                    self.dense_ms[heads] = ms  # no FA4: the baseline is SDPA
                results.setdefault("sdpa", (out, grads))
                self.record(name, heads, None, 0.0, ms, peak, rows_rel_err=rel_err(out[:, rows], ref))
            except Exception as e:  # noqa: BLE001
                emit({"option": name, "heads": heads, "failed": repr(e)[:300]})
        self.dense_results = results

    def selection(self, heads, block=128, padded=False):
        lay = make_layout(GRID, TILE_FOR_BLOCK[block], block, padded)
        q, k, v, _ = self.qkvd(heads, lay)
        fa4 = not padded and self.fa4_ok()
        for s in (0.5, 0.9):
            keep = keep_for(s, lay.blocks)
            ms, _ = timed(lambda: build_sparse(q, k, lay, keep, fa4=fa4), 20)
            ms_sel, _ = timed(lambda: select_blocks(q, k, lay, keep), 20)
            ms_direct = None
            if fa4:
                ms_direct, _ = timed(lambda: fa4_tensors_direct(select_blocks(q, k, lay, keep), lay), 20)
                ms_direct = round(ms_direct, 3)
            N = math.prod(GRID)
            x = torch.randn(1, N, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            ms_perm, _ = timed(lambda: lay.from_kernel(lay.to_kernel(x)), 20)
            emit({"selection": lay.name, "heads": heads, "sparsity": s, "keep": keep,
                  "ms_means_scores_topk": round(ms_sel, 3), "ms_with_block_mask": round(ms, 3),
                  "includes_fa4_tensors": fa4,
                  "ms_selection_with_fa4_tensors_direct": ms_direct, "ms_reorder_one_tensor_there_and_back": round(ms_perm, 3)})

    _fa4 = None

    def fa4_ok(self) -> bool:
        if Bench._fa4 is None:
            try:
                from flash_attn.cute import flash_attn_func  # noqa: F401
                from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401
                Bench._fa4 = True
            except Exception as e:  # noqa: BLE001
                emit({"fa4_import_failed": repr(e)[:300]})
                Bench._fa4 = False
        return Bench._fa4

    def sparse(self, kernel, heads, block, padded, sparsities, tile=None):
        lay = make_layout(GRID, tile or TILE_FOR_BLOCK[block], block, padded)
        kopts = None
        if block == 64 and kernel == "flex":  # flex's kernel tiles must divide the sparse block
            kopts = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64,
                     "BLOCK_M2": 64, "BLOCK_N2": 32}
        restore = None
        if block == 64 and kernel != "flex":  # FA4's SM90 backward picks 128-wide key tiles
            import dataclasses

            import flash_attn.cute.interface as fa4i

            restore = fa4i._tile_size_bwd_sm90
            fa4i._tile_size_bwd_sm90 = lambda *a, **kw: dataclasses.replace(
                restore(*a, **kw), m_block_size=64, n_block_size=64, dQ_swapAB=False)
        try:
            self._sparse(kernel, heads, lay, sparsities, kopts)
        finally:
            if restore is not None:
                fa4i._tile_size_bwd_sm90 = restore

    def _sparse(self, kernel, heads, lay, sparsities, kopts):
        q, k, v, dout = self.qkvd(heads, lay)
        padded = lay.padded
        real = lay.valid.to("cuda")
        real_rows = torch.nonzero(real).flatten()
        rows = torch.cat([real_rows[::509], real_rows[-3:]])  # the last rows: the short tail block
        for s in sparsities:
            if self.time_left() < 15:
                emit({"skipped": f"{kernel} {lay.name} h{heads} s={s}", "why": "time budget"})
                return
            keep = keep_for(s, lay.blocks)
            sp = build_sparse(q, k, lay, keep, fa4=kernel == "fa4-sparse")
            if kernel == "fa4-direct":
                sp.fa4_fwd, sp.fa4_bwd = fa4_tensors_direct(sp.selected, lay)
            mask_ok = torch.equal(dense_block_mask(sp.block_mask),
                                  torch.zeros_like(dense_block_mask(sp.block_mask)).scatter_(
                                      -1, sp.selected.long(), True))
            if kernel == "flex":
                def fn(q_, k_, v_, sp=sp):
                    return flex_call(self.flex, q_, k_, v_, sp, kopts)
            else:
                def fn(q_, k_, v_, sp=sp):  # fa4-sparse, fa4-direct
                    return fa4_sparse_call(q_, k_, v_, sp)
            try:
                ms, peak, out, grads = self.run(fn, q, k, v, dout)
            except Exception as e:  # noqa: BLE001
                emit({"option": kernel, "heads": heads, "tile": lay.name, "sparsity": s,
                      "failed": repr(e)[:400]})
                return
            extra = {"keep_blocks": keep, "blocks": lay.blocks, "mask_matches_selection": mask_ok}
            allowed = rows_allowed(sp, lay, rows)
            extra["rows_rel_err_masked_ref"] = rel_err(out[:, rows], reference_rows(q, k, v, rows, allowed))
            if s > 0:
                extra["rows_rel_err_unmasked_ref"] = rel_err(
                    out[:, rows], reference_rows(q, k, v, rows, real.expand_as(allowed)))
            dense = getattr(self, "dense_results", {}).get("fa4") or getattr(
                self, "dense_results", {}).get("sdpa")
            if s == 0.0 and dense is not None and not padded and dense[0].shape == out.shape:
                extra["s0_out_rel_err_vs_dense"] = rel_err(out, dense[0])
                extra["s0_grad_rel_err_vs_dense"] = max(rel_err(a, b) for a, b in zip(grads, dense[1]))
            other = self.last_grads.get((heads, lay.name, s))
            if other is not None:
                extra["grad_rel_err_vs_other_sparse_kernel"] = max(
                    rel_err(a, b) for a, b in zip(grads, other))
            self.last_grads[(heads, lay.name, s)] = grads
            self.record(kernel, heads, lay, s, ms, peak, **extra)
            del out, grads

    last_grads: dict = {}


def main() -> None:
    global _OUT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy", action="store_true", help="CPU check of the layout, selection and masks")
    p.add_argument("--items", default="all", help="comma-separated items to run (see ITEMS)")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting items after this")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None, help="also append the JSON lines here")
    args = p.parse_args()
    _OUT = args.out
    if args.toy:
        toy()
        return
    if not torch.cuda.is_available():
        raise SystemExit("sparse_attention.py measures on a GPU; on CPU run it with --toy")
    emit({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
          "grid": GRID, "tokens": math.prod(GRID), "head_dim": HEAD_DIM})
    b = Bench(args)
    small, big = HEADS["1.3B"], HEADS["14B"]
    ITEMS = {  # in order of priority: a run cut short by --budget-s keeps what matters most
        "dense": lambda: b.dense(small),
        "selection": lambda: b.selection(small),
        "fa4-sparse": lambda: b.sparse("fa4-sparse", small, 128, False, SPARSITIES) if b.fa4_ok() else None,
        "flex": lambda: b.sparse("flex", small, 128, False, SPARSITIES),
        "dense-14b": lambda: b.dense(big),
        "fa4-sparse-14b": lambda: b.sparse("fa4-sparse", big, 128, False, SPARSITIES[1:]) if b.fa4_ok() else None,
        "flex-14b": lambda: b.sparse("flex", big, 128, False, SPARSITIES[1:]),
        "selection-14b": lambda: b.selection(big),
        "flex-padded-128": lambda: b.sparse("flex", small, 128, True, (0.0, 0.9)),
        "flex-64": lambda: b.sparse("flex", small, 64, False, (0.5, 0.9)),
        "flex-padded-64": lambda: b.sparse("flex", small, 64, True, (0.9,)),
        "fa4-sparse-64": lambda: b.sparse("fa4-sparse", small, 64, False, (0.9,)) if b.fa4_ok() else None,
        "fa4-direct": lambda: b.sparse("fa4-direct", small, 128, False, (0.0, 0.9)) if b.fa4_ok() else None,
    }
    chosen = list(ITEMS) if args.items == "all" else args.items.split(",")
    for name in chosen:
        if b.time_left() < 20:
            emit({"skipped": name, "why": "time budget"})
            continue
        t = time.perf_counter()
        try:
            ITEMS[name]()
        except Exception as e:  # noqa: BLE001
            emit({"item": name, "failed": repr(e)[:400]})
        emit({"item": name, "s": round(time.perf_counter() - t, 1)})
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
