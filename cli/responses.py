"""The ``/v1/responses`` endpoint of the Batch format: its body in, its
``response`` object out.

Contract: ``read_body`` turns a responses body into what a chat body gives
the JSONL reader (messages, the sampling fields under their chat names, a
grammar) or raises ``LineFault`` naming the field (``body.input[1].content``,
``body.text.format.schema``); ``response_object`` builds the ``response``
object of a finished line, which parses as the ``openai`` package's
``Response``.

Taken: ``input`` (a string, or a list of messages ``{role, content}`` whose
content is a string or a list of ``input_text``/``output_text`` parts),
``instructions`` (a system message before the input), ``max_output_tokens``,
``temperature``, ``top_p``, ``text.format`` (``text``, ``json_object``, or
``json_schema`` with ``name``, ``schema``, ``strict``, ``description``:
constrained as ``response_format`` is), and metrale's own ``seed`` and
``top_k`` as on the other endpoints. ``model``, ``user``, ``metadata``,
``store``, ``service_tier`` are accepted and ignored; ``stream`` only false.
Any other field (``tools``, ``previous_response_id``, ``reasoning``,
``include``...) is an error naming it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from metrale.cli.faults import LineFault
from metrale.cli.grammar_fields import JSON_SCHEMA_KEYS, checked
from metrale.engine.api import Grammar, Result
from metrale.engine.spec.grammar import json_schema_grammar

TAKEN = frozenset({"input", "instructions", "max_output_tokens", "temperature", "top_p"})
TAKEN |= {"text", "seed", "top_k"}
IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier"})
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class ResponsesBody:
    """A responses body, read: chat messages, the sampling fields under their
    chat names (for the reader's checks), the grammar, and what the
    ``response`` object echoes."""

    messages: tuple[dict[str, str], ...]
    sampling: dict[str, Any]
    grammar: Grammar | None
    named_format: bool  # text.format was given (text included): it wins over --json-schema
    echo: dict[str, Any]


def read_body(body: dict[str, Any]) -> ResponsesBody:
    """Reads a responses body (module doc); ``LineFault`` names a bad field."""
    for key in sorted(body):
        if key == "stream" and body[key] in (False, None):
            continue
        if key not in TAKEN and key not in IGNORED:
            raise LineFault(f"body.{key}", "is not supported on /v1/responses")
    messages = _input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise LineFault("body.instructions", "must be a string")
        messages = ({"role": "system", "content": instructions}, *messages)
    sampling: dict[str, Any] = {
        k: body[k] for k in ("temperature", "top_p", "seed", "top_k") if k in body
    }
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise LineFault("body.max_output_tokens", f"must be an integer >= 1, got {limit!r}")
        sampling["max_tokens"] = limit
    fmt = _text_format(body.get("text"))
    echo = {
        "instructions": instructions,
        "max_output_tokens": limit,
        "text": {"format": fmt if fmt is not None else {"type": "text"}},
        "metadata": body.get("metadata"),
    }
    grammar = _format_grammar(fmt) if fmt is not None else None
    return ResponsesBody(messages, sampling, grammar, fmt is not None, echo)


def response_object(
    number: int, result: Result, model_name: str, echo: dict[str, Any], sampling: dict[str, Any]
) -> dict[str, Any]:
    """The ``response`` object of line ``number``'s finished request: status
    ``incomplete`` with ``incomplete_details`` when cut at max tokens.
    ``sampling``: the temperature and top_p it ran with."""
    cut = result.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    text = {"type": "output_text", "text": result.text, "annotations": [], "logprobs": []}
    message = {
        "type": "message",
        "id": f"msg_{number}",
        "status": status,
        "role": "assistant",
        "content": [text],
    }
    return {
        "id": f"resp_{number}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": model_name,
        "output": [message],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        **sampling,
        **echo,
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": result.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
    }


def _input_messages(value: Any) -> tuple[dict[str, str], ...]:
    if isinstance(value, str):
        if not value:
            raise LineFault("body.input", "must not be empty")
        return ({"role": "user", "content": value},)
    if not isinstance(value, list) or not value:
        raise LineFault("body.input", "must be a string or a non-empty list of messages")
    return tuple(_input_message(item, f"body.input[{i}]") for i, item in enumerate(value))


def _input_message(item: Any, where: str) -> dict[str, str]:
    if not isinstance(item, dict):
        raise LineFault(where, "must be a message object {role, content}")
    kind = item.get("type", "message")
    if kind != "message":
        raise LineFault(f"{where}.type", f"{kind!r} items are not supported (only messages)")
    role = item.get("role")
    if role not in ROLES:
        raise LineFault(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    unknown = sorted(set(item) - {"type", "role", "content", "id", "status"})
    if unknown:
        raise LineFault(f"{where}.{unknown[0]}", "is not supported")
    return {"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise LineFault(where, "must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise LineFault(f"{where}[{i}]", f"{kind!r} parts are not supported (text only)")
        if not isinstance(part.get("text"), str):
            raise LineFault(f"{where}[{i}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _text_format(value: Any) -> dict[str, Any] | None:
    """``text.format``, checked for shape; None when not given."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise LineFault("body.text", "must be an object with a format")
    unknown = sorted(set(value) - {"format"})
    if unknown:
        raise LineFault(f"body.text.{unknown[0]}", "is not supported")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise LineFault("body.text.format", "must be an object with a type")
    return fmt


def _format_grammar(fmt: dict[str, Any]) -> Grammar | None:
    """The grammar of ``text.format``: none for text, like ``response_format``."""
    where, kind = "body.text.format", fmt.get("type")
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return Grammar("json_object") if kind == "json_object" else None
    if kind != "json_schema":
        raise LineFault(f"{where}.type", "must be text, json_object or json_schema")
    unknown = sorted(set(fmt) - JSON_SCHEMA_KEYS - {"type"})
    if unknown:
        raise LineFault(f"{where}.{unknown[0]}", "is not supported")
    if not isinstance(fmt.get("schema"), dict):
        raise LineFault(f"{where}.schema", "must be a JSON schema object")
    if "name" in fmt and not isinstance(fmt["name"], str):
        raise LineFault(f"{where}.name", "must be a string")
    if "strict" in fmt and not isinstance(fmt["strict"], bool | None):
        raise LineFault(f"{where}.strict", "must be true or false")
    return checked(json_schema_grammar(fmt["schema"]), f"{where}.schema")
