"""Two real train.py processes on one output_dir: the second refuses and touches nothing.

The first run holds `<output_dir>/.relay-lock` for its whole life (trainer.runtime.lock); a second
run started meanwhile must exit 2 with one paragraph naming the first, and leave every file of
the first run as it was. A run killed with SIGKILL leaves a stale record, which the next run
reports and takes over.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

PREEMPTED = 75  # trainer.runtime.preemption.PREEMPTED_EXIT_CODE
LOCK_FILE = ".relay-lock"  # trainer.runtime.lock.LOCK_FILE


def _wait_until(condition, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            pytest.fail(f"the first run ended early (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"timed out waiting for the first run:\n{log.read_text()[-3000:]}")


def _holder_pid(out: Path) -> int | None:
    try:
        return json.loads((out / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _logged_steps(out: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


def test_a_second_run_on_a_busy_output_dir_exits_2_naming_the_first_and_changes_nothing(
        tiny_trainer, tmp_path):
    out, log = tmp_path / "run", tmp_path / "first.log"
    first = tiny_trainer.start(out, "--max_steps", "100000", "--save_interval", "100000", log=log)
    try:
        _wait_until(lambda: _holder_pid(out) == first.pid and len(_logged_steps(out)) >= 2,
                    first, log)
        before = {name: (out / name).read_bytes()
                  for name in ("resolved-config.json", "launch-manifest.json", "train.log")}
        second = tiny_trainer.run(out, "--seed", "7")
        assert first.poll() is None, "the first run must still be running for this test to mean anything"
        assert second.returncode == 2, second.stdout + second.stderr
        refusal = [line for line in second.stderr.splitlines() if "in use by another run" in line]
        assert len(refusal) == 1, second.stderr
        assert f"pid {first.pid} on host" in refusal[0] and f"delete {out / LOCK_FILE}" in refusal[0]
        assert "Traceback" not in second.stderr
        # Nothing of the first run was rewritten, and the second wrote no result of its own.
        # (train.log: the first run keeps appending to it, so compare what was there before.)
        assert (out / "resolved-config.json").read_bytes() == before["resolved-config.json"]
        assert (out / "launch-manifest.json").read_bytes() == before["launch-manifest.json"]
        assert (out / "train.log").read_bytes().startswith(before["train.log"])
        assert not (out / "run-result.json").exists()
        assert _holder_pid(out) == first.pid
    finally:
        first.send_signal(signal.SIGUSR2)
        code = first.wait(timeout=120)
    assert code == PREEMPTED, log.read_text()[-3000:]
    assert json.loads((out / "run-result.json").read_text())["status"] == "preempted"
    assert json.loads((out / "resolved-config.json").read_text())["seed"] != 7
    steps = _logged_steps(out)
    assert steps == sorted(set(steps)), "a step was logged twice"
    assert (out / LOCK_FILE).read_text() == ""  # released at exit


def test_a_run_killed_with_sigkill_leaves_a_stale_lock_that_the_restart_reports_and_takes_over(
        tiny_trainer, tmp_path):
    out, log = tmp_path / "run", tmp_path / "first.log"
    first = tiny_trainer.start(out, log=log)
    _wait_until(lambda: (out / "checkpoint-2").is_dir(), first, log)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert _holder_pid(out) == first.pid  # the record outlives the process; the lock does not
    restart = tiny_trainer.run(out)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert f"stale lock of pid {first.pid}" in restart.stderr
    assert json.loads((out / "run-result.json").read_text())["status"] == "completed"
