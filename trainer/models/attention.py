"""Attention for the DiT: each form relay needs, routed to a kernel that computes it exactly.

Layout: q [B, Nq, heads, head_dim], k and v [B, Nk, heads, head_dim], output like q. This is
the layout the projections produce and FlashAttention takes; SDPA and FlexAttention get
transposed views.

Keys are ordered `[structured keys | prefix keys]`. The prefix (the caption, sometimes after
committed chunks) comes last, so caption padding is a per-sample count of used keys,
`key_lengths`, rather than a mask: keys at positions >= key_lengths[b] are padding. The forms:

- full: every query sees every key (no mask reaches any kernel);
- padded: full, but sample b sees only its first key_lengths[b] keys;
- chunked: a `ChunkLayout` says which of the structured (video) keys each query sees
  (block-causal, teacher forcing); every query also sees the prefix keys (within key_lengths);
- varlen: packed sequences with cu_seqlens (`attention_varlen`).

Kernels: "sdpa" (torch SDPA: every form, through dense boolean masks where needed; the
reference, and the only kernel on CPU), "fa4" (FlashAttention 4, `flash_attn.cute`: full,
padded through seqused_k, varlen), "flash_attn" (FlashAttention 2/3: full, varlen) and "flex"
(FlexAttention with a block mask: chunked, skipping the key blocks no query of a query block
sees). `attention_backend` names the kernel to prefer; "auto" prefers the fastest one that
can run here. A form the preferred kernel cannot compute goes to the next one that can (for
chunked on a GPU: flex); each routing decision is logged once. Optional packages are imported
lazily, so a machine without them (a laptop, a login node) still imports this module.

A model builds one `AttentionPlan` per forward pass (the kernel and any mask, prepared once)
and every block runs it with `attend(plan, q, k, v)`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from trainer.models.fa4_ops import fa4_attention, fa4_varlen_attention
from trainer.models.backends import ATTENTION_BACKENDS

log = logging.getLogger("relay")

__all__ = [
    "BACKENDS",
    "AttentionPlan",
    "ChunkLayout",
    "attend",
    "attention_varlen",
    "available_kernels",
    "block_causal_mask",
    "chunk_ids",
    "choose_kernel",
    "known_backends",
    "PackedKeys",
    "plan_attention",
    "packed_keys",
    "plan_packed",
    "teacher_forcing_mask",
]

BACKENDS = ATTENTION_BACKENDS
# What each nameable backend computes; "sdpa" computes everything.
_FORMS = {
    "sdpa": {"full", "padded", "chunked", "varlen"},
    "fa4": {"full", "padded", "varlen"},
    "flash_attn": {"full", "varlen"},
}
# Fastest first, as measured on an H200 (docs/performance.md): FA4 1.18x cuDNN SDPA on relay's
# video attention; flex only where a mask is unavoidable.
_SPEED_ORDER = {"full": ("fa4", "flash_attn", "sdpa"), "padded": ("fa4", "flex", "sdpa"),
                "chunked": ("flex", "sdpa"), "varlen": ("fa4", "flash_attn", "sdpa")}
# kernel -> (module that must import, attribute of the full-attention function)
_PACKAGES = {"fa4": ("flash_attn.cute", "flash_attn_func"),
             "flash_attn": ("flash_attn", "flash_attn_func")}
_IMPORT_ERRORS: dict[str, str] = {}


def known_backends() -> list[str]:
    """Every `attention_backend` value the model accepts, available here or not."""
    return list(BACKENDS)


# --------------------------------------------------------------------------------------------
# the structure of chunked attention


def chunk_ids(num_frames: int, tokens_per_frame: int, chunk_size: int) -> torch.Tensor:
    """Chunk index of each video token (frame-major order): long [num_frames * tokens_per_frame].

    The last chunk holds the remaining frames when chunk_size does not divide num_frames.
    """
    frames = torch.arange(num_frames).repeat_interleave(tokens_per_frame)
    return frames // chunk_size


def _check_layout(num_frames: int, tokens_per_frame: int, chunk_size: int,
                  window_chunks: int | None) -> None:
    for name, value in (("num_frames", num_frames), ("tokens_per_frame", tokens_per_frame),
                        ("chunk_size", chunk_size)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if window_chunks is not None and (int(window_chunks) != window_chunks or window_chunks < 0):
        raise ValueError(f"window_chunks must be None or an integer >= 0, got {window_chunks!r}")


def _allowed(q_chunk, q_noisy, k_chunk, k_noisy, window: int | None):
    """The chunk rule, elementwise on broadcastable index tensors (docs/algorithms.md, "Attention mask").

    A clean key is seen by a clean query of the same or a later chunk and by a noisy query of a
    strictly later chunk, within `window` chunks; a noisy key only by noisy queries of its own
    chunk. Block-causal attention is the rule with every token clean. Written once, for the
    dense masks and for FlexAttention's mask_mod, so the two cannot disagree.
    """
    clean_key = ~k_noisy & (k_chunk <= q_chunk - q_noisy.to(q_chunk.dtype))
    if window is not None:
        clean_key = clean_key & (k_chunk >= q_chunk - window)
    return clean_key | (k_noisy & q_noisy & (k_chunk == q_chunk))


def block_causal_mask(num_frames: int, tokens_per_frame: int, chunk_size: int,
                      window_chunks: int | None = None) -> torch.Tensor:
    """Block-causal mask over video tokens: bool [V, V], True = the query may see the key.

    V = num_frames * tokens_per_frame, chunks of chunk_size frames (the last may be shorter).
    A query in chunk i sees keys in chunks j with max(0, i - window_chunks) <= j <= i (no lower
    bound when window_chunks is None). Raises ValueError for non-integer or out-of-range sizes.
    """
    _check_layout(num_frames, tokens_per_frame, chunk_size, window_chunks)
    ch = chunk_ids(num_frames, tokens_per_frame, chunk_size)
    clean = torch.zeros_like(ch, dtype=torch.bool)
    return _allowed(ch[:, None], clean[:, None], ch[None, :], clean[None, :], window_chunks)


def teacher_forcing_mask(num_frames: int, tokens_per_frame: int, chunk_size: int,
                         window_chunks: int | None = None) -> torch.Tensor:
    """Teacher-forcing mask over `[clean_0..clean_{M-1} | noisy_0..noisy_{M-1}]`: bool [2V, 2V].

    True = allowed (docs/algorithms.md, "Attention mask"): clean chunk i sees clean chunks max(0, i -
    window_chunks)..i; noisy chunk i sees its own noisy chunk and clean chunks
    max(0, i - window_chunks)..i-1 (never clean chunk i or later); clean never sees noisy.
    Raises ValueError for non-integer or out-of-range sizes.
    """
    _check_layout(num_frames, tokens_per_frame, chunk_size, window_chunks)
    ch = chunk_ids(num_frames, tokens_per_frame, chunk_size).repeat(2)
    noisy = torch.arange(ch.numel()) >= ch.numel() // 2
    return _allowed(ch[:, None], noisy[:, None], ch[None, :], noisy[None, :], window_chunks)


@dataclass(frozen=True)
class ChunkLayout:
    """The structure of chunked attention over `[video keys | prefix keys]`.

    kind "block_causal": queries and structured keys are the V video tokens; "teacher_forcing":
    both are `[clean | noisy]`, 2V tokens. num_frames counts patch-frames and chunk_size is in
    patch-frames. The num_prefix keys after the structured ones are seen by every query.
    """

    kind: str
    num_frames: int
    tokens_per_frame: int
    chunk_size: int
    window_chunks: int | None
    num_prefix: int

    def __post_init__(self) -> None:
        if self.kind not in ("block_causal", "teacher_forcing"):
            raise ValueError(f"ChunkLayout kind must be block_causal or teacher_forcing, got {self.kind!r}")
        _check_layout(self.num_frames, self.tokens_per_frame, self.chunk_size, self.window_chunks)

    @property
    def num_queries(self) -> int:
        video = self.num_frames * self.tokens_per_frame
        return 2 * video if self.kind == "teacher_forcing" else video

    @property
    def num_keys(self) -> int:
        return self.num_queries + self.num_prefix

    def token_ids(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk index long [num_keys], noisy bool [num_keys]) of every key position.

        Queries are the first num_queries positions. Prefix positions get chunk 0, clean:
        the rule never reads them (prefix keys are always visible).
        """
        ch = chunk_ids(self.num_frames, self.tokens_per_frame, self.chunk_size)
        noisy = torch.zeros_like(ch, dtype=torch.bool)
        if self.kind == "teacher_forcing":
            ch, noisy = ch.repeat(2), torch.cat([noisy, ~noisy])
        pad = self.num_prefix
        ch = torch.cat([ch, ch.new_zeros(pad)])
        noisy = torch.cat([noisy, noisy.new_zeros(pad)])
        return ch.to(device), noisy.to(device)

    def dense(self, device=None) -> torch.Tensor:
        """bool [num_queries, num_keys], True = allowed."""
        build = teacher_forcing_mask if self.kind == "teacher_forcing" else block_causal_mask
        video = build(self.num_frames, self.tokens_per_frame, self.chunk_size, self.window_chunks)
        prefix = torch.ones(video.shape[0], self.num_prefix, dtype=torch.bool)
        return torch.cat([video, prefix], dim=1).to(device)

    def mask_mod(self, key_lengths: torch.Tensor | None, device):
        """FlexAttention's mask_mod(b, h, q_idx, kv_idx) for this layout and key padding."""
        ch, noisy = self.token_ids(device)
        structured, window = self.num_queries, self.window_chunks

        def mask_mod(b, h, q_idx, kv_idx):
            seen = (kv_idx >= structured) | _allowed(ch[q_idx], noisy[q_idx], ch[kv_idx],
                                                     noisy[kv_idx], window)
            if key_lengths is not None:
                seen = seen & (kv_idx < key_lengths[b])
            return seen

        return mask_mod


