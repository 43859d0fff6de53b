"""`relay run`: the pipeline on this machine, stage after stage, without Slurm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = {"train_batch_size": 4, "synthetic_num_samples": 64, "log_interval": 1, "warmup_steps": 1,
        "validation_interval": -1}


def relay(*args: str, cwd: Path):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def pipeline(tmp_path: Path, pretrain_overrides: dict) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"name": "local", "stages": {
        "pretrain": {"config": str(ROOT / "config/tiny/pretrain.yaml"),
                     "overrides": {**TINY, "max_steps": 3, "data_path": "data-pretrain",
                                   **pretrain_overrides}},
        "sft": {"config": str(ROOT / "config/tiny/sft.yaml"),
                "overrides": {**TINY, "max_steps": 2, "data_path": "data-sft",
                              # SFT samples at its end (tiny), pretrain does not.
                              "validation_interval": 0, "validation_steps": 2,
                              "validation_num_captions": 2,
                              "pretrained_transformer_path": "${stages.pretrain.output_dir}"}},
    }}))
    return path


def test_run_trains_each_stage_in_turn_and_records_the_pipeline(tmp_path):
    marker = tmp_path / "pwned"
    hostile = f"$(touch {marker}); touch {marker}"
    proc = relay("run", str(pipeline(tmp_path, {"wandb_run_name": hostile})), "--root", "out",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = tmp_path / "out"
    record = json.loads((root / "pipeline.json").read_text())
    assert record["mode"] == "local"
    assert {n: (s["job_id"], s["depends_on"], s["sbatch"]) for n, s in record["stages"].items()} == \
        {"pretrain": (None, [], None), "sft": (None, ["pretrain"], None)}
    # Each stage's process, for `relay status` to tell a running stage from a killed one.
    assert all(isinstance(s["pid"], int) and s["pid_started"] > 0 and s["host"]
               for s in record["stages"].values())
    assert json.loads((root / "sft/run-result.json").read_text())["status"] == "completed"
    warm = json.loads((root / "sft/warm-start.json").read_text())
    assert str(root / "pretrain/checkpoint-3") in json.dumps(warm["source"])
    # Relative data paths resolve against the directory relay ran in.
    assert (tmp_path / "data-pretrain").is_dir()
    # Where the samples are, or how to score the stage.
    assert f"pretrain: no validation samples in {root / 'pretrain'}; score it with `relay eval " \
        f"--checkpoint {root / 'pretrain'}`" in proc.stdout
    # The tiny SFT validates its EMA, the teacher the distilling stages start from.
    assert f"sft: samples of step 2 in {root / 'sft/samples/step-2'} (ema colour" in proc.stdout
    assert not marker.exists()
    # And one picture of the whole run.
    assert f"relay run: plot of every stage: {root / 'plot.png'}" in proc.stdout
    assert (root / "plot.png").stat().st_size > 0

    status = relay("status", str(root), cwd=tmp_path)
    lines = status.stdout.splitlines()
    assert lines[1].split()[:4] == ["pretrain", "-", "COMPLETED", "3/3"]
    assert lines[2].split()[:4] == ["sft", "-", "COMPLETED", "2/2"]


def test_run_stops_at_the_first_failing_stage_with_a_clear_message(tmp_path):
    from trainer.data.synthetic import ensure_dataset

    # Readable data that passes every check before the job, too small for one batch of 4:
    # the stage fails when its loader starts.
    bad = ensure_dataset(tmp_path / "bad-data", 2, seed=0)
    proc = relay("run", str(pipeline(tmp_path, {"synthetic_data": False, "data_path": str(bad)})),
                 cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stage pretrain failed (training failed)" in proc.stdout
    assert "Later stages were not run" in proc.stdout
    assert not (tmp_path / "runs/local/sft").exists()


def test_run_refuses_an_invalid_pipeline_before_training(tmp_path):
    proc = relay("run", str(pipeline(tmp_path, {"max_step": 3})), cwd=tmp_path)
    assert proc.returncode == 2
    assert "stage pretrain:" in proc.stderr and "`max_steps`" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_samples_summary_reads_scores_at_the_top_or_per_weights(tmp_path):
    from types import SimpleNamespace

    from launcher.local import describe_samples

    for step, manifest in ((5, {"colour_accuracy": 1.0, "direction_accuracy": 0.5}),
                           (10, {"weights": {"live": {"colour_accuracy": 0.25,
                                                      "direction_accuracy": 0.75},
                                             "ema": {"colour_accuracy": 1.0,
                                                     "direction_accuracy": 1.0}}})):
        (tmp_path / f"samples/step-{step}").mkdir(parents=True)
        (tmp_path / f"samples/step-{step}/manifest.json").write_text(json.dumps(manifest))
    text = describe_samples(SimpleNamespace(name="sft", output_dir=str(tmp_path)))
    assert text == (f"sft: samples of step 10 in {tmp_path / 'samples/step-10'} "
                    f"(live colour 25%, direction 75%; ema colour 100%, direction 100%)")
