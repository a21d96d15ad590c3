"""The output file: locked for one run, written a whole line at a time."""

from __future__ import annotations

import errno
import io
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from metrale.cli import output as output_module
from metrale.cli.output import OutputBusy, OutputFailed, OutputFile, StandardOutput
from metrale.cli.stop import Stopped, stop_signals

LINE = '{"id": 1, "text": "abc"}\n'


def test_a_second_open_is_refused_naming_the_process_that_holds_it(tmp_path: Path) -> None:
    path = str(tmp_path / "out.jsonl")
    first = OutputFile.open(path)
    try:
        with pytest.raises(OutputBusy) as busy:
            OutputFile.open(path)
        assert busy.value.holder is not None
        assert busy.value.holder.startswith(f"pid {os.getpid()}: ")
        assert str(busy.value).startswith(f"{path} is being written by another run (pid ")
    finally:
        first.close()
    OutputFile.open(path).close()  # closing dropped the lock


def test_opening_keeps_the_content_and_start_empties_it_unless_appending(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text(LINE)
    out = OutputFile.open(str(path))
    assert path.read_text() == LINE  # a run refused later has destroyed nothing
    out.start(append=True)
    out.write_line(LINE)
    assert path.read_text() == LINE * 2
    out.start(append=False)
    out.write_line(LINE)
    out.close()
    assert path.read_text() == LINE


def test_a_file_created_for_a_run_that_never_started_is_removed(tmp_path: Path) -> None:
    made, kept = tmp_path / "made.jsonl", tmp_path / "kept.jsonl"
    kept.write_text(LINE)
    OutputFile.open(str(made)).close()
    OutputFile.open(str(kept)).close()
    assert not made.exists() and kept.read_text() == LINE


def test_a_device_is_neither_locked_nor_emptied() -> None:
    first, second = OutputFile.open(os.devnull), OutputFile.open(os.devnull)
    second.start(append=False)
    second.write_line(LINE)
    first.close()
    second.close()


def test_a_write_the_disk_cuts_short_is_cut_back_and_every_later_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "out.jsonl"
    out = OutputFile.open(str(path))
    out.start(append=False)
    out.write_line(LINE)
    real_write = os.write
    calls: list[int] = []

    def full_disk(fd: int, data: Any) -> int:  # takes 5 bytes, then the disk is full
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(output_module.os, "write", full_disk)
    with pytest.raises(OutputFailed) as failed:
        out.write_line(LINE)
    assert failed.value.whole and path.read_text() == LINE
    assert str(failed.value) == f"cannot write {path}: No space left on device (ENOSPC)"
    with pytest.raises(OutputFailed):
        out.write_line(LINE)
    assert len(calls) == 2  # the later write never reached the file
    out.close()


def test_a_stop_during_a_write_lands_after_the_whole_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "out.jsonl"
    out = OutputFile.open(str(path))
    out.start(append=False)
    real_write = os.write
    calls: list[int] = []

    def signalled(fd: int, data: Any) -> int:  # SIGTERM comes mid-line, 3 bytes at a time
        calls.append(len(data))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_write(fd, bytes(data[:3]))

    monkeypatch.setattr(output_module.os, "write", signalled)
    with pytest.raises(Stopped), stop_signals():
        out.write_line(LINE)
    monkeypatch.undo()
    assert path.read_text() == LINE and out.size == len(LINE)
    out.close()


def test_a_closed_descriptor_fails_the_write_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    out = OutputFile.open(str(path))
    out.start(append=False)
    os.close(out.fd)
    with pytest.raises(OutputFailed) as failed:
        out.write_line(LINE)
    assert failed.value.error.errno == errno.EBADF and str(path) in str(failed.value)


class FailingStream(io.StringIO):
    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def flush(self) -> None:
        raise self.error


def test_standard_output_failing_is_an_output_failure_and_a_gone_reader_is_not() -> None:
    out = StandardOutput(FailingStream(OSError(errno.EIO, os.strerror(errno.EIO))))
    with pytest.raises(OutputFailed) as failed:
        out.write_line(LINE)
    assert str(failed.value) == "cannot write standard output: Input/output error (EIO)"
    assert not failed.value.whole  # the shell's file cannot be cut back
    with pytest.raises(BrokenPipeError):
        StandardOutput(FailingStream(BrokenPipeError())).write_line(LINE)
