"""The two sides of every benchmark: transformers ``generate`` and metrale's engine.

Contract: a runner takes greedy ``Request``s (token ids, ``max_tokens``, EOS
ids) and returns every request's output ids, the wall time of the whole run
and the number of forward passes of the main model (prefill included). Output
ids follow the engine's rule on both sides: generated tokens up to and
including the first EOS, at most ``max_tokens`` of them; padding is never
counted. Both sides see exactly the same prompt ids, the same checkpoint
folder and the same dtype; neither sees text.

``load_transformers`` is the one place a benchmark loads the transformers
model: from a checkpoint folder (``checkpoint_folder``: the embedded
default's converted cache folder when no folder is given), at a dtype, on a
device, in eval mode. ``Subjects`` loads what `metrale bench` compares once:
that model and metrale's runtime at batch 1 and at the batch size under test
(separate runtimes, so the batch-1 figures do not carry 16 KV slots).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from metrale.engine.api import Request
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.stats import EngineStats


@dataclass(frozen=True)
class RunOutcome:
    """One timed run. ``stats`` is metrale's snapshot (None for transformers)."""

    outputs: dict[str, tuple[int, ...]]
    wall_s: float
    forward_passes: int
    stats: EngineStats | None = None

    @property
    def generated_tokens(self) -> int:
        return sum(len(ids) for ids in self.outputs.values())


@dataclass
class Subjects:
    """The loaded models one bench compares (see module doc)."""

    folder: Path
    hf_model: Any  # transformers PreTrainedModel, eval mode
    single: LoadedModel  # metrale at batch 1
    batched: LoadedModel  # metrale at the batch size under test
    batch: int

    @property
    def has_mtp(self) -> bool:
        return bool(self.single.mtp)

    @property
    def device(self) -> torch.device:
        return self.single.model.device


def checkpoint_folder(source: str | Path | None, revision: str | None = None) -> Path:
    """The folder transformers reads for ``source``: the folder itself, a GGUF's
    converted folder, a hub id's snapshot, or the embedded model's cache."""
    from metrale.engine.load.source import resolve_source

    return resolve_source(source, revision).folder


