"""How many drafts each sequence verifies this step, and from which source:
the allocation that maximises expected tokens per second.

Owner: the draft budget (``budget.py``); a pure function, tested against a
brute force over every candidate.

Problem: a step verifies ``base_rows`` rows that are sure to produce
``base_tokens`` tokens (one bonus token per sequence, plus a grammar's forced
drafts, always accepted). Sequence ``i`` may add drafts from one of its
sources: ``options[i][o][n - 1]`` is the expected number of accepted drafts
when it verifies the first ``n`` drafts of source ``o``. The step then takes
``step_s(base_rows + extra rows)`` seconds. The plan maximises::

    (base_tokens + sum of expected accepted) / step_s(base_rows + extra rows)

Expected accepted drafts are cumulative sums of the probabilities that each
draft and all before it are accepted, so each source's increments never
grow. When the best envelope over a sequence's sources keeps that property
for every sequence (the common case: one source, or one that dominates), the
best gain for each extra row count is the sum of the largest increments
(a merge); otherwise a dynamic programme over sequences and rows finds it.
Either way every total row count is then priced by ``step_s`` and the best
rate wins; ties go to fewer rows, and within a sequence to no drafts, then
to the earlier source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Gains = Sequence[float]  # cumulative expected accepted drafts for 1..n drafts


@dataclass(frozen=True)
class Plan:
    """``choices[i] = (source index, drafts)``; ``(-1, 0)``: no drafts."""

    choices: tuple[tuple[int, int], ...]
    rows: int  # base rows plus every chosen draft
    tokens: float  # expected tokens: base tokens plus expected accepted drafts
    seconds: float  # predicted step time

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def best_plan(
    base_rows: int,
    base_tokens: float,
    options: Sequence[Sequence[Gains]],
    step_s: Callable[[int], float],
) -> Plan:
    """The allocation of drafts that maximises the expected rate (module doc)."""
    envelopes = [_envelope(opts) for opts in options]
    if all(_concave(env) for env in envelopes):
        gain_by_rows = _merge(envelopes)
        extra = _best_rows(base_rows, base_tokens, gain_by_rows, step_s)
        counts = _top_counts(envelopes, extra)
        choices = tuple(_source_for(opts, n) for opts, n in zip(options, counts, strict=True))
    else:
        gain_by_rows, picks = _programme(options)
        extra = _best_rows(base_rows, base_tokens, gain_by_rows, step_s)
        choices = _backtrack(picks, extra)
    tokens = base_tokens + sum(options[i][o][n - 1] for i, (o, n) in enumerate(choices) if n)
    rows = base_rows + sum(n for _, n in choices)
    return Plan(choices, rows, tokens, step_s(rows))


def _envelope(opts: Sequence[Gains]) -> list[float]:
    width = max((len(g) for g in opts), default=0)
    return [max((g[n] for g in opts if len(g) > n), default=0.0) for n in range(width)]


def _concave(env: Sequence[float]) -> bool:
    last, before = float("inf"), 0.0
    for value in env:
        step = value - before
        if step > last + 1e-12 or step < 0:
            return False
        last, before = step, value
    return True


def _merge(envelopes: Sequence[Sequence[float]]) -> list[float]:
    """Best gain for each extra row count: the sum of the largest increments."""
    steps = sorted(
        (value - (env[n - 1] if n else 0.0) for env in envelopes for n, value in enumerate(env)),
        reverse=True,
    )
    gains = [0.0]
    for step in steps:
        gains.append(gains[-1] + step)
    return gains


def _top_counts(envelopes: Sequence[Sequence[float]], extra: int) -> list[int]:
    """How many rows each sequence gets among the ``extra`` largest increments
    (earlier sequences and shallower drafts first on ties)."""
    steps = [
        (-(value - (env[n - 1] if n else 0.0)), i, n)
        for i, env in enumerate(envelopes)
        for n, value in enumerate(env)
    ]
    steps.sort()
    counts = [0] * len(envelopes)
    for _, i, _ in steps[:extra]:
        counts[i] += 1
    return counts


def _source_for(opts: Sequence[Gains], n: int) -> tuple[int, int]:
    if n == 0:
        return (-1, 0)
    best, value = -1, -1.0
    for o, gains in enumerate(opts):
        if len(gains) >= n and gains[n - 1] > value:
            best, value = o, gains[n - 1]
    return (best, n)


def _programme(
    options: Sequence[Sequence[Gains]],
) -> tuple[list[float], list[list[tuple[int, int]]]]:
    """Best gain with exactly ``r`` extra rows, for every ``r``, and per
    sequence the choice behind each ``r`` (a dynamic programme)."""
    best = [0.0]
    picks: list[list[tuple[int, int]]] = []
    for opts in options:
        width = max((len(g) for g in opts), default=0)
        new = [-1.0] * (len(best) + width)
        back = [(-1, 0)] * len(new)
        for r, value in enumerate(best):
            if value < 0:
                continue
            if value > new[r]:
                new[r], back[r] = value, (-1, 0)
            for o, gains in enumerate(opts):
                for n, gain in enumerate(gains, 1):
                    if value + gain > new[r + n]:
                        new[r + n], back[r + n] = value + gain, (o, n)
        best = new
        picks.append(back)
    return best, picks


def _backtrack(picks: list[list[tuple[int, int]]], extra: int) -> tuple[tuple[int, int], ...]:
    choices: list[tuple[int, int]] = []
    for back in reversed(picks):
        o, n = back[extra]
        choices.append((o, n))
        extra -= n
    return tuple(reversed(choices))


def _best_rows(
    base_rows: int,
    base_tokens: float,
    gain_by_rows: Sequence[float],
    step_s: Callable[[int], float],
) -> int:
    best, best_rate = 0, -1.0
    for extra, gain in enumerate(gain_by_rows):
        if gain < 0:
            continue
        seconds = step_s(base_rows + extra)
        rate = (base_tokens + gain) / seconds if seconds > 0 else float("inf")
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = extra, rate
    return best
