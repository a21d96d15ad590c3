"""/v1/responses lines: the body read as a chat request, unsupported fields named."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from metrale.cli.jsonl import LineDefaults, LineError, LineRef, ParsedLine, parse_line
from metrale.engine.api import Grammar, SamplingParams

REF = LineRef(4, "in.jsonl:4")
DEFAULTS = LineDefaults(params=SamplingParams(max_tokens=32, seed=10))


def line(body: dict[str, Any], defaults: LineDefaults = DEFAULTS) -> ParsedLine | LineError:
    obj = {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body}
    return parse_line(REF, orjson.dumps(obj), defaults)


def ok(body: dict[str, Any], defaults: LineDefaults = DEFAULTS) -> ParsedLine:
    parsed = line(body, defaults)
    assert isinstance(parsed, ParsedLine), parsed
    return parsed


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    parsed = ok({"model": "m", "input": "hi", "instructions": "Be brief.", "store": False})
    assert parsed.format == "response" and parsed.output_id == "r"
    assert parsed.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    )
    assert parsed.params == SamplingParams(max_tokens=32, seed=14)
    assert parsed.echo is not None and parsed.echo["instructions"] == "Be brief."


def test_message_inputs_take_text_parts_and_sampling_fields() -> None:
    parsed = ok(
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "c"}]},
            ],
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
        }
    )
    assert parsed.messages == (
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    )
    assert parsed.params == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3)


def test_text_format_constrains_as_response_format_does() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    parsed = ok({"input": "q", "text": {"format": fmt}})
    assert parsed.grammar is not None and parsed.grammar.kind == "json_schema"
    assert ok({"input": "q", "text": {"format": {"type": "json_object"}}}).grammar == Grammar(
        "json_object"
    )
    # A format given (text included) wins over --json-schema; none given takes it.
    run_wide = LineDefaults(grammar=Grammar("json_object"))
    assert ok({"input": "q", "text": {"format": {"type": "text"}}}, run_wide).grammar is None
    assert ok({"input": "q"}, run_wide).grammar == Grammar("json_object")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "q", "tools": [{"type": "function"}]}, "body.tools"),
        ({"input": "q", "previous_response_id": "resp_1"}, "body.previous_response_id"),
        ({"input": "q", "reasoning": {"effort": "low"}}, "body.reasoning"),
        ({"input": "q", "include": ["message.output_text.logprobs"]}, "body.include"),
        ({"input": "q", "top_logprobs": 2}, "body.top_logprobs"),
        ({"input": "q", "stream": True}, "body.stream"),
        ({"input": "q", "max_output_tokens": 0}, "body.max_output_tokens"),
        ({"input": "q", "temperature": 9000}, "body.temperature"),
        ({"input": "q", "instructions": 5}, "body.instructions"),
        ({}, "body.input"),
        ({"input": []}, "body.input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "body.input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "body.input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "body.input[0].content[0]",
        ),
        ({"input": "q", "text": {"format": {"type": "xml"}}}, "body.text.format.type"),
        ({"input": "q", "text": {"verbosity": "low"}}, "body.text.verbosity"),
        (
            {"input": "q", "text": {"format": {"type": "json_schema", "schema": {"type": 5}}}},
            "body.text.format.schema",
        ),
    ],
)
def test_unsupported_or_bad_fields_are_error_records_naming_the_field(
    body: dict[str, Any], field: str
) -> None:
    err = line(body)
    assert isinstance(err, LineError) and err.format == "response"
    assert err.field == field and err.message
