"""Engine settings, built once by the CLI and validated here.

Each part of the engine receives only its own settings: the scheduler takes
``EngineConfig``; prompt lookup takes ``metrale.lookup.PromptLookupConfig``;
the model loader takes ``RuntimeConfig``. A message about a bad value names
the setting first, as its field (``max_batch must be at least 1``): the
engine knows no flags, and the CLI says which flag sets that field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from metrale.lookup import PromptLookupConfig, SharedLookupConfig

# A draft the MTP module itself gives less than this is accepted far less
# often than one it is sure of, yet costs the same verify row: the chain
# stops there rather than pay for rows that are mostly thrown away.
MTP_MIN_PROB = 0.3


@dataclass(frozen=True)
class MtpLadder:
    """MTP chain length by number of running sequences.

    ``steps`` are ``(max_running, drafts)`` pairs in increasing ``max_running``;
    a batch wider than every step drafts ``beyond`` tokens. The default drafts
    a chain of 3 while at most 8 sequences run, 2 up to 15, 1 from 16 on: each
    draft costs a verify row per sequence, so the wider the batch, the less a
    long chain that is often cut short is worth.
    """

    steps: tuple[tuple[int, int], ...] = ((8, 3), (15, 2))
    beyond: int = 1

    def __post_init__(self) -> None:
        last = 0
        for max_running, drafts in self.steps:
            if max_running <= last:
                raise ValueError("mtp_ladder: batch sizes must increase, e.g. '8:3,15:2,1'")
            if drafts < 0:
                raise ValueError("mtp_ladder: draft counts must be 0 or more")
            last = max_running
        if self.beyond < 0:
            raise ValueError("mtp_ladder: draft counts must be 0 or more")

    def text(self) -> str:
        """The ladder as ``parse`` reads it: ``"8:3,15:2,1"`` for the default."""
        return ",".join([*(f"{n}:{d}" for n, d in self.steps), str(self.beyond)])

    @property
    def longest(self) -> int:
        """The longest chain any batch size drafts."""
        return max([self.beyond, *(drafts for _, drafts in self.steps)])

    def drafts_for(self, running: int) -> int:
        for max_running, drafts in self.steps:
            if running <= max_running:
                return drafts
        return self.beyond

    @classmethod
    def parse(cls, text: str) -> MtpLadder:
        """Parses ``"8:3,15:2,1"`` (or a single ``"3"`` for every batch size)."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise ValueError("mtp_ladder: empty ladder")
        try:
            steps = tuple((int(p.split(":")[0]), int(p.split(":")[1])) for p in parts if ":" in p)
            tail = [p for p in parts if ":" not in p]
            if len(tail) > 1 or (tail and parts[-1] != tail[0]):
                raise ValueError
            beyond = int(tail[0]) if tail else steps[-1][1]
        except (ValueError, IndexError) as exc:
            raise ValueError(
                f"mtp_ladder: cannot parse {text!r}; expected e.g. '8:3,15:2,1' or '3'"
            ) from exc
        return cls(steps=steps, beyond=beyond)


@dataclass(frozen=True)
class SharedLookupSettings:
    """The cross-request cache: ``cache_mb == 0`` turns it off."""

    cache_mb: float = 0.0
    scopes: int = 4

    def __post_init__(self) -> None:
        if self.cache_mb < 0:
            raise ValueError(f"cache_mb must be 0 (off) or more, got {self.cache_mb}")
        if self.scopes < 1:
            raise ValueError(f"scopes must be at least 1, got {self.scopes}")


