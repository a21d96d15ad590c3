"""Cross-request prompt lookup: a bounded cache of finished requests' tokens.

Contract: the cache is partitioned into scopes; a proposal reads only the
scope whose ``ScopeKey`` equals the asking sequence's in every field (model,
tokenizer, adapter, tenant). Memory is fixed per scope when it is created:
``cache_mb`` split evenly over ``scopes``, spent on two flat int32 buffers (a
ring of tokens and a hash index into it), so inserts never grow it. Creating
a scope beyond ``scopes`` drops the least recently used one whole.

Within a scope:
- tokens are written to a ring, oldest evicted first; a boundary marker ends
  every stored request, so a copy never crosses into the next request;
- the index maps an n-gram's hash to two candidate cells (a 2-way set whose
  older entry a write replaces) holding the ring position just after the
  n-gram; a lookup takes the newest entry that re-checks token by token
  (against hash collisions, evicted or overwritten tokens) over ``min_match``
  tokens that must all lie in the same stored request, so the latest write of
  an n-gram wins;
- a run that the scope already predicts (``DEDUP_RUN`` predicted tokens in a
  row, e.g. a re-sent conversation prefix) is not stored again until the
  prediction breaks, so re-sending costs (almost) no space.
Deterministic: proposals depend only on the order of inserts and proposals
(the hash of a tuple of ints does not depend on ``PYTHONHASHSEED``).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from metrale.lookup.stats import CopyCounts

MIN_SCOPE_TOKENS = 1024
"""A scope too small to hold this many tokens is a configuration error."""

DEDUP_RUN = 32
"""Predicted tokens in a row after which the rest of a repeat is not stored."""

_BOUNDARY = -1  # ring marker between stored requests; never a token id
_INT32_BYTES = 4
_BYTES_PER_TOKEN = 2 * _INT32_BYTES  # one ring cell and one index slot
_SCOPE_OVERHEAD_BYTES = 1024  # the scope's Python objects, kept inside the budget


@dataclass(frozen=True)
class ScopeKey:
    """Two sequences share copies only when these are equal in every field."""

    model: str
    tokenizer: str
    adapter: str
    tenant: str


@dataclass(frozen=True)
class SharedLookupConfig:
    """``cache_mb`` (> 0; build no cache to turn it off) is split evenly over
    ``scopes``. ``ngram`` and ``min_match`` have the meaning they have in
    ``PromptLookupConfig``."""

    cache_mb: float
    scopes: int = 4
    ngram: int = 4
    min_match: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.cache_mb < float("inf"):
            raise ValueError(f"cache_mb must be above 0 for a shared cache, got {self.cache_mb}")
        if self.scopes < 1:
            raise ValueError(f"scopes must be at least 1, got {self.scopes}")
        if not 1 <= self.ngram <= 64:
            raise ValueError(f"ngram must be between 1 and 64, got {self.ngram}")
        if self.min_match < 1:
            raise ValueError(f"min_match must be at least 1, got {self.min_match}")
        if self.scope_tokens < MIN_SCOPE_TOKENS:
            need_mb = (
                self.scopes * (MIN_SCOPE_TOKENS * _BYTES_PER_TOKEN + _SCOPE_OVERHEAD_BYTES) / 2**20
            )
            raise ValueError(
                f"cache_mb: {self.cache_mb} MB split over {self.scopes} scopes leaves room "
                f"for {max(self.scope_tokens, 0)} tokens per scope; a scope needs at least "
                f"{MIN_SCOPE_TOKENS}: raise the cache to {need_mb:.3f} MB or use fewer scopes"
            )
        if self.effective_min_match > self.scope_tokens // 2:
            raise ValueError(
                f"min_match must be at most {self.scope_tokens // 2} for a scope of "
                f"{self.scope_tokens} tokens"
            )

    @property
    def scope_bytes(self) -> int:
        """Bytes one scope may use, all its buffers and objects included."""
        return int(self.cache_mb * 2**20) // self.scopes

    @property
    def scope_tokens(self) -> int:
        """Tokens (boundary markers included) one scope's ring holds."""
        return (self.scope_bytes - _SCOPE_OVERHEAD_BYTES) // _BYTES_PER_TOKEN

    @property
    def effective_min_match(self) -> int:
        return max(self.min_match, self.ngram)


