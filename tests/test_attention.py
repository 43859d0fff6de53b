import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from trainer.models import attention as attn
from trainer.models.attention import (
    ChunkLayout,
    attend,
    attention_varlen,
    block_causal_mask,
    choose_kernel,
    plan_attention,
    teacher_forcing_mask,
)

torch.set_num_threads(1)


def test_teacher_forcing_mask_reproduces_the_spec_example():
    # docs/algorithms.md, "Attention mask": three chunks, one token each, order (c0, c1, c2, n0, n1, n2)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    got = teacher_forcing_mask(num_frames=3, tokens_per_frame=1, chunk_size=1)
    assert torch.equal(got, expected)


def _tf_rule(q, k, ch, v, window):
    """The "Attention mask" rule of docs/algorithms.md, written token by token, as the reference for the vectorised builder."""
    if q == k:
        return True
    q_clean, k_clean = q < v, k < v
    cq, ck = ch[q % v], ch[k % v]
    in_window = window is None or ck >= cq - window
    if q_clean and k_clean:
        return ck <= cq and in_window
    if not q_clean and not k_clean:
        return ck == cq
    if not q_clean and k_clean:
        return ck < cq and in_window
    return False


@pytest.mark.parametrize("window", [None, 0, 1, 2])
def test_teacher_forcing_mask_follows_the_rule_with_ragged_last_chunk(window):
    frames, per_frame, chunk = 7, 2, 2  # chunks of 2, 2, 2, 1 frames
    got = teacher_forcing_mask(frames, per_frame, chunk, window_chunks=window)
    ch = [f // chunk for f in range(frames) for _ in range(per_frame)]
    v = frames * per_frame
    expected = torch.tensor([[_tf_rule(q, k, ch, v, window) for k in range(2 * v)] for q in range(2 * v)])
    assert torch.equal(got, expected)


def test_teacher_forcing_window_limits_noisy_to_recent_clean_chunks():
    mask = teacher_forcing_mask(num_frames=5, tokens_per_frame=1, chunk_size=1, window_chunks=2)
    noisy4 = mask[5 + 4, :5]
    # noisy chunk 4 sees clean chunks max(0, 4 - 2)..3 only
    assert noisy4.tolist() == [False, False, True, True, False]


def test_block_causal_mask_sees_earlier_chunks_within_window():
    mask = block_causal_mask(num_frames=6, tokens_per_frame=1, chunk_size=2, window_chunks=1)
    # chunks {0,1} {2,3} {4,5}; chunk 2 sees chunks 1 and 2, not 0
    assert mask[4].tolist() == [False, False, True, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False, False]
    full = block_causal_mask(num_frames=6, tokens_per_frame=1, chunk_size=2)
    assert full[4].tolist() == [True] * 6
    assert full[3].tolist() == [True] * 4 + [False] * 2


def test_mask_builders_reject_bad_sizes():
    with pytest.raises(ValueError, match="chunk_size"):
        block_causal_mask(4, 1, 0)
    with pytest.raises(ValueError, match="window_chunks"):
        teacher_forcing_mask(4, 1, 1, window_chunks=-1)
    with pytest.raises(ValueError, match="kind"):
        ChunkLayout("causal", 4, 1, 1, None, 0)


@pytest.mark.parametrize("kind", ["block_causal", "teacher_forcing"])
def test_layout_lets_every_query_see_the_prefix_keys_placed_last(kind):
    layout = ChunkLayout(kind, num_frames=4, tokens_per_frame=2, chunk_size=2, window_chunks=None,
                         num_prefix=3)
    dense = layout.dense()
    build = teacher_forcing_mask if kind == "teacher_forcing" else block_causal_mask
    assert dense.shape == (layout.num_queries, layout.num_queries + 3)
    assert torch.equal(dense[:, :-3], build(4, 2, 2))
    assert dense[:, -3:].all()


LAYOUTS = [ChunkLayout("block_causal", 5, 3, 2, None, 4), ChunkLayout("block_causal", 6, 2, 2, 1, 3),
           ChunkLayout("teacher_forcing", 5, 3, 2, None, 4), ChunkLayout("teacher_forcing", 7, 2, 2, 1, 2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.kind}-w{l.window_chunks}")
@pytest.mark.parametrize("padded", [False, True])
def test_flex_mask_mod_allows_exactly_the_dense_mask(layout, padded):
    lengths = torch.tensor([layout.num_keys - 1, layout.num_queries + 1]) if padded else None
    batch = 2 if padded else 1
    got = create_mask(layout.mask_mod(lengths, "cpu"), batch, 1, layout.num_queries, layout.num_keys,
                      device="cpu")
    expected = layout.dense().expand(batch, layout.num_queries, layout.num_keys).clone()
    if padded:
        expected &= torch.arange(layout.num_keys)[None, None, :] < lengths[:, None, None]
    assert torch.equal(got[:, 0], expected)


def _qkv(batch, nq, nk, heads=2, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, n, heads, dim, generator=g, dtype=dtype) for n in (nq, nk, nk))


def _masked_reference(q, k, v, allowed):
    """Softmax attention written out: allowed bool [B or 1, Nq, Nk]."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("layout", LAYOUTS[:3:2], ids=lambda l: l.kind)
def test_flex_kernel_computes_the_chunked_attention_of_the_dense_mask(layout):
    from trainer.models.attention import _flex, _flex_block_mask

    q, k, v = _qkv(2, layout.num_queries, layout.num_keys)
    lengths = torch.tensor([layout.num_keys, layout.num_keys - 2])
    block_mask = _flex_block_mask(layout, lengths, layout.num_queries, layout.num_keys, "cpu")
    allowed = layout.dense() & (torch.arange(layout.num_keys) < lengths[:, None, None])
    torch.testing.assert_close(_flex(q, k, v, block_mask), _masked_reference(q, k, v, allowed),
                               rtol=1e-5, atol=1e-5)


def test_cpu_plans_use_sdpa_and_no_mask_when_nothing_is_masked():
    common = dict(head_dim=8, dtype=torch.float32, device="cpu")
    full = plan_attention("auto", num_queries=6, num_keys=9, **common)
    assert full.kernel == "sdpa" and full.mask is None
    padded = plan_attention("auto", num_queries=6, num_keys=9, key_lengths=torch.tensor([9, 7]), **common)
    assert padded.mask.shape == (2, 1, 1, 9)
    assert padded.mask[1, 0, 0].tolist() == [True] * 7 + [False] * 2
    layout = ChunkLayout("block_causal", 3, 2, 1, None, 3)
    chunked = plan_attention("auto", num_queries=6, num_keys=9, layout=layout, **common)
    assert torch.equal(chunked.mask[0, 0], layout.dense())


def test_padded_plan_ignores_the_keys_past_each_length():
    q, k, v = _qkv(2, 5, 7, dtype=torch.float64)
    lengths = torch.tensor([7, 4])
    plan = plan_attention("sdpa", num_queries=5, num_keys=7, head_dim=8, dtype=torch.float64,
                          device="cpu", key_lengths=lengths)
    out = attend(plan, q, k, v)
    short = attend(plan_attention("sdpa", num_queries=5, num_keys=4, head_dim=8, dtype=torch.float64,
                                  device="cpu"), q[1:], k[1:, :4], v[1:, :4])
    torch.testing.assert_close(out[1:], short, rtol=0, atol=1e-12)
    v2 = v.clone()
    v2[1, 4:] += 100.0
    torch.testing.assert_close(attend(plan, q, k, v2), out, rtol=0, atol=1e-12)


def test_plan_rejects_a_layout_of_other_sizes():
    with pytest.raises(ValueError, match="does not fit"):
        plan_attention("auto", num_queries=5, num_keys=9, head_dim=8, dtype=torch.float32,
                       device="cpu", layout=ChunkLayout("block_causal", 3, 2, 1, None, 3))


def test_varlen_attention_keeps_packed_sequences_apart():
    lengths_q, lengths_k = [3, 5, 2], [4, 6, 3]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 10, 13], dtype=torch.int32)
    out = attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), backend="sdpa")
    # one sequence of all tokens under a block-diagonal mask, derived from the lengths alone
    seq_q = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths_q))
    seq_k = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths_k))
    allowed = (seq_q[:, None] == seq_k[None, :])[None]
    torch.testing.assert_close(out[None], _masked_reference(q[None], k[None], v[None], allowed),
                               rtol=0, atol=1e-12)


def _gpu_like(kernels):
    return lambda kernel: kernel in kernels


@pytest.mark.parametrize("form,expected", [("full", "fa4"), ("padded", "fa4"), ("chunked", "flex"),
                                           ("varlen", "fa4")])
def test_auto_picks_the_fastest_kernel_that_computes_the_form(monkeypatch, form, expected):
    monkeypatch.setattr(attn, "_load", lambda kernel: SimpleNamespace())
    assert choose_kernel("auto", form, _gpu_like({"sdpa", "flex", "fa4", "flash_attn"})) == expected
    assert choose_kernel("auto", form, _gpu_like({"sdpa"})) == "sdpa"  # a CPU


def test_named_backend_serves_its_forms_and_hands_the_others_on(monkeypatch):
    monkeypatch.setattr(attn, "_load", lambda kernel: SimpleNamespace())
    gpu = _gpu_like({"sdpa", "flex", "flash_attn"})
    assert choose_kernel("flash_attn", "full", gpu) == "flash_attn"
    assert choose_kernel("flash_attn", "padded", gpu) == "flex"
    assert choose_kernel("fa4", "full", _gpu_like({"sdpa"})) == "sdpa"  # installed, but no GPU
    for form in ("full", "padded", "chunked", "varlen"):
        assert choose_kernel("sdpa", form, gpu) == "sdpa"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn installed")
def test_missing_backend_package_is_named_in_the_error():
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(ImportError, match="flash_attn"):
        plan_attention("flash_attn", num_queries=2, num_keys=2, head_dim=8, dtype=q.dtype, device="cpu")
    with pytest.raises(ImportError, match=r"flash_attn\.cute"):
        plan_attention("fa4", num_queries=2, num_keys=2, head_dim=8, dtype=q.dtype, device="cpu")
    assert "flash_attn" not in attn.available_kernels()


def test_unknown_backend_lists_known_names():
    with pytest.raises(ValueError, match="sdpa"):
        choose_kernel("flashy", "full", _gpu_like({"sdpa"}))


def test_routing_is_logged_once_per_decision(caplog):
    attn._log_route.cache_clear()
    with caplog.at_level("INFO", logger="relay"):
        for _ in range(3):
            plan_attention("auto", num_queries=2, num_keys=2, head_dim=8, dtype=torch.float32,
                           device="cpu")
    routes = [r.getMessage() for r in caplog.records if "attention:" in r.getMessage()]
    assert routes == ["attention: full attention -> sdpa (attention_backend=auto, cpu, float32)"]


def test_sdpa_plan_matches_written_out_softmax():
    q, k, v = _qkv(2, 4, 6, dtype=torch.float64)
    plan = plan_attention("sdpa", num_queries=4, num_keys=6, head_dim=8, dtype=torch.float64, device="cpu")
    allowed = torch.ones(1, 4, 6, dtype=torch.bool)
    torch.testing.assert_close(attend(plan, q, k, v), _masked_reference(q, k, v, allowed),
                               rtol=0, atol=1e-12)
