"""Acceptance of a whole batch's drafts as tensor ops, with no host sync.

Contract: a device-style verify feeds ``B`` slots padded to a static width
``W``. ``tokens[b]`` holds the slot's last token then its drafts, valid up to
``widths[b]`` rows (``0 <= widths[b] <= W``; 0 is an inactive slot, whose
outputs are meaningless but well-formed, with ``accepted == 0``); padding must
still be token ids in ``[0, vocab)``. ``chosen[b, r]`` is the token the slot
emits at row ``r``'s position if it gets there (greedy: the argmax; sampled:
``sampling.sample_rows`` of ``target_probs_rows`` under the row's key, which
``choose_rows`` computes). Every function here is pure: no ``.item()``, no
transfer, no Python loop over rows or vocabulary, so it runs on any device
and under ``torch.inference_mode``.

``accept_rows`` is ``acceptance.accept_drafts`` on each row: greedy and
sampled slots share the rule, and a sampled slot's tokens are those the host
step chooses for the same key, position and distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.engine.noise import row_keys
from metrale.engine.sampling import sample_rows


@dataclass(frozen=True)
class DeviceAccepted:
    """One verify's outcome for a batch: slot ``b`` keeps ``accepted[b]``
    drafts and emits ``emitted[b, : accepted[b] + 1]`` (the kept drafts then
    the bonus token), so an active slot emits ``accepted + 1`` tokens.
    ``emitted`` is the chosen token of every row; beyond the bonus it holds
    what the later rows chose, which nothing emits."""

    accepted: torch.Tensor  # [B] int64
    emitted: torch.Tensor  # [B, W] int64


def accept_rows(
    tokens: torch.Tensor,  # [B, W] int64: last token, then drafts
    widths: torch.Tensor,  # [B] int64: valid rows of each slot
    chosen: torch.Tensor,  # [B, W] int64: each row's chosen token
) -> DeviceAccepted:
    """Keeps the longest prefix of drafts equal to the chosen tokens.

    ``emitted`` is ``chosen`` itself: each kept draft equals the token chosen
    at the row before it, and the bonus is the token chosen after the last one.
    """
    valid = _valid_drafts(widths, tokens.shape[1])  # [B, W-1]
    matches = (tokens[:, 1:] == chosen[:, :-1]) & valid  # [B, W-1]
    return DeviceAccepted(accepted=_prefix_length(matches), emitted=chosen)


def choose_rows(
    target: torch.Tensor,  # [N, V] each row's target distribution (target_probs_rows)
    request_keys: torch.Tensor,  # [N] int64: the noise key of each row's request
    positions: torch.Tensor,  # [N] int64: the position of the token each row chooses
) -> torch.Tensor:  # [N] int64
    """Each row's token, drawn with its request's key at its position. A
    greedy row's target is one-hot on the argmax, which the draw returns."""
    return sample_rows(target, row_keys(request_keys, positions))


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


def _valid_drafts(widths: torch.Tensor, width: int) -> torch.Tensor:  # [B, W-1] bool
    """Which draft positions hold a real draft (``widths - 1`` of them)."""
    positions = torch.arange(width - 1, device=widths.device)  # [W-1]
    return positions[None, :] < (widths - 1)[:, None]


def _prefix_length(kept: torch.Tensor) -> torch.Tensor:  # [B] int64
    """The number of leading True entries of each row of ``kept`` [B, W-1]."""
    return kept.long().cumprod(dim=1).sum(dim=1)
