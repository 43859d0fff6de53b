"""Sparse video attention (trainer/models/sparse_attention.py, docs/model.md "Sparse video
attention"), on the CPU with its SDPA kernel: sparsity 0 is bit for bit the dense path of the
tiny DiT and the tiny Wan; keeping every tile equals dense attention; the tile order, the
selection (the top-k of the coarse scores) and the attention over the chosen blocks (equal to a
float64 masked reference); the ramp; a tiny Wan SFT with sparsity ramped through train.py that
resumes bit for bit and exports a dense diffusers model with the note in relay-sampling.json;
and the refusals at --dry-run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config.schema import ConfigError
from trainer.models.sparse_attention import (SparseVideoSettings, current_sparsity, keep_for,
                                             select_key_blocks, set_video_attention_sparsity,
                                             sparse_video_plan, tile_order)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "config" / "tiny"


def _dit(**overrides):
    from trainer.models.dit.module import VideoDiT

    torch.manual_seed(0)
    config = dict(hidden_size=32, num_attention_heads=2, num_layers=2, rope_axes_dim=(4, 6, 6),
                  patch_size=(1, 2, 2), zero_init_modulation=False)
    return VideoDiT(**{**config, **overrides})


def _wan(**overrides):
    from trainer.models.wan.module import WanTransformer

    torch.manual_seed(0)
    config = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16,
              "in_channels": 4, "out_channels": 4, "text_dim": 32, "freq_dim": 32,
              "ffn_dim": 64, "num_layers": 2, "cross_attn_norm": True,
              "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 64}
    return WanTransformer({**config, **overrides})


def _inputs(channels, times_per_frame=False, padded=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, channels, 4, 12, 16, generator=g, dtype=dtype)  # grid 4 x 6 x 8
    t = torch.rand(2, 4, generator=g) * 1000 if times_per_frame else torch.tensor([900.0, 40.0])
    text = torch.randn(2, 5, 32, generator=g, dtype=dtype)
    mask = torch.ones(2, 5, dtype=torch.bool)
    if padded:
        mask[1, 3:] = False
    return x, t, text, mask


def _forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["dit", "wan"])
def test_sparsity_zero_is_the_dense_path_bit_for_bit(family):
    model = _dit() if family == "dit" else _wan()
    inputs = _inputs(3 if family == "dit" else 4, padded=True)
    want, want_grads = _forward_backward(model, inputs)
    assert set_video_attention_sparsity(model, 0.0, (2, 2, 2)) == 1
    got, got_grads = _forward_backward(model, inputs)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    set_video_attention_sparsity(model, 0.5, (2, 2, 2))  # and the option really acts
    sparse = model(*inputs)
    assert not torch.equal(sparse, want)
    set_video_attention_sparsity(model, 0.5, (2, 2, 2), own_tile=True)  # and so does own_tile
    assert not torch.equal(model(*inputs), sparse)


@pytest.mark.parametrize("family", ["dit", "wan"])
@pytest.mark.parametrize("per_frame", [False, True])
def test_keeping_every_tile_equals_dense_attention(family, per_frame):
    # the tile order of tokens, RoPE positions and per-frame modulation, undone after the head
    model = (_dit() if family == "dit" else _wan()).double()
    inputs = _inputs(3 if family == "dit" else 4, per_frame, padded=True, dtype=torch.float64)
    with torch.no_grad():
        want = model(*inputs)
        set_video_attention_sparsity(model, 1e-6, (2, 2, 3))  # keeps every block
        got = model(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_tile_order_is_a_permutation_that_keeps_tiles_together():
    grid, tile = (5, 6, 10), (2, 4, 4)
    order = tile_order(grid, tile, "cpu")
    n = math.prod(grid)
    assert torch.equal(order.to_tiles.sort().values, torch.arange(n))
    assert torch.equal(order.to_tiles[order.from_tiles], torch.arange(n))
    t, h, w = torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij")
    tile_id = ((t // 2) * 10 + h // 4) * 10 + w // 4
    tiled = tile_id.flatten()[order.to_tiles]
    # each tile's tokens are one consecutive run, tiles in order
    runs = torch.unique_consecutive(tiled)
    assert runs.numel() == torch.unique(tile_id).numel() and bool((runs.diff() > 0).all())


def test_the_selection_is_the_top_k_of_the_coarse_scores():
    g = torch.Generator().manual_seed(0)
    block, num_video, text = 8, 8 * 9 + 5, 6  # 9 whole video blocks, a short one, the caption
    q = torch.randn(2, num_video, 3, 16, generator=g)
    k = torch.randn(2, num_video + text, 3, 16, generator=g)
    for sparsity in (0.3, 0.5, 0.9):
        keep = keep_for(sparsity, 9)
        chosen = select_key_blocks(q, k, block, num_video, keep)
        nq, nk = math.ceil(num_video / block), math.ceil((num_video + text) / block)
        assert chosen.shape == (2, 3, nq, nk)
        assert bool(chosen[..., 9:].all())  # the short video block and the caption's: always
        qm = torch.stack([q[:, i * block:(i + 1) * block].mean(1) for i in range(nq)], 2)
        km = torch.stack([k[:, i * block:(i + 1) * block].mean(1) for i in range(9)], 2)
        scores = torch.einsum("bhqd,bhkd->bhqk", qm, km)
        want = torch.zeros_like(scores, dtype=torch.bool).scatter_(
            -1, scores.topk(keep, dim=-1).indices, True)
        assert torch.equal(chosen[..., :9], want)
        assert bool((chosen[..., :9].sum(-1) == keep).all())
    assert keep_for(0.999, 9) == 1 and keep_for(0.0, 9) == 9


def test_own_tile_keeps_each_query_tiles_own_key_tile_within_the_same_count():
    g = torch.Generator().manual_seed(1)
    block, num_video = 8, 8 * 9
    q = torch.randn(1, num_video, 4, 16, generator=g)
    k = torch.randn(1, num_video, 4, 16, generator=g)
    keep = keep_for(0.8, 9)  # 2 of 9
    top = select_key_blocks(q, k, block, num_video, keep)
    own = select_key_blocks(q, k, block, num_video, keep, own_tile=True)
    diagonal = torch.eye(9, dtype=torch.bool)
    assert not bool(top[..., diagonal].all())  # the coarse scores alone drop some own tiles
    assert bool(own[..., diagonal].all())
    assert bool((own.sum(-1) == keep).all())  # the same cost
    # where the own tile was among the top k anyway, the choice is the same
    same = top[..., diagonal]
    assert torch.equal(own[same], top[same])


@pytest.mark.parametrize("padded", [False, True])
def test_the_sparse_output_equals_a_masked_dense_reference(padded):
    g = torch.Generator().manual_seed(2)
    block, num_video, text = 8, 8 * 7 + 3, 5
    q = torch.randn(2, num_video, 2, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, num_video + text, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, num_video + text, 2, 16, generator=g, dtype=torch.float64)
    lengths = torch.tensor([num_video + text, num_video + 2]) if padded else None
    settings = SparseVideoSettings(0.6, (1, 2, 4))
    plan = sparse_video_plan(settings, "auto", num_video=num_video, head_dim=16,
                             dtype=torch.float64, device="cpu", key_lengths=lengths)
    assert plan.kernel == "sparse" and plan.mask.kernel == "sdpa"
    got = plan.mask.attend(q, k, v)
    chosen = select_key_blocks(q, k, block, num_video, keep_for(0.6, 7))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    qb = torch.arange(num_video) // block
    kb = torch.arange(num_video + text) // block
    allowed = chosen[:, :, qb][:, :, :, kb]
    if padded:
        allowed = allowed & (torch.arange(num_video + text)[None, :] < lengths[:, None])[:, None, None]
    want = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dense = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    assert (got - dense).abs().max() > 1e-3


def test_the_ramp_is_a_function_of_the_step():
    assert [current_sparsity(0.8, 4, s) for s in (1, 2, 4, 9)] == [0.2, 0.4, 0.8, 0.8]
    assert current_sparsity(0.8, 0, 1) == 0.8 and current_sparsity(0.0, 4, 9) == 0.0


# --------------------------------------------------------------------------------------------
# through train.py: a tiny Wan SFT, resumed, exported


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _wan_argv(root: Path, out: Path, steps: int) -> list[str]:
    return [sys.executable, "trainer/train.py", "--config", str(TINY / "pretrain.yaml"),
            "--model_family", "wan", "--pretrained_transformer_path", str(root / "tiny-wan"),
            "--load_transformer_weights", "true", "--transformer_config_overrides", "{}",
            "--synthetic_num_frames", "9", "--synthetic_height", "64", "--synthetic_width", "64",
            "--train_batch_size", "2", "--synthetic_num_samples", "8", "--log_interval", "1",
            "--validation_interval", "-1", "--data_path", str(root / "data"),
            "--output_dir", str(out), "--max_steps", str(steps), "--save_interval", "2",
            "--video_attention_sparsity", "0.5", "--video_attention_tile", "[1, 2, 2]",
            "--video_attention_own_tile", "true",
            "--video_attention_sparsity_warmup_steps", "2"]


def _losses(out: Path) -> list[tuple[int, float, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["video_attention_sparsity"]) for r in records]


def test_a_sparse_wan_sft_trains_resumes_bit_for_bit_and_exports_dense(tmp_path, capsys):
    from launcher.cli import main as relay_main
    from trainer.models.wan import tiny

    tiny.write_tiny_wan_pipeline(tmp_path / "tiny-wan")
    # the data first (both runs read the same directory)
    first = subprocess.run(_wan_argv(tmp_path, tmp_path / "half", 2), cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    straight = subprocess.Popen(_wan_argv(tmp_path, tmp_path / "straight", 4), cwd=ROOT,
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    resumed = subprocess.run(_wan_argv(tmp_path, tmp_path / "half", 4), cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)
    log, _ = straight.communicate(timeout=300)
    assert straight.returncode == 0, log[-3000:]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "sparse video attention -> sdpa" in first.stderr
    want = _losses(tmp_path / "straight")
    assert [(s, sp) for s, _, sp in want] == [(1, 0.25), (2, 0.5), (3, 0.5), (4, 0.5)]
    assert _losses(tmp_path / "half") == want  # the resumed run's steps 3, 4 bit for bit

    out = tmp_path / "export"
    code = relay_main(["export", str(tmp_path / "straight"), "--format", "diffusers", "--out",
                       str(out), "--components", "none"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "trained with sparse video attention" in captured.out
    note = json.loads((out / "relay-sampling.json").read_text())["trained_sparse"]
    assert note["video_attention_sparsity"] == 0.5 and note["video_attention_tile"] == [1, 2, 2]
    assert note["video_attention_own_tile"] is True
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(str(out / "transformer"))  # a dense model
    assert model.config.num_layers == tiny.TRANSFORMER["num_layers"]

    # relay samples it densely unless asked for the attention it trained with
    frames = {}
    for attention in ("dense", "trained"):
        code = relay_main(["sample", "--checkpoint", str(tmp_path / "straight"), "--prompt",
                           "a red square moving right", "--steps", "2", "--attention", attention,
                           "--out", str(tmp_path / attention)])
        assert code == 0, capsys.readouterr().err
        frames[attention] = np.load(tmp_path / attention / "frames.npy")
    assert frames["dense"].shape == frames["trained"].shape
    assert not np.array_equal(frames["dense"], frames["trained"])
    code = relay_main(["eval", "--checkpoint", str(tmp_path / "straight"), "--steps", "2",
                       "--attention", "trained", "--out", str(tmp_path / "eval.json")])
    assert code == 0, capsys.readouterr().err
    assert "sparse 0.5, tile 1x2x2, own tile attention" in capsys.readouterr().out
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["attention"] == "sparse 0.5, tile 1x2x2, own tile"


# --------------------------------------------------------------------------------------------
# refusals


def _resolve(*argv: str, world_size: int = 1):
    from trainer.resolve import resolve_args

    return resolve_args(list(argv), world_size=world_size, check_weights=False)


def _refusal(*argv: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as caught:
        _resolve(*argv, world_size=world_size)
    return str(caught.value)


def test_invalid_keys_are_refused(tmp_path):
    base = ("--config", str(TINY / "pretrain.yaml"), "--output_dir", str(tmp_path / "o"))
    assert "must lie in [0, 1)" in _refusal(*base, "--video_attention_sparsity", "1.0")
    assert "three positive integers" in _refusal(*base, "--video_attention_sparsity", "0.5",
                                                 "--video_attention_tile", "[2, 0, 8]")
    assert "three positive integers" in _refusal(*base, "--video_attention_tile", "[2, 8]")
    assert "must be >= 0" in _refusal(*base, "--video_attention_sparsity_warmup_steps", "-1")
    assert "leave video_attention_own_tile out" in _refusal(*base, "--video_attention_own_tile",
                                                            "true")
    args, _ = _resolve(*base, "--video_attention_sparsity", "0.9")  # the tiny DiT takes it
    assert args.video_attention_sparsity == 0.9


def test_what_sparse_attention_does_not_run_is_refused_at_dry_run(tmp_path, capsys):
    from trainer.train import main

    sparse = ("--video_attention_sparsity", "0.8")
    base = ("--config", str(TINY / "pretrain.yaml"), "--output_dir", str(tmp_path / "o"), *sparse)
    # teacher forcing / KV cache (Stage1), with the paragraph at --dry-run
    code = main(["--config", str(TINY / "stage1.yaml"), "--output_dir", str(tmp_path / "s1"),
                 "--pretrained_transformer_path", "null", "--load_transformer_weights", "false",
                 *sparse, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "stage tf_anyflow runs block-causal teacher forcing" in err, err
    assert "Train the sparse model with stage fm" in err
    # a causal model under fm
    message = _refusal(*base, "--transformer_config_overrides",
                       "{in_channels: 3, patch_size: [2, 4, 4], causal_chunk_size: 4}")
    assert "the model is causal" in message
    # packs
    assert "batches are packs" in _refusal(*base, "--packing_token_budget", "512")
    # context parallel
    message = _refusal(*base, "--cp_size", "2", world_size=2)
    assert "cp_size 2 splits each sample's tokens over ranks" in message
    # a family without the capability
    proc = subprocess.run([sys.executable, "trainer/train.py", *base, "--model_family",
                           "tests.families.pixel_mlp:PixelMLPFamily",
                           "--transformer_config_overrides", "{}", "--dry-run"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "which model family 'pixel_mlp' cannot do" in proc.stderr
