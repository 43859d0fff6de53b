"""A FastVideo-layout dataset of mixed shapes trains in packs through train.py, and resumes exactly."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.fastvideo_t2v import write_fastvideo_dataset

ROOT = Path(__file__).resolve().parents[1]
MODEL = ("{hidden_size: 16, num_attention_heads: 2, num_layers: 1, rope_axes_dim: [2, 2, 4], "
         "text_dim: 8, patch_size: [1, 2, 2], in_channels: 4}")


# Stage1 from scratch: the tiny model made causal and two-time, no SFT weights to start from;
# a constant LR, since the "killed" run's cosine would end at its own max_steps.
STAGE1 = ("--config", str(ROOT / "config" / "tiny" / "stage1.yaml"), "--transformer_config_overrides",
          MODEL[:-1] + ", causal_chunk_size: 2, two_time: true, time_gate: 0.25}",
          "--load_transformer_weights", "false", "--pretrained_transformer_path", "null",
          "--lr_scheduler_type", "constant")


def _train(data: Path, out: Path, max_steps: int, *extra: str, budget: str = "60") -> None:
    command = [sys.executable, str(ROOT / "trainer" / "train.py"),
               "--config", str(ROOT / "config" / "tiny" / "pretrain.yaml"),
               "--transformer_config_overrides", MODEL, "--synthetic_data", "false",
               "--data_path", str(data), "--output_dir", str(out), "--max_steps", str(max_steps),
               "--packing_token_budget", budget, "--packed_dataloader_num_workers", "2",
               "--warmup_steps", "2", "--log_interval", "1", "--save_interval", "2",
               "--validation_interval", "-1", "--deterministic", "true", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def fastvideo_data(tmp_path_factory):
    return write_fastvideo_dataset(tmp_path_factory.mktemp("fv-train"), 24, dtype=torch.bfloat16)


def test_mixed_shapes_train_in_packs_and_resume_on_the_same_trajectory(fastvideo_data, tmp_path):
    _train(fastvideo_data, tmp_path / "reference", 8)
    _train(fastvideo_data, tmp_path / "resumed", 4)   # the "kill": the run ends at step 4
    _train(fastvideo_data, tmp_path / "resumed", 8)   # and a new process resumes from checkpoint-4
    reference, resumed = _losses(tmp_path / "reference"), _losses(tmp_path / "resumed")
    assert sorted(reference) == list(range(1, 9))
    assert all(math.isfinite(v) for v in reference.values())
    assert [resumed[s] for s in range(5, 9)] == [reference[s] for s in range(5, 9)]
    cursor = json.loads((tmp_path / "resumed" / "checkpoint-8" / "dataloader" / "0.json").read_text())
    assert cursor["token_budget"] == 60 and cursor["cursor"]["batch"] == 8


def test_a_budget_derived_from_the_data_resumes_when_the_same_command_runs_again(fastvideo_data, tmp_path):
    # No packing_token_budget: the mixed shapes derive one. A requeued job runs the same command,
    # so the resume must derive the same budget before comparing it with the checkpoint's.
    _train(fastvideo_data, tmp_path / "reference", 6, budget="null")
    _train(fastvideo_data, tmp_path / "resumed", 4, budget="null")
    _train(fastvideo_data, tmp_path / "resumed", 6, budget="null")
    reference, resumed = _losses(tmp_path / "reference"), _losses(tmp_path / "resumed")
    assert [resumed[s] for s in (5, 6)] == [reference[s] for s in (5, 6)]
    cursor = json.loads((tmp_path / "resumed" / "checkpoint-6" / "dataloader" / "0.json").read_text())
    assert cursor["token_budget"] > 60  # derived from the data: batch size x the largest sample


def test_stage1_trains_in_packs_of_mixed_shapes_and_resumes_on_the_same_trajectory(fastvideo_data, tmp_path):
    _train(fastvideo_data, tmp_path / "reference", 6, *STAGE1)
    _train(fastvideo_data, tmp_path / "resumed", 4, *STAGE1)
    _train(fastvideo_data, tmp_path / "resumed", 6, *STAGE1)
    reference, resumed = _losses(tmp_path / "reference"), _losses(tmp_path / "resumed")
    assert sorted(reference) == list(range(1, 7))
    assert all(math.isfinite(v) for v in reference.values())
    assert [resumed[s] for s in (5, 6)] == [reference[s] for s in (5, 6)]
    records = [json.loads(line) for line in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()]
    # the packs' samples took every kind of time pair over the run
    assert {"loss_diffusion", "loss_consistency", "loss_flowmap"} <= set().union(*records)
