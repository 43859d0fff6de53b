"""`relay status` and pipeline.json, from files and canned Slurm answers (no Slurm needed)."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.pipeline import validate_pipeline
from launcher.record import build_record, read_record, write_record
from launcher.slurm import JobInfo, parse_sacct, parse_squeue
from launcher.status import (read_last_json_line, read_progress, render_status_table,
                             stage_status)

ROOT = Path(__file__).resolve().parents[1]


def test_sacct_lines_of_a_requeued_job_count_its_requeues():
    text = ("41|REQUEUED|0:0|00:00:12|None\n"
            "41|COMPLETED|0:0|00:00:30|None\n"
            "42|CANCELLED by 0|0:0|00:00:00|DependencyNeverSatisfied\n")
    jobs = parse_sacct(text)
    assert jobs["41"] == JobInfo("41", "COMPLETED", "0:0", "00:00:30", None, 1)
    assert jobs["42"].state == "CANCELLED" and jobs["42"].reason == "DependencyNeverSatisfied"
    assert jobs["42"].requeues == 0


def test_squeue_lines_give_state_and_pending_reason():
    jobs = parse_squeue("43|PENDING|Dependency|0:00\n44|RUNNING|None|1:02\n")
    assert (jobs["43"].state, jobs["43"].reason) == ("PENDING", "Dependency")
    assert (jobs["44"].state, jobs["44"].reason, jobs["44"].elapsed) == ("RUNNING", None, "1:02")


def test_last_json_line_skips_a_line_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert read_last_json_line(path) == {"step": 2, "loss": 1.5}
    assert read_last_json_line(tmp_path / "missing.jsonl") is None


def test_progress_reads_step_loss_max_steps_and_newest_complete_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 0.25}\n')
    (tmp_path / "resolved-config.json").write_text(json.dumps({"max_steps": 9}))
    for step, complete in ((3, True), (5, True), (7, False)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "COMPLETE").write_text("{}")
    progress = read_progress(tmp_path)
    assert (progress.step, progress.loss, progress.max_steps, progress.checkpoint) == \
        (5, 0.25, 9, "checkpoint-5")


def test_failed_stage_row_names_the_trainer_error_and_its_log(tmp_path):
    out = tmp_path / "pretrain"
    (out / "slurm").mkdir(parents=True)
    (out / "slurm" / "7_0_log.out").write_text("...")
    (out / "run-result.json").write_text(json.dumps(
        {"status": "failed", "step": 0, "error": "data_path /x does not exist"}))
    row = stage_status("pretrain", {"output_dir": str(out), "job_id": "7", "max_steps": 6},
                       JobInfo("7", "FAILED", "1:0", "00:00:03"), {})
    assert row.state == "FAILED"
    assert row.reason == "train.py: data_path /x does not exist"
    assert row.log == str(out / "slurm" / "7_0_log.out")


def test_stage_cancelled_by_its_failed_dependency_says_so(tmp_path):
    entry = {"output_dir": str(tmp_path / "sft"), "job_id": "8", "depends_on": ["pretrain"]}
    row = stage_status("sft", entry, JobInfo("8", "CANCELLED", "0:0", "00:00:00",
                                             "DependencyNeverSatisfied"), {"pretrain": "FAILED"})
    assert row.reason.startswith("not run: pretrain did not complete")
    table = render_status_table([row])
    assert "sft: not run: pretrain did not complete" in table


def test_local_stage_state_comes_from_run_result(tmp_path):
    (tmp_path / "run-result.json").write_text(json.dumps({"status": "completed", "step": 4}))
    row = stage_status("a", {"output_dir": str(tmp_path), "job_id": None}, None, {})
    assert (row.state, row.step, row.reason) == ("COMPLETED", 4, None)
    row = stage_status("b", {"output_dir": str(tmp_path / "nothing"), "job_id": None}, None, {})
    assert row.state == "NOT RUN"


def test_status_table_has_one_row_per_stage_in_order():
    rows = [stage_status(n, {"output_dir": f"/nonexistent/{n}", "job_id": j}, info, {})
            for n, j, info in (("pretrain", "1", JobInfo("1", "RUNNING", elapsed="0:05")),
                               ("sft", "2", JobInfo("2", "PENDING", reason="Dependency")))]
    lines = render_status_table(rows).splitlines()
    assert lines[0].split() == ["stage", "job", "state", "step", "loss", "checkpoint", "requeues",
                                "elapsed"]
    assert lines[1].split()[:3] == ["pretrain", "1", "RUNNING"]
    assert lines[2].split()[:3] == ["sft", "2", "PENDING"]


def test_pipeline_record_follows_the_contract_and_keeps_earlier_stages(tmp_path):
    pipeline = validate_pipeline(ROOT / "config/pipeline/tiny.yaml", root=str(tmp_path), cwd=ROOT,
                                 check_paths=False)
    record = build_record(pipeline, {"pretrain": {"job_id": "10", "sbatch": "/s/p.sbatch"},
                                     "sft": {"job_id": "11", "sbatch": "/s/s.sbatch"}},
                          mode="slurm")
    write_record(tmp_path, record)
    back = read_record(tmp_path)
    assert back["pipeline"] == str(ROOT / "config/pipeline/tiny.yaml")
    assert "submitted_at" in back
    assert list(back["stages"]) == ["pretrain", "sft", "stage1", "stage2"]  # pipeline order
    assert back["stages"]["stage1"]["job_id"] is None  # not launched in this submission
    assert back["stages"]["sft"] == {**back["stages"]["sft"], "output_dir": str(tmp_path / "sft"),
                                     "job_id": "11", "depends_on": ["pretrain"],
                                     "sbatch": "/s/s.sbatch"}
    assert back["stages"]["pretrain"]["depends_on"] == []

    # A later `--from sft` keeps pretrain's entry from the first submission.
    later = validate_pipeline(ROOT / "config/pipeline/tiny.yaml", root=str(tmp_path), cwd=ROOT,
                              from_stage="sft", check_paths=False)
    again = build_record(later, {"sft": {"job_id": "12", "sbatch": None}}, mode="slurm",
                         previous=back)
    assert again["stages"]["pretrain"]["job_id"] == "10"
    assert again["stages"]["sft"]["job_id"] == "12" and again["stages"]["sft"]["depends_on"] == []


def _stage_process(tmp_path: Path):
    """A real process standing in for a stage's trainer, and the entry relay run records."""
    import socket
    import subprocess
    import sys

    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    entry = {"output_dir": str(tmp_path), "job_id": None, "max_steps": 9, "pid": child.pid,
             "pid_started": psutil.Process(child.pid).create_time(),
             "host": socket.gethostname()}
    return child, entry


