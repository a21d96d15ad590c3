"""Deciding how many drafts a verify keeps: greedy and speculative sampling.

Contract: a verify fed one sequence the rows ``[last_token, d_1 .. d_k]`` and
got back one target row per fed token; row ``i`` predicts the token after
``d_i`` (row 0: after ``last_token``). The functions here return
``(accepted, bonus)``: the first ``accepted`` drafts are kept and ``bonus`` is
the model's own token after them, so a verify always emits ``accepted + 1``
tokens. Both rules are lossless: the emitted tokens are what plain decoding
would give (greedy) or are distributed exactly as plain sampling (sampled),
whatever the drafts were.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from metrale.engine.sampling import draw, uniform


def accept_greedy(draft_ids: Sequence[int], target_ids: Sequence[int]) -> tuple[int, int]:
    """``target_ids`` are the argmax of each row (``len(draft_ids) + 1`` of them).

    Keeps the longest prefix of drafts equal to the model's argmax; the bonus is
    the argmax after that prefix, which is the model's token where the first
    wrong draft stood (or after the last draft when all were right).
    """
    assert len(target_ids) == len(draft_ids) + 1, "one target row per fed token"
    accepted = 0
    for draft, target in zip(draft_ids, target_ids, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted, target_ids[accepted]


def accept_sampled(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor | None,  # [num_drafts, vocab]; None: every draft one-hot (a copy)
    target: torch.Tensor,  # [num_drafts + 1, vocab] target distributions, rows sum to 1
    generator: torch.Generator,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    For draft ``d`` drawn from ``q`` with target ``p`` at the same position:

        accept d      with probability  min(1, p(d) / q(d))
        else emit x ~ norm(max(0, p - q))   and stop

    and after all drafts are accepted emit ``x ~ p_{k+1}``. The token emitted
    at each position is then distributed as ``p`` exactly:
    ``P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) *
    max(0, p(x)-q(x)) / sum_y max(0, p(y)-q(y)) = min(q, p) + max(0, p-q) = p(x)``.

    A copy is a draft whose ``q`` is one-hot on ``d``: it is accepted with
    probability ``p(d)``, and a rejection draws from ``p`` with ``d`` removed.
    """
    num_drafts = len(draft_ids)
    assert target.shape[0] == num_drafts + 1, "one target row per fed token"
    for i, draft in enumerate(draft_ids):
        p = target[i]  # [vocab]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        p_draft = float(p[draft])
        # q_draft > 0 always holds for a draft that was drawn from q; a copy
        # has q_draft == 1.
        if q_draft > 0.0 and uniform(generator) * q_draft < p_draft:
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        mass = float(residual.sum())
        # Rejecting needs p(d) < q(d), which leaves mass in the residual; a
        # float underflow there falls back to p itself.
        return i, draw(residual / mass if mass > 0.0 else p, generator)
    return num_drafts, draw(target[num_drafts], generator)
