"""Records reach the output in the run's order, and a line the output
refused is not counted as written."""

from __future__ import annotations

import orjson
import pytest

from metrale.cli.live import RunCounters
from metrale.cli.options import OutputOrder
from metrale.cli.output import OutputFailed
from metrale.cli.writer import Writer


class ListSink:
    def __init__(self, fail_after: int | None = None) -> None:
        self.lines: list[str] = []
        self.fail_after = fail_after

    def write_line(self, line: str) -> None:
        if self.fail_after is not None and len(self.lines) == self.fail_after:
            raise OutputFailed("out.jsonl", OSError(28, "No space left on device"), whole=True)
        self.lines.append(line)


def test_input_order_holds_records_until_the_earlier_ones_are_out() -> None:
    sink, counters = ListSink(), RunCounters()
    writer = Writer(sink, OutputOrder.input, counters)
    for n in (1, 2, 3):
        writer.expect(n)
    writer.put(3, {"id": 3}, failed=False)
    writer.put(2, {"id": 2}, failed=True)
    assert sink.lines == [] and len(writer.held) == 2
    writer.put(1, {"id": 1}, failed=False)
    assert [orjson.loads(x)["id"] for x in sink.lines] == [1, 2, 3]
    assert (counters.written, counters.failed, writer.held) == (3, 1, {})


def test_a_line_the_sink_refused_is_not_counted_as_written() -> None:
    counters = RunCounters()
    writer = Writer(ListSink(fail_after=1), OutputOrder.completed, counters)
    writer.put(1, {"id": 1}, failed=False)
    with pytest.raises(OutputFailed):
        writer.put(2, {"id": 2}, failed=False)
    assert counters.written == 1
