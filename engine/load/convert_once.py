"""Building a folder once, under a name that means "finished".

Contract: ``convert_once(target, convert)`` returns ``target`` at once when it
holds ``STAMP``; otherwise ``convert`` fills a fresh temporary folder beside
it (writing ``STAMP`` last) and the folder is renamed into place. An
interrupted or failed conversion leaves no folder that looks finished, and
its temporary folder is removed; a stale unstamped ``target`` from an older
attempt is replaced. When two processes convert at once, the first rename
wins and the other returns the winner's folder.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

STAMP = "metrale-converted.json"


def convert_once(target: Path, convert: Callable[[Path], None]) -> Path:
    if (target / STAMP).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    work.chmod(0o755)
    try:
        convert(work)
        if (target / STAMP).exists():  # another process finished first
            return target
        if target.exists():  # a stale, unstamped folder from an older attempt
            shutil.rmtree(target)
        try:
            work.rename(target)
        except OSError:
            if not (target / STAMP).exists():  # not a rename lost to another process
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target
