"""The engine under a grammar, on the fake model: parity, cuts, forced runs.

The fake n-gram model's logits are random over the small JSON-ish vocabulary
of ``grammar_fakes`` (token 0 is EOS), so its output is whatever the grammar
lets a random model write; the masks are llguidance's own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jsonschema
import pytest

from metrale.engine.api import Grammar, Request, Result, SamplingParams
from metrale.engine.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.engine.sequence import SeqState
from metrale.engine.spec import copies as copies_module
from metrale.engine.spec.copies import bucket_copy
from metrale.engine.spec.grammar import choice_grammar, json_schema_grammar
from metrale.lookup import PromptLookupConfig
from tests.support.fake_model import FakeModel, FakeMtp
from tests.support.grammar_fakes import JSON_TEXTS, Vocabulary

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = Vocabulary(JSON_TEXTS)
LOOKUP = PromptLookupConfig(ngram=2, min_match=2, max_drafts=8)
SCHEMA = {
    "type": "object",
    "properties": {
        "ab": {"type": "boolean"},
        "c": {"type": "array", "items": {"type": "integer", "maximum": 2}, "maxItems": 3},
        "b": {"enum": ["a", "ab", "cab"]},
        "a": {"type": "object", "properties": {"c": {"type": "string", "maxLength": 4}}},
    },
    "required": ["ab", "c", "b", "a"],
    "additionalProperties": False,
}
GRAMMARS = {
    "schema": json_schema_grammar(SCHEMA),
    "object": Grammar("json_object"),
    "regex": Grammar("regex", "(ab|c)+1?"),
    "choice": choice_grammar(['{"ab":true}', '{"ab":false}', "cab"]),
}
# Prompts that repeat JSON-like runs, so copies are on offer.
PROMPTS = [
    VOCAB.encode('{"ab":true,"c":[1,2],"b":"cab","a":{"c":"ab"}}{"ab":true,"c":['),
    VOCAB.encode('{"ab":false,"c":[],"b":"a"'),
    VOCAB.encode("ababcab1cabab"),
    VOCAB.encode('"a":{"c":"abc"},"a":{"c":"'),
    VOCAB.encode("1"),
    VOCAB.encode('{"ab":true,"c":[2,2,2],"b":"ab","a":{}}' * 2),
]


def engine(
    mtp: str | None, lookup: bool, forced: bool, max_batch: int = 8, seed: int = 0
) -> tuple[Engine, FakeModel]:
    model = FakeModel(vocab=VOCAB.size, num_slots=8, seed=seed, max_len=256)
    config = EngineConfig(
        max_batch=max_batch, prompt_lookup=LOOKUP if lookup else None, forced_drafts=forced
    )
    drafters = [FakeMtp(model, mtp)] if mtp else []  # type: ignore[arg-type]
    grammars = VOCAB.compiler()
    built = Engine(model, VOCAB.decode, config, mtp=drafters, eos_token_ids=(0,), grammars=grammars)
    return built, model


def run(
    built: Engine, grammar: Grammar, prompts: Sequence[Sequence[int]] = PROMPTS, **params: object
) -> list[Result]:
    sampling = SamplingParams(max_tokens=48, **params)  # type: ignore[arg-type]
    stream = [Request(str(i), tuple(p), sampling, grammar=grammar) for i, p in enumerate(prompts)]
    return sorted(built.generate(stream), key=lambda r: int(r.request_id))


@pytest.mark.parametrize("name", list(GRAMMARS))
@pytest.mark.parametrize(
    ("mtp", "lookup", "max_batch"),
    [
        ("mixed", True, 8),
        ("right", True, 1),
        ("wrong", True, 3),
        (None, True, 8),
        ("mixed", False, 8),
    ],
)
def test_greedy_output_with_mtp_copies_and_forced_drafts_equals_constrained_decoding_without_drafts(
    name: str, mtp: str | None, lookup: bool, max_batch: int
) -> None:
    for seed in range(3):
        plain, _ = engine(None, lookup=False, forced=False, seed=seed)
        drafted, _ = engine(mtp, lookup=lookup, forced=True, max_batch=max_batch, seed=seed)
        expected = run(plain, GRAMMARS[name])
        got = run(drafted, GRAMMARS[name])
        assert [r.output_ids for r in got] == [r.output_ids for r in expected]
        assert all(r.error is None for r in got)
        assert plain.stats().mean_tokens_per_verify == 1.0
    stats = drafted.stats()
    assert stats.forced_accepted == stats.forced_proposed
    if name in ("schema", "choice"):
        assert stats.forced_proposed > 0 and stats.mean_tokens_per_verify > 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_that_stops_is_complete_and_matches_its_grammar(temperature: float) -> None:
    built, _ = engine("mixed", lookup=True, forced=True)
    stopped = 0
    for name, grammar in GRAMMARS.items():
        for result in run(built, grammar, temperature=temperature, seed=7):
            assert result.error is None
            if result.finish_reason != "stop":
                continue
            stopped += 1
            text = result.text
            if name == "schema":
                jsonschema.validate(json.loads(text), SCHEMA)
            elif name == "object":
                assert isinstance(json.loads(text), dict)
            elif name == "choice":
                assert text in json.loads(grammar.source)
            else:
                assert text and all(part in ("ab", "c", "1") for part in _split(text))
    assert stopped >= len(GRAMMARS) * len(PROMPTS) // 2


def _split(text: str) -> list[str]:
    parts, at = [], 0
    while at < len(text):
        step = 2 if text.startswith("ab", at) else 1
        parts.append(text[at : at + step])
        at += step
    return parts


def test_a_forced_run_is_accepted_whole() -> None:
    answer = '{"ab":true,"c":[1,2]}'
    built, model = engine("mixed", lookup=True, forced=True)
    (result,) = run(built, choice_grammar([answer]), [VOCAB.encode("ab")])
    assert result.text == answer and result.finish_reason == "stop"
    run_ids = VOCAB.encode(answer)
    # The prefill gives the first token; one verify holds the rest as forced
    # drafts, accepts every one and gains EOS as its bonus token.
    assert result.stats.verifies == 1
    assert result.stats.forced_proposed == result.stats.forced_accepted == len(run_ids) - 1
    assert result.stats.verify_tokens == len(run_ids)
    verify = model.forwards[-1]
    assert [list(s.token_ids) for s in verify] == [run_ids]


def test_a_copy_that_leaves_the_grammar_is_cut_at_the_first_forbidden_token_and_its_allowed_prefix_verified(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grammar = Grammar("regex", "[ab]{40}")
    cuts: list[tuple[list[int], list[int], int]] = []
    real = copies_module.allowed_copy

    def recording(seq: SeqState, copy: list[int]) -> list[int]:
        kept = real(seq, copy)
        # An independent walk from the sequence's own output says where the
        # grammar first forbids a token of the copy.
        fresh = VOCAB.matcher(grammar)
        fresh.advance(seq.output_ids)
        _, allowed = fresh.row_masks(copy)
        cuts.append((list(copy), kept, allowed))
        return kept

    monkeypatch.setattr(copies_module, "allowed_copy", recording)
    # The prompt holds a '1' the grammar (letters a and b only) forbids.
    built, model = engine(None, lookup=True, forced=False, max_batch=1)
    (result,) = run(built, grammar, [VOCAB.encode("abaab1ba")])
    assert len(result.text) == 40 and set(result.text) <= {"a", "b"}
    assert all(kept == copy[:allowed] for copy, kept, allowed in cuts)
    assert any(0 < len(kept) < len(copy) for copy, kept, _ in cuts), "a copy was cut, not dropped"
    assert any(VOCAB.encode("1")[0] in copy for copy, _, _ in cuts)
    # Each copy the grammar let through is what its verify fed after last_token.
    fed = [list(seg.token_ids)[1:] for step in model.forwards[1:] for seg in step]
    taken = [bucket_copy(kept) for _, kept, _ in cuts if kept]
    assert taken and all(drafts in fed for drafts in taken)
    assert result.stats.prompt_lookup.total.copies == len(taken)


def test_a_grammar_no_token_can_satisfy_fails_only_its_own_request() -> None:
    built, _ = engine("mixed", lookup=True, forced=True)
    stream = [
        Request(
            "0", tuple(PROMPTS[0]), SamplingParams(max_tokens=8), grammar=Grammar("regex", "z+")
        ),
        Request("1", tuple(PROMPTS[1]), SamplingParams(max_tokens=8), grammar=GRAMMARS["regex"]),
    ]
    results = {r.request_id: r for r in built.generate(stream)}
    assert results["0"].finish_reason == "error" and "grammar" in str(results["0"].error)
    assert results["1"].error is None and results["1"].output_ids


def test_a_stop_string_beside_a_grammar_is_refused() -> None:
    built, _ = engine(None, lookup=False, forced=True)
    (result,) = built.generate(
        [Request("0", (1,), SamplingParams(max_tokens=8, stop=("a",)), grammar=GRAMMARS["regex"])]
    )
    assert result.finish_reason == "error" and "stop strings" in str(result.error)


def test_a_tokenizer_that_cannot_drive_a_grammar_fails_only_grammar_requests() -> None:
    # A decode callable, not a tokenizer with a tokenizer.json: no binding.
    model = FakeModel(vocab=VOCAB.size, num_slots=4, seed=0, max_len=256)
    built = Engine(model, VOCAB.decode, EngineConfig(max_batch=4), eos_token_ids=(0,))
    sampling = SamplingParams(max_tokens=8)
    stream = [
        Request("0", tuple(PROMPTS[0]), sampling, grammar=GRAMMARS["regex"]),
        Request("1", tuple(PROMPTS[1]), sampling),
        Request("2", tuple(PROMPTS[2]), sampling, grammar=GRAMMARS["object"]),
    ]
    results = {r.request_id: r for r in built.generate(stream)}
    for failed in ("0", "2"):
        assert results[failed].finish_reason == "error"
        assert "cannot drive a grammar" in str(results[failed].error)
    assert results["1"].error is None and results["1"].output_ids


def test_constrained_figures_count_forced_drafts_and_grammar_time() -> None:
    built, _ = engine("mixed", lookup=True, forced=True)
    results = run(built, GRAMMARS["schema"])
    stats = built.stats()
    assert stats.grammar_requests == len(PROMPTS)
    assert stats.grammar_tokens == sum(len(r.output_ids) for r in results)
    assert stats.grammar_s > 0 and stats.grammar_us_per_token > 0
    assert stats.forced_proposed == sum(r.stats.forced_proposed for r in results) > 0
    assert all(r.stats.grammar_s > 0 for r in results)
