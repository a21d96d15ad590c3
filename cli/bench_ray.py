"""`make bench-ray`: the same job in one process and on a local Ray, in one run.

Contract: the sample prompts (``--prompts`` lines of ``sample_prompts/``,
cycled) go through the default model twice with the same flags: once through
one process's engine (torch's threads: all cores), then through ``--ray local
--ray-workers N`` (the cores shared out between the workers as torch threads).
Printed: tokens, the throughput by the engines' own clocks (model loading
excluded on both sides, as ``metrale generate`` reports it), the wall time
of the whole generation call (on Ray: starting the actors included), and Ray
over one process. The outputs are checked identical (greedy). A benchmark,
not a test: on a shared machine its figures are noisy.

    python -m metrale.cli.bench_ray [--prompts 32] [--max-tokens 64] [--workers 2]
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import replace
from pathlib import Path

from metrale.cli.jsonl import LineDefaults, LineRef, ParsedLine, encode, parse_line
from metrale.cli.ray_backend import RaySettings, open_ray_backend
from metrale.cli.run import Backend
from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig

SAMPLES = Path(__file__).resolve().parent.parent / "sample_prompts"
WORKLOADS = ("code_edits", "prose", "doc_qa", "json_rewrites")


def sample_lines(count: int, max_tokens: int) -> list[ParsedLine]:
    """``count`` parsed lines, taken in turn from the workloads."""
    pools = [(SAMPLES / f"{w}.jsonl").read_bytes().splitlines() for w in WORKLOADS]
    defaults = LineDefaults(params=SamplingParams(max_tokens=max_tokens))
    lines = []
    for i in range(count):
        pool = pools[i % len(pools)]
        raw = pool[(i // len(pools)) % len(pool)]
        parsed = parse_line(LineRef(i + 1, f"sample:{i + 1}"), raw, defaults)
        assert isinstance(parsed, ParsedLine), parsed
        # The workload's own max_tokens would make runs of different lengths.
        lines.append(replace(parsed, params=replace(parsed.params, max_tokens=max_tokens)))
    return lines


def measure(backend: Backend, lines: list[ParsedLine]) -> tuple[dict[str, str], float, float, int]:
    """Texts by request id, engine tok/s, wall seconds of the call, tokens."""
    requests = []
    for line in lines:
        line = replace(line, params=replace(line.params, eos_token_ids=backend.eos_token_ids))
        request = encode(line, backend.tokenizer, backend.max_len)
        assert isinstance(request, Request), request
        requests.append(request)
    started = time.perf_counter()
    texts = {r.request_id: r.text for r in backend.generate(requests)}
    wall_s = time.perf_counter() - started
    stats = backend.stats()
    return texts, stats.tokens_per_s, wall_s, stats.generated_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    from metrale.cli.generate import open_backend

    engine = EngineConfig(max_batch=args.max_batch)
    runtime = RuntimeConfig(num_slots=args.max_batch, max_len=1024)
    lines = sample_lines(args.prompts, args.max_tokens)
    one = open_backend(None, runtime, engine)
    one_texts, one_tps, one_wall, one_tokens = measure(one, lines)
    del one
    gc.collect()
    cluster = open_ray_backend(RaySettings("local", args.workers), None, runtime, engine)
    ray_texts, ray_tps, ray_wall, ray_tokens = measure(cluster, lines)
    assert ray_texts == one_texts, "the Ray run wrote other text than one process"
    print(f"{args.prompts} prompts x {args.max_tokens} tokens, --max-batch {args.max_batch}")
    print(f"{'run':<28} {'tokens':>7} {'engine tok/s':>13} {'call wall s':>12}")
    print(f"{'one process':<28} {one_tokens:>7} {one_tps:>13.1f} {one_wall:>12.2f}")
    name = f"--ray local --ray-workers {args.workers}"
    print(f"{name:<28} {ray_tokens:>7} {ray_tps:>13.1f} {ray_wall:>12.2f}")
    print(
        f"ray / one process: {ray_tps / one_tps:.2f}x by the engines' clocks, "
        f"{one_wall / ray_wall:.2f}x by the wall time of the call (outputs identical)"
    )


if __name__ == "__main__":
    main()
