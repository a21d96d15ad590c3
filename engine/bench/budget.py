"""Benchmark: the draft budget against every fixed choice of draft sources, same run.

``python -m metrale.engine.bench.budget [WORKLOAD ...]`` (``make bench-budget``)
loads the default model (or ``--model``) once and, per workload (default: the
sample workloads), at batch 1 (the first ``--single`` requests, one at a
time) and at ``--batch`` (the first that many together), times five
configurations taking turns (``take_turns``), ``--repeats`` rounds, after an
untimed warm-up of each:

- no drafts; copies only; MTP only; MTP + copies: the fixed policy (the
  ladder and copy windows, ``--draft-policy fixed``);
- the draft budget over both sources (``--draft-policy auto``, the default).

It prints each one's median tokens/s, which fixed configuration was best
(the highest median), and the budget's ratio to it twice: the ratio of the
two medians, and the median over rounds of the ratio within a round
(``paired``). On a machine whose speed drifts by 10-20% over tens of seconds
(seen on a 2-core Xeon VM: plain decoding of one workload at 158.8 to 208.6
tokens/s in eight runs), the second cancels what the two runs of a round
share, and the first does not; both are printed. Outputs are
greedy and compared token for token with the no-drafts run; a difference is
an error. The budget's calibration is taken (or read from ``METRALE_HOME``)
before anything is timed. Timings are wall clock on a shared machine: read
ratios, not absolute figures. No assertion is made: this prints figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from metrale.engine.api import Request, SamplingParams
from metrale.engine.bench.timing import take_turns
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


def decode(
    loaded: LoadedModel, config: EngineConfig, requests: Sequence[Request], one_at_a_time: bool
) -> tuple[float, dict[str, tuple[int, ...]]]:
    """Seconds and outputs of one run on a fresh engine (calibrated first)."""
    engine = Engine.from_loaded(loaded, config)
    engine.calibrate()
    began = time.perf_counter()
    if one_at_a_time:
        results = [r for request in requests for r in engine.generate([request])]
    else:
        results = list(engine.generate(requests))
    return time.perf_counter() - began, {r.request_id: r.output_ids for r in results}


def bench_workload(
    loaded: LoadedModel, name: str, requests: Sequence[Request], batch: int, repeats: int
) -> dict[str, list[float]]:
    """Tokens/s per configuration, round by round; raises on any output difference."""
    single = batch == 1
    configs = {k: EngineConfig(max_batch=batch, **v) for k, v in CONFIGS.items()}  # type: ignore[arg-type]
    outputs: dict[str, dict[str, tuple[int, ...]]] = {}

    def runner(key: str) -> Callable[[], float]:
        def run() -> float:
            seconds, out = decode(loaded, configs[key], requests, single)
            if out != outputs.setdefault("no drafts", out):
                raise SystemExit(f"{name}, batch {batch}: {key} changed the greedy output")
            return sum(len(ids) for ids in out.values()) / seconds

        return run

    keys = list(configs)
    warmups = [partial(decode, loaded, configs[k], requests[:1], True) for k in keys]
    rounds = take_turns([runner(k) for k in keys], repeats, warmups=warmups)
    return dict(zip(keys, rounds, strict=True))


def summarise(rounds: dict[str, list[float]]) -> tuple[dict[str, float], str, float, float]:
    """Per configuration its median tokens/s; the best fixed one; the budget's
    ratio to it as a ratio of medians, and as the median of the ratios
    within each round (module doc)."""
    rates = {key: statistics.median(values) for key, values in rounds.items()}
    best = max(FIXED, key=lambda k: rates[k])
    paired = statistics.median(a / b for a, b in zip(rounds["auto"], rounds[best], strict=True))
    return rates, best, rates["auto"] / rates[best], paired


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", type=Path)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--single", type=int, default=8, help="requests decoded at batch 1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--batch-one", choices=("yes", "no", "only"), default="yes")
    parser.add_argument(
        "--rounds-json", type=Path, default=None, help="write every round's tokens/s here"
    )
    args = parser.parse_args(argv)
    found: dict[str, dict[str, list[float]]] = {}
    paths = args.workloads or sorted(Path("sample_prompts").glob("*.jsonl"))
    loaded = load_model(args.model, RuntimeConfig(num_slots=args.batch))
    columns = ["workload", "batch", *CONFIGS, "auto / best fixed", "paired", "best fixed"]
    print(f"| {' | '.join(columns)} |")
    print("|" + "---|" * len(columns))
    for path in paths:
        requests = read_requests(path, loaded, args.max_tokens)
        shapes = [(1, requests[: args.single]), (args.batch, requests[: args.batch])]
        if args.batch_one != "yes":
            shapes = shapes[:1] if args.batch_one == "only" else shapes[1:]
        for batch, subset in shapes:
            rounds = bench_workload(loaded, path.stem, subset, batch, args.repeats)
            rates, best, ratio, paired = summarise(rounds)
            cells = [f"{rates[k]:.1f}" for k in CONFIGS]
            print(
                f"| {path.stem} | {batch} | {' | '.join(cells)} | {ratio:.3f}x | {paired:.3f}x "
                f"| {best} |",
                flush=True,
            )
            if args.rounds_json is not None:
                found[f"{path.stem}/{batch}"] = rounds
                args.rounds_json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
