"""A pipeline that starts from raw media: an encode stage (`kind: encode`) turns a manifest of
real mp4 files into latents and caption embeddings through the tiny Wan's VAE and UMT5, two
ranks each encoding its share; one rank is stopped mid-way, the rerun redoes only the parts
that were not published, and SFT -> Stage1 -> Stage2 train on the output (`relay run`).
`relay submit --dry-run` renders the shipped raw-media chain as four chained jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

imageio = pytest.importorskip("imageio.v3")

from fixtures.raw_media import CLIPS, write_media
from trainer.models.wan import tiny

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "config" / "pipeline" / "wan-raw-tiny.yaml"


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _pipeline(tmp: Path) -> Path:
    """The shipped raw-media chain on the test's files, few steps a stage."""
    data = yaml.safe_load(PIPELINE.read_text())
    data["source"], data["manifest"] = str(tmp / "tiny-wan"), str(tmp / "media" / "manifest.csv")
    data["data"], data["root"] = str(tmp / "encoded"), str(tmp / "runs")
    encode = data["stages"]["encode"]
    encode.update(rows_per_shard=2)
    del encode["make_tiny_wan"], encode["demo_clips"]
    steps = {"log_interval": 1, "validation_interval": -1, "train_batch_size": 4,
             "save_total_limit": 0, "warmup_steps": 1}
    for name, stage in data["stages"].items():
        if name != "encode":
            stage["config"] = str(ROOT / stage["config"])
            stage["overrides"].update(steps, max_steps=2, save_interval=2)
    path = tmp / "raw.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _rank_process(parent: subprocess.Popen, rank: int, timeout: float = 120) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(parent.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "trainer.encode" in child.cmdline():
                    return child
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no encode rank {rank} under relay run")


def _wait_for(path: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_raw_media_encode_on_two_ranks_one_stopped_then_the_chain_trains_on_it(tmp_path):
    tiny.write_tiny_wan_pipeline(tmp_path / "tiny-wan")
    write_media(tmp_path / "media")
    pipeline = _pipeline(tmp_path)
    out = tmp_path / "encoded"
    # rank 1 stopped (SIGTERM) after its first part: the stage stops, saying how to go on
    run = subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", str(pipeline), "--only",
                            "encode"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    rank1 = _rank_process(run, 1)
    _wait_for(out / "part-r001-00000.json")
    rank1.send_signal(signal.SIGTERM)
    text, _ = run.communicate(timeout=300)
    assert run.returncode == 75, text[-3000:]
    assert "published every part it finished" in text and "--from encode" in text
    published = {p.name: p.stat().st_mtime_ns for p in out.glob("part-r*.json")}
    expected = 5 + 4  # rank 0: 9 entries in parts of 2; rank 1: 8 entries
    assert "part-r001-00000.json" in published and len(published) < expected
    assert not (out / "encode-summary.json").exists()
    # the rerun redoes only what was not published, then SFT -> Stage1 -> Stage2 read its shards
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "run", str(pipeline), "--from",
                           "encode"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = {p.name: p.stat().st_mtime_ns for p in out.glob("part-r*.json")}
    assert len(again) == expected
    assert {name: again[name] for name in published} == published  # not encoded twice
    summary = json.loads((out / "encode-summary.json").read_text())
    assert summary["encoded"] == CLIPS and summary["entries"] == CLIPS + 1
    assert [Path(b["path"]).name for b in summary["bad"]] == ["broken.mp4"]
    assert f"encode: {CLIPS} of {CLIPS + 1} files encoded" in proc.stdout
    for stage in ("sft", "stage1", "stage2"):
        result = json.loads((tmp_path / "runs" / stage / "run-result.json").read_text())
        assert result["status"] == "completed" and result["step"] == 2, stage
    sft = json.loads((tmp_path / "runs" / "sft" / "resolved-config.json").read_text())
    assert sft["data_path"] == str(out) and not sft["synthetic_data"]
    status = subprocess.run([sys.executable, "-m", "launcher.cli", "status",
                             str(tmp_path / "runs")], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=120)
    row = next(line for line in status.stdout.splitlines() if line.startswith("encode"))
    assert "COMPLETED" in row and f"{CLIPS + 1}/{CLIPS + 1}" in row, status.stdout


def test_the_shipped_raw_media_chain_renders_as_four_chained_jobs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(PIPELINE),
                           "--dry-run", "--root", str(tmp_path / "runs")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = proc.stdout
    assert "encode: 1 node(s) x 2 CPU ranks = world 2, 48 files" in plan
    assert "encode 48 files of" in plan and "24 a rank at most" in plan
    for stage, after in (("sft", "encode"), ("stage1", "sft"), ("stage2", "stage1")):
        assert f"  {stage}: " in plan and f"after {after} ->" in plan
    assert plan.count("#SBATCH --ntasks-per-node=2") == 1  # the encode job: one task a rank
    assert not (tmp_path / "runs").exists()  # validation writes nothing
