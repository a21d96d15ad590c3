"""The benchmarks' one timing loop (``metrale.engine.bench.timing``)."""

from __future__ import annotations

from collections.abc import Callable

from metrale.engine.bench.timing import stopwatch, take_turns


def recorder(calls: list[str], name: str) -> Callable[[], str]:
    def run() -> str:
        calls.append(name)
        return f"{name}{sum(c == name for c in calls)}"

    return run


def test_runs_warm_up_once_then_take_turns_in_rotated_order() -> None:
    calls: list[str] = []
    runs = [recorder(calls, n) for n in "abc"]
    results = take_turns(runs, 3)
    assert "".join(calls) == "abc" + "abc" + "bca" + "cab"
    # Warm-up results are dropped: each run's first kept result is its second call.
    assert results == [["a2", "a3", "a4"], ["b2", "b3", "b4"], ["c2", "c3", "c4"]]


def test_given_warmups_replace_the_default_and_before_sees_every_timed_turn() -> None:
    calls: list[str] = []
    turns: list[tuple[int, int]] = []
    runs = [recorder(calls, "a"), recorder(calls, "b")]
    warm = recorder(calls, "w")
    take_turns(runs, 2, warmups=[warm, warm], before=lambda rep, i: turns.append((rep, i)))
    assert "".join(calls) == "ww" + "ab" + "ba"
    assert turns == [(0, 0), (0, 1), (1, 1), (1, 0)]


def test_stopwatch_times_the_call_and_runs_after_outside_it() -> None:
    order: list[str] = []
    run = stopwatch(lambda: order.append("call"), lambda: order.append("after"))
    (seconds,) = take_turns([run], 1, warmups=[run])
    assert order == ["call", "after", "call", "after"]
    assert len(seconds) == 1 and seconds[0] >= 0.0
