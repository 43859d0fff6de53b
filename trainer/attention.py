"""Attention backends behind one call, and the boolean masks the DiT's modes need.

`attention(q, k, v, mask, backend)` is the only entry point the model uses, so swapping the
kernel (torch SDPA here and on CPU; FlashAttention 2 / FlashAttention 4 on GPUs) is a config
value, not a code change. Optional backends are imported lazily: a machine without their
packages (a laptop, a login node) can still import this module and use "sdpa".

Masks are boolean, True = the query may attend to the key, over the token order
`[prefix (text) tokens | video tokens]` with video tokens frame-major. They are pure functions
of the shape, so callers build them once per shape and cache them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "attention",
    "available_backends",
    "backend_supports_mask",
    "known_backends",
    "register_backend",
    "block_causal_mask",
    "teacher_forcing_mask",
    "chunk_ids",
]

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class _Backend:
    fn: AttentionFn
    supports_mask: bool


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _flash_layout(fn):
    """Adapts a FlashAttention-style kernel ([B, N, heads, head_dim] in and out) to ours."""

    def run(q, k, v, mask):
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        # FA4 releases differ: some return (out, lse), some out only.
        if isinstance(out, tuple):
            out = out[0]
        return out.transpose(1, 2)

    return run


# name -> (module that must import, attribute holding the kernel)
_OPTIONAL = {
    "flash_attn": ("flash_attn", "flash_attn_func"),
    "fa4": ("flash_attn.cute", "flash_attn_func"),
}
_REGISTRY: dict[str, _Backend] = {"sdpa": _Backend(_sdpa, supports_mask=True)}
_IMPORT_ERRORS: dict[str, str] = {}


def register_backend(name: str, fn: AttentionFn, supports_mask: bool) -> None:
    """Registers `fn(q, k, v, mask) -> out` under `name` ([B, heads, N, head_dim] layout).

    A backend with supports_mask=False is only called with mask=None; `attention` raises
    ValueError for it otherwise. Re-registering a name replaces it.
    """
    _REGISTRY[name] = _Backend(fn, supports_mask)


def _try_load(name: str) -> None:
    """Registers optional backend `name` if its package imports; remembers why not otherwise."""
    if name in _REGISTRY or name in _IMPORT_ERRORS:
        return
    module_name, attr = _OPTIONAL[name]
    try:
        kernel = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # a broken CUDA build raises more than ImportError
        _IMPORT_ERRORS[name] = f"{type(exc).__name__}: {exc}"
        return
    register_backend(name, _flash_layout(kernel), supports_mask=False)


def known_backends() -> list[str]:
    """Every backend name `attention` accepts, available here or not."""
    return sorted(set(_REGISTRY) | set(_OPTIONAL))


def backend_supports_mask(name: str) -> bool:
    """Whether backend `name` accepts a mask (optional FlashAttention backends do not).

    Answers without importing anything, so a login node can validate a config.
    Raises ValueError for an unknown name.
    """
    if name in _REGISTRY:
        return _REGISTRY[name].supports_mask
    if name in _OPTIONAL:
        return False
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(known_backends())}")


def available_backends() -> list[str]:
    """The backend names usable in this process (always includes "sdpa")."""
    for name in _OPTIONAL:
        _try_load(name)
    return sorted(_REGISTRY)


def _get_backend(name: str) -> _Backend:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name not in _OPTIONAL:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(known_backends())}")
    _try_load(name)
    if name not in _REGISTRY:
        package = _OPTIONAL[name][0]
        raise ImportError(
            f"attention backend {name!r} needs the package {package!r}, which does not import here "
            f"({_IMPORT_ERRORS[name]}); install it (pip extra 'gpu') or set attention_backend='sdpa'"
        )
    return _REGISTRY[name]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Softmax attention of q over (k, v) with the chosen backend.

    q: [B, heads, Nq, head_dim]; k, v: [B, heads, Nk, head_dim]; mask: bool, broadcastable to
    [B, heads, Nq, Nk], True = may attend, or None for full attention. Every query row must allow
    at least one key (a fully masked row gives NaN with SDPA).
    Returns [B, heads, Nq, head_dim].
    Raises ValueError for an unknown backend or a mask given to a backend that supports only
    mask=None (flash_attn, fa4); ImportError naming the package when the backend's package is
    missing.
    """
    chosen = _get_backend(backend)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"attention mask must be bool (True = may attend), got {mask.dtype}")
        if not chosen.supports_mask:
            raise ValueError(
                f"attention backend {backend!r} supports only mask=None; masked attention "
                "(block-causal, teacher forcing, padded text) needs backend='sdpa'"
            )
        if mask.ndim < 4:
            # some SDPA kernels broadcast only over leading singleton dims that exist
            mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    return chosen.fn(q, k, v, mask)


