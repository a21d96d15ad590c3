"""The budget bench's figures (``engine/bench/budget.py``): which fixed
configuration is best, and the budget's ratio to it, of medians and paired."""

from __future__ import annotations

import pytest

from metrale.engine.bench.budget import summarise


def test_the_paired_ratio_is_the_median_of_the_ratios_within_each_round() -> None:
    rounds = {
        "no drafts": [100.0, 80.0, 60.0],
        "copies": [110.0, 88.0, 66.0],
        "MTP": [90.0, 72.0, 54.0],
        "MTP+copies": [105.0, 84.0, 63.0],
        "auto": [66.0, 110.0, 88.0],
    }
    row = summarise(rounds)
    assert row.best == "copies" and row.rates["copies"] == 88.0
    # The medians come from different rounds: 88 against 88.
    assert row.ratio == pytest.approx(1.0)
    # Round by round 0.6, 1.25 and 1.333: the median is 1.25.
    assert row.paired == pytest.approx(1.25)


def test_the_best_fixed_configuration_has_the_highest_median_and_never_is_auto() -> None:
    rounds = {
        "no drafts": [50.0, 52.0, 51.0],
        "copies": [60.0, 20.0, 61.0],
        "MTP": [55.0, 56.0, 54.0],
        "MTP+copies": [40.0, 41.0, 42.0],
        "auto": [99.0, 99.0, 99.0],
    }
    row = summarise(rounds)
    assert row.best == "copies" and row.rates["copies"] == 60.0  # above MTP's 55, a slow round
    assert row.ratio == pytest.approx(99.0 / 60.0)
    assert row.paired == pytest.approx(99.0 / 60.0)
