"""A grammar binding for the fake models' vocabularies: token ids with texts.

Contract: ``Vocabulary(texts)`` gives token ``t`` the text ``texts[t]``; the
ids in ``eos`` are special tokens with no text, which a grammar allows only
where it is complete. ``encode`` splits text greedily into the longest
tokens, which is what llguidance asks of a tokenizer to find the forced
tokens of a state. The binding is the real llguidance one, over this
vocabulary, so the masks the engine sees are the library's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance

from metrale.engine.api import Grammar
from metrale.engine.spec.grammar import GrammarCompiler
from metrale.engine.spec.matcher import GrammarMatcher

# A small JSON-ish vocabulary: punctuation, letters, digits and a few words,
# so forced runs, free strings and numbers all happen; token 0 is EOS.
JSON_TEXTS = (
    "",
    "{",
    "}",
    '"',
    ":",
    ",",
    "a",
    "b",
    "c",
    "1",
    "2",
    "ab",
    "true",
    "false",
    "[",
    "]",
)


@dataclass(frozen=True)
class Vocabulary:
    texts: tuple[str, ...]
    eos: tuple[int, ...] = (0,)

    @property
    def size(self) -> int:
        return len(self.texts)

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        ids, at = [], 0
        while at < len(data):
            best = max(
                (
                    t
                    for t in range(self.size)
                    if t not in self.eos and self._bytes(t) and data.startswith(self._bytes(t), at)
                ),
                key=lambda t: len(self._bytes(t)),
                default=None,
            )
            if best is None:
                raise ValueError(f"no token for {data[at:]!r}")
            ids.append(best)
            at += len(self._bytes(best))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.texts[t] for t in ids if t not in self.eos)

    def _bytes(self, token: int) -> bytes:
        return self.texts[token].encode()

    def compiler(self) -> GrammarCompiler:
        return GrammarCompiler(llguidance.LLTokenizer(_Wrapped(self), n_vocab=self.size))

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        compiler = self.compiler()
        return GrammarMatcher(compiler.start(grammar), compiler.vocab_size)


class _Wrapped(llguidance.TokenizerWrapper):
    """The vocabulary in the shape llguidance's ``TokenizerWrapper`` reads."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.eos_token_id = vocab.eos[0]
        self.bos_token_id = None
        self.tokens = [b"<eos>" if t in vocab.eos else vocab._bytes(t) for t in range(vocab.size)]
        self.special_token_ids = list(vocab.eos)
        self.is_tokenizer_wrapper = True
        self._accepts_bytes = True

    def __call__(self, s: str | bytes) -> list[int]:
        return self.vocab.encode(s)
