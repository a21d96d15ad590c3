"""What people see while `metrale generate` runs, all on standard error.

Contract: the view only reads. It asks ``stats()`` (the engine's snapshot,
safe from another thread) and the command's ``RunCounters`` a few times a
second from its own thread, and never blocks the thread that drives the
engine. On a terminal it is a Rich live region (progress bar, speculation
table); elsewhere (a pipeline, CI) a one-line summary every few seconds. Both
end with the final table.

Figures: ``mean tokens/verify`` counts the bonus token, so plain decoding
scores 1.0. "own history" copies come from the sequence's own prompt and
output, "shared cache" ones from earlier requests of the same scope; the
engine counts the latter inside its totals, so own = total - shared here.
"grammar: forced" are drafts that were a grammar's forced continuation (the
only token its mask allowed): a source of their own, always accepted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from metrale.cli.budget_view import budget_table
from metrale.engine.stats import EngineStats

StatsSource = Callable[[], EngineStats]
REFRESH_PER_S = 4.0
PLAIN_INTERVAL_S = 5.0


@dataclass
class RunCounters:
    """The command's own progress: lines answered this run (``written``),
    of which ``failed``; lines ``skipped`` by ``--resume``; ``total`` input
    lines when known up front (files), else None (standard input)."""

    total: int | None = None
    written: int = 0
    failed: int = 0
    skipped: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> int:
        return self.written + self.skipped

    def eta_s(self) -> float | None:
        """Seconds left at this run's pace so far, or None when unknown."""
        if self.total is None or self.written == 0:
            return None
        per_line = (time.monotonic() - self.started) / self.written
        return max(self.total - self.done, 0) * per_line


def _rate(accepted: int, proposed: int) -> str:
    return f"{100.0 * accepted / proposed:.1f}%" if proposed else "-"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def headline(stats: EngineStats, counters: RunCounters) -> str:
    """``done/total requests, failed, tokens, tok/s, ETA h:mm:ss`` (no ETA on stdin)."""
    total = "?" if counters.total is None else str(counters.total)
    parts = [f"{counters.done}/{total} requests", f"{counters.failed} failed"]
    parts.append(f"{stats.generated_tokens} tokens")
    parts.append(f"{stats.tokens_per_s:.1f} tok/s")
    if counters.total is not None:
        parts.append(f"ETA {_clock(counters.eta_s())}")
    return ", ".join(parts)


def summary_line(stats: EngineStats, counters: RunCounters) -> str:
    """The non-terminal progress line: headline plus acceptance at a glance."""
    total = stats.prompt_lookup.total
    copies = _rate(total.accepted, total.proposed)
    mtp = _rate(stats.mtp_accepted, stats.mtp_proposed)
    return (
        f"metrale: {headline(stats, counters)}, {stats.mean_tokens_per_verify:.2f} tokens/verify, "
        f"copies {copies} accepted, MTP {mtp} accepted, "
        f"prefix cache {_hits(stats)}"
    )


def _hits(stats: EngineStats) -> str:
    return f"{100.0 * stats.prefix_hit_rate:.1f}% hits" if stats.prefix_cache else "off"


def speculation_table(stats: EngineStats) -> Table:
    """Prompt-lookup copies (own, shared, all), MTP drafts by position and,
    once a request with a grammar ran, its forced drafts."""
    table = Table(title="speculation", title_justify="left", expand=False)
    for name in ("source", "copies", "proposed", "accepted", "acceptance"):
        table.add_column(name, justify="left" if name == "source" else "right")
    lookup = stats.prompt_lookup
    for label, counts in (
        ("prompt lookup: own history", lookup.own),
        ("prompt lookup: shared cache", lookup.shared),
        ("prompt lookup: all", lookup.total),
    ):
        c, p, a = counts.copies, counts.proposed, counts.accepted
        table.add_row(label, str(c), str(p), str(a), _rate(a, p))
    by_pos = zip(stats.mtp_proposed_by_position, stats.mtp_accepted_by_position, strict=False)
    for i, (p, a) in enumerate(by_pos):
        table.add_row(f"MTP draft {i + 1}", "", str(p), str(a), _rate(a, p))
    if not stats.mtp_proposed_by_position:
        table.add_row("MTP drafts", "", "0", "0", "-")
    if stats.grammar_requests or stats.forced_proposed:
        p, a = stats.forced_proposed, stats.forced_accepted
        table.add_row("grammar: forced", "", str(p), str(a), _rate(a, p))
    return table


def verify_line(stats: EngineStats) -> str:
    return (
        f"{stats.verifies} verifies, {stats.mean_tokens_per_verify:.2f} mean tokens/verify "
        "(counts the bonus token: 1.00 = no draft accepted)"
    )


def prefix_line(stats: EngineStats) -> str:
    """What the prefix cache saved: requests that reused a prefix, and the
    prompt tokens they did not prefill."""
    if not stats.prefix_cache:
        return "prefix cache: off"
    return (
        f"prefix cache: {stats.prefix_hits}/{stats.admitted} requests hit "
        f"({100.0 * stats.prefix_hit_rate:.1f}%), {stats.cached_tokens} of "
        f"{stats.prompt_tokens} prompt tokens not prefilled"
    )


def final_view(stats: EngineStats) -> RenderableType:
    """The table and the mean acceptance length under it, what the prefix
    cache saved, then what the draft budget chose, once it has planned a step."""
    parts: list[RenderableType] = [
        speculation_table(stats),
        Text(verify_line(stats)),
        Text(prefix_line(stats)),
    ]
    if stats.budget is not None and stats.budget.steps:
        parts.append(budget_table(stats.budget))
    return Group(*parts)


def render(stats: EngineStats, counters: RunCounters) -> RenderableType:
    """The live region: a progress bar with its headline, then the table."""
    bar = ProgressBar(total=counters.total, completed=counters.done, width=40)
    head = Table.grid(padding=(0, 1))
    head.add_row(bar, Text(headline(stats, counters)))
    return Group(head, final_view(stats))


@contextmanager
def live_view(
    console: Console,
    stats: StatsSource,
    counters: RunCounters,
    mode: str,
    interval_s: float = PLAIN_INTERVAL_S,
) -> Iterator[None]:
    """Shows progress while the body runs; prints the final table on exit
    (also when the body raises, so Ctrl-C shows what finished).

    ``mode``: ``"live"`` (Rich live region), ``"plain"`` (a summary line every
    ``interval_s``), ``"off"`` (final table only).
    """
    if mode == "live":
        live = Live(
            get_renderable=lambda: render(stats(), counters),
            console=console,
            refresh_per_second=REFRESH_PER_S,
            redirect_stdout=False,  # standard output carries JSONL only
            redirect_stderr=False,
        )
        with live:
            yield
        return
    stop = threading.Event()
    ticker = None
    if mode == "plain":
        ticker = threading.Thread(
            target=_tick,
            args=(console, stats, counters, stop, interval_s),
            daemon=True,
            name="metrale-plain",
        )
        ticker.start()
    try:
        yield
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        final = stats()
        console.print(summary_line(final, counters), soft_wrap=True)
        console.print(final_view(final))


def _tick(
    console: Console,
    stats: StatsSource,
    counters: RunCounters,
    stop: threading.Event,
    interval_s: float,
) -> None:
    while not stop.wait(interval_s):
        console.print(summary_line(stats(), counters), soft_wrap=True)
