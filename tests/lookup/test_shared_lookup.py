"""Properties of the cross-request cache (metrale.lookup.shared)."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.lookup import CopyCounts, ScopeKey, SharedLookup, SharedLookupConfig
from metrale.lookup import shared as shared_module

SCOPE = ScopeKey(model="m", tokenizer="t", adapter="", tenant="acme")
MIN_MATCH = 8


def random_tokens(n: int, seed: int) -> list[int]:
    # A wide vocabulary: accidental matches between unrelated runs are negligible.
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def make_cache(cache_mb: float = 1.0, scopes: int = 4) -> SharedLookup:
    return SharedLookup(SharedLookupConfig(cache_mb=cache_mb, scopes=scopes))


@pytest.mark.parametrize("field", ["model", "tokenizer", "adapter", "tenant"])
def test_copies_never_cross_any_scope_field(field):
    cache = make_cache()
    request = random_tokens(200, seed=1)
    cache.insert(SCOPE, request)
    other = dataclasses.replace(SCOPE, **{field: "other"})
    assert cache.propose(other, request[:100], 4) is None
    assert cache.propose(SCOPE, request[:100], 4) == request[100:104]


def test_unknown_scope_proposes_nothing_and_is_not_created():
    cache = make_cache()
    assert cache.propose(SCOPE, random_tokens(50, seed=1), 4) is None
    assert cache.scopes == [] and cache.nbytes == 0


@pytest.mark.parametrize("shared_prefix", [20, 100])
def test_latest_request_is_preferred(shared_prefix):
    cache = make_cache()
    context = random_tokens(shared_prefix, seed=2)
    cache.insert(SCOPE, [*context, 1, 2, 3])
    cache.insert(SCOPE, [*context, 4, 5, 6])
    assert cache.propose(SCOPE, context, 8) == [4, 5, 6]


def test_copy_stops_at_its_request_end():
    cache = make_cache()
    context = random_tokens(30, seed=3)
    cache.insert(SCOPE, [*context, 1, 2])
    cache.insert(SCOPE, random_tokens(30, seed=4))
    assert cache.propose(SCOPE, context, 8) == [1, 2]


def test_match_must_not_reach_back_into_the_previous_request():
    cache = make_cache()
    first, second = random_tokens(30, seed=5), random_tokens(30, seed=6)
    cache.insert(SCOPE, first)
    cache.insert(SCOPE, second)
    # The last 4 tokens of `first` plus the first 4 of `second` are adjacent in
    # the ring but never in one request.
    assert cache.propose(SCOPE, first[-4:] + second[:4], 4) is None


def test_hash_hit_whose_tokens_differ_is_refused(monkeypatch):
    # Every n-gram collides: each lookup hits the latest entry, whatever its tokens.
    monkeypatch.setattr(shared_module, "hash", lambda key: 0, raising=False)
    cache = make_cache()
    request = random_tokens(40, seed=7)
    cache.insert(SCOPE, request)
    latest_context = request[-1 - MIN_MATCH : -1]
    assert cache.propose(SCOPE, latest_context, 4) == request[-1:]
    differing = [*latest_context[:-1], latest_context[-1] + 1]
    assert cache.propose(SCOPE, differing, 4) is None


def test_oldest_tokens_are_evicted_first():
    cfg = SharedLookupConfig(cache_mb=0.02, scopes=1)
    cache = SharedLookup(cfg)
    oldest = random_tokens(300, seed=8)
    cache.insert(SCOPE, oldest)
    newer = [random_tokens(300, seed=100 + i) for i in range(cfg.scope_tokens // 300)]
    for request in newer:
        cache.insert(SCOPE, request)
    assert cache.propose(SCOPE, oldest[:150], 4) is None
    assert cache.propose(SCOPE, newer[-1][:150], 4) == newer[-1][150:154]
    assert cache.propose(SCOPE, newer[1][:150], 4) == newer[1][150:154]


def test_least_recently_used_scope_is_dropped_whole():
    cache = make_cache(scopes=2)
    keys = [dataclasses.replace(SCOPE, tenant=f"t{i}") for i in range(3)]
    requests = [random_tokens(100, seed=10 + i) for i in range(3)]
    cache.insert(keys[0], requests[0])
    cache.insert(keys[1], requests[1])
    assert cache.propose(keys[0], requests[0][:50], 2) == requests[0][50:52]  # use keys[0]
    cache.insert(keys[2], requests[2])
    assert cache.scopes == [keys[0], keys[2]]
    assert cache.propose(keys[1], requests[1][:50], 2) is None
    assert cache.propose(keys[0], requests[0][:50], 2) == requests[0][50:52]


def test_cache_stays_within_its_byte_budget_measured():
    cfg = SharedLookupConfig(cache_mb=0.06, scopes=3)
    keys = [dataclasses.replace(SCOPE, tenant=f"t{i}") for i in range(4)]
    # Enough tokens that every live scope's ring wraps around.
    requests = [random_tokens(1000, seed=20 + i) for i in range(16)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = SharedLookup(cfg)
        for i, request in enumerate(requests):
            cache.insert(keys[i % len(keys)], request)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    budget = cfg.cache_mb * 2**20
    assert held <= budget
    assert cache.nbytes >= 0.9 * budget  # the budget is spent on tokens, not left idle


def test_resent_request_takes_almost_no_new_space():
    cache = make_cache()
    conversation = random_tokens(2000, seed=30)
    cache.insert(SCOPE, conversation)
    before = cache.stored(SCOPE)
    cache.insert(SCOPE, conversation)
    assert cache.stored(SCOPE) - before <= 1

    new_turn = random_tokens(50, seed=31)
    before = cache.stored(SCOPE)
    cache.insert(SCOPE, conversation + new_turn)
    assert cache.stored(SCOPE) - before <= len(new_turn) + MIN_MATCH + 2
    assert cache.propose(SCOPE, conversation + new_turn[:10], 4) == new_turn[10:14]
    assert cache.propose(SCOPE, conversation[:500], 4) == conversation[500:504]


def test_edited_resend_stores_the_edit_and_follows_it():
    cache = make_cache()
    original = random_tokens(1000, seed=32)
    cache.insert(SCOPE, original)
    edited = [*original[:500], 7, 7, 7, *original[500:]]
    before = cache.stored(SCOPE)
    cache.insert(SCOPE, edited)
    assert cache.stored(SCOPE) - before <= 3 * MIN_MATCH + 8
    assert cache.propose(SCOPE, original[:500], 4) == [7, 7, 7, original[500]]


stored_requests = st.lists(st.lists(st.integers(0, 3), max_size=40), max_size=6)


@settings(max_examples=150, deadline=None)
@given(stored_requests, st.lists(st.integers(0, 3), max_size=30), st.integers(1, 8))
def test_every_copy_is_a_genuine_continuation_in_one_request(requests, history, max_len):
    cache = SharedLookup(SharedLookupConfig(cache_mb=1.0, scopes=1, ngram=2, min_match=3))
    for request in requests:
        cache.insert(SCOPE, request)
    copy = cache.propose(SCOPE, history, max_len)
    if copy is None:
        return
    assert 1 <= len(copy) <= max_len
    assert any(
        r[j - 3 : j] == history[-3:] and r[j : j + len(copy)] == copy
        for r in requests
        for j in range(3, len(r))
    )


def test_too_small_scope_is_a_configuration_error_naming_the_cache_and_its_scopes():
    with pytest.raises(ValueError, match=r"^cache_mb: 0.01 MB split over 4 scopes") as err:
        SharedLookupConfig(cache_mb=0.01, scopes=4)
    assert "fewer scopes" in str(err.value)
    assert SharedLookupConfig(cache_mb=0.01, scopes=1).scope_tokens >= 1024


def test_record_counts_verified_shared_copies():
    cache = make_cache()
    cache.record(4, 3)
    cache.record(2, 5)
    cache.record(0, 0)
    assert cache.stats == CopyCounts(copies=2, proposed=6, accepted=5)


_DETERMINISM_SCRIPT = """
import random
from metrale.lookup import ScopeKey, SharedLookup, SharedLookupConfig
rng = random.Random(0)
cache = SharedLookup(SharedLookupConfig(cache_mb=0.05, scopes=2))
keys = [ScopeKey("m", "t", "", f"t{i}") for i in range(3)]
out = []
for step in range(60):
    request = [rng.randrange(40) for _ in range(rng.randrange(1, 300))]
    cache.insert(keys[step % 3], request)
    history = [rng.randrange(40) for _ in range(20)] + request[: rng.randrange(len(request) + 1)]
    out.append(cache.propose(keys[(step + 1) % 3], history, 8))
print(out, cache.nbytes)
"""


def run_determinism_script(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", _DETERMINISM_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


def test_proposals_depend_only_on_the_order_of_calls():
    first, second = run_determinism_script("1"), run_determinism_script("2")
    assert first == second
    assert "[" in first and any(c.isdigit() for c in first)
