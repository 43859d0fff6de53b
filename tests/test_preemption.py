"""Preemption signals set a flag (never kill the loop), and the process exits for requeue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.runtime.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler

REPO_ROOT = Path(__file__).resolve().parents[1]

LOOP = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from trainer.runtime.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler

    handler = PreemptionHandler().install()
    print("ready", flush=True)
    steps, deadline = 0, time.monotonic() + 30
    while not handler.requested and time.monotonic() < deadline:
        steps += 1          # a training step
        time.sleep(0.01)
    print(handler.signal_name, steps, flush=True)
    sys.exit(PREEMPTED_EXIT_CODE if handler.requested else 1)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_signal_sets_the_flag_and_the_loop_exits_with_the_requeue_code(sig):
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(REPO_ROOT)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == PREEMPTED_EXIT_CODE
    assert out.split()[0] == sig.name


def test_handler_only_records_signals_in_process_and_uninstall_restores():
    before = signal.getsignal(signal.SIGUSR2)
    with PreemptionHandler(signals=("USR2",)) as handler:
        assert not handler.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.requested and handler.signal_name == "SIGUSR2" and handler.signal_count == 2
    assert signal.getsignal(signal.SIGUSR2) == before


def test_unknown_signal_name_is_rejected():
    with pytest.raises(ValueError, match="unknown signal"):
        PreemptionHandler(signals=("SIGNOPE",))
