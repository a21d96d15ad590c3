"""Every Batch output body parses as the official ``openai`` package's type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from pydantic import BaseModel
from typer.testing import CliRunner

from metrale.cli.jsonl import LineDefaults, LineRef, ParsedLine, parse_line
from metrale.cli.main import app
from metrale.cli.records import result_record
from metrale.engine.api import RequestStats, Result, TokenLogprob
from tests.support.checkpoints import write_tiny_checkpoint

BODY_TYPES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletion,
    "/v1/completions": Completion,
    "/v1/responses": Response,
}
LOGPROBS = (
    TokenLogprob(104, -0.25, ((104, -0.25), (105, -1.5))),
    TokenLogprob(0xC3, -2.0, ((0xC3, -2.0), (33, -2.5))),  # half of a character
)
SPELLED = {104: b"h", 105: b"i", 0xC3: b"\xc3", 33: b"!"}


def parsed(url: str, body: dict[str, Any]) -> ParsedLine:
    obj = {"custom_id": "c", "method": "POST", "url": url, "body": body}
    line = parse_line(LineRef(3, "in:3"), orjson.dumps(obj), LineDefaults())
    assert isinstance(line, ParsedLine), line
    return line


def result(finish: str = "stop", logprobs: bool = True) -> Result:
    return Result(
        "3",
        5,
        (104, 0xC3),
        "h\ufffd",
        finish,  # type: ignore[arg-type]
        RequestStats(),
        logprobs=LOGPROBS if logprobs else None,
        token_bytes=SPELLED if logprobs else {},
    )


def test_chat_logprobs_parse_as_choice_logprobs_with_bytes_and_tops() -> None:
    line = parsed(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
    )
    body = result_record(line, [result()], "m")["response"]["body"]
    completion = ChatCompletion.model_validate(body)
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [c.token for c in content] == ["h", "bytes:\\xc3"]
    assert content[1].bytes == [0xC3] and content[0].logprob == -0.25
    assert [t.token for t in content[0].top_logprobs] == ["h", "i"]


def test_completion_logprobs_parse_with_offsets_and_top_dicts() -> None:
    line = parsed("/v1/completions", {"prompt": "x", "logprobs": 2})
    body = result_record(line, [result()], "m")["response"]["body"]
    logprobs = Completion.model_validate(body).choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["h", "bytes:\\xc3"] and logprobs.token_logprobs == [-0.25, -2.0]
    assert logprobs.top_logprobs == [{"h": -0.25, "i": -1.5}, {"bytes:\\xc3": -2.0, "!": -2.5}]
    assert logprobs.text_offset == [0, 1]


@pytest.mark.parametrize(("finish", "status"), [("stop", "completed"), ("length", "incomplete")])
def test_a_response_parses_with_its_status_and_usage(finish: str, status: str) -> None:
    line = parsed("/v1/responses", {"input": "x", "instructions": "be brief"})
    body = result_record(line, [result(finish, logprobs=False)], "m")["response"]["body"]
    response = Response.model_validate(body)
    assert response.status == status and response.output_text == "h\ufffd"
    assert (response.incomplete_details is not None) == (status == "incomplete")
    if response.incomplete_details is not None:
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (5, 2)
    assert response.usage.total_tokens == 7 and response.instructions == "be brief"


def test_every_batch_line_a_run_writes_parses_as_its_openai_type(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "tiny", "llama")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    bodies = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "logprobs": True,
                "top_logprobs": 3,
                "temperature": 0.8,
                "seed": 1,
            },
        ),
        ("/v1/completions", {"prompt": "abc abc", "logprobs": 2}),
        ("/v1/responses", {"input": "hello", "instructions": "answer", "max_output_tokens": 5}),
        (
            "/v1/responses",
            {
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "json"}]}],
                "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}},
                "max_output_tokens": 40,
            },
        ),
        ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}),
    ]
    lines = "".join(
        orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}).decode()
        + "\n"
        for i, (url, body) in enumerate(bodies)
    )
    args = ["generate", "--model", str(model), "--device", "cpu", "--dtype", "float32"]
    run = CliRunner().invoke(app, [*args, "--max-tokens", "12"], input=lines)
    assert run.exit_code == 1, run.output  # the line with tools failed, alone
    records = {r["custom_id"]: r for r in map(orjson.loads, run.stdout.splitlines())}
    assert len(records) == len(bodies)
    for i, (url, _) in enumerate(bodies[:-1]):
        response = records[f"c{i}"]["response"]
        assert response["status_code"] == 200, response
        BODY_TYPES[url].model_validate(response["body"])
    assert records["c1"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert Response.model_validate(records["c3"]["response"]["body"]).status == "incomplete"
    constrained = Response.model_validate(records["c4"]["response"]["body"])
    if constrained.status == "completed":
        assert isinstance(orjson.loads(constrained.output_text)["n"], int)
    refused = records["c5"]["response"]
    assert refused["status_code"] == 400
    assert refused["body"]["error"]["param"] == "body.tools"
