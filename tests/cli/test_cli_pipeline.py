"""`metrale generate` end to end on real checkpoints: a shell-style pipeline
through a subprocess (stdin to stdout), and in-process runs on the real engine."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from metrale.cli.main import app
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.env import home_env

METRALE = Path(sys.executable).parent / "metrale"
SAMPLES = Path(__file__).resolve().parents[2] / "sample_prompts"
ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
TINY_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-len", "256", "--max-batch", "4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-deepseek")
    write_tiny_checkpoint(path, family="llama", mtp_layout="deepseek")
    return path


def jsonl(lines: list[Any]) -> bytes:
    return b"".join(orjson.dumps(x) + b"\n" for x in lines)


# Repetitive prompts: a random tiny model still loops, so copies get proposed.
LINES: list[Any] = [
    {"id": "rep", "prompt": "abc abc abc abc abc abc abc abc abc", "max_tokens": 24},
    {
        "id": "chat",
        "messages": [{"role": "user", "content": "hello hello hello"}],
        "max_tokens": 16,
    },
    {
        "custom_id": "b1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "xy xy xy xy"}], "max_tokens": 12},
    },
    {
        "custom_id": "b2",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "one two one two one two", "max_tokens": 12},
    },
]


def test_stdin_to_stdout_pipeline_carries_only_jsonl(tiny: Path) -> None:
    # A broken line takes the format of the line before it: simple here.
    data = jsonl(LINES[:1]) + b"{broken\n" + jsonl(LINES[1:])
    proc = subprocess.run(
        [str(METRALE), "generate", "-", "--model", str(tiny), *TINY_ARGS],
        input=data,
        capture_output=True,
        timeout=300,
        env={**ENV, "PATH": "/usr/bin:/bin", **home_env()},
    )
    assert proc.returncode == 1, proc.stderr.decode()  # the broken line failed, the rest not
    out = [orjson.loads(line) for line in proc.stdout.splitlines()]
    assert len(out) == 5
    simple = {r["id"]: r for r in out if "custom_id" not in r}
    batch = {r["custom_id"]: r for r in out if "custom_id" in r}
    assert simple["rep"]["usage"]["completion_tokens"] >= 1
    assert simple["chat"]["finish_reason"] in ("stop", "length")
    assert simple[2]["finish_reason"] == "error" and simple[2]["error"]["line"] == "<stdin>:2"
    assert batch["b1"]["response"]["body"]["object"] == "chat.completion"
    assert batch["b2"]["response"]["body"]["object"] == "text_completion"
    stderr = proc.stderr.decode()
    assert "5/? requests, 1 failed" in stderr and "prompt lookup: own history" in stderr


def test_sigint_keeps_finished_lines_prints_the_summary_and_exits_130(tiny: Path) -> None:
    proc = subprocess.Popen(
        [str(METRALE), "generate", "--model", str(tiny), *TINY_ARGS, "--max-batch", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**ENV, "PATH": "/usr/bin:/bin", **home_env()},
        # A suite started as a background job (`make test &` in a script)
        # inherits SIGINT ignored, and Python then installs no handler: the
        # child gets the default disposition, as a terminal's job has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdin is not None and proc.stdout is not None
    # Standard input stays open: the run waits for more lines after these.
    proc.stdin.write(jsonl(LINES[:2]))
    proc.stdin.flush()
    first = orjson.loads(proc.stdout.readline())  # flushed as soon as it finished
    assert first["id"] == "rep"
    proc.send_signal(signal.SIGINT)
    rest, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr.decode()
    written = 1 + len(rest.splitlines())
    assert f"interrupted; {written} lines written" in stderr.decode()
    assert "prompt lookup: all" in stderr.decode()


def texts(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        r = orjson.loads(line)
        if "custom_id" in r:
            body = r["response"]["body"]["choices"][0]
            out[r["custom_id"]] = body.get("text", body.get("message", {}).get("content"))
        else:
            out[r["id"]] = r["text"]
    return out


def test_copies_and_drafts_never_change_greedy_output(tiny: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(LINES))
    runs = {}
    for name, extra in {
        "plain": ["--no-mtp", "--no-prompt-lookup"],
        # The fixed policy's knobs, so that both sources surely draft; the
        # budget (the default) runs at batch 1.
        "spec": [
            "--draft-policy",
            "fixed",
            "--prompt-lookup-min-match",
            "2",
            "--prompt-lookup-ngram",
            "2",
            "--mtp-min-prob",
            "0",
        ],
        "spec-batch-1": ["--max-batch", "1"],
    }.items():
        stats = tmp_path / f"{name}.json"
        args = [
            "generate",
            str(src),
            "--model",
            str(tiny),
            *TINY_ARGS,
            *extra,
            "--stats-json",
            str(stats),
        ]
        result = CliRunner().invoke(app, args, env=ENV)
        assert result.exit_code == 0, result.output
        runs[name] = (texts(result.stdout), orjson.loads(stats.read_bytes()))
    plain_texts, plain_stats = runs["plain"]
    spec_texts, spec_stats = runs["spec"]
    assert spec_texts == plain_texts == runs["spec-batch-1"][0]
    assert plain_stats["mtp"]["proposed"] == 0 and plain_stats["prompt_lookup"]["proposed"] == 0
    assert spec_stats["mtp"]["proposed"] > 0  # speculation really ran
    assert spec_stats["generated_tokens"] == plain_stats["generated_tokens"]


@pytest.mark.slow
def test_default_model_on_sample_prompts(tmp_path: Path) -> None:
    lines = (SAMPLES / "code_edits.jsonl").read_bytes().splitlines()[:2]
    src, stats = tmp_path / "in.jsonl", tmp_path / "stats.json"
    # Short answers keep the test well under a minute on two cores.
    src.write_bytes(
        b"".join(orjson.dumps({**orjson.loads(line), "max_tokens": 16}) + b"\n" for line in lines)
    )
    args = [
        "generate",
        str(src),
        "--max-len",
        "1024",
        "--max-batch",
        "2",
        "--stats-json",
        str(stats),
    ]
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 0, result.output
    out = [orjson.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["id"] for r in out) == ["code-01", "code-02"]
    # The model starts by repeating the code it was given: copies are accepted.
    assert all("def " in r["text"] for r in out)
    figures = orjson.loads(stats.read_bytes())
    assert figures["generated_tokens"] == 32 and figures["prompt_lookup"]["accepted"] > 0


def test_slow_pipe_answers_each_line_before_the_next_arrives(tiny: Path) -> None:
    # A producer that waits for each answer before writing the next line (a
    # conversation driver, `tail -f`) must get it: the engine may not hold
    # running requests back until its batch fills or the input ends.
    proc = subprocess.Popen(
        [str(METRALE), "generate", "-", *TINY_ARGS, "--progress", "off"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**ENV, "PATH": str(METRALE.parent), **home_env()},
    )
    assert proc.stdin is not None and proc.stdout is not None
    # A stalled run would block readline() for good: end it, so the test fails.
    watchdog = threading.Timer(90, proc.kill)
    watchdog.start()
    try:
        answers = []
        for i in range(2):
            proc.stdin.write(jsonl([{"id": f"turn{i}", "prompt": "abc abc", "max_tokens": 4}]))
            proc.stdin.flush()
            answers.append(orjson.loads(proc.stdout.readline()))  # blocks until answered
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        proc.kill()
    assert [a["id"] for a in answers] == ["turn0", "turn1"]
    assert all(a["finish_reason"] == "length" for a in answers)
