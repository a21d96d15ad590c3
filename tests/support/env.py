"""Environments for the ``metrale`` processes a test starts."""

from __future__ import annotations

import os


def home_env() -> dict[str, str]:
    """``METRALE_HOME`` as this test sees it (``conftest.session_home``): a
    child given a bare environment would otherwise use the user's home."""
    return {"METRALE_HOME": os.environ["METRALE_HOME"]}
