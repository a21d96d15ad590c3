"""How many rounds a benchmark row runs (``make bench-budget``, ``make
bench-cli``): at least ``least``, then more until every configuration of the
row ran ``min_seconds`` in all, at most ``most``. A row of runs of a second
or two needs many rounds for a median that a row of long runs gets from
three."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rounds:
    """The rounds rule (module doc)."""

    least: int
    most: int
    min_seconds: float

    def more(self, done: int, seconds: Iterable[float]) -> bool:
        """Whether a row that ran ``done`` rounds, each configuration
        ``seconds`` in all, takes another."""
        if done < self.least:
            return True
        return done < self.most and min(seconds) < self.min_seconds


def add_round_options(parser: argparse.ArgumentParser, min_seconds: float) -> None:
    """``--min-seconds`` and ``--max-rounds`` (``Rounds.min_seconds``, ``Rounds.most``)."""
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=min_seconds,
        help="more rounds until each configuration of a row ran this long in all",
    )
    parser.add_argument("--max-rounds", type=int, default=12, help="the most rounds of a row")
