"""The measuring core of `metrale bench`: metrale against transformers, one process.

Contract: ``run_bench`` runs every configuration of ``configurations(settings)``
on every workload, in one process, on the same loaded checkpoint, dtype and
prompt ids. Batch-1 configurations decode the workload's first
``single_prompts`` requests one at a time; batched ones the first ``batch``
requests together (so "batch 16" really has 16 in flight). Per workload: one
untimed warm-up run of each configuration (a few requests, a few tokens),
then ``repeats`` timed runs per configuration, the configurations taking
turns (``take_turns``: rep 1 of each, then rep 2 of each, in rotated order),
so drift on a shared machine hits all of them alike. Figures come from the
median run.

Outputs are greedy. Every run of every configuration is compared with
transformers greedy at batch 1, the reference (its first timed run, plus one
untimed run for requests only the batched configurations decode), in
``settings.compare``'s mode (``figures.py``). ``exact``: token for token;
any difference is a failure of the bench, reported with the first differing
request. transformers' own batched run (left padding) may legitimately
differ in float arithmetic; its differences are reported as a note, not a
failure. ``divergence`` (bfloat16 on CUDA): each request's first differing
token and the mean common prefix, of the run that keeps the least, are
reported and nothing fails.

Figures and their definitions: ``bench_figures``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from metrale.engine.api import Request
from metrale.engine.bench.figures import (
    Compare,
    Divergence,
    Figures,
    Mismatch,
    Side,
    WorkloadReport,
    divergence,
    first_mismatch,
    least_common,
)
from metrale.engine.bench.memory import PeakMemory, frozen_heap
from metrale.engine.bench.runners import (
    HfRunner,
    MetraleRunner,
    Runner,
    RunOutcome,
    Subjects,
    hf_weight_bytes,
    pad_id,
    resident_state_bytes,
)
from metrale.engine.bench.timing import take_turns
from metrale.engine.config import MTP_MIN_PROB, EngineConfig, MtpLadder
from metrale.lookup import PromptLookupConfig

Speculation = Literal["off", "mtp", "lookup", "both", "auto"]
REFERENCE = "hf-greedy-b1"
NO_MTP = "n/a: the model has no MTP layers"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchSettings:
    """How the bench runs; metrale's speculation settings mirror `generate`'s flags."""

    repeats: int = 3
    batch: int = 16
    single_prompts: int | None = None  # None: every request of the workload
    hf_lookup_tokens: int = 10
    warmup_tokens: int = 8
    prompt_lookup: PromptLookupConfig = field(default_factory=PromptLookupConfig)
    mtp_ladder: MtpLadder = field(default_factory=MtpLadder)
    mtp_min_prob: float = MTP_MIN_PROB
    compare: Compare = "exact"  # how outputs are compared (figures.py)

    def __post_init__(self) -> None:
        if self.compare not in ("exact", "divergence"):
            raise ValueError(f"compare must be exact or divergence, got {self.compare!r}")
        if self.single_prompts is not None and self.single_prompts < 1:
            raise ValueError("single_prompts must be at least 1")
        if self.repeats < 1:
            raise ValueError("repeats must be at least 1")
        if self.batch < 2:
            raise ValueError("batch must be at least 2 (batch 1 is always measured)")
        if self.hf_lookup_tokens < 1:
            raise ValueError("hf_lookup_tokens must be at least 1")
        if self.warmup_tokens < 1:
            raise ValueError("warmup_tokens must be at least 1")


@dataclass(frozen=True)
class Configuration:
    """One row of a table: who decodes, at which batch size, with which drafts."""

    key: str
    label: str
    side: Side
    batch: int
    speculation: Speculation = "off"
    hf_lookup_tokens: int = 0  # transformers' prompt_lookup_num_tokens; 0: off

    @property
    def uses_mtp(self) -> bool:
        return self.speculation in ("mtp", "both", "auto")


@dataclass(frozen=True)
class Workload:
    """Named greedy requests; every configuration gets exactly these ids."""

    name: str
    requests: tuple[Request, ...]

    def requests_for(self, batch: int, single_prompts: int | None) -> tuple[Request, ...]:
        """What a configuration of ``batch`` decodes (see the module doc)."""
        return self.requests[: single_prompts if batch == 1 else batch]


def configurations(settings: BenchSettings) -> tuple[Configuration, ...]:
    """transformers (HF) greedy at 1 and ``batch``, its prompt lookup at 1, and
    metrale off / MTP / lookup / both at 1 and ``batch``: each speculation
    mode of metrale next to the plain decoding it must beat and to the
    speculation transformers itself offers, at both batch sizes."""
    b = settings.batch
    rows = [
        Configuration(REFERENCE, "HF greedy", "transformers", 1),
        Configuration(
            "hf-lookup-b1",
            f"HF prompt lookup {settings.hf_lookup_tokens}",
            "transformers",
            1,
            "off",
            settings.hf_lookup_tokens,
        ),
    ]
    rows += _metrale_rows(1)
    rows.append(Configuration(f"hf-greedy-b{b}", "HF greedy", "transformers", b))
    rows += _metrale_rows(b)
    return tuple(rows)


def _metrale_rows(batch: int) -> list[Configuration]:
    labels: dict[Speculation, str] = {
        "off": "metrale, no drafts",
        "mtp": "metrale, MTP",
        "lookup": "metrale, lookup",
        "both": "metrale, MTP+lookup",
        "auto": "metrale, draft budget",
    }
    return [
        Configuration(f"metrale-{mode}-b{batch}", label, "metrale", batch, mode)
        for mode, label in labels.items()
    ]


def engine_config(
    settings: BenchSettings, batch: int, speculation: Speculation, lookup: PromptLookupConfig
) -> EngineConfig:
    """The four fixed rows keep the ladder and windows (``--draft-policy
    fixed``); ``auto`` is the default, both sources under the draft budget."""
    return EngineConfig(
        max_batch=batch,
        mtp=speculation in ("mtp", "both", "auto"),
        mtp_ladder=settings.mtp_ladder,
        mtp_min_prob=settings.mtp_min_prob,
        prompt_lookup=lookup if speculation in ("lookup", "both", "auto") else None,
        draft_policy="auto" if speculation == "auto" else "fixed",
    )


def run_bench(
    workloads: Sequence[Workload],
    settings: BenchSettings,
    subjects: Subjects,
    progress: Progress | None = None,
) -> tuple[WorkloadReport, ...]:
    with frozen_heap():
        return tuple(bench_workload(w, settings, subjects, progress) for w in workloads)


def bench_workload(
    workload: Workload,
    settings: BenchSettings,
    subjects: Subjects,
    progress: Progress | None = None,
) -> WorkloadReport:
    configs = configurations(settings)
    runnable = [c for c in configs if subjects.has_mtp or not c.uses_mtp]
    runners = {c.key: _runner(c, settings, subjects) for c in runnable}
    runs = timed_runs(workload, runnable, runners, settings, subjects, progress)
    reference = dict(runs[REFERENCE][0][0].outputs)
    rest = [r for r in workload.requests[: settings.batch] if r.request_id not in reference]
    if rest:
        _say(progress, f"{workload.name}: reference outputs of the batch-only requests")
        reference.update(runners[REFERENCE].run(rest).outputs)
    figures = [
        _figures(c, runs[c.key], reference, subjects, workload, settings)
        if c.key in runs
        else Figures(c.key, c.label, c.side, c.batch, available=False, note=NO_MTP)
        for c in configs
    ]
    return WorkloadReport(
        workload.name,
        len(workload.requests_for(settings.batch, settings.single_prompts)),
        tuple(_with_ratios(figures)),
        len(workload.requests_for(1, settings.single_prompts)),
    )


TimedRuns = dict[str, list[tuple[RunOutcome, int | None]]]


def timed_runs(
    workload: Workload,
    configs: Sequence[Configuration],
    runners: dict[str, Runner],
    settings: BenchSettings,
    subjects: Subjects,
    progress: Progress | None,
) -> TimedRuns:
    """A short warm-up of each, then ``repeats`` rounds in which every
    configuration runs once (``take_turns``). Returns each configuration's
    (outcome, peak bytes) per round."""
    meter = PeakMemory(subjects.device)

    def warmup(config: Configuration) -> Callable[[], RunOutcome]:
        def run() -> RunOutcome:
            _say(progress, f"{workload.name}: warm-up, {config.label} (batch {config.batch})")
            short = warmup_requests(workload, config.batch, settings.warmup_tokens)
            return runners[config.key].run(short)

        return run

    def measured(config: Configuration) -> Callable[[], tuple[RunOutcome, int | None]]:
        requests = workload.requests_for(config.batch, settings.single_prompts)

        def run() -> tuple[RunOutcome, int | None]:
            with meter.measure():
                outcome = runners[config.key].run(requests)
            return outcome, meter.peak_bytes

        return run

    def announce(rep: int, index: int) -> None:
        config = configs[index]
        _say(
            progress,
            f"{workload.name}: run {rep + 1}/{settings.repeats}, "
            f"{config.label} (batch {config.batch})",
        )

    rounds = take_turns(
        [measured(c) for c in configs],
        settings.repeats,
        warmups=[warmup(c) for c in configs],
        before=announce,
    )
    return {c.key: runs for c, runs in zip(configs, rounds, strict=True)}


def warmup_requests(workload: Workload, batch: int, tokens: int) -> list[Request]:
    """The first ``batch`` requests, cut to ``tokens`` new tokens each."""
    return [
        replace(r, params=replace(r.params, max_tokens=min(tokens, r.params.max_tokens)))
        for r in workload.requests[:batch]
    ]


def _runner(config: Configuration, settings: BenchSettings, subjects: Subjects) -> Runner:
    if config.side == "transformers":
        pad = pad_id(subjects.single)
        return HfRunner(subjects.hf_model, pad, config.batch, config.hf_lookup_tokens)
    loaded = subjects.single if config.batch == 1 else subjects.batched
    cfg = engine_config(settings, config.batch, config.speculation, settings.prompt_lookup)
    return MetraleRunner(loaded, cfg)


def _figures(
    config: Configuration,
    runs: list[tuple[RunOutcome, int | None]],
    reference: dict[str, tuple[int, ...]],
    subjects: Subjects,
    workload: Workload,
    settings: BenchSettings,
) -> Figures:
    order = [r.request_id for r in workload.requests_for(config.batch, settings.single_prompts)]
    mismatch, diverged = compare_outputs(reference, [o.outputs for o, _ in runs], order, settings)
    walls = tuple(outcome.wall_s for outcome, _ in runs)
    first = runs[0][0]
    figures = Figures(
        config.key,
        config.label,
        config.side,
        config.batch,
        wall_s=walls,
        generated_tokens=first.generated_tokens,
        tokens_per_s=first.generated_tokens / statistics.median(walls),
        passes_per_token=first.forward_passes / max(first.generated_tokens, 1),
        peak_mb=_peak_mb(config, runs, subjects),
        mismatch=mismatch,
        divergence=diverged,
    )
    stats = first.stats
    if stats is None:
        return figures
    acceptance = tuple(
        a / p if p else 0.0
        for a, p in zip(stats.mtp_accepted_by_position, stats.mtp_proposed_by_position, strict=True)
    )
    return replace(
        figures,
        mean_tokens_per_verify=stats.mean_tokens_per_verify,
        copies=stats.prompt_lookup.total.copies,
        copy_proposed=stats.prompt_lookup.total.proposed,
        copy_accepted=stats.prompt_lookup.total.accepted,
        mtp_acceptance=acceptance,
    )


def compare_outputs(
    reference: dict[str, tuple[int, ...]],
    runs: Sequence[dict[str, tuple[int, ...]]],
    order: Sequence[str],
    settings: BenchSettings,
) -> tuple[Mismatch | None, Divergence | None]:
    """Every run's outputs against the reference, in ``settings.compare``'s
    mode: the first mismatch of any run (exact), or the divergence of the run
    that keeps the shortest common prefix (divergence)."""
    if settings.compare == "divergence":
        return None, least_common([divergence(reference, outputs, order) for outputs in runs])
    mismatch = None
    for outputs in runs:
        mismatch = mismatch or first_mismatch(reference, outputs, order)
    return mismatch, None


def _peak_mb(
    config: Configuration, runs: list[tuple[RunOutcome, int | None]], subjects: Subjects
) -> float | None:
    peaks = [p for _, p in runs if p is not None]
    if not peaks:
        return None
    held = 0
    if subjects.device.type != "cuda":  # CUDA's high-water already holds them
        if config.side == "transformers":
            held = hf_weight_bytes(subjects.hf_model)
        else:
            held = resident_state_bytes(subjects.single if config.batch == 1 else subjects.batched)
    return (max(peaks) + held) / 2**20


def _with_ratios(figures: list[Figures]) -> list[Figures]:
    peers = {f.batch: f.tokens_per_s for f in figures if f.key.startswith("hf-greedy-")}
    return [
        replace(f, ratio=f.tokens_per_s / peers[f.batch])
        if f.available and peers.get(f.batch)
        else f
        for f in figures
    ]


def _say(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)
