"""One `metrale generate` run: input lines through the engine to output lines.

Contract: every non-blank input line gets exactly one output record, written
and flushed as soon as it can be (``completed`` order: when its request
finishes; ``input`` order: when every earlier line's record is out). Bad lines
become error records and never stop the run. Standard output, when it is the
output, carries JSONL only; people read standard error.

Exit status: 0 all lines succeeded, 1 some failed, 130 interrupted (Ctrl-C),
141 the reader of standard output went away. On an interrupt, records held
back for ``input`` order are written anyway (out of order: losing finished
work is worse), and the summary of what finished is printed.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, TypeVar

import orjson
from rich.console import Console

from metrale.cli.budget_view import budget_figures
from metrale.cli.jsonl import (
    LineDefaults,
    LineError,
    LineFormat,
    LineRef,
    ParsedLine,
    Tokenizer,
    encode,
    id_key,
    parse_line,
)
from metrale.cli.live import RunCounters, live_view
from metrale.cli.options import OutputOrder
from metrale.cli.records import copy_figures, dumps, error_record, result_record
from metrale.engine.api import Request, Result
from metrale.engine.stats import EngineStats

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 130, 141


@dataclass
class Backend:
    """A loaded model and its engine, as the run sees them (tests fake it)."""

    name: str
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    max_len: int
    generate: Callable[[Iterable[Request | None]], Iterator[Result]]
    stats: Callable[[], EngineStats]
    # Why sequences get max_len positions (``ModelInfo.kv_limit``), quoted
    # by the error record of a line too long for them; "" says nothing more.
    limit: str = ""


@dataclass(frozen=True)
class RunPlan:
    """Everything the run needs besides the backend, built from the flags.
    ``inputs`` holds paths, ``"-"`` for standard input; ``output`` None (or
    ``"-"``) writes standard output."""

    inputs: tuple[str, ...]
    output: str | None
    order: OutputOrder
    skip_ids: frozenset[str]  # ``id_key``s already answered (``--resume``)
    stats_json: Path | None
    progress: str  # "live", "plain" or "off", already resolved
    defaults: LineDefaults
    settings: dict[str, Any]


class Writer:
    """Writes records in the plan's order, counting failures, flushing each."""

    def __init__(self, out: IO[str], order: OutputOrder, counters: RunCounters) -> None:
        self.out, self.order, self.counters = out, order, counters
        self.expected: deque[int] = deque()  # line numbers owed a record, input order
        self.held: dict[int, str] = {}
        # Error records are put by the input reader, which an engine may run
        # on its own thread; results are put by the thread driving the engine.
        self.lock = threading.Lock()

    def expect(self, number: int) -> None:
        if self.order is OutputOrder.input:
            with self.lock:
                self.expected.append(number)

    def put(self, number: int, record: dict[str, Any], failed: bool) -> None:
        line = dumps(record)
        with self.lock:
            self.counters.failed += failed
            if self.order is OutputOrder.completed:
                self._write(line)
                return
            self.held[number] = line
            while self.expected and self.expected[0] in self.held:
                self._write(self.held.pop(self.expected.popleft()))

    def release_held(self) -> None:
        """Writes what is held back, in input order, gaps and all."""
        with self.lock:
            for number in sorted(self.held):
                self._write(self.held.pop(number))

    def _write(self, line: str) -> None:
        # Counted first: a Ctrl-C raised as the flush returns must not leave a
        # line on the output that the summary does not count.
        self.counters.written += 1
        self.out.write(line)
        self.out.flush()


def count_lines(inputs: tuple[str, ...]) -> int | None:
    """Non-blank lines over all inputs; None when one is standard input."""
    if "-" in inputs:
        return None
    total = 0
    for path in inputs:
        with open(path, "rb") as f:
            total += sum(1 for line in f if line.strip())
    return total


def read_lines(inputs: tuple[str, ...]) -> Iterator[tuple[LineRef, bytes]]:
    """Non-blank lines, lazily, numbered across inputs (blank lines count)."""
    number = 0
    for path in inputs:
        stream = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
        name = "<stdin>" if path == "-" else path
        try:
            for i, raw in enumerate(stream, start=1):
                number += 1
                if i == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM some editors write
                if raw.strip():
                    yield LineRef(number, f"{name}:{i}"), raw
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()


T = TypeVar("T")


def prefetched(items: Iterator[T]) -> Iterator[T | None]:
    """``items`` drawn on a reader thread; ``None`` whenever nothing new is
    ready yet, which the engine takes as "decode what you hold" (see
    ``Engine.generate``). A pipe whose writer is slow (a producer still
    working, `tail -f`) then never holds back the requests already running.
    An exception in the reader comes out here, where the items are consumed."""
    ready: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def reader() -> None:
        try:
            for item in items:
                ready.put(("item", item))
        except BaseException as exc:  # handed to the consumer, which raises it
            ready.put(("error", exc))
        ready.put(("end", None))

    threading.Thread(target=reader, name="metrale-input", daemon=True).start()
    while True:
        try:
            kind, value = ready.get_nowait()
        except queue.Empty:
            yield None
            continue
        if kind == "end":
            return
        if kind == "error":
            raise value
        yield value


