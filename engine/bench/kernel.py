"""The packed kernel built for this CPU next to the same source built without
AVX-512, same weights, same run.

Usage: ``python -m metrale.engine.bench.kernel [--model DIR] [--repeats 10]``
(``make bench-kernel``).

Each row times every packed product of the model once, as a forward runs
them (per layer q/k/v, o, gate/up and down, then the LM head), with the rows
of a decode step (1), of verifies (2, 4, 8; 16 is a batch-16 step) and of a
prefill chunk (512): the library ``packed_kernel()`` loads, then the one
``kernel_built_with("-mno-avx512f")`` builds, taking turns (``take_turns``),
median of ``--repeats`` rounds. The ratio is the native build's median over
the 8-wide one's: below 1 is faster. Every product's output is compared bit
for bit between the two, and a difference is an error. Where the native
build is not the AVX-512 one (``PackedKernel.vector_lanes``), there is
nothing to compare, and the benchmark says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from functools import partial

import torch

from metrale.engine.bench.timing import stopwatch, take_turns
from metrale.engine.config import RuntimeConfig
from metrale.engine.kernels.binding import PackedKernel, kernel_built_with, packed_kernel
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.packed import PackedWeight

ROWS = (1, 2, 4, 8, 16, 512)


def products(model: LlamaModel) -> list[PackedWeight]:
    """The packed weights of a forward, in its order."""
    found: list[PackedWeight] = []
    for block in model.stack.blocks:
        found += [
            w
            for w in (block.qkv, block.o_proj, block.gate_up, block.down)
            if isinstance(w, PackedWeight)
        ]
    head = model.head.lm_head
    if isinstance(head, PackedWeight):
        found.append(head)
    return found


def forward_products(
    kernel: PackedKernel, weights: Sequence[PackedWeight], inputs: dict[int, torch.Tensor]
) -> list[torch.Tensor]:
    """Each weight's product over its input rows (by width): the outputs."""
    return [
        kernel.linear(w.fmt, inputs[w.shape[1]], w.tiles, w.tile_scales, w.shape[0])
        for w in weights
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    native = packed_kernel()
    if native is None:
        sys.exit("metrale bench.kernel: the packed kernel is unavailable here")
    if native.vector_lanes != 16:
        print("The kernel here is not built with AVX-512: nothing to compare it with.")
        return
    narrow = kernel_built_with("-mno-avx512f")
    assert narrow.vector_lanes == 8, "-mno-avx512f left the 16-wide paths in"
    model = load_model(args.model, RuntimeConfig(num_slots=1)).model
    if not isinstance(model, LlamaModel):
        sys.exit("metrale bench.kernel: a CPU model with packed weights is needed")
    weights = products(model)
    print(f"{len(weights)} packed products a forward, {torch.get_num_threads()} threads")
    print("| rows | AVX-512 ms | 8-wide ms | ratio |")
    print("|---|---|---|---|")
    for rows in ROWS:
        generator = torch.Generator().manual_seed(rows)
        inputs = {
            k: torch.randn(rows, k, generator=generator) for k in {w.shape[1] for w in weights}
        }
        pairs = zip(
            forward_products(native, weights, inputs),
            forward_products(narrow, weights, inputs),
            strict=True,
        )
        if not all(torch.equal(a, b) for a, b in pairs):
            sys.exit(f"rows {rows}: the two builds' products differ")
        runs = [stopwatch(partial(forward_products, k, weights, inputs)) for k in (native, narrow)]
        repeats = args.repeats if rows < 512 else max(3, args.repeats // 3)
        wide_s, eight_s = (statistics.median(t) for t in take_turns(runs, repeats))
        print(f"| {rows} | {wide_s * 1e3:.1f} | {eight_s * 1e3:.1f} | {wide_s / eight_s:.2f} |")


if __name__ == "__main__":
    main()
