"""What each srun task of a stage's Slurm job runs: one rank of train.py, plus the requeue.

submitit unpickles a `StageJob` in every task and calls it. The task exports its rank
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from Slurm), changes to the directory relay
was run in, and runs `trainer.train.main(argv)` in this same process. In-process rather than a
child process because then this task *is* the rank: Slurm's `--signal=USR2@lead` reaches it
directly and train.py's own handler turns it into "save at the next step boundary, exit 75",
with no forwarding layer that could lose the signal (torchrun's agent dies on USR2, and under
cgroup tracking only slurmstepd's direct children get it).

After train.py returns:
  0   the stage is done (the job completes; the next stage's afterok is satisfied);
  75  preempted and saved: rank 0 runs `scontrol requeue $SLURM_JOB_ID` while
      SLURM_RESTART_COUNT < max_requeues (the requeued job resumes from output_dir), else the
      job fails; other ranks just return and leave the requeue to rank 0;
  any other code: the job fails (raises), so later stages are cancelled (kill-on-invalid-dep).

The kernel-cache warm-up job (cluster.warmup) runs a `WarmupJob` in its single task instead:
`python -m trainer.warmup <stage argv>` for each stage about to launch, one child process
each, stopping at the first that fails. `run_warmups` is that loop; `relay run` uses it too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from trainer.runtime.files import write_json

PREEMPTED = 75  # trainer.runtime.preemption.PREEMPTED_EXIT_CODE (kept importable without torch)
REQUEUE_GRACE_S = 600  # how long rank 0 waits for Slurm to stop it after `scontrol requeue`
WARMUP_REPORT_ENV = "RELAY_WARMUP_REPORT"  # trainer.warmup.REPORT_ENV (importable without torch)
WARMUP_RESULT = "warmup-result.json"  # in <root>/warmup: the outcome of the whole warm-up


class StageFailed(RuntimeError):
    """The stage did not complete and must not be retried by this job. The message says why."""


class _PreemptedBeforeTraining(BaseException):
    """The preemption signal arrived before train.py installed its handler.

    A BaseException so that train.py's `except Exception` cannot turn it into a failure.
    """


def decide_after_exit(code: int, *, rank: int, restart_count: int, max_requeues: int) -> str:
    """What a task does once train.py returned `code`: "done", "requeue", "leave" or "fail".

    "leave": a preempted non-zero rank returns and lets rank 0 requeue the job.
    """
    if code == 0:
        return "done"
    if code == PREEMPTED:
        if rank != 0:
            return "leave"
        return "requeue" if restart_count < max_requeues else "fail"
    return "fail"


@dataclasses.dataclass
class StageJob:
    """The callable submitit runs in every task of a stage's job (pickled: no secrets here)."""

    stage: str
    train_argv: list[str]
    workdir: str
    output_dir: str
    max_requeues: int
    preemption_signal: str = "SIGUSR2"
    entry: str = "trainer.train"  # the module whose main(argv) the task runs (an encode stage's)

    def __call__(self) -> dict[str, Any]:
        previous = signal.signal(_signal_number(self.preemption_signal), _raise_preempted)
        try:
            rank = export_rank_environment()
            os.chdir(self.workdir)
            import importlib

            # after chdir: the stage YAML's relative paths need it
            code = importlib.import_module(self.entry).main(list(self.train_argv))
        except _PreemptedBeforeTraining:
            rank, code = _env_int("RANK", "SLURM_PROCID"), PREEMPTED
            print(f"relay: stage {self.stage}: preemption signal before training started",
                  file=sys.stderr, flush=True)
        finally:
            # train.py installs its own handler; only undo ours if it is still in place.
            if signal.getsignal(_signal_number(self.preemption_signal)) is _raise_preempted:
                signal.signal(_signal_number(self.preemption_signal), previous)
        restarts = _env_int("SLURM_RESTART_COUNT")
        action = decide_after_exit(code, rank=rank, restart_count=restarts,
                                   max_requeues=self.max_requeues)
        if action == "done":
            return {"stage": self.stage, "status": "completed", "restarts": restarts}
        if action == "leave":
            return {"stage": self.stage, "status": "preempted", "restarts": restarts}
        if action == "requeue":
            requeue_this_job(self.stage, restarts, self.max_requeues)
        if code == PREEMPTED:
            raise StageFailed(
                f"stage {self.stage} was preempted again after {restarts} requeues "
                f"(max_requeues {self.max_requeues}); its checkpoint is saved in "
                f"{self.output_dir}. Resubmit with `relay submit PIPELINE --from {self.stage}` "
                f"or raise max_requeues.")
        trains = self.entry == "trainer.train"
        program, log = ("train.py", f"{self.output_dir}/train.log") if trains else \
            (self.entry, "the job's log")
        raise StageFailed(
            f"stage {self.stage}: {program} exited with code {code} ({_describe(code)}). See "
            f"{self.output_dir}/run-result.json and {log}.")


