"""Builds and binds metrale's C kernels: ``kernels/packed_linear.c`` (linear
layers over packed weights in the formats ``FORMATS`` names, whose
arithmetic ``packed_columns.h`` states; its tiles in ``packed_tiles.c``, its
register paths in ``packed_rows.c`` and ``packed_rows512.c``), ``kernels/attention.c`` (decode and verify
attention over the KV cache) and ``kernels/layer_ops.c`` (the norms, rotary
embedding, cache write and SwiGLU between them); see their headers for the
maths.

Contract: ``packed_kernel()`` returns the bound kernel, or ``None`` when it
cannot be had here, with ``kernel_problem()`` saying why (no C compiler, a
failed build). The shared library is compiled once per source, compiler
flags and CPU, into ``$METRALE_HOME/kernels/``, written to a temporary name
and renamed into place, so concurrent first runs never load half a file.
``METRALE_NO_KERNEL=1`` disables it (dense float32 weights and torch's
attention are then used).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from metrale.engine.load.home import metrale_home

KERNELS = Path(__file__).parent
# The slowest to compile first: a first build runs them on all cores at once.
SOURCES = tuple(
    KERNELS / name
    for name in (
        "packed_rows.c",
        "packed_rows_bits.c",
        "packed_linear.c",
        "packed_tiles.c",
        "packed_rows512.c",
        "attention.c",
        "layer_ops.c",
        "decoder_layers.c",
    )
)
# Included by the sources: hashed with them.
HEADERS = tuple(
    KERNELS / name for name in ("packed.h", "packed_columns.h", "packed_rows.h", "vector_math.h")
)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
# What links the objects into the library (the rest of FLAGS compiles them).
LINK_ONLY = ("-shared",)
# The packed formats, as packed.h numbers them (runtime/packed.py's LAYOUT
# gives their bytes; load/gguf_blocks.py which GGUF type becomes which).
# "parts" is no block format: a weight stacked from parts of several formats,
# its data a table of them (packed_linear.c, runtime/packed.py's stack).
FORMATS = {"q4_1": 0, "q8_0": 1, "bf16": 2, "q4_0": 3, "q5_0": 4, "q5_1": 5, "q6_k": 6, "parts": 7}
LAYER_FIELDS = 16  # int64 fields of a layer in decoder_layers.c's table

_pointer, _int64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# bfloat16 weights have no scales; the kernel still gets a valid address.
_NO_SCALES = torch.zeros(1)


def _scales_ptr(scales: torch.Tensor) -> int:
    return int(scales.data_ptr()) if scales.numel() else int(_NO_SCALES.data_ptr())


class PackedKernel:
    """The entry points of the shared library, typed. Each wrapper checks
    shapes, dtypes and strides and raises ``ValueError``: the C code trusts
    what it is given."""

    def __init__(self, library: ctypes.CDLL, build: str = "") -> None:
        self.build = build  # the library's build key: its sources, compiler, flags and CPU
        self._linear = library.metrale_packed_linear
        self._linear.argtypes = [
            _int, _pointer, _int64, _int64, _pointer, _pointer, _int64, _pointer, _int,
        ]  # fmt: skip
        self._linear.restype = _int
        # Floats a vector of the products holds: 16 (AVX-512), 8 (AVX2) or 1.
        self.vector_lanes = int(library.metrale_vector_lanes())
        self._decode = library.metrale_decode
        self._decode.argtypes = [_int, _int64, _pointer, _pointer, _int64, _pointer, _int]
        self._decode.restype = _int
        self._attend = library.metrale_attend
        self._attend.argtypes = [
            _pointer, _int64, _pointer, _pointer, _int64, _int64, _int64, _int64, _int64,
            _pointer, _int64, ctypes.c_float, _pointer, _int,
        ]  # fmt: skip
        self._attend.restype = _int
        self._rms_norm = library.metrale_rms_norm
        self._rms_norm.argtypes = [
            _pointer, _int64, _int64, _pointer, ctypes.c_float, _pointer, _int,
        ]  # fmt: skip
        self._rope = library.metrale_rope
        self._rope.argtypes = [
            _pointer, _int64, _int64, _int64, _int64, _pointer, _pointer, _pointer,
        ]  # fmt: skip
        self._kv_write = library.metrale_kv_write
        self._kv_write.argtypes = [
            _pointer, _int64, _pointer, _int64, _pointer, _pointer, _int64, _int64, _int64,
            _int64, _pointer,
        ]  # fmt: skip
        self._layers = library.metrale_decoder_layers
        self._layers.argtypes = [
            _pointer, _int64, _int64, _pointer, _int64, _int64, _int64, _int64, _int64,
            ctypes.c_float, _pointer, _pointer, _pointer, _int64, _int64, _pointer, _int64,
            ctypes.c_float, _pointer, _int,
        ]  # fmt: skip
        self._layers.restype = _int
        self._silu_mul = library.metrale_silu_mul
        self._silu_mul.argtypes = [_pointer, _int64, _int64, _pointer, _int]
        for function in (self._rms_norm, self._rope, self._kv_write, self._silu_mul):
            function.restype = None

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

    def attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        segments: torch.Tensor,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``q`` ``[rows, heads, head_dim]`` (rows may be strided)
        over one layer's cache ``[slots, kv_heads, max_len, head_dim]`` for the
        segments ``[num_segments, 4]`` = (slot, start, rows, first row), int64:
        a ``RowPlan``'s ``segment_table``, whose bounds ``plan_rows`` checked
        against this cache. Returns ``[rows, heads * head_dim]``. Float32 CPU
        tensors throughout."""
        rows, heads, head_dim = q.shape
        _, kv_heads, max_len, _ = keys.shape
        _float32_cpu(q, keys, values)
        _heads_packed(q)
        _whole_cache(keys, values, kv_heads, head_dim)
        _segment_table(segments)
        out = torch.empty(rows, heads * head_dim, dtype=torch.float32)
        code = self._attend(
            q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), heads, kv_heads,
            max_len, head_dim, segments.shape[0], segments.data_ptr(), window, scale,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if code == -1:
            raise ValueError(f"{heads} query heads over {kv_heads} kv heads")
        if code != 0:
            raise MemoryError("the attention kernel could not allocate its score buffer")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' RMSNorm of ``x`` ``[rows, n]`` (contiguous), scaled by ``weight``."""
        rows, n = x.shape
        _float32_cpu(x, weight)
        _require(x.is_contiguous() and weight.shape == (n,), "contiguous rows, a weight per column")
        out = torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(), rows, n, weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads()
        )
        return out

    def rope_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Rotates ``x`` ``[rows, heads, head_dim]`` (rows may be strided) in place
        by the rows ``positions`` ``[rows]`` (int64) of the tables ``[max_len,
        head_dim]``: a ``RowPlan``'s positions, which ``plan_rows`` checked
        against ``max_len``."""
        rows, heads, head_dim = x.shape
        _float32_cpu(x, cos, sin)
        _heads_packed(x)
        _rope_tables(cos, sin, head_dim, 0)
        _positions(positions, rows)
        self._rope(
            x.data_ptr(), x.stride(0), rows, heads, head_dim, cos.data_ptr(), sin.data_ptr(),
            positions.data_ptr(),
        )  # fmt: skip

    def kv_write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        segments: torch.Tensor,
    ) -> None:
        """Stores ``k``/``v`` ``[rows, kv_heads, head_dim]`` (rows may be strided)
        at their segments' slots and positions of a layer's cache; ``segments``
        as for ``attend``."""
        _, kv_heads, head_dim = k.shape
        _float32_cpu(k, v, keys, values)
        _require(k.shape == v.shape, "keys and values of the same shape")
        _heads_packed(k)
        _heads_packed(v)
        _whole_cache(keys, values, kv_heads, head_dim)
        _segment_table(segments)
        self._kv_write(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), keys.data_ptr(),
            values.data_ptr(), kv_heads, keys.shape[2], head_dim, segments.shape[0],
            segments.data_ptr(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * n]`` (gate first), contiguous."""
        rows, width = gate_up.shape
        _float32_cpu(gate_up)
        _require(gate_up.is_contiguous() and width % 2 == 0, "contiguous rows of gate then up")
        out = torch.empty(rows, width // 2, dtype=torch.float32)
        self._silu_mul(
            gate_up.data_ptr(), rows, width // 2, out.data_ptr(), torch.get_num_threads()
        )
        return out

    def takes_cache(
        self, keys: torch.Tensor, values: torch.Tensor, kv_heads: int, head_dim: int
    ) -> bool:
        """Whether a layer's cache tensors are what the C side reads."""
        try:
            _float32_cpu(keys, values)
            _whole_cache(keys, values, kv_heads, head_dim)
        except ValueError:
            return False
        return True

    @staticmethod
    def weight_fields(fmt: str, tiles: torch.Tensor, scales: torch.Tensor) -> list[int]:
        """A packed weight's format, data and scales addresses for a layer table."""
        return [FORMATS[fmt], int(tiles.data_ptr()), _scales_ptr(scales)]

    def decoder_layers(
        self,
        x: torch.Tensor,
        table: torch.Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        max_len: int,
        segments: torch.Tensor,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """``x`` ``[rows, hidden]`` (updated in place and returned) through the
        layers of ``table`` ``[layers, LAYER_FIELDS]``, which ``FusedLayers``
        writes from tensors it checked; ``positions`` and ``segments`` are a
        ``RowPlan``'s, checked by ``plan_rows`` against the cache."""
        rows, hidden = x.shape
        _float32_cpu(x, cos, sin)
        _require(x.is_contiguous(), "contiguous rows")
        _require(
            table.dtype == torch.int64 and table.is_contiguous() and table.dim() == 2
            and table.shape[1] == LAYER_FIELDS,
            f"an int64 layer table [layers, {LAYER_FIELDS}]",
        )  # fmt: skip
        _rope_tables(cos, sin, head_dim, max_len)
        _positions(positions, rows)
        _segment_table(segments)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        widths = 2 * hidden + q_size + 2 * kv_size + q_size + 3 * intermediate
        scratch = torch.empty(rows * widths, dtype=torch.float32)
        code = self._layers(
            x.data_ptr(), rows, table.shape[0], table.data_ptr(), hidden, heads, kv_heads,
            head_dim, intermediate, eps, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
            max_len, segments.shape[0], segments.data_ptr(), window, scale, scratch.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if code == -1:
            raise ValueError(f"a packed format, or {heads} query heads over {kv_heads} kv heads")
        if code != 0:
            raise MemoryError("the decoder-layers kernel could not allocate a buffer")
        return x


def _require(condition: bool, what: str) -> None:
    """The C side checks nothing: a wrong shape or dtype must stop here."""
    if not condition:
        raise ValueError(f"metrale kernel: expected {what}")


def _float32_cpu(*tensors: torch.Tensor) -> None:
    _require(
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors),
        "float32 CPU tensors",
    )


def _heads_packed(x: torch.Tensor) -> None:
    _require(
        x.stride(2) == 1 and x.stride(1) == x.shape[2], "[rows, heads, head_dim], heads packed"
    )


def _whole_cache(keys: torch.Tensor, values: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    _require(
        keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape
        and keys.shape[1] == kv_heads and keys.shape[3] == head_dim,
        f"whole cache tensors [slots, {kv_heads}, max_len, {head_dim}]",
    )  # fmt: skip


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, positions: int) -> None:
    _require(
        cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape
        and cos.shape[1] == head_dim and cos.shape[0] >= positions,
        "contiguous cos/sin tables of one row per position",
    )  # fmt: skip


def _positions(positions: torch.Tensor, rows: int) -> None:
    _require(
        positions.dtype == torch.int64 and positions.shape == (rows,)
        and positions.device.type == "cpu" and positions.is_contiguous(),
        "one int64 CPU position per row",
    )  # fmt: skip


def _segment_table(segments: torch.Tensor) -> None:
    _require(
        segments.dtype == torch.int64 and segments.is_contiguous() and segments.dim() == 2
        and segments.shape[1] == 4 and segments.device.type == "cpu",
        "an int64 CPU segment table [segments, 4]",
    )  # fmt: skip


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
        library = _build()
        return PackedKernel(ctypes.CDLL(str(library)), library.stem.rsplit("-", 1)[-1])
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        _problem.append(f"the packed-weight kernel is unavailable: {exc}")
        return None


def kernel_built_with(*extra_flags: str) -> PackedKernel:
    """The kernels built with ``extra_flags`` after the usual ones, beside
    the library ``packed_kernel()`` loads (tests: ``-mno-avx512f`` gives the
    8-wide paths on a CPU with AVX-512, whose bits the wide ones must give)."""
    library = _build(extra_flags)
    return PackedKernel(ctypes.CDLL(str(library)), library.stem.rsplit("-", 1)[-1])


def _build(extra_flags: tuple[str, ...] = ()) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = (*FLAGS, *extra_flags)
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + " ".join((compiler, *flags)).encode() + _cpu_id()).hexdigest()
    target = metrale_home() / "kernels" / f"metrale-kernels-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        _compile(compiler, flags, Path(work))
        objects = [str(Path(work) / f"{source.stem}.o") for source in SOURCES]
        _run([compiler, *flags, *objects, "-o", str(built)], compiler)
        built.replace(target)
    return target


def _compile(compiler: str, flags: tuple[str, ...], work: Path) -> None:
    """Each source to its object in ``work``, as many at once as there are
    cores (a first build waits on the largest source, not on the sum)."""
    compile_flags = [flag for flag in flags if flag not in LINK_ONLY]
    commands = [
        [compiler, *compile_flags, "-c", str(source), "-o", str(work / f"{source.stem}.o")]
        for source in SOURCES
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(len(commands), cores or 1))
    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(_run, command, compiler) for command in commands]:
            future.result()


def _run(command: list[str], compiler: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")


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
