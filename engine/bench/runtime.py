"""Forward time of metrale's runtime next to transformers', same weights, same run.

Usage: ``python -m metrale.engine.bench.runtime [--dtype float32] [--context 1024]
[--repeats 10] [--model DIR | --moe]`` (``make bench-runtime`` runs the default
model, then ``--moe``).

``--moe`` writes a random Qwen3-MoE checkpoint of ``MOE_SHAPE`` (8 routed
experts, 2 active per token, hidden 512, 8 layers) with transformers' own
class into a temporary folder, and times it at 1, 4 and 16 rows.

For each row shape ``slots x rows`` (1x1, 1x4, 1x8, 16x1, 16x4) every slot
holds ``context`` tokens of KV, and one forward feeds ``rows`` new tokens per
slot with logits for every row (what a verify needs). transformers runs its
model class on the same checkpoint with a ``DynamicCache`` of the same
context, cropped back after each forward (cropping is not timed), on the same
device. Each time is the median of ``--repeats`` forwards after two warm-ups
(``take_turns``). The ratio is metrale's median time over transformers'
median: below 1 is faster.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from metrale.engine.bench.runners import checkpoint_folder, load_transformers
from metrale.engine.bench.timing import stopwatch, take_turns
from metrale.engine.config import RuntimeConfig
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.kv_cache import SlotKVCache
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Segment

SHAPES = ((1, 1), (1, 4), (1, 8), (16, 1), (16, 4))
MOE_SHAPES = ((1, 1), (1, 4), (1, 16), (16, 1))
MOE_SHAPE: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def write_moe_model(folder: Path) -> Path:
    """A random Qwen3-MoE checkpoint of ``MOE_SHAPE`` in ``folder`` (saved by
    transformers, so its per-expert keys are the public ones)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_SHAPE)).float().save_pretrained(str(folder))
    return folder


def median_ms(run: Callable[[], float], repeats: int) -> float:
    """Milliseconds of the median of ``repeats`` timed ``run``s, after two warm-ups."""
    (seconds,) = take_turns([run], repeats, warmups=[run, run])
    return 1000 * statistics.median(seconds)


def bench_metrale(
    model: LlamaModel, context_ids: list[int], shapes: tuple[tuple[int, int], ...], repeats: int
) -> list[float]:
    context = len(context_ids)
    model.forward([Segment(0, 0, context_ids)], logits="last")
    cache = model.stack.cache
    for layer in range(model.spec.num_layers):  # every slot holds the same context
        if isinstance(cache, SlotKVCache):
            for held in (cache.keys[layer], cache.values[layer]):
                held[1:, :, :context] = held[:1, :, :context]
        else:
            cache.entries[layer][1:, :context] = cache.entries[layer][:1, :context]
    results = []
    for slots, rows in shapes:
        segments = [Segment(s, context, list(range(100, 100 + rows))) for s in range(slots)]
        results.append(median_ms(stopwatch(partial(model.forward, segments)), repeats))
    return results


def bench_transformers(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    context_ids: list[int],
    shapes: tuple[tuple[int, int], ...],
    repeats: int,
) -> list[float]:
    from transformers import DynamicCache

    model = load_transformers(folder, dtype, device)
    results = []
    with torch.inference_mode():
        prefill = DynamicCache(config=model.config)
        context = torch.tensor([context_ids], device=device)  # [1, context]
        model(context, past_key_values=prefill, use_cache=True)
        for slots, rows in shapes:
            cache = DynamicCache(config=model.config)
            for layer, (keys, values) in enumerate(_layers(prefill)):
                cache.update(keys.repeat(slots, 1, 1, 1), values.repeat(slots, 1, 1, 1), layer)
            ids = torch.arange(100, 100 + rows, device=device).repeat(slots, 1)  # [slots, rows]
            forward = partial(model, ids, past_key_values=cache, use_cache=True)
            results.append(median_ms(stopwatch(forward, partial(cache.crop, -rows)), repeats))
    return results


def _layers(cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint folder (default: the embedded model)"
    )
    parser.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: the runtime's)"
    )
    parser.add_argument(
        "--moe", action="store_true", help="a random Qwen3-MoE checkpoint (see the module doc)"
    )
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=None, help="intra-op threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.moe:
        run(checkpoint_folder(args.model), SHAPES, args)
        return
    with tempfile.TemporaryDirectory() as work:
        run(write_moe_model(Path(work)), MOE_SHAPES, args)


def run(folder: Path, shapes: tuple[tuple[int, int], ...], args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    rows = max(r for _, r in shapes)
    runtime = RuntimeConfig(dtype=args.dtype, num_slots=16, max_len=args.context + rows, mtp=False)
    loaded = load_model(folder, runtime)
    converted = loaded.folder  # what transformers reads (a GGUF's converted folder)
    model = loaded.model
    assert isinstance(model, LlamaModel)
    context_ids = torch.randint(0, model.vocab_size, (args.context,)).tolist()
    print(
        f"model {loaded.name}, dtype {loaded.info.dtype}, device {loaded.info.device}, "
        f"context {args.context}, threads {torch.get_num_threads()}, median of {args.repeats}"
    )
    dtype, device = model.dtype, model.device
    ours = bench_metrale(model, context_ids, shapes, args.repeats)
    print(
        "metrale ms:", " ".join(f"{s}x{r}={t:.2f}" for (s, r), t in zip(shapes, ours, strict=True))
    )
    del loaded, model  # free the slots before transformers' copy of the weights
    theirs = bench_transformers(converted, dtype, device, context_ids, shapes, args.repeats)
    print(f"{'slots x rows':>12} {'metrale ms':>11} {'transformers ms':>16} {'ratio':>6}")
    for (slots, n), a, b in zip(shapes, ours, theirs, strict=True):
        print(f"{f'{slots} x {n}':>12} {a:11.2f} {b:16.2f} {a / b:6.2f}")


if __name__ == "__main__":
    main()