class StepPathError(ValueError):
    """``step_path="device"`` for a model the device step cannot run
    (``step/device_verify.py``); the message names the field (``step_path: ...``)."""


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler settings. ``prompt_lookup is None`` turns copies off;
    ``mtp is False`` turns the MTP drafter off even when the model has one.
    ``mtp_min_prob``: an MTP chain stops at the first position where the
    module's own distribution has no token at least this likely (0: the
    ladder's full chain always); see ``mtp_drafter.py``.
    ``forced_drafts``: a constrained request drafts its grammar's forced
    tokens (``spec/constrained.py``); False decodes them one verify each.
    ``prefix_cache``: a new request reuses the longest prompt prefix a slot
    holds (``prefix_cache.py``) where the model can copy one.
    ``draft_policy``: ``"auto"`` sizes each sequence's drafts every step by
    the measured verify cost and live acceptance (``spec/budget.py``);
    ``"fixed"`` keeps the ladder and the copy windows' own lengths.
    ``step_path``: ``"device"`` runs each step's verify, acceptance and MTP
    chain as device tensor ops with one readback (``step/device_verify.py``);
    ``"host"`` the step that decides on the host;
    ``"auto"`` the device step on CUDA, the host step on the CPU."""

    max_batch: int = 16
    prefill_chunk: int = 512
    mtp: bool = True
    mtp_ladder: MtpLadder = field(default_factory=MtpLadder)
    mtp_min_prob: float = MTP_MIN_PROB
    prompt_lookup: PromptLookupConfig | None = field(default_factory=PromptLookupConfig)
    shared_lookup: SharedLookupSettings = field(default_factory=SharedLookupSettings)
    forced_drafts: bool = True
    prefix_cache: bool = True
    draft_policy: str = "auto"
    step_path: str = "auto"
    # Mechanisms of the draft budget turned off, for ablations only
    # (``spec/budget.py``, ``MECHANISMS``; ``make bench-ablation``).
    budget_ablation: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.step_path not in ("auto", "host", "device"):
            raise ValueError(f"step_path must be auto, host or device, got {self.step_path!r}")
        if self.draft_policy not in ("auto", "fixed"):
            raise ValueError(f"draft_policy must be auto or fixed, got {self.draft_policy!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {self.prefill_chunk}")
        if not 0.0 <= self.mtp_min_prob < 1.0:
            raise ValueError(f"mtp_min_prob must be in [0, 1), got {self.mtp_min_prob}")
        self.shared_lookup_config()  # a cache too small for its scopes is refused here

    def shared_lookup_config(self) -> SharedLookupConfig | None:
        """The cross-request cache's settings; None when it is off (no cache
        memory, or prompt lookup off)."""
        settings, lookup = self.shared_lookup, self.prompt_lookup
        if lookup is None or settings.cache_mb <= 0:
            return None
        return SharedLookupConfig(
            cache_mb=settings.cache_mb,
            scopes=settings.scopes,
            ngram=lookup.ngram,
            min_match=lookup.min_match,
        )


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the model runs.

    ``device``/``dtype`` of ``None`` pick the defaults (CUDA with bfloat16 when
    available, else the CPU default documented in docs/models.md). ``max_len`` of
    ``None`` uses the model's context length, capped by ``kv_budget_mb`` when
    that is set. ``kv_cache_gb`` (GiB, main + MTP caches of all slots) sizes
    slots x positions by ``runtime/kv_sizing.py``'s rule; left ``None``, a
    CUDA device gives the cache ``kv_cache_fraction`` of its free memory
    after the weights, and the CPU keeps ``num_slots`` x ``max_len``.
    ``mtp=False`` skips loading MTP layers. ``weights="auto"``
    runs the linear weights a folder also holds packed (``packed.py``) in the
    packed-weight kernel when on the CPU in float32; ``"dense"`` never does.
    ``mtp_head`` is a head written by ``metrale train-mtp`` (its stem, either
    file, or a folder holding one): it drafts instead of the checkpoint's own
    MTP layers, or of the head shipped with the default model.
    """

    device: str | None = None
    dtype: str | None = None
    num_slots: int = 16
    max_len: int | None = None
    kv_budget_mb: float | None = None
    kv_cache_gb: float | None = None
    kv_cache_fraction: float = 0.9
    mtp: bool = True
    weights: str = "auto"
    mtp_head: Path | None = None
    revision: str | None = None  # a hub id's branch, tag or commit (None: its main)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {self.num_slots}")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len must be at least 2, got {self.max_len}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be more than 0, got {self.kv_cache_gb}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kv_cache_gb is not None and self.kv_budget_mb is not None:
            raise ValueError("kv_cache_gb: set it or kv_budget_mb, not both")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {self.dtype!r}")
        if self.weights not in ("auto", "dense"):
            raise ValueError(f"weights must be auto or dense, got {self.weights!r}")
