"""The flags of every `metrale` command: names, ranges, environment variables.

Contract: a flag means one thing in every command that has it: one name, one
range (``RANGES``) and one environment variable named after it
(``--prompt-lookup-max-drafts`` -> ``METRALE_PROMPT_LOOKUP_MAX_DRAFTS``); a
flag on the command line wins. Options that several commands take are
declared once here, as ``Annotated`` aliases (``ModelOpt``, ``DeviceOpt``...);
an option of one command is declared beside it with ``option``, which gives it
its variable and range the same way. A value out of range is a usage error
(exit 2) whose message names the flag (Click adds it) and the range, whether
the value came from the command line or the environment.

The configs the commands build know no flags: their messages name a field
first (``max_batch must be at least 1``, ``mtp_ladder: empty ladder``), and
``config_error`` turns such a message into a usage error on the flag that
sets that field (``Invalid value for --max-batch: must be at least 1``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, NamedTuple, TypeVar

import typer

from metrale.engine.config import MtpLadder, RuntimeConfig

ENV_PREFIX = "METRALE_"
SPECULATION = "Speculation: MTP drafts and prompt-lookup copies"
SAMPLING = "Sampling (lines may override)"
RUNTIME = "Model and runtime"
CLUSTER = "Ray cluster (pip install 'metrale[ray]')"
MTP_DRAFTS = MtpLadder().text()  # the default of --mtp-drafts: "8:3,15:2,1"
KV_CACHE_FRACTION = RuntimeConfig().kv_cache_fraction  # the default of --kv-cache-fraction

Number = TypeVar("Number", int, float)


class Range(NamedTuple):
    """``lo..hi`` (``hi=None``: no upper bound; ``lo_open``: ``lo`` itself is out)."""

    lo: float
    hi: float | None = None
    lo_open: bool = False


# Every numeric flag of every command, by name.
RANGES: dict[str, Range] = {
    # speculation
    "--mtp-min-prob": Range(0.0, 0.99),
    "--prompt-lookup-max-drafts": Range(1, 256),
    "--prompt-lookup-max-seqs": Range(1, 1 << 20),
    "--prompt-lookup-ngram": Range(1, 64),
    "--prompt-lookup-min-match": Range(1, 4096),
    "--prompt-lookup-miss-backoff": Range(0, 1 << 20),
    "--prompt-lookup-shared-cache-mb": Range(0, 1 << 20),
    "--prompt-lookup-shared-cache-scopes": Range(1, 4096),
    # model, runtime and sampling
    "--max-batch": Range(1, 4096),
    "--max-len": Range(2, 1 << 24),
    "--kv-cache-gb": Range(0, 1 << 20, lo_open=True),
    "--kv-cache-fraction": Range(0, 1, lo_open=True),
    "--threads": Range(1),
    "--max-tokens": Range(1, 1 << 24),
    "--temperature": Range(0, 100),
    "--top-p": Range(0, 1, lo_open=True),
    "--top-k": Range(0, 1 << 24),
    "--seed": Range(0, (1 << 63) - 1),
    "--n": Range(1, 16),
    # bench
    "--prompts": Range(1),
    "--repeats": Range(1),
    "--batch": Range(2),
    "--hf-lookup-tokens": Range(1),
    "--sweep-batch": Range(1),
    # train-mtp
    "--epochs": Range(1),
    "--batch-tokens": Range(1),
    "--lr": Range(0, lo_open=True),
    "--heldout": Range(0, 0.9),
    "--eval-every": Range(0),
    "--checkpoint-every": Range(0),
    "--prompt-weight": Range(0, 1),
    "--feature-weight": Range(0),
    "--max-steps": Range(1),
    "--draft-vocab": Range(0),
    "--gen-batch": Range(1, 4096),
    # generate on a Ray cluster
    "--ray-workers": Range(1, 1 << 16),
    "--ray-max-retries": Range(0, 100),
}


def env(flag: str) -> str:
    """The environment variable that may set ``--flag``: ``METRALE_FLAG``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def range_text(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    """``[1, 64]``, ``(0, 1]`` or ``>= 0``: how the range reads in help and errors."""
    if hi is None:
        return f"> {_num(lo)}" if lo_open else f">= {_num(lo)}"
    left = "(" if lo_open else "["
    return f"{left}{_num(lo)}, {_num(hi)}]"


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and x == int(x) else str(x)


def in_range(
    lo: float, hi: float | None = None, lo_open: bool = False
) -> Callable[[Number | None], Number | None]:
    """A Typer callback rejecting values outside ``lo..hi`` (``None`` passes:
    it means the option was left at its "unset" default)."""
    bounds = range_text(lo, hi, lo_open)
    wording = f"must be {bounds}" if hi is None else f"must be in {bounds}"

    def check(value: Number | None) -> Number | None:
        if value is None:
            return value
        too_low = value <= lo if lo_open else value < lo
        if too_low or (hi is not None and value > hi):
            raise typer.BadParameter(f"{wording}, got {value}")
        return value

    return check


def option(flag: str, help: str, *decls: str, panel: str | None = None) -> Any:
    """A ``typer.Option`` for ``flag`` (``--name`` or ``--name/--no-name``)
    with its environment variable, and its range from ``RANGES`` checked and
    shown in the help."""
    name = flag.split("/")[0]
    bounds = RANGES.get(name)
    if bounds is not None:
        help = f"{help} Range {range_text(*bounds)}."
    return typer.Option(
        flag,
        *decls,
        help=help,
        envvar=env(name),
        show_envvar=True,
        rich_help_panel=panel,
        callback=in_range(*bounds) if bounds is not None else None,
    )


MODEL_HELP = (
    "Checkpoint folder (HF layout), .gguf file (llama, qwen2, qwen3, qwen2moe, qwen3moe, "
    "qwen35, qwen35moe; "
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; converted once) or "
    "hub id owner/name (the Hugging Face cache first); "
    "default: the embedded SmolLM2-135M-Instruct."
)
ModelOpt = Annotated[str | None, option("--model", MODEL_HELP, panel=RUNTIME)]
RevisionOpt = Annotated[
    str | None,
    option(
        "--revision",
        "Branch, tag or commit of a hub model id (default: main).",
        panel=RUNTIME,
    ),
]
DeviceOpt = Annotated[
    str | None,
    option("--device", "cpu, cuda, cuda:1 ... (default: CUDA if available).", panel=RUNTIME),
]
DtypeOpt = Annotated[
    str | None,
    option("--dtype", "float32, bfloat16 or float16 (default: per device).", panel=RUNTIME),
]
WeightsOpt = Annotated[
    str,
    option(
        "--weights",
        "auto: run weights the model holds packed (the default model's Q4_1) in the "
        "CPU kernel, same values in a sixth of the bytes; dense: float32 matrices.",
        panel=RUNTIME,
    ),
]
MaxBatchOpt = Annotated[int, option("--max-batch", "Sequences decoded together.", panel=RUNTIME)]
MaxLenOpt = Annotated[
    int | None,
    option(
        "--max-len",
        "Positions per sequence (prompt + output); default: the model's.",
        panel=RUNTIME,
    ),
]
KvCacheGbOpt = Annotated[
    float | None,
    option(
        "--kv-cache-gb",
        "KV cache size in GiB (main + MTP caches, every slot): a --max-len given is kept "
        "and fewer slots run; else --max-batch slots run, with positions cut to fit. "
        "Default: on CUDA, --kv-cache-fraction of the free memory after the weights; "
        "on the CPU, --max-batch slots at full length.",
        panel=RUNTIME,
    ),
]
KvCacheFractionOpt = Annotated[
    float,
    option(
        "--kv-cache-fraction",
        "Without --kv-cache-gb, on CUDA: the share of the free memory after the weights "
        "that the KV cache may take.",
        panel=RUNTIME,
    ),
]
ThreadsOpt = Annotated[
    int | None, option("--threads", "torch intra-op threads (default: torch's).", panel=RUNTIME)
]
MaxTokensOpt = Annotated[
    int, option("--max-tokens", "Tokens to generate per line.", panel=SAMPLING)
]
MtpOpt = Annotated[
    bool, option("--mtp/--no-mtp", "Draft with the model's MTP layers.", panel=SPECULATION)
]
MtpHeadOpt = Annotated[
    Path | None,
    option(
        "--mtp-head",
        "MTP head written by `metrale train-mtp --out`, drafting for this model instead "
        "of its own MTP layers (or the default model's shipped head).",
        panel=SPECULATION,
    ),
]
MtpDraftsOpt = Annotated[
    str,
    option(
        "--mtp-drafts",
        "MTP chain length by batch size: 'running:drafts,...,beyond', or 'N'.",
        panel=SPECULATION,
    ),
]
MtpMinProbOpt = Annotated[
    float,
    option(
        "--mtp-min-prob",
        "Stop an MTP chain where the module gives no token this probability (0: full chain).",
        panel=SPECULATION,
    ),
]


