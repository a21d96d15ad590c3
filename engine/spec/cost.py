"""What a step costs on this machine: the verify forward by its row count, the
MTP head's forwards, and the rest of the step, measured as the run goes.

Owner: the draft budget (``budget.py``), which asks ``step_s`` for the time
of a step of ``rows`` verify rows and feeds every measured step back.

Contract:
- Every figure is seconds of wall time read from ``clock`` (injected in
  tests: a fake model that advances a fake clock by the cost it is told to
  have makes the whole budget deterministic).
- ``verify`` holds one running estimate per row-count bucket (exact up to
  16 rows, then coarser, ``bucket``). Up to 16 rows a count between measured
  buckets is interpolated linearly between its neighbours; beyond the widest
  measured it is extrapolated along the cost of the last measured row, and
  below the narrowest it costs what the narrowest does. Above 16 rows (a
  batch's verify with drafts) it is read off one straight line through the
  16-row bucket, whose slope is the mean of the wide buckets' own slopes,
  each weighed by how often it was measured: neighbouring buckets measured
  on a noisy moment may come out equal, and interpolated they would price
  the rows between as free; weighed by their counts, the widths a run
  verifies decide the slope. A bucket measured again moves by ``ALPHA``
  towards the new figure, so the estimate follows the context growing and
  the machine getting busier.
- ``head`` is the time of one MTP head forward by the sequences it feeds,
  the same way, measured as the run's calls to the drafter take it (its
  Python and reads included); ``other_s`` the rest of a step (sampling,
  lookup, grammar, Python) beyond its verify and the head's forwards after
  it, one running figure.
- ``held_row_s``: what a row held back while a chain rested adds to the
  head forward that takes it (``observe_held``: what such a forward took
  beyond ``head``'s figure for its feeds, per held row), calibrated with the
  head (a call feeding its widest count of sequences
  ``HELD_CALIBRATION_ROWS`` rows each, beyond the same call feeding one row
  each). The figure is seconds over rows, both summed and decayed by
  ``ALPHA`` a call, the calibration counting as the rows it measured, so a
  catch-up of many rows weighs more than one of a few, whose rows carry the
  call's own noise, and a low figure climbs back.
- ``calibrate`` warm-starts ``verify`` from a few forwards at chosen widths,
  and, when the run has a head, ``head`` from a few drafter calls feeding 1,
  2, 4... sequences a row each: a run whose chains rest from the start
  would otherwise never measure the head. The figures come from a
  ``CostCache`` (``calibration.py``) when it holds them for this set-up; a
  cache lacking either table is measured again whole, and a run with no
  head keeps the head's stored figures, so its ``save`` does not drop them.
  A run stores its costs again as it ends (``save``), so a calibration
  taken on a busy moment heals.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import time
from collections.abc import Callable, Mapping

from metrale.engine.spec.calibration import Calibration, CostCache

# How far a new measurement moves its bucket's estimate, and the most a
# single one counts for, as a multiple of the estimate.
ALPHA = 0.15
SPIKE = 2.0
# Calibration widths: the verify shapes a run meets most (1 sequence with
# drafts, or a batch with up to 3 drafts each), and the head forwards' (the
# sequences one feeds, a row each).
CALIBRATION_ROWS = (1, 2, 3, 4, 8, 16, 32, 64)
CALIBRATION_FEEDS = (1, 2, 4, 8, 16)
# Rows each sequence hands the head in the calibration's held-row call; a
# stored held-row figure counts as the rows of the widest such call.
HELD_CALIBRATION_ROWS = 16
SEEDED_HELD_ROWS = CALIBRATION_FEEDS[-1] * (HELD_CALIBRATION_ROWS - 1)
# Buckets are exact up to this many rows; wider verifies are priced by a line.
FINE_ROWS = 16

Clock = Callable[[], float]

# Versions of estimates: a new number on every change of any of them, so a
# figure derived from several can be kept until one of them moves.
_VERSIONS = itertools.count(1)


def bucket(rows: int) -> int:
    """The bucket a verify of ``rows`` rows is kept in: exact up to 16, then
    rounded up to a multiple of 4 up to 64, of 16 beyond."""
    if rows <= FINE_ROWS:
        return max(rows, 1)
    step = 4 if rows <= 64 else 16
    return -(-rows // step) * step


class RunningCosts:
    """Running estimates of seconds by row count, interpolated between buckets."""

    def __init__(self, initial: Mapping[int, float] | None = None) -> None:
        self._by_bucket: dict[int, float] = dict(initial or {})
        # The mean row count each bucket measured (its key until it has).
        self._rows: dict[int, float] = {k: float(k) for k in self._by_bucket}
        self._count: dict[int, int] = dict.fromkeys(self._by_bucket, 1)  # measurements
        self._keys: list[int] = sorted(self._by_bucket)
        self._monotone: dict[int, float] = {}
        self._line: tuple[float, float] | None = None  # (cost at FINE_ROWS, per row)
        self.version = next(_VERSIONS)
        self._repair()

    def observe(self, rows: int, seconds: float) -> None:
        """A measured forward. One far slower than its bucket's estimate (the
        machine was busy) counts as ``SPIKE`` times the estimate, so one spike
        cannot price a width out of every later plan, where it would never be
        measured again."""
        key = bucket(rows)
        old = self._by_bucket.get(key)
        self._count[key] = self._count.get(key, 0) + 1
        if old is None:
            self._by_bucket[key], self._rows[key] = seconds, float(rows)
            bisect.insort(self._keys, key)
        else:
            self._by_bucket[key] = old + ALPHA * (min(seconds, SPIKE * old) - old)
            self._rows[key] += ALPHA * (rows - self._rows[key])
        self.version = next(_VERSIONS)
        self._repair()

    def _repair(self) -> None:
        """Two facts of any forward hold whatever a busy moment measured: a
        forward of more rows costs no more per row than one of fewer (it could
        be split into those), and no less in all (a bucket dearer than a wider
        one is priced as the wider one)."""
        per_row = float("inf")
        for key in self._keys:
            per_row = min(per_row, self._by_bucket[key] / key)
            self._monotone[key] = min(self._by_bucket[key], per_row * key)
        cheapest = float("inf")
        for key in reversed(self._keys):
            cheapest = min(cheapest, self._monotone[key])
            self._monotone[key] = cheapest
        self._line = self._fit()

    def _fit(self) -> tuple[float, float] | None:
        """The line wide verifies are priced by (module doc): through the
        16-row figure, with the mean of the wider buckets' slopes (at their
        mean row counts) weighed by their measurements; no less than 0 and
        no more than the 16-row figure's cost per row (the two facts
        ``_repair`` keeps). None until a bucket beyond 16 rows has been
        measured."""
        if FINE_ROWS not in self._by_bucket:
            return None
        start = self._monotone[FINE_ROWS]
        wide = [
            (self._count[k], (self._by_bucket[k] - start) / (self._rows[k] - FINE_ROWS))
            for k in self._keys
            if k > FINE_ROWS and self._rows[k] > FINE_ROWS
        ]
        if not wide:
            return None
        slope = sum(n * s for n, s in wide) / sum(n for n, _ in wide)
        return start, min(max(slope, 0.0), start / FINE_ROWS)

    def known(self) -> bool:
        return bool(self._keys)

    def predict(self, rows: int) -> float:
        """Seconds for ``rows`` (0 when nothing was measured yet)."""
        keys, costs = self._keys, self._monotone
        if not keys:
            return 0.0
        rows = max(rows, 1)
        if rows > FINE_ROWS and self._line is not None:
            start, per_row = self._line
            return start + per_row * (rows - FINE_ROWS)
        at = bisect.bisect_left(keys, rows)
        if at < len(keys) and keys[at] == rows:
            return costs[rows]
        if at == 0:
            return costs[keys[0]]
        if at == len(keys):
            last = keys[-1]
            if len(keys) == 1:
                return costs[last] * rows / last
            slope = max((costs[last] - costs[keys[-2]]) / (last - keys[-2]), 0.0)
            return costs[last] + slope * (rows - last)
        lo, hi = keys[at - 1], keys[at]
        return costs[lo] + (costs[hi] - costs[lo]) * (rows - lo) / (hi - lo)

    def table(self) -> dict[int, float]:
        """Bucket -> predicted seconds, in bucket order."""
        return {k: self.predict(k) for k in self._keys}


class CostModel:
    """The step's costs (module doc); one per engine."""

    def __init__(self, clock: Clock = time.perf_counter, cache: CostCache | None = None) -> None:
        self.clock = clock
        self.cache = cache
        self.verify = RunningCosts()
        self.head = RunningCosts()
        self.other_s = 0.0
        self._other_seen = False
        # Held rows' extra seconds and their count, decayed (``held_row_s``).
        self._held_s = self._held_rows = 0.0
        self._other_version = next(_VERSIONS)
        self.calibrated = False

    @property
    def version(self) -> tuple[int, int, int]:
        """Changes whenever ``step_s`` or ``head`` may answer differently."""
        return self.verify.version, self.head.version, self._other_version

    def step_s(self, rows: int) -> float:
        """Predicted seconds of a step that verifies ``rows`` rows, without
        the head's forwards after the verify (the budget prices them apart)."""
        return self.verify.predict(rows) + self.other_s

    def observe_other(self, seconds: float) -> None:
        self._other_version = next(_VERSIONS)
        seconds = max(seconds, 0.0)
        if not self._other_seen:
            self.other_s, self._other_seen = seconds, True
        else:
            spike = SPIKE * self.other_s if self.other_s > 0 else seconds
            self.other_s += ALPHA * (min(seconds, spike) - self.other_s)

    def held_row_s(self) -> float:
        """Seconds a held row adds to the head forward that takes it (module doc)."""
        if self._held_rows > 0:
            return self._held_s / self._held_rows
        widest = max(self.head.table(), default=0)
        return self.head.predict(widest) / widest if widest else 0.0

    def observe_held(self, rows: int, feeds: int, forwards: int, seconds: float) -> None:
        """A drafter call feeding ``feeds`` sequences ran ``forwards`` head
        forwards in ``seconds``, ``rows`` held rows among what the first took."""
        if rows <= 0:
            return
        extra = max(seconds - forwards * self.head.predict(feeds), 0.0)
        keep = 1.0 - ALPHA if self._held_rows > 0 else 0.0
        self._held_s = keep * self._held_s + extra
        self._held_rows = keep * self._held_rows + rows

    def _seed_held(self, row_s: float | None, rows: int = SEEDED_HELD_ROWS) -> None:
        """Starts the held rows' figure at ``row_s`` a row, counted as ``rows``
        rows (those a calibration measures it over)."""
        self._held_s = self._held_rows = 0.0
        if row_s is not None:
            self._held_rows = float(rows)
            self._held_s = row_s * rows

    def calibrate(
        self,
        forward: Callable[[int], None],
        max_rows: int,
        head: tuple[Callable[[int, int], int], int] | None = None,
    ) -> None:
        """Warm-starts ``verify`` from the cache, or by timing ``forward(rows)``
        (one untimed warm-up, then the better of two) at each calibration width
        up to ``max_rows``; likewise, given ``head = (call, max_feeds)``, the
        head by ``call(feeds, 1)``, a drafter call feeding ``feeds`` sequences
        (up to ``max_feeds``) a row each that returns the head forwards it
        ran, and a held row by ``call(max_feeds, HELD_CALIBRATION_ROWS)``
        (module doc). Stores what it measured."""
        if self.calibrated:
            return
        self.calibrated = True
        widths = [r for r in CALIBRATION_ROWS if r <= max_rows]
        feeds = [f for f in CALIBRATION_FEEDS if f <= head[1]] if head is not None else []
        cached = self.cache.load() if self.cache is not None else None
        if (
            cached is not None
            and _covers(cached.verify_s, widths)
            and _covers(cached.head_s, feeds)
            and (cached.held_row_s is not None or not feeds)
        ):
            for rows, seconds in cached.verify_s.items():
                self.verify.observe(rows, seconds)
            for rows, seconds in cached.head_s.items():
                self.head.observe(rows, seconds)
            self._seed_held(cached.held_row_s)
            return
        _time_widths(self.clock, forward, widths, self.verify)
        if head is not None and feeds:
            call, widest = head[0], feeds[-1]
            _time_widths(self.clock, lambda n: call(n, 1), feeds, self.head)

            def whole_call(each: int) -> float:  # after a warm-up
                call(widest, each)
                return _better_of_two(self.clock, lambda: call(widest, each))[0]

            extra = whole_call(HELD_CALIBRATION_ROWS) - whole_call(1)
            rows = widest * (HELD_CALIBRATION_ROWS - 1)
            self._seed_held(max(extra, 0.0) / rows, rows)
        self.save()

    def save(self) -> None:
        """Stores the costs as they stand, so the next run on this set-up
        starts from what this one measured last."""
        if self.cache is not None and self.verify.known():
            held = self.held_row_s() if self._held_rows > 0 else None
            self.cache.store(Calibration(self.verify.table(), self.head.table(), held))


def _covers(measured: Mapping[int, float], sizes: list[int]) -> bool:
    return all(bucket(n) in measured for n in sizes)


def _time_widths(
    clock: Clock, call: Callable[[int], int | None], sizes: list[int], into: RunningCosts
) -> None:
    """Times ``call(size)`` at each size (one untimed warm-up, then the better
    of two) into ``into``; a call that returns a count is priced per unit of
    it (a drafter call that ran several head forwards)."""
    if not sizes:
        return
    call(sizes[0])
    for size in sizes:
        seconds, units = _better_of_two(clock, functools.partial(call, size))
        into.observe(size, seconds / max(units or 1, 1))


def _better_of_two(clock: Clock, call: Callable[[], int | None]) -> tuple[float, int | None]:
    """The shorter of two timed runs of ``call``, in seconds, and what it
    returned (the same each time: the head forwards a drafter call ran)."""
    best, result = float("inf"), None
    for _ in range(2):
        began = clock()
        result = call()
        best = min(best, clock() - began)
    return best, result
