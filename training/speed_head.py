"""Whether an MTP head pays for its drafts: the engine with MTP against the
same engine without, alternating in one process, on ``sample_prompts/``.

Greedy, prompt lookup on (the default), the default MTP ladder; each
configuration runs twice per workload and the faster run counts. Outputs are
checked identical. Prints generated tokens per second and the ratio (above 1:
the head pays).

Usage: ``python training/speed_head.py [--head PATH] [--batch 1] [--limit 3]``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from eval_head import WORKLOADS, requests_of

from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", type=Path, default=None, help="default: the shipped head")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--limit", type=int, default=3, help="first N lines of each workload")
    args = parser.parse_args()
    runtime = RuntimeConfig(num_slots=args.batch, max_len=1280, mtp_head=args.head)
    loaded = load_model(None, runtime)
    for name in WORKLOADS:
        path = Path("sample_prompts") / f"{name}.jsonl"
        requests = requests_of(path, loaded.tokenizer, loaded.eos_token_ids)
        requests = requests[: max(args.limit, args.batch)]
        best = {False: 0.0, True: 0.0}
        outputs = {}
        for _ in range(2):
            for mtp in (False, True):
                engine = Engine.from_loaded(loaded, EngineConfig(max_batch=args.batch, mtp=mtp))
                started = time.perf_counter()
                results = list(engine.generate(requests))
                seconds = time.perf_counter() - started
                tokens = sum(len(r.output_ids) for r in results)
                best[mtp] = max(best[mtp], tokens / seconds)
                outputs[mtp] = {r.request_id: r.output_ids for r in results}
        if outputs[True] != outputs[False]:
            raise SystemExit(f"{name}: outputs differ with MTP on")
        print(
            f"{name:<14} batch {args.batch}  no MTP {best[False]:6.1f} tok/s"
            f"  MTP {best[True]:6.1f} tok/s  ratio {best[True] / best[False]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
