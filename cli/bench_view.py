"""How `metrale bench` shows its figures: Rich tables, failures, JSON, a chart.

Contract: nothing here measures; it renders ``metrale.engine.bench.suite`` and
``bench_sweep`` reports. Tables go to the console given (standard output);
the JSON document holds every figure of the tables plus each run's wall time,
the settings and the definitions of the figures; the chart (matplotlib, an
optional extra) shows each configuration's speedup over transformers greedy
at the same batch size, per workload.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from metrale.engine.bench.figures import Divergence, Figures, Mismatch, WorkloadReport
    from metrale.engine.bench.suite import BenchSettings
    from metrale.engine.bench.sweep import SweepReport
    from metrale.engine.load.loader import ModelInfo

DASH = "—"
DEFINITIONS = {
    "tokens_per_s": "generated tokens / median wall time of the timed runs",
    "ratio": "tokens/s over transformers greedy at the same batch size, same run",
    "mean_tokens_per_verify": "metrale: (accepted drafts + 1 bonus token) per sequence verify; "
    "plain decoding scores 1.0",
    "passes_per_token": "forward passes of the main model (prefill included; one batched pass "
    "counts once) per generated token",
    "copies": "prompt-lookup copies verified / tokens proposed / tokens accepted",
    "mtp_acceptance": "accepted / proposed MTP drafts at chain depth 1, 2, ...",
    "peak_mb": "CPU: weights + preallocated KV slots + resident-set high-water above the idle "
    "process during the run (sampled every few milliseconds); CUDA: "
    "torch.cuda.max_memory_allocated",
    "reference": "every output is compared with transformers greedy at batch 1",
    "divergence": "compare=divergence (bfloat16 on CUDA): per request, the first output token "
    "that differs from the reference (null: equal), and the mean common prefix in tokens next "
    "to the reference's mean length, of the run that keeps the least; never a failure",
}


def _num(value: float | None, fmt: str = ".2f") -> str:
    return DASH if value is None else format(value, fmt)


def _output_cell(f: Figures) -> str:
    if not f.available:
        return "n/a"
    if f.key == "hf-greedy-b1":
        return "reference"
    if f.divergence is not None:
        return _divergence_cell(f.divergence)
    if f.mismatch is None:
        return "[green]equal[/]"
    if not f.is_failure:
        return "[yellow]differs*[/]"
    return "[bold red]DIFFERS[/]"


def _divergence_cell(d: Divergence) -> str:
    """``equal``, or ``prefix 9.3/12.0``: the mean common prefix of the
    reference's mean length, in tokens."""
    if d.num_diverged == 0:
        return "[green]equal[/]"
    return f"[yellow]prefix {d.mean_common_prefix:.1f}/{d.mean_length:.1f}[/]"


COLUMNS = (
    ("configuration", "left"),
    ("batch", "right"),
    ("tok/s", "right"),
    ("×HF", "right"),
    ("tok/verify", "right"),
    ("passes/tok", "right"),
    ("copies c/p/a", "right"),
    ("MTP acc/depth", "right"),
    ("peak MB", "right"),
    ("output", "left"),
)


def _prompts(report: WorkloadReport) -> str:
    single = report.single_requests
    if single is None or single == report.num_requests:
        return f"{report.num_requests} prompts"
    return f"{single} prompts at batch 1, {report.num_requests} batched"


