"""Benchmark: the engine against transformers' greedy ``generate``, same run.

``python -m metrale.engine.bench.engine`` loads the default model (or
``--model FOLDER``) once in metrale's runtime and once in transformers, at the
same dtype and thread count, and prints ratios measured side by side:

1. batch 1, speculation off: the engine's time per generated token over
   transformers' (goal: at most 0.8x);
2. batch 16, speculation off: the engine's tokens/s over transformers'
   batched, left-padded ``generate`` on the same prompts (goal: at least 2x);
3. the engine with prompt lookup (and MTP when the model has a head) over the
   engine without, one request at a time on the first code-edit sample
   prompts, with the mean tokens per verify (which counts the bonus token).

Every run generates exactly ``--tokens`` tokens per prompt (EOS is ignored on
both sides: the runners' ``ignore_eos``), prompts are chat-templated as
``generate`` does it, and each figure is the best of ``--repeats`` runs after a
warm-up, the two sides of a figure taking turns (``take_turns``). No assertion
is made: this prints figures, it does not test.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.bench.runners import (
    HfRunner,
    MetraleRunner,
    Runner,
    RunOutcome,
    load_transformers,
    pad_id,
)
from metrale.engine.bench.timing import take_turns
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.prompts import user_prompt_ids
from metrale.lookup import PromptLookupConfig

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash map is in two sentences.",
    "List five fruits and their colours.",
    "What is the capital of France? Answer briefly.",
    "Give three tips for writing clean Python code.",
    "Describe a cat to someone who has never seen one.",
    "Translate 'good morning' into Spanish, French and German.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "Name three planets and one fact about each.",
    "What does HTTP stand for?",
    "Suggest a name for a bakery.",
    "Explain recursion to a child.",
    "Write a limerick about a programmer.",
]
GROUNDED = (
    "Rewrite this function with type hints, keeping everything else the same:\n\n"
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n"
)


def grounded_texts(limit: int) -> list[str]:
    """The first prompts of the shipped code-edit workload (a source checkout),
    else one built-in rewrite prompt."""
    path = Path(__file__).resolve().parents[2] / "sample_prompts" / "code_edits.jsonl"
    if not path.exists():
        return [GROUNDED]
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line["messages"][-1]["content"] for line in lines[:limit]]


def greedy_requests(prompts: Sequence[Sequence[int]], tokens: int) -> list[Request]:
    """One request per prompt, ``tokens`` new tokens each (the runners ignore EOS)."""
    params = SamplingParams(max_tokens=tokens)
    return [Request(str(i), tuple(p), params) for i, p in enumerate(prompts)]


Side = tuple[Runner, list[Request]]  # a runner and what it decodes


def metrale_side(
    loaded: LoadedModel, config: EngineConfig, prompts: Sequence[Sequence[int]], tokens: int
) -> Side:
    return MetraleRunner(loaded, config, ignore_eos=True), greedy_requests(prompts, tokens)


def transformers_side(
    hf_model: Any, pad: int, prompts: Sequence[Sequence[int]], tokens: int
) -> Side:
    """Greedy ``generate`` on all ``prompts`` in one left-padded batch."""
    runner = HfRunner(hf_model, pad, batch=len(prompts), ignore_eos=True)
    return runner, greedy_requests(prompts, tokens)


def best_of(repeats: int, *sides: Side) -> list[RunOutcome]:
    """The fastest of ``repeats`` runs of each side, after one warm-up each."""
    rounds = take_turns([partial(runner.run, requests) for runner, requests in sides], repeats)
    return [min(outcomes, key=lambda o: o.wall_s) for outcomes in rounds]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m metrale.engine.bench.engine")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runtime = RuntimeConfig(
        device="cpu", dtype=args.dtype, num_slots=args.batch, max_len=512, mtp=True
    )
    loaded = load_model(args.model, runtime)
    hf = load_transformers(loaded.folder, getattr(torch, loaded.info.dtype))
    metrale = partial(metrale_side, loaded)
    transformers = partial(transformers_side, hf, pad_id(loaded))
    prompts = [user_prompt_ids(loaded.tokenizer, t) for t in PROMPTS]
    batch = [prompts[i % len(prompts)] for i in range(args.batch)]
    plain = EngineConfig(max_batch=args.batch, mtp=False, prompt_lookup=None)
    n = args.tokens
    print(
        f"model {loaded.name}, {loaded.info.dtype}, {torch.get_num_threads()} threads, {n} tokens"
    )

    eng1, hf1 = (
        o.wall_s
        for o in best_of(args.repeats, metrale(plain, prompts[:1], n), transformers(prompts[:1], n))
    )
    print(
        f"batch 1   engine {1e3 * eng1 / n:7.2f} ms/token   transformers {1e3 * hf1 / n:7.2f} "
        f"ms/token   ratio {eng1 / hf1:.2f}x  (goal <= 0.8x)"
    )
    engb, hfb = (
        o.wall_s for o in best_of(args.repeats, metrale(plain, batch, n), transformers(batch, n))
    )
    total = n * len(batch)
    print(
        f"batch {len(batch):<3} engine {total / engb:7.1f} tok/s      transformers "
        f"{total / hfb:7.1f} tok/s      ratio {hfb / engb:.2f}x  (goal >= 2x)"
    )

    # One request at a time, as speculative decoding is usually compared.
    grounded = [user_prompt_ids(loaded.tokenizer, t) for t in grounded_texts(3)]
    lone_plain = EngineConfig(max_batch=1, mtp=False, prompt_lookup=None)
    spec_cfg = EngineConfig(max_batch=1, prompt_lookup=PromptLookupConfig())
    base, spec = best_of(
        args.repeats, metrale(lone_plain, grounded, 2 * n), metrale(spec_cfg, grounded, 2 * n)
    )
    assert spec.stats is not None
    drafts = "prompt lookup + MTP" if loaded.mtp else "prompt lookup"
    print(
        f"grounded  {drafts}: {base.wall_s / spec.wall_s:.2f}x the engine without speculation; "
        f"{spec.stats.mean_tokens_per_verify:.2f} tokens per verify (bonus token included)"
    )


if __name__ == "__main__":
    main()
