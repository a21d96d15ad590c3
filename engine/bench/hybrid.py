"""Forward time of a hybrid MoE model (Qwen3.5 layout) in metrale next to transformers.

Usage: ``python -m metrale.engine.bench.hybrid [--context 512] [--repeats 10]
[--docs docs/benchmarks.md]`` (``make bench-runtime`` runs it after the dense
and MoE runs, and writes its table into ``docs/benchmarks.md``).

The checkpoint is random, written by transformers' ``Qwen3_5MoeForCausalLM``
at the released ratios (``HYBRID_SHAPE``: 3 gated DeltaNet layers to 1 gated
full-attention layer, softmax top-k experts with a gated shared expert),
small enough for a 2-core machine. For each row shape ``slots x rows`` (1x1,
1x4, 1x16, 16x1) every slot holds ``context`` tokens (KV for the attention
layers, a recurrent state and conv window for the linear ones), and one
forward feeds ``rows`` new tokens per slot with logits for every row, as a
verify does. The two sides take turns round by round.

metrale's timed forward starts where the last one did, so it commits no
accepted rows (a real step replays the accepted rows' recurrence first:
one step per accepted token and linear layer, small next to the
projections). transformers runs its own class with its cache of the same
context; its recurrent state cannot be cropped, so each timed forward
appends its rows (``repeats`` x ``rows`` more tokens, which changes the
attention layers' work by a few per cent at most). Each time is the median
of ``--repeats`` after two warm-ups each. The ratio is metrale's time over
transformers': below 1 is faster. "verify 4 / step 1" is metrale's 1x4 time
over its 1x1 time: what a verify of three drafts costs next to plain decoding.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from metrale.engine.bench.docs_table import REPO, stamp, write_section
from metrale.engine.bench.runners import load_transformers
from metrale.engine.bench.timing import stopwatch, take_turns
from metrale.engine.config import RuntimeConfig
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Segment

SHAPES = ((1, 1), (1, 4), (1, 16), (16, 1))
DESCRIPTION = (
    "`make bench-runtime`, last part (`python -m metrale.engine.bench.hybrid`): one forward "
    "of a random hybrid MoE model (Qwen3.5 layout, gated DeltaNet and gated attention) in "
    "metrale and in transformers, same weights, same run, at the row shapes a verify feeds. "
    "Ratio below 1: metrale is faster. The module doc says what is and is not timed."
)
HYBRID_SHAPE: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"],
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}  # fmt: skip


def write_hybrid_model(folder: Path) -> Path:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**HYBRID_SHAPE)).float()
    model.save_pretrained(str(folder))
    return folder


def bench_pair(
    model: LlamaModel, reference: Any, context_ids: list[int], repeats: int
) -> list[tuple[float, float]]:
    """``(metrale ms, transformers ms)`` per shape, the two sides taking turns
    round by round (``take_turns``), so load on a shared machine hits both."""
    from transformers import DynamicCache

    context = len(context_ids)
    slots = max(s for s, _ in SHAPES)
    # Every slot prefills the same context (a long segment: committed at its end).
    model.forward([Segment(s, 0, context_ids) for s in range(slots)], logits="last")
    results = []
    with torch.inference_mode():
        for num, rows in SHAPES:
            segments = [Segment(s, context, list(range(100, 100 + rows))) for s in range(num)]
            cache = DynamicCache(config=reference.config)
            reference(torch.tensor([context_ids] * num), cache=cache, use_cache=True)
            ids = torch.arange(100, 100 + rows).repeat(num, 1)  # [slots, rows]
            ours = stopwatch(partial(model.forward, segments))
            theirs = stopwatch(partial(reference, ids, cache=cache, use_cache=True))
            times = take_turns([ours, theirs], repeats, warmups=[ours, theirs, ours, theirs])
            a, b = (1000 * statistics.median(t) for t in times)
            results.append((a, b))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        folder = write_hybrid_model(Path(work))
        rows = max(r for _, r in SHAPES)
        runtime = RuntimeConfig(
            device="cpu", num_slots=16, max_len=args.context + 32 * rows, mtp=False
        )
        loaded = load_model(folder, runtime)
        model = loaded.model
        assert isinstance(model, LlamaModel)
        context_ids = torch.randint(0, model.vocab_size, (args.context,)).tolist()
        reference = load_transformers(folder, torch.float32, "cpu")
        pairs = bench_pair(model, reference, context_ids, args.repeats)
        state = loaded.info.state_bytes_per_slot
    ours = [a for a, _ in pairs]
    lines = [
        f"{stamp()}",
        "",
        f"Random Qwen3.5-MoE layout ({HYBRID_SHAPE['num_hidden_layers']} layers, 3 linear : 1 "
        f"full, hidden {HYBRID_SHAPE['hidden_size']}), float32, context {args.context}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}; state per slot "
        f"{state / 2**20:.2f} MiB.",
        "",
        "| slots x rows | metrale ms | transformers ms | ratio |",
        "|---|---|---|---|",
    ]
    for (num, n), (a, b) in zip(SHAPES, pairs, strict=True):
        lines.append(f"| {num} x {n} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    lines += ["", f"verify 4 / step 1 (metrale): {ours[1] / ours[0]:.2f}x"]
    table = "\n".join(lines)
    print(table)
    write_section(args.docs, "bench-runtime (hybrid)", table, DESCRIPTION)


if __name__ == "__main__":
    main()
