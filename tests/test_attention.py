import importlib.util

import pytest
import torch

from trainer import attention as attn
from trainer.attention import (
    attention,
    available_backends,
    block_causal_mask,
    teacher_forcing_mask,
)

torch.set_num_threads(1)


def test_teacher_forcing_mask_reproduces_the_spec_example():
    # ALGORITHMS.md §5.2: three chunks, one token each, order (c0, c1, c2, n0, n1, n2)
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
    """The §5.2 rule written token by token, as the reference for the vectorised builder."""
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


@pytest.mark.parametrize("builder", [block_causal_mask, teacher_forcing_mask])
def test_prefix_is_seen_by_all_and_sees_only_itself(builder):
    p = 3
    mask = builder(num_frames=4, tokens_per_frame=2, chunk_size=2, num_prefix_tokens=p)
    assert mask[:, :p].all()
    assert not mask[:p, p:].any()
    without = builder(num_frames=4, tokens_per_frame=2, chunk_size=2)
    assert torch.equal(mask[p:, p:], without)


def test_mask_builders_reject_bad_sizes():
    with pytest.raises(ValueError, match="chunk_size"):
        block_causal_mask(4, 1, 0)
    with pytest.raises(ValueError, match="window_chunks"):
        teacher_forcing_mask(4, 1, 1, window_chunks=-1)


def test_sdpa_masked_attention_ignores_disallowed_keys():
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    k = torch.randn(2, 2, 5, 4, dtype=torch.float64)
    v = torch.randn(2, 2, 5, 4, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, False])
    out = attention(q, k, v, mask)
    keep = mask.nonzero().squeeze(1)
    assert torch.allclose(out, attention(q, k[:, :, keep], v[:, :, keep]), atol=1e-12)
    v2 = v.clone()
    v2[:, :, 2] += 100.0
    assert torch.allclose(out, attention(q, k, v2, mask), atol=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn installed")
def test_missing_backend_package_is_named_in_the_error():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ImportError, match="flash_attn"):
        attention(q, q, q, backend="flash_attn")
    with pytest.raises(ImportError, match=r"flash_attn\.cute"):
        attention(q, q, q, backend="fa4")
    assert "flash_attn" not in available_backends()


def test_unknown_backend_lists_known_names():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="sdpa"):
        attention(q, q, q, backend="flashy")


def test_maskless_backend_refuses_a_mask(monkeypatch):
    monkeypatch.setitem(attn._REGISTRY, "test_maskless", attn._Backend(lambda q, k, v, m: q, False))
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="only mask=None"):
        attention(q, q, q, torch.ones(2, 2, dtype=torch.bool), backend="test_maskless")
