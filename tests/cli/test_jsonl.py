"""Input lines -> requests (cli/jsonl.py) and output records (cli/records.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from metrale.cli.jsonl import (
    LineDefaults,
    LineError,
    LineRef,
    ParsedLine,
    encode,
    id_key,
    parse_line,
)
from metrale.cli.records import done_ids, error_record, result_record
from metrale.engine.api import Request, RequestStats, Result, SamplingParams
from tests.support.checkpoints import write_byte_tokenizer
from tests.support.cli_fakes import ByteTokenizer

REF = LineRef(7, "in.jsonl:7")
DEFAULTS = LineDefaults(params=SamplingParams(max_tokens=32, temperature=0.5, seed=100))


def parse(obj: Any, defaults: LineDefaults = DEFAULTS) -> ParsedLine | LineError:
    raw = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return parse_line(REF, raw, defaults)


def ok(obj: Any) -> ParsedLine:
    parsed = parse(obj)
    assert isinstance(parsed, ParsedLine), parsed
    return parsed


def fault(obj: Any) -> LineError:
    parsed = parse(obj)
    assert isinstance(parsed, LineError), parsed
    return parsed


def test_simple_line_overrides_the_run_defaults_field_by_field() -> None:
    line = ok({"prompt": "p", "max_tokens": 5, "top_k": 3, "stop": "\n\n", "scope": "t"})
    assert line.format == "simple" and line.output_id == 7 and line.prompt == "p"
    assert line.params == SamplingParams(
        max_tokens=5, temperature=0.5, top_k=3, seed=107, stop=("\n\n",)
    )
    assert line.scope == "t"
    assert ok({"id": "x", "prompt": "p", "seed": 1}).params.seed == 1


def chat(body: dict[str, Any]) -> dict[str, Any]:
    """A chat Batch line with ``body`` beside one message."""
    messages = [{"role": "user", "content": "hi"}]
    return {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": messages, **body}}


def test_logprobs_fields_ask_for_the_top_alternatives_in_each_format() -> None:
    assert ok({"prompt": "p"}).params.logprobs is None
    assert ok({"prompt": "p", "logprobs": 0}).params.logprobs == 0
    assert ok({"prompt": "p", "logprobs": 20}).params.logprobs == 20
    assert ok(chat({})).params.logprobs is None
    assert ok(chat({"logprobs": False, "top_logprobs": None})).params.logprobs is None
    assert ok(chat({"logprobs": True})).params.logprobs == 0
    assert ok(chat({"logprobs": True, "top_logprobs": 5})).params.logprobs == 5
    body: dict[str, Any] = {"prompt": "p"}
    completion = {"custom_id": "c", "url": "/v1/completions", "body": body}
    assert ok(completion).params.logprobs is None
    body["logprobs"] = 3
    assert ok(completion).params.logprobs == 3


def test_batch_lines_are_detected_by_custom_id_and_url() -> None:
    chat = ok(
        {
            "custom_id": "r1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "gpt",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
                "max_completion_tokens": 9,
                "n": 1,
                "stream": False,
            },
        }
    )
    assert chat.format == "chat" and chat.output_id == "r1"
    assert chat.messages == ({"role": "user", "content": "ab"},)
    assert chat.params.max_tokens == 9
    text = ok(
        {
            "custom_id": "r2",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "stop": ["a", "b"], "top_p": 0.5},
        }
    )
    assert text.format == "completion" and text.params.stop == ("a", "b")
    assert text.params.top_p == 0.5


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"id": 1}, "prompt"),
        ({"prompt": "a", "messages": []}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_k": -1}, "top_k"),
        ({"prompt": "a", "seed": True}, "seed"),
        ({"prompt": "a", "stop": [""]}, "stop"),
        ({"prompt": "a", "scope": 5}, "scope"),
        ({"prompt": "a", "max_token": 5}, "max_token"),
        ({"id": None, "prompt": "a"}, "id"),
        ({"custom_id": "", "url": "/v1/completions", "body": {}}, "custom_id"),
        ({"custom_id": "c", "url": "/v1/embeddings", "body": {}}, "url"),
        ({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}}, "method"),
        ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a", "n": 17}}, "body.n"),
        ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a", "n": 0}}, "body.n"),
        ({"prompt": "a", "n": 17}, "n"),
        ({"custom_id": "c", "url": "/v1/chat/completions", "body": {"prompt": "a"}}, "body.prompt"),
        (
            {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a", "tools": [1]}},
            "body.tools",
        ),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "logprobs": True}, "logprobs"),
        (chat({"logprobs": True, "top_logprobs": 21}), "body.top_logprobs"),
        (chat({"logprobs": True, "top_logprobs": -1}), "body.top_logprobs"),
        (chat({"top_logprobs": 3}), "body.top_logprobs"),
        (chat({"logprobs": 3}), "body.logprobs"),
        (
            {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a", "logprobs": 21}},
            "body.logprobs",
        ),
        (
            {
                "custom_id": "c",
                "url": "/v1/completions",
                "body": {"prompt": "a", "top_logprobs": 2},
            },
            "body.top_logprobs",
        ),
    ],
)
def test_bad_lines_name_the_field(obj: Any, field: str | None) -> None:
    err = fault(obj)
    assert err.field == field and err.ref == REF and err.message


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.dictionaries(
            st.sampled_from(
                [
                    "id",
                    "prompt",
                    "messages",
                    "max_tokens",
                    "temperature",
                    "top_p",
                    "custom_id",
                    "body",
                    "url",
                    "stop",
                    "seed",
                ]
            ),
            st.one_of(
                st.none(),
                st.booleans(),
                st.integers(),
                st.floats(),
                st.text(max_size=4),
                st.lists(st.text(max_size=3), max_size=2),
            ),
        ).map(lambda d: json.dumps(d).encode()),
    )
)
def test_any_line_parses_or_names_its_fault_without_raising(raw: bytes) -> None:
    parsed = parse_line(REF, raw, DEFAULTS)
    assert isinstance(parsed, ParsedLine | LineError)
    if isinstance(parsed, ParsedLine):
        assert encode(parsed, ByteTokenizer(), max_len=1 << 20) is not None


def test_messages_go_through_the_models_chat_template(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    line = ok({"messages": [{"role": "user", "content": "hi"}]})
    request = encode(line, tokenizer, max_len=512)
    assert isinstance(request, Request) and request.request_id == "7"
    text = tokenizer.decode(list(request.prompt_ids))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_prompt_that_leaves_no_room_for_max_tokens_is_too_long() -> None:
    line = ok({"prompt": "abcd", "max_tokens": 3})
    assert isinstance(encode(line, ByteTokenizer(), max_len=7), Request)
    err = encode(line, ByteTokenizer(), max_len=6)
    assert isinstance(err, LineError) and err.field == "prompt" and "too long" in err.message


def test_records_keep_the_input_format() -> None:
    stats = RequestStats(verifies=1, verify_tokens=2)
    stats.prompt_lookup.observe(1, 1, shared=False)
    result = Result("7", 3, (1, 2), "hey", "stop", stats)
    simple = result_record(ok({"id": "q", "prompt": "p", "metadata": {"k": 1}}), [result], "m")
    assert simple["id"] == "q" and simple["text"] == "hey" and simple["metadata"] == {"k": 1}
    assert simple["speculation"]["mean_tokens_per_verify"] == 2.0
    assert simple["speculation"]["prompt_lookup"] == {"copies": 1, "proposed": 1, "accepted": 1}
    assert simple["speculation"]["shared_lookup"] == {"copies": 0, "proposed": 0, "accepted": 0}
    line = ok({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "p"}})
    batch = result_record(line, [result], "m")
    assert batch["custom_id"] == "c" and batch["id"] == "batch_req_7"
    assert batch["response"]["body"]["choices"][0]["text"] == "hey"
    failed = Result("7", 3, (), "", "error", RequestStats(), error="boom")
    assert result_record(line, [failed], "m")["response"]["status_code"] == 500
    err = error_record(fault({"custom_id": "c", "url": "/v1/x", "body": {}}))
    assert err["response"]["body"]["error"]["param"] == "url"
    assert "line in.jsonl:7" in err["response"]["body"]["error"]["message"]


def test_done_ids_cut_a_partial_last_line_and_keep_whole_ones(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": 1}\n{"custom_id": "c"}\ngarbage\n{"id": "tr')
    assert done_ids(out) == {id_key(1), id_key("c")}
    assert out.read_bytes() == b'{"id": 1}\n{"custom_id": "c"}\ngarbage\n'
    out.write_bytes(b'{"id": 1}\n{"id": 2}')  # whole but unterminated
    assert done_ids(out) == {id_key(1), id_key(2)}
    assert out.read_bytes() == b'{"id": 1}\n{"id": 2}\n'
    assert done_ids(tmp_path / "missing.jsonl") == set()
    assert id_key(1) != id_key("1")
