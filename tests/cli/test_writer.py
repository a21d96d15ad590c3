"""Records reach the output in the run's order; what waits behind a slow
line is bounded, and the input waits instead."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from metrale.cli.jsonl import LineDefaults
from metrale.cli.live import RunCounters
from metrale.cli.options import OutputOrder
from metrale.cli.output import OutputFailed
from metrale.cli.run import Backend, RunPlan, run
from metrale.cli.writer import HeldLimit, Writer
from metrale.engine.api import Request, RequestStats, Result
from metrale.engine.stats import EngineStats
from tests.support.cli_fakes import ByteTokenizer


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
    assert (counters.written, counters.failed, writer.held_bytes) == (3, 1, 0)


def test_the_writer_backs_up_at_either_limit() -> None:
    writer = Writer(ListSink(), OutputOrder.input, RunCounters(), HeldLimit(lines=3, bytes=40))
    writer.expect(0)
    for n in (1, 2):
        writer.put(n, {"id": n}, failed=False)
    assert not writer.backed_up()
    writer.put(3, {"id": 3}, failed=False)
    assert writer.backed_up()  # three lines
    writer.release_held()
    writer.put(4, {"text": "x" * 40}, failed=False)
    assert writer.backed_up()  # one line of 40 bytes and more


def test_a_line_the_sink_refused_is_not_counted_as_written() -> None:
    counters = RunCounters()
    writer = Writer(ListSink(fail_after=1), OutputOrder.completed, counters)
    writer.put(1, {"id": 1}, failed=False)
    with pytest.raises(OutputFailed):
        writer.put(2, {"id": 2}, failed=False)
    assert counters.written == 1


class StoppedAfterWriting(ListSink):
    def write_line(self, line: str) -> None:
        super().write_line(line)
        raise KeyboardInterrupt  # a stop held off until the line was out


def test_a_stop_as_a_line_is_written_counts_that_line() -> None:
    counters, sink = RunCounters(), StoppedAfterWriting()
    with pytest.raises(KeyboardInterrupt):
        Writer(sink, OutputOrder.completed, counters).put(1, {"id": 1}, failed=False)
    assert counters.written == len(sink.lines) == 1


class SlowHeadEngine:
    """Finishes every request at once but the first, which it holds until
    its source has nothing for it (a ``None``): a slow line at the front.
    ``pulled`` is how many requests it had taken when that happened."""

    def __init__(self) -> None:
        self.pulled: int | None = None

    def generate(self, requests: Iterable[Request | None]) -> Iterator[Result]:
        head: Request | None = None
        taken = 0
        for request in requests:
            if request is None:
                if self.pulled is None:
                    self.pulled = taken
                if head is not None:
                    yield answer(head)
                    head = None
                continue
            taken += 1
            if taken == 1:
                head = request
            else:
                yield answer(request)
        if head is not None:
            yield answer(head)


def answer(request: Request) -> Result:
    ids = request.prompt_ids[:2]
    return Result(request.request_id, len(request.prompt_ids), ids, "ab", "length", RequestStats())


@pytest.mark.parametrize("limit", [HeldLimit(lines=5), HeldLimit(bytes=1000)])
def test_a_slow_line_at_the_front_makes_the_input_wait_not_memory(
    tmp_path: Path, limit: HeldLimit
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": i, "prompt": "abc"}) + b"\n" for i in range(200)))
    engine = SlowHeadEngine()
    backend = Backend("fake", ByteTokenizer(), (0,), 1024, engine.generate, EngineStats)
    plan = RunPlan(
        inputs=(str(src),),
        output=None,
        order=OutputOrder.input,
        skip_ids=frozenset(),
        stats_json=None,
        progress="off",
        defaults=LineDefaults(),
        settings={},
        held=limit,
    )
    sink = ListSink()
    assert run(plan, backend, sink, Console(file=io.StringIO())) == 0
    assert [orjson.loads(x)["id"] for x in sink.lines] == list(range(200))
    # The reader stopped once the records behind the slow one reached the limit.
    held = sizes = 0
    while held < limit.lines and sizes < limit.bytes:
        held += 1
        sizes += len(sink.lines[held])
    assert engine.pulled == 1 + held
