"""Prompt lookup: copies of earlier tokens as drafts (pure Python, no torch).

``PromptLookupSeq`` serves one sequence from its own history; ``SharedLookup``
serves copies from recent finished requests of the same scope; ``LookupStats``
holds the run-wide counters of verified copies.
"""

from metrale.lookup.prompt_lookup import Fallback, PromptLookupConfig, PromptLookupSeq
from metrale.lookup.shared import (
    DEDUP_RUN,
    MIN_SCOPE_TOKENS,
    ScopeKey,
    SharedLookup,
    SharedLookupConfig,
)
from metrale.lookup.stats import CopyCounts, LookupStats

__all__ = [
    "DEDUP_RUN",
    "MIN_SCOPE_TOKENS",
    "CopyCounts",
    "Fallback",
    "LookupStats",
    "PromptLookupConfig",
    "PromptLookupSeq",
    "ScopeKey",
    "SharedLookup",
    "SharedLookupConfig",
]
