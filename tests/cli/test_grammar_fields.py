"""A line's grammar from its fields: both formats, --json-schema, and the
error record a schema or regex that does not compile becomes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from metrale.cli import generate as generate_module
from metrale.cli.jsonl import LineDefaults, LineError, LineRef, ParsedLine, parse_line
from metrale.cli.main import app
from metrale.cli.records import error_record
from metrale.engine.api import Grammar
from metrale.engine.spec.grammar import choice_grammar, json_schema_grammar
from tests.support.cli_fakes import FakeOpener

REF = LineRef(3, "in.jsonl:3")
SCHEMA = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "integer"}}}


def parse(obj: dict[str, Any], defaults: LineDefaults | None = None) -> ParsedLine | LineError:
    return parse_line(REF, orjson.dumps(obj), defaults or LineDefaults())


def batch(body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": MSG, **body}}


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("obj", "grammar"),
    [
        ({"prompt": "x", "json_schema": SCHEMA}, json_schema_grammar(SCHEMA)),
        ({"prompt": "x", "regex": "[0-9]+"}, Grammar("regex", "[0-9]+")),
        ({"prompt": "x", "choice": ["yes", "no"]}, choice_grammar(["yes", "no"])),
        ({"prompt": "x"}, None),
        (
            batch(
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                    }
                }
            ),
            json_schema_grammar(SCHEMA),
        ),
        (batch({"response_format": {"type": "json_object"}}), Grammar("json_object")),
        (batch({"response_format": {"type": "text"}}), None),
        (batch({}), None),
    ],
)
def test_each_format_names_its_grammar(obj: dict[str, Any], grammar: Grammar | None) -> None:
    parsed = parse(obj)
    assert isinstance(parsed, ParsedLine) and parsed.grammar == grammar


def test_schema_key_order_is_kept_since_it_is_the_order_properties_are_written() -> None:
    parsed = parse({"prompt": "x", "json_schema": SCHEMA})
    assert isinstance(parsed, ParsedLine) and parsed.grammar is not None
    assert list(json.loads(parsed.grammar.source)["properties"]) == ["b", "a"]


def test_the_runs_json_schema_goes_to_every_line_that_names_none() -> None:
    default = json_schema_grammar({"type": "object"})
    defaults = LineDefaults(grammar=default)
    named = parse({"prompt": "x", "regex": "a"}, defaults)
    bare = parse({"prompt": "x"}, defaults)
    text = parse(batch({"response_format": {"type": "text"}}), defaults)
    plain_batch = parse(batch({}), defaults)
    assert isinstance(named, ParsedLine) and named.grammar == Grammar("regex", "a")
    assert isinstance(bare, ParsedLine) and bare.grammar == default
    assert isinstance(plain_batch, ParsedLine) and plain_batch.grammar == default
    assert isinstance(text, ParsedLine) and text.grammar is None  # it asked for text


@pytest.mark.parametrize(
    ("obj", "field", "says"),
    [
        ({"prompt": "x", "json_schema": {"type": "strnig"}}, "json_schema", "strnig"),
        ({"prompt": "x", "json_schema": {"$ref": "#/defs/none"}}, "json_schema", "none"),
        ({"prompt": "x", "json_schema": "{}"}, "json_schema", "schema object"),
        ({"prompt": "x", "regex": "[z-a]"}, "regex", "invalid regex"),
        ({"prompt": "x", "regex": "(ab"}, "regex", "unclosed group"),
        ({"prompt": "x", "regex": ""}, "regex", "non-empty"),
        ({"prompt": "x", "choice": []}, "choice", "non-empty list"),
        ({"prompt": "x", "choice": ["a", 3]}, "choice", "non-empty list"),
        ({"prompt": "x", "regex": "a", "choice": ["a"]}, "choice", "at most one"),
        ({"prompt": "x", "regex": "a", "stop": "b"}, "stop", "grammar"),
        (
            batch(
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "n", "schema": {"type": "strnig"}},
                    }
                }
            ),
            "body.response_format.json_schema.schema",
            "strnig",
        ),
        (
            batch(
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"schema": SCHEMA, "extra": 1},
                    }
                }
            ),
            "body.response_format.json_schema.extra",
            "not supported",
        ),
        (
            batch({"response_format": {"type": "json_schema"}}),
            "body.response_format.json_schema",
            "schema",
        ),
        (batch({"response_format": {"type": "yaml"}}), "body.response_format.type", "json_schema"),
        (batch({"response_format": {"type": "json_object"}, "stop": "}"}), "body.stop", "grammar"),
    ],
)
def test_invalid_grammars_become_error_records_naming_the_field(
    obj: dict[str, Any], field: str, says: str
) -> None:
    err = parse(obj)
    assert isinstance(err, LineError) and err.field == field and says in err.message
    record = error_record(err)
    if err.format == "simple":
        assert record["finish_reason"] == "error" and record["error"]["field"] == field
    else:
        response = record["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == field


@pytest.fixture
def opener(monkeypatch: pytest.MonkeyPatch) -> FakeOpener:
    fake = FakeOpener()
    monkeypatch.setattr(generate_module, "open_backend", fake)
    return fake


def invoke(args: list[str], input: str) -> Any:
    return CliRunner().invoke(app, ["generate", *args], input=input, env={"COLUMNS": "400"})


def test_a_bad_grammar_fails_its_line_and_the_other_lines_go_on(opener: FakeOpener) -> None:
    lines = [
        {"id": "good", "prompt": "ab", "regex": "[ab]+"},
        {"id": "bad", "prompt": "ab", "regex": "[z-a]"},
        batch({"response_format": {"type": "json_object"}}),
    ]
    result = invoke(["--progress", "off"], "".join(json.dumps(x) + "\n" for x in lines))
    assert result.exit_code == 1  # some lines failed
    out = {
        r.get("id") if "custom_id" not in r else r["custom_id"]: r
        for r in map(json.loads, result.stdout.splitlines())
    }
    assert out["bad"]["error"]["field"] == "regex"
    assert out["good"]["speculation"]["forced"] == {"proposed": 0, "accepted": 0}
    assert out["c"]["response"]["status_code"] == 200
    seen = {r.prompt_ids: r.grammar for r in opener.engine.seen}
    assert set(seen.values()) == {Grammar("regex", "[ab]+"), Grammar("json_object")}


def test_json_schema_file_constrains_lines_that_name_none(
    opener: FakeOpener, tmp_path: Path
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    result = invoke(["--json-schema", str(schema), "--progress", "off"], '{"prompt": "ab"}\n')
    assert result.exit_code == 0, result.output
    assert [r.grammar for r in opener.engine.seen] == [json_schema_grammar(SCHEMA)]


@pytest.mark.parametrize("text", ["{not json", '{"type": "strnig"}', "[1]"])
def test_a_bad_json_schema_file_is_a_usage_error(
    opener: FakeOpener, tmp_path: Path, text: str
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(text)
    result = invoke(["--json-schema", str(schema)], '{"prompt": "ab"}\n')
    assert result.exit_code == 2 and "--json-schema" in result.output
    assert opener.calls == []  # refused before any model loads
