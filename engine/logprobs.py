"""Log-probabilities of emitted tokens, from the verifying forward's logits.

Contract: a token's log-probability is a float32 log-softmax of the raw
logits row that chose it (before temperature, top-k, top-p and a grammar's
mask: what vLLM reports by default), so it does not depend on the sampling
parameters, and, since a row's logits are those plain decoding computes at
that position, not on the drafts either. The host step reads it here from the
rows of the tokens a verify emitted; the device step computes the same
tensors on the device and brings them back with the step's one readback
(``logprob_tensors``, then ``assemble``). ``TokenBytes`` gives the bytes of
each token a result's logprobs name, which the output formats write.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch

from metrale.engine.api import TokenLogprob


def logprob_tensors(
    logits: torch.Tensor,  # [N, V] raw logits, one row a token
    token_ids: torch.Tensor,  # [N] int64 the token each row emitted
    top: int,  # alternatives a row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprob [N], top logprobs [N, top], top ids [N, top])``, float32
    values, the alternatives likeliest first; tensor ops only."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, V]
    chosen = logp.gather(1, token_ids[:, None])[:, 0]  # [N]
    if top == 0:
        return chosen, logp[:, :0], token_ids[:, None][:, :0]
    values, ids = torch.topk(logp, top, dim=-1)  # [N, top] each, descending
    return chosen, values, ids


def token_logprobs(
    logits: torch.Tensor,  # [N, V] raw logits of the rows that chose the tokens
    token_ids: Sequence[int],  # [N]
    top: int,
) -> list[TokenLogprob]:
    """Each token's ``TokenLogprob`` with ``top`` alternatives (the host step)."""
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logits.device)
    chosen, values, top_ids = logprob_tensors(logits, ids, top)
    return assemble(token_ids, chosen.tolist(), values.tolist(), top_ids.tolist())


def assemble(
    token_ids: Sequence[int],
    chosen: Sequence[float],
    values: Sequence[Sequence[float]],
    top_ids: Sequence[Sequence[int]],
) -> list[TokenLogprob]:
    """``TokenLogprob``s from ``logprob_tensors``' values read back as lists."""
    return [
        TokenLogprob(int(token), float(lp), tuple(zip(map(int, i), map(float, v), strict=True)))
        for token, lp, v, i in zip(token_ids, chosen, values, top_ids, strict=True)
    ]


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_map() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted (char -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    stand_in, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            stand_in[chr(byte)] = byte
        else:
            stand_in[chr(256 + extra)] = byte
            extra += 1
    return stand_in


class TokenBytes:
    """Each token id's own bytes, from a tokenizer: through a byte-level
    BPE's byte map, a byte-fallback piece's byte, else the UTF-8 of its
    decoded text (``decode`` of it alone)."""

    def __init__(self, tokenizer: Any, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(self._backend, "decoder", None)
        state = decoder.__getstate__() if decoder is not None else b""
        state = state.encode() if isinstance(state, str) else bytes(state)
        self._byte_level = b'"ByteLevel"' in state
        self._byte_map = _byte_level_map() if self._byte_level else {}
        self._bytes = lru_cache(maxsize=65536)(self._token_bytes)

    def spell(self, token_id: int) -> bytes:
        """The token's bytes."""
        return self._bytes(token_id)

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._backend.id_to_token(token_id) if self._backend is not None else None
        if piece is not None:
            if self._byte_level and all(c in self._byte_map for c in piece):
                return bytes(self._byte_map[c] for c in piece)
            byte = _BYTE_PIECE.fullmatch(piece)
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            if not self._byte_level and "\u2581" in piece:  # SentencePiece's space
                return piece.replace("\u2581", " ").encode()
        return self._decode([token_id]).encode()
