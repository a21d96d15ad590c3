"""What runs on the Ray cluster: the window source and the engine actors.

Contract: the driver puts *windows* (a pickled list of ``Request``s, or
``None`` for the end) on a Ray queue. ``WindowSource`` is a Ray Data source
with one read task that takes windows off that queue, one row each, for as
long as the driver sends them, so the dataset streams an input of any length.
``EngineWorker`` is the callable class of ``map_batches``: each actor loads
the model once and keeps one ``Engine`` decoding on a thread of its own for
its whole life. Several windows are in flight per actor (Ray Data calls it
concurrently), and all of them feed that one engine, so its slots refill from
the next window while a window's slowest request still runs. A call returns
when every request of its window has finished: one output row holding the
window's ``Result``s, the engine's stats snapshot, the actor's key and the
``WorkerCard`` the driver checks its own tokenization limits against.

A worker whose engine raises ends its process, as one killed would: Ray
restarts the actor (a fresh engine) and runs its windows again, which
``ray_tries.py`` turns into bounded tries per line. So a window comes back
once, whole, whatever befalls the workers on the way.

This module imports ray (and, in an actor, torch); the CLI imports it only
when ``--ray`` is given.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from metrale.cli.ray_tries import Gate, Mode, given_up_text
from metrale.engine.api import Request, RequestStats, Result
from metrale.engine.config import EngineConfig, RuntimeConfig

# What the engine takes as "nothing has arrived yet": it decodes what it
# holds, or, holding nothing, waits a moment and asks again.
_NOTHING_YET = None


@dataclass(frozen=True)
class WorkerCard:
    """What a worker's engine accepts, which the driver must agree with: it
    tokenizes and checks each line's length against these."""

    name: str
    eos_token_ids: tuple[int, ...]
    max_len: int


class WindowSource(Datasource):
    """One read task streaming the driver's windows (module doc). ``windows``
    is a ``ray.util.queue.Queue`` handle; ``None`` on it ends the read."""

    def __init__(self, windows: Any) -> None:
        super().__init__()
        self._windows = windows

    def estimate_inmemory_data_size(self) -> int | None:
        return None  # an input of unknown length

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        windows = self._windows

        def read() -> Iterator[pa.Table]:
            while (window := windows.get()) is not None:
                yield pa.table({"window": pa.array([window], type=pa.binary())})

        meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
        return [ReadTask(read, meta)]


class EngineWorker:
    """One actor: a loaded model and its engine (module doc). ``ledger`` is
    the run's ``TryLedger`` actor (None: every window runs shared, as on a
    cluster where no worker dies)."""

    def __init__(
        self,
        model: str | None,
        runtime: RuntimeConfig,
        config: EngineConfig,
        threads: int | None,
        ledger: Any = None,
    ) -> None:
        import torch

        from metrale.engine.engine import Engine
        from metrale.engine.load.loader import load_model

        if threads is not None:
            torch.set_num_threads(threads)
        loaded = load_model(model, runtime)
        self.engine = Engine.from_loaded(loaded, config)
        self.key = uuid.uuid4().hex
        max_len = min([loaded.model.max_len] + [m.max_len for m in loaded.mtp if config.mtp])
        self.card = pickle.dumps(WorkerCard(loaded.name, tuple(loaded.eos_token_ids), max_len))
        self._ledger = ledger
        self._gate = Gate()
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._replies: dict[str, queue.SimpleQueue[Result]] = {}
        self._lock = threading.Lock()
        # Started by the first window, so the engine's clock (its stats'
        # wall_s) counts generation only, as in one process.
        self._thread = threading.Thread(target=self._drive, name="metrale-engine", daemon=True)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        results = [pickle.dumps(self._window(pickle.loads(w))) for w in batch["window"]]
        stats = pickle.dumps(self.engine.stats())
        n = len(results)
        return {
            "results": results,
            "stats": [stats] * n,
            "worker": [self.key] * n,
            "card": [self.card] * n,
        }

    def _window(self, requests: list[Request]) -> list[Result]:
        """A window's results, run as the ledger says (``ray_tries.py``)."""
        if self._ledger is None:
            with self._gate.shared():
                return self._answer(requests)
        ids = [r.request_id for r in requests]
        mode = self._ask("start_window", ids[0])
        if mode is Mode.LINES_ALONE:
            results = [self._alone(request) for request in requests]
        else:
            with self._gate.shared() if mode is Mode.SHARED else self._gate.alone():
                given_up = set(self._ask("start_lines", ids))  # tried once they run
                results = self._answer([r for r in requests if r.request_id not in given_up])
            results += [self._given_up(r) for r in requests if r.request_id in given_up]
        self._ask("finish", ids, ids[0])
        return results

    def _alone(self, request: Request) -> Result:
        """One line with nothing else in the engine, or its error if given up."""
        with self._gate.alone():
            if not self._ask("start_line", request.request_id):
                return self._given_up(request)
            (result,) = self._answer([request])
        self._ask("finish", [request.request_id])
        return result

    def _given_up(self, request: Request) -> Result:
        text = given_up_text(self._ask("max_tries"))
        return Result(
            request.request_id, len(request.prompt_ids), (), "", "error", RequestStats(), text
        )

    def _ask(self, method: str, *args: Any) -> Any:
        return ray.get(getattr(self._ledger, method).remote(*args))

    def _answer(self, requests: list[Request]) -> list[Result]:
        """Hands requests to the engine thread; waits for all their results."""
        reply: queue.SimpleQueue[Result] = queue.SimpleQueue()
        with self._lock:
            if self._thread.ident is None:
                self._thread.start()
            for request in requests:
                self._replies[request.request_id] = reply
                self._inbox.put(request)
        return [reply.get() for _ in requests]

    def _drive(self) -> None:
        """The engine's thread: one endless ``generate`` over the inbox. An
        engine that raises is beyond repair here: the process ends, and Ray
        restarts the actor with a fresh one (module doc)."""
        try:
            for result in self.engine.generate(self._requests()):
                with self._lock:
                    reply = self._replies.pop(result.request_id)
                reply.put(result)
        except BaseException:
            traceback.print_exc()  # into the worker's log
            sys.stderr.flush()
            os._exit(70)

    def _requests(self) -> Iterator[Request | None]:
        """The inbox as the engine reads a slow source: ``None`` whenever no
        request is waiting, so running sequences never wait for the next window."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                yield _NOTHING_YET
