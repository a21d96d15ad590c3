"""Grammars and matchers: compiled once, masks exact, rollback leaves no trace.

Everything runs the real llguidance over the small JSON-ish vocabulary of
``grammar_fakes``, so the masks checked here are the ones the engine sees.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from metrale.engine.api import Grammar
from metrale.engine.spec import grammar as grammar_module
from metrale.engine.spec.grammar import (
    choice_grammar,
    grammar_problem,
    json_schema_grammar,
)
from metrale.engine.spec.matcher import GrammarMatcher
from tests.support.grammar_fakes import JSON_TEXTS, Vocabulary

VOCAB = Vocabulary(JSON_TEXTS)
EOS = 0
SCHEMA = {
    "type": "object",
    "properties": {
        "ab": {"type": "boolean"},
        "c": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "b": {"enum": ["a", "ab", "cab"]},
    },
    "required": ["ab", "c", "b"],
    "additionalProperties": False,
}
GRAMMARS = [
    json_schema_grammar(SCHEMA),
    Grammar("json_object"),
    Grammar("regex", "(ab|c)+1?"),
    choice_grammar(["abc", "ab1", "cc"]),
]


def walk(matcher: GrammarMatcher, rng: random.Random, steps: int) -> Iterator[list[int]]:
    """Yields the allowed tokens at each state of a random walk, then takes one."""
    for _ in range(steps):
        masks, _ = matcher.row_masks([])
        allowed = [t for t in range(VOCAB.size) if masks.allowed(0, t)]
        yield allowed
        non_eos = [t for t in allowed if t != EOS]
        if not non_eos:
            return
        matcher.advance([rng.choice(non_eos)])


@pytest.mark.parametrize("grammar", GRAMMARS, ids=lambda g: g.kind)
def test_forced_tokens_are_the_only_token_their_mask_allows(grammar: Grammar) -> None:
    rng = random.Random(0)
    for _ in range(5):
        matcher = VOCAB.matcher(grammar)
        for allowed in walk(matcher, rng, 40):
            forced = matcher.forced(16)
            if forced:
                assert allowed == [forced[0]]
                # The rest of the run is the forced run of the next state.
                probe = VOCAB.matcher(grammar)
                probe._matcher = matcher._matcher.deep_copy()
                probe.advance(forced[:1])
                assert probe.forced(16) == forced[1:] or len(forced) == 16


@pytest.mark.parametrize("grammar", GRAMMARS, ids=lambda g: g.kind)
def test_eos_is_allowed_exactly_where_the_grammar_is_complete(grammar: Grammar) -> None:
    rng = random.Random(1)
    for _ in range(5):
        matcher = VOCAB.matcher(grammar)
        for allowed in walk(matcher, rng, 40):
            assert (EOS in allowed) == matcher.complete


def test_row_masks_are_the_masks_along_the_drafts_and_cut_at_the_first_forbidden() -> None:
    grammar = json_schema_grammar(SCHEMA)
    ok = VOCAB.encode('{"ab":true,"c":[1')
    drafts = [*ok, VOCAB.encode("a")[0], *VOCAB.encode("2]")]  # 'a' cannot follow [1
    matcher = VOCAB.matcher(grammar)
    masks, kept = matcher.row_masks(drafts)
    assert kept == len(ok) and masks.num_rows == len(ok) + 1
    for row in range(masks.num_rows):
        fresh = VOCAB.matcher(grammar)
        fresh.advance(ok[:row])
        expected, _ = fresh.row_masks([])
        assert (masks.rows(row, row + 1) == expected.rows()).all()


def test_matcher_state_after_a_rejected_draft_equals_the_state_after_the_accepted_prefix() -> None:
    grammar = json_schema_grammar(SCHEMA)
    prefix = VOCAB.encode('{"ab":false,"c":[')
    drafts = [*VOCAB.encode('{"ab":false,"c":[2,1,2]'), *VOCAB.encode(',"b":"ab"}')]
    for accepted in range(len(prefix) + 1):
        walked = VOCAB.matcher(grammar)
        walked.row_masks(drafts)  # walks every draft, as the step does before a verify
        bonus = VOCAB.encode('{"ab":false,"c":[1')[accepted]
        walked.advance([*drafts[:accepted], bonus])
        fresh = VOCAB.matcher(grammar)
        fresh.advance([*drafts[:accepted], bonus])
        assert walked.state() == fresh.state()
        # ...and the two stay equal from there on.
        rest = VOCAB.encode('{"ab":false,"c":[1]')[accepted + 1 :]
        walked.advance(rest)
        fresh.advance(rest)
        assert walked.state() == fresh.state()


def test_each_distinct_grammar_is_compiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Grammar] = []
    real = grammar_module.grammar_text

    def counting(grammar: Grammar) -> str:
        built.append(grammar)
        return real(grammar)

    compiler = VOCAB.compiler()
    monkeypatch.setattr(grammar_module, "grammar_text", counting)
    first = compiler.start(GRAMMARS[0])
    second = compiler.start(GRAMMARS[0])
    compiler.start(GRAMMARS[2])
    assert len(built) == 2 and compiler.cached == 2
    assert first is not second  # each request gets its own state
    first.consume_tokens(VOCAB.encode('{"'))
    assert second.compute_ff_tokens() != first.compute_ff_tokens()


@pytest.mark.parametrize(
    ("grammar", "says"),
    [
        (Grammar("regex", "[z-a]"), "invalid character class range"),
        (Grammar("regex", "(ab"), "unclosed group"),
        (json_schema_grammar({"type": "strnig"}), "strnig"),
        (json_schema_grammar({"properties": {"a": {"$ref": "#/nope"}}}), "/nope"),
        (json_schema_grammar({"type": "string", "pattern": "(("}), "unclosed group"),
        (Grammar("choice", "[]"), "non-empty list"),
    ],
)
def test_a_grammar_that_does_not_compile_says_why(grammar: Grammar, says: str) -> None:
    problem = grammar_problem(grammar)
    assert problem is not None and says in problem


@pytest.mark.parametrize("grammar", GRAMMARS, ids=lambda g: g.kind)
def test_the_grammars_used_here_compile(grammar: Grammar) -> None:
    assert grammar_problem(grammar) is None


def test_walking_drafts_past_an_eos_rolls_back_to_the_state_before_them() -> None:
    # A stopped matcher counts no further token: walking on past an EOS draft
    # once made the rollback undo an emitted token too.
    grammar = Grammar("regex", "(ab|c)+")
    matcher = VOCAB.matcher(grammar)
    matcher.advance(VOCAB.encode("c"))
    before = matcher.state()
    masks, kept = matcher.row_masks([EOS, EOS, EOS])
    assert kept == 1 and masks.num_rows == 2
    assert matcher.state() == before
    matcher.advance(VOCAB.encode("ab"))  # 'c' is still there: "cab" is a sentence
    assert matcher.complete
