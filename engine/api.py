"""Requests in, results out: the engine's public types.

Contract: the engine takes prompt token ids and sampling parameters and gives
back token ids, text and figures. The CLI builds these objects once from JSONL
and flags; nothing here knows about JSON, terminals or files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from metrale.lookup import LookupStats

FinishReason = Literal["stop", "length", "error"]
# Most alternatives a token's log-probabilities list (OpenAI's top_logprobs bound).
MAX_TOP_LOGPROBS = 20
GrammarKind = Literal["json_schema", "json_object", "regex", "choice"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "choice")


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match.

    ``source`` is text: a JSON schema as JSON, a regular expression, or the
    choices as a JSON list of strings (``json_object`` needs none: any JSON
    object). Equal grammars are equal values, so the engine compiles each
    distinct one once; ``metrale.engine.spec.grammar`` checks and compiles them.
    """

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``temperature == 0`` means greedy.

    ``logprobs``: None for none; ``k`` for each emitted token's raw
    log-probability and the ``k`` likeliest alternatives (``TokenLogprob``).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Request:
    """One generation: ``request_id`` is the caller's and comes back unchanged.

    ``scope`` names the tenant whose earlier finished requests may supply
    prompt-lookup copies (see ``metrale.lookup.SharedLookup``); ``None`` means
    the request neither reads from nor is stored in the shared cache.
    ``grammar`` constrains the output: a ``"stop"`` finish then always ends
    where the grammar is complete. ``choice`` is the sample's index among a
    line's ``n``: each draws from its own noise stream of the seed.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    scope: str | None = None
    grammar: Grammar | None = None
    choice: int = 0


@dataclass
class RequestStats:
    """Speculation figures of one request.

    ``verifies`` counts forward passes of the main model that decoded this
    request (prefill excluded); ``verify_tokens`` the tokens they produced
    (accepted drafts plus the bonus token, before any cut at EOS or a stop).
    Mean acceptance length = ``verify_tokens / verifies``; it counts the bonus
    token, so plain decoding scores exactly 1. The first output token comes
    from the prefill and is in neither figure. ``prompt_lookup`` counts the
    request's copies (definitions in ``metrale.lookup.stats``).
    ``forced_proposed``/``forced_accepted``: drafts that were the grammar's
    forced continuation (the only token its mask allowed), always accepted;
    ``grammar_s``: time spent on the request's grammar (masks, checks,
    advancing the matcher). All three stay 0 without a grammar.
    """

    verifies: int = 0
    verify_tokens: int = 0
    mtp_proposed: int = 0
    mtp_accepted: int = 0
    prompt_lookup: LookupStats = field(default_factory=LookupStats)
    forced_proposed: int = 0
    forced_accepted: int = 0
    grammar_s: float = 0.0

    @property
    def mean_tokens_per_verify(self) -> float:
        """Counts the bonus token: 1.0 means no draft was ever accepted."""
        return self.verify_tokens / self.verifies if self.verifies else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the model's raw distribution
    (a float32 log-softmax of the verifying forward's logits: before
    temperature, top-k, top-p and a grammar's mask), and the ``k`` likeliest
    tokens there, likeliest first: ``top`` is ``((token_id, logprob), ...)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Result:
    """A finished request. ``error`` is set (and ``finish_reason == "error"``)
    when the request could not be generated; the other requests are unaffected."""

    request_id: str
    prompt_tokens: int
    output_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    error: str | None = None
    # One a token of ``text`` (a final EOS has none), when the request asked,
    # and the bytes of every token they name (the emitted and the top ones).
    logprobs: tuple[TokenLogprob, ...] | None = None
    token_bytes: Mapping[int, bytes] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
