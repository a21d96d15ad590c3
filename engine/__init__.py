"""The batch engine: the loop that admits, drafts, verifies and finishes
requests, over a model runtime and its MTP modules.

Public API: build an ``EngineConfig``, load a model with ``load_model`` (or
bring any ``Model``), and call ``Engine(...).generate(requests)``.

Layout by role: the loop and its public types sit here (``engine``, ``api``,
``config``, ``stats``, ``sequence``, ``sampling``), with ``prompts``, the one
way every command turns a prompt or chat messages into ids; ``spec/`` holds
the draft sources and acceptance; ``runtime/`` the model forwards and caches;
``kernels/`` the C kernels; ``load/`` checkpoints and the default model;
``train/`` and
``bench/`` are leaves only the CLI imports. Every name below is imported on
first use, so importing a sub-package (the runtime, say) loads none of the
loop.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from metrale.engine.api import Request, RequestStats, Result, SamplingParams
    from metrale.engine.config import EngineConfig, RuntimeConfig
    from metrale.engine.engine import Engine
    from metrale.engine.load.loader import LoadedModel, load_model
    from metrale.engine.stats import EngineStats

_HOMES = {
    "Engine": "metrale.engine.engine",
    "EngineConfig": "metrale.engine.config",
    "EngineStats": "metrale.engine.stats",
    "LoadedModel": "metrale.engine.load.loader",
    "Request": "metrale.engine.api",
    "RequestStats": "metrale.engine.api",
    "Result": "metrale.engine.api",
    "RuntimeConfig": "metrale.engine.config",
    "SamplingParams": "metrale.engine.api",
    "load_model": "metrale.engine.load.loader",
}

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
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'metrale.engine' has no attribute {name!r}")
    return getattr(import_module(home), name)
