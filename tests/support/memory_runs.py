"""Peak memory of `metrale generate` over a long stream of short lines.

Contract: ``stream_run`` starts the real CLI on a checkpoint (the tiny one,
in the tests and in the benchmark), writes ``num_lines`` lines to its
standard input from a thread of this process as fast as the child takes them
(the input is never all in memory on either side), and returns the child's
peak resident set size once it had taken ``early_at`` lines (``VmHWM``:
the model loaded, the pipeline under way) and over the whole run
(``ru_maxrss``), in KiB. With
``slow_first`` the first line asks for ``SLOW_TOKENS`` tokens and every
other for one: under ``--order input`` all the lines behind it finish first,
the case that piles finished records up when nothing bounds them. Each line
carries ``metadata_bytes`` of metadata, echoed in its record, so that such a
pile shows in the resident size.

    python -m tests.support.memory_runs [--lines 10000,100000]

runs ``--order completed`` and ``--order input`` (slow first line) at each
count and writes the ``bench-memory`` section of docs/benchmarks.md
(``make bench-memory``). It lives beside the test fixtures it runs on.

    python -m tests.support.memory_runs --one MODEL OUT LINES ORDER

runs one stream (slow first line under ``input``) and prints its ``Peak`` as
JSON: the test runs it so, because the feeding process's own state shows in
the child's figures (after Ray ran in a pytest process, a child's peak grew
by hundreds of MiB with no line held), and a fresh process feeds as a user's
pipeline does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from metrale.engine.bench.docs_table import stamp, write_section
from tests.support.checkpoints import write_tiny_checkpoint

METRALE = Path(sys.executable).parent / "metrale"
SLOW_TOKENS = 448
ARGS = ["--device", "cpu", "--dtype", "float32", "--max-len", "480", "--max-batch", "64"]
ARGS += ["--progress", "off", "--draft-policy", "fixed"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
HEADING = "bench-memory"


@dataclass(frozen=True)
class Peak:
    lines: int
    order: str
    early_kib: int  # VmHWM once the child had taken ``early_at`` lines
    end_kib: int  # ru_maxrss of the whole run
    seconds: float


def line(i: int, slow_first: bool, metadata_bytes: int) -> bytes:
    max_tokens = SLOW_TOKENS if slow_first and i == 0 else 1
    record: dict[str, object] = {"id": i, "prompt": f"line {i}", "max_tokens": max_tokens}
    if metadata_bytes:
        record["metadata"] = "m" * metadata_bytes
    return orjson.dumps(record) + b"\n"


def stream_run(
    model: Path,
    out: Path,
    num_lines: int,
    order: str = "completed",
    slow_first: bool = False,
    metadata_bytes: int = 0,
    early_at: int = 1000,
) -> Peak:
    """The module's contract; raises when the run fails or misses a line."""
    started = time.monotonic()
    errors = out.with_suffix(".stderr")
    command = [str(METRALE), "generate", "-", "--model", str(model), *ARGS, "--order", order]
    with errors.open("wb") as stderr:
        proc = subprocess.Popen(
            [*command, "-o", str(out)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    fed = [0]  # lines the child has taken (a pipe holds a few more)
    feeder = threading.Thread(target=_feed, args=(proc, num_lines, slow_first, metadata_bytes, fed))
    feeder.start()
    early = 0
    while True:  # reaped here rather than by Popen, for the child's resource usage
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if not early and fed[0] >= early_at:
            early = _hwm_kib(proc.pid)
        time.sleep(0.01)
    proc.returncode = os.waitstatus_to_exitcode(status)
    feeder.join()
    if proc.returncode != 0:
        raise RuntimeError(f"metrale exited {proc.returncode}: {errors.read_text()}")
    if _lines(out) != num_lines:
        raise RuntimeError(f"{_lines(out)} lines written for {num_lines}: {errors.read_text()}")
    return Peak(num_lines, order, early, usage.ru_maxrss, time.monotonic() - started)


def _feed(
    proc: subprocess.Popen[bytes], num_lines: int, slow_first: bool, metadata: int, fed: list[int]
) -> None:
    assert proc.stdin is not None
    try:
        for i in range(num_lines):
            proc.stdin.write(line(i, slow_first, metadata))
            proc.stdin.flush()  # so ``fed`` counts what the pipe took
            fed[0] = i + 1
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the child ended early: its status says why


def _lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


def _hwm_kib(pid: int) -> int:
    try:
        rows = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(r.split()[1]) for r in rows if r.startswith("VmHWM:")), 0)


def table(peaks: list[Peak]) -> str:
    rows = [
        "| lines | order | peak RSS at 1,000 lines read | peak RSS of the run | seconds |",
        "|---|---|---|---|---|",
    ]
    for p in peaks:
        rows.append(
            f"| {p.lines:,} | {p.order} | {p.early_kib / 1024:.0f} MiB | "
            f"{p.end_kib / 1024:.0f} MiB | {p.seconds:.0f} |"
        )
    ratios = []
    for order in dict.fromkeys(p.order for p in peaks):
        runs = sorted((p for p in peaks if p.order == order), key=lambda p: p.lines)
        if len(runs) > 1:
            low, high = runs[0], runs[-1]
            ratios.append(
                f"`--order {order}`: {high.end_kib / low.end_kib:.3f}x at "
                f"{high.lines:,} lines over {low.lines:,}"
            )
    if ratios:
        rows += ["", "Peak RSS of the run, " + "; ".join(ratios) + "."]
    return "\n".join(rows)


def run_alone(model: Path, out: Path, num_lines: int, order: str, metadata_bytes: int) -> Peak:
    """``stream_run`` from a fresh process (module doc, ``--one``)."""
    command = [sys.executable, "-m", "tests.support.memory_runs", "--one"]
    command += [str(model), str(out), str(num_lines), order]
    command += ["--metadata-bytes", str(metadata_bytes)]
    repo = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(command, cwd=repo, capture_output=True, check=True)
    return Peak(**orjson.loads(done.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", default="10000,100000", help="line counts, comma-separated")
    parser.add_argument("--metadata-bytes", type=int, default=1024)
    parser.add_argument("--no-docs", action="store_true", help="print only")
    parser.add_argument("--one", nargs=4, metavar=("MODEL", "OUT", "LINES", "ORDER"))
    args = parser.parse_args()
    if args.one:
        model, out, count, order = args.one
        slow = order == "input"
        one = stream_run(Path(model), Path(out), int(count), order, slow, args.metadata_bytes)
        print(orjson.dumps(dataclasses.asdict(one)).decode())
        return
    peaks = []
    with tempfile.TemporaryDirectory() as work:
        model = write_tiny_checkpoint(Path(work) / "tiny", "llama", mtp_layout="deepseek")
        for count in (int(n) for n in args.lines.split(",")):
            for order, slow in (("completed", False), ("input", True)):
                out = Path(work) / f"out-{count}-{order}.jsonl"
                peak = stream_run(model, out, count, order, slow, args.metadata_bytes)
                print(peak, flush=True)
                peaks.append(peak)
                out.unlink()
    body = table(peaks)
    print(body)
    if not args.no_docs:
        write_section(DOCS, HEADING, f"{stamp()}\n\n{body}")


if __name__ == "__main__":
    main()
