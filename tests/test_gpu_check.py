"""The prepared GPU check (``tests/support/gpu_check.py``, ``tests/support/gpu_step_ms.py``) on the CPU."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.gpu_check import FAMILIES, MODES
from tests.support.gpu_step_ms import TINY, bench_step_ms, targets

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_dry_run_reports_parity_one_readback_per_step_and_every_key(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    command = [sys.executable, "-m", "tests.support.gpu_check", "--device", "cpu"]
    done = subprocess.run(
        [*command, "--max-tokens", "12", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert set(report) >= {"device", "parity", "readbacks_per_step", "graphs", "step_ms", "targets"}
    assert "errors" not in report
    assert report["device"]["type"] == "cpu"
    assert report["parity"] is True
    assert set(report["parity_detail"]) == set(FAMILIES)
    for family, record in report["parity_detail"].items():
        expected_modes = set(MODES) if record["mtp_modules"] else {"off", "copies"}
        assert set(record["modes"]) == expected_modes, family
        assert all(m["equal"] and m["tokens"] > 0 for m in record["modes"].values()), family
    assert report["readbacks_per_step"] == 1.0
    assert report["graphs"]["parity"] == {family: [] for family in FAMILIES}  # none off CUDA
    assert "skipped" in report["step_ms"] and "skipped" in report["targets"]


def test_the_timed_forwards_compute_the_same_logits() -> None:
    """metrale's static step and transformers' static-cache forward, timed
    side by side, read the same weights and caches: in float32 their logits
    agree at every shape, so the figures compare like with like."""
    shape = dataclasses.replace(TINY, dtype="float32")
    seen: list[int] = []
    step_ms = bench_step_ms(
        shape, torch.device("cpu"), lambda partial: seen.append(len(partial["rows"]))
    )
    rows = step_ms["rows"]
    assert [(r["batch"], r["width"]) for r in rows] == [(b, w) for b in (1, 4) for w in (1, 2, 4)]
    for row in rows:
        assert row["logits_max_diff"] <= 1e-4 * max(1.0, row["logits_max"]), row
        assert row["argmax_agree"] == 1.0, row
        assert row["metrale_ms"] > 0 and row["transformers_ms"] > 0
    assert seen == list(range(1, len(rows) + 1))  # handed over row by row
    assert step_ms["graphs"] == []  # graphs are captured on CUDA only


def bench_rows(figures: dict[tuple[int, int, int], tuple[float, float]]) -> dict[str, Any]:
    rows = [
        {"ctx": c, "batch": b, "width": w, "metrale_ms": ours, "transformers_ms": theirs}
        for (c, b, w), (ours, theirs) in figures.items()
    ]
    return {"bound_ms": 4.0, "rows": rows}


def test_targets_hold_at_their_limits_and_fail_past_them() -> None:
    at_limits = bench_rows(
        {
            (1024, 1, 1): (6.0, 20.0),
            (1024, 1, 4): (7.8, 20.0),  # 1.3x width 1
            (1024, 16, 1): (8.0, 16.0),  # 2x faster than transformers
            (1024, 16, 4): (9.0, 18.0),
        }
    )
    met = targets(at_limits)
    assert met["batch1_width1_over_bound"]["by_ctx"] == {1024: 1.5}
    assert all(t["met"] for t in met.values())
    past = bench_rows(
        {
            (1024, 1, 1): (6.1, 20.0),
            (1024, 1, 4): (8.0, 20.0),
            (1024, 16, 1): (8.0, 15.9),
            (1024, 16, 4): (9.0, 18.0),
        }
    )
    assert not any(t["met"] for t in targets(past).values())
