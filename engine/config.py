"""Engine settings, built once by the CLI and validated here.

Each part of the engine receives only its own settings: the scheduler takes
``EngineConfig``; prompt lookup takes ``metrale.lookup.PromptLookupConfig``;
the model loader takes ``RuntimeConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from metrale.lookup import PromptLookupConfig

# Measured on the default model and its head (sample prompts, greedy): a
# first draft the head gives >= 0.3 is accepted 55% of the time, one below
# 0.3 only 13%, and on a CPU a verify row costs about a tenth of a step.
MTP_MIN_PROB = 0.3


@dataclass(frozen=True)
class MtpLadder:
    """MTP chain length by number of running sequences.

    ``steps`` are ``(max_running, drafts)`` pairs in increasing ``max_running``;
    a batch wider than every step drafts ``beyond`` tokens. The default is the
    seed server's: 3 drafts up to 8 sequences, 2 up to 15, 1 from 16 on.
    """

    steps: tuple[tuple[int, int], ...] = ((8, 3), (15, 2))
    beyond: int = 1

    def __post_init__(self) -> None:
        last = 0
        for max_running, drafts in self.steps:
            if max_running <= last:
                raise ValueError("--mtp-drafts: batch sizes must increase, e.g. '8:3,15:2,1'")
            if drafts < 0:
                raise ValueError("--mtp-drafts: draft counts must be 0 or more")
            last = max_running
        if self.beyond < 0:
            raise ValueError("--mtp-drafts: draft counts must be 0 or more")

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
            raise ValueError("--mtp-drafts: empty ladder")
        try:
            steps = tuple((int(p.split(":")[0]), int(p.split(":")[1])) for p in parts if ":" in p)
            tail = [p for p in parts if ":" not in p]
            if len(tail) > 1 or (tail and parts[-1] != tail[0]):
                raise ValueError
            beyond = int(tail[0]) if tail else steps[-1][1]
        except (ValueError, IndexError) as exc:
            raise ValueError(
                f"--mtp-drafts: cannot parse {text!r}; expected e.g. '8:3,15:2,1' or '3'"
            ) from exc
        return cls(steps=steps, beyond=beyond)


@dataclass(frozen=True)
class SharedLookupSettings:
    """The cross-request cache: ``cache_mb == 0`` turns it off."""

    cache_mb: float = 0.0
    scopes: int = 4

    def __post_init__(self) -> None:
        if self.cache_mb < 0:
            raise ValueError("--prompt-lookup-shared-cache-mb must be 0 (off) or more")
        if self.scopes < 1:
            raise ValueError("--prompt-lookup-shared-cache-scopes must be at least 1")


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler settings. ``prompt_lookup is None`` turns copies off;
    ``mtp is False`` turns the MTP drafter off even when the model has one.
    ``mtp_min_prob``: an MTP chain stops at the first position where the
    module's own distribution has no token at least this likely (0: the
    ladder's full chain always); see ``mtp_drafter.py``."""

    max_batch: int = 16
    prefill_chunk: int = 512
    mtp: bool = True
    mtp_ladder: MtpLadder = field(default_factory=MtpLadder)
    mtp_min_prob: float = MTP_MIN_PROB
    prompt_lookup: PromptLookupConfig | None = field(default_factory=PromptLookupConfig)
    shared_lookup: SharedLookupSettings = field(default_factory=SharedLookupSettings)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("--max-batch must be at least 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill chunk must be at least 1 token")
        if not 0.0 <= self.mtp_min_prob < 1.0:
            raise ValueError("--mtp-min-prob must be in [0, 1)")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the model runs.

    ``device``/``dtype`` of ``None`` pick the defaults (CUDA with bfloat16 when
    available, else the CPU default documented in the README). ``max_len`` of
    ``None`` uses the model's context length, capped by ``kv_budget_mb`` when
    that is set. ``mtp=False`` skips loading MTP layers. ``weights="auto"``
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
    mtp: bool = True
    weights: str = "auto"
    mtp_head: Path | None = None

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError("--max-batch must be at least 1")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError("max_len must be at least 2 tokens")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError("--dtype must be one of float32, bfloat16, float16")
        if self.weights not in ("auto", "dense"):
            raise ValueError("--weights must be auto or dense")
