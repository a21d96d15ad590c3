"""Flag helpers for `metrale generate`: environment names, ranges, choices.

Contract: every option of `generate` may also be set by an environment
variable named after it (``--prompt-lookup-max-drafts`` ->
``METRALE_PROMPT_LOOKUP_MAX_DRAFTS``); a flag on the command line wins. A value
out of range is a usage error (exit 2) whose message names the flag (Click
adds it) and the range, whether the value came from the command line or the
environment.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import typer

ENV_PREFIX = "METRALE_"

Number = TypeVar("Number", int, float)


def env(flag: str) -> str:
    """The environment variable that may set ``--flag``: ``METRALE_FLAG``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def range_text(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    """``[1, 64]``, ``(0, 1]`` or ``>= 0``: how the range reads in help and errors."""
    if hi is None:
        return f"> {_num(lo)}" if lo_open else f">= {_num(lo)}"
    left = "(" if lo_open else "["
    return f"{left}{_num(lo)}, {_num(hi)}]"


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and x == int(x) else str(x)


def in_range(
    lo: float, hi: float | None = None, lo_open: bool = False
) -> Callable[[Number | None], Number | None]:
    """A Typer callback rejecting values outside ``lo..hi`` (``None`` passes:
    it means the option was left at its "unset" default)."""

    def check(value: Number | None) -> Number | None:
        if value is None:
            return value
        too_low = value <= lo if lo_open else value < lo
        if too_low or (hi is not None and value > hi):
            raise typer.BadParameter(f"must be in {range_text(lo, hi, lo_open)}, got {value}")
        return value

    return check


class OutputOrder(enum.StrEnum):
    """``completed``: each line as its request finishes (lowest latency, and
    what survives an interrupt best); ``input``: in input order, holding back
    results that finish early."""

    completed = "completed"
    input = "input"


class Progress(enum.StrEnum):
    """What people see on standard error. ``auto``: the live view when standard
    error is a terminal (and standard output is not the same terminal), else
    ``plain``. ``plain``: a summary line every few seconds and a final table.
    ``off``: the final table only."""

    auto = "auto"
    live = "live"
    plain = "plain"
    off = "off"


def load_error(exc: BaseException, mtp_head: Path | None) -> typer.BadParameter:
    """A model that could not be loaded, as a usage error on the flag it
    belongs to: ``--mtp-head`` when a head the user named is the problem,
    else ``--model``."""
    from metrale.engine.runtime.mtp_head import MtpHeadError  # torch is loaded by then

    culprit = isinstance(exc, MtpHeadError) and mtp_head is not None
    return typer.BadParameter(
        f"cannot load it: {exc}", param_hint="--mtp-head" if culprit else "--model"
    )
