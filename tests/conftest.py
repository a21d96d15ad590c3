"""Fixtures the test modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def session_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``$METRALE_HOME`` for the whole session, child processes included: a
    fresh folder, so the draft budget's stored costs (``calibration/``) start
    empty and never reach the user's home, where an earlier run's costs
    would steer this run's tests. Its ``kernels`` and
    ``models`` are the real home's, linked: a kernel build and the default
    model's conversion are the same whoever made them, and slow to redo. A
    test that needs a home of its own still sets the variable itself."""
    from metrale.engine.load.home import metrale_home

    real = metrale_home()
    home = tmp_path_factory.mktemp("metrale-home")
    for shared in ("kernels", "models"):
        (real / shared).mkdir(parents=True, exist_ok=True)
        (home / shared).symlink_to(real / shared, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("METRALE_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny forwards: on a shared 2-core
    machine a second thread only waits for a busy core (an OpenMP barrier
    waiting for a descheduled thread costs milliseconds a call). A module asks
    for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """GGUF conversions go to a fresh folder (the kernels stay in the real
    home), tiny forwards on one thread. A GGUF module asks for it with
    ``pytestmark = pytest.mark.usefixtures("cache_root")``; a test reads the
    folder by naming it."""
    from metrale.engine.load import gguf_cache

    root = tmp_path / "converted"
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: root)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield root
    torch.set_num_threads(threads)
