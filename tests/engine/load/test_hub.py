"""A hub id as the model: read from the Hugging Face cache, fetched only when
it is not there, and a clear usage error offline; and how a source is told
from a folder or a file."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.engine.load.hub import HubError, hub_snapshot
from metrale.engine.load.source import resolve_source, source_kind
from metrale.engine.runtime.arch import CheckpointError
from tests.support.checkpoints import write_tiny_checkpoint

REPO = "owner/tiny-model"
MAIN = "a" * 40  # commit hashes: 40 hex digits
V2 = "b" * 40
WIDE = {"COLUMNS": "400", "NO_COLOR": "1"}


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}"


def add_snapshot(cache: Path, repo_id: str, commit: str, ref: str | None, seed: int) -> Path:
    """huggingface_hub's layout: ``refs/<ref>`` holds the commit hash and
    ``snapshots/<commit>/`` the files (symlinks into ``blobs/`` in a real
    download; plain files read the same)."""
    folder = repo_folder(cache, repo_id)
    snapshot = write_tiny_checkpoint(folder / "snapshots" / commit, "llama", seed=seed)
    if ref is not None:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache with REPO at main and at the tag v2, offline. huggingface_hub
    reads HF_HUB_CACHE/HF_HUB_OFFLINE once, at import (a subprocess test
    below proves the variables themselves are honoured)."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, MAIN, "main", seed=1)
    add_snapshot(cache, REPO, V2, "v2", seed=2)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    yield cache


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch, hub_cache: Path) -> list[dict[str, Any]]:
    """Offline mode off, with ``snapshot_download`` recorded: a call that may
    use the network (``local_files_only`` false) "downloads" REPO's files."""
    from huggingface_hub import snapshot_download

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls: list[dict[str, Any]] = []

    def recorded(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        if kwargs.get("local_files_only"):
            return str(snapshot_download(repo_id, **kwargs))
        commit = "c" * 40
        return str(add_snapshot(hub_cache, repo_id, commit, kwargs.get("revision"), seed=3))

    monkeypatch.setattr("huggingface_hub.snapshot_download", recorded)
    return calls


def test_a_hub_id_resolves_offline_from_the_cache(hub_cache: Path) -> None:
    resolved = resolve_source(REPO, None)
    assert resolved.kind == "hub" and resolved.name == REPO
    assert resolved.folder == repo_folder(hub_cache, REPO) / "snapshots" / MAIN
    assert resolved.origin == f"hub {REPO}@main (commit {MAIN})"


@pytest.mark.parametrize(("revision", "commit"), [("v2", V2), (V2, V2), (MAIN, MAIN)])
def test_a_revision_picks_another_ref_or_a_commit(
    hub_cache: Path, revision: str, commit: str
) -> None:
    snapshot = hub_snapshot(REPO, revision)
    assert (snapshot.revision, snapshot.commit) == (revision, commit)
    assert snapshot.folder == repo_folder(hub_cache, REPO) / "snapshots" / commit


def test_a_model_missing_offline_says_how_to_fetch_it(hub_cache: Path) -> None:
    with pytest.raises(HubError, match=r"`hf download other/model` .* or unset HF_HUB_OFFLINE"):
        resolve_source("other/model", None)
    with pytest.raises(HubError, match=rf"`hf download {REPO} --revision v9`"):
        resolve_source(REPO, "v9")


def test_a_cached_model_is_read_without_any_network_call(online: list[dict[str, Any]]) -> None:
    assert resolve_source(REPO, "v2").folder.name == V2
    assert [call["local_files_only"] for call in online] == [True]


def test_a_model_is_downloaded_only_when_the_cache_lacks_it(
    online: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = hub_snapshot("other/model", None)
    assert snapshot.commit == "c" * 40 and (snapshot.folder / "model.safetensors").exists()
    assert [call.get("local_files_only", False) for call in online] == [True, False]
    patterns = online[-1]["allow_patterns"]
    assert {"*.safetensors", "*.json"} <= set(patterns) and "*.bin" not in patterns
    assert "downloading" in capsys.readouterr().err  # progress is for people: stderr


def test_a_snapshot_cached_in_part_is_completed(
    online: list[dict[str, Any]], hub_cache: Path
) -> None:
    (repo_folder(hub_cache, REPO) / "snapshots" / V2 / "model.safetensors").unlink()
    snapshot = hub_snapshot(REPO, "v2")
    assert (snapshot.folder / "model.safetensors").exists()
    assert [call.get("local_files_only", False) for call in online] == [True, False]


def test_the_hub_variables_are_honoured(hub_cache: Path) -> None:
    code = (
        "from metrale.engine.load.source import resolve_source\n"
        f"print(resolve_source({REPO!r}, 'v2').folder)"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == str(repo_folder(hub_cache, REPO) / "snapshots" / V2)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("./missing", "no such folder or file"),
        ("/no/such/folder", "no such folder or file"),
        ("missing.gguf", "no such folder or file"),
        ("owner/missing.gguf", "no such folder or file"),
        ("a/b/c", "no such folder or file"),
        ("name-only", "no such folder or file"),
        ("owner/../name", "no such folder or file"),
    ],
)
def test_a_path_that_does_not_exist_is_no_such_folder(
    hub_cache: Path, source: str, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        source_kind(source)


def test_an_existing_path_wins_over_a_hub_id(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert source_kind(REPO) == "hub"
    monkeypatch.chdir(tmp_path)
    write_tiny_checkpoint(tmp_path / REPO, "llama")
    assert source_kind(REPO) == "folder"
    assert resolve_source(REPO, None).folder == Path(REPO)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="a file but not a GGUF"):
        source_kind("notes.txt")


def test_a_revision_without_a_hub_id_is_refused(hub_cache: Path, tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path / "local", "llama")
    with pytest.raises(
        CheckpointError, match=r"^revision: applies to a hub id \(owner/name\), not to a folder$"
    ):
        resolve_source(str(folder), "v2")


def test_info_shows_the_hub_id_revision_and_commit(hub_cache: Path) -> None:
    result = CliRunner().invoke(app, ["info", REPO, "--revision", "v2"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert f"hub {REPO}@v2 (commit {V2})" in result.output
    result = CliRunner().invoke(app, ["info", REPO], env=WIDE)
    assert f"hub {REPO}@main (commit {MAIN})" in result.output


def test_generate_with_a_missing_model_offline_is_a_usage_error(hub_cache: Path) -> None:
    args = ["generate", "--model", "other/model", "--progress", "off"]
    result = CliRunner().invoke(app, args, input='{"prompt": "hi"}\n', env=WIDE)
    assert result.exit_code == 2
    assert "--model" in result.output and "`hf download other/model`" in result.output


def test_a_revision_for_a_folder_is_a_usage_error_on_revision(
    hub_cache: Path, tmp_path: Path
) -> None:
    folder = write_tiny_checkpoint(tmp_path / "local", "llama")
    args = ["generate", "--model", str(folder), "--revision", "v2", "--progress", "off"]
    result = CliRunner().invoke(app, args, input='{"prompt": "hi"}\n', env=WIDE)
    assert result.exit_code == 2
    assert "Invalid value for --revision: applies to a hub id" in result.output


def test_revision_comes_from_its_variable_too(hub_cache: Path) -> None:
    env = {**WIDE, "METRALE_REVISION": "v2"}
    result = CliRunner().invoke(app, ["info", REPO], env=env)
    assert result.exit_code == 0, result.output
    assert f"(commit {V2})" in result.output


def test_the_cache_miss_is_what_huggingface_hub_reports(hub_cache: Path) -> None:
    # What hub.py relies on: a cached-only lookup of a missing repo raises
    # LocalEntryNotFoundError, never a network error.
    from huggingface_hub import snapshot_download

    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download("other/model", local_files_only=True)
