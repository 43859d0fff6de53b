"""benchmarks/flowmap_error.py, the Stage1 diagnostic, on tiny checkpoints a user's runs write."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL = ("in_channels: 3, hidden_size: 32, num_attention_heads: 2, num_layers: 2, "
         "patch_size: [1, 4, 4], rope_axes_dim: [4, 4, 8], text_dim: 32")


def run(*argv: str) -> None:
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """An FM teacher (3 steps) and a Stage1 student warm-started from it (2 steps)."""
    tmp = tmp_path_factory.mktemp("flowmap")
    data = ["--synthetic_num_samples", "32", "--data_path", str(tmp / "data"),
            "--validation_interval", "-1", "--train_batch_size", "4"]
    run("trainer/train.py", "--config", "config/tiny/pretrain.yaml", "--max_steps", "3",
        "--use_ema", "true", "--transformer_config_overrides", "{" + SMALL + "}",
        "--output_dir", str(tmp / "fm"), *data)
    run("trainer/train.py", "--config", "config/tiny/stage1.yaml", "--max_steps", "2",
        "--warmup_steps", "0", "--pretrained_transformer_path", str(tmp / "fm"),
        "--output_dir", str(tmp / "stage1"), *data, "--transformer_config_overrides",
        "{" + SMALL + ", causal_chunk_size: 2, two_time: true, time_gate: 0.25}")
    return tmp


def measure(runs: Path, student: str) -> dict:
    out = runs / f"{student}.json"
    run("benchmarks/flowmap_error.py", "--teacher", str(runs / "fm"), "--student",
        str(runs / student), "--samples", "2", "--ode-steps", "20", "--json", str(out))
    return json.loads(out.read_text())


def test_the_teacher_against_itself_has_no_flow_map_error(runs):
    found = measure(runs, "fm")
    # one row per jump of the 1-, 2- and 4-step samplers
    assert [(r["steps"], r["k"]) for r in found["rows"]] == [
        (1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    for row in found["rows"]:
        for key in ("map_w", "map_1", "self", "ode_w"):
            assert row[key] == 0.0, (row, key)


def test_a_stage1_student_is_measured_against_the_teachers_ode(runs):
    found = measure(runs, "stage1")
    assert found["student_two_time"] and found["guidance"] == 4.0
    for row in found["rows"]:
        assert all(math.isfinite(row[k]) for k in ("map_w", "map_1", "self", "ode_w")), row
        assert row["map_w"] > 0.0 and len(row["chunks_w"]) > 1
    assert set(found["means"]) == {"1", "2", "4", "all"}
