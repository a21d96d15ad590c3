"""How `metrale bench` compares outputs: token for token, or by first divergence
(bfloat16 on CUDA), forced here on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from metrale.cli.bench_view import divergence_text
from metrale.cli.main import app
from metrale.engine.bench.figures import (
    Divergence,
    Mismatch,
    compare_mode,
    divergence,
    first_difference,
    least_common,
)
from metrale.engine.bench.runners import MetraleRunner, RunOutcome
from metrale.engine.bench.suite import BenchSettings, compare_outputs
from tests.support.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

REFERENCE = {"a": (1, 2, 3, 4), "b": (5, 6, 7), "c": (8, 9)}


def test_the_first_difference_is_where_outputs_part_or_the_shorter_ends() -> None:
    assert first_difference((1, 2, 3), (1, 2, 3)) is None
    assert first_difference((1, 2, 3), (1, 9, 3)) == 1
    assert first_difference((1, 2, 3), (1, 2)) == 2  # stopped early
    assert first_difference((1, 2), (1, 2, 3)) == 2  # ran on
    assert first_difference((), (4,)) == 0


def test_divergence_gives_each_requests_first_difference_and_the_mean_common_prefix() -> None:
    outputs = {"a": (1, 2, 0, 0), "b": (5, 6, 7), "c": (8,)}
    found = divergence(REFERENCE, outputs, ["a", "b", "c"])
    assert found.first_diff == (("a", 2), ("b", None), ("c", 1))
    assert found.mean_common_prefix == pytest.approx((2 + 3 + 1) / 3)
    assert found.mean_length == pytest.approx((4 + 3 + 2) / 3)
    assert found.num_diverged == 2
    assert divergence(REFERENCE, dict(REFERENCE), ["a", "c"]).num_diverged == 0
    missing = divergence(REFERENCE, {}, ["b"])  # no output at all: it differs at once
    assert missing.first_diff == (("b", 0),) and missing.mean_common_prefix == 0


def test_of_several_runs_the_one_keeping_the_least_is_reported() -> None:
    runs = [
        Divergence((("a", None),), 4.0, 4.0),
        Divergence((("a", 1),), 1.0, 4.0),
        Divergence((("a", 1),), 1.0, 4.0),
    ]
    assert least_common(runs) is runs[1]
    assert least_common([]) is None


def test_divergence_mode_reports_and_never_fails_exact_mode_fails() -> None:
    order = ["a", "b", "c"]
    good, bad = dict(REFERENCE), {**REFERENCE, "b": (5, 0, 7)}
    exact = BenchSettings(compare="exact")
    mismatch, diverged = compare_outputs(REFERENCE, [good, bad], order, exact)
    assert mismatch == Mismatch("b", 1, (5, 6, 7), (5, 0, 7)) and diverged is None
    loose = BenchSettings(compare="divergence")
    mismatch, diverged = compare_outputs(REFERENCE, [good, bad], order, loose)
    assert mismatch is None and diverged is not None
    assert diverged.first_diff == (("a", None), ("b", 1), ("c", None))
    assert divergence_text(diverged) == (
        "first differing output token per request: a equal, b 1, c equal; "
        "mean common prefix 2.3 of 3.0 tokens"
    )
    with pytest.raises(ValueError, match="compare must be exact or divergence"):
        BenchSettings(compare="auto")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "mode"),
    [
        ("auto", "cuda", "bfloat16", "divergence"),
        ("auto", "cuda", "float16", "divergence"),
        ("auto", "cuda", "float32", "exact"),  # greedy parity is exact in float32
        ("auto", "cpu", "bfloat16", "exact"),
        ("auto", "cpu", "float32", "exact"),
        ("divergence", "cpu", "float32", "divergence"),
        ("exact", "cuda", "bfloat16", "exact"),
    ],
)
def test_auto_compares_by_divergence_on_cuda_below_float32(
    requested: str, device: str, dtype: str, mode: str
) -> None:
    assert compare_mode(requested, device, dtype) == mode


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("plain"), seed=3)


@pytest.fixture
def workload(tmp_path: Path) -> Path:
    lines = [
        {"id": "a", "prompt": "abc abc abc abc abc abc abc abc", "max_tokens": 10},
        {"id": "b", "prompt": "one two three one two three one two three"},
    ]
    path = tmp_path / "echo.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def corrupt_lookup_at_batch_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Line b's 3rd token turns wrong in metrale's lookup runs at batch 2, as a
    bfloat16 near-tie might tip it."""
    real_run = MetraleRunner.run

    def run(self: MetraleRunner, requests: Any) -> RunOutcome:
        outcome = real_run(self, requests)
        if self.config.prompt_lookup is None or self.config.max_batch != 2:
            return outcome
        outputs = dict(outcome.outputs)
        if "b" in outputs:
            ids = list(outputs["b"])
            ids[2] = (ids[2] + 1) % 256
            outputs["b"] = tuple(ids)
        return RunOutcome(outputs, outcome.wall_s, outcome.forward_passes, outcome.stats)

    monkeypatch.setattr(MetraleRunner, "run", run)


def test_forced_divergence_mode_reports_the_difference_and_passes(
    checkpoint: Path, workload: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corrupt_lookup_at_batch_2(monkeypatch)
    out = tmp_path / "bench.json"
    args = [str(workload), "--model", str(checkpoint), "--batch", "2", "--prompts", "2"]
    args += ["--max-tokens", "12", "--repeats", "1", "--device", "cpu", "--json", str(out)]
    result = CliRunner().invoke(
        app, ["bench", *args, "--compare", "divergence"], env={"COLUMNS": "240"}
    )
    assert result.exit_code == 0, result.output
    assert "FAILED" not in result.output and "compared by first divergence" in result.output
    assert "first differing output token per request: a equal, b 2" in result.output
    doc = json.loads(out.read_text())
    assert doc["failures"] == [] and doc["settings"]["compare"] == "divergence"
    figures = {f["key"]: f for f in doc["workloads"][0]["figures"]}
    lookup = figures["metrale-lookup-b2"]
    assert lookup["mismatch"] is None
    assert lookup["divergence"]["first_diff"] == [["a", None], ["b", 2]]
    assert figures["metrale-off-b2"]["divergence"]["first_diff"] == [["a", None], ["b", None]]
    # The same difference, compared token for token (auto on the CPU), fails.
    exact = CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "240"})
    assert exact.exit_code == 1 and "request b differs from output token 2" in exact.output
    assert json.loads(out.read_text())["settings"]["compare"] == "exact"
