"""``load_model``: a model source (folder, GGUF file, hub id, or the embedded
default) to a ready runtime.

Contract: ``load_model(source, runtime)`` returns a ``LoadedModel`` whose
``model`` owns a KV cache of ``runtime.num_slots`` slots of ``max_len``
positions, plus its MTP modules (each with its own cache of the same shape),
the tokenizer and the EOS ids. ``source`` is resolved to a checkpoint folder
by ``source.py``: a folder as it is, a ``.gguf`` file converted once, a hub
id (``owner/name``, at ``runtime.revision``) from the Hugging Face cache,
fetched only when the cache lacks it. ``source=None`` is the embedded
SmolLM2-135M-Instruct, paired with the head shipped at
``engine/heads/smollm2-135m-instruct.{safetensors,json}`` when present;
``runtime.mtp_head`` names a trained head to draft with instead, for any model.

Slots x positions (``size_cache``): with a budget, by the rule of
``runtime/kv_sizing.py`` (an asked-for ``max_len`` is kept and the slots cut
to fit; else all ``num_slots`` are kept and positions cut to fit). The
budget is ``runtime.kv_cache_gb``; without one, on CUDA, it is
``runtime.kv_cache_fraction`` of the device's free memory less the weights
about to be loaded, estimated before the model is built (the model allocates
its cache as it is built): every tensor the checkpoint stores (and a named
head's) at the runtime dtype, FP8 ones dequantized. What the estimate leaves
out (activations, the step's buffers and graphs, the allocator's slack) lives
in the rest of the free memory. On the CPU without a budget: ``num_slots``
slots of ``runtime.max_len`` or the context length (positions capped by
``runtime.kv_budget_mb`` when set). ``ModelInfo.kv_limit`` says which
of these made the shape what it is.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.engine.config import RuntimeConfig
from metrale.engine.kernels.binding import PackedKernel, kernel_problem, packed_kernel
from metrale.engine.load.checkpoint import Checkpoint, read_checkpoint
from metrale.engine.load.fast_tokenizer import read_tokenizer
from metrale.engine.load.heap import release_free_heap
from metrale.engine.load.model_info import (
    count_parameters,
    describe_attention,
    describe_blocks,
    describe_experts,
    describe_quant,
    streamed_bytes_per_token,
)
from metrale.engine.load.source import HEADS_DIR as HEADS_DIR  # where tests find the heads
from metrale.engine.load.source import resolve_source
from metrale.engine.runtime.arch import ArchSpec, CheckpointError
from metrale.engine.runtime.device import dtype_name, pick_device, pick_dtype
from metrale.engine.runtime.kv_sizing import (
    GIB,
    KvSizing,
    PositionsFrom,
    gib,
    kv_bytes_per_position,
    size_kv_cache,
)
from metrale.engine.runtime.linear_state import VERIFY_ROWS, LinearStates
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Model, MtpModule
from metrale.engine.runtime.mtp import MtpFound, detect_mtp, load_checkpoint_mtp
from metrale.engine.runtime.mtp_head import MtpHeadError, head_paths, load_mtp_head
from metrale.engine.runtime.packed import Bf16Source, PackedSource, PackedStore
from metrale.engine.runtime.static_step import HEADROOM
from metrale.engine.runtime.weights import WeightStore


@dataclass(frozen=True)
class ModelInfo:
    """What ``metrale info`` shows. ``mtp_layout`` is ``None`` when no MTP
    module was loaded; ``kv_bytes_per_token`` counts the main model and its
    MTP modules, per slot position; ``kv_limit`` says why the cache holds
    ``num_slots`` slots of ``max_len`` positions (``KvSizing.describe``:
    "16 slots of 4,096 positions, what a KV cache of 2 GiB (kv_cache_gb)
    holds at 16 slots"), and ``kv_cache_bytes`` is what it takes."""

    name: str
    source: str  # where it came from: "folder ...", "gguf file ...", "hub owner/name@main ..."
    architecture: str
    parameters: int
    dtype: str
    device: str
    context_len: int
    max_len: int
    num_slots: int
    weights: str  # "dense", or "packed (q4_1, q8_0)"; with the reason when packing was off
    mtp_layout: str | None
    mtp_count: int
    mtp_draft_vocab: int | None  # tokens a standalone head drafts from; None: all
    mtp_head: str | None  # the standalone head's weights file, when one drafts
    kv_bytes_per_token: int
    # Per slot, whatever its length: gated DeltaNet layers' states and a full
    # verify's pending rows (linear_state.py); 0 for a model without them.
    state_bytes_per_slot: int
    kv_limit: str
    kv_cache_bytes: int
    attention: str  # "GQA, 9 query / 3 kv heads of 64" or "MLA, ..."
    experts: str | None  # routed / shared / active per token; None: dense
    quantization: str  # "none" or the block FP8 layout
    load_s: float
    # A converted GGUF's tensor types, "Q5_0 x 166, Q8_0 x 15, ..."; None otherwise.
    gguf_blocks: str | None = None
    # Weight bytes one decoded row reads, as held (model_info.streamed_bytes_per_token).
    streamed_bytes: int = 0


@dataclass
class LoadedModel:
    model: Model
    mtp: list[MtpModule]
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    info: ModelInfo
    name: str
    folder: Path  # the checkpoint folder it was read from (a GGUF's converted one)


def load_model(source: str | Path | None, runtime: RuntimeConfig) -> LoadedModel:
    started = time.perf_counter()
    resolved = resolve_source(source, runtime.revision)
    folder, name, shipped = resolved.folder, resolved.name, resolved.shipped_head
    checkpoint = read_checkpoint(folder)  # no weight read yet: refuses a bad folder first
    # The tokenizer before the weights, and the heap trimmed after each phase:
    # what parsing tokenizer.json and tiling weights free is then never
    # resident on top of the weights (heap.py).
    tokenizer = _tokenizer(folder)
    release_free_heap()
    device = pick_device(runtime.device)
    dtype = pick_dtype(runtime.dtype, device)
    found, head = drafter_of(checkpoint, runtime, shipped)
    sizing, kv_limit = size_cache(
        checkpoint, runtime, device, dtype, found.count if found else 0, head
    )
    kernel, packed, weights = _packed_source(folder, checkpoint, runtime, device, dtype)
    model = LlamaModel(
        checkpoint.spec,
        checkpoint.hf_config,
        checkpoint.weights,
        num_slots=sizing.num_slots,
        max_len=sizing.max_len,
        dtype=dtype,
        device=device,
        packed=packed,
        # Every slot keeps room for the device step's padded rows, so either
        # step runs any loaded model (static_step.py).
        headroom=HEADROOM,
    )
    release_free_heap()
    mtp = _load_mtp(model, checkpoint, found, head, kernel)
    release_free_heap()
    info = ModelInfo(
        name=name,
        source=resolved.origin,
        architecture=checkpoint.spec.model_type,
        parameters=count_parameters(model) + sum(count_parameters(m) for m in mtp),
        dtype=dtype_name(dtype),
        device=str(device),
        context_len=checkpoint.spec.context_len,
        max_len=sizing.max_len,
        num_slots=sizing.num_slots,
        weights=weights,
        mtp_layout=found.layout if found else None,
        mtp_count=len(mtp),
        mtp_head=str(head) if head is not None else None,
        mtp_draft_vocab=next(
            (
                int(m.draft_vocab.numel())
                for m in mtp
                if getattr(m, "draft_vocab", None) is not None
            ),
            None,
        ),
        kv_bytes_per_token=model.kv_bytes_per_token + sum(m.kv_bytes_per_token for m in mtp),
        state_bytes_per_slot=model.state_bytes_per_slot,
        kv_limit=kv_limit,
        kv_cache_bytes=sizing.cache_bytes,
        attention=describe_attention(checkpoint.spec),
        experts=describe_experts(checkpoint.spec),
        quantization=describe_quant(checkpoint.quant),
        load_s=time.perf_counter() - started,
        gguf_blocks=describe_blocks(folder),
        streamed_bytes=streamed_bytes_per_token(model),
    )
    eos = eos_token_ids(folder, checkpoint.raw_config, tokenizer)
    return LoadedModel(model, list(mtp), tokenizer, eos, info, name, folder)


def _packed_source(
    folder: Path,
    checkpoint: Checkpoint,
    runtime: RuntimeConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[PackedKernel | None, PackedSource | None, str]:
    """The kernel and the model's packed weights when they can run here, and
    what ``info`` says about the weights."""
    if runtime.weights == "dense":
        return None, None, "dense"
    if device.type != "cpu" or dtype != torch.float32:
        return None, None, "dense (packed weights run on the CPU in float32 only)"
    kernel = packed_kernel()
    if kernel is None:
        return None, None, f"dense ({kernel_problem()})"
    store = PackedStore.open(folder, kernel)
    if store is not None:
        return kernel, store, f"packed ({', '.join(sorted(set(store.formats.values())))})"
    if _stored_in_bf16(checkpoint):
        return kernel, Bf16Source(checkpoint.weights, kernel), "packed (bf16)"
    return kernel, None, "dense"


def _stored_in_bf16(checkpoint: Checkpoint) -> bool:
    """Whether the first layer's attention output is stored in bfloat16 (read
    from the header: every family has this weight, dense or MoE)."""
    name = "model.layers.0.self_attn.o_proj.weight"
    return name in checkpoint.weights and checkpoint.weights.dtype(name) == "BF16"


def drafter_of(
    checkpoint: Checkpoint, runtime: RuntimeConfig, shipped: Path | None
) -> tuple[MtpFound | None, Path | None]:
    """The MTP modules that will draft (None: none) and the standalone head's
    weights file when a head is what drafts; ``shipped`` is the source's own
    head (``resolve_source``)."""
    found = detect_mtp(
        checkpoint.raw_config, checkpoint.weights.names(), checkpoint.spec.num_layers
    )
    head = _drafting_head(runtime, shipped, found)
    if not runtime.mtp:
        return None, None
    if head is not None:
        return MtpFound("head", 1), head
    return found, None


def _drafting_head(
    runtime: RuntimeConfig, shipped: Path | None, found: MtpFound | None
) -> Path | None:
    """The weights file of the standalone head that drafts: the one the user
    named (it replaces any other drafter), else the shipped one for a model
    without MTP layers of its own; ``None`` with MTP off (not even a named
    head is looked for)."""
    if not runtime.mtp:
        return None
    if runtime.mtp_head is not None:
        named = Path(runtime.mtp_head).expanduser()
        weights_file = head_paths(named)[0]
        if not weights_file.exists():
            raise MtpHeadError(
                f"MTP head {named}: {weights_file} not found "
                "(pass what `metrale train-mtp --out` wrote)"
            )
        return weights_file
    if shipped is not None and found is None and head_paths(shipped)[0].exists():
        return head_paths(shipped)[0]
    return None


def _load_mtp(
    model: LlamaModel,
    checkpoint: Checkpoint,
    found: MtpFound | None,
    head: Path | None,
    kernel: PackedKernel | None,
) -> list[Any]:
    """The MTP modules; with a kernel, their bfloat16 linear weights run packed."""
    if found is None:
        return []
    if found.layout == "head":
        assert head is not None
        return [load_mtp_head(head, model, kernel)]
    packed = Bf16Source(checkpoint.weights, kernel) if kernel else None
    return list(load_checkpoint_mtp(model, checkpoint.weights, found, packed))


def size_cache(
    checkpoint: Checkpoint,
    runtime: RuntimeConfig,
    device: torch.device,
    dtype: torch.dtype,
    num_mtp: int,
    head: Path | None = None,
) -> tuple[KvSizing, str]:
    """The cache's slots x positions and why (see module doc). ``num_mtp``:
    MTP modules that will be loaded (each one a 1-layer cache); ``head``: a
    standalone head's weights file, counted with the weights on CUDA. A
    budget too small for the rule's minimum is a ``CheckpointError`` naming
    the setting it came from (``kv_cache_gb: ...``)."""
    spec = checkpoint.spec
    attending = len(spec.attention_layers)
    per_position = kv_bytes_per_position(attending, num_mtp, spec.kv_width, dtype.itemsize)
    slot_bytes = state_bytes_per_slot(spec, dtype)
    if runtime.max_len is not None and runtime.max_len > spec.context_len:
        raise CheckpointError(
            f"max_len {runtime.max_len} exceeds the model's context length {spec.context_len}"
        )
    budget = kv_budget(checkpoint, runtime, device, dtype, head)
    if budget is None:  # the CPU's default: every slot asked for, at full length
        max_len = choose_max_len(spec, runtime, dtype, 1 + num_mtp)
        asked = runtime.max_len or spec.context_len
        source: PositionsFrom = "max_len" if runtime.max_len else "context"
        if runtime.kv_budget_mb is not None and max_len < asked:
            source = "budget"
        sizing = KvSizing(
            runtime.num_slots,
            max_len,
            per_position,
            source,
            headroom=HEADROOM,
            slot_bytes=slot_bytes,
        )
        older = runtime.kv_budget_mb
        return sizing, sizing.describe(None if older is None else f"{older} MB (kv_budget_mb)")
    budget_bytes, field, where = budget
    try:
        sizing = size_kv_cache(
            budget_bytes,
            per_position,
            runtime.num_slots,
            spec.context_len,
            runtime.max_len,
            headroom=HEADROOM,
            slot_bytes=slot_bytes,
        )
    except ValueError as exc:
        whence = "" if field == "kv_cache_gb" else f" (the budget: {where})"
        raise CheckpointError(f"{field}: {exc}{whence}") from exc
    return sizing, sizing.describe(where)


def kv_budget(
    checkpoint: Checkpoint,
    runtime: RuntimeConfig,
    device: torch.device,
    dtype: torch.dtype,
    head: Path | None,
) -> tuple[int, str, str] | None:
    """``(bytes, the setting it came from, how a message names it)``, or None
    when no budget applies (the CPU without ``kv_cache_gb``)."""
    if runtime.kv_cache_gb is not None:
        gb = runtime.kv_cache_gb
        shown = f"{gb:.10f}".rstrip("0").rstrip(".")  # as given: 2, 0.0003, never 3e-04
        return int(gb * GIB), "kv_cache_gb", f"{shown} GiB (kv_cache_gb)"
    if device.type != "cuda" or runtime.kv_budget_mb is not None:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    weights = weight_bytes(checkpoint, dtype, head)
    left = free - weights
    if left <= 0:
        raise CheckpointError(
            f"the weights (about {gib(weights)} GiB in {dtype_name(dtype)}) need more than "
            f"the {gib(free)} GiB free on {device}"
        )
    fraction = runtime.kv_cache_fraction
    budget = int(fraction * left)
    where = (
        f"{gib(budget)} GiB (kv_cache_fraction {fraction:g} of the {gib(left)} GiB free "
        f"on {device} after the weights)"
    )
    return budget, "kv_cache_fraction", where


def weight_bytes(checkpoint: Checkpoint, dtype: torch.dtype, head: Path | None = None) -> int:
    """What the weights will take on the device, from the headers alone:
    every tensor the checkpoint stores (FP8 scales aside) and the head's, at
    ``dtype``. It counts MTP layers that ``mtp=False`` leaves unloaded: the
    estimate errs towards a smaller cache, never towards running out. A
    renamed store (Qwen3.5's nested layout) counts what it reads, by the names
    it is stored under; a vision tower it leaves out is not counted."""
    store = checkpoint.weights
    headers = store.headers()
    numel = sum(math.prod(headers[store.stored_name(name)].shape) for name in store.names())
    if head is not None:
        numel += sum(math.prod(h.shape) for h in WeightStore.open_file(head).headers().values())
    return numel * dtype.itemsize


def choose_max_len(
    spec: ArchSpec, runtime: RuntimeConfig, dtype: torch.dtype, num_stacks: int
) -> int:
    """Positions per slot (see module doc). ``num_stacks`` counts caches that
    hold every position: the main model's and one per MTP module."""
    max_len = runtime.max_len or spec.context_len
    if max_len > spec.context_len:
        raise CheckpointError(
            f"max_len {max_len} exceeds the model's context length {spec.context_len}"
        )
    if runtime.kv_budget_mb is not None:
        per_slot = kv_bytes_per_position(
            len(spec.attention_layers), num_stacks - 1, spec.kv_width, dtype.itemsize
        )
        per_position = per_slot * runtime.num_slots
        fits = int(runtime.kv_budget_mb * 2**20) // per_position
        if fits < 2:
            raise CheckpointError(
                f"a KV budget of {runtime.kv_budget_mb} MB holds {fits} positions for "
                f"{runtime.num_slots} slots; raise the budget or use fewer slots"
            )
        max_len = min(max_len, fits)
    return max_len


def state_bytes_per_slot(spec: ArchSpec, dtype: torch.dtype) -> int:
    """What a slot of ``spec``'s model holds whatever its length (``KvSizing.slot_bytes``)."""
    if spec.linear is None:
        return 0
    layers = spec.num_layers - len(spec.attention_layers)
    return LinearStates.bytes_per_slot(spec.linear, layers, VERIFY_ROWS, dtype)


def _tokenizer(folder: Path) -> Any:
    """``tokenizers`` alone when transformers would run it as that backend
    (``fast_tokenizer.py``), else transformers' ``AutoTokenizer``."""
    fast = read_tokenizer(folder)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise CheckpointError(f"cannot load the tokenizer in {folder}: {exc}") from exc


def eos_token_ids(folder: Path, raw_config: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer, in that
    order, without repeats."""
    found: list[int] = []

    def add(value: Any) -> None:
        for item in value if isinstance(value, list) else [value]:
            if item is not None and int(item) not in found:
                found.append(int(item))

    generation = folder / "generation_config.json"
    if generation.exists():
        add(json.loads(generation.read_text()).get("eos_token_id"))
    add(raw_config.get("eos_token_id"))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(found)
