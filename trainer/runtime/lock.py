"""One run per output_dir: an exclusive lock on `<output_dir>/.relay-lock`, held for the whole run.

Two runs in one output_dir would append the same steps to metrics.jsonl and skip or overwrite
each other's checkpoints. Rank 0 takes the lock before it writes anything there and keeps it
until run-result.json is written.

The lock is a POSIX record lock (`fcntl.lockf`) on the file, so the kernel (or the network
filesystem's lock manager) releases it when the process dies, however it dies. The file also
holds a record of its holder (host, pid, Slurm job id, restart count, start time) for the
message that a second run gets, and for the cases the kernel lock cannot settle:

- a filesystem without lock support (NFS without lockd, Lustre without `flock`): the record
  alone decides, and the run says so. A holder is over when its process is gone (same host)
  or Slurm says its job has finished; when neither can be known, the run refuses.
- a record of another host whose Slurm job is still active while the kernel lock was free:
  the filesystem's locks are local to each node (NFS `nolock`, Lustre `localflock`), so the
  record wins and the run refuses.
- a requeued job (same SLURM_JOB_ID, higher SLURM_RESTART_COUNT) may take over from its own
  earlier run even while a lock manager still holds that run's lock (its node went away).

The file is never deleted: a run that ends empties it. Deleting a lock file that another
process holds open would let a third process lock a new file of the same name. Stdlib only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("trainer.runtime.lock")

LOCK_FILE = ".relay-lock"
# squeue states in which a job still owns its output_dir (it runs, or will run again).
_ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                            "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING",
                            "STAGE_OUT", "RESV_DEL_HOLD"})
_HELD = (errno.EAGAIN, errno.EACCES)  # lockf's answers for "another process holds it"


class RunLockError(Exception):
    """Another run holds the output_dir (or may): this run must not start. One paragraph."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) an output_dir: what the lock file records."""

    host: str
    pid: int
    slurm_job_id: str | None
    slurm_restart_count: int
    started_at: str
    process_start: str | None = None  # /proc/<pid>/stat start time: tells a reused pid apart

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        again = f" (restart {self.slurm_restart_count})" if self.slurm_restart_count else ""
        return f"pid {self.pid} on host {self.host}{job}{again}, started {self.started_at}"


def current_holder() -> Holder:
    """This process, as the lock file would record it."""
    env = os.environ
    try:
        restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restarts = 0
    return Holder(host=socket.gethostname(), pid=os.getpid(),
                  slurm_job_id=env.get("SLURM_JOB_ID") or None, slurm_restart_count=restarts,
                  started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  process_start=_process_start(os.getpid()))


