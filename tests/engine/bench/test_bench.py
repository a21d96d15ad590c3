"""`metrale bench` end to end on tiny checkpoints, and its sweep parsing.

The tiny runs are real: transformers and metrale load the same random
checkpoint, decode the same prompt ids, and the bench compares outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.engine.api import Request, SamplingParams
from metrale.engine.bench.figures import Figures, Mismatch, WorkloadReport, first_mismatch
from metrale.engine.bench.runners import MetraleRunner, RunOutcome
from metrale.engine.bench.sweep import parse_sweep
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.load.loader import load_model
from tests.support.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG_KEYS = {
    "hf-greedy-b1",
    "hf-lookup-b1",
    "hf-greedy-b2",
    *(f"metrale-{m}-b{b}" for m in ("off", "mtp", "lookup", "both", "auto") for b in (1, 2)),
}
# Lines that repeat themselves, so prompt lookup finds copies to propose.
LINES = [
    {"id": "a", "prompt": "abc abc abc abc abc abc abc abc abc abc abc", "max_tokens": 10},
    {"id": "b", "messages": [{"role": "user", "content": "xyzw xyzw xyzw xyzw xyzw xyzw"}]},
    {"id": "c", "prompt": "one two three one two three one two three"},
]


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), mtp_layout="deepseek")


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("plain"), seed=3)


@pytest.fixture
def workload(tmp_path: Path) -> Path:
    path = tmp_path / "echo.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def bench(args: list[str]) -> Any:
    # Rich sizes its tables from COLUMNS when it writes to a pipe.
    return CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "240"})


def tiny_args(checkpoint: Path, workload: Path, out: Path, repeats: int = 1) -> list[str]:
    return [
        str(workload),
        "--model",
        str(checkpoint),
        "--batch",
        "2",
        "--prompts",
        "2",
        "--max-tokens",
        "12",
        "--repeats",
        str(repeats),
        "--device",
        "cpu",
        "--json",
        str(out),
        # The tiny random head is never sure of anything: draft its full chain.
        "--mtp-min-prob",
        "0",
    ]


def test_bench_measures_every_configuration_and_outputs_agree(
    mtp_checkpoint: Path, workload: Path, tmp_path: Path
) -> None:
    result = bench(tiny_args(mtp_checkpoint, workload, tmp_path / "bench.json", repeats=2))
    assert result.exit_code == 0, result.output
    assert "metrale, MTP+lookup" in result.output and "FAILED" not in result.output
    doc = json.loads((tmp_path / "bench.json").read_text())
    (report,) = doc["workloads"]
    assert report["name"] == "echo"
    figures = {f["key"]: f for f in report["figures"]}
    assert set(figures) == CONFIG_KEYS
    assert doc["failures"] == []
    for f in figures.values():
        assert f["available"] and f["mismatch"] is None
        assert len(f["wall_s"]) == 2 and f["tokens_per_s"] > 0
    # Batch 1 decodes the first 2 lines, batch 2 the first 2 too; line a caps at 10.
    assert figures["hf-greedy-b1"]["generated_tokens"] <= 10 + 12
    assert figures["hf-greedy-b1"]["ratio"] == pytest.approx(1.0)
    assert figures["hf-greedy-b2"]["ratio"] == pytest.approx(1.0)
    assert figures["metrale-off-b1"]["mean_tokens_per_verify"] == pytest.approx(1.0)
    assert figures["metrale-off-b1"]["copies"] == 0
    assert figures["metrale-mtp-b1"]["mtp_acceptance"], "MTP drafts were verified"
    assert figures["metrale-lookup-b1"]["copy_proposed"] > 0, "the echo lines give copies"
    # One token per pass without drafts: prefill + one verify per further token.
    off = figures["metrale-off-b1"]
    assert off["passes_per_token"] == pytest.approx(1.0)
    assert all(f["peak_mb"] is None or f["peak_mb"] > 0 for f in figures.values())


def test_a_model_without_mtp_shows_mtp_configurations_as_not_available(
    plain_checkpoint: Path, workload: Path, tmp_path: Path
) -> None:
    result = bench(tiny_args(plain_checkpoint, workload, tmp_path / "bench.json"))
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "bench.json").read_text())
    figures = {f["key"]: f for f in doc["workloads"][0]["figures"]}
    for key in ("metrale-mtp-b1", "metrale-both-b2"):
        assert not figures[key]["available"] and "no MTP" in figures[key]["note"]
    assert figures["metrale-lookup-b2"]["available"]
    assert "no MTP layers" in result.output


def test_an_injected_output_difference_fails_the_run_naming_the_request(
    plain_checkpoint: Path, workload: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_run = MetraleRunner.run

    def corrupt(self: MetraleRunner, requests: Any) -> RunOutcome:
        outcome = real_run(self, requests)
        if self.config.prompt_lookup is None or self.config.max_batch != 2:
            return outcome
        outputs = dict(outcome.outputs)
        if "b" in outputs:  # lookup at batch 2: line b's 3rd token turns wrong
            ids = list(outputs["b"])
            ids[2] = (ids[2] + 1) % 256
            outputs["b"] = tuple(ids)
        return RunOutcome(outputs, outcome.wall_s, outcome.forward_passes, outcome.stats)

    monkeypatch.setattr(MetraleRunner, "run", corrupt)
    result = bench(tiny_args(plain_checkpoint, workload, tmp_path / "bench.json"))
    assert result.exit_code == 1, result.output
    assert "FAILED" in result.output
    assert "request b differs from output token 2" in result.output
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["failures"] == [
        {"workload": "echo", "configuration": "metrale-lookup-b2", "request_id": "b"}
    ]
    figures = {f["key"]: f for f in doc["workloads"][0]["figures"]}
    assert figures["metrale-lookup-b2"]["mismatch"]["position"] == 2
    assert figures["metrale-off-b2"]["mismatch"] is None


def test_sweep_runs_each_value_against_speculation_off_and_marks_the_best(
    plain_checkpoint: Path, workload: Path, tmp_path: Path
) -> None:
    args = tiny_args(plain_checkpoint, workload, tmp_path / "sweep.json")
    result = bench([*args, "--sweep", "prompt-lookup-max-drafts=1,4"])
    assert result.exit_code == 0, result.output
    assert "sweep prompt-lookup-max-drafts" in result.output and "★ best" in result.output
    (sweep,) = json.loads((tmp_path / "sweep.json").read_text())["sweeps"]
    assert [p["value"] for p in sweep["points"]] == [1, 4]
    assert sum(p["best"] for p in sweep["points"]) == 1
    best = max(sweep["points"], key=lambda p: p["tokens_per_s"])
    assert best["best"] and all(p["mismatch"] is None for p in sweep["points"])


def test_sweep_of_mtp_drafts_on_a_model_without_mtp_is_a_usage_error(
    plain_checkpoint: Path, workload: Path, tmp_path: Path
) -> None:
    args = tiny_args(plain_checkpoint, workload, tmp_path / "x.json")
    result = bench([*args, "--sweep", "mtp-drafts=1,2"])
    assert result.exit_code == 2
    assert "no MTP layers" in result.output


@pytest.mark.parametrize(
    ("text", "parameter", "values"),
    [
        ("prompt-lookup-max-drafts=1,2,4,8,16", "prompt-lookup-max-drafts", (1, 2, 4, 8, 16)),
        ("--prompt-lookup-ngram=2, 3", "prompt-lookup-ngram", (2, 3)),
        ("prompt-lookup-min-match=4,8,12", "prompt-lookup-min-match", (4, 8, 12)),
        ("mtp-drafts=0,1,3", "mtp-drafts", (0, 1, 3)),
    ],
)
def test_sweep_parses_its_values(text: str, parameter: str, values: tuple[int, ...]) -> None:
    spec = parse_sweep(text)
    assert (spec.parameter, spec.values) == (parameter, values)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-drafts=1,2", "NAME one of"),
        ("prompt-lookup-max-drafts", "NAME one of"),
        ("prompt-lookup-max-drafts=", "comma-separated integers"),
        ("prompt-lookup-max-drafts=1,,2", "comma-separated integers"),
        ("prompt-lookup-max-drafts=1,two", "'two' is not an integer"),
        ("prompt-lookup-max-drafts=4,4", "4 is given twice"),
        (
            "prompt-lookup-max-drafts=0,8",
            "prompt-lookup-max-drafts=0: max_drafts must be between 1 and 256",
        ),
        ("prompt-lookup-ngram=2,65", "prompt-lookup-ngram=65"),
        ("mtp-drafts=-1", "0 or more"),
    ],
)
def test_sweep_rejects_bad_values_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="--sweep") as caught:
        parse_sweep(text)
    assert message in str(caught.value)


def test_bad_sweep_is_refused_before_any_model_is_loaded(workload: Path) -> None:
    result = bench([str(workload), "--model", "/nonexistent", "--sweep", "ngram=1,2"])
    assert result.exit_code == 2
    assert "NAME one of" in result.output


def test_plot_without_matplotlib_says_how_to_install_it(
    workload: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    result = bench([str(workload), "--model", "/nonexistent", "--plot", "x.png"])
    assert result.exit_code == 2
    assert "metrale[plot]" in result.output


def test_first_mismatch_names_the_first_differing_request_and_token() -> None:
    reference = {"1": (5, 6, 7), "2": (1, 2, 3), "3": (9,)}
    outputs = {"1": (5, 6, 7), "2": (1, 2), "3": (8,)}
    assert first_mismatch(reference, outputs, ["1", "2", "3"]) == Mismatch(
        "2", 2, (1, 2, 3), (1, 2)
    )
    assert first_mismatch(reference, outputs, ["3", "2"]) == Mismatch("3", 0, (9,), (8,))
    assert first_mismatch(reference, dict(reference), ["1", "2", "3"]) is None


def test_only_transformers_own_batched_difference_is_a_note() -> None:
    m = Mismatch("x", 0, (1,), (2,))
    assert not Figures("hf-greedy-b16", "hf", "transformers", 16, mismatch=m).is_failure
    assert Figures("hf-lookup-b1", "hf", "transformers", 1, mismatch=m).is_failure
    assert Figures("metrale-off-b16", "m", "metrale", 16, mismatch=m).is_failure
    assert not Figures("metrale-off-b16", "m", "metrale", 16).is_failure


def test_workload_requests_are_split_by_batch_size() -> None:
    from metrale.engine.bench.suite import Workload

    requests = tuple(Request(str(i), (1, 2)) for i in range(5))
    w = Workload("w", requests)
    assert [r.request_id for r in w.requests_for(1, 2)] == ["0", "1"]
    assert [r.request_id for r in w.requests_for(4, 2)] == ["0", "1", "2", "3"]
    assert len(w.requests_for(1, None)) == 5


def test_plot_draws_one_bar_series_per_configuration_with_its_speedups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib is an optional extra: a stand-in records what would be drawn."""
    import sys
    from unittest import mock

    from metrale.cli.bench_view import write_plot

    pyplot = mock.MagicMock()
    fig, ax = mock.MagicMock(), mock.MagicMock()
    pyplot.subplots.return_value = (fig, ax)
    fig.savefig.side_effect = lambda path, dpi: Path(path).write_bytes(b"png")
    matplotlib = mock.MagicMock(pyplot=pyplot)
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)

    def report(name: str, lookup_ratio: float) -> WorkloadReport:
        figures = (
            Figures("hf-greedy-b1", "HF greedy", "transformers", 1, ratio=1.0),
            Figures("metrale-lookup-b1", "metrale, lookup", "metrale", 1, ratio=lookup_ratio),
            Figures("metrale-mtp-b1", "metrale, MTP", "metrale", 1, available=False),
        )
        return WorkloadReport(name, 4, figures)

    write_plot(tmp_path / "chart.png", [report("code", 2.5), report("prose", 1.25)])
    assert (tmp_path / "chart.png").read_bytes() == b"png"
    series = {call.kwargs["label"]: call.args[1] for call in ax.bar.call_args_list}
    assert series == {"metrale, lookup (b1)": [2.5, 1.25]}  # no bar for what never ran


