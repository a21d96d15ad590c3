"""`make bench-prefix`: whole `metrale generate` processes, the prefix cache and `n` against prefilling every line.

Contract: what is timed is what a user waits for, one fresh ``metrale
generate`` process per run (``bench_runs.run_once``), model loading
included, on the embedded default model unless ``--model`` names another.
Two jobs, each written here from text nothing was tuned on:

- *shared system prompt*: 16 chat lines whose system message is the same
  document of ``--system-tokens`` tokens (the project's own ``docs/``, cut
  by the model's tokenizer) and whose user messages are 16 short questions
  about it; greedy, ``--answer-tokens`` each. With the cache (the default)
  against ``--no-prefix-cache``.
- *RL rollouts*: 4 prompts (a ``--rollout-tokens``-token passage each, and a
  task) sampled ``n=8`` times each at temperature 0.8 with a seed, against
  the same 4 prompts written as 32 separate lines (seeds ``s..s+7``) under
  ``--no-prefix-cache``, the way a job had to run before ``n``.

Each configuration runs once untimed (kernels built, weights in the page
cache), then the timed ones once per round, in an order rotated by one each
round. Per row: each timed configuration's median process seconds and the
ratio of the baseline's median to the cache's. Outputs must match where
they are the same draws (a difference is an error): the greedy lines with
and without the cache, and the ``n=8`` lines with and without it (run
untimed only: it differs from the 32 lines in nothing but the cache); the 32
separate lines are other draws of the same distributions. The table goes to
``--docs`` (section ``## bench-prefix``, stamped).

    python -m metrale.cli.bench_prefix [--rounds 3] [--model M] [--docs PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.cli.bench_runs import metrale_command, rotated, run_once
from metrale.engine.bench.docs_table import stamp, write_section

REPO = Path(__file__).resolve().parent.parent
HEADING = "bench-prefix"
DESCRIPTION = """\
Whole `metrale generate` processes on the default model, model loading
included: the prefix cache against `--no-prefix-cache` on 16 chat lines that
share a long system prompt (a document from `docs/`) and ask short questions
about it, greedy, outputs checked identical; and an RL-style job, 4 prompts
sampled `n=8` times each, against the same prompts as 32 separate lines
without the cache. Each round runs every configuration once, the order
rotated each round, after one untimed run of each. Cells: median seconds of
the process; "speed-up" is the baseline's median over the cache's."""
QUESTIONS = (
    "Which exit status means the output could not be written?",
    "What happens to a line that is not JSON?",
    "Name one field a batch line must have.",
    "How does a run continue after it was stopped?",
    "What does the simple format call its prompt field?",
    "Which signal stops a run gracefully?",
    "Where do error records go?",
    "Can two inputs be given at once?",
    "What is written when a line is too long?",
    "Does a bad line stop the run?",
    "How are ids of batch records formed?",
    "What does --resume skip?",
    "Which endpoints does the batch format accept?",
    "What does finish_reason length mean?",
    "Is standard output ever mixed with messages?",
    "What does metadata do in a simple line?",
)
TASKS = (
    "List the three most important facts above, one per line.",
    "Write a one-sentence summary of the passage above.",
    "Ask one question a new user would have after reading the passage.",
    "Rewrite the first sentence of the passage more simply.",
)
DOCS = ("reliability.md", "formats.md", "ray.md", "models.md")


@dataclass(frozen=True)
class Row:
    """One job: each configuration's median process seconds; ``speedup``,
    the baseline's median over the cache's (the first and last keys)."""

    job: str
    prompt_tokens: int
    seconds: dict[str, float]

    @property
    def speedup(self) -> float:
        keys = list(self.seconds)
        return self.seconds[keys[-1]] / self.seconds[keys[0]]


def cut(text: str, tokens: int, tokenizer: Any) -> str:
    """The longest whole-word start of ``text`` within ``tokens`` tokens."""
    words = text.split()
    low, high = 0, len(words)
    while low < high:
        mid = (low + high + 1) // 2
        if len(tokenizer.encode(" ".join(words[:mid]))) <= tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def default_tokenizer(model: str | None) -> Any:
    """The tokenizer of ``--model`` (a local folder) or of the embedded model."""
    from metrale.engine.load.default_model import default_model_dir
    from metrale.engine.load.fast_tokenizer import read_tokenizer

    folder = Path(model) if model else default_model_dir()
    tokenizer = read_tokenizer(folder)
    if tokenizer is None:
        raise SystemExit(f"no tokenizer.json in {folder}")
    return tokenizer


def shared_prompt_lines(document: str, answer_tokens: int) -> list[dict[str, Any]]:
    system = f"Answer from this document only, in one short sentence.\n\n{document}"
    return [
        {
            "id": f"q{i}",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": answer_tokens,
        }
        for i, question in enumerate(QUESTIONS)
    ]


def rollout_lines(passages: Sequence[str], tokens: int, n: int, seed: int) -> list[dict[str, Any]]:
    """The 4 prompts as lines asking ``n`` choices each; ``n == 1`` writes
    every choice as its own line, seeds ``seed..seed+7`` per prompt."""
    lines = []
    for i, (passage, task) in enumerate(zip(passages, TASKS, strict=True)):
        prompt = {"messages": [{"role": "user", "content": f"{passage}\n\n{task}"}]}
        common = {**prompt, "max_tokens": tokens, "temperature": 0.8}
        if n > 1:
            lines.append({"id": f"p{i}", **common, "n": n, "seed": seed + 100 * i})
        else:
            lines += [{"id": f"p{i}-{k}", **common, "seed": seed + 100 * i + k} for k in range(8)]
    return lines


def bench_job(
    base: list[str],
    configs: dict[str, tuple[Path, tuple[str, ...]]],
    work: Path,
    rounds: int,
    timed: Sequence[str],
) -> dict[str, float]:
    """Median process seconds of each ``timed`` configuration (``configs``:
    its input and flags, the cache's first). Every configuration runs once
    untimed first (kernels built, weights in the page cache), and each run of
    a configuration on the first one's input must write the first one's text."""
    keys = list(configs)
    expected: list[dict[str, str]] = []

    def run(key: str) -> float:
        inputs, flags = configs[key]
        done, got = run_once([*base, str(inputs), *flags], work)
        if inputs == configs[keys[0]][0]:
            expected[:] = expected or [got]
            if got != expected[0]:
                raise SystemExit(f"{key} wrote other text than {keys[0]}")
        return done.process_s

    for key in keys:
        run(key)
    seconds: dict[str, list[float]] = {key: [] for key in timed}
    for round_ in range(rounds):
        for key in rotated(list(timed), round_):
            seconds[key].append(run(key))
            print(f"  {key}: {seconds[key][-1]:.2f} s", flush=True)
    return {key: statistics.median(values) for key, values in seconds.items()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="--model of every run (default: embedded)")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--rollout-tokens", type=int, default=1000, help="each RL prompt's passage")
    parser.add_argument("--rollout-output", type=int, default=32, help="tokens per rollout")
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = default_tokenizer(args.model)
    base = [*metrale_command(), "generate", *(["--model", args.model] if args.model else [])]
    base += ["--order", "input"]
    documents = [(REPO / "docs" / name).read_text() for name in DOCS]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as scratch:
        work = Path(scratch)

        def write(name: str, lines: list[dict[str, Any]]) -> Path:
            path = work / name
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            return path

        system = cut(documents[0], args.system_tokens, tokenizer)
        shared = write("shared.jsonl", shared_prompt_lines(system, args.answer_tokens))
        print(f"shared system prompt ({args.system_tokens} tokens), 16 lines:", flush=True)
        seconds = bench_job(
            base,
            {"cache": (shared, ()), "no cache": (shared, ("--no-prefix-cache",))},
            work,
            args.rounds,
            timed=("cache", "no cache"),
        )
        rows.append(Row("16 lines, shared system prompt", args.system_tokens, seconds))
        passages = [cut(doc, args.rollout_tokens, tokenizer) for doc in documents]
        forked = write("n8.jsonl", rollout_lines(passages, args.rollout_output, 8, 7))
        apart = write("lines32.jsonl", rollout_lines(passages, args.rollout_output, 1, 7))
        print(f"RL rollouts, 4 prompts ({args.rollout_tokens} tokens) x 8:", flush=True)
        seconds = bench_job(
            base,
            {
                "n=8, cache": (forked, ()),
                "n=8, no cache": (forked, ("--no-prefix-cache",)),
                "32 lines, no cache": (apart, ("--no-prefix-cache",)),
            },
            work,
            args.rounds,
            timed=("n=8, cache", "32 lines, no cache"),
        )
        rows.append(Row("4 prompts x n=8 sampled", args.rollout_tokens, seconds))
    lines = ["| job | prompt tokens | cache | without | speed-up |", "|---|---|---|---|---|"]
    for row in rows:
        keys = list(row.seconds)
        without = ", ".join(f"{k}: {row.seconds[k]:.2f} s" for k in keys[1:])
        lines.append(
            f"| {row.job} | {row.prompt_tokens} | {row.seconds[keys[0]]:.2f} s | {without} "
            f"| {row.speedup:.2f}x |"
        )
    settings = (
        f"{args.rounds} rounds; answers {args.answer_tokens} tokens (greedy); rollouts "
        f"{args.rollout_output} tokens at temperature 0.8; --max-batch 16 (the default)."
    )
    body = "\n\n".join([stamp(), settings, "\n".join(lines)])
    print("\n".join(lines))
    write_section(args.docs, HEADING, body, DESCRIPTION)
    print(f"written to {args.docs} (## {HEADING})")


if __name__ == "__main__":
    main()
