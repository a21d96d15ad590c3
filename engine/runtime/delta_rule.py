"""The gated delta rule: the recurrence of a gated DeltaNet layer, token by token
and chunk by chunk.

Contract: everything here is float32 and per value head. With the state
``S`` in ``R^{K x V}``, a key ``k`` (L2-normalised), a value ``v``, a decay
``g <= 0`` (log space) and a step size ``beta`` in (0, 1), one token does

    S   <- e^g S                         # forget
    S   <- S + k (beta (v - S^T k))^T    # write the part of v that S mispredicts
    out  = S^T q                         # q L2-normalised and scaled by K^-1/2

``delta_rule_step`` and ``read_state`` are that step over any leading batch
dimensions, in the order of operations of transformers'
``torch_recurrent_gated_delta_rule``; decode and verify rows run through it,
and so does the replay that commits a verify's accepted prefix
(``linear_state.py``), so the state a replay commits is the one the verify
computed at that row. ``chunked_delta_rule`` is the same recurrence for a
prefill, in blocks of ``CHUNK`` tokens (the WY form of transformers'
``torch_chunk_gated_delta_rule``): within a block the writes are solved as one
unit-lower-triangular system, between blocks the state is carried. The two
forms agree up to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per block of the chunked form.
CHUNK = 64


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / |x|`` over the last dim, with the epsilon the released kernels use."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def delta_rule_step(
    state: torch.Tensor,  # [..., K, V] float32
    key: torch.Tensor,  # [..., K]
    value: torch.Tensor,  # [..., V]
    decay: torch.Tensor,  # [...] g, log space
    beta: torch.Tensor,  # [...]
) -> torch.Tensor:
    """The state after one token (see module doc)."""
    state = state * decay.exp()[..., None, None]
    remembered = (state * key.unsqueeze(-1)).sum(dim=-2)  # [..., V]: S^T k
    delta = (value - remembered) * beta.unsqueeze(-1)
    return state + key.unsqueeze(-1) * delta.unsqueeze(-2)


def read_state(state: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``S^T q``: ``[..., K, V]`` and ``[..., K]`` -> ``[..., V]``."""
    return (state * query.unsqueeze(-1)).sum(dim=-2)


def chunked_delta_rule(
    query: torch.Tensor,  # [T, H, K] float32, normalised and scaled
    key: torch.Tensor,  # [T, H, K] normalised
    value: torch.Tensor,  # [T, H, V]
    decay: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, K, V] the state before the first token
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``[T, H, V]`` and the state after the last token, for one sequence."""
    length = query.shape[0]
    pad = (-length) % chunk
    # Head-major, padded to whole blocks: [H, blocks, chunk, dim]; a padded
    # token has beta 0 and decay 0, so it writes nothing and forgets nothing.
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (query, key, value))
    g, b = (F.pad(x.transpose(0, 1), (0, pad)) for x in (decay, beta))
    heads, blocks = q.shape[0], (length + pad) // chunk
    k_beta, v_beta = k * b.unsqueeze(-1), v * b.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, blocks, chunk, -1) for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, blocks, chunk).cumsum(dim=-1)  # decay from the block's start
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # e^{g_i - g_j} for j <= i: pairwise differences, never e^{g_i} * e^{-g_j},
    # whose factors overflow when a block forgets a lot.
    pairwise = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # [H, blocks, chunk, chunk]
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    decayed_keys = torch.linalg.solve_triangular(
        system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    within = (q @ k.transpose(-1, -2)) * pairwise  # attention inside the block
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)  # decay from each token to the block's end
    block_decay = g[..., -1].exp()[..., None, None]  # [H, blocks, 1, 1]
    out = torch.zeros_like(new_values)
    for i in range(blocks):
        v_new = new_values[:, i] - decayed_keys[:, i] @ state
        out[:, i] = q[:, i] @ state + within[:, i] @ v_new
        state = state * block_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, blocks * chunk, -1)[:, :length]
    return out.transpose(0, 1), state
