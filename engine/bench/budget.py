"""Benchmark: the draft budget against every fixed choice of draft sources, same run.

``python -m metrale.engine.bench.budget [WORKLOAD ...]`` (``make bench-budget``)
loads the default model (or ``--model``), once per configuration, and, per
workload (default: the sample workloads), at batch 1 (the first ``--single``
requests, one at a time) and at ``--batch`` (the first that many together),
times five configurations, at least ``--repeats`` rounds at batch 1 and
``--batch-repeats`` at ``--batch`` (a batch row takes a fifth of a batch-1
row's time, and the rounds' drift weighs on its few seconds more), then more
until each configuration of the row ran ``--min-seconds`` in all, at most
``--max-rounds`` (a row of runs of a second or two needs many rounds for a
median that a row of long runs gets from three), after an untimed warm-up
of each:

- no drafts; copies only; MTP only; MTP + copies: the fixed policy (the
  ladder and copy windows, ``--draft-policy fixed``);
- the draft budget over both sources (``--draft-policy auto``, the default).

How they take turns: step by step, in step with the text. Each round
builds a fresh engine per configuration, each on its own loaded copy of the
model (an engine's caches live in the model), and the five run at once: the
one that has written the fewest tokens so far takes the next step (among
those level, who goes first rotates; ``Engine.steps``), and a
configuration's time is the sum of its own steps. Outputs are the same
tokens in every configuration, so all five write the same stretch of text
over the same stretch of wall time. At ``--batch`` an engine decodes the
batch as one run; at batch 1 it decodes the requests in order, one at a
time. The speed of a shared machine drifts over tens of seconds, so
configurations that took turns by whole batches, whole runs or a fixed
number of steps each met stretches of the machine the others never saw;
taking turns by tokens written keeps them side by side to the end.

It prints each one's median tokens/s, which fixed configuration was best
(the highest median), and the budget's ratio to it twice: the ratio of the
two medians, and the median over rounds of the ratio within a round
(``paired``), which cancels what the runs of a round share. With
``--rounds-json PATH``, every round's tokens/s per configuration, by
``workload/batch``, are written there after each row. The table goes to
``--docs`` (section ``## bench-budget``, stamped); with ``--readme PATH``
(``make bench-budget``: the README), a summary of it goes to that file's
``## How fast`` section too: per batch size, the budget's lowest, median and
highest ratio to the best fixed choice over the workloads, and how many
rows are at 0.97x and 1.1x or above (``readme_summary``). Outputs are
greedy and compared token for token with the no-drafts run; a difference is
an error. The budget's calibration is taken (or read from ``METRALE_HOME``)
before anything is timed; all timed sets share it, as every model here has
``--batch`` slots. Timings are wall clock on a shared machine: read
ratios, not absolute figures. No assertion is made: this prints figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from metrale.engine.api import Request, Result, SamplingParams
from metrale.engine.bench.docs_table import stamp, write_section
from metrale.engine.bench.rounds import Rounds, add_round_options
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.prompts import record_prompt_ids

CONFIGS: dict[str, dict[str, object]] = {
    "no drafts": {"mtp": False, "prompt_lookup": None, "draft_policy": "fixed"},
    "copies": {"mtp": False, "draft_policy": "fixed"},
    "MTP": {"prompt_lookup": None, "draft_policy": "fixed"},
    "MTP+copies": {"draft_policy": "fixed"},
    "auto": {"draft_policy": "auto"},
}
FIXED = [name for name in CONFIGS if name != "auto"]
Outputs = dict[str, tuple[int, ...]]  # request id -> output ids


def read_requests(path: Path, loaded: LoadedModel, max_tokens: int | None) -> list[Request]:
    requests = []
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        item = json.loads(line)
        body = item.get("body", item)
        ids = record_prompt_ids(body, loaded.tokenizer)
        assert ids is not None, f"{path}:{n + 1} has no messages or prompt"
        tokens = max_tokens or int(body.get("max_tokens", 128))
        requests.append(Request(str(n), tuple(ids), SamplingParams(max_tokens=tokens)))
    return requests


def warm_up(loaded: LoadedModel, config: EngineConfig, request: Request) -> None:
    """An untimed run of one request on a fresh engine (its calibration taken)."""
    list(Engine.from_loaded(loaded, config).generate([request]))


def step_by_step(
    models: dict[str, LoadedModel],
    configs: dict[str, EngineConfig],
    requests: Sequence[Request],
    one_at_a_time: bool,
    round_: int,
) -> dict[str, tuple[float, Outputs]]:
    """One round (module doc): per configuration, the seconds its engine
    spent in its own steps, and its outputs; the one that has generated the
    fewest tokens steps next. Each configuration runs on its
    own loaded copy of the model (an engine's caches live in the model, and
    here every engine is mid-run at once)."""
    keys = list(configs)
    engines = {key: Engine.from_loaded(models[key], configs[key]) for key in keys}
    for engine in engines.values():
        engine.calibrate()

    def steps(engine: Engine) -> Iterator[list[Result]]:
        if not one_at_a_time:
            return engine.steps(requests)
        return itertools.chain.from_iterable(engine.steps([r]) for r in requests)

    running = {key: steps(engines[key]) for key in keys}
    seconds = dict.fromkeys(keys, 0.0)
    written = dict.fromkeys(keys, 0)  # tokens each has generated so far
    outputs: dict[str, Outputs] = {key: {} for key in keys}
    for turn in itertools.count(round_):
        if not running:
            break
        least = min(written[key] for key in running)
        behind = [key for key in keys if key in running and written[key] == least]
        key = behind[turn % len(behind)]
        began = time.perf_counter()
        results = next(running[key], None)
        seconds[key] += time.perf_counter() - began
        if results is None:
            del running[key]
            continue
        written[key] = engines[key].stats().generated_tokens
        outputs[key].update((r.request_id, r.output_ids) for r in results)
    return {key: (seconds[key], outputs[key]) for key in keys}


def bench_workload(
    models: dict[str, LoadedModel],
    name: str,
    requests: Sequence[Request],
    batch: int,
    repeats: int,
    min_seconds: float = 0.0,
    max_rounds: int = 0,
) -> dict[str, list[float]]:
    """Tokens/s per configuration, round by round: ``repeats`` rounds, then
    more until every configuration ran ``min_seconds`` in all, at most
    ``max_rounds`` (a row of short runs takes more rounds, so that its
    median is as steady as a long row's). Raises on any output difference."""
    configs = {k: EngineConfig(max_batch=batch, **v) for k, v in CONFIGS.items()}  # type: ignore[arg-type]
    expected: dict[str, Outputs] = {}

    def rate(key: str, seconds: float, out: Outputs) -> float:
        if out != expected.setdefault("no drafts", out):
            raise SystemExit(f"{name}, batch {batch}: {key} changed the greedy output")
        return sum(len(ids) for ids in out.values()) / seconds

    for key in configs:  # untimed warm-ups
        warm_up(models[key], configs[key], requests[0])
    by_round: list[dict[str, tuple[float, Outputs]]] = []
    spent = dict.fromkeys(configs, 0.0)
    rounds = Rounds(repeats, max_rounds, min_seconds)
    while rounds.more(len(by_round), spent.values()):
        by_round.append(step_by_step(models, configs, requests, batch == 1, len(by_round)))
        for key, (seconds, _) in by_round[-1].items():
            spent[key] += seconds
    return {key: [rate(key, *measured[key]) for measured in by_round] for key in configs}


@dataclass(frozen=True)
class Summary:
    """A row's figures: ``rates``, each configuration's median tokens/s;
    ``best``, the fixed configuration with the highest; ``ratio``, the
    budget's median over that one's; ``paired``, the median over rounds of
    the budget's tokens/s over that one's in the same round."""

    rates: dict[str, float]
    best: str
    ratio: float
    paired: float
    rounds: int = 0


def summarise(rounds: dict[str, list[float]]) -> Summary:
    """A row's figures from every round's tokens/s per configuration."""
    rates = {key: statistics.median(values) for key, values in rounds.items()}
    best = max(FIXED, key=lambda k: rates[k])
    paired = statistics.median(a / b for a, b in zip(rounds["auto"], rounds[best], strict=True))
    return Summary(rates, best, rates["auto"] / rates[best], paired, len(rounds["auto"]))


Row = tuple[str, int, Summary]  # workload, batch, figures


def bench_paths(
    args: argparse.Namespace,
    paths: Sequence[Path],
    models: dict[str, LoadedModel],
    found: dict[str, dict[str, list[float]]],
) -> list[Row]:
    """Every workload's rows, each printed as it is measured (and kept in
    ``found``)."""
    loaded = models["no drafts"]
    rows: list[Row] = []
    for path in paths:
        requests = read_requests(path, loaded, args.max_tokens)
        shapes = [(1, requests[: args.single]), (args.batch, requests[: args.batch])]
        if args.batch_one != "yes":
            shapes = shapes[:1] if args.batch_one == "only" else shapes[1:]
        for batch, subset in shapes:
            repeats = args.repeats if batch == 1 else args.batch_repeats
            rounds = bench_workload(
                models, path.stem, subset, batch, repeats, args.min_seconds, args.max_rounds
            )
            rows.append((path.stem, batch, summarise(rounds)))
            print(table_lines(rows[-1:])[-1], flush=True)
            if args.rounds_json is not None:
                found[f"{path.stem}/{batch}"] = rounds
                args.rounds_json.write_text(json.dumps(found, indent=1))
    return rows


def table_lines(rows: Sequence[Row]) -> list[str]:
    """The docs table: a header, then one line per row."""
    columns = [
        "workload",
        "batch",
        "rounds",
        *CONFIGS,
        "auto / best fixed",
        "paired",
        "best fixed",
    ]
    lines = [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]
    for name, batch, row in rows:
        cells = " | ".join(f"{row.rates[k]:.1f}" for k in CONFIGS)
        lines.append(
            f"| {name} | {batch} | {row.rounds} | {cells} | {row.ratio:.3f}x "
            f"| {row.paired:.3f}x | {row.best} |"
        )
    return lines


def readme_summary(rows: Sequence[Row]) -> list[str]:
    """The README's summary of a run: per batch size, how the budget's
    ratio to the best fixed choice spreads over the workloads."""
    lines = [
        "| batch | workloads | auto / best fixed: lowest | median | highest "
        "| at 0.97x or above | at 1.1x or above |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in sorted({b for _, b, _ in rows}):
        at = sorted(((row.ratio, name) for name, b, row in rows if b == batch))
        n = len(at)
        (low, low_name), (high, high_name) = at[0], at[-1]
        middle = statistics.median(r for r, _ in at)
        fair = sum(r >= 0.97 for r, _ in at)
        fast = sum(r >= 1.1 for r, _ in at)
        lines.append(
            f"| {batch} | {n} | {low:.3f}x ({low_name}) | {middle:.3f}x "
            f"| {high:.3f}x ({high_name}) | {fair} of {n} | {fast} of {n} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", type=Path)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--single", type=int, default=8, help="requests decoded at batch 1")
    parser.add_argument("--repeats", type=int, default=3, help="rounds at batch 1")
    parser.add_argument("--batch-repeats", type=int, default=5, help="rounds at --batch")
    add_round_options(parser, min_seconds=15.0)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--batch-one", choices=("yes", "no", "only"), default="yes")
    parser.add_argument(
        "--rounds-json", type=Path, default=None, help="write every round's tokens/s here"
    )
    parser.add_argument("--docs", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument(
        "--readme", type=Path, default=None, help="also write its summary into this README"
    )
    args = parser.parse_args(argv)
    found: dict[str, dict[str, list[float]]] = {}
    if args.rounds_json is not None:
        args.rounds_json.parent.mkdir(parents=True, exist_ok=True)
    paths = args.workloads or sorted(Path("sample_prompts").glob("*.jsonl"))
    runtime = RuntimeConfig(num_slots=args.batch)
    models = {key: load_model(args.model, runtime) for key in CONFIGS}
    print("\n".join(table_lines([])))
    rows = bench_paths(args, paths, models, found)
    tokens = (
        f"at most {args.max_tokens} tokens a line" if args.max_tokens else "each line's max_tokens"
    )
    settings = (
        f"At least {args.repeats} rounds at batch 1 (the first {args.single} lines, one at a "
        f"time), {args.batch_repeats} at batch {args.batch} (the first {args.batch} together), "
        f"more until each configuration of a row ran {args.min_seconds:g} s in all, at most "
        f"{max(args.max_rounds, args.repeats, args.batch_repeats)}; {tokens}."
    )
    figures = [stamp(), settings, "\n".join(table_lines(rows))]
    write_section(args.docs, "bench-budget", "\n\n".join(figures))
    if args.readme is not None:
        figures[2] = "\n".join(readme_summary(rows))
        write_section(args.readme, "How fast", "\n\n".join(figures))


if __name__ == "__main__":
    main()