def _describe(code: int) -> str:
    return {1: "training failed", 2: "bad configuration, or output_dir in use by another run"}.get(
        code, "unexpected exit code")


def _raise_preempted(signum, frame) -> None:
    raise _PreemptedBeforeTraining()


def _signal_number(name: str) -> signal.Signals:
    name = name.upper()
    return signal.Signals[name if name.startswith("SIG") else "SIG" + name]


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.strip().lstrip("-").isdigit():
            return int(value)
    return default


def export_rank_environment() -> int:
    """Export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; return the rank.

    Under Slurm these come from the srun task (submitit's TorchDistributedEnvironment);
    MASTER_PORT keeps the value slurm/env.sh derived from the job id. Outside Slurm: rank 0.
    """
    if not os.environ.get("SLURM_JOB_ID"):
        return 0
    from submitit.helpers import TorchDistributedEnvironment

    # GPUs are picked by LOCAL_RANK in the trainer; leave CUDA_VISIBLE_DEVICES as Slurm set it.
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return env.rank


def requeue_this_job(stage: str, restarts: int, max_requeues: int) -> None:
    """`scontrol requeue $SLURM_JOB_ID`, then wait for Slurm to stop this task.

    Raises StageFailed when scontrol refuses (e.g. the job is being cancelled) or when Slurm
    does not stop the job within REQUEUE_GRACE_S.
    """
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise StageFailed(f"stage {stage}: preempted outside Slurm; nothing can requeue it.")
    # A cancelled job also gets SIGTERM and saves, but must stay cancelled: `scontrol requeue`
    # would happily requeue it. Only a job Slurm still counts as RUNNING is requeued.
    state = job_state(job_id)
    if state != "RUNNING":
        raise StageFailed(f"stage {stage}: checkpoint saved, but job {job_id} is {state or 'gone'}"
                          f" (cancelled?), so it is not requeued.")
    print(f"relay: stage {stage}: checkpoint saved; requeueing job {job_id} "
          f"(requeue {restarts + 1} of at most {max_requeues})", file=sys.stderr, flush=True)
    # Slurm answers the requeue with SIGTERM (then SIGKILL): let it end this process at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        raise StageFailed(f"stage {stage}: `scontrol requeue {job_id}` failed: "
                          f"{(proc.stderr or proc.stdout).strip()}")
    deadline = time.monotonic() + REQUEUE_GRACE_S
    while time.monotonic() < deadline:
        time.sleep(1)
    raise StageFailed(f"stage {stage}: job {job_id} was requeued but not stopped within "
                      f"{REQUEUE_GRACE_S} s.")


def job_state(job_id: str) -> str | None:
    """`JobState` of `scontrol show job` (RUNNING, COMPLETING, CANCELLED, ...), or None."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for token in out.split():
        if token.startswith("JobState="):
            return token.split("=", 1)[1]
    return None


# ---------------------------------------------------------------------------------------------
# The kernel-cache warm-up
# ---------------------------------------------------------------------------------------------

class WarmupFailed(RuntimeError):
    """A stage's kernel warm-up failed; the chain must not start. The message says why."""


def warmup_command(python: str, argv) -> list[str]:
    """The warm-up of one stage: trainer.warmup with the stage's exact train.py argv."""
    return [python, "-u", "-m", "trainer.warmup", *argv]


def explain_warmup_exit(code: int) -> str:
    """What a trainer.warmup exit code means (0 ok, 1 failed, 2 bad config)."""
    if code == 1:
        return "exit 1: forward or backward failed, e.g. a kernel that does not build or out of memory"
    if code == 2:
        return "exit 2: trainer.warmup rejected the configuration"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        hint = (" (the warm-up job's time limit is near: raise cluster.warmup_time)"
                if name == "SIGUSR2" else "")
        return f"killed by signal {name}{hint}"
    return f"exit code {code}"


