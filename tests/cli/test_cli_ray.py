"""`metrale generate --ray` on a local Ray instance of 2 CPUs with the tiny
checkpoint: what it writes is, line for line, what one process writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
    """The output lines without the one field that is a clock: a Batch body's
    ``created``."""
    lines = []
    for raw in path.read_bytes().splitlines():
        record = orjson.loads(raw)
        if "custom_id" in record and "created" in record["response"]["body"]:
            del record["response"]["body"]["created"]
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
    assert cluster["settings"]["ray"] == {"address": "local", "workers": 2}
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


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _key(record: dict[str, Any]) -> str:
    return str(record.get("custom_id", record.get("id")))