class DraftPolicy(enum.StrEnum):
    """``auto``: each step sizes every sequence's drafts, and picks their
    source, by the verify cost the run measures where it runs and the
    acceptance seen so far (``engine/spec/budget.py``); ``fixed``: the MTP
    ladder and the copy windows decide."""

    auto = "auto"
    fixed = "fixed"


DraftPolicyOpt = Annotated[
    DraftPolicy,
    option(
        "--draft-policy",
        "auto: size drafts each step by measured cost and acceptance; "
        "fixed: the ladder and copy windows as set.",
        panel=SPECULATION,
    ),
]


class StepPath(enum.StrEnum):
    """``auto``: the device step on CUDA, the host step on the CPU;
    ``device``: each step's verify, acceptance and MTP chain as device tensor
    ops with one readback (forced on the CPU it runs the GPU's code there);
    ``host``: the step that decides on the host (``engine/step/host.py``; the device one is ``engine/step/device.py``)."""

    auto = "auto"
    device = "device"
    host = "host"


StepPathOpt = Annotated[
    StepPath,
    option(
        "--step-path",
        "auto: the device step on CUDA, the host step on the CPU; device or host: that one.",
        panel=RUNTIME,
    ),
]
RayOpt = Annotated[
    str | None,
    option(
        "--ray",
        "Run the engines on a Ray cluster: its ADDRESS (auto, host:6379, ray://host:10001) "
        "or 'local' (a Ray on this machine).",
        panel=CLUSTER,
    ),
]
RayWorkersOpt = Annotated[
    int | None,
    option(
        "--ray-workers",
        "Engines to start on the cluster (default: one per GPU, else one).",
        panel=CLUSTER,
    ),
]
RayMaxRetriesOpt = Annotated[
    int | None,
    option(
        "--ray-max-retries",
        "Tries again a line whose worker died (killed, its node lost, its engine "
        "crashed); past them the line gets an error record. Default: 3.",
        panel=CLUSTER,
    ),
]
PromptLookupMaxDraftsOpt = Annotated[
    int, option("--prompt-lookup-max-drafts", "Longest copy.", panel=SPECULATION)
]
PromptLookupMaxSeqsOpt = Annotated[
    int,
    option("--prompt-lookup-max-seqs", "No copies while more sequences run.", panel=SPECULATION),
]
PromptLookupNgramOpt = Annotated[
    int,
    option(
        "--prompt-lookup-ngram",
        "N-gram length looked up (fixed policy; auto copies from the longest agreement).",
        panel=SPECULATION,
    ),
]
PromptLookupMinMatchOpt = Annotated[
    int,
    option(
        "--prompt-lookup-min-match",
        "Tokens that must agree (never fewer than the n-gram; under auto, a"
        " shorter agreement asks the shared cache first).",
        panel=SPECULATION,
    ),
]


