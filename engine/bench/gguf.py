"""``make bench-gguf``: metrale against llama.cpp on the GGUF files people
download, the embedded model requantized by llama.cpp itself.

Usage: ``python -m metrale.engine.bench.gguf [WORKLOAD.jsonl] [--types
Q4_K_M,Q5_K_M,Q6_K,Q4_0] [--rounds 2] [--prompts 12] [--max-tokens 128]
[--threads 2]
[--docs docs/benchmarks.md]``; needs llama-cpp-python in the interpreter
(``gguf_llama.py`` runs it in processes of its own).

1. The embedded SmolLM2-135M-Instruct GGUF is requantized by llama.cpp's
   ``llama_model_quantize`` into each type (into ``build/bench-gguf/``,
   kept for later runs), so the files mix their tensor types as llama.cpp
   chooses (a Q4_K_M of a model whose rows are not all of 256 values is
   mostly Q5_0).
2. On each file, at batch 1 and ``--threads`` threads, each round runs, in
   an order rotated by one each round: metrale with no drafts
   (``--draft-policy fixed --no-mtp --no-prompt-lookup``), metrale at its
   defaults (for a GGUF path: prompt-lookup copies under the draft budget,
   as no MTP head ships for it), llama.cpp plain, and llama.cpp with its
   prompt lookup. Each run is a fresh process: ``metrale generate`` whole,
   llama.cpp's loading the model once and generating every line (the first
   once more, untimed). Each metrale configuration runs once first on one
   line, untimed (the file's conversion, the kernels, the draft budget's
   calibration, as a user's earlier runs would have left them).
3. A cell is the median over rounds of tokens per second of generation:
   metrale's ``--stats-json`` ``tokens_per_s`` (its clock starts after
   loading) and llama.cpp's tokens over the seconds of its generation
   calls, prompt evaluation included on both sides. Ratios are metrale's
   over llama.cpp plain (no drafts), and over the faster of llama.cpp's two
   modes (defaults).

Outputs are greedy. metrale's two configurations must write the same text
for every line (a difference is an error); the texts of llama.cpp and of
metrale are not the same bits of arithmetic (llama.cpp multiplies with
8-bit activations), so the table says on how many lines they agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from metrale.engine.bench.docs_table import REPO, stamp, write_section

HEADING = "bench-gguf"
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0")
WORKLOAD = REPO / "bench_prompts" / "code_refactors.jsonl"
CONFIGS = ("metrale no drafts", "metrale defaults", "llama.cpp plain", "llama.cpp lookup")
NO_DRAFTS = ("--draft-policy", "fixed", "--no-mtp", "--no-prompt-lookup")
LOOKUP_TOKENS = 10  # llama-cpp-python's example setting for code


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    out = REPO / "build" / "bench-gguf"
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.loads(t) for t in args.workload.read_text().splitlines() if t.strip()]
    lines = [{**line, "max_tokens": args.max_tokens} for line in lines[: args.prompts]]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        (work / "lines.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        warm = {**lines[0], "max_tokens": 8}  # converts, builds, calibrates: untimed
        (work / "warm.jsonl").write_text(json.dumps(warm) + "\n")
        for kind in args.types:
            path = requantized(out, kind)
            prompts = prompt_ids(path, lines, work / f"{kind}.json")
            rows.append((kind, path, bench_file(path, prompts, work, args)))
    table = table_lines(rows, args)
    print("\n".join(table))
    write_section(args.docs, HEADING, "\n".join([stamp(), "", *table]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", type=Path, default=WORKLOAD)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=12, help="first lines of the workload")
    parser.add_argument("--max-tokens", type=int, default=128, help="every line's max_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    args.types = args.types.split(",")
    return args


def requantized(out: Path, kind: str) -> Path:
    """The embedded model's GGUF requantized into ``kind`` (made once)."""
    from metrale.engine.load.default_model import find_gguf

    path = out / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not path.exists():
        partial = path.with_suffix(".partial")
        llama(["quantize", str(find_gguf()), str(partial), kind])
        partial.replace(path)
    return path


def prompt_ids(path: Path, lines: list[dict[str, Any]], out: Path) -> Path:
    """The token ids ``metrale generate`` serves for each line, from the
    file's own tokenizer and chat template, for llama.cpp to take as they are."""
    from metrale.engine.load.gguf_cache import ensure_gguf_model
    from metrale.engine.load.loader import _tokenizer
    from metrale.engine.prompts import record_prompt_ids

    tokenizer = _tokenizer(ensure_gguf_model(path))
    prompts = [
        {"id": line["id"], "ids": list(record_prompt_ids(line, tokenizer) or ()),
         "max_tokens": line["max_tokens"]}
        for line in lines
    ]  # fmt: skip
    out.write_text(json.dumps(prompts))
    return out


