"""Input lines -> engine requests, in both JSONL formats, detected per line.

Contract: one input line gives exactly one output record, good or bad. A line
that is not JSON, lacks a prompt, carries an invalid parameter or is too long
for the model becomes a ``LineError`` naming the line (``path:number``) and
the field; it never stops the other lines. Nothing here touches the engine or
a terminal: the command feeds ``Request``s to the engine and writes records.

Formats (docs/formats.md):

- simple: ``{"id"?, "prompt" | "messages", "max_tokens"?, "temperature"?,
  "top_p"?, "top_k"?, "seed"?, "stop"?, "logprobs"?, "scope"?, "metadata"?,
  "json_schema" | "regex" | "choice"?}``; its output ``id`` is the input's,
  else the line number (1-based, counted across all inputs of the run).
- OpenAI Batch API: ``{"custom_id", "method": "POST", "url":
  "/v1/chat/completions" | "/v1/completions" | "/v1/responses", "body":
  {...}}``, the body's ``response_format`` a JSON schema, a JSON object or
  text; a responses body is read by ``responses.py``.

A line's grammar (``grammar_fields.py``) is checked here, so a schema or
regex that does not compile is an error record naming its field.

Sampling fields a line leaves out come from the run's flags. A line without
``seed`` gets ``--seed + line number`` (when ``--seed`` is given), so a
sampled run is reproducible whatever order requests finish in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson

from metrale.cli.faults import LineFault
from metrale.cli.grammar_fields import SIMPLE_GRAMMAR_FIELDS, batch_grammar, simple_grammar
from metrale.cli.responses import read_body
from metrale.engine.api import MAX_TOP_LOGPROBS, Grammar, Request, SamplingParams
from metrale.engine.prompts import Tokenizer, chat_prompt_ids, content_text, text_prompt_ids

LineFormat = Literal["simple", "chat", "completion", "response"]
BATCH_URLS: dict[str, LineFormat] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "response",
}
SIMPLE_FIELDS = frozenset(
    {"id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed"}
    | {"stop", "logprobs", "n", "scope", "metadata", *SIMPLE_GRAMMAR_FIELDS}
)
# Batch bodies carry more than metrale honours. These are accepted and ignored:
BODY_IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options"})
# ...and these only at the value that means "feature off", since anything else
# would silently change what the caller asked for.
BODY_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "echo": (False,),
    "best_of": (1,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
MAX_STOPS = 16
MAX_N = 16  # choices one line may ask for

__all__ = ["LineFault"]  # re-exported: parsing code raises it from here


@dataclass(frozen=True)
class LineRef:
    """Where a line came from: ``number`` counts across inputs, ``where`` is
    ``path:line-in-file`` for messages."""

    number: int
    where: str


@dataclass(frozen=True)
class LineDefaults:
    """Run-wide values for what a line leaves out (from the flags)."""

    params: SamplingParams = field(default_factory=SamplingParams)
    scope: str | None = None
    grammar: Grammar | None = None  # ``--json-schema FILE``: for lines that name none
    n: int = 1  # ``--n``: choices of a line that says none


@dataclass(frozen=True)
class ParsedLine:
    """A well-formed line, not yet tokenized. ``output_id`` is the value the
    output record carries (simple ``id`` or batch ``custom_id``)."""

    ref: LineRef
    format: LineFormat
    output_id: Any
    params: SamplingParams
    scope: str | None
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    metadata: Any = None
    grammar: Grammar | None = None
    echo: dict[str, Any] | None = None  # what a response object repeats of its body
    n: int = 1  # choices: samples of the prompt, each from its own noise stream


@dataclass(frozen=True)
class LineError:
    """A line that will not be generated; written as an error record."""

    ref: LineRef
    format: LineFormat
    output_id: Any
    field: str | None
    message: str


def parse_line(
    ref: LineRef, raw: bytes, defaults: LineDefaults, fallback: LineFormat = "simple"
) -> ParsedLine | LineError:
    """Parses one input line. ``fallback`` is the format an error record takes
    when the line is too broken to tell (the format of the previous line)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return LineError(ref, fallback, _default_id(ref, fallback), None, f"not JSON: {exc}")
    if not isinstance(obj, dict):
        msg = f"expected a JSON object, got {type(obj).__name__}"
        return LineError(ref, fallback, _default_id(ref, fallback), None, msg)
    fmt: LineFormat = "simple"
    output_id: Any = obj.get("id", ref.number)
    try:
        if "custom_id" in obj or "body" in obj:
            output_id = obj.get("custom_id")
            # A batch line's error is a batch record even when its url is bad.
            fmt = BATCH_URLS.get(str(obj.get("url")), "chat")
            fmt = _batch_format(obj)
            return _parse_body(ref, fmt, output_id, obj, defaults)
        return _parse_simple(ref, output_id, obj, defaults)
    except LineFault as fault:
        return LineError(ref, fmt, output_id, fault.field, fault.message)


