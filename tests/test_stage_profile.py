"""benchmarks/stage_profile.py: train.py's stage timed and profiled, on the tiny config (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_profile_of_a_stage_names_its_optimizer_and_matrix_products(tmp_path):
    out = tmp_path / "profile"
    proc = subprocess.run(
        [sys.executable, "benchmarks/stage_profile.py", "--out", str(out), "--warmup", "1",
         "--steps", "2", "--profile-steps", "1", "--", "--config", "config/tiny/pretrain.yaml",
         "--data_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["stage"] == "fm"
    assert 0 < report["min_step_s"] <= report["median_step_s"]
    host = (out / "host.txt").read_text()
    assert "Optimizer.step" in host and "aten::mm" in host  # the whole step was profiled
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("checkpoint-*"))


def test_without_a_train_command_line_it_says_what_to_give():
    proc = subprocess.run([sys.executable, "benchmarks/stage_profile.py", "--out", "x"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "after `--`" in proc.stderr
