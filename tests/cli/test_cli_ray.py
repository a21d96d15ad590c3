"""`metrale generate --ray` on a local Ray instance of 2 CPUs with the tiny
checkpoint: what it writes is, line for line, what one process writes, also
when a worker is killed mid-job or a line kills every worker that runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.cli.records import is_failure
from tests.support.checkpoints import write_tiny_checkpoint

ray = pytest.importorskip("ray", reason="the Ray extra: pip install 'metrale[ray]'")

METRALE = Path(sys.executable).parent / "metrale"
ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
# A line's speculation figures depend on which requests shared its batch (in
# one process too: copies are cut to fit the step), and its text never does;
# one sequence a batch makes every field of every line comparable. The fixed
# draft policy, so that nothing timed decides a draft either.
ARGS = ["--device", "cpu", "--dtype", "float32", "--max-len", "256", "--max-batch", "1"]
ARGS += ["--draft-policy", "fixed", "--progress", "plain"]
PROMPTS = ["abc abc abc abc abc", "hello hello hello", "one two one two", "xy xy xy xy"]
# Enough work that a kill lands mid-run: 16 answers of up to 160 tokens.
LINES: list[Any] = [
    {"id": f"p{i}", "prompt": PROMPTS[i % 4] + f" {i}", "max_tokens": 160} for i in range(14)
]
LINES.insert(3, "{broken")  # not JSON: an error record in the simple format
LINES.insert(7, {"id": "long", "prompt": "x", "max_tokens": 300})  # beyond --max-len
LINES.insert(
    10,
    {
        "custom_id": "b1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "ab ab ab ab"}], "max_tokens": 40},
    },
)
LINES.append(
    {"id": "chat", "messages": [{"role": "user", "content": "hi hi hi"}], "max_tokens": 24}
)
NUM_FAILED = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-ray")
    write_tiny_checkpoint(path, family="llama", mtp_layout="deepseek")
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray-input") / "in.jsonl"
    path.write_bytes(b"".join(_line(x) + b"\n" for x in LINES))
    return path


def _line(x: Any) -> bytes:
    return x.encode() if isinstance(x, str) else orjson.dumps(x)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[str]:
    """One local Ray for the module; `--ray local` in this process joins it,
    a subprocess joins it by its address."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def generate(args: list[str], status: int = 1) -> Any:
    """An in-process run; by default the bad lines fail, nothing else."""
    result = CliRunner().invoke(app, ["generate", *args], env=ENV)
    assert result.exit_code == status, result.output
    return result


def comparable(path: Path) -> list[bytes]:
    """The output lines without the fields that say how the run went rather
    than what it wrote: a Batch body's ``created`` (a clock) and the prompt
    tokens a line found in its engine's prefix cache (each worker has its own)."""
    lines = []
    for raw in path.read_bytes().splitlines():
        record = orjson.loads(raw)
        if "custom_id" in record and "created" in record["response"]["body"]:
            del record["response"]["body"]["created"]
        body = record["response"]["body"] if "custom_id" in record else record
        body.get("usage", {}).pop("prompt_tokens_details", None)
        lines.append(orjson.dumps(record))
    return lines


@pytest.fixture(scope="module")
def one_process(
    tiny: Path, source: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[bytes], dict[str, Any]]:
    folder = tmp_path_factory.mktemp("one-process")
    out, stats = folder / "out.jsonl", folder / "stats.json"
    args = [str(source), "--model", str(tiny), *ARGS, "--order", "input"]
    generate([*args, "-o", str(out), "--stats-json", str(stats)])
    return comparable(out), orjson.loads(stats.read_bytes())


def test_ray_local_writes_what_one_process_writes_line_for_line(
    tiny: Path,
    source: Path,
    local_ray: str,
    one_process: tuple[list[bytes], dict[str, Any]],
    tmp_path: Path,
) -> None:
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    args = [str(source), "--model", str(tiny), *ARGS, "--order", "input", "--ray", "local"]
    result = generate([*args, "--ray-workers", "2", "-o", str(out), "--stats-json", str(stats)])
    expected, figures = one_process
    # In input order, error records included, every field of every line.
    assert comparable(out) == expected
    assert len(expected) == len(LINES)
    assert sum(is_failure(orjson.loads(x)) for x in expected) == NUM_FAILED
    # The cluster's figures are the sum of its two engines': the same as one's.
    cluster = orjson.loads(stats.read_bytes())
    for key in ("requests", "failed", "prompt_tokens", "generated_tokens", "seq_verifies"):
        assert cluster[key] == figures[key], key
    assert cluster["prompt_lookup"] == figures["prompt_lookup"]
    assert cluster["mtp"]["proposed"] == figures["mtp"]["proposed"]
    assert cluster["settings"]["ray"] == {"address": "local", "workers": 2, "max_retries": 3}
    # ...and the view on standard error shows them.
    done = f"{len(LINES)}/{len(LINES)} requests, {NUM_FAILED} failed"
    assert f"{done}, {figures['generated_tokens']} tokens" in result.stderr


