"""Every packed format of the kernel over the default model's products, next
to float32 matrices multiplied by torch, same shapes, same run.

Usage: ``python -m metrale.engine.bench.kernel_formats [--repeats 10]
[--docs docs/benchmarks.md]`` (``make bench-kernel``).

Each row times the products of one forward of the embedded default model
(per layer q/k/v, o, gate/up and down, then the LM head: 121 products of its
shapes) in one format, with the rows of a decode step (1), of verifies (2,
4, 8; 16 is a batch-16 step) and of a prefill chunk (512). The peer is the
dense fallback: torch's ``x @ w.T`` on float32 weights of the same shapes,
timed in the same rounds (``take_turns``), median of ``--repeats`` rounds;
the ratio is the format's median over float32's (below 1 is faster). The
blocks are random bytes with small float32 scales: the product's time does
not depend on the values. The GGUF types run as these formats (Q4_K as
q4_1, Q5_K as q5_1: ``load/gguf_blocks.py``). Writes the table to the
``bench-kernel-formats`` section of ``--docs``, stamped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from metrale.engine.bench.docs_table import REPO, stamp, write_section
from metrale.engine.bench.kernel import ROWS, products
from metrale.engine.bench.timing import stopwatch, take_turns
from metrale.engine.config import RuntimeConfig
from metrale.engine.kernels.binding import packed_kernel
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.packed import BLOCK, LAYOUT, PackedWeight

HEADING = "bench-kernel-formats"
# The GGUF types each format holds, for the table.
HOLDS = {
    "q4_0": "Q4_0",
    "q4_1": "Q4_1, Q4_K",
    "q5_0": "Q5_0",
    "q5_1": "Q5_1, Q5_K",
    "q6_k": "Q6_K",
    "q8_0": "Q8_0",
    "bf16": "BF16",
}


def random_weight(fmt: str, n: int, k: int, generator: torch.Generator) -> PackedWeight:
    """A ``[n, k]`` weight of random blocks in ``fmt``."""
    kernel = packed_kernel()
    assert kernel is not None
    element, per_block, num_scales = LAYOUT[fmt]
    row_bytes = k // BLOCK * per_block * element.itemsize
    data = torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=generator)
    if fmt == "bf16":  # finite values: clear each half's top exponent bit
        data.view(torch.int16).bitwise_and_(0x3FFF)
    scales = torch.rand(n, k // BLOCK * num_scales, generator=generator) * 0.01
    return PackedWeight.from_rows(fmt, data, scales, kernel)


def packed_products(weights: Sequence[PackedWeight], inputs: dict[int, torch.Tensor]) -> None:
    for w in weights:
        w.matmul(inputs[w.shape[1]])


def dense_products(weights: Sequence[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    for w in weights:
        inputs[w.shape[1]] @ w.T


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    if packed_kernel() is None:
        sys.exit("metrale bench.kernel_formats: the packed kernel is unavailable here")
    model = load_model(None, RuntimeConfig(num_slots=1)).model
    if not isinstance(model, LlamaModel):
        sys.exit("metrale bench.kernel_formats: a CPU model with packed weights is needed")
    shapes = [w.shape for w in products(model)]
    del model
    generator = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=generator) * 0.02 for n, k in shapes]
    threads = torch.get_num_threads()
    lines = [
        f"{len(shapes)} products a forward, {threads} threads; ms per forward's products.",
        "",
        "| format | GGUF types | " + " | ".join(f"{rows} rows" for rows in ROWS) + " |",
        "|---|---|" + "---|" * len(ROWS),
    ]
    cells: dict[str, list[str]] = {}
    for fmt in HOLDS:
        weights = [random_weight(fmt, n, k, generator) for n, k in shapes]
        for rows in ROWS:
            inputs = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in shapes}}
            runs = [
                stopwatch(partial(packed_products, weights, inputs)),
                stopwatch(partial(dense_products, dense, inputs)),
            ]
            repeats = args.repeats if rows < 512 else max(3, args.repeats // 3)
            packed_s, dense_s = (statistics.median(t) for t in take_turns(runs, repeats))
            cell = f"{packed_s * 1e3:.1f} ({packed_s / dense_s:.2f}x)"
            cells.setdefault(fmt, []).append(cell)
            print(f"{fmt} {rows} rows: {cell}, float32 {dense_s * 1e3:.1f} ms", flush=True)
        lines.append(f"| {fmt} | {HOLDS[fmt]} | " + " | ".join(cells[fmt]) + " |")
    lines += ["", "Each cell: the format's ms, and in brackets its ratio to float32's."]
    table = "\n".join(lines)
    print(table)
    description = (
        "Every packed format over the default model's products, next to torch's float32\n"
        "matmul of the same shapes in the same run (`engine/bench/kernel_formats.py`)."
    )
    write_section(args.docs, HEADING, f"{stamp()}\n\n{table}", description)


if __name__ == "__main__":
    main()
