"""A bench's warm-up and round, faked to learn as real ones do: each writes
the stored estimates, and a round records what it found there first (the
budget benches' tests, ``tests/engine/bench/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from metrale.engine.bench.estimates_store import stored_estimates


class LearningRounds:
    """``warm_up`` and ``step_by_step`` stand-ins over the calibration ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: list[dict[Path, bytes]] = []  # the stored estimates each round found

    def warm_up(self, *args: Any) -> None:  # learns on the row's own first line
        (self.folder / "k.acceptance.json").write_text("learnt on the warm-up")

    def step_by_step(
        self, models: Any, configs: Any, requests: Any, one: bool, round_: int
    ) -> dict[str, tuple[float, dict[str, list[int]]]]:
        self.seen.append(stored_estimates())
        (self.folder / "k.acceptance.json").write_text(f"learnt in round {round_}")
        (self.folder / "new.acceptance.json").write_text("a key of its own")
        return {key: (1.0, {"0": [1]}) for key in configs}


def seeded_rounds(
    folder: Path, bench: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[Path, bytes], LearningRounds]:
    """Estimates in the calibration ``folder`` as a seeding run leaves them
    (learnt on other sets), and the ``bench`` module's warm-up and round
    faked by a ``LearningRounds``; returns that snapshot and the fake."""
    (folder / "k.acceptance.json").write_text("learnt on other sets")
    fake = LearningRounds(folder)
    monkeypatch.setattr(bench, "warm_up", fake.warm_up)
    monkeypatch.setattr(bench, "step_by_step", fake.step_by_step)
    return stored_estimates(), fake
