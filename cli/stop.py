"""SIGINT and SIGTERM: a run stops cleanly on the first, at once on the second.

Contract: inside ``stop_signals()``, the first SIGINT (Ctrl-C) or SIGTERM
(``timeout``, Slurm, Kubernetes, a preempted machine) raises ``Stopped`` in
the main thread, wherever it is. ``Stopped`` is a ``KeyboardInterrupt``, so
what unwinds on Ctrl-C unwinds the same way: the run writes the lines it has
finished, closes the live view and prints its summary, and the command exits
``128 + signal`` (130, 143). A second signal, while that cleanup runs, ends
the process at once, killed by that signal: nothing more is written, and a
line cut off mid-write is repaired by ``--resume``. On leaving the block the
handlers found on entry are put back.

Outside the main thread no handler can be installed; the block then changes
nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """The run was asked to stop by ``signum``; the command exits ``status``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def status(self) -> int:
        return 128 + self.signum


def stop_status(exc: KeyboardInterrupt) -> int:
    """The exit status for ``exc``: a plain ``KeyboardInterrupt`` (Ctrl-C seen
    outside ``stop_signals``) is SIGINT's."""
    return exc.status if isinstance(exc, Stopped) else 128 + signal.SIGINT


@contextmanager
def stop_signals() -> Iterator[None]:
    """The module's contract, for the body of the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            # The default action of the signal itself, so the parent (a shell,
            # a scheduler) sees the process killed by it, as it asked.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)  # not reached: the signal's action ends the process
        stopping = True
        raise Stopped(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
