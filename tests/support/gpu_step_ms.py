"""Step times of the prepared GPU check (``tests/support/gpu_check.py``): metrale's
static step next to transformers' static-cache forward on the same weights.

Contract: ``bench_step_ms(shape, device, on_row)`` builds transformers'
Qwen2ForCausalLM with random weights on ``device`` and metrale's
``LlamaModel`` over the same tensors (no checkpoint on disk), then times both
forwards at every (context, batch, verify width) of ``shape`` on the same
tokens and positions, handing each row to ``on_row`` as it is measured;
``targets(step_ms)`` reads the issue's three targets off the result. Each
row also says how far the two forwards' logits agree, so a fast step that
computes something else is caught.

Why the timed step includes the host: each sample starts on an idle device
(a sync before the start event), so a forward that is bound by its kernel
launches is charged for them, as the engine's step, which syncs once, is.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from metrale.engine.load.checkpoint import _arch_spec, family_config
from metrale.engine.runtime.arch import CheckpointError
from metrale.engine.runtime.kv_cache import SlotKVCache
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.weights import WeightStore
from metrale.engine.step.device_verify import MAX_WIDTH, StaticStep

# bytes/s: an H200's device-to-device copy as measured there once; the bound
# of a CUDA run uses the copy it measures itself (copy_bandwidth), this only
# stands in off CUDA, where step times are a dry run.
BANDWIDTH = 4.3e12
COPY_BYTES = 4 << 30  # several times the L2, so the copy runs from memory


@dataclass(frozen=True)
class BenchShape:
    """A Qwen2 model's shapes, its dtype, and the step shapes timed on it."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    dtype: str = "bfloat16"
    batches: tuple[int, ...] = (1, 4, 16)
    widths: tuple[int, ...] = (1, 2, 4)
    contexts: tuple[int, ...] = (1024, 4096)
    warmup: int = 3
    repeats: int = 20

    def config(self) -> Any:
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            use_sliding_window=False,
            hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )


# XiaomiMiMo/MiMo-7B-Base's config.json: a Qwen2 body (q/k/v bias, untied
# embeddings, head_dim 128); its one MTP layer is not part of the step timed.
MIMO_7B = BenchShape("MiMo-7B", 4096, 36, 32, 8, 11008, 151680, 640000.0)
# The same code on shapes a CPU runs in a second (tests, and --bench tiny).
TINY = BenchShape(
    "tiny", 64, 2, 4, 2, 128, 300, 10000.0, batches=(1, 4), contexts=(64,), warmup=1, repeats=2
)
BENCHES = {"tiny": TINY, "mimo-7b": MIMO_7B}


