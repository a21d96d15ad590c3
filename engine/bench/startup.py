"""Start-up of a one-line job against a bare torch import, in the same run.

Usage: ``python -m metrale.engine.bench.startup [--repeats 5] [--model NAME]``
(``make bench-startup``).

Each round runs, one after the other, ``python -c "import torch"`` and
``echo LINE | metrale generate -`` (one prompt, 8 new tokens, greedy, no
progress view) as fresh processes. For the job it records the wall time from
the start of the process to its first output line on standard output (the
answer), and for both the peak resident memory of the process (its own
``ru_maxrss``, read with ``wait4``). It prints the median of each, the ratio
of the job's time to the import's, and the job's peak memory above the
import's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LINE = json.dumps({"prompt": "Say hi in three words.", "max_tokens": 8})


@dataclass(frozen=True)
class Started:
    """One process: seconds to its first output line, and its peak RSS in MB."""

    first_line_s: float
    peak_mb: float


def run_once(argv: Sequence[str], stdin: str | None) -> Started:
    started = time.perf_counter()
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdin is not None or stdin is None
    if stdin is not None and process.stdin is not None:
        process.stdin.write(stdin + "\n")
        process.stdin.close()
    assert process.stdout is not None
    first = process.stdout.readline()
    first_line_s = time.perf_counter() - started
    process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0 or (stdin is not None and not first.strip()):
        raise RuntimeError(f"{' '.join(argv)} failed with status {process.returncode}")
    return Started(first_line_s, usage.ru_maxrss / 1024)  # ru_maxrss is in KB on Linux


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m metrale.engine.bench.startup")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="--model for the job (default: embedded)")
    args = parser.parse_args(argv)
    torch_cmd = [sys.executable, "-c", "import torch"]
    # The console script beside this interpreter: the command a user runs.
    metrale = str(Path(sys.executable).with_name("metrale"))
    job = [metrale, "generate", "-", "--progress", "off"]
    if args.model:
        job += ["--model", args.model]
    run_once(job, LINE)  # a first run converts or compiles what it must, once
    imports, jobs = [], []
    for _ in range(args.repeats):
        imports.append(run_once(torch_cmd, None))
        jobs.append(run_once(job, LINE))
    torch_s = statistics.median(s.first_line_s for s in imports)
    job_s = statistics.median(s.first_line_s for s in jobs)
    torch_mb = statistics.median(s.peak_mb for s in imports)
    job_mb = statistics.median(s.peak_mb for s in jobs)
    print(f"median of {args.repeats}, alternating")
    print(f"{'':24} {'seconds':>8} {'peak MB':>8}")
    print(f"{'python -c import torch':24} {torch_s:8.2f} {torch_mb:8.0f}")
    print(f"{'one-line job':24} {job_s:8.2f} {job_mb:8.0f}")
    print(
        f"time to first line: {job_s / torch_s:.2f}x the torch import (goal <= 1.5x); "
        f"peak RSS {job_mb - torch_mb:.0f} MB above it (goal <= 200)"
    )


if __name__ == "__main__":
    main()