class OutputOrder(enum.StrEnum):
    """``completed``: each line as its request finishes (lowest latency, and
    what survives an interrupt best); ``input``: in input order, holding back
    results that finish early."""

    completed = "completed"
    input = "input"


class Progress(enum.StrEnum):
    """What people see on standard error. ``auto``: the live view when standard
    error is a terminal (and standard output is not the same terminal), else
    ``plain``. ``plain``: a summary line every few seconds and a final table.
    ``off``: the final table only."""

    auto = "auto"
    live = "live"
    plain = "plain"
    off = "off"


# The flag that sets each config field the commands fill in (a command whose
# flag for a field has another name says so to ``config_error``).
FIELD_FLAGS: dict[str, str] = {
    "max_batch": "--max-batch",
    "num_slots": "--max-batch",
    "max_len": "--max-len",
    "kv_cache_gb": "--kv-cache-gb",
    "kv_cache_fraction": "--kv-cache-fraction",
    "revision": "--revision",
    "device": "--device",
    "dtype": "--dtype",
    "weights": "--weights",
    "mtp_ladder": "--mtp-drafts",
    "mtp_min_prob": "--mtp-min-prob",
    "draft_policy": "--draft-policy",
    "step_path": "--step-path",
    "ngram": "--prompt-lookup-ngram",
    "max_drafts": "--prompt-lookup-max-drafts",
    "max_seqs": "--prompt-lookup-max-seqs",
    "min_match": "--prompt-lookup-min-match",
    "miss_backoff": "--prompt-lookup-miss-backoff",
    "cache_mb": "--prompt-lookup-shared-cache-mb",
    "scopes": "--prompt-lookup-shared-cache-scopes",
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "ray": "--ray",
    "ray_workers": "--ray-workers",
    "max_retries": "--ray-max-retries",
}
# "max_batch must be at least 1" or "mtp_ladder: empty ladder"
_FIELD_MESSAGE = re.compile(r"([a-z][a-z0-9_]*)(?:: | (?=must ))(.+)", re.DOTALL)


