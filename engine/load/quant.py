"""What a checkpoint's quantization is, and the refusal of any metrale cannot run.

Contract: ``read_quant(raw_config)`` reads ``quantization_config`` (or
``compression_config``, its old name) and returns the ``BlockFp8`` it
declares, or ``None`` for a plain checkpoint. Block FP8 is
``quant_method: fp8`` with ``fmt: e4m3``, dynamic activations and a
``weight_block_size`` (every ``*-FP8`` release), or compressed-tensors
holding exactly that (float-quantized 8-bit block weights, dynamic or no
activation quantization). Any other method (GPTQ, AWQ, bitsandbytes, per-tensor
FP8, ...) raises ``CheckpointError`` naming it.

``check_tensors(headers, quant)`` holds the tensors to what the config says,
from safetensors headers only: each must be plain (float32, bfloat16, float16;
int64/bool buffers), or, under block FP8, an ``F8_E4M3`` weight whose scale
has one entry per block. A packed-looking tensor (FP8, 8/16/32-bit integers,
GPTQ/AWQ/bitsandbytes names) is refused naming it, so a quantized checkpoint
whose config lost its ``quantization_config`` is not read as plain.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale.engine.runtime.arch import CheckpointError
from metrale.engine.runtime.fp8 import FP8_DTYPE, BlockFp8
from metrale.engine.runtime.weights import TensorHeader

SUPPORTED = "metrale loads plain (float32/bfloat16/float16) and block-FP8 checkpoints only"
QUANT_KEYS = ("quantization_config", "compression_config")
PLAIN_DTYPES = frozenset({"F64", "F32", "BF16", "F16", "I64", "BOOL"})
# Tensors of GPTQ/AWQ (qweight, qzeros, scales, g_idx) and bitsandbytes
# (absmax, quant_map, quant_state, SCB, weight_format) checkpoints.
PACKED_NAMES = (".qweight", ".qzeros", ".scales", ".g_idx", ".absmax", ".quant_map", ".SCB")
PACKED_PARTS = (".quant_state.", ".weight_format")
COMPRESSED_FORMAT = "float-quantized"


def read_quant(raw: Mapping[str, Any]) -> BlockFp8 | None:
    for key in QUANT_KEYS:
        config = raw.get(key)
        if config:
            return _declared(key, config)
    return None


def check_tensors(headers: Mapping[str, TensorHeader], quant: BlockFp8 | None) -> None:
    """Raises on the first tensor (by name) the config does not account for."""
    for name in sorted(headers):
        header = headers[name]
        if header.dtype == FP8_DTYPE and quant is not None:
            scale = headers.get(quant.scale_name(name))
            quant.check_scale(name, header.shape, scale.shape if scale else None)
        elif header.dtype not in PLAIN_DTYPES or _packed_name(name):
            raise CheckpointError(_stray(name, header.dtype, quant))


def _declared(key: str, config: Any) -> BlockFp8:
    if not isinstance(config, dict):
        raise _refusal(f"has a {key} that is not an object")
    method = str(config.get("quant_method") or "unknown").lower()
    if config.get("load_in_4bit") or config.get("load_in_8bit"):
        method = "bitsandbytes"
    if method == "fp8":
        return _fp8(key, config)
    if method == "compressed-tensors":
        return _compressed(key, config)
    raise _refusal(f"is quantized with {method} ({key}.quant_method)")


def _fp8(key: str, config: dict[str, Any]) -> BlockFp8:
    fmt = config.get("fmt") or "e4m3"
    scheme = config.get("activation_scheme") or "dynamic"
    if fmt != "e4m3":
        raise _refusal(f"is quantized with fp8 in {fmt} ({key}.fmt; block FP8 is e4m3)")
    if scheme != "dynamic":
        raise _refusal(
            f"is quantized with fp8 and {scheme} activation scales ({key}.activation_scheme)"
        )
    if not config.get("weight_block_size"):
        raise _refusal(f"is quantized with fp8 per tensor (no {key}.weight_block_size)")
    skip = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    block = _block(config["weight_block_size"], f"{key}.weight_block_size")
    return BlockFp8(block, "fp8", "_scale_inv", tuple(str(m) for m in skip))


def _compressed(key: str, config: dict[str, Any]) -> BlockFp8:
    """compressed-tensors, accepted only as block-FP8 weights: its scale of
    ``x.weight`` is ``x.weight_scale``, in the same layout."""
    problem = _compressed_problem(config)
    if problem:
        raise _refusal(f"is quantized with compressed-tensors ({problem}), not block-FP8 weights")
    group = next(iter(config["config_groups"].values()))
    block = _block(group["weights"]["block_structure"], f"{key}.config_groups weights")
    skip = tuple(str(m) for m in config.get("ignore") or ())
    return BlockFp8(block, "compressed-tensors", "_scale", skip)


def _compressed_problem(config: dict[str, Any]) -> str | None:
    """What keeps a compressed-tensors config from being block FP8, or ``None``."""
    fmt = config.get("format")
    if fmt not in (None, COMPRESSED_FORMAT):
        return f"format {fmt}"
    for extra in ("kv_cache_scheme", "transform_config"):
        if config.get(extra):
            return f"a {extra}"
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        return f"sparsity format {sparsity['format']}"
    groups = config.get("config_groups") or {}
    if not groups:
        return "no config_groups"
    for name, group in groups.items():
        problem = _group_problem(group)
        if problem:
            return f"{name}: {problem}"
    blocks = {tuple(group["weights"]["block_structure"]) for group in groups.values()}
    if len(blocks) > 1:
        return f"groups with different block sizes {sorted(blocks)}"
    return None


def _group_problem(group: dict[str, Any]) -> str | None:
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    if group.get("format") not in (None, COMPRESSED_FORMAT):
        return f"format {group['format']}"
    kind = f"{weights.get('num_bits')}-bit {weights.get('type')} {weights.get('strategy')}"
    if kind != "8-bit float block":
        return f"weights are {kind}"
    if weights.get("symmetric") is False or weights.get("dynamic"):
        return "weights are asymmetric or dynamically quantized"
    if not weights.get("block_structure"):
        return "weights have no block_structure"
    if acts and not acts.get("dynamic"):
        return "static activation scales"
    if group.get("output_activations"):
        return "output activations are quantized"
    return None


def _block(value: Any, where: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2):
        raise _refusal(f"has {where} {value!r}; expected two block sizes")
    return int(value[0]), int(value[1])


def _packed_name(name: str) -> bool:
    return name.endswith(PACKED_NAMES) or any(part in name for part in PACKED_PARTS)


def _stray(name: str, dtype: str, quant: BlockFp8 | None) -> str:
    if quant is None:
        return (
            f"the checkpoint holds tensor {name!r} stored as {dtype} (a quantized layout) "
            f"but config.json declares no quantization_config; {SUPPORTED}"
        )
    return (
        f"the checkpoint holds tensor {name!r} stored as {dtype}, which block FP8 "
        f"({quant.method}) does not use; {SUPPORTED}"
    )


def _refusal(reason: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint {reason}; {SUPPORTED}")
