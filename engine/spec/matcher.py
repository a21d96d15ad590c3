"""One request's grammar state: what it has emitted, and what may come next.

Contract (owned by the sequence, one ``GrammarMatcher`` per constrained
request): the matcher has consumed exactly the tokens the request emitted,
``last_token`` included, and nothing else. ``forced`` reads the state's
forced continuation without moving it; ``row_masks`` walks through a
verify's drafts to give each verify row its mask and then rolls back every
draft it walked through; only ``advance``, with the tokens a verify (or the
prefill) really emitted, moves it. So a rejected draft never leaves a trace:
after a verify the state is the state after the accepted prefix and the
bonus token, however many drafts were walked.

A mask row is llguidance's bitmask: ``int32`` words, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. The EOS tokens of the binding are
allowed exactly where the grammar is complete, so an output that ends on EOS
is complete.

``spent_s`` adds up the time spent on this request's grammar, here and in
``constrained.py`` (applying the masks), for the figures.

``ModelGrammars`` is the engine's side: it says at admission why a
request's grammar cannot run, and starts each admitted request's matcher.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
import torch

from metrale.engine.api import Grammar, Request
from metrale.engine.spec.grammar import GrammarCompiler, GrammarError


@dataclass
class RowMasks:
    """The masks of one sequence's verify rows: row ``i`` holds the tokens the
    grammar allows after ``last_token`` and the first ``i`` drafts."""

    bits: np.ndarray  # [num_rows, words] int32
    vocab_size: int

    @property
    def num_rows(self) -> int:
        return int(self.bits.shape[0])

    def allowed(self, row: int, token: int) -> bool:
        return _bit(self.bits, row, token, self.vocab_size)

    def any_allowed(self, row: int) -> bool:
        return bool(self.bits[row].any())

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start..stop`` as booleans: ``[num, vocab_size]``."""
        words = np.ascontiguousarray(self.bits[start:stop]).view(np.uint8)  # [num, 4 * words]
        flags = np.unpackbits(words, axis=1, bitorder="little")[:, : self.vocab_size]
        return torch.from_numpy(flags).bool()


def _bit(bits: np.ndarray, row: int, token: int, vocab_size: int) -> bool:
    """Whether ``bits[row]`` (``[rows, words]`` int32) allows ``token``."""
    if not 0 <= token < vocab_size:
        return False
    return bool((int(bits[row, token >> 5]) >> (token & 31)) & 1)


class GrammarMatcher:
    """A request's llguidance matcher, moved only by emitted tokens (module doc)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.spent_s = 0.0

    @property
    def complete(self) -> bool:
        """The tokens emitted so far are a whole sentence of the grammar."""
        return bool(self._matcher.is_accepting())

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar alone determines from here: at
        each, its mask allows that one token and nothing else."""
        if limit <= 0:
            return []
        began = time.perf_counter()
        try:
            tokens = [int(t) for t in self._matcher.compute_ff_tokens()[:limit]]
            self._raise_if_broken()
        finally:
            self.spent_s += time.perf_counter() - began
        return tokens

    def allowed_prefix(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts``, in order, the grammar allows from here
        (the state does not move)."""
        began = time.perf_counter()
        count = int(self._matcher.validate_tokens(list(drafts))) if drafts else 0
        self.spent_s += time.perf_counter() - began
        return count

    def row_masks(self, drafts: Sequence[int]) -> tuple[RowMasks, int]:
        """Masks along ``drafts`` and how many of them the grammar allows:
        rows ``0..kept`` are filled, row ``i`` being the mask after the first
        ``i`` drafts; ``drafts[kept]``, if any, is the first one forbidden, or
        follows the draft that ended the grammar (EOS). The state is rolled
        back to where it was."""
        began = time.perf_counter()
        bits = np.zeros((len(drafts) + 1, self.words), dtype=np.int32)  # [rows, words]
        kept = 0
        try:
            for row in range(len(drafts) + 1):
                llguidance.numpy.fill_next_token_bitmask(self._matcher, bits, row)
                self._raise_if_broken()
                if row == len(drafts):
                    break
                token = drafts[row]
                if not _bit(bits, row, token, self.vocab_size):
                    break
                if not self._matcher.consume_token(token):
                    raise GrammarError(
                        f"a token its mask allowed failed: {self._matcher.get_error()}"
                    )
                kept += 1
                if self._matcher.is_stopped():
                    # An EOS (or the grammar's end): nothing after it is
                    # emitted, and a stopped matcher counts no further token,
                    # so walking on would make the rollback undo too much.
                    llguidance.numpy.fill_next_token_bitmask(self._matcher, bits, kept)
                    break
        finally:
            if kept:
                self._matcher.rollback(kept)
            self.spent_s += time.perf_counter() - began
        return RowMasks(bits[: kept + 1], self.vocab_size), kept

    def _raise_if_broken(self) -> None:
        # A matcher in its error state only ever allows EOS, which would end
        # the output "complete" where it is not: the request fails instead.
        if self._matcher.is_error():
            raise GrammarError(f"the grammar cannot go on: {self._matcher.get_error()[:500]}")

    def advance(self, tokens: Sequence[int]) -> None:
        """Consumes tokens the request emitted; a token the grammar forbids
        means the engine broke its contract, and raises ``GrammarError``."""
        if not tokens:
            return
        began = time.perf_counter()
        try:
            if not self._matcher.consume_tokens(list(tokens)):
                raise GrammarError(f"emitted tokens left the grammar: {self._matcher.get_error()}")
        finally:
            self.spent_s += time.perf_counter() - began

    def state(self) -> tuple[bytes, bytes, bool]:
        """A fingerprint of the state for tests: its mask, its forced bytes
        and whether it is complete."""
        bits = np.zeros((1, self.words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bits, 0)
        return bits.tobytes(), bytes(self._matcher.compute_ff_bytes()), self.complete


class ModelGrammars:
    """The grammars of one engine's requests: the model's tokenizer is bound
    to the grammar engine once, when the first request with a grammar comes
    (``compiler`` brings a binding instead); a tokenizer that cannot be
    bound fails each such request with the reason, never the run."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        compiler: GrammarCompiler | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._compiler = compiler
        self._problem: str | None = None

    def rejection(self, request: Request) -> str | None:
        """Why ``request``'s grammar cannot run here: no binding for this
        tokenizer, a stop string beside it (it would cut the output), or a
        grammar that does not compile. None for a request without one."""
        if request.grammar is None:
            return None
        if request.params.stop:
            return "stop strings cannot be combined with a grammar (they would cut the output)"
        if self._compiler is None and self._problem is None:
            try:
                self._compiler = GrammarCompiler.for_tokenizer(
                    self._tokenizer, self._vocab_size, self._eos
                )
            except GrammarError as exc:
                self._problem = str(exc)
        if self._compiler is None:
            return self._problem
        return self._compiler.problem(request.grammar)

    def matcher(self, grammar: Grammar | None) -> GrammarMatcher | None:
        """A new matcher at ``grammar``'s start, for a request ``rejection``
        passed."""
        if grammar is None:
            return None
        assert self._compiler is not None, "rejection bound the grammar engine"
        return GrammarMatcher(self._compiler.start(grammar), self._compiler.vocab_size)
