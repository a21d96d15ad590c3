"""The driver's side of the `--ray` input: requests in windows, onto the cluster.

Contract: ``windows`` groups the run's requests lazily (a window never waits
for lines not yet written); ``Feeder`` puts each window, pickled, on the Ray
queue the cluster reads (``ray_worker.WindowSource``) from a thread of its
own, blocking while the queue is full, so the input is read as fast as the
cluster takes it and no faster. Nothing here imports ray: the queue is
handed in.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from metrale.engine.api import Request

_IDLE_S = 0.005  # how long the feeder waits when the input has nothing ready


def windows(requests: Iterable[Request | None], size: int) -> Iterator[list[Request]]:
    """Requests in lists of ``size``; a ``None`` (nothing ready yet) closes
    the list it interrupts, so no request waits for ones not yet written.

    Example: ``[a, b, None, c, d, e]`` in windows of 2 is ``[a, b]``, ``[c, d]``,
    ``[e]``; ``[a, None, None, b]`` is ``[a]``, ``[b]``."""
    window: list[Request] = []
    for request in requests:
        if request is None:
            if window:
                yield window
                window = []
            else:
                time.sleep(_IDLE_S)
            continue
        window.append(request)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


class Feeder:
    """Puts windows on the cluster's queue from a thread of the driver,
    blocking while the queue is full (so the input is read as it is used),
    and ``None`` at the end. An exception the input raises is raised again
    where the results are consumed."""

    def __init__(self, source: Iterator[list[Request]], inbox: Any) -> None:
        self._source, self._inbox = source, inbox
        self._stopped = threading.Event()
        self._problem: BaseException | None = None
        self._thread = threading.Thread(target=self._feed, name="metrale-ray-feed", daemon=True)
        self._thread.start()

    def _feed(self) -> None:
        try:
            for window in self._source:
                data = pickle.dumps(window, protocol=pickle.HIGHEST_PROTOCOL)
                while not self._stopped.is_set():
                    try:
                        self._inbox.put(data, timeout=0.5)
                        break
                    except Exception:  # ray.util.queue.Full: try again unless stopped
                        continue
                if self._stopped.is_set():
                    return
        except BaseException as exc:
            self._problem = exc
        if not self._stopped.is_set():
            self._inbox.put(None)

    def finish(self) -> None:
        self._thread.join()
        if self._problem is not None:
            raise self._problem

    def stop(self) -> None:
        self._stopped.set()
