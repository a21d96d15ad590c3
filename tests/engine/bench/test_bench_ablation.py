"""The ablation bench (``engine/bench/ablation.py``): a row's rounds."""

from __future__ import annotations

from typing import cast

import pytest

from metrale.engine.api import Request, SamplingParams
from metrale.engine.bench import ablation
from metrale.engine.bench.ablation import bench_row, configurations
from metrale.engine.load.loader import LoadedModel


def test_a_row_rates_every_round_and_stops_on_an_output_difference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each round's tokens/s per configuration, from its seconds and tokens;
    an ablation whose output differs from the whole budget's is an error."""
    ablations = configurations(["rest"])
    assert ablations == {"auto": (), "-rest": ("rest",)}

    def round_(models: object, configs: object, requests: object, one: bool, r: int) -> object:
        out = {key: (float(r + 1), {"0": (1, 2)}) for key in ablations}
        if r == 1 and changed:
            out["-rest"] = (1.0, {"0": (1, 3)})
        return out

    monkeypatch.setattr(ablation, "warm_up", lambda *args: None)
    monkeypatch.setattr(ablation, "step_by_step", round_)
    models = cast(dict[str, LoadedModel], dict.fromkeys(ablations))
    requests = [Request("0", (1, 2), SamplingParams(max_tokens=2))]
    changed = False
    assert bench_row(models, ablations, "set", requests, 1, 2) == {
        "auto": [2.0, 1.0],
        "-rest": [2.0, 1.0],
    }
    changed = True
    with pytest.raises(SystemExit, match="-rest changed the greedy output"):
        bench_row(models, ablations, "set", requests, 16, 2)
