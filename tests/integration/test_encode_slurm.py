"""An encode stage as a real Slurm job of two tasks (the local cluster): rank 1 is signalled
after publishing its first part, rank 0 finishes its own share, sees rank 1 stopped and
requeues the job, the requeued job redoes only the unpublished parts, and the SFT stage chained
after it (afterok) trains on the shards."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import yaml

from fixtures.raw_media import CLIPS, write_media
from integration.test_pipeline_slurm import rank_processes, relay, unique, wait_final
from trainer.models.wan import tiny

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]


def test_a_signalled_encode_rank_requeues_the_job_and_sft_trains_on_the_shards(slurm_cluster,
                                                                                tmp_path):
    name = unique("relay-it-encode-")
    source = tiny.write_tiny_wan_pipeline(tmp_path / "tiny-wan")
    manifest = write_media(tmp_path / "media")
    data = tmp_path / "encoded"
    pipeline = {
        "name": name, "root": str(tmp_path / "runs"),
        "cluster": {"cpus_per_task": 1, "mem": "2G", "time": 10, "network": "none",
                    "signal_lead_s": 60, "max_requeues": 2},
        "stages": {
            "encode": {"kind": "encode", "manifest": str(manifest), "pipeline": str(source),
                       "output_dir": str(data), "rows_per_shard": 2,
                       "resources": {"tasks_per_node": 2}},
            "sft": {"config": str(ROOT / "config" / "wan" / "tiny-sft.yaml"), "overrides": {
                "pretrained_transformer_path": str(source), "data_path": str(data),
                "synthetic_data": False, "max_steps": 2, "save_interval": 2,
                "train_batch_size": 4, "warmup_steps": 1, "validation_interval": -1}}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    proc = relay("submit", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = json.loads((tmp_path / "runs" / "pipeline.json").read_text())["stages"]
    encode, sft = jobs["encode"]["job_id"], jobs["sft"]["job_id"]
    ranks = {int(p.environ()["SLURM_PROCID"]): p for p in rank_processes(encode, 2, timeout=120)}
    deadline = time.monotonic() + 180
    while not (data / "part-r001-00000.json").exists():
        assert time.monotonic() < deadline, "rank 1 published no part"
        time.sleep(0.02)
    ranks[1].send_signal(signal.SIGUSR2)  # one rank preempted, the other runs on
    first = {p.name: p.stat().st_mtime_ns for p in data.glob("part-r*.json")}
    assert wait_final([encode, sft], timeout=600) == {encode: "COMPLETED", sft: "COMPLETED"}
    logs = "".join(p.read_text() for p in (data / "slurm").glob(f"{encode}_*_log.*"))
    assert "rank(s) [1] stopped before their share was done" in logs
    after = {p.name: p.stat().st_mtime_ns for p in data.glob("part-r*.json")}
    assert {n: after[n] for n in first} == first and len(after) == 9  # nothing encoded twice
    summary = json.loads((data / "encode-summary.json").read_text())
    assert summary["encoded"] == CLIPS and len(summary["bad"]) == 1
    status = relay("status", str(tmp_path / "runs")).stdout.splitlines()
    row = next(line.split() for line in status if line.startswith("encode"))
    assert row[2:4] == ["COMPLETED", f"{CLIPS + 1}/{CLIPS + 1}"] and row[6] == "1"  # requeued once
    result = json.loads((tmp_path / "runs" / "sft" / "run-result.json").read_text())
    assert result["status"] == "completed" and result["step"] == 2
