"""Structured outputs inside the step: forced drafts, drafts checked against the
grammar, and acceptance under each verify row's mask.

Owner: the engine loop (``engine.py``), for the sequences whose request has
a grammar (``seq.grammar``). In step order:

1. ``take_forced`` (before the copies): the grammar's forced continuation
   from the state after ``last_token`` becomes the forced run
   (``forced_of``). The MTP
   chain drafted last step stands at the same positions: it goes on after the
   forced run only when its first drafts are the forced tokens (later drafts
   were drawn after those, so after anything else they predict nothing);
   otherwise it is dropped and the sequence may take a copy, as when its
   drafter declines. Copies are proposed after the forced run
   (``copies.py``), cut to the prefix the grammar allows.
2. ``check_drafts`` (before the verify): the drafts become ``forced + (copy or
   MTP chain)``; the matcher walks through them to give each verify row its
   mask, and the first draft the grammar forbids cuts the rest; a copy in
   flight is cut with it (``copies.fit_copy``).
3. ``accept_constrained`` (in the verify): each row chooses its token under
   its mask (greedy: the masked argmax; sampled: drawn from the masked,
   renormalised target with the request's key at the row's position), and
   ``accept_drafts`` keeps the drafts equal to them. A forced draft is the
   only token its row allows, so it is always the chosen one.
4. ``GrammarMatcher.advance`` with the emitted tokens only.

The forced run and the rows' masks are this module's, kept per sequence
for one step: the forced run from ``take_forced`` until the verify is
counted (``clear_forced``), the masks from ``check_drafts`` until
``accept_constrained`` reads them.

Why the output stays exactly plain constrained decoding: every emitted token
is chosen from a row whose mask is the mask at the state of the tokens before
it, as a function of that masked distribution, the key and the position
alone (``acceptance.py``), so the drafts decide only how many rows a verify
settles.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch

from metrale.engine.sampling import sample_at, target_probs
from metrale.engine.sequence import SeqState
from metrale.engine.spec.acceptance import accept_drafts
from metrale.engine.spec.grammar import GrammarError
from metrale.engine.spec.matcher import RowMasks
from metrale.engine.spec.mtp import declined, mark_declined

# Longest forced run drafted in one verify: forced rows are always accepted,
# so the bound only keeps verify widths few.
FORCED_MAX = 16

# Each constrained sequence's forced run and verify rows' masks this step
# (module doc).
_forced: weakref.WeakKeyDictionary[SeqState, list[int]] = weakref.WeakKeyDictionary()
_masks: weakref.WeakKeyDictionary[SeqState, RowMasks] = weakref.WeakKeyDictionary()


def forced_of(seq: SeqState) -> list[int]:
    """``seq``'s forced run this step: the first drafts its verify checks;
    ``[]`` for an unconstrained sequence, or once the verify was counted."""
    return _forced.get(seq, [])


def clear_forced(seq: SeqState) -> None:
    """Ends ``seq``'s forced run: its verify has been counted."""
    _forced.pop(seq, None)


def take_forced(seq: SeqState, enabled: bool) -> None:
    """Sets a constrained sequence's forced run for this step (none when
    ``enabled`` is False) and aligns its MTP chain behind it (module doc)."""
    clear_forced(seq)
    if seq.grammar is None or not enabled:
        return
    forced = seq.grammar.forced(min(FORCED_MAX, seq.draft_capacity()))
    if not forced:
        return
    _forced[seq] = forced
    chain, m = seq.pending_drafts, len(forced)
    if chain[:m] == forced and len(chain) > m:
        seq.set_drafts(chain[m:])
    else:
        # Like a drafter that declined: a copy may stand after the forced run.
        mark_declined(seq, declined(seq) or bool(chain))
        seq.set_drafts([])


def allowed_copy(seq: SeqState, copy: list[int]) -> list[int]:
    """``copy`` (proposed after the forced run) cut at the first token the
    grammar forbids; whole for an unconstrained sequence."""
    if seq.grammar is None:
        return copy
    forced = forced_of(seq)
    return copy[: seq.grammar.allowed_prefix([*forced, *copy]) - len(forced)]


