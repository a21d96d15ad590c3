"""Properties of the copy counters (metrale.lookup.stats)."""

from __future__ import annotations

from metrale.lookup import CopyCounts, LookupStats


def test_shared_copies_count_in_the_total_and_the_shared_figures():
    stats = LookupStats()
    stats.observe(4, 4, shared=False)
    stats.observe(2, 1, shared=True)
    assert stats.total == CopyCounts(copies=2, proposed=6, accepted=5)
    assert stats.shared == CopyCounts(copies=1, proposed=2, accepted=1)
    assert stats.own == CopyCounts(copies=1, proposed=4, accepted=4)


def test_accepted_never_exceeds_proposed_and_empty_copies_are_not_counted():
    stats = LookupStats()
    stats.observe(2, 5, shared=True)  # the bonus token must not inflate acceptance
    stats.observe(0, 0, shared=False)  # settle() returned 0: nothing was in flight
    stats.observe(3, -1, shared=False)
    assert stats.total == CopyCounts(copies=2, proposed=5, accepted=2)
    assert stats.shared.accepted == 2


def test_a_copy_of_the_stats_does_not_move_with_them():
    stats = LookupStats()
    stats.observe(4, 2, shared=True)
    frozen = stats.copy()
    stats.observe(4, 4, shared=True)
    assert frozen.total == frozen.shared == CopyCounts(copies=1, proposed=4, accepted=2)


def test_copy_counts_acceptance_rate():
    counts = CopyCounts()
    assert counts.acceptance_rate == 0.0
    counts.observe(4, 3)
    counts.observe(4, 1)
    assert counts.acceptance_rate == 0.5
