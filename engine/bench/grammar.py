"""Benchmark: structured outputs with and without drafts, against unconstrained.

``python -m metrale.engine.bench.grammar`` loads the default model (or
``--model``) once and runs the Batch lines of ``--workload`` (default
``sample_prompts/json_extract.jsonl``: extraction and classification with a
JSON schema each), greedy, at batch 1 and at batch 16, in five set-ups:

- ``unconstrained``: the same prompts without their schemas, MTP and copies on;
- ``constrained, no drafts``: every token its own verify;
- ``constrained, forced only``: the grammar's forced tokens drafted, nothing else;
- ``constrained, MTP + copies``: MTP drafts and copies checked against the
  grammar, forced tokens not drafted;
- ``constrained, all``: forced drafts, then MTP drafts or copies (the default).

For each it prints tokens/s, mean tokens per verify (counting the bonus
token) and the grammar's time per constrained token, and the ratios the
issue set targets for: tokens per verify of ``all`` over ``no drafts`` and
tokens/s of ``all`` over ``unconstrained``. It also checks that the
constrained outputs are identical in every set-up, and times llguidance
alone per token along those outputs (one mask, the forced tokens, one
consume). Each figure is the best of ``--repeats`` runs after a warm-up, the
set-ups taking turns (``take_turns``). No assertion is made.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

from metrale.engine.api import Grammar, Request, SamplingParams
from metrale.engine.bench.timing import take_turns
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.prompts import chat_prompt_ids
from metrale.engine.spec.grammar import GrammarCompiler, json_schema_grammar

WORKLOAD = Path(__file__).resolve().parents[2] / "sample_prompts" / "json_extract.jsonl"
SETUPS: dict[str, tuple[bool, EngineConfig]] = {
    "unconstrained": (False, EngineConfig()),
    "constrained, no drafts": (
        True,
        EngineConfig(mtp=False, prompt_lookup=None, forced_drafts=False),
    ),
    "constrained, forced only": (True, EngineConfig(mtp=False, prompt_lookup=None)),
    "constrained, MTP + copies": (True, EngineConfig(forced_drafts=False)),
    "constrained, all": (True, EngineConfig()),
}


@dataclass(frozen=True)
class Line:
    prompt_ids: tuple[int, ...]
    grammar: Grammar
    max_tokens: int


@dataclass(frozen=True)
class Outcome:
    seconds: float
    tokens: int
    mean_tokens_per_verify: float
    grammar_us_per_token: float
    outputs: tuple[tuple[int, ...], ...]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def read_workload(path: Path, loaded: LoadedModel) -> list[Line]:
    """Batch chat lines with a ``json_schema`` response format."""
    lines = []
    for raw in path.read_text().splitlines():
        if not raw.strip():
            continue
        body = json.loads(raw)["body"]
        schema = body["response_format"]["json_schema"]["schema"]
        ids = chat_prompt_ids(loaded.tokenizer, body["messages"])
        lines.append(Line(tuple(ids), json_schema_grammar(schema), int(body["max_tokens"])))
    return lines


def run_once(
    loaded: LoadedModel,
    grammars: GrammarCompiler,
    lines: Sequence[Line],
    constrained: bool,
    config: EngineConfig,
    batch: int,
) -> Outcome:
    engine = Engine.from_loaded(
        loaded, EngineConfig(**{**config.__dict__, "max_batch": batch}), grammars
    )
    eos = tuple(loaded.eos_token_ids)
    requests = [
        Request(
            str(i),
            line.prompt_ids,
            SamplingParams(max_tokens=line.max_tokens, eos_token_ids=eos),
            grammar=line.grammar if constrained else None,
        )
        for i, line in enumerate(lines)
    ]
    began = time.perf_counter()
    results = sorted(engine.generate(requests), key=lambda r: int(r.request_id))
    seconds = time.perf_counter() - began
    stats = engine.stats()
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    return Outcome(
        seconds=seconds,
        tokens=sum(r.completion_tokens for r in results),
        mean_tokens_per_verify=stats.mean_tokens_per_verify,
        grammar_us_per_token=stats.grammar_us_per_token,
        outputs=tuple(r.output_ids for r in results),
    )


def library_cost_us(
    grammars: GrammarCompiler, lines: Sequence[Line], outputs: Sequence[Sequence[int]]
) -> dict[str, float]:
    """llguidance alone along each output, per token: one mask, the forced
    tokens of the state, one consume."""
    mask_s = forced_s = consume_s = 0.0
    tokens = 0
    words = (grammars.vocab_size + 31) // 32
    bits = np.zeros((1, words), dtype=np.int32)  # [1, words]
    for line, output in zip(lines, outputs, strict=True):
        matcher = grammars.start(line.grammar)
        for token in output:
            t0 = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, bits, 0)
            t1 = time.perf_counter()
            matcher.compute_ff_tokens()
            t2 = time.perf_counter()
            matcher.consume_token(token)
            t3 = time.perf_counter()
            mask_s, forced_s, consume_s = mask_s + t1 - t0, forced_s + t2 - t1, consume_s + t3 - t2
            tokens += 1
    return {
        "mask": 1e6 * mask_s / tokens,
        "forced": 1e6 * forced_s / tokens,
        "consume": 1e6 * consume_s / tokens,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, RuntimeConfig(num_slots=16))
    grammars = GrammarCompiler.for_tokenizer(
        loaded.tokenizer, loaded.model.vocab_size, sorted(loaded.eos_token_ids)
    )
    lines = read_workload(args.workload, loaded)
    report: dict[str, object] = {"workload": str(args.workload), "lines": len(lines)}
    for batch in (int(b) for b in args.batches.split(",")):
        runs = [
            lambda c=constrained, cfg=config, b=batch: run_once(loaded, grammars, lines, c, cfg, b)
            for constrained, config in SETUPS.values()
        ]
        outcomes = [min(r, key=lambda o: o.seconds) for r in take_turns(runs, args.repeats)]
        by_name = dict(zip(SETUPS, outcomes, strict=True))
        print(f"\nbatch {batch}: {len(lines)} lines of {args.workload.name}, greedy")
        print(f"{'set-up':28} {'tok/s':>8} {'tokens/verify':>14} {'grammar us/token':>17}")
        for name, o in by_name.items():
            us = f"{o.grammar_us_per_token:.0f}" if SETUPS[name][0] else "-"
            print(f"{name:28} {o.tokens_per_s:8.1f} {o.mean_tokens_per_verify:14.2f} {us:>17}")
        constrained_outputs = {o.outputs for n, o in by_name.items() if SETUPS[n][0]}
        base, best = by_name["constrained, no drafts"], by_name["constrained, all"]
        free = by_name["unconstrained"]
        tpv = best.mean_tokens_per_verify / base.mean_tokens_per_verify
        speed = best.tokens_per_s / free.tokens_per_s
        print(f"tokens/verify, all over no drafts: {tpv:.2f}x (target >= 1.5x)")
        print(f"tok/s, constrained all over unconstrained: {speed:.2f}x (target >= 0.9x)")
        print(f"constrained outputs identical in every set-up: {len(constrained_outputs) == 1}")
        report[f"batch_{batch}"] = {
            name: {
                "tokens_per_s": o.tokens_per_s,
                "mean_tokens_per_verify": o.mean_tokens_per_verify,
                "grammar_us_per_token": o.grammar_us_per_token,
                "tokens": o.tokens,
            }
            for name, o in by_name.items()
        }
    cost = library_cost_us(grammars, lines, base.outputs)
    print(
        "llguidance alone per token: mask {mask:.1f} us, forced tokens {forced:.1f} us, "
        "consume {consume:.1f} us".format(**cost)
    )
    report["library_us_per_token"] = cost
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
