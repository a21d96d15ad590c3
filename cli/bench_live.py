"""Does the live view slow the engine? ``python -m metrale.cli.bench_live``.

Contract: runs the same engine-like loop with no view, with the Rich live view
(4 refreshes a second into a terminal console that writes to /dev/null) and
with the plain summaries, alternating the three so machine load hits them
alike, and prints each one's speed as a ratio to the no-view runs measured in
the same process, plus the cost of rendering one frame. The order of the
three rotates from round to round. A step is a few small
matrix products (which release the GIL, as the engine's forward does) and
Python bookkeeping (which holds it, as the scheduler does), publishing an
``EngineStats`` snapshot each step as the engine does.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console

from metrale.cli.live import RunCounters, live_view, render
from metrale.engine.stats import EngineStats
from metrale.lookup import CopyCounts, LookupStats

STEPS = 1500
ROUNDS = 6


class FakeLoop:
    def __init__(self) -> None:
        self.weights = torch.randn(384, 384)  # [hidden, hidden]
        self.snapshot = EngineStats()

    def stats(self) -> EngineStats:
        return self.snapshot

    def step(self, i: int) -> None:
        x = torch.randn(16, 384)  # [rows, hidden]
        for _ in range(6):
            x = torch.tanh(x @ self.weights)
        book = {j: j * i for j in range(300)}  # scheduler-like Python work
        self.snapshot = EngineStats(
            requests_done=i // 10,
            generated_tokens=i * 16 + len(book) % 7,
            verifies=i,
            seq_verifies=i * 16,
            verify_tokens=i * 30,
            wall_s=float(i),
            mtp_proposed_by_position=(i, i, i),
            mtp_accepted_by_position=(i // 2, i // 3, i // 4),
            prompt_lookup=LookupStats(total=CopyCounts(i // 3, i, i // 2)),
        )


def timed_run(mode: str | None, sink: Console) -> float:
    """Steps per second of the loop under the given view (None: no view)."""
    loop = FakeLoop()
    counters = RunCounters(total=STEPS // 10)
    started = time.perf_counter()
    if mode is None:
        for i in range(STEPS):
            loop.step(i)
    else:
        with live_view(sink, loop.stats, counters, mode, interval_s=0.25):
            for i in range(STEPS):
                loop.step(i)
                counters.written = i // 10
    return STEPS / (time.perf_counter() - started)


def frame_ms(console: Console, frames: int = 50) -> float:
    counters = RunCounters(total=100, written=40, failed=1)
    stats = FakeLoop()
    stats.step(500)
    started = time.perf_counter()
    for _ in range(frames):
        console.print(render(stats.stats(), counters))
    return 1000 * (time.perf_counter() - started) / frames


def main() -> None:
    torch.set_num_threads(1)
    with open("/dev/null", "w") as devnull:
        terminal = Console(file=devnull, force_terminal=True, width=120)
        plain = Console(file=io.StringIO(), width=120)
        speeds: dict[str, list[float]] = {"none": [], "live": [], "plain": []}
        runs: list[tuple[str, Callable[[], float]]] = [
            ("none", lambda: timed_run(None, terminal)),
            ("live", lambda: timed_run("live", terminal)),
            ("plain", lambda: timed_run("plain", plain)),
        ]
        timed_run(None, terminal)  # warm-up
        for round_ in range(ROUNDS):
            # Rotate the order so no view always runs first (or last) in a round.
            for name, fn in runs[round_ % 3 :] + runs[: round_ % 3]:
                speeds[name].append(fn())
        base = statistics.median(speeds["none"])
        print(f"engine-like loop, {STEPS} steps x {ROUNDS} rounds, medians:")
        for name, values in speeds.items():
            med = statistics.median(values)
            print(f"  view {name:5s}: {med:8.1f} steps/s  ratio to no view {med / base:.3f}")
        ms = frame_ms(terminal)
        print(f"one live frame renders in {ms:.2f} ms ({4 * ms / 10:.2f}% of one core at 4/s)")


if __name__ == "__main__":
    main()
