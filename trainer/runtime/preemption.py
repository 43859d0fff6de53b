"""Turn a preemption signal into a flag the training loop checks at step boundaries.

The protocol (docs/checkpoints.md): Slurm sends SIGUSR2 some time before the end of a job's
allocation (`--signal=USR2@<lead>`) and SIGTERM when it cancels or preempts. The handler only
records that a signal arrived: doing real work inside a signal handler (saving, logging,
collectives) can interrupt the main thread in the middle of a write or a collective and deadlock
or corrupt state. The loop polls `requested`, agrees with every rank through
`trainer.parallel.distributed.any_rank`, saves a checkpoint at the step boundary and exits with
`PREEMPTED_EXIT_CODE` so the launcher requeues the job.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Any, Iterable, Iterator


# sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry". Deliberately not
# 143 (128 + SIGTERM): that is also what a rank killed by SIGTERM *without* saving returns, so the
# launcher could not tell "saved, please requeue" from "died". 75 is used by nothing else in
# torch, torchrun or Slurm.
PREEMPTED_EXIT_CODE = 75

DEFAULT_SIGNALS = ("SIGUSR2", "SIGTERM")


class PreemptionHandler:
    """Installs signal handlers that only set a flag.

    Use as a context manager or call `install()` / `uninstall()` from the main thread (Python only
    delivers signals there). A second signal while the flag is set is counted and otherwise
    ignored: the save already pending must not be interrupted.
    """

    def __init__(self, signals: Iterable[str | int] = DEFAULT_SIGNALS) -> None:
        self._signals = tuple(_resolve_signal(s) for s in signals)
        self._previous: dict[signal.Signals, Any] = {}
        self._signal: signal.Signals | None = None
        self._count = 0

    @property
    def requested(self) -> bool:
        """True once any of the watched signals has arrived in this process."""
        return self._signal is not None

    @property
    def signal_name(self) -> str | None:
        """Name of the first signal received ("SIGUSR2"), or None."""
        return self._signal.name if self._signal is not None else None

    @property
    def signal_count(self) -> int:
        """How many watched signals arrived so far."""
        return self._count

    def install(self) -> "PreemptionHandler":
        """Install the handlers, remembering the previous ones. Returns self.

        Raises ValueError when called outside the main thread (Python's rule for signal.signal).
        """
        for sig in self._signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before `install()`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only plain assignments here: no logging, no I/O (see the module docstring).
        self._count += 1
        if self._signal is None:
            self._signal = signal.Signals(signum)

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def _resolve_signal(sig: str | int) -> signal.Signals:
    if isinstance(sig, str):
        name = sig.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"unknown signal {sig!r}; use a name such as 'SIGUSR2' or 'SIGTERM'") from None
    return signal.Signals(sig)


__all__ = [
    "DEFAULT_SIGNALS",
    "PREEMPTED_EXIT_CODE",
    "PreemptionHandler",
    "interrupts_deferred",
]


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block ends.

    A checkpoint save cut in half is lost work: the save finishes and is published, then the
    KeyboardInterrupt is raised. Only the default handler is deferred (a run whose
    preemption_signal is SIGINT keeps its own), and only in the main thread.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
