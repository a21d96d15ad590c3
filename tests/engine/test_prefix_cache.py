"""The prefix cache (``engine/prefix_cache.py``) changes no output, only what is prefilled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.spec.calibration import Calibration, CostCache, calibration_key
from metrale.engine.spec.cost import CALIBRATION_FEEDS, CALIBRATION_ROWS
from metrale.engine.spec.mtp import DraftFeed, MtpDrafter
from metrale.engine.stats import EngineStats
from tests.support.checkpoints import write_tiny_checkpoint

SHARED = list(range(3, 3 + 40))  # a 40-token "system prompt"


@pytest.fixture(scope="module", params=[None, "deepseek"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", mtp_layout=request.param)


def load(path: Path, slots: int) -> LoadedModel:
    return load_model(
        path, RuntimeConfig(device="cpu", dtype="float32", num_slots=slots, max_len=128)
    )


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> LoadedModel:
    return load(checkpoint, 4)


def lines(sampled: bool) -> list[Request]:
    params = SamplingParams(max_tokens=12, temperature=1.0 if sampled else 0.0, seed=7)
    tails = [[50 + i, 60 + i, 70 + i][: 1 + i % 3] for i in range(10)]
    return [Request(str(i), tuple(SHARED + tail), params) for i, tail in enumerate(tails)]


def run(loaded: LoadedModel, requests: list[Request], **config: object) -> tuple[dict, int]:
    engine = Engine.from_loaded(loaded, EngineConfig(draft_policy="fixed", **config))  # type: ignore[arg-type]
    out = {r.request_id: r.output_ids for r in engine.generate(requests)}
    return out, engine.stats().cached_tokens


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize(("batch", "path"), [(1, "host"), (4, "host"), (4, "device")])
def test_output_is_the_same_with_and_without_the_cache(
    loaded: LoadedModel, sampled: bool, batch: int, path: str
) -> None:
    requests = lines(sampled)
    without, none = run(loaded, requests, max_batch=batch, prefix_cache=False, step_path=path)
    with_cache, cached = run(loaded, requests, max_batch=batch, step_path=path)
    assert with_cache == without
    assert none == 0
    # All but the first line reuse the shared prompt, less the MTP module's lag.
    lag = 1 if loaded.mtp else 0
    assert cached >= (len(requests) - 1) * (len(SHARED) - lag)


def chains_rest(loaded: LoadedModel, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores a head forward so dear that no chain ever pays it: under
    ``auto`` every chain rests and holds its rows."""
    monkeypatch.setenv("METRALE_HOME", str(home))
    verify = {rows: 1e-3 for rows in CALIBRATION_ROWS}
    head = {feeds: 10.0 for feeds in CALIBRATION_FEEDS}
    CostCache(home, calibration_key(loaded)).store(Calibration(verify, head, 1.0))


def count_feeds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every feed the MTP head is given from now on: (first position, rows)."""
    fed: list[tuple[int, int]] = []
    feed_and_draft = MtpDrafter.feed_and_draft

    def counted(self: MtpDrafter, feeds: list[DraftFeed], rows: torch.Tensor) -> object:
        fed.extend((f.start, len(f.next_ids)) for f in feeds)
        return feed_and_draft(self, feeds, rows)

    monkeypatch.setattr(MtpDrafter, "feed_and_draft", counted)
    return fed


def exact_under_auto(
    loaded: LoadedModel, requests: list[Request], batch: int, fed: list[tuple[int, int]]
) -> tuple[EngineStats, list[tuple[int, int]]]:
    """Runs ``requests`` under ``auto`` with the prefix cache, checks their
    output against a run without the cache, and returns the run's stats and
    the head feeds it made (``count_feeds``)."""
    engine = Engine.from_loaded(loaded, EngineConfig(max_batch=batch, draft_policy="auto"))
    results = {r.request_id: r.output_ids for r in engine.generate(requests)}
    made = list(fed)
    plain, _ = run(loaded, requests, max_batch=batch, prefix_cache=False)
    assert results == plain
    return engine.stats(), made


def test_one_line_at_a_time_under_auto_reuses_the_prompt_a_resting_chain_held(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain that rests holds its prompt back from the MTP module, and a
    slot serves only the rows every module holds: the module reads the held
    prompt rows as the sequence ends, so the next line still reuses them."""
    if not loaded.mtp:
        pytest.skip("no MTP module: nothing is held back")
    chains_rest(loaded, tmp_path, monkeypatch)
    stats, _ = exact_under_auto(loaded, lines(False)[:4], 1, [])
    assert sum(stats.mtp_proposed_by_position) == 0, "the chains rested"
    assert stats.prefix_hits == 3
    assert stats.cached_tokens >= 3 * (len(SHARED) - 1)


