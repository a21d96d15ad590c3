"""The budget bench's figures (``engine/bench/budget.py``): which fixed
configuration is best, and the budget's ratio to it, of medians and paired."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import cast

import pytest

from metrale.engine.api import Request, SamplingParams
from metrale.engine.bench import budget
from metrale.engine.bench.budget import (
    Summary,
    bench_workload,
    readme_summary,
    step_by_step,
    summarise,
)
from metrale.engine.config import EngineConfig
from metrale.engine.load.loader import LoadedModel
from metrale.engine.runtime.model import ForwardOutput, LogitRows, Segment
from tests.support.fake_model import FakeModel, FakeMtp, byte_decode, reference_greedy


def test_the_paired_ratio_is_the_median_of_the_ratios_within_each_round() -> None:
    rounds = {
        "no drafts": [100.0, 80.0, 60.0],
        "copies": [110.0, 88.0, 66.0],
        "MTP": [90.0, 72.0, 54.0],
        "MTP+copies": [105.0, 84.0, 63.0],
        "auto": [66.0, 110.0, 88.0],
    }
    row = summarise(rounds)
    assert row.best == "copies" and row.rates["copies"] == 88.0
    # The medians come from different rounds: 88 against 88.
    assert row.ratio == pytest.approx(1.0)
    # Round by round 0.6, 1.25 and 1.333: the median is 1.25.
    assert row.paired == pytest.approx(1.25)


def test_the_best_fixed_configuration_has_the_highest_median_and_never_is_auto() -> None:
    rounds = {
        "no drafts": [50.0, 52.0, 51.0],
        "copies": [60.0, 20.0, 61.0],
        "MTP": [55.0, 56.0, 54.0],
        "MTP+copies": [40.0, 41.0, 42.0],
        "auto": [99.0, 99.0, 99.0],
    }
    row = summarise(rounds)
    assert row.best == "copies" and row.rates["copies"] == 60.0  # above MTP's 55, a slow round
    assert row.ratio == pytest.approx(99.0 / 60.0)
    assert row.paired == pytest.approx(99.0 / 60.0)


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_configurations_take_turns_step_by_step_each_on_its_own_model(
    one_at_a_time: bool,
) -> None:
    order: list[str] = []

    def loaded(key: str) -> LoadedModel:
        model = FakeModel(num_slots=4)
        forward = model.forward

        def counted(segments: Sequence[Segment], logits: LogitRows = "all") -> ForwardOutput:
            order.append(key)
            return forward(segments, logits)

        model.forward = counted  # type: ignore[method-assign]
        fake = SimpleNamespace(
            model=model,
            mtp=[FakeMtp(model, "right")],
            tokenizer=byte_decode,
            eos_token_ids=(),
            name="fake",
        )
        return cast(LoadedModel, fake)

    fixed: dict[str, object] = {"max_batch": 4, "prompt_lookup": None, "draft_policy": "fixed"}
    configs = {
        "no drafts": EngineConfig(mtp=False, **fixed),  # type: ignore[arg-type]
        "MTP": EngineConfig(**fixed),  # type: ignore[arg-type]
    }
    models = {key: loaded(key) for key in configs}
    requests = [Request(str(i), (i + 1, 2, 3), SamplingParams(max_tokens=40)) for i in range(3)]
    measured = step_by_step(models, configs, requests, one_at_a_time, round_=1)

    reference = FakeModel(num_slots=4)
    for seconds, outputs in measured.values():
        assert seconds > 0
        assert {k: list(v) for k, v in outputs.items()} == {
            r.request_id: reference_greedy(reference, r.prompt_ids, 40) for r in requests
        }
    # Round 1: level at the start, the second configuration goes first. From
    # then on the one that has written fewer tokens steps: the MTP engine's
    # oracle drafts are always accepted (4 tokens a step), so the other one
    # takes several steps to each of its, and neither runs on alone for
    # more than a step's worth of the other's tokens. (Taking one step
    # each in turn, the MTP engine ended with most of the other's steps to go.)
    turns = [(key, len(list(group))) for key, group in itertools.groupby(order)]
    assert turns[0][0] == "MTP"
    assert max(n for key, n in turns if key == "no drafts") >= 3
    assert max(n for key, n in turns if key == "MTP") <= 2
    tail = list(itertools.takewhile(lambda k: k == order[-1], reversed(order)))
    assert len(tail) <= 5


def test_a_row_rates_every_round_and_stops_on_an_output_difference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each round's tokens/s per configuration, from its seconds and tokens;
    a configuration whose output differs from no drafts' is an error."""
    outputs = {"0": (1, 2)}

    def round_(models: object, configs: object, requests: object, one: bool, r: int) -> object:
        out = {key: (float(r + 1), dict(outputs)) for key in budget.CONFIGS}
        if r == 1 and changed:
            out["auto"] = (1.0, {"0": (1, 3)})
        return out

    monkeypatch.setattr(budget, "warm_up", lambda *args: None)
    monkeypatch.setattr(budget, "step_by_step", round_)
    models = cast(dict[str, LoadedModel], dict.fromkeys(budget.CONFIGS))
    requests = [Request("0", (1, 2), SamplingParams(max_tokens=2))]
    changed = False
    rounds = bench_workload(models, "set", requests, 1, 3)
    assert rounds == {key: [2.0, 1.0, 2 / 3] for key in budget.CONFIGS}
    changed = True
    with pytest.raises(SystemExit, match="auto changed the greedy output"):
        bench_workload(models, "set", requests, 16, 3)


