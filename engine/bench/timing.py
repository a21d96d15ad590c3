"""The one timing loop of every benchmark: runs that take turns.

Contract: ``take_turns(runs, repeats)`` first makes the warm-up calls (by
default one call of each run), untimed and thrown away, then ``repeats``
rounds in which every run goes once, round ``r`` starting at run
``r mod len(runs)``. It returns each run's results, round by round; callers
take the min or the median. ``before(round, index)``, when given, is called
before each timed call (a progress line, say).

A run measures itself: it returns its own seconds, or an outcome that holds
them. So what a run needs around its timed part (cropping a cache back,
sampling memory, building a fresh engine) stays out of the figure.
``stopwatch`` makes such a run from a plain call.

Why turns: on a shared machine the load drifts during a benchmark; runs
interleaved round by round see the same drift, and rotating the order keeps
any one run from always going first, or always right after the same other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

R = TypeVar("R")
BeforeTurn = Callable[[int, int], None]  # (round, run index), before each timed call


def take_turns(
    runs: Sequence[Callable[[], R]],
    repeats: int,
    *,
    warmups: Sequence[Callable[[], object]] | None = None,
    before: BeforeTurn | None = None,
) -> list[list[R]]:
    """``results[i][r]``: what run ``i`` returned in round ``r`` (module doc).

    Example: runs ``a, b, c`` and ``repeats=2`` call ``a b c`` (warm-up), then
    ``a b c`` (round 0), then ``b c a`` (round 1)."""
    assert repeats >= 1, "at least one timed round"
    for warmup in runs if warmups is None else warmups:
        warmup()
    results: list[list[R]] = [[] for _ in runs]
    for rep in range(repeats):
        shift = rep % len(runs)
        for index in [*range(shift, len(runs)), *range(shift)]:
            if before is not None:
                before(rep, index)
            results[index].append(runs[index]())
    return results


def stopwatch(
    call: Callable[[], object], after: Callable[[], object] | None = None
) -> Callable[[], float]:
    """A run that returns the seconds ``call`` took; ``after`` (untimed)
    follows every call, warm-ups included, to undo what the call changed."""

    def run() -> float:
        started = time.perf_counter()
        call()
        seconds = time.perf_counter() - started
        if after is not None:
            after()
        return seconds

    return run
