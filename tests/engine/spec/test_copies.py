"""Prompt-lookup copies in the step: caps, windows, fallbacks and settling, traced
on a fake model."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, SharedLookupSettings
from metrale.engine.engine import Engine
from metrale.engine.sequence import SeqState
from metrale.engine.spec import copies as copies_module
from metrale.engine.spec.copies import (
    BATCHED_COPY_MAX,
    CopyTaken,
    bucket_copy,
    drafter_accepted,
    lookup_for,
    lookup_of,
    settle_copies,
    take_rounds_with_copies,
)
from metrale.lookup import CopyCounts, Fallback, LookupStats, PromptLookupConfig, PromptLookupSeq
from tests.support.fake_model import FakeModel, FakeMtp, reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

# A history that repeats itself: its last 8 tokens occurred before, followed
# by 8 more, so a copy of up to 8 tokens is on offer.
REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0] * 2 + [1, 2, 3, 4, 5, 6, 7, 8]
LOOKUP = PromptLookupConfig(ngram=4, max_drafts=16, max_seqs=8, min_match=8, miss_backoff=16)


def decoding_seq(history: Sequence[int], max_tokens: int = 100, max_len: int = 200) -> SeqState:
    """A sequence mid-decode: ``history[-1]`` is its last token."""
    prompt = tuple(history[:-1])
    request = Request("r", prompt, SamplingParams(max_tokens=max_tokens))
    seq = SeqState(request, 0, max_len, frozenset(), None, None)
    seq.history = list(history)
    seq.seq_len = len(history) - 1
    return seq


def warm_window(seq: SeqState, cfg: PromptLookupConfig, window: int) -> None:
    """Grows the sequence's copy window by fully accepted copies."""
    lookup = lookup_for(seq, cfg)
    while lookup.window < window:
        copy = lookup.propose(seq.history, lookup.window)
        assert copy is not None
        lookup.settle(len(copy))


def run(
    model: FakeModel,
    prompts: Sequence[Sequence[int]],
    config: EngineConfig,
    mtp: FakeMtp | None = None,
    max_tokens: int = 40,
) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, None, config, mtp=[mtp] if mtp else ())
    engine.calibrate()
    model.forwards.clear()  # the draft budget's calibration verifies are no part of the trace
    requests = [
        Request(str(i), tuple(p), SamplingParams(max_tokens=max_tokens))
        for i, p in enumerate(prompts)
    ]
    by_id = {r.request_id: list(r.output_ids) for r in engine.generate(requests)}
    return [by_id[str(i)] for i in range(len(prompts))], engine


def verify_widths(model: FakeModel, prompt_len: int) -> list[int]:
    """Rows of each verify of slot 0 (segments past the prompt)."""
    return [
        len(s.token_ids)
        for forward in model.forwards
        for s in forward
        if s.slot == 0 and s.start >= prompt_len
    ]


# -- trace tests on the engine ------------------------------------------------


@pytest.mark.parametrize("counting", [True, False])
@pytest.mark.parametrize("num_prompts", [1, 3])
def test_copies_change_the_number_of_verifies_not_the_output(
    num_prompts: int, counting: bool
) -> None:
    prompts = [REPEATING[i:] for i in range(num_prompts)]
    cfg = PromptLookupConfig(ngram=2, min_match=2)
    off, off_engine = run(FakeModel(counting=counting), prompts, EngineConfig(prompt_lookup=None))
    on, on_engine = run(FakeModel(counting=counting), prompts, EngineConfig(prompt_lookup=cfg))
    expected = [reference_greedy(FakeModel(counting=counting), p, 40) for p in prompts]
    assert on == off == expected
    assert on_engine.stats().prompt_lookup.total.accepted > 0
    assert on_engine.stats().verifies < off_engine.stats().verifies


class WrongCopies(PromptLookupSeq):
    """Proposes the copy it would, with every token shifted and the first
    one never the default ``FakeModel``'s next token: always wrong."""

    def propose_with(
        self, history: Sequence[int], max_len: int, fallback: Fallback | None
    ) -> list[int] | None:
        copy = super().propose_with(history, max_len, fallback)
        if copy is None:
            return None
        shifted = [(t + 1) % 16 for t in copy]
        right = int(FakeModel().next_logits(history).argmax())
        if shifted[0] == right:
            shifted[0] = (right + 1) % 16
        return shifted


def test_copies_that_are_always_wrong_never_change_the_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = [REPEATING, REPEATING[3:], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]
    expected = [reference_greedy(FakeModel(), p, 40) for p in prompts]
    monkeypatch.setattr(copies_module, "PromptLookupSeq", WrongCopies)
    cfg = PromptLookupConfig(ngram=2, min_match=2, miss_backoff=0)
    outputs, engine = run(FakeModel(), prompts, EngineConfig(prompt_lookup=cfg))
    stats = engine.stats()
    assert outputs == expected
    assert stats.prompt_lookup.total.copies > 0 and stats.prompt_lookup.total.accepted == 0
    assert stats.mean_tokens_per_verify == 1.0