def test_a_row_of_short_runs_takes_rounds_until_each_configuration_ran_long_enough(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At least ``repeats`` rounds, then more until every configuration's
    seconds add up to ``min_seconds``, never more than ``max_rounds``."""
    seconds = {key: 1.0 for key in budget.CONFIGS} | {"copies": 0.5}

    def round_(models: object, configs: object, requests: object, one: bool, r: int) -> object:
        return {key: (seconds[key], {"0": (1, 2)}) for key in budget.CONFIGS}

    monkeypatch.setattr(budget, "warm_up", lambda *args: None)
    monkeypatch.setattr(budget, "step_by_step", round_)
    models = cast(dict[str, LoadedModel], dict.fromkeys(budget.CONFIGS))
    requests = [Request("0", (1, 2), SamplingParams(max_tokens=2))]

    def rounds(repeats: int, min_seconds: float, max_rounds: int) -> int:
        rates = bench_workload(models, "set", requests, 16, repeats, min_seconds, max_rounds)
        return len(rates["auto"])

    assert rounds(3, 0.0, 12) == 3
    assert rounds(3, 4.0, 12) == 8  # copies, the quickest, ran 0.5 s a round
    assert rounds(3, 100.0, 12) == 12
    assert rounds(5, 100.0, 4) == 5  # the fewest rounds stand above the most
    row = summarise({key: [float(r + 1) for r in range(7)] for key in budget.CONFIGS})
    assert row.rounds == 7


def test_the_readme_summary_spreads_each_batch_sizes_ratios_over_its_workloads() -> None:
    def row(ratio: float) -> Summary:
        return Summary({}, "copies", ratio, ratio)

    rows = [
        ("a", 1, row(1.2)),
        ("b", 1, row(0.95)),
        ("c", 1, row(1.0)),
        ("a", 16, row(0.98)),
        ("b", 16, row(0.99)),
    ]
    lines = readme_summary(rows)
    assert lines[2] == "| 1 | 3 | 0.950x (b) | 1.000x | 1.200x (a) | 2 of 3 | 1 of 3 |"
    assert lines[3] == "| 16 | 2 | 0.980x (a) | 0.985x | 0.990x (b) | 2 of 2 | 0 of 2 |"
    assert len(lines) == 4
