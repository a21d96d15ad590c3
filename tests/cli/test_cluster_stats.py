"""Summing the workers' EngineStats into the cluster's figures."""

from __future__ import annotations

import dataclasses

import pytest

from metrale.cli.cluster_stats import WorkerStats, add_stats
from metrale.engine import stats as stats_module
from metrale.engine.stats import EngineStats
from metrale.lookup import LookupStats


def snapshot(tokens: int, mtp: tuple[int, ...], copies: int, wall_s: float = 1.0) -> EngineStats:
    lookup = LookupStats()
    for _ in range(copies):
        lookup.observe(3, 2, shared=False)
    return EngineStats(
        requests_done=tokens // 5,
        generated_tokens=tokens,
        seq_verifies=tokens // 2,
        verify_tokens=tokens,
        wall_s=wall_s,
        mtp_proposed_by_position=mtp,
        mtp_accepted_by_position=tuple(p // 2 for p in mtp),
        prompt_lookup=lookup,
        window_histogram={8: 1, 2: copies},
        grammar_s=0.25,
    )


def test_worker_figures_add_field_by_field_with_the_cluster_clock() -> None:
    total = add_stats([snapshot(10, (4, 2), 1), snapshot(5, (3,), 2)], wall_s=3.0)
    assert total.generated_tokens == 15 and total.requests_done == 3
    assert total.mtp_proposed_by_position == (7, 2)  # position by position
    assert total.mtp_accepted_by_position == (3, 1)
    assert total.prompt_lookup.total.copies == 3 and total.prompt_lookup.total.accepted == 6
    assert total.window_histogram == {8: 2, 2: 3}
    assert total.grammar_s == 0.5
    assert total.wall_s == 3.0 and total.tokens_per_s == 5.0  # the cluster's, not a sum
    assert total.mean_tokens_per_verify == 15 / 7


def test_every_counter_of_engine_stats_is_summed() -> None:
    # A counter the engine gains must not be dropped from the cluster's figures.
    one = snapshot(10, (4,), 1)
    total = add_stats([one, one], wall_s=0.0)
    for f in dataclasses.fields(EngineStats):
        value = getattr(one, f.name)
        if isinstance(value, int | float) and f.name != "wall_s":
            assert getattr(total, f.name) == 2 * value, f.name


def test_optional_reports_of_one_machine_stay_out_of_the_sum() -> None:
    # The draft budget's report holds one machine's cost model (milliseconds,
    # acceptance estimates): summed over machines it would mean nothing.
    budget_type = getattr(stats_module, "BudgetStats", None)
    if budget_type is None:
        pytest.skip("EngineStats carries no optional report")
    one = dataclasses.replace(snapshot(10, (4,), 1), budget=budget_type(steps=3))
    total = add_stats([one, one], wall_s=1.0)
    assert total.budget is None and total.generated_tokens == 20


def test_no_worker_yet_gives_zero_figures() -> None:
    assert add_stats([], wall_s=0.0) == EngineStats()


def test_an_older_snapshot_arriving_late_does_not_replace_a_newer_one() -> None:
    now = [100.0]
    workers = WorkerStats(clock=lambda: now[0])
    workers.update("a", snapshot(20, (), 0, wall_s=2.0))
    workers.update("a", snapshot(10, (), 0, wall_s=1.0))  # an earlier window, returned later
    workers.update("b", snapshot(5, (), 0, wall_s=0.5))
    assert workers.total().generated_tokens == 25 and workers.num_workers == 2


def test_the_cluster_clock_starts_with_the_first_engine_and_stops_at_freeze() -> None:
    now = [100.0]
    workers = WorkerStats(clock=lambda: now[0])
    assert workers.total().wall_s == 0.0
    workers.update("a", snapshot(10, (), 0, wall_s=4.0))  # its engine started at 96
    now[0] = 101.0
    workers.update("b", snapshot(10, (), 0, wall_s=2.0))  # started at 99
    assert workers.total().wall_s == 5.0
    workers.freeze()
    now[0] = 200.0
    assert workers.total().wall_s == 5.0 and workers.total().tokens_per_s == 4.0
