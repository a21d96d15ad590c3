"""A calibration on disk and what it is keyed by (``spec/calibration.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.engine.config import RuntimeConfig
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.device import cpu_info
from metrale.engine.spec.calibration import CostCache, calibration_key
from metrale.engine.spec.cost import CostModel
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.fake_model import FakeClock

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_calibration_is_reused_only_by_the_same_model_device_dtype_and_threads(
    tmp_path: Path,
) -> None:
    key = {"model": "m", "device": "cpu", "dtype": "float32", "threads": "2"}
    clock = FakeClock()
    calls: list[int] = []

    def forward(rows: int) -> None:
        calls.append(rows)
        clock.now += 0.001 * rows

    first = CostModel(clock, CostCache(tmp_path, key))
    first.calibrate(forward, 8)
    assert calls and first.verify.predict(8) == pytest.approx(0.008)
    calls.clear()
    again = CostModel(clock, CostCache(tmp_path, key))
    again.calibrate(forward, 8)
    assert calls == [] and again.verify.table() == first.verify.table()
    for changed in ({"threads": "1"}, {"dtype": "bfloat16"}):
        other = CostModel(clock, CostCache(tmp_path, {**key, **changed}))
        other.calibrate(forward, 8)
        assert calls, f"a calibration for {changed} reused another's"
        calls.clear()


def test_the_calibration_key_names_threads_dtype_and_processor(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path / "tiny", "llama")
    loaded = load_model(folder, RuntimeConfig(device="cpu", num_slots=2, max_len=64))
    key = calibration_key(loaded)
    assert key["dtype"] == "float32" and key["threads"] == "1"
    # A home directory moved to another machine does not price its rows
    # by this one's calibration.
    assert key["processor"] == cpu_info()[0]
    torch.set_num_threads(2)
    try:
        assert calibration_key(loaded)["threads"] == "2"
    finally:
        torch.set_num_threads(1)
    as_bf16 = load_model(folder, RuntimeConfig(device="cpu", dtype="bfloat16", num_slots=2))
    assert calibration_key(as_bf16)["dtype"] == "bfloat16"
    assert CostCache(tmp_path, key).path != CostCache(tmp_path, calibration_key(as_bf16)).path
