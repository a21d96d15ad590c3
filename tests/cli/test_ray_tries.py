"""A window run again after its worker died: isolated step by step, and a
line that keeps killing its worker is given up after its tries."""

from __future__ import annotations

import threading
import time

import pytest

from metrale.cli.ray_tries import Gate, Mode, TryLedger, mode_of


def test_a_window_runs_shared_then_alone_then_line_by_line() -> None:
    assert [mode_of(n) for n in (1, 2, 3, 4)] == [
        Mode.SHARED,
        Mode.WINDOW_ALONE,
        Mode.LINES_ALONE,
        Mode.LINES_ALONE,
    ]


def lose(ledger: TryLedger, window: list[str], killer: str) -> list[str]:
    """Runs ``window`` as its worker would until it finishes, the worker
    dying whenever ``killer`` runs; returns the lines given up."""
    while True:
        if ledger.start_window(window[0]) is not Mode.LINES_ALONE:
            given_up = ledger.start_lines(window)
            if killer in window and killer not in given_up:
                continue  # the worker died: the window starts again
            ledger.finish(window, window[0])
            return given_up
        given_up = []
        for line in window:
            if not ledger.start_line(line):
                given_up.append(line)
            elif line == killer:
                break  # died alone: the window starts again
            else:
                ledger.finish([line])
        else:
            ledger.finish(window, window[0])
            return given_up


@pytest.mark.parametrize(
    ("max_retries", "given_up"), [(0, ["a", "p"]), (1, ["a", "p"]), (3, ["p"])]
)
def test_only_the_line_that_kills_its_worker_is_given_up_when_retries_allow(
    max_retries: int, given_up: list[str]
) -> None:
    # The module doc's example: with 1 retry the lines' tries are spent
    # before they run alone; with 3, only p's are.
    ledger = TryLedger(max_retries)
    assert lose(ledger, ["a", "p"], killer="p") == given_up
    assert ledger.counts()[1] == len(given_up)
    assert ledger.tries == {} and ledger.window_starts == {}  # nothing kept for an endless job


def test_a_line_is_tried_one_plus_max_retries_times() -> None:
    ledger = TryLedger(max_retries=3)
    starts = 0
    while True:
        if ledger.start_window("p") is Mode.LINES_ALONE:
            if not ledger.start_line("p"):
                break
        elif ledger.start_lines(["p"]):
            break
        starts += 1  # and the worker dies
    assert starts == 4


def test_a_window_waiting_for_its_turn_when_its_worker_dies_is_not_charged() -> None:
    ledger = TryLedger(max_retries=0)
    assert ledger.start_window("w") is Mode.SHARED
    # Its worker died before the window ran: nothing of it was tried.
    assert ledger.start_window("w") is Mode.WINDOW_ALONE
    assert ledger.start_lines(["a", "b"]) == []


def test_a_window_lost_with_its_worker_runs_again_whole() -> None:
    ledger = TryLedger(max_retries=0)
    ledger.start_window("w")
    ledger.start_lines(["a", "b"])
    # It ran when its worker died, and no retries are allowed: given up.
    ledger.start_window("w")
    assert ledger.start_lines(["a", "b"]) == ["a", "b"]
    ledger = TryLedger(max_retries=1)
    ledger.start_window("w")
    ledger.start_lines(["a", "b"])
    assert ledger.start_window("w") is Mode.WINDOW_ALONE
    assert ledger.start_lines(["a", "b"]) == []
    ledger.finish(["a", "b"], "w")
    assert ledger.start_window("w") is Mode.SHARED  # forgotten once whole


def test_alone_waits_for_shared_windows_and_keeps_new_ones_out() -> None:
    gate, order = Gate(), []
    inside = threading.Event()

    def shared(name: str, hold_s: float) -> None:
        with gate.shared():
            inside.set()
            order.append(f"{name} in")
            time.sleep(hold_s)
            order.append(f"{name} out")

    def alone() -> None:
        with gate.alone():
            order.append("alone")

    first = threading.Thread(target=shared, args=("first", 0.2))
    first.start()
    inside.wait()
    lone = threading.Thread(target=alone)
    lone.start()
    time.sleep(0.05)  # the alone one now waits
    late = threading.Thread(target=shared, args=("late", 0.0))
    late.start()
    for t in (first, lone, late):
        t.join(timeout=5)
    assert order == ["first in", "first out", "alone", "late in", "late out"]
