"""The prepared GPU check of issue 16: parity, syncs, graphs and step times in one JSON.

Contract: ``python -m tests.support.gpu_check --device cuda --out build/gpu-check.json``
runs in a few minutes on one H200 (``make gpu-check``); ``--device cpu`` runs
the same code as a dry run, where the step times are skipped. The JSON is
rewritten after every part, so a run stopped at its time limit still leaves
what it measured, and a part that raises is recorded under ``errors`` while
the others still run. Its keys:

- ``device``: where it ran (the GPU's name, torch and transformers versions);
- ``parity``: true when, on tiny random Llama (with a DeepSeek-style MTP
  layer), Qwen2, MiMo and Qwen3.5-MoE (gated DeltaNet layers, whose state
  the device step rolls back on the GPU, and its ``mtp.*`` layer)
  checkpoints in float32, metrale's greedy output
  equals transformers' ``generate`` on the same device token for token, with
  no drafts, MTP drafts, copies, and both under the draft budget (so MTP on
  equals MTP off);
  ``parity_detail`` gives per family and mode the tokens compared, the
  drafts proposed and accepted, and any first divergence with the
  reference's logit margin there (a near tie tells float noise from a bug);
- ``readbacks_per_step``: device-to-host reads per decode step of the device
  step, the worst of the configurations in ``readbacks`` (prefill cancels out:
  each configuration runs a short and a long generation and the figure is the
  difference of their reads over the difference of their decode steps);
- ``graphs``: the (role, batch bucket, width, ctx) shapes captured as CUDA
  graphs, by part (none off CUDA);
- ``step_ms``: the step time of random bfloat16 weights in MiMo-7B shapes at
  batch 1/4/16 x verify width 1/2/4 at 1k and 4k context, next to
  transformers' forward with a static cache on the same weights and shapes
  (with how far their logits agree), and the bound ``weight bytes /
  bandwidth``, the bandwidth that of a large copy measured on the device
  (device runs only; ``tests/support/gpu_step_ms.py``);
- ``targets``: the issue's three targets from ``step_ms``, each with its figures;
- ``cli``: ``metrale generate`` as a user runs it, a whole process with the
  default draft policy, on a tiny checkpoint with an MTP layer in float32:
  once on the device with the device step and once on the CPU with the host
  step; ``equal`` when their texts are, with each run's process seconds,
  tokens per verify and drafts (the dry run runs the device step on the CPU);
- ``attention``: the SDPA backends torch has enabled, cuDNN's version, and the
  CUDA kernels a masked decode-shaped attention call launches in bfloat16 and
  float32, as the runtime calls it (device runs only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from metrale.cli.bench_runs import record_text
from metrale.engine.api import Request, SamplingParams
from metrale.engine.bench.figures import first_difference
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import load_model
from metrale.lookup import PromptLookupConfig
from tests.support.checkpoints import EOS_ID, load_reference_model, write_tiny_checkpoint
from tests.support.gpu_step_ms import BENCHES, BenchShape, bench_step_ms, targets, time_ms
from tests.support.hybrid_checkpoints import write_hybrid_checkpoint
from tests.support.hybrid_references import load_reference

# family -> (checkpoint family, MTP layout)
FAMILIES: dict[str, tuple[str, str | None]] = {
    "llama": ("llama", "deepseek"),
    "qwen2": ("qwen2", None),
    "mimo": ("qwen2", "mimo"),
    "qwen3_5_moe": ("qwen3_5_moe", "qwen3_next"),  # tests/support/hybrid_checkpoints.py
}
HYBRIDS = ("qwen3_5_moe",)
PROMPTS = ("def f(x):\n    return x", "abcabcabcabc", "hello", 'JSON {"a": 1, "b": 2}')
LOOKUP = PromptLookupConfig(ngram=2, min_match=3, max_drafts=8)
# mode -> the engine's settings, one draft source at a time, then the
# defaults. "mtp": the fixed ladder's full chain of 3 (verify width 4) every
# step, however unsure the random head is; "mtp+copies": the draft budget
# chooses between the two.
MODES: dict[str, dict[str, Any]] = {
    "off": dict(mtp=False, prompt_lookup=None, draft_policy="fixed"),
    "mtp": dict(mtp=True, prompt_lookup=None, draft_policy="fixed", mtp_min_prob=0.0),
    "copies": dict(mtp=False, prompt_lookup=LOOKUP, draft_policy="fixed"),
    "mtp+copies": dict(mtp=True, prompt_lookup=LOOKUP, draft_policy="auto"),
}


# -- the report ---------------------------------------------------------------


class Report:
    """The JSON being built, rewritten whole after every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}
        path.parent.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)

    def run(self, name: str, part: Callable[[], Any]) -> Any:
        """``part()``, which puts its own keys, timed under ``seconds``; what it
        raises is kept under ``errors`` and ``None`` returned."""
        started = time.perf_counter()
        try:
            return part()
        except Exception as exc:
            traceback.print_exc()
            self.data.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            self.data.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
            self.write()


