"""Structured outputs on loaded models: a tiny random checkpoint through the
loader's own tokenizer, and the embedded default model (slow).

Every output that finishes with ``stop`` must parse and validate against its
schema with ``jsonschema`` (or match its regex, or be one of its choices);
with MTP, copies and forced drafts the greedy output must be constrained
decoding without any draft, token for token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from metrale.engine.api import Grammar, Request, Result, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.prompts import chat_prompt_ids
from metrale.engine.spec import grammar as grammar_module
from metrale.engine.spec.grammar import choice_grammar, json_schema_grammar
from tests.support.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMAS: dict[str, dict[str, object]] = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum_and_boolean": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "mixed"]},
            "urgent": {"type": "boolean"},
        },
        "required": ["label", "urgent"],
        "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.org$"},
        },
        "required": ["code", "email"],
        "additionalProperties": False,
    },
}
REGEX = "[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMARS: dict[str, Grammar] = {
    **{name: json_schema_grammar(schema) for name, schema in SCHEMAS.items()},
    "json_object": Grammar("json_object"),
    "regex": Grammar("regex", REGEX),
    "choice": choice_grammar(CHOICES),
}
QUESTIONS = {
    "nested": "Ada Park lives in Lisbon. Give her name and city as JSON.",
    "bounded_array": "Give up to three tags for a post about sourdough bread, as JSON.",
    "enum_and_boolean": "Review: 'Cold soup, rude waiter, never again.' Label it as JSON.",
    "number_ranges": "Bo is 41 and rates the film 7.5 out of 10. Answer as JSON.",
    "string_pattern": "Order GB-1042 was placed by ada@shop.org. Answer as JSON.",
    "json_object": "Describe a cat as a JSON object with two keys.",
    "regex": "When was the Berlin Wall opened? Answer as YYYY-MM-DD.",
    "choice": "Is 'I loved every minute of it' positive, negative or neutral?",
}


def valid(name: str, text: str) -> bool:
    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    if name == "choice":
        return text in CHOICES
    value = json.loads(text)
    if name == "json_object":
        return isinstance(value, dict)
    jsonschema.validate(value, SCHEMAS[name])
    return True


def generate(
    loaded: LoadedModel, config: EngineConfig, max_tokens: int, **params: object
) -> dict[str, Result]:
    engine = Engine.from_loaded(loaded, config)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        eos_token_ids=tuple(loaded.eos_token_ids),
        **params,  # type: ignore[arg-type]
    )
    stream = [
        Request(
            name,
            tuple(
                chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": QUESTIONS[name]}])
            ),
            sampling,
            grammar=grammar,
        )
        for name, grammar in GRAMMARS.items()
    ]
    return {r.request_id: r for r in engine.generate(stream)}


def without_drafts() -> EngineConfig:
    return EngineConfig(mtp=False, prompt_lookup=None, forced_drafts=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path: Path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), mtp_layout="deepseek")
    return load_model(path, RuntimeConfig(device="cpu", num_slots=16, max_len=512))


def test_the_tokenizer_binding_is_built_once_per_model_and_outputs_that_stop_validate(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound: list[object] = []
    real = grammar_module.GrammarCompiler.for_tokenizer

    def counting(tokenizer: object, vocab: int, eos: list[int]) -> object:
        bound.append(tokenizer)
        return real(tokenizer, vocab, eos)

    monkeypatch.setattr(grammar_module.GrammarCompiler, "for_tokenizer", staticmethod(counting))
    for temperature in (0.0, 1.0):
        results = generate(tiny, EngineConfig(), 160, temperature=temperature, seed=3)
        for name, result in results.items():
            assert result.error is None, (name, result.error)
            if result.finish_reason == "stop":
                assert valid(name, result.text), (name, result.text)
        # Finite grammars end: the random model cannot run past their end.
        for name in ("enum_and_boolean", "choice", "regex", "string_pattern"):
            assert results[name].finish_reason == "stop", (name, results[name].text)
    assert len(bound) == 2  # once per engine: each run above built its own


def test_greedy_output_with_every_draft_source_equals_constrained_decoding_without_drafts_on_a_tiny_model(
    tiny: LoadedModel,
) -> None:
    drafted = generate(tiny, EngineConfig(), 96)
    plain = generate(tiny, without_drafts(), 96)
    assert {k: r.output_ids for k, r in drafted.items()} == {
        k: r.output_ids for k, r in plain.items()
    }


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model(None, RuntimeConfig(device="cpu", num_slots=16, max_len=1024))


@pytest.mark.slow
def test_every_output_of_the_default_model_validates(default_model: LoadedModel) -> None:
    # Sampled with a seed whose free-form JSON object ends within 160 tokens
    # (some seeds' run past it): a seed gives the same sample whatever the
    # drafts, so the choice holds under either draft policy.
    for temperature in (0.0, 0.8):
        results = generate(default_model, EngineConfig(), 160, temperature=temperature, seed=2)
        for name, result in results.items():
            assert result.error is None and result.finish_reason == "stop", (name, result)
            assert valid(name, result.text), (name, result.text)


@pytest.mark.slow
def test_greedy_parity_of_every_draft_source_on_the_default_model(
    default_model: LoadedModel,
) -> None:
    drafted = generate(default_model, EngineConfig(), 96)
    plain = generate(default_model, without_drafts(), 96)
    assert {k: r.output_ids for k, r in drafted.items()} == {
        k: r.output_ids for k, r in plain.items()
    }
    assert sum(r.stats.forced_accepted for r in drafted.values()) > 0


@pytest.mark.slow
def test_the_sample_extraction_workload_answers_every_line_with_valid_json(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from metrale.cli.main import app

    workload = Path(__file__).resolve().parents[3] / "sample_prompts" / "json_extract.jsonl"
    stats = tmp_path / "stats.json"
    args = ["generate", str(workload), "--progress", "off", "--stats-json", str(stats)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    lines = {json.loads(line)["custom_id"]: json.loads(line) for line in workload.open()}
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(lines)
    for record in out:
        choice = record["response"]["body"]["choices"][0]
        schema = lines[record["custom_id"]]["body"]["response_format"]["json_schema"]["schema"]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    figures = json.loads(stats.read_text())
    assert figures["forced"]["accepted"] == figures["forced"]["proposed"] > 0
    assert figures["grammar"]["requests"] == len(lines)
