"""`metrale info [MODEL]`: what the runtime would load, and how long it takes.

Contract: loads the model (the embedded default when ``MODEL`` is omitted)
with the given runtime flags, which mean what they mean to `generate`, and
prints where it came from (folder, GGUF file, or hub id@revision and its
commit), its architecture, parameter count, dtype, the weights as held
(dense, or the packed formats), a GGUF file's tensor types and how many
tensors of each, the weight bytes a decoded token streams, device (a GPU's
name and memory), context length, MTP layers found, KV bytes per token, the
KV cache `generate` would get with the same flags (slots x positions, GiB, and why)
and the step's graph shapes. A model that cannot be loaded exits with 2 and
the loader's message; a bad ``--device``, ``--dtype``, ``--weights`` or
``--kv-cache-gb`` is a usage error on that flag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from metrale.cli.options import (
    KV_CACHE_FRACTION,
    MODEL_HELP,
    DeviceOpt,
    DtypeOpt,
    KvCacheFractionOpt,
    KvCacheGbOpt,
    MaxBatchOpt,
    MaxLenOpt,
    MtpHeadOpt,
    MtpOpt,
    RevisionOpt,
    WeightsOpt,
    config_error,
    env,
    load_error,
    with_flags,
)
from metrale.engine.config import RuntimeConfig

if TYPE_CHECKING:
    from metrale.engine.load.loader import LoadedModel, ModelInfo


def step_path(loaded: LoadedModel) -> str:
    """Which step ``generate --step-path auto`` runs for this model here: the
    device step's own rule (``device_verify.device_verify_problem``)."""
    from metrale.engine.step.device_verify import device_verify_problem

    if loaded.model.device.type != "cuda":
        return "host (--step-path device runs the GPU's step here)"
    problem = device_verify_problem(loaded.model, loaded.mtp)
    if problem is not None:
        return f"host: the device step cannot run it ({problem})"
    return "device: one upload and one readback a step (--step-path host: the host's)"


def graph_shapes(loaded: LoadedModel, step: str) -> str:
    """The device step's CUDA graph shapes as `info` shows them (they are
    captured lazily, as a run first needs each one); none where the host
    step runs, which runs every forward eagerly."""
    if loaded.model.device.type != "cuda":
        return "none on the CPU (every forward runs eagerly)"
    if not step.startswith("device"):
        return "none: the host step runs every forward eagerly"
    num_slots = loaded.info.num_slots
    from metrale.engine.runtime.static_step import MAX_GRAPHS, MIN_CTX, WIDTHS, batch_buckets

    batches = ", ".join(map(str, batch_buckets(num_slots)))
    widths = ", ".join(map(str, WIDTHS))
    return (
        f"captured lazily: verify, MTP feed and chain at batch {batches} x width {widths} "
        f"x context (powers of two from {MIN_CTX}); at most {MAX_GRAPHS} kept"
    )


