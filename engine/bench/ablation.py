"""Benchmark: what each mechanism of the draft budget earns, by ablation.

``python -m metrale.engine.bench.ablation [WORKLOAD ...]``
(``make bench-ablation``) runs the draft budget (``--draft-policy auto``)
whole, and once with each mechanism of ``spec/budget.py``'s ``MECHANISMS``
turned off, in the same run, taking turns step by step as ``budget.py``'s
bench does (the configuration that has written the fewest tokens steps
next), at batch 1 (the first ``--single`` requests, one at a time) and at
``--batch`` together. Outputs are greedy and checked identical to the whole
budget's.

Per row it prints the whole budget's median tokens/s and, per mechanism,
the median over rounds of the whole budget's tokens/s over the ablated one's
in the same round: above 1, removing the mechanism cost that much; below 1,
the run was faster without it. A mechanism earns its keep where removing it
costs more than 2% on some row. The table goes to the ``bench-ablation``
section of ``docs/benchmarks.md``, stamped. Timings are wall clock on a
shared machine: read ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path

from metrale.engine.api import Request, SamplingParams
from metrale.engine.bench.budget import read_requests, step_by_step, warm_up
from metrale.engine.bench.docs_table import stamp, write_section
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.spec.budget import MECHANISMS

Rounds = dict[str, list[float]]  # configuration -> tokens/s per round


def configurations(mechanisms: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``"auto"`` whole, then ``"-name"`` for each mechanism turned off."""
    return {"auto": (), **{f"-{m}": (m,) for m in mechanisms}}


def bench_row(
    models: dict[str, LoadedModel],
    ablations: dict[str, tuple[str, ...]],
    name: str,
    requests: Sequence[Request],
    batch: int,
    repeats: int,
) -> Rounds:
    """Tokens/s per configuration, round by round; raises on any output
    difference."""
    configs = {
        key: EngineConfig(max_batch=batch, draft_policy="auto", budget_ablation=without)
        for key, without in ablations.items()
    }
    for key in configs:  # untimed warm-ups, calibration included
        warm_up(models[key], configs[key], requests[0])
    rounds: Rounds = {key: [] for key in configs}
    for r in range(repeats):
        measured = step_by_step(models, configs, requests, batch == 1, r)
        expected = measured["auto"][1]
        for key, (seconds, outputs) in measured.items():
            if outputs != expected:
                raise SystemExit(f"{name}, batch {batch}: {key} changed the greedy output")
            rounds[key].append(sum(len(ids) for ids in outputs.values()) / seconds)
    return rounds


def paired(rounds: Rounds, key: str) -> float:
    """The median over rounds of the whole budget's tokens/s over ``key``'s."""
    return statistics.median(a / b for a, b in zip(rounds["auto"], rounds[key], strict=True))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", type=Path)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--single", type=int, default=4, help="requests decoded at batch 1")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per row")
    parser.add_argument("--max-tokens", type=int, default=96, help="cap on each line's own")
    parser.add_argument("--batches", default="1,16", help="1 and/or --batch, comma-separated")
    parser.add_argument("--mechanisms", default=",".join(sorted(MECHANISMS)))
    parser.add_argument("--docs", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args(argv)
    mechanisms = [m for m in args.mechanisms.split(",") if m]
    ablations = configurations(mechanisms)
    paths = args.workloads or sorted(Path("bench_prompts").glob("*.jsonl"))
    models = {key: load_model(args.model, RuntimeConfig(num_slots=args.batch)) for key in ablations}
    columns = ["workload", "batch", "auto tok/s", *(f"without {m}" for m in mechanisms)]
    table = [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]
    print("\n".join(table), flush=True)
    _ablate(args, paths, models, ablations, table)
    settings = (
        f"{args.repeats} rounds; at most {args.max_tokens} tokens a line; "
        f"batch 1: the first {args.single} lines one at a time; "
        f"batch {args.batch}: the first {args.batch} together. A cell: the whole budget's "
        "tokens/s over the budget's without that mechanism, median over rounds."
    )
    write_section(args.docs, "bench-ablation", f"{stamp()}\n\n{settings}\n\n" + "\n".join(table))


def _ablate(
    args: argparse.Namespace,
    paths: Sequence[Path],
    models: dict[str, LoadedModel],
    ablations: dict[str, tuple[str, ...]],
    table: list[str],
) -> None:
    """Every row into ``table``, each printed as it is measured."""
    mechanisms = [key[1:] for key in ablations if key != "auto"]
    for path in paths:
        requests = [
            dataclasses.replace(r, params=SamplingParams(max_tokens=min(r.params.max_tokens, cap)))
            for r in read_requests(path, models["auto"], None)
            for cap in [args.max_tokens]
        ]
        for batch in (int(b) for b in args.batches.split(",")):
            subset = requests[: args.single] if batch == 1 else requests[:batch]
            rounds = bench_row(models, ablations, path.stem, subset, batch, args.repeats)
            cells = [f"{paired(rounds, f'-{m}'):.3f}x" for m in mechanisms]
            auto = statistics.median(rounds["auto"])
            table.append(f"| {path.stem} | {batch} | {auto:.1f} | {' | '.join(cells)} |")
            print(table[-1], flush=True)


if __name__ == "__main__":
    main()
