"""Where metrale keeps what it builds once: converted models and compiled kernels.

Contract: ``metrale_home()`` is ``$METRALE_HOME``, else ``~/.cache/metrale``.
This module imports nothing of metrale, so the kernel binding below the
runtime can reach it without importing the loader above it.
"""

from __future__ import annotations

import os
from pathlib import Path


def metrale_home() -> Path:
    return Path(os.environ.get("METRALE_HOME") or Path.home() / ".cache" / "metrale")
