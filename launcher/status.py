"""What each stage of a pipeline root is doing: Slurm's view plus what its output_dir says.

`collect_status(root)` reads `<root>/pipeline.json`, asks Slurm about the recorded jobs and
reads each output_dir (metrics.jsonl, run-result.json, checkpoints); `render_status_table` turns
that into the table `relay status` prints. Nothing here changes any state. A stage launched by
`relay run` has no Slurm job: its state comes from the process relay run recorded (pid, start
time, host) and its run-result.json. A pipeline.json with a "warmup" entry (cluster.warmup)
gets a first row for the kernel-cache warm-up job, whose step column counts the stages warmed
so far.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from launcher.job import WARMUP_RESULT
from launcher.pipeline import WARMUP_NAME
from launcher.record import read_record
from launcher.slurm import ACTIVE_STATES, SLURM_DIR, JobInfo, query_jobs
from trainer.data.manifest import PLAN_FILE, encode_progress

FAILED_STATES = frozenset({"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                           "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


@dataclasses.dataclass
class StageStatus:
    """One row of `relay status`."""

    name: str
    job_id: str | None
    state: str
    step: int | None
    max_steps: int | None
    loss: float | None
    checkpoint: str | None
    requeues: int | None
    elapsed: str | None
    reason: str | None = None  # why it failed or did not run (None when fine)
    log: str | None = None  # the log to read first


def read_last_json_line(path: Path, max_bytes: int = 65536) -> dict[str, Any] | None:
    """The last complete JSON object of a JSON-lines file (None when there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written, or cut by the tail window
        if isinstance(value, dict):
            return value
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


@dataclasses.dataclass(frozen=True)
class Progress:
    """What an output_dir says about its run."""

    step: int | None
    max_steps: int | None
    loss: float | None
    checkpoint: str | None
    result: dict[str, Any] | None  # run-result.json


def read_progress(output_dir: str | os.PathLike, max_steps: int | None = None) -> Progress:
    """Step and loss (metrics.jsonl / run-result.json), max_steps, newest complete checkpoint.

    Before a run's first metrics line the step is its newest checkpoint's (where it resumes).
    """
    from trainer.checkpoint.layout import list_checkpoints

    out = Path(output_dir)
    if (out / PLAN_FILE).is_file():  # an encode stage: files done of the manifest's
        done, total, _ = encode_progress(out)
        return Progress(step=done, max_steps=total, loss=None, checkpoint=None,
                        result=_read_json(out / "run-result.json"))
    metrics = read_last_json_line(out / "metrics.jsonl")
    result = _read_json(out / "run-result.json")
    config = _read_json(out / "resolved-config.json")
    if config and isinstance(config.get("max_steps"), int):
        max_steps = config["max_steps"]
    step = metrics.get("step") if metrics else None
    if result and isinstance(result.get("step"), int) and (step is None or result["step"] > step):
        step = result["step"]
    # Stage2 has no single loss: its student (generator) loss is the one to watch.
    loss = metrics.get("loss", metrics.get("generator_loss")) if metrics else None
    try:
        checkpoints = list_checkpoints(out)
    except OSError:
        checkpoints = []
    if step is None and checkpoints:
        step = int(checkpoints[-1].name.split("-")[-1])
    return Progress(step=step, max_steps=max_steps, loss=loss if isinstance(loss, (int, float)) else None,
                    checkpoint=checkpoints[-1].name if checkpoints else None, result=result)


def local_process_alive(entry: dict[str, Any]) -> bool | None:
    """Whether the process `relay run` recorded for a stage (pid, its start time, host) still
    runs: None when nothing was recorded or it ran on another host (this host cannot tell)."""
    import socket

    import psutil

    pid, started = entry.get("pid"), entry.get("pid_started")
    if not isinstance(pid, int) or not isinstance(started, (int, float)):
        return None
    if entry.get("host") != socket.gethostname():
        return None
    try:
        # The start time tells the stage's process from a later one that reused its pid.
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False


def local_state(entry: dict[str, Any], progress: Progress) -> str:
    """The state of a stage launched by `relay run` (no Slurm job): RUNNING while its process
    lives, then what its run-result.json says; STOPPED when the process ended without one."""
    alive = local_process_alive(entry)
    if alive:
        return "RUNNING"
    result = progress.result or {}
    if result.get("status") and _written_by_this_launch(entry):
        return str(result["status"]).upper()
    if alive is False:
        return "STOPPED"  # killed before it could write run-result.json
    if progress.step is not None:
        return "STARTED"  # metrics but no result, and no process to ask (running, or killed)
    return "NOT RUN"


def _written_by_this_launch(entry: dict[str, Any]) -> bool:
    """Whether run-result.json is newer than the recorded launch (not a previous attempt's)."""
    started = entry.get("pid_started")
    if not isinstance(started, (int, float)):
        return True
    try:
        return (Path(entry.get("output_dir", "")) / "run-result.json").stat().st_mtime >= started
    except OSError:
        return False


def find_log(output_dir: str | os.PathLike, job_id: str | None) -> str | None:
    """The log to read first: rank 0's Slurm log of the job, else train.log."""
    out = Path(output_dir)
    if job_id:
        log = out / SLURM_DIR / f"{job_id}_0_log.out"
        if log.exists():
            return str(log)
    if (out / "train.log").exists():
        return str(out / "train.log")
    return None


def stage_status(name: str, entry: dict[str, Any], job: JobInfo | None,
                 dependency_states: dict[str, str], *, waits_for: tuple[str, ...] = ()) -> StageStatus:
    """Combine pipeline.json's entry, Slurm's JobInfo and the output_dir into one row.

    waits_for: jobs other than its depends_on stages that it waited for (the warm-up).
    """
    out = entry.get("output_dir", "")
    job_id = entry.get("job_id")
    progress = read_progress(out, entry.get("max_steps"))
    result = progress.result or {}
    if job_id:
        state = job.state if job else "UNKNOWN"
    else:
        state = local_state(entry, progress)
    row = StageStatus(name=name, job_id=job_id, state=state, step=progress.step,
                      max_steps=progress.max_steps, loss=progress.loss,
                      checkpoint=progress.checkpoint, requeues=job.requeues if job else None,
                      elapsed=job.elapsed if job else None)
    if state in FAILED_STATES or state == "UNKNOWN":
        row.reason = explain_failure(state, job, result, entry, dependency_states,
                                     waits_for=waits_for)
        row.log = find_log(out, job_id)
    elif state == "STOPPED":
        row.reason = (f"its process ended without writing run-result.json (killed?); resume "
                      f"with: relay run <pipeline> --from {name}")
        row.log = find_log(out, job_id)
    return row


def explain_failure(state: str, job: JobInfo | None, result: dict[str, Any],
                    entry: dict[str, Any], dependency_states: dict[str, str], *,
                    waits_for: tuple[str, ...] = ()) -> str:
    """One line saying why a stage failed or never ran."""
    reason = job.reason if job else None
    deps = [d for d in (*waits_for, *entry.get("depends_on", []))
            if dependency_states.get(d) != "COMPLETED"]
    if state == "CANCELLED" and (reason == "DependencyNeverSatisfied" or (deps and result == {})):
        return (f"not run: {', '.join(deps) or 'its dependency'} did not complete "
                f"(Slurm: {reason or 'cancelled'})")
    if state == "UNKNOWN":
        return "Slurm does not know this job (too old for sacct, or another cluster)"
    stop = result.get("stop_reason")
    if result.get("status") == "failed" and isinstance(stop, dict):
        return (f"stopped by the health gate ({stop.get('gate')}) at step {stop.get('step')}, "
                f"after saving {result.get('last_checkpoint')}: {stop.get('message')}")
    if result.get("status") == "failed" and result.get("error"):
        return f"train.py: {result['error']}"
    if result.get("status") == "preempted" and state != "PREEMPTED":
        return (f"Slurm {state} after a preemption save at step {result.get('step')}; "
                f"resubmit with --from")
    parts = [f"Slurm {state}"]
    if job and job.exit_code:
        parts.append(f"exit {job.exit_code}")
    if reason:
        parts.append(reason)
    return ", ".join(parts)


def warmup_status(entry: dict[str, Any], job: JobInfo | None) -> StageStatus:
    """The warm-up row: Slurm's state (or, under relay run, warmup-result.json's), the stages
    warmed so far out of those it warms, and for a failure the stage, the error and the log."""
    job_id = entry.get("job_id")
    stages = [str(s) for s in entry.get("stages") or []]
    reports = entry.get("reports") if isinstance(entry.get("reports"), dict) else {}
    directory = Path(str(entry.get("directory", "")))
    result = _read_json(Path(str(entry.get("result") or directory / WARMUP_RESULT))) or {}
    warmed = sum(1 for s in stages if reports.get(s)
                 and (_read_json(Path(str(reports[s]))) or {}).get("status") == "ok")
    if job_id:
        state = job.state if job else "UNKNOWN"
    else:
        state = {"ok": "COMPLETED", "failed": "FAILED", "running": "STARTED"}.get(
            result.get("status"), "NOT RUN")
    row = StageStatus(name=WARMUP_NAME, job_id=job_id, state=state, step=warmed,
                      max_steps=len(stages), loss=None, checkpoint=None,
                      requeues=job.requeues if job else None, elapsed=job.elapsed if job else None)
    if state not in FAILED_STATES and state != "UNKNOWN":
        return row
    if result.get("status") == "failed" and result.get("error"):
        row.reason = str(result["error"])
    elif state == "UNKNOWN":
        row.reason = "Slurm does not know this job (too old for sacct, or another cluster)"
    else:
        parts = [f"Slurm {state}"]
        if job and job.exit_code:
            parts.append(f"exit {job.exit_code}")
        if job and job.reason:
            parts.append(job.reason)
        row.reason = ", ".join(parts)
        if state == "TIMEOUT":
            row.reason += ("; raise cluster.warmup_time (a cold cache can take over 30 minutes "
                           "a stage at production shapes)")
    log = directory / SLURM_DIR / f"{job_id}_0_log.out" if job_id else None
    if log is not None and log.exists():
        row.log = str(log)
    elif result.get("failed") and reports.get(result["failed"]):
        row.log = str(reports[result["failed"]])
    return row


def collect_status(root: str | os.PathLike) -> list[StageStatus]:
    """The warm-up (when recorded), then every stage of `<root>/pipeline.json`, in pipeline
    order. Raises RecordError."""
    record = read_record(root)
    stages = record["stages"]
    warmup = record.get("warmup") if isinstance(record.get("warmup"), dict) else None
    ids = [e.get("job_id") for e in stages.values() if e.get("job_id")]
    if warmup and warmup.get("job_id"):
        ids.append(warmup["job_id"])
    jobs = query_jobs(ids)
    rows: list[StageStatus] = []
    states: dict[str, str] = {}
    if warmup:
        row = warmup_status(warmup, jobs.get(str(warmup.get("job_id"))))
        states[WARMUP_NAME] = row.state
        rows.append(row)
    for name, entry in stages.items():
        waits_for = (WARMUP_NAME,) if warmup and warmup.get("before") == name else ()
        row = stage_status(name, entry, jobs.get(str(entry.get("job_id"))), states,
                           waits_for=waits_for)
        states[name] = row.state
        rows.append(row)
    return rows


def render_status_table(rows: list[StageStatus]) -> str:
    """The table, then one line per failed stage with its reason and log."""
    header = ["stage", "job", "state", "step", "loss", "checkpoint", "requeues", "elapsed"]
    table = [header]
    for r in rows:
        step = f"{r.step if r.step is not None else '-'}/{r.max_steps if r.max_steps is not None else '-'}"
        table.append([r.name, r.job_id or "-", r.state, step,
                      f"{r.loss:.4f}" if r.loss is not None else "-", r.checkpoint or "-",
                      str(r.requeues) if r.requeues is not None else "-", r.elapsed or "-"])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    for r in rows:
        if r.reason:
            lines.append("")
            lines.append(f"{r.name}: {r.reason}")
            if r.log:
                lines.append(f"{r.name}: log {r.log}")
    return "\n".join(lines)


def active_jobs(rows: list[StageStatus]) -> list[StageStatus]:
    """Rows whose Slurm job is still queued or running."""
    return [r for r in rows if r.job_id and r.state in ACTIVE_STATES]