def test_with_nothing_to_match_the_trace_equals_prompt_lookup_off() -> None:
    # Two distinct tokens never repeat a 4-gram with min_match 40 in 30 tokens.
    prompts = [[3, 9, 12, 1], [7, 2, 5, 11, 6]]
    cfg = PromptLookupConfig(min_match=40)
    off_model, on_model = FakeModel(), FakeModel()
    # The fixed rule's trace: under the budget the MTP rows verified follow the costs.
    fixed = EngineConfig(prompt_lookup=None, draft_policy="fixed")
    run(off_model, prompts, fixed, FakeMtp(off_model, "mixed"), 30)
    _, engine = run(
        on_model,
        prompts,
        EngineConfig(prompt_lookup=cfg, draft_policy="fixed"),
        FakeMtp(on_model, "mixed"),
        30,
    )
    assert engine.stats().prompt_lookup.total.copies == 0
    assert on_model.forwards == off_model.forwards


def test_a_lone_sequence_verifies_a_long_copy_in_one_pass() -> None:
    model = FakeModel(counting=True)
    run(model, [REPEATING], EngineConfig(prompt_lookup=LOOKUP, draft_policy="fixed"))
    assert max(verify_widths(model, len(REPEATING))) == 1 + 16


def test_inside_a_batch_a_long_copy_is_cut_to_the_four_row_verify() -> None:
    model = FakeModel(counting=True)
    prompts = [REPEATING, REPEATING[1:]]
    outputs, engine = run(model, prompts, EngineConfig(prompt_lookup=LOOKUP, draft_policy="fixed"))
    widths = [len(s.token_ids) for fwd in model.forwards[1:] for s in fwd]
    assert engine.stats().prompt_lookup.total.copies > 0
    assert max(widths) == 1 + BATCHED_COPY_MAX
    assert outputs == [reference_greedy(FakeModel(counting=True), p, 40) for p in prompts]


def test_long_copies_are_bucketed_to_powers_of_two() -> None:
    assert bucket_copy(list(range(7))) == list(range(4))
    assert bucket_copy(list(range(9))) == list(range(8))
    assert bucket_copy(list(range(3))) == list(range(3))
    assert bucket_copy([1]) == [1]
    model = FakeModel(counting=True)
    cfg = PromptLookupConfig(ngram=4, max_drafts=32, min_match=8)
    run(model, [REPEATING], EngineConfig(prompt_lookup=cfg), max_tokens=60)
    drafts = {w - 1 for w in verify_widths(model, len(REPEATING))}
    assert drafts <= {0, 1, 2, 3, 4, 8, 16, 32} and 16 in drafts


def test_a_fully_accepted_copy_still_trims_the_drafter_as_a_full_reject() -> None:
    model = FakeModel(counting=True)
    mtp = FakeMtp(model, "right")
    # The fixed rule takes the copies over the oracle's chain; the budget
    # may not, and then no copy is verified to check the trim with.
    config = EngineConfig(prompt_lookup=LOOKUP, draft_policy="fixed")
    outputs, engine = run(model, [REPEATING], config, mtp)
    stats = engine.stats()
    assert outputs == [reference_greedy(FakeModel(counting=True), REPEATING, 40)]
    # The oracle MTP is never wrong, yet the copies' accepted tokens are not
    # counted as its own: it proposed more than its figures show verified.
    assert stats.prompt_lookup.total.accepted > 0
    assert stats.mtp_accepted == stats.mtp_proposed
    assert (
        stats.mtp_proposed + stats.prompt_lookup.total.proposed
        == stats.verify_tokens - stats.seq_verifies
    )
    # After every verify the module was fed all verified positions from the
    # main model's hidden states, copy or not: each position holds the true
    # (context, next token), never an entry of its own chain.
    history = [*REPEATING, *outputs[0]]
    last_verify_start = model.forwards[-1][0].start
    for (_slot, pos), (context, token) in mtp.fed.items():
        if pos < last_verify_start:
            assert (context, token) == (tuple(history[max(0, pos - 1) : pos + 1]), history[pos + 1])
    seq = decoding_seq(REPEATING)
    lookup = lookup_for(seq, LOOKUP)
    assert lookup.propose(seq.history, 4) is not None
    assert drafter_accepted(seq, 4) == 0
    lookup.abandon()
    assert drafter_accepted(seq, 4) == 4


def test_a_batch_wider_than_max_seqs_takes_no_copies() -> None:
    cfg = PromptLookupConfig(max_seqs=2)
    seqs = [decoding_seq(REPEATING) for _ in range(3)]
    assert take_rounds_with_copies(seqs, cfg, None, 0, mtp_drafting=False) == []
    assert all(lookup_of(s) is None and not s.pending_drafts for s in seqs)
    assert len(take_rounds_with_copies(seqs[:2], cfg, None, 0, mtp_drafting=False)) == 2
    _, engine = run(FakeModel(), [REPEATING[i:] for i in range(3)], EngineConfig(prompt_lookup=cfg))
    assert engine.stats().prompt_lookup.total.copies == 0


