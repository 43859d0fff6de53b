"""trainer/warmup.py: the kernel-cache warm-up, on CPU with the tiny config at small shapes."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pytest
import torch

from trainer import warmup
from trainer.resolve import resolve_config
from trainer.data.synthetic import ensure_dataset
from trainer.stages import fm

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "config" / "tiny" / "pretrain.yaml")
SMALL = ["--train_batch_size", "2", "--synthetic_num_frames", "4", "--synthetic_height", "8",
         "--synthetic_width", "8"]


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["--output_dir", str(tmp_path / "out"), "--data_path", str(tmp_path / "data"),
            *SMALL, *extra]


@pytest.fixture
def captured_model(monkeypatch):
    """The model the warm-up builds, with a copy of its initial weights."""
    seen = {}
    build = warmup.build_model

    def recording_build(args, device, config=None):
        model = build(args, device, config)
        seen["model"] = model
        seen["initial"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model

    monkeypatch.setattr(warmup, "build_model", recording_build)
    return seen


def test_warm_up_runs_one_forward_backward_at_the_stage_shapes_and_writes_nothing(
        tmp_path, captured_model, caplog):
    caplog.set_level(logging.INFO, logger="relay")
    args = resolve_config(TINY, _argv(tmp_path))
    report = warmup.warm_up_kernels(args, "cpu")

    assert report["status"] == "ok" and report["stage"] == "fm"
    assert report["shapes"] == {"batch": 2, "latent": [3, 4, 8, 8], "text_tokens": 8,
                                "text_dim": 32, "video_tokens": (4 // 2) * 2 * 2}  # patch (2, 4, 4)
    assert math.isfinite(report["loss"])
    timings = report["timings_s"]
    assert timings["forward"] > 0 and timings["backward"] > 0
    assert timings["total"] >= timings["forward"] + timings["backward"]
    assert report["attention_backend"] == "auto" and report["compile_transformer"] is False
    # the backward ran, and no optimizer stepped: every weight is still its initial value
    model = captured_model["model"]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, captured_model["initial"][name]), name
    # neither the output_dir nor the synthetic dataset was created
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()
    messages = [r.getMessage() for r in caplog.records]
    assert "autotuning may take minutes on a cold cache" in messages[0]
    assert messages[-1].startswith("kernel warm-up: done")


def test_stage1_warm_up_runs_the_teacher_forcing_loss_of_the_two_time_model(tmp_path,
                                                                             monkeypatch):
    from trainer.models.dit.module import VideoDiT

    calls = []
    real = VideoDiT.forward_teacher_forcing

    def recording(self, noisy, clean, *args, **kwargs):
        calls.append((tuple(noisy.shape), tuple(clean.shape), kwargs.get("r") is not None))
        return real(self, noisy, clean, *args, **kwargs)

    monkeypatch.setattr(VideoDiT, "forward_teacher_forcing", recording)
    stage1 = str(REPO / "config" / "tiny" / "stage1.yaml")
    args = resolve_config(stage1, _argv(tmp_path, "--pretrained_transformer_path",
                                        str(tmp_path / "sft")), check_paths=False)
    report = warmup.warm_up_kernels(args, "cpu")

    assert report["status"] == "ok" and report["stage"] == "tf_anyflow"
    assert math.isfinite(report["loss"])
    # Teacher forcing on the batch's clips, with the second time r: the shapes Stage1 trains at.
    assert calls and all(c == ((2, 3, 4, 8, 8), (2, 3, 4, 8, 8), True) for c in calls), calls
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rollout_mode", ["simulate", "data_latent"])
def test_stage2_warm_up_runs_one_outer_step_of_all_three_roles(tmp_path, captured_model,
                                                                rollout_mode):
    stage2 = str(REPO / "config" / "tiny" / "stage2.yaml")
    sources = [f"--{role}_init_path={tmp_path / 'sources'}"
               for role in ("student", "teacher", "critic")]
    args = resolve_config(stage2, _argv(tmp_path, *sources, "--rollout_mode", rollout_mode,
                                        "--zero_init_modulation", "false"), check_paths=False)
    report = warmup.warm_up_kernels(args, "cpu")

    assert report["status"] == "ok" and report["stage"] == "dmd_sgf"
    assert math.isfinite(report["loss"])
    # The backward reached the causal student (the model the warm-up builds) through its
    # replay. Without zero-init modulation the teacher and the critic disagree, so the DMD
    # gradient, and with it the student's, is not zero. No optimizer step was taken.
    student = captured_model["model"]
    assert student.cfg.causal_chunk_size
    assert all(p.grad is not None for p in student.blocks.parameters())
    assert any(p.grad.abs().sum() > 0 for p in student.blocks.parameters())
    for name, value in student.state_dict().items():
        assert torch.equal(value, captured_model["initial"][name]), name
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage", ["pretrain", "stage1", "stage2"])
def test_every_stage_runs_with_gradient_checkpointing_and_the_same_loss(tmp_path, stage):
    # The warm-up runs a stage's own loss on the model prepare_for_training made, from the
    # seed: checkpointing must change the memory, not the numbers. Stage2 covers the no-grad
    # rollout with its KV cache, the replay with grad and the frozen teacher.
    extra = {"pretrain": [], "stage1": ["--pretrained_transformer_path", str(tmp_path)],
             "stage2": [f"--{role}_init_path={tmp_path}"
                        for role in ("student", "teacher", "critic")]}[stage]
    config = str(REPO / "config" / "tiny" / f"{stage}.yaml")
    losses, saved = {}, {}
    for on in ("false", "true"):
        args = resolve_config(config, _argv(tmp_path, *extra, "--enable_gradient_checkpointing",
                                            on), check_paths=False)
        saved[on] = 0

        def pack(tensor, on=on):
            saved[on] += tensor.numel() * tensor.element_size()
            return tensor

        # What the backward keeps is what checkpointing changes: the warm-up must measure it.
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            losses[on] = warmup.warm_up_kernels(args, "cpu")["loss"]
    assert math.isfinite(losses["true"]) and losses["true"] == losses["false"]
    assert saved["true"] < 0.5 * saved["false"], saved


def test_latent_shape_comes_from_the_first_parquet_row(tmp_path):
    data = tmp_path / "parquet"
    ensure_dataset(data, 4, seed=0, num_frames=2, height=8, width=8)
    args = resolve_config(TINY, ["--output_dir", str(tmp_path / "out"), "--data_path", str(data),
                                 "--synthetic_data", "false", "--train_batch_size", "3"])
    report = warmup.warm_up_kernels(args, "cpu")
    assert report["shapes"]["latent"] == [3, 2, 8, 8]
    assert report["shapes"]["batch"] == 3


def test_compile_transformer_compiles_every_block_and_counts_the_cache_files_it_adds(
        tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    cache.mkdir()
    (cache / "old-kernel").write_text("x")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    compiled = []

    def fake_compile(fn, **kwargs):
        # stands in for Inductor: records what is compiled and leaves an artifact in the cache
        compiled.append(fn.__name__)
        (cache / f"kernel-{len(compiled)}").write_text("x")
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    args = resolve_config(TINY, _argv(tmp_path, "--compile_transformer", "true"))
    report = warmup.warm_up_kernels(args, "cpu")

    layers = args.transformer_config_overrides["num_layers"]
    assert sorted(compiled) == sorted(["forward_text", "forward_video"] * layers)
    assert report["compile_transformer"] is True
    inductor = report["caches"]["TORCHINDUCTOR_CACHE_DIR"]
    assert inductor == {"path": str(cache), "files_before": 1, "files_after": 1 + 2 * layers,
                        "added": 2 * layers, "truncated": False}


def test_a_long_step_logs_a_heartbeat(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="relay")
    real_loss = fm.warmup_loss

    def slow_loss(*args):
        time.sleep(0.3)
        return real_loss(*args)

    monkeypatch.setattr(fm, "warmup_loss", slow_loss)  # what the stage's declaration names
    warmup.warm_up_kernels(resolve_config(TINY, _argv(tmp_path)), "cpu", heartbeat_s=0.05)
    assert any("still in the forward pass" in r.getMessage() for r in caplog.records)


def test_main_prints_the_report_and_writes_it_where_the_launcher_looks(tmp_path, monkeypatch,
                                                                       capsys):
    from launcher.job import WARMUP_REPORT_ENV

    target = tmp_path / "reports" / "warmup.json"
    monkeypatch.setenv(WARMUP_REPORT_ENV, str(target))  # what the warm-up job sets
    assert warmup.main(["--config", TINY, *_argv(tmp_path), "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["status"] == "ok" and printed["config"] == TINY
    assert json.loads(target.read_text()) == printed
    assert not (tmp_path / "out").exists()


def test_main_reports_a_failed_warm_up_with_exit_code_1(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("CUDA out of memory (pretend)")

    monkeypatch.setattr(fm, "warmup_loss", broken)
    target = tmp_path / "warmup.json"
    monkeypatch.setenv(warmup.REPORT_ENV, str(target))
    assert warmup.main(["--config", TINY, *_argv(tmp_path)]) == 1
    report = json.loads(target.read_text())
    assert report["status"] == "failed"
    assert report["error"] == "RuntimeError: CUDA out of memory (pretend)"
    assert json.loads(capsys.readouterr().out) == report


def test_main_rejects_a_bad_config_with_exit_code_2(tmp_path, capsys):
    assert warmup.main(["--config", TINY, *_argv(tmp_path), "--learning_rat", "1"]) == 2
    assert "learning_rate" in capsys.readouterr().err
