"""Deciding how many drafts a verify keeps: greedy and speculative sampling.

Contract: a verify fed one sequence the rows ``[last_token, d_1 .. d_k]`` and
got back one target row per fed token; row ``i`` predicts the token after
``d_i`` (row 0: after ``last_token``). The functions here return
``(accepted, bonus)``: the first ``accepted`` drafts are kept and ``bonus`` is
the model's own token after them, so a verify always emits ``accepted + 1``
tokens. ``accept_sampled_with`` is the sampled rule with its uniforms handed
in: the scalar statement of what ``device_accept.accept_sampled_rows`` does to
each row, so the two give the same tokens from the same uniforms. The rules
are lossless: the emitted tokens are what plain decoding would give (greedy)
or are distributed exactly as plain sampling (sampled), whatever the drafts
were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    rejected, residual = _first_rejection(
        draft_ids, draft_probs, target, lambda _: uniform(generator)
    )
    if residual is None:
        return rejected, draw(target[rejected], generator)
    mass = float(residual.sum())
    # Rejecting needs p(d) < q(d), which leaves mass in the residual; a
    # float underflow there falls back to p itself.
    return rejected, draw(residual / mass if mass > 0.0 else target[rejected], generator)


def accept_sampled_with(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor | None,  # [num_drafts, vocab]; None: every draft one-hot (a copy)
    target: torch.Tensor,  # [num_drafts + 1, vocab] target distributions
    accept_u: Sequence[float],  # one U[0, 1) draw a draft (at least num_drafts)
    draw_u: float,  # the U[0, 1) draw of the emitted token
) -> tuple[int, int]:
    """``accept_sampled`` with its uniforms given instead of a generator.

    Draft ``i`` is tested with ``accept_u[i]``, and the emitted token is drawn
    by inverse CDF with ``draw_u`` (``draw_inverse_cdf``) from the
    unnormalised residual, which is the same distribution as drawing from the
    normalised one.
    """
    assert len(accept_u) >= len(draft_ids), "one uniform a draft"
    rejected, residual = _first_rejection(draft_ids, draft_probs, target, accept_u.__getitem__)
    if residual is None or float(residual.sum()) <= 0.0:
        return rejected, draw_inverse_cdf(target[rejected], draw_u)
    return rejected, draw_inverse_cdf(residual, draw_u)


def _first_rejection(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor | None,  # [num_drafts, vocab]; None: every draft one-hot
    target: torch.Tensor,  # [num_drafts + 1, vocab]
    uniform_at: Callable[[int], float],  # draft i's U[0, 1) draw, asked for in order
) -> tuple[int, torch.Tensor | None]:
    """The rule both callers share: the first draft the test ``u * q(d) <
    p(d)`` rejects and the residual ``max(0, p - q)`` it leaves (``p`` with
    ``d`` removed for a one-hot copy); ``(num_drafts, None)`` when every
    draft is kept. ``q(d) > 0`` holds for a draft drawn from ``q``; a copy
    has ``q(d) == 1``."""
    num_drafts = len(draft_ids)
    assert target.shape[0] == num_drafts + 1, "one target row per fed token"
    for i, draft in enumerate(draft_ids):
        p = target[i]  # [vocab]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        if q_draft > 0.0 and uniform_at(i) * q_draft < float(p[draft]):
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        return i, residual
    return num_drafts, None


def draw_inverse_cdf(
    probs: torch.Tensor,  # [vocab] float32, non-negative, need not sum to 1
    u: float,  # U[0, 1)
) -> int:
    """The first token of positive probability whose cumulative sum exceeds
    ``u * total``; the last token of positive probability when none does
    (``u`` rounded up to 1). The threshold is a float32 product, as on the
    device."""
    cdf = torch.cumsum(probs, dim=0)  # [vocab]
    threshold = cdf[-1] * torch.tensor(u, dtype=torch.float32)  # 0-d
    positive = probs > 0  # [vocab]
    above = torch.nonzero((cdf > threshold) & positive)  # [num_above, 1]
    if above.numel() > 0:
        return int(above[0, 0])
    last = torch.nonzero(positive)  # [num_positive, 1]
    assert last.numel() > 0, "a draw needs some probability mass"
    return int(last[-1, 0])