def config_error(
    exc: BaseException, renamed: Mapping[str, str] | None = None
) -> typer.BadParameter:
    """A config's message as a usage error on the flag that sets the field it
    names (``renamed`` holds the command's own flags for fields, and wins over
    ``FIELD_FLAGS``); a message that names no such field is kept whole."""
    found = _field_flag(str(exc), renamed or {})
    if found is None:
        return typer.BadParameter(str(exc))
    flag, rest = found
    return typer.BadParameter(rest, param_hint=flag)


def _field_flag(message: str, renamed: Mapping[str, str]) -> tuple[str, str] | None:
    match = _FIELD_MESSAGE.fullmatch(message)
    if match is None:
        return None
    field, rest = match.groups()
    flag = renamed.get(field) or FIELD_FLAGS.get(field)
    return None if flag is None else (flag, rest)


_FIELD_WORD = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def with_flags(text: str) -> str:
    """An engine text with the config fields it names as their flags:
    ``"a KV cache of 2 GiB (kv_cache_gb)"`` -> ``"... (--kv-cache-gb)"``."""
    return _FIELD_WORD.sub(lambda m: FIELD_FLAGS.get(m.group(0), m.group(0)), text)


def load_error(
    exc: BaseException, mtp_head: Path | None, model: str = "--model"
) -> typer.BadParameter:
    """A model that could not be loaded, as a usage error on the flag it
    belongs to: the setting the loader names (``device must be ...``), else
    ``--mtp-head`` when a head the user named is the problem, else ``model``
    (``--model``, or the ``MODEL`` argument of `info`)."""
    from metrale.engine.runtime.mtp_head import MtpHeadError  # torch is loaded by then

    if _field_flag(str(exc), {}) is not None:
        return config_error(exc)
    culprit = isinstance(exc, MtpHeadError) and mtp_head is not None
    return typer.BadParameter(
        f"cannot load it: {exc}", param_hint="--mtp-head" if culprit else model
    )