class RunLock:
    """The lock of one output_dir, held by this process until `release()`."""

    def __init__(self, path: Path, fd: int, holder: Holder, kernel_lock: bool) -> None:
        self.path = path
        self.holder = holder
        self.kernel_lock = kernel_lock  # False: only the record protects the output_dir
        self._fd: int | None = fd

    def release(self) -> None:
        """Empty the record and drop the lock. Safe to call twice; never raises."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self.kernel_lock or _read_holder(fd) == self.holder:
                os.ftruncate(fd, 0)
                os.fsync(fd)
        except OSError as exc:
            log.warning("could not clear the lock record %s (%s); the next run will find it "
                        "stale and take over", self.path, exc)
        finally:
            os.close(fd)  # closing drops the POSIX lock


def acquire_run_lock(output_dir: str | os.PathLike) -> RunLock:
    """Lock `output_dir` (which must exist) for this process; return the held lock.

    Raises RunLockError, with a message naming the holder, when another run holds it or may
    hold it. A stale record (its run died without releasing) is reported and taken over.
    """
    path = Path(output_dir) / LOCK_FILE
    me = current_holder()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunLockError(f"cannot open the lock file {path} ({exc.strerror}); this run needs "
                           f"write access to its output_dir {output_dir}.") from None
    try:
        kernel_lock = _lock_or_judge(path, fd, me)
        _write_holder(fd, me)
    except BaseException:
        os.close(fd)
        raise
    return RunLock(path, fd, me, kernel_lock)


def _lock_or_judge(path: Path, fd: int, me: Holder) -> bool:
    """Take the kernel lock, or decide from the record; True if the kernel lock is held.

    Raises RunLockError when the output_dir is (or may be) in use.
    """
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        previous = _read_holder(fd)
        if exc.errno in _HELD:
            if previous is not None and _is_requeue_of(previous, me):
                log.warning("%s: the lock is still held for %s, an earlier run of this same Slurm "
                            "job (requeued): taking over with the record only", path,
                            previous.describe())
                return False
            raise RunLockError(_in_use(path, previous, "it holds the lock")) from None
        log.warning("%s: this filesystem does not support file locks (%s); relying on the "
                    "recorded holder alone, which cannot catch two runs started at the same "
                    "moment", path, exc.strerror or exc)
        _judge_record(path, previous, me, kernel_free=False)
        return False
    _judge_record(path, _read_holder(fd), me, kernel_free=True)
    return True


def _judge_record(path: Path, previous: Holder | None, me: Holder, *, kernel_free: bool) -> None:
    """Refuse (RunLockError) or report a stale record, from what the record says.

    `kernel_free`: the kernel lock was granted, so a holder on this host is certainly gone.
    """
    if previous is None or previous == me:
        return
    if _is_requeue_of(previous, me):
        log.info("%s: taking over from %s, an earlier run of this Slurm job", path,
                 previous.describe())
        return
    if previous.host == socket.gethostname():
        if kernel_free or not _process_alive(previous):
            log.warning("%s: stale lock of %s, whose process is gone: taking over", path,
                        previous.describe())
            return
        raise RunLockError(_in_use(path, previous, "its process is alive on this host"))
    state = _slurm_job_state(previous.slurm_job_id) if previous.slurm_job_id else None
    if state is not None and state not in _ACTIVE_STATES:
        log.warning("%s: stale lock of %s, whose Slurm job has ended (%s): taking over", path,
                    previous.describe(), state)
        return
    if state is not None:
        reason = (f"Slurm says its job is {state}, yet the filesystem granted this run the lock: "
                  "its locks are not shared between nodes") if kernel_free else \
                 f"Slurm says its job is {state}"
        raise RunLockError(_in_use(path, previous, reason))
    if kernel_free:
        log.warning("%s: lock record of %s on another host, which no longer holds the lock: "
                    "taking over", path, previous.describe())
        return
    raise RunLockError(_in_use(path, previous, "this filesystem has no file locks and nothing "
                                               "can tell whether that run is still going"))


def _is_requeue_of(previous: Holder, me: Holder) -> bool:
    return (previous.slurm_job_id is not None and previous.slurm_job_id == me.slurm_job_id
            and me.slurm_restart_count > previous.slurm_restart_count)


def _in_use(path: Path, holder: Holder | None, why: str) -> str:
    who = holder.describe() if holder is not None else "a process whose record is empty or " \
                                                         "unreadable (it may be starting)"
    cancel = f" (scancel {holder.slurm_job_id})" if holder and holder.slurm_job_id else ""
    return (f"output_dir {path.parent} is in use by another run: {who}; {why}. Two runs in one "
            f"output_dir would write the same checkpoints and metrics, so this one does not "
            f"start and changes nothing there. Wait for that run to end or stop it{cancel}, or "
            f"give this run another output_dir. If that run is certainly over, delete {path}.")


def _read_holder(fd: int) -> Holder | None:
    """The record in the lock file, or None if it is empty or unreadable."""
    try:
        data = os.pread(fd, 65536, 0)
        fields = json.loads(data) if data.strip() else None
        return Holder(**fields) if isinstance(fields, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def _write_holder(fd: int, holder: Holder) -> None:
    # In place, not by rename: the lock belongs to this file.
    data = json.dumps(asdict(holder), sort_keys=True).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _process_alive(holder: Holder) -> bool:
    """Whether the holder's process (on this host) still runs, and is the same process."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    started = _process_start(holder.pid)
    return holder.process_start is None or started is None or started == holder.process_start


def _slurm_job_state(job_id: str) -> str | None:
    """Slurm's state of a job (`RUNNING`, `COMPLETED`, `GONE` once Slurm forgot it), or None
    when Slurm cannot be asked."""
    try:
        proc = subprocess.run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = proc.stdout.strip().split("\n")[0].strip()
    if proc.returncode == 0 and state:
        return state
    if "Invalid job id" in proc.stderr:
        return "GONE"  # ended longer ago than the controller remembers (MinJobAge)
    return None
