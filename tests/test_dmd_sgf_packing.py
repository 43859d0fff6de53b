"""Stage2 on packs: the KV-cached rollout over a pack of samples of different shapes computes
what each sample's own rollout computes, and a packed Stage2 step equals the per-sample steps."""

import pytest
import torch

from test_data_packing import C, D, _causal_samples, _model

torch.set_num_threads(1)


@pytest.mark.parametrize("window", [None, 1])
def test_packed_cache_chunks_equal_each_sample_with_its_own_cache(window):
    model = _model(causal_chunk_size=2, attn_window_chunks=window)
    xs, _, texts, masks = _causal_samples()  # 4, 3 and 1 frames: 2, 2 and 1 chunks
    g = torch.Generator().manual_seed(11)
    cache = model.new_packed_kv_cache(texts, masks)
    alone = [model.new_kv_cache(t[None], m[None]) for t, m in zip(texts, masks)]
    for start in (0, 2):
        active = [i for i, x in enumerate(xs) if x.shape[1] > start]
        chunks = [xs[i][:, start:start + 2] for i in active]
        times = [torch.rand((), generator=g, dtype=torch.float64) * 1000 for _ in active]
        packed = model.forward_chunk_packed(chunks, times, cache, active)
        for i, x, t, out in zip(active, chunks, times, packed):
            want = model.forward_chunk(x[None], t[None], alone[i], start)[0]
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        cleans = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in chunks]
        model.commit_chunk_packed(cleans, cache, active)
        for i, clean in zip(active, cleans):
            model.commit_chunk(clean[None], alone[i], start)
    assert cache.next_frame == [c.next_frame for c in alone] == [4, 3, 1]
    assert [len(c) for c in cache.chunks] == [len(c.chunks) for c in alone]


def test_a_sample_of_a_packed_cache_does_not_see_the_others():
    model = _model(causal_chunk_size=2)
    xs, _, texts, masks = _causal_samples()
    outputs = []
    for shift in (0.0, 5.0):
        moved = [texts[0], texts[1] + shift, texts[2]]
        cache = model.new_packed_kv_cache(moved, masks)
        model.commit_chunk_packed([x[:, :2] for x in xs[:2]], cache, [0, 1])
        outputs.append(model.forward_chunk_packed([xs[0][:, 2:], xs[1][:, 2:]],
                                                  [300.0, 300.0], cache, [0, 1]))
    assert torch.equal(outputs[0][0], outputs[1][0])  # sample 0 is blind to sample 1's caption
    assert not torch.equal(outputs[0][1], outputs[1][1])
