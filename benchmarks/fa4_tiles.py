"""FA4's attention at Wan2.1-1.3B's self-attention shape on a Hopper GPU, per tile setting.

Times relay's FA4 operator (trainer/models/fa4_ops.py) forward, and forward plus backward, on
q, k, v [1, 32760, 12, 128] bf16, once with the tile configuration FA4 picks for SM90 and once
for each change below, made by replacing FA4's SM90 tile choice for the run. A setting that
does not compile or launch on the GPU is reported as failed. Prints one JSON line per setting;
the backward's gradients are compared with the default's.

    python benchmarks/fa4_tiles.py

TFLOP/s count the forward as 4 N^2 d heads and the backward as 2.5 times that (FlashAttention's
convention: the backward recomputes the scores).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.models.fa4_ops import fa4_attention  # noqa: E402

SHAPE = (1, 32760, 12, 128)  # batch, video tokens, heads, head_dim of Wan2.1-1.3B at 81x480x832
FORWARD = {"wider key tile (176)": dict(n_block_size=176),
           "key tile 160": dict(n_block_size=160),
           "key tile 192": dict(n_block_size=192),
           "query tile 192, key tile 112, P from shared memory": dict(
               m_block_size=192, n_block_size=112, mma_pv_is_rs=False)}
BACKWARD = {"query tile 64": dict(m_block_size=64, dQ_swapAB=False),
            "query tile 96": dict(m_block_size=96),
            "one P/dS stage": dict(num_stages_PdS=1),
            "one dO stage": dict(num_stages_dO=1),
            "one Q stage": dict(num_stages_Q=1),
            "dK/dV atom layout 1": dict(AtomLayoutNdKV=1)}


def _timed_ms(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def _choosing(default, change):
    """FA4's SM90 tile choice with `change` applied to what it returns (default when None)."""
    if change is None:
        return default
    return lambda *args, **kwargs: dataclasses.replace(default(*args, **kwargs), **change)


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("fa4_tiles.py measures FA4's tile settings for Hopper (SM90): run it on "
                         "an H100 or H200 with flash-attn-4 installed")
    import flash_attn.cute.interface as fa4

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=g)
    batch, tokens, heads, head_dim = SHAPE
    flop = 4 * batch * heads * tokens * tokens * head_dim

    def forward():
        return fa4_attention(q, k, v)

    def forward_backward():
        return torch.autograd.grad(fa4_attention(q, k, v), (q, k, v), dout)

    default_fwd, default_bwd = fa4._tile_size_fwd_sm90, fa4._tile_size_bwd_sm90
    for name, change in {"default": None, **FORWARD}.items():
        fa4._tile_size_fwd_sm90 = _choosing(default_fwd, change)
        try:
            ms = _timed_ms(forward)
            print(json.dumps({"forward": name, "ms": round(ms, 2),
                              "tflops": round(flop / ms / 1e9, 1)}), flush=True)
        except Exception as error:  # a tile FA4 cannot build or launch on this GPU
            print(json.dumps({"forward": name, "failed": str(error).strip()[:200]}), flush=True)
    fa4._tile_size_fwd_sm90 = default_fwd
    forward_ms = _timed_ms(forward)
    reference = None
    for name, change in {"default": None, **BACKWARD}.items():
        fa4._tile_size_bwd_sm90 = _choosing(default_bwd, change)
        try:
            grads = forward_backward()
            reference = reference or grads
            error = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference))
            ms = _timed_ms(forward_backward) - forward_ms
            print(json.dumps({"backward": name, "ms": round(ms, 2),
                              "tflops": round(2.5 * flop / ms / 1e9, 1),
                              "max_grad_difference": error}), flush=True)
        except Exception as error:
            print(json.dumps({"backward": name, "failed": str(error).strip()[:200]}), flush=True)
    fa4._tile_size_bwd_sm90 = default_bwd


if __name__ == "__main__":
    main()
