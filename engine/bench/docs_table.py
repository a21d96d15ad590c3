"""Benchmark figures into ``docs/``: one Markdown section per ``make`` target, stamped.

Contract: standard library only (``cli`` and the stand-alone benchmarks both
call it). A section runs from its ``## heading`` line to the next line that
starts with ``## `` (or the end of the file), and holds two parts: a
*description* a person wrote (what the target measures, how to read it) and
the *figures* a benchmark wrote, which begin at the first line that starts
with ``Machine:`` (a ``stamp()``) or reads ``No stamped figures yet.``.
``write_section`` replaces the figures only, so a new run never drops the
description, and it leaves every other section byte for byte as it was.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

from metrale.engine.runtime.device import cpu_info

STAMP_PREFIX = "Machine:"
PLACEHOLDER = "No stamped figures yet."
REPO = Path(__file__).resolve().parent.parent.parent


def stamp() -> str:
    """Where and when figures were taken, in the form the docs already use:
    ``Machine: 2-core AMD EPYC VM. Date: 2026-12-03. Commit: 04cdedc-dirty.``
    (``-dirty``: tracked files differ from the commit, so the figures may
    come from code no commit holds)."""
    today = datetime.date.today().isoformat()
    return f"{STAMP_PREFIX} {machine()}. Date: {today}. Commit: {commit()}."


def machine() -> str:
    """``N-core MODEL``, with ``VM`` under a hypervisor and ``(AVX-512)`` when
    the CPU has it (the packed kernel's widest path), from ``/proc/cpuinfo``."""
    model, flags = cpu_info()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    vm = " VM" if "hypervisor" in flags else ""
    avx512 = " (AVX-512)" if "avx512f" in flags else ""
    return f"{cores}-core {model}{vm}{avx512}"


def commit() -> str:
    """``git rev-parse --short HEAD`` of this checkout, ``-dirty`` when a
    tracked file differs from it; ``unknown`` outside a git checkout."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
        )
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def write_section(path: Path, heading: str, body: str, description: str = "") -> None:
    """Put ``body`` (figures: a ``stamp()`` line first) under ``## heading`` in ``path``.

    An existing section keeps its heading and description, and its figures
    are replaced by ``body``; a section with no figures yet gets ``body``
    after its text. A missing section is appended at the end of the file as
    the heading, ``description`` (if any) and ``body``; a missing file is
    created. The file is replaced in one rename, so a reader never sees half
    of it. For example, ``write_section(p, "a", "Machine: new.\\n| 2 |")``
    on a file holding::

        ## a                          ## a

        What a is.          becomes   What a is.

        Machine: old.                 Machine: new.
        | 1 |                         | 2 |

        ## b                          ## b
    """
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines(keepends=True)
    title = f"## {heading}"
    figures = body.strip("\n") + "\n"
    start = next((i for i, line in enumerate(lines) if line.rstrip("\r\n") == title), None)
    if start is None:
        parts = (
            [title, description.strip("\n"), figures] if description.strip() else [title, figures]
        )
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + "\n\n".join(parts)
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        cut = next((i for i in range(start + 1, end) if _is_figures(lines[i])), end)
        kept = "".join(lines[start:cut]).rstrip("\n") + "\n\n"
        after = "".join(lines[end:])
        text = "".join(lines[:start]) + kept + figures + ("\n" + after if after else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(text)
    os.replace(scratch, path)


def _is_figures(line: str) -> bool:
    return line.startswith(STAMP_PREFIX) or line.strip() == PLACEHOLDER
