"""The plan: the allocation of drafts that maximises the expected rate,
against a brute force over every candidate (``spec/plan.py``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.spec.plan import best_plan

odds_lists = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4)
seq_options = st.lists(odds_lists, min_size=0, max_size=2)


def brute_force_rate(
    base_rows: int, options: Sequence[Sequence[Sequence[float]]], step_s: Callable[[int], float]
) -> float:
    per_seq = [
        [(0, 0.0)] + [(n, g[n - 1]) for g in opts for n in range(1, len(g) + 1)] for opts in options
    ]
    best = 0.0
    for combo in itertools.product(*per_seq):
        rows = base_rows + sum(n for n, _ in combo)
        best = max(best, (base_rows + sum(g for _, g in combo)) / step_s(rows))
    return best


def cumulative(odds: Sequence[float]) -> list[float]:
    gains, reach, total = [], 1.0, 0.0
    for p in odds:
        reach *= p
        total += reach
        gains.append(total)
    return gains


@settings(max_examples=300, deadline=None)
@given(
    options=st.lists(seq_options, min_size=1, max_size=4),
    fixed_s=st.floats(0.001, 1.0),
    row_costs=st.lists(st.floats(0.0, 0.5), min_size=20, max_size=20),
)
def test_the_plan_maximises_the_expected_rate_over_every_candidate(
    options: list[list[list[float]]], fixed_s: float, row_costs: list[float]
) -> None:
    gains = [[cumulative(odds) for odds in opts] for opts in options]

    def step_s(rows: int) -> float:  # any increasing cost, not only a linear one
        return fixed_s + sum(row_costs[:rows])

    base = len(gains)
    plan = best_plan(base, float(base), gains, step_s)
    assert plan.rate == pytest.approx(brute_force_rate(base, gains, step_s), rel=1e-9)
    # The plan is what it says it is.
    assert plan.rows == base + sum(n for _, n in plan.choices)
    chosen = sum(gains[i][o][n - 1] for i, (o, n) in enumerate(plan.choices) if n)
    assert plan.tokens == pytest.approx(base + chosen)
    for i, (o, n) in enumerate(plan.choices):
        assert (o, n) == (-1, 0) or (0 <= o < len(gains[i]) and 1 <= n <= len(gains[i][o]))


def test_the_plan_verifies_sure_drafts_when_rows_are_cheap_and_none_when_dear() -> None:
    options = [[[0.9, 1.7, 2.4]], [[0.5, 0.7]]]
    cheap = best_plan(2, 2.0, options, lambda rows: 1.0 + 0.01 * rows)
    assert cheap.choices == ((0, 3), (0, 2))
    dear = best_plan(2, 2.0, options, lambda rows: 1.0 * rows)
    assert dear.choices == ((-1, 0), (-1, 0))
