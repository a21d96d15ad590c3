"""Records to the output, in the run's order, with a bound on what waits.

Contract: ``Writer.put`` writes a record at once under ``--order completed``;
under ``--order input`` it holds the record until every earlier line's record
is out. What is held back is bounded: ``backed_up()`` is true while the held
records reach ``HeldLimit`` (lines or bytes), and the reader takes no new
line until it is false again, so a slow line at the front makes the lines
behind it wait in the input, not in memory. The running requests (the slow
one among them) go on meanwhile, so the backlog always clears.

Each record is counted as written before it is handed to the sink and
uncounted if the sink fails it, so the summary never counts a line the
output lacks, nor the reverse (a stop lands between two lines: the sink
holds it off while it writes one). A sink that fails (``output.py``) fails
every later write too: the run stops there.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from metrale.cli.live import RunCounters
from metrale.cli.options import OutputOrder
from metrale.cli.output import LineSink, OutputFailed
from metrale.cli.records import dumps


@dataclass(frozen=True)
class HeldLimit:
    """How much ``--order input`` may hold back before the reader waits: a
    record is a few hundred bytes for short answers, a long answer's text for
    long ones, so both a count and a size bound it."""

    lines: int = 4096
    bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.lines < 1 or self.bytes < 1:
            raise ValueError(f"held limits must be positive, got {self}")


class Writer:
    """Writes records in the plan's order (module doc), counting failures."""

    def __init__(
        self,
        out: LineSink,
        order: OutputOrder,
        counters: RunCounters,
        limit: HeldLimit | None = None,
    ) -> None:
        self.out, self.order, self.counters = out, order, counters
        self.limit = limit or HeldLimit()
        self.expected: deque[int] = deque()  # line numbers owed a record, input order
        self.held: dict[int, str] = {}
        self.held_bytes = 0
        # Error records are put by the input reader, which an engine may run
        # on its own thread; results are put by the thread driving the engine.
        self.lock = threading.Lock()

    def expect(self, number: int) -> None:
        if self.order is OutputOrder.input:
            with self.lock:
                self.expected.append(number)

    def put(self, number: int, record: dict[str, Any], failed: bool) -> None:
        line = dumps(record)
        with self.lock:
            self.counters.failed += failed
            if self.order is OutputOrder.completed:
                self._write(line)
                return
            self.held[number] = line
            self.held_bytes += len(line)
            while self.expected and self.expected[0] in self.held:
                self._write(self._release(self.expected.popleft()))

    def backed_up(self) -> bool:
        """True while the records held back for input order reach the limit."""
        return len(self.held) >= self.limit.lines or self.held_bytes >= self.limit.bytes

    def release_held(self) -> None:
        """Writes what is held back, in input order, gaps and all."""
        with self.lock:
            for number in sorted(self.held):
                self._write(self._release(number))

    def _release(self, number: int) -> str:
        line = self.held.pop(number)
        self.held_bytes -= len(line)
        return line

    def _write(self, line: str) -> None:
        self.counters.written += 1
        try:
            self.out.write_line(line)
        except OutputFailed:
            self.counters.written -= 1
            raise
