"""Deciding how many drafts a verify keeps: one rule, greedy or sampled.

Contract: a verify fed one sequence the rows ``[last_token, d_1 .. d_k]``; row
``i`` predicts the token after ``d_i`` (row 0: after ``last_token``), and the
step chose one token a row: the token the sequence emits at that row's
position if it gets there. Greedy: the argmax. Sampled: ``sampling.
sample_rows``, a pure function of the request's noise key, the position and
the target distribution. Under a grammar: either, over the row's masked
distribution (``constrained.py``). ``accept_drafts`` keeps the longest prefix
of drafts equal to the chosen tokens and returns ``(accepted, bonus)``, the
bonus being the chosen token after that prefix, so a verify always emits
``accepted + 1`` tokens. ``device_accept.accept_rows`` is the same rule on a
padded batch.

Why the output is plain decoding's, token for token, whatever the drafts:
the token chosen at a position depends only on the tokens before it (through
the distribution), the key and the position. A kept draft equals the token
plain decoding emits there, so the rows after it see plain decoding's prefix,
and the bonus is plain decoding's next token. Drafts change how many
positions a verify settles, never which token a position gets.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_drafts(draft_ids: Sequence[int], chosen_ids: Sequence[int]) -> tuple[int, int]:
    """``chosen_ids`` are each row's chosen token (``len(draft_ids) + 1`` of them).

    Keeps the longest prefix of drafts equal to the chosen tokens; the bonus
    is the chosen token after that prefix: the sequence's own token where the
    first wrong draft stood (or after the last draft when all were right).
    """
    assert len(chosen_ids) == len(draft_ids) + 1, "one chosen token per fed row"
    accepted = 0
    for draft, chosen in zip(draft_ids, chosen_ids, strict=False):
        if draft != chosen:
            break
        accepted += 1
    return accepted, chosen_ids[accepted]
