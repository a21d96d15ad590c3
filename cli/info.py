"""`metrale info [MODEL]`: what the runtime would load, and how long it takes.

Contract: loads the model (the embedded default when ``MODEL`` is omitted)
with the given device/dtype and prints where it came from (folder, GGUF
file, or hub id@revision and its commit), its architecture, parameter count,
dtype, device, context length, MTP layers found and KV bytes per token. A
model that cannot be loaded exits with 2 and the loader's message; a bad
``--device``, ``--dtype`` or ``--weights`` is a usage error on that flag.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from metrale.cli.options import (
    MODEL_HELP,
    DeviceOpt,
    DtypeOpt,
    MtpHeadOpt,
    MtpOpt,
    RevisionOpt,
    WeightsOpt,
    config_error,
    env,
    load_error,
)
from metrale.engine.config import RuntimeConfig


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
) -> None:
    """Show a model's architecture, size, MTP layers and KV cost."""
    console = Console()
    try:
        runtime = RuntimeConfig(
            device=device,
            dtype=dtype,
            num_slots=1,
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
        ("device", facts.device),
        ("context length", f"{facts.context_len:,}"),
        ("attention", facts.attention),
        ("experts", facts.experts or "none (dense MLP)"),
        ("quantization", facts.quantization),
        ("MTP layers", mtp_text),
        ("KV bytes per token", f"{facts.kv_bytes_per_token:,} (as the cache stores it)"),
        ("EOS ids", ", ".join(map(str, loaded.eos_token_ids))),
        ("load time", f"{facts.load_s:.2f} s"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