class TensorStore(WeightStore):
    """A ``WeightStore`` over tensors already in memory (a transformers
    model's state dict), so metrale's model shares their storage where it
    takes a weight as it is."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(dict.fromkeys(tensors, Path("<memory>")))
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        return self.tensors[name]


def build_models(shape: BenchShape, device: torch.device) -> tuple[Any, LlamaModel, int]:
    """transformers' Qwen2ForCausalLM with random weights made on the device,
    metrale's model over the same tensors (slots for the widest batch, the
    longest context), and the bytes of the weights a step reads: all but the
    embedding table, of which it reads a row per token."""
    from transformers import AutoModelForCausalLM

    config, dtype = shape.config(), getattr(torch, shape.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        reference = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reference.to(device).eval().requires_grad_(False)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.02)
    tensors = {k: v for k, v in reference.state_dict().items() if torch.is_floating_point(v)}
    hf_config = family_config(config.to_dict(), "qwen2")
    model = LlamaModel(
        _arch_spec(hf_config, "qwen2", "qwen2"),
        hf_config,
        TensorStore(tensors),
        num_slots=max(shape.batches),
        max_len=max(shape.contexts),
        dtype=dtype,
        device=device,
        headroom=MAX_WIDTH,
    )
    step_bytes = sum(
        t.numel() * t.element_size() for k, t in tensors.items() if "embed_tokens" not in k
    )
    return reference, model, step_bytes


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn()``, each sample from an idle device (module doc)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - began))
    return statistics.median(samples)


def static_cache(reference: Any, batch: int, ctx: int, device: torch.device) -> Any:
    """transformers' ``StaticCache`` of ``ctx`` positions for ``batch`` rows,
    allocated now (zeros, as metrale's cache after ``zero_cache``)."""
    from transformers import StaticCache

    config = reference.config
    cache = StaticCache(config=config, max_cache_len=ctx)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = reference.dtype
    cache.early_initialization(batch, config.num_key_value_heads, head_dim, dtype, device)
    return cache


def zero_cache(model: LlamaModel) -> None:
    cache = model.stack.cache
    assert isinstance(cache, SlotKVCache)
    for tensor in (*cache.keys, *cache.values):
        tensor.zero_()


def hf_step(reference: Any, cache: Any, tokens: torch.Tensor, start: int) -> Callable[[], Any]:
    """One forward of ``tokens`` ``[B, W]`` at positions ``start..start+W-1``
    over the static cache, returning logits ``[B, W, vocab]``: every layer's
    fill level is set back to ``start`` first (on the device), so repeated
    calls time the same step."""
    width = tokens.shape[1]
    positions = torch.arange(start, start + width, device=tokens.device)[None].expand_as(tokens)
    layers = cache.layers
    # transformers 5.17 takes past_key_values=; later 5.x renamed it cache= (the old name warns).
    named = (
        "cache" if "cache" in inspect.signature(reference.forward).parameters else "past_key_values"
    )

    def run() -> torch.Tensor:
        for layer in layers:
            layer.cumulative_length.fill_(start)
        out = reference(input_ids=tokens, position_ids=positions, use_cache=True, **{named: cache})
        logits: torch.Tensor = out.logits
        return logits

    return run


def time_shape(
    step: Any, reference: Any, cache: Any, shape: BenchShape, size: tuple[int, int, int]
) -> dict[str, Any]:
    """One ``step_ms`` row: both forwards timed on the same tokens at the same
    positions, then compared. Both caches hold the same keys (zeros below the
    rows written, which every width of a batch and context rewrites), so the
    logits agree up to the dtype's rounding."""
    batch, width, ctx = size
    device = reference.device
    gen = torch.Generator(device=device).manual_seed(batch * 1000 + width)
    tokens = torch.randint(0, shape.vocab, (batch, width), generator=gen, device=device)
    starts = torch.full((batch,), ctx - width, dtype=torch.int64, device=device)

    def ours() -> torch.Tensor:
        logits: torch.Tensor = step.forward(tokens, starts, ctx)[0]
        return logits

    theirs = hf_step(reference, cache, tokens, ctx - width)
    ours_ms = time_ms(ours, device, shape.warmup, shape.repeats)
    theirs_ms = time_ms(theirs, device, shape.warmup, shape.repeats)
    got = ours().view(batch, width, -1)  # [B, W, vocab] float32
    expected = theirs().float()  # [B, W, vocab]
    return {
        "ctx": ctx,
        "batch": batch,
        "width": width,
        "metrale_ms": round(ours_ms, 4),
        "transformers_ms": round(theirs_ms, 4),
        "speedup": round(theirs_ms / ours_ms, 3),
        "logits_max_diff": float((got - expected).abs().max()),
        "logits_max": float(expected.abs().max()),
        "argmax_agree": float((got.argmax(-1) == expected.argmax(-1)).float().mean()),
    }


def copy_bandwidth(device: torch.device) -> tuple[float, str]:
    """Bytes per second of a large device-to-device copy, counting bytes read
    and written, and where the figure comes from."""
    if device.type != "cuda":
        return BANDWIDTH, "assumed (no CUDA device to measure)"
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    ms = time_ms(partial(torch.Tensor.copy_, torch.empty_like(src), src), device, 3, 10)
    return 2 * COPY_BYTES / (ms / 1e3), f"measured: a {COPY_BYTES >> 30} GiB copy on {device}"


def bench_step_ms(
    shape: BenchShape, device: torch.device, on_row: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """``step_ms`` (module doc); ``on_row`` sees it after every row."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what the parity models left
    began = time.perf_counter()
    reference, model, step_bytes = build_models(shape, device)
    step = StaticStep(model)
    bandwidth, whence = copy_bandwidth(device)
    bound_ms = 1e3 * step_bytes / bandwidth
    out: dict[str, Any] = {
        "model": dataclasses.asdict(shape),
        "weight_bytes": step_bytes,
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth": whence,
        "bound_ms": bound_ms,
        "timing": "median of repeats after warmup, each sample from an idle device",
        "build_s": round(time.perf_counter() - began, 1),
        "rows": [],
    }
    print(
        f"\nstep ms, {shape.name} {shape.dtype}; bound {bound_ms:.3f} ms "
        f"({step_bytes / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s, {whence})"
    )
    print(
        f"{'ctx':>6} {'batch':>5} {'width':>5} {'metrale':>9} {'hf':>9} {'hf/m':>6} {'m/bound':>7}"
    )
    with torch.inference_mode():
        for ctx in shape.contexts:
            for batch in shape.batches:
                zero_cache(model)
                cache = static_cache(reference, batch, ctx, device)
                for width in shape.widths:
                    row = time_shape(step, reference, cache, shape, (batch, width, ctx))
                    row["x_bound"] = round(row["metrale_ms"] / bound_ms, 3)
                    out["rows"].append(row)
                    on_row(out)
                    print(
                        f"{ctx:>6} {batch:>5} {width:>5} {row['metrale_ms']:>9.3f} "
                        f"{row['transformers_ms']:>9.3f} {row['speedup']:>6.2f} "
                        f"{row['x_bound']:>7.2f}",
                        flush=True,
                    )
                del cache
    # (role, batch, width, ctx) of each graph captured
    out["graphs"] = sorted((list(cast(tuple, key)) for key in step.graphs.captured()), key=str)
    return out


def targets(step_ms: dict[str, Any]) -> dict[str, Any]:
    """The issue's three targets (module doc), each held at every context timed."""
    rows = {(r["ctx"], r["batch"], r["width"]): r for r in step_ms["rows"]}
    contexts = sorted({ctx for ctx, _, _ in rows})
    bound = step_ms["bound_ms"]

    def ms(ctx: int, batch: int, width: int, key: str = "metrale_ms") -> float:
        return float(rows[(ctx, batch, width)][key])

    width4 = {c: round(ms(c, 1, 4) / ms(c, 1, 1), 3) for c in contexts}
    to_bound = {c: round(ms(c, 1, 1) / bound, 3) for c in contexts}
    wide = max(b for _, b, _ in rows)
    speedup = {
        f"{c}/w{w}": round(ms(c, wide, w, "transformers_ms") / ms(c, wide, w), 3)
        for c, b, w in sorted(rows)
        if b == wide
    }
    return {
        "batch1_width4_over_width1": {
            "limit": 1.3,
            "by_ctx": width4,
            "met": all(v <= 1.3 for v in width4.values()),
        },
        "batch1_width1_over_bound": {
            "limit": 1.5,
            "bound_ms": bound,
            "by_ctx": to_bound,
            "met": all(v <= 1.5 for v in to_bound.values()),
        },
        f"batch{wide}_speedup_over_transformers": {
            "limit": 2.0,
            "by_ctx_width": speedup,
            "met": all(v >= 2.0 for v in speedup.values()),
        },
    }
