"""Properties of the per-sequence prompt lookup (metrale.lookup.prompt_lookup)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.lookup import PromptLookupConfig, PromptLookupSeq
from metrale.lookup.prompt_lookup import (
    LONGEST_AGREEMENT,
    LONGEST_CANDIDATES,
    LONGEST_MIN_AGREEMENT,
)

# A small alphabet makes repeated n-grams, stale entries and near-misses common.
histories = st.lists(st.integers(0, 3), max_size=60)
ngrams = st.integers(1, 4)
min_matches = st.integers(1, 8)
max_lens = st.integers(1, 10)


def reference_match(history: Sequence[int], n: int, m: int) -> int | None:
    """Brute force: the position after the latest earlier occurrence of the
    final n-gram, if the max(m, n) tokens before it equal the history's last ones."""
    h, m = list(history), max(m, n)
    end = len(h)
    if end <= n:
        return None
    for after in range(end - 1, n - 1, -1):
        if h[after - n : after] == h[end - n :]:
            if after < m or h[after - m : after] != h[end - m :]:
                return None
            return after
    return None


def reference_copy(history: Sequence[int], n: int, m: int, max_len: int) -> list[int] | None:
    after = reference_match(history, n, m)
    return None if after is None else list(history[after : after + max_len])


def make_seq(ngram: int = 4, min_match: int = 8, max_drafts: int = 8, backoff: int = 16):
    return PromptLookupSeq(
        PromptLookupConfig(
            ngram=ngram, min_match=min_match, max_drafts=max_drafts, miss_backoff=backoff
        )
    )


def always_matching(length: int) -> list[int]:
    """A history whose final n-gram always has an earlier, min_match-long match."""
    return [i % 10 for i in range(length)]


@settings(max_examples=300, deadline=None)
@given(histories, ngrams, min_matches, max_lens)
def test_proposal_equals_brute_force_reference(history, ngram, min_match, max_len):
    seq = make_seq(ngram=ngram, min_match=min_match)
    assert seq.propose(history, max_len) == reference_copy(history, ngram, min_match, max_len)


@settings(max_examples=100, deadline=None)
@given(histories, ngrams, min_matches, max_lens)
def test_incremental_indexing_equals_one_shot_indexing(history, ngram, min_match, max_len):
    growing = make_seq(ngram=ngram, min_match=min_match)
    for end in range(len(history) + 1):
        prefix = history[:end]
        one_shot = make_seq(ngram=ngram, min_match=min_match).propose(prefix, max_len)
        assert growing.propose(prefix, max_len) == one_shot
        growing.abandon()


@settings(max_examples=200, deadline=None)
@given(histories, st.integers(0, 60), histories, ngrams, min_matches)
def test_rewound_history_never_proposes_from_a_stale_entry(old, keep, new, ngram, min_match):
    seq = make_seq(ngram=ngram, min_match=min_match)
    kept = old[: min(keep, len(old))]
    for seen in (old, kept):  # the engine shows the rewind before extending again
        seq.propose(seen, 8)
        seq.abandon()
    history = kept + new
    got = seq.propose(history, 8)
    # Stale entries may hide a match (None), but never supply a wrong copy.
    assert got is None or got == reference_copy(history, ngram, min_match, 8)


@settings(max_examples=200, deadline=None)
@given(histories, histories, ngrams, min_matches, max_lens)
def test_unrelated_history_still_gets_only_genuine_copies(old, history, ngram, min_match, max_len):
    # Outside the contract (not an extension, not a prefix): the index may
    # miss matches, but every copy is still one the history really contains.
    seq = make_seq(ngram=ngram, min_match=min_match)
    seq.propose(old, 8)
    seq.abandon()
    got = seq.propose(history, max_len)
    if got is not None:
        m, end = max(min_match, ngram), len(history)
        assert any(
            history[after - m : after] == history[end - m :]
            and got == history[after : after + max_len]
            for after in range(m, end)
        )


def test_stale_entry_whose_tokens_differ_is_refused():
    seq = make_seq(ngram=2, min_match=2)
    seq.propose([1, 2, 3, 4, 5, 6, 1, 2], 4)  # indexes (5, 6) -> position 6
    seq.abandon()
    # Same length region rewritten: position 6 now follows (9, 9), not (5, 6).
    rewritten = [1, 2, 3, 4]
    assert seq.propose(rewritten, 4) is None
    assert seq.propose([*rewritten, 9, 9, 7, 5, 6], 4) is None


@settings(max_examples=200, deadline=None)
@given(histories, ngrams, min_matches, max_lens)
def test_copy_stops_at_max_len_and_at_history_end(history, ngram, min_match, max_len):
    copy = make_seq(ngram=ngram, min_match=min_match).propose(history, max_len)
    after = reference_match(history, ngram, min_match)
    if after is None:
        assert copy is None
    else:
        assert copy is not None
        assert len(copy) == min(max_len, len(history) - after) >= 1


