"""What a model source names, and the checkpoint folder it comes to.

Contract: ``resolve_source(source, revision)`` returns the HF-style folder
the loader reads, the model's name, and where it came from (``origin``, as
``metrale info`` shows it). ``source`` is read as, in this order:

1. ``None``: the embedded default model (``default_model.py``);
2. an existing folder: a checkpoint folder, read in place;
3. an existing file: a GGUF (it starts with the ``GGUF`` magic), converted
   once into ``$METRALE_HOME`` (``gguf_cache.py``); any other file is refused,
   and so is a damaged GGUF, named with its fault (``file_checks.py``);
4. ``owner/name`` that exists nowhere on disk: a hub id, found in the
   Hugging Face cache or fetched into it (``hub.py``);
5. anything else (``./models/x``, ``/abs/path``, ``x.gguf``, ``name``): no
   such folder or file.

An existing path always wins over a hub id of the same spelling. ``revision``
(a branch, tag or commit) belongs to a hub id; with any other source it is
refused rather than ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from metrale.engine.runtime.arch import CheckpointError

Kind = Literal["default", "folder", "gguf", "hub"]
HEADS_DIR = Path(__file__).parents[1] / "heads"  # the MTP heads shipped with metrale
GGUF_MAGIC = b"GGUF"
# huggingface_hub's repo id: [owner/]name of word characters, '-' and '.',
# at most 96 characters, no '--' or '..'; metrale asks for the owner.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


@dataclass(frozen=True)
class ResolvedSource:
    kind: Kind
    folder: Path  # config.json + safetensors + tokenizer
    name: str  # the model's name in results and reports
    origin: str  # "hub owner/name@main (commit ...)", "gguf file ...", ...
    shipped_head: Path | None = None  # the MTP head shipped for it (the default model)


def source_kind(source: str | Path | None) -> Kind:
    """Which of the contract's sources ``source`` is; ``CheckpointError``
    for one that is none of them."""
    if source is None:
        return "default"
    path = Path(source).expanduser()
    if path.is_dir():
        return "folder"
    if path.is_file():
        if _starts_with_magic(path):
            return "gguf"
        raise CheckpointError(
            f"model {str(source)!r} is a file but not a GGUF; pass a checkpoint folder "
            "(config.json + *.safetensors), a .gguf file or a hub id (owner/name)"
        )
    if isinstance(source, str) and is_hub_id(source):
        return "hub"
    raise CheckpointError(
        f"model {str(source)!r} is not a checkpoint folder, a GGUF file or a hub id "
        "(owner/name): no such folder or file"
    )


def is_hub_id(text: str) -> bool:
    """``owner/name`` as the hub spells ids (not a path: no leading ``.``,
    ``/`` or ``~``, one slash, no ``..`` or ``--``, not a ``.gguf`` name)."""
    return (
        _HUB_ID.fullmatch(text) is not None
        and len(text) <= 96
        and ".." not in text
        and "--" not in text
        and not text.lower().endswith(".gguf")
    )


def resolve_source(source: str | Path | None, revision: str | None) -> ResolvedSource:
    kind = source_kind(source)
    if revision is not None and kind != "hub":
        what = {
            "default": "the embedded default model",
            "folder": "a folder",
            "gguf": "a GGUF file",
        }
        raise CheckpointError(f"revision: applies to a hub id (owner/name), not to {what[kind]}")
    if kind == "default":
        return _default()
    assert source is not None
    path = Path(source).expanduser()
    if kind == "folder":
        resolved = path.resolve()
        return ResolvedSource(kind, path, resolved.name, f"folder {resolved}")
    if kind == "gguf":
        folder = _converted(path)
        origin = f"gguf file {path.resolve()} (converted into {folder})"
        return ResolvedSource(kind, folder, path.stem, origin)
    from metrale.engine.load.hub import hub_snapshot

    snapshot = hub_snapshot(str(source), revision)
    origin = f"hub {snapshot.repo_id}@{snapshot.revision} (commit {snapshot.commit})"
    return ResolvedSource(kind, snapshot.folder, snapshot.repo_id, origin)


def _converted(path: Path) -> Path:
    """The folder converted from a GGUF file. A conversion that fails on a
    damaged file says what the damage is rather than where the converter
    tripped over it (the framing is read only then: a sound file costs
    nothing more)."""
    from metrale.engine.load.file_checks import gguf_problem
    from metrale.engine.load.gguf_cache import ensure_gguf_model

    try:
        return ensure_gguf_model(path)
    except CheckpointError as exc:
        problem = gguf_problem(path)
        if problem is None:
            raise
        raise CheckpointError(problem) from exc


def _default() -> ResolvedSource:
    from metrale.engine.load.default_model import (
        DISTRIBUTION,
        GGUF_NAME,
        MODEL_NAME,
        VERSION,
        ensure_default_model,
    )

    origin = f"embedded default ({GGUF_NAME} from {DISTRIBUTION} {VERSION})"
    folder = ensure_default_model()
    return ResolvedSource("default", folder, MODEL_NAME, origin, HEADS_DIR / MODEL_NAME)


def _starts_with_magic(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False