def describe_device(device: str) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H200, 139.8 GiB)``: a GPU's name and its
    total memory."""
    if not device.startswith("cuda"):
        return device
    import torch

    gpu = torch.device(device)
    total = torch.cuda.get_device_properties(gpu).total_memory
    return f"{device} ({torch.cuda.get_device_name(gpu)}, {total / 2**30:.1f} GiB)"


def describe_streamed(streamed: int) -> str:
    """The weight bytes a decoded token reads, in MiB and bytes."""
    return f"{streamed / 2**20:,.1f} MiB of weights ({streamed:,} bytes) a decoded token reads"


def describe_kv_cache(facts: ModelInfo) -> str:
    """``4 x 512 positions, 0.00146 GiB``, then why on a line of its own."""
    from metrale.engine.runtime.kv_sizing import gib
    from metrale.engine.runtime.static_step import HEADROOM

    state = ""
    if facts.state_bytes_per_slot:
        state = (
            f", with {facts.state_bytes_per_slot / 2**20:,.2f} MiB of linear-layer state per slot"
        )
    return (
        f"{facts.num_slots} x {facts.max_len:,} positions (+{HEADROOM} for padded verify rows)"
        f"{state}, {gib(facts.kv_cache_bytes)} GiB\n" + with_flags(facts.kv_limit)
    )


def describe_prefix_cache(loaded: LoadedModel) -> str:
    """Whether ``generate`` reuses cached prompt prefixes for this model, and
    why not where it cannot (``engine/prefix_cache.py``)."""
    from metrale.engine.prefix_cache import copiers

    if copiers(loaded.model, loaded.mtp) is not None:
        return "on: a line reuses the longest prompt prefix a slot holds (--no-prefix-cache)"
    if loaded.info.state_bytes_per_slot:
        return (
            "off: the gated DeltaNet layers keep their recurrent state at each line's end "
            "only, never at a prefix of it, so every line prefills its whole prompt"
        )
    return "off: this runtime cannot copy cache rows between slots"


def info(
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL",
            help=MODEL_HELP,
            envvar=env("--model"),
            show_envvar=True,
        ),
    ] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    mtp: MtpOpt = True,
    mtp_head: MtpHeadOpt = None,
    weights: WeightsOpt = "auto",
    revision: RevisionOpt = None,
    max_batch: MaxBatchOpt = 16,
    max_len: MaxLenOpt = None,
    kv_cache_gb: KvCacheGbOpt = None,
    kv_cache_fraction: KvCacheFractionOpt = KV_CACHE_FRACTION,
) -> None:
    """Show a model's architecture, size, MTP layers, KV cache and device."""
    console = Console()
    try:
        runtime = RuntimeConfig(
            device=device,
            dtype=dtype,
            num_slots=max_batch,
            max_len=max_len,
            kv_cache_gb=kv_cache_gb,
            kv_cache_fraction=kv_cache_fraction,
            mtp=mtp,
            weights=weights,
            mtp_head=mtp_head,
            revision=revision,
        )
    except ValueError as exc:
        raise config_error(exc) from exc
    try:
        from metrale.engine.load.loader import load_model  # torch loads only when needed

        loaded = load_model(model, runtime)
    except (OSError, ValueError) as exc:  # CheckpointError/DefaultModelError are ValueErrors
        error = load_error(exc, mtp_head, model="MODEL")
        if error.param_hint != "MODEL":  # a flag's value: --device, --mtp-head...
            raise error from exc
        # The loader's message whole: an error box would fold the folder's path.
        Console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    facts = loaded.info
    step = step_path(loaded)
    table = Table(show_header=False, box=None)
    mtp_text = f"{facts.mtp_layout} x {facts.mtp_count}" if facts.mtp_layout else "none"
    if facts.mtp_draft_vocab is not None:
        mtp_text += f" (drafts from {facts.mtp_draft_vocab:,} tokens)"
    if facts.mtp_head is not None:
        mtp_text += f"\n{facts.mtp_head}"
    rows = [
        ("model", facts.name),
        ("source", facts.source),
        ("architecture", facts.architecture),
        ("parameters", f"{facts.parameters:,} ({facts.parameters / 1e6:.1f} M)"),
        ("dtype", facts.dtype),
        ("weights", facts.weights),
        *([("GGUF tensors", facts.gguf_blocks)] if facts.gguf_blocks else []),
        ("streamed per token", describe_streamed(facts.streamed_bytes)),
        ("device", describe_device(facts.device)),
        ("context length", f"{facts.context_len:,}"),
        ("attention", facts.attention),
        ("experts", facts.experts or "none (dense MLP)"),
        ("quantization", facts.quantization),
        ("MTP layers", mtp_text),
        ("KV bytes per token", f"{facts.kv_bytes_per_token:,} (as the cache stores it)"),
        ("KV cache", describe_kv_cache(facts)),
        ("prefix cache", describe_prefix_cache(loaded)),
        ("step", step),
        ("graphs", graph_shapes(loaded, step)),
        ("EOS ids", ", ".join(map(str, loaded.eos_token_ids))),
        ("load time", f"{facts.load_s:.2f} s"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
