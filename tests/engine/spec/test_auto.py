"""The cost-aware draft policy (``--draft-policy auto``, ``spec/auto.py``)
driven through its ``DraftPolicy`` methods only, as a step calls them, on
costs set up front and a fake clock: the step's time accounted, the copies
priced by position, and the head's schedule (rest, quiet steps, the drain)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import MtpLadder
from metrale.engine.sequence import SeqState
from metrale.engine.spec.auto import AutoPolicy
from metrale.engine.spec.copies import settle_copies
from metrale.engine.spec.cost import CostModel
from metrale.engine.spec.mtp import DraftFeed
from metrale.engine.spec.policy import Feed
from metrale.engine.spec.rest import HOLD_MAX
from metrale.engine.step import Queues, StepTimes
from metrale.lookup import LookupStats, PromptLookupConfig
from tests.support.fake_model import FakeClock

HIDDEN = 4  # width of the hidden rows fed to the head (the policy only holds them)


def policy_on(
    costs: CostModel, lookup: PromptLookupConfig | None = None, without: tuple[str, ...] = ()
) -> AutoPolicy:
    return AutoPolicy(MtpLadder(), lookup, None, costs, without)


def decoding(
    slot: int, prompt: Sequence[int] = (1, 2, 3), max_tokens: int = 64, token: int = 9
) -> SeqState:
    """A sequence that has sampled its first token: the next verify feeds it."""
    request = Request(str(slot), tuple(prompt), SamplingParams(max_tokens=max_tokens))
    seq = SeqState(request, slot, 1024, frozenset(), None, None)
    seq.history.append(token)
    seq.seq_len = len(prompt)
    return seq


def draft(policy: AutoPolicy, seq: SeqState, chain: Sequence[int] = (5,)) -> None:
    """The head drafted ``chain`` for ``seq`` (as the device step reports it)."""
    policy.chain_drafted(seq, list(chain))
    seq.set_drafts(list(chain))


def head_step(policy: AutoPolicy, batch: list[SeqState], queues: Queues) -> dict[int, DraftFeed]:
    """One step's drafts and head as the host step asks for them, nothing
    verified or measured (the costs stay as set up): the plan, then a row
    per sequence for the head. Returns the feeds by slot; each fed sequence
    gets a chain of one draft."""
    policy.take_drafts(batch, queues)
    policy.before_head(batch, queues)
    fed = {}
    for seq in batch:
        rows = torch.zeros(1, HIDDEN)
        feed = policy.head_feed(seq, seq.seq_len, [seq.last_token], rows, len(batch))
        if feed is not None:
            fed[seq.slot] = feed[0]
            draft(policy, seq)
    return fed


def test_the_heads_forwards_are_kept_out_of_the_rest_of_the_step() -> None:
    # The rest of a step prices every row: counted there, the head's forwards
    # would lower the rate rows and chains are priced at.
    clock = FakeClock()
    costs = CostModel(clock)
    for rows, seconds in ((4, 0.020), (8, 0.025)):
        costs.verify.observe(rows, seconds)
    policy = policy_on(costs)
    batch = [decoding(slot) for slot in range(4)]
    policy.take_drafts(batch, Queues(decoding=batch))
    # A 30 ms step: 20 ms its verify, 6 ms the head's forwards after it.
    clock.now = 0.030
    policy.end_step(StepTimes(began=0.0, verify_s=0.020, head_s=0.006))
    assert costs.other_s == pytest.approx(0.004)
    snapshot = policy.snapshot(final=True)
    assert snapshot is not None and snapshot.measured_ms == pytest.approx(24.0)
    # A step without a plan (nothing verified under the budget) counts nothing.
    clock.now = 0.130
    policy.end_step(StepTimes(began=0.030, verify_s=0.050))
    assert costs.other_s == pytest.approx(0.004)
    snapshot = policy.snapshot(final=True)
    assert snapshot is not None and snapshot.steps == 1


def test_a_copy_is_verified_as_far_as_the_runs_estimates_by_position_pay() -> None:
    # A sequence's copy of 4 is right on its first two tokens and wrong on the
    # third, every time: the estimates per position learn it, and the plan
    # verifies the first two alone, where a further row costs 2 ms for
    # nothing.
    lookup = PromptLookupConfig(ngram=2, min_match=3, max_drafts=8, miss_backoff=0)

    def step_s(rows: int) -> float:
        return 0.010 + 0.002 * (rows - 1)

    costs = CostModel(FakeClock())
    for rows in range(1, 6):
        costs.verify.observe(rows, step_s(rows))
    policy = policy_on(costs, lookup)
    # The last 16 tokens occurred before, followed by 1 2 3 4 5; 6 tokens
    # left: copies of 4.
    stretch = list(range(100, 116))
    seq = decoding(0, (70, *stretch, 1, 2, 3, 4, 5, *stretch[:-1]), max_tokens=6, token=115)
    model_says = [1, 2, 9, 9, 9]  # what the model emits next

    def offer() -> list[int]:
        """The drafts the policy verifies for ``seq`` alone, and their verify."""
        took = policy.take_drafts([seq], Queues(decoding=[seq]))
        drafts = list(seq.pending_drafts)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == model_says[accepted]:
            accepted += 1
        produced = model_says[: accepted + 1]  # the accepted drafts and the bonus token
        rows = 1 + len(drafts)
        policy.verified(StepTimes(verify_s=step_s(rows), verify_rows=rows, produced={0: produced}))
        settle_copies(took, None, LookupStats())
        return drafts

    for _ in range(30):
        offer()
    assert offer() == [1, 2]
    # From here every copy is wrong: the estimates, decayed slowly over the
    # run, unlearn what they saw, and the copies stop.
    model_says[:2] = [8, 8]
    for _ in range(150):
        offer()
    assert offer() == []


def test_a_held_prompt_goes_to_the_head_only_where_its_chain_repays_it() -> None:
    # Verifies of 1 and 2 rows at 10 and 11 ms, head forwards at 1 ms (one
    # sequence) and 8 ms (16): at 100 tokens/s a first draft at the prior is
    # worth 0.5 - 0.1 (its row), far above the head's 0.1, and a sure one
    # adds 0.8 token a step at most; a held row costs 0.5 ms, 0.05 token.
    costs = CostModel(FakeClock())
    costs.verify.observe(1, 0.010)
    costs.verify.observe(2, 0.011)
    costs.head.observe(1, 0.001)
    costs.head.observe(16, 0.008)
    policy = policy_on(costs)

    def last_chunk_fed(tokens_left: int, held: int) -> DraftFeed | None:
        """Reads a prompt of ``held + 1`` tokens in two chunks."""
        request = Request("a", tuple(range(held + 1)), SamplingParams(max_tokens=tokens_left))
        seq = SeqState(request, 0, 1024, frozenset(), None, None)
        queues = Queues(prefilling=[seq])
        if held:
            first = policy.prompt_feed(seq, 0, [5] * held, torch.zeros(held, HIDDEN), False, queues)
            assert first is None  # a prompt's chunks wait for its chain to be worth them
        feed = policy.prompt_feed(seq, held, [5], torch.zeros(1, HIDDEN), True, queues)
        return None if feed is None else feed[0]

    alone = last_chunk_fed(6, 0)  # nothing held: it drafts
    assert alone is not None and (alone.start, len(alone.next_ids)) == (0, 1)
    # 100 held rows cost 5 tokens: repaid over 7 tokens left, and handed to
    # the head with the last chunk in one feed; not over 6.
    whole = last_chunk_fed(7, 100)
    assert whole is not None and (whole.start, len(whole.next_ids)) == (0, 101)
    assert last_chunk_fed(6, 100) is None


def costs_a_token_a_row_at_sixteen() -> CostModel:
    """One or two rows at about the same cost (10 and 11 ms); from 16 rows
    on, every row costs what a 16-row step costs per token: no chain could
    pay there (``rest.chain_margin``). A head forward: 0.5 ms for one
    sequence, 1 ms for 16."""
    costs = CostModel(FakeClock())
    for rows, seconds in ((1, 0.010), (2, 0.011), (16, 0.048), (32, 0.096)):
        costs.verify.observe(rows, seconds)
    costs.head.observe(1, 0.0005)
    costs.head.observe(16, 0.001)
    return costs


def test_above_max_seqs_no_chain_drafts_where_none_could_pay_until_the_batch_thins() -> None:
    policy = policy_on(costs_a_token_a_row_at_sixteen())  # no lookup: copies off
    alone = decoding(0, max_tokens=1000)
    for _ in range(3):  # alone, its chain is worth the head forward every step
        assert list(head_step(policy, [alone], Queues(decoding=[alone]))) == [0]
    # Fifteen join: a row costs a token. The chain valued alone no longer
    # drafts, nor do the new ones; each holds its rows.
    batch = [alone, *(decoding(slot, max_tokens=1000) for slot in range(1, 16))]
    for _ in range(20):
        assert head_step(policy, batch, Queues(decoding=batch)) == {}
    # Alone again, it drafts at once, the 20 held rows before this step's.
    fed = head_step(policy, [alone], Queues(decoding=[alone]))
    assert list(fed) == [0] and len(fed[0].next_ids) == 21


def test_a_chain_is_priced_at_every_sequence_that_shares_the_steps_to_come() -> None:
    # A batch's first request decodes alone while the others read their
    # prompts or wait to copy its prefix: priced at that lone step, where a
    # row is nearly free, its chain would start, and rest again once they
    # decode beside it. Alone for good, it drafts.
    policy = policy_on(costs_a_token_a_row_at_sixteen())
    first = decoding(0, max_tokens=1000)
    reading = [decoding(slot, max_tokens=1000) for slot in range(1, 16)]
    assert head_step(policy, [first], Queues(decoding=[first], prefilling=reading)) == {}
    assert head_step(policy, [first], Queues(decoding=[first], attached=15)) == {}
    fed = head_step(policy, [first], Queues(decoding=[first]))
    assert list(fed) == [0] and len(fed[0].next_ids) == 3  # the two rows it held, and this one


def verified_step(policy: AutoPolicy, batch: list[SeqState], queues: Queues) -> list[int]:
    """``head_step`` with a verify between the plan and the head, where every
    draft is accepted; returns the slots fed."""
    policy.take_drafts(batch, queues)
    produced = {seq.slot: [*seq.pending_drafts, 9] for seq in batch}
    verify_rows = sum(len(tokens) for tokens in produced.values())
    policy.verified(StepTimes(verify_s=0.010, verify_rows=verify_rows, produced=produced))
    starts = [seq.seq_len for seq in batch]
    for seq in batch:
        seq.emit(produced[seq.slot], None)
        seq.seq_len += len(produced[seq.slot])
        seq.set_drafts([])
    policy.before_head(batch, queues)
    fed = []
    for seq, start in zip(batch, starts, strict=True):
        next_ids = seq.history[start + 1 : seq.seq_len + 1]
        rows = torch.zeros(len(next_ids), HIDDEN)
        if policy.head_feed(seq, start, next_ids, rows, len(batch)) is not None:
            fed.append(seq.slot)
            draft(policy, seq)
    return fed


def test_while_the_batch_only_thins_a_chain_that_rested_since_its_prompt_stays_at_rest() -> None:
    # Two sequences are left of sixteen: one whose chain drafted, and was
    # verified, before the others joined; one whose chain rested from its
    # prompt on. While a request may still join, or while no slot is free,
    # both draft again with the rows they hold; once none will (the stream
    # has ended and slots are free), only the first. A run that has verified
    # no draft of the head at all still starts both: it learns the head so.
    def drafting_when_two_are_left(
        stream_done: bool, free_slots: int = 14, alone: int = 3
    ) -> list[int]:
        policy = policy_on(costs_a_token_a_row_at_sixteen())
        valued = decoding(0, max_tokens=1000)
        batch = [valued, *(decoding(slot, max_tokens=1000) for slot in range(1, 16))]
        for step in range(alone + 20):
            live = [valued] if step < alone else batch
            fed = verified_step(policy, live, Queues(decoding=live))
            assert fed == ([0] if step < alone else [])
        left = batch[:2]
        queues = Queues(decoding=left, stream_done=stream_done, free_slots=free_slots)
        return verified_step(policy, left, queues)

    assert drafting_when_two_are_left(stream_done=False) == [0, 1]
    assert drafting_when_two_are_left(stream_done=True, free_slots=0) == [0, 1]
    assert drafting_when_two_are_left(stream_done=True) == [0]
    assert drafting_when_two_are_left(stream_done=True, alone=0) == [0, 1]


def test_without_the_rest_every_chain_drafts_even_where_none_could_pay() -> None:
    # The ablation of the rest (``budget.MECHANISMS``) turns quiet steps off too.
    policy = policy_on(costs_a_token_a_row_at_sixteen(), without=("rest",))
    batch = [decoding(slot, max_tokens=1000) for slot in range(16)]
    for _ in range(3):
        assert sorted(head_step(policy, batch, Queues(decoding=batch))) == list(range(16))


def test_above_max_seqs_where_no_chain_could_pay_a_full_hold_is_fed() -> None:
    policy = policy_on(costs_a_token_a_row_at_sixteen())
    batch = [decoding(slot, max_tokens=1000) for slot in range(16)]
    queues = Queues(decoding=batch)
    fed: dict[int, DraftFeed] = {}
    steps = 0
    while not fed and steps <= HOLD_MAX:
        fed, steps = head_step(policy, batch, queues), steps + 1
    # Each holds one row a step; once HOLD_MAX wait, the head takes them all.
    assert steps == HOLD_MAX + 1 and sorted(fed) == list(range(16))
    assert {len(feed.next_ids) for feed in fed.values()} == {HOLD_MAX + 1}


def test_a_chain_drafts_where_it_pays_the_forwards_a_step_lately_ran() -> None:
    # 16 sequences at 100 tokens/s whose rows cost 0.25 token: a first draft
    # at the prior adds 0.25 a step. A head forward of 1 ms for one (0.1
    # token): every chain pays its forward.
    costs = CostModel(FakeClock())
    costs.verify.observe(16, 0.160)
    costs.verify.observe(32, 0.200)
    costs.head.observe(1, 0.001)
    costs.head.observe(16, 0.004)
    policy = policy_on(costs)
    batch = [decoding(slot) for slot in range(16)]
    queues = Queues(decoding=batch)

    def fed() -> list[int]:
        policy.before_head(batch, queues)
        feeds = [
            policy.head_feed(seq, seq.seq_len, [seq.last_token], torch.zeros(1, HIDDEN), 16)
            for seq in batch
        ]
        return [seq.slot for seq, feed in zip(batch, feeds, strict=True) if feed is not None]

    assert fed() == list(range(16))
    # Steps whose head calls ran three forwards each (chains two drafts
    # deeper): 0.3 token a chain, and every chain rests.
    feeds = [DraftFeed(seq, seq.seq_len, [seq.last_token], 1) for seq in batch]
    for _ in range(40):
        policy.head_ran(feeds, 3, 3 * 0.004)
    assert fed() == []


def waited_on_source(prompt: Sequence[int]) -> SeqState:
    """A sequence reading ``prompt`` whose prefix a request waits to copy,
    its MTP modules' rows all still to be fed."""
    request = Request("source", tuple(prompt), SamplingParams(max_tokens=64))
    seq = SeqState(request, 0, 1024, frozenset(), None, None, head_rows=0)
    seq.waited_on = 1
    return seq