def workload_table(report: WorkloadReport, info: ModelInfo, repeats: int) -> Table:
    table = Table(
        title=f"{report.name}: {_prompts(report)}, greedy, {info.dtype} on "
        f"{info.device}, median of {repeats} run{'s' if repeats != 1 else ''}",
        title_justify="left",
    )
    for name, justify in COLUMNS:
        table.add_column(name, justify=justify, no_wrap=name == "configuration")  # type: ignore[arg-type]
    for f in report.figures:
        if not f.available:
            table.add_row(f.label, str(f.batch), *[DASH] * 7, _output_cell(f))
            continue
        copies = DASH if f.copies is None else f"{f.copies}/{f.copy_proposed}/{f.copy_accepted}"
        mtp = " ".join(f"{a:.2f}" for a in f.mtp_acceptance) or DASH
        table.add_row(
            f.label,
            str(f.batch),
            f"{f.tokens_per_s:.1f}",
            DASH if f.ratio is None else f"{f.ratio:.2f}x",
            _num(f.mean_tokens_per_verify),
            _num(f.passes_per_token, ".3f"),
            copies,
            mtp,
            _num(f.peak_mb, ".0f"),
            _output_cell(f),
        )
    return table


def print_reports(console: Console, reports: Sequence[WorkloadReport], info: ModelInfo) -> None:
    for report in reports:
        repeats = len(report.figures[0].wall_s) if report.figures else 0
        console.print(workload_table(report, info, repeats))
    notes = sorted({f.note for r in reports for f in r.figures if f.note})
    for note in notes:
        console.print(note, style="yellow")
    console.print(
        "×HF: tok/s over HF (transformers) greedy at the same batch size. tok/verify counts "
        "the bonus token (1.00 = no draft accepted). passes/tok: forward passes of the main "
        "model, prefill included, one batched pass counting once. peak MB: "
        + DEFINITIONS["peak_mb"]
        + ". "
        + _output_legend(reports),
        style="dim",
    )


def _output_legend(reports: Sequence[WorkloadReport]) -> str:
    if any(f.divergence is not None for r in reports for f in r.figures):
        return (
            "output: compared by first divergence with HF greedy at batch 1 (bfloat16 outputs "
            "may leave each other at near-ties); prefix = mean common prefix / mean reference "
            "length, in tokens."
        )
    return (
        "output: compared token for token with HF greedy at batch 1; differs* = HF's own "
        "left-padded batch, a note, not a failure."
    )


def sweep_table(report: SweepReport) -> Table:
    table = Table(
        title=f"{report.workload}: sweep {report.parameter}, batch {report.batch}; peer: metrale "
        f"with speculation off, {report.peer_tokens_per_s:.1f} tok/s",
        title_justify="left",
    )
    for name in ("value", "tok/s", "× off", "tok/verify", "copy acc.", "MTP acc.", "output", ""):
        table.add_column(name, justify="right")
    for p in report.points:
        table.add_row(
            str(p.value),
            f"{p.tokens_per_s:.1f}",
            f"{p.ratio:.2f}x",
            f"{p.mean_tokens_per_verify:.2f}",
            _num(p.copy_acceptance),
            _num(p.mtp_acceptance),
            _divergence_cell(p.divergence)
            if p.divergence is not None
            else "[green]equal[/]"
            if p.mismatch is None
            else f"[bold red]DIFFERS ({p.mismatch.request_id})[/]",
            "[bold]★ best[/]" if p.best else "",
        )
    return table


def print_sweeps(console: Console, sweeps: Sequence[SweepReport]) -> None:
    for report in sweeps:
        console.print(sweep_table(report))
    console.print("Acceptance: accepted / proposed tokens; best: highest tok/s.", style="dim")


