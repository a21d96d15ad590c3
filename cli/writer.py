"""Records to the output, in the run's order.

Contract: ``Writer.put`` writes a record at once under ``--order completed``;
under ``--order input`` it holds the record until every earlier line's record
is out.

Each record is counted as written before it is handed to the sink and
uncounted if the sink takes none of it, so the summary never counts a line
the output lacks, nor the reverse. A sink that fails (``output.py``) fails
every later write too: the run stops there.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from metrale.cli.live import RunCounters
from metrale.cli.options import OutputOrder
from metrale.cli.output import LineSink
from metrale.cli.records import dumps


class Writer:
    """Writes records in the plan's order (module doc), counting failures."""

    def __init__(
        self,
        out: LineSink,
        order: OutputOrder,
        counters: RunCounters,
    ) -> None:
        self.out, self.order, self.counters = out, order, counters
        self.expected: deque[int] = deque()  # line numbers owed a record, input order
        self.held: dict[int, str] = {}
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
            while self.expected and self.expected[0] in self.held:
                self._write(self.held.pop(self.expected.popleft()))

    def release_held(self) -> None:
        """Writes what is held back, in input order, gaps and all."""
        with self.lock:
            for number in sorted(self.held):
                self._write(self.held.pop(number))

    def _write(self, line: str) -> None:
        self.counters.written += 1
        try:
            self.out.write_line(line)
        except BaseException:
            self.counters.written -= 1
            raise
