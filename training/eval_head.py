"""Held-out figures of an MTP head (default: the shipped one) on the sample workloads.

Runs each ``sample_prompts/*.jsonl`` workload (none of it is training data)
through the engine with the default model and its shipped head: greedy, prompt
lookup off, MTP chain length 3 at every batch size. Prints, per workload, the
MTP acceptance by chain position (accepted / proposed drafts at that depth;
a depth counts only when every earlier draft was accepted, as the engine
counts it) and mean tokens per verify (which counts the bonus token, so plain
decoding scores 1.0).

Usage: ``python training/eval_head.py [--head PATH] [--max-batch 16] [--json OUT] [FILES...]``
(``--head``: a head written by ``metrale train-mtp`` instead of the shipped one).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, MtpLadder, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import load_model
from metrale.engine.train.data import prompt_ids

WORKLOADS = ("code_edits", "json_rewrites", "doc_qa", "prose")


def requests_of(path: Path, tokenizer: object, eos: tuple[int, ...]) -> list[Request]:
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        record = json.loads(line)
        ids = prompt_ids(record, tokenizer)
        params = SamplingParams(max_tokens=int(record.get("max_tokens", 128)), eos_token_ids=eos)
        out.append(Request(str(record.get("id", number)), ids, params))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--limit", type=int, default=None, help="first N lines of each file")
    parser.add_argument(
        "--head", type=Path, default=None, help="head to measure (default: shipped)"
    )
    args = parser.parse_args()
    files = args.files or [Path("sample_prompts") / f"{w}.jsonl" for w in WORKLOADS]
    loaded = load_model(
        None, RuntimeConfig(num_slots=args.max_batch, max_len=1280, mtp_head=args.head)
    )
    assert loaded.info.mtp_layout == "head", "the default model loaded without an MTP head"
    # The head's own acceptance: every draft of a chain of 3, none held back
    # for low confidence (that is the engine's choice, measured by `bench`).
    config = EngineConfig(
        max_batch=args.max_batch,
        prompt_lookup=None,
        mtp_ladder=MtpLadder(steps=(), beyond=3),
        mtp_min_prob=0.0,
    )
    report = {}
    for path in files:
        engine = Engine.from_loaded(loaded, config)
        started = time.perf_counter()
        requests = requests_of(path, loaded.tokenizer, loaded.eos_token_ids)[: args.limit]
        results = list(engine.generate(requests))
        stats = engine.stats()
        by_position = [
            a / p if p else 0.0
            for a, p in zip(
                stats.mtp_accepted_by_position, stats.mtp_proposed_by_position, strict=True
            )
        ]
        report[path.stem] = {
            "requests": len(results),
            "generated_tokens": stats.generated_tokens,
            "proposed_by_position": list(stats.mtp_proposed_by_position),
            "accepted_by_position": list(stats.mtp_accepted_by_position),
            "acceptance_by_position": [round(x, 4) for x in by_position],
            "mean_tokens_per_verify": round(stats.mean_tokens_per_verify, 3),
            "seq_verifies": stats.seq_verifies,
            "verify_tokens": stats.verify_tokens,
            "seconds": round(time.perf_counter() - started, 1),
        }
        pos = " ".join(f"d{i + 1} {x:.1%}" for i, x in enumerate(by_position))
        print(
            f"{path.stem:<14} acceptance {pos}  tokens/verify {stats.mean_tokens_per_verify:.2f}"
            f"  ({stats.generated_tokens} tokens, {report[path.stem]['seconds']} s)",
            flush=True,
        )
    proposed = [sum(r["proposed_by_position"][i] for r in report.values()) for i in range(3)]
    accepted = [sum(r["accepted_by_position"][i] for r in report.values()) for i in range(3)]
    verifies = sum(r["seq_verifies"] for r in report.values())
    tokens = sum(r["verify_tokens"] for r in report.values())
    overall = " ".join(
        f"d{i + 1} {a / p:.1%}" if p else f"d{i + 1} -"
        for i, (a, p) in enumerate(zip(accepted, proposed, strict=True))
    )
    print(f"{'all':<14} acceptance {overall}  tokens/verify {tokens / max(verifies, 1):.2f}")
    if args.json is not None:
        document = {"head": loaded.info.mtp_head, "workloads": report}
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
