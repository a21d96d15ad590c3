"""Input lines, read lazily: as the engine takes them, never ahead of it.

Contract: ``read_lines`` yields the non-blank lines of the inputs one at a
time, numbered across inputs. ``prefetched`` moves a source that may block
(standard input) onto a reader thread, at most ``PREFETCH_LINES`` ahead of
its consumer, and yields ``None`` when nothing new is ready, so the engine
decodes what it holds instead of waiting for a slow pipe, and a fast pipe is
read no faster than its lines are used.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

from metrale.cli.jsonl import LineRef

# Lines standard input's reader may have parsed ahead of the engine.
PREFETCH_LINES = 256
_IDLE_S = 0.005  # how long the reader waits when its source has nothing for it

T = TypeVar("T")


def count_lines(inputs: tuple[str, ...]) -> int | None:
    """Non-blank lines over all inputs; None when one is standard input."""
    if "-" in inputs:
        return None
    total = 0
    for path in inputs:
        with open(path, "rb") as f:
            total += sum(1 for line in f if line.strip())
    return total


def read_lines(inputs: tuple[str, ...]) -> Iterator[tuple[LineRef, bytes]]:
    """Non-blank lines, lazily, numbered across inputs (blank lines count)."""
    number = 0
    for path in inputs:
        stream = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
        name = "<stdin>" if path == "-" else path
        try:
            for i, raw in enumerate(stream, start=1):
                number += 1
                if i == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM some editors write
                if raw.strip():
                    yield LineRef(number, f"{name}:{i}"), raw
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()


def prefetched(items: Iterator[T | None], ahead: int = PREFETCH_LINES) -> Iterator[T | None]:
    """``items`` drawn on a reader thread, at most ``ahead`` of the consumer;
    ``None`` whenever nothing new is ready yet, which the engine takes as
    "decode what you hold" (see ``Engine.generate``). A pipe whose writer is
    slow (a producer still working, `tail -f`) then never holds back the
    requests already running, and a fast one is read no faster than it is
    used. A ``None`` from ``items`` (its own "nothing yet") idles the reader.
    An exception in the reader comes out here, where the items are consumed."""
    ready: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=ahead)

    def reader() -> None:
        try:
            for item in items:
                if item is None:
                    time.sleep(_IDLE_S)
                    continue
                ready.put(("item", item))
        except BaseException as exc:  # handed to the consumer, which raises it
            ready.put(("error", exc))
        ready.put(("end", None))

    threading.Thread(target=reader, name="metrale-input", daemon=True).start()
    while True:
        try:
            kind, value = ready.get_nowait()
        except queue.Empty:
            yield None
            continue
        if kind == "end":
            return
        if kind == "error":
            raise value
        yield value
