"""The budget benchmarks' handling of the stored acceptance estimates
(``engine/bench/estimates_store.py``)."""

from __future__ import annotations

from pathlib import Path

from metrale.engine.bench.estimates_store import restore_estimates, stored_estimates


def test_stored_estimates_go_back_to_a_snapshot_file_for_file(calibration: Path) -> None:
    folder = calibration
    (folder / "a.acceptance.json").write_text("a")
    (folder / "a.json").write_text("costs")  # the costs are not estimates
    saved = stored_estimates()
    assert saved == {folder / "a.acceptance.json": b"a"}
    (folder / "a.acceptance.json").write_text("learnt on this row")
    (folder / "b.acceptance.json").write_text("b")
    restore_estimates(saved)
    assert stored_estimates() == saved and (folder / "a.json").read_text() == "costs"
    restore_estimates({})
    assert stored_estimates() == {} and (folder / "a.json").exists()
