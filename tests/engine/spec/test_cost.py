"""The cost model: verify and head costs by rows, held rows, and the
calibration (``spec/cost.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale.engine.spec.calibration import CostCache
from metrale.engine.spec.cost import CostModel, RunningCosts, bucket
from tests.support.fake_model import (
    FakeClock,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_calibration_prices_the_head_and_a_cache_without_it_is_measured_again(
    tmp_path: Path,
) -> None:
    key = {"model": "m", "device": "cpu", "dtype": "float32", "threads": "2"}
    clock = FakeClock()
    calls: list[tuple[str, int]] = []

    def forward(rows: int) -> None:
        calls.append(("verify", rows))
        clock.now += 0.001 * rows

    def head(feeds: int, each: int) -> int:
        calls.append(("head", feeds) if each == 1 else ("held", feeds * (each - 1)))
        clock.now += 2 * (0.0002 + 0.0001 * feeds) + 0.00001 * feeds * (each - 1)
        return 2  # head forwards run: the cost is per forward

    first = CostModel(clock, CostCache(tmp_path, key))
    first.calibrate(forward, 8)  # a run without a head measures none
    assert not first.head.known() and ("head", 1) not in calls
    calls.clear()
    with_head = CostModel(clock, CostCache(tmp_path, key))
    with_head.calibrate(forward, 8, (head, 4))
    assert {c for c in calls if c[0] == "head"} == {("head", 1), ("head", 2), ("head", 4)}
    assert with_head.head.predict(4) == pytest.approx(0.0006)
    # 4 sequences with 16 rows each: 60 rows beyond one a sequence, 10 us each.
    assert ("held", 60) in calls
    assert with_head.held_row_s() == pytest.approx(0.00001)
    calls.clear()
    again = CostModel(clock, CostCache(tmp_path, key))
    again.calibrate(forward, 8, (head, 4))
    assert calls == [] and again.head.table() == with_head.head.table()
    assert again.held_row_s() == pytest.approx(0.00001)
    # A run without a head reads the same file and stores it again whole.
    headless = CostModel(clock, CostCache(tmp_path, key))
    headless.calibrate(forward, 8)
    headless.save()
    after = CostModel(clock, CostCache(tmp_path, key))
    after.calibrate(forward, 8, (head, 4))
    assert calls == [] and after.head.table() == with_head.head.table()


def test_a_held_rows_figure_weighs_catch_ups_by_their_rows_and_climbs_back_from_low() -> None:
    costs = CostModel(FakeClock())
    costs.head.observe(1, 0.001)
    costs.head.observe(16, 0.004)
    # A first catch-up of 10 rows: 5 us each beyond the head's forward.
    costs.observe_held(10, 1, 1, 0.001 + 10 * 5e-6)
    assert costs.held_row_s() == pytest.approx(5e-6)
    # 800 rows at 40 us each: the figure goes nearly all the way (moved by a
    # fixed share a call, at most twice the estimate, it came to 5.75 us).
    costs.observe_held(800, 16, 1, 0.004 + 800 * 40e-6)
    expected = (0.85 * 10 * 5e-6 + 800 * 40e-6) / (0.85 * 10 + 800)
    assert costs.held_row_s() == pytest.approx(expected)
    assert costs.held_row_s() > 39e-6
    # A catch-up of 10 rows on a noisy moment moves it little.
    costs.observe_held(10, 1, 1, 0.001 + 10 * 150e-6)
    assert 39e-6 < costs.held_row_s() < 42e-6
    # Nor is a call faster than the head's own forwards counted below nothing.
    before = costs.held_row_s()
    costs.observe_held(10, 16, 1, 0.002)
    assert before * 0.98 < costs.held_row_s() < before


def test_costs_are_interpolated_between_buckets_and_follow_new_measurements() -> None:
    costs = RunningCosts({1: 2.0, 4: 5.0, 16: 11.0})
    assert costs.predict(2) == pytest.approx(3.0)
    assert costs.predict(10) == pytest.approx(8.0)
    assert costs.predict(32) == pytest.approx(11.0 + 0.5 * 16)  # the last slope on
    assert costs.predict(0) == 2.0
    costs.observe(4, 8.0)
    assert 5.0 < costs.predict(4) < 8.0
    assert bucket(17) == 20 and bucket(65) == 80 and bucket(16) == 16


def test_every_row_inside_a_coarse_bucket_costs_something() -> None:
    # 17..20 rows share a bucket: priced as one, the plan and the chain's
    # worth saw the rows after the 17th as free.
    costs = RunningCosts({16: 32.0, 20: 40.0})
    assert [costs.predict(r) for r in (17, 18, 19, 20)] == pytest.approx([34.0, 36.0, 38.0, 40.0])


def test_wide_verifies_are_priced_by_one_line_so_equal_neighbours_leave_no_row_free() -> None:
    # 20 and 24 rows measured alike (a noisy moment): bucket to bucket, rows
    # 21-24 were free to the plan. One line through 16 rows prices them all.
    costs = RunningCosts({16: 32.0, 20: 40.0, 24: 40.0, 32: 56.0})
    slope = (8 / 4 + 8 / 8 + 24 / 16) / 3  # the buckets' own slopes, each measured once
    assert costs.predict(16) == 32.0
    assert [costs.predict(r) for r in (17, 24, 40)] == pytest.approx(
        [32.0 + slope, 32.0 + 8 * slope, 32.0 + 24 * slope]
    )
    assert costs.table()[24] == pytest.approx(32.0 + 8 * slope)


def test_the_widths_a_run_verifies_set_the_slope_beyond_16_rows() -> None:
    # Calibrated at 32 and 64 rows at 1 a row beyond 16; a batch of 16 then
    # verifies 18 rows, at 3 a row beyond 16, step after step.
    costs = RunningCosts({16: 64.0, 32: 80.0, 64: 112.0})
    assert costs.predict(18) == pytest.approx(66.0)
    for _ in range(30):
        costs.observe(18, 70.0)
    assert costs.predict(18) == pytest.approx(64.0 + 2 * (30 * 3.0 + 2 * 1.0) / 32, rel=1e-3)
    assert costs.predict(18) > 69.5


def test_a_wide_bucket_is_placed_at_the_rows_it_measured() -> None:
    costs = RunningCosts({16: 32.0})
    for _ in range(40):
        costs.observe(17, 34.0)  # bucket 20, always at 17 rows: 2 a row
    assert costs.predict(18) == pytest.approx(36.0, rel=1e-3)
    # Never dearer per row than 16 rows, never cheaper than 16 rows in all.
    steep = RunningCosts({16: 32.0, 20: 400.0})
    assert steep.predict(32) == pytest.approx(64.0)
    flat = RunningCosts({16: 32.0, 20: 10.0})  # repaired down to 10 at 16 rows, slope 0
    assert flat.predict(20) == pytest.approx(flat.predict(16)) == pytest.approx(10.0)


def test_a_busy_moment_cannot_price_a_width_out_of_the_plans() -> None:
    costs = RunningCosts({1: 1.0, 2: 50.0, 4: 4.0, 8: 400.0})
    assert costs.predict(2) <= 2.0  # no dearer per row than one row
    assert costs.predict(8) <= 8.0
    assert costs.predict(1) <= costs.predict(2) <= costs.predict(4) <= costs.predict(8)
    before = costs.predict(4)
    costs.observe(4, 1000.0)  # counted as twice the estimate at most
    assert costs.predict(4) <= before * (1 + 0.15) + 1e-9