@functools.lru_cache(maxsize=16)
def _dense_layout_mask(layout: ChunkLayout, device: torch.device) -> torch.Tensor:
    return layout.dense(device)


# --------------------------------------------------------------------------------------------
# kernels


def _load(kernel: str):
    """The package module of an optional kernel, or None (the reason kept for the error)."""
    module_name, function = _PACKAGES[kernel]
    if kernel in _IMPORT_ERRORS:
        return None
    try:
        module = importlib.import_module(module_name)
        # FA4 alone installs `flash_attn/cute/`, which makes `flash_attn` an importable
        # namespace package without FlashAttention 2's functions.
        getattr(module, function)
        return module
    except Exception as exc:  # a broken CUDA build raises more than ImportError
        _IMPORT_ERRORS[kernel] = f"{type(exc).__name__}: {exc}"
        return None


def available_kernels() -> list[str]:
    """The kernels whose packages import in this process ("sdpa" and "flex" always)."""
    return ["sdpa", "flex"] + [k for k in _PACKAGES if _load(k) is not None]


def _runs_here(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `kernel` can run on these inputs (package present, GPU generation, dtype)."""
    if kernel == "sdpa":
        return True
    if device.type != "cuda":
        return False
    if kernel == "flex":
        return True
    major, _ = torch.cuda.get_device_capability(device)
    half = dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0
    if kernel == "fa4":
        # FA4's CuTe kernels exist for Hopper (sm90, head_dim up to 256) and Blackwell (128).
        limit = 256 if major == 9 else 128
        ok = half and major in (9, 10, 11) and head_dim <= limit
    else:
        ok = half and major >= 8 and head_dim <= 256
    return ok and _load(kernel) is not None


def choose_kernel(backend: str, form: str, runs_here) -> str:
    """The kernel for `form` given the preferred `backend` and `runs_here(kernel) -> bool`.

    An explicit backend is used for every form it computes and can run here; otherwise, and
    for "auto", the fastest kernel that computes the form and runs here. Raises ValueError for
    an unknown backend or form; ImportError when an explicitly named backend's package does
    not import (a config that asks for FA4 on a machine without it is a mistake, not a hint).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; known: {', '.join(BACKENDS)}")
    if form not in _SPEED_ORDER:
        raise ValueError(f"unknown attention form {form!r}")
    if backend in _PACKAGES and _load(backend) is None:
        package = _PACKAGES[backend][0]
        raise ImportError(
            f"attention backend {backend!r} needs the package {package!r}, which does not import "
            f"here ({_IMPORT_ERRORS[backend]}); install it (pip extra 'gpu') or set "
            "attention_backend to 'auto' or 'sdpa'")
    if backend != "auto" and form in _FORMS[backend] and runs_here(backend):
        return backend  # "sdpa" computes every form, so it stays the reference everywhere
    return next(k for k in _SPEED_ORDER[form] if runs_here(k))


@functools.lru_cache(maxsize=None)
def _log_route(backend: str, form: str, kernel: str, where: str) -> None:
    log.info("attention: %s attention -> %s (attention_backend=%s, %s)", form, kernel, backend, where)


def _sdpa(q, k, v, mask=None):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask)
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # flex_attention is only fast compiled; compiled once here, or inlined into a compiled block.
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    # Inside a compiled block flex is traced into the block's graph; eager GPU code needs the
    # compiled kernel; eager flex on a CPU is the (slow) reference the tests use.
    eager_gpu = q.is_cuda and not torch.compiler.is_compiling()
    fn = _compiled_flex() if eager_gpu else flex_attention
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
    return out.transpose(1, 2)


