"""`metrale bench --sweep NAME=V1,V2,...`: one speculation setting, several values.

Contract: ``parse_sweep`` reads ``prompt-lookup-max-drafts=1,2,4,8,16`` (also
``prompt-lookup-ngram``, ``prompt-lookup-min-match``, ``mtp-drafts``; a
leading ``--`` is allowed) and raises ``ValueError`` with a message naming the
bad part, for an unknown name, a value that is not an integer, a repeated
value, or a value the setting's own validation refuses. ``run_sweep`` runs
metrale with MTP (when the model has MTP layers) and prompt lookup at the
given batch size once per value, plus metrale with speculation off as the
peer every ratio is taken against; runs take turns as in ``run_bench``, the
median counts, and each value's greedy output is compared with the peer's
in ``settings.compare``'s mode (exact: a difference is a failure, reported
with its first differing request; divergence: reported, never failed).
``mtp-drafts=N`` drafts N tokens at every batch size.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from metrale.engine.bench.figures import Divergence, Mismatch
from metrale.engine.bench.memory import frozen_heap
from metrale.engine.bench.runners import MetraleRunner, Runner, Subjects
from metrale.engine.bench.suite import (
    BenchSettings,
    Configuration,
    Progress,
    Speculation,
    TimedRuns,
    Workload,
    compare_outputs,
    engine_config,
    timed_runs,
)
from metrale.engine.config import MtpLadder

SWEEPABLE = (
    "prompt-lookup-max-drafts",
    "prompt-lookup-ngram",
    "prompt-lookup-min-match",
    "mtp-drafts",
)
PEER = "off"


@dataclass(frozen=True)
class SweepSpec:
    parameter: str
    values: tuple[int, ...]


@dataclass(frozen=True)
class SweepPoint:
    """One value on one workload. ``copy_acceptance`` = accepted / proposed
    copy tokens; ``mtp_acceptance`` = accepted / proposed MTP drafts, all depths
    together; ``mean_tokens_per_verify`` counts the bonus token."""

    value: int
    tokens_per_s: float
    ratio: float  # to metrale with speculation off, same run
    mean_tokens_per_verify: float
    copy_acceptance: float | None
    mtp_acceptance: float | None
    best: bool = False
    mismatch: Mismatch | None = None  # exact mode only
    divergence: Divergence | None = None  # divergence mode only


@dataclass(frozen=True)
class SweepReport:
    workload: str
    parameter: str
    batch: int
    peer_tokens_per_s: float
    points: tuple[SweepPoint, ...]

    @property
    def failures(self) -> tuple[SweepPoint, ...]:
        return tuple(p for p in self.points if p.mismatch is not None)


def parse_sweep(text: str) -> SweepSpec:
    name, sep, raw = text.partition("=")
    name = name.strip().removeprefix("--")
    if not sep or name not in SWEEPABLE:
        raise ValueError(
            f"--sweep {text!r}: expected NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}"
        )
    parts = [p.strip() for p in raw.split(",")]
    if not raw.strip() or any(not p for p in parts):
        raise ValueError(f"--sweep {name}: give comma-separated integers, e.g. {name}=1,2,4,8")
    values: list[int] = []
    for part in parts:
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"--sweep {name}: {part!r} is not an integer") from None
        if value in values:
            raise ValueError(f"--sweep {name}: {value} is given twice")
        values.append(value)
    spec = SweepSpec(name, tuple(values))
    base = BenchSettings()
    for value in spec.values:
        try:
            apply_value(base, spec.parameter, value)
        except ValueError as exc:
            raise ValueError(f"--sweep {name}={value}: {exc}") from None
    return spec


def apply_value(settings: BenchSettings, parameter: str, value: int) -> BenchSettings:
    """``settings`` with one speculation setting changed (validated by its config)."""
    lookup = settings.prompt_lookup
    if parameter == "prompt-lookup-max-drafts":
        return replace(settings, prompt_lookup=replace(lookup, max_drafts=value))
    if parameter == "prompt-lookup-ngram":
        return replace(settings, prompt_lookup=replace(lookup, ngram=value))
    if parameter == "prompt-lookup-min-match":
        return replace(settings, prompt_lookup=replace(lookup, min_match=value))
    if parameter == "mtp-drafts":
        if value < 0:
            raise ValueError("MTP draft counts must be 0 or more")
        return replace(settings, mtp_ladder=MtpLadder(steps=(), beyond=value))
    raise ValueError(f"cannot sweep {parameter!r}; choose one of {', '.join(SWEEPABLE)}")


def run_sweep(
    workloads: Sequence[Workload],
    spec: SweepSpec,
    settings: BenchSettings,
    subjects: Subjects,
    batch: int = 1,
    progress: Progress | None = None,
) -> tuple[SweepReport, ...]:
    if spec.parameter == "mtp-drafts" and not subjects.has_mtp:
        raise ValueError("--sweep mtp-drafts: the model has no MTP layers, so it has no effect")
    loaded = subjects.single if batch == 1 else subjects.batched
    mode: Speculation = "both" if subjects.has_mtp else "lookup"
    configs = [Configuration(PEER, "speculation off", "metrale", batch, "off")]
    off = engine_config(settings, batch, "off", settings.prompt_lookup)
    runners: dict[str, Runner] = {PEER: MetraleRunner(loaded, off)}
    for value in spec.values:
        varied = apply_value(settings, spec.parameter, value)
        key = str(value)
        configs.append(Configuration(key, f"{spec.parameter}={value}", "metrale", batch, mode))
        cfg = engine_config(varied, batch, mode, varied.prompt_lookup)
        runners[key] = MetraleRunner(loaded, cfg)
    reports = []
    with frozen_heap():
        for workload in workloads:
            runs = timed_runs(workload, configs, runners, settings, subjects, progress)
            reports.append(_report(workload, spec, batch, runs, settings))
    return tuple(reports)


def _report(
    workload: Workload, spec: SweepSpec, batch: int, runs: TimedRuns, settings: BenchSettings
) -> SweepReport:
    order = [r.request_id for r in workload.requests_for(batch, settings.single_prompts)]
    peer_runs = [outcome for outcome, _ in runs[PEER]]
    reference = peer_runs[0].outputs
    peer_tps = peer_runs[0].generated_tokens / statistics.median(o.wall_s for o in peer_runs)
    points = []
    for value in spec.values:
        outcomes = [outcome for outcome, _ in runs[str(value)]]
        stats = outcomes[0].stats
        assert stats is not None
        tps = outcomes[0].generated_tokens / statistics.median(o.wall_s for o in outcomes)
        outputs = [outcome.outputs for outcome in outcomes]
        mismatch, diverged = compare_outputs(reference, outputs, order, settings)
        points.append(
            SweepPoint(
                value=value,
                tokens_per_s=tps,
                ratio=tps / peer_tps if peer_tps else 0.0,
                mean_tokens_per_verify=stats.mean_tokens_per_verify,
                copy_acceptance=_rate(
                    stats.prompt_lookup.total.accepted, stats.prompt_lookup.total.proposed
                ),
                mtp_acceptance=_rate(stats.mtp_accepted, stats.mtp_proposed),
                mismatch=mismatch,
                divergence=diverged,
            )
        )
    best = max(points, key=lambda p: p.tokens_per_s)
    marked = tuple(replace(p, best=p is best) for p in points)
    return SweepReport(workload.name, spec.parameter, batch, peer_tps, marked)


def _rate(accepted: int, proposed: int) -> float | None:
    return accepted / proposed if proposed else None