def encode(
    parsed: ParsedLine, tokenizer: Tokenizer, max_len: int, limit: str = ""
) -> Request | LineError:
    """Tokenizes a parsed line into a Request whose id is the line number
    (unique within the run, unlike user ids), the way ``train-mtp`` and the
    benchmarks do (``metrale.engine.prompts``). A prompt that leaves no room for
    ``max_tokens`` within ``max_len`` positions is an error naming its field
    (the engine would refuse it; here the record can say which line and field),
    and ``limit``, why sequences have that many positions (``ModelInfo.kv_limit``)."""
    name = "prompt" if parsed.prompt is not None else "messages"
    try:
        if parsed.prompt is not None:
            ids = text_prompt_ids(tokenizer, parsed.prompt)
        else:
            ids = chat_prompt_ids(tokenizer, parsed.messages or ())
    except Exception as exc:  # a chat template may raise anything (jinja)
        return _error(parsed, name, f"cannot tokenize: {exc}")
    if not ids:
        return _error(parsed, name, "encodes to no tokens")
    if len(ids) + parsed.params.max_tokens > max_len:
        why = f" ({limit})" if limit else ""
        msg = (
            f"too long: {len(ids)} prompt tokens + max_tokens {parsed.params.max_tokens} "
            f"exceed the model's {max_len} positions{why}; shorten it or lower max_tokens"
        )
        return _error(parsed, name, msg)
    return Request(str(parsed.ref.number), tuple(ids), parsed.params, parsed.scope, parsed.grammar)


def choices(request: Request, n: int) -> list[Request]:
    """The ``n`` requests of a line: choice ``i`` is ``"line:i"`` and draws
    from stream ``i``; a single choice keeps the line's own id."""
    if n == 1:
        return [request]
    return [replace(request, request_id=f"{request.request_id}:{i}", choice=i) for i in range(n)]


def line_of(request_id: str) -> tuple[int, int]:
    """The line number and choice index a request id from ``choices`` names."""
    line, _, choice = request_id.partition(":")
    return int(line), int(choice or 0)


