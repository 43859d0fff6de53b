"""Shared pytest fixtures and markers.

slurm_cluster: the one-machine Slurm cluster of slurm/local/ (session scoped).
gpu: tests that need CUDA; skipped without it (`pytest -m gpu` runs exactly them).
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SLURM_START = REPO_ROOT / "slurm" / "local" / "start.sh"


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; registering here keeps the fixtures self-contained.
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster (slurm/local/start.sh)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    # Without a GPU, relay's Triton kernels (trainer/models/triton_kernels.py) run in Triton's
    # interpreter on CPU tensors (tests/test_fused_ops.py). Triton reads the switch when it is
    # first imported, so it is set here, before any test module is.
    if not Path("/dev/nvidiactl").exists():
        os.environ.setdefault("TRITON_INTERPRET", "1")


# tryfirst: xdist's worker reads the xdist_group marks in this same hook, so they must be
# on the items before it runs (otherwise the groups below are silently ignored).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that uses the cluster is a `slurm` test, marked or not (so `-m "not slurm"` works).
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slurm)
        # Under `pytest -n N --dist loadgroup` (scripts/test.sh) the cluster's tests run in one
        # worker, one after another: they share its one node and their time limits assume it free.
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        # A module-scoped fixture (a trained chain, a saved model) is built once per worker that
        # runs one of its tests: keeping the module's tests together builds it once.
        elif _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # `gpu` tests skip where CUDA is missing, so the whole suite runs anywhere and a GPU machine
    # runs exactly them with `pytest -m gpu`. torch is imported only when one was collected.
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
            for item in gpu_items:
                item.add_marker(skip)


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        definition.scope == "module"
        for definitions in info.name2fixturedefs.values() for definition in definitions)


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


# ---------------------------------------------------------------------------------------------
# tiny_trainer: real `python trainer/train.py` runs of a very small model (trainer-level tests)
# ---------------------------------------------------------------------------------------------

TINY_MODEL = ("{hidden_size: 32, num_attention_heads: 2, num_layers: 1, rope_axes_dim: [4, 6, 6], "
              "text_dim: 32, patch_size: [1, 4, 4], in_channels: 3}")
TINY_MAX_STEPS = 12


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class TinyTrainer:
    """Builds and runs train.py commands for one small, fully deterministic configuration.

    Every run made through `command` shares the data directory and every argument except
    output_dir and the `extra` ones, so a run's loss trajectory can be compared bit for bit
    with `reference()`: an uninterrupted run (save_interval 2, all checkpoints kept).
    """

    def __init__(self, root: Path) -> None:
        import sys

        self.root = root
        self.python = sys.executable
        self.data_path = root / "data"
        self._reference: Path | None = None

    def args(self, output_dir: Path, *extra: str, config: str = "pretrain") -> list[str]:
        return [
            "--config", str(REPO_ROOT / "config" / "tiny" / f"{config}.yaml"),
            "--transformer_config_overrides", TINY_MODEL,
            "--train_batch_size", "4", "--synthetic_num_samples", "64",
            "--data_path", str(self.data_path), "--output_dir", str(output_dir),
            "--max_steps", str(TINY_MAX_STEPS), "--warmup_steps", "4",
            "--log_interval", "1", "--save_interval", "2", "--validation_interval", "-1",
            "--deterministic", "true", *extra,
        ]

    def command(self, output_dir: Path, *extra: str, config: str = "pretrain") -> list[str]:
        return [self.python, str(REPO_ROOT / "trainer" / "train.py"),
                *self.args(output_dir, *extra, config=config)]

    @staticmethod
    def env(**extra: str) -> dict[str, str]:
        # One thread per process: the machine has two cores, shared with other work.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        env.pop("WANDB_API_KEY", None)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_JOB_ID"):
            env.pop(key, None)
        env.update(extra)
        return env

    def run(self, output_dir: Path, *extra: str, config: str = "pretrain", timeout: float = 180,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run train.py to its end; returns the finished process (stdout/stderr as text)."""
        return subprocess.run(self.command(output_dir, *extra, config=config), cwd=REPO_ROOT,
                              env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def start(self, output_dir: Path, *extra: str, config: str = "pretrain",
              log: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start train.py in the background; stdout and stderr go to `log` (default:
        <output_dir>.log, appended). It starts with SIGINT's default action, as a command
        typed at a terminal does, even when the tests themselves run in a background job
        (which a non-interactive shell starts with SIGINT ignored, and children inherit)."""
        log = log or output_dir.with_name(output_dir.name + ".log")
        handle = open(log, "ab")
        try:
            return subprocess.Popen(self.command(output_dir, *extra, config=config),
                                    cwd=REPO_ROOT, env=env or self.env(), stdout=handle,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_default_sigint)
        finally:
            handle.close()

    def reference(self) -> Path:
        """The output_dir of the uninterrupted run (made once per session)."""
        if self._reference is None:
            out = self.root / "reference"
            proc = self.run(out, "--save_total_limit", "0")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            self._reference = out
        return self._reference

    @staticmethod
    def losses(output_dir: Path) -> list[tuple[int, float]]:
        """(step, loss) of every record in metrics.jsonl, in file order."""
        import json

        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


@pytest.fixture(scope="session")
def tiny_trainer(tmp_path_factory: pytest.TempPathFactory) -> TinyTrainer:
    """A TinyTrainer rooted in a session temp directory (its data is generated once)."""
    return TinyTrainer(tmp_path_factory.mktemp("tiny-trainer"))