@pytest.mark.parametrize("ngram", [1, 2, 4])
def test_history_no_longer_than_ngram_proposes_nothing(ngram):
    for length in range(ngram + 1):
        assert make_seq(ngram=ngram, min_match=1).propose([7] * length, 8) is None


def test_final_ngram_never_matches_itself():
    assert make_seq(ngram=2, min_match=2).propose([1, 2, 3, 4], 8) is None


def test_window_starts_at_two_doubles_on_full_accept_and_halves_on_shortfall():
    seq = make_seq()
    history = always_matching(40)
    seen = [seq.window]
    for _ in range(3):
        copy = seq.propose(history, seq.window)
        assert copy is not None
        seq.settle(len(copy))
        seen.append(seq.window)
    for _ in range(4):
        copy = seq.propose(history, seq.window)
        assert copy is not None
        seq.settle(len(copy) - 1)
        seen.append(seq.window)
    assert seen == [2, 4, 8, 8, 4, 2, 1, 1]


def test_window_is_clamped_to_max_drafts():
    seq = make_seq(max_drafts=1)
    assert seq.window == 1
    assert seq.propose(always_matching(40), 8) is not None
    seq.settle(8)
    assert seq.window == 1


def test_miss_backoff_sequence_and_reset_by_an_accepted_token():
    seq = make_seq(backoff=16)
    history = always_matching(40)

    def miss_then_count_cooldown() -> int:
        assert seq.propose(history, 4) is not None
        seq.settle(0)
        rounds = 0
        while seq.propose(history, 4) is None:
            rounds += 1
        seq.abandon()
        return rounds

    assert [miss_then_count_cooldown() for _ in range(7)] == [1, 2, 4, 8, 16, 16, 16]
    assert seq.propose(history, 4) is not None
    seq.settle(1)
    assert miss_then_count_cooldown() == 1


def test_zero_miss_backoff_disables_the_cooldown():
    seq = make_seq(backoff=0)
    history = always_matching(40)
    for _ in range(5):
        assert seq.propose(history, 4) is not None
        seq.settle(0)


def test_fallback_is_asked_only_without_own_match_and_its_copy_is_clipped_and_shared():
    calls: list[int] = []

    def fallback(history: Sequence[int], max_len: int) -> list[int] | None:
        calls.append(max_len)
        return [9] * 20

    seq = make_seq()
    assert seq.propose_with(always_matching(40), 3, fallback) == [0, 1, 2]
    assert not seq.in_flight_shared and calls == []
    seq.settle(3)
    assert seq.propose_with([5, 6, 7, 8, 9, 10, 11, 12, 13], 3, fallback) == [9, 9, 9]
    assert seq.in_flight_shared and seq.in_flight == 3 and calls == [3]


def test_cooldown_applies_to_the_fallback_too():
    calls: list[int] = []

    def fallback(history: Sequence[int], max_len: int) -> list[int] | None:
        calls.append(max_len)
        return [9]

    seq = make_seq()
    assert seq.propose_with([1] * 3, 4, fallback) == [9]
    seq.settle(0)
    assert seq.propose_with([1] * 3, 4, fallback) is None
    assert calls == [4]


def test_settle_without_copy_in_flight_returns_zero_and_changes_nothing():
    seq = make_seq()
    assert seq.settle(5) == 0
    assert (seq.window, seq.in_flight, seq.cooldown) == (2, 0, 0)


def test_settle_returns_proposed_length_and_clears_the_copy():
    seq = make_seq()
    copy = seq.propose(always_matching(40), 2)
    assert copy is not None and seq.in_flight == 2
    assert seq.settle(1) == 2
    assert seq.in_flight == 0 and not seq.in_flight_shared


def test_abandon_drops_the_copy_and_keeps_the_window():
    seq = make_seq()
    assert seq.propose(always_matching(40), 2) is not None
    seq.abandon()
    assert (seq.window, seq.in_flight, seq.cooldown) == (2, 0, 0)


def test_cut_in_flight_makes_settle_judge_the_verified_part():
    seq = make_seq()
    assert seq.propose(always_matching(40), 7) is not None
    seq.cut_in_flight(4)
    assert seq.settle(4) == 4
    assert seq.window == 4


def test_proposing_over_an_unsettled_copy_is_an_error():
    seq = make_seq()
    assert seq.propose(always_matching(40), 2) is not None
    with pytest.raises(RuntimeError):
        seq.propose(always_matching(41), 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [("ngram", 0), ("max_drafts", 0), ("max_seqs", 0), ("min_match", 0), ("miss_backoff", -1)],
)
def test_config_rejects_out_of_range_values_naming_the_field(field, value):
    # The field leads the message, so the CLI can say which flag set it.
    with pytest.raises(ValueError, match=rf"^{field} must be between \d+ and \d+, got {value}$"):
        PromptLookupConfig(**{field: value})


