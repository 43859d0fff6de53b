"""The output_dir lock: one run per directory, stale locks taken over, requeues let in.

Holders are real processes (a child that takes the lock and waits), locks are real fcntl
locks on real files. A filesystem without lock support is simulated by making `fcntl.lockf`
fail the way NFS without lockd does (ENOLCK): this machine has no such filesystem.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

import trainer.runtime.lock as run_lock
from trainer.runtime.lock import LOCK_FILE, RunLockError, acquire_run_lock, current_holder

REPO = Path(__file__).resolve().parents[1]
HOLD = ("import sys; from trainer.runtime.lock import acquire_run_lock; "
        "lock = acquire_run_lock(sys.argv[1]); print('locked', flush=True); sys.stdin.read(); "
        "lock.release()")


class HoldingProcess:
    """A child process holding the lock of `output_dir` until `stop()` (or a kill)."""

    def __init__(self, output_dir: Path, **env: str) -> None:
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        child_env.update(PYTHONPATH=str(REPO), **env)
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=child_env)
        assert self.proc.stdout.readline().strip() == "locked"

    def stop(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(autouse=True)
def _no_slurm_identity(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


def _no_file_locks(monkeypatch) -> None:
    def lockf(fd, flags):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "lockf", lockf)


def _write_record(output_dir: Path, **fields) -> None:
    record = {**asdict(current_holder()), **fields}
    (output_dir / LOCK_FILE).write_text(json.dumps(record))


def test_a_second_process_is_refused_naming_the_holder_until_the_holder_exits(tmp_path):
    holder = HoldingProcess(tmp_path)
    with pytest.raises(RunLockError) as info:
        acquire_run_lock(tmp_path)
    message = str(info.value)
    assert f"pid {holder.proc.pid} on host {socket.gethostname()}" in message
    assert "in use by another run" in message and "\n" not in message
    holder.stop()
    lock = acquire_run_lock(tmp_path)
    assert lock.kernel_lock
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_the_record_names_host_pid_job_and_start_and_release_empties_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    lock = acquire_run_lock(tmp_path)
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (record["host"], record["pid"], record["slurm_job_id"], record["slurm_restart_count"]) \
        == (socket.gethostname(), os.getpid(), "4242", 2)
    assert record["started_at"][:2] == "20"
    lock.release()
    lock.release()  # twice is harmless
    # The file stays (deleting it would race with a process about to lock it), empty.
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_a_killed_holder_leaves_a_stale_record_that_is_reported_and_taken_over(tmp_path, caplog):
    holder = HoldingProcess(tmp_path)
    holder.kill()
    with caplog.at_level(logging.WARNING):
        lock = acquire_run_lock(tmp_path)
    assert f"stale lock of pid {holder.proc.pid}" in caplog.text
    assert lock.kernel_lock
    lock.release()


def test_a_requeued_run_of_the_same_slurm_job_takes_over_a_lock_still_held_by_its_earlier_run(
        tmp_path, monkeypatch, caplog):
    # The earlier run's node went away and the lock manager has not noticed yet.
    holder = HoldingProcess(tmp_path, SLURM_JOB_ID="777", SLURM_RESTART_COUNT="0")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with caplog.at_level(logging.WARNING):
        lock = acquire_run_lock(tmp_path)
    assert not lock.kernel_lock and "same Slurm job (requeued)" in caplog.text
    lock.release()
    holder.stop()


def test_two_steps_of_one_slurm_job_are_not_a_requeue(tmp_path, monkeypatch):
    holder = HoldingProcess(tmp_path, SLURM_JOB_ID="778", SLURM_RESTART_COUNT="0")
    monkeypatch.setenv("SLURM_JOB_ID", "778")
    with pytest.raises(RunLockError, match=r"Slurm job 778.*scancel 778"):
        acquire_run_lock(tmp_path)
    holder.stop()


# ---- a filesystem without lock support: the record decides -----------------------------------

def test_without_file_locks_a_live_holder_on_this_host_is_refused(tmp_path, monkeypatch, caplog):
    holder = HoldingProcess(tmp_path)  # took the real lock; this process then cannot use locks at all
    _no_file_locks(monkeypatch)
    with caplog.at_level(logging.WARNING), pytest.raises(RunLockError) as info:
        acquire_run_lock(tmp_path)
    assert "does not support file locks" in caplog.text
    assert f"pid {holder.proc.pid}" in str(info.value) and "alive on this host" in str(info.value)
    holder.stop()


def test_without_file_locks_a_dead_holder_is_stale_and_a_reused_pid_is_not_the_holder(
        tmp_path, monkeypatch, caplog):
    _no_file_locks(monkeypatch)
    holder = HoldingProcess(tmp_path)
    holder.kill()
    with caplog.at_level(logging.WARNING):
        acquire_run_lock(tmp_path).release()
    assert f"stale lock of pid {holder.proc.pid}" in caplog.text
    # A live pid that started at another time is some other process that got the number.
    _write_record(tmp_path, pid=os.getppid(), process_start="1")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        lock = acquire_run_lock(tmp_path)
    assert f"stale lock of pid {os.getppid()}" in caplog.text and not lock.kernel_lock
    lock.release()


def test_without_file_locks_a_holder_on_another_host_without_a_job_is_refused(tmp_path,
                                                                               monkeypatch):
    _no_file_locks(monkeypatch)
    _write_record(tmp_path, host="node-elsewhere", pid=1234, slurm_job_id=None)
    with pytest.raises(RunLockError, match="pid 1234 on host node-elsewhere.*refreshed 0 s ago"):
        acquire_run_lock(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "node-elsewhere"


# ---- Holders on other hosts: the record's age decides when Slurm cannot ------------------------

def test_a_fresh_record_of_another_host_is_refused_even_when_the_kernel_lock_is_free(tmp_path):
    # Written seconds ago, no Slurm job: the kernel lock is free (node-local locks), but the
    # holder may well be running there.
    written = time.time() - 5
    _write_record(tmp_path, host="node-elsewhere", pid=1234, slurm_job_id=None,
                  refreshed_at=int(written))
    os.utime(tmp_path / LOCK_FILE, (written, written))
    with pytest.raises(RunLockError) as refused:
        acquire_run_lock(tmp_path, refresh_interval=None)
    message = str(refused.value)
    assert "pid 1234 on host node-elsewhere" in message
    assert re.search(r"refreshed [5-9] s ago", message), message
    assert f"every {int(run_lock.REFRESH_INTERVAL_S)} s" in message
    assert f"{int(run_lock.STALE_AFTER_S) // 60} min without a refresh" in message
    assert "\n" not in message
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "node-elsewhere"


def test_a_record_of_another_host_not_refreshed_for_longer_than_the_limit_is_taken_over(
        tmp_path, caplog):
    hour_ago = time.time() - 3600
    _write_record(tmp_path, host="node-elsewhere", pid=1234, slurm_job_id=None,
                  refreshed_at=int(hour_ago))
    os.utime(tmp_path / LOCK_FILE, (hour_ago, hour_ago))
    with caplog.at_level(logging.WARNING):
        lock = acquire_run_lock(tmp_path, refresh_interval=None)
    assert "pid 1234 on host node-elsewhere" in caplog.text
    assert "was last refreshed 1 h ago, longer than the 5 min" in caplog.text
    assert "taking over" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_record_of_an_older_relay_is_judged_by_the_file_time(tmp_path, monkeypatch):
    _no_file_locks(monkeypatch)
    _write_record(tmp_path, host="node-elsewhere", pid=1234, slurm_job_id=None)
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    record.pop("refreshed_at")
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(RunLockError, match="refreshed 0 s ago"):
        acquire_run_lock(tmp_path, refresh_interval=None)
    old = time.time() - 2 * run_lock.STALE_AFTER_S
    os.utime(tmp_path / LOCK_FILE, (old, old))
    acquire_run_lock(tmp_path, refresh_interval=None).release()


def test_the_holder_refreshes_its_record_while_it_runs(tmp_path, caplog):
    lock = acquire_run_lock(tmp_path, refresh_interval=0.05)
    path = tmp_path / LOCK_FILE
    first = json.loads(path.read_text())
    old = time.time() - 1000
    os.utime(path, (old, old))
    deadline = time.monotonic() + 10
    while path.stat().st_mtime < old + 500 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.stat().st_mtime > old + 500, "the record was not refreshed"
    again = json.loads(path.read_text())  # a refresh rewrites whole, parseable records
    assert again["refreshed_at"] >= first["refreshed_at"] and again["pid"] == os.getpid()
    assert len(path.read_bytes()) % 512 == 0
    lock.release()
    assert path.read_text() == ""
    time.sleep(0.2)
    assert path.read_text() == ""  # the refresher stopped with the release


def test_a_holder_whose_record_was_taken_over_stops_refreshing_it(tmp_path, caplog):
    lock = acquire_run_lock(tmp_path, refresh_interval=None)
    _write_record(tmp_path, host="node-elsewhere", pid=99, slurm_job_id=None)
    with caplog.at_level(logging.ERROR):
        assert lock.refresh() is False
    assert "now names pid 99 on host node-elsewhere" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == 99
    lock.release()


def test_an_unwritable_output_dir_is_one_clear_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(RunLockError, match="needs write access"):
            acquire_run_lock(tmp_path)
    finally:
        tmp_path.chmod(0o700)


# ---- Slurm decides for holders on other hosts -------------------------------------------------

def _sbatch_sleep(seconds: int) -> str:
    proc = subprocess.run(["sbatch", "--parsable", "--wrap", f"sleep {seconds}", "-o", "/dev/null"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _wait_for_state(job_id: str, wanted: set[str]) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if run_lock._slurm_job_state(job_id) in wanted:
            return
        time.sleep(0.2)
    pytest.fail(f"job {job_id} never reached {wanted}")


@pytest.mark.slurm
def test_a_holder_on_another_host_counts_while_its_slurm_job_is_active(slurm_cluster, tmp_path,
                                                                       monkeypatch, caplog):
    job = _sbatch_sleep(300)
    try:
        _wait_for_state(job, {"RUNNING"})
        _write_record(tmp_path, host="node-elsewhere", pid=1234, slurm_job_id=job)
        # Node-local locks (NFS nolock, Lustre localflock) grant the lock: the record still wins.
        with pytest.raises(RunLockError, match=f"Slurm job {job}.*RUNNING.*not shared between nodes"):
            acquire_run_lock(tmp_path)
        _no_file_locks(monkeypatch)
        with pytest.raises(RunLockError, match="Slurm says its job is RUNNING"):
            acquire_run_lock(tmp_path)
    finally:
        subprocess.run(["scancel", job], timeout=60)
    _wait_for_state(job, {"CANCELLED", "GONE"})
    with caplog.at_level(logging.WARNING):
        lock = acquire_run_lock(tmp_path)
    assert "whose Slurm job has ended (CANCELLED)" in caplog.text
    lock.release()