class _ScopeStore:
    """One scope's ring and index. Positions are absolute write counts; the
    ring cell of position ``p`` is ``p % capacity``, live while
    ``p >= head - capacity``."""

    __slots__ = ("capacity", "head", "min_match", "ngram", "ring", "seg_len", "slots")

    def __init__(self, capacity: int, ngram: int, min_match: int) -> None:
        self.capacity = capacity
        self.ngram = ngram
        self.min_match = min_match
        # Built by repetition: the size is then exact (`frombytes` over-allocates).
        self.ring = array("i", [0]) * capacity  # [capacity] token ids
        self.slots = array("i", [-1]) * capacity  # [capacity] ring cell after an n-gram, -1 empty
        self.head = 0  # positions written so far
        self.seg_len = 0  # tokens written since the last boundary

    @property
    def nbytes(self) -> int:
        return (len(self.ring) + len(self.slots)) * _INT32_BYTES

    def find(self, tokens: Sequence[int], end: int) -> int | None:
        """The position after the latest stored occurrence of the n-gram that
        ends ``tokens[:end]``, when the ``min_match`` tokens before it equal
        the ones before ``end`` and lie in one stored request; else ``None``."""
        if end < self.min_match:
            return None
        first, second = self._cells(tokens, end)
        near, far = (
            (first, second) if self._distance(first) <= self._distance(second) else (second, first)
        )
        for cell in (near, far):
            after = self._verified(cell, tokens, end)
            if after is not None:
                return after
        return None

    def _cells(self, tokens: Sequence[int], end: int) -> tuple[int, int]:
        """The two index cells the n-gram ending at ``end`` may occupy (a
        2-way set, so one collision does not lose a recent n-gram)."""
        key = hash(tuple(tokens[end - self.ngram : end]))
        cap = self.capacity
        return key % cap, (key // cap) % cap

    def _distance(self, slot: int) -> int:
        """How far back the ring position a slot names lies; empty is farthest."""
        cell = self.slots[slot]
        return self.capacity if cell < 0 else (self.head - 1 - cell) % self.capacity

    def _verified(self, slot: int, tokens: Sequence[int], end: int) -> int | None:
        cell, m, cap = self.slots[slot], self.min_match, self.capacity
        if cell < 0:
            return None
        after = self.head - 1 - (self.head - 1 - cell) % cap
        if after - m < max(0, self.head - cap):
            return None  # the tokens before the match were evicted
        ring = self.ring
        for k in range(1, m + 1):
            # A boundary (-1) never equals a token, so this also stops the
            # match at the start of its stored request.
            if ring[(after - k) % cap] != tokens[end - k]:
                return None
        return after

    def copy_from(self, after: int, max_len: int) -> list[int]:
        """Up to ``max_len`` stored tokens from ``after``, stopping at the end
        of their request."""
        out: list[int] = []
        ring, cap, stop = self.ring, self.capacity, min(self.head, after + max_len)
        for p in range(after, stop):
            token = ring[p % cap]
            if token == _BOUNDARY:
                break
            out.append(token)
        return out

    def follows(self, cursor: int | None, tokens: Sequence[int], i: int) -> int | None:
        """Where the scope's copy continues after ``tokens[i]`` if it predicts
        that token, else ``None``. ``cursor`` is where the previous prediction
        continues: following it keeps a repeat recognised even where the
        index lost an n-gram to a collision."""
        ring, cap = self.ring, self.capacity
        if cursor is not None and cursor >= self.head - cap and ring[cursor % cap] == tokens[i]:
            return cursor + 1
        after = self.find(tokens, i)
        if after is not None and ring[after % cap] == tokens[i]:
            return after + 1
        return None

    def write(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """Appends ``tokens[start:stop]`` to the current stored request. The
        caller guarantees that the request's earlier tokens in the ring are
        ``tokens[start - seg_len : start]``, so n-gram keys can be read from
        ``tokens``. A position is indexed only with ``min_match`` tokens of its
        request before it: any other hit would fail the re-check anyway, and
        would hide an older usable entry."""
        m, cap = self.min_match, self.capacity
        ring, slots = self.ring, self.slots
        for i in range(start, stop):
            p = self.head
            if self.seg_len >= m:
                first, second = self._cells(tokens, i)
                # Replace the older entry of the set; the newer one may be
                # the same n-gram's previous write, which `find` then ranks
                # below this one.
                older = first if self._distance(first) >= self._distance(second) else second
                slots[older] = p % cap
            ring[p % cap] = tokens[i]
            self.head = p + 1
            self.seg_len += 1

    def end_request(self) -> None:
        if self.seg_len:
            self.ring[self.head % self.capacity] = _BOUNDARY
            self.head += 1
            self.seg_len = 0

    def insert(self, tokens: Sequence[int]) -> None:
        """Stores one request, skipping runs the scope already predicts."""
        m = self.min_match
        done = 0  # tokens[:done] are written or skipped
        run = 0  # predicted tokens in a row, not yet written
        skipping = False
        cursor: int | None = None  # where the scope's copy continues
        for i in range(m, len(tokens)):
            cursor = self.follows(cursor, tokens, i)
            if cursor is not None:
                run += 1
                skipping = skipping or run >= DEDUP_RUN
                continue
            if skipping:
                # The repeat broke at i. Its tokens stay unstored; the new
                # request part restarts with min_match tokens of context, so
                # that the n-grams from i on can be found and re-checked.
                if i - done > m:
                    self.end_request()
                    done = i - m
                skipping = False
            self.write(tokens, done, i + 1)
            done, run = i + 1, 0
        if not skipping:
            self.write(tokens, done, len(tokens))
        self.end_request()


class SharedLookup:
    """The cross-request cache (see the module docstring). ``stats`` counts the
    copies it supplied that were verified, as reported through ``record``."""

    def __init__(self, cfg: SharedLookupConfig) -> None:
        self._cfg = cfg
        self._scopes: OrderedDict[ScopeKey, _ScopeStore] = OrderedDict()
        self.stats = CopyCounts()

    @property
    def nbytes(self) -> int:
        """Bytes held by all scopes' token and index buffers."""
        return sum(store.nbytes for store in self._scopes.values())

    @property
    def scopes(self) -> list[ScopeKey]:
        """Live scopes, least recently used first."""
        return list(self._scopes)

    def stored(self, scope: ScopeKey) -> int:
        """Ring positions ``scope`` has written since it was created (tokens
        and request boundaries, evicted ones included); 0 for no such scope."""
        store = self._scopes.get(scope)
        return 0 if store is None else store.head

    def insert(self, scope: ScopeKey, tokens: Sequence[int]) -> None:
        """Stores a finished, error-free request's tokens (prompt + output)."""
        if tokens and min(tokens) < 0:
            raise ValueError("token ids must not be negative")
        store = self._scopes.get(scope)
        if store is None:
            if len(self._scopes) >= self._cfg.scopes:
                self._scopes.popitem(last=False)
            cfg = self._cfg
            store = _ScopeStore(cfg.scope_tokens, cfg.ngram, cfg.effective_min_match)
            self._scopes[scope] = store
        self._scopes.move_to_end(scope)
        store.insert(tokens)

    def propose(self, scope: ScopeKey, history: Sequence[int], max_len: int) -> list[int] | None:
        """A copy of at most ``max_len`` tokens that followed the history's
        final n-gram in the latest stored request of ``scope``, or ``None``."""
        store = self._scopes.get(scope)
        if store is None or max_len < 1:
            return None
        self._scopes.move_to_end(scope)
        after = store.find(history, len(history))
        if after is None:
            return None
        return store.copy_from(after, max_len) or None

    def record(self, proposed: int, accepted: int) -> None:
        """Counts one verified copy this cache supplied."""
        self.stats.observe(proposed, accepted)
