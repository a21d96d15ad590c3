"""The draft budget's stored acceptance estimates, as the budget benchmarks
handle them (``make bench-budget``, ``make bench-cli``).

An auto run starts from the estimates the last run on its set-up ended with
(``spec/estimates.py``), stored in ``$METRALE_HOME/calibration``. A bench
that let them be would have every auto run after the first start from what
the one before it learnt on the very prompts it times. So a bench sets the
caller's estimates aside (``estimates_set_aside``), has auto learn once on
lines of a set it does not time (``seed_set``), and before every timed auto
run puts the estimates back to a snapshot of what was learnt on other
material, as a user's next job would start: bench-budget's is taken once,
after that learning; bench-cli's as each row begins, its set-up's earlier
rows being other workloads. The caller's estimates come back when the
bench ends, however it ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from metrale.engine.load.home import metrale_home
from metrale.engine.spec.cost import ACCEPTANCE_SUFFIX

REPO = Path(__file__).resolve().parents[2]
# What the estimates are first learnt on: the first of these sets (in
# bench_prompts/) that the bench does not time, its first SEED_LINES lines.
SEEDS = ("math_steps", "table_tasks", "code_refactors")
SEED_LINES = 8


def seed_set(timed: Iterable[str]) -> Path:
    """The set the estimates are learnt on, given the stems of the sets timed."""
    names = set(timed)
    return next(REPO / "bench_prompts" / f"{s}.jsonl" for s in SEEDS if s not in names)


def stored_estimates() -> dict[Path, bytes]:
    """The stored acceptance estimates, file by file (``spec/cost.py``)."""
    folder = metrale_home() / "calibration"
    return {path: path.read_bytes() for path in folder.glob(f"*{ACCEPTANCE_SUFFIX}")}


def restore_estimates(saved: dict[Path, bytes]) -> None:
    """The stored estimates back as ``saved`` holds them: no file more, none less."""
    for path in stored_estimates().keys() - saved.keys():
        path.unlink(missing_ok=True)
    for path, data in saved.items():
        path.write_bytes(data)


@contextmanager
def estimates_set_aside() -> Iterator[None]:
    """No stored estimates inside; the caller's back on the way out."""
    users = stored_estimates()
    restore_estimates({})
    try:
        yield
    finally:
        restore_estimates(users)
