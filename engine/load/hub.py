"""A model named by its hub id, found in (or fetched into) the Hugging Face cache.

Contract: ``hub_snapshot(repo_id, revision)`` returns the snapshot folder of
``repo_id`` at ``revision`` (a branch, a tag or a commit hash; ``None`` is
``main``) holding ``config.json``, the safetensors weights and the tokenizer
files. The cache is huggingface_hub's own (``HF_HUB_CACHE``, else
``HF_HOME/hub``), and so are its tokens (``HF_TOKEN``, ``hf auth login``) and
``HF_HUB_OFFLINE``. The cache is read first, without any network call; only
when it lacks the files, and offline mode is off, are they downloaded, with
huggingface_hub's progress bars on standard error. Only what the runtime
reads is fetched (``ALLOW``): never ``*.bin``/``*.pth``/GGUF weights, nor the
duplicate ``consolidated`` copies some repos carry. A model that is not there
and cannot be fetched raises ``HubError``, saying how to fetch it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from metrale.engine.runtime.arch import CheckpointError

ALLOW = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
]
IGNORE = ["consolidated*", "original/*"]


class HubError(CheckpointError):
    """A hub model that is neither cached nor fetchable; the message says how to fix it."""


@dataclass(frozen=True)
class HubSnapshot:
    repo_id: str
    revision: str  # as asked: "main", a tag, a branch or a commit hash
    commit: str  # the commit the snapshot holds
    folder: Path


def hub_snapshot(repo_id: str, revision: str | None) -> HubSnapshot:
    from huggingface_hub import constants

    asked = revision or constants.DEFAULT_REVISION
    folder = _cached(repo_id, asked)
    if folder is None:
        if constants.is_offline_mode():
            raise HubError(
                f"{_named(repo_id, revision)} is not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}), or only in part, and HF_HUB_OFFLINE is set; "
                f"fetch it with `{fetch_command(repo_id, revision)}` where there is a "
                "network, or unset HF_HUB_OFFLINE"
            )
        folder = _download(repo_id, revision)
    return HubSnapshot(repo_id, asked, folder.name, folder)


def fetch_command(repo_id: str, revision: str | None) -> str:
    """The huggingface_hub CLI line that fills the cache ``hub_snapshot`` reads."""
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def _named(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id


def _cached(repo_id: str, revision: str) -> Path | None:
    """The cached snapshot, when it holds a whole checkpoint; no network call."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=ALLOW,
                ignore_patterns=IGNORE,
                local_files_only=True,
            )
        )
    except LocalEntryNotFoundError:  # not cached, or cached in part
        return None
    return folder if missing_files(folder) == [] else None


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = _named(repo_id, revision)
    print(f"metrale: {name} is not cached; downloading it", file=sys.stderr)
    try:
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=ALLOW, ignore_patterns=IGNORE
            )
        )
    except GatedRepoError as exc:
        raise HubError(
            f"{name} is gated: accept its terms on its hub page, then log in "
            "(`hf auth login`) or set HF_TOKEN"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise HubError(
            f"no hub model {repo_id} (nor a local folder of that name); a private one "
            "needs a token: `hf auth login` or HF_TOKEN"
        ) from exc
    except RevisionNotFoundError as exc:
        raise HubError(f"{repo_id} has no revision {revision!r}") from exc
    except (LocalEntryNotFoundError, OSError) as exc:  # no network, or the hub is down
        raise HubError(
            f"cannot download {name} ({type(exc).__name__}: {exc}); fetch it with "
            f"`{fetch_command(repo_id, revision)}` where there is a network"
        ) from exc
    missing = missing_files(folder)
    if missing:
        raise HubError(
            f"{name} has no {', '.join(missing)}: metrale reads safetensors checkpoints "
            "from the hub (a GGUF file loads by its path, once downloaded)"
        )
    return folder


def missing_files(folder: Path) -> list[str]:
    """What a checkpoint folder lacks before it can load: ``config.json``, and
    the weights (``model.safetensors``, or every shard its index names)."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError):
            return [*missing, "readable model.safetensors.index.json"]
        missing += sorted(s for s in shards if not (folder / s).is_file())
    elif not (folder / "model.safetensors").is_file():
        missing.append("model.safetensors")
    return missing