def test_a_local_stage_is_running_from_its_start_and_shows_its_newest_checkpoint(tmp_path):
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "COMPLETE").write_text("{}")
    child, entry = _stage_process(tmp_path)
    try:
        row = stage_status("sft", entry, None, {})
        # No metrics line yet (building, or resuming): running, at its checkpoint's step.
        assert (row.state, row.step, row.max_steps, row.checkpoint) == \
            ("RUNNING", 5, 9, "checkpoint-5")
        assert row.reason is None
        assert render_status_table([row]).splitlines()[1].split()[:4] == \
            ["sft", "-", "RUNNING", "5/9"]
    finally:
        child.kill()
        child.wait()
    row = stage_status("sft", entry, None, {})
    assert row.state == "STOPPED"
    assert "ended without writing run-result.json" in row.reason and "--from sft" in row.reason


def test_a_previous_attempts_result_does_not_hide_the_running_one(tmp_path):
    import os

    result = tmp_path / "run-result.json"
    result.write_text(json.dumps({"status": "preempted", "step": 4}))
    os.utime(result, (1, 1))  # written long before this attempt started
    child, entry = _stage_process(tmp_path)
    try:
        assert stage_status("pretrain", entry, None, {}).state == "RUNNING"
    finally:
        child.kill()
        child.wait()
    assert stage_status("pretrain", entry, None, {}).state == "STOPPED"
    result.write_text(json.dumps({"status": "completed", "step": 9}))  # this attempt's own
    assert stage_status("pretrain", entry, None, {}).state == "COMPLETED"


def test_a_pid_reused_by_another_process_is_not_the_stage(tmp_path):
    child, entry = _stage_process(tmp_path)
    try:
        entry["pid_started"] -= 3600  # the recorded stage started an hour before this process
        assert stage_status("pretrain", entry, None, {}).state == "STOPPED"
    finally:
        child.kill()
        child.wait()
