"""A calibration: the cost model's figures kept on disk between runs, and
the forwards that measure them on a model before its first run.

Owner: the cost model (``cost.py``), whose ``calibrate`` reads a
``CostCache`` and, when it holds no figures for this set-up, times the
forwards ``calibrate_model`` makes, then stores what it measured.

Contract:
- ``CostCache`` keeps one ``Calibration`` in ``METRALE_HOME`` under a key
  (``calibration_key``) naming the model, its weights, device, processor,
  dtype, thread count, slots and kernel build: a later run on the same
  set-up starts from it, and a run with another thread count or dtype does
  not reuse it. A file whose key differs, or that does not parse, reads as
  no calibration; a home that cannot be written is left alone.
- ``calibrate_model`` runs only before a run, while no request holds a
  slot: it writes positions and head rows that a later prefill or feed
  writes anew.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.kernels.binding import packed_kernel
from metrale.engine.load.home import metrale_home
from metrale.engine.runtime.device import processor_name
from metrale.engine.runtime.model import Segment
from metrale.engine.sequence import SeqState
from metrale.engine.spec.mtp import DraftFeed, MtpDrafter

if TYPE_CHECKING:
    from metrale.engine.load.loader import LoadedModel
    from metrale.engine.spec.cost import CostModel

# Raised whenever the stored figures change meaning (2: the head's beside the
# verify's; 3: a held row's beside the head's; 4: a held row's as a sum, so
# that the figures stuck low under format 3 are measured again).
CACHE_FORMAT = 4


@dataclass(frozen=True)
class Calibration:
    """Stored costs: seconds by verify rows, by sequences a head forward
    feeds, and what a held row adds to it (None: not measured)."""

    verify_s: Mapping[int, float]
    head_s: Mapping[int, float]
    held_row_s: float | None = None


class CostCache:
    """A calibration on disk: ``<home>/calibration/<hash of key>.json``, which
    also holds the key itself, checked on reading (module doc)."""

    def __init__(self, home: Path, key: Mapping[str, str]) -> None:
        self.key = {"format": str(CACHE_FORMAT), **{k: str(v) for k, v in key.items()}}
        text = json.dumps(self.key, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:20]
        self.path = home / "calibration" / f"{digest}.json"

    def load(self) -> Calibration | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != self.key:
            return None
        try:
            held = data.get("held_row_s")
            return Calibration(
                {int(k): float(v) for k, v in data["verify_s"].items()},
                {int(k): float(v) for k, v in data["head_s"].items()},
                None if held is None else float(held),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def store(self, costs: Calibration) -> None:
        """Writes atomically; a home that cannot be written is left alone
        (the next run calibrates again)."""
        data = {
            "key": self.key,
            "verify_s": {str(k): v for k, v in costs.verify_s.items()},
            "head_s": {str(k): v for k, v in costs.head_s.items()},
            "held_row_s": costs.held_row_s,
        }
        _write(self.path, data)


def _write(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as JSON at ``path``, written to a temporary name and renamed
    into place; a home that cannot be written is left alone."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=1))
        partial.replace(path)
    except OSError:
        pass


def calibrate_model(
    costs: CostModel, model: Any, drafter: MtpDrafter | None, slots: int, max_len: int
) -> None:
    """Warm-starts ``costs`` from its cache, or from verifies of 1..64 rows at
    the start of free slots (a later prefill writes those positions anew) and
    head forwards feeding 1..16 of those slots a row each (a later feed
    writes them anew too). Only before a run, while no request holds a slot.
    One sequence's widths fit one slot; wider ones are spread as a batch
    would be."""

    def forward(rows: int) -> None:
        spread = 1 if rows <= 9 else min(slots, rows)
        width = -(-rows // spread)
        segments, left = [], rows
        for slot in range(spread):
            take = min(width, left)
            if take:
                segments.append(Segment(slot, 0, [0] * take))
            left -= take
        model.forward(segments, logits="all").logits.argmax(dim=-1).tolist()

    head: Callable[[int, int], int] | None = None
    if drafter is not None:
        seqs: list[SeqState] = []
        rows: list[torch.Tensor] = []  # [slots, hidden_size]: the rows fed, made once

        def head(count: int, each: int) -> int:
            """A head call feeding ``count`` slots ``each`` rows from their
            start, one draft each, through the drafter as a run calls it (more
            than a row: as a catch-up hands over held rows); the forwards it ran."""
            if not seqs:  # only when the costs are not read from the cache
                segments = [Segment(slot, 0, [0]) for slot in range(slots)]
                rows.append(model.forward(segments, logits="last").hidden)
                request = Request("calibration", (0,), SamplingParams(max_tokens=1))
                for slot in range(slots):
                    seqs.append(SeqState(request, slot, max_len, frozenset(), None, None))
            feeds = [DraftFeed(seq, 0, [0] * each, 1) for seq in seqs[:count]]
            hidden = rows[0][:count].repeat_interleave(each, dim=0)
            before = drafter.forwards
            drafter.feed_and_draft(feeds, hidden)
            return drafter.forwards - before

    costs.calibrate(forward, min(4 * slots, max_len - 1), (head, slots) if head else None)


def calibration_key(loaded: LoadedModel) -> dict[str, str]:
    """What a calibration is valid for: the model and its weights as loaded,
    where (and on which processor: a home directory may move between
    machines) and in which dtype they run, on how many threads, and with
    which build of the C kernels (a faster kernel prices rows differently)."""
    info = loaded.info
    return {
        "model": loaded.name,
        "source": info.source,
        "weights": info.weights,
        "parameters": str(info.parameters),
        "mtp": f"{info.mtp_layout}:{info.mtp_count}:{info.mtp_head}",
        "device": info.device,
        "processor": processor_name(info.device),
        "dtype": info.dtype,
        "threads": str(torch.get_num_threads()),
        "slots": str(info.num_slots),
        "kernels": _kernel_build(info.weights),
    }


def calibration_cache(loaded: LoadedModel) -> CostCache:
    """The cache of ``loaded``'s calibration in this user's home."""
    return CostCache(metrale_home(), calibration_key(loaded))


def _kernel_build(weights: str) -> str:
    kernel = packed_kernel() if weights.startswith("packed") else None
    return kernel.build if kernel is not None else "none"
