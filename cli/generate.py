"""`metrale generate`: JSONL prompts in, JSONL completions out.

Contract: the command turns flags (or their ``METRALE_*`` environment
variables) into validated configs, loads the model, and hands everything to
``metrale.cli.run.run``. Usage errors (a flag out of range, a missing input,
``--resume`` without ``-o``, a model that cannot be loaded) exit with 2 and a
message on standard error before any line is generated.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.console import Console

from metrale.cli.jsonl import LineDefaults
from metrale.cli.options import OutputOrder, Progress, env, in_range, load_error, range_text
from metrale.cli.records import done_ids
from metrale.cli.run import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, Backend, RunPlan, run
from metrale.engine.api import SamplingParams
from metrale.engine.config import (
    MTP_MIN_PROB,
    EngineConfig,
    MtpLadder,
    RuntimeConfig,
    SharedLookupSettings,
)
from metrale.lookup import PromptLookupConfig

LOOKUP = "Speculation: MTP drafts and prompt-lookup copies"
SAMPLING = "Sampling (lines may override)"
RUNTIME = "Model and runtime"


def _opt(
    flag: str,
    help: str,
    *decls: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    panel: str | None = None,
) -> Any:
    """An option with its env var, and its range checked and shown in help."""
    if lo is not None:
        help = f"{help} Range {range_text(lo, hi, lo_open)}."
    name = flag.split("/")[0]
    return typer.Option(
        flag,
        *decls,
        help=help,
        envvar=env(name),
        show_envvar=True,
        rich_help_panel=panel,
        callback=in_range(lo, hi, lo_open) if lo is not None else None,
    )


def open_backend(model: str | None, runtime: RuntimeConfig, engine: EngineConfig) -> Backend:
    """Loads the model and starts its engine (imported here: `--help` and
    usage errors should not wait for torch)."""
    from metrale.engine.engine import Engine
    from metrale.engine.load.loader import load_model

    loaded = load_model(model, runtime)
    eng = Engine.from_loaded(loaded, engine)
    return Backend(
        name=loaded.name,
        tokenizer=loaded.tokenizer,
        eos_token_ids=tuple(loaded.eos_token_ids),
        # The engine serves the shorter of the model's and its drafter's slots.
        max_len=min([loaded.model.max_len] + [m.max_len for m in loaded.mtp if engine.mtp]),
        generate=eng.generate,
        stats=eng.stats,
    )


def generate(
    inputs: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="INPUT...",
            help="JSONL files; '-' or none reads standard input.",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        str | None, _opt("--output", "Write JSONL here ('-' or none: standard output).", "-o")
    ] = None,
    model: Annotated[
        str | None,
        _opt(
            "--model",
            "Checkpoint folder (HF layout); default: the embedded SmolLM2-135M-Instruct.",
            panel=RUNTIME,
        ),
    ] = None,
    mtp: Annotated[
        bool, _opt("--mtp/--no-mtp", "Draft with the model's MTP layers.", panel=LOOKUP)
    ] = True,
    mtp_head: Annotated[
        Path | None,
        _opt(
            "--mtp-head",
            "MTP head written by `metrale train-mtp --out`, drafting for this model instead "
            "of its own MTP layers (or the default model's shipped head).",
            panel=LOOKUP,
        ),
    ] = None,
    mtp_drafts: Annotated[
        str,
        _opt(
            "--mtp-drafts",
            "MTP chain length by batch size: 'running:drafts,...,beyond', or 'N'.",
            panel=LOOKUP,
        ),
    ] = "8:3,15:2,1",
    mtp_min_prob: Annotated[
        float,
        _opt(
            "--mtp-min-prob",
            "Stop an MTP chain where the module gives no token this probability (0: full chain).",
            lo=0.0,
            hi=0.99,
            panel=LOOKUP,
        ),
    ] = MTP_MIN_PROB,
    prompt_lookup: Annotated[
        bool,
        _opt(
            "--prompt-lookup/--no-prompt-lookup",
            "Draft with copies of earlier tokens.",
            panel=LOOKUP,
        ),
    ] = True,
    pl_max_drafts: Annotated[
        int, _opt("--prompt-lookup-max-drafts", "Longest copy.", lo=1, hi=256, panel=LOOKUP)
    ] = 8,
    pl_max_seqs: Annotated[
        int,
        _opt(
            "--prompt-lookup-max-seqs",
            "No copies while more sequences run.",
            lo=1,
            hi=1 << 20,
            panel=LOOKUP,
        ),
    ] = 8,
    pl_ngram: Annotated[
        int, _opt("--prompt-lookup-ngram", "N-gram length looked up.", lo=1, hi=64, panel=LOOKUP)
    ] = 4,
    pl_min_match: Annotated[
        int,
        _opt(
            "--prompt-lookup-min-match",
            "Tokens that must agree (never fewer than the n-gram).",
            lo=1,
            hi=4096,
            panel=LOOKUP,
        ),
    ] = 8,
    pl_miss_backoff: Annotated[
        int,
        _opt(
            "--prompt-lookup-miss-backoff",
            "Cap of the cooldown after misses (0: none).",
            lo=0,
            hi=1 << 20,
            panel=LOOKUP,
        ),
    ] = 16,
    pl_shared_mb: Annotated[
        float,
        _opt(
            "--prompt-lookup-shared-cache-mb",
            "Cross-request cache size (0: off).",
            lo=0,
            hi=1 << 20,
            panel=LOOKUP,
        ),
    ] = 0.0,
    pl_shared_scopes: Annotated[
        int,
        _opt(
            "--prompt-lookup-shared-cache-scopes",
            "Scopes the cache is split over.",
            lo=1,
            hi=4096,
            panel=LOOKUP,
        ),
    ] = 4,
    shared_scope: Annotated[
        str | None,
        _opt("--shared-scope", "Scope of lines without 'scope' (none: not shared).", panel=LOOKUP),
    ] = None,
    max_batch: Annotated[
        int, _opt("--max-batch", "Sequences decoded together.", lo=1, hi=4096, panel=RUNTIME)
    ] = 16,
    max_len: Annotated[
        int | None,
        _opt(
            "--max-len",
            "Positions per sequence (prompt + output); default: the model's.",
            lo=2,
            hi=1 << 24,
            panel=RUNTIME,
        ),
    ] = None,
    max_tokens: Annotated[
        int, _opt("--max-tokens", "Tokens to generate per line.", lo=1, hi=1 << 24, panel=SAMPLING)
    ] = 256,
    temperature: Annotated[
        float, _opt("--temperature", "0 is greedy.", lo=0, hi=100, panel=SAMPLING)
    ] = 0.0,
    top_p: Annotated[
        float, _opt("--top-p", "Nucleus sampling mass.", lo=0, hi=1, lo_open=True, panel=SAMPLING)
    ] = 1.0,
    top_k: Annotated[
        int,
        _opt("--top-k", "Keep the k likeliest tokens (0: all).", lo=0, hi=1 << 24, panel=SAMPLING),
    ] = 0,
    seed: Annotated[
        int | None,
        _opt(
            "--seed",
            "A line without 'seed' uses this + its line number.",
            lo=0,
            hi=(1 << 63) - 1,
            panel=SAMPLING,
        ),
    ] = None,
    device: Annotated[
        str | None,
        _opt("--device", "cpu, cuda, cuda:1 ... (default: CUDA if available).", panel=RUNTIME),
    ] = None,
    dtype: Annotated[
        str | None,
        _opt("--dtype", "float32, bfloat16 or float16 (default: per device).", panel=RUNTIME),
    ] = None,
    weights: Annotated[
        str,
        _opt(
            "--weights",
            "auto: run weights the model holds packed (the default model's Q4_1) in the "
            "CPU kernel, same values in a sixth of the bytes; dense: float32 matrices.",
            panel=RUNTIME,
        ),
    ] = "auto",
    stats_json: Annotated[
        Path | None, _opt("--stats-json", "Write the run's figures here as JSON.")
    ] = None,
    resume: Annotated[
        bool, _opt("--resume/--no-resume", "Skip lines whose id is already in OUTPUT (needs -o).")
    ] = False,
    order: Annotated[
        OutputOrder, _opt("--order", "Write lines as they complete, or in input order.")
    ] = OutputOrder.completed,
    progress: Annotated[
        Progress,
        _opt("--progress", "Live view (terminal), summary lines, or just the final table."),
    ] = Progress.auto,
) -> None:
    """Generate completions for JSONL prompts (simple or OpenAI Batch format)."""
    sources, out_path = _io_paths(inputs, output, resume)
    try:
        engine_cfg = EngineConfig(
            max_batch=max_batch,
            mtp=mtp,
            mtp_ladder=MtpLadder.parse(mtp_drafts),
            mtp_min_prob=mtp_min_prob,
            prompt_lookup=PromptLookupConfig(
                ngram=pl_ngram,
                max_drafts=pl_max_drafts,
                max_seqs=pl_max_seqs,
                min_match=pl_min_match,
                miss_backoff=pl_miss_backoff,
            )
            if prompt_lookup
            else None,
            shared_lookup=SharedLookupSettings(cache_mb=pl_shared_mb, scopes=pl_shared_scopes),
        )
        runtime = RuntimeConfig(
            device=device,
            dtype=dtype,
            num_slots=max_batch,
            max_len=max_len,
            mtp=mtp,
            weights=weights,
            mtp_head=mtp_head,
        )
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
    except ValueError as exc:  # the configs' messages name the flag
        raise typer.BadParameter(str(exc)) from exc
    console = Console(stderr=True)
    backend = _load(console, model, runtime, engine_cfg)
    plan = RunPlan(
        inputs=sources,
        output=out_path,
        order=order,
        skip_ids=frozenset(done_ids(Path(out_path))) if resume and out_path else frozenset(),
        stats_json=stats_json,
        progress=_view_mode(progress, console, out_path is None),
        defaults=LineDefaults(params=params, scope=shared_scope),
        settings={
            "model": model,
            "engine": dataclasses.asdict(engine_cfg),
            "runtime": dataclasses.asdict(runtime),
            "sampling": dataclasses.asdict(params),
        },
    )
    raise typer.Exit(_run_into(plan, backend, console, append=resume))


def _io_paths(
    inputs: list[str] | None, output: str | None, resume: bool
) -> tuple[tuple[str, ...], str | None]:
    """Inputs (``"-"`` for standard input) and the output path (None: stdout)."""
    sources = tuple(inputs or ["-"])
    for path in sources:
        if path != "-" and not Path(path).is_file():
            raise typer.BadParameter(f"no such file: {path}", param_hint="INPUT")
    out_path = None if output in (None, "-") else output
    if resume and out_path is None:
        raise typer.BadParameter(
            "needs -o OUTPUT: it skips the ids already written there", param_hint="--resume"
        )
    return sources, out_path


def _load(
    console: Console, model: str | None, runtime: RuntimeConfig, engine: EngineConfig
) -> Backend:
    try:
        console.print(f"metrale: loading {model or 'the embedded default model'}...")
        return open_backend(model, runtime, engine)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (OSError, ValueError) as exc:  # CheckpointError is a ValueError
        raise load_error(exc, runtime.mtp_head) from exc


def _run_into(plan: RunPlan, backend: Backend, console: Console, append: bool) -> int:
    """Runs with the output opened (appending under ``--resume``); returns the status."""
    stream = sys.stdout if plan.output is None else _open_output(plan.output, append)
    try:
        status = run(plan, backend, stream, console)
    finally:
        if stream is not sys.stdout:
            stream.close()
    if status == EXIT_BROKEN_PIPE and stream is sys.stdout:
        # Nobody reads standard output any more: point it at /dev/null so the
        # interpreter's final flush does not raise a second BrokenPipeError.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


def _open_output(path: str, resume: bool) -> IO[str]:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Resume appends: done_ids() has already cut any partial last line.
    return open(path, "a" if resume else "w", encoding="utf-8", newline="\n")


def _view_mode(progress: Progress, console: Console, to_stdout: bool) -> str:
    """``auto`` is live only on a terminal, and not when standard output
    shares it (JSONL lines would tear through the live region)."""
    if progress is not Progress.auto:
        return progress.value
    if console.is_terminal and not (to_stdout and sys.stdout.isatty()):
        return "live"
    return "plain"
