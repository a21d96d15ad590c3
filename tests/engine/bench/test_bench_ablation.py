"""The ablation bench (``engine/bench/ablation.py``): where its rounds start from."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from metrale.engine.api import Request, SamplingParams
from metrale.engine.bench import ablation
from metrale.engine.bench.ablation import bench_row, configurations
from metrale.engine.load.loader import LoadedModel
from tests.support.learning_rounds import seeded_rounds


def test_every_round_of_every_row_starts_from_the_estimates_it_is_given(
    calibration: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole budget and its ablations resume from the store as each
    round starts: each round finds the seeded estimates, not what the
    warm-ups, the rounds before it or the row before learnt."""
    seeded, fake = seeded_rounds(calibration, ablation, monkeypatch)
    ablations = configurations(["rest"])
    models = cast(dict[str, LoadedModel], dict.fromkeys(ablations))
    requests = [Request("0", (1, 2), SamplingParams(max_tokens=1))]
    rows = [bench_row(models, ablations, "set", requests, b, 2, seeded) for b in (1, 16)]
    assert fake.seen == [seeded] * 4
    assert all(rounds["-rest"] == [1.0] * 2 for rounds in rows)
