"""The local Slurm cluster works as the launcher needs it: sbatch, afterok, kill-on-invalid-dep, sacct."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"}


def sbatch(*args: str) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return out.strip().split(";")[0]


def sacct_states(job_ids: list[str]) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    states = {}
    for line in out.splitlines():
        job, _, state = line.partition("|")
        states[job] = state.split()[0] if state else ""  # "CANCELLED by 0" -> CANCELLED
    return states


def wait_final(job_ids: list[str], timeout: float = 90) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = sacct_states(job_ids)
        if all(states.get(j) in FINAL for j in job_ids):
            return states
        time.sleep(0.3)
    raise AssertionError(f"jobs not final after {timeout} s: {states}")


def test_sbatch_wrap_and_output(slurm_cluster, tmp_path: Path):
    out = tmp_path / "hello.out"
    job = sbatch("-J", "relay-test-hello", "-o", str(out), "--wrap", "echo hello $SLURM_JOB_ID")
    assert wait_final([job]) == {job: "COMPLETED"}
    assert out.read_text().strip() == f"hello {job}"


def test_afterok_chain(slurm_cluster, tmp_path: Path):
    first = sbatch("-o", str(tmp_path / "a.out"), "--wrap", "sleep 1; date +%s.%N")
    second = sbatch(
        "-o", str(tmp_path / "b.out"), f"--dependency=afterok:{first}", "--kill-on-invalid-dep=yes",
        "--wrap", "date +%s.%N",
    )
    assert wait_final([first, second]) == {first: "COMPLETED", second: "COMPLETED"}
    assert float((tmp_path / "b.out").read_text()) >= float((tmp_path / "a.out").read_text())


def test_failed_parent_cancels_dependent(slurm_cluster, tmp_path: Path):
    parent = sbatch("-o", str(tmp_path / "p.out"), "--wrap", "exit 3")
    child = sbatch(
        "-o", str(tmp_path / "c.out"), f"--dependency=afterok:{parent}", "--kill-on-invalid-dep=yes",
        "--wrap", "echo must not run",
    )
    assert wait_final([parent, child]) == {parent: "FAILED", child: "CANCELLED"}
    assert not (tmp_path / "c.out").exists()
