"""SIGINT and SIGTERM stop a run cleanly on the first signal, at once on the second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from metrale.cli.stop import Stopped, held, stop_signals, stop_status


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_first_signal_raises_stopped_with_its_exit_status(signum: int, status: int) -> None:
    with pytest.raises(Stopped) as caught, stop_signals():
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises at once
    assert caught.value.signum == signum and stop_status(caught.value) == status
    assert isinstance(caught.value, KeyboardInterrupt)  # unwinds as Ctrl-C does


def test_a_plain_keyboard_interrupt_is_sigints() -> None:
    assert stop_status(KeyboardInterrupt()) == 130


def test_leaving_the_block_puts_the_handlers_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with stop_signals():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_stop_during_a_write_on_another_thread_acts_when_the_write_ends() -> None:
    events: list[str] = []
    seen_when_stopped: list[str] | None = None

    def write() -> None:
        with held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)
            events.append("written")

    writer = threading.Thread(target=write)
    with stop_signals():
        writer.start()
        try:
            time.sleep(10)
        except Stopped:
            seen_when_stopped = list(events)
    writer.join()
    assert seen_when_stopped == ["written"]  # raised in the main thread, after the write


CHILD = textwrap.dedent(
    """
    import sys, time
    from metrale.cli.stop import Stopped, stop_signals
    with stop_signals():
        try:
            print("running", flush=True)
            time.sleep(60)
        except Stopped:
            print("cleaning up", flush=True)  # a slow cleanup: the second signal lands here
            time.sleep(60)
    sys.exit(3)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_during_cleanup_kills_the_process_at_once(signum: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        # As a terminal's job has it, even under a suite started in the background.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == b"running\n"
        proc.send_signal(signum)
        assert proc.stdout.readline() == b"cleaning up\n"
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == -signum  # killed by it, not after the cleanup
    finally:
        proc.kill()
