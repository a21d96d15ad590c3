"""Cluster-wide figures: the ``EngineStats`` of many engines as one.

Contract: ``add_stats`` sums snapshots field by field, whatever fields
``EngineStats`` holds (counters add, per-position tuples add position by
position, histograms add bucket by bucket, nested counters such as
``LookupStats`` add recursively), so a counter the engine gains is summed
without a change here; an optional report that is None in a snapshot (the
draft budget's per-machine cost model) stays None in the sum. ``wall_s`` is not a sum: the caller sets the cluster's
own clock, so ``tokens_per_s`` is the cluster's throughput. ``WorkerStats``
keeps each worker's latest snapshot; any thread may read its total.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from metrale.engine.stats import EngineStats

T = TypeVar("T")


def add_stats(snapshots: Iterable[EngineStats], wall_s: float) -> EngineStats:
    """The sum of ``snapshots`` with ``wall_s`` as its wall time.

    Example: two workers that generated 10 and 5 tokens with MTP drafts
    proposed ``(4, 2)`` and ``(3,)`` by position add to 15 tokens and
    ``(7, 2)``."""
    total = EngineStats()
    for snap in snapshots:
        total = _add(total, snap)
    return dataclasses.replace(total, wall_s=wall_s)


def _add(a: T, b: T) -> T:
    if a is None or b is None:
        # An optional report (``budget``: one engine's cost model and
        # estimates) describes one machine and does not add up across them.
        return None  # type: ignore[return-value]
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        sums = {f.name: _add(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)}
        return type(a)(**sums)
    if isinstance(a, tuple):
        assert isinstance(b, tuple)
        longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
        padded = shorter + (0,) * (len(longer) - len(shorter))
        return tuple(x + y for x, y in zip(longer, padded, strict=True))  # type: ignore[return-value]
    if isinstance(a, dict):
        assert isinstance(b, dict)
        merged: dict[Any, Any] = dict(a)
        for key, value in b.items():
            merged[key] = _add(merged[key], value) if key in merged else value
        return merged  # type: ignore[return-value]
    if isinstance(a, bool):  # a feature on any worker is on for the cluster
        return a or b
    return a + b  # type: ignore[operator]


class WorkerStats:
    """The latest snapshot of each worker, by the worker's key, and the
    cluster's clock. A worker's snapshots are cumulative, so the newest
    replaces the one before. The clock starts when the first engine started
    (a snapshot received at ``t`` with ``wall_s`` says its engine started at
    ``t - wall_s`` on this machine's clock: no clocks of two machines are
    compared) and stops at ``freeze``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._latest: dict[str, EngineStats] = {}
        self._started: float | None = None
        self._ended: float | None = None
        self._lock = threading.Lock()

    def update(self, worker: str, snapshot: EngineStats) -> None:
        """Keeps ``snapshot`` unless one taken later (a longer ``wall_s``) is
        already in: windows of one worker may come back out of order."""
        started = self._clock() - snapshot.wall_s
        with self._lock:
            kept = self._latest.get(worker)
            if kept is None or snapshot.wall_s >= kept.wall_s:
                self._latest[worker] = snapshot
            if self._started is None or started < self._started:
                self._started = started

    def freeze(self) -> None:
        """Stops the clock: the run is over."""
        with self._lock:
            self._ended = self._clock()

    def total(self) -> EngineStats:
        with self._lock:
            snapshots = list(self._latest.values())
            started, ended = self._started, self._ended
        wall_s = 0.0 if started is None else (self._clock() if ended is None else ended) - started
        return add_stats(snapshots, max(wall_s, 0.0))

    @property
    def num_workers(self) -> int:
        with self._lock:
            return len(self._latest)
