"""Properties of the run-wide copy counters (metrale.lookup.stats)."""

from __future__ import annotations

from metrale.lookup import CopyCounts, LookupStats


def test_shared_copies_count_in_both_the_own_and_the_shared_figures():
    stats = LookupStats()
    stats.record(4, 4, shared=False)
    stats.record(2, 1, shared=True)
    assert (stats.copies, stats.proposed, stats.accepted) == (2, 6, 5)
    assert (stats.shared_copies, stats.shared_proposed, stats.shared_accepted) == (1, 2, 1)


def test_accepted_never_exceeds_proposed_and_empty_copies_are_not_counted():
    stats = LookupStats()
    stats.record(2, 5, shared=True)  # the bonus token must not inflate acceptance
    stats.record(0, 0, shared=False)  # settle() returned 0: nothing was in flight
    stats.record(3, -1, shared=False)
    assert (stats.copies, stats.proposed, stats.accepted) == (2, 5, 2)
    assert stats.shared_accepted == 2


def test_copy_counts_acceptance_rate():
    counts = CopyCounts()
    assert counts.acceptance_rate == 0.0
    counts.record(4, 3)
    counts.record(4, 1)
    assert counts.acceptance_rate == 0.5
