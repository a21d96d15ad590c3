"""Output records, and reading back an output file for ``--resume``.

Contract: a line answered in the simple format gets a simple record; a batch
line gets an OpenAI batch output line (``id``, ``custom_id``, ``response:
{status_code, request_id, body}``, ``error``), with a ``chat.completion``,
``text_completion`` or ``response`` body and its usage, and the tokens'
logprobs where the line asked (``logprobs.py``). Every body parses as the
``openai`` package's type for it. Errors keep the input's format: a
simple error record carries ``finish_reason: "error"`` and ``error: {line,
field, message}``; a batch one answers status 400 (bad line) or 500 (the
engine failed it) with an OpenAI-style error body.

Ids in batch records are derived from the line number (``batch_req_7``,
``chatcmpl-7``), so two runs over the same input write the same ids.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from metrale.cli.jsonl import LineError, LineFormat, ParsedLine, id_key
from metrale.cli.logprobs import chat_logprobs, completion_logprobs, simple_logprobs
from metrale.cli.responses import response_object
from metrale.engine.api import RequestStats, Result
from metrale.engine.stats import EngineStats


def result_record(parsed: ParsedLine, results: Sequence[Result], model_name: str) -> dict[str, Any]:
    """The record for a line the engine finished (or failed): ``results``
    holds its ``n`` choices in order. One failed choice fails the line."""
    failed = next((r for r in results if r.error is not None), None)
    if failed is not None:
        assert failed.error is not None
        return _failure(
            parsed.ref.where,
            parsed.ref.number,
            parsed.format,
            parsed.output_id,
            None,
            failed.error,
            status=500,
        )
    first = results[0]
    completion = sum(r.completion_tokens for r in results)
    # The prompt counts once, as OpenAI counts it for n choices: the line
    # read it once, and its other choices forked from that reading.
    usage = {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }
    if parsed.format == "simple":
        return _simple_record(parsed, results, usage)
    n = parsed.ref.number
    if parsed.format == "chat":
        body: dict[str, Any] = {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": r.text},
                    "finish_reason": r.finish_reason,
                    "logprobs": chat_logprobs(r.logprobs, r.token_bytes)
                    if r.logprobs is not None
                    else None,
                }
                for i, r in enumerate(results)
            ],
            "usage": usage,
        }
    elif parsed.format == "response":
        sampling = {"temperature": parsed.params.temperature, "top_p": parsed.params.top_p}
        body = response_object(n, first, model_name, parsed.echo or {}, sampling)
    else:
        body = {
            "id": f"cmpl-{n}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "text": r.text,
                    "finish_reason": r.finish_reason,
                    "logprobs": completion_logprobs(r.logprobs, r.token_bytes)
                    if r.logprobs is not None
                    else None,
                }
                for i, r in enumerate(results)
            ],
            "usage": usage,
        }
    response = {"status_code": 200, "request_id": f"req_{n}", "body": body}
    return {
        "id": f"batch_req_{n}",
        "custom_id": parsed.output_id,
        "response": response,
        "error": None,
    }


def _simple_record(
    parsed: ParsedLine, results: Sequence[Result], usage: dict[str, Any]
) -> dict[str, Any]:
    """A simple record: ``text`` and ``finish_reason`` for one choice, a
    ``choices`` list of them for ``n > 1``."""
    constrained = parsed.grammar is not None
    choices = []
    for i, r in enumerate(results):
        choice: dict[str, Any] = {"index": i, "text": r.text, "finish_reason": r.finish_reason}
        if r.logprobs is not None:
            choice["logprobs"] = simple_logprobs(r.logprobs, r.token_bytes)
        choice["speculation"] = speculation(r.stats, constrained)
        choices.append(choice)
    record: dict[str, Any] = {"id": parsed.output_id}
    if len(choices) == 1:
        del choices[0]["index"]
        speculation_figures = choices[0].pop("speculation")
        record |= choices[0] | {"usage": usage, "speculation": speculation_figures}
    else:
        record |= {"choices": choices, "usage": usage}
    if parsed.metadata is not None:
        record["metadata"] = parsed.metadata
    return record


def error_record(err: LineError) -> dict[str, Any]:
    """The record for a line that was never generated."""
    return _failure(
        err.ref.where, err.ref.number, err.format, err.output_id, err.field, err.message, status=400
    )


def speculation(stats: RequestStats, constrained: bool = False) -> dict[str, Any]:
    """Per-request figures. ``mean_tokens_per_verify`` counts the bonus token
    (plain decoding scores 1.0); the first output token comes from the
    prefill and is in neither ``verifies`` nor ``verify_tokens``. A request
    with a grammar also has ``forced`` (its grammar's forced drafts) and
    ``grammar_ms`` (time spent on its grammar)."""
    figures = {
        "verifies": stats.verifies,
        "verify_tokens": stats.verify_tokens,
        "mean_tokens_per_verify": round(stats.mean_tokens_per_verify, 3),
        "mtp": {"proposed": stats.mtp_proposed, "accepted": stats.mtp_accepted},
        **copy_figures(stats),
    }
    if constrained:
        figures["forced"] = {"proposed": stats.forced_proposed, "accepted": stats.forced_accepted}
        figures["grammar_ms"] = round(1e3 * stats.grammar_s, 3)
    return figures


def copy_figures(stats: RequestStats | EngineStats) -> dict[str, dict[str, int]]:
    """Prompt-lookup figures, of one request or of the run: ``prompt_lookup``
    counts every copy, ``shared_lookup`` the part the shared cache supplied."""
    lookup = stats.prompt_lookup
    return {"prompt_lookup": asdict(lookup.total), "shared_lookup": asdict(lookup.shared)}


def dumps(record: dict[str, Any]) -> str:
    """One JSONL line, newline included."""
    return orjson.dumps(record).decode() + "\n"


def is_failure(record: dict[str, Any]) -> bool:
    if "custom_id" in record:
        return record.get("error") is not None or record["response"]["status_code"] != 200
    return record.get("finish_reason") == "error"


def done_ids(path: Path) -> set[str]:
    """Ids (as ``id_key``) already answered in ``path``, for ``--resume``.

    A run cut off mid-write leaves a partial last line: it is cut away here so
    that appending starts on a fresh line. A missing file means nothing is done.
    """
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    tail = data[len(complete) :]
    if tail:
        with path.open("r+b") as f:
            if _parses(tail):  # whole but unterminated: keep it, end the line
                f.seek(len(data))
                f.write(b"\n")
                complete = data + b"\n"
            else:
                f.truncate(len(complete))
    ids: set[str] = set()
    for line in complete.splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # not ours: leave it, its request runs again
        if isinstance(record, dict):
            key = "custom_id" if "custom_id" in record else "id"
            if key in record:
                ids.add(id_key(record[key]))
    return ids


def _parses(line: bytes) -> bool:
    try:
        return isinstance(orjson.loads(line), dict)
    except orjson.JSONDecodeError:
        return False


def _failure(
    where: str,
    number: int,
    fmt: LineFormat,
    output_id: Any,
    field: str | None,
    message: str,
    status: int,
) -> dict[str, Any]:
    if fmt == "simple":
        return {
            "id": output_id,
            "finish_reason": "error",
            "error": {"line": where, "field": field, "message": message},
        }
    kind = "invalid_request_error" if status == 400 else "server_error"
    text = f"line {where}: " + (f"{field}: {message}" if field else message)
    body = {"error": {"message": text, "type": kind, "param": field, "code": None}}
    response = {"status_code": status, "request_id": f"req_{number}", "body": body}
    return {
        "id": f"batch_req_{number}",
        "custom_id": output_id,
        "response": response,
        "error": None,
    }
