"""`metrale generate`: JSONL prompts in, JSONL completions out.

Contract: the command turns flags (or their ``METRALE_*`` environment
variables) into validated configs, claims the output (``output.py``: an
advisory lock, so two runs never write one file), loads the model, and hands
everything to ``metrale.cli.run.run``. Usage errors (a flag out of range, a
missing input, ``--resume`` without ``-o``, an output another run is writing,
a model that cannot be loaded) exit with 2 and a message on standard error
before any line is read. SIGINT and SIGTERM stop it cleanly, while the model
loads too (``stop.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from metrale.cli.grammar_fields import schema_file_grammar
from metrale.cli.jsonl import LineDefaults
from metrale.cli.options import (
    KV_CACHE_FRACTION,
    MTP_DRAFTS,
    SAMPLING,
    SPECULATION,
    DeviceOpt,
    DraftPolicy,
    DraftPolicyOpt,
    DtypeOpt,
    KvCacheFractionOpt,
    KvCacheGbOpt,
    MaxBatchOpt,
    MaxLenOpt,
    MaxTokensOpt,
    ModelOpt,
    MtpDraftsOpt,
    MtpHeadOpt,
    MtpMinProbOpt,
    MtpOpt,
    OutputOrder,
    Progress,
    PromptLookupMaxDraftsOpt,
    PromptLookupMaxSeqsOpt,
    PromptLookupMinMatchOpt,
    PromptLookupNgramOpt,
    RayMaxRetriesOpt,
    RayOpt,
    RayWorkersOpt,
    RevisionOpt,
    StepPath,
    StepPathOpt,
    WeightsOpt,
    config_error,
    load_error,
    option,
    with_flags,
)
from metrale.cli.output import OutputBusy, OutputFile, StandardOutput
from metrale.cli.ray_backend import RaySettings, open_ray_backend, ray_problem
from metrale.cli.records import done_ids
from metrale.cli.run import EXIT_BROKEN_PIPE, EXIT_OUTPUT_FAILED, Backend, RunPlan, run
from metrale.cli.stop import Stopped, stop_signals, stop_status
from metrale.engine.api import Grammar, SamplingParams
from metrale.engine.config import (
    MTP_MIN_PROB,
    EngineConfig,
    MtpLadder,
    RuntimeConfig,
    SharedLookupSettings,
    StepPathError,
)
from metrale.lookup import PromptLookupConfig


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
        limit=with_flags(loaded.info.kv_limit),
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
        str | None, option("--output", "Write JSONL here ('-' or none: standard output).", "-o")
    ] = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    mtp: MtpOpt = True,
    mtp_head: MtpHeadOpt = None,
    mtp_drafts: MtpDraftsOpt = MTP_DRAFTS,
    mtp_min_prob: MtpMinProbOpt = MTP_MIN_PROB,
    prompt_lookup: Annotated[
        bool,
        option(
            "--prompt-lookup/--no-prompt-lookup",
            "Draft with copies of earlier tokens.",
            panel=SPECULATION,
        ),
    ] = True,
    pl_max_drafts: PromptLookupMaxDraftsOpt = 8,
    pl_max_seqs: PromptLookupMaxSeqsOpt = 8,
    pl_ngram: PromptLookupNgramOpt = 4,
    pl_min_match: PromptLookupMinMatchOpt = 8,
    pl_miss_backoff: Annotated[
        int,
        option(
            "--prompt-lookup-miss-backoff",
            "Cap of the cooldown after misses (0: none; fixed policy).",
            panel=SPECULATION,
        ),
    ] = 16,
    pl_shared_mb: Annotated[
        float,
        option(
            "--prompt-lookup-shared-cache-mb",
            "Cross-request cache size (0: off).",
            panel=SPECULATION,
        ),
    ] = 0.0,
    pl_shared_scopes: Annotated[
        int,
        option(
            "--prompt-lookup-shared-cache-scopes",
            "Scopes the cache is split over.",
            panel=SPECULATION,
        ),
    ] = 4,
    shared_scope: Annotated[
        str | None,
        option(
            "--shared-scope",
            "Scope of lines without 'scope' (none: not shared).",
            panel=SPECULATION,
        ),
    ] = None,
    forced_drafts: Annotated[
        bool,
        option(
            "--forced-drafts/--no-forced-drafts",
            "Draft the tokens a line's grammar forces (always accepted).",
            panel=SPECULATION,
        ),
    ] = True,
    prefix_cache: Annotated[
        bool,
        option(
            "--prefix-cache/--no-prefix-cache",
            "Reuse the cached KV of the longest prompt prefix another line read.",
            panel=SPECULATION,
        ),
    ] = True,
    draft_policy: DraftPolicyOpt = DraftPolicy.auto,
    step_path: StepPathOpt = StepPath.auto,
    max_batch: MaxBatchOpt = 16,
    max_len: MaxLenOpt = None,
    kv_cache_gb: KvCacheGbOpt = None,
    kv_cache_fraction: KvCacheFractionOpt = KV_CACHE_FRACTION,
    max_tokens: MaxTokensOpt = 256,
    temperature: Annotated[float, option("--temperature", "0 is greedy.", panel=SAMPLING)] = 0.0,
    top_p: Annotated[float, option("--top-p", "Nucleus sampling mass.", panel=SAMPLING)] = 1.0,
    top_k: Annotated[
        int, option("--top-k", "Keep the k likeliest tokens (0: all).", panel=SAMPLING)
    ] = 0,
    seed: Annotated[
        int | None,
        option("--seed", "A line without 'seed' uses this + its line number.", panel=SAMPLING),
    ] = None,
    n: Annotated[
        int,
        option(
            "--n",
            "Samples of each chat, completion or simple line without 'n' (a response: one).",
            panel=SAMPLING,
        ),
    ] = 1,
    json_schema: Annotated[
        Path | None,
        option(
            "--json-schema",
            "JSON schema FILE the output of every line that names no grammar must match.",
            panel=SAMPLING,
        ),
    ] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = "auto",
    stats_json: Annotated[
        Path | None, option("--stats-json", "Write the run's figures here as JSON.")
    ] = None,
    resume: Annotated[
        bool, option("--resume/--no-resume", "Skip lines whose id is already in OUTPUT (needs -o).")
    ] = False,
    order: Annotated[
        OutputOrder, option("--order", "Write lines as they complete, or in input order.")
    ] = OutputOrder.completed,
    progress: Annotated[
        Progress,
        option("--progress", "Live view (terminal), summary lines, or just the final table."),
    ] = Progress.auto,
    ray: RayOpt = None,
    ray_workers: RayWorkersOpt = None,
    ray_max_retries: RayMaxRetriesOpt = None,
) -> None:
    """Generate completions for JSONL prompts (simple or OpenAI Batch format)."""
    sources, out_path = _io_paths(inputs, output, resume)
    cluster = _ray_settings(ray, ray_workers, ray_max_retries)
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
            forced_drafts=forced_drafts,
            prefix_cache=prefix_cache,
            draft_policy=draft_policy.value,
            # Every line is constrained under --json-schema, and grammars run on
            # the host step only: auto picks it rather than fail each line.
            step_path="host" if json_schema and step_path is StepPath.auto else step_path.value,
        )
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
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
    except ValueError as exc:  # the configs' messages name a field: say its flag
        raise config_error(exc) from exc
    grammar = _schema_file(json_schema)
    console = Console(stderr=True)
    claimed = _claim_output(out_path)
    try:
        skip_ids = _done_ids(out_path) if resume and out_path else frozenset()
        with stop_signals():
            backend = _load(console, model, runtime, engine_cfg, cluster)
        plan = RunPlan(
            inputs=sources,
            output=out_path,
            order=order,
            skip_ids=skip_ids,
            stats_json=stats_json,
            progress=_view_mode(progress, console, out_path is None),
            defaults=LineDefaults(params=params, scope=shared_scope, grammar=grammar, n=n),
            settings={
                "model": model,
                "json_schema": None if json_schema is None else str(json_schema),
                "engine": dataclasses.asdict(engine_cfg),
                "runtime": dataclasses.asdict(runtime),
                "sampling": dataclasses.asdict(params) | {"n": n},
                "ray": None if cluster is None else dataclasses.asdict(cluster),
            },
        )
        status = _run_into(plan, backend, console, claimed, append=resume)
    finally:
        if claimed is not None:
            claimed.close()  # drops the lock
    raise typer.Exit(status)


def _schema_file(path: Path | None) -> Grammar | None:
    """``--json-schema FILE``, checked before the model loads."""
    if path is None:
        return None
    try:
        return schema_file_grammar(path)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--json-schema") from exc


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


def _ray_settings(
    address: str | None, workers: int | None, max_retries: int | None
) -> RaySettings | None:
    """``--ray``/``--ray-workers``/``--ray-max-retries``, checked (Ray
    installed) before anything loads."""
    if address is None:
        for flag, value in (("--ray-workers", workers), ("--ray-max-retries", max_retries)):
            if value is not None:
                raise typer.BadParameter("needs --ray ADDRESS|local", param_hint=flag)
        return None
    problem = ray_problem()
    if problem is not None:
        raise typer.BadParameter(problem, param_hint="--ray")
    try:
        if max_retries is None:
            return RaySettings(address, workers)
        return RaySettings(address, workers, max_retries)
    except ValueError as exc:
        raise config_error(exc) from exc


def _claim_output(path: str | None) -> OutputFile | None:
    """Opens and locks ``-o OUTPUT`` (None: standard output) before anything
    loads, so a second run on the same file is refused at once."""
    if path is None:
        if sys.stdout is None:  # started with its standard output closed
            raise typer.BadParameter(
                "standard output is closed: give -o OUTPUT", param_hint="'-o' / '--output'"
            )
        return None
    try:
        return OutputFile.open(path)
    except OutputBusy as exc:
        raise typer.BadParameter(str(exc), param_hint="'-o' / '--output'") from exc
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot open {path}: {exc.strerror or exc}", param_hint="'-o' / '--output'"
        ) from exc


def _done_ids(path: str) -> frozenset[str]:
    """The ids ``--resume`` skips (a cut-off last line repaired first)."""
    try:
        return frozenset(done_ids(Path(path)))
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot read {path}: {exc.strerror or exc}", param_hint="--resume"
        ) from exc


def _load(
    console: Console,
    model: str | None,
    runtime: RuntimeConfig,
    engine: EngineConfig,
    cluster: RaySettings | None = None,
) -> Backend:
    try:
        console.print(f"metrale: loading {model or 'the embedded default model'}...")
        if cluster is not None:
            return open_ray_backend(cluster, model, runtime, engine)
        return open_backend(model, runtime, engine)
    except KeyboardInterrupt as exc:
        what = exc.name if isinstance(exc, Stopped) else "SIGINT"
        console.print(f"metrale: stopped by {what} while loading the model; nothing was read")
        raise typer.Exit(stop_status(exc)) from None
    except StepPathError as exc:  # the model loaded, but not for that step
        raise config_error(exc) from exc
    except (OSError, ValueError) as exc:  # CheckpointError is a ValueError
        raise load_error(exc, runtime.mtp_head) from exc


def _run_into(
    plan: RunPlan, backend: Backend, console: Console, output: OutputFile | None, append: bool
) -> int:
    """Runs into the claimed output (emptied first unless ``append``: an
    earlier output survives a run refused or failing to load), or standard
    output; returns the status."""
    if output is not None:
        try:
            output.start(append)
        except OSError as exc:
            console.print(f"metrale: cannot empty {output.path}: {exc.strerror or exc}")
            return EXIT_OUTPUT_FAILED
    sink = output if output is not None else StandardOutput(sys.stdout)
    with stop_signals():
        status = run(plan, backend, sink, console)
    if output is None and status in (EXIT_BROKEN_PIPE, EXIT_OUTPUT_FAILED):
        # Standard output cannot take more: point it at /dev/null so the
        # interpreter's final flush does not raise a second error.
        with contextlib.suppress(OSError, ValueError):  # not a descriptor: a test's capture
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


def _view_mode(progress: Progress, console: Console, to_stdout: bool) -> str:
    """``auto`` is live only on a terminal, and not when standard output
    shares it (JSONL lines would tear through the live region)."""
    if progress is not Progress.auto:
        return progress.value
    if console.is_terminal and not (to_stdout and sys.stdout.isatty()):
        return "live"
    return "plain"
