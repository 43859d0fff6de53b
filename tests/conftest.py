"""Shared pytest fixtures.

slurm_cluster: the one-machine Slurm cluster of slurm/local/ (session scoped).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SLURM_START = REPO_ROOT / "slurm" / "local" / "start.sh"


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; registering here keeps the fixture self-contained.
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster (slurm/local/start.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that uses the cluster is a `slurm` test, marked or not (so `-m "not slurm"` works).
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slurm)


@dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    log_dir: Path
    start_output: str


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """Start (or find running) the local Slurm cluster; it stays up after the session.

    start.sh is idempotent: about 0.2 s when the cluster is already healthy, ~5 s from a
    stopped cluster, ~30 s when it must install packages first. When it fails the test
    FAILS with the script's output, unless RELAY_ALLOW_NO_SLURM=1, where it is skipped.
    """
    state = Path(os.environ.get("RELAY_SLURM_STATE", "/tmp/slurm-local"))
    try:
        proc = subprocess.run(
            ["bash", str(SLURM_START)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=900,
        )
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"")
        rc, output = -1, (out.decode(errors="replace") if isinstance(out, bytes) else str(out))
        output += "\n(start.sh timed out after 900 s)"
    if rc != 0:
        message = f"slurm/local/start.sh failed (exit {rc}):\n{output}"
        if os.environ.get("RELAY_ALLOW_NO_SLURM") == "1":
            print(f"\n!!! SKIPPING Slurm tests (RELAY_ALLOW_NO_SLURM=1): {message}", flush=True)
            pytest.skip(f"RELAY_ALLOW_NO_SLURM=1 and no local Slurm cluster: {message}")
        pytest.fail(message, pytrace=False)
    return SlurmCluster(state_dir=state, log_dir=state / "log", start_output=output)
