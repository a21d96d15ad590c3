"""A fake backend for CLI tests: the engine's interface, no model.

Contract: ``FakeEngine.generate`` consumes requests lazily in batches of
``batch`` and yields each batch's results shortest-output first, so
completion order differs from input order (as a real engine's does). The
"model" echoes the prompt's bytes backwards, ``max_tokens`` at most. A prompt
containing ``FAIL`` finishes with an engine error; one containing ``CRASH``
raises ``KeyboardInterrupt`` before its batch is yielded (a Ctrl-C).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from metrale.cli.run import Backend
from metrale.engine.api import FinishReason, Request, RequestStats, Result
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.stats import EngineStats

FAKE_EOS = 0


class ByteTokenizer:
    """UTF-8 bytes as ids; a chat template that tags each message."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        assert kwargs.get("tokenize") is False and kwargs.get("add_generation_prompt") is True
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


@dataclass
class FakeEngine:
    batch: int = 3
    seen: list[Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stats: EngineStats = field(default_factory=EngineStats)

    def generate(self, requests: Iterable[Request | None]) -> Iterator[Result]:
        pending: list[Request] = []
        for request in requests:
            if request is None:  # "nothing ready yet": batches stay fixed in the fake
                continue
            self.seen.append(request)
            pending.append(request)
            if len(pending) == self.batch:
                yield from self._finish(pending)
                pending = []
        yield from self._finish(pending)

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats

    def _finish(self, batch: list[Request]) -> Iterator[Result]:
        results = [self._one(r) for r in batch]
        results.sort(key=lambda r: (r.completion_tokens, -int(r.request_id)))
        yield from results

    def _one(self, request: Request) -> Result:
        prompt = bytes(request.prompt_ids)
        if b"CRASH" in prompt:
            raise KeyboardInterrupt
        failing = b"FAIL" in prompt
        out = () if failing else tuple(reversed(request.prompt_ids))[: request.params.max_tokens]
        stats = RequestStats(
            verifies=max(1, len(out) // 2),
            verify_tokens=len(out),
            mtp_proposed=2,
            mtp_accepted=1,
        )
        stats.prompt_lookup.observe(4, len(out) // 2, shared=False)
        with self._lock:
            s = self._stats
            lookup = s.prompt_lookup.copy()
            lookup.observe(4, len(out) // 2, shared=False)
            self._stats = EngineStats(
                requests_done=s.requests_done + 1,
                generated_tokens=s.generated_tokens + len(out),
                prompt_tokens=s.prompt_tokens + len(prompt),
                verifies=s.verifies + stats.verifies,
                seq_verifies=s.seq_verifies + stats.verifies,
                verify_tokens=s.verify_tokens + stats.verify_tokens,
                wall_s=s.wall_s + 0.01,
                prompt_lookup=lookup,
                mtp_proposed_by_position=(s.mtp_proposed + 2,),
                mtp_accepted_by_position=(s.mtp_accepted + 1,),
            )
        if failing:
            return Result(request.request_id, len(prompt), (), "", "error", stats, "out of memory")
        finish: FinishReason = "length" if len(out) == request.params.max_tokens else "stop"
        return Result(
            request.request_id,
            len(prompt),
            out,
            bytes(out).decode("utf-8", "replace"),
            finish,
            stats,
        )


@dataclass
class FakeOpener:
    """Stands in for ``open_backend``; remembers what it was asked for."""

    max_len: int = 1024
    calls: list[tuple[str | None, RuntimeConfig, EngineConfig]] = field(default_factory=list)
    engine: FakeEngine = field(default_factory=FakeEngine)

    def __call__(self, model: str | None, runtime: RuntimeConfig, engine: EngineConfig) -> Backend:
        self.calls.append((model, runtime, engine))
        return Backend(
            name="fake-model",
            tokenizer=ByteTokenizer(),
            eos_token_ids=(FAKE_EOS,),
            max_len=self.max_len,
            generate=self.engine.generate,
            stats=self.engine.stats,
        )
