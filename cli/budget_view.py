"""The draft budget's figures (``--draft-policy auto``), for the live view,
the final table and ``--stats-json``.

Figures: "verified" is how often a sequence verified that many drafts of a
source in a step (``n×count``); "estimate" the run's acceptance estimate of
each chain depth or copy position given every draft before it accepted;
"verify ms" the cost model by verify rows; "step ms" the mean step time the
plans predicted against the one measured.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from metrale.engine.stats import BudgetStats


def _histogram(counts: dict[int, int]) -> str:
    return " ".join(f"{n}×{c}" for n, c in sorted(counts.items())) or "-"


def _estimates(rates: tuple[float, ...]) -> str:
    return " ".join(f"{100 * r:.0f}%" for r in rates) or "-"


def _costs(ms: dict[int, float]) -> str:
    return " ".join(f"{rows}:{value:.1f}" for rows, value in sorted(ms.items())) or "-"


def budget_table(budget: BudgetStats) -> Table:
    table = Table(title="draft budget", title_justify="left", expand=False)
    table.add_column("", justify="left")
    table.add_column("", justify="left")
    table.add_row("MTP verified", _histogram(budget.chosen.get("mtp", {})))
    table.add_row("copies verified", _histogram(budget.chosen.get("copy", {})))
    table.add_row("no drafts", str(budget.no_drafts))
    table.add_row("MTP estimate by depth", _estimates(budget.mtp_acceptance))
    table.add_row("copy estimate by position", _estimates(budget.copy_acceptance))
    table.add_row("verify ms by rows", _costs(budget.verify_ms))
    table.add_row(
        "step ms, predicted / measured", f"{budget.predicted_ms:.1f} / {budget.measured_ms:.1f}"
    )
    return table


def budget_figures(budget: BudgetStats | None) -> dict[str, Any] | None:
    """The ``draft_budget`` part of ``--stats-json`` (None under the fixed policy)."""
    if budget is None:
        return None
    return {
        "steps": budget.steps,
        "verified": {
            source: {str(n): c for n, c in sorted(counts.items())}
            for source, counts in budget.chosen.items()
        },
        "no_drafts": budget.no_drafts,
        "mtp_acceptance_by_depth": list(budget.mtp_acceptance),
        "copy_acceptance_by_position": list(budget.copy_acceptance),
        "verify_ms_by_rows": {str(k): v for k, v in sorted(budget.verify_ms.items())},
        "head_ms_by_seqs": {str(k): v for k, v in sorted(budget.head_ms.items())},
        "other_ms": budget.other_ms,
        "predicted_step_ms": budget.predicted_ms,
        "measured_step_ms": budget.measured_ms,
    }
