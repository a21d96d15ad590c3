"""A window whose Ray worker died: how it runs again, and when a line is given up.

Contract: Ray restarts a dead actor (killed, its node lost, its engine
crashed: ``ray_worker.py`` ends the process then) and runs the windows it
had in flight again on it, as often as it takes. ``TryLedger`` (one Ray
actor per run, state in the driver's job) counts, so that the worker can
tell a window run again from a new one, find the line that kills its worker
and stop trying that line:

1. a window's first start runs ``SHARED``: in its worker's engine beside the
   other windows there;
2. its second start runs ``WINDOW_ALONE``: the whole window, no other in the
   engine, since most windows lost with a worker were not what killed it;
3. any later start runs ``LINES_ALONE``: one line at a time, nothing else in
   the engine, so a death is charged to the one line that ran.

A line is *started* when its window is handed to the engine (shared), or
when its turn alone comes (the other two), never while it waits for that
turn. A *failed try* is a start that did not finish: the ledger counts them
per line and forgets them when the line finishes. A line that has failed
more than ``max_retries`` tries is not started again: it is *given up*, and
its worker answers it with an error result instead (a status 500 record).
So a line is tried at most ``1 + max_retries`` times, and a line that has not
started when a worker dies is not charged for it. Example, ``max_retries`` 1, a
window ``[a, p]`` where ``p`` kills its worker: shared (a, p fail once),
alone as a window (a, p fail twice), then lines alone: a and p have each
failed 2 > 1 tries, so both are given up. With ``max_retries`` 3 the lines
alone run: a finishes, p fails its 3rd and 4th try, then is given up.

``Gate`` keeps a worker's engine to shared windows or one thing alone.
Nothing here imports ray.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_MAX_RETRIES = 3


class Mode(enum.Enum):
    SHARED = "shared"
    WINDOW_ALONE = "window alone"
    LINES_ALONE = "lines alone"


def mode_of(start: int) -> Mode:
    """How the ``start``-th start of a window runs (module doc)."""
    if start <= 1:
        return Mode.SHARED
    return Mode.WINDOW_ALONE if start == 2 else Mode.LINES_ALONE


def given_up_text(tries: int) -> str:
    """The error of a line given up after ``tries`` failed tries."""
    return (
        f"the Ray worker running this line died on each of its {tries} tries (a killed "
        "process, a lost node or a crash in its engine: see the Ray workers' logs); "
        "--ray-max-retries sets how often it is tried again"
    )


class TryLedger:
    """Starts of windows and failed tries of lines (module doc). Keys are
    request ids; a window's key is its first request's."""

    def __init__(self, max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be at least 0, got {max_retries}")
        self.max_retries = max_retries
        self.window_starts: dict[str, int] = {}
        self.tries: dict[str, int] = {}  # line -> starts not finished
        self.windows_again = 0
        self.given_up = 0

    def start_window(self, window: str) -> Mode:
        """How the window runs this time (module doc). Its lines are started
        only once it runs (``start_lines``): one still waiting for its turn
        when its worker dies has not been tried."""
        start = self.window_starts.get(window, 0) + 1
        self.window_starts[window] = start
        self.windows_again += start > 1
        return mode_of(start)

    def start_lines(self, lines: list[str]) -> list[str]:
        """Starts ``lines`` (a window running ``SHARED`` or ``WINDOW_ALONE``)
        and returns those given up instead."""
        return [line for line in lines if not self.start_line(line)]

    def start_line(self, line: str) -> bool:
        """Starts ``line`` (True), or gives it up (False): module doc."""
        failed = self.tries.get(line, 0)
        if failed > self.max_retries:
            self.given_up += 1
            self.tries.pop(line)
            return False
        self.tries[line] = failed + 1
        return True

    def max_tries(self) -> int:
        return 1 + self.max_retries

    def finish(self, lines: list[str], window: str | None = None) -> None:
        """``lines`` finished (a line given up counts as finished); with
        ``window``, that window returned whole."""
        for line in lines:
            self.tries.pop(line, None)
        if window is not None:
            self.window_starts.pop(window, None)

    def counts(self) -> tuple[int, int]:
        """Starts of windows that had started before, and lines given up."""
        return self.windows_again, self.given_up


class Gate:
    """Shared windows, or one thing alone, in a worker's engine. ``alone``
    waits for the shared windows running to finish and lets no new one in
    meanwhile, so a window run again is never starved."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._alone = False
        self._waiting_alone = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and not self._waiting_alone)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._waiting_alone += 1
            self._cond.wait_for(lambda: not self._alone and not self._shared)
            self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()