def check_drafts(seq: SeqState) -> None:
    """Makes a constrained sequence's drafts ``forced + the rest``, cut at the
    first forbidden draft, with one mask per verify row (module doc)."""
    grammar = seq.grammar
    assert grammar is not None, "only a constrained sequence is checked"
    forced, rest = forced_of(seq), seq.pending_drafts
    masks, kept = grammar.row_masks([*forced, *rest])
    began = time.perf_counter()
    m = len(forced)
    if kept < m:  # a forced token its own mask forbids: the grammar library's fault
        raise GrammarError(f"forced token {forced[kept]} is not allowed by its own mask")
    seq.set_drafts([*forced, *rest[: kept - m]])
    _masks[seq] = masks
    grammar.spent_s += time.perf_counter() - began


def accept_constrained(
    seq: SeqState,
    logits: torch.Tensor,  # [num_drafts + 1, vocab] the sequence's verify rows
    argmax: Sequence[int],  # [num_drafts + 1] the rows' unmasked argmax
) -> tuple[int, int]:
    """``(accepted, bonus)`` under the masks ``check_drafts`` set (module doc)."""
    masks, grammar = _masks.get(seq), seq.grammar
    assert masks is not None and grammar is not None, "check_drafts runs before the verify"
    began = time.perf_counter()
    try:
        drafts = seq.pending_drafts
        if seq.noise_key is None:
            # Greedy: a row's masked argmax is needed only up to the first miss.
            for row in range(len(drafts) + 1):
                target = masked_argmax(logits[row], masks, row, argmax[row])
                if row == len(drafts) or drafts[row] != target:
                    return row, target
            raise AssertionError("unreachable: the last row always returns")
        allowed = masks.rows().to(logits.device)  # [num_rows, vocab]
        _require_some(masks, range(masks.num_rows))
        masked = logits.masked_fill(~allowed, float("-inf"))  # [num_rows, vocab]
        probs = target_probs(masked, seq.request.params)  # [num_rows, vocab]
        # Row r draws the token at position len(history) + r.
        first, rows = len(seq.history), probs.shape[0]
        chosen = sample_at(probs, [seq.noise_key] * rows, range(first, first + rows))
        return accept_drafts(drafts, chosen)
    finally:
        _masks.pop(seq, None)
        grammar.spent_s += time.perf_counter() - began


def first_token(seq: SeqState, logits: torch.Tensor) -> int:  # logits: [vocab]
    """The token after the prompt, under the grammar's start mask."""
    grammar = seq.grammar
    assert grammar is not None
    masks, _ = grammar.row_masks([])
    began = time.perf_counter()
    try:
        if seq.noise_key is None:
            return masked_argmax(logits, masks, 0, int(logits.argmax()))
        _require_some(masks, [0])
        allowed = masks.rows().to(logits.device)  # [1, vocab]
        probs = target_probs(
            logits[None, :].masked_fill(~allowed, float("-inf")), seq.request.params
        )
        return sample_at(probs, [seq.noise_key], [len(seq.history)])[0]
    finally:
        grammar.spent_s += time.perf_counter() - began


def masked_argmax(
    logits: torch.Tensor,  # [vocab] one row
    masks: RowMasks,
    row: int,
    argmax: int,
) -> int:
    """The argmax among the tokens ``masks[row]`` allows: the plain argmax
    when it is allowed (no mask applied), else the row masked."""
    if masks.allowed(row, argmax):
        return argmax
    _require_some(masks, [row])
    allowed = masks.rows(row, row + 1)[0].to(logits.device)  # [vocab]
    return int(logits.masked_fill(~allowed, float("-inf")).argmax())


def _require_some(masks: RowMasks, rows: Sequence[int] | range) -> None:
    for row in rows:
        if not masks.any_allowed(row):
            raise GrammarError("the grammar allows no token here (an unsatisfiable grammar)")