def id_key(value: Any) -> str:
    """A hashable key for an output id; ``1`` and ``"1"`` stay different."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _default_id(ref: LineRef, fmt: LineFormat) -> Any:
    return ref.number if fmt == "simple" else None


def _error(parsed: ParsedLine, name: str | None, message: str) -> LineError:
    return LineError(parsed.ref, parsed.format, parsed.output_id, name, message)


def _batch_format(obj: dict[str, Any]) -> LineFormat:
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise LineFault("custom_id", "must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise LineFault("method", "must be POST")
    url = obj.get("url")
    if not isinstance(url, str) or url not in BATCH_URLS:
        raise LineFault("url", f"must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    if not isinstance(obj.get("body"), dict):
        raise LineFault("body", "must be a JSON object")
    return BATCH_URLS[url]


def _parse_simple(
    ref: LineRef, output_id: Any, obj: dict[str, Any], defaults: LineDefaults
) -> ParsedLine:
    unknown = sorted(set(obj) - SIMPLE_FIELDS)
    if unknown:
        raise LineFault(unknown[0], "unknown field (see docs/formats.md)")
    if not isinstance(output_id, str | int) or isinstance(output_id, bool):
        raise LineFault("id", "must be a string or an integer")
    prompt, messages = _prompt_or_messages(obj, "")
    params = _params(obj, "", defaults.params, ref.number, obj.get("max_tokens"))
    if obj.get("logprobs") is not None:
        params = replace(params, logprobs=_top(obj["logprobs"], "logprobs"))
    scope = _scope(obj.get("scope", defaults.scope), "scope")
    grammar = _without_stops(simple_grammar(obj) or defaults.grammar, params, "stop")
    n = _n(obj.get("n"), "n", defaults.n)
    return ParsedLine(
        ref, "simple", output_id, params, scope, prompt, messages, obj.get("metadata"), grammar, n=n
    )


def _parse_body(
    ref: LineRef, fmt: LineFormat, custom_id: str, obj: dict[str, Any], defaults: LineDefaults
) -> ParsedLine:
    body: dict[str, Any] = obj["body"]
    if fmt == "response":
        return _parse_responses(ref, custom_id, obj, defaults)
    for key, allowed in BODY_DEFAULTS.items():
        if key in body and body[key] not in allowed:
            raise LineFault(f"body.{key}", f"is not supported (only {allowed[0]!r})")
    known = {"prompt", "messages", "max_tokens", "max_completion_tokens", "temperature"}
    known |= {"top_p", "top_k", "seed", "stop", "response_format", "logprobs", "n"}
    known |= {"top_logprobs"} if fmt == "chat" else set()
    known |= BODY_IGNORED | set(BODY_DEFAULTS)
    unknown = sorted(set(body) - known)
    if unknown:
        raise LineFault(f"body.{unknown[0]}", "is not supported")
    if fmt == "chat" and "prompt" in body:
        raise LineFault("body.prompt", "belongs to /v1/completions; chat takes messages")
    if fmt == "completion" and "messages" in body:
        raise LineFault("body.messages", "belongs to /v1/chat/completions; use prompt")
    prompt, messages = _prompt_or_messages(body, "body.")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = _params(body, "body.", defaults.params, ref.number, max_tokens)
    params = replace(params, logprobs=_body_logprobs(body, fmt))
    scope = _scope(obj.get("scope", defaults.scope), "scope")
    # An explicit response_format (text included) wins over --json-schema.
    named = body.get("response_format") is not None
    grammar = batch_grammar(body) if named else defaults.grammar
    grammar = _without_stops(grammar, params, "body.stop")
    n = _n(body.get("n"), "body.n", defaults.n)
    return ParsedLine(ref, fmt, custom_id, params, scope, prompt, messages, grammar=grammar, n=n)


def _parse_responses(
    ref: LineRef, custom_id: str, obj: dict[str, Any], defaults: LineDefaults
) -> ParsedLine:
    """A ``/v1/responses`` body (``responses.py``), checked as a chat body is."""
    read = read_body(obj["body"])
    max_tokens = read.sampling.get("max_tokens")
    params = _params(read.sampling, "body.", defaults.params, ref.number, max_tokens)
    scope = _scope(obj.get("scope", defaults.scope), "scope")
    grammar = read.grammar if read.named_format else defaults.grammar
    return ParsedLine(
        ref, "response", custom_id, params, scope, None, read.messages, None, grammar, read.echo
    )


def _body_logprobs(body: dict[str, Any], fmt: LineFormat) -> int | None:
    """How many alternatives a token's logprobs list (None: no logprobs).
    Chat: ``logprobs: true`` and ``top_logprobs`` 0-20; completions: an
    integer ``logprobs`` 0-20."""
    value = body.get("logprobs")
    if fmt == "completion":
        return None if value is None else _top(value, "body.logprobs")
    if value not in (True, False, None):
        raise LineFault("body.logprobs", f"must be true or false, got {value!r}")
    top = body.get("top_logprobs")
    if top is not None and value is not True:
        raise LineFault("body.top_logprobs", "needs logprobs: true")
    if value is not True:
        return None
    return 0 if top is None else _top(top, "body.top_logprobs")


def _n(value: Any, name: str, default: int) -> int:
    return default if value is None else _bounded(value, name, 1, MAX_N)


def _top(value: Any, name: str) -> int:
    return _bounded(value, name, 0, MAX_TOP_LOGPROBS)


def _bounded(value: Any, name: str, lo: int, hi: int) -> int:
    count = _int(value, name, lo)
    if count > hi:
        raise LineFault(name, f"must be at most {hi}, got {count}")
    return count


def _without_stops(
    grammar: Grammar | None, params: SamplingParams, stop_field: str
) -> Grammar | None:
    """A grammar is refused beside a stop string, which would cut the output
    before the grammar is complete."""
    if grammar is not None and params.stop:
        raise LineFault(stop_field, "cannot be combined with a grammar (it would cut the output)")
    return grammar


def _prompt_or_messages(
    obj: dict[str, Any], prefix: str
) -> tuple[str | None, tuple[dict[str, str], ...] | None]:
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        what = "both" if has_prompt else "neither"
        raise LineFault(f"{prefix}prompt", f"give exactly one of prompt or messages, not {what}")
    if has_prompt:
        if not isinstance(obj["prompt"], str):
            raise LineFault(f"{prefix}prompt", "must be a string")
        return obj["prompt"], None
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise LineFault(f"{prefix}messages", "must be a non-empty list of {role, content}")
    return None, tuple(_message(m, f"{prefix}messages[{i}]") for i, m in enumerate(messages))


def _message(m: Any, where: str) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise LineFault(where, "must be an object with a string role")
    try:
        content = content_text(m.get("content"))
    except ValueError as exc:
        raise LineFault(f"{where}.content", str(exc)) from None
    return {"role": m["role"], "content": content}


def _params(
    obj: dict[str, Any], prefix: str, base: SamplingParams, number: int, max_tokens: Any
) -> SamplingParams:
    changes: dict[str, Any] = {}
    if max_tokens is not None:
        changes["max_tokens"] = _int(max_tokens, f"{prefix}max_tokens", 1)
    for name, lo, hi, lo_open in (("temperature", 0.0, 100.0, False), ("top_p", 0.0, 1.0, True)):
        if obj.get(name) is not None:
            changes[name] = _float(obj[name], prefix + name, lo, hi, lo_open)
    if obj.get("top_k") is not None:
        changes["top_k"] = _int(obj["top_k"], f"{prefix}top_k", 0)
    if obj.get("seed") is not None:
        changes["seed"] = _int(obj["seed"], f"{prefix}seed", 0)
    elif base.seed is not None:
        changes["seed"] = base.seed + number
    if obj.get("stop") is not None:
        changes["stop"] = _stops(obj["stop"], f"{prefix}stop")
    return replace(base, **changes)


def _int(value: Any, name: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LineFault(name, f"must be an integer, got {value!r}")
    if value < lo:
        raise LineFault(name, f"must be at least {lo}, got {value}")
    return value


def _float(value: Any, name: str, lo: float, hi: float, lo_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LineFault(name, f"must be a number, got {value!r}")
    if (value <= lo if lo_open else value < lo) or value > hi:
        left = "(" if lo_open else "["
        raise LineFault(name, f"must be in {left}{lo:g}, {hi:g}], got {value}")
    return float(value)


def _stops(value: Any, name: str) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise LineFault(name, "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise LineFault(name, f"at most {MAX_STOPS} stop strings")
    return tuple(stops)


def _scope(value: Any, name: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise LineFault(name, "must be a non-empty string")
    return value
