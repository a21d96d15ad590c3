"""The acceptance estimates (``spec/estimates.py``): each key over its parent."""

from __future__ import annotations

import pytest

from metrale.engine.spec.estimates import FIRST_PRIOR, Rates


def test_an_unseen_key_starts_from_its_parent_and_the_first_from_the_prior() -> None:
    rates = Rates(decay=1.0, strength=2.0)
    assert rates.rate(("mtp", 0)) == FIRST_PRIOR
    rates.observe(("mtp", 0), False)
    rates.observe(("mtp", 0), False)
    assert rates.rate(("mtp", 0)) == pytest.approx(FIRST_PRIOR * 2 / 4)
    # depth 1 leans on depth 0's estimate, copy position 2 on position 1's
    assert rates.rate(("mtp", 1)) == pytest.approx(rates.rate(("mtp", 0)))
    rates.observe(("copy", 1), True)
    assert rates.rate(("copy", 2)) == pytest.approx(rates.rate(("copy", 1)))
    assert rates.rate(("copy", 1)) == pytest.approx((1 + 2 * FIRST_PRIOR) / 3)
