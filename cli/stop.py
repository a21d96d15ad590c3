"""SIGINT and SIGTERM: a run stops cleanly on the first, at once on the second.

Contract: inside ``stop_signals()``, the first SIGINT (Ctrl-C) or SIGTERM
(``timeout``, Slurm, Kubernetes, a preempted machine) raises ``Stopped`` in
the main thread. ``Stopped`` is a ``KeyboardInterrupt``, so what unwinds on
Ctrl-C unwinds the same way: the run writes the lines it has finished, closes
the live view and prints its summary, and the command exits ``128 + signal``
(130, 143). A second signal, while that cleanup runs, ends the process at
once, killed by that signal: nothing more is written, and a line cut off
mid-write is repaired by ``--resume``. On leaving the block the handlers
found on entry are put back.

A stop that comes while a line is being written (``held()``, on any thread)
waits for that line to be out, then acts: an output line is written whole,
and counted, or not at all. Holding a signal mask would not do: a signal to
the process may land on any thread, and Python raises it in the main thread.

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


class _State:
    """The process's stop, shared by the handler and ``held`` (signals are
    the process's, so this is too)."""

    def __init__(self) -> None:
        self.holding = 0  # writes under way that a stop waits for
        self.pending: int | None = None  # a signal that came during one
        self.stopping = False  # a stop was raised: the next signal kills
        # Reentrant: the handler takes it in the main thread, which may be
        # holding it already (a line written there).
        self.lock = threading.RLock()


_STATE = _State()


@contextmanager
def held() -> Iterator[None]:
    """A stop that comes while the body runs acts when it ends (module doc)."""
    with _STATE.lock:
        _STATE.holding += 1
    try:
        yield
    finally:
        with _STATE.lock:
            _STATE.holding -= 1
            signum = _STATE.pending if _STATE.holding == 0 else None
            if signum is not None:
                _STATE.pending = None
        if signum is not None:
            # Sent again, so that it is raised in the main thread whichever
            # thread was writing.
            os.kill(os.getpid(), signum)


@contextmanager
def stop_signals() -> Iterator[None]:
    """The module's contract, for the body of the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    state = _STATE
    state.stopping, state.pending = False, None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if state.stopping or state.pending is not None:
            # The default action of the signal itself, so the parent (a shell,
            # a scheduler) sees the process killed by it, as it asked.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)  # not reached: the signal's action ends the process
        with state.lock:
            if state.holding:
                state.pending = signum
                return
        state.stopping = True
        raise Stopped(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
