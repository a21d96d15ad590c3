"""`make bench-cli`: whole `metrale generate` processes, the draft budget against every fixed choice.

Contract: what is timed is what a user waits for. Each run is one fresh
``metrale generate`` process (the console script beside this interpreter),
from spawn to exit, model loading included, on the first ``--prompts`` lines
of a workload (their ``max_tokens`` replaced by ``--max-tokens`` when given),
at ``--max-batch`` 1 and 16. Five configurations:

- no drafts; copies only; MTP only; MTP + copies: the fixed policy
  (``--draft-policy fixed`` with ``--no-mtp`` / ``--no-prompt-lookup``);
- the draft budget over both sources (``--draft-policy auto``, the default).

Per workload and batch, every round runs each configuration once, in an order
rotated by one each round, so that no configuration always runs first after
another's exit, nor always meets the same stretch of a shared machine's
drift. After ``--rounds`` rounds a row takes more (``more_rounds``) until
each configuration has run ``--min-seconds`` in all, up to ``--max-rounds``:
a short run's process time is mostly start-up, whose spread would
otherwise decide its row. Before the first row at a batch size, each configuration runs once
untimed on one line, as a user's earlier runs would have: kernels built, the
budget's calibration stored in ``METRALE_HOME``, the weights in the page
cache. ``METRALE_*`` option variables of the caller's environment are
dropped, so each configuration is exactly its flags.

Per row it prints each configuration's median process seconds and median
tokens/s of generation (``tokens_per_s`` of its ``--stats-json``, whose clock
starts after loading), the fixed configuration with the most tokens per
process-second (``best fixed``), and the budget's ratio to it twice: the ratio
of the two medians of tokens per process-second, and the median over rounds of
that ratio within a round (``paired``). Outputs are greedy, and every run's
text per id must equal the first run's: a difference is an error. The table
goes to ``--docs`` (section ``## bench-cli``, stamped), ``--rounds-json``
keeps every run. Wall clock on a shared machine: read ratios, not absolutes.

    python -m metrale.cli.bench_runs [WORKLOAD.jsonl ...] [--rounds 3]
        [--min-seconds 60] [--max-rounds 12] [--batches 1,16] [--max-tokens M]
        [--prompts 16] [--docs PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from metrale.engine.bench.docs_table import stamp, write_section
from metrale.engine.bench.rounds import Rounds as RoundsRule
from metrale.engine.bench.rounds import add_round_options

REPO = Path(__file__).resolve().parent.parent
HELD_OUT = ("short_answers", "log_summaries", "chat_tasks", "code_gen")
CONFIGS: dict[str, tuple[str, ...]] = {
    "no drafts": ("--draft-policy", "fixed", "--no-mtp", "--no-prompt-lookup"),
    "copies": ("--draft-policy", "fixed", "--no-mtp"),
    "MTP": ("--draft-policy", "fixed", "--no-prompt-lookup"),
    "MTP+copies": ("--draft-policy", "fixed"),
    "auto": ("--draft-policy", "auto"),
}
FIXED = [name for name in CONFIGS if name != "auto"]
# Not options of `generate`: where caches live, and the kernel switch.
KEPT_ENV = {"METRALE_HOME", "METRALE_NO_KERNEL"}
HEADING = "bench-cli"
DESCRIPTION = """\
Whole `metrale generate` processes, as a user runs them: the draft budget
(`--draft-policy auto`) against four fixed configurations (no drafts, copies
only, MTP only, MTP + copies, all `--draft-policy fixed`), at `--max-batch` 1
and 16, one fresh process per configuration and run, model loading included,
on held-out sets nothing was tuned on, short answers among them: there a run
lasts seconds and what the budget spends finding its feet weighs most. Greedy,
outputs checked identical. Each round runs every configuration once, the order
rotated by one each round, after one untimed run of each; a row runs more
rounds until each configuration ran a minute in all (its "rounds" column),
since a short run's process time is mostly start-up. A configuration's
cell: median seconds of the process, then median tokens/s of generation as
its `--stats-json` reports it (clock started after loading). "auto / best
fixed" is the ratio of median tokens per process-second against the fixed
configuration with the most; "paired" the median over rounds of that ratio
within a round."""


@dataclass(frozen=True)
class Run:
    """One process: ``process_s``, wall seconds from spawn to exit (loading
    included); ``tokens``, the tokens it generated; ``tok_s``, its own
    tokens/s of generation (``--stats-json`` ``tokens_per_s``)."""

    process_s: float
    tokens: int
    tok_s: float

    @property
    def rate(self) -> float:
        """Tokens per second of the whole process: what the user gets."""
        return self.tokens / self.process_s


@dataclass(frozen=True)
class Summary:
    """A row: each configuration's median ``process_s`` and ``tok_s``;
    ``best``, the fixed configuration with the highest median ``rate``;
    ``ratio``, the budget's median rate over that one's; ``paired``, the
    median over rounds of the budget's rate over that one's in the same round."""

    process_s: dict[str, float]
    tok_s: dict[str, float]
    best: str
    ratio: float
    paired: float
    rounds: int


def summarise(rounds: dict[str, list[Run]]) -> Summary:
    """A row's figures from every round's run per configuration
    (``rounds[key][r]``: configuration ``key``'s run in round ``r``)."""
    rates = {key: statistics.median(run.rate for run in runs) for key, runs in rounds.items()}
    best = max(FIXED, key=lambda key: rates[key])
    paired = statistics.median(
        a.rate / b.rate for a, b in zip(rounds["auto"], rounds[best], strict=True)
    )
    return Summary(
        process_s={
            key: statistics.median(r.process_s for r in runs) for key, runs in rounds.items()
        },
        tok_s={key: statistics.median(r.tok_s for r in runs) for key, runs in rounds.items()},
        best=best,
        ratio=rates["auto"] / rates[best],
        paired=paired,
        rounds=len(rounds["auto"]),
    )


def rotated(keys: Sequence[str], round_: int) -> list[str]:
    """The order of round ``round_``: ``keys`` turned left by ``round_``
    (``rotated("abc", 1) == ["b", "c", "a"]``)."""
    turn = round_ % len(keys)
    return [*keys[turn:], *keys[:turn]]


def capped(line: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """``line`` (simple or OpenAI Batch) asking for ``max_tokens``: a line's
    own limit outranks the ``--max-tokens`` flag, so the limit is written into
    the line (``max_completion_tokens`` where a batch body names it)."""
    if "body" not in line:
        return {**line, "max_tokens": max_tokens}
    body = dict(line["body"])
    body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = max_tokens
    return {**line, "body": body}


def read_lines(path: Path, prompts: int, max_tokens: int | None) -> list[dict[str, Any]]:
    """The first ``prompts`` lines of the workload at ``path``, capped."""
    lines = [json.loads(text) for text in path.read_text().splitlines() if text.strip()]
    lines = lines[:prompts]
    return [capped(line, max_tokens) for line in lines] if max_tokens else lines


def record_text(record: dict[str, Any]) -> tuple[str, str]:
    """An output record's (id, text); raises ``SystemExit`` on a failed line."""
    if "custom_id" in record:
        response = record.get("response") or {}
        if record.get("error") is not None or response.get("status_code") != 200:
            raise SystemExit(f"line {record['custom_id']} failed: {record}")
        choice = response["body"]["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return str(record["custom_id"]), text
    if record.get("finish_reason") == "error":
        raise SystemExit(f"line {record.get('id')} failed: {record.get('error')}")
    if "choices" in record:  # n > 1: every choice's text, in order
        return str(record["id"]), json.dumps([c["text"] for c in record["choices"]])
    return str(record["id"]), record["text"]


def metrale_command() -> list[str]:
    """The console script beside this interpreter (the command a user runs),
    else the same app through this interpreter."""
    script = Path(sys.executable).with_name("metrale")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from metrale.cli.main import app; app()"]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("METRALE_") or k in KEPT_ENV}


def run_once(argv: list[str], work: Path) -> tuple[Run, dict[str, str]]:
    """One ``generate`` process writing into ``work``: its run and texts by id."""
    output, stats = work / "out.jsonl", work / "stats.json"
    output.unlink(missing_ok=True)
    command = [*argv, "-o", str(output), "--stats-json", str(stats), "--progress", "off"]
    started = time.perf_counter()
    done = subprocess.run(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    process_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    figures = json.loads(stats.read_text())
    texts = dict(record_text(json.loads(t)) for t in output.read_text().splitlines() if t.strip())
    return Run(process_s, int(figures["generated_tokens"]), float(figures["tokens_per_s"])), texts


@dataclass(frozen=True)
class Job:
    """What every process of a row shares: the command up to the flags of a
    configuration (input file and ``--max-batch`` included) and a scratch
    folder."""

    argv: list[str]
    work: Path

    def run(self, key: str) -> tuple[Run, dict[str, str]]:
        return run_once([*self.argv, *CONFIGS[key]], self.work)


class Rounds(RoundsRule):
    """How many rounds a row runs (module doc, ``engine/bench/rounds.py``)."""

    def more_rounds(self, runs: dict[str, list[Run]]) -> bool:
        """Whether a row that ran ``runs`` so far takes another round."""
        spent = [sum(run.process_s for run in row) for row in runs.values()]
        return self.more(len(runs["auto"]), spent)


def bench_row(job: Job, name: str, rounds: Rounds) -> dict[str, list[Run]]:
    """Every round's run per configuration; raises on any output difference."""
    runs: dict[str, list[Run]] = {key: [] for key in CONFIGS}
    expected: dict[str, str] | None = None
    round_ = 0
    while rounds.more_rounds(runs):
        round_ += 1
        for key in rotated(list(CONFIGS), round_ - 1):
            run, texts = job.run(key)
            expected = texts if expected is None else expected
            if texts != expected:
                differ = sorted(
                    k for k in expected.keys() | texts.keys() if texts.get(k) != expected.get(k)
                )
                raise SystemExit(f"{name}: {key} wrote other text for ids {differ[:5]}")
            runs[key].append(run)
    return runs


def table_lines(rows: list[tuple[str, int, Summary]]) -> list[str]:
    columns = ["workload", "batch", "rounds", *CONFIGS, "auto / best fixed", "paired", "best fixed"]
    lines = [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]
    for name, batch, row in rows:
        cells = [f"{row.process_s[k]:.2f} s, {row.tok_s[k]:.1f}" for k in CONFIGS]
        lines.append(
            f"| {name} | {batch} | {row.rounds} | {' | '.join(cells)} | {row.ratio:.3f}x "
            f"| {row.paired:.3f}x | {row.best} |"
        )
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", type=Path, help="default: the held-out sets")
    parser.add_argument("--rounds", type=int, default=3, help="the fewest rounds of a row")
    add_round_options(parser, min_seconds=60.0)
    parser.add_argument("--batches", default="1,16", help="--max-batch values, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: each line's own")
    parser.add_argument("--prompts", type=int, default=16, help="first lines of each workload")
    parser.add_argument("--model", default=None, help="--model of every run (default: embedded)")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--rounds-json", type=Path, default=None, help="write every run here")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.rounds < 1 or args.prompts < 1 or min(args.batches) < 1:
        parser.error("--rounds, --prompts and every --batches value must be at least 1")
    if args.max_rounds < args.rounds:
        parser.error("--max-rounds must be at least --rounds")
    return args


def warm_up(base: list[str], line: dict[str, Any], batch: int, work: Path) -> None:
    """One untimed run of each configuration on ``line``, 4 tokens (module doc)."""
    inputs = work / "warm-up.jsonl"
    inputs.write_text(json.dumps(capped(line, 4)) + "\n")
    for key in CONFIGS:
        Job([*base, str(inputs), "--max-batch", str(batch)], work).run(key)


def run_rows(
    args: argparse.Namespace,
    paths: Sequence[Path],
    base: list[str],
    rows: list[tuple[str, int, Summary]],
    found: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    """Every row, its runs into ``rows`` and ``found`` (``main``)."""
    warmed: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as scratch:
        work = Path(scratch)
        for path in paths:
            lines = read_lines(path, args.prompts, args.max_tokens)
            inputs = work / f"{path.stem}.jsonl"
            inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
            for batch in args.batches:
                if args.warm_up and batch not in warmed:
                    warm_up(base, lines[0], batch, work)
                    warmed.add(batch)
                job = Job([*base, str(inputs), "--max-batch", str(batch)], work)
                rounds = Rounds(args.rounds, args.max_rounds, args.min_seconds)
                runs = bench_row(job, f"{path.stem}, batch {batch}", rounds)
                rows.append((path.stem, batch, summarise(runs)))
                print(table_lines(rows[-1:])[-1], flush=True)
                if args.rounds_json is not None:
                    found[f"{path.stem}/{batch}"] = {
                        k: [asdict(r) for r in v] for k, v in runs.items()
                    }
                    args.rounds_json.parent.mkdir(parents=True, exist_ok=True)
                    args.rounds_json.write_text(json.dumps(found, indent=1))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    paths = args.workloads or [REPO / "bench_prompts" / f"{name}.jsonl" for name in HELD_OUT]
    base = [*metrale_command(), "generate", *(["--model", args.model] if args.model else [])]
    rows: list[tuple[str, int, Summary]] = []
    found: dict[str, dict[str, list[dict[str, Any]]]] = {}
    print("\n".join(table_lines([])), flush=True)
    run_rows(args, paths, base, rows, found)
    tokens = f"{args.max_tokens} tokens" if args.max_tokens else "each line's max_tokens"
    settings = (
        f"At least {args.rounds} rounds a row, more until each configuration ran "
        f"{args.min_seconds:g} s in all, at most {args.max_rounds}; the first "
        f"{args.prompts} lines of each set; {tokens}."
    )
    body = "\n\n".join([stamp(), settings, "\n".join(table_lines(rows))])
    write_section(args.docs, HEADING, body, DESCRIPTION)
    print(f"written to {args.docs} (## {HEADING})")


if __name__ == "__main__":
    main()
