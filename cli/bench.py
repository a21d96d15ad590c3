"""`metrale bench`: metrale against transformers, same model, prompts and dtype.

Contract: the command reads each workload (JSONL in either `generate` format;
default: the sample workloads), tokenizes every line exactly as `generate`
does (chat template for ``messages``), makes it greedy with ``max_tokens``
capped at ``--max-tokens`` and stop strings dropped (transformers has no
equivalent cut), and hands the token ids to ``metrale.engine.bench.suite``. It
prints one Rich table per workload (or per workload and sweep), writes
``--json`` and ``--plot`` when asked, and exits 0 when every configuration's
output equals the reference, 1 when one differs (the first differing request
is named), 2 on a usage error (bad flag, bad line, missing matplotlib, a KV
cache that holds fewer slots than the batch) before anything is measured.
``--compare`` (``figures.py``): ``auto`` compares token for token, except on
CUDA in a dtype other than float32, where outputs are compared by first
divergence, reported and never failed (a bfloat16 verify of another width
is another matmul, whose last bits may tip a near-tie).
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from metrale.cli.bench_view import (
    bench_document,
    check_plot_available,
    print_failures,
    print_reports,
    print_sweeps,
    write_json,
    write_plot,
)
from metrale.cli.jsonl import LineDefaults, LineError, LineRef, encode, parse_line
from metrale.cli.options import (
    KV_CACHE_FRACTION,
    MTP_DRAFTS,
    DeviceOpt,
    DtypeOpt,
    KvCacheFractionOpt,
    KvCacheGbOpt,
    MaxTokensOpt,
    ModelOpt,
    MtpDraftsOpt,
    MtpHeadOpt,
    MtpMinProbOpt,
    PromptLookupMaxDraftsOpt,
    PromptLookupMaxSeqsOpt,
    PromptLookupMinMatchOpt,
    PromptLookupNgramOpt,
    RevisionOpt,
    ThreadsOpt,
    WeightsOpt,
    config_error,
    load_error,
    option,
    with_flags,
)
from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import MTP_MIN_PROB, MtpLadder, RuntimeConfig
from metrale.lookup import PromptLookupConfig

if TYPE_CHECKING:
    from metrale.engine.bench.figures import WorkloadReport
    from metrale.engine.bench.runners import Subjects
    from metrale.engine.bench.suite import BenchSettings
    from metrale.engine.bench.sweep import SweepReport, SweepSpec

SAMPLE_DIR = "sample_prompts"
EXIT_MISMATCH = 1
# BenchSettings fields set by bench's own flags.
BENCH_FLAGS = {
    "single_prompts": "--prompts",
    "repeats": "--repeats",
    "batch": "--batch",
    "hf_lookup_tokens": "--hf-lookup-tokens",
    "compare": "--compare",
}


class CompareMode(enum.StrEnum):
    """How outputs are compared with the reference (``figures.py``)."""

    auto = "auto"
    exact = "exact"
    divergence = "divergence"


def sample_workloads() -> list[Path]:
    """``sample_prompts/*.jsonl`` of the working directory, else of the source tree."""
    for folder in (Path.cwd() / SAMPLE_DIR, Path(__file__).resolve().parents[1] / SAMPLE_DIR):
        found = sorted(folder.glob("*.jsonl"))
        if found:
            return found
    raise typer.BadParameter(
        "no sample workloads found (looked for sample_prompts/*.jsonl); pass WORKLOAD files",
        param_hint="WORKLOAD",
    )


def read_workload(
    path: Path, tokenizer: Any, max_tokens: int, limit: int | None
) -> list[tuple[str, tuple[int, ...], int]]:
    """(request id, prompt ids, max_tokens) of the first ``limit`` lines. Ids are
    the lines' own (``id`` or ``custom_id``), or ``line N`` when they repeat."""
    defaults = LineDefaults(params=SamplingParams(max_tokens=max_tokens))
    out: list[tuple[str, tuple[int, ...], int]] = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        if limit is not None and len(out) >= limit:
            break
        ref = LineRef(number, f"{path}:{number}")
        parsed = parse_line(ref, raw, defaults)
        encoded = parsed if isinstance(parsed, LineError) else encode(parsed, tokenizer, 1 << 30)
        if isinstance(encoded, LineError):
            where = f" ({encoded.field})" if encoded.field else ""
            raise typer.BadParameter(
                f"{ref.where}{where}: {encoded.message}", param_hint="WORKLOAD"
            )
        assert not isinstance(parsed, LineError)
        cap = min(max_tokens, encoded.params.max_tokens)
        out.append((str(parsed.output_id), encoded.prompt_ids, cap))
    if not out:
        raise typer.BadParameter(f"{path} holds no prompts", param_hint="WORKLOAD")
    counts = Counter(rid for rid, _, _ in out)
    return [
        (rid if counts[rid] == 1 else f"line {i + 1}", ids, n)
        for i, (rid, ids, n) in enumerate(out)
    ]


def bench(
    workloads: Annotated[
        list[Path] | None,
        typer.Argument(
            metavar="WORKLOAD...",
            help="JSONL workloads (default: the samples).",
            show_default=False,
        ),
    ] = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    max_tokens: MaxTokensOpt = 64,
    prompts: Annotated[
        int,
        option(
            "--prompts",
            "Lines each batch-1 configuration decodes (the first N of each workload); "
            "batched configurations decode the first --batch lines.",
        ),
    ] = 4,
    repeats: Annotated[
        int, option("--repeats", "Timed runs per configuration; the median counts.")
    ] = 3,
    batch: Annotated[int, option("--batch", "The batched configurations' batch size.")] = 16,
    hf_lookup_tokens: Annotated[
        int, option("--hf-lookup-tokens", "transformers' prompt_lookup_num_tokens.")
    ] = 10,
    mtp_drafts: MtpDraftsOpt = MTP_DRAFTS,
    mtp_min_prob: MtpMinProbOpt = MTP_MIN_PROB,
    prompt_lookup_max_drafts: PromptLookupMaxDraftsOpt = 8,
    prompt_lookup_max_seqs: PromptLookupMaxSeqsOpt = 8,
    prompt_lookup_ngram: PromptLookupNgramOpt = 4,
    prompt_lookup_min_match: PromptLookupMinMatchOpt = 8,
    sweep: Annotated[
        str | None,
        option(
            "--sweep",
            "Instead of the comparison: tune one setting, e.g. "
            "'prompt-lookup-max-drafts=1,2,4,8,16' (also prompt-lookup-ngram, "
            "prompt-lookup-min-match, mtp-drafts).",
        ),
    ] = None,
    sweep_batch: Annotated[int, option("--sweep-batch", "Batch size of a sweep.")] = 1,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = "auto",
    kv_cache_gb: KvCacheGbOpt = None,
    kv_cache_fraction: KvCacheFractionOpt = KV_CACHE_FRACTION,
    compare: Annotated[
        CompareMode,
        option(
            "--compare",
            "exact: token for token, a difference fails; divergence: each prompt's first "
            "differing token and the mean common prefix, never failed; auto: divergence on "
            "CUDA in a dtype other than float32, else exact.",
        ),
    ] = CompareMode.auto,
    mtp_head: MtpHeadOpt = None,
    threads: ThreadsOpt = None,
    json_path: Annotated[Path | None, option("--json", "Write the figures here.")] = None,
    plot: Annotated[
        Path | None, option("--plot", "Bar chart of speedups (PNG; needs matplotlib).")
    ] = None,
) -> None:
    """Measure metrale against transformers on the same model, prompts and dtype.

    Every line decodes greedily, at most --max-tokens tokens. transformers
    always runs the dense float32 matrices, whatever --weights says.
    """
    from metrale.engine.bench.suite import BenchSettings
    from metrale.engine.bench.sweep import parse_sweep

    try:
        settings = BenchSettings(
            repeats=repeats,
            batch=batch,
            single_prompts=prompts,
            hf_lookup_tokens=hf_lookup_tokens,
            prompt_lookup=PromptLookupConfig(
                ngram=prompt_lookup_ngram,
                max_drafts=prompt_lookup_max_drafts,
                max_seqs=prompt_lookup_max_seqs,
                min_match=prompt_lookup_min_match,
            ),
            mtp_ladder=MtpLadder.parse(mtp_drafts),
            mtp_min_prob=mtp_min_prob,
        )
        spec = parse_sweep(sweep) if sweep is not None else None
        runtime = RuntimeConfig(
            device=device,
            dtype=dtype,
            weights=weights,
            mtp_head=mtp_head,
            revision=revision,
            kv_cache_gb=kv_cache_gb,
            kv_cache_fraction=kv_cache_fraction,
        )
    except ValueError as exc:
        raise config_error(exc, BENCH_FLAGS) from exc
    if plot is not None:
        check_plot_available()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)  # both sides run in this process: same threads
    paths = list(workloads or sample_workloads())
    for path in paths:
        if not path.is_file():
            raise typer.BadParameter(f"no such file: {path}", param_hint="WORKLOAD")
    err, out = Console(stderr=True), Console()
    run = _measure(paths, model, runtime, settings, compare, spec, sweep_batch, max_tokens, err)
    subjects, settings, reports, sweeps = run
    if sweeps:
        print_sweeps(out, sweeps)
    else:
        print_reports(out, reports, subjects.single.info)
    failed = print_failures(out, reports, sweeps, subjects.single.tokenizer)
    document = bench_document(subjects.single.info, settings, reports, sweeps)
    if json_path is not None:
        write_json(json_path, document)
        err.print(f"figures written to {json_path}")
    if plot is not None and reports:
        write_plot(plot, reports)
        err.print(f"chart written to {plot}")
    raise typer.Exit(EXIT_MISMATCH if failed else 0)


def _stamped(message: str) -> str:
    return f"[dim]{time.strftime('%H:%M:%S')}[/] {message}"


def _measure(
    paths: list[Path],
    model: str | None,
    runtime: RuntimeConfig,
    settings: BenchSettings,
    compare: CompareMode,
    spec: SweepSpec | None,
    sweep_batch: int,
    max_tokens: int,
    err: Console,
) -> tuple[Subjects, BenchSettings, tuple[WorkloadReport, ...], tuple[SweepReport, ...]]:
    """Loads both sides with KV slots sized to the workloads, then measures;
    the settings come back with ``compare`` resolved for the loaded device."""
    from transformers import AutoTokenizer

    from metrale.engine.bench.figures import compare_mode
    from metrale.engine.bench.runners import checkpoint_folder, load_subjects
    from metrale.engine.bench.suite import Workload, run_bench
    from metrale.engine.bench.sweep import run_sweep

    try:
        folder = checkpoint_folder(model, runtime.revision)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"cannot load it: {exc}", param_hint="--model") from exc
    limit = max(settings.single_prompts or 0, settings.batch, sweep_batch)
    lines = {path.stem: read_workload(path, tokenizer, max_tokens, limit) for path in paths}
    longest = max(len(ids) + n for rows in lines.values() for _, ids, n in rows)
    # Slots just long enough for the longest line: the default model's 8k
    # context times 16 slots would hold gigabytes of KV cache for nothing.
    runtime = replace(runtime, max_len=-(-(longest + 1) // 64) * 64, mtp=True)
    err.print(
        f"metrale bench: loading {model or 'the embedded default model'} twice (metrale, transformers)..."
    )
    try:
        subjects = load_subjects(model, runtime, max(settings.batch, sweep_batch))
    except (OSError, ValueError) as exc:
        raise load_error(exc, runtime.mtp_head) from exc
    _check_slots(subjects, max(settings.batch, sweep_batch), runtime)
    info = subjects.single.info
    mode = compare_mode(compare.value, info.device.partition(":")[0], info.dtype)
    settings = replace(settings, compare=mode)
    eos = tuple(subjects.single.eos_token_ids)
    workloads = [
        Workload(
            name,
            tuple(
                Request(rid, ids, SamplingParams(max_tokens=n, eos_token_ids=eos))
                for rid, ids, n in rows
            ),
        )
        for name, rows in lines.items()
    ]
    with err.status("measuring...") as status:
        # A spinner on a terminal; elsewhere (a log file) one line per run.
        say = status.update if err.is_terminal else (lambda m: err.print(_stamped(m)))
        if spec is not None:
            try:
                sweeps = run_sweep(workloads, spec, settings, subjects, sweep_batch, say)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--sweep") from exc
            return subjects, settings, (), sweeps
        return subjects, settings, run_bench(workloads, settings, subjects, say), ()


def _check_slots(subjects: Subjects, batch: int, runtime: RuntimeConfig) -> None:
    """A batched configuration must really have ``batch`` sequences in
    flight: a KV cache that holds fewer slots is a usage error on the flag
    that sized it."""
    held = subjects.batched.model.num_slots
    if held >= batch:
        return
    flag = "--kv-cache-gb" if runtime.kv_cache_gb is not None else "--kv-cache-fraction"
    raise typer.BadParameter(
        f"the KV cache holds {with_flags(subjects.batched.info.kv_limit)}, fewer than the "
        f"batch of {batch}; raise it or lower --batch",
        param_hint=flag,
    )
