"""The batch engine: model runtime, MTP drafter, KV slots, scheduler, verify.

Public API: build an ``EngineConfig``, load a model with ``load_model`` (or
bring any ``Model``), and call ``Engine(...).generate(requests)``.
``load_model``/``LoadedModel`` are imported on first use, so importing the
engine does not read the model runtime's modules until they are needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metrale.engine.api import Request, RequestStats, Result, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.scheduler import Engine
from metrale.engine.stats import EngineStats

if TYPE_CHECKING:
    from metrale.engine.loader import LoadedModel, load_model

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "LoadedModel",
    "Request",
    "RequestStats",
    "Result",
    "RuntimeConfig",
    "SamplingParams",
    "load_model",
]


def __getattr__(name: str) -> Any:
    if name in ("LoadedModel", "load_model"):
        from metrale.engine import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'metrale.engine' has no attribute {name!r}")