def _first(out):
    # FlashAttention releases differ: some return (out, lse), some out only.
    return out[0] if isinstance(out, tuple) else out


# FlashAttention 2/3 is opaque to torch.compile: a compiled block breaks its graph around it
# rather than tracing into C++ extension code. FA4 runs as a registered operator
# (trainer/models/fa4_ops.py), which compiled graphs and selective checkpointing can see.
@torch.compiler.disable
def _flash_attn(q, k, v):
    return _first(_load("flash_attn").flash_attn_func(q, k, v))


# --------------------------------------------------------------------------------------------
# plans


class AttentionPlan(NamedTuple):
    """One forward pass's attention: the kernel and what it needs, prepared once.

    A NamedTuple so torch.compile treats it as plain data (a tuple of tensors and constants).
    Run it with `attend(plan, q, k, v)`.
    """

    kernel: str
    key_lengths: torch.Tensor | None  # int32 [B] (fa4) or None
    # sdpa: bool broadcastable to [B, heads, Nq, Nk]; flex: BlockMask; fa4 / flash_attn over
    # packed sequences: PackedKeys; sparse (video attention over chosen key blocks):
    # trainer.models.sparse_attention.SparseVideo; else None
    mask: Any


class PackedKeys(NamedTuple):
    """Packed sequences for a varlen kernel: the keys each sequence uses, gathered into runs.

    Queries are already in runs (sequence by sequence); keys may be in any order (the video
    stream's keys are [all video | all captions]), so `key_index` picks every used key of
    sequence 0, then of sequence 1, ... Padding keys are left out, not masked.
    """

    key_index: torch.Tensor  # long [used keys]
    cu_seqlens_q: torch.Tensor  # int32 [sequences + 1]
    cu_seqlens_k: torch.Tensor  # int32 [sequences + 1]
    max_seqlen_q: int
    max_seqlen_k: int


