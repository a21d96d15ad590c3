"""Prompt lookup: copies of earlier tokens as drafts (pure Python, no torch)."""

from metrale.lookup.prompt_lookup import PromptLookupConfig

__all__ = ["PromptLookupConfig"]