# --------------------------------------------------------------------------------------------
# masks


def _check_layout(num_frames: int, tokens_per_frame: int, chunk_size: int, num_prefix_tokens: int,
                  window_chunks: int | None) -> None:
    for name, value, low in (("num_frames", num_frames, 1), ("tokens_per_frame", tokens_per_frame, 1),
                             ("chunk_size", chunk_size, 1), ("num_prefix_tokens", num_prefix_tokens, 0)):
        if int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if window_chunks is not None and (int(window_chunks) != window_chunks or window_chunks < 0):
        raise ValueError(f"window_chunks must be None or an integer >= 0, got {window_chunks!r}")


def chunk_ids(num_frames: int, tokens_per_frame: int, chunk_size: int) -> torch.Tensor:
    """Chunk index of each video token (frame-major order): long [num_frames * tokens_per_frame].

    The last chunk holds the remaining frames when chunk_size does not divide num_frames.
    """
    frames = torch.arange(num_frames).repeat_interleave(tokens_per_frame)
    return frames // chunk_size


def _causal_window(q_chunk: torch.Tensor, k_chunk: torch.Tensor, window_chunks: int | None,
                   strict: bool) -> torch.Tensor:
    q = q_chunk[:, None]
    k = k_chunk[None, :]
    allowed = k < q if strict else k <= q
    if window_chunks is not None:
        allowed &= k >= q - window_chunks
    return allowed


def _with_prefix(video_block: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """Adds prefix rows/columns: everyone sees the prefix, the prefix sees only itself.

    Keeping prefix (text) states independent of the video is what lets a KV cache compute the
    text K/V once per caption.
    """
    p = num_prefix_tokens
    n = video_block.shape[0]
    mask = torch.zeros(p + n, p + n, dtype=torch.bool)
    mask[:, :p] = True
    mask[p:, p:] = video_block
    return mask


def block_causal_mask(
    num_frames: int,
    tokens_per_frame: int,
    chunk_size: int,
    num_prefix_tokens: int = 0,
    window_chunks: int | None = None,
) -> torch.Tensor:
    """Block-causal mask over `[prefix | video]`: bool [P + V, P + V], True = allowed.

    V = num_frames * tokens_per_frame, chunks of chunk_size frames (the last may be shorter).
    A video query in chunk i sees video keys in chunks j with max(0, i - window_chunks) <= j <= i
    (no lower bound when window_chunks is None), and every prefix key. Prefix queries see only
    prefix keys. Raises ValueError for non-integer or out-of-range sizes.
    """
    _check_layout(num_frames, tokens_per_frame, chunk_size, num_prefix_tokens, window_chunks)
    ch = chunk_ids(num_frames, tokens_per_frame, chunk_size)
    return _with_prefix(_causal_window(ch, ch, window_chunks, strict=False), num_prefix_tokens)


def teacher_forcing_mask(
    num_frames: int,
    tokens_per_frame: int,
    chunk_size: int,
    num_prefix_tokens: int = 0,
    window_chunks: int | None = None,
) -> torch.Tensor:
    """Teacher-forcing mask over `[prefix | clean_0..clean_{M-1} | noisy_0..noisy_{M-1}]`.

    Returns bool [P + 2V, P + 2V], True = allowed (ALGORITHMS.md §5.2): the diagonal; clean
    chunk i sees clean chunks max(0, i - window_chunks)..i; noisy chunk i sees its own noisy
    chunk and clean chunks max(0, i - window_chunks)..i-1 (never clean chunk i or later); clean
    never sees noisy. Every query sees the prefix; prefix queries see only the prefix.
    Raises ValueError for non-integer or out-of-range sizes.
    """
    _check_layout(num_frames, tokens_per_frame, chunk_size, num_prefix_tokens, window_chunks)
    ch = chunk_ids(num_frames, tokens_per_frame, chunk_size)
    v = ch.numel()
    video = torch.zeros(2 * v, 2 * v, dtype=torch.bool)
    video[:v, :v] = _causal_window(ch, ch, window_chunks, strict=False)
    video[v:, v:] = ch[:, None] == ch[None, :]
    video[v:, :v] = _causal_window(ch, ch, window_chunks, strict=True)
    video |= torch.eye(2 * v, dtype=torch.bool)
    return _with_prefix(video, num_prefix_tokens)
