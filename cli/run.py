"""One `metrale generate` run: input lines through the engine to output lines.

Contract: every non-blank input line gets exactly one output record, written
as soon as it can be (``completed`` order: when its request finishes;
``input`` order: when every earlier line's record is out; ``writer.py``).
Bad lines become error records and never stop the run. Standard output, when
it is the output, carries JSONL only; people read standard error.

Memory does not grow with the input: lines are read as the engine takes
them, standard input through a bounded queue, and under ``input`` order the
reader waits while too many finished records are held back behind a slow
line (``Writer.backed_up``).

Exit status: 0 all lines succeeded, 1 some failed, 74 the output could not be
written (the first failed write stops the run; ``output.py``), 130/143
stopped by SIGINT/SIGTERM (``stop.py``), 141 the reader of standard output
went away. On a stop, records held back for ``input`` order are written
anyway (out of order: losing finished work is worse), and the summary of what
finished is printed with what to run next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from metrale.cli.budget_view import budget_figures
from metrale.cli.jsonl import (
    LineDefaults,
    LineError,
    LineFormat,
    ParsedLine,
    Tokenizer,
    choices,
    encode,
    id_key,
    line_of,
    parse_line,
)
from metrale.cli.live import RunCounters, live_view
from metrale.cli.options import OutputOrder
from metrale.cli.output import LineSink, OutputFailed
from metrale.cli.reader import count_lines, prefetched, read_lines
from metrale.cli.records import copy_figures, error_record, result_record
from metrale.cli.stop import Stopped, stop_status
from metrale.cli.writer import HeldLimit, Writer
from metrale.engine.api import Request, Result
from metrale.engine.stats import EngineStats

EXIT_OK, EXIT_FAILED, EXIT_OUTPUT_FAILED, EXIT_BROKEN_PIPE = 0, 1, 74, 141


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
    # What the backend has to tell people once the run is over (a Ray
    # worker lost on the way), printed after the final view.
    notes: Callable[[], list[str]] = lambda: []


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
    held: HeldLimit = field(default_factory=HeldLimit)


def run(plan: RunPlan, backend: Backend, out: LineSink, console: Console) -> int:
    """Generates every line of ``plan.inputs`` into ``out``; returns the exit status."""
    counters = RunCounters(total=count_lines(plan.inputs))
    writer = Writer(out, plan.order, counters, plan.held)
    defaults = replace(
        plan.defaults, params=replace(plan.defaults.params, eos_token_ids=backend.eos_token_ids)
    )
    # Lines in the engine: each with its choices' results as they finish.
    pending: dict[int, tuple[ParsedLine, list[Result | None]]] = {}

    def requests() -> Iterator[Request | None]:
        fallback: LineFormat = "simple"
        for ref, raw in read_lines(plan.inputs):
            while writer.backed_up():  # the engine decodes on; the slow line is among its own
                yield None
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
                    pending[ref.number] = (parsed, [None] * parsed.n)
                    yield from choices(encoded, parsed.n)
                    continue
                request = encoded
            assert request is not None
            writer.put(ref.number, error_record(request), failed=True)

    status = EXIT_OK
    stopped: KeyboardInterrupt | None = None
    failure: OutputFailed | None = None
    started = time.monotonic()
    with live_view(console, backend.stats, counters, plan.progress):
        try:
            # Standard input may be a slow pipe: read it on its own thread.
            source = prefetched(requests()) if "-" in plan.inputs else requests()
            for result in backend.generate(source):
                number, choice = line_of(result.request_id)
                parsed, results = pending[number]
                results[choice] = result
                if any(r is None for r in results):
                    continue
                del pending[number]
                done = [r for r in results if r is not None]
                record = result_record(parsed, done, backend.name)
                writer.put(number, record, failed=any(r.error is not None for r in done))
        except KeyboardInterrupt as exc:
            stopped, status = exc, stop_status(exc)
        except BrokenPipeError:
            status = EXIT_BROKEN_PIPE
        except OutputFailed as exc:
            failure = exc
        finally:
            if failure is None and status != EXIT_BROKEN_PIPE:
                try:
                    writer.release_held()
                except OutputFailed as exc:
                    failure = exc
                except BrokenPipeError:
                    status = EXIT_BROKEN_PIPE
    wall_s = time.monotonic() - started
    for note in backend.notes():
        console.print(f"metrale: {note}")
    where = plan.output or "standard output"
    if plan.stats_json is not None:
        figures = run_figures(backend.stats(), counters, wall_s, backend.name, plan.settings)
        figures["interrupted"] = stopped is not None
        try:
            plan.stats_json.parent.mkdir(parents=True, exist_ok=True)
            plan.stats_json.write_bytes(
                orjson.dumps(figures, default=_path_text, option=orjson.OPT_INDENT_2)
            )
        except OSError as exc:
            console.print(f"metrale: cannot write --stats-json {plan.stats_json}: {exc}")
            status = EXIT_OUTPUT_FAILED if status == EXIT_OK else status
    if failure is not None:
        last = "the last one whole" if failure.whole else "the last one may be cut off"
        console.print(
            f"metrale: {failure}; stopped with {counters.written} lines written, {last}. "
            f"Free some space (or mend the device), then {_next_run(plan)}"
        )
        return EXIT_OUTPUT_FAILED
    if stopped is not None:
        console.print(
            f"metrale: {_stop_text(stopped)}; {counters.written} lines written to {where}. "
            f"To answer the rest, {_next_run(plan)}"
        )
    if status == EXIT_OK and counters.failed:
        status = EXIT_FAILED
    return status


def _stop_text(exc: KeyboardInterrupt) -> str:
    if isinstance(exc, Stopped) and exc.name != "SIGINT":
        return f"stopped by {exc.name}"
    return "interrupted"


def _next_run(plan: RunPlan) -> str:
    """What to run to answer the lines this run did not."""
    if plan.output is not None:
        return "run the same command again with --resume."
    return (
        "run it again with -o FILE --resume, FILE holding what standard output received "
        "(--resume repairs a line cut off at its end)."
    )


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
    ``prefix_cache`` the requests that reused a cached prompt prefix and
    the prompt tokens they did not prefill; ``draft_budget`` what the budget chose and measured (``cli/budget_view.py``;
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
        "prefix_cache": {
            "on": stats.prefix_cache,
            "requests": stats.admitted,
            "hits": stats.prefix_hits,
            "hit_rate": stats.prefix_hit_rate,
            "cached_tokens": stats.cached_tokens,
            "prefilled_tokens": stats.prompt_tokens - stats.cached_tokens,
        },
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
