"""Where the model runs and in which dtype.

Contract: ``pick_device(None)`` is CUDA when available, else the CPU;
``pick_dtype(None, device)`` is bfloat16 on CUDA and ``CPU_DEFAULT_DTYPE`` on
the CPU. Explicit names are validated with a message that names the setting
(``device``, ``dtype``) and lists the choices.

Why float32 on the CPU: a CPU without a native bfloat16 dot product (AVX2
without avx512_bf16) has oneDNN convert every operand, so only a bare one-row
matmul gains from bfloat16's halved weight traffic and every other forward
loses (``python -m metrale.engine.bench.runtime`` measures both dtypes). float32 also keeps
greedy parity with transformers' float32 forward exact enough to test token
for token.
"""

from __future__ import annotations

from pathlib import Path

import torch

CPU_DEFAULT_DTYPE = torch.float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device must be cpu here (CUDA is not available), got {name!r}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda (cuda:N), got {name!r}")
    return device


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else CPU_DEFAULT_DTYPE
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_info() -> tuple[str, set[str]]:
    """This CPU's model name and feature flags, from ``/proc/cpuinfo``
    (``"unknown CPU"`` and no flags where it cannot be read)."""
    model, flags = "unknown CPU", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = " ".join(value.split())
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model, flags


def processor_name(device: str) -> str:
    """The processor a device names: a GPU's model, or the CPU's."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_info()[0]