def _read_report(path: str) -> dict[str, Any]:
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def run_warmups(runs: list[dict[str, Any]], *, directory: str, python: str, workdir: str,
                echo: Callable[[str], None] = print, show_reports: bool = True,
                prefix: str = "relay") -> dict[str, Any]:
    """Warm up each run ({"stage", "argv", "report"}) in turn; stop at the first failure.

    Each run is a child process `python -m trainer.warmup <argv>` in `workdir` with
    RELAY_WARMUP_REPORT=<report>; its stderr (the progress log) goes where ours goes, its stdout
    (the report as JSON) too unless `show_reports` is False. Old reports are removed first, so
    every report present belongs to this warm-up. Returns the result, also written to
    <directory>/warmup-result.json: {"status": "ok" | "failed", "failed": stage or None,
    "error": message or None, "stages": {stage: {"report", "code", "status", "error",
    "timings_s", "peak_device_mem_gb"}}}.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for run in runs:
        Path(run["report"]).unlink(missing_ok=True)
    result: dict[str, Any] = {"status": "running", "failed": None, "error": None, "stages": {}}
    write_json(out / WARMUP_RESULT, result)
    for index, run in enumerate(runs, 1):
        stage, report_path = run["stage"], run["report"]
        cmd = warmup_command(python, run["argv"])
        echo(f"{prefix}: kernel warm-up {index}/{len(runs)}: stage {stage} -> {report_path}")
        echo("  " + shlex.join(cmd))
        started = time.monotonic()
        code = subprocess.run(cmd, cwd=workdir, env={**os.environ, WARMUP_REPORT_ENV: report_path},
                              stdout=None if show_reports else subprocess.DEVNULL).returncode
        report = _read_report(report_path)
        entry = {"report": report_path, "code": code, "status": report.get("status"),
                 "error": report.get("error"), "timings_s": report.get("timings_s"),
                 "peak_device_mem_gb": report.get("peak_device_mem_gb"),
                 "wall_s": round(time.monotonic() - started, 1)}
        result["stages"][stage] = entry
        if code == 0 and report.get("status") == "ok":
            timings = report.get("timings_s") or {}
            echo(f"{prefix}: kernel warm-up of stage {stage}: ok (forward "
                 f"{timings.get('forward', '?')} s, backward {timings.get('backward', '?')} s)")
            write_json(out / WARMUP_RESULT, result)
            continue
        if code == 0:
            what = f"no report with status ok in {report_path}"
        else:
            what = explain_warmup_exit(code)
        detail = f": {report['error']}" if report.get("error") else ""
        result.update(status="failed", failed=stage,
                      error=f"kernel warm-up of stage {stage} failed ({what}){detail}. "
                            f"Report: {report_path}")
        write_json(out / WARMUP_RESULT, result)
        return result
    result["status"] = "ok"
    write_json(out / WARMUP_RESULT, result)
    return result


def _warn_time_limit(signum, frame) -> None:
    print("relay: warm-up: SIGUSR2, the job's time limit (cluster.warmup_time) is near",
          file=sys.stderr, flush=True)


@dataclasses.dataclass
class WarmupJob:
    """The callable submitit runs in the warm-up job's one task (pickled: no secrets here)."""

    job_name: str
    workdir: str
    directory: str
    runs: list[dict[str, Any]]  # {"stage", "argv", "report"}

    @classmethod
    def from_spec(cls, warmup, *, workdir: str) -> "WarmupJob":
        """From a launcher.pipeline.WarmupSpec."""
        return cls(job_name=warmup.job_name, workdir=str(workdir), directory=warmup.directory,
                   runs=[{"stage": r.stage, "argv": list(r.argv), "report": r.report}
                         for r in warmup.runs])

    def __call__(self) -> dict[str, Any]:
        # Slurm's --signal says the time limit is near; say so instead of dying silently.
        previous = signal.signal(signal.SIGUSR2, _warn_time_limit)
        try:
            result = run_warmups(self.runs, directory=self.directory, python=sys.executable,
                                 workdir=self.workdir, echo=lambda m: print(m, flush=True))
        finally:
            signal.signal(signal.SIGUSR2, previous)
        if result["status"] != "ok":
            print(f"relay: {result['error']}", file=sys.stderr, flush=True)
            raise WarmupFailed(f"{result['error']}. The pipeline's stages will not start.")
        return result
