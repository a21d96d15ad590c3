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
    # depth 1 and a confidence bin of depth 0 lean on depth 0's estimate
    assert rates.rate(("mtp", 1)) == pytest.approx(rates.rate(("mtp", 0)))
    assert rates.rate(("mtp", 0, 3)) == pytest.approx(rates.rate(("mtp", 0)))
