"""The training loop's contract with its users: what a run writes, how it stops on a bad
number, and what `relay sample | eval | export` make of its checkpoints.

Training runs are real `python trainer/train.py` processes of the tiny configuration of the
`tiny_trainer` fixture (tests/conftest.py); the relay commands run in-process through
launcher.cli.main, except one through the installed `relay` script.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from launcher.cli import main as relay_main
from trainer.checkpoint.layout import list_checkpoints, validate_checkpoint

RELAY = Path(sys.executable).with_name("relay")
METRIC_KEYS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "host_mem_gb",
               "peak_device_mem_gb")
SECRET = "secret-test-key"


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# The output directory
# ---------------------------------------------------------------------------------------------

def test_a_completed_run_writes_the_output_dir_contract(tiny_trainer):
    out = tiny_trainer.reference()

    resolved = json.loads((out / "resolved-config.json").read_text())
    assert resolved["output_dir"] == str(out) and resolved["max_steps"] == 12
    manifest = json.loads((out / "launch-manifest.json").read_text())
    for key in ("host", "world_size", "ranks_per_node", "git_commit", "python", "torch", "argv",
                "started_at"):
        assert key in manifest, key
    assert manifest["world_size"] == 1
    assert isinstance(manifest["environment"], dict) and manifest["environment"]

    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, 13))
    for record in records:
        for key in METRIC_KEYS:
            assert isinstance(record.get(key), (int, float)) and math.isfinite(record[key]), \
                (record["step"], key, record.get(key))
        assert record["tokens_per_s"] > 0 and record["step_time_s"] > 0
        assert record["host_mem_gb"] > 0 and record["grad_norm"] > 0
    # lr (AdamW) and muon_lr (where Muon is on) are the rates the step trained with: with 4
    # warm-up steps, steps 1..4 train at 1/4 .. 4/4 of the peak.
    peaks = {"lr": resolved["learning_rate"]}
    if resolved["use_muon"]:
        peaks["muon_lr"] = resolved["muon_learning_rate"]
    for key, peak in peaks.items():
        assert [r[key] for r in records[:4]] == \
            pytest.approx([peak * k / 4 for k in (1, 2, 3, 4)], rel=1e-12), key

    result = json.loads((out / "run-result.json").read_text())
    assert result == {"status": "completed", "step": 12, "error": None,
                      "last_checkpoint": str(out / "checkpoint-12")}
    info = validate_checkpoint(out / "checkpoint-12")
    assert set(info["members"]) == {"transformer", "optimizer"}
    assert (out / "checkpoint-12" / "resolved-config.json").is_file()


# ---------------------------------------------------------------------------------------------
# Non-finite numbers
# ---------------------------------------------------------------------------------------------

def _write_nan_copy(data_dir: Path, nan_dir: Path) -> None:
    """The same rows in the real schema (trainer.data.synthetic.DATASET_SCHEMA), latents all NaN."""
    from trainer.data.synthetic import DATASET_SCHEMA

    nan_dir.mkdir(parents=True)
    for shard in sorted(data_dir.glob("*.parquet")):
        rows = pq.read_table(shard).to_pylist()
        for row in rows:
            row["vae_latent_bytes"] = np.full(row["vae_latent_shape"], np.nan, np.float32).tobytes()
        pq.write_table(pa.Table.from_pylist(rows, schema=DATASET_SCHEMA), nan_dir / shard.name)


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_leaves_checkpoints_untouched(
        tiny_trainer, tmp_path):
    reference = tiny_trainer.reference()
    out = tmp_path / "nan-run"
    shutil.copytree(reference, out)
    for path in list_checkpoints(out)[1:]:
        shutil.rmtree(path)
    before = _digests(out / "checkpoint-2")
    assert before == _digests(reference / "checkpoint-2")
    nan_data = tmp_path / "nan-data"
    _write_nan_copy(tiny_trainer.data_path, nan_data)

    # Resumes from checkpoint-2 (same data size and cursor; the data changed on purpose), then
    # meets NaN latents at step 3.
    proc = tiny_trainer.run(out, "--synthetic_data", "false", "--data_path", str(nan_data),
                            "--allow_data_change", "true")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "non-finite loss=nan" in proc.stderr and "at step 3;" in proc.stderr
    assert "Traceback" not in proc.stderr
    result = json.loads((out / "run-result.json").read_text())
    assert result["status"] == "failed" and "at step 3" in result["error"]
    assert [p.name for p in sorted(out.iterdir()) if p.name.startswith("checkpoint")] == \
        ["checkpoint-2"]
    assert _digests(out / "checkpoint-2") == before
    assert max(r["step"] for r in _records(out)) == 2


def test_a_non_finite_loss_raises_before_the_optimizer_step_changes_any_weight(
        tiny_trainer, tmp_path):
    import torch

    from trainer.resolve import resolve_args
    from trainer.parallel.distributed import Topology
    from trainer.stages.registry import build_stage
    from trainer.stages.base import NonFiniteError

    tiny_trainer.reference()  # generates the shared data
    nan_data = tmp_path / "nan-data"
    _write_nan_copy(tiny_trainer.data_path, nan_data)
    args, _ = resolve_args(tiny_trainer.args(tmp_path / "out", "--synthetic_data", "false",
                                             "--data_path", str(nan_data)), world_size=1)
    topo = Topology(rank=0, world_size=1, local_rank=0, cp_size=1, device=torch.device("cpu"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        stage = build_stage(args, topo)
        model, optimizer = stage.model, stage.optimizers["transformer"]
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        lr = optimizer.param_groups[0]["lr"]
        with pytest.raises(NonFiniteError, match=r"non-finite loss=nan.* at step 1;"):
            stage.train_step(1)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state  # AdamW never stepped
    assert optimizer.param_groups[0]["lr"] == lr  # nor did the LR schedule


@pytest.mark.parametrize("fused", [True, False], ids=["fused-adamw", "foreach-adamw"])
def test_a_non_finite_step_leaves_weights_and_adamw_moments_as_they_were(fused):
    """The fused AdamW relay uses on GPUs is handed the step before the host has read the loss
    and skips it on the device; the other optimizers step only after the check. Either way a
    NaN changes no weight, moment or step count, and is reported by name."""
    import torch

    from trainer.stages.base import NonFiniteError, clip_and_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused or None)
    x = torch.randn(5, 6)

    def backward(scale: float) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean() * scale
        loss.backward()
        return loss

    loss, norm = clip_and_step(1, model, optimizer, backward(1.0), max_grad_norm=1.0)
    assert loss > 0 and 0 < norm  # a good step is taken and reported
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{n: t.clone() for n, t in optimizer.state[p].items()} for p in model.parameters()]
    with pytest.raises(NonFiniteError, match=r"non-finite loss=nan, grad_norm=nan at step 2;"):
        clip_and_step(2, model, optimizer, backward(float("nan")), max_grad_norm=1.0)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    for p, before in zip(model.parameters(), moments):
        assert all(torch.equal(before[n], optimizer.state[p][n]) for n in before)
    assert float(optimizer.state[next(model.parameters())]["step"]) == 1.0


# ---------------------------------------------------------------------------------------------
# One run with W&B (offline), image conditioning and validation
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def feature_run(tiny_trainer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("features") / "run"
    env = tiny_trainer.env(WANDB_MODE="offline", WANDB_API_KEY=SECRET, WANDB_SILENT="true")
    proc = tiny_trainer.run(out, "--max_steps", "4", "--report_to", "wandb",
                            "--image_cond_prob", "1.0", "--validation_interval", "2",
                            "--validation_num_captions", "2", "--validation_steps", "2",
                            env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (out.parent / "train.out").write_text(proc.stdout + proc.stderr)
    return out


def test_wandb_offline_run_lands_in_output_dir_and_no_file_holds_the_api_key(feature_run):
    runs = list((feature_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((feature_run / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())
    leaks = [str(p) for p in [*feature_run.rglob("*"), feature_run.parent / "train.out"]
             if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []


def test_a_resumed_run_logs_on_into_the_same_wandb_run(tiny_trainer, tmp_path):
    out = tmp_path / "run"
    env = tiny_trainer.env(WANDB_MODE="offline", WANDB_SILENT="true")
    for steps in ("2", "4"):  # the second start resumes from checkpoint-2, as a requeue does
        proc = tiny_trainer.run(out, "--max_steps", steps, "--report_to", "wandb", env=env,
                                timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((out / "run-result.json").read_text())["step"] == 4
    run_id = (out / "wandb-run-id").read_text().strip()
    attempts = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(name.endswith(f"-{run_id}") for name in attempts), attempts
    # Started afresh in the same directory (its checkpoints gone), it is a new W&B run: in the
    # old one, W&B would drop its steps 1-4 as logged already.
    for checkpoint in out.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)
    proc = tiny_trainer.run(out, "--max_steps", "2", "--report_to", "wandb", env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "wandb-run-id").read_text().strip() != run_id


def test_validation_writes_its_manifest_last_and_its_scores_into_metrics(feature_run):
    step_dir = feature_run / "samples" / "step-2"
    manifest_path = step_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["step"] == 2 and len(manifest["captions"]) == 2
    live = manifest["weights"]["live"]
    files = [live["files"]["grid"], live["files"]["frames"], *live["files"]["videos"]]
    assert all(Path(f).is_file() for f in files), files
    others = [p for p in step_dir.rglob("*") if p.is_file() and p != manifest_path]
    assert max(p.stat().st_mtime_ns for p in others) <= manifest_path.stat().st_mtime_ns
    assert not list(step_dir.glob("*.tmp"))
    record = next(r for r in _records(feature_run) if r["step"] == 2)
    assert record["val/live/colour_accuracy"] == live["colour_accuracy"]
    assert record["val/live/direction_accuracy"] == live["direction_accuracy"]
    assert (feature_run / "samples" / "step-4" / "manifest.json").is_file()  # and the last step


def test_each_validation_step_has_one_captioned_grid_of_all_its_clips(feature_run):
    from PIL import Image

    for step in (2, 4):
        step_dir = feature_run / "samples" / f"step-{step}"
        manifest = json.loads((step_dir / "manifest.json").read_text())
        assert manifest["grid"] == str(step_dir / "grid.png")
        # 2 captions in one row of 4 panels (8 frames of 16 px at 2x), live weights only.
        assert Image.open(step_dir / "grid.png").size == (8 + 4 * (8 * 32 + 7 * 2 + 8),
                                                          8 + 22 + (32 + 28 + 8) + 8)


def test_image_conditioned_run_trains_and_relay_sample_continues_the_given_first_frame(
        feature_run, tmp_path):
    from PIL import Image

    assert json.loads((feature_run / "run-result.json").read_text())["status"] == "completed"
    assert all(math.isfinite(r["loss"]) for r in _records(feature_run))
    rng = np.random.default_rng(7)
    small = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    image = tmp_path / "first.png"
    Image.fromarray(small.repeat(2, axis=0).repeat(2, axis=1)).save(image)  # 32x32, 2x2 blocks

    out = tmp_path / "clip"
    proc = subprocess.run([str(RELAY), "sample", "--checkpoint", str(feature_run), "--steps", "2",
                           "--prompt", "a red square moving left", "--first-frame", str(image),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    frames = np.load(out / "frames.npy")
    assert frames.dtype == np.uint8 and frames.shape == (8, 16, 16, 3)
    assert np.array_equal(frames[0], small)
    assert not np.array_equal(frames[1], small)  # the rest is generated, not copied


# ---------------------------------------------------------------------------------------------
# relay sample | eval | export
# ---------------------------------------------------------------------------------------------

def _relay(capsys, *argv: str) -> tuple[int, str, str]:
    code = relay_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_relay_sample_writes_video_contact_sheet_and_frames_from_a_checkpoint_or_output_dir(
        tiny_trainer, tmp_path, capsys):
    reference = tiny_trainer.reference()
    clips = {}
    for name, source in (("checkpoint", reference / "checkpoint-12"), ("output_dir", reference)):
        out = tmp_path / name
        code, stdout, stderr = _relay(capsys, "sample", "--checkpoint", str(source), "--steps", "2",
                                      "--prompt", "a green circle moving up", "--out", str(out))
        assert code == 0, stderr
        videos = [p for p in (out / "sample.mp4", out / "sample.gif") if p.is_file()]
        assert len(videos) == 1 and videos[0].stat().st_size > 0
        assert (out / "frames.png").stat().st_size > 0
        clips[name] = np.load(out / "frames.npy")
        assert clips[name].dtype == np.uint8 and clips[name].shape == (8, 16, 16, 3)
    # An output_dir means its newest checkpoint: the same seed gives the same clip.
    assert np.array_equal(clips["checkpoint"], clips["output_dir"])


def test_relay_eval_writes_accuracies_and_a_per_caption_table(tiny_trainer, tmp_path, capsys):
    from trainer.evaluation.evaluate import EVAL_CAPTIONS

    path = tmp_path / "eval.json"
    code, stdout, stderr = _relay(capsys, "eval", "--checkpoint", str(tiny_trainer.reference()),
                                  "--steps", "2", "--out", str(path))
    assert code == 0, stderr
    report = json.loads(path.read_text())
    assert report["step"] == 12 and report["weights"] == "live"
    rows = report["per_caption"]
    assert [row["caption"] for row in rows] == list(EVAL_CAPTIONS)
    for row in rows:
        # "a red square moving left": what is expected comes from the caption's own words,
        # and a row is right exactly when the detection says the same.
        words = row["caption"].split()
        assert (row["expected_colour"], row["expected_direction"]) == (words[1], words[-1])
        assert row["colour_ok"] == (row["detected_colour"] == row["expected_colour"])
        assert row["direction_ok"] == (row["detected_direction"] == row["expected_direction"])
    # The accuracies are the table's: the fraction of its rows that are right.
    assert report["colour_accuracy"] == sum(r["colour_ok"] for r in rows) / len(rows)
    assert report["direction_accuracy"] == sum(r["direction_ok"] for r in rows) / len(rows)
    assert str(path) in stdout


def test_relay_export_writes_weights_and_config_that_rebuild_the_same_model(
        tiny_trainer, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    from trainer.evaluation.inference import load_model_for_inference
    from trainer.models.dit.module import VideoDiT

    checkpoint = tiny_trainer.reference() / "checkpoint-12"
    out = tmp_path / "export" / "model.safetensors"
    code, stdout, stderr = _relay(capsys, "export", str(checkpoint), "--out", str(out))
    assert code == 0, stderr
    config = json.loads((out.parent / "model_config.json").read_text())
    exported = VideoDiT(**config)
    exported.load_state_dict(load_file(str(out)), strict=True)
    exported.eval()
    trained = load_model_for_inference(checkpoint, "live").model
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 16, 16, generator=generator)
    text = torch.randn(2, 8, 32, generator=generator)
    mask = torch.ones(2, 8, dtype=torch.bool)
    t = torch.tensor([250.0, 750.0])
    with torch.no_grad():
        assert torch.equal(exported(x, t, text, mask), trained(x, t, text, mask))


def test_relay_export_refuses_existing_files_without_force_and_leaves_no_temporary(
        tiny_trainer, tmp_path, capsys):
    checkpoint = tiny_trainer.reference() / "checkpoint-12"
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    code, _, stderr = _relay(capsys, "export", str(checkpoint), "--out", str(out))
    assert code == 2 and "already exists" in stderr and "--force" in stderr
    assert "Traceback" not in stderr and out.read_bytes() == b"keep me"
    code, _, stderr = _relay(capsys, "export", str(checkpoint), "--out", str(out), "--force")
    assert code == 0, stderr
    assert out.read_bytes() != b"keep me"
    code, _, stderr = _relay(capsys, "export", str(checkpoint), "--out", str(tmp_path))
    assert code == 2 and "is a directory" in stderr and "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model_config.json"]


def test_relay_commands_reject_bad_paths_with_exit_2_and_a_message(tmp_path, capsys):
    empty = tmp_path / "empty-run"
    empty.mkdir()
    missing = tmp_path / "missing"
    cases = [
        ("sample", "--checkpoint", str(missing), "--prompt", "a red square moving left",
         "--out", str(tmp_path / "s")),
        ("eval", "--checkpoint", str(empty)),
        ("export", str(missing), "--out", str(tmp_path / "m.safetensors")),
        ("export", str(empty), "--out", str(tmp_path / "m.safetensors")),
    ]
    for argv in cases:
        code, _, stderr = _relay(capsys, *argv)
        assert code == 2, (argv, stderr)
        assert f"relay {argv[0]}:" in stderr and ("does not exist" in stderr
                                                  or "no complete checkpoint" in stderr), stderr
        assert "Traceback" not in stderr


def test_relay_sample_rejects_an_unreadable_first_frame_with_exit_2(tiny_trainer, tmp_path,
                                                                    capsys):
    bad = tmp_path / "not-an-image.png"
    bad.write_text("hello")
    code, _, stderr = _relay(capsys, "sample", "--checkpoint", str(tiny_trainer.reference()),
                             "--prompt", "a red square moving left", "--first-frame", str(bad),
                             "--out", str(tmp_path / "s"), "--steps", "1")
    assert code == 2 and f"cannot read --first-frame {bad}" in stderr


def test_validation_runs_every_interval_and_at_the_last_step_and_asks_sampling_once():
    from trainer.evaluation.validation import ValidationSettings
    from trainer.resolve import resolve_config
    from trainer.stages.registry import sampling_plan

    repo = Path(__file__).resolve().parents[1]

    def due(interval):
        args = resolve_config(str(repo / "config/tiny/stage1.yaml"),
                              {"validation_interval": interval, "max_steps": 10,
                               "validation_num_captions": 3}, cwd=repo, check_paths=False)
        settings = ValidationSettings.of(args)
        assert settings.plan == sampling_plan(args) and settings.num_captions == 3
        return [step for step in range(1, 11) if settings.due(step)]

    assert due(4) == [4, 8, 10]
    assert due(0) == [10]
    assert due(-1) == []
