"""Fixtures the test modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


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
