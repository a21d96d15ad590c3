"""A user's GGUF file, converted once into ``$METRALE_HOME``.

Contract: ``ensure_gguf_model(path)`` returns the HF-style folder converted
from ``path`` (``gguf_convert.py``), converting it first when no finished
folder exists for the file as it is now. The folder is
``$METRALE_HOME/models/gguf/<stem>-<key>``, where ``key`` is a hash of the
file's identity: its resolved path, byte size and modification time (in
nanoseconds), and ``CONVERTER``. Editing, replacing or touching the file
gives a new key, so a stale conversion is never used; the folders earlier
keys left for the same path are then removed. Reading the key costs one
``stat``, so a second run starts at once. A file that cannot be converted
raises ``GgufError``; nothing is left behind.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from metrale.engine.load.convert_once import STAMP, convert_once
from metrale.engine.load.gguf_config import GgufError
from metrale.engine.load.gguf_convert import convert_gguf
from metrale.engine.load.home import metrale_home

# Bumped when the folder a conversion writes changes, so older ones are redone.
CONVERTER = 2


def gguf_cache_root() -> Path:
    return metrale_home() / "models" / "gguf"


def identity(gguf_path: Path) -> dict[str, Any]:
    """What the cache key is a hash of; also the folder's stamp."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    return {
        "source": str(resolved),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter": CONVERTER,
    }


def gguf_model_dir(gguf_path: Path) -> Path:
    facts = identity(gguf_path)
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf_path.stem)[:64] or "model"
    return gguf_cache_root() / f"{stem}-{key}"


def ensure_gguf_model(gguf_path: Path) -> Path:
    target = gguf_model_dir(gguf_path)
    if (target / STAMP).exists():
        return target
    facts = identity(gguf_path)
    print(f"metrale: converting {gguf_path} once into {target}", file=sys.stderr)
    try:
        convert_once(target, lambda work: convert_gguf(gguf_path, work, facts))
    except GgufError:
        raise
    except Exception as exc:
        raise GgufError(
            f"cannot convert {gguf_path} ({type(exc).__name__}: {exc}); "
            "the file may be truncated or not a GGUF model"
        ) from exc
    _remove_older(target, facts["source"])
    return target


def _remove_older(current: Path, source: str) -> None:
    """Removes the finished folders converted from ``source`` under other keys
    (an earlier version of the file): best effort, as each can be large."""
    for folder in current.parent.iterdir():
        stamp = folder / STAMP
        if folder == current or not stamp.is_file():
            continue
        try:
            if json.loads(stamp.read_text()).get("source") == source:
                shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):
            continue