def print_failures(
    console: Console,
    reports: Sequence[WorkloadReport],
    sweeps: Sequence[SweepReport],
    tokenizer: Any,
) -> bool:
    """Prints every output difference; returns True when one is a failure."""
    failed = False
    for report in reports:
        for f in report.figures:
            if f.divergence is not None and f.divergence.num_diverged:
                who = f"{f.label} (batch {f.batch}) on {report.name}"
                console.print(f"[yellow]note[/]: {who}: " + divergence_text(f.divergence))
            if f.mismatch is None:
                continue
            failed = failed or f.is_failure
            head = "FAILED" if f.is_failure else "note"
            who = f"{f.label} (batch {f.batch}) on {report.name}"
            console.print(
                f"[{'bold red' if f.is_failure else 'yellow'}]{head}[/]: {who}: "
                + _diff(f.mismatch, tokenizer)
            )
            if not f.is_failure:
                console.print(
                    "  (transformers' own left-padded batch; not a metrale failure)", style="dim"
                )
    for sweep in sweeps:
        for p in sweep.points:
            if p.divergence is not None and p.divergence.num_diverged:
                who = f"{sweep.parameter}={p.value} on {sweep.workload}"
                console.print(f"[yellow]note[/]: {who}: " + divergence_text(p.divergence))
        for p in sweep.failures:
            assert p.mismatch is not None
            failed = True
            who = f"{sweep.parameter}={p.value} on {sweep.workload}"
            console.print(f"[bold red]FAILED[/]: {who}: " + _diff(p.mismatch, tokenizer))
    return failed


def divergence_text(d: Divergence) -> str:
    """``first differing output token per request: a 7, b equal, c 12; mean
    common prefix 9.3 of 12.0 tokens``."""
    firsts = ", ".join(f"{rid} {'equal' if at is None else at}" for rid, at in d.first_diff)
    return (
        f"first differing output token per request: {firsts}; mean common prefix "
        f"{d.mean_common_prefix:.1f} of {d.mean_length:.1f} tokens"
    )


def _diff(m: Mismatch, tokenizer: Any) -> str:
    def text(ids: Sequence[int]) -> str:
        return repr(str(tokenizer.decode(list(ids[m.position : m.position + 12]))))

    return (
        f"request {m.request_id} differs from output token {m.position}: "
        f"expected {text(m.expected)}, got {text(m.got)}"
    )


def bench_document(
    info: ModelInfo,
    settings: BenchSettings,
    reports: Sequence[WorkloadReport],
    sweeps: Sequence[SweepReport],
) -> dict[str, Any]:
    return {
        "model": info.name,
        "dtype": info.dtype,
        "device": info.device,
        "mtp_layout": info.mtp_layout,
        "mtp_head": info.mtp_head,
        "settings": dataclasses.asdict(settings),
        "definitions": DEFINITIONS,
        "workloads": [dataclasses.asdict(r) for r in reports],
        "sweeps": [dataclasses.asdict(s) for s in sweeps],
        "failures": [
            {"workload": r.name, "configuration": f.key, "request_id": f.mismatch.request_id}
            for r in reports
            for f in r.failures
            if f.mismatch is not None
        ]
        + [
            {
                "workload": s.workload,
                "configuration": f"{s.parameter}={p.value}",
                "request_id": p.mismatch.request_id,
            }
            for s in sweeps
            for p in s.failures
            if p.mismatch is not None
        ],
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def check_plot_available() -> None:
    """Fails before measuring, not after an hour of it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise typer.BadParameter(
            "needs matplotlib, an optional extra: pip install 'metrale[plot]'",
            param_hint="--plot",
        ) from None


def write_plot(path: Path, reports: Sequence[WorkloadReport]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    # The peers are 1.0 by definition; configurations that never ran have no bar.
    keys = [
        f.key
        for f in reports[0].figures
        if not f.key.startswith("hf-greedy-")
        and any(g.available for r in reports for g in r.figures if g.key == f.key)
    ]
    labels = {f.key: f"{f.label} (b{f.batch})" for f in reports[0].figures}
    width = 0.8 / max(len(keys), 1)
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(reports)), 5))
    for i, key in enumerate(keys):
        ratios = [next((f.ratio or 0.0 for f in r.figures if f.key == key), 0.0) for r in reports]
        xs = [x + (i - (len(keys) - 1) / 2) * width for x in range(len(reports))]
        ax.bar(xs, ratios, width, label=labels[key])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(reports)), [r.name for r in reports])
    ax.set_ylabel("speedup over transformers greedy, same batch size")
    ax.legend(fontsize="x-small", ncols=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