def device_info(device: torch.device) -> dict[str, Any]:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "name": name,
        "type": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        # "highest": float32 matmuls in full float32, no TF32 (parity needs it).
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def graph_shapes(engine: Engine) -> list[list[Any]]:
    """``(role, batch bucket, width, ctx)`` of each graph the engine captured."""
    return sorted((list(s) for s in engine.graph_shapes()), key=str)


# -- parity -------------------------------------------------------------------


def hf_greedy(reference: Any, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` of one prompt (no padding)."""
    device = reference.device
    ids = torch.tensor([list(prompt)], device=device)
    with torch.inference_mode():
        out = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=EOS_ID,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def first_divergence(
    reference: Any, prompt: Sequence[int], expected: list[int], got: list[int]
) -> dict[str, Any] | None:
    """Where ``got`` leaves ``expected``, and the reference's logit margin of
    its own token over metrale's there (``None`` when they agree)."""
    at = first_difference(expected, got)
    if at is None:
        return None
    if at >= min(len(expected), len(got)):  # one is a prefix of the other
        return {"index": at, "lengths": [len(expected), len(got)]}
    ids = torch.tensor([[*prompt, *expected[:at]]], device=reference.device)
    with torch.inference_mode():
        logits = reference(ids).logits[0, -1].float()  # [vocab]
    margin = float(logits[expected[at]] - logits[got[at]])
    return {"index": at, "expected": expected[at], "got": got[at], "margin": margin}


def family_parity(
    family: str, folder: Path, device: torch.device, max_tokens: int, step_path: str
) -> tuple[dict[str, Any], list[list[Any]]]:
    """One family's parity record, and the graph shapes its engines captured."""
    base, layout = FAMILIES[family]
    if family in HYBRIDS:
        path = write_hybrid_checkpoint(folder / family, base)
        reference = load_reference(path).to(device)
    else:
        path = write_tiny_checkpoint(folder / family, base, mtp_layout=layout)
        reference = load_reference_model(path).to(device)
    runtime = RuntimeConfig(device=str(device), dtype="float32", num_slots=4, max_len=128)
    loaded = load_model(path, runtime)
    prompts = [list(loaded.tokenizer.encode(p)) for p in PROMPTS]
    expected = [hf_greedy(reference, p, max_tokens) for p in prompts]
    record: dict[str, Any] = {"mtp_layout": layout, "mtp_modules": len(loaded.mtp), "modes": {}}
    shapes: set[tuple[Any, ...]] = set()
    for mode, settings in MODES.items():
        if mode.startswith("mtp") and not loaded.mtp:
            continue  # the same engines as "off" and "copies"
        engine = Engine.from_loaded(
            loaded, EngineConfig(step_path=step_path, max_batch=4, **settings)
        )
        got = generate(engine, prompts, max_tokens)
        shapes.update(tuple(s) for s in graph_shapes(engine))
        stats = engine.stats()
        diverged = [
            first_divergence(reference, p, e, g)
            for p, e, g in zip(prompts, expected, got, strict=True)
        ]
        record["modes"][mode] = {
            "equal": got == expected,
            "tokens": sum(len(e) for e in expected),
            "verifies": stats.verifies,
            "tokens_per_verify": round(stats.mean_tokens_per_verify, 3),
            "mtp_drafts": [
                sum(stats.mtp_proposed_by_position),
                sum(stats.mtp_accepted_by_position),
            ],
            "copy_drafts": [stats.prompt_lookup.total.proposed, stats.prompt_lookup.total.accepted],
            "divergences": [d for d in diverged if d is not None],
        }
    record["equal"] = all(m["equal"] for m in record["modes"].values())
    return record, sorted((list(s) for s in shapes), key=str)


def generate(engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    requests = [
        Request(str(i), tuple(p), SamplingParams(max_tokens=max_tokens))
        for i, p in enumerate(prompts)
    ]
    results = {r.request_id: list(r.output_ids) for r in engine.generate(requests)}
    return [results[str(i)] for i in range(len(prompts))]


def check_parity(
    report: Report, folder: Path, device: torch.device, max_tokens: int, step_path: str
) -> None:
    detail: dict[str, Any] = {}
    graphs = report.data.setdefault("graphs", {})
    for family in FAMILIES:
        record, shapes = family_parity(family, folder, device, max_tokens, step_path)
        detail[family] = record
        graphs.setdefault("parity", {})[family] = shapes
        report.put("parity_detail", detail)
        print(f"parity {family}: {'equal' if record['equal'] else 'DIVERGED'}", flush=True)
    report.put("parity", all(r["equal"] for r in detail.values()))


# -- readbacks per step --------------------------------------------------------


def readbacks(
    folder: Path, device: torch.device, step_path: str, max_tokens: int
) -> tuple[dict[str, Any], list[list[Any]]]:
    """Syncs per decode step at batch 4 on the MiMo checkpoint in every mode
    (module doc: a short and a long run, differenced)."""
    from metrale.engine.runtime.syncs import count_syncs

    path = folder / "mimo"
    if not (path / "config.json").exists():
        write_tiny_checkpoint(path, "qwen2", mtp_layout="mimo")
    runtime = RuntimeConfig(device=str(device), dtype="float32", num_slots=4, max_len=128)
    loaded = load_model(path, runtime)
    prompts = [list(loaded.tokenizer.encode(p)) for p in PROMPTS]
    out: dict[str, Any] = {}
    shapes: set[tuple[Any, ...]] = set()
    for mode in MODES:
        engine = Engine.from_loaded(
            loaded, EngineConfig(step_path=step_path, max_batch=4, **MODES[mode])
        )
        runs: list[dict[str, Any]] = []
        for tokens in (4, 4 + max_tokens):
            before = engine.stats()
            with count_syncs() as syncs, cuda_syncs(device) as seen:
                generate(engine, prompts, tokens)
            after = engine.stats()
            runs.append(
                {
                    "max_tokens": tokens,
                    "verifies": after.verifies - before.verifies,
                    "prefills": after.prefills - before.prefills,
                    "readbacks": syncs.readbacks,
                    "uploads": syncs.uploads,
                    "by_kind": dict(syncs.by_kind),
                    "cuda_syncs": len(seen),
                    "cuda_sync_kinds": sorted(set(seen))[:8],
                }
            )
        short, long = runs
        steps = long["verifies"] - short["verifies"]
        assert steps > 0, f"{mode}: the long run took no more decode steps than the short one"
        out[mode] = {
            "runs": runs,
            "readbacks_per_step": (long["readbacks"] - short["readbacks"]) / steps,
            "uploads_per_step": (long["uploads"] - short["uploads"]) / steps,
            # What CUDA itself reports as synchronizing (torch's sync debug
            # mode), beyond the step's one event sync; None off CUDA.
            "cuda_syncs_per_step": (long["cuda_syncs"] - short["cuda_syncs"]) / steps
            if device.type == "cuda"
            else None,
        }
        shapes.update(tuple(s) for s in graph_shapes(engine))
    return out, sorted((list(s) for s in shapes), key=str)


@contextlib.contextmanager
def cuda_syncs(device: torch.device) -> Iterator[list[str]]:
    """The messages of every synchronizing CUDA operation torch's sync debug
    mode reports while open (none recorded off CUDA)."""
    seen: list[str] = []
    if device.type != "cuda":
        yield seen
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen.extend(str(w.message).splitlines()[0][:120] for w in caught)


def check_readbacks(
    report: Report, folder: Path, device: torch.device, step_path: str, max_tokens: int
) -> None:
    detail, shapes = readbacks(folder, device, step_path, max_tokens)
    report.data.setdefault("graphs", {})["readbacks"] = shapes
    report.put("readbacks", detail)
    worst = max(d["readbacks_per_step"] for d in detail.values())
    report.put("readbacks_per_step", worst)
    print(f"readbacks per decode step: {worst:g}", flush=True)


# -- step times (tests/support/gpu_step_ms.py) ----------------------------------------


def put_step_ms(report: Report, shape: BenchShape, device: torch.device) -> None:
    step_ms = bench_step_ms(shape, device, lambda partial: report.put("step_ms", partial))
    report.data.setdefault("graphs", {})["step_ms"] = step_ms["graphs"]
    report.put("step_ms", step_ms)


# -- whole processes -----------------------------------------------------------

# Each prompt twice: the second copy of a line finds copies in the first's text.
CLI_LINES = [
    {"id": f"p{i}", "prompt": prompt, "max_tokens": 48} for i, prompt in enumerate(PROMPTS * 2)
]


def cli_runs(folder: Path, device: torch.device) -> dict[str, Any]:
    """``cli`` (module doc)."""
    path = write_tiny_checkpoint(folder / "cli", "llama", mtp_layout="deepseek")
    prompts = folder / "cli.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in CLI_LINES))
    sides = {"device": (str(device), "device"), "cpu": ("cpu", "host")}
    out: dict[str, Any] = {}
    texts: dict[str, dict[str, str]] = {}
    for side, (where, step_path) in sides.items():
        written, stats = folder / f"cli-{side}.jsonl", folder / f"cli-{side}-stats.json"
        argv = [sys.executable, "-c", "from metrale.cli.main import app; app(prog_name='metrale')"]
        argv += ["generate", str(prompts), "--model", str(path), "--device", where]
        argv += ["--step-path", step_path, "--dtype", "float32", "-o", str(written)]
        argv += ["--stats-json", str(stats), "--max-batch", "4"]
        began = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - began
        if done.returncode != 0:
            raise RuntimeError(
                f"metrale generate on {where} exited {done.returncode}: {done.stderr[-600:]}"
            )
        records = [json.loads(text) for text in written.read_text().splitlines()]
        texts[side] = dict(record_text(record) for record in records)
        figures = json.loads(stats.read_text())
        out[side] = {
            "device": where,
            "step_path": step_path,
            "process_s": round(seconds, 2),
            "generated_tokens": figures["generated_tokens"],
            "mean_tokens_per_verify": round(figures["mean_tokens_per_verify"], 3),
            "draft_budget_verified": (figures.get("draft_budget") or {}).get("verified"),
        }
    out["equal"] = texts["device"] == texts["cpu"]
    out["lines"] = len(CLI_LINES)
    print(f"cli: {'equal' if out['equal'] else 'DIFFERENT'} texts, device step against host step")
    return out


# -- attention kernels ---------------------------------------------------------


def attention_kernels(device: torch.device) -> dict[str, Any]:
    """``attention`` (module doc): what SDPA runs for a verify of 4 rows over
    4k positions with a boolean mask, the call the runtime makes per layer."""
    backends = torch.backends.cuda
    out: dict[str, Any] = {
        "cudnn_version": torch.backends.cudnn.version(),
        "enabled": {
            "flash": backends.flash_sdp_enabled(),
            "mem_efficient": backends.mem_efficient_sdp_enabled(),
            "cudnn": backends.cudnn_sdp_enabled(),
            "math": backends.math_sdp_enabled(),
        },
    }
    batch, heads, rows, ctx, dim = 4, 32, 4, 4096, 128
    mask = torch.ones(batch, 1, rows, ctx, device=device, dtype=torch.bool).tril(ctx - rows)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(batch, heads, rows, dim, device=device, dtype=dtype)
        k = torch.randn(batch, heads, ctx, dim, device=device, dtype=dtype)
        out[str(dtype).removeprefix("torch.")] = profile_attention(q, k, mask, device)
    return out


def profile_attention(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, device: torch.device
) -> dict[str, Any]:
    """The CUDA kernels of one masked SDPA call (keys as values), and its time."""

    def call() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)

    call()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    kernels = sorted({e.name[:100] for e in prof.events() if e.device_type.name == "CUDA"})
    return {"kernels": kernels, "us": round(1e3 * time_ms(call, device, warmup=3, repeats=20), 1)}


# -- main ----------------------------------------------------------------------


def quiet_transformers() -> None:
    """No load reports (the MTP keys transformers does not know) or progress bars."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.gpu_check", description=__doc__)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run")
    parser.add_argument("--out", type=Path, default=Path("build/gpu-check.json"))
    parser.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per prompt")
    parser.add_argument(
        "--step-path", default="device", choices=("device", "host", "auto"), help="the engine's"
    )
    parser.add_argument(
        "--bench",
        default="auto",
        choices=("auto", "skip", "tiny", "mimo-7b"),
        help="step_ms shapes; auto: MiMo-7B on CUDA, skipped on the CPU",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    quiet_transformers()
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny forwards: a second thread only waits
    report = Report(args.out)
    report.put("device", device_info(device))
    with tempfile.TemporaryDirectory(prefix="metrale-gpu-check-") as tmp:
        folder = Path(tmp)
        report.run(
            "parity", lambda: check_parity(report, folder, device, args.max_tokens, args.step_path)
        )
        report.run(
            "readbacks_per_step",
            lambda: check_readbacks(report, folder, device, args.step_path, args.max_tokens),
        )
        report.run("cli", lambda: report.put("cli", cli_runs(folder, device)))
    if device.type == "cuda":
        report.run("attention", lambda: report.put("attention", attention_kernels(device)))
    choice = args.bench if args.bench != "auto" else "mimo-7b" if device.type == "cuda" else "skip"
    bench = BENCHES.get(choice)
    if bench is None:
        report.put("step_ms", {"skipped": "device runs only (--bench mimo-7b or tiny to force)"})
        report.put("targets", {"skipped": "no step_ms"})
    else:
        report.run("step_ms", lambda: put_step_ms(report, bench, device))
        if "rows" in report.data.get("step_ms", {}):
            report.run("targets", lambda: report.put("targets", targets(report.data["step_ms"])))
            print(json.dumps(report.data.get("targets"), indent=2))
    cli_equal = report.data.get("cli", {}).get("equal") is True
    ok = report.data.get("parity") is True and cli_equal and not report.data.get("errors")
    print(f"\n{'ok' if ok else 'FAILED'}: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
