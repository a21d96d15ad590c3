"""Grammars: checked without a model, compiled once each, bound once per model.

Contract: a ``Grammar`` (``metrale.engine.api``) becomes llguidance grammar
text here (``grammar_text``), and ``grammar_problem`` says, without any
tokenizer, whether that text compiles: the CLI turns its message into an
error record for the line before any token is generated. A
``GrammarCompiler`` holds one model's tokenizer binding (an
``llguidance.LLTokenizer``, built once, since it walks the whole vocabulary)
and a bounded cache of compiled grammars: each distinct grammar is compiled
once into a matcher at its start state, and each request gets a copy of it
(``start``), which is cheap.

JSON comes out compact (no whitespace between tokens): keys, quotes and
punctuation are then forced by the schema, which the step drafts for free
(``constrained.py``), and a model cannot run on into whitespace. Inside
strings and numbers the model still chooses among every token the grammar
allows.

The library is llguidance: its masks are exact over the tokenizer's bytes, it
rolls a matcher back by any number of tokens, it computes the forced tokens
of a state itself, and its wheel carries no dependencies (docs/structured-outputs.md).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from metrale.engine.api import Grammar

if TYPE_CHECKING:
    import llguidance

# Distinct grammars kept compiled per model; the oldest unused one goes first.
CACHE_SIZE = 256
# Compact JSON: the separators carry no whitespace around them.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar that does not compile; the message says why."""


def json_schema_grammar(schema: dict[str, Any]) -> Grammar:
    """A schema object as a ``Grammar``. Key order is kept: it is the order
    in which the output writes an object's properties."""
    return Grammar("json_schema", json.dumps(schema, ensure_ascii=False))


def choice_grammar(choices: Sequence[str]) -> Grammar:
    return Grammar("choice", json.dumps(list(choices), ensure_ascii=False))


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar text for ``grammar``; raises ``GrammarError`` when
    the source is not even well-formed (a schema that is not JSON)."""
    import llguidance  # here, not at the top: only lines with a grammar pay for it

    try:
        if grammar.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                grammar.source, defaults=_JSON_OPTIONS
            )
        if grammar.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=_JSON_OPTIONS
            )
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar.source)
        return llguidance.grammar_from("choice", grammar.source)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None


@lru_cache(maxsize=CACHE_SIZE)
def grammar_problem(grammar: Grammar) -> str | None:
    """Why ``grammar`` cannot constrain output, or None when it can."""
    if grammar.kind == "choice":
        choices = json.loads(grammar.source)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            return "must be a non-empty list of non-empty strings"
    import llguidance

    try:
        message = llguidance.LLMatcher.validate_grammar(grammar_text(grammar))
    except GrammarError as exc:
        return str(exc)
    return message.strip() or None


class GrammarCompiler:
    """One model's grammar binding and its cache of compiled grammars."""

    def __init__(self, binding: llguidance.LLTokenizer) -> None:
        self.binding = binding
        self._compiled: OrderedDict[Grammar, llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarCompiler:
        """Binds a tokenizer backed by a ``tokenizers.Tokenizer`` (its
        ``backend_tokenizer``: transformers' fast tokenizers and the loader's
        own); ``vocab_size`` is the width of the model's logits (token ids the
        tokenizer lacks are never allowed), and every id in ``eos_token_ids``
        ends the output where the grammar is complete."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise GrammarError("the tokenizer cannot drive a grammar: it has no tokenizer.json")
        import llguidance
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(backend.to_str())  # a copy: padding and truncation off
        plain.no_padding()
        plain.no_truncation()
        try:
            binding = llguidance.LLTokenizer(
                plain.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
            )
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the tokenizer cannot drive a grammar: {exc}") from None
        return cls(binding)

    @property
    def vocab_size(self) -> int:
        return int(self.binding.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.binding.eos_tokens)

    def problem(self, grammar: Grammar) -> str | None:
        """Why ``grammar`` does not compile for this model, or None (it is
        compiled and cached then)."""
        try:
            self._template(grammar)
        except GrammarError as exc:
            return f"invalid {grammar.kind}: {exc}"
        return None

    def start(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A matcher of ``grammar`` at its start state, for one request."""
        return self._template(grammar).deep_copy()

    def _template(self, grammar: Grammar) -> llguidance.LLMatcher:
        template = self._compiled.get(grammar)
        if template is not None:
            self._compiled.move_to_end(grammar)
            return template
        import llguidance

        template = llguidance.LLMatcher(self.binding, grammar_text(grammar), log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        self._compiled[grammar] = template
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return template

    @property
    def cached(self) -> int:
        """Distinct grammars compiled and kept."""
        return len(self._compiled)
