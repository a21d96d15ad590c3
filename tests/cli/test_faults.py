"""Faults a long `metrale generate` job meets, each through the real CLI on
the tiny checkpoint: a broken model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from metrale.cli.main import app
from tests.support.broken_models import Broken, write_broken_models

METRALE = Path(sys.executable).parent / "metrale"
ENV = {"COLUMNS": "400", "NO_COLOR": "1"}
LINE = {"id": "q0", "prompt": "abc abc abc abc 0", "max_tokens": 64}


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
    src.write_bytes(orjson.dumps(LINE) + b"\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        app, ["generate", str(src), "--model", str(model.model), "-o", str(out)], env=ENV
    )
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # a message, never a traceback
    assert f"Invalid value for --model: cannot load it: {model.culprit}" in result.stderr
    assert model.fault in result.stderr and "download or copy it again" in result.stderr
    assert not out.exists()  # nothing generated
    assert not any((tmp_path / "home").glob("models/gguf/*/config.json"))  # nothing half-made


def test_a_broken_model_stops_the_cli_before_it_reads_a_line(broken: dict[str, Broken]) -> None:
    # Standard input stays open and empty: a run that read it would wait.
    proc = subprocess.Popen(
        [str(METRALE), "generate", "-", "--model", str(broken["truncated safetensors"].model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.wait(timeout=120) == 2
    finally:
        proc.kill()
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    assert "is truncated" in stderr and "Traceback" not in stderr