def bench_file(path: Path, prompts: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every round's tokens/s per configuration, and the agreement of texts."""
    rates: dict[str, list[float]] = {key: [] for key in CONFIGS}
    texts: dict[str, dict[str, str]] = {}
    for flags in (NO_DRAFTS, ()):  # untimed: conversion, kernels, the budget's calibration
        metrale_run(path, work, flags, args.threads, "warm.jsonl")
    for round_ in range(args.rounds):
        turn = round_ % len(CONFIGS)
        for key in [*CONFIGS[turn:], *CONFIGS[:turn]]:
            if key.startswith("metrale"):
                flags = NO_DRAFTS if key == "metrale no drafts" else ()
                rate, written = metrale_run(path, work, flags, args.threads)
            else:
                lookup = LOOKUP_TOKENS if key == "llama.cpp lookup" else 0
                rate, written = llama_run(path, prompts, work, lookup, args.threads)
            rates[key].append(rate)
            texts.setdefault(key, written)
            print(f"{path.name} round {round_}: {key} {rate:.1f} tok/s", flush=True)
    if texts["metrale defaults"] != texts["metrale no drafts"]:
        raise SystemExit(f"{path.name}: metrale's defaults wrote other text than no drafts")
    ours, theirs = texts["metrale no drafts"], texts["llama.cpp plain"]
    return {
        "tok_s": {key: statistics.median(values) for key, values in rates.items()},
        "agree": sum(ours[k] == theirs.get(k) for k in ours),
        "lines": len(ours),
    }


def metrale_run(
    path: Path, work: Path, flags: Sequence[str], threads: int, lines: str = "lines.jsonl"
) -> tuple[float, dict[str, str]]:
    """One ``metrale generate`` process at batch 1 on ``work / lines``: its
    tokens/s and texts."""
    output, stats = work / "out.jsonl", work / "stats.json"
    script = Path(sys.executable).with_name("metrale")
    command = [
        str(script), "generate", str(work / lines), "--model", str(path),
        "--max-batch", "1", *flags,
        "-o", str(output), "--stats-json", str(stats), "--progress", "off",
    ]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("METRALE_") or k == "METRALE_HOME"
    }
    env["OMP_NUM_THREADS"] = str(threads)  # torch's threads: generate has no flag for them
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    records = [json.loads(t) for t in output.read_text().splitlines() if t.strip()]
    return float(json.loads(stats.read_text())["tokens_per_s"]), {
        str(r["id"]): r["text"] for r in records
    }


def llama_run(
    path: Path, prompts: Path, work: Path, lookup: int, threads: int
) -> tuple[float, dict[str, str]]:
    """One llama.cpp process (``gguf_llama.py``): its tokens/s and texts."""
    result = work / "llama.json"
    command = ["generate", str(path), str(prompts), str(result), "--threads", str(threads)]
    llama([*command, "--lookup", str(lookup)])
    figures = json.loads(result.read_text())
    return figures["tokens"] / figures["seconds"], figures["texts"]


def llama(arguments: list[str]) -> None:
    command = [sys.executable, "-m", "metrale.engine.bench.gguf_llama", *arguments]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")


def table_lines(
    rows: list[tuple[str, Path, dict[str, Any]]], args: argparse.Namespace
) -> list[str]:
    from metrale.engine.load.gguf_cache import ensure_gguf_model
    from metrale.engine.load.model_info import describe_blocks

    lines = [
        f"{args.workload.name}, first {args.prompts} lines at max_tokens {args.max_tokens}, "
        f"batch 1, {args.threads} threads, {args.rounds} rounds; tokens/s of generation "
        "(median over rounds).",
        "",
        "| file | tensors | " + " | ".join(CONFIGS) + " | no drafts / plain "
        "| defaults / faster llama.cpp | same text |",
        "|---|---|" + "---|" * (len(CONFIGS) + 3),
    ]
    for kind, path, row in rows:
        tok_s = row["tok_s"]
        faster = max(tok_s["llama.cpp plain"], tok_s["llama.cpp lookup"])
        cells = " | ".join(f"{tok_s[key]:.1f}" for key in CONFIGS)
        lines.append(
            f"| {kind} | {describe_blocks(ensure_gguf_model(path))} | {cells} "
            f"| {tok_s['metrale no drafts'] / tok_s['llama.cpp plain']:.2f}x "
            f"| {tok_s['metrale defaults'] / faster:.2f}x | {row['agree']}/{row['lines']} |"
        )
    return lines


if __name__ == "__main__":
    main()
