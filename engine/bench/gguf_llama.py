"""llama.cpp's side of ``make bench-gguf``, through llama-cpp-python, in a
process of its own (the benchmark's driver never imports ``llama_cpp``).

Usage:
``python -m metrale.engine.bench.gguf_llama quantize SOURCE OUT FTYPE``
writes SOURCE requantized by llama.cpp's ``llama_model_quantize`` into OUT
(FTYPE a ``LLAMA_FTYPE_MOSTLY_*`` suffix: Q4_K_M, Q5_K_M, Q6_K, Q4_0);
``python -m metrale.engine.bench.gguf_llama generate MODEL PROMPTS OUT
--threads 2 [--lookup N]`` loads MODEL once, generates greedily for each
line of PROMPTS (a JSON list of ``{"id", "ids", "max_tokens"}``: token ids
as metrale renders the line) and writes ``{"tokens", "seconds", "texts"}``
to OUT. The first line runs once untimed first; ``seconds`` is the time of
the generation calls over every line (prompt evaluation included, loading
not), ``tokens`` what they generated. ``--lookup N`` drafts with llama.cpp's
prompt lookup (``LlamaPromptLookupDecoding``, N tokens a draft).

Greedy is ``temperature 0`` with no repeat penalty (llama-cpp-python's
default is 1.1), so both engines decode the same model greedily.

llama-cpp-python is used here only: never by metrale at run time, nor by
its tests.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def quantize(source: Path, out: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True  # the source is itself quantized (Q4_1/Q8_0)
    params.nthread = 2
    code = llama_cpp.llama_model_quantize(
        str(source).encode(), str(out).encode(), ctypes.byref(params)
    )
    if code != 0:
        sys.exit(f"llama_model_quantize {source} -> {out} ({ftype}) failed: {code}")


def generate(model: Path, prompts: Path, out: Path, threads: int, lookup: int) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lines: list[dict[str, Any]] = json.loads(prompts.read_text())
    llm = Llama(
        model_path=str(model),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None,
    )

    def complete(line: dict[str, Any]) -> dict[str, Any]:
        result: Any = llm.create_completion(
            prompt=line["ids"],
            max_tokens=line["max_tokens"],
            temperature=0.0,
            top_k=1,
            repeat_penalty=1.0,
        )
        return result

    complete(lines[0])  # untimed: the first evaluation's one-off costs
    texts, tokens = {}, 0
    started = time.perf_counter()
    for line in lines:
        result = complete(line)
        texts[line["id"]] = result["choices"][0]["text"]
        tokens += int(result["usage"]["completion_tokens"])
    seconds = time.perf_counter() - started
    out.write_text(json.dumps({"tokens": tokens, "seconds": seconds, "texts": texts}))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    q = commands.add_parser("quantize")
    q.add_argument("source", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("ftype")
    g = commands.add_parser("generate")
    g.add_argument("model", type=Path)
    g.add_argument("prompts", type=Path)
    g.add_argument("out", type=Path)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--lookup", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "quantize":
        quantize(args.source, args.out, args.ftype)
    else:
        generate(args.model, args.prompts, args.out, args.threads, args.lookup)


if __name__ == "__main__":
    main()