def test_no_prompt_row_is_fed_where_every_chain_rests(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines admitted together from a stream that has ended: the first
    line's resting chain holds its prompt rows, and the others take the
    ones of the prefix they share with them, so they reuse the whole shared
    prompt (no module lag) and the head reads none of it; every held row is
    dropped unread as its line ends, since no request is left to reuse it."""
    if not loaded.mtp:
        pytest.skip("no MTP module: nothing is held back")
    chains_rest(loaded, tmp_path, monkeypatch)
    fed = count_feeds(monkeypatch)
    # Fewer lines than slots: the engine reads the stream's end as it admits them.
    stats, made = exact_under_auto(loaded, lines(False)[:3], 4, fed)
    assert stats.prefix_hits == 2 and stats.cached_tokens == 2 * len(SHARED)
    assert made == []


def test_a_source_that_ends_on_its_first_token_has_its_prompt_read_for_its_waiters(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first line ends as its prompt completes, before the lines waiting
    on it could take its held rows: the head reads them as it ends, so the
    others copy modules' rows that hold their prefix."""
    if not loaded.mtp:
        pytest.skip("no MTP module: nothing is held back")
    chains_rest(loaded, tmp_path, monkeypatch)
    fed = count_feeds(monkeypatch)
    first, *rest = lines(False)[:3]
    requests = [Request(first.request_id, first.prompt_ids, SamplingParams(max_tokens=1)), *rest]
    stats, made = exact_under_auto(loaded, requests, 4, fed)
    assert stats.prefix_hits == 2 and stats.cached_tokens >= 2 * (len(SHARED) - 1)
    assert made and made[0][0] == 0 and sum(rows for _, rows in made) >= len(SHARED)


def test_a_held_prompt_no_later_line_reuses_is_never_fed(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line at a time, no two sharing a prefix: the prompt rows each
    resting chain held are owed to its slot and dropped unread when the
    next line takes it."""
    if not loaded.mtp:
        pytest.skip("no MTP module: nothing is held back")
    chains_rest(loaded, tmp_path, monkeypatch)
    fed = count_feeds(monkeypatch)
    params = SamplingParams(max_tokens=6)
    requests = [Request(str(i), tuple(range(10 + 20 * i, 30 + 20 * i)), params) for i in range(4)]
    stats, made = exact_under_auto(loaded, requests, 1, fed)
    assert stats.prefix_hits == 0
    assert made == []


def test_a_held_prompt_is_fed_only_as_far_as_the_next_line_reuses_it(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two lines one at a time, sharing 40 prompt tokens, the first with 30
    of its own after them: the second reuses the shared ones, and the head
    reads the first's held rows that far (and the module lag), not its whole
    prompt."""
    if not loaded.mtp:
        pytest.skip("no MTP module: nothing is held back")
    chains_rest(loaded, tmp_path, monkeypatch)
    fed = count_feeds(monkeypatch)
    params = SamplingParams(max_tokens=6)
    first = Request("0", tuple(SHARED + list(range(80, 110))), params)
    second = Request("1", (*SHARED, 50), params)
    stats, made = exact_under_auto(loaded, [first, second], 1, fed)
    assert stats.prefix_hits == 1 and stats.cached_tokens >= len(SHARED) - 1
    assert made and all(start == 0 for start, _ in made)
    assert sum(rows for _, rows in made) <= len(SHARED) + 1


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_lines_admitted_together_prefill_the_shared_prompt_once(
    loaded: LoadedModel, policy: str
) -> None:
    """Under ``auto`` too, whose resting chains hold short prompts back from
    the MTP module: a source others wait for lends them its held rows, or
    is fed at once."""
    requests = lines(False)[:4]
    engine = Engine.from_loaded(loaded, EngineConfig(max_batch=4, draft_policy=policy))
    results = list(engine.generate(requests))
    stats = engine.stats()
    assert stats.prefix_hits == 3 and stats.admitted == 4
    lag = 1 if loaded.mtp else 0
    assert stats.cached_tokens >= 3 * (len(SHARED) - lag)
    plain = Engine.from_loaded(
        loaded, EngineConfig(max_batch=4, draft_policy=policy, prefix_cache=False)
    )
    expected = {r.request_id: r.output_ids for r in plain.generate(requests)}
    assert {r.request_id: r.output_ids for r in results} == expected


def test_eviction_under_a_small_budget_is_least_recently_used_and_exact(
    checkpoint: Path,
) -> None:
    """One line at a time (one ``generate`` each, on one engine) over two
    slots, three system prompts: C's line overwrites A's rows (used least
    recently), so A's second line prefills again, while B's second line
    reuses B's rows. Four slots keep all three."""
    params = SamplingParams(max_tokens=6)
    prefix = {k: [base + i for i in range(40)] for k, base in (("A", 3), ("B", 43), ("C", 83))}
    order = ["A", "B", "B", "C", "A"]
    requests = [Request(str(i), (*prefix[k], 130 + i), params) for i, k in enumerate(order)]
    for slots, hits in ((2, [0, 0, 1, 0, 0]), (4, [0, 0, 1, 0, 1])):
        model = load(checkpoint, slots)
        engine = Engine.from_loaded(model, EngineConfig(draft_policy="fixed", max_batch=slots))
        results = {r.request_id: r for q in requests for r in engine.generate([q])}
        without, _ = run(model, requests, max_batch=1, prefix_cache=False)
        assert {k: r.output_ids for k, r in results.items()} == without
        assert [int(results[str(i)].cached_tokens > 0) for i in range(5)] == hits


def test_choices_of_one_prompt_fork_it_and_draw_their_own_streams(loaded: LoadedModel) -> None:
    prompt = (*SHARED, 90)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=11)
    forks = [Request(f"c{i}", prompt, sampled, choice=i) for i in range(4)]
    first, cached = run(loaded, forks, max_batch=4)
    again, _ = run(loaded, forks, max_batch=4, prefix_cache=False)
    assert first == again  # reproducible, with or without the fork
    assert len(set(first.values())) == 4  # each choice its own sample
    assert cached >= 3 * (len(SHARED) - 1)
    greedy = [Request(f"g{i}", prompt, SamplingParams(max_tokens=10), choice=i) for i in range(3)]
    plain, _ = run(loaded, greedy[:1], max_batch=1, prefix_cache=False)
    assert set(run(loaded, greedy, max_batch=3)[0].values()) == set(plain.values())
