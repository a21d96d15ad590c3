"""Prompt text -> prompt ids, one way for every command.

Contract: ``chat_prompt_ids`` and ``text_prompt_ids`` give the token ids a
model is asked to continue. ``generate`` (through its JSONL reader),
``train-mtp`` and the benchmarks all call them, so a drafting head is trained
on exactly the ids ``generate`` serves and the benchmarks time those same ids.
Nothing here knows JSONL, flags or a terminal; a chat template that raises
(it is jinja, it may raise anything) raises to the caller, who reports it.

- **messages**: the tokenizer's chat template is rendered to *text*, with the
  generation prompt (the opening of the assistant's turn) appended, and that
  text is encoded without special tokens. The template writes every special
  token the model expects; encoding must not add a BOS a second time. Taking
  the text and encoding it ourselves, rather than asking the template call to
  tokenize, keeps one behaviour whatever the transformers version (whose
  tokenizing call has returned a list in some versions and a
  ``BatchEncoding`` in others).
- **a raw prompt**: encoded with the tokenizer's own special tokens (a BOS,
  where the tokenizer adds one), as a completion endpoint takes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

Message = Mapping[str, str]  # {"role": ..., "content": ...}


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer prompts need."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[int, ...]:
    """The ids of ``messages`` rendered by the chat template, ready for the
    assistant's reply (see the module doc)."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
    )
    return tuple(int(i) for i in tokenizer.encode(str(text), add_special_tokens=False))


def user_prompt_ids(tokenizer: Tokenizer, content: str) -> tuple[int, ...]:
    """``chat_prompt_ids`` of one user message."""
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": content}])


def text_prompt_ids(tokenizer: Tokenizer, prompt: str) -> tuple[int, ...]:
    """The ids of a raw prompt, with the tokenizer's special tokens."""
    return tuple(int(i) for i in tokenizer.encode(prompt))
