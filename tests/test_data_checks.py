"""Issue 29, items 1, 2 and 7 (validation without a VAE): the data is checked before the job.

Broken data is refused by `train.py --dry-run`, `relay resolve` and `relay submit --dry-run`
(real processes, no torch needed for the check) in one paragraph per problem naming the file,
the key and the fix, every problem in one pass; a FastVideo directory of mixed shapes trains
with no extra key; validation of latents that nothing can decode is refused at --dry-run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from fixtures.fastvideo_t2v import T2V_SCHEMA, write_fastvideo_dataset

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny" / "pretrain.yaml")
TINY_SFT = str(ROOT / "config" / "tiny" / "sft.yaml")
# The fixture's data: 4-channel latents, 8-wide captions.
MODEL = ("{hidden_size: 16, num_attention_heads: 2, num_layers: 1, rope_axes_dim: [2, 2, 4], "
         "text_dim: 8, patch_size: [1, 2, 2], in_channels: 4}")
REAL_DATA = ("--transformer_config_overrides", MODEL, "--synthetic_data", "false",
             "--validation_interval", "-1")


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    return env


def dry_run(tmp_path: Path, data, *extra: str) -> subprocess.CompletedProcess:
    data = json.dumps({str(k): v for k, v in data.items()}) if isinstance(data, dict) else str(data)
    argv = [sys.executable, "trainer/train.py", "--config", TINY, "--output_dir",
            str(tmp_path / "out"), "--data_path", data, *REAL_DATA, *extra, "--dry-run"]
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("relay: config error:"), proc.stderr[-3000:]
    for word in words:
        assert word in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


@pytest.fixture
def data(tmp_path) -> Path:
    return write_fastvideo_dataset(tmp_path / "data", 12)


def test_a_truncated_shard_is_named_at_dry_run(tmp_path, data):
    shard = data / "worker_1" / "data_chunk_0.parquet"
    shard.write_bytes(shard.read_bytes()[:-300])  # the footer is gone, as after a killed copy
    refused(dry_run(tmp_path, data), str(shard), "not a readable parquet file",
            f"data_path entry {data}", "Write it again")


def test_a_mixture_entry_without_parquet_is_named_at_dry_run(tmp_path, data):
    empty = tmp_path / "dirB"
    empty.mkdir()
    refused(dry_run(tmp_path, {data: 1, empty: 2}),
            f"data_path entry `{empty}` (repeat 2) holds no *.parquet files")


def _rewrite_row(shard: Path, row: int, **values) -> None:
    rows = pq.read_table(shard).to_pylist()
    rows[row].update(values)
    pq.write_table(pa.Table.from_pylist(rows, schema=T2V_SCHEMA), shard, row_group_size=4)


def test_a_row_whose_shape_disagrees_with_its_bytes_is_named_at_dry_run(tmp_path, data):
    shard = data / "worker_0" / "data_chunk_0.parquet"
    row = pq.read_table(shard).to_pylist()[3]
    wrong = [4, 3, 4, 4]  # its bytes hold [4, 3, 4, 6] (bfloat16: 576 bytes)
    assert row["vae_latent_shape"] == [4, 3, 4, 6]
    _rewrite_row(shard, 3, vae_latent_shape=wrong)
    refused(dry_run(tmp_path, data), f"{shard}, row 3 (id {row['id']})",
            "vae_latent_shape [4, 3, 4, 4] bfloat16 needs 384 bytes but vae_latent_bytes holds 576")


def test_latent_channels_and_caption_width_that_the_model_does_not_take_name_the_key(tmp_path, data):
    model = MODEL.replace("text_dim: 8", "text_dim: 32").replace("in_channels: 4", "in_channels: 8")
    message = refused(dry_run(tmp_path, data, "--transformer_config_overrides", model),
                      "have 4 channels", "in_channels is 8", "Set in_channels: 4 in "
                      "transformer_config_overrides", "are 8 wide", "text_dim is 32",
                      "Set text_dim: 8", str(data / "worker_0" / "data_chunk_0.parquet"))
    assert "2 problems" in message


def test_every_problem_of_one_data_path_is_named_in_one_pass(tmp_path, data):
    truncated = data / "worker_1" / "data_chunk_0.parquet"
    truncated.write_bytes(truncated.read_bytes()[:100])
    empty = tmp_path / "dirB"
    empty.mkdir()
    resolve = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "resolve", TINY, "--output_dir",
         str(tmp_path / "o"), "--data_path", json.dumps({str(data): 1, str(empty): 2}),
         *REAL_DATA, "--transformer_config_overrides", MODEL.replace("in_channels: 4", "in_channels: 3")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    refused(resolve, "3 problems", str(truncated), f"`{empty}`", "Set in_channels: 4")


def test_a_pipeline_with_two_broken_stages_names_every_problem_in_one_pass(tmp_path):
    first = write_fastvideo_dataset(tmp_path / "d1", 12)
    second = write_fastvideo_dataset(tmp_path / "d2", 12)
    truncated = first / "worker_0" / "data_chunk_0.parquet"
    truncated.write_bytes(truncated.read_bytes()[:-50])
    empty = tmp_path / "dirB"
    empty.mkdir()
    small = {"transformer_config_overrides": yaml.safe_load(MODEL), "synthetic_data": False,
             "validation_interval": -1, "max_steps": 2}
    pipeline = {
        "name": "t", "root": str(tmp_path / "runs"),
        "cluster": {"cpus_per_task": 1, "time": 10, "network": "none", "signal_lead_s": 60},
        "stages": {
            "pretrain": {"config": TINY, "overrides": {**small, "data_path": str(first)}},
            "sft": {"config": TINY_SFT, "overrides": {
                **small, "data_path": {str(second): 1, str(empty): 2},
                "transformer_config_overrides": {**small["transformer_config_overrides"],
                                                 "text_dim": 16},
                "pretrained_transformer_path": "${stages.pretrain.output_dir}"}},
        },
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(path), "--dry-run"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    for words in (str(truncated), f"`{empty}` (repeat 2) holds no *.parquet", "Set text_dim: 8"):
        assert words in out, out[-3000:]
    assert "stage pretrain" in out and "stage sft" in out, out[-3000:]


def test_fastvideo_data_of_mixed_shapes_trains_with_no_extra_key(tmp_path, data):
    plan = dry_run(tmp_path, data)
    assert plan.returncode == 0, plan.stderr[-3000:]
    line = next(l for l in plan.stderr.splitlines() if l.startswith("batches:"))
    # 3 shapes (two video sizes and images): packs, train_batch_size 2 x the largest 27 tokens
    assert "derived from the data" in line and "3 latent shapes" in line, line
    argv = [sys.executable, "trainer/train.py", "--config", TINY, "--output_dir",
            str(tmp_path / "run"), "--data_path", str(data), *REAL_DATA, "--max_steps", "2",
            "--train_batch_size", "2", "--warmup_steps", "0", "--log_interval", "1",
            "--save_interval", "2"]
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    cursor = json.loads((tmp_path / "run" / "checkpoint-2" / "dataloader" / "0.json").read_text())
    assert cursor["token_budget"] == 2 * 27  # video 3 x 2 x 3 at patch (1, 2, 2) + 9 caption


def test_validation_of_latents_without_a_vae_is_refused_at_dry_run(tmp_path, data):
    refused(dry_run(tmp_path, data, "--validation_interval", "100"),
            "would decode 4-channel latents with no VAE", "Set vae_path",
            "validation_interval: -1")
    assert dry_run(tmp_path, data).returncode == 0  # REAL_DATA turns validation off