def test_config_defaults_are_the_ones_the_readme_documents():
    cfg = PromptLookupConfig()
    assert (cfg.ngram, cfg.max_drafts, cfg.max_seqs, cfg.min_match, cfg.miss_backoff) == (
        4,
        8,
        8,
        8,
        16,
    )
    assert PromptLookupConfig(ngram=10, min_match=8).effective_min_match == 10


# -- longest agreement (the draft budget's copies) ---------------------------


def reference_longest(history: Sequence[int], max_len: int) -> tuple[list[int], int] | None:
    """Brute force: of the latest LONGEST_CANDIDATES earlier occurrences of the
    last token, the one whose preceding tokens agree longest with the
    history's (counted up to LONGEST_AGREEMENT), the latest among equals;
    None below LONGEST_MIN_AGREEMENT."""
    h, end = list(history), len(history)
    if end < 2:
        return None
    occurrences = [j for j in range(1, end) if h[j - 1] == h[end - 1]][-LONGEST_CANDIDATES:]
    best: tuple[int, int] | None = None  # (agreement, position)
    for j in occurrences:
        k = 0
        while k < min(j, LONGEST_AGREEMENT) and h[j - 1 - k] == h[end - 1 - k]:
            k += 1
        if best is None or k >= best[0]:
            best = (k, j)
    if best is None or best[0] < LONGEST_MIN_AGREEMENT:
        return None
    return h[best[1] : best[1] + max_len], best[0]


def make_longest(min_match: int = 8, backoff: int = 16) -> PromptLookupSeq:
    return PromptLookupSeq(PromptLookupConfig(min_match=min_match, miss_backoff=backoff), True)


def proposed(seq: PromptLookupSeq, history: Sequence[int], max_len: int):
    copy = seq.propose(history, max_len)
    return None if copy is None else (copy, seq.agreement)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=120), max_lens)
def test_longest_copy_equals_brute_force_reference(history, max_len):
    assert proposed(make_longest(), history, max_len) == reference_longest(history, max_len)


@settings(max_examples=100, deadline=None)
@given(histories, max_lens)
def test_longest_incremental_indexing_equals_one_shot(history, max_len):
    growing = make_longest()
    for end in range(len(history) + 1):
        prefix = history[:end]
        assert proposed(growing, prefix, max_len) == reference_longest(prefix, max_len)
        growing.abandon()


@settings(max_examples=200, deadline=None)
@given(histories, st.integers(0, 60), histories, histories)
def test_longest_copy_after_a_rewind_or_an_unrelated_history_is_the_reference(
    old, keep, new, unrelated
):
    seq = make_longest()
    kept = old[: min(keep, len(old))]
    for seen in (old, kept):
        seq.propose(seen, 8)
        seq.abandon()
    assert proposed(seq, kept + new, 8) == reference_longest(kept + new, 8)
    seq.abandon()
    # Outside the contract the index may miss matches, never supply a wrong copy.
    got = proposed(seq, unrelated, 8)
    if got is not None:
        copy, agreement = got
        end = len(unrelated)
        assert any(
            unrelated[j - agreement : j] == unrelated[end - agreement :]
            and copy == unrelated[j : j + 8]
            for j in range(agreement, end)
        )


def test_longest_copy_prefers_the_longer_agreement_to_the_latest_occurrence():
    seq = make_longest()
    assert seq.propose([1, 2, 9, 5, 2, 8, 1, 2], 3) == [9, 5, 2]
    assert seq.agreement == 2


def test_a_longest_copy_that_misses_leaves_no_cooldown():
    seq = make_longest()
    for _ in range(4):
        assert seq.propose([3, 1, 3, 1], 2) == [3, 1]
        seq.settle(0)
    assert seq.cooldown == 0


def test_longest_copies_ask_the_fallback_when_they_agree_on_fewer_than_min_match():
    calls: list[int] = []

    def fallback(history: Sequence[int], max_len: int) -> list[int] | None:
        calls.append(max_len)
        return [9] * 20

    seq = make_longest(min_match=4)
    # Agrees on 2 tokens: the shared cache's copy is taken, its agreement unknown.
    assert seq.propose_with([1, 2, 9, 5, 2, 8, 1, 2], 3, fallback) == [9, 9, 9]
    assert seq.in_flight_shared and seq.agreement == 0 and calls == [3]
    # Agrees on 4: the own copy, the fallback not asked.
    seq = make_longest(min_match=4)
    assert seq.propose_with([4, 1, 2, 3, 7, 6, 4, 1, 2, 3], 2, fallback) == [7, 6]
    assert not seq.in_flight_shared and seq.agreement == 4 and calls == [3]
