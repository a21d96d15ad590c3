"""Input is read as the engine takes it: standard input's reader thread runs
at most a bounded number of lines ahead."""

from __future__ import annotations

import time
from collections.abc import Iterator

from metrale.cli.reader import prefetched


def test_the_reader_runs_at_most_its_bound_ahead_of_the_consumer() -> None:
    drawn = 0

    def endless() -> Iterator[int | None]:
        nonlocal drawn
        while True:
            drawn += 1
            yield drawn

    items = prefetched(endless(), ahead=8)
    taken: list[int] = []
    while len(taken) < 3:
        item = next(items)
        if item is not None:
            taken.append(item)
    time.sleep(0.2)  # time enough for a reader without a bound to run far ahead
    assert taken == [1, 2, 3]
    assert drawn <= 3 + 8 + 2  # the queue's bound, and one in each hand


def test_a_none_from_the_source_idles_the_reader_and_never_reaches_the_consumer() -> None:
    def source() -> Iterator[str | None]:
        yield None
        yield "a"
        yield None
        yield "b"

    assert [x for x in prefetched(source()) if x is not None] == ["a", "b"]