def run(plan: RunPlan, backend: Backend, out: IO[str], console: Console) -> int:
    """Generates every line of ``plan.inputs`` into ``out``; returns the exit status."""
    counters = RunCounters(total=count_lines(plan.inputs))
    writer = Writer(out, plan.order, counters)
    defaults = replace(
        plan.defaults, params=replace(plan.defaults.params, eos_token_ids=backend.eos_token_ids)
    )
    pending: dict[int, ParsedLine] = {}

    def requests() -> Iterator[Request]:
        fallback: LineFormat = "simple"
        for ref, raw in read_lines(plan.inputs):
            parsed = parse_line(ref, raw, defaults, fallback)
            fallback = parsed.format
            if id_key(parsed.output_id) in plan.skip_ids:
                counters.skipped += 1
                continue
            writer.expect(ref.number)
            request = parsed if isinstance(parsed, LineError) else None
            if isinstance(parsed, ParsedLine):
                encoded = encode(parsed, backend.tokenizer, backend.max_len, backend.limit)
                if isinstance(encoded, Request):
                    pending[ref.number] = parsed
                    yield encoded
                    continue
                request = encoded
            assert request is not None
            writer.put(ref.number, error_record(request), failed=True)

    status = EXIT_OK
    started = time.monotonic()
    with live_view(console, backend.stats, counters, plan.progress):
        try:
            # Standard input may be a slow pipe: read it on its own thread.
            source = prefetched(requests()) if "-" in plan.inputs else requests()
            for result in backend.generate(source):
                parsed = pending.pop(int(result.request_id))
                record = result_record(parsed, result, backend.name)
                writer.put(parsed.ref.number, record, failed=result.error is not None)
        except KeyboardInterrupt:
            status = EXIT_INTERRUPTED
        except BrokenPipeError:
            status = EXIT_BROKEN_PIPE
        finally:
            if status != EXIT_BROKEN_PIPE:
                writer.release_held()
    wall_s = time.monotonic() - started
    if plan.stats_json is not None:
        figures = run_figures(backend.stats(), counters, wall_s, backend.name, plan.settings)
        figures["interrupted"] = status == EXIT_INTERRUPTED
        plan.stats_json.parent.mkdir(parents=True, exist_ok=True)
        plan.stats_json.write_bytes(
            orjson.dumps(figures, default=_path_text, option=orjson.OPT_INDENT_2)
        )
    if status == EXIT_INTERRUPTED:
        console.print(f"metrale: interrupted; {counters.written} lines written")
    if status == EXIT_OK and counters.failed:
        status = EXIT_FAILED
    return status


def _path_text(value: object) -> str:
    """orjson's fallback for the settings: paths (``--mtp-head``) as text."""
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def run_figures(
    stats: EngineStats, counters: RunCounters, wall_s: float, model: str, settings: dict[str, Any]
) -> dict[str, Any]:
    """The ``--stats-json`` document. ``prompt_lookup`` counts every copy,
    ``shared_lookup`` the part of them the cross-request cache supplied;
    ``mean_tokens_per_verify`` counts the bonus token. ``forced`` counts the
    grammars' forced drafts; ``grammar`` the constrained requests, the tokens
    they emitted and the time their grammars took, in total and per token;
    ``draft_budget`` what the budget chose and measured (``cli/budget_view.py``;
    null under ``--draft-policy fixed``)."""
    return {
        "model": model,
        "requests": counters.written,
        "failed": counters.failed,
        "skipped": counters.skipped,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "verifies": stats.verifies,
        "seq_verifies": stats.seq_verifies,
        "verify_tokens": stats.verify_tokens,
        "prefills": stats.prefills,
        "mean_tokens_per_verify": stats.mean_tokens_per_verify,
        "wall_s": wall_s,
        "tokens_per_s": stats.generated_tokens / wall_s if wall_s > 0 else 0.0,
        **copy_figures(stats),
        "mtp": {
            "proposed": stats.mtp_proposed,
            "accepted": stats.mtp_accepted,
            "proposed_by_position": list(stats.mtp_proposed_by_position),
            "accepted_by_position": list(stats.mtp_accepted_by_position),
        },
        "window_histogram": {str(k): v for k, v in sorted(stats.window_histogram.items())},
        "forced": {"proposed": stats.forced_proposed, "accepted": stats.forced_accepted},
        "grammar": {
            "requests": stats.grammar_requests,
            "tokens": stats.grammar_tokens,
            "mask_s": stats.grammar_s,
            "mask_us_per_token": stats.grammar_us_per_token,
        },
        "draft_budget": budget_figures(stats.budget),
        "settings": settings,
    }
