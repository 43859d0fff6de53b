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
- a record of another host that Slurm cannot vouch for (no job id, or no squeue): the holder
  refreshes its record every REFRESH_INTERVAL_S while it runs (a background thread), so the
  record counts until it has gone STALE_AFTER_S without a refresh; only then is it taken over,
  and the message says how old it is.
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
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

log = logging.getLogger("trainer.runtime.lock")

LOCK_FILE = ".relay-lock"
# squeue states in which a job still owns its output_dir (it runs, or will run again).
_ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                            "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING",
                            "STAGE_OUT", "RESV_DEL_HOLD"})
_HELD = (errno.EAGAIN, errno.EACCES)  # lockf's answers for "another process holds it"
# A running holder rewrites its record this often; a record of another host that Slurm cannot
# vouch for is taken over only once it has gone STALE_AFTER_S without a rewrite (ten missed
# refreshes: a loaded metadata server or a long pause of the process is not a dead run).
REFRESH_INTERVAL_S = 30.0
STALE_AFTER_S = 300.0
_RECORD_BLOCK = 512  # records are padded to whole blocks, so a refresh rewrites the same bytes


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
    # time.time() (whole seconds) of the holder's last rewrite of the record; not part of who
    # the holder is.
    refreshed_at: float | None = field(default=None, compare=False)

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
    """The lock of one output_dir, held by this process until `release()`.

    While held, a daemon thread rewrites the record's `refreshed_at` every `refresh_interval`
    seconds (None: never), so a run on another host can tell a live holder from a dead one.
    """

    def __init__(self, path: Path, fd: int, holder: Holder, kernel_lock: bool,
                 refresh_interval: float | None = None) -> None:
        self.path = path
        self.holder = holder
        self.kernel_lock = kernel_lock  # False: only the record protects the output_dir
        self._fd: int | None = fd
        self._stop = threading.Event()
        self._guard = threading.Lock()  # a refresh never races release() for the fd
        self._refresher: threading.Thread | None = None
        if refresh_interval:
            self._refresher = threading.Thread(target=self._refresh_every, args=(refresh_interval,),
                                               name="relay-lock-refresh", daemon=True)
            self._refresher.start()

    def refresh(self) -> bool:
        """Rewrite the record with the time now. Returns False (and stops refreshing) once the
        record names another holder: a run elsewhere judged this one dead and took over."""
        with self._guard:
            if self._fd is None:
                return False
            try:
                found = _read_holder(self._fd)
                if found != self.holder:
                    log.error("%s now names %s: another run judged this one gone and took the "
                              "output_dir over; this run no longer refreshes the lock record",
                              self.path, found.describe() if found else "no holder")
                    return False
                _write_holder(self._fd, self.holder, truncate=False)
            except OSError as exc:
                log.warning("could not refresh the lock record %s (%s); will retry", self.path, exc)
            return True

    def _refresh_every(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if not self.refresh():
                return

    def release(self) -> None:
        """Empty the record and drop the lock. Safe to call twice; never raises."""
        self._stop.set()
        if self._refresher is not None and self._refresher is not threading.current_thread():
            self._refresher.join(timeout=30)
        with self._guard:
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


def acquire_run_lock(output_dir: str | os.PathLike, *,
                     refresh_interval: float | None = REFRESH_INTERVAL_S) -> RunLock:
    """Lock `output_dir` (which must exist) for this process; return the held lock, whose
    record is refreshed every `refresh_interval` seconds until it is released.

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
    return RunLock(path, fd, me, kernel_lock, refresh_interval)


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
        _judge_record(path, previous, me, kernel_free=False, age=_record_age(fd, previous))
        return False
    previous = _read_holder(fd)
    _judge_record(path, previous, me, kernel_free=True, age=_record_age(fd, previous))
    return True


def _judge_record(path: Path, previous: Holder | None, me: Holder, *, kernel_free: bool,
                  age: float | None = None) -> None:
    """Refuse (RunLockError) or report a stale record, from what the record says.

    `kernel_free`: the kernel lock was granted, so a holder on this host is certainly gone.
    `age`: seconds since the record was last written (None: unknown, counted as fresh).
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
    # Nothing but the record can tell: a live holder refreshes it every REFRESH_INTERVAL_S.
    if age is not None and age > STALE_AFTER_S:
        log.warning("%s: lock record of %s on another host was last refreshed %s ago, longer "
                    "than the %s after which a holder that stopped refreshing counts as gone: "
                    "taking over", path, previous.describe(), _duration(age),
                    _duration(STALE_AFTER_S))
        return
    when = "at an unknown time" if age is None else f"{_duration(age)} ago"
    raise RunLockError(_in_use(
        path, previous,
        f"its record was refreshed {when}, and a running holder refreshes it every "
        f"{_duration(REFRESH_INTERVAL_S)}; it is taken over only once it has gone "
        f"{_duration(STALE_AFTER_S)} without a refresh"
        + (f" (in about {_duration(STALE_AFTER_S - age)}, if that run is dead)"
           if age is not None else "")))


def _record_age(fd: int, holder: Holder | None) -> float | None:
    """Seconds since the record was last written: from its own `refreshed_at` and the file's
    modification time, whichever is later (a record of an older relay has only the latter).
    Never negative (clocks of two hosts differ); None when neither can be read."""
    times = [holder.refreshed_at] if holder is not None and holder.refreshed_at else []
    try:
        times.append(os.fstat(fd).st_mtime)
    except OSError:
        pass
    return max(0.0, time.time() - max(times)) if times else None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min" + (f" {seconds % 60} s" if seconds % 60 else "")
    return f"{seconds // 3600} h" + (f" {seconds % 3600 // 60} min" if seconds % 3600 >= 60 else "")


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
        record = json.loads(data) if data.strip() else None
        if not isinstance(record, dict):
            return None
        known = {f.name for f in fields(Holder)}  # a newer relay's extra fields are ignored
        return Holder(**{k: v for k, v in record.items() if k in known})
    except (OSError, ValueError, TypeError):
        return None


def _write_holder(fd: int, holder: Holder, *, truncate: bool = True) -> None:
    """Write `holder` with refreshed_at = now. In place, not by rename: the lock belongs to
    this file. The record is padded to whole _RECORD_BLOCKs, so a refresh (truncate=False)
    overwrites the same bytes and a reader never sees it half-written or empty."""
    record = {**asdict(holder), "refreshed_at": int(time.time())}  # ten digits: a fixed length
    data = json.dumps(record, sort_keys=True).encode()
    size = -(-(len(data) + 1) // _RECORD_BLOCK) * _RECORD_BLOCK
    data = data.ljust(size - 1) + b"\n"
    if truncate:
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
