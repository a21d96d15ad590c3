"""The live view and the non-terminal summaries (cli/live.py), recorded."""

from __future__ import annotations

import dataclasses
import io
import threading

import pytest
from rich.console import Console

from metrale.cli.live import (
    RunCounters,
    final_view,
    live_view,
    render,
    summary_line,
)
from metrale.engine.stats import EngineStats
from metrale.lookup import CopyCounts, LookupStats

STATS = EngineStats(
    requests_done=3,
    generated_tokens=400,
    verifies=100,
    seq_verifies=160,
    verify_tokens=400,
    wall_s=10.0,
    mtp_proposed_by_position=(100, 80, 60),
    mtp_accepted_by_position=(50, 20, 6),
    prompt_lookup=LookupStats(
        total=CopyCounts(copies=30, proposed=200, accepted=150),
        shared=CopyCounts(copies=10, proposed=40, accepted=10),
    ),
)


def recorded(renderable: object, terminal: bool = False) -> str:
    console = Console(record=True, width=120, file=io.StringIO(), force_terminal=terminal)
    console.print(renderable)
    return console.export_text()


def test_live_render_shows_progress_and_every_counter() -> None:
    counters = RunCounters(total=10, written=3, failed=1)
    text = recorded(render(STATS, counters), terminal=True)
    assert "3/10 requests, 1 failed, 400 tokens, 40.0 tok/s, ETA" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    # own history = all - shared: 20 copies, 160 proposed, 140 accepted.
    cells = {k: [c.strip() for c in v.split("│")[2:6]] for k, v in rows.items()}
    assert cells["prompt lookup: own history"] == ["20", "160", "140", "87.5%"]
    assert cells["prompt lookup: shared cache"] == ["10", "40", "10", "25.0%"]
    assert cells["prompt lookup: all"] == ["30", "200", "150", "75.0%"]
    assert cells["MTP draft 1"] == ["", "100", "50", "50.0%"]
    assert cells["MTP draft 3"] == ["", "60", "6", "10.0%"]
    assert "100 verifies, 2.50 mean tokens/verify (counts the bonus token" in text


def test_unknown_total_shows_done_count_without_eta() -> None:
    line = summary_line(STATS, RunCounters(total=None, written=5, skipped=2))
    assert line.startswith("metrale: 7/? requests, 0 failed") and "ETA" not in line
    assert "2.50 tokens/verify, copies 75.0% accepted, MTP 31.7% accepted" in line


def test_eta_is_what_is_left_at_the_pace_so_far() -> None:
    counters = RunCounters(total=10, written=2, skipped=2, started=0.0)
    eta = counters.eta_s()
    assert eta is not None and eta > 0
    # 6 lines left, 2 written in the elapsed time: 3x the elapsed time.
    assert RunCounters(total=10, written=0).eta_s() is None


def test_empty_run_renders_without_dividing_by_zero() -> None:
    text = recorded(final_view(EngineStats()))
    assert "MTP drafts" in text and "0.00 mean tokens/verify" in text


@pytest.mark.parametrize("mode", ["plain", "off"])
def test_non_terminal_modes_end_with_the_final_table(mode: str) -> None:
    console = Console(record=True, width=120, file=io.StringIO())
    counters = RunCounters(total=4)
    ticked = threading.Event()

    def stats() -> EngineStats:
        ticked.set()
        return STATS

    with live_view(console, stats, counters, mode, interval_s=0.01):
        if mode == "plain":
            assert ticked.wait(5.0)  # a summary line came without the body's help
        counters.written = 4
    text = console.export_text()
    last = text.rstrip().splitlines()[-2:]
    assert last[0].endswith("(counts the bonus token: 1.00 = no draft accepted)")
    assert last[1] == "prefix cache: off"  # STATS is of an engine without one
    assert "metrale: 4/4 requests" in text and "prompt lookup: shared cache" in text


def test_live_mode_reads_stats_off_the_engine_thread_and_survives_an_interrupt() -> None:
    console = Console(record=True, width=120, file=io.StringIO(), force_terminal=True)
    off_thread = threading.Event()

    def stats() -> EngineStats:
        if threading.current_thread() is not threading.main_thread():
            off_thread.set()
        return STATS

    counters = RunCounters(total=2)
    with pytest.raises(KeyboardInterrupt), live_view(console, stats, counters, "live"):
        counters.written = 1
        # The body (the engine's thread) never calls stats(): the view does.
        assert off_thread.wait(5.0)
        raise KeyboardInterrupt
    text = console.export_text()
    assert "1/2 requests" in text and "MTP draft 2" in text  # the last frame stays


def test_forced_drafts_are_a_source_of_their_own_once_a_grammar_ran() -> None:
    assert "grammar: forced" not in recorded(final_view(STATS))
    constrained = dataclasses.replace(
        STATS, grammar_requests=2, forced_proposed=40, forced_accepted=40
    )
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in recorded(final_view(constrained)).splitlines()
        if line.count("│") > 2
    }
    assert rows["grammar: forced"] == ["", "40", "40", "100.0%"]
