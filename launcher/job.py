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
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Any

PREEMPTED = 75  # trainer.preemption.PREEMPTED_EXIT_CODE (kept importable without torch)
REQUEUE_GRACE_S = 600  # how long rank 0 waits for Slurm to stop it after `scontrol requeue`


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

    def __call__(self) -> dict[str, Any]:
        previous = signal.signal(_signal_number(self.preemption_signal), _raise_preempted)
        try:
            rank = export_rank_environment()
            os.chdir(self.workdir)
            from trainer import train  # after chdir: the stage YAML's relative paths need it

            code = train.main(list(self.train_argv))
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
        raise StageFailed(
            f"stage {self.stage}: train.py exited with code {code} ({_describe(code)}). See "
            f"{self.output_dir}/run-result.json and {self.output_dir}/train.log.")


def _describe(code: int) -> str:
    return {1: "training failed", 2: "bad configuration"}.get(code, "unexpected exit code")


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
