"""The batch engine on a fake model: parity, batching, finishing and figures."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, MtpLadder, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.default_model import ensure_default_model
from metrale.engine.load.loader import load_model
from metrale.engine.spec.cost import CostModel
from metrale.engine.stats import EngineStats
from tests.support.checkpoints import load_reference_model, write_tiny_checkpoint
from tests.support.engine_runs import (
    CHECKPOINT_PROMPTS,
    LOOKUP,
    PROMPTS,
    check_figures_add_up,
    outputs,
    requests,
)
from tests.support.fake_model import (
    CostedModel,
    CostedMtp,
    FakeClock,
    FakeModel,
    FakeMtp,
    byte_decode,
    reference_greedy,
)

pytestmark = pytest.mark.usefixtures("one_thread")


MODES = {
    "off": (False, None),
    "mtp": (True, None),
    "lookup": (False, LOOKUP),
    "both": (True, LOOKUP),
}


def make_engine(
    mode: str,
    model: FakeModel | None = None,
    mtp_mode: str = "mixed",
    eos: tuple[int, ...] = (0,),
    **config: object,
) -> tuple[Engine, FakeModel]:
    model = model or FakeModel(num_slots=8)
    use_mtp, lookup = MODES[mode]
    mtp = [FakeMtp(model, mtp_mode)] if use_mtp else []  # type: ignore[arg-type]
    cfg = EngineConfig(prompt_lookup=lookup, **config)  # type: ignore[arg-type]
    return Engine(model, byte_decode, cfg, mtp=mtp, eos_token_ids=eos), model


@pytest.mark.parametrize("policy", ["fixed", "auto"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_output_is_plain_decoding_whatever_the_speculation(
    mode: str, batch: int, policy: str
) -> None:
    engine, _ = make_engine(mode, max_batch=batch, draft_policy=policy)
    results = list(engine.generate(requests(PROMPTS)))
    for r in results:
        expected = reference_greedy(FakeModel(), PROMPTS[int(r.request_id)], 30, eos=(0,))
        assert list(r.output_ids) == expected, (mode, batch, r.request_id)
        assert r.finish_reason == ("stop" if expected[-1] == 0 else "length")
    stats = engine.stats()
    assert stats.requests_done == len(PROMPTS) and stats.running == stats.waiting == 0
    if mode == "off":
        assert stats.mean_tokens_per_verify == 1.0
    elif policy == "fixed":
        # Under auto whether a draft is verified at all follows this fake's
        # wall-clock costs (a row of its Python forward costs about a token,
        # and rightly no chain runs); the fixed rules always draft.
        assert stats.mean_tokens_per_verify > 1.0


def test_requests_that_cannot_fit_come_back_as_errors_at_once() -> None:
    engine, _ = make_engine("both", FakeModel(num_slots=2, max_len=64))
    stream = [
        Request("ok", (1, 2, 3), SamplingParams(max_tokens=10)),
        Request("empty", (), SamplingParams(max_tokens=10)),
        Request("long", tuple(range(10)) * 6, SamplingParams(max_tokens=10)),
        Request("ok2", (4, 5), SamplingParams(max_tokens=10)),
    ]
    results = list(engine.generate(stream))
    by_id = {r.request_id: r for r in results}
    assert [r.request_id for r in results[:2]] == ["empty", "long"]
    assert by_id["empty"].finish_reason == "error" and "empty prompt" in str(by_id["empty"].error)
    assert by_id["long"].finish_reason == "error" and "64 positions" in str(by_id["long"].error)
    assert by_id["ok"].error is None and len(by_id["ok"].output_ids) > 0
    assert by_id["ok2"].error is None
    assert engine.stats().requests_failed == 2 and engine.stats().requests_total == 4


def test_requests_are_pulled_lazily_and_results_yielded_as_they_finish() -> None:
    pulled = 0

    def stream() -> Iterator[Request]:
        nonlocal pulled
        for i in range(1000):
            pulled += 1
            yield Request(str(i), (i % 16, 3), SamplingParams(max_tokens=2 if i == 0 else 20))

    engine, _ = make_engine("off", FakeModel(num_slots=4), eos=(), max_batch=4)
    results = engine.generate(stream())
    first = next(results)
    assert first.request_id == "0"  # the shortest finishes first
    assert pulled <= 4 + 1
    remaining = [next(results) for _ in range(5)]
    assert len(remaining) == 5 and pulled < 20


def test_steps_hand_back_each_step_and_add_up_to_generate() -> None:
    # Two lines at once, no drafts, 4 tokens each: the first step reads the
    # prompts, emits their first tokens and verifies them (a second token),
    # then two more verifies.
    stream = [
        Request("a", (1, 2, 3), SamplingParams(max_tokens=4)),
        Request("", (), SamplingParams(max_tokens=4)),
        Request("b", (4, 5, 6), SamplingParams(max_tokens=4)),
    ]
    engine, _ = make_engine("off", FakeModel(num_slots=2), eos=(), max_batch=2)
    steps = list(engine.steps(stream))
    assert [r.finish_reason for r in steps[0]] == ["error"]  # the empty prompt, at once
    assert all(step == [] for step in steps[1:-1])
    assert sorted(r.request_id for r in steps[-1]) == ["a", "b"]
    assert len(steps) == 1 + 3
    again, _ = make_engine("off", FakeModel(num_slots=2), eos=(), max_batch=2)
    assert outputs([r for step in steps for r in step]) == outputs(list(again.generate(stream)))


def test_a_quiet_source_does_not_hold_back_running_requests() -> None:
    # None from the source means "nothing has arrived yet": the engine must
    # finish what it holds instead of waiting for a full batch.
    arrived = threading.Event()

    def stream() -> Iterator[Request | None]:
        yield Request("first", (1, 2, 3), SamplingParams(max_tokens=3))
        while not arrived.is_set():
            yield None
        yield Request("second", (4, 5), SamplingParams(max_tokens=3))

    engine, _ = make_engine("both", FakeModel(num_slots=4), eos=(), max_batch=4)
    results = engine.generate(stream())
    first = next(results)
    assert first.request_id == "first" and first.completion_tokens == 3
    arrived.set()
    assert [r.request_id for r in results] == ["second"]
    assert engine.stats().requests_total == 2


def test_chunked_prefill_lets_running_sequences_keep_decoding() -> None:
    model = FakeModel(num_slots=2, max_len=256)
    engine, _ = make_engine("both", model, eos=(), prefill_chunk=8)
    long_prompt = [(i * 7) % 16 for i in range(100)]
    results = list(engine.generate(requests([[1, 2], long_prompt], max_tokens=20)))
    assert outputs(results) == {
        "0": reference_greedy(FakeModel(), [1, 2], 20),
        "1": reference_greedy(FakeModel(), long_prompt, 20),
    }
    assert max(len(s.token_ids) for f in model.forwards for s in f) <= 8 + 1
    # Slot 0 verified in the forwards between the chunks of slot 1's prompt.
    prefill_done = next(
        i
        for i, f in enumerate(model.forwards)
        if any(s.slot == 1 and s.start + len(s.token_ids) == 100 for s in f)
    )
    verifies = [f for f in model.forwards[:prefill_done] if f[0].slot == 0 and f[0].start >= 2]
    assert len(verifies) >= 5


def test_eos_and_stop_strings_end_a_request_the_same_way_with_any_speculation() -> None:
    prompt = PROMPTS[0]
    plain = reference_greedy(FakeModel(), prompt, 40)
    text = byte_decode(plain)
    stop = text[5:8]
    cut = text.find(stop)
    for mode in MODES:
        engine, _ = make_engine(mode, eos=())
        (result,) = engine.generate(
            [Request("s", tuple(prompt), SamplingParams(max_tokens=40, stop=(stop, "zzz")))]
        )
        assert result.finish_reason == "stop" and result.text == text[:cut], mode
        assert byte_decode(result.output_ids).startswith(text[: cut + len(stop)])
        assert len(byte_decode(result.output_ids)) <= cut + len(stop)
    eos = plain[3]
    engine, _ = make_engine("both", eos=())
    (result,) = engine.generate(
        [Request("e", tuple(prompt), SamplingParams(max_tokens=40, eos_token_ids=(eos,)))]
    )
    first_eos = plain.index(eos)
    assert list(result.output_ids) == plain[: first_eos + 1]
    assert result.text == byte_decode(plain[:first_eos]) and result.finish_reason == "stop"


def test_no_verify_emits_past_max_tokens() -> None:
    for max_tokens in (1, 2, 3, 7):
        engine, _ = make_engine("both", mtp_mode="right")
        results = list(engine.generate(requests(PROMPTS, max_tokens=max_tokens)))
        for r in results:
            assert 1 <= len(r.output_ids) <= max_tokens
            expected = reference_greedy(FakeModel(), PROMPTS[int(r.request_id)], max_tokens, (0,))
            assert list(r.output_ids) == expected


def test_mtp_chain_length_follows_the_ladder_by_batch_size() -> None:
    ladder = MtpLadder(steps=((1, 4),), beyond=1)
    model = FakeModel(num_slots=8)
    engine, _ = make_engine("mtp", model, mtp_mode="right", mtp_ladder=ladder, draft_policy="fixed")
    list(engine.generate(requests([PROMPTS[2]], max_tokens=25)))
    widths = {len(s.token_ids) for f in model.forwards[1:] for s in f}
    assert max(widths) == 1 + 4
    model = FakeModel(num_slots=8)
    engine, _ = make_engine("mtp", model, mtp_mode="right", mtp_ladder=ladder, draft_policy="fixed")
    list(engine.generate(requests([PROMPTS[2], PROMPTS[6]], max_tokens=25)))
    both_running = [f for f in model.forwards[1:] if len(f) == 2]
    assert both_running and all(len(s.token_ids) == 2 for f in both_running for s in f)
    stats = engine.stats()
    assert stats.mtp_accepted == stats.mtp_proposed > 0


def test_unsure_mtp_drafts_are_held_back_and_the_sequence_may_copy_instead() -> None:
    # No softmax peak reaches 0.9999: the drafter declines every chain, so no
    # MTP draft is verified, and the copies take the free rows (chain 0).
    # (--mtp-min-prob is the fixed policy's rule; the budget judges by itself.)
    always, _ = make_engine("both", mtp_mode="mixed", mtp_min_prob=0.0, draft_policy="fixed")
    never, _ = make_engine("both", mtp_mode="mixed", mtp_min_prob=0.9999, draft_policy="fixed")
    sure = outputs(list(always.generate(requests(PROMPTS))))
    unsure = outputs(list(never.generate(requests(PROMPTS))))
    assert sure == unsure
    for rid, output in unsure.items():
        assert output == reference_greedy(FakeModel(), PROMPTS[int(rid)], 30, eos=(0,))
    assert always.stats().mtp_proposed > 0
    assert never.stats().mtp_proposed == 0
    assert (
        never.stats().prompt_lookup.total.copies > 0 and never.stats().mean_tokens_per_verify > 1.0
    )


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_the_mtp_module_is_fed_every_verified_position_from_the_main_model(policy: str) -> None:
    # Under auto, CPU-like costs (a row a third of a step): chains rest,
    # holding their rows, and take them all when they draft again.
    clock = FakeClock()
    model = CostedModel(num_slots=8, clock=clock, cost=lambda rows: 0.010 + 0.003 * rows)
    mtp = CostedMtp(model, "mixed", cost=0.0005)
    config = EngineConfig(prompt_lookup=LOOKUP, draft_policy=policy)
    engine = Engine(model, None, config, mtp=[mtp], costs=CostModel(clock))
    engine.calibrate()
    model.forwards.clear()  # the budget's calibration verifies come first
    mtp.fed.clear()  # and its head calls, held rows' among them
    results = outputs(list(engine.generate(requests(PROMPTS[:4], max_tokens=30))))
    slot_of = {s.slot: s for s in model.forwards[0]}  # the first prefill admits all four
    checked = 0  # positions checked past the prompt
    for slot, seg in slot_of.items():
        prompt = list(seg.token_ids)
        rid = str(PROMPTS.index(prompt))
        history = prompt + results[rid]
        last_start = max(s.start for f in model.forwards for s in f if s.slot == slot)
        if policy == "auto":
            # A resting chain's rows may still wait when its request ends (a
            # chain that never looked: all of them); every row fed is final,
            # and the rows fed run from 0 without a gap.
            fed = [pos for (s, pos) in mtp.fed if s == slot]
            assert sorted(fed) == list(range(len(fed)))
            last_start = min(last_start, len(fed) - 1)
        for pos in range(last_start):
            context, token = mtp.fed[(slot, pos)]
            assert (
                context == tuple(history[max(0, pos - 1) : pos + 1]) and token == history[pos + 1]
            )
        checked += max(last_start - len(prompt), 0)
    assert checked > 0


def test_the_stats_snapshot_can_be_read_from_another_thread_while_generating() -> None:
    engine, _ = make_engine("both")
    seen: list[EngineStats] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.001):  # a reader polling, not spinning on the GIL
            seen.append(engine.stats())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = list(engine.generate(requests(PROMPTS * 4, max_tokens=30)))
    finally:
        stop.set()
        watcher.join()
    assert len(results) == 32 and seen
    done = [s.requests_done for s in seen]
    assert done == sorted(done)
    final = engine.stats()
    assert final.generated_tokens == sum(len(r.output_ids) for r in results)
    assert final.prompt_tokens == sum(len(p) for p in PROMPTS) * 4
    with pytest.raises(AttributeError):
        final.verifies = 0  # type: ignore[misc]


def test_figures_add_up() -> None:
    # The fixed policy: under ``auto`` whether copies are taken at all follows
    # the wall clock's timings of this fake (the budget's own figures are
    # checked on a fake clock, ``test_budget.py``).
    engine, _ = make_engine("both", draft_policy="fixed")
    results = list(engine.generate(requests(PROMPTS, max_tokens=30)))
    check_figures_add_up(engine, results)


@pytest.mark.parametrize("mode", ["off", "both"])
def test_the_same_seed_gives_the_same_sample(mode: str) -> None:
    def sample(prompts: Sequence[Sequence[int]], seed_of: int) -> list[int]:
        # Under the budget the drafts verified follow measured timings, and
        # with them which draws a seed's generator makes: same distribution,
        # not the same sample. A seed reproduces a sample under the fixed policy.
        engine, _ = make_engine(mode, FakeModel(num_slots=8, scale=1.0), draft_policy="fixed")
        stream = [
            Request(str(i), tuple(p), SamplingParams(max_tokens=20, temperature=1.0, seed=i))
            for i, p in enumerate(prompts)
        ]
        return outputs(list(engine.generate(stream)))[str(seed_of)]

    alone = sample(PROMPTS[:1], 0)
    assert alone == sample(PROMPTS[:1], 0)
    assert len({tuple(sample([PROMPTS[0]] * 3, i)) for i in range(3)}) > 1
    if mode == "off":
        # Without speculation a request's draws do not depend on its neighbours.
        assert sample(PROMPTS, 0) == alone


# -- the real runtime ---------------------------------------------------------


def hf_greedy(reference: torch.nn.Module, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` for one prompt (no padding)."""
    with torch.no_grad():
        out = reference.generate(  # type: ignore[operator]
            torch.tensor([list(prompt_ids)]),
            max_new_tokens=max_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", mtp_layout="deepseek")


def test_greedy_output_equals_transformers_generate_on_a_tiny_checkpoint(
    tiny_deepseek: Path,
) -> None:
    runtime = RuntimeConfig(device="cpu", dtype="float32", num_slots=8, max_len=128)
    loaded = load_model(tiny_deepseek, runtime)
    assert loaded.mtp, "the deepseek layout gives one MTP module"
    prompts = [loaded.tokenizer.encode(p) for p in CHECKPOINT_PROMPTS]
    reference = load_reference_model(tiny_deepseek)
    expected = {str(i): hf_greedy(reference, p, 24) for i, p in enumerate(prompts)}
    for mode, (use_mtp, lookup) in MODES.items():
        for batch in (1, 3, 8):
            engine = Engine.from_loaded(
                loaded, EngineConfig(max_batch=batch, mtp=use_mtp, prompt_lookup=lookup)
            )
            results = list(engine.generate(requests(prompts, max_tokens=24)))
            assert outputs(results) == expected, (mode, batch)
            if mode == "off":
                assert engine.stats().mean_tokens_per_verify == 1.0


@pytest.mark.slow
def test_greedy_parity_on_the_default_model() -> None:
    loaded = load_model(None, RuntimeConfig(device="cpu", num_slots=4, max_len=512))
    texts = ["Write a Python function that adds two numbers.", "List three colours:", "Hi"]
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    seen = {}
    for mode in ("off", "both"):
        use_mtp, lookup = MODES[mode]
        engine = Engine.from_loaded(
            loaded, EngineConfig(max_batch=3, mtp=use_mtp, prompt_lookup=lookup)
        )
        seen[mode] = outputs(list(engine.generate(requests(prompts, max_tokens=24))))
    assert seen["both"] == seen["off"]
    reference = load_reference_model(ensure_default_model())
    assert seen["off"]["2"] == hf_greedy(reference, prompts[2], 24)
