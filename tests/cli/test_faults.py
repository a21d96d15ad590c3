"""Faults a long `metrale generate` job meets, each through the real CLI in a
subprocess on the tiny checkpoint: a SIGTERM, a full disk or a failing
output, two runs on one output, a broken model. After each, the output holds
every input id at most once, and after ``--resume`` exactly once, with the
texts of an uninterrupted run (greedy)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from metrale.cli.main import app
from tests.support.broken_models import Broken, write_broken_models
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.memory_runs import run_alone

METRALE = Path(sys.executable).parent / "metrale"
ENV = {"COLUMNS": "400", "NO_COLOR": "1"}
ARGS = ["--device", "cpu", "--dtype", "float32", "--max-len", "128", "--max-batch", "2"]
ARGS += ["--progress", "plain"]
PROMPTS = ["abc abc abc abc", "hello hello", "one two one two", "xy xy xy"]
# Enough work that a fault lands mid-run: 12 answers of 64 tokens, 2 at a time.
LINES: list[Any] = [
    {"id": f"q{i}", "prompt": f"{PROMPTS[i % 4]} {i}", "max_tokens": 64} for i in range(12)
]
IDS = sorted(x["id"] for x in LINES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", mtp_layout="deepseek")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("input") / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in LINES))
    return path


@pytest.fixture(scope="module")
def reference(tiny: Path, source: Path) -> dict[str, str]:
    """Texts by id of an uninterrupted run."""
    result = CliRunner().invoke(
        app, ["generate", str(source), "--model", str(tiny), *ARGS], env=ENV
    )
    assert result.exit_code == 0, result.output
    return texts(result.stdout.encode())


def texts(data: bytes) -> dict[str, str]:
    """Texts by id; asserts every line is whole and every id there once."""
    records = [orjson.loads(line) for line in data.splitlines()]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), f"an id written twice: {sorted(ids)}"
    return {r["id"]: r["text"] for r in records}


def start(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(METRALE), "generate", *args],
        stdout=kwargs.pop("stdout", subprocess.DEVNULL),
        stderr=subprocess.PIPE,
        env={**os.environ, **ENV},
        **kwargs,
    )


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while not path.exists() or path.read_bytes().count(b"\n") < count:
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < deadline, f"fewer than {count} lines in 180 s"
        time.sleep(0.02)


def resume(args: list[str]) -> None:
    result = CliRunner().invoke(app, ["generate", *args, "--resume"], env=ENV)
    assert result.exit_code == 0, result.output


def test_sigterm_keeps_finished_lines_exits_143_and_resume_completes_the_run(
    tiny: Path, source: Path, reference: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    args = [str(source), "--model", str(tiny), *ARGS, "-o", str(out)]
    proc = start(args)
    wait_for_lines(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    stderr = err.decode()
    assert proc.returncode == 143, stderr
    written = texts(out.read_bytes())
    assert 2 <= len(written) < len(LINES), "the run ended before the signal: give it more work"
    assert f"stopped by SIGTERM; {len(written)} lines written to {out}" in stderr
    assert "run the same command again with --resume" in stderr
    assert "speculation" in stderr  # the final view closed as it does at the end
    assert "Traceback" not in stderr
    assert all(reference[k] == v for k, v in written.items())
    resume(args)
    assert texts(out.read_bytes()) == reference


def test_a_second_sigterm_stops_at_once_and_resume_still_repairs_the_output(
    tiny: Path, source: Path, reference: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    args = [str(source), "--model", str(tiny), *ARGS, "-o", str(out), "--order", "input"]
    proc = start(args)
    wait_for_lines(out, 1, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    # Killed by the second, or done before it came: whichever, nothing is lost.
    assert proc.returncode in (143, -signal.SIGTERM)
    resume(args)
    assert texts(out.read_bytes()) == reference


def file_size_limit(size: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def test_a_full_disk_stops_with_whole_lines_and_resume_completes_the_run(
    tiny: Path, source: Path, reference: dict[str, str], tmp_path: Path
) -> None:
    # A file-size limit fails writes past it as a full disk does: part of a
    # line goes in, then the kernel refuses the rest.
    out = tmp_path / "out.jsonl"
    args = [str(source), "--model", str(tiny), *ARGS, "-o", str(out)]
    proc = start(args, preexec_fn=file_size_limit(2000))
    _, err = proc.communicate(timeout=300)
    stderr = err.decode()
    assert proc.returncode == 74, stderr
    assert f"cannot write {out}: File too large (EFBIG)" in stderr
    assert "the last one whole" in stderr and "--resume" in stderr
    assert "Traceback" not in stderr
    data = out.read_bytes()
    assert data.endswith(b"\n") and 0 < len(data) <= 2000
    written = texts(data)
    assert f"stopped with {len(written)} lines written" in stderr
    assert all(reference[k] == v for k, v in written.items())
    resume(args)
    assert texts(out.read_bytes()) == reference


@pytest.mark.parametrize("to_stdout", [False, True], ids=["-o /dev/full", "stdout > /dev/full"])
def test_an_output_on_a_full_device_is_an_error_naming_it(
    tiny: Path, source: Path, to_stdout: bool
) -> None:
    with open("/dev/full", "wb") as full:
        if to_stdout:
            proc = start([str(source), "--model", str(tiny), *ARGS], stdout=full)
        else:
            proc = start([str(source), "--model", str(tiny), *ARGS, "-o", "/dev/full"])
        _, err = proc.communicate(timeout=300)
    stderr = err.decode()
    assert proc.returncode == 74, stderr
    where = "standard output" if to_stdout else "/dev/full"
    assert f"cannot write {where}: No space left on device (ENOSPC)" in stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr


def test_closed_standard_output_is_a_usage_error() -> None:
    proc = subprocess.run(
        [str(METRALE), "generate", "-"],
        input=b"",
        capture_output=True,
        env={**os.environ, **ENV},
        preexec_fn=lambda: os.close(1),
        timeout=120,
    )
    assert proc.returncode == 2
    assert "standard output is closed: give -o OUTPUT" in proc.stderr.decode()


def test_a_second_run_on_the_same_output_is_refused_naming_the_first(
    tiny: Path, source: Path, reference: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    args = ["--model", str(tiny), *ARGS, "-o", str(out)]
    # The first run reads a pipe that stays open: it runs until it is killed.
    first = start(["-", *args], stdin=subprocess.PIPE, start_new_session=True)
    assert first.stdin is not None
    first.stdin.write(b"".join(orjson.dumps(x) + b"\n" for x in LINES[:2]))
    first.stdin.flush()
    try:
        wait_for_lines(out, 1, first)
        for extra in ([], ["--resume"]):
            before = out.read_bytes()
            second = subprocess.run(
                [str(METRALE), "generate", str(source), *args, *extra],
                capture_output=True,
                env={**os.environ, **ENV},
                timeout=120,
            )
            stderr = second.stderr.decode()
            assert second.returncode == 2, stderr
            holder = f"another run (pid {first.pid}: metrale generate - --model"
            assert f"{out} is being written by {holder}" in stderr
            assert "wait for it to end, or stop it and run again with --resume" in stderr
            assert out.read_bytes().startswith(before)  # neither emptied nor repaired
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # no chance to clean up: the kernel drops the lock
        first.wait()
    resume([str(source), *args])
    assert texts(out.read_bytes()) == reference


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Broken]:
    return write_broken_models(tmp_path_factory.mktemp("broken"))


@pytest.mark.parametrize(
    "case",
    [
        "truncated safetensors",
        "corrupt safetensors header",
        "shard named by the index is gone",
        "shard missing from the index",
        "config.json not JSON",
        "truncated gguf",
        "corrupt gguf header",
    ],
)
def test_a_broken_model_is_a_usage_error_naming_the_file(
    broken: dict[str, Broken], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("METRALE_HOME", str(tmp_path / "home"))  # GGUF conversions go here
    model = broken[case]
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps(LINES[0]) + b"\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        app, ["generate", str(src), "--model", str(model.model), "-o", str(out)], env=ENV
    )
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # a message, never a traceback
    assert f"Invalid value for --model: cannot load it: {model.culprit}" in result.stderr
    assert model.fault in result.stderr and "download or copy it again" in result.stderr
    assert not out.exists()  # nothing generated, no empty output left behind
    assert not any((tmp_path / "home").glob("models/gguf/*/config.json"))  # nothing half-made


def test_a_broken_model_stops_the_cli_before_it_reads_a_line(broken: dict[str, Broken]) -> None:
    # Standard input stays open and empty: a run that read it would wait.
    proc = start(
        ["-", "--model", str(broken["truncated safetensors"].model)], stdin=subprocess.PIPE
    )
    try:
        assert proc.wait(timeout=120) == 2
    finally:
        proc.kill()
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    assert "is truncated" in stderr and "Traceback" not in stderr


def test_a_slow_first_line_under_input_order_holds_back_a_bounded_pile(
    tiny: Path, tmp_path: Path
) -> None:
    # Every line behind the first finishes before it. The writer holds at
    # most 4,096 of their records (about 33 MiB of 8 KiB records here), the
    # input waiting for the rest; held without a bound, all 12,000 would
    # take about 100 MiB. Measured from the point 1,000 lines were read, the
    # lines fed from a fresh process (``memory_runs`` says why).
    out = tmp_path / "out.jsonl"
    peak = run_alone(tiny, out, 12_000, "input", metadata_bytes=8000)
    assert peak.end_kib - peak.early_kib < 80 * 1024, peak
    assert peak.end_kib < 2 * 1024 * 1024, peak  # the tiny model's process, generously
    with out.open("rb") as f:
        assert [orjson.loads(line)["id"] for line in f] == list(range(12_000))