def test_a_runner_ignoring_eos_generates_exactly_max_tokens_past_an_eos(
    plain_checkpoint: Path,
) -> None:
    loaded = load_model(plain_checkpoint, RuntimeConfig(device="cpu", num_slots=1, max_len=64))
    config = EngineConfig(max_batch=1, mtp=False, prompt_lookup=None)
    prompt = tuple(b"abc abc abc")
    free = MetraleRunner(loaded, config).run([Request("r", prompt, SamplingParams(max_tokens=9))])
    greedy = free.outputs["r"]
    # The request names its own first greedy token as EOS: it would stop at once.
    stops = SamplingParams(max_tokens=9, eos_token_ids=(greedy[0],))
    assert MetraleRunner(loaded, config).run([Request("r", prompt, stops)]).outputs["r"] == (
        greedy[0],
    )
    ignoring = MetraleRunner(loaded, config, ignore_eos=True).run([Request("r", prompt, stops)])
    assert ignoring.outputs["r"] == greedy[:9] and len(greedy) == 9


def test_bench_reads_a_gguf_file_and_compares_transformers_on_its_converted_folder(
    plain_checkpoint: Path, workload: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.gguf_files import write_gguf

    monkeypatch.setenv("METRALE_HOME", str(tmp_path / "home"))
    gguf = write_gguf(plain_checkpoint, tmp_path / "tiny.gguf")
    result = bench(tiny_args(gguf, workload, tmp_path / "bench.json"))
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["failures"] == [], "metrale on the GGUF decodes what transformers does"
