"""Prompt lookup: copies of earlier tokens as drafts (pure Python, no torch)."""

from metrale.lookup.prompt_lookup import PromptLookupConfig, PromptLookupSeq

__all__ = ["PromptLookupConfig", "PromptLookupSeq"]