def test_only_sequences_holding_drafts_take_copies_when_mtp_drafts() -> None:
    without, holding = decoding_seq(REPEATING), decoding_seq(REPEATING)
    holding.set_drafts([99])
    took = take_rounds_with_copies([without, holding], LOOKUP, None, 3, mtp_drafting=True)
    assert [t.seq for t in took] == [holding]
    assert holding.pending_drafts == [9, 10]  # window 2, chain min(1, 3)


def test_a_one_draft_slot_caps_the_copy() -> None:
    # One token emitted, three allowed: the verify may hold one draft only.
    seq = decoding_seq(REPEATING, max_tokens=3)
    assert seq.draft_capacity() == 1
    took = take_rounds_with_copies([seq], LOOKUP, None, 0, mtp_drafting=False)
    assert len(took) == 1 and seq.pending_drafts == [9]
    # A slot with no position left after the verify's first row takes none.
    full = decoding_seq(REPEATING, max_len=len(REPEATING))
    assert full.draft_capacity() == 0
    assert take_rounds_with_copies([full], LOOKUP, None, 0, mtp_drafting=False) == []


def test_a_copy_shorter_than_the_chain_is_abandoned() -> None:
    seq = decoding_seq(REPEATING)
    seq.set_drafts([50, 51, 52])
    # Period 2: the latest earlier match ends two tokens before the history
    # does, so the copy has two tokens, fewer than the 3-draft chain.
    seq.history = [1, 2] * 6
    seq.seq_len = len(seq.history) - 1
    assert take_rounds_with_copies([seq], LOOKUP, None, 3, mtp_drafting=True) == []
    assert seq.pending_drafts == [50, 51, 52]
    lookup = lookup_of(seq)
    assert lookup is not None and lookup.in_flight == 0


def test_the_window_is_asked_for_at_least_the_chain() -> None:
    seq = decoding_seq(REPEATING)
    seq.set_drafts([50, 51, 52])
    take_rounds_with_copies([seq], LOOKUP, None, 3, mtp_drafting=True)
    assert seq.pending_drafts == [9, 10, 11]  # window 2, chain 3: three tokens
    warm = decoding_seq(REPEATING)
    warm_window(warm, LOOKUP, 8)
    warm.set_drafts([50])
    take_rounds_with_copies([warm], LOOKUP, None, 1, mtp_drafting=True)
    assert warm.pending_drafts == [9, 10, 11, 12, 13, 14, 15, 0]


def test_settling_reads_accepted_tokens_from_the_seq_len_advance() -> None:
    seq = decoding_seq(REPEATING)
    warm_window(seq, LOOKUP, 4)
    took = take_rounds_with_copies([seq], LOOKUP, None, 0, mtp_drafting=False)
    assert took == [CopyTaken(seq, seq.seq_len)] and len(seq.pending_drafts) == 4
    seq.seq_len += 3  # two drafts accepted, plus the bonus token
    counters = LookupStats()
    settle_copies(took, None, counters)
    assert counters.total == seq.stats.prompt_lookup.total == CopyCounts(1, 4, 2)
    lookup = lookup_of(seq)
    assert lookup is not None and lookup.in_flight == 0 and lookup.window == 2


def test_a_sequence_that_did_not_advance_settles_as_a_miss() -> None:
    seq = decoding_seq(REPEATING)
    took = take_rounds_with_copies([seq], LOOKUP, None, 0, mtp_drafting=False)
    counters = LookupStats()
    settle_copies(took, None, counters)
    assert counters.total.accepted == 0 and counters.total.copies == 1
    lookup = lookup_of(seq)
    assert lookup is not None and lookup.cooldown == 1


def test_an_earlier_request_of_the_same_scope_supplies_a_copy() -> None:
    # No repeat inside the prompt: only the first request's stored output can
    # tell the second what follows.
    prompt = (3, 9, 12, 1, 14, 6, 2, 10, 7, 13)
    config = EngineConfig(
        max_batch=1,
        prompt_lookup=PromptLookupConfig(min_match=8),
        shared_lookup=SharedLookupSettings(cache_mb=1.0),
    )

    def shared_stats(second_scope: str) -> tuple[int, list[int]]:
        engine = Engine(FakeModel(), None, config, model_name="fake")
        requests = [
            Request("first", prompt, SamplingParams(max_tokens=30), scope="tenant-a"),
            Request("second", prompt, SamplingParams(max_tokens=30), scope=second_scope),
        ]
        results = {r.request_id: list(r.output_ids) for r in engine.generate(requests)}
        assert results["first"] == results["second"] == reference_greedy(FakeModel(), prompt, 30)
        return engine.stats().prompt_lookup.shared.copies, [
            engine.stats().prompt_lookup.shared.accepted
        ]

    same, accepted = shared_stats("tenant-a")
    assert same > 0 and accepted[0] > 0
    other, _ = shared_stats("tenant-b")
    assert other == 0
