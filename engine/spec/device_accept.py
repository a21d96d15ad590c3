"""Acceptance of a whole batch's drafts as tensor ops, with no host sync.

Contract: a device-style verify feeds ``B`` slots padded to a static width
``W``. ``tokens[b]`` holds the slot's last token then its drafts, valid up to
``widths[b]`` rows (``0 <= widths[b] <= W``; 0 is an inactive slot, whose
outputs are meaningless but well-formed, with ``accepted == 0``); padding must
still be token ids in ``[0, vocab)``. Row ``r`` of ``argmax``/``target``
predicts the token after ``tokens[b, r]``. Every function here is pure: no
``.item()``, no transfer, no Python loop over rows or vocabulary, so it runs
on any device and under ``torch.inference_mode``.

The rules are those of ``acceptance``: ``accept_greedy_rows`` is
``accept_greedy`` on each row and ``accept_sampled_rows`` is
``accept_sampled_with`` on each row, given the same uniforms. The uniforms come
from ``request_uniforms``: each request's own generator, which the device path
makes on the model's device (``torch.Generator(device=model.device)``, seeded
from ``SamplingParams.seed``), so a request's draws depend on its seed and its
own history only. A step takes a fixed number of uniforms (one a draft
position, one for the emitted token) whatever it accepts, so the stream is not
the host path's: the same seed gives the same distribution there, not the
same sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceAccepted:
    """One verify's outcome for a batch: slot ``b`` keeps ``accepted[b]``
    drafts and emits ``emitted[b, : accepted[b] + 1]`` (the kept drafts then
    the bonus token), so an active slot emits ``accepted + 1`` tokens. What
    ``emitted`` holds beyond that is said by the function that made it."""

    accepted: torch.Tensor  # [B] int64
    emitted: torch.Tensor  # [B, W] int64


def accept_greedy_rows(
    tokens: torch.Tensor,  # [B, W] int64: last token, then drafts
    widths: torch.Tensor,  # [B] int64: valid rows of each slot
    argmax: torch.Tensor,  # [B, W] int64: the model's argmax after each row
) -> DeviceAccepted:
    """Keeps the longest prefix of drafts equal to the argmax.

    ``emitted`` is ``argmax`` itself: each kept draft equals the argmax of
    the row before it, and the bonus is the argmax after the last one.
    """
    valid = _valid_drafts(widths, tokens.shape[1])  # [B, W-1]
    matches = (tokens[:, 1:] == argmax[:, :-1]) & valid  # [B, W-1]
    return DeviceAccepted(accepted=_prefix_length(matches), emitted=argmax)


def accept_sampled_rows(
    tokens: torch.Tensor,  # [B, W] int64: last token, then drafts
    widths: torch.Tensor,  # [B] int64: valid rows of each slot
    draft_probs: torch.Tensor | None,  # [B, W-1, V] q of each draft; None: all one-hot
    one_hot: torch.Tensor,  # [B] bool: the slot's drafts are copies (q one-hot on the draft)
    target: torch.Tensor,  # [B, W, V] p of each row, rows sum to 1
    accept_u: torch.Tensor,  # [B, W-1] float32 U[0, 1): one a draft position
    draw_u: torch.Tensor,  # [B] float32 U[0, 1): the emitted token's draw
) -> DeviceAccepted:
    """Speculative sampling on every row (the rule ``accept_sampled`` states).

    Draft ``d`` at position ``i`` with ``q = draft_probs[b, i]`` (one-hot on
    ``d`` for a copy) and ``p = target[b, i]``:

        accept d   when  q(d) > 0 and accept_u * q(d) < p(d)
        else emit  x ~ norm(max(0, p - q))   (a copy: p with d removed; p itself
                                              when that has no mass) and stop

    and when every valid draft is kept, ``x ~ target[b, widths - 1]``. Either
    way ``x`` is drawn from row ``accepted`` of the target, so one gather
    serves both. A greedy slot passes a one-hot target
    (``target_probs_rows`` at temperature 0): it accepts a draft exactly when
    it is the argmax (given ``q(d) > 0``, which a copy and any drawn draft
    have) and emits the argmax, which is ``accept_greedy``.

    ``emitted[b, r]`` beyond the bonus holds ``tokens[b, r + 1]`` (the drafts
    after the rejected one), and its last column the bonus.
    """
    batch, width = tokens.shape
    drafts = tokens[:, 1:]  # [B, W-1]
    p_draft = target[:, :-1].gather(2, drafts[..., None])[..., 0]  # [B, W-1]
    q_draft = torch.ones_like(p_draft)  # [B, W-1]
    if draft_probs is not None:
        q_mtp = draft_probs.gather(2, drafts[..., None])[..., 0]  # [B, W-1]
        q_draft = torch.where(one_hot[:, None], q_draft, q_mtp)
    # In float64 both sides are exact (a product of two float32 fits in 53
    # bits), so the test is the rule itself, not its float32 rounding.
    kept = (q_draft > 0) & (accept_u.double() * q_draft.double() < p_draft.double())
    accepted = _prefix_length(kept & _valid_drafts(widths, width))  # [B]

    rows = torch.arange(batch, device=tokens.device)  # [B]
    probs = target[rows, accepted]  # [B, V]
    if width > 1:
        # Only a slot that rejected a valid draft draws from the residual.
        position = accepted.clamp(max=width - 2)  # [B]
        draft = drafts[rows, position]  # [B]: the rejected one, where a slot rejected
        residual = probs.scatter(1, draft[:, None], 0.0)  # [B, V] copies: p without d
        if draft_probs is not None:
            mtp_residual = (probs - draft_probs[rows, position]).clamp(min=0.0)  # [B, V]
            residual = torch.where(one_hot[:, None], residual, mtp_residual)
        # Rejecting needs p(d) < q(d), which leaves mass in the residual; a
        # float underflow there falls back to p itself.
        use = (accepted < widths - 1) & (residual.sum(dim=1) > 0)  # [B]
        probs = torch.where(use[:, None], residual, probs)
    bonus = draw_rows(probs, draw_u)  # [B]
    emitted = torch.cat([drafts, bonus[:, None]], dim=1)  # [B, W]
    emitted = emitted.scatter(1, accepted[:, None], bonus[:, None])
    return DeviceAccepted(accepted=accepted, emitted=emitted)


def target_probs_rows(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float32/64: 0 means greedy
    top_k: torch.Tensor,  # [N] int64: 0 means no top-k cut
    top_p: torch.Tensor,  # [N] float32/64 in (0, 1]: 1.0 means no nucleus cut
    cuts: bool = True,
) -> torch.Tensor:  # [N, V] float32 on logits' device, rows sum to 1
    """``sampling.target_probs`` with each row's own parameters, in one pass.

    A sampled row is ``target_probs(logits[i : i + 1], SamplingParams(...))``
    bit for bit, up to which of several tokens tied at the top-p boundary
    stays: here the one of larger logit, then of lower id (the reference's
    unstable sort leaves it open). A greedy row is one-hot on
    ``torch.argmax`` (the first maximum).

    Temperature and top_p are rounded to float32 where they meet the
    logits, as the reference's Python floats are; whether a row cuts at all
    (``top_p < 1``) is decided before, so float64 parameters agree with the
    reference even for a top_p within float32 rounding of 1.

    One stable sort of the scaled logits serves both cuts: its ``k``-th value
    is the top-k threshold (ties at it stay, as ``torch.topk`` counts them),
    and, since softmax keeps the order, it also orders the probabilities for
    the nucleus. ``cuts=False`` is the caller's word (it knows the requests'
    parameters on the host) that no row has a top-k or top-p cut: the sort
    of every row, most of a sampled step's cost at a large vocabulary, is
    skipped.
    """
    vocab = logits.shape[1]
    greedy = temperature == 0  # [N]
    safe_temperature = torch.where(greedy, 1.0, temperature).to(torch.float32)  # [N]
    scaled = logits.to(torch.float32) / safe_temperature[:, None]  # [N, V]
    argmax = torch.argmax(logits, dim=1, keepdim=True)  # [N, 1]
    if not cuts:
        probs = torch.softmax(scaled, dim=1)
        return torch.where(greedy[:, None], torch.zeros_like(probs).scatter_(1, argmax, 1.0), probs)
    sorted_scaled, order = torch.sort(scaled, dim=1, descending=True, stable=True)  # [N, V]

    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [N]: vocab cuts nothing
    kth = sorted_scaled.gather(1, (k - 1)[:, None])  # [N, 1]
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=1)  # [N, V]

    # Keep a token while the mass strictly before it is below top_p; rows at
    # 1.0 skip the cut and the renormalisation, as the reference does.
    nucleus = top_p < 1.0  # [N]
    sorted_probs = probs.gather(1, order)  # [N, V], descending
    mass_before = torch.cumsum(sorted_probs, dim=1) - sorted_probs  # [N, V]
    cut = (mass_before >= top_p.to(torch.float32)[:, None]) & nucleus[:, None]  # [N, V]
    kept = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(cut, 0.0))
    renormalised = kept / kept.sum(dim=1, keepdim=True)  # [N, V]
    probs = torch.where(nucleus[:, None], renormalised, probs)

    one_hot = torch.zeros_like(probs).scatter_(1, argmax, 1.0)  # [N, V]
    return torch.where(greedy[:, None], one_hot, probs)


def draw_rows(
    probs: torch.Tensor,  # [N, V] non-negative, rows need not sum to 1
    u: torch.Tensor,  # [N] float32 U[0, 1)
) -> torch.Tensor:  # [N] int64
    """Inverse-CDF draws: the first token of positive probability whose
    cumulative sum exceeds ``u * total`` (``acceptance.draw_inverse_cdf``).

    When there is no such token (``u`` rounded up to 1 upstream, or a
    parallel scan whose partial sums are not monotone) the last token of
    positive probability is taken, so a token of probability 0 is never
    drawn; a row with no mass at all gives token 0.
    """
    vocab = probs.shape[1]
    cdf = torch.cumsum(probs, dim=1)  # [N, V]
    threshold = cdf[:, -1:] * u[:, None].to(cdf.dtype)  # [N, 1]
    found = torch.searchsorted(cdf, threshold, right=True)  # [N, 1]: first cdf > threshold
    positions = torch.arange(vocab, device=probs.device)  # [V]
    positive = probs > 0  # [N, V]
    first = torch.where(positive & (positions >= found), positions, vocab).amin(dim=1)  # [N]
    last = torch.where(positive, positions, 0).amax(dim=1)  # [N]
    return torch.where(first < vocab, first, last)


def request_uniforms(
    generators: Sequence[torch.Generator | None],  # one a slot, on `device`
    count: int,
    device: torch.device | str,
) -> torch.Tensor:  # [B, count] float32 U[0, 1)
    """Each slot's row from its own request's generator; a slot without one
    (greedy or inactive) gets zeros and consumes nothing. One small op a
    sampled request, so a request's uniforms never depend on its neighbours."""
    uniforms = torch.zeros(len(generators), count, device=device)  # [B, count]
    for row, generator in zip(uniforms, generators, strict=True):
        if generator is not None:
            row.uniform_(generator=generator)
    return uniforms


def _valid_drafts(widths: torch.Tensor, width: int) -> torch.Tensor:  # [B, W-1] bool
    """Which draft positions hold a real draft (``widths - 1`` of them)."""
    positions = torch.arange(width - 1, device=widths.device)  # [W-1]
    return positions[None, :] < (widths - 1)[:, None]


def _prefix_length(kept: torch.Tensor) -> torch.Tensor:  # [B] int64
    """The number of leading True entries of each row of ``kept`` [B, W-1]."""
    return kept.long().cumprod(dim=1).sum(dim=1)
