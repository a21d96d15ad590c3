"""Builds and binds ``kernels/packed_linear.c`` (see its header for the maths).

Contract: ``packed_kernel()`` returns the bound kernel, or ``None`` when it
cannot be had here, with ``kernel_problem()`` saying why (no C compiler, a
failed build). The shared library is compiled once per source, compiler
flags and CPU, into ``$METRALE_HOME/kernels/``, written to a temporary name
and renamed into place, so concurrent first runs never load half a file.
``METRALE_NO_KERNEL=1`` disables it (the dense float32 path is then used).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "kernels" / "packed_linear.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
FORMATS = {"q4_1": 0, "q8_0": 1, "bf16": 2}

_pointer, _int64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# bfloat16 weights have no scales; the kernel still gets a valid address.
_NO_SCALES = torch.zeros(1)


def _scales_ptr(scales: torch.Tensor) -> int:
    return int(scales.data_ptr()) if scales.numel() else int(_NO_SCALES.data_ptr())


class PackedKernel:
    """The two entry points of the shared library, typed."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._linear = library.metrale_packed_linear
        self._linear.argtypes = [
            _int, _pointer, _int64, _int64, _pointer, _pointer, _int64, _pointer, _int,
        ]  # fmt: skip
        self._linear.restype = _int
        self._decode = library.metrale_decode
        self._decode.argtypes = [_int, _int64, _pointer, _pointer, _int64, _pointer, _int]
        self._decode.restype = _int

    def linear(
        self, fmt: str, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, n: int
    ) -> torch.Tensor:
        """``x`` ``[rows, k]`` float32 contiguous -> ``[rows, n]``."""
        rows, k = x.shape
        out = torch.empty(rows, n, dtype=torch.float32)
        code = self._linear(
            FORMATS[fmt], x.data_ptr(), rows, k, data.data_ptr(), _scales_ptr(scales), n,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        _check(code, fmt, k)
        return out

    def decode(
        self, fmt: str, data: torch.Tensor, scales: torch.Tensor, n: int, k: int
    ) -> torch.Tensor:
        """The float32 weight ``[n, k]``."""
        out = torch.empty(n, k, dtype=torch.float32)
        code = self._decode(
            FORMATS[fmt], k, data.data_ptr(), _scales_ptr(scales), n, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        _check(code, fmt, k)
        return out


def _check(code: int, fmt: str, k: int) -> None:
    if code == -1:
        raise ValueError(f"packed weight {fmt} with {k} columns: not a multiple of 32")
    if code != 0:
        raise MemoryError("the packed-weight kernel could not allocate its row buffer")


_problem: list[str] = []


def kernel_problem() -> str | None:
    """Why ``packed_kernel()`` returned ``None``; ``None`` when it did not."""
    return _problem[0] if _problem else None


@cache
def packed_kernel() -> PackedKernel | None:
    if os.environ.get("METRALE_NO_KERNEL"):
        _problem.append("disabled by METRALE_NO_KERNEL")
        return None
    try:
        return PackedKernel(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        _problem.append(f"the packed-weight kernel is unavailable: {exc}")
        return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    from metrale.engine.default_model import metrale_home  # it imports this module's users

    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode() + _cpu_id()).hexdigest()
    target = metrale_home() / "kernels" / f"packed_linear-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        built.replace(target)
    return target


def _cpu_id() -> bytes:
    """The CPU's feature flags: a library built with -march=native on one
    machine must not be loaded by another sharing the same home."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()