def test_a_killed_ray_run_resumes_with_every_line_answered_once(
    tiny: Path,
    source: Path,
    local_ray: str,
    one_process: tuple[list[bytes], dict[str, Any]],
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.jsonl"
    args = [str(source), "--model", str(tiny), *ARGS, "-o", str(out)]
    # A driver of its own joining the module's Ray, killed outright (no
    # chance to flush or clean up) once a few lines are out.
    proc = subprocess.Popen(
        [str(METRALE), "generate", *args, "--ray", local_ray, "--ray-workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **ENV},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while _count_lines(out) < 4:
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "no lines written in 120 s"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    written = _count_lines(out)
    assert written < len(LINES), "the run ended before the kill: give it more work"
    print(f"{written} of {len(LINES)} lines written before the kill")
    # The error records were written before the kill: nothing fails now.
    generate([*args, "--ray", "local", "--ray-workers", "2", "--resume"], status=0)
    expected, _ = one_process
    lines = comparable(out)
    ids = [_key(orjson.loads(x)) for x in lines]
    assert sorted(ids) == sorted(_key(orjson.loads(x)) for x in expected)  # each once
    assert sorted(lines) == sorted(expected)


def test_a_worker_killed_mid_job_loses_nothing_and_duplicates_nothing(
    tiny: Path,
    source: Path,
    local_ray: str,
    one_process: tuple[list[bytes], dict[str, Any]],
    tmp_path: Path,
) -> None:
    # A kill that lands on a worker with no window in flight (it finished its
    # windows, or had none yet) tests the loss of nothing: the job is run
    # again, each run checked whole, until a kill lands mid-window.
    expected, _ = one_process
    for attempt in range(6):
        out = tmp_path / f"out{attempt}.jsonl"
        stderr = _run_and_kill_a_worker(tiny, source, local_ray, out)
        assert comparable(out) == expected  # every line once, in order, every field
        assert "Traceback" not in stderr
        if "windows ran again" in stderr:
            break
    assert "windows ran again" in stderr, "no kill in six runs landed mid-window"
    assert "0 lines given up" in stderr


def _run_and_kill_a_worker(tiny: Path, source: Path, local_ray: str, out: Path) -> str:
    """Runs the job on ``local_ray`` and kills one of its workers once both
    run and 3 lines are written; the job's stderr."""
    args = [str(source), "--model", str(tiny), *ARGS, "-o", str(out), "--order", "input"]
    # Workers of an earlier job (a killed `--ray local` run's) may linger a
    # while: killing one of those would test nothing.
    earlier = set(_engine_workers())
    proc = subprocess.Popen(
        [str(METRALE), "generate", *args, "--ray", local_ray, "--ray-workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **ENV},
    )
    try:
        deadline = time.monotonic() + 180
        while len(workers := _own_workers(earlier)) < 2 or _count_lines(out) < 3:
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "no lines written in 180 s"
            time.sleep(0.01)
        os.kill(workers[0], signal.SIGKILL)  # as a lost spot instance: no goodbye
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    stderr = err.decode()
    assert proc.returncode == 1, stderr  # the input's two bad lines, nothing else
    return stderr


# The real CLI with workers whose process dies whenever their engine takes a
# line holding POISON (a line that crashes every engine, or kills its host).
POISONED_CLI = textwrap.dedent(
    """
    import os, sys
    from metrale.cli import ray_worker
    from metrale.cli.main import app

    class PoisonedWorker(ray_worker.EngineWorker):
        def _requests(self):
            for request in super()._requests():
                if request is not None and b"POISON" in bytes(
                    i for i in request.prompt_ids if i < 256
                ):
                    os._exit(1)
                yield request

    ray_worker.EngineWorker = PoisonedWorker
    sys.argv[0] = "metrale"
    app()
    """
)


def test_a_line_that_kills_every_worker_gets_an_error_record_and_the_job_goes_on(
    tiny: Path,
    source: Path,
    local_ray: str,
    one_process: tuple[list[bytes], dict[str, Any]],
    tmp_path: Path,
) -> None:
    poisoned = tmp_path / "in.jsonl"
    poison = {
        "custom_id": "poison",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "POISON POISON", "max_tokens": 8},
    }
    data = source.read_bytes().splitlines(keepends=True)
    poisoned.write_bytes(b"".join(data[:5]) + orjson.dumps(poison) + b"\n" + b"".join(data[5:]))
    out = tmp_path / "out.jsonl"
    args = [str(poisoned), "--model", str(tiny), *ARGS, "-o", str(out)]
    args += ["--ray", local_ray, "--ray-workers", "2", "--ray-max-retries", "1"]
    proc = subprocess.run(
        [sys.executable, "-c", POISONED_CLI, "generate", *args],
        capture_output=True,
        env={**os.environ, **ENV},
        timeout=600,
    )
    stderr = proc.stderr.decode()
    assert proc.returncode == 1, stderr
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    (failed,) = [r for r in records if r.get("custom_id") == "poison"]
    assert failed["response"]["status_code"] == 500
    error = failed["response"]["body"]["error"]
    assert error["type"] == "server_error"
    assert "the Ray worker running this line died on each of its 2 tries" in error["message"]
    assert "1 lines given up (--ray-max-retries 1)" in stderr
    expected, _ = one_process
    others = [r for r in records if r.get("custom_id") != "poison"]
    assert answers(others) == answers([orjson.loads(x) for x in expected])


def answers(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each line's answer by its id: its text, or that it failed."""
    out: dict[str, Any] = {}
    for r in records:
        key = _key(r)
        assert key not in out, f"{key} answered twice"
        if is_failure(r):
            out[key] = "failed"
        elif "custom_id" in r:
            choice = r["response"]["body"]["choices"][0]
            out[key] = choice.get("text", choice.get("message", {}).get("content"))
        else:
            out[key] = r["text"]
    return out


def _own_workers(earlier: set[int]) -> list[int]:
    """The live ``EngineWorker`` processes not among ``earlier``'s pids."""
    return [pid for pid in _engine_workers() if pid not in earlier]


def _engine_workers() -> list[int]:
    """Pids of the live Ray actor processes running an ``EngineWorker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"EngineWorker" in cmdline and cmdline.startswith(b"ray::"):
            pids.append(int(entry.name))
    return sorted(pids)


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _key(record: dict[str, Any]) -> str:
    return str(record.get("custom_id", record.get("id")))