def attend(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [B, Nq, heads, head_dim] over k, v [B, Nk, heads, head_dim] as
    `plan` says; returns [B, Nq, heads, head_dim]."""
    if isinstance(plan.mask, PackedKeys):  # one batch row of packed sequences
        packed = plan.mask
        k, v = k[0, packed.key_index], v[0, packed.key_index]
        run = _VARLEN_KERNELS[plan.kernel]
        return run(q[0], k, v, packed.cu_seqlens_q, packed.cu_seqlens_k, packed.max_seqlen_q,
                   packed.max_seqlen_k)[None]
    if plan.kernel == "sparse":  # sparse video attention (trainer.models.sparse_attention)
        return plan.mask.attend(q, k, v)
    if plan.kernel == "sdpa":
        return _sdpa(q, k, v, plan.mask)
    if plan.kernel == "flex":
        return _flex(q, k, v, plan.mask)
    if plan.kernel == "fa4":
        return fa4_attention(q, k, v, plan.key_lengths)
    return _flash_attn(q, k, v)


def _sdpa_mask(layout: ChunkLayout | None, key_lengths: torch.Tensor | None, num_keys: int,
               device) -> torch.Tensor | None:
    mask = None if layout is None else _dense_layout_mask(layout, torch.device(device))
    if key_lengths is not None:
        keys = torch.arange(num_keys, device=device)[None, :] < key_lengths[:, None]  # [B, Nk]
        keys = keys[:, None, None, :]
        mask = keys if mask is None else mask & keys
    if mask is not None and mask.ndim < 4:
        # some SDPA kernels broadcast only over leading singleton dims that exist
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    return mask


def _flex_block_mask(layout: ChunkLayout | None, key_lengths: torch.Tensor | None,
                     num_queries: int, num_keys: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    if layout is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx < key_lengths[b]
    else:
        mask_mod = layout.mask_mod(key_lengths, device)
    batch = None if key_lengths is None else key_lengths.shape[0]
    # _compile evaluates the rule block by block: the dense grid of a production teacher-forcing
    # step (65k x 66k) would not fit.
    return create_block_mask(mask_mod, batch, None, num_queries, num_keys, device=device,
                             _compile=torch.device(device).type == "cuda")


def plan_attention(backend: str, *, num_queries: int, num_keys: int, head_dim: int,
                   dtype: torch.dtype, device, key_lengths: torch.Tensor | None = None,
                   layout: ChunkLayout | None = None) -> AttentionPlan:
    """The plan for attention of num_queries queries over num_keys keys (q's dtype `dtype`).

    key_lengths: int [B] keys used per sample (padding last), or None for no padding. layout:
    the chunk structure of the first layout.num_queries keys, or None. Raises ValueError for
    an unknown backend, a layout whose sizes disagree with num_queries / num_keys, or key
    lengths out of range; ImportError as `choose_kernel`.
    """
    device = torch.device(device)
    if layout is not None and (layout.num_queries != num_queries or layout.num_keys > num_keys):
        raise ValueError(f"chunk layout for {layout.num_queries} queries over {layout.num_keys} keys "
                         f"does not fit {num_queries} queries over {num_keys} keys")
    form = "chunked" if layout is not None else "padded" if key_lengths is not None else "full"
    kernel = choose_kernel(backend, form, lambda k: _runs_here(k, device, dtype, head_dim))
    _log_route(backend, form, kernel, f"{device.type}, {str(dtype).removeprefix('torch.')}")
    if key_lengths is not None:
        key_lengths = key_lengths.to(device=device, dtype=torch.int32)
    if kernel == "sdpa":
        return AttentionPlan("sdpa", None, _sdpa_mask(layout, key_lengths, num_keys, device))
    if kernel == "flex":
        return AttentionPlan("flex", None, _flex_block_mask(layout, key_lengths, num_queries,
                                                            num_keys, device))
    return AttentionPlan(kernel, key_lengths, None)


# --------------------------------------------------------------------------------------------
# packed sequences


def plan_packed(backend: str, query_ids: torch.Tensor, key_ids: torch.Tensor,
                key_used: torch.Tensor, *, head_dim: int, dtype: torch.dtype) -> AttentionPlan | None:
    """The varlen plan for one batch row of packed sequences, or None where only SDPA runs
    (the caller then builds its dense block-diagonal mask).

    query_ids: long [Nq], the sequence of each query, non-decreasing; key_ids: long [Nk], the
    sequence of each key, in any order; key_used: bool [Nk], False for padding keys.
    """
    device = query_ids.device
    kernel = choose_kernel(backend, "varlen", lambda k: _runs_here(k, device, dtype, head_dim))
    _log_route(backend, "packed", kernel, f"{device.type}, {str(dtype).removeprefix('torch.')}")
    if kernel == "sdpa":
        return None
    return AttentionPlan(kernel, None, packed_keys(query_ids, key_ids, key_used))


def packed_keys(query_ids: torch.Tensor, key_ids: torch.Tensor, key_used: torch.Tensor) -> PackedKeys:
    """The runs of queries and used keys of packed sequences (arguments as `plan_packed`)."""
    used = key_used.nonzero()[:, 0]
    key_index = used[torch.argsort(key_ids[used], stable=True)]
    sequences = int(query_ids.max()) + 1
    q_counts = torch.bincount(query_ids, minlength=sequences)
    k_counts = torch.bincount(key_ids[used], minlength=sequences)

    def offsets(counts):
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)

    return PackedKeys(key_index, offsets(q_counts), offsets(k_counts), int(q_counts.max()),
                      int(k_counts.max()))


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     backend: str = "auto") -> torch.Tensor:
    """Attention within packed sequences: sequence i's queries q[cu_q[i]:cu_q[i+1]] see only
    its keys k[cu_k[i]:cu_k[i+1]].

    q: [total_q, heads, head_dim]; k, v: [total_k, heads, head_dim]; cu_seqlens_*: int32
    [num_sequences + 1], starting at 0. Returns [total_q, heads, head_dim]. SDPA runs one call
    per sequence (exact, slow: for CPU and tests). Raises like `choose_kernel`.
    """
    kernel = choose_kernel(backend, "varlen",
                           lambda name: _runs_here(name, q.device, q.dtype, q.shape[-1]))
    _log_route(backend, "varlen", kernel, f"{q.device.type}, {str(q.dtype).removeprefix('torch.')}")
    return _VARLEN_KERNELS[kernel](q, k, v, cu_seqlens_q.to(torch.int32),
                                   cu_seqlens_k.to(torch.int32), max_seqlen_q, max_seqlen_k)


def _sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k):
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    return torch.cat([_sdpa(q[None, a:b], k[None, c:d], v[None, c:d])[0]
                      for a, b, c, d in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:])])


@torch.compiler.disable
def _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k):
    return _first(_load("flash_attn").flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k))


_VARLEN_KERNELS = {"sdpa": _sdpa_varlen, "fa4": fa4_varlen_attention, "flash_attn": _flash_attn_varlen}
