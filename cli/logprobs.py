"""Log-probabilities as each output format writes them.

Contract: the engine hands back ``TokenLogprob``s (ids and float
log-probabilities, one per token of the output text) and each named token's
bytes (``Result.token_bytes``); this module renders them in the shape of
each format (docs/formats.md):

- chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token,
  logprob, bytes}]}], "refusal": null}`` (OpenAI's ``ChoiceLogprobs``);
- completions: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}],
  text_offset}`` (OpenAI's legacy ``Logprobs``; ``text_offset`` counts
  characters of the tokens' texts from the start of the completion);
- simple: ``[{token, id, logprob, top_logprobs: [{token, id, logprob}]}]``.

A token's ``token`` is its bytes as text, or ``bytes:\\xNN...`` when they
are not whole UTF-8 (a character split across tokens), as OpenAI writes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from metrale.engine.api import TokenLogprob

TokenBytes = Mapping[int, bytes]


def token_text(raw: bytes) -> str:
    """A token's text (module doc)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(logprobs: Sequence[TokenLogprob], tokens: TokenBytes) -> dict[str, Any]:
    """A chat choice's ``logprobs``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokens.get(token_id, b"")
        text = token_text(raw)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = [
        {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
        for t in logprobs
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob], tokens: TokenBytes) -> dict[str, Any]:
    """A completion choice's ``logprobs``."""
    texts = [token_text(tokens.get(t.token_id, b"")) for t in logprobs]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [{token_text(tokens.get(i, b"")): lp for i, lp in t.top} for t in logprobs],
        "text_offset": offsets,
    }


def simple_logprobs(logprobs: Sequence[TokenLogprob], tokens: TokenBytes) -> list[dict[str, Any]]:
    """A simple record's ``logprobs``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tokens.get(token_id, b"")), "id": token_id, "logprob": logprob}

    return [
        {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
        for t in logprobs
    ]