def read_prompt(policy: AutoPolicy, seq: SeqState, first: int, start: int = 0) -> Feed | None:
    """Reads ``seq``'s prompt from ``start`` in one chunk that completes it;
    hidden row ``p`` is ``[p] * HIDDEN``."""
    seq.seq_len = seq.prompt_len
    seq.history.append(first)
    next_ids = seq.history[start + 1 : seq.prompt_len + 1]
    rows = torch.arange(start, seq.prompt_len, dtype=torch.float32)[:, None].repeat(1, HIDDEN)
    return policy.prompt_feed(seq, start, next_ids, rows, True, Queues(prefilling=[seq]))


def test_a_waited_on_prompt_is_held_and_lent_with_the_prefix_its_waiter_reuses() -> None:
    # A head forward of 10 s: no chain pays it, so every prompt is held.
    costs = CostModel(FakeClock())
    costs.verify.observe(1, 0.010)
    costs.head.observe(1, 10.0)
    policy = policy_on(costs)
    source = waited_on_source(range(10, 20))
    assert read_prompt(policy, source, first=99) is None  # held, not fed
    # A request sharing the first 8 tokens takes rows 0..7, with its own
    # tokens after each; the head reads them only if its chain drafts.
    request = Request("waiter", (*range(10, 18), 77, 78), SamplingParams(max_tokens=64))
    waiter = SeqState(request, 1, 1024, frozenset(), None, None, head_rows=0)
    assert policy.lend(source, waiter, 0, 8)
    waiter.seq_len = 8
    assert read_prompt(policy, waiter, first=55, start=8) is None
    # Ended, its held prompt rows come out as one feed: the lent ones first.
    ended = policy.ended(waiter)
    assert ended is not None
    feed, rows = ended
    assert (feed.start, list(feed.next_ids)) == (0, [*range(11, 18), 77, 78, 55])
    assert rows[:, 0].tolist() == list(range(10))
    # Rows the source does not hold are not lent.
    assert not policy.lend(source, waiter, 8, 12)


