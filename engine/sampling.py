"""Turning logits into tokens: temperature, top-k, top-p and a keyed draw.

Contract: a sampled token is a pure function of its request's noise key
(``noise.request_key``: the seed and the stream, i.e. the choice index of
``n``), the token's position in the sequence, and the target distribution at
that position. ``sample_rows`` draws it by Gumbel-max (the exponential race)
with noise addressed by ``(key, position, index)``, never by a generator's
state. So the token a position gets does not depend on the drafts, on which
requests share the batch, on how many tokens a verify emitted, or on the
step path: a draft is kept when it equals that token (``spec/acceptance.py``).
Greedy requests (``temperature == 0``) take the argmax and need no key.

The target distribution of a sampled request is ``target_probs(logits)``:
softmax of ``logits / temperature`` restricted to the top-k tokens and then to
the smallest top-p nucleus, renormalised. The verify, the MTP drafter and a
grammar's masked rows all shape their distributions with this one function.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from metrale.engine.api import SamplingParams
from metrale.engine.noise import (
    SALT_BLOCK,
    SALT_TOKEN,
    exponentials,
    request_key,
    row_keys,
    uniform_bits,
)

# Tokens per block of the two-level draw (``sample_rows``). Part of what a
# seed means: changing it changes every sampled text.
BLOCK = 256


def noise_key(params: SamplingParams, stream: int = 0) -> int | None:
    """The noise key of a request: None for greedy; from the seed, or from a
    fresh random one for an unseeded sampled request. ``stream`` is the
    choice index (choice ``i`` of ``n`` draws from its own stream)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(64)
    return request_key(seed, stream)


def target_probs(
    logits: torch.Tensor,  # [num_rows, vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [num_rows, vocab] float32 on the CPU, rows sum to 1
    """The distribution a sampled request draws from, one row per logits row."""
    assert not params.greedy, "greedy requests take the argmax, not a distribution"
    scaled = logits.detach().to(device="cpu", dtype=torch.float32) / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        # Everything below the k-th largest logit is cut (ties at the k-th stay).
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # [num_rows, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [num_rows, vocab]
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token while the mass strictly before it is below top_p: the
        # nucleus is the smallest prefix reaching top_p, and never empty.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_rows(
    probs: torch.Tensor,  # [N, V] non-negative; rows need not sum to 1
    keys: torch.Tensor,  # [N] int64 row keys (noise.row_keys: request and position)
) -> torch.Tensor:  # [N] int64
    """One token a row, drawn exactly from the row's distribution by
    Gumbel-max in two levels, with tensor ops only (no host read).

    With ``E_i`` independent Exp(1) variates, ``argmax_i p_i / E_i`` is ``i``
    with probability ``p_i / sum(p)`` (the exponential race; ``log p - log E``
    is Gumbel-max). The vocabulary is cut into blocks of ``BLOCK`` tokens: a
    race over the blocks' masses picks a block, then a race within it a token,
    so ``P(token) = mass/total * p/mass = p/total``, with noise for ``V/BLOCK +
    BLOCK`` values a row instead of ``V``. Each variate is addressed by
    (row key, block or token id): two distributions drawn with the same key
    pick the same token where they agree enough, which is why a draft drawn
    from the MTP module's distribution with the target's key is accepted
    often. A row with no mass gives token 0.
    """
    rows, vocab = probs.shape
    blocks = -(-vocab // BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * BLOCK - vocab))  # [N, blocks * BLOCK]
    grid = padded.view(rows, blocks, BLOCK)
    mass = grid.sum(dim=2)  # [N, blocks]
    block_ids = torch.arange(blocks, device=probs.device)  # [blocks]
    block_noise = exponentials(uniform_bits(keys, block_ids, SALT_BLOCK))  # [N, blocks]
    block = (mass.double() / block_noise).argmax(dim=1)  # [N]
    within = grid[torch.arange(rows, device=probs.device), block]  # [N, BLOCK]
    token_ids = block[:, None] * BLOCK + torch.arange(BLOCK, device=probs.device)  # [N, BLOCK]
    token_noise = exponentials(uniform_bits(keys, token_ids, SALT_TOKEN))  # [N, BLOCK]
    return token_ids.gather(1, (within.double() / token_noise).argmax(dim=1, keepdim=True))[:, 0]


def sample_at(
    probs: torch.Tensor,  # [N, V] target distributions, one row a token to draw
    keys: Sequence[int],  # [N] the noise key of each row's request
    positions: Sequence[int],  # [N] the position of the token each row draws
) -> list[int]:
    """``sample_rows`` with the rows' keys and positions given as integers
    (the host's case: several requests' rows drawn in one call)."""
    device = probs.device
    request_keys = torch.tensor(list(keys), dtype=torch.int64, device=device)
    at = torch.tensor(list(positions), dtype=torch.int64, device=device)
    return [int(t) for t in sample_rows(probs, row_keys(request_keys, at)).tolist()]
