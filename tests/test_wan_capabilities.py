"""The wan family's capabilities beyond diffusers' forward, each against the plain forward of the
same module in float64: packed batches equal per-sample forwards; a second time input that at
r = t is exactly the single-time model; block-causal teacher forcing equal to running each chunk
over its clean prefix, and the KV-cache rollout equal to the rollout without the cache (also
over packs); the cp = 2 split of every forward equal to the unsplit model (real gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.ports import free_port

from trainer.models.wan.family import WanFamily

ROOT = Path(__file__).resolve().parents[1]
# a model built at random, as a trained one looks (zero_init_modulation would zero its output)
RANDOM = {"zero_init_modulation": False}

TINY = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 8,
        "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 32,
        "num_layers": 2}
EXACT = dict(rtol=0, atol=1e-12)


def tiny(**extra):
    torch.manual_seed(0)
    family = WanFamily()
    return family.build(family.config({**TINY, **extra}, RANDOM)).double().eval()


def video(frames=4, height=4, width=6, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, frames, height, width, generator=g, dtype=torch.float64)


def caption(length=5, batch=2, seed=2):
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(batch, length, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[-1, 3:] = False
    return text, mask


# ---- packed ------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_a_pack_equals_each_sample_run_alone(causal):
    model = tiny(causal_chunk_size=2 if causal else None)
    g = torch.Generator().manual_seed(3)
    shapes, lengths = [(4, 4, 6), (1, 2, 2), (3, 6, 4)], [5, 3, 7]
    xs = [torch.randn(4, *s, generator=g, dtype=torch.float64) for s in shapes]
    texts = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in lengths]
    masks = [torch.ones(n, dtype=torch.bool) for n in lengths]
    masks[2][4:] = False
    ts = [torch.tensor([0.0, 300.0, 300.0, 700.0]).double(), 900.0, torch.tensor(250.0)]
    with torch.no_grad():
        packed = model.forward_packed(xs, ts, texts, masks)
        for x, t, text, mask, got in zip(xs, ts, texts, masks, packed):
            t = torch.as_tensor(t)[None] if torch.as_tensor(t).ndim else torch.as_tensor(t)
            want = model(x[None], t, text[None], mask[None])[0]
            torch.testing.assert_close(got, want, **EXACT)


# ---- the second time input ----------------------------------------------------------------


def two_time_copy(single, gate=0.25):
    two = tiny(two_time=True, time_gate=gate)
    missing, unexpected = two.load_state_dict(single.state_dict(), strict=False)
    assert not unexpected and missing == [f"condition_embedder.time_embedder_r.linear_{i}.{p}"
                                          for i in (1, 2) for p in ("weight", "bias")]
    with torch.no_grad():  # make E_r differ first: the init must copy E_t over it
        for p in two.condition_embedder.time_embedder_r.parameters():
            p.add_(1.0)
    two.init_second_time_from_first()
    return two


def test_a_second_time_input_starts_as_the_single_time_model_at_r_equal_t():
    single = tiny()
    two = two_time_copy(single)
    x, (text, mask) = video(), caption()
    t = torch.tensor([[0.0, 500.0, 500.0, 999.0], [250.0, 250.0, 10.0, 10.0]]).double()
    with torch.no_grad():
        want = single(x, t, text, mask)
        assert torch.equal(two(x, t, text, mask, r=t), want)
        assert torch.equal(two(x, t, text, mask), want)
        assert not torch.allclose(two(x, t, text, mask, r=t * 0.3), want)
    with pytest.raises(ValueError, match="two_time: true"):
        single(x, t, text, mask, r=t)
    family = WanFamily()
    config = two.config
    counts = family.param_counts(config)
    assert counts.total == sum(p.numel() for p in two.parameters())
    assert counts.second_time == sum(p.numel() for p in
                                     two.condition_embedder.time_embedder_r.parameters())
    assert family.param_counts(single.config).total + counts.second_time == counts.total
    geometry = two.geometry
    assert (geometry.two_time, geometry.time_gate) == (True, 0.25)
    assert family.bidirectional_config({**config, "causal_chunk_size": 2}) == {
        **config, "two_time": False, "causal_chunk_size": None, "attn_window_chunks": None}
    # Public layouts have no second time input: both adapters leave it out on the way out.
    state = two.state_dict()
    for layout in ("diffusers", "original"):
        out = family.state_dict_adapter(layout).convert_from_relay(state)
        assert len(out) == len(state) - 4 and not any("time_embedder_r" in k for k in out)
    assert family.state_dict_adapter("relay").convert_from_relay(state).keys() == state.keys()


def test_at_gate_zero_r_changes_nothing():
    single = tiny()
    two = two_time_copy(single, gate=0.0)
    with torch.no_grad():
        for p in two.condition_embedder.time_embedder_r.parameters():
            p.add_(torch.randn_like(p))
        x, (text, mask) = video(), caption()
        t = torch.tensor([700.0, 20.0]).double()
        assert torch.equal(two(x, t, text, mask, r=t * 0.1), single(x, t, text, mask))


# ---- teacher forcing and the KV cache ----------------------------------------------------


def clean_prefix_forward(model, clean, noisy, t, r, text, mask, start, size):
    """Chunk [start, start + size) of noisy with full attention to the clean frames before it
    (at t = 0, r = 0): the block-causal forward over [clean prefix | noisy chunk]."""
    x = torch.cat([clean[:, :, :start], noisy[:, :, start:start + size]], dim=2)
    zero = torch.zeros(t.shape[0], start, dtype=t.dtype)
    times = torch.cat([zero, t[:, start:start + size]], dim=1)
    rs = None if r is None else torch.cat([zero, r[:, start:start + size]], dim=1)
    return model(x, times, text, mask, r=rs)[:, :, start:]


@pytest.mark.parametrize("window, frames, two_time", [(None, 6, False), (1, 7, True)])
def test_teacher_forcing_equals_each_chunk_over_its_clean_prefix_and_the_cached_chunk(
        window, frames, two_time):
    model = tiny(causal_chunk_size=2, attn_window_chunks=window, two_time=two_time)
    clean, noisy = video(frames, seed=1), video(frames, seed=2)
    text, mask = caption()
    t = torch.linspace(900, 100, frames, dtype=torch.float64).repeat(2, 1)
    r = t * 0.5 if two_time else None
    with torch.no_grad():
        tf, tf_clean = model.forward_teacher_forcing(noisy, clean, t, text, mask, r=r,
                                                     return_clean=True)
        # the clean half is the block-causal forward of the clean video at t = 0
        zero = torch.zeros(2, frames, dtype=torch.float64)
        torch.testing.assert_close(tf_clean, model(clean, zero, text, mask,
                                                   r=zero if two_time else None), **EXACT)
        for start in range(0, frames, 2):
            size = min(2, frames - start)
            sl = slice(start, start + size)
            if window is None:  # (a window hides early clean frames from the prefix forward)
                want = clean_prefix_forward(model, clean, noisy, t, r, text, mask, start, size)
                torch.testing.assert_close(tf[:, :, sl], want, **EXACT)
            cache = model.new_kv_cache(text, mask)
            for s in range(0, start, 2):
                model.commit_chunk(clean[:, :, s:s + 2], cache, s)
            kept = len(cache.chunks)
            got = model.forward_chunk(noisy[:, :, sl], t[:, sl], cache, start,
                                      r_chunk=None if r is None else r[:, sl])
            torch.testing.assert_close(got, tf[:, :, sl], **EXACT)
            assert len(cache.chunks) == kept and cache.next_frame == start
            assert window is None or kept <= window
    with pytest.raises(ValueError, match="next chunk starts at latent frame"):
        model.commit_chunk(clean[:, :, 2:4], model.new_kv_cache(text, mask), 2)
    with pytest.raises(ValueError, match="causal model"):
        tiny().forward_teacher_forcing(noisy, clean, t, text, mask)


def rollout(model, noise, text, mask, cached, steps=(900.0, 400.0)):
    """A two-step Euler rollout chunk by chunk; each finished chunk is committed clean. Without
    the cache every step is a block-causal forward over [finished chunks | this chunk]."""
    frames, out = noise.shape[2], []
    cache = model.new_kv_cache(text, mask) if cached else None
    for start in range(0, frames, 2):
        x = noise[:, :, start:start + 2]
        for j, t in enumerate(steps):
            following = steps[j + 1] if j + 1 < len(steps) else 0.0
            if cached:
                v = model.forward_chunk(x, t, cache, start)
            else:
                prefix = torch.cat([*out, x], dim=2)
                times = torch.cat([torch.zeros(2, start), torch.full((2, x.shape[2]), t)], dim=1)
                v = model(prefix, times.double(), text, mask)[:, :, start:]
            x = x - (t - following) / 1000.0 * v
        if cached:
            model.commit_chunk(x, cache, start)
        out.append(x)
    return torch.cat(out, dim=2)


def test_the_cached_rollout_equals_the_rollout_without_the_cache():
    model = tiny(causal_chunk_size=2)
    text, mask = caption()
    noise = video(5, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(rollout(model, noise, text, mask, True),
                                   rollout(model, noise, text, mask, False), **EXACT)


def test_packed_teacher_forcing_and_the_packed_rollout_equal_each_sample_alone():
    model = tiny(causal_chunk_size=2, two_time=True)
    g = torch.Generator().manual_seed(5)
    shapes, lengths = [(4, 4, 4), (3, 2, 2), (1, 4, 6)], [3, 5, 4]
    cleans = [torch.randn(4, *s, generator=g, dtype=torch.float64) for s in shapes]
    noisys = [torch.randn(4, *s, generator=g, dtype=torch.float64) for s in shapes]
    texts = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in lengths]
    masks = [torch.ones(n, dtype=torch.bool) for n in lengths]
    masks[1][3:] = False
    ts = [700.0, torch.tensor([0.0, 600.0, 600.0]).double(), 300.0]
    rs = [350.0, None, 100.0]

    def alone(value):  # a sample's time as a batch of one: [1] or [1, T]
        return torch.as_tensor(value, dtype=torch.float64)[None]

    with torch.no_grad():
        packed = model.forward_teacher_forcing_packed(noisys, cleans, ts, texts, masks, rs)
        for i in range(3):
            want = model.forward_teacher_forcing(
                noisys[i][None], cleans[i][None], alone(ts[i]), texts[i][None],
                masks[i][None], r=None if rs[i] is None else alone(rs[i]))[0]
            torch.testing.assert_close(packed[i], want, **EXACT)
        cache = model.new_packed_kv_cache(texts, masks)
        first = model.forward_chunk_packed([x[:, :2] for x in noisys], ts[:1] + [
            ts[1][:2], ts[2]], cache, [0, 1, 2], rs=rs)
        model.commit_chunk_packed([x[:, :2] for x in cleans[:2]], cache, [0, 1])
        second = model.forward_chunk_packed([noisys[0][:, 2:], noisys[1][:, 2:]],
                                            [500.0, torch.tensor([800.0]).double()], cache, [0, 1])
        for i, got in enumerate(first):
            own = model.new_kv_cache(texts[i][None], masks[i][None])
            t = ts[i][:2][None] if i == 1 else ts[i]
            r = None if rs[i] is None else rs[i]
            torch.testing.assert_close(got, model.forward_chunk(noisys[i][None, :, :2], t, own, 0,
                                                                r_chunk=r)[0], **EXACT)
            if i < 2:
                model.commit_chunk(cleans[i][None, :, :2], own, 0)
                t = 500.0 if i == 0 else torch.tensor([[800.0]]).double()
                torch.testing.assert_close(second[i], model.forward_chunk(
                    noisys[i][None, :, 2:], t, own, 2)[0], **EXACT)
        assert cache.next_frame == [2, 2, 0]


# ---- context parallel ----------------------------------------------------------------------


def test_every_forward_at_cp2_equals_the_unsplit_model(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         str(ROOT / "tests" / "wan_context_parallel_worker.py"), str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert set(result) == {"bidirectional", "per_frame_times", "block_causal",
                               "teacher_forcing", "kv_rollout", "packed", "packed_causal",
                               "packed_teacher_forcing", "packed_rollout"}
        for case, diff in result.items():  # float64: only the order of sums differs
            assert diff["out"] < 1e-12, (case, diff)
            if "grad" in diff:
                assert diff["grad"] < 1e-12 * diff["grad_scale"], (case, diff)
            # a real split: a rank's blocks held half the video tokens (a pack padded to split)
            assert diff["tokens"]["split"] == -(-diff["tokens"]["whole"] // 2), case


def _env():
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


# ---- the stages ----------------------------------------------------------------------------

WAN = ("{num_attention_heads: 2, attention_head_dim: 8, num_layers: 2, ffn_dim: 32, "
       "in_channels: 3, out_channels: 3, text_dim: 32, freq_dim: 32, patch_size: [1, 4, 4]")


def _train(config: str, out: Path, data: Path, model: str, *extra: str, steps: int = 2):
    proc = subprocess.run(
        [sys.executable, "trainer/train.py", "--config", f"config/tiny/{config}.yaml",
         "--model_family", "wan", "--transformer_config_overrides", model,
         "--train_batch_size", "2", "--synthetic_num_samples", "8", "--max_steps", str(steps),
         "--log_interval", "1", "--validation_interval", "-1", "--data_path", str(data),
         "--output_dir", str(out), *extra],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return records


def test_tiny_wan_trains_through_stage1_and_stage2(tmp_path):
    """FM (the teacher) -> Stage1 (causal, two-time: E_r copied from E_t, teacher forcing) ->
    Stage2 (the Stage1 student without E_r, a KV-cached rollout; bidirectional teacher and
    critic from the FM run), two steps each."""
    data = tmp_path / "data"
    _train("pretrain", tmp_path / "fm", data, WAN + "}", steps=1)
    stage1 = _train("stage1", tmp_path / "stage1", data,
                    WAN + ", causal_chunk_size: 2, two_time: true, time_gate: 0.25}",
                    "--pretrained_transformer_path", str(tmp_path / "fm"),
                    "--pretrained_weights", "live")
    assert all(r["loss"] == r["loss"] for r in stage1)
    report = json.loads((tmp_path / "stage1" / "warm-start.json").read_text())
    assert json.dumps(report).count('"second_time": "copied from the first"') == 1
    stage2 = _train("stage2", tmp_path / "stage2", data, WAN + ", causal_chunk_size: 2}",
                    "--student_init_path", str(tmp_path / "stage1"), "--student_init_weights",
                    "live", "--teacher_init_path", str(tmp_path / "fm"),
                    "--teacher_init_weights", "live", "--critic_init_path", str(tmp_path / "fm"),
                    "--critic_init_weights", "live", "--generator_update_interval", "1")
    assert "generator_loss" in stage2[-1] and stage2[-1]["critic_loss"] == stage2[-1]["critic_loss"]


def test_relay_keys_may_be_set_over_a_diffusers_directory(tmp_path):
    """Stage1 from public weights: the architecture comes from transformer/config.json, the
    causal and two-time keys (relay's own, no diffusers key) from the overrides."""
    from trainer.models.family import ConfigDirError

    transformer = tmp_path / "transformer"
    transformer.mkdir()
    (transformer / "config.json").write_text(json.dumps(
        {"_class_name": "WanTransformer3DModel", **TINY}))
    family = WanFamily()
    settings = {"pretrained_transformer_path": str(tmp_path), "load_transformer_weights": True}
    config = family.config({"causal_chunk_size": 2, "two_time": True, "time_gate": 0.5},
                           settings)
    assert {k: config[k] for k in TINY} == TINY
    geometry = family.geometry(config)
    assert (geometry.causal_chunk_frames, geometry.two_time, geometry.time_gate) == (2, True, 0.5)
    with pytest.raises(ConfigDirError, match="num_layers"):
        family.config({"num_layers": 3, "two_time": True}, settings)