def test_rows_released_to_the_head_while_a_request_waits_may_still_be_lent() -> None:
    # A cheap head: the chain drafts as its prompt completes, so the head
    # reads the prompt's rows; the waiter still takes the one row past its
    # modules' copy (the module lag) from them.
    costs = CostModel(FakeClock())
    costs.verify.observe(1, 0.010)
    costs.verify.observe(2, 0.011)
    costs.head.observe(1, 0.0001)
    policy = policy_on(costs)
    source = waited_on_source(range(10, 20))
    fed = read_prompt(policy, source, first=99)
    assert fed is not None and fed[0].start == 0 and len(fed[0].next_ids) == 10
    # Its first verify's row goes to the head too before the waiter is
    # ready; the prompt's rows are still kept.
    queues = Queues(decoding=[source])
    policy.take_drafts([source], queues)
    policy.before_head([source], queues)
    row = policy.head_feed(source, 10, [98], torch.full((1, HIDDEN), 10.0), 1)
    assert row is not None and row[0].start == 10
    request = Request("waiter", (*range(10, 18), 77), SamplingParams(max_tokens=64))
    waiter = SeqState(request, 1, 1024, frozenset(), None, None, head_rows=7)
    assert policy.lend(source, waiter, 7, 8)
    not_waited = waited_on_source(range(30, 40))
    not_waited.waited_on = 0
    assert read_prompt(policy, not_waited, first=98) is not None
    assert not policy.lend(not_waited, waiter, 7, 8)


def test_a_chain_starting_with_its_prompt_is_priced_with_the_requests_waiting_on_a_prefix() -> None:
    # Alone, a first draft is worth its row (10 to 11 ms); at 16 sequences a
    # row costs a token, and fifteen requests waiting to copy this prompt's
    # prefix will share the steps to come.
    def first_feed(attached: int) -> Feed | None:
        policy = policy_on(costs_a_token_a_row_at_sixteen())
        request = Request("a", (1, 2, 3), SamplingParams(max_tokens=64))
        seq = SeqState(request, 0, 1024, frozenset(), None, None, head_rows=0)
        seq.seq_len = 3
        seq.history.append(9)
        queues = Queues(prefilling=[seq], attached=attached)
        return policy.prompt_feed(seq, 0, [2, 3, 9], torch.zeros(3, HIDDEN), True, queues)

    assert first_feed(attached=0) is not None
    assert first_feed(attached=15) is None
