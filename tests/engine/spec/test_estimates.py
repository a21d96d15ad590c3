"""The acceptance estimates (``spec/estimates.py``): each key over its parent,
and a run started from where an earlier one ended."""

from __future__ import annotations

import pytest

from metrale.engine.spec.estimates import (
    FIRST_PRIOR,
    Rates,
    copy_key,
    key_text,
    text_key,
)


def test_an_unseen_key_starts_from_its_parent_and_the_first_from_the_prior() -> None:
    rates = Rates(decay=1.0, strength=2.0)
    assert rates.rate(("mtp", 0)) == FIRST_PRIOR
    rates.observe(("mtp", 0), False)
    rates.observe(("mtp", 0), False)
    assert rates.rate(("mtp", 0)) == pytest.approx(FIRST_PRIOR * 2 / 4)
    # depth 1 and a confidence bin of depth 0 lean on depth 0's estimate
    assert rates.rate(("mtp", 1)) == pytest.approx(rates.rate(("mtp", 0)))
    assert rates.rate(("mtp", 0, 3)) == pytest.approx(rates.rate(("mtp", 0)))


def test_a_run_started_from_stored_estimates_rates_those_keys_from_them() -> None:
    rates = Rates(decay=1.0, strength=2.0)
    before = rates.observed
    rates.start_from({("mtp", 0): 0.2, copy_key(1, 8): 0.9})
    assert rates.observed != before  # figures derived from the rates are stale
    assert rates.rate(("mtp", 0)) == pytest.approx(0.2)
    assert rates.rate(("mtp", 1)) == pytest.approx(0.2)  # unstored: from its parent
    assert rates.rate(copy_key(1, 8)) == pytest.approx(0.9)
    assert rates.rate(copy_key(1)) == FIRST_PRIOR
    # The run's own drafts overrule a stored figure within a few.
    for _ in range(6):
        rates.observe(("mtp", 0), True)
    assert rates.rate(("mtp", 0)) == pytest.approx((6 + 2 * 0.2) / 8)
    ended = rates.estimates()
    assert set(ended) == {("mtp", 0), copy_key(1, 8)}
    assert ended[("mtp", 0)] == pytest.approx(rates.rate(("mtp", 0)))


def test_stored_figures_outside_zero_to_one_are_clamped() -> None:
    rates = Rates(decay=1.0, strength=2.0)
    rates.start_from({("mtp", 0): 1.5, ("copy", 1): -0.5})
    assert rates.rate(("mtp", 0)) == 1.0 and rates.rate(("copy", 1)) == 0.0


@pytest.mark.parametrize("key", [("copy", 1), ("copy", 3, 2), ("mtp", 0), ("mtp", 2, 5)])
def test_keys_read_back_as_written(key: tuple[object, ...]) -> None:
    assert text_key(key_text(key)) == key


@pytest.mark.parametrize("text", ["", "copy", "copy/x", "draft/1", "mtp/1/2/3", "mtp/1.5"])
def test_text_that_is_no_key_reads_as_none(text: str) -> None:
    assert text_key(text) is None