def load_transformers(folder: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
    """transformers' own model class for the checkpoint in ``folder``, in eval
    mode: the peer every benchmark measures metrale against."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return model.to(device).eval()


def load_subjects(source: str | Path | None, runtime: RuntimeConfig, batch: int) -> Subjects:
    """Loads both sides on ``runtime``'s device and dtype; ``runtime.num_slots``
    is overridden per side (1 and ``batch``)."""
    single = load_model(source, replace(runtime, num_slots=1))
    batched = load_model(source, replace(runtime, num_slots=batch))
    dtype = getattr(torch, single.info.dtype)
    hf_model = load_transformers(single.folder, dtype, single.model.device)
    return Subjects(single.folder, hf_model, single, batched, batch)


def pad_id(loaded: LoadedModel) -> int:
    """The id transformers pads a left-padded batch with."""
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    if pad is None:  # padded positions are masked: any id works, EOS is customary
        pad = loaded.eos_token_ids[0] if loaded.eos_token_ids else 0
    return int(pad)


def resident_state_bytes(loaded: LoadedModel) -> int:
    """Weights (main + MTP) and the preallocated KV slots of a metrale runtime."""
    itemsize = getattr(torch, loaded.info.dtype).itemsize
    kv = loaded.info.kv_bytes_per_token * loaded.info.max_len * loaded.info.num_slots
    return loaded.info.parameters * itemsize + kv


def hf_weight_bytes(hf_model: Any) -> int:
    """Distinct parameter bytes (a tied LM head counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in hf_model.parameters()}
    return sum(seen.values())


class MetraleRunner:
    """A fresh ``Engine`` per run, so figures and caches start from zero.
    ``ignore_eos`` generates exactly ``max_tokens`` per request, as
    ``HfRunner(ignore_eos=True)`` does: the engine gets no EOS ids (the
    model's nor the requests'), and no tokenizer either, since with no EOS
    and no stop strings there is no text to watch and only ids are compared."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, ignore_eos: bool = False) -> None:
        self.loaded, self.config, self.ignore_eos = loaded, config, ignore_eos

    def run(self, requests: Sequence[Request]) -> RunOutcome:
        engine = self._engine()
        if self.ignore_eos:
            requests = [replace(r, params=replace(r.params, eos_token_ids=())) for r in requests]
        started = time.perf_counter()
        results = list(engine.generate(requests))
        wall_s = time.perf_counter() - started
        failed = [r for r in results if r.error is not None]
        if failed:
            raise RuntimeError(f"metrale refused request {failed[0].request_id}: {failed[0].error}")
        stats = engine.stats()
        return RunOutcome(
            outputs={r.request_id: r.output_ids for r in results},
            wall_s=wall_s,
            forward_passes=stats.prefills + stats.verifies,
            stats=stats,
        )

    def _engine(self) -> Engine:
        if not self.ignore_eos:
            return Engine.from_loaded(self.loaded, self.config)
        return Engine(self.loaded.model, None, self.config, mtp=self.loaded.mtp)


class HfRunner:
    """transformers ``generate``, greedy, ``batch`` requests per call (left
    padded), optionally with its prompt-lookup decoding (batch 1 only).
    ``ignore_eos`` generates exactly ``max_tokens`` per call, as an engine
    given no EOS ids does (the forward-speed benchmark compares those)."""

    def __init__(
        self,
        hf_model: Any,
        pad_id: int,
        batch: int = 1,
        prompt_lookup_tokens: int = 0,
        ignore_eos: bool = False,
    ) -> None:
        if prompt_lookup_tokens and batch != 1:
            raise ValueError("transformers' prompt lookup decodes one sequence at a time")
        self.model, self.pad_id = hf_model, pad_id
        self.batch, self.prompt_lookup_tokens = batch, prompt_lookup_tokens
        self.ignore_eos = ignore_eos
        self.passes = 0

    def _count(self, *_: Any) -> None:
        self.passes += 1

    def run(self, requests: Sequence[Request]) -> RunOutcome:
        outputs: dict[str, tuple[int, ...]] = {}
        self.passes = 0
        # Every top-level call of the model is one forward pass of it.
        hook = self.model.register_forward_pre_hook(self._count)
        try:
            started = time.perf_counter()
            for at in range(0, len(requests), self.batch):
                outputs.update(self._generate(requests[at : at + self.batch]))
            wall_s = time.perf_counter() - started
        finally:
            hook.remove()
        return RunOutcome(outputs, wall_s, self.passes)

    def _generate(self, chunk: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        device = self.model.device
        width = max(len(r.prompt_ids) for r in chunk)
        ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)  # [batch, width]
        mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [batch, width]
        for row, request in enumerate(chunk):
            # Left padding: every row's last prompt token sits in the last column.
            ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            mask[row, width - len(request.prompt_ids) :] = 1
        eos = sorted({e for r in chunk for e in r.params.eos_token_ids})
        extra: dict[str, Any] = {}
        if self.prompt_lookup_tokens:
            extra["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        max_new = max(r.params.max_tokens for r in chunk)
        if self.ignore_eos:
            extra["min_new_tokens"] = max_new
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=eos or None,
                pad_token_id=self.pad_id,
                **extra,
            )  # [batch, width + new]
        new = out[:, width:].tolist()
        return {r.request_id: _cut(row, r) for r, row in zip(chunk, new, strict=True)}


def _cut(generated: list[int], request: Request) -> tuple[int, ...]:
    """The engine's rule: up to and including the first EOS, at most max_tokens."""
    kept: list[int] = []
    for token in generated[: request.params.max_tokens]:
        kept.append(token)
        if token in request.params.eos_token_ids:
            break
    return tuple(kept)


Runner = MetraleRunner | HfRunner
