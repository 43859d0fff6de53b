"""Every attention kernel relay routes to, against float32 softmax attention, on the GPU."""

import pytest
import torch

from trainer.models import attention as attn
from trainer.models.attention import AttentionPlan, ChunkLayout, attend, attention_varlen, plan_attention

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def _runs(kernel, head_dim=128):
    return attn._runs_here(kernel, DEVICE, torch.bfloat16, head_dim)


def _inputs(batch, nq, nk, heads=4, head_dim=128, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(batch, n, heads, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=g)
            for n in (nq, nk, nk)]


def _reference(q, k, v, allowed=None):
    """float32 softmax attention; allowed: bool [B or 1, Nq, Nk] or None."""
    q, k, v = (t.float() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _check(plan, q, k, v, allowed=None, tol=1e-2):
    """Output and input gradients of the plan against the float32 reference."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    refs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out, ref = attend(plan, *leaves), _reference(*refs, allowed)
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    assert _rel(out, ref) < tol, ("out", _rel(out, ref))
    for name, a, b in zip("qkv", leaves, refs):
        assert _rel(a.grad, b.grad) < 2 * tol, (name, _rel(a.grad, b.grad))


@pytest.mark.parametrize("kernel", ["sdpa", "fa4", "flash_attn", "flex"])
def test_full_attention_kernels_match_float32(kernel):
    if not _runs(kernel):
        pytest.skip(f"{kernel} does not run here")
    q, k, v = _inputs(2, 300, 340)
    mask = None
    if kernel == "flex":
        mask = attn._flex_block_mask(None, torch.full((2,), 340, device=DEVICE), 300, 340, DEVICE)
    _check(AttentionPlan(kernel, None, mask), q, k, v)


@pytest.mark.parametrize("kernel", ["sdpa", "fa4", "flex"])
def test_padded_keys_are_ignored_by_every_kernel(kernel):
    if not _runs(kernel):
        pytest.skip(f"{kernel} does not run here")
    q, k, v = _inputs(2, 300, 340)
    lengths = torch.tensor([340, 301], device=DEVICE)
    if kernel == "flex":  # no backend name: auto routes padded attention to fa4 where it runs
        plan = AttentionPlan("flex", None, attn._flex_block_mask(None, lengths, 300, 340, DEVICE))
    else:
        plan = plan_attention(kernel, num_queries=300, num_keys=340, head_dim=128,
                              dtype=torch.bfloat16, device=DEVICE, key_lengths=lengths)
    assert plan.kernel == kernel
    # Poison the allocator: a kernel that leaves padded rows of dK/dV unwritten returns this.
    torch.full((64 << 20,), float("nan"), device=DEVICE)
    allowed = (torch.arange(340, device=DEVICE) < lengths[:, None])[:, None, :]
    _check(plan, q, k, v, allowed)


# One query and key count for all (384 over 424), so flex compiles its kernel once per padding.
LAYOUTS = [ChunkLayout("block_causal", 6, 64, 2, None, 40), ChunkLayout("block_causal", 6, 64, 2, 1, 40),
           ChunkLayout("teacher_forcing", 6, 32, 2, None, 40),
           ChunkLayout("teacher_forcing", 6, 32, 1, 2, 40)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.kind}-w{l.window_chunks}")
@pytest.mark.parametrize("padded", [False, True])
def test_chunked_attention_through_flex_matches_the_dense_mask(layout, padded):
    if not _runs("flex"):
        pytest.skip("flex does not run here")
    nq, nk = layout.num_queries, layout.num_keys
    lengths = torch.tensor([nk, nk - 7], device=DEVICE) if padded else None
    plan = plan_attention("auto", num_queries=nq, num_keys=nk, head_dim=128, dtype=torch.bfloat16,
                          device=DEVICE, key_lengths=lengths, layout=layout)
    assert plan.kernel == "flex"
    allowed = layout.dense(DEVICE)[None]
    if padded:
        allowed = allowed & (torch.arange(nk, device=DEVICE) < lengths[:, None])[:, None, :]
    _check(plan, *_inputs(2, nq, nk), allowed)


@pytest.mark.parametrize("kernel", ["sdpa", "fa4", "flash_attn"])
def test_varlen_keeps_packed_sequences_apart(kernel):
    if not _runs(kernel):
        pytest.skip(f"{kernel} does not run here")
    lengths_q, lengths_k = [130, 257, 64], [130 + 20, 257 + 20, 64 + 20]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(sum(lengths_q), 4, 128, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lengths_k), 4, 128, device=DEVICE, dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    cu_q = torch.tensor([0, 130, 387, 451], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 150, 427, 511], device=DEVICE, dtype=torch.int32)
    out = attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), backend=kernel)
    seq_q = torch.repeat_interleave(torch.arange(3, device=DEVICE), torch.tensor(lengths_q, device=DEVICE))
    seq_k = torch.repeat_interleave(torch.arange(3, device=DEVICE), torch.tensor(lengths_k, device=DEVICE))
    ref = _reference(q[None], k[None], v[None], (seq_q[:, None] == seq_k[None, :])[None])[0]
    assert _rel(out, ref) < 1e-2


def test_auto_takes_fa4_for_full_attention_where_it_runs():
    plan = plan_attention("auto", num_queries=64, num_keys=80, head_dim=128, dtype=torch.bfloat16,
                          device=DEVICE)
    assert plan.kernel == ("fa4" if _runs("fa4") else "flash_attn" if _runs("flash_attn") else "sdpa")
    assert plan.mask is None


def _fa4_or_skip():
    if not _runs("fa4"):
        pytest.skip("FA4 does not run here")


@pytest.mark.parametrize("form", ["full", "padded", "packed"])
def test_fa4_operator_passes_torch_opcheck(form):
    # The registered operator's schema, fake (meta) kernel and autograd formula agree with its
    # real kernel: what torch.compile and selective checkpointing rely on.
    _fa4_or_skip()
    q, k, v = (t.requires_grad_() for t in _inputs(2, 128, 192))
    cu = torch.tensor([0, 100, 256], device=DEVICE, dtype=torch.int32)
    args = {"full": (q, k, v, None, None, None, 0, 0),
            "padded": (q, k, v, torch.tensor([192, 150], device=DEVICE, dtype=torch.int32), None, None, 0, 0),
            "packed": (q.detach().reshape(256, 4, 128).requires_grad_(),
                       k.detach()[:, :128].reshape(256, 4, 128).requires_grad_(),
                       v.detach()[:, :128].reshape(256, 4, 128).requires_grad_(), None, cu, cu, 156, 156)}
    torch.library.opcheck(torch.ops.relay.fa4_forward.default, args[form])


def test_fa4_leaves_a_compiled_graph_whole():
    _fa4_or_skip()
    plan = plan_attention("fa4", num_queries=128, num_keys=192, head_dim=128, dtype=torch.bfloat16,
                          device=DEVICE)

    def around(q, k, v):
        return (attend(plan, q * 2, k, v) + 1).sum()

    explained = torch._dynamo.explain(around)(*_inputs(2, 128, 192))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("kernel", ["sdpa", "fa4", "flash_attn"])
def test_varlen_gradients_match_float32(kernel):
    if not _runs(kernel):
        pytest.skip(f"{kernel} does not run here")
    lengths_q, lengths_k = [130, 257], [150, 277]
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn(sum(lengths_q), 4, 128, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lengths_k), 4, 128, device=DEVICE, dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    cu_q = torch.tensor([0, 130, 387], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 150, 427], device=DEVICE, dtype=torch.int32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    refs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = attention_varlen(*leaves, cu_q, cu_k, 257, 277, backend=kernel)
    seq_q = torch.repeat_interleave(torch.arange(2, device=DEVICE), torch.tensor(lengths_q, device=DEVICE))
    seq_k = torch.repeat_interleave(torch.arange(2, device=DEVICE), torch.tensor(lengths_k, device=DEVICE))
    ref = _reference(*(t[None] for t in refs), (seq_q[:, None] == seq_k[None, :])[None])[0]
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    assert _rel(out, ref) < 1e-2
    for name, a, b in zip("qkv", leaves, refs):
        assert _rel(a.grad, b.grad) < 2e-2, (name, _rel(a.grad, b.grad))
