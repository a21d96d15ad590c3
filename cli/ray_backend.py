"""`metrale generate --ray`: the same run, its engines on a Ray cluster.

Contract: ``open_ray_backend`` gives a ``Backend`` like ``open_backend``'s, so
``run.py`` does everything it does for one process (reading, parsing and
tokenizing lines, error records, ``--resume``, ``--order``, the live view)
and only the engines move. The driver tokenizes, so a bad or too-long line
becomes its error record before anything travels. Requests go out in windows
through a Ray Data pipeline (``ray_worker.py``): a streaming source fed from
the driver, then ``map_batches`` over a fixed pool of actors, one ``Engine``
each (one per GPU; on CPUs ``--ray-workers``, the cluster's CPUs shared
between them as torch threads). Each window comes back once, whole, so every
request is answered exactly once; greedy output equals one process's because
an engine's output never depends on which requests share its batch.

A window closes at ``window`` requests, or sooner when the input has nothing
more ready (a slow pipe), so a conversation driver still gets each answer
before it writes the next line. Results reach the output a window at a time.

A worker lost on the way (its process killed, its node gone, its engine
crashed) is restarted by Ray, which runs its windows again; the run's
``TryLedger`` (``ray_tries.py``) makes those tries bounded per line, so a
line that keeps killing its worker gets an error record
(``--ray-max-retries``) and the job goes on.

Figures: each window's row carries its worker's cumulative ``EngineStats``;
the cluster's are their sum (``cluster_stats.py``), its wall time counted from
the first engine's start (model loading excluded, as in one process).

Nothing here imports ray (or torch) at module level: ``--help`` and usage
errors never load them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from metrale.cli.cluster_stats import WorkerStats
from metrale.cli.options import with_flags
from metrale.cli.ray_feed import Feeder, windows
from metrale.cli.ray_tries import DEFAULT_MAX_RETRIES, TryLedger
from metrale.cli.run import Backend
from metrale.engine.api import Request, Result
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.stats import EngineStats

RAY_INSTALL = "pip install 'metrale[ray]'"
LOCAL = "local"
# Windows each actor works on at once: with a window of a quarter of the
# batch, a batch and a half of requests are in every actor, so its engine
# refills slots while a window's last request runs, and the last windows of
# a job are spread over the actors rather than queued in one.
WINDOWS_PER_WORKER = 6
# How long the run waits for every actor to load its model before the first
# window goes out (a large model on a busy cluster may take minutes).
ACTOR_START_TIMEOUT_S = 1800


def ray_problem() -> str | None:
    """Why ``--ray`` cannot run here (ray or Ray Data missing), or None."""
    missing = [m for m in ("ray", "pyarrow", "pandas") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"needs Ray Data, and {', '.join(missing)} is not installed: {RAY_INSTALL}"


@dataclass(frozen=True)
class RaySettings:
    """``address``: ``"local"`` (this process's Ray, else a new one on this
    machine) or a cluster's (``auto``, ``host:6379``, ``ray://host:10001``);
    ``workers``: engines to start (None: one per GPU, else one);
    ``max_retries``: tries again of a line whose worker died (``ray_tries.py``)."""

    address: str
    workers: int | None = None
    max_retries: int = DEFAULT_MAX_RETRIES

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("ray: give a cluster address or 'local'")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"ray_workers must be at least 1, got {self.workers}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be at least 0, got {self.max_retries}")


@dataclass(frozen=True)
class WorkerPlan:
    """How many actors, what each claims from Ray, and its torch threads."""

    count: int
    num_cpus: float
    num_gpus: float
    threads: int | None
    runtime: RuntimeConfig


def plan_workers(
    requested: int | None, runtime: RuntimeConfig, resources: dict[str, float], node_cpus: int
) -> WorkerPlan:
    """One actor per GPU (``requested`` overrides); on CPUs ``requested`` or
    one, each claiming an equal share of the cluster's CPUs, no more than a
    node holds, and running that many torch threads. ``node_cpus`` is the
    largest node's CPU count. A worker's GPU is its ``cuda`` (Ray sets
    ``CUDA_VISIBLE_DEVICES``), so ``--device cuda:N`` becomes ``cuda``.
    More workers than the cluster can hold is an error naming the flag."""
    gpus = int(resources.get("GPU", 0))
    cpus = int(resources.get("CPU", 0))
    wants_cpu = runtime.device is not None and not runtime.device.startswith("cuda")
    if gpus and not wants_cpu:
        count = requested or gpus
        if count > gpus:
            raise ValueError(f"ray_workers must be at most the cluster's {gpus} GPUs, got {count}")
        device = None if runtime.device is None else "cuda"
        return WorkerPlan(count, 0, 1, None, replace(runtime, device=device))
    count = requested or 1
    if count > cpus:
        raise ValueError(f"ray_workers must be at most the cluster's {cpus} CPUs, got {count}")
    share = max(1, min(cpus // count, node_cpus))
    return WorkerPlan(count, share, 0, share, runtime)


def driver_card(
    model: str | None, runtime: RuntimeConfig, on_gpus: bool = False
) -> tuple[Any, Any, str]:
    """The tokenizer, the ``WorkerCard`` the driver tokenizes by and why its
    ``max_len`` is what it is (``ModelInfo.kv_limit``), read from the
    checkpoint without loading its weights (the driver may hold no GPU, nor
    memory for the model). ``on_gpus``: the workers run on GPUs, so their
    default dtype (bfloat16) is the one a KV budget is counted in."""
    from metrale.cli.ray_worker import WorkerCard
    from metrale.engine.load.checkpoint import read_checkpoint
    from metrale.engine.load.fast_tokenizer import read_tokenizer
    from metrale.engine.load.loader import drafter_of, eos_token_ids, size_cache
    from metrale.engine.load.source import resolve_source
    from metrale.engine.runtime.device import pick_dtype

    resolved = resolve_source(model, runtime.revision)
    checkpoint = read_checkpoint(resolved.folder)
    tokenizer: Any = read_tokenizer(resolved.folder)
    if tokenizer is None:  # as the loader does: transformers for what needs it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(resolved.folder))
    import torch

    # Only a KV budget makes the limit depend on the dtype and the MTP
    # modules; the workers' own cards are checked against this one anyway
    # (GPU workers without --kv-cache-gb or --max-len size their positions
    # from their own free memory, which the driver cannot know).
    cpu = torch.device("cpu")
    dtype = pick_dtype(runtime.dtype, torch.device("cuda") if on_gpus else cpu)
    found, head = drafter_of(checkpoint, runtime, resolved.shipped_head)
    sizing, limit = size_cache(checkpoint, runtime, cpu, dtype, found.count if found else 0, head)
    eos = eos_token_ids(resolved.folder, checkpoint.raw_config, tokenizer)
    return tokenizer, WorkerCard(resolved.name, eos, sizing.max_len), limit


def open_ray_backend(
    settings: RaySettings, model: str | None, runtime: RuntimeConfig, engine: EngineConfig
) -> Backend:
    """Connects to the cluster, plans the workers and reads the tokenizer;
    the actors start when the run does."""
    pipeline = RayPipeline(settings, model, runtime, engine)
    tokenizer, card, limit = driver_card(model, runtime, on_gpus=pipeline.plan.num_gpus > 0)
    pipeline.card = card
    return Backend(
        name=card.name,
        tokenizer=tokenizer,
        eos_token_ids=card.eos_token_ids,
        max_len=card.max_len,
        generate=pipeline.generate,
        stats=pipeline.stats,
        limit=with_flags(limit),
        notes=pipeline.notes,
    )


class RayPipeline:
    """The cluster side of one run (module doc)."""

    def __init__(
        self, settings: RaySettings, model: str | None, runtime: RuntimeConfig, engine: EngineConfig
    ) -> None:
        self.model, self.engine = model, engine
        self.max_retries = settings.max_retries
        self.card: Any = None
        self.owns_ray = _connect(settings.address)
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        node_cpus = max((int(n["Resources"].get("CPU", 0)) for n in nodes), default=1)
        self.plan = plan_workers(settings.workers, runtime, ray.cluster_resources(), node_cpus)
        self.window = max(1, engine.max_batch // 4)
        self._workers = WorkerStats()
        self._checked: set[str] = set()
        self._again, self._given_up = 0, 0

    def stats(self) -> EngineStats:
        return self._workers.total()

    def notes(self) -> list[str]:
        """What became of the windows whose worker died, when any did."""
        if not self._again:
            return []
        return [
            f"windows ran again {self._again} times after the Ray worker running them died; "
            f"{self._given_up} lines given up (--ray-max-retries {self.max_retries}), "
            "their error records in the output"
        ]

    def generate(self, requests: Iterable[Request | None]) -> Iterator[Result]:
        """Results as their windows come back (module doc)."""
        import ray
        from ray.util.queue import Queue

        inbox = Queue(maxsize=2 * WINDOWS_PER_WORKER * self.plan.count)
        feeder = Feeder(windows(requests, self.window), inbox)
        ledger = self._ledger()
        try:
            for batch in self._dataset(inbox, ledger).iter_batches(
                batch_size=None, batch_format="numpy", prefetch_batches=0
            ):
                rows = zip(
                    batch["results"], batch["stats"], batch["worker"], batch["card"], strict=True
                )
                for results, stats, worker, card in rows:
                    self._check(str(worker), card)
                    self._workers.update(str(worker), pickle.loads(stats))
                    yield from pickle.loads(results)
            feeder.finish()
            self._again, self._given_up = ray.get(ledger.counts.remote())
        finally:
            self._workers.freeze()
            feeder.stop()
            ray.kill(ledger)  # a driver that stays (a notebook, a test) keeps no actor
            if self.owns_ray:
                ray.shutdown()

    def _ledger(self) -> Any:
        """The run's ``TryLedger`` actor, on the driver's node: it lives and
        dies with the job, whatever becomes of the workers' nodes."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        actor = ray.remote(TryLedger).options(num_cpus=0, scheduling_strategy=here)
        return actor.remote(self.max_retries)

    def _dataset(self, inbox: Any, ledger: Any) -> Any:
        import ray.data
        from ray.data import ActorPoolStrategy

        from metrale.cli.ray_worker import EngineWorker, WindowSource

        logging.getLogger("ray.data").setLevel(logging.ERROR)  # after Ray Data set it up
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # standard error is the live view's
        context.print_on_execution_start = False
        # Every row (a window) is a block of its own, passed on at once: a
        # window must not wait for others to fill a block.
        context.target_max_block_size = 1
        # All actors loaded before the first window goes out: the first one
        # up would otherwise take a whole short job.
        context.wait_for_min_actors_s = ACTOR_START_TIMEOUT_S
        plan = self.plan
        return ray.data.read_datasource(
            WindowSource(inbox), override_num_blocks=1, num_cpus=0
        ).map_batches(
            EngineWorker,
            fn_constructor_args=(self.model, plan.runtime, self.engine, plan.threads, ledger),
            batch_size=1,
            batch_format="numpy",
            compute=ActorPoolStrategy(
                size=plan.count,
                max_tasks_in_flight_per_actor=WINDOWS_PER_WORKER,
                max_concurrent_calls_per_actor=WINDOWS_PER_WORKER,
                enable_true_multi_threading=True,
            ),
            num_cpus=plan.num_cpus,
            num_gpus=plan.num_gpus,
            # Ray Data's actor pools restart a dead actor and retry its tasks
            # without limit (max_restarts=-1, max_task_retries=-1 by default;
            # the test that kills a worker relies on it): the ledger bounds
            # the tries of each line instead.
        )

    def _check(self, worker: str, card_bytes: bytes) -> None:
        """A worker must tokenize-agree with the driver (same model, same
        metrale): else its limits differ from the ones lines were checked by."""
        if worker in self._checked:
            return
        card = pickle.loads(card_bytes)
        if card != self.card:
            raise RuntimeError(
                f"a Ray worker loaded {card}, the driver {self.card}: give every node the "
                "same model and the same metrale version"
            )
        self._checked.add(worker)


def _connect(address: str) -> bool:
    """Joins the cluster (``local``: this process's Ray if it runs one, else
    a new one); True when this run started Ray and so must shut it down."""
    import ray

    if address == LOCAL and ray.is_initialized():
        return False
    # Ray's own messages would tear through the live view on standard error.
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    kwargs: dict[str, Any] = dict(log_to_driver=False, logging_level=logging.ERROR)
    try:
        if address == LOCAL:
            ray.init(include_dashboard=False, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError) as exc:
        raise ValueError(f"ray: cannot join {address!r}: {exc}") from exc
    return True
